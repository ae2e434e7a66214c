// Bootstrap without processes: launcher, Slurm and torchrun environments, host lists, hostfiles,
// tokens.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <string>

#include "actors/bootstrap.hpp"

namespace {

using namespace troupe::actors;

env_lookup env_of(std::map<std::string, std::string> vars) {
  auto shared = std::make_shared<std::map<std::string, std::string>>(std::move(vars));
  return [shared](const char* name) -> const char* {
    auto it = shared->find(name);
    return it == shared->end() ? nullptr : it->second.c_str();
  };
}

}  // namespace

TEST_CASE("The launcher's variables give coordinator token rank and world") {
  auto j = join_info_from_env(env_of({{"TROUPE_COORDINATOR", "127.0.0.1:4000"},
                                      {"TROUPE_TOKEN", "abc"},
                                      {"TROUPE_RANK", "3"},
                                      {"TROUPE_WORLD_SIZE", "8"},
                                      {"TROUPE_LOCAL_RANK", "1"}}));
  REQUIRE(j);
  CHECK(j->source == "troupe launch");
  CHECK(j->coordinator == "127.0.0.1:4000");
  CHECK(j->token == "abc");
  CHECK(j->rank == 3);
  CHECK(j->world_size == 8);
  CHECK(j->local_rank == 1);
  CHECK(j->bind == "127.0.0.1");
  CHECK(j->net_device == "lo");
  CHECK_FALSE(j->host_coordinator);
}

