// Tests of the job registry in a temporary TROUPE_RUN_DIR, with real processes for stale entries.
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>

#include "actors/introspection/job_registry.hpp"

using namespace troupe::actors;
namespace fs = std::filesystem;

namespace {

// Points TROUPE_RUN_DIR at a fresh folder for the life of the object.
struct temp_run_dir {
  fs::path dir;
  std::string old;
  bool had_old = false;
  temp_run_dir() {
    char tmpl[] = "/tmp/troupe-registry-test-XXXXXX";
    REQUIRE(::mkdtemp(tmpl) != nullptr);
    dir = fs::path(tmpl) / "run";  // not there yet: register_job makes it
    if (const char* o = std::getenv("TROUPE_RUN_DIR")) had_old = true, old = o;
    ::setenv("TROUPE_RUN_DIR", dir.c_str(), 1);
  }
  ~temp_run_dir() {
    if (had_old)
      ::setenv("TROUPE_RUN_DIR", old.c_str(), 1);
    else
      ::unsetenv("TROUPE_RUN_DIR");
    std::error_code ec;
    fs::remove_all(dir.parent_path(), ec);
  }
};

int dead_pid() {
  pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) ::_exit(0);
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  return pid;
}

}  // namespace

TEST_CASE("Jobs are registered listed and unregistered", "[introspection]") {
  temp_run_dir tmp;
  CHECK(registry_dir() == (tmp.dir / "jobs").string());
  CHECK(list_jobs().empty());
  register_job({"train-b", "127.0.0.1:4001", ::getpid(), 1700000000.5});
  register_job({"train-a", "127.0.0.1:4000", ::getpid(), 1700000001.25});
  auto jobs = list_jobs();
  REQUIRE(jobs.size() == 2);
  CHECK(jobs[0].job == "train-a");
  CHECK(jobs[0].endpoint == "127.0.0.1:4000");
  CHECK(jobs[0].pid == ::getpid());
  CHECK(jobs[0].started == 1700000001.25);
  CHECK(jobs[1].job == "train-b");

  // Private: the folder 0700, the files 0600, no temporary files left behind.
  struct stat st {};
  REQUIRE(::stat((tmp.dir / "jobs").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0700);
  REQUIRE(::stat((tmp.dir / "jobs" / "train-a.json").c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0600);
  CHECK(std::distance(fs::directory_iterator(tmp.dir / "jobs"), fs::directory_iterator{}) == 2);

  // Registering again replaces the entry.
  register_job({"train-a", "127.0.0.1:5000", ::getpid(), 1.0});
  jobs = list_jobs();
  REQUIRE(jobs.size() == 2);
  CHECK(jobs[0].endpoint == "127.0.0.1:5000");

  unregister_job("train-a");
  jobs = list_jobs();
  REQUIRE(jobs.size() == 1);
  CHECK(jobs[0].job == "train-b");
  CHECK_NOTHROW(unregister_job("train-a"));
  CHECK_NOTHROW(unregister_job("never-there"));
}

TEST_CASE("Entries of processes that are gone are left out", "[introspection]") {
  temp_run_dir tmp;
  register_job({"alive", "127.0.0.1:1", ::getpid(), 0});
  register_job({"crashed", "127.0.0.1:2", dead_pid(), 0});
  std::vector<std::string> problems;
  auto jobs = list_jobs(problems);
  REQUIRE(jobs.size() == 1);
  CHECK(jobs[0].job == "alive");
  CHECK(problems.empty());
}

TEST_CASE("A corrupt registry file is reported by name and skipped", "[introspection]") {
  temp_run_dir tmp;
  register_job({"good", "127.0.0.1:1", ::getpid(), 0});
  fs::path jobs_dir = tmp.dir / "jobs";
  std::ofstream(jobs_dir / "broken.json") << "{\"job\": \"broken\", \"endp";
  std::ofstream(jobs_dir / "typed.json")
      << R"({"job": "typed", "endpoint": 7, "pid": 1, "started": 0})";
  std::ofstream(jobs_dir / "renamed.json")
      << R"({"job": "other", "endpoint": "h:1", "pid": )" << ::getpid() << R"(, "started": 0})";
  std::ofstream(jobs_dir / "notes.txt") << "ignored: not a .json file";
  std::vector<std::string> problems;
  auto jobs = list_jobs(problems);
  REQUIRE(jobs.size() == 1);
  CHECK(jobs[0].job == "good");
  REQUIRE(problems.size() == 3);
  CHECK_THAT(problems[0], Catch::Contains((jobs_dir / "broken.json").string()));
  CHECK_THAT(problems[1], Catch::Contains((jobs_dir / "renamed.json").string()));
  CHECK_THAT(problems[2],
             Catch::Contains((jobs_dir / "typed.json").string()) && Catch::Contains("endpoint"));
}

// The bounds on a registry entry (job_registry.cpp): 64 KiB, nesting 8 levels. An entry over
// either is reported by name and skipped, and the good entry beside it is still listed.
TEST_CASE("A registry entry nested too deep or too large is refused by name",
          "[introspection][faults]") {
  temp_run_dir tmp;
  register_job({"good", "127.0.0.1:1", ::getpid(), 0});
  const fs::path jobs_dir = tmp.dir / "jobs";
  const std::string deep = std::string(9, '[') + std::string(9, ']');
  std::ofstream(jobs_dir / "deep.json")
      << R"({"job": "deep", "endpoint": "h:1", "pid": 1, "started": 0, "x": )" << deep << "}";
  std::ofstream(jobs_dir / "huge.json")
      << R"({"job": "huge", "endpoint": ")" << std::string(70 * 1024, 'a') << R"("})";
  std::vector<std::string> problems;
  auto jobs = list_jobs(problems);
  REQUIRE(jobs.size() == 1);
  CHECK(jobs[0].job == "good");
  REQUIRE(problems.size() == 2);
  CHECK_THAT(problems[0], Catch::Contains((jobs_dir / "deep.json").string()) &&
                              Catch::Contains("nested deeper than 8 levels"));
  CHECK_THAT(problems[1],
             Catch::Contains((jobs_dir / "huge.json").string()) && Catch::Contains("larger than"));
  std::printf("faults: job registry entry nested 10 deep -> refused: %s\n", problems[0].c_str());
  std::printf("faults: job registry entry of 70 KiB -> refused: %s\n", problems[1].c_str());
}

TEST_CASE("Job names that are not plain file names are refused", "[introspection]") {
  temp_run_dir tmp;
  for (const std::string& bad : std::vector<std::string>{"", "../escape", "a/b", ".hidden",
                                                         "tab\tname", std::string(300, 'x')}) {
    INFO(bad);
    CHECK_THROWS_AS(register_job({bad, "127.0.0.1:1", ::getpid(), 0}), troupe::error);
  }
  CHECK(list_jobs().empty());
  CHECK_FALSE(fs::exists(tmp.dir.parent_path() / "escape.json"));
}

TEST_CASE("A registry folder that is not a folder is refused", "[introspection]") {
  temp_run_dir tmp;
  ::unsetenv("TROUPE_RUN_DIR");  // the default folder
  std::string dir = registry_dir();
  CHECK(dir == "/tmp/troupe-" + std::to_string(::getuid()) + "/jobs");
  ::setenv("TROUPE_RUN_DIR", tmp.dir.c_str(), 1);
  // A run folder that is a file.
  fs::create_directories(tmp.dir);
  std::ofstream(tmp.dir / "jobs") << "x";
  CHECK_THROWS_WITH(register_job({"j", "h:1", ::getpid(), 0}),
                    Catch::Contains((tmp.dir / "jobs").string()));
}

TEST_CASE("The job a command means is found by name or as the only one", "[introspection]") {
  temp_run_dir tmp;
  std::vector<job_entry> none, one = {{"a", "h:1", 1, 0}},
                               two = {{"a", "h:1", 1, 0}, {"b", "h:2", 2, 0}};
  auto r0 = find_job(none, "");
  REQUIRE_FALSE(r0.has_value());
  CHECK_THAT(r0.error_message(), Catch::Contains("no running troupe job"));
  auto r1 = find_job(one, "");
  REQUIRE(r1.has_value());
  CHECK(r1->job == "a");
  auto r2 = find_job(two, "");
  REQUIRE_FALSE(r2.has_value());
  CHECK_THAT(r2.error_message(), Catch::Contains("a, b") && Catch::Contains("--job"));
  auto r3 = find_job(two, "b");
  REQUIRE(r3.has_value());
  CHECK(r3->endpoint == "h:2");
  auto r4 = find_job(two, "c");
  REQUIRE_FALSE(r4.has_value());
  CHECK_THAT(r4.error_message(), Catch::Contains("'c'") && Catch::Contains("a, b"));
}
