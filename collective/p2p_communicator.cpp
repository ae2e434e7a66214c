// The host communicator (see p2p_communicator.hpp): issue, the executor thread, inline runs by
// waiters, send/recv posting, failure handling and the flight recorder.
#include "collective/p2p_communicator.hpp"

#include <algorithm>
#include <array>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>

#include <sched.h>

#include "collective/algo.hpp"
#include "collective/reduce.hpp"
#include "collective/work.hpp"
#include "memory/error.hpp"

namespace troupe::collective {

namespace detail {

namespace {
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}
using clock = std::chrono::steady_clock;
constexpr std::size_t recorder_size = 64;

// Waking a sleeping executor costs a futex wake and, on a busy or pinned core, two context
// switches (the executor preempts the caller, then the caller must be woken when the op is done):
// about 4 us, more than a small allreduce takes. So an op is handed to a *lightly* sleeping
// executor without a wake-up when it is small and alone in the queue: the caller's wait() usually
// runs it inline at once, and otherwise the executor, which naps at most `light_nap` while ops
// were issued in the last `deep_after`, finds it within a nap. After `deep_after` without ops the
// executor sleeps until woken, and every issue wakes it.
// Where the process may run on one CPU only (pinned ranks), every op alone in the queue is handed
// over lazily, whatever its size: the executor cannot run it beside the caller anyway, and the wake
// made the caller and the executor trade the CPU twice per op (2 ranks pinned, a 1 MiB all_to_allv,
// whose `count` is its total, took 43 us against 30 for the all_to_all of the same bytes, whose
// `count` is one peer's block and stayed under lazy_max_bytes; docs/performance.md).
constexpr std::chrono::microseconds light_nap{1000};
constexpr std::chrono::milliseconds deep_after{50};
constexpr std::size_t lazy_max_bytes = std::size_t{1} << 20;

int allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) != 0) return 1;
  return CPU_COUNT(&set);
}
}  // namespace

struct comm_core;

// A collective waiting for (or running on) the executor. A waiter may run it inline.
struct coll_work final : work_state {
  using work_state::work_state;
  std::weak_ptr<comm_core> core;
  std::function<void(op_context&)> body;
  std::chrono::milliseconds timeout{0};
  op_signature sig;  // what this op is, as the segments record it (shm_note_op)
  void wait() override;
};

// A send or receive: posted in issue order (inline or by the executor), then finished by whoever
// waits on or tests it.
struct p2p_work final : work_state {
  using work_state::work_state;
  std::weak_ptr<comm_core> core;
  std::atomic<int> posted{0};  // 0 queued, 1 posted (req is valid), 2 never posted (failed)
  p2p_request req;
  bool is_send = false;
  int peer = 0;  // group rank
  const void* send_buf = nullptr;
  void* recv_buf = nullptr;
  std::size_t bytes = 0;
  std::chrono::milliseconds timeout{0};
  clock::time_point deadline = clock::time_point::max();
  bool test() override;
  void wait() override;
};

struct comm_core {
  comm_core(transport& tr, const rank_group& g, std::string backend, std::shared_ptr<void> own)
      : t(tr), group(g), owner(std::move(own)), t0(clock::now()) {
    me = group.index_of(t.rank());
    TROUPE_CHECK(!group.ranks.empty(), "communicator ", backend, "#", group.id, ": empty group");
    std::string rs;
    for (std::size_t i = 0; i < group.ranks.size(); ++i) {
      TROUPE_CHECK(group.ranks[i] >= 0 && group.ranks[i] < t.size(), "communicator ", backend, "#",
                   group.id, ": rank ", group.ranks[i], " outside the transport's world of ",
                   t.size());
      if (i > 0) rs += ',';
      rs += std::to_string(group.ranks[i]);
    }
    name = backend + "#" + std::to_string(group.id) + "[" + rs + "]";
    TROUPE_CHECK(me >= 0, "communicator ", name, ": this transport's rank ", t.rank(),
                 " is not a member");
    n = static_cast<int>(group.ranks.size());
    direct.comm_name = name;
    heard.assign(static_cast<std::size_t>(n), 0);
  }

