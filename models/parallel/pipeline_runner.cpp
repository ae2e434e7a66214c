// pipeline_runner: one stage's pipeline schedule over a communicator (see pipeline_runner.hpp).
#include "models/parallel/pipeline_runner.hpp"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <exception>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models::parallel {

using scheduler::action;
using scheduler::action_kind;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// What an exception says, for the runner's "unusable" message.
std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "an exception that is not a std::exception";
  }
}

// Transfer buffers of runners that gave up a step (pipeline_runner::abandon): never freed.
std::mutex& graveyard_mutex() {
  static std::mutex m;
  return m;
}
std::vector<owned_tensor>& graveyard() {
  static auto* g = new std::vector<owned_tensor>;
  return *g;
}

// CPU time of the calling thread (for the trace: compute cost without the time others took).
double thread_cpu_seconds() {
  timespec ts{};
  if (clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts) != 0) return 0.0;
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

// On every link a -> b, the k-th message a sends must be the k-th b receives: same kind (the
// communicator has one FIFO per pair for activations and gradients alike) and microbatch.
void check_links(const std::vector<std::vector<action>>& all) {
  const int p = static_cast<int>(all.size());
  for (int a = 0; a < p; ++a)
    for (int b = 0; b < p; ++b) {
      std::vector<const action*> sent, received;
      for (const auto& x : all[a])
        if (scheduler::is_send(x.kind) && x.peer == b) sent.push_back(&x);
      for (const auto& x : all[b])
        if (scheduler::is_recv(x.kind) && x.peer == a) received.push_back(&x);
      TROUPE_CHECK(sent.size() == received.size(), "pipeline_runner: stage ", a, " sends ",
                   sent.size(), " messages to stage ", b, " which receives ", received.size());
      for (std::size_t k = 0; k < sent.size(); ++k) {
        bool act = sent[k]->kind == action_kind::send_activation;
        bool same = (act ? received[k]->kind == action_kind::recv_activation
                         : received[k]->kind == action_kind::recv_grad) &&
                    sent[k]->microbatch == received[k]->microbatch;
        TROUPE_CHECK(same, "pipeline_runner: message ", k, " from stage ", a, " to stage ", b,
                     " is '", scheduler::describe(*sent[k]), "' but stage ", b, " expects '",
                     scheduler::describe(*received[k]),
                     "' (send/recv between two ranks share one FIFO)");
      }
    }
}

}  // namespace

pipeline_runner::pipeline_runner(pipeline_stage& stage, collective::communicator& pp,
                                 const scheduler::parallel_plan& plan,
                                 collective::communicator* norm_group)
    : stage_(stage), pp_(pp), norm_group_(norm_group), plan_(plan) {
  TROUPE_CHECK(plan.pp == pp.size(), "pipeline_runner: parallel.pp is ", plan.pp,
               " but the pp communicator ", pp.name(), " has ", pp.size(), " ranks");
  TROUPE_CHECK(stage.stages() == plan.pp && stage.stage() == pp.rank(), "pipeline_runner: rank ",
               pp.rank(), " of ", pp.name(), " must run stage ", pp.rank(),
               " of parallel.pp = ", plan.pp, ", but its stage is ", stage.stage(), " of ",
               stage.stages());
  TROUPE_CHECK(stage.chunks() == plan.virtual_stages,
               "pipeline_runner: parallel.virtual_stages is ", plan.virtual_stages,
               " but the stage holds ", stage.chunks(), " chunks");
  TROUPE_CHECK(stage.tp().size() == plan.tp && stage.tp().sequence_parallel == plan.sp,
               "pipeline_runner: parallel.tp = ", plan.tp, " and parallel.sp = ", plan.sp,
               " but the stage's tensor group has ", stage.tp().size(), " ranks and sp ",
               stage.tp().sequence_parallel);
  TROUPE_CHECK(plan.recompute != scheduler::recompute_policy::selective,
               "pipeline_runner: parallel.recompute = selective is not supported by pipeline ",
               "stages (use full or none)");
  TROUPE_CHECK(plan.recompute != scheduler::recompute_policy::full || stage.recomputes(),
               "pipeline_runner: parallel.recompute = full but stage ", stage.stage(),
               " was built without recompute (set the model config's recompute)");
  TROUPE_CHECK(norm_group == nullptr || norm_group->size() == plan.pp * plan.tp,
               "pipeline_runner: the norm group ", norm_group ? norm_group->name() : "",
               " must hold the pp x tp = ", plan.pp * plan.tp, " ranks of one replica");
  TROUPE_CHECK(plan.pipe_p2p != scheduler::p2p_mode::blocking,
               "pipeline_runner: parallel.pipe_p2p = \"blocking\" is the simulator's only: ",
               "pipeline stages run \"async\" or \"batched\"");
  schedule(plan.microbatches);
  // parallel.pipe_p2p = "batched" waits for each of the list's transfer batches where it stands
  // (the schedule as Megatron runs it).
  batched_ = plan.pipe_p2p == scheduler::p2p_mode::batched;
  after_block_ = [this](std::int64_t block) {
    if (last_backward_ && hook_) hook_(block);
  };
}

