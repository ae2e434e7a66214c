// `troupe bench ring-attention`: the memory and time of causal attention (forward + backward) over
// one long sequence, on one rank with the whole sequence and on cp ranks with ring attention
// (models/layers/ring_attention.hpp), each rank a forked process over UCX
// (collective/ucx/local_ranks.hpp), pinned to its own CPU (mod the CPUs this process may use).
//
// Memory: each process's host tier ledger (memory/tier.hpp) from just before it allocates its
// tensors to the end of backward: q, k, v, dout, out, lse, dq, dk, dv (the whole sequence on one
// rank, T / cp of it per ring rank), the ring's workspace, and the attention kernels' scratch. The
// largest rank's peak is compared with --budget-mib: the report says which runs fit. Time: the
// forward + backward wall time of each rank, the slowest reported (the ranks share this machine's
// CPUs: a measurement, not a scaling claim), and how long the ranks were blocked in the ring's
// sends and receives (transfers the compute did not hide, and waits for a slower peer).
//
// --check runs at the given shape (keep it small) and has every ring rank also compute the
// single-rank attention in f32 and in f64 and judge its rows by the rounding rule of
// tests/rounding.hpp; the command then exits 1 when any rank's rows are off.
#include <fmt/core.h>
#include <sys/mman.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "apps/commands.hpp"
#include "collective/p2p_communicator.hpp"
#include "collective/ucx/local_ranks.hpp"
#include "memory/error.hpp"
#include "memory/tier.hpp"
#include "models/layers/ring_attention.hpp"
#include "models/layers/sequence_split.hpp"
#include "tensor/ops.hpp"
#include "tests/rounding.hpp"

