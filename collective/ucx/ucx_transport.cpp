// The UCX transport (see ucx_transport.hpp): ucp tag messages on one multi-threaded worker.
//
// Locking, in one place because it is the subtle part:
// - UCX takes the worker lock inside every ucp call and runs our completion callbacks under it.
// - mu_ guards the registry of pending requests and the peers' failure reasons. Callbacks take
//   mu_ (so: worker lock -> mu_); therefore no thread may call into UCX while holding mu_.
// - A UCX request handle is freed exactly once, by whoever sees it last: the completion callback,
//   unless a canceller holds it (cancel_holds), in which case the last canceller frees it. So
//   ucp_request_cancel never touches a freed (possibly reused) request.
// - An endpoint is closed only outside UCX callbacks, after the posters using it have left
//   (peer_state::users, a Dekker-style handshake with peer_state::closing). An endpoint error
//   reported inside a callback marks the peer failed at once and defers the close to reap().
// - progress_mu_ is held around ucp_worker_progress (progress_mu_ -> worker lock), so a callback
//   may take it only where its thread already holds it (inside progress: it is recursive). UCX
//   also runs the endpoint error callback inside other calls, e.g. ucp_tag_send_nbx failing a TCP
//   endpoint on the sender's thread with the worker lock held: there, waiting for progress_mu_
//   while the progress thread holds it and waits for the worker lock is a deadlock (seen: every
//   survivor of a SIGKILLed rank hung). mark_failed therefore only try-locks it and leaves the
//   cancels to reap() when it is taken.
#include "collective/ucx/ucx_transport.hpp"

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <time.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <climits>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "collective/auth.hpp"
#include "memory/error.hpp"

namespace troupe::collective {

namespace {

using clock = std::chrono::steady_clock;

// Shared memory between processes of one host (sysv preferred, posix as fallback), tcp for other
// hosts, and for large messages between local ranks one rendezvous rail: cma (the receiver copies
// straight from the sender's buffer with process_vm_readv, one copy instead of the two of the
// shared-memory fragments). Where cma cannot work (ptrace restricted) that one rail would be tcp
// loopback, at half the bandwidth, so then no rails: large messages move as pipelined shared-memory
// fragments. Measured in collective/ucx/README.md.
constexpr const char* default_tls = "self,sysv,posix,cma,tcp";
constexpr const char* fragment_tls = "self,sysv,posix,tcp";
// With cma, messages below this go eagerly through the shared-memory FIFOs: a cma rendezvous (RTS,
// process_vm_readv, ATS) made 16-64 KiB allreduces 1.4-1.7x slower than UCX's automatic choice
// without cma, and from 256 KiB on cma wins (collective/ucx/README.md).
constexpr const char* single_copy_rndv_thresh = "262144";
// address() = magic, host identity length (2 bytes), host identity, UCX worker address.
constexpr char address_magic[4] = {'t', 'r', 'x', '1'};

// Ranks with the same identity share a kernel, an IPC namespace (UCX's shared memory works) and
// a pid namespace (a peer's pid names it here, so process_vm_readv/writev by pid reach it: the
// direct allreduce).
std::string host_identity() {
  std::string id;
  char host[256] = {};
  if (gethostname(host, sizeof host - 1) == 0) id = host;
  int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    char boot[64] = {};
    ssize_t n = read(fd, boot, sizeof boot - 1);
    close(fd);
    if (n > 0) id += "|" + std::string(boot, static_cast<std::size_t>(n));
  }
  for (const char* link : {"/proc/self/ns/ipc", "/proc/self/ns/pid"}) {
    char ns[64] = {};  // e.g. "pid:[4026531836]"
    ssize_t n = readlink(link, ns, sizeof ns - 1);
    if (n > 0) id += "|" + std::string(ns, static_cast<std::size_t>(n));
  }
  return id;
}
// Whether process_vm_readv may read another process of this user here (what UCX's cma needs):
// Yama's ptrace_scope must be 0 (or absent), and the syscall must exist (seccomp may deny it).
bool cma_usable() {
  int fd = open("/proc/sys/kernel/yama/ptrace_scope", O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    char c = '0';
    ssize_t n = read(fd, &c, 1);
    close(fd);
    if (n == 1 && c != '0') return false;
  }
  char src = 1, dst = 0;
  iovec local{&dst, 1}, remote{&src, 1};
  return process_vm_readv(getpid(), &local, 1, &remote, 1, 0) == 1 && dst == 1;
}

constexpr int tag_shift = 48;
constexpr ucp_tag_t full_mask = ~ucp_tag_t{0};

// Handshake messages: bit 63 set (data tags never have it: ranks fit 15 bits), the sender's rank
// in bits 48-62, kind 1. A few receives for them from any sender are always posted.
constexpr ucp_tag_t hs_bit = ucp_tag_t{1} << 63;
constexpr ucp_tag_t hs_tag = hs_bit | 1;
constexpr ucp_tag_t hs_mask = hs_bit | max_tag;
constexpr std::size_t hs_slots = 4;
constexpr std::size_t hs_max_bytes = 16384;
constexpr char hs_magic[4] = {'t', 'r', 'x', 'h'};
enum : std::uint8_t { hs_hello = 1, hs_proof = 2 };

// hello: from, to, a = the sender's challenge nonce, mac over (from, to, a, addr), addr = the
// sender's address(). proof: from, to, a = the challenge answered, b = the prover's own challenge
// nonce, mac over (from, to, a, b).
struct hs_msg {
  std::uint8_t kind = 0;
  std::int32_t from = -1, to = -1;
  auth::nonce a{}, b{};
  auth::digest mac{};
  std::vector<std::uint8_t> addr;
};

std::vector<std::uint8_t> encode(const hs_msg& m) {
  std::vector<std::uint8_t> out(hs_magic, hs_magic + 4);
  out.push_back(m.kind);
  auto put32 = [&](std::uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<std::uint8_t>(v >> (8 * i)));
  };
  put32(static_cast<std::uint32_t>(m.from));
  put32(static_cast<std::uint32_t>(m.to));
  out.insert(out.end(), m.a.begin(), m.a.end());
  out.insert(out.end(), m.b.begin(), m.b.end());
  out.insert(out.end(), m.mac.begin(), m.mac.end());
  put32(static_cast<std::uint32_t>(m.addr.size()));
  out.insert(out.end(), m.addr.begin(), m.addr.end());
  return out;
}

bool decode(const std::vector<std::uint8_t>& in, hs_msg& m) {
  constexpr std::size_t head = 4 + 1 + 4 + 4 + 16 + 16 + 32 + 4;
  if (in.size() < head || std::memcmp(in.data(), hs_magic, 4) != 0) return false;
  std::size_t off = 4;
  auto get32 = [&] {
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= std::uint32_t{in[off + i]} << (8 * i);
    off += 4;
    return v;
  };
  m.kind = in[off++];
  m.from = static_cast<std::int32_t>(get32());
  m.to = static_cast<std::int32_t>(get32());
  std::memcpy(m.a.data(), in.data() + off, 16);
  std::memcpy(m.b.data(), in.data() + off + 16, 16);
  std::memcpy(m.mac.data(), in.data() + off + 32, 32);
  off += 64;
  const std::uint32_t n = get32();
  if (in.size() != head + n || (m.kind != hs_hello && m.kind != hs_proof)) return false;
  m.addr.assign(in.begin() + static_cast<std::ptrdiff_t>(head), in.end());
  return true;
}

auth::digest hello_mac(const std::string& token, const std::string& job, const hs_msg& m) {
  auth::transcript t;
  t.add(std::string_view("troupe-ucx hello")).add(job).add(std::int64_t{m.from});
  t.add(std::int64_t{m.to}).add(m.a).add(m.addr);
  return auth::hmac(token, t.bytes());
}