const std::vector<action>& pipeline_runner::schedule(int microbatches) {
  if (microbatches == schedule_m_) return actions_;
  std::vector<std::vector<action>> all;
  try {
    all = scheduler::make_schedules(plan_.schedule, plan_.pp, microbatches, plan_.virtual_stages);
  } catch (const std::exception& e) {
    TROUPE_FAIL("pipeline_runner: parallel.schedule = ", scheduler::name(plan_.schedule),
                " with parallel.pp = ", plan_.pp,
                ", parallel.virtual_stages = ", plan_.virtual_stages, " and ", microbatches,
                " microbatches: ", e.what());
  }
  check_links(all);
  actions_ = std::move(all[static_cast<std::size_t>(stage_.stage())]);
  schedule_m_ = microbatches;
  split_.assign(static_cast<std::size_t>(microbatches * stage_.chunks()), 0);
  for (const auto& a : actions_)
    if (a.kind == action_kind::weight)
      split_[static_cast<std::size_t>(a.microbatch * stage_.chunks() + a.chunk)] = 1;
  // Before compute action i: post the receives listed up to the compute action after it.
  post_until_.assign(actions_.size(), actions_.size());
  std::size_t next = actions_.size();
  for (std::size_t i = actions_.size(); i-- > 0;)
    if (scheduler::is_compute(actions_[i].kind)) {
      post_until_[i] = next;
      next = i;
    }
  return actions_;
}

bool pipeline_runner::set_block_grads_hook(std::function<void(std::int64_t block)> f) {
  hook_ = std::move(f);
  return true;
}

double pipeline_runner::bubble_fraction() const {
  if (timing_.schedule_s <= 0) return 0.0;
  return std::clamp(1.0 - timing_.compute_s / timing_.schedule_s, 0.0, 1.0 - 1e-12);
}

double pipeline_runner::step_bubble_fraction() const {
  if (timing_.wall_s <= 0) return 0.0;
  return std::clamp(1.0 - timing_.compute_s / timing_.wall_s, 0.0, 1.0 - 1e-12);
}

double pipeline_runner::ideal_bubble_fraction(int stages, int microbatches, int virtual_stages) {
  double idle = stages - 1;
  return idle / (static_cast<double>(virtual_stages) * microbatches + idle);
}

int pipeline_runner::take_buffer() {
  if (free_.empty()) {
    pool_.push_back(empty(stage_.boundary(), stage_.boundary_type()));
    return static_cast<int>(pool_.size()) - 1;
  }
  int i = free_.back();
  free_.pop_back();
  return i;
}

int& pipeline_runner::table(action_kind k, int mb, int chunk) {
  auto i = static_cast<std::size_t>(mb * stage_.chunks() + chunk);
  switch (k) {
    case action_kind::recv_activation:
      return act_in_[i];
    case action_kind::send_activation:
      return act_out_[i];
    case action_kind::recv_grad:
      return grad_in_[i];
    default:
      return grad_out_[i];
  }
}

double pipeline_runner::now() const {
  return seconds_since(t0_);
}

