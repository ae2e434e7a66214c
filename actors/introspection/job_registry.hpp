// Where running jobs announce their introspection endpoint on this host, so that `troupe ps` and
// `troupe top` find them: one small JSON file per job under
//   $TROUPE_RUN_DIR/jobs/<job>.json   (default run dir: /tmp/troupe-<uid>)
// written atomically (temp file + fsync + rename) with mode 0600, in a 0700 folder.
#pragma once

#include <string>
#include <vector>

#include "memory/error.hpp"

namespace troupe::actors {

struct job_entry {
  std::string job, endpoint;  // endpoint: "host:port" of the job's http_server
  int pid = 0;                // the process that registered it (the coordinator)
  double started = 0;         // unix time
};

// The folder holding the job files ($TROUPE_RUN_DIR/jobs or /tmp/troupe-<uid>/jobs).
std::string registry_dir();

// Writes (or replaces) the entry of `entry.job`; throws troupe::error naming the file on failure
// or when the job name cannot be a file name (empty, '/', leading '.', control characters).
void register_job(const job_entry& entry);
// Removes the entry of `job`; a missing entry is not an error.
void unregister_job(const std::string& job);

// The registered jobs whose process is still alive, sorted by name. Entries of dead processes are
// left out (their files stay: a job registering the same name replaces its file); unreadable or
// corrupt files are skipped and reported, naming the file: into `problems`, or as warnings on
// stderr by the overload without it. Reads only.
std::vector<job_entry> list_jobs();
std::vector<job_entry> list_jobs(std::vector<std::string>& problems);

// The job a command means: the one named `name`, or when `name` is empty the only one; a failure
// message that says what was found (none, or the names of several) otherwise.
expected<job_entry> find_job(const std::vector<job_entry>& jobs, const std::string& name);

}  // namespace troupe::actors
