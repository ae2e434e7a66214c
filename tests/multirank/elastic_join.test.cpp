// Joiners of elastic runs (docs/adr/0005, section 11): a process started later with
// `troupe launch --join --coordinator HOST:PORT --token T -- troupe train ...` takes a lost rank's
// place in the membership and becomes a spare of the running job. Two uses, each proven against
// the fault-free run:
//   - replace: a dp2 x pp2 run with no spare loses a rank and waits (elastic.join_wait) for a
//     joiner, which takes the lost position with its state from a data-parallel replica; the plan
//     does not change, every reduction keeps its order: the losses, weights and AdamW moments are
//     the fault-free run's byte for byte (elastic_runs.hpp's same_bits);
//   - grow back: a dp2 x pp2 run with elastic.min_ranks 2 loses a rank and shrinks to dp1 x pp2;
//     a joiner arrives (the drill elastic.await_join holds step 5 until it has, so the test
//     waits on that event, not on time) and at that step boundary the run grows back to dp2 x pp2
//     (the survivor the shrink left idle and the joiner take the second replica, their state from
//     the first): the steps under dp1 sum their gradients in another order, so the run is judged
//     by rounding as the shrink tests judge theirs (elastic_rounding.hpp).
// Joiners without the job's token, or with a wrong one, are refused, named, and the job goes on
// untouched (the replace run ends byte for byte equal after one was refused).
#include <catch2/catch.hpp>

#include <cstdio>
#include <regex>
#include <string>
#include <vector>

#include "tests/multirank/elastic_rounding.hpp"
#include "tests/multirank/elastic_runs.hpp"
#include "tests/multirank/process.hpp"
#include "tests/multirank/train_runs.hpp"

using namespace troupe;
using namespace troupe::tests;

namespace {

int coordinator_port_of(const child_process& p) {
  std::smatch m;
  static const std::regex re("coordinator on [^ ]+:([0-9]+)");
  for (const auto& l : p.lines_with("coordinator on "))
    if (std::regex_search(l, m, re)) return std::stoi(m[1]);
  return -1;
}

// The launch line of `argv` with the job token `token`, and a grace period that outlasts the
// wait for the joiner (the launcher stops the ranks that long after an untolerated failure, until
// a joiner takes the failed rank's place).
std::vector<std::string> with_token(std::vector<std::string> argv, const std::string& token) {
  argv.insert(argv.begin() + 2, {"--token", token, "--grace", "240"});
  return argv;
}

// A joiner of the job whose launch line is `job_argv` (its coordinator on `port`): the same
// troupe train command, started with troupe launch --join and the token `token` ("": none).
std::vector<std::string> joiner_argv(const std::vector<std::string>& job_argv, int port,
                                     const std::string& token) {
  std::vector<std::string> argv = {troupe_bin, "launch", "--join", "--coordinator",
                                   "127.0.0.1:" + std::to_string(port)};
  if (!token.empty()) argv.insert(argv.end(), {"--token", token});
  argv.push_back("--");
  bool after = false;
  for (const auto& a : job_argv) {
    if (after) argv.push_back(a);
    after = after || a == "--";
  }
  return argv;
}

}  // namespace