auth::digest proof_mac(const std::string& token, const std::string& job, const hs_msg& m) {
  auth::transcript t;
  t.add(std::string_view("troupe-ucx proof")).add(job).add(std::int64_t{m.from});
  t.add(std::int64_t{m.to}).add(m.a).add(m.b);
  return auth::hmac(token, t.bytes());
}

ucp_tag_t make_tag(int sender, std::uint64_t tag) {
  return (static_cast<ucp_tag_t>(sender) << tag_shift) | tag;
}

const char* status_text(ucs_status_t s) {
  return ucs_status_string(s);
}

std::string describe(const detail::p2p_state& r, int self) {
  std::string s = r.is_send ? "send to rank " : "recv from rank ";
  s += std::to_string(r.peer) + " tag " + std::to_string(r.tag) + " (" + std::to_string(r.bytes) +
       " bytes) on rank " + std::to_string(self);
  return s;
}

void futex_wait(std::atomic<std::uint32_t>* word, std::uint32_t expected, long ns) {
  timespec ts{ns / 1000000000L, ns % 1000000000L};
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAIT_PRIVATE, expected, &ts,
          nullptr, 0);
}

void futex_wake_all(std::atomic<std::uint32_t>* word) {
  syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), FUTEX_WAKE_PRIVATE, INT_MAX, nullptr,
          nullptr, 0);
}

}  // namespace

struct ucx_request : detail::p2p_state {
  ucx_transport::impl* owner = nullptr;
  // Guarded by impl::mu_:
  void* handle = nullptr;         // the UCX request while UCX may still use it
  bool ucx_done = false;          // the completion callback ran (or the post completed at once)
  int cancel_holds = 0;           // cancellers using `handle` outside mu_
  void* deferred_free = nullptr;  // completed while held: the last canceller frees it
  // Whoever sets this first writes `error` and `status` (UCX's callback, or the transport failing
  // a request UCX never completed).
  std::atomic<bool> claimed{false};
  // The peer's list of pending requests (guarded by impl::mu_); `self` keeps a listed request
  // alive while UCX may call back into it, even if the caller dropped its p2p_request.
  ucx_request* prev = nullptr;
  ucx_request* next = nullptr;
  std::shared_ptr<ucx_request> self;
};

// An intrusive list: no allocation per request (a hash map here cost ~5% of a ping-pong).
struct request_list {
  ucx_request* head = nullptr;
  void push(std::shared_ptr<ucx_request> r) {
    ucx_request* raw = r.get();
    raw->self = std::move(r);
    raw->prev = nullptr;
    raw->next = head;
    if (head != nullptr) head->prev = raw;
    head = raw;
  }
  // Unlinks `r` if listed; returns its self reference (empty if it was not listed).
  std::shared_ptr<ucx_request> remove(ucx_request* r) {
    if (r->self == nullptr) return nullptr;
    if (r->prev != nullptr) r->prev->next = r->next;
    if (r->next != nullptr) r->next->prev = r->prev;
    if (head == r) head = r->next;
    r->prev = r->next = nullptr;
    return std::move(r->self);
  }
  template <class F>
  void for_each(F&& f) {
    for (ucx_request* r = head; r != nullptr; r = r->next) f(r->self);
  }
  void clear() {
    while (head != nullptr) remove(head);
  }
};

struct peer_state {
  ucx_transport::impl* owner = nullptr;
  ucp_ep_h ep = nullptr;
  bool error_handling = false;      // the endpoint was made in UCP_ERR_HANDLING_MODE_PEER
  std::atomic<int> users{0};        // threads posting on `ep` right now
  std::atomic<bool> closing{true};  // no posts on `ep` (not connected, lost or closing)
  bool close_pending = false;       // an endpoint error asked for a deferred close (mu_)
  std::atomic<bool> local{false};   // its address carries this host's identity
  std::string failure;              // guarded by mu_
  request_list pending;             // guarded by mu_
  // Authentication. `proven` is set (release) after the pads are written; connect() clears it.
  std::atomic<bool> proven{false};
  std::uint64_t send_pad = 0, recv_pad = 0;  // XORed into the user tag of data to / from it
  // Guarded by impl::hs_mu_:
  std::vector<std::uint8_t> registered;  // the address connect() was given
  auth::nonce challenge{};               // the nonce of our hello to it
  std::vector<std::pair<ucp_tag_t, std::vector<std::uint8_t>>> deferred;  // before connect()
};

// One always-posted receive for handshake messages.
struct hs_slot {
  ucx_transport::impl* owner = nullptr;
  std::vector<std::uint8_t> buf = std::vector<std::uint8_t>(hs_max_bytes);
  void* handle = nullptr;  // inbox_mu_
  bool posted = false;     // inbox_mu_
};

struct ucx_transport::impl {
  ucx_transport_options opt;
  std::string tls;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  std::vector<std::uint8_t> address;  // magic + host identity + worker address
  std::string host;                   // host_identity()
  std::unique_ptr<peer_state[]> peers;

  mutable std::mutex mu_;
  // Held around every ucp_worker_progress and ucp_request_cancel: UCX 1.13's cancel reads a
  // request's COMPLETED flag before it takes the worker lock, so a completion by another thread's
  // progress in between (a rendezvous receive failed by a lost endpoint) trips an assertion in
  // tag_match.c. Recursive: callbacks run inside progress may cancel (mark_failed).
  std::recursive_mutex progress_mu_;
  unsigned progress_once() {
    std::lock_guard lk(progress_mu_);
    return ucp_worker_progress(worker);
  }
  // Receives of lost peers that mark_failed could not cancel at once (mu_), for reap().
  std::vector<std::pair<std::shared_ptr<ucx_request>, void*>> deferred_cancels_;
  std::mutex connect_mu_;  // serializes connect and endpoint close
  std::atomic<bool> any_close_pending{false};

  // Authentication. hs_mu_ guards the peers' handshake state and is never taken by callbacks
  // (its holder may call into UCX); inbox_mu_ is taken by the handshake receive callback.
  std::mutex hs_mu_;
  std::array<hs_slot, hs_slots> slots;
  std::mutex inbox_mu_;
  std::vector<std::pair<ucp_tag_t, std::vector<std::uint8_t>>> inbox;  // inbox_mu_
  std::vector<std::size_t> repost;                                     // inbox_mu_
  std::atomic<bool> hs_work{false};
  std::atomic<bool> hs_stopping{false};
  mutable std::mutex refuse_mu_;
  mutable std::condition_variable refuse_cv_;
  std::vector<std::string> refusal_log;  // refuse_mu_, the last 64
  std::uint64_t refused_count = 0;       // refuse_mu_
  std::uint64_t held_count = 0;          // refuse_mu_: handshake messages held for connect()

  std::atomic<std::uint64_t> sent{0}, received{0};
  std::atomic<std::uint32_t> completions{0};  // futex word bumped by every completion
  std::atomic<int> sleepers{0};               // threads in futex_wait on `completions`

  // Progress thread.
  std::thread progress;
  std::atomic<bool> stop{false};
  std::atomic<int> active_waiters{0};  // threads spinning on the worker: the thread parks
  static constexpr long park_ns = 200000;
  int efd = -1, stop_fd = -1, epoll_fd = -1;

  explicit impl(ucx_transport_options o) : opt(std::move(o)) {}

