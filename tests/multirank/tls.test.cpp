// The control plane over TLS (`troupe launch --tls`): a job does real work over it, its
// coordinator's port speaks TLS with the job's certificate, and bad settings or a peer without TLS
// or without a trusted certificate are refused, naming the flag, the file or the cause.
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include "tests/multirank/process.hpp"
#include "tests/multirank/train_runs.hpp"

namespace {

using troupe::tests::child_process;
using troupe::tests::run_command;
using troupe::tests::scratch_dir;
using namespace std::chrono_literals;

const std::string troupe_bin = TROUPE_BIN;
const std::string worker_bin = TROUPE_WORKER_BIN;

std::string job_name(const std::string& what) {
  return "multirank-tls-" + what + "-" + std::to_string(::getpid());
}

// A temporary folder with two self-signed certificates (CN=localhost) and their keys, made with
// the openssl command: a.crt / a.key (the job's) and b.crt / b.key (a stranger's).
struct cert_dir {
  scratch_dir dir{"tls"};  // removed with the certificates when the test ends
  const std::string& path = dir.path;
  bool ok = make("a") && make("b");
  bool make(const std::string& n) {
    auto [rc, out] = run_command(
        {"/usr/bin/env", "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-subj",
         "/CN=localhost", "-days", "1", "-keyout", file(n + ".key"), "-out", file(n + ".crt")},
        60s);
    if (rc != 0) WARN("openssl req failed (" << rc << "): " << out);
    return rc == 0;
  }
  std::string file(const std::string& n) const { return path + "/" + n; }
};

int coordinator_port(const child_process& p) {
  std::smatch m;
  for (const auto& l : p.lines_with("coordinator on ")) {
    static const std::regex re("coordinator on [^ ]+:([0-9]+)");
    if (std::regex_search(l, m, re)) return std::stoi(m[1]);
  }
  return -1;
}

// `troupe launch` with these arguments before `-- worker hold`, expected to be refused at once.
std::string refusal_of(const std::vector<std::string>& args) {
  std::vector<std::string> argv = {troupe_bin, "launch", "-n", "1"};
  argv.insert(argv.end(), args.begin(), args.end());
  argv.insert(argv.end(), {"--", worker_bin, "hold"});
  child_process p(argv);
  auto st = p.wait(30s);
  INFO(p.output());
  REQUIRE(st);
  CHECK(child_process::code(*st) != 0);
  CHECK(p.lines_with("ready rank").empty());
  auto lines = p.lines_with("troupe: error: ");
  REQUIRE(!lines.empty());
  return lines.front();
}

}  // namespace

TEST_CASE("A job with --tls exchanges tensors and its coordinator speaks TLS with its certificate",
          "[multirank]") {
  cert_dir certs;
  REQUIRE(certs.ok);
  const std::string crt = certs.file("a.crt"), key = certs.file("a.key");
  {
    child_process launcher({troupe_bin, "launch", "-n", "2", "--tls", "--tls-cert", crt,
                            "--tls-key", key, "--job", job_name("exchange"), "--", worker_bin,
                            "exchange"});
    auto st = launcher.wait(120s);
    INFO(launcher.output());
    REQUIRE(st);
    CHECK(child_process::code(*st) == 0);
    auto first = launcher.lines_with("coordinator on ");
    REQUIRE(!first.empty());
    CHECK(first.front().find("(TLS)") != std::string::npos);
    for (int r = 0; r < 2; ++r)
      CHECK(!launcher
                 .lines_with("[rank " + std::to_string(r) + "] exchange ok: rank " +
                             std::to_string(r) + " received 6 tensors")
                 .empty());
  }
  // A job waiting for its second rank: a TLS client with the job's certificate completes a
  // handshake with the coordinator's port and verifies the certificate it shows; then the rank
  // joins (its environment as the launcher gives it) and the job ends well.
  child_process launcher({troupe_bin, "launch",          "-n",  "1",        "--world-size",
                          "2",        "--token",         "tok", "--tls",    "--tls-cert",
                          crt,        "--tls-key",       key,   "--tls-ca", crt,
                          "--job",    job_name("probe"), "--",  worker_bin, "hold"});
  REQUIRE(launcher.wait_for("coordinator on ", 30s));
  const int port = coordinator_port(launcher);
  REQUIRE(port > 0);
  auto [rc, hello] = run_command(
      {"/bin/sh", "-c",
       "openssl s_client -brief -verify_return_error -connect 127.0.0.1:" + std::to_string(port) +
           " -cert " + crt + " -key " + key + " -CAfile " + crt + " </dev/null 2>&1"},
      30s);
  INFO(hello);
  CHECK(rc == 0);
  CHECK(hello.find("Verification: OK") != std::string::npos);
  CHECK(hello.find("Protocol version: TLSv1.") != std::string::npos);
  CHECK(hello.find("CN = localhost") != std::string::npos);
  child_process rank1({worker_bin, "hold"},
                      {{"TROUPE_COORDINATOR", "127.0.0.1:" + std::to_string(port)},
                       {"TROUPE_TOKEN", "tok"},
                       {"TROUPE_RANK", "1"},
                       {"TROUPE_WORLD_SIZE", "2"},
                       {"TROUPE_TLS_CERT", crt},
                       {"TROUPE_TLS_KEY", key}});
  auto st1 = rank1.wait(60s);
  auto st0 = launcher.wait(60s);
  INFO(launcher.output() << rank1.output());
  REQUIRE(st1);
  REQUIRE(st0);
  CHECK(child_process::code(*st1) == 0);
  CHECK(child_process::code(*st0) == 0);
  CHECK(!rank1.lines_with("hold done: rank 1").empty());
}