  transport& t;
  rank_group group;
  std::shared_ptr<void> owner;
  clock::time_point t0;
  std::string name;
  int me = 0, n = 1;

  mutable std::mutex tune_mu;
  algo_tuning tune;
  // The deadline of ops issued with options::timeout 0, in ms (0: none).
  std::atomic<std::int64_t> timeout_ms{default_op_timeout.count()};

  // The queue of issued ops. `running` is set while the executor or an inline waiter runs one.
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<work_state>> queue;
  std::atomic<int> queued{0};
  bool running = false;
  enum class nap { awake, light, deep } sleep_state = nap::awake;
  clock::time_point last_active = clock::now();
  bool may_spin = allowed_cpus() > 1;  // spinning on a single allowed CPU only delays the caller
  std::atomic<bool> stopping{false};
  std::uint64_t next_seq = 1;
  std::thread executor;

  // Failure: `cancelled` stops running ops (abort); `broken` fails later ops at once.
  std::atomic<bool> cancelled{false};
  std::atomic<bool> broken{false};
  mutable std::mutex fail_mu;
  std::string broken_reason, abort_reason;

  mutable std::mutex rec_mu;
  std::array<flight_record, recorder_size> ring{};

  scratch_pool scratch;
  direct_state direct;              // used by the op that runs (one at a time)
  std::vector<std::uint8_t> heard;  // the running collective's op_context::heard

  std::chrono::milliseconds op_timeout(const options& o) const {
    return o.timeout.count() > 0 ? o.timeout : std::chrono::milliseconds(timeout_ms.load());
  }

  double now_us() const {
    return std::chrono::duration<double, std::micro>(clock::now() - t0).count();
  }
  std::uint64_t coll_tag(std::uint64_t seq) const {
    return (static_cast<std::uint64_t>(group.id) << 15) | (seq & 0x3fff);
  }
  std::uint64_t p2p_tag() const {
    return (static_cast<std::uint64_t>(group.id) << 15) | (std::uint64_t{1} << 14);
  }

  void record_issue(const work_state& w, dtype type, std::size_t count, int peer) {
    std::lock_guard lock(rec_mu);
    flight_record& r = ring[w.seq % recorder_size];
    r = flight_record{};
    r.seq = w.seq;
    r.kind = w.kind;
    r.type = type;
    r.count = count;
    r.peer = peer;
    r.state = "issued";
    r.start_us = now_us();
  }
  void record_running(std::uint64_t seq) {
    std::lock_guard lock(rec_mu);
    flight_record& r = ring[seq % recorder_size];
    if (r.seq != seq || r.end_us != 0) return;  // gone from the ring, or already settled
    r.state = "running";
  }

  // Finishes w (failed with *message, or done) and its flight record together, so that a waiter
  // woken by the finish reads a record that says so. The first finisher wins.
  void settle(work_state& w, const std::string* message, const std::string& why) {
    std::lock_guard lock(rec_mu);
    if (w.finished()) return;
    flight_record& r = ring[w.seq % recorder_size];
    if (r.seq == w.seq) {
      r.state = message != nullptr ? "failed: " + why : std::string("done");
      r.end_us = now_us();
    }
    if (message != nullptr)
      w.fail(*message);
    else
      w.complete();
  }

