// `troupe bench kernels`: GFLOP/s of the CPU kernels one GPT-2 small training step runs, next to
// the raw OpenBLAS SGEMM peak measured in the same run (docs/performance.md defines the numbers).
//
// GEMMs: the three products of every linear layer of one GPT-2 small block (hidden 768, 4x MLP)
// and of the 50257-way head, at B*T = 4096 tokens, through troupe::ops::matmul with the weight
// layout of models/layers/linear.hpp (W [out, in]): forward y = x W^T, input gradient dx = dy W,
// weight gradient dW += dy^T x. Attention: forward and backward at B=4, T=1024, H=12, D=64, causal,
// with q, k and v sliced from one fused [B, T, 3 H D] buffer as the model holds them.
#include <cblas.h>

#include <fmt/core.h>
#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "apps/commands.hpp"
#include "tensor/cpu/attention.hpp"
#include "tensor/cpu/blas_info.hpp"
#include "tensor/ops.hpp"
#include "tensor/parallel.hpp"
#include "tensor/tensor.hpp"

namespace troupe::apps {
namespace {

struct bench_options {
  int threads = 0;  // 0: keep TROUPE_NUM_THREADS or all CPUs
  int repeat = 3;
  bool json = false;
};

// Deterministic values in [-0.5, 0.5): no denormals, no NaN, the same in every run.
owned_tensor filled(const shape& sizes) {
  owned_tensor t = empty(sizes);
  float* p = t.data_as<float>();
  std::uint32_t x = 12345;
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    x = x * 1664525u + 1013904223u;
    p[i] = static_cast<float>(x >> 8) / 16777216.0f - 0.5f;
  }
  return t;
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) {
      const auto colon = line.find(':');
      return colon == std::string::npos ? line : line.substr(colon + 2);
    }
  return "unknown";
}

double seconds(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// The machine's SGEMM peak: raw cblas_sgemm on square 2048 matrices (after the core selection).
class peak_probe {
 public:
  peak_probe() : a_(filled({n, n})), b_(filled({n, n})), c_(filled({n, n})) { sample(); }
  double sample() {  // GFLOP/s of one call
    const double s = seconds([&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a_.data_as<float>(), n,
                  b_.data_as<float>(), n, 0.0f, c_.data_as<float>(), n);
    });
    const double g = 2.0 * n * n * n / s / 1e9;
    samples.push_back(g);
    return g;
  }
  static constexpr int n = 2048;
  std::vector<double> samples;

 private:
  owned_tensor a_, b_, c_;
};

// One kernel timed against the peak at the same moment. The machine is shared and its speed drifts
// (another tenant can take a core for seconds), so after a warm-up call the kernel runs `repeat`
// rounds, each followed by a peak sample; a round's ratio is the kernel's GFLOP/s over the larger
// of the peak samples just before and just after it. Reported: the best time, and the medians of
// the local peaks and of the ratios.
struct measurement {
  double flops = 0, best_s = 0, median_s = 0, peak = 0, ratio = 0;
  double gflops() const { return flops / best_s / 1e9; }
};

measurement measure(peak_probe& probe, int repeat, double flops, const std::function<void()>& f) {
  f();
  double before = probe.sample();
  std::vector<double> times, peaks, ratios;
  for (int r = 0; r < repeat; ++r) {
    const double t = seconds(f);
    const double after = probe.sample(), local = std::max(before, after);
    times.push_back(t);
    peaks.push_back(local);
    ratios.push_back(flops / t / 1e9 / local);
    before = after;
  }
  measurement m;
  m.flops = flops;
  m.best_s = *std::min_element(times.begin(), times.end());
  m.median_s = median(times);
  m.peak = median(peaks);
  m.ratio = median(ratios);
  return m;
}

struct gemm_row {
  std::string name, layout;
  std::int64_t m, n, k;
  measurement t;
};

// The three GEMMs of one linear layer x [tokens, in] -> y [tokens, out], W [out, in].
void bench_linear(const std::string& name, std::int64_t tokens, std::int64_t in, std::int64_t out,
                  int repeat, peak_probe& probe, std::vector<gemm_row>& rows) {
  owned_tensor x = filled({tokens, in}), w = filled({out, in}), y = filled({tokens, out});
  owned_tensor dx = filled({tokens, in}), dw = filled({out, in});
  const double flops = 2.0 * tokens * in * out;
  rows.push_back({name + " fwd y = x W^T", "NT", tokens, out, in,
                  measure(probe, repeat, flops, [&] { ops::matmul(x, w.transpose(0, 1), y); })});
  rows.push_back({name + " dx = dy W", "NN", tokens, in, out,
                  measure(probe, repeat, flops, [&] { ops::matmul(y, w, dx); })});
  rows.push_back({name + " dW += dy^T x", "TN", out, in, tokens, measure(probe, repeat, flops, [&] {
                    ops::matmul(y.transpose(0, 1), x, dw, 1.0, 1.0);
                  })});
}