TEST_CASE(
    "A joiner takes the place of a rank lost with no spare left and the run ends byte for byte "
    "equal to the fault-free run; joiners without the token are refused",
    "[multirank][faults]") {
  scratch_dir dir("elastic-join");
  const std::vector<std::string> plan = {"--dp", "2", "--pp", "2", "--microbatches", "2"};
  run(elastic_argv(4, 0, dir.path, "clean", plan), 0);
  auto p = plan;
  p.insert(p.end(), {"--chaos-kill", "3:3:forward", "--join-wait", "240"});
  const auto argv = with_token(elastic_argv(4, 0, dir.path, "joined", p), "join-test-token");
  child_process job(argv);
  REQUIRE(job.wait_for_count("for a joiner (troupe launch --join) to take its place", 1, 240s));
  const int port = coordinator_port_of(job);
  REQUIRE(port > 0);
  {
    // No token: the launcher refuses before it starts anything.
    child_process none(joiner_argv(argv, port, ""));
    auto st = none.wait(60s);
    INFO(none.output());
    REQUIRE(st);
    CHECK(child_process::code(*st) != 0);
    const auto line = first_line_with(none.output(), "troupe launch: joining coordinator");
    CHECK(!line.empty());
    std::printf("faults: a joiner without the job's token -> refused: %s\n", line.c_str());
  }
  {
    // A wrong token: the coordinator refuses it, naming it, and the job goes on.
    child_process wrong(joiner_argv(argv, port, "not-the-token"));
    auto st = wrong.wait(60s);
    INFO(wrong.output());
    REQUIRE(st);
    CHECK(child_process::code(*st) != 0);
    CHECK(!wrong.lines_with("refused to join: wrong job token").empty());
    REQUIRE(job.wait_for_count("refused a joiner (host ", 1, 60s));
    const auto line = first_line_with(job.output(), "refused a joiner (host ");
    CHECK(line.find(": wrong job token") != std::string::npos);
    std::printf("faults: a joiner with a wrong token -> refused: %s\n", line.c_str());
  }
  child_process joiner(joiner_argv(argv, port, "join-test-token"));
  auto sj = joiner.wait(300s);
  auto sl = job.wait(300s);
  const std::string out = job.output();
  INFO(out << "\njoiner:\n" << joiner.output());
  REQUIRE(sj);
  REQUIRE(sl);
  CHECK(child_process::code(*sj) == 0);
  CHECK(child_process::code(*sl) == 0);  // rank 3's process was killed; a joiner took its place
  CHECK(out.find("a joiner took rank 3's place in the job after step 2") != std::string::npos);
  CHECK(out.find("rank 3 took its place at generation 1") != std::string::npos);
  // The reason of the loss, read before the joiner cleared it from the membership (the
  // coordinator hears of the loss from the dropped connection or from the launcher, first wins).
  CHECK(std::regex_search(out, std::regex("before its commit: (connection lost|its process)")));
  CHECK(out.find("its state from rank 1 (a data-parallel replica") != std::string::npos);
  CHECK(out.find("a new process (a joiner) took its place; the job goes on") !=
        std::string::npos);  // the launcher's line
  CHECK(out.find("shrank") == std::string::npos);
  same_bits(dir.path, "joined", "clean");
  std::printf(
      "faults: SIGKILL of rank 3 (dp 1 pp 1) before its forward pass of step 3, no "
      "spare, --join-wait -> survived: %s\n",
      first_line_with(out, "elastic: rank 3 (dp 1 pp 1 tp 0) lost in step 3").c_str());
}

TEST_CASE(
    "A dp2 x pp2 run shrinks to dp1 x pp2 after a loss, grows back when a joiner arrives and "
    "ends equal to the fault-free run by rounding",
    "[multirank][faults]") {
  scratch_dir dir("elastic-grow");
  const std::vector<std::string> plan = {"--dp", "2", "--pp", "2", "--microbatches", "2"};
  const int steps = 8;
  const auto exact = exact_run(dir.path, steps);
  run(elastic_argv(4, 0, dir.path, "clean", plan, steps), 0);
  auto p = plan;
  p.insert(p.end(), {"--chaos-kill", "3:3:forward", "--await-join", "5"});
  const auto argv = with_token(shrink_argv(4, 2, dir.path, "grown", p, steps), "grow-test-token");
  child_process job(argv);
  REQUIRE(job.wait_for_count("for a joiner before step 5 (elastic.await_join)", 1, 240s));
  const int port = coordinator_port_of(job);
  REQUIRE(port > 0);
  child_process joiner(joiner_argv(argv, port, "grow-test-token"));
  auto sj = joiner.wait(300s);
  auto sl = job.wait(300s);
  const std::string out = job.output();
  INFO(out << "\njoiner:\n" << joiner.output());
  REQUIRE(sj);
  REQUIRE(sl);
  CHECK(child_process::code(*sj) == 0);
  CHECK(child_process::code(*sl) == 0);
  CHECK(out.find("no spare left: shrank dp2 x pp2 -> dp1 x pp2, micro-batches per replica "
                 "(gradient accumulation) 2 -> 4") != std::string::npos);
  CHECK(out.find("a joiner took rank 3's place in the job after step 4") != std::string::npos);
  // The survivor the shrink left idle (rank 2, stage 0) and the joiner (rank 3, stage 1) hold the
  // second replica again, their state from the first.
  CHECK(out.find("grew dp1 x pp2 -> dp2 x pp2 after step 4, micro-batches per replica (gradient "
                 "accumulation) 4 -> 2, the global batch of 8 samples kept") != std::string::npos);
  CHECK(out.find("rank 2 took dp 1 pp 0 tp 0 (its state from rank 0), rank 3 took dp 1 pp 1 tp 0 "
                 "(its state from rank 1)") != std::string::npos);
  CHECK(out.find("completed on dp2 x pp2") != std::string::npos);
  same_by_rounding(dir.path, "grown", "clean", exact);
  std::printf(
      "faults: SIGKILL of rank 3 (dp 1 pp 1) before its forward pass of step 3, no "
      "spare, --min-ranks 2, a joiner before step 5 -> survived: %s\n",
      first_line_with(out, "elastic: grew ").c_str());
}

