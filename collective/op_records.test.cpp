// Ranks that issue different ops where one of them takes the staged path (shared-memory rings,
// which send no message) fail at once, with no deadline, naming the ranks and what each issued:
// every collective is recorded in the segments (direct_shm.cpp), whatever path it takes, so a
// rank waiting in a staged op reads that its peer runs another op, and a rank waiting on messages
// or in a pull op reads that its staged peer runs another op or failed.
//
// Processes over UCX (run_local_ranks): a child prints what went wrong and returns non-zero; the
// parent checks the exit codes. Every communicator has no deadline (set_timeout(0), as
// `parallel.collective_timeout = 0`): without the records these ops wait for ever, and the
// parent's watchdog reports a hang.
#include <catch2/catch.hpp>

#include <cstdio>
#include <string>
#include <vector>

#include "collective/p2p_communicator.hpp"
#include "collective/ucx/local_ranks.hpp"
#include "memory/error.hpp"

using namespace troupe;
using namespace troupe::collective;

namespace {

rank_group group_of(int n, std::uint32_t id) {
  rank_group g;
  g.id = id;
  for (int r = 0; r < n; ++r) g.ranks.push_back(r);
  return g;
}

// One mismatch: the ops each rank issues (after the probe), and what each rank's error must say.
struct mismatch {
  const char* name;
  int n;
  // Issues rank r's ops on c, in order, waiting on each (in[] and out[] are large enough).
  void (*issue)(communicator& c, int r, float* in, float* out);
  std::vector<std::vector<std::string>> want;  // by rank: every text its error must hold
};

constexpr std::size_t staged = std::size_t{1} << 16;  // 256 KiB of f32: staged (shm_min 64 KiB)
constexpr std::size_t small = 1024;                   // 4 KiB: the message path
constexpr std::size_t large = std::size_t{1} << 17;   // 512 KiB: direct allreduce, pull ops

std::vector<mismatch> mismatches() {
  return {
      {"staged all_gather against a message-path all_gather (counts on both sides of shm_min)",
       2,
       [](communicator& c, int r, float* in, float* out) {
         c.all_gather(in, out, r == 0 ? staged : small, dtype::f32).wait();
       },
       {{"rank 1 issued all_gather of f32 x 1024 as collective #3 of this communicator, but rank "
         "0 issued all_gather of f32 x 65536"},
        {"rank 0 issued all_gather of f32 x 65536 as collective #3 of this communicator, but rank "
         "1 issued all_gather of f32 x 1024"}}},
      {"staged all_gather against a pull reduce_scatter",
       2,
       [](communicator& c, int r, float* in, float* out) {
         if (r == 0)
           c.all_gather(in, out, large, dtype::f32).wait();
         else
           c.reduce_scatter(in, out, large, dtype::f32).wait();
       },
       {{"rank 1 issued reduce_scatter (sum) of f32 x 131072 as collective #3",
         "but rank 0 "
         "issued all_gather "
         "of f32 x 131072"},
        {"rank 0 issued all_gather of f32 x 131072 as collective #3",
         "but rank 1 issued reduce_scatter (sum) of f32 x 131072"}}},
      {"staged all_to_allv against a direct allreduce",
       2,
       [](communicator& c, int r, float* in, float* out) {
         if (r == 0) {
           const std::vector<std::size_t> counts(2, staged);
           c.all_to_allv(in, counts, out, counts, dtype::f32).wait();
         } else {
           c.allreduce(in, large, dtype::f32).wait();
         }
       },
       {{"rank 1 issued allreduce (sum) of f32 x 131072 as collective #3",
         "but rank 0 issued all_to_allv of f32"},
        {"rank 0 issued all_to_allv of f32 as collective #3",
         "but rank 1 issued allreduce (sum) of f32 x 131072"}}},
      {"staged all_to_all against a barrier",
       2,
       [](communicator& c, int r, float* in, float* out) {
         if (r == 0)
           c.all_to_all(in, out, staged, dtype::f32).wait();
         else
           c.barrier().wait();
       },
       {{"rank 1 issued barrier as collective #3", "but rank 0 issued all_to_all of f32 x 65536"},
        {"rank 0 issued all_to_all of f32 x 65536 as collective #3", "but rank 1 issued barrier"}}},
      // The root of a small broadcast may finish it without its peer and go on to the barrier:
      // rank 0 then reads that rank 1 went past its staged op, fails, and rank 1's barrier reads
      // rank 0's failure word; or rank 0 reads the broadcast while rank 1 still runs it.
      {"staged all_gather against a broadcast whose root finishes alone",
       2,
       [](communicator& c, int r, float* in, float* out) {
         if (r == 0) {
           c.all_gather(in, out, staged, dtype::f32).wait();
         } else {
           options o;
           o.root = 1;
           c.broadcast(in, small, dtype::f32, o).wait();
           c.barrier().wait();
         }
       },
       {{"rank 1 "}, {"rank 0 "}}},
      {"two ranks in a staged all_gather, the third on the message path",
       3,
       [](communicator& c, int r, float* in, float* out) {
         c.all_gather(in, out, r == 2 ? small : staged, dtype::f32).wait();
       },
       {{"rank 2 issued all_gather of f32 x 1024 as collective #3",
         "but rank 0 issued all_gather "
         "of f32 x 65536"},
        {"rank 2 issued all_gather of f32 x 1024 as collective #3"},
        {"issued all_gather of f32 x 65536 as collective #3",
         "but rank 2 issued all_gather of f32 x 1024"}}},
  };
}

}  // namespace

TEST_CASE("ranks whose ops take different paths fail at once naming both with no deadline",
          "[collective][multirank][faults]") {
  const auto all = mismatches();
  const auto i = static_cast<std::size_t>(GENERATE(0, 1, 2, 3, 4, 5));
  const mismatch& m = all[i];
  INFO(m.name);
  local_ranks_options opt;
  opt.timeout = std::chrono::seconds(60);  // the watchdog: a hang fails the test
  const int rc = run_local_ranks(
      m.n,
      [&](ucx_transport& t) {
        auto c = make_communicator(t, group_of(m.n, 21), "ucx");
        c->set_timeout(std::chrono::milliseconds(0));  // no deadline
        const int r = t.rank();
        std::vector<float> in(large * m.n, 1.0f), out(large * m.n, 0.0f);
        // Collective #1, the probe (staged from here on), and #2.
        c->all_gather(in.data(), out.data(), staged, dtype::f32).wait();
        c->barrier().wait();
        std::string err;
        try {
          m.issue(*c, r, in.data(), out.data());
        } catch (const troupe::error& e) {
          err = e.what();
        }
        bool ok = !err.empty();
        for (const std::string& w : m.want[r]) ok = ok && err.find(w) != std::string::npos;
        if (!ok) {
          std::fprintf(stderr, "rank %d (%s): expected an error holding '%s', got '%s'\n", r,
                       m.name, m.want[r].front().c_str(), err.c_str());
          return 1;
        }
        if (r == 0) std::printf("faults: %s, no deadline -> refused: %s\n", m.name, err.c_str());
        return 0;
      },
      opt);
  CHECK(rc == 0);
}