  // The cause of a failure with the abort reason filled in.
  std::string cause(const std::string& what) const {
    if (cancelled.load()) {
      std::lock_guard lock(fail_mu);
      return "aborted: " + abort_reason;
    }
    return what;
  }
  // Fails w with "<op> #<seq> on <name> failed: <cause>" and marks the communicator broken.
  void fail_work(work_state& w, const std::string& why) {
    std::string msg = w.describe() + " failed: " + why;
    {
      std::lock_guard lock(fail_mu);
      if (!broken.load()) {
        broken_reason =
            std::string(op_kind_name(w.kind)) + " #" + std::to_string(w.seq) + ": " + why;
        broken.store(true);
      }
    }
    settle(w, &msg, why);
  }
  // The error text of an op past its deadline, from what its waits knew (`waiting`: "waiting for
  // rank 3 (...)" or "timed out ...") and its flight record: how long it waited, what it moves,
  // the group, which ranks' messages of this op arrived.
  std::string deadline_text(const work_state& w, const op_context& c, const std::string& waiting,
                            bool collective) const {
    const auto waited = std::chrono::duration_cast<std::chrono::milliseconds>(
        clock::now() - c.deadline + c.timeout);
    std::string moves;
    {
      std::lock_guard lock(rec_mu);
      const flight_record& r = ring[w.seq % recorder_size];
      if (r.seq == w.seq && w.kind != op_kind::barrier)
        moves = std::string(dtype_name(r.type)) + " x " + std::to_string(r.count) + ", ";
    }
    std::string members;
    for (int g = 0; g < n; ++g) members += (g ? "," : "") + std::to_string(group.ranks[g]);
    std::string s = "deadline of " + std::to_string(c.timeout.count()) + " ms passed (waited " +
                    std::to_string(waited.count()) + " ms; " + moves + "group ranks " + members +
                    "): rank " + std::to_string(group.ranks[me]) + " " +
                    (waiting.rfind("waiting for", 0) == 0 ? "is " + waiting : waiting);
    if (collective) {
      std::string from;
      for (int g = 0; g < n; ++g)
        if (g != me && heard[g] != 0)
          from += (from.empty() ? "" : ", ") + std::to_string(group.ranks[g]);
      s += from.empty() ? "; no message of this op has arrived from any rank"
                        : "; messages of this op arrived from rank " + from;
    }
    return s;
  }
  // After w passed its deadline: every pending and later op of this communicator fails pointing
  // to it (the peers still blocked in this op meet their own deadlines).
  void abort_after_deadline(const work_state& w, const std::string& waiting) {
    abort("rank " + std::to_string(group.ranks[me]) + " gave up " + w.describe() +
          " at its deadline, " + waiting);
  }

  std::string broken_cause() const {
    std::lock_guard lock(fail_mu);
    if (cancelled.load()) return "aborted: " + abort_reason;
    return "communicator unusable after an earlier failure (" + broken_reason + ")";
  }

  op_context context(std::uint64_t tag, std::chrono::milliseconds timeout,
                     clock::time_point deadline, const algo_tuning& tu) {
    op_context c{t, group.ranks, me, n, tag, deadline, timeout, &cancelled, tu, &scratch};
    c.yield_poll = !may_spin;
    c.direct = &direct;
    return c;
  }

  void run_collective(coll_work& w) {
    if (w.finished()) return;  // failed by abort while queued
    if (broken.load()) {
      fail_work(w, broken_cause());
      detail::direct_left(direct);
      return;
    }
    record_running(w.seq);
    // Every rank numbers its collectives alike; the segments (once the probe made them) hold each
    // rank's record of the one it runs, so a peer in a staged op, which sends no message, still
    // sees at once when this rank issued another op as this one (direct_shm.cpp).
    ++direct.op_no;
    direct.sig = w.sig;
    detail::shm_note_op(direct);
    algo_tuning tu;
    {
      std::lock_guard lock(tune_mu);
      tu = tune;
    }
    auto deadline = w.timeout.count() > 0 ? clock::now() + w.timeout : clock::time_point::max();
    op_context c = context(coll_tag(w.seq), w.timeout, deadline, tu);
    std::fill(heard.begin(), heard.end(), std::uint8_t{0});
    c.heard = &heard;
    std::string why, waiting;
    try {
      c.check();
      // The peers' records are read from the op's first wait on (here they would cost a read of
      // a line each peer has just written, every op, for nothing a wait would not see).
      c.collective = true;
      w.body(c);
    } catch (const deadline_error& e) {
      waiting = e.what();
      why = cause(deadline_text(w, c, waiting, true));
    } catch (const std::exception& e) {
      why = cause(e.what());
    }
    w.body = nullptr;
    if (why.empty()) {
      settle(w, nullptr, {});
    } else {
      fail_work(w, why);
      // The op returned: this rank touches no peer's buffers any more (algo.hpp).
      detail::direct_left(direct);
      if (!waiting.empty()) abort_after_deadline(w, waiting);
    }
  }