TEST_CASE("A missing token or a bad rank is an error naming the variable") {
  // Without a token a launcher-style rank still asks (and the coordinator refuses it, naming it).
  auto no_token =
      join_info_from_env(env_of({{"TROUPE_COORDINATOR", "127.0.0.1:4000"}, {"TROUPE_RANK", "0"}}));
  REQUIRE(no_token);
  CHECK(no_token->token.empty());
  auto bad_file = join_info_from_env(env_of({{"TROUPE_COORDINATOR", "127.0.0.1:4000"},
                                             {"TROUPE_RANK", "0"},
                                             {"TROUPE_TOKEN_FILE", "/nonexistent/token"}}));
  REQUIRE_FALSE(bad_file);
  CHECK(bad_file.error_message().find("/nonexistent/token") != std::string::npos);
  // Slurm and torchrun ranks need one: rank 0 starts the coordinator with it.
  auto slurm = join_info_from_env(
      env_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NODELIST", "a"}}));
  REQUIRE_FALSE(slurm);
  CHECK(slurm.error_message().find("TROUPE_TOKEN") != std::string::npos);
  auto bad_rank = join_info_from_env(
      env_of({{"TROUPE_COORDINATOR", "h:1"}, {"TROUPE_TOKEN", "t"}, {"TROUPE_RANK", "two"}}));
  REQUIRE_FALSE(bad_rank);
  CHECK(bad_rank.error_message().find("TROUPE_RANK=\"two\"") != std::string::npos);
  auto nothing = join_info_from_env(env_of({}));
  REQUIRE_FALSE(nothing);
  CHECK(nothing.error_message().find("troupe launch") != std::string::npos);
}

TEST_CASE("A joiner's variables ask for any lost rank's place") {
  // troupe launch --join: TROUPE_JOIN=1 instead of TROUPE_RANK; the coordinator gives the rank.
  auto j = join_info_from_env(env_of(
      {{"TROUPE_COORDINATOR", "127.0.0.1:4000"}, {"TROUPE_TOKEN", "t"}, {"TROUPE_JOIN", "1"}}));
  REQUIRE(j);
  CHECK(j->rank == -1);
  CHECK(j->world_size == -1);
  // Without TROUPE_JOIN=1 the rank is required.
  auto none =
      join_info_from_env(env_of({{"TROUPE_COORDINATOR", "127.0.0.1:4000"}, {"TROUPE_TOKEN", "t"}}));
  REQUIRE(!none);
  CHECK(none.error_message().find("TROUPE_RANK is not set") != std::string::npos);
}

TEST_CASE("A token file is read and trimmed") {
  char path[] = "/tmp/troupe-token-test-XXXXXX";
  const int fd = ::mkstemp(path);
  REQUIRE(fd >= 0);
  ::close(fd);
  {
    std::ofstream f(path);
    f << "  s3cret \nsecond line\n";
  }
  auto j = join_info_from_env(
      env_of({{"TROUPE_COORDINATOR", "h:1"}, {"TROUPE_TOKEN_FILE", path}, {"TROUPE_RANK", "0"}}));
  REQUIRE(j);
  CHECK(j->token == "s3cret");
  { std::ofstream f(path); }
  auto empty = read_token_file(path);
  REQUIRE_FALSE(empty);
  CHECK(empty.error_message().find(path) != std::string::npos);
  std::remove(path);
  auto missing = read_token_file(path);
  REQUIRE_FALSE(missing);
  CHECK(missing.error_message().find("cannot read token file") != std::string::npos);
}

TEST_CASE("Slurm variables put the coordinator on rank 0 of the first host") {
  auto one = join_info_from_env(env_of({{"SLURM_PROCID", "0"},
                                        {"SLURM_NTASKS", "4"},
                                        {"SLURM_LOCALID", "0"},
                                        {"SLURM_NODELIST", "gpu07"},
                                        {"TROUPE_TOKEN", "t"}}));
  REQUIRE(one);
  CHECK(one->source == "slurm");
  CHECK(one->host_coordinator);
  CHECK(one->coordinator == "127.0.0.1:29400");
  CHECK(one->coordinator_bind == "127.0.0.1");
  auto other = join_info_from_env(env_of({{"SLURM_PROCID", "5"},
                                          {"SLURM_NTASKS", "8"},
                                          {"SLURM_LOCALID", "1"},
                                          {"SLURM_NODELIST", "gpu[07-08]"},
                                          {"TROUPE_PORT", "31000"},
                                          {"TROUPE_BIND", "0.0.0.0"},
                                          {"TROUPE_TOKEN", "t"}}));
  REQUIRE(other);
  CHECK_FALSE(other->host_coordinator);
  CHECK(other->rank == 5);
  CHECK(other->world_size == 8);
  CHECK(other->local_rank == 1);
  CHECK(other->coordinator == "gpu07:31000");
  // Rank 0 of a multi-host allocation must be told where to listen.
  auto unbound = join_info_from_env(env_of({{"SLURM_PROCID", "0"},
                                            {"SLURM_NTASKS", "8"},
                                            {"SLURM_NODELIST", "gpu[07-08]"},
                                            {"TROUPE_TOKEN", "t"}}));
  REQUIRE_FALSE(unbound);
  CHECK(unbound.error_message().find("TROUPE_BIND") != std::string::npos);
}

TEST_CASE("torchrun variables find the coordinator next to the agent's port") {
  auto j = join_info_from_env(env_of({{"RANK", "1"},
                                      {"WORLD_SIZE", "2"},
                                      {"LOCAL_RANK", "1"},
                                      {"LOCAL_WORLD_SIZE", "2"},
                                      {"MASTER_ADDR", "node3"},
                                      {"MASTER_PORT", "29500"},
                                      {"TORCHELASTIC_RUN_ID", "x"},
                                      {"TROUPE_TOKEN", "t"}}));
  REQUIRE(j);
  CHECK(j->source == "torchrun");
  CHECK(j->coordinator == "127.0.0.1:29501");  // one host: loopback; the agent has 29500
  CHECK(j->rank == 1);
  CHECK(j->local_rank == 1);
  auto plain = join_info_from_env(env_of({{"RANK", "0"},
                                          {"WORLD_SIZE", "2"},
                                          {"MASTER_ADDR", "127.0.0.1"},
                                          {"MASTER_PORT", "29500"},
                                          {"TROUPE_TOKEN", "t"}}));
  REQUIRE(plain);
  CHECK(plain->coordinator == "127.0.0.1:29500");
  CHECK(plain->host_coordinator);
}

TEST_CASE("Slurm host lists expand ranges with their zero padding") {
  auto h = expand_nodelist("node[01-03,7],gpu5,rack[1-2]-n[8-9]");
  REQUIRE(h);
  const std::vector<std::string> want = {"node01",   "node02",   "node03",   "node7",   "gpu5",
                                         "rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"};
  CHECK(*h == want);
  CHECK_FALSE(expand_nodelist("node[1-"));
  CHECK_FALSE(expand_nodelist("node[3-1]"));
  CHECK_FALSE(expand_nodelist(""));
}

TEST_CASE("Hostfiles give hosts and slots and name the bad line") {
  auto h = parse_hostfile_text("# cluster\nalpha slots=4\nbeta slots=2 # spare\n\ngamma\n", "hf");
  REQUIRE(h);
  REQUIRE(h->size() == 3);
  CHECK((*h)[0].host == "alpha");
  CHECK((*h)[0].slots == 4);
  CHECK((*h)[1].slots == 2);
  CHECK((*h)[2].slots == 1);
  auto bad = parse_hostfile_text("alpha slots=4\nbeta cpus=2\n", "hosts.txt");
  REQUIRE_FALSE(bad);
  CHECK(bad.error_message().find("hosts.txt:2") != std::string::npos);
  auto zero = parse_hostfile_text("alpha slots=0\n", "hosts.txt");
  REQUIRE_FALSE(zero);
  auto twice = parse_hostfile_text("alpha\nalpha\n", "hosts.txt");
  REQUIRE_FALSE(twice);
  CHECK(twice.error_message().find("twice") != std::string::npos);
  std::vector<host_slots> here = {{"no-such-host.invalid", 1}, {this_host(), 2}};
  auto i = find_host_index(here);
  REQUIRE(i);
  CHECK(*i == 1);
  std::vector<host_slots> by_address = {{"127.0.0.1", 1}};
  CHECK(find_host_index(by_address));
}

TEST_CASE("Job tokens are 128 random bits and compare exactly") {
  const auto a = generate_token(), b = generate_token();
  CHECK(a.size() == 32);
  CHECK(a.find_first_not_of("0123456789abcdef") == std::string::npos);
  CHECK(a != b);
  CHECK(tokens_equal(a, a));
  CHECK_FALSE(tokens_equal(a, b));
  CHECK_FALSE(tokens_equal(a, a.substr(0, 31)));
  CHECK_FALSE(tokens_equal("", ""));
}

TEST_CASE("The network device of an address is found from the interfaces") {
  CHECK(net_device_for("127.0.0.1") == "lo");
  CHECK(net_device_for("0.0.0.0").empty());
  CHECK(net_device_for("192.0.2.99").empty());  // TEST-NET-1: on no interface here
}