  // ---- completion ----------------------------------------------------------------------------
  void finish(ucx_request* r, ucs_status_t st, std::size_t length) {
    if (r->claimed.load(std::memory_order_acquire)) return;
    std::string err;
    if (st == UCS_OK && !r->is_send && length != r->bytes) {
      err = "message size mismatch: " + describe(*r, opt.rank) + " got a message of " +
            std::to_string(length) + " bytes, expected " + std::to_string(r->bytes);
    } else if (st == UCS_ERR_MESSAGE_TRUNCATED) {
      err = "message size mismatch: " + describe(*r, opt.rank) + " got a message of " +
            (length > r->bytes ? std::to_string(length) : "more than " + std::to_string(r->bytes)) +
            " bytes, expected " + std::to_string(r->bytes);
    } else if (st != UCS_OK) {
      std::string lost;
      {
        std::lock_guard lk(mu_);
        lost = peers[r->peer].failure;
      }
      if (!lost.empty()) {
        err = "rank " + std::to_string(r->peer) + " lost: " + lost + " (" + describe(*r, opt.rank) +
              ")";
      } else {
        err = std::string("UCX error: ") + status_text(st) + " (" + describe(*r, opt.rank) + ")";
      }
    }
    settle(r, std::move(err));
  }

  // Marks a request failed by the transport itself (lost peer, shutdown); UCX may still hold it.
  void fail_request(ucx_request* r, const std::string& why) {
    settle(r, why + " (" + describe(*r, opt.rank) + ")");
  }

  // The single place a request's outcome is published (once; `err` empty means success).
  void settle(ucx_request* r, std::string err) {
    if (r->claimed.exchange(true, std::memory_order_acq_rel)) return;
    if (err.empty()) {
      (r->is_send ? sent : received).fetch_add(r->bytes, std::memory_order_relaxed);
      r->status.store(detail::p2p_state::done, std::memory_order_release);
    } else {
      r->error = std::move(err);
      r->status.store(detail::p2p_state::failed, std::memory_order_release);
    }
    completions.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(&completions);
  }

  // Called by UCX (under the worker lock) when `handle` completed.
  void on_complete(ucx_request* r, void* handle, ucs_status_t st, std::size_t length) {
    std::shared_ptr<ucx_request> keep;  // keeps *r alive until we return
    bool free_now = false;
    {
      std::lock_guard lk(mu_);
      keep = peers[r->peer].pending.remove(r);
      r->ucx_done = true;
      r->handle = nullptr;
      if (r->cancel_holds == 0) {
        free_now = true;
      } else {
        r->deferred_free = handle;
      }
    }
    finish(r, st, length);
    if (free_now) ucp_request_free(handle);
  }

  static void send_cb(void* handle, ucs_status_t st, void* user) {
    auto* r = static_cast<ucx_request*>(user);
    r->owner->on_complete(r, handle, st, r->bytes);
  }

  static void recv_cb(void* handle, ucs_status_t st, const ucp_tag_recv_info_t* info, void* user) {
    auto* r = static_cast<ucx_request*>(user);
    r->owner->on_complete(r, handle, st, info != nullptr ? info->length : 0);
  }

  static void ep_error_cb(void* arg, ucp_ep_h, ucs_status_t st) {
    auto* ps = static_cast<peer_state*>(arg);
    impl* self = ps->owner;
    int peer = static_cast<int>(ps - self->peers.get());
    self->mark_failed(peer, std::string("UCX endpoint error: ") + status_text(st), true);
  }