namespace troupe::apps {
namespace {

struct ring_args {
  std::int64_t seq = 16384, batch = 1, heads = 8, kv_heads = 2, head_dim = 64;
  int cp = 4;
  std::string layout = "zigzag";
  std::string dtype = "f32";  // f32, bf16 or f16 (the timed runs; --check is f32)
  double budget_mib = 96;
  bool check = false;
};

// What a rank reports back through shared memory.
struct rank_report {
  std::int64_t peak = 0;       // host ledger bytes above what the rank held before allocating
  std::int64_t workspace = 0;  // the ring op's own workspace
  double seconds = 0;          // forward + backward
  double blocked = 0;          // of it, blocked in the ring's sends and receives
  int bad = 0;                 // --check: results that failed the rounding rule
};

// A value in [-scale, scale) for element i of input `which`: a hash of the element's index in the
// whole sequence, so that every rank draws its part without the whole.
double draw(std::uint64_t which, std::uint64_t i, double scale) {
  std::uint64_t z = (which << 56) ^ (i + 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return scale * (static_cast<double>(z >> 11) * 0x1.0p-53 * 2.0 - 1.0);
}

// Fills x [B, Tl, H, D] (host, f32 or f64; bf16 and f16 through an f32 copy) with the rank's
// tokens of input `which`.
void fill_part(const tensor& x, std::uint64_t which, double scale, std::int64_t t, int cp, int rank,
               models::sequence_layout layout) {
  if (x.type() == dtype::bf16 || x.type() == dtype::f16) {
    owned_tensor wide = empty(x.sizes(), dtype::f32);
    fill_part(wide, which, scale, t, cp, rank, layout);
    ops::copy(wide, x);
    return;
  }
  const auto pos = models::local_positions(t, cp, rank, layout);
  const std::int64_t b = x.size(0), tl = x.size(1), row = x.size(2) * x.size(3);
  for (std::int64_t bi = 0; bi < b; ++bi)
    for (std::int64_t j = 0; j < tl; ++j)
      for (std::int64_t e = 0; e < row; ++e) {
        const auto gi = static_cast<std::uint64_t>((bi * t + pos[j]) * row + e);
        // Rounded to f32 first: the f32 and f64 runs of --check see the same numbers.
        const double v = static_cast<float>(draw(which, gi, which == 0 ? 3.0 : 1.0));
        const std::int64_t at = (bi * tl + j) * row + e;
        if (x.type() == dtype::f64)
          x.data_as<double>()[at] = v;
        else
          x.data_as<float>()[at] = static_cast<float>(v);
      }
}

struct attn_tensors {
  owned_tensor q, k, v, dout, out, lse, dq, dk, dv;
};

attn_tensors make_tensors(const ring_args& a, std::int64_t t, dtype type) {
  const shape qs{a.batch, t, a.heads, a.head_dim}, ks{a.batch, t, a.kv_heads, a.head_dim};
  // The log-sum-exp of 16-bit attention is f32 (tensor/ops.hpp).
  const dtype stat = type == dtype::bf16 || type == dtype::f16 ? dtype::f32 : type;
  return {empty(qs, type), empty(ks, type), empty(ks, type),
          empty(qs, type), empty(qs, type), empty({a.batch, a.heads, t}, stat),
          empty(qs, type), empty(ks, type), empty(ks, type)};
}

// Inputs of this rank (the whole sequence when cp == 1).
void fill_inputs(const attn_tensors& x, const ring_args& a, int cp, int rank,
                 models::sequence_layout layout) {
  fill_part(x.q, 0, 3.0, a.seq, cp, rank, layout);
  fill_part(x.k, 1, 1.0, a.seq, cp, rank, layout);
  fill_part(x.v, 2, 1.0, a.seq, cp, rank, layout);
  fill_part(x.dout, 3, 1.0, a.seq, cp, rank, layout);
}

void single_rank(const attn_tensors& x) {
  ops::attention(x.q, x.k, x.v, x.out, x.lse);
  ops::attention_backward(x.q, x.k, x.v, x.out, x.dout, x.lse, x.dq, x.dk, x.dv);
}

// Element-wise values of a contiguous f32/f64 tensor, as doubles.
std::vector<double> values(const tensor& t) {
  std::vector<double> v(static_cast<std::size_t>(t.numel()));
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = t.type() == dtype::f64 ? t.data_as<double>()[i] : t.data_as<float>()[i];
  return v;
}

// --check: this rank's rows of the ring results against the single-rank runs' same rows.
int check_rows(const attn_tensors& got, const ring_args& a, int cp, int rank,
               models::sequence_layout layout) {
  attn_tensors ref = make_tensors(a, a.seq, dtype::f32), exact = make_tensors(a, a.seq, dtype::f64);
  fill_inputs(ref, a, 1, 0, layout);
  fill_inputs(exact, a, 1, 0, layout);
  single_rank(ref);
  single_rank(exact);
  const std::int64_t tl = a.seq / cp;
  int bad = 0;
  const std::pair<const char*, owned_tensor attn_tensors::*> fields[] = {
      {"out", &attn_tensors::out},
      {"dq", &attn_tensors::dq},
      {"dk", &attn_tensors::dk},
      {"dv", &attn_tensors::dv}};
  for (auto [name, f] : fields) {
    const tensor& full_ref = ref.*f;
    auto mine_ref = empty({a.batch, tl, full_ref.size(2), full_ref.size(3)}, dtype::f32);
    auto mine_exact = empty({a.batch, tl, full_ref.size(2), full_ref.size(3)}, dtype::f64);
    models::split_sequence(full_ref, cp, rank, layout, mine_ref);
    models::split_sequence(exact.*f, cp, rank, layout, mine_exact);
    const auto v = tests::as_accurate_as(values(got.*f), values(mine_ref), values(mine_exact));
    fmt::print(stderr, "rank {} {}: {}\n", rank, name, v.str());
    bad += v.ok() ? 0 : 1;
  }
  return bad;
}

int run(const ring_args& a) {
  const auto layout = a.layout == "contiguous" ? models::sequence_layout::contiguous
                                               : models::sequence_layout::zigzag;
  TROUPE_CHECK(a.layout == "contiguous" || a.layout == "zigzag",
               "bench ring-attention: --layout must be zigzag or contiguous, got ", a.layout);
  TROUPE_CHECK(a.cp >= 1, "bench ring-attention: --cp must be at least 1, got ", a.cp);
  const dtype type = a.dtype == "bf16" ? dtype::bf16 : a.dtype == "f16" ? dtype::f16 : dtype::f32;
  TROUPE_CHECK(a.dtype == "f32" || a.dtype == "bf16" || a.dtype == "f16",
               "bench ring-attention: --dtype must be f32, bf16 or f16, got ", a.dtype);
  TROUPE_CHECK(!a.check || type == dtype::f32, "bench ring-attention: --check runs in f32 only ",
               "(--dtype ", a.dtype, "); the 16-bit ring is checked by models/layers tests");
  // Checked here, before the ranks fork: a rank holds --seq / --cp tokens (zigzag: two chunks).
  const std::int64_t pieces = layout == models::sequence_layout::zigzag ? 2 * a.cp : a.cp;
  TROUPE_CHECK(a.seq > 0 && a.seq % pieces == 0, "bench ring-attention: --seq ", a.seq,
               " must split into ", pieces, " equal pieces (--cp ", a.cp, ", --layout ", a.layout,
               ")");
  // One report per rank of the ring run, and one for the single rank, shared with the children.
  const std::size_t n_reports = static_cast<std::size_t>(a.cp) + 1;
  void* shared = mmap(nullptr, n_reports * sizeof(rank_report), PROT_READ | PROT_WRITE,
                      MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  TROUPE_CHECK(shared != MAP_FAILED, "bench ring-attention: mmap of the reports failed");
  auto* reports = new (shared) rank_report[n_reports];
  collective::local_ranks_options opt;
  opt.timeout = std::chrono::hours(1);
  opt.pin_cpus = true;
  using clock = std::chrono::steady_clock;

  int rc = 0;
  if (!a.check) {  // one rank, the whole sequence
    rc |= collective::run_local_ranks(
        1,
        [&](collective::ucx_transport&) {
          const std::int64_t before = memory::stats(memory::tier::host).in_use;
          memory::reset_peak(memory::tier::host);
          attn_tensors x = make_tensors(a, a.seq, type);
          fill_inputs(x, a, 1, 0, layout);
          const auto t0 = clock::now();
          single_rank(x);
          reports[a.cp].seconds = std::chrono::duration<double>(clock::now() - t0).count();
          reports[a.cp].peak = memory::stats(memory::tier::host).peak - before;
          return 0;
        },
        opt);
  }
  rc |= collective::run_local_ranks(
      a.cp,
      [&](collective::ucx_transport& t) {
        collective::rank_group group;
        group.id = 7;
        for (int r = 0; r < a.cp; ++r) group.ranks.push_back(r);
        collective::p2p_communicator comm(t, group, "ucx");
        const int r = t.rank();
        const std::int64_t before = memory::stats(memory::tier::host).in_use;
        memory::reset_peak(memory::tier::host);
        const std::int64_t tl = a.seq / a.cp;
        attn_tensors x = make_tensors(a, tl, type);
        fill_inputs(x, a, a.cp, r, layout);
        models::ring_attention op(comm, {.batch = a.batch,
                                         .local_seq = tl,
                                         .n_head = a.heads,
                                         .n_kv_head = a.kv_heads,
                                         .head_dim = a.head_dim,
                                         .type = type,
                                         .layout = layout});
        comm.barrier().wait();
        const auto t0 = clock::now();
        op.forward(x.q, x.k, x.v, x.out, x.lse);
        op.backward(x.q, x.k, x.v, x.out, x.lse, x.dout, x.dq, x.dk, x.dv);
        reports[r].seconds = std::chrono::duration<double>(clock::now() - t0).count();
        reports[r].peak = memory::stats(memory::tier::host).peak - before;
        reports[r].workspace = static_cast<std::int64_t>(op.workspace_bytes());
        reports[r].blocked = op.waits().forward + op.waits().backward;
        if (a.check) reports[r].bad = check_rows(x, a, a.cp, r, layout);
        return reports[r].bad == 0 ? 0 : 1;
      },
      opt);
  auto unmap = [&] {
    if (munmap(shared, n_reports * sizeof(rank_report)) != 0)
      fmt::print(stderr, "troupe: bench ring-attention: munmap of the report area failed: {}\n",
                 std::strerror(errno));
  };
  if (rc != 0 && !a.check) {
    // A rank that failed reported nothing: no table of zeros that would read as a result.
    unmap();
    fmt::print(stderr, "troupe: bench ring-attention: a rank failed (see the lines above)\n");
    return 1;
  }

  const double mib = 1024.0 * 1024.0;
  fmt::print("causal attention forward + backward, {}, B {} T {} heads {} kv heads {} D {}\n",
             a.dtype, a.batch, a.seq, a.heads, a.kv_heads, a.head_dim);
  fmt::print("budget per rank: {:.1f} MiB of host tier\n", a.budget_mib);
  fmt::print("{:<28} {:>6} {:>16} {:>16} {:>8} {:>10} {:>12} {:>10}\n", "run", "ranks",
             "peak/rank MiB", "workspace MiB", "fits", "seconds", "tokens/s", "blocked s");
  auto row = [&](const std::string& name, int ranks, double peak, double ws, double sec,
                 double blocked) {
    fmt::print("{:<28} {:>6} {:>16.1f} {:>16.1f} {:>8} {:>10.2f} {:>12.0f} {:>10.2f}\n", name,
               ranks, peak / mib, ws / mib, peak / mib <= a.budget_mib ? "yes" : "no", sec,
               sec > 0 ? static_cast<double>(a.batch * a.seq) / sec : 0.0, blocked);
  };
  if (!a.check)
    row("one rank, whole sequence", 1, double(reports[a.cp].peak), 0, reports[a.cp].seconds, 0);
  double peak = 0, ws = 0, sec = 0, blocked_min = 1e300, blocked_max = 0;
  int bad = 0;
  for (int r = 0; r < a.cp; ++r) {
    peak = std::max(peak, double(reports[r].peak));
    ws = std::max(ws, double(reports[r].workspace));
    sec = std::max(sec, reports[r].seconds);
    blocked_min = std::min(blocked_min, reports[r].blocked);
    blocked_max = std::max(blocked_max, reports[r].blocked);
    bad += reports[r].bad;
  }
  // "blocked s": the least any rank spent blocked in the ring's sends and receives (what the
  // compute did not hide); the most, below, includes waiting for a slower peer.
  row(fmt::format("ring attention ({})", a.layout), a.cp, peak, ws, sec, blocked_min);
  fmt::print("blocked in the ring's sends and receives: {:.2f} to {:.2f} s per rank\n", blocked_min,
             blocked_max);
  if (a.check)
    fmt::print("check: {}\n", bad == 0 && rc == 0 ? "every rank's rows as accurate as one rank's"
                                                  : "FAILED (see the lines above)");
  unmap();
  return rc == 0 && bad == 0 ? 0 : 1;
}

}  // namespace

command_fn add_bench_ring_command(CLI::App& bench) {
  auto a = std::make_shared<ring_args>();
  CLI::App* c = bench.add_subcommand(
      "ring-attention",
      "Peak memory and time of causal attention over one long sequence: one rank against "
      "ring attention on cp ranks (forked processes over UCX)");
  c->add_option("--seq", a->seq, "sequence length T")->capture_default_str();
  c->add_option("--cp", a->cp, "ranks of the ring")->capture_default_str();
  c->add_option("--batch", a->batch, "sequences B")->capture_default_str();
  c->add_option("--heads", a->heads, "query heads")->capture_default_str();
  c->add_option("--kv-heads", a->kv_heads, "key/value heads")->capture_default_str();
  c->add_option("--head-dim", a->head_dim, "head dimension D")->capture_default_str();
  c->add_option("--layout", a->layout, "zigzag or contiguous")->capture_default_str();
  c->add_option("--dtype", a->dtype,
                "f32, bf16 or f16 (16 bits: blocks travel in 16 bits, computed and merged in f32)")
      ->capture_default_str();
  c->add_option("--budget-mib", a->budget_mib,
                "the per-rank host memory budget the report "
                "compares peaks with")
      ->capture_default_str();
  c->add_flag("--check", a->check,
              "also compare every ring rank's rows with single-rank attention (small shapes)");
  return [c, a]() -> int {
    if (!c->parsed()) return -1;
    return run(*a);
  };
}

}  // namespace troupe::apps
