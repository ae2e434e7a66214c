// Schedule generation: GPipe, 1F1B, eager 1F1B, zero-bubble and interleaved 1F1B as action lists
// (see pipeline.hpp).
#include "scheduler/pipeline.hpp"

#include <algorithm>
#include <map>
#include <stdexcept>
#include <tuple>

namespace troupe::scheduler {

std::string_view name(action_kind k) {
  switch (k) {
    case action_kind::forward:
      return "forward";
    case action_kind::backward:
      return "backward";
    case action_kind::weight:
      return "weight";
    case action_kind::send_activation:
      return "send_activation";
    case action_kind::recv_activation:
      return "recv_activation";
    case action_kind::send_grad:
      return "send_grad";
    case action_kind::recv_grad:
      return "recv_grad";
  }
  return "?";
}

std::string describe(const action& a) {
  std::string s = std::string(name(a.kind)) + " microbatch " + std::to_string(a.microbatch) +
                  " chunk " + std::to_string(a.chunk);
  if (is_send(a.kind)) s += " to stage " + std::to_string(a.peer);
  if (is_recv(a.kind)) s += " from stage " + std::to_string(a.peer);
  return s;
}

namespace {

void check_arguments(schedule_kind kind, int stage, int stages, int m, int v) {
  auto fail = [](const std::string& what) {
    throw std::invalid_argument("make_schedule: " + what);
  };
  if (stages < 1) fail("stages = " + std::to_string(stages) + " must be >= 1");
  if (stage < 0 || stage >= stages)
    fail("stage = " + std::to_string(stage) + " must be in [0, " + std::to_string(stages) + ")");
  if (m < 1) fail("microbatches = " + std::to_string(m) + " must be >= 1");
  if (kind == schedule_kind::interleaved) {
    if (stages < 2) fail("interleaved needs stages >= 2");
    if (v < 2) fail("interleaved needs virtual_stages >= 2, got " + std::to_string(v));
    if (m % stages != 0)
      fail("interleaved needs microbatches (" + std::to_string(m) +
           ") to be a multiple of stages (" + std::to_string(stages) + ")");
  } else if (v != 1) {
    fail("virtual_stages = " + std::to_string(v) + " needs the interleaved schedule, not " +
         std::string(name(kind)));
  }
}

// Builds one stage's list; receives may be emitted unlabelled (microbatch -1) and are labelled
// afterwards by matching them in order against the sender's sends on the same link, which is how
// Megatron's FIFO of received tensors pairs them.
class builder {
 public:
  builder(int stage, int stages) : s_(stage), p_(stages) {}

  void compute(action_kind k, int mb, int chunk) { out.push_back({k, mb, chunk, -1}); }

  // One batch of transfers in the order Megatron's _p2p_ops posts them. Sends name what they
  // carry; receives are labelled later (chunk: the local chunk they feed, when known).
  struct batch {
    const action* send_next = nullptr;  // activation to the next stage
    bool recv_prev = false;             // activation from the previous stage
    const action* send_prev = nullptr;  // gradient to the previous stage
    bool recv_next = false;             // gradient from the next stage
  };
  void transfers(const batch& b) {
    const int next = (s_ + 1) % p_, prev = (s_ - 1 + p_) % p_;
    auto send_next = [&] {
      if (b.send_next) out.push_back(*b.send_next);
    };
    auto send_prev = [&] {
      if (b.send_prev) out.push_back(*b.send_prev);
    };
    auto recv_prev = [&] {
      if (b.recv_prev) out.push_back({action_kind::recv_activation, -1, -1, prev});
    };
    auto recv_next = [&] {
      if (b.recv_next) out.push_back({action_kind::recv_grad, -1, -1, next});
    };
    if (s_ % 2 == 0) {
      send_next(), recv_prev(), send_prev(), recv_next();
    } else {
      recv_prev(), send_next(), recv_next(), send_prev();
    }
  }

  std::vector<action> out;

