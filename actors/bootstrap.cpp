// Bootstrap: environment parsing for launcher, Slurm and torchrun ranks; hostfiles; tokens.
#include "actors/bootstrap.hpp"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sys/random.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>

namespace troupe::actors {
namespace {

std::string trim(std::string s) {
  const char* ws = " \t\r\n";
  const auto b = s.find_first_not_of(ws);
  if (b == std::string::npos) return {};
  return s.substr(b, s.find_last_not_of(ws) - b + 1);
}

// A non-negative integer variable; a failure names it and quotes the value.
expected<int> int_var(const char* name, const char* value) {
  if (!value || !*value) return expected<int>::failure(std::string(name) + " is not set");
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(value, &end, 10);
  if (errno != 0 || *end != '\0' || v < 0 || v > 1 << 24)
    return expected<int>::failure(std::string(name) + "=\"" + value +
                                  "\" is not a non-negative integer");
  return static_cast<int>(v);
}

bool is_loopback_name(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

// The token from TROUPE_TOKEN or the file named by TROUPE_TOKEN_FILE.
expected<std::string> token_from_env(const env_lookup& get, const std::string& source) {
  if (const char* t = get("TROUPE_TOKEN"); t && *t) return std::string(t);
  if (const char* f = get("TROUPE_TOKEN_FILE"); f && *f) return read_token_file(f);
  return expected<std::string>::failure(
      source +
      ": no job token: set TROUPE_TOKEN or TROUPE_TOKEN_FILE (every rank needs the same "
      "token)");
}

void fill_common(join_info& j, const env_lookup& get) {
  if (const char* b = get("TROUPE_BIND"); b && *b) j.bind = b;
  if (const char* d = get("TROUPE_NET_DEVICE"))
    j.net_device = d;
  else
    j.net_device = net_device_for(j.bind);
  if (const char* v = get("TROUPE_TLS_CERT")) j.tls.cert = v;
  if (const char* v = get("TROUPE_TLS_KEY")) j.tls.key = v;
  if (const char* v = get("TROUPE_TLS_CA")) j.tls.ca = v;
}

// Expands one host pattern with bracket groups ("rack[1-2]-n[01-02]") into `out`.
expected<bool> expand_one(const std::string& pattern, std::vector<std::string>& out) {
  const auto open = pattern.find('[');
  if (open == std::string::npos) {
    if (pattern.find(']') != std::string::npos)
      return expected<bool>::failure("unbalanced ']' in \"" + pattern + "\"");
    out.push_back(pattern);
    return true;
  }
  const auto close = pattern.find(']', open);
  if (close == std::string::npos)
    return expected<bool>::failure("unbalanced '[' in \"" + pattern + "\"");
  const std::string head = pattern.substr(0, open), tail = pattern.substr(close + 1);
  std::stringstream ranges(pattern.substr(open + 1, close - open - 1));
  std::string range;
  bool any = false;
  while (std::getline(ranges, range, ',')) {
    range = trim(range);
    const auto dash = range.find('-');
    const std::string lo = range.substr(0, dash);
    const std::string hi = dash == std::string::npos ? lo : range.substr(dash + 1);
    if (lo.empty() || hi.empty() || lo.find_first_not_of("0123456789") != std::string::npos ||
        hi.find_first_not_of("0123456789") != std::string::npos || lo.size() > 9 || hi.size() > 9)
      return expected<bool>::failure("bad range \"" + range + "\" in \"" + pattern + "\"");
    const long a = std::stol(lo), b = std::stol(hi);
    if (b < a || b - a > 100000)
      return expected<bool>::failure("bad range \"" + range + "\" in \"" + pattern + "\"");
    for (long v = a; v <= b; ++v) {
      std::string digits = std::to_string(v);
      if (digits.size() < lo.size()) digits.insert(0, lo.size() - digits.size(), '0');
      auto r = expand_one(head + digits + tail, out);
      if (!r) return r;
      any = true;
    }
  }
  if (!any) return expected<bool>::failure("empty brackets in \"" + pattern + "\"");
  return true;
}

}  // namespace

expected<std::vector<std::string>> expand_nodelist(const std::string& list) {
  using result = expected<std::vector<std::string>>;
  std::vector<std::string> hosts;
  std::string cur;
  int depth = 0;
  auto flush = [&]() -> expected<bool> {
    const std::string p = trim(cur);
    cur.clear();
    if (p.empty()) return true;
    return expand_one(p, hosts);
  };
  for (char c : list) {
    if (c == '[') ++depth;
    if (c == ']') --depth;
    if (depth < 0) return result::failure("Slurm node list \"" + list + "\": unbalanced ']'");
    if (c == ',' && depth == 0) {
      auto r = flush();
      if (!r) return result::failure("Slurm node list: " + r.error_message());
    } else {
      cur += c;
    }
  }
  if (depth != 0) return result::failure("Slurm node list \"" + list + "\": unbalanced '['");
  auto r = flush();
  if (!r) return result::failure("Slurm node list: " + r.error_message());
  if (hosts.empty()) return result::failure("Slurm node list \"" + list + "\" names no host");
  return hosts;
}

expected<join_info> join_info_from_env(const env_lookup& lookup) {
  using result = expected<join_info>;
  env_lookup get = lookup ? lookup : env_lookup([](const char* n) { return std::getenv(n); });
  join_info j;

  if (const char* c = get("TROUPE_COORDINATOR"); c && *c) {
    j.source = "troupe launch";
    j.coordinator = c;
    // TROUPE_JOIN=1 (troupe launch --join): a joiner, whose rank the coordinator gives.
    const char* joiner = get("TROUPE_JOIN");
    if (joiner && std::string(joiner) == "1") {
      j.rank = -1;
    } else {
      auto rank = int_var("TROUPE_RANK", get("TROUPE_RANK"));
      if (!rank) return result::failure(rank.error_message());
      j.rank = *rank;
    }
    if (const char* w = get("TROUPE_WORLD_SIZE"); w && *w) {
      auto ws = int_var("TROUPE_WORLD_SIZE", w);
      if (!ws) return result::failure(ws.error_message());
      j.world_size = *ws;
    }
    if (const char* l = get("TROUPE_LOCAL_RANK"); l && *l) {
      auto lr = int_var("TROUPE_LOCAL_RANK", l);
      if (!lr) return result::failure(lr.error_message());
      j.local_rank = *lr;
    }
    // Without a token the rank still asks, so that the coordinator refuses it (and logs who it
    // was): both sides then say what is wrong. A token file that cannot be read is an error here.
    const char* token = get("TROUPE_TOKEN");
    const char* file = get("TROUPE_TOKEN_FILE");
    if (token && *token) {
      j.token = token;
    } else if (file && *file) {
      auto t = read_token_file(file);
      if (!t) return result::failure(t.error_message());
      j.token = *t;
    }
    fill_common(j, get);
    return j;
  }

  auto port_from = [&](int fallback) -> expected<int> {
    if (const char* p = get("TROUPE_PORT"); p && *p) {
      auto v = int_var("TROUPE_PORT", p);
      if (!v || *v == 0 || *v > 65535)
        return expected<int>::failure(std::string("TROUPE_PORT=\"") + p + "\" is not a port");
      return *v;
    }
    return fallback;
  };

  if (const char* procid = get("SLURM_PROCID"); procid && *procid) {
    j.source = "slurm";
    auto rank = int_var("SLURM_PROCID", procid);
    if (!rank) return result::failure(rank.error_message());
    auto ws = int_var("SLURM_NTASKS", get("SLURM_NTASKS"));
    if (!ws) return result::failure(ws.error_message());
    j.rank = *rank;
    j.world_size = *ws;
    if (const char* l = get("SLURM_LOCALID"); l && *l) {
      auto lr = int_var("SLURM_LOCALID", l);
      if (!lr) return result::failure(lr.error_message());
      j.local_rank = *lr;
    }
    const char* list = get("SLURM_STEP_NODELIST");
    if (!list || !*list) list = get("SLURM_JOB_NODELIST");
    if (!list || !*list) list = get("SLURM_NODELIST");
    if (!list || !*list) return result::failure("SLURM_PROCID is set but SLURM_NODELIST is not");
    auto hosts = expand_nodelist(list);
    if (!hosts) return result::failure(hosts.error_message());
    auto port = port_from(default_coordinator_port);
    if (!port) return result::failure(port.error_message());
    auto token = token_from_env(get, "Slurm rank");
    if (!token) return result::failure(token.error_message());
    j.token = *token;
    fill_common(j, get);
    const bool one_host = hosts->size() == 1;
    j.coordinator =
        (one_host ? std::string("127.0.0.1") : hosts->front()) + ":" + std::to_string(*port);
    j.host_coordinator = j.rank == 0;
    const char* bind = get("TROUPE_BIND");
    if (!one_host && j.host_coordinator && (!bind || !*bind))
      return result::failure("SLURM_NODELIST names " + std::to_string(hosts->size()) +
                             " hosts: set TROUPE_BIND to an address of " + hosts->front() +
                             " the other hosts reach (e.g. 0.0.0.0), or all ranks stay local");
    j.coordinator_bind = one_host ? "127.0.0.1" : j.bind;
    return j;
  }

  if (const char* r = get("RANK"); r && *r && get("WORLD_SIZE") && get("MASTER_ADDR")) {
    j.source = "torchrun";
    auto rank = int_var("RANK", r);
    if (!rank) return result::failure(rank.error_message());
    auto ws = int_var("WORLD_SIZE", get("WORLD_SIZE"));
    if (!ws) return result::failure(ws.error_message());
    j.rank = *rank;
    j.world_size = *ws;
    if (const char* l = get("LOCAL_RANK"); l && *l) {
      auto lr = int_var("LOCAL_RANK", l);
      if (!lr) return result::failure(lr.error_message());
      j.local_rank = *lr;
    }
    auto mport = int_var("MASTER_PORT", get("MASTER_PORT"));
    if (!mport || *mport == 0 || *mport > 65535)
      return result::failure("torchrun rank: MASTER_PORT is missing or not a port");
    // torchrun's own agent listens on MASTER_PORT: the coordinator takes the next port.
    const char* elastic = get("TORCHELASTIC_RUN_ID");
    auto port = port_from(*mport + (elastic && *elastic ? 1 : 0));
    if (!port) return result::failure(port.error_message());
    auto token = token_from_env(get, "torchrun rank");
    if (!token) return result::failure(token.error_message());
    j.token = *token;
    fill_common(j, get);
    const std::string master = get("MASTER_ADDR");
    bool local = is_loopback_name(master);
    if (const char* lws = get("LOCAL_WORLD_SIZE"); lws && *lws) {
      auto v = int_var("LOCAL_WORLD_SIZE", lws);
      if (v && *v == j.world_size) local = true;
    }
    j.coordinator = (local ? std::string("127.0.0.1") : master) + ":" + std::to_string(*port);
    j.host_coordinator = j.rank == 0;
    const char* bind = get("TROUPE_BIND");
    if (!local && j.host_coordinator && (!bind || !*bind))
      return result::failure("MASTER_ADDR=" + master +
                             " is another host's: set TROUPE_BIND to an address the other hosts "
                             "reach (e.g. 0.0.0.0)");
    j.coordinator_bind = local ? "127.0.0.1" : j.bind;
    return j;
  }

  return result::failure(
      "this process was not started by `troupe launch`, Slurm or torchrun: no TROUPE_COORDINATOR, "
      "SLURM_PROCID or RANK/WORLD_SIZE/MASTER_ADDR in the environment (run it as `troupe launch "
      "-n N -- PROGRAM`)");
}

expected<std::vector<host_slots>> parse_hostfile_text(const std::string& text,
                                                      const std::string& source) {
  using result = expected<std::vector<host_slots>>;
  std::vector<host_slots> hosts;
  std::istringstream in(text);
  std::string line;
  int lineno = 0;
  while (std::getline(in, line)) {
    ++lineno;
    if (auto hash = line.find('#'); hash != std::string::npos) line.resize(hash);
    std::istringstream words(line);
    std::string host, word;
    if (!(words >> host)) continue;
    host_slots h{host, 1};
    while (words >> word) {
      const auto eq = word.find('=');
      const std::string key = word.substr(0, eq);
      if (eq == std::string::npos || (key != "slots" && key != "max_slots"))
        return result::failure(source + ":" + std::to_string(lineno) + ": unknown field \"" + word +
                               "\" (expected \"host slots=N\")");
      if (key == "max_slots") continue;
      auto n = int_var("slots", word.c_str() + eq + 1);
      if (!n || *n == 0)
        return result::failure(source + ":" + std::to_string(lineno) + ": \"" + word +
                               "\" is not a positive slot count");
      h.slots = *n;
    }
    for (const auto& other : hosts)
      if (other.host == h.host)
        return result::failure(source + ":" + std::to_string(lineno) + ": host \"" + h.host +
                               "\" is listed twice");
    hosts.push_back(h);
  }
  if (hosts.empty()) return result::failure(source + ": names no host");
  return hosts;
}

expected<std::vector<host_slots>> read_hostfile(const std::string& path) {
  std::ifstream f(path);
  if (!f)
    return expected<std::vector<host_slots>>::failure("cannot read hostfile " + path + ": " +
                                                      std::strerror(errno));
  std::stringstream ss;
  ss << f.rdbuf();
  return parse_hostfile_text(ss.str(), path);
}

expected<int> find_host_index(const std::vector<host_slots>& hosts) {
  std::vector<std::string> names;
  const std::string full = this_host();
  names.push_back(full);
  if (auto dot = full.find('.'); dot != std::string::npos) names.push_back(full.substr(0, dot));
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) == 0) {
    for (ifaddrs* i = ifs; i; i = i->ifa_next) {
      if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
      char buf[INET_ADDRSTRLEN];
      auto* sin = reinterpret_cast<sockaddr_in*>(i->ifa_addr);
      if (inet_ntop(AF_INET, &sin->sin_addr, buf, sizeof buf)) names.emplace_back(buf);
    }
    freeifaddrs(ifs);
  }
  for (std::size_t i = 0; i < hosts.size(); ++i) {
    std::string h = hosts[i].host;
    for (const auto& n : names)
      if (h == n || (h.find('.') != std::string::npos && h.substr(0, h.find('.')) == n))
        return static_cast<int>(i);
  }
  std::string tried;
  for (const auto& n : names) tried += (tried.empty() ? "" : ", ") + n;
  return expected<int>::failure("this host (" + tried +
                                ") is not in the hostfile: give --host-index");
}