double pipeline_runner::forward_backward(int microbatches,
                                         const std::function<microbatch_data(int k)>& fetch) {
  TROUPE_CHECK(broken_.empty(), "pipeline_runner: stage ", stage_.stage(),
               " cannot run another step: an earlier step failed in its transfers over ",
               pp_.name(), " (", broken_, "); that communicator is unusable, build a new runner ",
               "over a new one");
  t0_ = std::chrono::steady_clock::now();
  const auto& acts = schedule(microbatches);
  stage_.begin_step(microbatches);
  const auto slots = static_cast<std::size_t>(microbatches * stage_.chunks());
  for (auto* t : {&act_in_, &act_out_, &grad_in_, &grad_out_}) t->assign(slots, -1);
  recv_work_.assign(2 * slots, collective::work{});
  backwards_done_.assign(static_cast<std::size_t>(stage_.chunks()), 0);
  grads_done_.assign(static_cast<std::size_t>(stage_.chunks()), 0);
  free_.clear();
  for (int i = static_cast<int>(pool_.size()) - 1; i >= 0; --i) free_.push_back(i);
  sends_.clear();
  next_recv_ = 0;
  trace_.clear();
  fetched_ = -1;
  for (auto& k : kept_) k.data = microbatch_data{};
  loss_sum_ = 0;
  failure_ = nullptr;
  timing_ = {};
  timing_.microbatches = microbatches;

  int failed_stage = -1;
  try {
    run_schedule(acts, fetch);
    reap_sends(true);
    timing_.schedule_s = now();
    for (int c = 0; c < stage_.chunks(); ++c)
      TROUPE_CHECK(backwards_done_[c] == microbatches && grads_done_[c] == microbatches,
                   "pipeline_runner: stage ", stage_.stage(), " ran ", backwards_done_[c],
                   " backwards of chunk ", c, " and completed the gradients of ", grads_done_[c],
                   " for ", microbatches, " microbatches");
    const double tw = now();
    exchange_tied_grad();
    failed_stage = share_loss(failure_ ? stage_.stage() : -1);
    timing_.wait_s += now() - tw;
  } catch (...) {
    // A transfer failed (or a check of the runner's own bookkeeping): nothing says which of the
    // posted operations the peers will still match, so the runner stops here for good.
    auto e = std::current_exception();
    abandon(what_of(e));
    std::rethrow_exception(failure_ ? failure_ : e);
  }
  timing_.wall_s = now();
  ++steps_;
  if (!trace_path_.empty()) write_trace();
  if (failure_) std::rethrow_exception(failure_);
  TROUPE_CHECK(failed_stage < 0, "pipeline_runner: stage ", stage_.stage(), ": pipeline stage ",
               failed_stage, " failed during step ", steps_,
               " (its own error says why); this stage ran the rest of the step's transfers ",
               "without computing, so its gradients and the loss are not valid");
  return loss_sum_;
}

void pipeline_runner::run_schedule(const std::vector<action>& acts,
                                   const std::function<microbatch_data(int k)>& fetch) {
  for (std::size_t i = 0; i < acts.size(); ++i) {
    const action& a = acts[i];
    if (scheduler::is_compute(a.kind)) {
      if (!batched_) post_receives(post_until_[i]);
      wait_input(a);
      const double tc = now(), cc = thread_cpu_seconds();
      if (failure_ == nullptr) {
        try {
          if (a.kind == action_kind::forward)
            forward(a, fetch);
          else if (a.kind == action_kind::backward)
            backward(a);
          else
            weight(a);
        } catch (...) {
          // This stage's compute failed (fetch, the model, the block hook): it keeps to the
          // list's transfers without computing, so no peer waits forever and nothing stays
          // posted, and throws at the end of the step.
          failure_ = std::current_exception();
          last_backward_ = false;
          skip(a);
        }
      } else {
        skip(a);
      }
      const double te = now();
      timing_.compute_s += te - tc;
      trace_.push_back({a, tc, te, thread_cpu_seconds() - cc});
      reap_sends(false);
    } else if (batched_) {  // the list's batch: post it, then wait for all of it
      std::size_t j = i;
      for (; j < acts.size() && !scheduler::is_compute(acts[j].kind); ++j)
        if (scheduler::is_send(acts[j].kind)) post_send(acts[j]);
      post_receives(j);
      reap_sends(true);
      for (; i < j; ++i)
        if (scheduler::is_recv(acts[i].kind)) wait_recv(acts[i]);
      --i;
    } else if (scheduler::is_send(a.kind)) {
      post_send(a);
    } else {
      post_receives(i + 1);
    }
  }
}

