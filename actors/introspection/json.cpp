// job_snapshot <-> JSON (nlohmann-json), the format of the endpoint's /json and `troupe ps --json`.
#include <nlohmann/json.hpp>

#include <cmath>
#include <limits>

#include "actors/introspection/render.hpp"

namespace troupe::actors {
namespace {
using json = nlohmann::json;

// NaN and infinities are not JSON: they are written as null and read back as NaN.
json number(double v) {
  return std::isfinite(v) ? json(v) : json(nullptr);
}

json to_j(const collective_op& c) {
  return {{"communicator", c.communicator},
          {"seq", c.seq},
          {"op", c.op},
          {"dtype", c.dtype},
          {"count", c.count},
          {"peer", c.peer},
          {"state", c.state},
          {"start_us", number(c.start_us)},
          {"end_us", number(c.end_us)},
          {"age_s", number(c.age_s)}};
}

json to_j(const std::map<std::string, double>& values) {
  json out = json::object();
  for (const auto& [k, v] : values) out[k] = number(v);
  return out;
}

json to_j(const step_sample& h) {
  return {{"step", h.step}, {"uptime_s", number(h.uptime_s)}, {"values", to_j(h.values)}};
}

json to_j(const actor_state& a) {
  json collectives = json::array();
  for (const auto& c : a.collectives) collectives.push_back(to_j(c));
  json history = json::array();
  for (const auto& h : a.history) history.push_back(to_j(h));
  return {{"name", a.name},
          {"role", a.role},
          {"rank", a.rank},
          {"mesh", a.mesh},
          {"activity", a.activity},
          {"mailbox_depth", a.mailbox_depth},
          {"messages_sent", a.messages_sent},
          {"messages_received", a.messages_received},
          {"bytes_sent", a.bytes_sent},
          {"bytes_received", a.bytes_received},
          {"uptime_s", number(a.uptime_s)},
          {"metrics", to_j(a.metrics)},
          {"collectives", collectives},
          {"history", history}};
}

json to_j(const membership_event& e) {
  return {{"uptime_s", number(e.uptime_s)},
          {"epoch", e.epoch},
          {"rank", e.rank},
          {"kind", e.kind},
          {"detail", e.detail}};
}

json to_j(const member_state& m) {
  return {{"rank", m.rank},
          {"host", m.host},
          {"pid", m.pid},
          {"status", m.status},
          {"last_heartbeat_age_s", number(m.last_heartbeat_age_s)}};
}

bool fits_int(const json& v) {
  if (v.is_number_unsigned()) return v.get<std::uint64_t>() <= std::numeric_limits<int>::max();
  if (!v.is_number_integer()) return false;
  auto x = v.get<std::int64_t>();
  return x >= std::numeric_limits<int>::min() && x <= std::numeric_limits<int>::max();
}

// Reads fields of one JSON object, remembering the first problem with its path.
class reader {
 public:
  reader(const json& j, std::string path, std::string* problem)
      : j_(j), path_(std::move(path)), problem_(problem) {
    if (!j_.is_object()) fail(path_, "expected an object");
  }
  bool ok() const { return problem_->empty(); }

  void get(const char* key, std::string& out) {
    if (const json* v = find(key)) {
      if (v->is_string())
        out = v->get<std::string>();
      else
        fail(at(key), "expected a string");
    }
  }
  void get(const char* key, int& out) {
    if (const json* v = find(key)) {
      if (fits_int(*v))
        out = v->get<int>();
      else
        fail(at(key), "expected an integer");
    }
  }
  void get(const char* key, std::uint64_t& out) {
    if (const json* v = find(key)) {
      if (v->is_number_unsigned())
        out = v->get<std::uint64_t>();
      else
        fail(at(key), "expected an unsigned integer");
    }
  }
  void get(const char* key, std::int64_t& out) {
    if (const json* v = find(key)) {
      if (v->is_number_integer() &&
          (!v->is_number_unsigned() ||
           v->get<std::uint64_t>() <= std::uint64_t(std::numeric_limits<std::int64_t>::max())))
        out = v->get<std::int64_t>();
      else
        fail(at(key), "expected an integer");
    }
  }
  void get(const char* key, double& out) {
    if (const json* v = find(key)) read_number(*v, at(key), out);
  }
  void get(const char* key, std::map<std::string, int>& out) {
    if (const json* v = find(key)) {
      if (!v->is_object()) return fail(at(key), "expected an object");
      for (const auto& [k, x] : v->items()) {
        if (!fits_int(x)) return fail(at(key) + "." + k, "expected an integer");
        out[k] = x.get<int>();
      }
    }
  }
  void get(const char* key, std::map<std::string, std::uint64_t>& out) {
    if (const json* v = find(key)) {
      if (!v->is_object()) return fail(at(key), "expected an object");
      for (const auto& [k, x] : v->items()) {
        if (!x.is_number_unsigned()) return fail(at(key) + "." + k, "expected an unsigned integer");
        out[k] = x.get<std::uint64_t>();
      }
    }
  }
  void get(const char* key, std::map<std::string, double>& out) {
    if (const json* v = find(key)) {
      if (!v->is_object()) return fail(at(key), "expected an object");
      for (const auto& [k, x] : v->items()) read_number(x, at(key) + "." + k, out[k]);
    }
  }
  const json* array(const char* key) {
    const json* v = find(key);
    if (v && !v->is_array()) {
      fail(at(key), "expected an array");
      return nullptr;
    }
    return v;
  }
  std::string at(const std::string& key) const { return path_.empty() ? key : path_ + "." + key; }

