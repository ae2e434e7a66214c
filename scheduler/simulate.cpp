// The schedule simulator: static dependency checks, then a dataflow run on a model clock.
#include "scheduler/simulate.hpp"

#include <algorithm>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

namespace troupe::scheduler {
namespace {

// A message: an activation or a gradient of one microbatch, named by the virtual stage that
// produced it.
struct msg_key {
  bool grad = false;
  int microbatch = 0;
  int producer = 0;  // virtual stage
  auto operator<=>(const msg_key&) const = default;
};

struct layout {
  int p = 1, v = 1;
  int vs(int stage, int chunk) const { return chunk * p + stage; }
  int stage_of(int vs) const { return vs % p; }
  int last() const { return p * v - 1; }
};

std::string where(int stage, std::size_t index, const action& a) {
  return "stage " + std::to_string(stage) + " action " + std::to_string(index) + " (" +
         describe(a) + ")";
}

// The message a transfer carries, or an error for a transfer that cannot exist.
msg_key key_of(const layout& l, int stage, std::size_t index, const action& a, std::string& err) {
  const int vs = l.vs(stage, a.chunk);
  int producer = vs, peer_vs = vs;
  bool grad = false;
  switch (a.kind) {
    case action_kind::send_activation:
      peer_vs = vs + 1;
      break;
    case action_kind::recv_activation:
      producer = peer_vs = vs - 1;
      break;
    case action_kind::send_grad:
      grad = true;
      peer_vs = vs - 1;
      break;
    case action_kind::recv_grad:
      grad = true;
      producer = peer_vs = vs + 1;
      break;
    default:
      break;
  }
  if (peer_vs < 0 || peer_vs > l.last()) {
    err = where(stage, index, a) + " has no peer: virtual stage " + std::to_string(vs) +
          (peer_vs < 0 ? " is the first" : " is the last");
  } else if (a.peer != l.stage_of(peer_vs)) {
    err = where(stage, index, a) + " names stage " + std::to_string(a.peer) +
          ", but virtual stage " + std::to_string(peer_vs) + " lives on stage " +
          std::to_string(l.stage_of(peer_vs));
  }
  return {grad, a.microbatch, producer};
}

// Walks each list in order and checks what a stage can know without the others: fields in range,
// inputs received before use, each compute once, sends after the compute that made their data,
// every forward matched by a backward, each weight pass once after its backward. Also fills the
// message keys of the transfers.
std::string check_lists(const std::vector<std::vector<action>>& lists, const layout& l,
                        std::vector<std::vector<msg_key>>& keys) {
  std::set<msg_key> sent, received;
  keys.assign(lists.size(), {});
  for (int s = 0; s < l.p; ++s) {
    using mc = std::pair<int, int>;
    std::set<mc> input, grad, fwd, bwd, wgt;
    auto& ks = keys[s];
    ks.resize(lists[s].size());
    for (std::size_t i = 0; i < lists[s].size(); ++i) {
      const action& a = lists[s][i];
      const mc id{a.microbatch, a.chunk};
      if (a.microbatch < 0 || a.chunk < 0 || a.chunk >= l.v)
        return where(s, i, a) + " has a negative microbatch or a chunk outside [0, " +
               std::to_string(l.v) + ")";
      if (!is_compute(a.kind)) {
        std::string err;
        ks[i] = key_of(l, s, i, a, err);
        if (!err.empty()) return err;
        auto& seen = is_send(a.kind) ? sent : received;
        if (!seen.insert(ks[i]).second) return where(s, i, a) + " repeats an earlier transfer";
      }
      const int vs = l.vs(s, a.chunk);
      switch (a.kind) {
        case action_kind::forward:
          if (fwd.count(id)) return where(s, i, a) + " runs a second time";
          if (vs != 0 && !input.count(id))
            return where(s, i, a) + " runs before a recv_activation brought its input";
          fwd.insert(id);
          break;
        case action_kind::backward:
          if (bwd.count(id)) return where(s, i, a) + " runs a second time";
          if (!fwd.count(id)) return where(s, i, a) + " runs before its forward";
          if (vs != l.last() && !grad.count(id))
            return where(s, i, a) + " runs before a recv_grad brought its output's gradient";
          bwd.insert(id);
          break;
        case action_kind::weight:
          if (wgt.count(id)) return where(s, i, a) + " runs a second time";
          if (!bwd.count(id)) return where(s, i, a) + " runs before its backward";
          wgt.insert(id);
          break;
        case action_kind::send_activation:
          if (!fwd.count(id)) return where(s, i, a) + " comes before the forward that makes it";
          break;
        case action_kind::send_grad:
          if (!bwd.count(id)) return where(s, i, a) + " comes before the backward that makes it";
          break;
        case action_kind::recv_activation:
          input.insert(id);
          break;
        case action_kind::recv_grad:
          grad.insert(id);
          break;
      }
    }
    for (const auto& id : fwd)
      if (!bwd.count(id))
        return "stage " + std::to_string(s) + ": forward microbatch " + std::to_string(id.first) +
               " chunk " + std::to_string(id.second) + " has no backward";
  }
  return {};
}

}  // namespace

simulation simulate(const std::vector<std::vector<action>>& lists, const cost& c, p2p_mode mode) {
  simulation r;
  const int p = static_cast<int>(lists.size());
  layout l{std::max(p, 1), 1};
  for (const auto& list : lists)
    for (const auto& a : list) l.v = std::max(l.v, a.chunk + 1);
  r.busy.assign(p, 0.0);
  r.idle.assign(p, 0.0);
  r.peak_in_flight.assign(p, 0);
  r.start.resize(p);
  r.finish.resize(p);
  for (int s = 0; s < p; ++s) {
    r.start[s].assign(lists[s].size(), -1.0);
    r.finish[s].assign(lists[s].size(), -1.0);
  }
  std::vector<std::vector<msg_key>> keys;
  if (p == 0) return r;
  r.error = check_lists(lists, l, keys);
  if (!r.error.empty()) return r;
  // The backwards whose weight pass is a separate action: they compute only the input gradient.
  std::vector<std::set<std::pair<int, int>>> split(p);
  for (int s = 0; s < p; ++s)
    for (const auto& a : lists[s])
      if (a.kind == action_kind::weight) split[s].insert({a.microbatch, a.chunk});
  for (int s = 0; s < p; ++s)
    if (!split[s].empty() && !(c.weight >= 0 && c.weight <= c.backward)) {
      std::ostringstream os;
      os << "stage " << s << " splits backwards into weight actions, but cost.weight = " << c.weight
         << " is not in [0, cost.backward = " << c.backward << "]";
      r.error = os.str();
      return r;
    }
  auto duration = [&](int s, const action& a) {
    switch (a.kind) {
      case action_kind::forward:
        return c.forward;
      case action_kind::weight:
        return c.weight;
      default:
        return split[s].count({a.microbatch, a.chunk}) ? c.backward - c.weight : c.backward;
    }
  };

  // Posted transfers: message -> post time of its send / receive.
  std::map<msg_key, double> send_post, recv_post;
  std::vector<std::size_t> pc(p, 0), group_end(p, 0);
  std::vector<double> t(p, 0.0);
  std::vector<int> in_flight(p, 0);
  std::vector<bool> posted(p, false);
  auto other_side = [&](int s, std::size_t i) -> const std::map<msg_key, double>& {
    return is_send(lists[s][i].kind) ? recv_post : send_post;
  };

  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < p; ++s) {
      const auto& list = lists[s];
      while (pc[s] < list.size()) {
        const action& a = list[pc[s]];
        if (is_compute(a.kind)) {
          // The compute waits for its own input, nothing else (a weight pass has none: its
          // backward ran earlier on this stage).
          if (mode == p2p_mode::async && a.kind != action_kind::weight) {
            const int vs = l.vs(s, a.chunk);
            const bool fwd = a.kind == action_kind::forward;
            if (fwd ? vs > 0 : vs < l.last()) {
              auto it = send_post.find({!fwd, a.microbatch, fwd ? vs - 1 : vs + 1});
              if (it == send_post.end()) break;
              t[s] = std::max(t[s], it->second + c.p2p);
            }
          }
          const double d = duration(s, a);
          r.start[s][pc[s]] = t[s];
          t[s] += d;
          r.finish[s][pc[s]] = t[s];
          r.busy[s] += d;
          // A split microbatch is held until its weight pass.
          if (a.kind == action_kind::forward)
            ++in_flight[s];
          else if (a.kind == action_kind::weight || !split[s].count({a.microbatch, a.chunk}))
            --in_flight[s];
          r.peak_in_flight[s] = std::max(r.peak_in_flight[s], in_flight[s]);
          ++pc[s];
          progress = true;
          continue;
        }
        if (mode == p2p_mode::async) {  // posted where the list has it; nobody waits here
          const std::size_t i = pc[s];
          (is_send(a.kind) ? send_post : recv_post)[keys[s][i]] = t[s];
          r.start[s][i] = r.finish[s][i] = t[s];
          ++pc[s];
          progress = true;
          continue;
        }
        if (!posted[s]) {
          std::size_t e = pc[s] + 1;
          if (mode == p2p_mode::batched)
            while (e < list.size() && !is_compute(list[e].kind)) ++e;
          for (std::size_t i = pc[s]; i < e; ++i) {
            (is_send(list[i].kind) ? send_post : recv_post)[keys[s][i]] = t[s];
            r.start[s][i] = t[s];
          }
          group_end[s] = e;
          posted[s] = true;
          progress = true;
        }
        bool all = true;
        double done = t[s];
        for (std::size_t i = pc[s]; i < group_end[s] && all; ++i) {
          const auto& peer = other_side(s, i);
          auto it = peer.find(keys[s][i]);
          if (it == peer.end()) {
            all = false;
          } else {
            r.finish[s][i] = std::max(r.start[s][i], it->second) + c.p2p;
            done = std::max(done, r.finish[s][i]);
          }
        }
        if (!all) break;
        t[s] = done;
        pc[s] = group_end[s];
        posted[s] = false;
        progress = true;
      }
    }
  }

  if (mode == p2p_mode::async) {
    // A stage stops only at a compute whose input was never sent; a send nobody receives would
    // leave the runner waiting for its completion at the end of the step. Name a stuck stage
    // whose input is nowhere in what its producer has left to run, else the first stuck one.
    int stuck = -1;
    std::string why;
    for (int s = 0; s < p; ++s) {
      if (pc[s] == lists[s].size()) continue;
      const action& a = lists[s][pc[s]];
      const bool fwd = a.kind == action_kind::forward;
      const int producer_vs = l.vs(s, a.chunk) + (fwd ? -1 : 1);
      const int q = l.stage_of(producer_vs);
      const msg_key want{!fwd, a.microbatch, producer_vs};
      bool pending = false;
      for (std::size_t j = pc[q]; j < lists[q].size() && !pending; ++j)
        pending = is_send(lists[q][j].kind) && keys[q][j] == want;
      if (stuck < 0 || !pending) {
        stuck = s;
        why = "deadlock: " + where(s, pc[s], a) + " can never proceed: its input from stage " +
              std::to_string(q) +
              (pending ? " waits behind that stage's own wait" : " is never sent");
        if (!pending) break;
      }
    }
    if (stuck >= 0) {
      r.error = why;
      return r;
    }
    for (const auto& [key, posted_at] : send_post)
      if (!recv_post.count(key)) {
        r.error = std::string("deadlock: a send of the ") + (key.grad ? "gradient" : "activation") +
                  " of microbatch " + std::to_string(key.microbatch) + " from virtual stage " +
                  std::to_string(key.producer) + " is never received";
        return r;
      }
  }

  // Deadlock: follow who waits for whom from the first stuck stage until a stage that finished
  // (nobody will ever answer) or a cycle, and name the transfer that waits there.
  auto blocked_at = [&](int s) {
    std::size_t i = pc[s];
    while (i < group_end[s] && other_side(s, i).count(keys[s][i])) ++i;
    return i < group_end[s] ? i : pc[s];
  };
  for (int s0 = 0; s0 < p; ++s0) {
    if (pc[s0] == lists[s0].size()) continue;
    std::vector<bool> seen(p, false);
    int s = s0;
    bool cycle = false;
    for (;;) {
      seen[s] = true;
      const int q = lists[s][blocked_at(s)].peer;
      if (pc[q] == lists[q].size()) break;
      if (seen[q]) {
        cycle = true;
        s = q;
        break;
      }
      s = q;
    }
    if (cycle) {  // name the cycle's lowest stage
      int low = s;
      for (int q = lists[s][blocked_at(s)].peer; q != s; q = lists[q][blocked_at(q)].peer)
        low = std::min(low, q);
      s = low;
    }
    const std::size_t i = blocked_at(s);
    const action& a = lists[s][i];
    const int q = a.peer;
    std::ostringstream os;
    os << "deadlock: " << where(s, i, a) << " can never proceed: stage " << q;
    if (pc[q] == lists[q].size()) {
      os << " finished without the matching transfer";
    } else {
      const std::size_t j = blocked_at(q);
      os << " waits at its action " << j << " (" << describe(lists[q][j]) << ")";
    }
    r.error = os.str();
    return r;
  }

  r.makespan = *std::max_element(t.begin(), t.end());
  double idle = 0;
  for (int s = 0; s < p; ++s) {
    r.idle[s] = r.makespan - r.busy[s];
    idle += r.idle[s];
  }
  r.bubble_fraction = r.makespan > 0 ? idle / (p * r.makespan) : 0.0;
  return r;
}

