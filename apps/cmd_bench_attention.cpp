// `troupe bench attention`: time of ops::attention forward and forward + backward at one shape, on
// the CPU or a GPU; on a GPU for each CUDA kernel (the tensor-core kernel where it applies, and
// the f32 CUDA-core kernel), so one command compares them. Reports ms per call, tokens/s
// (B T over the forward + backward time) and TFLOP/s counted as FlashAttention does: the forward
// is 2 products of 2 D flops per visible (query, key) pair and head, the backward 2.5 times that
// (5 products; the kernels recompute more, which the count leaves out).
#include <fmt/core.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "apps/commands.hpp"
#include "memory/gpu.hpp"
#include "tensor/ops.hpp"
#include "tensor/tensor.hpp"

namespace troupe::apps {
namespace {

struct attention_bench_options {
  std::string device = "cuda";
  std::string precision = "bf16";
  std::int64_t batch = 16, heads = 12, kv_heads = 0, seq = 1024, head_dim = 64;
  bool causal = true;
  int steps = 10, warmup = 2;
  bool json = false;
};

// Uniform values in [-1, 1) of dtype t on dev.
owned_tensor random_tensor(const shape& s, dtype t, const device& dev, std::uint32_t seed) {
  owned_tensor f = empty(s, dtype::f32);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (std::int64_t i = 0; i < f.numel(); ++i) f.data_as<float>()[i] = u(gen);
  owned_tensor c = empty(s, t);
  ops::copy(f, c);
  return to_device(c, dev);
}

void sync(const device& dev) {
  if (!dev.is_cpu()) memory::device_synchronize();
}

// Seconds per call of f (after the warm-up calls), the device drained before and after.
template <class F>
double seconds_per_call(const device& dev, int warmup, int steps, F&& f) {
  for (int i = 0; i < warmup; ++i) f();
  sync(dev);
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) f();
  sync(dev);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / steps;
}

int run_attention_bench(const attention_bench_options& o) {
  const bool gpu = o.device == "cuda";
  if (gpu && !memory::gpu_available()) {
    fmt::print(stderr, "troupe bench attention: --device cuda but no GPU is available\n");
    return 2;
  }
  const std::int64_t kv = o.kv_heads == 0 ? o.heads : o.kv_heads;
  if (o.heads % kv != 0) {
    fmt::print(stderr, "troupe bench attention: --heads {} is not a multiple of --kv-heads {}\n",
               o.heads, kv);
    return 2;
  }
  const device dev = gpu ? device::cuda() : device::cpu();
  const dtype t = o.precision == "bf16"  ? dtype::bf16
                  : o.precision == "f16" ? dtype::f16
                                         : dtype::f32;
  const std::int64_t B = o.batch, T = o.seq, H = o.heads, D = o.head_dim;
  owned_tensor q = random_tensor({B, T, H, D}, t, dev, 1),
               k = random_tensor({B, T, kv, D}, t, dev, 2),
               v = random_tensor({B, T, kv, D}, t, dev, 3),
               dout = random_tensor({B, T, H, D}, t, dev, 4);
  owned_tensor out = empty({B, T, H, D}, t, dev), lse = empty({B, H, T}, dtype::f32, dev);
  owned_tensor dq = empty({B, T, H, D}, t, dev), dk = empty({B, T, kv, D}, t, dev),
               dv = empty({B, T, kv, D}, t, dev);

  const double pairs = o.causal ? static_cast<double>(T) * (T + 1) / 2 : static_cast<double>(T) * T;
  const double fwd_flops = 4.0 * static_cast<double>(B * H * D) * pairs;
  const double step_flops = 3.5 * fwd_flops;

  std::vector<ops::attention_kernel> kernels{ops::attention_kernel::automatic};
  if (gpu) kernels = {ops::attention_kernel::tensor_cores, ops::attention_kernel::cuda_cores};
  if (!o.json)
    fmt::print("troupe bench attention: {} {} B={} T={} Hq={} Hkv={} D={} {}, {} calls after {}\n",
               o.device, o.precision, B, T, H, kv, D, o.causal ? "causal" : "full", o.steps,
               o.warmup);
  std::string previous;
  for (ops::attention_kernel kern : kernels) {
    ops::attention_options opt;
    opt.causal = o.causal;
    opt.kernel = kern;
    const std::string name = ops::attention_kernel_for(q, opt);
    if (name == previous) continue;  // automatic already took the CUDA-core kernel
    previous = name;
    const double fwd =
        seconds_per_call(dev, o.warmup, o.steps, [&] { ops::attention(q, k, v, out, lse, opt); });
    const double step = seconds_per_call(dev, o.warmup, o.steps, [&] {
      ops::attention(q, k, v, out, lse, opt);
      ops::attention_backward(q, k, v, out, dout, lse, dq, dk, dv, opt);
    });
    const double tokens_per_s = static_cast<double>(B * T) / step;
    if (o.json) {
      nlohmann::json j{{"bench", "attention"},
                       {"impl", "troupe"},
                       {"device", o.device},
                       {"kernel", name},
                       {"precision", o.precision},
                       {"batch", B},
                       {"seq", T},
                       {"heads", H},
                       {"kv_heads", kv},
                       {"head_dim", D},
                       {"causal", o.causal},
                       {"steps", o.steps},
                       {"forward_s", fwd},
                       {"forward_backward_s", step},
                       {"attention_tokens_per_s", tokens_per_s},
                       {"forward_tflops", fwd_flops / fwd / 1e12},
                       {"forward_backward_tflops", step_flops / step / 1e12}};
      fmt::print("{}\n", j.dump());
    } else {
      fmt::print(
          "  {}: forward {:.3f} ms ({:.1f} TFLOP/s), forward + backward {:.3f} ms ({:.1f} "
          "TFLOP/s), {:.0f} tokens/s\n",
          name, fwd * 1e3, fwd_flops / fwd / 1e12, step * 1e3, step_flops / step / 1e12,
          tokens_per_s);
    }
  }
  return 0;
}

}  // namespace

command_fn add_bench_attention_command(CLI::App& bench) {
  CLI::App* sub = bench.add_subcommand(
      "attention",
      "Time of attention forward and forward + backward at one shape (on a GPU: the tensor-core "
      "and the CUDA-core kernels)");
  auto o = std::make_shared<attention_bench_options>();
  sub->add_option("--device", o->device, "where it runs")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  sub->add_option("--precision", o->precision, "dtype of q, k, v and the gradients")
      ->check(CLI::IsMember({"f32", "bf16", "f16"}))
      ->capture_default_str();
  sub->add_option("--batch", o->batch, "B")->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--seq", o->seq, "T (= S)")->check(CLI::PositiveNumber)->capture_default_str();
  sub->add_option("--heads", o->heads, "query heads")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--kv-heads", o->kv_heads, "key/value heads (0: as many as query heads)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  sub->add_option("--head-dim", o->head_dim, "D")->check(CLI::Range(1, 128))->capture_default_str();
  sub->add_option("--causal", o->causal, "causal mask (true) or full attention (false)")
      ->capture_default_str();
  sub->add_option("--steps", o->steps, "timed calls")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--warmup", o->warmup, "untimed calls first")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  sub->add_flag("--json", o->json, "print one JSON object per kernel");
  return [sub, o]() -> int {
    if (!sub->parsed()) return -1;
    return run_attention_bench(*o);
  };
}

}  // namespace troupe::apps