void pipeline_runner::skip(const action& a) {
  const int mb = a.microbatch, c = a.chunk;
  if (a.kind == action_kind::weight) {
    ++grads_done_[c];
    return;  // nothing to hand back or send; begin_step drops the queued gradients
  }
  const bool fwd = a.kind == action_kind::forward;
  const bool first = stage_.holds_first(c), last = stage_.holds_last(c);
  int& in = table(fwd ? action_kind::recv_activation : action_kind::recv_grad, mb, c);
  if (in >= 0) {
    free_.push_back(in);
    in = -1;
  }
  if (fwd ? !last : !first) {
    int& out = table(fwd ? action_kind::send_activation : action_kind::send_grad, mb, c);
    if (out < 0) out = take_buffer();
    ops::fill(pool_[out], std::numeric_limits<double>::quiet_NaN());
  }
  if (!fwd) {
    ++backwards_done_[c];
    if (!split(mb, c)) ++grads_done_[c];
  }
}

void pipeline_runner::abandon(const std::string& why) {
  broken_ = why.empty() ? std::string("unknown error") : why;
  pp_.abort("pipeline stage " + std::to_string(stage_.stage()) + " gave up its step: " + broken_);
  // Receives and sends the transport may still hold point into these buffers, and a transport
  // cannot cancel them: keep them alive for the life of the process (a few boundary tensors).
  std::lock_guard lock(graveyard_mutex());
  for (auto& b : pool_) graveyard().push_back(std::move(b));
  if (tied_recv_.defined()) graveyard().push_back(std::move(tied_recv_));
  if (msg_.defined()) graveyard().push_back(std::move(msg_));
  pool_.clear();
  free_.clear();
  sends_.clear();
  recv_work_.clear();
  pending_.clear();
}

void pipeline_runner::post_receives(std::size_t until) {
  const auto n = static_cast<std::size_t>(stage_.boundary().numel());
  for (; next_recv_ < until; ++next_recv_) {
    const action& a = actions_[next_recv_];
    if (!scheduler::is_recv(a.kind)) continue;
    int& buf = table(a.kind, a.microbatch, a.chunk);
    TROUPE_CHECK(buf < 0, "pipeline_runner: stage ", stage_.stage(), " would ",
                 scheduler::describe(a), " twice");
    buf = take_buffer();
    const auto k = static_cast<std::size_t>(a.microbatch * stage_.chunks() + a.chunk) * 2 +
                   (a.kind == action_kind::recv_grad ? 1 : 0);
    recv_work_[k] = pp_.recv(pool_[buf].data(), n, stage_.boundary_type(), a.peer);
  }
}

void pipeline_runner::wait_input(const action& a) {
  const int p = stage_.stages(), s = stage_.stage();
  if (a.kind == action_kind::forward && !stage_.holds_first(a.chunk))
    wait_recv({action_kind::recv_activation, a.microbatch, a.chunk, (s - 1 + p) % p});
  if (a.kind == action_kind::backward && !stage_.holds_last(a.chunk))
    wait_recv({action_kind::recv_grad, a.microbatch, a.chunk, (s + 1) % p});
}

void pipeline_runner::wait_recv(const action& r) {
  auto& w = recv_work_[static_cast<std::size_t>(r.microbatch * stage_.chunks() + r.chunk) * 2 +
                       (r.kind == action_kind::recv_grad ? 1 : 0)];
  if (!w.valid()) return;  // waited already, or never posted (forward / backward name it)
  const double t = now();
  w.wait();
  w = collective::work{};
  const double e = now();
  timing_.wait_s += e - t;
  trace_.push_back({r, t, e});
}

void pipeline_runner::post_send(const action& a) {
  int& buf = table(a.kind, a.microbatch, a.chunk);
  TROUPE_CHECK(buf >= 0, "pipeline_runner: stage ", stage_.stage(), " would ",
               scheduler::describe(a), " before computing it");
  const auto n = static_cast<std::size_t>(stage_.boundary().numel());
  const double t = now();
  sends_.push_back(
      {pp_.send(pool_[buf].data(), n, stage_.boundary_type(), a.peer), buf, trace_.size()});
  trace_.push_back({a, t, t});
  buf = -1;
  if (static_cast<int>(sends_.size()) > max_sends) {
    const double tw = now();
    sends_.front().w.wait();
    timing_.wait_s += now() - tw;
    reap_sends(false);
  }
}

void pipeline_runner::reap_sends(bool all) {
  const double tw = now();
  std::size_t done = 0;
  for (; done < sends_.size(); ++done) {
    auto& s = sends_[done];
    if (all)
      s.w.wait();
    else if (!s.w.test())
      break;
    free_.push_back(s.buffer);
    trace_[s.event].end_s = now();
  }
  sends_.erase(sends_.begin(), sends_.begin() + static_cast<std::ptrdiff_t>(done));
  if (all) timing_.wait_s += now() - tw;
}