std::string timeline(const std::vector<std::vector<action>>& lists, const simulation& sim,
                     double unit) {
  int v = 1;
  for (const auto& list : lists)
    for (const auto& a : list) v = std::max(v, a.chunk + 1);
  auto label = [&](const action& a) {
    std::string s(1, a.kind == action_kind::forward  ? 'F'
                     : a.kind == action_kind::weight ? 'W'
                                                     : 'B');
    s += std::to_string(a.microbatch);
    if (v > 1) {
      s += '.';
      s += std::to_string(a.chunk);
    }
    return s;
  };
  std::size_t width = 2;
  for (const auto& list : lists)
    for (const auto& a : list)
      if (is_compute(a.kind)) width = std::max(width, label(a).size() + 1);
  const int cols = unit > 0 ? static_cast<int>(sim.makespan / unit + 0.999999) : 0;
  std::ostringstream os;
  for (std::size_t s = 0; s < lists.size() && s < sim.start.size(); ++s) {
    std::vector<std::string> cells(cols, ".");
    for (std::size_t i = 0; i < lists[s].size(); ++i) {
      if (!is_compute(lists[s][i].kind) || sim.start[s][i] < 0) continue;
      for (int k = 0; k < cols; ++k) {
        const double mid = (k + 0.5) * unit;
        if (mid >= sim.start[s][i] && mid < sim.finish[s][i]) cells[k] = label(lists[s][i]);
      }
    }
    os << "stage " << s << " |";
    for (auto& cell : cells) os << cell << std::string(width - cell.size(), ' ');
    os << "\n";
  }
  return os.str();
}

}  // namespace troupe::scheduler