  void post_p2p(p2p_work& w) {
    if (!w.finished()) {
      if (broken.load()) {
        fail_work(w, broken_cause());
      } else {
        try {
          const int wr = group.ranks[w.peer];
          w.req = w.is_send ? t.isend(wr, p2p_tag(), w.send_buf, w.bytes)
                            : t.irecv(wr, p2p_tag(), w.recv_buf, w.bytes);
          if (w.timeout.count() > 0) w.deadline = clock::now() + w.timeout;
          record_running(w.seq);
          w.posted.store(1);
          w.posted.notify_all();
          return;
        } catch (const std::exception& e) {
          fail_work(w, cause(e.what()));
        }
      }
    }
    w.posted.store(2);
    w.posted.notify_all();
  }

  // Finishes a posted p2p op: blocking (wait) or not (test).
  void finish_p2p(p2p_work& w, bool block) {
    if (w.finished()) return;
    algo_tuning tu;
    op_context c = context(p2p_tag(), w.timeout, w.deadline, tu);
    try {
      if (block) {
        c.wait(w.req);
      } else if (!t.test(w.req)) {
        return;
      }
    } catch (const deadline_error& e) {
      fail_work(w, cause(deadline_text(w, c, e.what(), false)));
      abort_after_deadline(w, e.what());
      return;
    } catch (const std::exception& e) {
      fail_work(w, cause(e.what()));
      return;
    }
    settle(w, nullptr, {});
  }

  void execute(const std::shared_ptr<work_state>& w) {
    if (w->kind == op_kind::send || w->kind == op_kind::recv)
      post_p2p(static_cast<p2p_work&>(*w));
    else
      run_collective(static_cast<coll_work&>(*w));
  }

  void executor_loop() {
    for (;;) {
      int spin_us;
      {
        std::lock_guard lock(tune_mu);
        spin_us = tune.executor_spin_us;
      }
      // Poll a little for the next op (a training step issues them back to back), then sleep.
      if (!may_spin) spin_us = 0;
      const auto until = clock::now() + std::chrono::microseconds(spin_us);
      for (int i = 0;
           spin_us > 0 && queued.load(std::memory_order_acquire) == 0 && !stopping.load(); ++i) {
        cpu_relax();
        if ((i & 63) == 63 && clock::now() > until) break;
      }
      std::shared_ptr<work_state> w;
      {
        std::unique_lock lock(mu);
        while (!stopping.load() && (queue.empty() || running)) {
          if (clock::now() - last_active < deep_after) {
            sleep_state = nap::light;
            cv.wait_for(lock, light_nap);
          } else {
            sleep_state = nap::deep;
            cv.wait(lock);
          }
          sleep_state = nap::awake;
        }
        if (stopping.load()) return;
        w = std::move(queue.front());
        queue.pop_front();
        queued.fetch_sub(1);
        running = true;
      }
      execute(w);
      std::lock_guard lock(mu);
      running = false;
      last_active = clock::now();
    }
  }

  // Runs `w` on the calling thread if it is next and nothing runs; true if it did.
  bool try_run_inline(work_state* w) {
    std::shared_ptr<work_state> mine;
    {
      std::lock_guard lock(mu);
      if (running || queue.empty() || queue.front().get() != w || stopping.load()) return false;
      mine = std::move(queue.front());
      queue.pop_front();
      queued.fetch_sub(1);
      running = true;
    }
    execute(mine);
    std::lock_guard lock(mu);
    running = false;
    last_active = clock::now();
    if (!queue.empty() && sleep_state != nap::awake) cv.notify_one();
    return true;
  }