  // ---- authentication ------------------------------------------------------------------------
  void wake() {
    completions.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) > 0) futex_wake_all(&completions);
  }

  static void hs_recv_cb(void* handle, ucs_status_t st, const ucp_tag_recv_info_t* info,
                         void* user) {
    auto* s = static_cast<hs_slot*>(user);
    impl* m = s->owner;
    {
      std::lock_guard lk(m->inbox_mu_);
      const ucp_tag_t tag = info != nullptr ? info->sender_tag : hs_bit;
      if (st == UCS_OK && info != nullptr) {
        m->inbox.emplace_back(
            tag, std::vector<std::uint8_t>(
                     s->buf.begin(), s->buf.begin() + static_cast<std::ptrdiff_t>(info->length)));
      } else if (st == UCS_ERR_MESSAGE_TRUNCATED) {
        m->inbox.emplace_back(tag, std::vector<std::uint8_t>{});  // an oversized message
      }
      s->handle = nullptr;
      s->posted = false;
      if (st != UCS_ERR_CANCELED)
        m->repost.push_back(static_cast<std::size_t>(s - m->slots.data()));
    }
    ucp_request_free(handle);
    m->hs_work.store(true, std::memory_order_release);
    m->wake();
  }

  // Posts the handshake receive of slot i (hs_mu_ held, outside callbacks).
  void post_slot(std::size_t i) {
    auto& s = slots[i];
    {
      std::lock_guard lk(inbox_mu_);
      s.posted = true;
    }
    ucp_request_param_t p{};
    p.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
    p.cb.recv = &impl::hs_recv_cb;
    p.user_data = &s;
    ucs_status_ptr_t sp = ucp_tag_recv_nbx(worker, s.buf.data(), s.buf.size(), hs_tag, hs_mask, &p);
    std::lock_guard lk(inbox_mu_);
    if (sp == nullptr || UCS_PTR_IS_ERR(sp)) {
      s.posted = false;
      std::fprintf(stderr,
                   "troupe: ucx_transport rank %d: posting a handshake receive failed: %s\n",
                   opt.rank, sp == nullptr ? "completed at once" : status_text(UCS_PTR_STATUS(sp)));
      return;
    }
    if (s.posted) s.handle = sp;  // else its callback ran already
  }

  static void hs_send_cb(void* handle, ucs_status_t, void* user) {
    delete static_cast<std::vector<std::uint8_t>*>(user);
    ucp_request_free(handle);
  }

  // Sends a handshake message on our endpoint to `peer` (outside callbacks).
  bool hs_send(int peer, const hs_msg& msg) {
    auto& ps = peers[peer];
    ps.users.fetch_add(1, std::memory_order_seq_cst);
    struct leave {
      std::atomic<int>& u;
      ~leave() { u.fetch_sub(1, std::memory_order_seq_cst); }
    } guard{ps.users};
    if (ps.closing.load(std::memory_order_seq_cst)) return false;
    auto* buf = new std::vector<std::uint8_t>(encode(msg));
    ucp_request_param_t p{};
    p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
    p.cb.send = &impl::hs_send_cb;
    p.user_data = buf;
    const ucp_tag_t tag = hs_tag | (static_cast<ucp_tag_t>(opt.rank) << tag_shift);
    ucs_status_ptr_t sp = ucp_tag_send_nbx(ps.ep, buf->data(), buf->size(), tag, &p);
    if (sp == nullptr || UCS_PTR_IS_ERR(sp)) delete buf;
    return sp == nullptr || !UCS_PTR_IS_ERR(sp);
  }

  void refuse(int claimed, const std::string& why) {
    std::string line = "rank " + std::to_string(opt.rank) + " refused a UCX peer claiming rank " +
                       std::to_string(claimed) + ": " + why;
    std::uint64_t n;
    {
      std::lock_guard lk(refuse_mu_);
      n = ++refused_count;
      refusal_log.push_back(line);
      if (refusal_log.size() > 64) refusal_log.erase(refusal_log.begin());
    }
    if (n <= 20 || n % 1000 == 0)
      std::fprintf(stderr, "troupe: %s (%llu refused so far)\n", line.c_str(),
                   static_cast<unsigned long long>(n));
    refuse_cv_.notify_all();
  }

  std::uint64_t pad(const auth::digest& session, int from, int to) const {
    auth::transcript t;
    t.add(std::string_view("troupe-ucx pad")).add(std::int64_t{from}).add(std::int64_t{to});
    auth::digest d = auth::hmac(
        std::string_view(reinterpret_cast<const char*>(session.data()), session.size()), t.bytes());
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= std::uint64_t{d[i]} << (8 * i);
    return v & max_tag;
  }

  // One handshake message (hs_mu_ held).
  void handle_message(ucp_tag_t tag, const std::vector<std::uint8_t>& bytes) {
    const int tag_rank = static_cast<int>((tag >> tag_shift) & 0x7fff);
    if (bytes.empty()) {
      refuse(tag_rank, "its handshake message exceeds " + std::to_string(hs_max_bytes) + " bytes");
      return;
    }
    hs_msg m;
    if (!decode(bytes, m)) {
      refuse(tag_rank, "malformed handshake message (" + std::to_string(bytes.size()) + " bytes)");
      return;
    }
    if (m.from != tag_rank) {
      refuse(tag_rank, "its handshake names rank " + std::to_string(m.from) + ", its tag rank " +
                           std::to_string(tag_rank));
      return;
    }
    if (m.from < 0 || m.from >= opt.size || m.from == opt.rank) {
      refuse(m.from, "not a peer in a world of " + std::to_string(opt.size));
      return;
    }
    if (m.to != opt.rank) {
      refuse(m.from, "its handshake is addressed to rank " + std::to_string(m.to));
      return;
    }
    auto& ps = peers[m.from];
    bool lost = false;
    {
      std::lock_guard lk(mu_);  // hs_mu_ -> mu_: no UCX call under either here
      lost = !ps.failure.empty();
    }
    // Not connected yet, or lost and not yet re-connected (a replacement's hello can come before
    // this rank learns its address): keep it for connect().
    if (ps.registered.empty() || lost) {
      if (ps.deferred.size() < 16) {
        ps.deferred.emplace_back(tag, bytes);
        {
          std::lock_guard lk(refuse_mu_);
          ++held_count;
        }
        refuse_cv_.notify_all();
      } else {
        refuse(m.from, "too many handshake messages before rank " + std::to_string(m.from) +
                           " was connected");
      }
      return;
    }
    if (m.kind == hs_hello) {
      if (!auth::equal(m.mac, hello_mac(opt.token, opt.job, m))) {
        refuse(m.from, "its hello does not verify: it does not hold this job's token");
        return;
      }
      if (m.addr != ps.registered) {
        refuse(m.from, "it holds the job token, but its worker address is not rank " +
                           std::to_string(m.from) + "'s (a member posing as rank " +
                           std::to_string(m.from) + "?)");
        return;
      }
      // Answer on OUR endpoint to the registered address: only the real rank gets it.
      hs_msg proof;
      proof.kind = hs_proof;
      proof.from = opt.rank;
      proof.to = m.from;
      proof.a = m.a;
      proof.b = ps.challenge;
      proof.mac = proof_mac(opt.token, opt.job, proof);
      hs_send(m.from, proof);
      return;
    }
    if (m.a != ps.challenge) {
      refuse(m.from, "its proof answers a challenge rank " + std::to_string(opt.rank) +
                         " never sent it (someone posing as rank " + std::to_string(opt.rank) +
                         " towards rank " + std::to_string(m.from) + "?)");
      return;
    }
    if (!auth::equal(m.mac, proof_mac(opt.token, opt.job, m))) {
      refuse(m.from, "its proof does not verify: it does not hold this job's token");
      return;
    }
    if (ps.proven.load(std::memory_order_acquire)) return;  // a duplicate
    const bool low = opt.rank < m.from;
    auth::transcript t;
    t.add(std::string_view("troupe-ucx session")).add(opt.job);
    t.add(std::int64_t{low ? opt.rank : m.from}).add(std::int64_t{low ? m.from : opt.rank});
    t.add(low ? ps.challenge : m.b).add(low ? m.b : ps.challenge);
    const auth::digest session = auth::hmac(opt.token, t.bytes());
    ps.send_pad = pad(session, opt.rank, m.from);
    ps.recv_pad = pad(session, m.from, opt.rank);
    ps.proven.store(true, std::memory_order_release);
    wake();
  }

  // Handles the handshake messages that arrived and re-posts their receives (outside callbacks).
  void process_handshakes() {
    if (!hs_work.exchange(false, std::memory_order_acq_rel)) return;
    std::unique_lock hk(hs_mu_, std::try_to_lock);
    if (!hk.owns_lock()) {
      hs_work.store(true, std::memory_order_release);  // the holder may have swapped already
      return;
    }
    std::vector<std::pair<ucp_tag_t, std::vector<std::uint8_t>>> msgs;
    std::vector<std::size_t> again;
    {
      std::lock_guard lk(inbox_mu_);
      msgs.swap(inbox);
      again.swap(repost);
    }
    if (!hs_stopping.load(std::memory_order_acquire))
      for (std::size_t i : again) post_slot(i);
    for (auto& [tag, bytes] : msgs) {
      try {
        handle_message(tag, bytes);
      } catch (const std::exception& e) {
        std::fprintf(stderr, "troupe: ucx_transport rank %d: handshake: %s\n", opt.rank, e.what());
      }
    }
  }

  // Waits (progressing the worker) until `peer` proved membership, is lost, or the timeout
  // passes (then throws). Returns at once for a peer never connected (the caller reports it).
  void await_proven(int peer) {
    auto& ps = peers[peer];
    if (ps.proven.load(std::memory_order_acquire)) return;
    const auto deadline = clock::now() + opt.handshake_timeout;
    active_waiters.fetch_add(1, std::memory_order_acq_rel);
    struct leave {
      impl& m;
      ~leave() { m.leave_active(); }
    } guard{*this};
    for (;;) {
      if (ps.proven.load(std::memory_order_acquire)) return;
      if (ps.closing.load(std::memory_order_seq_cst)) return;  // lost or not connected
      const bool progressed = progress_once() != 0;
      process_handshakes();
      reap();
      if (ps.proven.load(std::memory_order_acquire)) return;
      if (clock::now() >= deadline) {
        TROUPE_FAIL("ucx_transport rank ", opt.rank, ": rank ", peer,
                    " has not proven job membership on its UCX endpoint within ",
                    opt.handshake_timeout.count(),
                    " ms (does it hold this job's token, and did it connect back?)");
      }
      if (!progressed) {
        timespec ts{0, 100000};
        nanosleep(&ts, nullptr);
      }
    }
  }

  // ---- posting -------------------------------------------------------------------------------
  std::shared_ptr<ucx_request> make_request(int peer, std::uint64_t tag, std::size_t bytes,
                                            bool is_send) {
    TROUPE_CHECK(peer >= 0 && peer < opt.size && peer != opt.rank, "ucx_transport rank ", opt.rank,
                 ": ", is_send ? "isend to" : "irecv from", " invalid peer ", peer, " (world size ",
                 opt.size, ")");
    TROUPE_CHECK(tag <= max_tag, "ucx_transport rank ", opt.rank, ": tag ", tag,
                 " exceeds max_tag with peer ", peer);
    auto r = std::make_shared<ucx_request>();
    r->owner = this;
    r->peer = peer;
    r->tag = tag;
    r->bytes = bytes;
    r->is_send = is_send;
    return r;
  }

  // Registers `r` as pending unless its peer is lost (then fails it and returns false).
  bool enlist(const std::shared_ptr<ucx_request>& r) {
    std::lock_guard lk(mu_);
    auto& ps = peers[r->peer];
    if (!ps.failure.empty()) {
      r->claimed.store(true, std::memory_order_relaxed);  // not shared with anyone yet
      r->error = "rank " + std::to_string(r->peer) + " lost: " + ps.failure + " (" +
                 describe(*r, opt.rank) + ")";
      r->status.store(detail::p2p_state::failed, std::memory_order_release);
      return false;
    }
    ps.pending.push(r);
    return true;
  }

  // Handles what ucp_tag_*_nbx returned.
  void posted(const std::shared_ptr<ucx_request>& r, ucs_status_ptr_t sp, std::size_t length) {
    if (sp == nullptr || UCS_PTR_IS_ERR(sp)) {  // completed (or failed) at once: no callback
      {
        std::lock_guard lk(mu_);
        peers[r->peer].pending.remove(r.get());
        r->ucx_done = true;
      }
      finish(r.get(), sp == nullptr ? UCS_OK : UCS_PTR_STATUS(sp), length);
      return;
    }
    bool cancel = false;
    {
      std::lock_guard lk(mu_);
      if (r->ucx_done) return;  // the callback already ran and freed the handle
      r->handle = sp;
      // A receive posted while fail_peer ran: fail_peer may have missed it, so cancel it here.
      if (!r->is_send && !peers[r->peer].failure.empty()) {
        ++r->cancel_holds;
        cancel = true;
      }
    }
    if (cancel) cancel_held({{r, sp}});
  }

  // Cancels requests whose cancel_holds the caller raised; frees handles completed meanwhile.
  void cancel_held(const std::vector<std::pair<std::shared_ptr<ucx_request>, void*>>& held) {
    {
      std::lock_guard lk(progress_mu_);
      for (auto& [r, h] : held) ucp_request_cancel(worker, h);
    }
    std::vector<void*> to_free;
    {
      std::lock_guard lk(mu_);
      for (auto& [r, h] : held) {
        if (--r->cancel_holds == 0 && r->deferred_free != nullptr) {
          to_free.push_back(r->deferred_free);
          r->deferred_free = nullptr;
        }
      }
    }
    for (void* h : to_free) ucp_request_free(h);
  }

  // ---- failure -------------------------------------------------------------------------------
  // Records that `peer` is lost and cancels its posted receives. Safe inside UCX callbacks; the
  // endpoint is closed by the caller (fail_peer) or later by reap() (from_callback).
  bool mark_failed(int peer, const std::string& reason, bool from_callback) {
    std::vector<std::pair<std::shared_ptr<ucx_request>, void*>> held;
    {
      std::lock_guard lk(mu_);
      auto& ps = peers[peer];
      if (!ps.failure.empty()) return false;
      ps.failure = reason.empty() ? std::string("(no reason given)") : reason;
      ps.pending.for_each([&](const std::shared_ptr<ucx_request>& r) {
        if (!r->is_send && r->handle != nullptr && !r->ucx_done) {
          ++r->cancel_holds;
          held.emplace_back(r, r->handle);
        }
      });
      if (from_callback) {
        ps.close_pending = true;
        any_close_pending.store(true, std::memory_order_release);
      }
    }
    peers[peer].closing.store(true, std::memory_order_seq_cst);
    if (held.empty()) return true;
    if (!from_callback) {
      cancel_held(held);
      return true;
    }
    // Inside a UCX callback: never wait for progress_mu_ (see the locking notes at the top).
    std::unique_lock pk(progress_mu_, std::try_to_lock);
    if (pk.owns_lock()) {
      cancel_held(held);  // takes progress_mu_ again (recursive)
      return true;
    }
    {
      std::lock_guard lk(mu_);
      deferred_cancels_.insert(deferred_cancels_.end(), held.begin(), held.end());
    }
    any_close_pending.store(true, std::memory_order_release);  // reap() cancels them
    return true;
  }

  // Force-closes the endpoint to `peer` (never from a UCX callback), then fails what UCX did not.
  void close_endpoint(int peer, const std::string& why_left) {
    std::lock_guard ck(connect_mu_);
    auto& ps = peers[peer];
    ps.closing.store(true, std::memory_order_seq_cst);
    while (ps.users.load(std::memory_order_seq_cst) != 0) sched_yield();
    ucp_ep_h ep = ps.ep;
    ps.ep = nullptr;
    {
      std::lock_guard lk(mu_);
      ps.close_pending = false;
    }
    if (ep != nullptr) {
      ucp_request_param_t p{};
      p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      p.flags = UCP_EP_CLOSE_FLAG_FORCE;
      ucs_status_ptr_t sp = ucp_ep_close_nbx(ep, &p);
      if (sp != nullptr && !UCS_PTR_IS_ERR(sp)) {
        // A forced close needs no answer from the peer; bound the wait anyway.
        auto give_up = clock::now() + std::chrono::seconds(5);
        while (ucp_request_check_status(sp) == UCS_INPROGRESS && clock::now() < give_up) {
          progress_once();
        }
        if (ucp_request_check_status(sp) != UCS_INPROGRESS) ucp_request_free(sp);
      }
    }
    // Whatever UCX did not complete (a matched rendezvous from a dead sender) fails now.
    std::vector<std::shared_ptr<ucx_request>> left;
    {
      std::lock_guard lk(mu_);
      ps.pending.for_each([&](const std::shared_ptr<ucx_request>& r) { left.push_back(r); });
    }
    for (auto& r : left) fail_request(r.get(), why_left);
  }

  // Closes endpoints whose error was reported inside a callback.
  void reap() {
    if (!any_close_pending.load(std::memory_order_acquire)) return;
    any_close_pending.store(false, std::memory_order_release);
    std::vector<std::pair<std::shared_ptr<ucx_request>, void*>> cancels;
    {
      std::lock_guard lk(mu_);
      cancels.swap(deferred_cancels_);
    }
    if (!cancels.empty()) cancel_held(cancels);
    for (int p = 0; p < opt.size; ++p) {
      std::string why;
      {
        std::lock_guard lk(mu_);
        if (!peers[p].close_pending) continue;
        why = "rank " + std::to_string(p) + " lost: " + peers[p].failure;
      }
      close_endpoint(p, why);
    }
  }

  // ---- progress ------------------------------------------------------------------------------
  void progress_loop() {
    epoll_event events[2];
    while (!stop.load(std::memory_order_acquire)) {
      if (active_waiters.load(std::memory_order_acquire) > 0) {
        // A waiter is spinning on the worker: stay out of its way (no lock contention, no arming,
        // so senders need not signal us) and look again shortly. Waking this thread whenever a
        // wait ends would cost a syscall and a context switch per wait (8-byte latency x10).
        timespec ts{0, park_ns};
        nanosleep(&ts, nullptr);
        continue;
      }
      while (progress_once() != 0) {
      }
      reap();
      process_handshakes();
      if (hs_work.load(std::memory_order_acquire)) continue;
      ucs_status_t st = ucp_worker_arm(worker);
      if (st == UCS_ERR_BUSY) continue;
      int timeout_ms = -1;
      if (st != UCS_OK) {
        std::fprintf(stderr, "troupe: ucx_transport rank %d: ucp_worker_arm failed: %s; polling\n",
                     opt.rank, status_text(st));
        timeout_ms = 1;
      }
      int n = epoll_wait(epoll_fd, events, 2, timeout_ms);
      if (n < 0 && errno != EINTR) {
        std::fprintf(stderr, "troupe: ucx_transport rank %d: epoll_wait failed: %s\n", opt.rank,
                     std::strerror(errno));
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
    }
  }

  void leave_active() { active_waiters.fetch_sub(1, std::memory_order_acq_rel); }
};