TEST_CASE("An elastic policy actor waits for a joiner, else has the run shrink",
          "[multirank][faults]") {
  // apps/examples/elastic_policy.cpp: the "wait-for-joiner" actor on rank 0 hears each
  // membership event (actors/elastic_policy.hpp) and decides; the drill kills rank 3 before its
  // forward pass of step 3 in a dp2 x pp2 run with no spare.
  scratch_dir dir("elastic-policy");
  auto job_argv = [&](const std::string& name, const std::string& wait) {
    return std::vector<std::string>{troupe_bin,
                                    "launch",
                                    "-n",
                                    "4",
                                    "--min-ranks",
                                    "2",
                                    "--token",
                                    "policy-token",
                                    "--grace",
                                    "240",
                                    "--job",
                                    "policy-" + name + "-" + std::to_string(::getpid()),
                                    "--",
                                    TROUPE_EXAMPLE_ELASTIC_POLICY_BIN,
                                    "--steps",
                                    "6",
                                    "--wait",
                                    wait,
                                    "--chaos-kill",
                                    "3:3:forward",
                                    "--checkpoint-dir",
                                    dir.path + "/" + name};
  };
  SECTION("no joiner comes: the policy has the run shrink") {
    const auto out = run(job_argv("shrink", "0.2"), 0);
    CHECK(out.find("policy: rank 3 lost after step 2 under dp2 x pp2, no spare: waiting up to "
                   "0.2 s for a joiner") != std::string::npos);
    CHECK(out.find("policy: no joiner came in 0.2 s: shrink dp2 x pp2 onto the survivors") !=
          std::string::npos);
    CHECK(out.find("no spare left: shrank dp2 x pp2 -> dp1 x pp2") != std::string::npos);
    CHECK(out.find("policy: recovered: dp1 x pp2 on ranks 0, 1") != std::string::npos);
    CHECK(out.find("1 recoveries, 0 joiners, 0 growths") != std::string::npos);
    std::printf("faults: SIGKILL of rank 3, a policy waiting 0.2 s for a joiner -> survived: %s\n",
                first_line_with(out, "policy: no joiner came").c_str());
  }
  SECTION("a joiner comes within the wait: it takes the lost place") {
    const auto argv = job_argv("joined", "240");
    child_process job(argv);
    REQUIRE(job.wait_for_count("the policy wait-for-joiner waits up to 240 s", 1, 240s));
    child_process joiner(joiner_argv(argv, coordinator_port_of(job), "policy-token"));
    auto sj = joiner.wait(300s);
    auto sl = job.wait(300s);
    const std::string out = job.output();
    INFO(out << "\njoiner:\n" << joiner.output());
    REQUIRE(sj);
    REQUIRE(sl);
    CHECK(child_process::code(*sj) == 0);
    CHECK(child_process::code(*sl) == 0);
    CHECK(out.find("rank 3 took its place at generation 1") != std::string::npos);
    CHECK(out.find("shrank") == std::string::npos);
    CHECK(out.find("1 recoveries, 1 joiners, 0 growths") != std::string::npos);
    std::printf(
        "faults: SIGKILL of rank 3, a policy waiting for a joiner, one came -> "
        "survived: %s\n",
        first_line_with(out, "elastic: rank 3 (dp 1 pp 1 tp 0) lost in step 3").c_str());
  }
}