  void enqueue(std::shared_ptr<work_state> w, dtype type, std::size_t count, int peer) {
    const std::size_t bytes = count * dtype_size(type);
    bool run_now = false;
    {
      std::lock_guard lock(mu);
      TROUPE_CHECK(!stopping.load(), op_kind_name(w->kind), " on ", name,
                   ": the communicator is being destroyed");
      w->seq = next_seq++;
      w->spin = may_spin;
      record_issue(*w, type, count, peer);
      if (broken.load()) {
        // Fail fast, below, outside the lock.
      } else if ((w->kind == op_kind::send || w->kind == op_kind::recv) && !running &&
                 queue.empty()) {
        run_now = true;  // nothing ahead of it: post on the caller's thread
        running = true;
      } else {
        queue.push_back(w);
        queued.fetch_add(1, std::memory_order_release);
        const bool lazy =
            sleep_state == nap::light && queue.size() == 1 && (bytes < lazy_max_bytes || !may_spin);
        if (sleep_state != nap::awake && !lazy) cv.notify_one();
        return;
      }
    }
    if (!run_now) {  // broken
      fail_work(*w, broken_cause());
      if (auto* p = dynamic_cast<p2p_work*>(w.get())) {
        p->posted.store(2);
        p->posted.notify_all();
      }
      return;
    }
    post_p2p(static_cast<p2p_work&>(*w));
    std::lock_guard lock(mu);
    running = false;
    if (!queue.empty() && sleep_state != nap::awake) cv.notify_one();
  }

  void abort(const std::string& reason) {
    {
      std::lock_guard lock(fail_mu);
      if (!cancelled.load()) abort_reason = reason;
      cancelled.store(true);
      if (!broken.load()) {
        broken_reason = "aborted: " + reason;
        broken.store(true);
      }
    }
    std::deque<std::shared_ptr<work_state>> doomed;
    {
      std::lock_guard lock(mu);
      doomed.swap(queue);
      queued.store(0);
      // Nothing runs: this rank touches no peer's buffers any more (else the running op, failed
      // by `cancelled`, says so when it returns).
      if (!running) detail::direct_left(direct);
    }
    for (auto& w : doomed) {
      fail_work(*w, "aborted: " + reason);
      if (auto* p = dynamic_cast<p2p_work*>(w.get())) {
        p->posted.store(2);
        p->posted.notify_all();
      }
    }
  }
};

void coll_work::wait() {
  if (!finished())
    if (auto c = core.lock()) c->try_run_inline(this);
  work_state::wait();
}

bool p2p_work::test() {
  if (!finished() && posted.load() == 1)
    if (auto c = core.lock()) c->finish_p2p(*this, false);
  return work_state::test();
}

void p2p_work::wait() {
  if (!finished()) {
    if (posted.load() == 0)
      if (auto c = core.lock()) c->try_run_inline(this);
    while (posted.load() == 0) posted.wait(0);
    if (posted.load() == 1) {
      if (auto c = core.lock())
        c->finish_p2p(*this, true);
      else
        fail(describe() + " failed: the communicator was destroyed");
    }
  }
  work_state::wait();
}

}  // namespace detail

using detail::coll_work;
using detail::comm_core;
using detail::p2p_work;

p2p_communicator::p2p_communicator(transport& t, const rank_group& g, std::string backend_name,
                                   std::shared_ptr<void> owner)
    : core_(std::make_shared<comm_core>(t, g, std::move(backend_name), std::move(owner))) {
  core_->executor = std::thread([c = core_.get()] { c->executor_loop(); });
}

p2p_communicator::~p2p_communicator() {
  core_->abort("communicator " + core_->name + " destroyed");
  {
    std::lock_guard lock(core_->mu);
    core_->stopping.store(true);
    core_->cv.notify_all();
  }
  core_->executor.join();
}

int p2p_communicator::rank() const {
  return core_->me;
}
int p2p_communicator::size() const {
  return core_->n;
}
std::string p2p_communicator::name() const {
  return core_->name;
}