namespace {
ucx_request* as_ucx(p2p_request& r, int rank) {
  TROUPE_CHECK(r.valid(), "ucx_transport rank ", rank, ": waiting on an empty p2p_request");
  auto* u = dynamic_cast<ucx_request*>(r.state());
  TROUPE_CHECK(u != nullptr, "ucx_transport rank ", rank,
               ": the request was not made by a ucx_transport");
  return u;
}

void throw_if_failed(const detail::p2p_state& s) {
  if (s.status.load(std::memory_order_acquire) == detail::p2p_state::failed) throw error(s.error);
}

#define TROUPE_UCX_CHECK(call, ...)                                                      \
  do {                                                                                   \
    ucs_status_t st_ = (call);                                                           \
    TROUPE_CHECK(st_ == UCS_OK, "UCX: " #call " failed: ", ucs_status_string(st_), " (", \
                 __VA_ARGS__, ")");                                                      \
  } while (0)
}  // namespace

ucx_transport::ucx_transport(ucx_transport_options options)
    : impl_(std::make_unique<impl>(std::move(options))) {
  impl& m = *impl_;
  TROUPE_CHECK(m.opt.size >= 1 && m.opt.rank >= 0 && m.opt.rank < m.opt.size,
               "ucx_transport: rank ", m.opt.rank, " outside a world of size ", m.opt.size);
  TROUPE_CHECK(m.opt.size < (1 << 15), "ucx_transport: world size ", m.opt.size,
               " does not fit the 16 sender bits of a UCX tag");
  TROUPE_CHECK(!m.opt.token.empty(), "ucx_transport rank ", m.opt.rank,
               ": no job token (every UCX endpoint proves job membership with it)");
  m.peers = std::make_unique<peer_state[]>(m.opt.size);
  for (int p = 0; p < m.opt.size; ++p) m.peers[p].owner = &m;
  for (auto& s : m.slots) s.owner = &m;

  ucp_config_t* config = nullptr;
  TROUPE_UCX_CHECK(ucp_config_read(nullptr, nullptr, &config), "rank ", m.opt.rank);
  const char* env_tls = std::getenv("UCX_TLS");
  const char* env_rails = std::getenv("UCX_MAX_RNDV_RAILS");
  // Our own default TLS with cma gets one rail (cma's); any other list none (see default_tls).
  const bool single_copy = env_tls == nullptr && m.opt.single_copy && cma_usable();
  const char* tls = env_tls != nullptr ? env_tls : single_copy ? default_tls : fragment_tls;
  const char* rails = env_rails != nullptr ? env_rails : single_copy ? "1" : "0";
  m.tls = std::string("UCX_TLS=") + tls + " UCX_MAX_RNDV_RAILS=" + rails;
  try {
    if (env_tls == nullptr) {
      TROUPE_UCX_CHECK(ucp_config_modify(config, "TLS", tls), "rank ", m.opt.rank);
    }
    if (env_rails == nullptr) {
      TROUPE_UCX_CHECK(ucp_config_modify(config, "MAX_RNDV_RAILS", rails), "rank ", m.opt.rank);
    }
    if (single_copy && std::getenv("UCX_RNDV_THRESH") == nullptr) {
      TROUPE_UCX_CHECK(ucp_config_modify(config, "RNDV_THRESH", single_copy_rndv_thresh), "rank ",
                       m.opt.rank);
      m.tls += std::string(" UCX_RNDV_THRESH=") + single_copy_rndv_thresh;
    }
    if (std::getenv("UCX_NET_DEVICES") == nullptr && !m.opt.net_device.empty()) {
      TROUPE_UCX_CHECK(ucp_config_modify(config, "NET_DEVICES", m.opt.net_device.c_str()), "rank ",
                       m.opt.rank, ", device ", m.opt.net_device);
    }
    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES;
    params.features = UCP_FEATURE_TAG | UCP_FEATURE_WAKEUP;
    TROUPE_UCX_CHECK(ucp_init(&params, config, &m.context), "rank ", m.opt.rank,
                     ", UCX_TLS=", m.tls);
  } catch (...) {
    ucp_config_release(config);
    throw;
  }
  ucp_config_release(config);

  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_MULTI;
  ucs_status_t st = ucp_worker_create(m.context, &wp, &m.worker);
  if (st != UCS_OK) {
    ucp_cleanup(m.context);
    TROUPE_FAIL("UCX: ucp_worker_create failed on rank ", m.opt.rank, ": ", status_text(st));
  }
  auto undo = [&] {
    if (m.epoll_fd >= 0) close(m.epoll_fd);
    if (m.stop_fd >= 0) close(m.stop_fd);
    ucp_worker_destroy(m.worker);
    ucp_cleanup(m.context);
  };
  try {
    ucp_worker_attr_t attr{};
    attr.field_mask = UCP_WORKER_ATTR_FIELD_THREAD_MODE;
    TROUPE_UCX_CHECK(ucp_worker_query(m.worker, &attr), "rank ", m.opt.rank);
    TROUPE_CHECK(attr.thread_mode == UCS_THREAD_MODE_MULTI, "ucx_transport rank ", m.opt.rank,
                 ": this UCX was built without multi-thread support (--enable-mt)");
    ucp_address_t* addr = nullptr;
    std::size_t len = 0;
    TROUPE_UCX_CHECK(ucp_worker_get_address(m.worker, &addr, &len), "rank ", m.opt.rank);
    m.host = host_identity();
    m.address.assign(address_magic, address_magic + 4);
    auto host_len = static_cast<std::uint16_t>(m.host.size());
    m.address.push_back(static_cast<std::uint8_t>(host_len & 0xff));
    m.address.push_back(static_cast<std::uint8_t>(host_len >> 8));
    m.address.insert(m.address.end(), m.host.begin(), m.host.end());
    auto* bytes = reinterpret_cast<const std::uint8_t*>(addr);
    m.address.insert(m.address.end(), bytes, bytes + len);
    ucp_worker_release_address(m.worker, addr);
    {
      std::lock_guard hk(m.hs_mu_);
      for (std::size_t i = 0; i < hs_slots; ++i) m.post_slot(i);
    }

    if (m.opt.progress_thread) {
      TROUPE_UCX_CHECK(ucp_worker_get_efd(m.worker, &m.efd), "rank ", m.opt.rank);
      m.stop_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
      TROUPE_CHECK(m.stop_fd >= 0, "ucx_transport rank ", m.opt.rank,
                   ": eventfd failed: ", std::strerror(errno));
      m.epoll_fd = epoll_create1(EPOLL_CLOEXEC);
      TROUPE_CHECK(m.epoll_fd >= 0, "ucx_transport rank ", m.opt.rank,
                   ": epoll_create1 failed: ", std::strerror(errno));
      for (int fd : {m.efd, m.stop_fd}) {
        epoll_event ev{};
        ev.events = EPOLLIN;
        ev.data.fd = fd;
        TROUPE_CHECK(epoll_ctl(m.epoll_fd, EPOLL_CTL_ADD, fd, &ev) == 0, "ucx_transport rank ",
                     m.opt.rank, ": epoll_ctl failed: ", std::strerror(errno));
      }
      m.progress = std::thread([&m] { m.progress_loop(); });
    }
  } catch (...) {
    undo();
    throw;
  }
}