// GFLOP/s of a group of rows (total flops over total best time), and its ratio: the time the
// group would take at the local peaks over the (median) time it took.
struct group {
  double gflops = 0, ratio = 0;
};
group summarize(const std::vector<gemm_row>& rows, std::size_t lo, std::size_t hi) {
  double flops = 0, best = 0, ideal = 0, took = 0;
  for (std::size_t i = lo; i < hi; ++i) {
    const measurement& m = rows[i].t;
    flops += m.flops;
    best += m.best_s;
    ideal += m.flops / (m.peak * 1e9);
    took += m.median_s;
  }
  return {flops / best / 1e9, ideal / took};
}

int run_kernels(const bench_options& o) {
  if (o.threads > 0) parallel::set_num_threads(o.threads);
  const cpu::blas_core_choice& core = cpu::ensure_blas_core();
  const int threads = parallel::num_threads();
  peak_probe probe;

  const std::int64_t tokens = 4096, c = 768;
  std::vector<gemm_row> rows;
  bench_linear("attn.qkv ", tokens, c, 3 * c, o.repeat, probe, rows);
  bench_linear("attn.proj", tokens, c, c, o.repeat, probe, rows);
  bench_linear("mlp.fc   ", tokens, c, 4 * c, o.repeat, probe, rows);
  bench_linear("mlp.proj ", tokens, 4 * c, c, o.repeat, probe, rows);
  const std::size_t block_rows = rows.size();
  bench_linear("lm_head  ", tokens, c, 50257, o.repeat, probe, rows);
  const group block = summarize(rows, 0, block_rows), all = summarize(rows, 0, rows.size());

  // Attention at B=4, T=1024, H=12, D=64, causal, q/k/v/dq/dk/dv sliced from fused buffers.
  const std::int64_t ab = 4, at = 1024, ah = 12, ad = 64;
  owned_tensor qkv = filled({ab, at, 3 * ah * ad}), dqkv = filled({ab, at, 3 * ah * ad});
  owned_tensor out = filled({ab, at, ah, ad}), dout = filled({ab, at, ah, ad});
  owned_tensor lse = filled({ab, ah, at});
  auto part = [&](const owned_tensor& buf, int i) {
    return tensor::strided(buf.data(), buf.nbytes(), dtype::f32, {ab, at, ah, ad},
                           {at * 3 * ah * ad, 3 * ah * ad, ad, 1}, i * ah * ad);
  };
  const tensor q = part(qkv, 0), k = part(qkv, 1), v = part(qkv, 2);
  const tensor dq = part(dqkv, 0), dk = part(dqkv, 1), dv = part(dqkv, 2);
  // Causal forward: QK^T and PV over the T^2 / 2 visible pairs, 2 flops per multiply-add.
  // Backward: five such products (S, dP, dV, dK, dQ) instead of two.
  const double fwd_flops = 4.0 * ab * ah * at * at * ad / 2, bwd_flops = 2.5 * fwd_flops;
  const measurement fwd =
      measure(probe, o.repeat, fwd_flops, [&] { ops::attention(q, k, v, out, lse); });
  const measurement bwd = measure(probe, o.repeat, bwd_flops, [&] {
    ops::attention_backward(q, k, v, out, dout, lse, dq, dk, dv);
  });
  const std::size_t scratch = cpu::attention_scratch_bytes();
  const std::size_t per_thread = cpu::attention_scratch_bytes_per_thread(ad, dtype::f32);
  const double scores_bytes = 4.0 * ab * ah * at * at;
  const double peak = *std::max_element(probe.samples.begin(), probe.samples.end());

  if (o.json) {
    auto js = [](const measurement& m) {
      return nlohmann::json{{"ms", m.best_s * 1e3},
                            {"gflops", m.gflops()},
                            {"median_ms", m.median_s * 1e3},
                            {"local_peak_gflops", m.peak},
                            {"ratio", m.ratio}};
    };
    nlohmann::json j;
    j["machine"] = {{"cpu", cpu_model()},
                    {"threads", threads},
                    {"blas_core", core.after},
                    {"blas_core_before", core.before},
                    {"blas_core_overridden", core.overridden},
                    {"blas_core_reason", core.reason}};
    j["peak_sgemm"] = {{"n", peak_probe::n}, {"best_gflops", peak}, {"samples", probe.samples}};
    for (const gemm_row& r : rows) {
      nlohmann::json e = js(r.t);
      e.update({{"name", r.name}, {"layout", r.layout}, {"m", r.m}, {"n", r.n}, {"k", r.k}});
      j["gemm"].push_back(e);
    }
    j["gemm_block"] = {{"gflops", block.gflops}, {"ratio", block.ratio}};
    j["gemm_block_and_head"] = {{"gflops", all.gflops}, {"ratio", all.ratio}};
    j["attention"] = {{"b", ab},
                      {"t", at},
                      {"h", ah},
                      {"d", ad},
                      {"causal", true},
                      {"forward", js(fwd)},
                      {"backward", js(bwd)},
                      {"scratch_bytes", scratch},
                      {"scratch_bytes_per_thread", per_thread},
                      {"score_matrix_bytes", scores_bytes}};
    fmt::print("{}\n", j.dump(2));
    return 0;
  }

  fmt::print("troupe bench kernels: {} threads on {}\n", threads, cpu_model());
  fmt::print("OpenBLAS core: {} ({})\n", core.after, core.reason);
  fmt::print(
      "peak: cblas_sgemm {0}x{0}x{0}, best {1:.1f} GFLOP/s of {2} samples (median {3:.1f})\n",
      peak_probe::n, peak, probe.samples.size(), median(probe.samples));
  fmt::print("ratio: GFLOP/s over the peak sampled around the same call (median of {} rounds)\n\n",
             o.repeat);
  fmt::print(
      "GEMM (f32, ops::matmul, {} tokens)   layout      M      N      K       ms  GFLOP/s"
      "    peak  ratio\n",
      tokens);
  for (const gemm_row& r : rows)
    fmt::print("  {:<33} {:>6} {:>6} {:>6} {:>6} {:>8.2f} {:>8.1f} {:>7.1f} {:>6.2f}\n", r.name,
               r.layout, r.m, r.n, r.k, r.t.best_s * 1e3, r.t.gflops(), r.t.peak, r.t.ratio);
  fmt::print("  {:<33} {:>44.1f} {:>14.2f}\n", "one block (12 GEMMs)", block.gflops, block.ratio);
  fmt::print("  {:<33} {:>44.1f} {:>14.2f}\n\n", "block + lm_head (15 GEMMs)", all.gflops,
             all.ratio);
  fmt::print("attention (f32, B={} T={} H={} D={}, causal)    ms  GFLOP/s    peak  ratio\n", ab, at,
             ah, ad);
  for (auto [name, m] : {std::pair{"forward", fwd}, std::pair{"backward", bwd}})
    fmt::print("  {:<38} {:>8.2f} {:>8.1f} {:>7.1f} {:>6.2f}\n", name, m.best_s * 1e3, m.gflops(),
               m.peak, m.ratio);
  fmt::print("  scratch: {} bytes held ({} per thread); a T x T score matrix would be {:.0f} MB\n",
             scratch, per_thread, scores_bytes / 1e6);
  return 0;
}

}  // namespace

command_fn add_bench_command(CLI::App& app) {
  CLI::App* bench =
      app.add_subcommand("bench", "Measure kernel and training throughput on this machine");
  bench->require_subcommand(1);
  CLI::App* kernels = bench->add_subcommand(
      "kernels", "GFLOP/s of the GPT-2 small GEMMs and of attention, against the SGEMM peak");
  auto o = std::make_shared<bench_options>();
  kernels->add_option("--threads", o->threads, "CPU threads (default: TROUPE_NUM_THREADS or all)")
      ->check(CLI::PositiveNumber);
  kernels->add_option("--repeat", o->repeat, "timed runs per kernel; best and median are shown")
      ->check(CLI::PositiveNumber);
  kernels->add_flag("--json", o->json, "print one JSON object instead of tables");
  command_fn train = add_bench_train_command(*bench);  // apps/cmd_bench_train.cpp
  return [kernels, o, train]() -> int {
    if (!kernels->parsed()) return train();
    return run_kernels(*o);
  };
}

}  // namespace troupe::apps