 private:
  const json* find(const char* key) {
    if (!ok() || !j_.is_object()) return nullptr;
    auto it = j_.find(key);
    return it == j_.end() ? nullptr : &*it;
  }
  void read_number(const json& v, const std::string& where, double& out) {
    if (v.is_number())
      out = v.get<double>();
    else if (v.is_null())
      out = std::numeric_limits<double>::quiet_NaN();
    else
      fail(where, "expected a number");
  }
  void fail(const std::string& where, const std::string& what) {
    if (problem_->empty()) *problem_ = (where.empty() ? "top level" : where) + ": " + what;
  }
  const json& j_;
  std::string path_;
  std::string* problem_;
};

}  // namespace

std::string to_json(const job_snapshot& s) {
  json members = json::array(), actors = json::array(), events = json::array();
  for (const auto& m : s.members) members.push_back(to_j(m));
  for (const auto& a : s.actors) actors.push_back(to_j(a));
  for (const auto& e : s.events) events.push_back(to_j(e));
  json counts = json::object();
  for (const auto& [kind, n] : s.event_counts) counts[kind] = n;
  json j = {{"job", s.job},          {"world_size", s.world_size}, {"uptime_s", number(s.uptime_s)},
            {"members", members},    {"actors", actors},           {"events", events},
            {"event_counts", counts}};
  // Names and activities come from user code: replace invalid UTF-8 instead of throwing.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

expected<job_snapshot> snapshot_from_json(std::string_view text, const std::string& source) {
  json j;
  try {
    j = json::parse(text.begin(), text.end());
  } catch (const json::parse_error& e) {
    return expected<job_snapshot>::failure(source + ": not valid JSON: " + e.what());
  }
  std::string problem;
  job_snapshot s;
  reader top(j, "", &problem);
  top.get("job", s.job);
  top.get("world_size", s.world_size);
  top.get("uptime_s", s.uptime_s);
  if (const json* ms = top.array("members")) {
    for (std::size_t i = 0; i < ms->size() && problem.empty(); ++i) {
      member_state m;
      reader r((*ms)[i], "members[" + std::to_string(i) + "]", &problem);
      r.get("rank", m.rank);
      r.get("host", m.host);
      r.get("pid", m.pid);
      r.get("status", m.status);
      r.get("last_heartbeat_age_s", m.last_heartbeat_age_s);
      s.members.push_back(std::move(m));
    }
  }
  if (const json* as = top.array("actors")) {
    for (std::size_t i = 0; i < as->size() && problem.empty(); ++i) {
      actor_state a;
      reader r((*as)[i], "actors[" + std::to_string(i) + "]", &problem);
      r.get("name", a.name);
      r.get("role", a.role);
      r.get("rank", a.rank);
      r.get("mesh", a.mesh);
      r.get("activity", a.activity);
      r.get("mailbox_depth", a.mailbox_depth);
      r.get("messages_sent", a.messages_sent);
      r.get("messages_received", a.messages_received);
      r.get("bytes_sent", a.bytes_sent);
      r.get("bytes_received", a.bytes_received);
      r.get("uptime_s", a.uptime_s);
      r.get("metrics", a.metrics);
      if (const json* cs = r.array("collectives")) {
        for (std::size_t k = 0; k < cs->size() && problem.empty(); ++k) {
          collective_op c;
          reader rc((*cs)[k], r.at("collectives[" + std::to_string(k) + "]"), &problem);
          rc.get("communicator", c.communicator);
          rc.get("seq", c.seq);
          rc.get("op", c.op);
          rc.get("dtype", c.dtype);
          rc.get("count", c.count);
          rc.get("peer", c.peer);
          rc.get("state", c.state);
          rc.get("start_us", c.start_us);
          rc.get("end_us", c.end_us);
          rc.get("age_s", c.age_s);
          a.collectives.push_back(std::move(c));
        }
      }
      if (const json* hs = r.array("history")) {
        for (std::size_t k = 0; k < hs->size() && problem.empty(); ++k) {
          step_sample h;
          reader rh((*hs)[k], r.at("history[" + std::to_string(k) + "]"), &problem);
          rh.get("step", h.step);
          rh.get("uptime_s", h.uptime_s);
          rh.get("values", h.values);
          a.history.push_back(std::move(h));
        }
      }
      s.actors.push_back(std::move(a));
    }
  }
  if (const json* es = top.array("events")) {
    for (std::size_t i = 0; i < es->size() && problem.empty(); ++i) {
      membership_event e;
      reader r((*es)[i], "events[" + std::to_string(i) + "]", &problem);
      r.get("uptime_s", e.uptime_s);
      r.get("epoch", e.epoch);
      r.get("rank", e.rank);
      r.get("kind", e.kind);
      r.get("detail", e.detail);
      s.events.push_back(std::move(e));
    }
  }
  top.get("event_counts", s.event_counts);
  if (!problem.empty()) return expected<job_snapshot>::failure(source + ": " + problem);
  return s;
}

}  // namespace troupe::actors
