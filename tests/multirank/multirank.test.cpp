// The actor runtime across real processes: `troupe launch` with real CAF remoting and real UCX on
// loopback (and across two network namespaces), fault injection with SIGKILL and SIGSTOP.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <regex>
#include <string>
#include <thread>
#include <vector>

#include "tests/multirank/process.hpp"

namespace {

using troupe::tests::child_process;
using troupe::tests::run_command;
using namespace std::chrono_literals;

const std::string troupe_bin = TROUPE_BIN;
const std::string worker_bin = TROUPE_WORKER_BIN;
const std::string example_bin = TROUPE_EXAMPLE_ROLES_BIN;

std::string job_name(const std::string& what) {
  return "multirank-" + what + "-" + std::to_string(::getpid());
}

// The pid a worker announced in its "ready rank R pid P" line.
int ready_pid(const child_process& p, int rank) {
  const std::string key = "ready rank " + std::to_string(rank) + " pid ";
  for (const auto& l : p.lines_with(key)) {
    const auto at = l.find(key);
    return std::atoi(l.c_str() + at + key.size());
  }
  return -1;
}

// The port of the coordinator from the launcher's first line.
int coordinator_port(const child_process& p) {
  std::smatch m;
  for (const auto& l : p.lines_with("coordinator on ")) {
    static const std::regex re("coordinator on [^ ]+:([0-9]+)");
    if (std::regex_search(l, m, re)) return std::stoi(m[1]);
  }
  return -1;
}

// For a job that did not end in time: the stacks of every thread of the launcher and of each rank
// that joined and still runs (gdb -batch; a line saying so where gdb is missing), so that a rare
// hang in CI shows where it is.
std::string stacks_of_job(const child_process& launcher) {
  std::vector<int> pids = {static_cast<int>(launcher.pid())};
  for (const auto& l : launcher.lines_with(") joined (")) {
    const auto at = l.find("pid ");
    if (at != std::string::npos) pids.push_back(std::atoi(l.c_str() + at + 4));
  }
  std::string out;
  for (int pid : pids) {
    if (pid <= 0 || ::kill(pid, 0) != 0) continue;
    auto [rc, text] = run_command(
        {"/usr/bin/env", "gdb", "-batch", "-ex", "thread apply all bt", "-p", std::to_string(pid)},
        30s);
    out += "\n=== threads of pid " + std::to_string(pid) + " (gdb exit " + std::to_string(rc) +
           ")\n" + text;
  }
  return out;
}

double seconds_between(child_process::clock::time_point a, child_process::clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// SIGKILL or SIGSTOP one rank of four; every survivor must see it for one of `reasons` (whichever
// detection comes first). The reason is what tells the detections apart, not how long they took:
// the waits' bounds only guard against a hang, and the seconds go into the message.
void loss_test(int sig, double heartbeat_s, const std::vector<std::string>& reasons) {
  const int victim = 2;
  child_process launcher({troupe_bin, "launch", "-n", "4", "--heartbeat-timeout",
                          std::to_string(heartbeat_s), "--grace", "20", "--job",
                          job_name(sig == SIGKILL ? "kill" : "stop"), "--", worker_bin, "loss",
                          "--victim", std::to_string(victim)});
  REQUIRE(launcher.wait_for_count("ready rank", 4, 60s));
  const int pid = ready_pid(launcher, victim);
  REQUIRE(pid > 0);
  const auto t0 = child_process::clock::now();
  REQUIRE(::kill(pid, sig) == 0);
  const bool all = launcher.wait_for_count("pending receive failed", 3, 30s);
  // Every survivor reports the rest, then meets the others in a barrier.
  const bool done = launcher.wait_for_count("survivors barrier passed", 3, 30s);
  if (sig == SIGSTOP) ::kill(pid, SIGKILL);  // let the launcher finish
  INFO(launcher.output());
  REQUIRE(all);
  CHECK(done);
  for (int r : {0, 1, 3}) {
    const std::string who = "rank " + std::to_string(r) + ":";
    auto t = launcher.time_of("pending receive failed: " + who);
    REQUIRE(t);
    INFO("rank " << r << " noticed after " << seconds_between(t0, *t) << " s");
    auto lines = launcher.lines_with("pending receive failed: " + who);
    REQUIRE(!lines.empty());
    CHECK(lines.front().find("rank 2 lost") != std::string::npos);
    bool named = false;
    for (const auto& reason : reasons)
      named = named || lines.front().find(reason) != std::string::npos;
    INFO(lines.front());
    CHECK(named);
    auto raw = launcher.lines_with("pending transport receive failed: " + who);
    REQUIRE(!raw.empty());
    CHECK(raw.front().find("rank 2") != std::string::npos);
    CHECK(!launcher.lines_with("next_tensor failed: " + who).empty());
    auto cb = launcher.lines_with("membership callback: " + who);
    REQUIRE(!cb.empty());
    CHECK(cb.front().find("rank 2 lost: ") != std::string::npos);
  }
  auto st = launcher.wait(60s);
  REQUIRE(st);
  CHECK(child_process::code(*st) == 1);  // the launcher names the killed rank
  CHECK(!launcher.lines_with("ranks failed (rank 2)").empty());
  CHECK(launcher.lines_with("UNEXPECTED").empty());
}

}  // namespace

TEST_CASE("Four ranks exchange tensors of 1 KiB to 64 MiB by handle byte for byte", "[multirank]") {
  child_process launcher({troupe_bin, "launch", "-n", "4", "--job", job_name("exchange"), "--",
                          worker_bin, "exchange"});
  auto st = launcher.wait(120s);
  INFO(launcher.output());
  REQUIRE(st);
  CHECK(child_process::code(*st) == 0);
  for (int r = 0; r < 4; ++r)
    CHECK(!launcher
               .lines_with("[rank " + std::to_string(r) + "] exchange ok: rank " +
                           std::to_string(r) + " received 6 tensors")
               .empty());
}

TEST_CASE("A rank with the wrong job token is refused and both sides say so",
          "[multirank][faults]") {
  // A short heartbeat timeout: rank 0 waits longer than that for rank 1 while the world forms.
  child_process launcher({troupe_bin, "launch", "-n", "1", "--world-size", "2", "--token",
                          "the-right-token", "--heartbeat-timeout", "0.5", "--job",
                          job_name("token"), "--", worker_bin, "hold"});
  REQUIRE(launcher.wait_for("coordinator on ", 30s));
  const int port = coordinator_port(launcher);
  REQUIRE(port > 0);
  const std::string endpoint = "127.0.0.1:" + std::to_string(port);
  {
    child_process intruder({worker_bin, "hold"}, {{"TROUPE_COORDINATOR", endpoint},
                                                  {"TROUPE_TOKEN", "a-wrong-token"},
                                                  {"TROUPE_RANK", "1"},
                                                  {"TROUPE_WORLD_SIZE", "2"}});
    auto st = intruder.wait(60s);
    INFO(intruder.output());
    REQUIRE(st);
    CHECK(child_process::code(*st) != 0);
    CHECK(!intruder.lines_with("coordinator " + endpoint + " refused to join: wrong job token")
               .empty());
    REQUIRE(launcher.wait_for("wrong job token", 10s));
    auto refusal = launcher.lines_with("wrong job token");
    CHECK(refusal.front().find("refused rank 1") != std::string::npos);
    CHECK(refusal.front().find("pid " + std::to_string(intruder.pid())) != std::string::npos);
    std::printf("faults: a wrong job token at join -> refused: %s\n", refusal.front().c_str());
  }
  {
    // A rank without any token is refused too, on both sides.
    child_process tokenless(
        {worker_bin, "hold"},
        {{"TROUPE_COORDINATOR", endpoint}, {"TROUPE_TOKEN", ""}, {"TROUPE_RANK", "1"}});
    auto st = tokenless.wait(30s);
    INFO(tokenless.output());
    REQUIRE(st);
    CHECK(child_process::code(*st) != 0);
    CHECK(!tokenless.lines_with("coordinator " + endpoint + " refused to join: no job token")
               .empty());
    REQUIRE(launcher.wait_for("no job token", 10s));
    CHECK(launcher.lines_with("no job token")
              .front()
              .find("pid " + std::to_string(tokenless.pid())) != std::string::npos);
  }
  // The job still forms with the right token, later than one heartbeat timeout. The sleep makes
  // that time pass (a lower bound, which holds under any load); it synchronises nothing.
  std::this_thread::sleep_for(1500ms);
  child_process rank1({worker_bin, "hold"}, {{"TROUPE_COORDINATOR", endpoint},
                                             {"TROUPE_TOKEN", "the-right-token"},
                                             {"TROUPE_RANK", "1"},
                                             {"TROUPE_WORLD_SIZE", "2"}});
  auto st1 = rank1.wait(60s);
  auto st0 = launcher.wait(60s);
  INFO(launcher.output() << rank1.output());
  REQUIRE(st1);
  REQUIRE(st0);
  CHECK(child_process::code(*st1) == 0);
  CHECK(child_process::code(*st0) == 0);
  CHECK(!rank1.lines_with("hold done: rank 1").empty());
}

TEST_CASE("A killed rank is detected by every other rank and its pending receives fail",
          "[multirank]") {
  // The connection drops, or the launcher reports the signal to the coordinator first: either comes
  // before the heartbeat timeout, which would name "no heartbeat".
  loss_test(SIGKILL, 3.0, {"connection lost", "killed by signal 9"});
}

TEST_CASE("A stopped rank is detected by heartbeat although its connection stays open",
          "[multirank]") {
  // Heartbeat timeout 1 s: lost after 1 s of silence, checked every 0.25 s.
  loss_test(SIGSTOP, 1.0, {"no heartbeat"});
}

TEST_CASE("The example actor script runs and troupe ps lists every actor", "[multirank]") {
  const std::string job = job_name("ps");
  // The job holds until the test is done with it (a SIGUSR1 to rank 0); 120 s only bounds a hang.
  child_process launcher(
      {troupe_bin, "launch", "-n", "4", "--job", job, "--", example_bin, "--hold", "120"});
  REQUIRE(launcher.wait_for("holding the job", 60s));
  auto [rc, out] = run_command({troupe_bin, "ps", "--job", job}, 20s);
  int rank0 = -1;
  for (const auto& l : launcher.lines_with("rank 0 (host "))
    if (const auto at = l.find(", pid "); at != std::string::npos && l.find(" joined (") != l.npos)
      rank0 = std::atoi(l.c_str() + at + 6);
  INFO(launcher.output());
  REQUIRE(rank0 > 0);
  REQUIRE(::kill(rank0, SIGUSR1) == 0);
  INFO(out);
  CHECK(rc == 0);
  for (const char* name : {"coordinator", "node@0", "node@1", "node@2", "node@3", "worker@0",
                           "worker@1", "worker@2", "worker@3"})
    CHECK(out.find(name) != std::string::npos);
  CHECK(out.find("4/4 alive") != std::string::npos);
  // A job still running 60 s after the hold: its threads' stacks go into the failure message.
  const std::string stacks = launcher.running_after(60s) ? stacks_of_job(launcher) : "";
  auto st = launcher.wait(1s);
  INFO(launcher.output() << stacks);
  REQUIRE(st);
  CHECK(child_process::code(*st) == 0);
  CHECK(!launcher.lines_with("hold ended by SIGUSR1").empty());
  CHECK(!launcher.lines_with("weighted sum 40").empty());
  CHECK(!launcher.lines_with("(match)").empty());
}

TEST_CASE("Ranks on two hosts form one job across network namespaces", "[multirank]") {
  const std::string id = std::to_string(::getpid() % 100000);
  const std::string ns_a = "troupe_a" + id, ns_b = "troupe_b" + id;
  const std::string dev_a = "trpa" + id, dev_b = "trpb" + id;
  auto ip = [](std::vector<std::string> args) {
    args.insert(args.begin(), {"/usr/bin/env", "ip"});
    return run_command(args, 10s);
  };
  // Removes the namespaces (and with them the veth pair) however the test ends.
  struct cleanup {
    std::function<void()> f;
    ~cleanup() { f(); }
  } guard{[&] {
    ip({"netns", "del", ns_a});
    ip({"netns", "del", ns_b});
  }};
  const std::vector<std::vector<std::string>> setup = {
      {"netns", "add", ns_a},
      {"netns", "add", ns_b},
      {"link", "add", dev_a, "type", "veth", "peer", "name", dev_b},
      {"link", "set", dev_a, "netns", ns_a},
      {"link", "set", dev_b, "netns", ns_b},
      {"-n", ns_a, "addr", "add", "10.231.7.1/24", "dev", dev_a},
      {"-n", ns_b, "addr", "add", "10.231.7.2/24", "dev", dev_b},
      {"-n", ns_a, "link", "set", dev_a, "up"},
      {"-n", ns_b, "link", "set", dev_b, "up"},
      {"-n", ns_a, "link", "set", "lo", "up"},
      {"-n", ns_b, "link", "set", "lo", "up"}};
  for (const auto& step : setup) {
    auto [rc, out] = ip(step);
    if (rc != 0) {
      std::string cmd = "ip";
      for (const auto& s : step) cmd += " " + s;
      WARN("troupe-skip: cannot create network namespaces here (" << cmd << ": " << out
                                                                  << "): two-host test skipped");
      return;
    }
  }
  const std::string token = "netns-token-" + id;
  const std::string port = std::to_string(29400 + static_cast<int>(::getpid() % 500));
  child_process host_a({"/usr/bin/env",    "ip",     "netns",    "exec",         ns_a,  troupe_bin,
                        "launch",          "-n",     "2",        "--world-size", "4",   "--bind",
                        "10.231.7.1",      "--port", port,       "--token",      token, "--job",
                        job_name("netns"), "--",     worker_bin, "exchange"});
  REQUIRE(host_a.wait_for("coordinator on 10.231.7.1:" + port, 30s));
  child_process host_b({"/usr/bin/env",
                        "ip",
                        "netns",
                        "exec",
                        ns_b,
                        troupe_bin,
                        "launch",
                        "-n",
                        "2",
                        "--coordinator",
                        "10.231.7.1:" + port,
                        "--rank-offset",
                        "2",
                        "--bind",
                        "10.231.7.2",
                        "--token",
                        token,
                        "--",
                        worker_bin,
                        "exchange"});
  auto sb = host_b.wait(120s);
  auto sa = host_a.wait(60s);
  INFO(host_a.output() << host_b.output());
  REQUIRE(sa);
  REQUIRE(sb);
  CHECK(child_process::code(*sa) == 0);
  CHECK(child_process::code(*sb) == 0);
  for (int r = 0; r < 2; ++r)
    CHECK(!host_a.lines_with("exchange ok: rank " + std::to_string(r)).empty());
  for (int r = 2; r < 4; ++r)
    CHECK(!host_b.lines_with("exchange ok: rank " + std::to_string(r)).empty());
  // Rank 2 (on host b) received from rank 1 (on host a): the data crossed the namespaces.
  CHECK(!host_b.lines_with("rank 2 received 6 tensors").empty());

  // The same job from one hostfile: each launcher finds its line by its interface address.
  char path[] = "/tmp/troupe-hostfile-XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  const std::string hosts = "10.231.7.1 slots=2\n10.231.7.2 slots=2\n";
  REQUIRE(::write(fd, hosts.data(), hosts.size()) == static_cast<ssize_t>(hosts.size()));
  ::close(fd);
  struct unlink_file {
    const char* p;
    ~unlink_file() { ::unlink(p); }
  } unlink_guard{path};
  const std::string port2 = std::to_string(std::stoi(port) + 500);
  child_process hf_a({"/usr/bin/env", "ip", "netns", "exec", ns_a, troupe_bin, "launch",
                      "--hostfile", path, "--bind", "10.231.7.1", "--port", port2, "--token", token,
                      "--", worker_bin, "exchange"});
  child_process hf_b({"/usr/bin/env", "ip", "netns", "exec", ns_b, troupe_bin, "launch",
                      "--hostfile", path, "--bind", "10.231.7.2", "--port", port2, "--token", token,
                      "--", worker_bin, "exchange"});
  auto hb = hf_b.wait(120s);
  auto ha = hf_a.wait(60s);
  INFO(hf_a.output() << hf_b.output());
  REQUIRE(ha);
  REQUIRE(hb);
  CHECK(child_process::code(*ha) == 0);
  CHECK(child_process::code(*hb) == 0);
  CHECK(!hf_a.lines_with("[rank 1] exchange ok: rank 1").empty());
  CHECK(!hf_b.lines_with("[rank 3] exchange ok: rank 3").empty());
}

TEST_CASE("Ranks started with torchrun or Slurm variables host the coordinator on rank 0",
          "[multirank]") {
  const std::string base = std::to_string(29000 + static_cast<int>(::getpid() % 400) * 2);
  for (const bool slurm : {false, true}) {
    std::vector<std::unique_ptr<child_process>> ranks;
    for (int r = 0; r < 3; ++r) {
      std::vector<std::pair<std::string, std::string>> env = {{"TROUPE_TOKEN", "env-token"}};
      if (slurm)
        env.insert(env.end(), {{"SLURM_PROCID", std::to_string(r)},
                               {"SLURM_NTASKS", "3"},
                               {"SLURM_LOCALID", std::to_string(r)},
                               {"SLURM_NODELIST", "localhost"},
                               {"TROUPE_PORT", std::to_string(std::stoi(base) + 1)}});
      else
        env.insert(env.end(), {{"RANK", std::to_string(r)},
                               {"WORLD_SIZE", "3"},
                               {"MASTER_ADDR", "127.0.0.1"},
                               {"MASTER_PORT", base}});
      ranks.push_back(
          std::make_unique<child_process>(std::vector<std::string>{worker_bin, "exchange"}, env));
    }
    for (int r = 0; r < 3; ++r) {
      auto st = ranks[r]->wait(60s);
      INFO((slurm ? "slurm" : "torchrun") << " rank " << r << ":\n" << ranks[r]->output());
      REQUIRE(st);
      CHECK(child_process::code(*st) == 0);
      CHECK(!ranks[r]->lines_with("exchange ok: rank " + std::to_string(r)).empty());
    }
    CHECK(!ranks[0]->lines_with("all 3 ranks joined and connected").empty());
  }
}

TEST_CASE("An actor script gets typed replies and errors that name the actor and its rank",
          "[multirank]") {
  child_process launcher({troupe_bin, "launch", "-n", "4", "--grace", "20", "--job",
                          job_name("roles"), "--", worker_bin, "roles"});
  auto st = launcher.wait(120s);
  INFO(launcher.output());
  REQUIRE(st);
  CHECK(child_process::code(*st) == 1);  // rank 3 killed itself
  CHECK(!launcher.lines_with("ranks failed (rank 3)").empty());
  CHECK(launcher.lines_with("CHECK FAILED").empty());
  CHECK(launcher.lines_with("check ok").size() == 6);
  auto has = [&](const std::string& key, const std::string& text) {
    for (const auto& l : launcher.lines_with(key))
      if (l.find(text) != std::string::npos) return true;
    return false;
  };
  CHECK(has("duplicate name:", "rank 1 already has an actor named \"calc@1\""));
  CHECK(has("unknown role:", "rank 2 has no role \"nope\" (registered: calc)"));
  CHECK(has("handler error:", "calc@1 (rank 1) failed on \"(anonymous namespace)::fail_request\""));
  CHECK(has("handler error:", "refusing on purpose: test"));
  CHECK(has("unknown kind:", "calc@2 (rank 2) has no handler for requests of kind"));
  CHECK(has("wrong reply type:", "calc@1 (rank 1) answered with a reply of kind"));
  CHECK(has("timeout:", "calc@2 (rank 2): no reply to"));
  CHECK(has("timeout:", "within 200 ms"));
  CHECK(has("lost rank:", "calc@3 (rank 3): rank 3 lost"));
  for (int r = 0; r < 3; ++r)
    CHECK(!launcher.lines_with("roles done: rank " + std::to_string(r)).empty());
}

TEST_CASE("A rank that exits before joining makes the others fail fast instead of waiting",
          "[multirank]") {
  child_process launcher({troupe_bin, "launch", "-n", "3", "--job", job_name("early"), "--",
                          worker_bin, "early-exit"});
  auto st = launcher.wait(60s);
  INFO(launcher.output());
  REQUIRE(st);
  CHECK(child_process::code(*st) == 1);
  // Failing fast shows in the reason: a rank that waited would fail on its join timeout instead.
  for (int r : {0, 2}) {
    auto lines =
        launcher.lines_with("[rank " + std::to_string(r) + "] troupe_multirank_worker: error");
    REQUIRE(!lines.empty());
    CHECK(lines.front().find("rank 1 exited with status 3 before joining") != std::string::npos);
  }
  CHECK(!launcher.lines_with("ranks failed (ranks 0, 1, 2)").empty());
}

TEST_CASE("A new process takes the place of a killed rank and the job goes on", "[multirank]") {
  child_process launcher({troupe_bin, "launch", "-n", "3", "--token", "rejoin-token", "--grace",
                          "30", "--job", job_name("rejoin"), "--", worker_bin, "rejoin"});
  REQUIRE(launcher.wait_for_count("ready rank", 3, 60s));
  const int port = coordinator_port(launcher);
  const int pid = ready_pid(launcher, 2);
  REQUIRE(port > 0);
  REQUIRE(pid > 0);
  REQUIRE(::kill(pid, SIGKILL) == 0);
  REQUIRE(launcher.wait_for_count("saw rank 2 lost", 2, 30s));
  child_process replacement({worker_bin, "rejoin"},
                            {{"TROUPE_COORDINATOR", "127.0.0.1:" + std::to_string(port)},
                             {"TROUPE_TOKEN", "rejoin-token"},
                             {"TROUPE_RANK", "2"},
                             {"TROUPE_WORLD_SIZE", "3"},
                             {"TROUPE_REPLACEMENT", "1"}});
  auto sr = replacement.wait(60s);
  auto sl = launcher.wait(60s);
  INFO(launcher.output() << "replacement:\n" << replacement.output());
  REQUIRE(sr);
  REQUIRE(sl);
  CHECK(child_process::code(*sr) == 0);
  // The original rank 2 was killed, but a new process took its place and ended well: the
  // launcher does not count the replaced rank's end as the job's failure.
  CHECK(child_process::code(*sl) == 0);
  CHECK(!launcher.lines_with("a new process (a joiner) took its place").empty());
  CHECK(!replacement.lines_with("replacement joined as rank 2: alive 0 1 2").empty());
  CHECK(!replacement.lines_with("rejoin ok rank 2").empty());
  for (int r : {0, 1}) {
    CHECK(!launcher.lines_with("saw rank 2 rejoin: rank " + std::to_string(r)).empty());
    CHECK(!launcher.lines_with("rejoin ok rank " + std::to_string(r)).empty());
  }
  CHECK(!launcher.lines_with("rejoined; membership epoch").empty());
  CHECK(launcher.lines_with("UNEXPECTED").empty());
  CHECK(replacement.lines_with("UNEXPECTED").empty());
}

TEST_CASE("Launched ranks keep the user's kernel settings and drop an outer job's variables",
          "[multirank]") {
  // TROUPE_KEEP_OPENBLAS_CORETYPE and TROUPE_NUM_THREADS are the user's (README, Environment);
  // TROUPE_JOB and TROUPE_TOKEN from an outer job must not leak into this one.
  child_process launcher(
      {troupe_bin, "launch", "-n", "1", "--job", job_name("env"), "--", "/usr/bin/env"},
      {{"TROUPE_KEEP_OPENBLAS_CORETYPE", "1"},
       {"TROUPE_NUM_THREADS", "3"},
       {"TROUPE_JOB", "outer-job"},
       {"TROUPE_TOKEN", "outer-token"}});
  auto st = launcher.wait(60s);
  INFO(launcher.output());
  REQUIRE(st);
  CHECK(child_process::code(*st) == 0);
  CHECK(!launcher.lines_with("[rank 0] TROUPE_KEEP_OPENBLAS_CORETYPE=1").empty());
  CHECK(!launcher.lines_with("[rank 0] TROUPE_NUM_THREADS=3").empty());
  CHECK(!launcher.lines_with("[rank 0] TROUPE_JOB=" + job_name("env")).empty());
  CHECK(launcher.lines_with("outer-job").empty());
  CHECK(launcher.lines_with("outer-token").empty());
}

TEST_CASE("A rogue process with a rank's UCX address but not the token is refused; the job goes on",
          "[multirank][faults]") {
  const std::string address_file =
      "/tmp/troupe-ucx-address-" + std::to_string(::getpid()) + "-" + job_name("rogue");
  child_process launcher({troupe_bin, "launch", "-n", "2", "--job", job_name("rogue"), "--",
                          worker_bin, "guarded", "--address-file", address_file});
  {
    const bool written = launcher.wait_for("ucx address written", 60s);
    INFO(launcher.output());
    REQUIRE(written);
  }
  child_process rogue(
      {worker_bin, "rogue-ucx", "--address-file", address_file, "--claim", "1", "--world", "2"});
  auto rs = rogue.wait(60s);
  INFO(rogue.output());
  INFO(launcher.output());
  REQUIRE(rs);
  CHECK(child_process::code(*rs) == 0);
  CHECK(!rogue.lines_with("rogue: refused: ").empty());
  auto st = launcher.wait(120s);
  std::remove(address_file.c_str());
  INFO(launcher.output());
  REQUIRE(st);
  CHECK(child_process::code(*st) == 0);
  const auto refusals = launcher.lines_with("refusal: rank 0 refused a UCX peer claiming rank 1");
  REQUIRE(!refusals.empty());
  CHECK(refusals.front().find("does not hold this job's token") != std::string::npos);
  for (int r = 0; r < 2; ++r)
    CHECK(!launcher
               .lines_with("[rank " + std::to_string(r) + "] exchange ok: rank " +
                           std::to_string(r) + " received 6 tensors")
               .empty());
  std::printf("faults: a rogue UCX peer (worker address, no token) -> refused: %s\n",
              refusals.front().c_str());
}

TEST_CASE("A member posing as another rank in a tensor announcement is refused; the job goes on",
          "[multirank][faults]") {
  child_process launcher({troupe_bin, "launch", "-n", "3", "--job", job_name("forge"), "--",
                          worker_bin, "forge-announce"});
  auto st = launcher.wait(120s);
  INFO(launcher.output());
  REQUIRE(st);
  CHECK(child_process::code(*st) == 0);
  CHECK(!launcher.lines_with("forged: rank 2 announced a tensor as rank 1").empty());
  CHECK(!launcher
             .lines_with("rank 0: got \"after-forged\" from rank 2; refused announcements: 1; a "
                         "tensor from rank 1 waiting: no")
             .empty());
  const auto refusals = launcher.lines_with(
      "rank 0 refused tensor \"forged\" (seq 0) announced as from rank 1: it came from rank 2");
  REQUIRE(!refusals.empty());
  for (int r = 0; r < 3; ++r)
    CHECK(!launcher
               .lines_with("[rank " + std::to_string(r) + "] exchange ok: rank " +
                           std::to_string(r) + " received 6 tensors")
               .empty());
  std::printf("faults: a member posing as another rank in an announcement -> refused: %s\n",
              refusals.front().c_str());
}