void pipeline_runner::trace_to(const std::string& prefix) {
  if (prefix.empty()) {
    trace_path_.clear();
    return;
  }
  const std::string path = prefix + ".stage" + std::to_string(stage_.stage()) + "." +
                           std::to_string(::getpid()) + ".txt";
  // Opened (and created) now, so a folder that is not there fails before the first step.
  std::FILE* f = std::fopen(path.c_str(), "a");
  TROUPE_CHECK(f != nullptr, "parallel.pipe_trace (--pipe-trace) ", prefix, ": cannot open ", path,
               " for appending: ", std::strerror(errno));
  std::fclose(f);
  trace_path_ = path;
}

void pipeline_runner::write_trace() {
  std::FILE* f = std::fopen(trace_path_.c_str(), "a");
  TROUPE_CHECK(f != nullptr, "parallel.pipe_trace (--pipe-trace): cannot open ", trace_path_,
               " for appending: ", std::strerror(errno));
  for (const auto& e : trace_)
    std::fprintf(f, "%d %s %d %d %.3f %.3f %.3f\n", steps_, std::string(name(e.what.kind)).c_str(),
                 e.what.microbatch, e.what.chunk, e.start_s * 1e3, e.end_s * 1e3, e.cpu_s * 1e3);
  std::fprintf(f, "%d wall -1 -1 0 %.3f 0\n", steps_, timing_.wall_s * 1e3);
  // The step's start on the machine's monotonic clock (steady_clock, shared by the processes of
  // one host), so a reader can put the stages' traces on one time line.
  std::fprintf(f, "%d t0 -1 -1 0 %.3f 0\n", steps_,
               std::chrono::duration<double, std::milli>(t0_.time_since_epoch()).count());
  std::fclose(f);
}

void pipeline_runner::forward(const action& a, const std::function<microbatch_data(int k)>& fetch) {
  const int mb = a.microbatch, c = a.chunk;
  const bool first = stage_.holds_first(c), last = stage_.holds_last(c);
  tensor in, targets, y;
  double weight = 0;
  const microbatch_data* d = nullptr;
  if (every_stage_reads_) {
    d = &keep(mb, fetch);
  } else if (first || last) {
    TROUPE_CHECK(mb > fetched_, "pipeline_runner: stage ", stage_.stage(),
                 " would fetch microbatch ", mb, " after ", fetched_, " (fetches must ascend)");
    data_ = fetch(mb);
    fetched_ = mb;
    d = &data_;
  }
  if (d != nullptr) {
    if (first) in = d->ids;
    if (last) {
      targets = d->targets;
      weight = d->weight;
    }
    stage_.next_packing(d->segments, d->positions);
  }
  int& in_buf = table(action_kind::recv_activation, mb, c);
  if (!first) {
    TROUPE_CHECK(in_buf >= 0, "pipeline_runner: stage ", stage_.stage(),
                 " runs forward of microbatch ", mb, " chunk ", c,
                 " before its activation arrived");
    in = pool_[in_buf];
  }
  if (!last) {
    int& out = table(action_kind::send_activation, mb, c);
    out = take_buffer();
    y = pool_[out];
  }
  if (last) stage_.next_objective(d->objective);
  double loss = stage_.forward(mb, c, in, targets, weight, y);
  if (!first) {
    free_.push_back(in_buf);
    in_buf = -1;
  }
  if (last) loss_sum_ += weight * loss;
}

const microbatch_data& pipeline_runner::keep(int mb,
                                             const std::function<microbatch_data(int k)>& fetch) {
  if (kept_.size() < static_cast<std::size_t>(mb) + 1)
    kept_.resize(static_cast<std::size_t>(mb) + 1);
  auto& k = kept_[static_cast<std::size_t>(mb)];
  if (mb <= fetched_) {
    TROUPE_CHECK(k.data.ids.defined(), "pipeline_runner: stage ", stage_.stage(),
                 " runs a forward of microbatch ", mb,
                 " whose data it did not read (it read up to ", fetched_, ")");
    return k.data;
  }
  // A stage's first forward of each microbatch comes in ascending order (chunk 0's).
  microbatch_data got = fetch(mb);
  fetched_ = mb;
  const auto own = [](const tensor& t, owned_tensor& o) -> tensor {
    if (!t.defined()) return {};
    if (!o.defined() || o.sizes() != t.sizes() || o.type() != t.type())
      o = empty(t.sizes(), t.type());
    ops::copy(t, o);
    return o.view();
  };
  k.data.ids = own(got.ids, k.ids);
  k.data.targets = own(got.targets, k.targets);
  k.data.segments = own(got.segments, k.segments);
  k.data.positions = own(got.positions, k.positions);
  k.data.weight = got.weight;
  k.data.objective = std::move(got.objective);
  return k.data;
}

