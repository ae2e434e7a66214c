// The `troupe ps` / `troupe top` table, traffic rates between snapshots, and the HTML page.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "actors/introspection/render.hpp"

namespace troupe::actors {
namespace {

// Valid UTF-8 without control characters (C0, DEL, C1): a name cannot move the cursor of the
// terminal that shows it. Everything else becomes '?'.
std::string printable(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      out += (c < 0x20 || c == 0x7f) ? '?' : char(c);
      ++i;
      continue;
    }
    std::size_t n = c >= 0xf0 && c <= 0xf4 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 && c < 0xe0 ? 2 : 0;
    bool ok = n > 0 && i + n <= s.size();
    std::uint32_t cp = n == 2 ? c & 0x1f : n == 3 ? c & 0x0f : c & 0x07;
    for (std::size_t k = 1; ok && k < n; ++k) {
      auto d = static_cast<unsigned char>(s[i + k]);
      ok = (d & 0xc0) == 0x80;
      cp = (cp << 6) | (d & 0x3f);
    }
    // Overlong forms, surrogates, beyond U+10FFFF and C1 controls are refused.
    ok = ok && !(n == 3 && cp < 0x800) && !(n == 4 && (cp < 0x10000 || cp > 0x10ffff)) &&
         !(cp >= 0xd800 && cp <= 0xdfff) && !(cp >= 0x80 && cp < 0xa0);
    if (ok) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out += '?';
      ++i;
    }
  }
  return out;
}

// Columns a (valid UTF-8) string takes: one per code point.
std::size_t columns(std::string_view s) {
  return std::count_if(s.begin(), s.end(), [](char c) { return (c & 0xc0) != 0x80; });
}

// The first `n` columns of a (valid UTF-8) string.
std::string first_columns(std::string_view s, std::size_t n) {
  std::size_t cols = 0, i = 0;
  for (; i < s.size(); ++i) {
    if ((s[i] & 0xc0) != 0x80) {
      if (cols == n) break;
      ++cols;
    }
  }
  return std::string(s.substr(0, i));
}

std::string shorten(const std::string& s, std::size_t n) {
  return columns(s) <= n ? s : first_columns(s, n - 2) + "..";
}