void p2p_communicator::set_tuning(const algo_tuning& t) {
  TROUPE_CHECK(
      t.chunk_bytes > 0 && t.window > 0 && t.direct_piece_bytes > 0 && t.direct_copy_bytes > 0,
      "set_tuning on ", core_->name,
      ": chunk_bytes, window, direct_piece_bytes and direct_copy_bytes must be positive");
  std::lock_guard lock(core_->tune_mu);
  core_->tune = t;
}

algo_tuning p2p_communicator::tuning() const {
  std::lock_guard lock(core_->tune_mu);
  return core_->tune;
}

namespace {

work issue_collective(const std::shared_ptr<comm_core>& core, op_kind k, dtype t, std::size_t count,
                      int peer, const options& o, std::function<void(detail::op_context&)> body) {
  auto w = std::make_shared<coll_work>(k, 0, core->name);
  w->core = core;
  w->timeout = core->op_timeout(o);
  w->body = std::move(body);
  const bool reduces = k == op_kind::allreduce || k == op_kind::reduce_scatter;
  w->sig.kind = detail::direct_kind(k, t, reduces ? o.op : reduce_op::sum);
  w->sig.count = k == op_kind::all_to_allv ? 0 : count;
  w->sig.root = k == op_kind::broadcast ? peer : 0;
  core->enqueue(w, t, count, peer);
  return work(std::move(w));
}

}  // namespace

work p2p_communicator::allreduce(void* data, std::size_t count, dtype t, const options& o) {
  check_reducible(t, ("allreduce on " + core_->name).c_str());
  TROUPE_CHECK(data != nullptr || count == 0, "allreduce on ", core_->name, ": null buffer");
  const reduce_op op = o.op;
  return issue_collective(core_, op_kind::allreduce, t, count, -1, o,
                          [=](detail::op_context& c) { detail::allreduce(c, data, count, t, op); });
}

work p2p_communicator::reduce_scatter(const void* in, void* out, std::size_t count, dtype t,
                                      const options& o) {
  check_reducible(t, ("reduce_scatter on " + core_->name).c_str());
  TROUPE_CHECK((in != nullptr && out != nullptr) || count == 0, "reduce_scatter on ", core_->name,
               ": null buffer");
  const reduce_op op = o.op;
  return issue_collective(
      core_, op_kind::reduce_scatter, t, count, -1, o,
      [=](detail::op_context& c) { detail::reduce_scatter(c, in, out, count, t, op); });
}

work p2p_communicator::all_gather(const void* in, void* out, std::size_t count, dtype t,
                                  const options& o) {
  TROUPE_CHECK((in != nullptr && out != nullptr) || count == 0, "all_gather on ", core_->name,
               ": null buffer");
  return issue_collective(core_, op_kind::all_gather, t, count, -1, o,
                          [=](detail::op_context& c) { detail::all_gather(c, in, out, count, t); });
}

work p2p_communicator::broadcast(void* data, std::size_t count, dtype t, const options& o) {
  TROUPE_CHECK(o.root >= 0 && o.root < core_->n, "broadcast on ", core_->name, ": root ", o.root,
               " outside the group of ", core_->n);
  TROUPE_CHECK(data != nullptr || count == 0, "broadcast on ", core_->name, ": null buffer");
  const int root = o.root;
  return issue_collective(core_, op_kind::broadcast, t, count, root, o, [=](detail::op_context& c) {
    detail::broadcast(c, data, count, t, root);
  });
}

work p2p_communicator::all_to_all(const void* in, void* out, std::size_t count, dtype t,
                                  const options& o) {
  TROUPE_CHECK((in != nullptr && out != nullptr) || count == 0, "all_to_all on ", core_->name,
               ": null buffer");
  const int n = core_->n;
  return issue_collective(core_, op_kind::all_to_all, t, count, -1, o, [=](detail::op_context& c) {
    std::vector<std::size_t> counts(n, count);
    detail::all_to_allv(c, op_kind::all_to_all, in, counts, out, counts, t);
  });
}