ucx_transport::~ucx_transport() {
  impl& m = *impl_;
  if (m.progress.joinable()) {
    m.stop.store(true, std::memory_order_release);
    std::uint64_t one = 1;
    if (write(m.stop_fd, &one, sizeof one) != sizeof one) {
      std::fprintf(stderr, "troupe: ucx_transport rank %d: waking the progress thread failed\n",
                   m.opt.rank);
    }
    m.progress.join();
  }
  // The handshake receives go first (cancelled; their callbacks run in the progress below).
  m.hs_stopping.store(true, std::memory_order_release);
  {
    std::vector<void*> handles;
    {
      std::lock_guard lk(m.inbox_mu_);
      for (auto& s : m.slots)
        if (s.posted && s.handle != nullptr) handles.push_back(s.handle);
    }
    std::lock_guard lk(m.progress_mu_);
    for (void* h : handles) ucp_request_cancel(m.worker, h);
  }
  for (auto give_up = clock::now() + std::chrono::seconds(5); clock::now() < give_up;) {
    m.progress_once();
    std::lock_guard lk(m.inbox_mu_);
    bool any = false;
    for (auto& s : m.slots) any |= s.posted;
    if (!any) break;
  }
  // Peers may be gone: never flush, force-close every endpoint and fail what is left.
  for (int p = 0; p < m.opt.size; ++p) {
    m.mark_failed(p, "transport destroyed", false);
    m.close_endpoint(p, "ucx_transport on rank " + std::to_string(m.opt.rank) + " destroyed");
  }
  while (m.progress_once() != 0) {
  }
  {
    std::lock_guard lk(m.mu_);
    for (int p = 0; p < m.opt.size; ++p) m.peers[p].pending.clear();
  }
  if (m.epoll_fd >= 0) close(m.epoll_fd);
  if (m.stop_fd >= 0) close(m.stop_fd);
  ucp_worker_destroy(m.worker);
  ucp_cleanup(m.context);
}

