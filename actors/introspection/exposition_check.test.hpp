// An independent reader of the Prometheus text exposition format 0.0.4, strict enough for tests:
// metric and label names, escaped label values, HELP/TYPE before samples, one TYPE per family,
// families contiguous, no duplicate series.
#pragma once

#include <cmath>
#include <cstdlib>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace troupe::actors::testing {

struct exposition_sample {
  std::string name;
  std::map<std::string, std::string> labels;  // values unescaped
  double value = 0;
};

struct exposition {
  std::vector<exposition_sample> samples;
  std::map<std::string, std::string> types, help;
  std::string error;  // empty when the text is valid

  // The value of the one sample with `name` whose labels include `with`; NaN when none.
  double value(const std::string& name, const std::map<std::string, std::string>& with) const {
    for (const auto& s : samples) {
      if (s.name != name) continue;
      bool all = true;
      for (const auto& [k, v] : with) all = all && s.labels.count(k) && s.labels.at(k) == v;
      if (all) return s.value;
    }
    return std::nan("");
  }
};

inline bool parse_prometheus_value(const std::string& t, double& v) {
  if (t == "NaN") return v = std::nan(""), true;
  if (t == "+Inf" || t == "Inf") return v = INFINITY, true;
  if (t == "-Inf") return v = -INFINITY, true;
  if (t.empty()) return false;
  char* end = nullptr;
  v = std::strtod(t.c_str(), &end);
  return *end == '\0' && t.find_first_of("xXnN") == std::string::npos;  // no hex, nan, inf words
}

// [a-zA-Z_:][a-zA-Z0-9_:]* for metric names, [a-zA-Z_][a-zA-Z0-9_]* for label names.
inline bool valid_name(const std::string& n, bool colon) {
  auto letter = [&](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (colon && c == ':');
  };
  if (n.empty() || !letter(n[0])) return false;
  for (char c : n)
    if (!letter(c) && !(c >= '0' && c <= '9')) return false;
  return true;
}

// "# HELP name doc" / "# TYPE name kind" -> name and the rest; false for other lines.
inline bool split_comment(const std::string& line, const char* what, std::string& name,
                          std::string& rest) {
  std::string prefix = std::string("# ") + what + " ";
  if (line.rfind(prefix, 0) != 0) return false;
  std::size_t sp = line.find(' ', prefix.size());
  if (sp == std::string::npos) return false;
  name = line.substr(prefix.size(), sp - prefix.size());
  rest = line.substr(sp + 1);
  return true;
}

inline exposition parse_exposition(const std::string& text) {
  static const std::set<std::string> kinds = {"counter", "gauge", "histogram", "summary",
                                              "untyped"};
  exposition e;
  if (!text.empty() && text.back() != '\n') e.error = "the last line does not end with \\n";
  std::set<std::string> closed, series;
  std::string current;  // family of the previous sample
  std::size_t start = 0;
  int line_no = 0;
  auto fail = [&](const std::string& why, const std::string& line) {
    if (e.error.empty()) e.error = "line " + std::to_string(line_no) + ": " + why + ": " + line;
  };
  while (start < text.size() && e.error.empty()) {
    std::size_t end = text.find('\n', start);
    if (end == std::string::npos) end = text.size();
    std::string line = text.substr(start, end - start);
    start = end + 1;
    ++line_no;
    if (line.empty()) continue;
    if (line[0] == '#') {
      std::string name, doc, kind;
      if (split_comment(line, "HELP", name, doc)) {
        if (!valid_name(name, true)) fail("bad metric name in HELP", line);
        if (e.help.count(name)) fail("second HELP", line);
        for (std::size_t i = 0; i < doc.size(); ++i)
          if (doc[i] == '\\' && (i + 1 == doc.size() || (doc[i + 1] != '\\' && doc[i + 1] != 'n')))
            fail("bad escape in HELP", line);
          else if (doc[i] == '\\')
            ++i;
        for (const auto& s : e.samples)
          if (s.name == name) fail("HELP after samples", line);
        e.help[name] = doc;
      } else if (split_comment(line, "TYPE", name, kind)) {
        if (!valid_name(name, true)) fail("bad metric name in TYPE", line);
        if (!kinds.count(kind)) fail("unknown type", line);
        if (e.types.count(name)) fail("second TYPE", line);
        for (const auto& s : e.samples)
          if (s.name == name) fail("TYPE after samples", line);
        e.types[name] = kind;
      }
      continue;  // other comments are allowed
    }
    exposition_sample s;
    std::size_t i = 0;
    while (i < line.size() && line[i] != '{' && line[i] != ' ' && line[i] != '\t') ++i;
    s.name = line.substr(0, i);
    if (!valid_name(s.name, true)) {
      fail("bad metric name", line);
      break;
    }
    std::string key = s.name + "{";
    if (i < line.size() && line[i] == '{') {
      ++i;
      while (i < line.size() && line[i] != '}') {
        std::size_t eq = line.find('=', i);
        if (eq == std::string::npos) {
          fail("label without '='", line);
          break;
        }
        std::string lname = line.substr(i, eq - i);
        if (!valid_name(lname, false)) fail("bad label name '" + lname + "'", line);
        i = eq + 1;
        if (i >= line.size() || line[i] != '"') {
          fail("label value not quoted", line);
          break;
        }
        std::string value;
        bool closed_quote = false;
        for (++i; i < line.size(); ++i) {
          if (line[i] == '"') {
            closed_quote = true;
            ++i;
            break;
          }
          if (line[i] == '\\') {
            if (i + 1 >= line.size()) break;
            char c = line[++i];
            if (c == '\\')
              value += '\\';
            else if (c == '"')
              value += '"';
            else if (c == 'n')
              value += '\n';
            else
              fail("bad escape in label value", line);
          } else {
            value += line[i];
          }
        }
        if (!closed_quote) {
          fail("unterminated label value", line);
          break;
        }
        if (s.labels.count(lname)) fail("repeated label", line);
        s.labels[lname] = value;
        if (i < line.size() && line[i] == ',') ++i;
      }
      if (i >= line.size() || line[i] != '}') {
        fail("labels not closed", line);
        break;
      }
      ++i;
    }
    for (const auto& [k, v] : s.labels) key += k + "=" + v + ",";
    if (i >= line.size() || line[i] != ' ') {
      fail("no space before the value", line);
      break;
    }
    std::string rest = line.substr(i + 1);
    std::string value_text = rest.substr(0, rest.find(' '));
    if (!parse_prometheus_value(value_text, s.value)) fail("bad value", line);
    if (rest.find(' ') != std::string::npos) {
      std::string ts = rest.substr(rest.find(' ') + 1);
      if (ts.empty() || ts.find_first_not_of("-0123456789") != std::string::npos)
        fail("bad timestamp", line);
    }
    // The family: the TYPE'd name equal to the sample name (counters and gauges here).
    if (!e.types.count(s.name)) fail("sample before its TYPE", line);
    if (!e.help.count(s.name)) fail("sample before its HELP", line);
    if (s.name != current) {
      if (closed.count(s.name)) fail("family not contiguous", line);
      if (!current.empty()) closed.insert(current);
      current = s.name;
    }
    if (!series.insert(key).second) fail("duplicate series", line);
    e.samples.push_back(std::move(s));
  }
  return e;
}

}  // namespace troupe::actors::testing