work p2p_communicator::all_to_allv(const void* in, std::span<const std::size_t> send_counts,
                                   void* out, std::span<const std::size_t> recv_counts, dtype t,
                                   const options& o) {
  const int n = core_->n;
  TROUPE_CHECK(send_counts.size() == static_cast<std::size_t>(n) &&
                   recv_counts.size() == static_cast<std::size_t>(n),
               "all_to_allv on ", core_->name, ": ", send_counts.size(), " send counts and ",
               recv_counts.size(), " receive counts for a group of ", n);
  TROUPE_CHECK(send_counts[core_->me] == recv_counts[core_->me], "all_to_allv on ", core_->name,
               ": rank ", core_->me, " sends itself ", send_counts[core_->me],
               " elements but expects ", recv_counts[core_->me]);
  std::vector<std::size_t> sc(send_counts.begin(), send_counts.end());
  std::vector<std::size_t> rc(recv_counts.begin(), recv_counts.end());
  std::size_t total = 0;
  for (auto x : sc) total += x;
  return issue_collective(core_, op_kind::all_to_allv, t, total, -1, o,
                          [=, sc = std::move(sc), rc = std::move(rc)](detail::op_context& c) {
                            detail::all_to_allv(c, op_kind::all_to_allv, in, sc, out, rc, t);
                          });
}

namespace {

work issue_p2p(const std::shared_ptr<comm_core>& core, bool is_send, const void* sbuf, void* rbuf,
               std::size_t count, dtype t, int peer, const options& o) {
  const char* what = is_send ? "send" : "recv";
  TROUPE_CHECK(peer >= 0 && peer < core->n && peer != core->me, what, " on ", core->name, ": peer ",
               peer, " is not another rank of the group of ", core->n);
  auto w = std::make_shared<p2p_work>(is_send ? op_kind::send : op_kind::recv, 0, core->name);
  w->core = core;
  w->is_send = is_send;
  w->peer = peer;
  w->send_buf = sbuf;
  w->recv_buf = rbuf;
  w->bytes = count * dtype_size(t);
  w->timeout = core->op_timeout(o);
  core->enqueue(w, t, count, peer);
  return work(std::move(w));
}

}  // namespace

work p2p_communicator::send(const void* data, std::size_t count, dtype t, int peer,
                            const options& o) {
  return issue_p2p(core_, true, data, nullptr, count, t, peer, o);
}

work p2p_communicator::recv(void* data, std::size_t count, dtype t, int peer, const options& o) {
  return issue_p2p(core_, false, nullptr, data, count, t, peer, o);
}

work p2p_communicator::barrier(const options& o) {
  return issue_collective(core_, op_kind::barrier, dtype::u8, 0, -1, o,
                          [](detail::op_context& c) { detail::barrier(c); });
}

void p2p_communicator::set_timeout(std::chrono::milliseconds timeout) {
  TROUPE_CHECK(timeout.count() >= 0, "set_timeout on ", core_->name, ": negative deadline ",
               timeout.count(), " ms");
  core_->timeout_ms.store(timeout.count());
}

void p2p_communicator::abort(const std::string& reason) {
  core_->abort(reason);
}

std::vector<flight_record> p2p_communicator::recent() const {
  std::vector<flight_record> out;
  {
    std::lock_guard lock(core_->rec_mu);
    for (const auto& r : core_->ring)
      if (r.seq != 0) out.push_back(r);
  }
  std::sort(out.begin(), out.end(),
            [](const flight_record& a, const flight_record& b) { return a.seq < b.seq; });
  return out;
}

std::unique_ptr<communicator> make_communicator(transport& t, const rank_group& g,
                                                std::string backend_name) {
  return std::make_unique<p2p_communicator>(t, g, std::move(backend_name));
}

std::unique_ptr<communicator> make_communicator(transport& t, const rank_group& g,
                                                std::string backend_name,
                                                std::shared_ptr<void> owner) {
  return std::make_unique<p2p_communicator>(t, g, std::move(backend_name), std::move(owner));
}

}  // namespace troupe::collective
