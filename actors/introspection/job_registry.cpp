// The per-host registry of running jobs: one JSON file per job, see job_registry.hpp.
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "actors/introspection/job_registry.hpp"

namespace troupe::actors {
namespace {
using json = nlohmann::json;

constexpr std::size_t max_entry_bytes = 64 * 1024;
constexpr int max_entry_depth = 8;

std::string errno_text() {
  return std::strerror(errno);
}

bool valid_job_name(const std::string& job) {
  if (job.empty() || job.size() > 200 || job[0] == '.') return false;
  return std::none_of(job.begin(), job.end(), [](char c) {
    return c == '/' || static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
  });
}

// Creates `dir` (mode 0700) unless it exists; it must be a real folder, and when `private_dir` it
// must belong to us (a folder under /tmp that someone else made could redirect our entries).
void ensure_dir(const std::string& dir, bool private_dir) {
  if (!private_dir) {  // a folder the user chose: make its parents too
    std::error_code ec;
    std::filesystem::create_directories(std::filesystem::path(dir).parent_path(), ec);
  }
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST)
    TROUPE_FAIL("job registry: cannot create folder ", dir, ": ", errno_text());
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0)
    TROUPE_FAIL("job registry: cannot stat ", dir, ": ", errno_text());
  if (S_ISLNK(st.st_mode) && !private_dir) {
    if (::stat(dir.c_str(), &st) != 0)
      TROUPE_FAIL("job registry: cannot stat ", dir, ": ", errno_text());
  }
  TROUPE_CHECK(S_ISDIR(st.st_mode), "job registry: ", dir, " is not a folder");
  if (private_dir)
    TROUPE_CHECK(st.st_uid == ::getuid(), "job registry: ", dir, " belongs to uid ", st.st_uid,
                 ", not to us (uid ", ::getuid(), "); set TROUPE_RUN_DIR to a folder of ours");
}

std::string run_dir(bool& private_dir) {
  const char* env = std::getenv("TROUPE_RUN_DIR");
  private_dir = !(env && *env);
  return private_dir ? "/tmp/troupe-" + std::to_string(::getuid()) : std::string(env);
}

std::string entry_path(const std::string& job) {
  return registry_dir() + "/" + job + ".json";
}

bool process_alive(int pid) {
  return pid > 0 && (::kill(pid, 0) == 0 || errno == EPERM);
}

void write_all(int fd, const std::string& data, const std::string& path) {
  std::size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::write(fd, data.data() + done, data.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) TROUPE_FAIL("job registry: cannot write ", path, ": ", errno_text());
    done += std::size_t(n);
  }
}

// Reads a registry file into `out`; false with `problem` naming the file when that fails.
bool read_file(const std::string& path, std::string& out, std::string& problem) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    if (errno != ENOENT) problem = path + ": cannot open: " + errno_text();
    return false;  // (a file removed while we list it is no problem)
  }
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      problem = path + ": cannot read: " + errno_text();
      break;
    }
    if (n == 0) break;
    out.append(buf, std::size_t(n));
    if (out.size() > max_entry_bytes) {
      problem = path + ": larger than " + std::to_string(max_entry_bytes) + " bytes";
      break;
    }
  }
  ::close(fd);
  return problem.empty();
}

bool parse_entry(const std::string& path, const std::string& text, job_entry& e,
                 std::string& problem) {
  // An entry is a flat object: anything nested deeper than max_entry_depth is refused before it
  // is built (the size is bounded by read_file).
  bool too_deep = false;
  json::parser_callback_t depth_bound = [&](int depth, json::parse_event_t ev, json&) {
    if ((ev == json::parse_event_t::object_start || ev == json::parse_event_t::array_start) &&
        depth + 1 > max_entry_depth)
      too_deep = true;
    return !too_deep;  // false: the deeper container is dropped, not built
  };
  json j = json::parse(text, depth_bound, false);
  if (too_deep) {
    problem = path + ": nested deeper than " + std::to_string(max_entry_depth) +
              " levels, the bound for a job registry entry";
    return false;
  }
  if (j.is_discarded() || !j.is_object()) {
    problem = path + ": not a JSON object (corrupt registry entry)";
    return false;
  }
  auto field = [&](const char* key, auto check) {
    auto it = j.find(key);
    if (it == j.end() || !check(*it)) {
      if (problem.empty()) problem = path + ": field '" + key + "' is missing or has a wrong type";
      return false;
    }
    return true;
  };
  bool ok = field("job", [](const json& v) { return v.is_string(); }) &&
            field("endpoint", [](const json& v) { return v.is_string(); }) &&
            field("pid",
                  [](const json& v) {
                    return v.is_number_integer() && v.get<std::int64_t>() > 0 &&
                           v.get<std::int64_t>() <= 0x7fffffff;
                  }) &&
            field("started", [](const json& v) { return v.is_number(); });
  if (!ok) return false;
  e.job = j["job"].get<std::string>();
  e.endpoint = j["endpoint"].get<std::string>();
  e.pid = j["pid"].get<int>();
  e.started = j["started"].get<double>();
  return true;
}

}  // namespace