void pipeline_runner::backward(const action& a) {
  const int mb = a.microbatch, c = a.chunk;
  const bool first = stage_.holds_first(c), last = stage_.holds_last(c);
  tensor dy, dx;
  int& in_buf = table(action_kind::recv_grad, mb, c);
  if (!last) {
    TROUPE_CHECK(in_buf >= 0, "pipeline_runner: stage ", stage_.stage(),
                 " runs backward of microbatch ", mb, " chunk ", c, " before its gradient arrived");
    dy = pool_[in_buf];
  }
  if (!first) {
    int& out = table(action_kind::send_grad, mb, c);
    out = take_buffer();
    dx = pool_[out];
  }
  const bool split_here = split(mb, c);
  last_backward_ = !split_here && grads_done_[c] + 1 == schedule_m_;
  stage_.backward(mb, c, dy, dx, after_block_, split_here);
  last_backward_ = false;
  ++backwards_done_[c];
  if (!split_here) ++grads_done_[c];
  if (!last) {
    free_.push_back(in_buf);
    in_buf = -1;
  }
}

void pipeline_runner::weight(const action& a) {
  const int c = a.chunk;
  last_backward_ = grads_done_[c] + 1 == schedule_m_;
  stage_.weight(a.microbatch, c, after_block_);
  last_backward_ = false;
  ++grads_done_[c];
}

bool pipeline_runner::split(int mb, int chunk) const {
  return split_[static_cast<std::size_t>(mb * stage_.chunks() + chunk)] != 0;
}

int pipeline_runner::share_loss(int failed) {
  const int p = pp_.size(), s = stage_.stage();
  if (p == 1) return failed;
  // msg_: [0, p - 1) the stages' statuses (on the last stage), then the loss and the status.
  if (!msg_.defined()) msg_ = empty({p + 1}, dtype::f64);
  double* m = msg_.data_as<double>();
  double* out = m + p - 1;
  pending_.clear();
  if (s == p - 1) {
    for (int q = 0; q < p - 1; ++q) pending_.push_back(pp_.recv(m + q, 1, dtype::f64, q));
    for (auto& w : pending_) w.wait();
    pending_.clear();
    for (int q = p - 2; q >= 0; --q)
      if (m[q] >= 0) failed = static_cast<int>(m[q]);
    out[0] = loss_sum_;
    out[1] = failed;
    for (int q = 0; q < p - 1; ++q) pending_.push_back(pp_.send(out, 2, dtype::f64, q));
  } else {
    m[0] = failed;
    pending_.push_back(pp_.send(m, 1, dtype::f64, p - 1));
    pending_.push_back(pp_.recv(out, 2, dtype::f64, p - 1));
  }
  for (auto& w : pending_) w.wait();
  pending_.clear();
  loss_sum_ = out[0];
  return static_cast<int>(out[1]);
}

void pipeline_runner::exchange_tied_grad() {
  const int p = pp_.size(), s = stage_.stage();
  if (p == 1 || stage_.tied_parameter().empty() || (s != 0 && s != p - 1)) return;
  const int peer = s == 0 ? p - 1 : 0;
  tensor g = stage_.tied_grad();
  TROUPE_CHECK(g.defined() && g.is_contiguous(), "pipeline_runner: stage ", s,
               " holds no gradient for the tied parameter '", stage_.tied_parameter(), "'");
  if (!tied_recv_.defined()) tied_recv_ = empty(g.sizes(), g.type());
  const auto n = static_cast<std::size_t>(g.numel());
  auto sent = pp_.send(g.data(), n, g.type(), peer);
  auto got = pp_.recv(tied_recv_.data(), n, g.type(), peer);
  sent.wait();
  got.wait();
  ops::add(g, tied_recv_, g);  // a + b on one end, b + a on the other: the same sum
}

}  // namespace troupe::models::parallel