TEST_CASE("TLS settings, a rank without TLS and an untrusted certificate are refused",
          "[multirank][faults]") {
  cert_dir certs;
  REQUIRE(certs.ok);
  const std::string crt = certs.file("a.crt"), key = certs.file("a.key");
  const std::string other_crt = certs.file("b.crt"), other_key = certs.file("b.key");
  struct row {
    std::string what;
    std::vector<std::string> args;
    std::vector<std::string> expect;
  };
  const std::vector<row> rows = {
      {"--tls without a key", {"--tls", "--tls-cert", crt}, {"--tls needs", "--tls-key"}},
      {"--tls-cert without --tls", {"--tls-cert", crt, "--tls-key", key}, {"without --tls"}},
      {"a missing certificate file",
       {"--tls", "--tls-cert", certs.file("none.crt"), "--tls-key", key},
       {"--tls-cert " + certs.file("none.crt"), "cannot read it"}},
      {"a key that is not PEM",
       {"--tls", "--tls-cert", crt, "--tls-key", crt},
       {"--tls-key " + crt, "private key"}},
      {"a key of another certificate",
       {"--tls", "--tls-cert", crt, "--tls-key", other_key},
       {"--tls-key " + other_key, "does not match the certificate"}},
      {"a certificate not signed by the CA",
       {"--tls", "--tls-cert", crt, "--tls-key", key, "--tls-ca", other_crt},
       {"--tls-cert " + crt + " does not verify against --tls-ca " + other_crt}},
  };
  for (const auto& r : rows) {
    INFO(r.what);
    const std::string line = refusal_of(r.args);
    for (const auto& e : r.expect) CHECK(line.find(e) != std::string::npos);
    std::printf("faults: %s -> refused: %s\n", r.what.c_str(), line.c_str());
  }

  // A TLS coordinator: a rank without TLS, and a rank whose certificate the job does not trust,
  // cannot join and say why at once; then the right rank joins and the job ends well.
  child_process launcher({troupe_bin, "launch", "-n", "1", "--world-size", "2", "--token", "tok",
                          "--tls", "--tls-cert", crt, "--tls-key", key, "--job", job_name("refuse"),
                          "--", worker_bin, "hold"});
  REQUIRE(launcher.wait_for("coordinator on ", 30s));
  const int port = coordinator_port(launcher);
  REQUIRE(port > 0);
  const std::string endpoint = "127.0.0.1:" + std::to_string(port);
  std::vector<std::pair<std::string, std::string>> env = {{"TROUPE_COORDINATOR", endpoint},
                                                          {"TROUPE_TOKEN", "tok"},
                                                          {"TROUPE_RANK", "1"},
                                                          {"TROUPE_WORLD_SIZE", "2"}};
  // A rank started with `rank_env` is refused at the handshake, saying `why`.
  auto refused = [&](const std::vector<std::pair<std::string, std::string>>& rank_env,
                     const std::string& why, const char* what) {
    child_process rank({worker_bin, "hold"}, rank_env);
    auto st = rank.wait(30s);
    INFO(rank.output());
    REQUIRE(st);
    CHECK(child_process::code(*st) != 0);
    auto lines = rank.lines_with("cannot join the coordinator at " + endpoint);
    REQUIRE(!lines.empty());
    CHECK(lines.front().find(why) != std::string::npos);
    std::printf("faults: %s -> refused: %s\n", what, lines.front().c_str());
  };
  refused(env, "this process does not use TLS", "a rank without TLS joining a TLS coordinator");
  auto stranger_env = env;
  stranger_env.push_back({"TROUPE_TLS_CERT", other_crt});
  stranger_env.push_back({"TROUPE_TLS_KEY", other_key});
  refused(stranger_env, "this process uses TLS",
          "a rank with a certificate the job does not trust");
  auto good_env = env;
  good_env.push_back({"TROUPE_TLS_CERT", crt});
  good_env.push_back({"TROUPE_TLS_KEY", key});
  child_process rank1({worker_bin, "hold"}, good_env);
  auto st1 = rank1.wait(60s);
  auto st0 = launcher.wait(60s);
  INFO(launcher.output() << rank1.output());
  REQUIRE(st1);
  REQUIRE(st0);
  CHECK(child_process::code(*st1) == 0);
  CHECK(child_process::code(*st0) == 0);
}
