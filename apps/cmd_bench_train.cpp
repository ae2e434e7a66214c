// `troupe bench train`: training throughput and peak memory of one process, on the CPU or one GPU
// (`--device cuda`), f32 or bf16 with f32 master weights (`--precision`) (docs/performance.md,
// "Training, single process (CPU)" and "GPU"; scripts/bench/train_pytorch.py is the same model and
// loop in PyTorch, scripts/bench/train_vs_pytorch.sh runs the two side by side).
//
// Builds a named model size (make_causal_lm), then runs `warmup` untimed and `steps` timed steps
// of the trainer (models/trainer.hpp): forward, backward, clip_grad_norm 1.0, AdamW (torch
// semantics, weight decay on every parameter) on uniform random token ids drawn per step from
// (seed, step). tokens/s = B * T * steps / the wall time of the timed steps; the CPU seconds per
// step (all threads) are reported too. On a GPU each timed step ends with a device synchronise, so
// its time includes all of its kernels. Peak memory: the
// host tier ledger's high-water mark (every buffer troupe allocates: parameters, gradients,
// activations, scratch, optimizer moments) and the process's peak resident set (VmHWM: what the
// kernel saw, including the binary, libraries and OpenBLAS's buffers), and on a GPU the device
// tier ledger's high-water mark (every device buffer troupe allocates).
#include <sys/resource.h>
#include <time.h>

#include <fmt/core.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "apps/commands.hpp"
#include "memory/gpu.hpp"
#include "memory/tier.hpp"
#include "models/causal_lm.hpp"
#include "models/trainer.hpp"
#include "tensor/cpu/blas_info.hpp"
#include "tensor/parallel.hpp"

namespace troupe::apps {
namespace {

struct train_bench_options {
  std::string model = "bench-small";
  std::string device = "cpu", precision = "f32";
  std::int64_t batch = 8, seq = 256;
  int steps = 10, warmup = 2, threads = 0;
  std::uint64_t seed = 1337;
  bool json = false;
};

// A /proc/self/status field in bytes ("VmHWM", "VmRSS"); -1 when absent.
std::int64_t proc_status_bytes(const std::string& key) {
  std::ifstream f("/proc/self/status");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1)) * 1024;
  return -1;
}

std::int64_t peak_rss_bytes() {
  std::int64_t hwm = proc_status_bytes("VmHWM");
  if (hwm >= 0) return hwm;
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<std::int64_t>(u.ru_maxrss) * 1024;  // Linux: KiB
}

