// The in-process transport (see local_transport.hpp): mailboxes matched per (source, tag), one
// memcpy per message, futex wake-ups, and simulated rank loss.
#include "collective/local/local_transport.hpp"

#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>
#include <thread>
#include <unordered_map>

#include "collective/grid.hpp"
#include "collective/p2p_communicator.hpp"
#include "memory/error.hpp"

namespace troupe::collective {

namespace {

struct local_req : detail::p2p_state {
  int src = -1, dst = -1;  // world ranks of sender and receiver
  const void* send_buf = nullptr;
  void* recv_buf = nullptr;
  std::atomic<int> sleepers{0};
  std::shared_ptr<local_req> next;  // mailbox queue link
};

struct fifo {
  std::shared_ptr<local_req> head;
  local_req* tail = nullptr;
  void push(std::shared_ptr<local_req> q) {
    local_req* raw = q.get();
    if (tail != nullptr)
      tail->next = std::move(q);
    else
      head = std::move(q);
    tail = raw;
  }
  std::shared_ptr<local_req> pop() {
    std::shared_ptr<local_req> q = std::move(head);
    head = std::move(q->next);
    if (!head) tail = nullptr;
    return q;
  }
  bool empty() const { return !head; }
};

inline int* futex_word(std::atomic<int>& a) {
  return reinterpret_cast<int*>(&a);
}

// Wakes sleepers after the status changed (the waker stores status first, then reads sleepers;
// the sleeper counts itself first, then reads status: one of them sees the other).
void finish(local_req& q, int status, std::string error = {}) {
  if (status == detail::p2p_state::failed) q.error = std::move(error);
  q.status.store(status, std::memory_order_seq_cst);
  if (q.sleepers.load(std::memory_order_seq_cst) > 0)
    syscall(SYS_futex, futex_word(q.status), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr, nullptr, 0);
}

inline std::uint64_t slot_key(int src, std::uint64_t tag) {
  return (static_cast<std::uint64_t>(src) << 48) | tag;
}
inline int key_src(std::uint64_t key) {
  return static_cast<int>(key >> 48);
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

}  // namespace

struct local_transport::mailbox {
  struct slot {
    fifo sends, recvs;
  };
  std::mutex mu;
  std::unordered_map<std::uint64_t, slot> slots;
};

namespace {

// Copies a matched send into its receive and completes both (outside any lock).
void deliver(local_req& send, local_req& recv, std::atomic<std::uint64_t>& sent,
             std::atomic<std::uint64_t>& received) {
  if (send.bytes != recv.bytes) {
    std::string m = "local transport: size mismatch on tag " + std::to_string(send.tag) +
                    ": rank " + std::to_string(send.src) + " sent " + std::to_string(send.bytes) +
                    " bytes but rank " + std::to_string(recv.dst) + " posted a receive of " +
                    std::to_string(recv.bytes) + " bytes";
    finish(send, detail::p2p_state::failed, m);
    finish(recv, detail::p2p_state::failed, m);
    return;
  }
  if (send.bytes != 0) std::memcpy(recv.recv_buf, send.send_buf, send.bytes);
  sent.fetch_add(send.bytes, std::memory_order_relaxed);
  received.fetch_add(send.bytes, std::memory_order_relaxed);
  finish(send, detail::p2p_state::done);
  finish(recv, detail::p2p_state::done);
}

}  // namespace

local_transport::local_transport(local_world& world, int rank)
    : world_(world),
      rank_(rank),
      box_(std::make_unique<mailbox>()),
      failures_(world.size()),
      failed_(new std::atomic<bool>[world.size()]) {
  for (int i = 0; i < world.size(); ++i) failed_[i].store(false);
}

local_transport::~local_transport() = default;

int local_transport::size() const {
  return world_.size();
}

void local_transport::check_peer(int peer, const char* what) const {
  TROUPE_CHECK(peer >= 0 && peer < world_.size() && peer != rank_, "local transport: rank ", rank_,
               " cannot ", what, " peer ", peer, " (world of ", world_.size(), ")");
}

p2p_request local_transport::isend(int peer, std::uint64_t tag, const void* data,
                                   std::size_t bytes) {
  check_peer(peer, "send to");
  TROUPE_CHECK(tag <= max_tag, "local transport: tag ", tag, " above max_tag (send to ", peer, ")");
  auto q = std::make_shared<local_req>();
  q->peer = peer;
  q->tag = tag;
  q->bytes = bytes;
  q->is_send = true;
  q->src = rank_;
  q->dst = peer;
  q->send_buf = data;
  local_transport& dst = world_.transport(peer);
  std::shared_ptr<local_req> match;
  std::string lost;
  {
    std::lock_guard lock(dst.box_->mu);
    if (self_lost_.load()) {
      lost = "rank " + std::to_string(rank_) + " lost: " + peer_failure(rank_);
    } else if (failed_[peer].load()) {
      lost = "rank " + std::to_string(peer) + " lost: " + peer_failure(peer);
    } else {
      auto& s = dst.box_->slots[slot_key(rank_, tag)];
      if (!s.recvs.empty()) {
        match = s.recvs.pop();
        if (s.recvs.empty() && s.sends.empty()) dst.box_->slots.erase(slot_key(rank_, tag));
      } else {
        s.sends.push(q);
      }
    }
  }
  if (!lost.empty()) finish(*q, detail::p2p_state::failed, lost);
  if (match) deliver(*q, *match, sent_, dst.received_);
  return p2p_request(std::move(q));
}

p2p_request local_transport::irecv(int peer, std::uint64_t tag, void* data, std::size_t bytes) {
  check_peer(peer, "receive from");
  TROUPE_CHECK(tag <= max_tag, "local transport: tag ", tag, " above max_tag (receive from ", peer,
               ")");
  auto q = std::make_shared<local_req>();
  q->peer = peer;
  q->tag = tag;
  q->bytes = bytes;
  q->src = peer;
  q->dst = rank_;
  q->recv_buf = data;
  std::shared_ptr<local_req> match;
  std::string lost;
  {
    std::lock_guard lock(box_->mu);
    if (self_lost_.load()) {
      lost = "rank " + std::to_string(rank_) + " lost: " + peer_failure(rank_);
    } else if (failed_[peer].load()) {
      lost = "rank " + std::to_string(peer) + " lost: " + peer_failure(peer);
    } else {
      auto& s = box_->slots[slot_key(peer, tag)];
      if (!s.sends.empty()) {
        match = s.sends.pop();
        if (s.recvs.empty() && s.sends.empty()) box_->slots.erase(slot_key(peer, tag));
      } else {
        s.recvs.push(q);
      }
    }
  }
  if (!lost.empty()) finish(*q, detail::p2p_state::failed, lost);
  if (match) deliver(*match, *q, world_.transport(peer).sent_, received_);
  return p2p_request(std::move(q));
}

bool local_transport::test(p2p_request& r) {
  TROUPE_CHECK(r.valid(), "local transport: test on an empty request (rank ", rank_, ")");
  auto* q = r.state();
  int s = q->status.load(std::memory_order_acquire);
  if (s == detail::p2p_state::failed) throw troupe::error(q->error);
  return s == detail::p2p_state::done;
}

void local_transport::wait(p2p_request& r, std::chrono::milliseconds timeout) {
  TROUPE_CHECK(r.valid(), "local transport: wait on an empty request (rank ", rank_, ")");
  auto* q = static_cast<local_req*>(r.state());
  using clock = std::chrono::steady_clock;
  const auto t0 = clock::now();
  // Spin a few microseconds: the peer thread is often just about to post.
  for (int i = 0; i < 512 && q->status.load(std::memory_order_acquire) == 0; ++i) cpu_relax();
  for (int i = 0; i < 4 && q->status.load(std::memory_order_acquire) == 0; ++i)
    std::this_thread::yield();
  if (q->status.load(std::memory_order_acquire) == detail::p2p_state::pending) {
    q->sleepers.fetch_add(1, std::memory_order_seq_cst);
    while (q->status.load(std::memory_order_seq_cst) == detail::p2p_state::pending) {
      timespec ts{};
      timespec* tsp = nullptr;
      if (timeout.count() > 0) {
        auto left =
            timeout - std::chrono::duration_cast<std::chrono::nanoseconds>(clock::now() - t0);
        if (left.count() <= 0) {
          q->sleepers.fetch_sub(1);
          TROUPE_FAIL("local transport: rank ", rank_, " timed out after ", timeout.count(),
                      " ms waiting for a ", q->is_send ? "send to" : "receive from", " rank ",
                      q->peer, " (tag ", q->tag, ", ", q->bytes, " bytes)");
        }
        auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(left).count();
        ts.tv_sec = static_cast<time_t>(ns / 1000000000);
        ts.tv_nsec = static_cast<long>(ns % 1000000000);
        tsp = &ts;
      }
      syscall(SYS_futex, futex_word(q->status), FUTEX_WAIT_PRIVATE, detail::p2p_state::pending, tsp,
              nullptr, 0);
    }
    q->sleepers.fetch_sub(1);
  }
  if (q->status.load(std::memory_order_acquire) == detail::p2p_state::failed)
    throw troupe::error(q->error);
}

void local_transport::fail_pending_with(int peer, const std::string& message) {
  const bool all = peer == rank_;
  std::vector<std::shared_ptr<local_req>> doomed;
  auto collect = [&](mailbox& box, bool recvs, int src_match) {
    std::lock_guard lock(box.mu);
    for (auto it = box.slots.begin(); it != box.slots.end();) {
      int src = key_src(it->first);
      bool hit = src_match < 0 ? src != rank_ : src == src_match;
      fifo& f = recvs ? it->second.recvs : it->second.sends;
      if (hit)
        while (!f.empty()) doomed.push_back(f.pop());
      if (it->second.recvs.empty() && it->second.sends.empty())
        it = box.slots.erase(it);
      else
        ++it;
    }
  };
  // This rank's receives wait in its own mailbox; its sends wait in the receivers' mailboxes.
  collect(*box_, true, all ? -1 : peer);
  for (int p = 0; p < world_.size(); ++p)
    if (p != rank_ && (all || p == peer)) collect(*world_.transport(p).box_, false, rank_);
  for (auto& q : doomed) finish(*q, detail::p2p_state::failed, message);
}

void local_transport::fail_peer(int peer, const std::string& reason) {
  check_peer(peer, "fail");
  {
    std::lock_guard lock(fail_mu_);
    if (failed_[peer].load()) return;
    failures_[peer] = reason.empty() ? std::string("lost") : reason;
    failed_[peer].store(true);
  }
  fail_pending_with(peer, "rank " + std::to_string(peer) + " lost: " + peer_failure(peer));
}

void local_transport::lose_self(const std::string& reason) {
  {
    std::lock_guard lock(fail_mu_);
    if (self_lost_.load()) return;
    failures_[rank_] = reason.empty() ? std::string("lost") : reason;
    self_lost_.store(true);
  }
  fail_pending_with(rank_, "rank " + std::to_string(rank_) + " lost: " + peer_failure(rank_));
}

std::string local_transport::peer_failure(int peer) const {
  if (peer < 0 || peer >= world_.size()) return {};
  if (peer == rank_ ? !self_lost_.load() : !failed_[peer].load()) return {};
  std::lock_guard lock(fail_mu_);
  return failures_[peer];
}

bool local_transport::same_host(int peer) const {
  return world_.same_host() && peer >= 0 && peer < world_.size() && peer != rank_;
}

local_world::local_world(int n, bool same_host) : same_host_(same_host) {
  TROUPE_CHECK(n >= 1 && n < (1 << 15), "local_world: size ", n, " outside [1, 32767]");
  ranks_.reserve(n);
  // The transports read size() from the world while being built, so size the vector first.
  for (int r = 0; r < n; ++r) ranks_.push_back(nullptr);
  for (int r = 0; r < n; ++r) ranks_[r] = std::make_unique<local_transport>(*this, r);
}

local_world::~local_world() = default;

local_transport& local_world::transport(int rank) {
  TROUPE_CHECK(rank >= 0 && rank < size(), "local_world: no rank ", rank, " in a world of ",
               size());
  return *ranks_[rank];
}

void local_world::fail_peer(int rank, const std::string& reason) {
  TROUPE_CHECK(rank >= 0 && rank < size(), "local_world: fail_peer of rank ", rank,
               " in a world of ", size());
  ranks_[rank]->lose_self(reason);
  for (int r = 0; r < size(); ++r)
    if (r != rank) ranks_[r]->fail_peer(rank, reason);
}

std::vector<std::unique_ptr<communicator>> make_local_group(std::shared_ptr<local_world> world,
                                                            std::uint32_t group_id) {
  rank_group g;
  g.id = group_id;
  for (int r = 0; r < world->size(); ++r) g.ranks.push_back(r);
  std::vector<std::unique_ptr<communicator>> out;
  for (int r = 0; r < world->size(); ++r)
    out.push_back(make_communicator(world->transport(r), g, "local", world));
  return out;
}

std::vector<std::unique_ptr<communicator>> make_local_group(int n) {
  return make_local_group(std::make_shared<local_world>(n));
}

}  // namespace troupe::collective