std::string format(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

struct column {
  std::string header;
  bool right = false;  // numbers are right-aligned
};

// Aligns cells under headers, two spaces apart; trailing blanks are trimmed. When the table is
// wider than `width` (> 0), the columns in `shrink` give up columns in that order, each down to
// its minimum.
struct shrinkable {
  std::size_t column, minimum;
};
void table(std::string& out, const std::vector<column>& cols,
           std::vector<std::vector<std::string>> rows, int width = 0,
           const std::vector<shrinkable>& shrink = {}) {
  std::vector<std::size_t> w(cols.size());
  std::size_t total = 0;
  for (std::size_t c = 0; c < cols.size(); ++c) {
    w[c] = columns(cols[c].header);
    for (const auto& r : rows) w[c] = std::max(w[c], columns(r[c]));
    total += w[c] + (c ? 2 : 0);
  }
  for (auto [k, least] : shrink) {
    if (width <= 0 || total <= std::size_t(width) || k >= cols.size() || w[k] <= least) continue;
    const std::size_t excess = total - std::size_t(width);
    const std::size_t before = w[k];
    w[k] = excess >= w[k] - least ? least : w[k] - excess;
    total -= before - w[k];
    for (auto& r : rows) r[k] = shorten(r[k], w[k]);
  }
  auto line = [&](auto cell) {
    std::string l;
    for (std::size_t c = 0; c < cols.size(); ++c) {
      std::string v = cell(c);
      std::string pad(w[c] - columns(v), ' ');
      if (c) l += "  ";
      l += cols[c].right ? pad + v : v + pad;
    }
    while (!l.empty() && l.back() == ' ') l.pop_back();
    out += l + '\n';
  };
  line([&](std::size_t c) { return cols[c].header; });
  for (const auto& r : rows) line([&](std::size_t c) { return r[c]; });
}

std::string mesh_text(const std::map<std::string, int>& mesh) {
  std::string s;
  for (const auto& [k, v] : mesh) {
    if (!s.empty()) s += ',';
    s += k;
    s += '=';
    s += std::to_string(v);
  }
  return s.empty() ? "-" : printable(s);
}

std::string metrics_text(const std::map<std::string, double>& metrics) {
  std::string s;
  for (const auto& [k, v] : metrics) {
    if (!s.empty()) s += ' ';
    s += printable(k);
    s += '=';
    s += format("%.4g", v);
  }
  return s.empty() ? "-" : s;
}

// 35us, 1.2ms, then as human_duration.
std::string short_duration(double s) {
  if (!(s >= 0) || std::isinf(s)) return "-";
  if (s < 1e-3) return format("%.0fus", s * 1e6);
  if (s < 1) return format("%.1fms", s * 1e3);
  return human_duration(s);
}

std::string collective_cell(const actor_state& a) {
  const collective_op* op = key_collective(a);
  if (!op) return "-";
  std::size_t unfinished = 0;
  for (const auto& c : a.collectives) unfinished += !c.finished();
  std::string text = printable(collective_text(*op));
  if (unfinished > 1) text += " (+" + std::to_string(unfinished - 1) + " unfinished)";
  return text;
}

std::string cut_lines(const std::string& text, int width) {
  if (width <= 0) return text;
  std::string out;
  std::size_t start = 0;
  while (start < text.size()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line =
        first_columns(std::string_view(text).substr(start, end - start), std::size_t(width));
    while (!line.empty() && line.back() == ' ') line.pop_back();
    out += line + '\n';
    start = end + 1;
  }
  return out;
}

std::string render(const job_snapshot& s, int width,
                   const std::map<std::string, actor_rates>* rates) {
  std::string out;
  std::size_t alive = std::count_if(s.members.begin(), s.members.end(),
                                    [](const member_state& m) { return m.status == "alive"; });
  out += "job " + printable(s.job) + "  world " + std::to_string(s.world_size) + "  up " +
         human_duration(s.uptime_s) + "  members " + std::to_string(alive) + "/" +
         std::to_string(s.members.size()) + " alive  actors " + std::to_string(s.actors.size());
  if (rates) {
    double in = 0, outr = 0;
    for (const auto& [name, r] : *rates) in += r.bytes_in_per_s, outr += r.bytes_out_per_s;
    out += "  in " + human_bytes(in) + "/s  out " + human_bytes(outr) + "/s";
  }
  out += "\n\n";

  std::vector<std::vector<std::string>> rows;
  for (const auto& m : s.members)
    rows.push_back({std::to_string(m.rank), m.host.empty() ? "-" : printable(m.host),
                    std::to_string(m.pid), m.status.empty() ? "-" : printable(m.status),
                    human_duration(m.last_heartbeat_age_s)});
  if (rows.empty())
    out += "(no members)\n";
  else
    table(out, {{"RANK", true}, {"HOST"}, {"PID", true}, {"STATUS"}, {"HEARTBEAT", true}}, rows);
  out += '\n';

  std::vector<column> cols = {{"ACTOR"},          {"ROLE"},           {"RANK", true},
                              {"MESH"},           {"ACTIVITY"},       {"COLLECTIVE"},
                              {"MAILBOX", true},  {"MSGS IN", true},  {"MSGS OUT", true},
                              {"BYTES IN", true}, {"BYTES OUT", true}};
  if (rates) cols.insert(cols.end(), {{"IN/s", true}, {"OUT/s", true}});
  cols.insert(cols.end(), {{"UPTIME", true}, {"METRICS"}});
  rows.clear();
  for (const auto& a : s.actors) {
    std::vector<std::string> r = {printable(a.name),
                                  a.role.empty() ? "-" : printable(a.role),
                                  std::to_string(a.rank),
                                  mesh_text(a.mesh),
                                  a.activity.empty() ? "-" : shorten(printable(a.activity), 32),
                                  collective_cell(a),
                                  human_count(a.mailbox_depth),
                                  human_count(a.messages_received),
                                  human_count(a.messages_sent),
                                  human_bytes(double(a.bytes_received)),
                                  human_bytes(double(a.bytes_sent))};
    if (rates) {
      auto it = rates->find(a.name);
      r.push_back(it == rates->end() ? "-" : human_bytes(it->second.bytes_in_per_s));
      r.push_back(it == rates->end() ? "-" : human_bytes(it->second.bytes_out_per_s));
    }
    r.push_back(human_duration(a.uptime_s));
    r.push_back(metrics_text(a.metrics));
    rows.push_back(std::move(r));
  }
  if (rows.empty())
    out += "(no actors)\n";
  else
    // ACTIVITY gives way first, then COLLECTIVE down to its op, number, state and time.
    table(out, cols, std::move(rows), width, {{4, 12}, {5, 28}});
  return cut_lines(out, width);
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

}  // namespace

std::string human_bytes(double b) {
  if (!(b >= 0) || std::isinf(b)) return "-";
  if (b < 1023.5) return format("%.0f B", b);
  const char* units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  b /= 1024;
  while (b >= 1023.95 && u < 5) b /= 1024, ++u;  // what would print as 1024.0 goes up a unit
  return format("%.1f ", b) + units[u];
}

std::string human_count(std::uint64_t n) {
  if (n < 100000) return std::to_string(n);
  const char* units[] = {"k", "M", "G", "T", "P", "E"};
  double v = double(n);
  int u = -1;
  while (v >= 1000 && u < 5) v /= 1000, ++u;
  return format(v < 10 ? "%.2f" : v < 100 ? "%.1f" : "%.0f", v) + units[u];
}

std::string human_duration(double s) {
  if (!(s >= 0) || std::isinf(s)) return "-";
  if (s < 10) return format("%.1fs", s);
  auto t = static_cast<long long>(s);
  char buf[64];
  if (t < 60)
    std::snprintf(buf, sizeof buf, "%llds", t);
  else if (t < 3600)
    std::snprintf(buf, sizeof buf, "%lldm%02llds", t / 60, t % 60);
  else if (t < 86400)
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", t / 3600, t % 3600 / 60);
  else
    std::snprintf(buf, sizeof buf, "%lldd%02lldh", t / 86400, t % 86400 / 3600);
  return buf;
}

std::map<std::string, actor_rates> compute_rates(const job_snapshot& before,
                                                 const job_snapshot& after, double seconds) {
  std::map<std::string, actor_rates> rates;
  if (!(seconds > 0)) return rates;
  std::map<std::string, const actor_state*> old;
  for (const auto& a : before.actors) old[a.name] = &a;
  for (const auto& a : after.actors) {
    auto it = old.find(a.name);
    if (it == old.end()) continue;
    const actor_state& b = *it->second;
    if (a.bytes_received < b.bytes_received || a.bytes_sent < b.bytes_sent ||
        a.messages_received < b.messages_received || a.messages_sent < b.messages_sent)
      continue;  // restarted: its counters began again
    rates[a.name] = {double(a.bytes_received - b.bytes_received) / seconds,
                     double(a.bytes_sent - b.bytes_sent) / seconds,
                     double(a.messages_received - b.messages_received) / seconds,
                     double(a.messages_sent - b.messages_sent) / seconds};
  }
  return rates;
}

const collective_op* key_collective(const actor_state& a) {
  const collective_op* oldest = nullptr;  // unfinished, the largest age
  const collective_op* last = nullptr;    // finished, the latest end
  auto since_end = [](const collective_op& c) {
    return c.age_s - std::max(0.0, c.end_us - c.start_us) * 1e-6;
  };
  for (const auto& c : a.collectives) {
    if (!c.finished()) {
      if (!oldest || c.age_s > oldest->age_s) oldest = &c;
    } else if (!last || since_end(c) < since_end(*last) ||
               (since_end(c) == since_end(*last) && c.seq > last->seq)) {
      last = &c;
    }
  }
  return oldest ? oldest : last;
}

std::string collective_text(const collective_op& op) {
  std::string head = op.op + " #" + std::to_string(op.seq);
  if (!op.finished())
    return head + " " + op.state + " " + short_duration(op.age_s) + " on " + op.communicator;
  if (op.state == "done")
    return head + " done in " + short_duration((op.end_us - op.start_us) * 1e-6) + " on " +
           op.communicator;
  std::string cause = op.state.rfind("failed: ", 0) == 0 ? op.state.substr(8) : op.state;
  return head + " failed on " + op.communicator + ": " + cause;
}

std::string render_collectives(const job_snapshot& s, int width) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& a : s.actors)
    for (const auto& c : a.collectives)
      rows.push_back({printable(a.name), printable(c.communicator), std::to_string(c.seq),
                      printable(c.op), printable(c.dtype), human_count(c.count),
                      c.peer < 0 ? "-" : std::to_string(c.peer), printable(c.state),
                      short_duration(c.age_s),
                      c.finished() ? short_duration((c.end_us - c.start_us) * 1e-6) : "-"});
  if (rows.empty()) return "(no collectives)\n";
  std::string out;
  table(out,
        {{"ACTOR"},
         {"COMMUNICATOR"},
         {"SEQ", true},
         {"OP"},
         {"DTYPE"},
         {"COUNT", true},
         {"PEER", true},
         {"STATE"},
         {"AGE", true},
         {"TOOK", true}},
        std::move(rows), width, {{7, 12}});
  return cut_lines(out, width);
}