std::uint64_t splitmix64(std::uint64_t& x) {
  std::uint64_t z = (x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// CPU seconds of all the process's threads (spinning waits included).
double process_cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

double mib(std::int64_t bytes) {
  return static_cast<double>(bytes) / (1024.0 * 1024.0);
}

int run_train_bench(const train_bench_options& o) {
  if (o.threads > 0) parallel::set_num_threads(o.threads);
  const cpu::blas_core_choice& core = cpu::ensure_blas_core();
  const std::int64_t rss_start = proc_status_bytes("VmRSS");

  const bool gpu = o.device == "cuda";
  TROUPE_CHECK(!gpu || memory::gpu_available(), "--device cuda: ",
               memory::cuda_built() ? "no GPU is visible" : "troupe was built without CUDA");
  const auto mcfg = models::named_model_config(o.model).value();
  auto model = models::make_causal_lm(mcfg, {o.batch, o.seq},
                                      o.precision == "bf16" ? dtype::bf16 : dtype::f32,
                                      gpu ? device::cuda() : device::cpu());
  TROUPE_CHECK(o.seq <= model->max_seq(), "--seq ", o.seq, " exceeds the model's ",
               model->max_seq(), " positions");
  model->init_weights(o.seed);
  models::train_config cfg;
  cfg.model_size = o.model;
  cfg.batch = o.batch;
  cfg.seq = o.seq;
  cfg.steps = o.warmup + o.steps;
  cfg.seed = o.seed;
  cfg.lr = 3e-4;  // as the PyTorch script: constant, no warmup
  cfg.min_lr = 3e-4;
  cfg.warmup = 0;
  cfg.beta1 = 0.9;
  cfg.beta2 = 0.95;
  cfg.eps = 1e-8;
  cfg.weight_decay = 0.1;
  cfg.clip = 1.0;
  cfg.precision = o.precision;
  models::trainer tr(*model, cfg);
  const auto sync = [gpu] {
    if (gpu) memory::device_synchronize();
  };

  const auto vocab = static_cast<std::uint64_t>(model->vocab());
  const models::trainer::batch_source data = [&](std::uint64_t draw, int b, int t,
                                                 std::vector<std::int32_t>& rows) {
    rows.resize(static_cast<std::size_t>(b) * static_cast<std::size_t>(t));
    std::uint64_t x = o.seed * 0x100000001b3ull + draw;
    for (auto& id : rows) id = static_cast<std::int32_t>(splitmix64(x) % vocab);
  };

  std::vector<double> losses, times;
  for (int i = 0; i < o.warmup; ++i) losses.push_back(tr.step(data).loss);
  sync();
  const auto t0 = std::chrono::steady_clock::now();
  const double cpu0 = process_cpu_seconds();
  for (int i = 0; i < o.steps; ++i) {
    const auto s0 = std::chrono::steady_clock::now();
    losses.push_back(tr.step(data).loss);
    sync();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count());
  }
  const double total = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double cpu = process_cpu_seconds() - cpu0;
  const double tokens = static_cast<double>(o.batch * o.seq) * o.steps;
  std::sort(times.begin(), times.end());

  const memory::tier_stats host = memory::stats(memory::tier::host);
  const memory::tier_stats dev = memory::stats(memory::tier::device);
  auto& mem = model->memory();
  const std::int64_t params = model->slots().param_count();
  const std::int64_t rss_peak = peak_rss_bytes();
  const int threads = parallel::num_threads();

  if (o.json) {
    nlohmann::json j{{"impl", "troupe"},
                     {"device", o.device},
                     {"precision", o.precision},
                     {"model", o.model},
                     {"params", params},
                     {"batch", o.batch},
                     {"seq", o.seq},
                     {"steps", o.steps},
                     {"warmup", o.warmup},
                     {"threads", threads},
                     {"blas_core", core.after},
                     {"tokens_per_s", tokens / total},
                     {"step_s",
                      {{"mean", total / o.steps},
                       {"min", times.front()},
                       {"median", times[times.size() / 2]},
                       {"max", times.back()}}},
                     {"cpu_s_per_step", cpu / o.steps},
                     {"peak_rss_bytes", rss_peak},
                     {"rss_at_start_bytes", rss_start},
                     {"host_ledger_peak_bytes", host.peak},
                     {"host_ledger_in_use_bytes", host.in_use},
                     {"device_ledger_peak_bytes", dev.peak},
                     {"model_bytes",
                      {{"params", mem.param_bytes()},
                       {"grads", mem.param_bytes()},
                       {"activations", mem.activation_bytes()},
                       {"scratch", mem.scratch_bytes()},
                       {"adamw_moments", 2 * tr.master_weights().nbytes()}}},
                     {"loss_first", losses.front()},
                     {"loss_last", losses.back()}};
    fmt::print("{}\n", j.dump());
    return 0;
  }
  fmt::print(
      "troupe bench train: {} ({:.2f} M parameters), {} on {}, B={} T={}, {} threads, "
      "OpenBLAS {}\n",
      o.model, static_cast<double>(params) / 1e6, o.precision, o.device, o.batch, o.seq, threads,
      core.after);
  fmt::print("  {} timed steps after {} warm-up: {:.0f} tokens/s\n", o.steps, o.warmup,
             tokens / total);
  fmt::print("  step time: mean {:.3f} s, min {:.3f}, median {:.3f}, max {:.3f}; CPU {:.3f} s\n",
             total / o.steps, times.front(), times[times.size() / 2], times.back(), cpu / o.steps);
  fmt::print("  peak memory: host ledger {:.1f} MiB, process RSS (VmHWM) {:.1f} MiB\n",
             mib(host.peak), mib(rss_peak));
  if (gpu) fmt::print("  peak device memory (device ledger): {:.1f} MiB\n", mib(dev.peak));
  fmt::print(
      "  planned: params {:.1f} MiB, grads {:.1f}, activations {:.1f}, scratch {:.1f}, "
      "AdamW moments {:.1f}\n",
      mib(static_cast<std::int64_t>(mem.param_bytes())),
      mib(static_cast<std::int64_t>(mem.param_bytes())),
      mib(static_cast<std::int64_t>(mem.activation_bytes())),
      mib(static_cast<std::int64_t>(mem.scratch_bytes())),
      mib(2 * static_cast<std::int64_t>(mem.params().nbytes())));
  fmt::print("  loss: first {:.4f}, last {:.4f}\n", losses.front(), losses.back());
  return 0;
}

}  // namespace

command_fn add_bench_train_command(CLI::App& bench) {
  CLI::App* sub = bench.add_subcommand(
      "train",
      "Training tokens/s and peak memory of a GPT-2 model (AdamW, clip 1.0) on the CPU or a GPU");
  auto o = std::make_shared<train_bench_options>();
  sub->add_option("--model", o->model, "model size")
      ->check(CLI::IsMember({"bench-small", "gpt2-small", "gpt2-demo"}))
      ->capture_default_str();
  sub->add_option("--device", o->device, "where the model trains")
      ->check(CLI::IsMember({"cpu", "cuda"}))
      ->capture_default_str();
  sub->add_option("--precision", o->precision,
                  "f32, or bf16 compute with f32 master weights, gradients and AdamW moments")
      ->check(CLI::IsMember({"f32", "bf16"}))
      ->capture_default_str();
  sub->add_option("--batch", o->batch, "sequences per step (B)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--seq", o->seq, "tokens per sequence (T)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--steps", o->steps, "timed steps")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  sub->add_option("--warmup", o->warmup, "untimed steps first")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  sub->add_option("--threads", o->threads, "CPU threads (default: TROUPE_NUM_THREADS or all)")
      ->check(CLI::PositiveNumber);
  sub->add_option("--seed", o->seed, "seed of the weights and the token ids")
      ->capture_default_str();
  sub->add_flag("--json", o->json, "print one JSON object");
  return [sub, o]() -> int {
    if (!sub->parsed()) return -1;
    return run_train_bench(*o);
  };
}

}  // namespace troupe::apps