 private:
  int s_, p_;
};

action send_act(int mb, int chunk, int to) {
  return {action_kind::send_activation, mb, chunk, to};
}
action send_grad(int mb, int chunk, int to) {
  return {action_kind::send_grad, mb, chunk, to};
}

std::vector<action> gpipe(int s, int p, int m) {
  builder b(s, p);
  const bool first = s == 0, last = s == p - 1;
  for (int i = 0; i < m; ++i) {
    if (!first) b.transfers({.recv_prev = true});
    b.compute(action_kind::forward, i, 0);
    if (!last) {
      auto a = send_act(i, 0, s + 1);
      b.transfers({.send_next = &a});
    }
  }
  for (int i = 0; i < m; ++i) {
    if (!last) b.transfers({.recv_next = true});
    b.compute(action_kind::backward, i, 0);
    if (!first) {
      auto a = send_grad(i, 0, s - 1);
      b.transfers({.send_prev = &a});
    }
  }
  return b.out;
}

// Megatron's forward_backward_pipelining_without_interleaving; `warmup` forwards before the steady
// state (p - s - 1 for 1F1B, 2 (p - s - 1) for eager 1F1B).
std::vector<action> one_f_one_b(int s, int p, int m, int warmup) {
  builder b(s, p);
  const bool first = s == 0, last = s == p - 1;
  const int remaining = m - warmup;
  auto fwd_send = [&](int i) { return send_act(i, 0, s + 1); };
  auto bwd_send = [&](int i) { return send_grad(i, 0, s - 1); };
  for (int i = 0; i < warmup; ++i) {
    if (!first) b.transfers({.recv_prev = true});  // recv_forward
    b.compute(action_kind::forward, i, 0);
    if (!last) {
      auto a = fwd_send(i);
      b.transfers({.send_next = &a});  // send_forward
    }
  }
  if (remaining > 0 && !first) b.transfers({.recv_prev = true});  // recv_forward
  for (int k = 0; k < remaining; ++k) {
    const int f = warmup + k, g = k;
    b.compute(action_kind::forward, f, 0);
    if (!last) {
      auto a = fwd_send(f);
      b.transfers({.send_next = &a, .recv_next = true});  // send_forward_recv_backward
    }
    b.compute(action_kind::backward, g, 0);
    if (!first) {
      auto a = bwd_send(g);
      b.transfers({.recv_prev = k + 1 < remaining, .send_prev = &a});  // send_backward(_recv_fwd)
    }
  }
  for (int k = 0; k < warmup; ++k) {
    const int g = remaining + k;
    if (!last) b.transfers({.recv_next = true});  // recv_backward
    b.compute(action_kind::backward, g, 0);
    if (!first) {
      auto a = bwd_send(g);
      b.transfers({.send_prev = &a});  // send_backward
    }
  }
  return b.out;
}

// Zero-bubble: `eager` (one stage's eager 1F1B list) with a weight pass per backward, `deferred`
// backwards late. The weight pass of microbatch k - deferred runs right after the transfer batch
// that follows backward k (right after the backward when no transfer follows it); after the last
// backward's batch the stage runs the remaining ones, all in microbatch order.
std::vector<action> with_weight_passes(const std::vector<action>& eager, int deferred, int m) {
  std::vector<action> out;
  int done = 0, due = 0;  // weight passes listed / due at the end of the current batch
  for (std::size_t i = 0; i < eager.size(); ++i) {
    const action& a = eager[i];
    out.push_back(a);
    if (a.kind == action_kind::backward)
      due = a.microbatch == m - 1 ? m : std::max(due, a.microbatch - deferred + 1);
    if (i + 1 == eager.size() || is_compute(eager[i + 1].kind))
      for (; done < due; ++done) out.push_back({action_kind::weight, done, 0, -1});
  }
  return out;
}

int py_mod(int a, int n) {
  return ((a % n) + n) % n;
}

// Megatron's forward_backward_pipelining_with_interleaving (microbatch groups of p).
std::vector<action> interleaved(int s, int p, int m, int v) {
  builder b(s, p);
  const int total = m * v, group = p * v;
  auto fchunk = [&](int k) { return py_mod(k, group) / p; };
  auto bchunk = [&](int k) { return v - 1 - py_mod(k, group) / p; };
  auto mb = [&](int k) { return (k / group) * p + k % p; };
  auto first_vs = [&](int c) { return s == 0 && c == 0; };
  auto last_vs = [&](int c) { return s == p - 1 && c == v - 1; };
  const int next = (s + 1) % p, prev = (s - 1 + p) % p;
  const bool all_warmup = m == p;
  const int warmup = warmup_forwards(schedule_kind::interleaved, s, p, m, v);
  const int remaining = total - warmup;

  if (!first_vs(0)) b.transfers({.recv_prev = true});
  for (int k = 0; k < warmup; ++k) {
    const int c = fchunk(k);
    b.compute(action_kind::forward, mb(k), c);
    bool recv_prev = !(s == 0 && fchunk(k + 1) == 0) && k != total - 1;
    action out = send_act(mb(k), c, next);
    const action* send = last_vs(c) ? nullptr : &out;
    if (k == warmup - 1 && !all_warmup) {
      b.transfers({.send_next = send, .recv_prev = recv_prev, .recv_next = s != p - 1});
    } else {
      b.transfers({.send_next = send, .recv_prev = recv_prev});
    }
  }
  for (int k = 0; k < remaining; ++k) {
    const int fk = k + warmup, bk = k;
    const int fc = fchunk(fk), bc = bchunk(bk);
    b.compute(action_kind::forward, mb(fk), fc);
    b.compute(action_kind::backward, mb(bk), bc);
    action out = send_act(mb(fk), fc, next), grad = send_grad(mb(bk), bc, prev);
    // The first stage runs p - 1 forwards ahead of the last: it receives from the last stage only
    // while that one is not yet on its last chunk; symmetrically for gradients.
    bool recv_prev = s == 0 ? fchunk(fk - (p - 1)) != v - 1 : true;
    bool recv_next = s == p - 1 ? bchunk(bk - (p - 1)) != 0 : true;
    if (k == remaining - 1) recv_prev = false;
    b.transfers({.send_next = last_vs(fc) ? nullptr : &out,
                 .recv_prev = recv_prev,
                 .send_prev = first_vs(bc) ? nullptr : &grad,
                 .recv_next = recv_next});
  }
  if (all_warmup && s != p - 1) b.transfers({.recv_next = true});
  for (int k = remaining; k < total; ++k) {
    const int c = bchunk(k);
    b.compute(action_kind::backward, mb(k), c);
    bool recv_next = !(s == p - 1 && bchunk(k + 1) == v - 1) && k != total - 1;
    action grad = send_grad(mb(k), c, prev);
    b.transfers({.send_prev = first_vs(c) ? nullptr : &grad, .recv_next = recv_next});
  }
  return b.out;
}

std::vector<action> raw_schedule(schedule_kind kind, int s, int p, int m, int v) {
  switch (kind) {
    case schedule_kind::gpipe:
      return gpipe(s, p, m);
    case schedule_kind::one_f_one_b:
    case schedule_kind::eager_1f1b:
      return one_f_one_b(s, p, m, warmup_forwards(kind, s, p, m, v));
    case schedule_kind::zero_bubble: {
      auto eager = one_f_one_b(s, p, m, warmup_forwards(kind, s, p, m, v));
      // The first stage sends no input gradient: a split would gain it nothing.
      return s == 0 ? eager : with_weight_passes(eager, 2 * s, m);
    }
    case schedule_kind::interleaved:
      return interleaved(s, p, m, v);
  }
  return {};
}

// Labels the receives of `stage` in order with what the sender sends on the same link.
void label_receives(std::vector<std::vector<action>>& all, int stage) {
  const int p = static_cast<int>(all.size());
  // (sender, kind received) -> the sender's sends to `stage` of that kind, in order.
  std::map<std::pair<int, action_kind>, std::vector<const action*>> sends;
  std::map<std::pair<int, action_kind>, std::size_t> used;
  for (int q = 0; q < p; ++q)
    for (const auto& a : all[q])
      if (is_send(a.kind) && a.peer == stage) {
        auto k = a.kind == action_kind::send_activation ? action_kind::recv_activation
                                                        : action_kind::recv_grad;
        sends[{q, k}].push_back(&a);
      }
  for (auto& a : all[stage]) {
    if (!is_recv(a.kind) || a.microbatch >= 0) continue;
    auto key = std::make_pair(a.peer, a.kind);
    auto& i = used[key];
    auto it = sends.find(key);
    if (it == sends.end() || i >= it->second.size())
      throw std::logic_error("make_schedule: stage " + std::to_string(stage) + " receives more " +
                             std::string(name(a.kind)) + " from stage " + std::to_string(a.peer) +
                             " than that stage sends");
    const action& src = *it->second[i++];
    a.microbatch = src.microbatch;
    // Activations enter the same chunk on the next stage, or the next chunk after a wrap from the
    // last stage to the first; gradients the other way round.
    if (a.kind == action_kind::recv_activation) {
      a.chunk = stage == 0 ? src.chunk + 1 : src.chunk;
    } else {
      a.chunk = stage == p - 1 ? src.chunk - 1 : src.chunk;
    }
  }
}

}  // namespace

int warmup_forwards(schedule_kind kind, int stage, int stages, int microbatches,
                    int virtual_stages) {
  check_arguments(kind, stage, stages, microbatches, virtual_stages);
  switch (kind) {
    case schedule_kind::gpipe:
      return microbatches;
    case schedule_kind::one_f_one_b:
      return std::min(stages - stage - 1, microbatches);
    case schedule_kind::eager_1f1b:
    case schedule_kind::zero_bubble:
      return std::min(2 * (stages - stage - 1), microbatches);
    case schedule_kind::interleaved: {
      const int total = microbatches * virtual_stages;
      if (microbatches == stages) return total;
      return std::min((stages - stage - 1) * 2 + (virtual_stages - 1) * stages, total);
    }
  }
  return 0;
}

std::vector<std::vector<action>> make_schedules(schedule_kind kind, int stages, int microbatches,
                                                int virtual_stages) {
  check_arguments(kind, 0, stages, microbatches, virtual_stages);
  std::vector<std::vector<action>> all(stages);
  for (int s = 0; s < stages; ++s)
    all[s] = raw_schedule(kind, s, stages, microbatches, virtual_stages);
  for (int s = 0; s < stages; ++s) label_receives(all, s);
  return all;
}

std::vector<action> make_schedule(schedule_kind kind, int stage, int stages, int microbatches,
                                  int virtual_stages) {
  check_arguments(kind, stage, stages, microbatches, virtual_stages);
  auto all = make_schedules(kind, stages, microbatches, virtual_stages);
  return std::move(all[stage]);
}

}  // namespace troupe::scheduler
