// job_snapshot -> Prometheus text exposition format 0.0.4 (the endpoint's /metrics).
//
// Every family gets its HELP and TYPE lines before its samples; label values are escaped
// (backslash, double quote, newline) as the format requires.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "actors/introspection/render.hpp"

namespace troupe::actors {
namespace {

std::string escape_label(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\')
      out += "\\\\";
    else if (c == '"')
      out += "\\\"";
    else if (c == '\n')
      out += "\\n";
    else
      out += c;
  }
  return out;
}

std::string format_value(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  char buf[64];
  auto r = std::to_chars(buf, buf + sizeof buf, v);
  return std::string(buf, r.ptr);
}
std::string format_value(std::uint64_t v) {
  return std::to_string(v);
}

using labels = std::vector<std::pair<std::string, std::string>>;

class writer {
 public:
  void family(const char* name, const char* type, const char* help) {
    name_ = name;
    out_ += "# HELP ";
    out_ += name;
    out_ += ' ';
    out_ += help;
    out_ += "\n# TYPE ";
    out_ += name;
    out_ += ' ';
    out_ += type;
    out_ += '\n';
  }
  template <class T>
  void sample(const labels& ls, T value) {
    out_ += name_;
    if (!ls.empty()) {
      out_ += '{';
      for (std::size_t i = 0; i < ls.size(); ++i) {
        if (i) out_ += ',';
        out_ += ls[i].first;
        out_ += "=\"";
        out_ += escape_label(ls[i].second);
        out_ += '"';
      }
      out_ += '}';
    }
    out_ += ' ';
    out_ += format_value(value);
    out_ += '\n';
  }
  std::string take() { return std::move(out_); }

 private:
  std::string out_, name_;
};

std::string mesh_text(const std::map<std::string, int>& mesh) {
  std::string s;
  for (const auto& [k, v] : mesh) {
    if (!s.empty()) s += ',';
    s += k;
    s += '=';
    s += std::to_string(v);
  }
  return s;
}

}  // namespace

std::vector<collective_summary> summarize_collectives(const actor_state& a) {
  std::vector<collective_summary> out;
  for (const auto& op : a.collectives) {
    auto it = std::find_if(out.begin(), out.end(), [&](const collective_summary& c) {
      return c.communicator == op.communicator;
    });
    if (it == out.end()) {
      out.push_back({});
      it = std::prev(out.end());
      it->communicator = op.communicator;
    }
    it->last_seq = std::max(it->last_seq, op.seq);
    if (op.finished()) {
      it->last_completed_seq = std::max(it->last_completed_seq, op.seq);
    } else {
      ++it->unfinished;
      it->oldest_unfinished_s = std::max(it->oldest_unfinished_s, op.age_s);
    }
  }
  return out;
}

std::string to_prometheus(const job_snapshot& s) {
  writer w;
  w.family("troupe_job_info", "gauge", "The job this endpoint serves (always 1).");
  w.sample({{"name", s.job}}, 1.0);
  w.family("troupe_job_world_size", "gauge", "Number of ranks in the job.");
  w.sample({}, double(s.world_size));
  w.family("troupe_job_uptime_seconds", "gauge", "Seconds since the job started.");
  w.sample({}, s.uptime_s);
  w.family("troupe_job_events_total", "counter",
           "Events of the job's log by kind (joined, lost, recovery, ...).");
  for (const auto& [kind, n] : s.event_counts) w.sample({{"kind", kind}}, double(n));

  w.family("troupe_member_up", "gauge", "1 if the rank process is alive, else 0.");
  for (const auto& m : s.members)
    w.sample({{"rank", std::to_string(m.rank)}, {"host", m.host}, {"pid", std::to_string(m.pid)}},
             m.status == "alive" ? 1.0 : 0.0);
  w.family("troupe_member_heartbeat_age_seconds", "gauge",
           "Seconds since the coordinator last heard from the rank.");
  for (const auto& m : s.members)
    w.sample({{"rank", std::to_string(m.rank)}}, m.last_heartbeat_age_s);

  auto actor_labels = [](const actor_state& a) -> labels {
    return {{"actor", a.name}, {"role", a.role}, {"rank", std::to_string(a.rank)}};
  };
  w.family("troupe_actor_info", "gauge", "Actors of the job with their mesh coordinates (1).");
  for (const auto& a : s.actors) {
    auto ls = actor_labels(a);
    ls.emplace_back("mesh", mesh_text(a.mesh));
    w.sample(ls, 1.0);
  }
  struct counter {
    const char* name;
    const char* type;
    const char* help;
    std::uint64_t actor_state::*field;
  };
  const counter counters[] = {
      {"troupe_actor_mailbox_depth", "gauge", "Messages waiting in the actor's mailbox.",
       &actor_state::mailbox_depth},
      {"troupe_actor_messages_sent_total", "counter", "Messages the actor sent.",
       &actor_state::messages_sent},
      {"troupe_actor_messages_received_total", "counter", "Messages the actor received.",
       &actor_state::messages_received},
      {"troupe_actor_bytes_sent_total", "counter", "Bytes the actor sent (messages and data).",
       &actor_state::bytes_sent},
      {"troupe_actor_bytes_received_total", "counter", "Bytes the actor received.",
       &actor_state::bytes_received},
  };
  for (const auto& c : counters) {
    w.family(c.name, c.type, c.help);
    for (const auto& a : s.actors) w.sample(actor_labels(a), a.*(c.field));
  }
  w.family("troupe_actor_uptime_seconds", "gauge", "Seconds since the actor started.");
  for (const auto& a : s.actors) w.sample(actor_labels(a), a.uptime_s);
  struct per_comm {
    const actor_state* actor;
    collective_summary sum;
  };
  std::vector<per_comm> comms;
  for (const auto& a : s.actors)
    for (auto& c : summarize_collectives(a)) comms.push_back({&a, std::move(c)});
  auto comm_labels = [&](const per_comm& c) {
    auto ls = actor_labels(*c.actor);
    ls.emplace_back("communicator", c.sum.communicator);
    return ls;
  };
  w.family("troupe_collective_last_seq", "gauge",
           "The last sequence number the actor issued on the communicator.");
  for (const auto& c : comms) w.sample(comm_labels(c), c.sum.last_seq);
  w.family("troupe_collective_last_completed_seq", "gauge",
           "The highest sequence number that finished (done or failed) on the communicator.");
  for (const auto& c : comms) w.sample(comm_labels(c), c.sum.last_completed_seq);
  w.family("troupe_collective_unfinished", "gauge",
           "Operations the actor issued on the communicator that have not finished.");
  for (const auto& c : comms) w.sample(comm_labels(c), c.sum.unfinished);
  w.family("troupe_collective_oldest_unfinished_seconds", "gauge",
           "Seconds since the oldest unfinished operation was issued (0 when none).");
  for (const auto& c : comms) w.sample(comm_labels(c), c.sum.oldest_unfinished_s);
  w.family("troupe_actor_metric", "gauge",
           "Role-specific numbers of an actor (loss, step, bytes per tier...), by metric name.");
  for (const auto& a : s.actors)
    for (const auto& [k, v] : a.metrics) {
      auto ls = actor_labels(a);
      ls.emplace_back("metric", k);
      w.sample(ls, v);
    }
  return w.take();
}

}  // namespace troupe::actors
