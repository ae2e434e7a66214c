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

// Best and median seconds of `repeat` timed calls, after one untimed warm-up call.
struct timing {
  double best = 0, median = 0;
};

timing time_it(int repeat, const std::function<void()>& f) {
  f();
  std::vector<double> s;
  for (int r = 0; r < repeat; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    s.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(s.begin(), s.end());
  return {s.front(), s[s.size() / 2]};
}

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

struct gemm_row {
  std::string name, layout;
  std::int64_t m, n, k;
  timing t;
  double gflops() const { return 2.0 * m * n * k / t.best / 1e9; }
  double gflops_median() const { return 2.0 * m * n * k / t.median / 1e9; }
};

// The three GEMMs of one linear layer x [tokens, in] -> y [tokens, out].
void bench_linear(const std::string& name, std::int64_t tokens, std::int64_t in, std::int64_t out,
                  int repeat, std::vector<gemm_row>& rows) {
  owned_tensor x = filled({tokens, in}), w = filled({out, in}), y = filled({tokens, out});
  owned_tensor dx = filled({tokens, in}), dw = filled({out, in});
  rows.push_back({name + " fwd  y = x W^T", "NT", tokens, out, in,
                  time_it(repeat, [&] { ops::matmul(x, w.transpose(0, 1), y); })});
  rows.push_back({name + " dx = dy W", "NN", tokens, in, out,
                  time_it(repeat, [&] { ops::matmul(y, w, dx); })});
  rows.push_back({name + " dW += dy^T x", "TN", out, in, tokens,
                  time_it(repeat, [&] { ops::matmul(y.transpose(0, 1), x, dw, 1.0, 1.0); })});
}

int run_kernels(const bench_options& o) {
  if (o.threads > 0) parallel::set_num_threads(o.threads);
  const cpu::blas_core_choice& core = cpu::ensure_blas_core();
  const int threads = parallel::num_threads();

  // Raw OpenBLAS SGEMM on square 2048 matrices: the machine's peak for this run.
  const int np = 2048;
  owned_tensor pa = filled({np, np}), pb = filled({np, np}), pc = filled({np, np});
  const timing peak_t = time_it(o.repeat, [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, np, np, np, 1.0f, pa.data_as<float>(),
                np, pb.data_as<float>(), np, 0.0f, pc.data_as<float>(), np);
  });
  const double peak = 2.0 * np * np * np / peak_t.best / 1e9;
  const double peak_median = 2.0 * np * np * np / peak_t.median / 1e9;

  const std::int64_t tokens = 4096, c = 768;
  std::vector<gemm_row> rows;
  bench_linear("attn.qkv ", tokens, c, 3 * c, o.repeat, rows);
  bench_linear("attn.proj", tokens, c, c, o.repeat, rows);
  bench_linear("mlp.fc   ", tokens, c, 4 * c, o.repeat, rows);
  bench_linear("mlp.proj ", tokens, 4 * c, c, o.repeat, rows);
  const std::size_t layer_rows = rows.size();
  bench_linear("lm_head  ", tokens, c, 50257, o.repeat, rows);
  auto total = [&](std::size_t lo, std::size_t hi) {
    double flops = 0, secs = 0;
    for (std::size_t i = lo; i < hi; ++i) {
      flops += 2.0 * rows[i].m * rows[i].n * rows[i].k;
      secs += rows[i].t.best;
    }
    return flops / secs / 1e9;
  };
  const double layer_gflops = total(0, layer_rows), all_gflops = total(0, rows.size());

  // Attention at B=4, T=1024, H=12, D=64, causal.
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
  const timing fwd_t = time_it(o.repeat, [&] { ops::attention(q, k, v, out, lse); });
  const timing bwd_t =
      time_it(o.repeat, [&] { ops::attention_backward(q, k, v, out, dout, lse, dq, dk, dv); });
  // Causal forward: QK^T and PV over the T^2/2 visible pairs, 2 flops per multiply-add.
  const double fwd_flops = 4.0 * ab * ah * at * at * ad / 2;
  const double bwd_flops = 2.5 * fwd_flops;  // five block products instead of two
  const std::size_t scratch = cpu::attention_scratch_bytes();
  const std::size_t per_thread = cpu::attention_scratch_bytes_per_thread(ad, dtype::f32);
  const double scores_bytes = 4.0 * ab * ah * at * at;

  if (o.json) {
    nlohmann::json j;
    j["machine"] = {{"cpu", cpu_model()},
                    {"threads", threads},
                    {"blas_core", core.after},
                    {"blas_core_before", core.before},
                    {"blas_core_overridden", core.overridden},
                    {"blas_core_reason", core.reason}};
    j["peak_sgemm"] = {{"n", np}, {"gflops", peak}, {"gflops_median", peak_median}};
    for (const gemm_row& r : rows)
      j["gemm"].push_back({{"name", r.name},
                           {"layout", r.layout},
                           {"m", r.m},
                           {"n", r.n},
                           {"k", r.k},
                           {"ms", r.t.best * 1e3},
                           {"gflops", r.gflops()},
                           {"gflops_median", r.gflops_median()},
                           {"ratio", r.gflops() / peak}});
    j["gemm_layer"] = {{"gflops", layer_gflops}, {"ratio", layer_gflops / peak}};
    j["gemm_all"] = {{"gflops", all_gflops}, {"ratio", all_gflops / peak}};
    j["attention"] = {{"b", ab},
                      {"t", at},
                      {"h", ah},
                      {"d", ad},
                      {"causal", true},
                      {"fwd_ms", fwd_t.best * 1e3},
                      {"fwd_gflops", fwd_flops / fwd_t.best / 1e9},
                      {"bwd_ms", bwd_t.best * 1e3},
                      {"bwd_gflops", bwd_flops / bwd_t.best / 1e9},
                      {"scratch_bytes", scratch},
                      {"scratch_bytes_per_thread", per_thread},
                      {"score_matrix_bytes_avoided", scores_bytes}};
    fmt::print("{}\n", j.dump(2));
    return 0;
  }

  fmt::print("troupe bench kernels: {} threads on {}\n", threads, cpu_model());
  fmt::print("OpenBLAS core: {} ({})\n\n", core.after, core.reason);
  fmt::print("peak: cblas_sgemm {0}x{0}x{0}: {1:.1f} GFLOP/s best, {2:.1f} median (of {3})\n\n", np,
             peak, peak_median, o.repeat);
  fmt::print(
      "GEMM (f32, ops::matmul, {} tokens)        layout      M      N      K      ms  "
      "GFLOP/s  median  ratio\n",
      tokens);
  for (const gemm_row& r : rows)
    fmt::print("  {:<38} {:>6} {:>6} {:>6} {:>6} {:>7.2f} {:>8.1f} {:>7.1f} {:>6.2f}\n", r.name,
               r.layout, r.m, r.n, r.k, r.t.best * 1e3, r.gflops(), r.gflops_median(),
               r.gflops() / peak);
  fmt::print("  {:<38} {:>43.1f} {:>14.2f}\n", "one block (12 GEMMs, time-weighted)", layer_gflops,
             layer_gflops / peak);
  fmt::print("  {:<38} {:>43.1f} {:>14.2f}\n\n", "block + lm_head (15 GEMMs)", all_gflops,
             all_gflops / peak);
  fmt::print("attention (f32, B={} T={} H={} D={}, causal)        ms  GFLOP/s  ratio\n", ab, at, ah,
             ad);
  fmt::print("  {:<44} {:>7.2f} {:>8.1f} {:>6.2f}\n", "forward", fwd_t.best * 1e3,
             fwd_flops / fwd_t.best / 1e9, fwd_flops / fwd_t.best / 1e9 / peak);
  fmt::print("  {:<44} {:>7.2f} {:>8.1f} {:>6.2f}\n", "backward", bwd_t.best * 1e3,
             bwd_flops / bwd_t.best / 1e9, bwd_flops / bwd_t.best / 1e9 / peak);
  fmt::print("  scratch: {} bytes held ({} per thread); a T x T score matrix would be {:.0f} MB\n",
             scratch, per_thread, scores_bytes / 1e6);
  return 0;
}

}  // namespace

command_fn add_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "Measure kernel throughput on this machine");
  bench->require_subcommand(1);
  CLI::App* kernels = bench->add_subcommand(
      "kernels", "GFLOP/s of the GPT-2 small GEMMs and of attention, against the SGEMM peak");
  auto o = std::make_shared<bench_options>();
  kernels->add_option("--threads", o->threads, "CPU threads (default: TROUPE_NUM_THREADS or all)")
      ->check(CLI::PositiveNumber);
  kernels->add_option("--repeat", o->repeat, "timed runs per kernel; best and median are shown")
      ->check(CLI::PositiveNumber);
  kernels->add_flag("--json", o->json, "print one JSON object instead of tables");
  return [kernels, o]() -> int {
    if (!kernels->parsed()) return -1;
    return run_kernels(*o);
  };
}

}  // namespace troupe::apps