std::vector<std::uint8_t> ucx_transport::address() const {
  return impl_->address;
}

void ucx_transport::connect(int peer, std::span<const std::uint8_t> address) {
  impl& m = *impl_;
  TROUPE_CHECK(peer >= 0 && peer < m.opt.size && peer != m.opt.rank, "ucx_transport rank ",
               m.opt.rank, ": connect to invalid peer ", peer, " (world size ", m.opt.size, ")");
  TROUPE_CHECK(address.size() > 6 && std::memcmp(address.data(), address_magic, 4) == 0,
               "ucx_transport rank ", m.opt.rank, ": the address given for rank ", peer,
               " is not a ucx_transport address (", address.size(), " bytes)");
  std::size_t host_len = address[4] | (std::size_t{address[5]} << 8);
  TROUPE_CHECK(address.size() > 6 + host_len, "ucx_transport rank ", m.opt.rank,
               ": the address given for rank ", peer, " is truncated (", address.size(), " bytes)");
  std::string peer_host(reinterpret_cast<const char*>(address.data()) + 6, host_len);
  const std::uint8_t* worker_address = address.data() + 6 + host_len;
  bool error_handling = m.opt.error_mode == ucx_error_mode::peer ||
                        (m.opt.error_mode == ucx_error_mode::automatic && peer_host != m.host);
  std::string lost;
  {
    std::lock_guard lk(m.mu_);
    lost = m.peers[peer].failure;
  }
  if (!lost.empty()) {
    // Re-joining a lost rank: hellos wait for the new address from here on (the old one is no
    // longer the rank's), and its old endpoint goes first (it may still await a deferred close).
    {
      std::lock_guard hk(m.hs_mu_);
      m.peers[peer].registered.clear();
    }
    m.close_endpoint(peer, "rank " + std::to_string(peer) + " lost: " + lost);
  } else {
    std::lock_guard ck(m.connect_mu_);
    TROUPE_CHECK(m.peers[peer].ep == nullptr, "ucx_transport rank ", m.opt.rank, ": rank ", peer,
                 " is already connected");
  }
  m.peers[peer].proven.store(false, std::memory_order_seq_cst);
  std::unique_lock ck(m.connect_mu_);
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(worker_address);
  ep.err_mode = error_handling ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
  ep.err_handler.cb = &impl::ep_error_cb;
  ep.err_handler.arg = &m.peers[peer];
  ucp_ep_h h = nullptr;
  TROUPE_UCX_CHECK(ucp_ep_create(m.worker, &ep, &h), "rank ", m.opt.rank, " connecting to rank ",
                   peer);
  {
    std::lock_guard lk(m.mu_);
    m.peers[peer].failure.clear();
    m.peers[peer].close_pending = false;
  }
  m.peers[peer].ep = h;
  m.peers[peer].error_handling = error_handling;
  m.peers[peer].local.store(peer_host == m.host);
  m.peers[peer].closing.store(false, std::memory_order_seq_cst);
  ck.unlock();
  // The hello: our challenge to `peer`, and proof that we hold the token (replayable, but its
  // answer goes to the registered address only). Hellos that came before connect() are handled now.
  std::vector<std::pair<ucp_tag_t, std::vector<std::uint8_t>>> early;
  {
    std::lock_guard hk(m.hs_mu_);
    auto& ps = m.peers[peer];
    ps.registered.assign(address.begin(), address.end());
    ps.challenge = auth::fresh_nonce();
    hs_msg hello;
    hello.kind = hs_hello;
    hello.from = m.opt.rank;
    hello.to = peer;
    hello.a = ps.challenge;
    hello.addr = m.address;
    hello.mac = hello_mac(m.opt.token, m.opt.job, hello);
    early.swap(ps.deferred);
    m.hs_send(peer, hello);
  }
  {
    std::lock_guard lk(m.inbox_mu_);
    for (auto& e : early) m.inbox.push_back(std::move(e));
  }
  m.hs_work.store(true, std::memory_order_release);
  m.process_handshakes();
}

void ucx_transport::authenticate(std::chrono::milliseconds timeout) {
  impl& m = *impl_;
  const auto deadline = clock::now() + timeout;
  m.active_waiters.fetch_add(1, std::memory_order_acq_rel);
  struct leave {
    impl& m;
    ~leave() { m.leave_active(); }
  } guard{m};
  for (;;) {
    const bool progressed = m.progress_once() != 0;
    m.process_handshakes();
    m.reap();
    std::string unproven;
    for (int p = 0; p < m.opt.size; ++p) {
      if (p == m.opt.rank || m.peers[p].closing.load() || m.peers[p].proven.load()) continue;
      unproven += (unproven.empty() ? "" : ", ") + std::to_string(p);
    }
    if (unproven.empty()) return;
    if (clock::now() >= deadline)
      TROUPE_FAIL("ucx_transport rank ", m.opt.rank, ": rank(s) ", unproven,
                  " did not prove job membership on their UCX endpoints within ", timeout.count(),
                  " ms (do they hold this job's token, and did they connect back?)");
    if (!progressed) {
      timespec ts{0, 100000};
      nanosleep(&ts, nullptr);
    }
  }
}

bool ucx_transport::authenticated(int peer) const {
  impl& m = *impl_;
  if (peer < 0 || peer >= m.opt.size || peer == m.opt.rank) return false;
  return m.peers[peer].proven.load(std::memory_order_acquire);
}

std::uint64_t ucx_transport::refused() const {
  std::lock_guard lk(impl_->refuse_mu_);
  return impl_->refused_count;
}

std::vector<std::string> ucx_transport::refusals() const {
  std::lock_guard lk(impl_->refuse_mu_);
  return impl_->refusal_log;
}

bool ucx_transport::await_refusals(std::uint64_t count, std::chrono::milliseconds timeout) const {
  std::unique_lock lk(impl_->refuse_mu_);
  return impl_->refuse_cv_.wait_for(lk, timeout, [&] { return impl_->refused_count >= count; });
}

std::uint64_t ucx_transport::held_handshakes() const {
  std::lock_guard lk(impl_->refuse_mu_);
  return impl_->held_count;
}

bool ucx_transport::await_held_handshakes(std::uint64_t count,
                                          std::chrono::milliseconds timeout) const {
  std::unique_lock lk(impl_->refuse_mu_);
  return impl_->refuse_cv_.wait_for(lk, timeout, [&] { return impl_->held_count >= count; });
}

bool ucx_transport::connected(int peer) const {
  impl& m = *impl_;
  if (peer < 0 || peer >= m.opt.size || peer == m.opt.rank) return false;
  std::lock_guard ck(m.connect_mu_);
  return m.peers[peer].ep != nullptr && !m.peers[peer].closing.load();
}