std::string registry_dir() {
  bool private_dir = false;
  return run_dir(private_dir) + "/jobs";
}

void register_job(const job_entry& e) {
  TROUPE_CHECK(valid_job_name(e.job), "job registry: job name '", e.job,
               "' cannot be a file name (empty, '/', leading '.', control characters or over "
               "200 bytes)");
  bool private_dir = false;
  std::string run = run_dir(private_dir);
  ensure_dir(run, private_dir);
  std::string dir = run + "/jobs";
  ensure_dir(dir, private_dir);

  json j = {{"job", e.job}, {"endpoint", e.endpoint}, {"pid", e.pid}, {"started", e.started}};
  std::string text = j.dump(2, ' ', false, json::error_handler_t::replace) + "\n";
  static std::atomic<unsigned> counter{0};
  std::string path = dir + "/" + e.job + ".json";
  std::string tmp = dir + "/." + e.job + ".json.tmp." + std::to_string(::getpid()) + "." +
                    std::to_string(counter++);
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) TROUPE_FAIL("job registry: cannot create ", tmp, ": ", errno_text());
  try {
    write_all(fd, text, tmp);
    if (::fsync(fd) != 0) TROUPE_FAIL("job registry: cannot fsync ", tmp, ": ", errno_text());
  } catch (...) {
    ::close(fd);
    ::unlink(tmp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    ::unlink(tmp.c_str());
    TROUPE_FAIL("job registry: cannot close ", tmp, ": ", errno_text());
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    std::string why = errno_text();
    ::unlink(tmp.c_str());
    TROUPE_FAIL("job registry: cannot rename ", tmp, " to ", path, ": ", why);
  }
}

void unregister_job(const std::string& job) {
  if (!valid_job_name(job)) return;  // register_job never wrote such a name
  std::string path = entry_path(job);
  if (::unlink(path.c_str()) != 0 && errno != ENOENT)
    TROUPE_FAIL("job registry: cannot remove ", path, ": ", errno_text());
}

std::vector<job_entry> list_jobs(std::vector<std::string>& problems) {
  std::vector<job_entry> jobs;
  std::string dir = registry_dir();
  DIR* d = ::opendir(dir.c_str());
  if (!d) {
    if (errno != ENOENT) problems.push_back(dir + ": cannot list: " + errno_text());
    return jobs;
  }
  std::vector<std::string> names;
  while (dirent* de = ::readdir(d)) {
    std::string name = de->d_name;
    if (name.empty() || name[0] == '.') continue;  // ".", "..", temp files
    if (name.size() <= 5 || name.compare(name.size() - 5, 5, ".json") != 0) continue;
    names.push_back(name);
  }
  ::closedir(d);
  std::sort(names.begin(), names.end());
  for (const auto& name : names) {
    std::string path = dir + "/" + name, text, problem;
    job_entry e;
    if (!read_file(path, text, problem) || !parse_entry(path, text, e, problem)) {
      if (!problem.empty()) problems.push_back(problem);
      continue;
    }
    if (e.job + ".json" != name) {
      problems.push_back(path + ": names job '" + e.job + "', not the one of its file name");
      continue;
    }
    if (process_alive(e.pid)) jobs.push_back(std::move(e));
  }
  return jobs;
}

std::vector<job_entry> list_jobs() {
  std::vector<std::string> problems;
  auto jobs = list_jobs(problems);
  for (const auto& p : problems)
    std::fprintf(stderr, "troupe: warning: job registry: %s\n", p.c_str());
  return jobs;
}

expected<job_entry> find_job(const std::vector<job_entry>& jobs, const std::string& name) {
  std::string names;
  for (const auto& j : jobs) {
    if (!names.empty()) names += ", ";
    names += j.job;
  }
  if (name.empty()) {
    if (jobs.size() == 1) return jobs[0];
    if (jobs.empty())
      return expected<job_entry>::failure("no running troupe job is registered in " +
                                          registry_dir());
    return expected<job_entry>::failure("several troupe jobs are running (" + names +
                                        "): choose one with --job NAME");
  }
  for (const auto& j : jobs)
    if (j.job == name) return j;
  return expected<job_entry>::failure(
      "no running troupe job named '" + name + "' in " + registry_dir() +
      (jobs.empty() ? std::string(" (none is running)") : " (running: " + names + ")"));
}

}  // namespace troupe::actors
