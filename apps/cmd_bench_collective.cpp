// `troupe bench collective`: time, algbw and busbw of the host collectives, nccl-tests style.
//
// Forks N ranks connected by UCX (collective/ucx/local_ranks.hpp; ranks pinned to CPUs), or runs
// them as threads on the local transport (--backend local), makes one communicator over all ranks
// and times each op at sizes from --min to --max bytes (x4 steps, or --step). "size" is what
// nccl-tests calls size: the whole buffer of the op (allreduce, broadcast: the vector; all_gather:
// the gathered output; reduce_scatter: the input; all_to_all, all_to_allv: one rank's send buffer;
// all_to_allv sends equal blocks, so it differs from all_to_all only by its count check). Time is
// the slowest rank's mean over the timed iterations of one repetition, the fastest of --reps
// repetitions (the machine is shared: the best repetition is the least disturbed one), after
// --warmup untimed ones. algbw = size / time; busbw = algbw * f with f = 2(n-1)/n for allreduce,
// (n-1)/n for reduce_scatter, all_gather and all_to_all(v), and 1 for broadcast (nccl-tests
// doc/PERFORMANCE.md). Rates are GB/s of 1e9 bytes. Before timing each size the op runs once on
// known data and the result is checked.
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "apps/commands.hpp"
#include "collective/communicator.hpp"
#include "collective/grid.hpp"
#include "collective/local/local_transport.hpp"
#include "collective/p2p_communicator.hpp"
#include "collective/ucx/local_ranks.hpp"
#include "collective/ucx/ucx_transport.hpp"
#include "memory/error.hpp"