int ucx_transport::rank() const {
  return impl_->opt.rank;
}
int ucx_transport::size() const {
  return impl_->opt.size;
}

p2p_request ucx_transport::isend(int peer, std::uint64_t tag, const void* data, std::size_t bytes) {
  impl& m = *impl_;
  auto r = m.make_request(peer, tag, bytes, true);
  auto& ps = m.peers[peer];
  m.await_proven(peer);
  ps.users.fetch_add(1, std::memory_order_seq_cst);
  struct leave {
    std::atomic<int>& u;
    ~leave() { u.fetch_sub(1, std::memory_order_seq_cst); }
  } guard{ps.users};
  if (!m.enlist(r)) return p2p_request(r);  // the peer is lost
  if (ps.closing.load(std::memory_order_seq_cst)) {
    // Lost since enlist, or never connected: no endpoint to post on.
    std::string failure;
    {
      std::lock_guard lk(m.mu_);
      failure = ps.failure;
      ps.pending.remove(r.get());
      r->ucx_done = true;
    }
    TROUPE_CHECK(!failure.empty(), "ucx_transport rank ", m.opt.rank, ": isend to rank ", peer,
                 " before connect()");
    m.fail_request(r.get(), "rank " + std::to_string(peer) + " lost: " + failure);
    return p2p_request(r);
  }
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.send = &impl::send_cb;
  p.user_data = r.get();
  ucs_status_ptr_t sp =
      ucp_tag_send_nbx(ps.ep, data, bytes, make_tag(m.opt.rank, tag ^ ps.send_pad), &p);
  m.posted(r, sp, bytes);
  return p2p_request(r);
}

p2p_request ucx_transport::irecv(int peer, std::uint64_t tag, void* data, std::size_t bytes) {
  impl& m = *impl_;
  auto r = m.make_request(peer, tag, bytes, false);
  m.await_proven(peer);
  TROUPE_CHECK(m.peers[peer].proven.load(std::memory_order_acquire) || !peer_failure(peer).empty(),
               "ucx_transport rank ", m.opt.rank, ": irecv from rank ", peer, " before connect()");
  if (!m.enlist(r)) return p2p_request(r);
  // UCX 1.13 reports no length when a message from the unexpected queue completes the receive at
  // once (not even through UCP_OP_ATTR_FIELD_RECV_INFO): deny immediate completion, so that the
  // callback always runs and reports the length.
  ucp_request_param_t p{};
  p.op_attr_mask =
      UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FLAG_NO_IMM_CMPL;
  p.cb.recv = &impl::recv_cb;
  p.user_data = r.get();
  ucs_status_ptr_t sp = ucp_tag_recv_nbx(
      m.worker, data, bytes, make_tag(peer, tag ^ m.peers[peer].recv_pad), full_mask, &p);
  m.posted(r, sp, 0);
  return p2p_request(r);
}

bool ucx_transport::test(p2p_request& r) {
  impl& m = *impl_;
  ucx_request* u = as_ucx(r, m.opt.rank);
  if (u->status.load(std::memory_order_acquire) == detail::p2p_state::pending) {
    m.progress_once();
    m.reap();
  }
  throw_if_failed(*u);
  return u->status.load(std::memory_order_acquire) == detail::p2p_state::done;
}

void ucx_transport::wait(p2p_request& r, std::chrono::milliseconds timeout) {
  impl& m = *impl_;
  ucx_request* u = as_ucx(r, m.opt.rank);
  auto done = [u] {
    return u->status.load(std::memory_order_acquire) != detail::p2p_state::pending;
  };
  if (done()) return throw_if_failed(*u);
  const auto start = clock::now();
  const bool has_deadline = timeout.count() > 0;
  const auto deadline = start + timeout;
  auto check_deadline = [&](clock::time_point now) {
    if (has_deadline && now >= deadline && !done()) {
      TROUPE_FAIL("ucx_transport: timeout after ", timeout.count(),
                  " ms: ", describe(*u, m.opt.rank), " did not complete");
    }
  };
  // Spin while the worker makes progress; back off after 50 us without any.
  constexpr auto spin_idle = std::chrono::microseconds(50);
  constexpr auto yield_idle = std::chrono::microseconds(1000);
  m.active_waiters.fetch_add(1, std::memory_order_acq_rel);
  bool active = true;
  try {
    // The clock is read every 32 polls only: reading it each time cost 17% of an 8-byte ping-pong.
    auto last_progress = start;
    bool progressed = false;
    for (unsigned polls = 1; !done(); ++polls) {
      progressed |= m.progress_once() != 0;
      if (done() || polls % 32 != 0) continue;
      auto now = clock::now();
      check_deadline(now);
      if (progressed) {
        last_progress = now;
        progressed = false;
        continue;
      }
      auto idle = now - last_progress;
      if (idle < spin_idle) continue;
      m.reap();
      m.process_handshakes();
      if (idle < yield_idle) {
        sched_yield();
        continue;
      }
      break;  // idle for a while: sleep below
    }
    // Sleep: with a progress thread, until a completion (futex) or 1 ms; without one, poll with
    // growing naps (20 us .. 500 us).
    long nap_ns = 20000;
    while (!done()) {
      if (active) {
        active = false;
        m.leave_active();
      }
      if (m.progress.joinable()) {
        std::uint32_t seq = m.completions.load(std::memory_order_seq_cst);
        m.sleepers.fetch_add(1, std::memory_order_seq_cst);
        if (!done()) futex_wait(&m.completions, seq, 1000000L);
        m.sleepers.fetch_sub(1, std::memory_order_seq_cst);
        if (!done() && m.progress_once() == 0) m.reap();
        m.process_handshakes();
      } else {
        timespec ts{0, nap_ns};
        nanosleep(&ts, nullptr);
        nap_ns = std::min(nap_ns * 2, 500000L);
        while (m.progress_once() != 0) {
        }
        m.reap();
        m.process_handshakes();
      }
      check_deadline(clock::now());
    }
  } catch (...) {
    if (active) m.leave_active();
    throw;
  }
  if (active) m.leave_active();
  throw_if_failed(*u);
}

void ucx_transport::fail_peer(int peer, const std::string& reason) {
  impl& m = *impl_;
  TROUPE_CHECK(peer >= 0 && peer < m.opt.size, "ucx_transport rank ", m.opt.rank,
               ": fail_peer of invalid rank ", peer);
  if (peer == m.opt.rank) return;
  if (!m.mark_failed(peer, reason, false)) return;
  m.close_endpoint(peer, "rank " + std::to_string(peer) + " lost: " + reason);
}

std::string ucx_transport::peer_failure(int peer) const {
  impl& m = *impl_;
  if (peer < 0 || peer >= m.opt.size) return {};
  std::lock_guard lk(m.mu_);
  return m.peers[peer].failure;
}

bool ucx_transport::same_host(int peer) const {
  impl& m = *impl_;
  if (peer < 0 || peer >= m.opt.size || peer == m.opt.rank) return false;
  return m.peers[peer].local.load();
}

std::uint64_t ucx_transport::bytes_sent() const {
  return impl_->sent.load();
}
std::uint64_t ucx_transport::bytes_received() const {
  return impl_->received.load();
}
std::string ucx_transport::transports() const {
  return impl_->tls;
}

bool ucx_transport::peer_error_handling(int peer) const {
  impl& m = *impl_;
  if (peer < 0 || peer >= m.opt.size || peer == m.opt.rank) return false;
  std::lock_guard ck(m.connect_mu_);
  return m.peers[peer].ep != nullptr && m.peers[peer].error_handling;
}

}  // namespace troupe::collective
