// Renderings of a job_snapshot: JSON (and back), Prometheus text exposition format 0.0.4, the
// `troupe ps` / `troupe top` table and the endpoint's HTML table (/table). Pure functions.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "actors/introspection/snapshot.hpp"
#include "memory/error.hpp"

namespace troupe::actors {

std::string to_json(const job_snapshot& snapshot);
// Parses what to_json wrote; a failure names `source` (a file, an URL) and the offending field.
// Missing fields keep their defaults, unknown fields are ignored, wrong types are errors.
expected<job_snapshot> snapshot_from_json(std::string_view text, const std::string& source);

// Prometheus families per actor and communicator (labels actor, role, rank, communicator):
// troupe_collective_last_seq (the last sequence number issued),
// troupe_collective_last_completed_seq (the highest that finished, done or failed),
// troupe_collective_unfinished (ops issued or running) and
// troupe_collective_oldest_unfinished_seconds (0 when none).
std::string to_prometheus(const job_snapshot& snapshot);

// What one actor's records say about one communicator (records of one name are merged).
struct collective_summary {
  std::string communicator;
  std::uint64_t last_seq = 0;            // the highest sequence number seen
  std::uint64_t last_completed_seq = 0;  // the highest that finished (done or failed), 0: none
  std::uint64_t unfinished = 0;          // issued or running
  double oldest_unfinished_s = 0;        // age of the oldest unfinished op, 0 when none
};
// By communicator name.
std::vector<collective_summary> summarize_collectives(const actor_state& actor);
// The operation that says what the actor waits for: its oldest unfinished one, else the one that
// finished last; null when it has no records.
const collective_op* key_collective(const actor_state& actor);
// "allreduce #12 running 2.1s on ucx:tp#3[0,1]", "allreduce #11 done in 35us on ...",
// "broadcast #4 failed on ...: <cause>" (the COLLECTIVE column of the table).
std::string collective_text(const collective_op& op);

// Traffic rates of one actor between two snapshots.
struct actor_rates {
  double bytes_in_per_s = 0, bytes_out_per_s = 0;
  double msgs_in_per_s = 0, msgs_out_per_s = 0;
};
// Rates per actor name from two successive snapshots taken `seconds` apart (actors missing from
// `before`, or counters that went backwards, get no entry).
std::map<std::string, actor_rates> compute_rates(const job_snapshot& before,
                                                 const job_snapshot& after, double seconds);

// The `troupe ps` table: a job line, the members, then the actors (with key_collective() in the
// COLLECTIVE column); every line cut to `width` columns (width <= 0: no limit). Control characters
// in names are shown as '?'.
std::string render_table(const job_snapshot& snapshot, int width);
// The same with two rate columns (bytes/s in and out), as `troupe top` shows it.
std::string render_table(const job_snapshot& snapshot, int width,
                         const std::map<std::string, actor_rates>& rates);

// Every collective record of every actor, one line each (actor, communicator, seq, op, dtype,
// count, peer, state, age, duration), cut to `width` columns; "(no collectives)" when none.
std::string render_collectives(const job_snapshot& snapshot, int width);

// A small self-refreshing HTML page with the table and the collective records (refresh every
// `refresh_s` seconds).
std::string render_html(const job_snapshot& snapshot, int refresh_s = 2);

// "1.5 KiB", "12.0 MiB"; "99999", "1.10T"; "45s", "12m03s", "3h04m", "2d03h".
std::string human_bytes(double bytes);
std::string human_count(std::uint64_t n);
std::string human_duration(double seconds);

}  // namespace troupe::actors