std::string generate_token() {
  unsigned char raw[16];
  std::size_t got = 0;
  while (got < sizeof raw) {
    const ssize_t n = getrandom(raw + got, sizeof raw - got, 0);
    if (n < 0) {
      if (errno == EINTR) continue;
      TROUPE_FAIL("getrandom failed while generating the job token: ", std::strerror(errno));
    }
    got += static_cast<std::size_t>(n);
  }
  static const char* hex = "0123456789abcdef";
  std::string s;
  for (unsigned char c : raw) {
    s += hex[c >> 4];
    s += hex[c & 15];
  }
  return s;
}

expected<std::string> read_token_file(const std::string& path) {
  std::ifstream f(path);
  if (!f)
    return expected<std::string>::failure("cannot read token file " + path + ": " +
                                          std::strerror(errno));
  std::string line;
  std::getline(f, line);
  line = trim(line);
  if (line.empty()) return expected<std::string>::failure("token file " + path + " is empty");
  return line;
}

bool tokens_equal(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const std::size_t n = std::max(a.size(), b.size());
  for (std::size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= static_cast<unsigned char>(x ^ y);
  }
  return diff == 0 && !a.empty();
}

std::string net_device_for(const std::string& address) {
  if (address.empty() || address == "0.0.0.0" || address == "::") return {};
  if (is_loopback_name(address)) return "lo";
  in_addr want{};
  if (inet_pton(AF_INET, address.c_str(), &want) != 1) return {};
  std::string dev;
  ifaddrs* ifs = nullptr;
  if (getifaddrs(&ifs) != 0) return {};
  for (ifaddrs* i = ifs; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET) continue;
    if (reinterpret_cast<sockaddr_in*>(i->ifa_addr)->sin_addr.s_addr == want.s_addr) {
      dev = i->ifa_name;
      break;
    }
  }
  freeifaddrs(ifs);
  return dev;
}

std::string this_host() {
  char buf[256] = {};
  if (gethostname(buf, sizeof buf - 1) != 0 || !buf[0]) return "localhost";
  return buf;
}

}  // namespace troupe::actors
