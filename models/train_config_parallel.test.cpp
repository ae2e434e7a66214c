// The [parallel] table of a job file: values land in the plan, mistakes name the file and key.
#include <catch2/catch.hpp>

#include <unistd.h>
#include <cstdio>
#include <fstream>
#include <string>

#include "models/train_config.hpp"

using namespace troupe::models;
namespace sched = troupe::scheduler;

namespace {
std::string write_job(const std::string& text) {
  static int n = 0;
  std::string path =
      "/tmp/troupe_pjob_" + std::to_string(::getpid()) + "_" + std::to_string(n++) + ".toml";
  std::ofstream(path) << text;
  return path;
}
}  // namespace

TEST_CASE("a parallel table sets every field of the plan") {
  auto path = write_job(R"(
[train]
batch = 8
grad_accum = 4
seq = 64
[parallel]
dp = 2
tp = 2
pp = 4
sp = true
zero = 1
microbatches = 8
schedule = "interleaved"
virtual_stages = 2
recompute = "selective"
order = ["pp", "dp", "tp"]
dp_overlap = false
dp_bucket_bytes = "256K"
pipe_p2p = "batched"
pipe_trace = "/tmp/trace"
)");
  auto c = load_train_config(path);
  std::remove(path.c_str());
  REQUIRE(c.has_value());
  sched::parallel_plan want;
  want.dp = 2, want.tp = 2, want.pp = 4, want.sp = true, want.zero = 1, want.microbatches = 8;
  want.schedule = sched::schedule_kind::interleaved;
  want.virtual_stages = 2;
  want.recompute = sched::recompute_policy::selective;
  want.order = {"pp", "dp", "tp"};
  want.dp_overlap = false;
  want.dp_bucket_bytes = 256 << 10;
  want.pipe_p2p = sched::p2p_mode::batched;
  CHECK(c->plan == want);
  CHECK(c->batch == 8);
  CHECK(c->pipe_trace == "/tmp/trace");
  // Sent to the ranks of a launched run as TOML: every setting arrives.
  auto sent = parse_train_config(to_toml(*c), "the driver's job");
  REQUIRE(sent.has_value());
  CHECK(*sent == *c);
}

// The settings that were environment variables (TROUPE_DP_OVERLAP, TROUPE_DP_BUCKET_BYTES,
// TROUPE_PIPE_P2P, TROUPE_PIPE_TRACE) keep their defaults: overlap on, 25 MiB buckets, async
// transfers, no trace.
TEST_CASE("The data-parallel and pipeline transfer settings default to what the engine did") {
  auto c = parse_train_config("[train]\nsteps = 3\n", "job.toml");
  REQUIRE(c.has_value());
  CHECK(c->plan.dp_overlap);
  CHECK(c->plan.dp_bucket_bytes == 25 << 20);
  CHECK(c->plan.pipe_p2p == sched::p2p_mode::async);
  CHECK(c->pipe_trace.empty());
  auto bytes = parse_train_config("[parallel]\ndp_bucket_bytes = 65536\n", "job.toml");
  REQUIRE(bytes.has_value());
  CHECK(bytes->plan.dp_bucket_bytes == 65536);
  // describe() names them only where they differ from the defaults.
  CHECK(sched::describe(c->plan) ==
        "dp1 x pp1 x tp1, zero 0, 1f1b x 1 microbatches, recompute none");
  sched::parallel_plan p;
  p.dp = 2;
  p.dp_overlap = false;
  p.dp_bucket_bytes = 4096;
  p.pipe_p2p = sched::p2p_mode::batched;
  CHECK(sched::describe(p) ==
        "dp2 x pp1 x tp1, zero 0, 1f1b x 1 microbatches, recompute none, dp buckets 4096 bytes, "
        "dp overlap off, pipe p2p batched");
}

TEST_CASE("a job file without a parallel table runs the single-process plan") {
  auto path = write_job("[train]\nsteps = 3\n");
  auto c = load_train_config(path);
  std::remove(path.c_str());
  REQUIRE(c.has_value());
  CHECK(c->plan == sched::parallel_plan{});
  CHECK(c->plan.world_size() == 1);
  CHECK(c->plan.schedule == sched::schedule_kind::one_f_one_b);
}