std::string render_table(const job_snapshot& s, int width) {
  return render(s, width, nullptr);
}

std::string render_table(const job_snapshot& s, int width,
                         const std::map<std::string, actor_rates>& rates) {
  return render(s, width, &rates);
}

std::string render_html(const job_snapshot& s, int refresh_s) {
  std::string title = html_escape(printable(s.job));
  return "<!doctype html>\n<html><head><meta charset=\"utf-8\">"
         "<meta http-equiv=\"refresh\" content=\"" +
         std::to_string(std::max(1, refresh_s)) + "\"><title>troupe: " + title +
         "</title>\n<style>body{font-family:sans-serif;margin:1.5em}"
         "pre{font-size:13px;line-height:1.3}</style></head>\n<body><h2>troupe job " +
         title + "</h2>\n<pre>" + html_escape(render_table(s, 0)) +
         "</pre>\n<h3>recent collectives</h3>\n<pre>" + html_escape(render_collectives(s, 0)) +
         "</pre>\n<p><a href=\"/\">dashboard</a> &middot; <a href=\"/json\">json</a> &middot; "
         "<a href=\"/metrics\">metrics</a> "
         "&middot; refreshes every " +
         std::to_string(std::max(1, refresh_s)) + " s</p>\n</body></html>\n";
}

}  // namespace troupe::actors