namespace troupe::apps {
namespace {

using namespace troupe::collective;
using clock_type = std::chrono::steady_clock;

struct coll_args {
  int ranks = 2;
  std::vector<std::string> ops = {"allreduce", "reduce_scatter", "all_gather", "broadcast",
                                  "all_to_all"};
  std::string min_size = "1K", max_size = "256M";
  int step = 4;
  int warmup = 5;
  int reps = 5;
  double seconds_per_size = 0.2;  // target timed seconds per size and op (iterations adapt)
  std::string dtype_name = "f32";
  std::string backend = "ucx";
  bool csv = false;
  bool pin = true;
  bool progress_thread = false;
  bool single_copy = true;
  std::size_t ring_min = 0, chain_min = 0, chunk = 0;  // 0: the communicator's defaults
  std::size_t direct_min = 0, piece = 0, copy_piece = 0, pull_min = 0;
  bool direct = true;
  bool shm = true;
  std::size_t shm_min = 0, shm_slot = 0;
  int shm_slots = 0;
  bool touch = false;  // rewrite the buffer before every allreduce (timed with it)
  int window = 0;
};

std::size_t parse_size(const std::string& s) {
  TROUPE_CHECK(!s.empty(), "troupe bench collective: empty size");
  std::size_t mult = 1;
  std::string num = s;
  const char last = static_cast<char>(std::toupper(static_cast<unsigned char>(s.back())));
  if (last == 'K' || last == 'M' || last == 'G') {
    mult = last == 'K' ? 1024 : last == 'M' ? 1024 * 1024 : std::size_t{1} << 30;
    num = s.substr(0, s.size() - 1);
  }
  try {
    return static_cast<std::size_t>(std::stoull(num)) * mult;
  } catch (const std::exception&) {
    TROUPE_FAIL("troupe bench collective: cannot read size '", s, "' (use e.g. 4K, 16M)");
  }
}

std::string size_text(std::size_t b) {
  if (b >= (std::size_t{1} << 30) && b % (std::size_t{1} << 30) == 0)
    return std::to_string(b >> 30) + "GiB";
  if (b >= (1u << 20) && b % (1u << 20) == 0) return std::to_string(b >> 20) + "MiB";
  if (b >= 1024 && b % 1024 == 0) return std::to_string(b >> 10) + "KiB";
  return std::to_string(b) + "B";
}

dtype parse_dtype(const std::string& s) {
  for (dtype t : {dtype::f32, dtype::f64, dtype::bf16, dtype::f16})
    if (s == dtype_name(t)) return t;
  TROUPE_FAIL("troupe bench collective: --dtype must be f32, f64, bf16 or f16, not '", s, "'");
}

double bus_factor(const std::string& op, int n) {
  if (op == "allreduce") return 2.0 * (n - 1) / n;
  if (op == "broadcast") return 1.0;
  return static_cast<double>(n - 1) / n;
}

struct result_row {
  std::string op;
  std::size_t bytes = 0;
  double time_us = 0;
};

void fill(std::vector<std::byte>& buf, dtype t, double v) {
  const std::size_t n = buf.size() / dtype_size(t);
  for (std::size_t i = 0; i < n; ++i) {
    switch (t) {
      case dtype::f32: {
        float f = static_cast<float>(v);
        std::memcpy(&buf[i * 4], &f, 4);
        break;
      }
      case dtype::f64:
        std::memcpy(&buf[i * 8], &v, 8);
        break;
      case dtype::bf16: {
        auto h = f32_to_bf16_bits(static_cast<float>(v));
        std::memcpy(&buf[i * 2], &h, 2);
        break;
      }
      default: {
        auto h = f32_to_f16_bits(static_cast<float>(v));
        std::memcpy(&buf[i * 2], &h, 2);
      }
    }
  }
}

double read_at(const std::vector<std::byte>& buf, dtype t, std::size_t i) {
  switch (t) {
    case dtype::f32: {
      float f;
      std::memcpy(&f, &buf[i * 4], 4);
      return f;
    }
    case dtype::f64: {
      double d;
      std::memcpy(&d, &buf[i * 8], 8);
      return d;
    }
    case dtype::bf16: {
      std::uint16_t h;
      std::memcpy(&h, &buf[i * 2], 2);
      return bf16_bits_to_f32(h);
    }
    default: {
      std::uint16_t h;
      std::memcpy(&h, &buf[i * 2], 2);
      return f16_bits_to_f32(h);
    }
  }
}

// One rank's part: every op and size; returns the rows (rank 0's are printed).
std::vector<result_row> run_rank(communicator& comm, const coll_args& a) {
  const int n = comm.size(), me = comm.rank();
  const dtype t = parse_dtype(a.dtype_name);
  const std::size_t es = dtype_size(t);
  if (auto* p = dynamic_cast<p2p_communicator*>(&comm)) {
    algo_tuning tu = p->tuning();
    if (a.ring_min) tu.allreduce_ring_min = a.ring_min;
    if (a.chain_min) tu.broadcast_chain_min = a.chain_min;
    if (a.chunk) tu.chunk_bytes = a.chunk;
    if (a.window) tu.window = a.window;
    if (a.direct_min) tu.allreduce_direct_min = a.direct_min;
    if (a.piece) tu.direct_piece_bytes = a.piece;
    if (a.copy_piece) tu.direct_copy_bytes = a.copy_piece;
    if (a.pull_min)
      tu.all_gather_direct_min = tu.reduce_scatter_direct_min = tu.all_to_all_direct_min =
          a.pull_min;
    tu.allreduce_direct = tu.allreduce_direct && a.direct;
    tu.pull_direct = tu.pull_direct && a.direct;
    tu.shm = tu.shm && a.direct && a.shm;
    if (a.shm_min) tu.shm_min = a.shm_min;
    if (a.shm_slot) tu.shm_slot_bytes = a.shm_slot;
    if (a.shm_slots) tu.shm_slots = a.shm_slots;
    p->set_tuning(tu);
  }
  const std::size_t lo = parse_size(a.min_size), hi = parse_size(a.max_size);
  std::vector<std::byte> in(hi), out(hi);
  std::vector<result_row> rows;
  for (const auto& op : a.ops) {
    for (std::size_t bytes = lo; bytes <= hi; bytes *= a.step) {
      const std::size_t per_rank = bytes / es / n;  // block elements for the blocked ops
      const std::size_t elems = bytes / es;
      std::function<work()> run;
      bool touching = false;  // --touch, from the warmup on (not in the check below)
      if (op == "allreduce") {
        run = [&, elems, bytes] {
          if (touching) std::memset(in.data(), 0, bytes);
          return comm.allreduce(in.data(), elems, t);
        };
      } else if (op == "reduce_scatter") {
        run = [&, per_rank] { return comm.reduce_scatter(in.data(), out.data(), per_rank, t); };
      } else if (op == "all_gather") {
        run = [&, per_rank] {
          return comm.all_gather(in.data() + me * per_rank * es, out.data(), per_rank, t);
        };
      } else if (op == "broadcast") {
        run = [&, elems] { return comm.broadcast(in.data(), elems, t); };
      } else if (op == "all_to_all") {
        run = [&, per_rank] { return comm.all_to_all(in.data(), out.data(), per_rank, t); };
      } else if (op == "all_to_allv") {
        run = [&, per_rank, counts = std::vector<std::size_t>(n, per_rank)] {
          return comm.all_to_allv(in.data(), counts, out.data(), counts, t);
        };
      } else {
        TROUPE_FAIL("troupe bench collective: unknown op '", op,
                    "' (allreduce, reduce_scatter, all_gather, broadcast, all_to_all, "
                    "all_to_allv)");
      }
      if (per_rank == 0) continue;
      // Check once on known data: every rank holds me+1 (sums exact in every dtype up to 8 ranks).
      {
        std::vector<std::byte> probe(bytes);
        fill(probe, t, me + 1);
        std::copy(probe.begin(), probe.end(), in.begin());
        run().wait();
        double want = 1, got = 0;
        if (op == "allreduce") {
          want = n * (n + 1) / 2.0;
          got = read_at(in, t, elems - 1);
        } else if (op == "reduce_scatter") {
          want = n * (n + 1) / 2.0;
          got = read_at(out, t, per_rank - 1);
        } else if (op == "all_gather" || op == "all_to_all" || op == "all_to_allv") {
          want = n;  // block n-1 came from rank n-1
          got = read_at(out, t, (n - 1) * per_rank);
        } else {
          got = read_at(in, t, elems - 1);  // 1, from root 0
        }
        TROUPE_CHECK(got == want, "troupe bench collective: ", op, " of ", size_text(bytes),
                     " gave ", got, " on rank ", me, ", expected ", want);
      }
      std::fill(in.begin(), in.end(), std::byte{0});
      touching = a.touch;
      for (int i = 0; i < a.warmup; ++i) run().wait();
      // Iterations for about seconds_per_size / reps per repetition, agreed from rank 0's guess.
      comm.barrier().wait();
      const auto g0 = clock_type::now();
      run().wait();
      double one = std::chrono::duration<double>(clock_type::now() - g0).count();
      double agreed = one;  // every rank must run the same iterations: rank 0's guess decides
      comm.broadcast(&agreed, 1, dtype::f64).wait();
      const int iters = static_cast<int>(
          std::clamp(a.seconds_per_size / a.reps / std::max(agreed, 1e-7), 1.0, 20000.0));
      std::vector<double> reps;
      for (int r = 0; r < a.reps; ++r) {
        comm.barrier().wait();
        const auto t0 = clock_type::now();
        for (int i = 0; i < iters; ++i) run().wait();
        double us =
            std::chrono::duration<double, std::micro>(clock_type::now() - t0).count() / iters;
        comm.allreduce(&us, 1, dtype::f64, options{.op = reduce_op::max}).wait();
        reps.push_back(us);
      }
      std::sort(reps.begin(), reps.end());
      rows.push_back({op, bytes, reps.front()});
    }
  }
  return rows;
}

void print_rows(const std::vector<result_row>& rows, const coll_args& a, int n,
                const std::string& what) {
  if (a.csv) {
    std::printf("op,bytes,time_us,algbw_GBs,busbw_GBs\n");
    for (const auto& r : rows) {
      const double alg = r.bytes / (r.time_us * 1e-6) / 1e9;
      std::printf("%s,%zu,%.3f,%.4f,%.4f\n", r.op.c_str(), r.bytes, r.time_us, alg,
                  alg * bus_factor(r.op, n));
    }
  } else {
    std::printf("troupe bench collective: %d ranks, %s, %s\n", n, what.c_str(),
                a.dtype_name.c_str());
    std::printf("%-15s %10s %12s %10s %10s\n", "op", "size", "time_us", "algbw", "busbw");
    for (const auto& r : rows) {
      const double alg = r.bytes / (r.time_us * 1e-6) / 1e9;
      std::printf("%-15s %10s %12.2f %10.3f %10.3f\n", r.op.c_str(), size_text(r.bytes).c_str(),
                  r.time_us, alg, alg * bus_factor(r.op, n));
    }
    std::printf(
        "(GB/s = 1e9 B/s; busbw = algbw x 2(n-1)/n allreduce, (n-1)/n reduce_scatter, "
        "all_gather, all_to_all, 1 broadcast)\n");
  }
  std::fflush(stdout);
}

int run_bench(const coll_args& a) {
  TROUPE_CHECK(a.ranks >= 1 && a.ranks <= 64, "troupe bench collective: -n ", a.ranks,
               " outside [1, 64]");
  TROUPE_CHECK(a.step >= 2, "troupe bench collective: --step must be at least 2");
  TROUPE_CHECK(a.reps >= 1 && a.warmup >= 0, "troupe bench collective: --reps >= 1, --warmup >= 0");
  parse_dtype(a.dtype_name);
  TROUPE_CHECK(parse_size(a.min_size) <= parse_size(a.max_size),
               "troupe bench collective: --min above --max");
  rank_group all;
  for (int r = 0; r < a.ranks; ++r) all.ranks.push_back(r);
  if (a.backend == "local") {
    auto comms = make_local_group(a.ranks);
    std::vector<std::vector<result_row>> rows(a.ranks);
    std::vector<std::string> errors(a.ranks);
    std::vector<std::thread> threads;
    for (int r = 0; r < a.ranks; ++r)
      threads.emplace_back([&, r] {
        try {
          rows[r] = run_rank(*comms[r], a);
        } catch (const std::exception& e) {
          errors[r] = e.what();
        }
      });
    for (auto& th : threads) th.join();
    for (int r = 0; r < a.ranks; ++r)
      TROUPE_CHECK(errors[r].empty(), "troupe bench collective: rank ", r, ": ", errors[r]);
    print_rows(rows[0], a, a.ranks, "local transport (threads, unpinned)");
    return 0;
  }
  TROUPE_CHECK(a.backend == "ucx", "troupe bench collective: --backend must be ucx or local, not '",
               a.backend, "'");
  local_ranks_options lo;
  lo.pin_cpus = a.pin;
  lo.progress_thread = a.progress_thread;
  lo.single_copy = a.single_copy;
  lo.timeout = std::chrono::hours(1);
  return run_local_ranks(
      a.ranks,
      [&](ucx_transport& tr) {
        auto comm = make_communicator(tr, all, "ucx");
        try {
          auto rows = run_rank(*comm, a);
          if (tr.rank() == 0)
            print_rows(rows, a, a.ranks,
                       "ucx (" + tr.transports() + (a.pin ? "), ranks pinned" : "), unpinned"));
        } catch (const std::exception& e) {
          std::fprintf(stderr, "troupe bench collective: rank %d: %s\n", tr.rank(), e.what());
          return 1;
        }
        comm->barrier().wait();
        return 0;
      },
      lo);
}

}  // namespace

command_fn add_bench_collective_command(CLI::App& bench) {
  auto a = std::make_shared<coll_args>();
  CLI::App* c = bench.add_subcommand(
      "collective", "Time the host collectives between local ranks (nccl-tests algbw/busbw)");
  c->add_option("-n,--ranks", a->ranks, "Ranks (processes, or threads with --backend local)")
      ->capture_default_str();
  c->add_option("--ops", a->ops, "Ops to time")->delimiter(',')->capture_default_str();
  c->add_option("--min", a->min_size, "Smallest size in bytes (K, M, G suffixes)")
      ->capture_default_str();
  c->add_option("--max", a->max_size, "Largest size in bytes")->capture_default_str();
  c->add_option("--step", a->step, "Size multiplier between rows")->capture_default_str();
  c->add_option("--warmup", a->warmup, "Untimed iterations per size")->capture_default_str();
  c->add_option("--reps", a->reps, "Timed repetitions per size (the fastest is reported)")
      ->capture_default_str();
  c->add_option("--seconds", a->seconds_per_size, "Target timed seconds per op and size")
      ->capture_default_str();
  c->add_option("--dtype", a->dtype_name, "f32, f64, bf16 or f16")->capture_default_str();
  c->add_option("--backend", a->backend, "ucx (processes) or local (threads)")
      ->capture_default_str();
  c->add_flag("--csv", a->csv, "Print op,bytes,time_us,algbw_GBs,busbw_GBs");
  c->add_flag("!--no-pin", a->pin, "Do not pin ranks to CPUs");
  c->add_flag("--progress-thread", a->progress_thread,
              "Give each rank's UCX worker its background progress thread");
  c->add_flag("!--no-single-copy", a->single_copy,
              "Large messages by shared-memory fragments, not cma (without UCX_TLS set)");
  c->add_option("--ring-min", a->ring_min, "Override: allreduce ring from this many bytes");
  c->add_option("--chain-min", a->chain_min, "Override: broadcast chain from this many bytes");
  c->add_option("--chunk", a->chunk, "Override: pipeline chunk bytes");
  c->add_flag("!--no-direct", a->direct,
              "Every op without the direct path (process_vm_readv/writev between local ranks)");
  c->add_flag("--touch", a->touch,
              "Rewrite the allreduce buffer before every op, as a training step rewrites its "
              "gradients (the time includes the rewrite)");
  c->add_option("--direct-min", a->direct_min, "Override: direct allreduce from this many bytes");
  c->add_option("--piece", a->piece,
                "Override: direct allreduce and reduce_scatter read piece bytes");
  c->add_option("--copy-piece", a->copy_piece,
                "Override: direct all_gather / all_to_all(v) bytes per process_vm_readv");
  c->add_option("--pull-direct-min", a->pull_min,
                "Override: direct reduce_scatter, all_gather and all_to_all from this many bytes");
  c->add_flag("!--no-shm", a->shm,
              "all_gather and all_to_all(v) without the shared-memory staging between local ranks");
  c->add_option("--shm-min", a->shm_min,
                "Override: staged all_gather / all_to_all(v) from this many bytes");
  c->add_option("--shm-slot", a->shm_slot, "Override: bytes per shared-memory slot");
  c->add_option("--shm-slots", a->shm_slots, "Override: shared-memory slots per channel");
  c->add_option("--window", a->window, "Override: receives posted ahead in pipelined loops");
  return [c, a]() -> int {
    if (!c->parsed()) return -1;
    return run_bench(*a);
  };
}

}  // namespace troupe::apps