TEST_CASE("parallel table mistakes are errors naming the file and the key") {
  struct bad_case {
    const char* text;
    const char* says;
  };
  for (auto [text, says] : {
           bad_case{"[parallel]\ndq = 2\n", "unknown key 'parallel.dq'"},
           bad_case{"[parallel]\ntp = \"two\"\n", "parallel.tp must be an integer"},
           bad_case{"[parallel]\ntp = 1.5\n", "parallel.tp must be an integer"},
           bad_case{"[parallel]\nsp = 1\n", "parallel.sp must be true or false"},
           bad_case{
               "[parallel]\nschedule = \"zb\"\n",
               "parallel.schedule must be \"gpipe\", \"1f1b\", \"eager-1f1b\", \"zero-bubble\" or "
               "\"interleaved\""},
           bad_case{"[parallel]\nrecompute = true\n",
                    "parallel.recompute must be \"none\", \"selective\" or \"full\""},
           bad_case{"[parallel]\norder = \"dp,pp,tp\"\n", "parallel.order must be an array"},
           bad_case{"[parallel]\norder = [\"dp\", 2, \"tp\"]\n",
                    "parallel.order must hold strings"},
           bad_case{"[parallel]\norder = [\"dp\", \"tp\"]\n", "parallel.order = [\"dp\", \"tp\"]"},
           bad_case{"[parallel]\nzero = 4\n", "parallel.zero = 4 must be 0, 1, 2 or 3"},
           bad_case{"[parallel]\ndp_overlap = 0\n", "parallel.dp_overlap must be true or false"},
           bad_case{"[parallel]\ndp_bucket_bytes = \"lots\"\n",
                    "parallel.dp_bucket_bytes must be a size"},
           bad_case{"[parallel]\ndp_bucket_bytes = -1\n",
                    "parallel.dp_bucket_bytes must be a size"},
           bad_case{"[parallel]\ndp_bucket_bytes = 0\n",
                    "parallel.dp_bucket_bytes = 0 must be at least 4 (one f32 gradient)"},
           bad_case{"[parallel]\npipe_p2p = \"sync\"\n",
                    "parallel.pipe_p2p must be \"async\" or \"batched\""},
           bad_case{"[parallel]\npipe_p2p = \"blocking\"\n",
                    "parallel.pipe_p2p = \"blocking\" is the simulator's only"},
           bad_case{"[parallel]\npipe_trace = 1\n", "parallel.pipe_trace must be a string"},
           bad_case{"[parallel]\npp = 0\n", "parallel.pp = 0 must be >= 1"},
           bad_case{"[parallel]\nsp = true\n", "parallel.sp = true needs parallel.tp > 1"},
           bad_case{"[parallel]\nvirtual_stages = 2\n", "parallel.virtual_stages = 2 needs"},
           bad_case{"[parallel]\npp = 4\nmicrobatches = 6\nschedule = \"interleaved\"\n"
                    "virtual_stages = 2\n",
                    "parallel.microbatches = 6 must be a multiple of parallel.pp = 4"},
           // The global batch is train.batch x train.grad_accum = 8 x 1.
           bad_case{"[parallel]\ndp = 3\n", "parallel.dp = 3 does not divide the global batch = 8"},
           bad_case{
               "[train]\nbatch = 6\n[parallel]\nmicrobatches = 4\n",
               "parallel.microbatches = 4 does not divide the batch per data-parallel rank = 6"},
           bad_case{"[train]\nseq = 63\n[parallel]\ntp = 2\nsp = true\n",
                    "parallel.tp = 2 does not divide seq = 63"},
       }) {
    auto path = write_job(text);
    auto c = load_train_config(path);
    std::remove(path.c_str());
    INFO(text);
    REQUIRE(!c.has_value());
    CHECK_THAT(c.error_message(), Catch::Contains(says) && Catch::Contains(path));
  }
}

TEST_CASE("every problem of the parallel table is reported at once") {
  auto path = write_job("[parallel]\nzero = 7\npp = 0\nsp = true\n");
  auto c = load_train_config(path);
  std::remove(path.c_str());
  REQUIRE(!c.has_value());
  CHECK(c.error_message() == path +
                                 ": parallel.pp = 0 must be >= 1; parallel.sp = true needs "
                                 "parallel.tp > 1 (it splits activations over the tp group); "
                                 "parallel.zero = 7 must be 0, 1, 2 or 3");
}

TEST_CASE("parallel.ep sets the expert parallel degree and reaches the ranks of a launched run") {
  auto path = write_job("[train]\nbatch = 8\n[parallel]\ndp = 4\nep = 2\n");
  auto c = load_train_config(path);
  std::remove(path.c_str());
  REQUIRE(c.has_value());
  CHECK(c->plan.ep == 2);
  CHECK(c->plan.world_size() == 4);  // carved out of dp
  auto sent = parse_train_config(to_toml(*c), "the driver's job");
  REQUIRE(sent.has_value());
  CHECK(sent->plan.ep == 2);
  // An ep that does not divide dp is refused naming the key.
  path = write_job("[parallel]\ndp = 4\nep = 3\n");
  c = load_train_config(path);
  std::remove(path.c_str());
  REQUIRE(!c.has_value());
  CHECK_THAT(c.error_message(), Catch::Contains("parallel.ep = 3 does not divide parallel.dp = 4"));
}

TEST_CASE("a job file's context-parallel degree and mode reach the plan and the ranks") {
  auto path = write_job("[train]\nseq = 64\n[parallel]\ndp = 2\ncp = 2\ncp_mode = \"ulysses\"\n");
  auto c = load_train_config(path);
  std::remove(path.c_str());
  REQUIRE(c.has_value());
  CHECK(c->plan.cp == 2);
  CHECK(c->plan.cp_mode == sched::cp_mode_kind::ulysses);
  CHECK(c->plan.world_size() == 4);
  auto sent = parse_train_config(to_toml(*c), "the driver's job");
  REQUIRE(sent.has_value());
  CHECK(*sent == *c);
  auto ring_path = write_job("[train]\nseq = 64\n[parallel]\ncp = 2\ncp_mode = \"ring\"\n");
  auto ring = load_train_config(ring_path);
  std::remove(ring_path.c_str());
  REQUIRE(ring.has_value());
  CHECK(ring->plan.cp_mode == sched::cp_mode_kind::ring);
  struct bad_case {
    const char* text;
    const char* says;
  };
  for (auto [text, says] : {
           bad_case{"[parallel]\ncp_mode = \"zigzag\"\n",
                    "parallel.cp_mode must be \"ulysses\" or \"ring\""},
           bad_case{"[parallel]\ncp = 0\n", "parallel.cp = 0 must be >= 1"},
           bad_case{"[train]\nseq = 63\n[parallel]\ncp = 2\n",
                    "parallel.cp = 2 does not divide seq = 63"},
           bad_case{"[train]\nseq = 66\n[parallel]\ncp = 2\ncp_mode = \"ring\"\n",
                    "2 x cp = 4 does not divide seq = 66"},
       }) {
    auto p = write_job(text);
    auto bad = load_train_config(p);
    std::remove(p.c_str());
    INFO(text);
    REQUIRE(!bad.has_value());
    CHECK_THAT(bad.error_message(), Catch::Contains(says) && Catch::Contains(p));
  }
}
