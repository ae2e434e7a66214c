// The NCCL communicator: a non-blocking ncclComm_t, work handles on CUDA events, abort and
// timeouts, and a flight recorder of recent ops.
//
// Locking: `issue_mu` lets one thread at a time issue an op (NCCL needs the calls on a
// communicator serialized, including the polling of a call still in progress); `mu` guards the
// communicator pointer, the abort reason, the flight recorder and the pending list, and is held
// around every single NCCL call, so abort() from another thread (membership) never frees the
// communicator under a call. Polling loops release `mu` between polls.
#include "collective/nccl/nccl_communicator.hpp"

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

#include "collective/work.hpp"
#include "memory/error.hpp"

namespace troupe::collective {

namespace {

using steady = std::chrono::steady_clock;

static_assert(sizeof(ncclUniqueId) == std::tuple_size_v<nccl_unique_id>,
              "nccl_unique_id must hold an ncclUniqueId");

std::string at(const char* file, int line) {
  return " [" + std::string(file) + ":" + std::to_string(line) + "]";
}

std::string cuda_msg(const char* call, cudaError_t e, const char* file, int line) {
  return std::string(call) + " failed: " + cudaGetErrorName(e) + " (" + cudaGetErrorString(e) +
         ")" + at(file, line);
}

std::string nccl_msg(const char* call, ncclResult_t r, ncclComm_t comm, const char* file,
                     int line) {
  std::string m = std::string(call) + " failed: " + ncclGetErrorString(r);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') m += std::string(" (") + last + ")";
  return m + at(file, line);
}

// The message of a failed CUDA call as a string (for the paths that fail a work handle) ...
#define TROUPE_NCCL_CUDA_MSG(expr, e) cuda_msg(#expr, e, __FILE__, __LINE__)
// ... or thrown, prefixed with the context (communicator, op).
#define TROUPE_NCCL_CUDA_THROW(ctx, expr)                                                        \
  do {                                                                                           \
    cudaError_t e_ = (expr);                                                                     \
    if (e_ != cudaSuccess) throw ::troupe::error((ctx) + ": " + TROUPE_NCCL_CUDA_MSG(expr, e_)); \
  } while (0)

// Waiting on the GPU: yield a few times (short ops finish in microseconds), then sleep with a
// growing interval up to 250 us, so a waiter never busy-spins on the shared cores.
void backoff(int i) {
  if (i < 32) {
    std::this_thread::yield();
  } else {
    int us = std::min(250, 10 << std::min(i - 32, 5));
    std::this_thread::sleep_for(std::chrono::microseconds(us));
  }
}

std::string dtype_label(dtype t) {
  std::string_view n = dtype_name(t);
  if (n == "?") return "dtype #" + std::to_string(static_cast<int>(t));
  return "dtype " + std::string(n);
}

// Reductions take the floating types; data movement takes every dtype (bytes are bytes).
bool nccl_type(dtype t, bool reduction, ncclDataType_t* out) {
  switch (t) {
    case dtype::f32:
      *out = ncclFloat32;
      return true;
    case dtype::f64:
      *out = ncclFloat64;
      return true;
    case dtype::bf16:
      *out = ncclBfloat16;
      return true;
    case dtype::f16:
      *out = ncclFloat16;
      return true;
    case dtype::i32:
      *out = ncclInt32;
      return !reduction;
    case dtype::i64:
      *out = ncclInt64;
      return !reduction;
    case dtype::u8:
      *out = ncclUint8;
      return !reduction;
  }
  return false;
}

bool nccl_op(reduce_op op, ncclRedOp_t* out) {
  switch (op) {
    case reduce_op::sum:
      *out = ncclSum;
      return true;
    case reduce_op::avg:
      *out = ncclAvg;
      return true;
    case reduce_op::max:
      *out = ncclMax;
      return true;
  }
  return false;
}

// Makes `device` current for a scope and restores the previous device after.
class device_scope {
 public:
  // Returns an empty string on success, the failure otherwise (no throw: callers decide).
  std::string enter(int device) {
    cudaError_t e = cudaGetDevice(&prev_);
    if (e != cudaSuccess) return TROUPE_NCCL_CUDA_MSG(cudaGetDevice(&prev_), e);
    if (prev_ != device) {
      e = cudaSetDevice(device);
      if (e != cudaSuccess) return TROUPE_NCCL_CUDA_MSG(cudaSetDevice(device), e);
      restore_ = true;
    }
    return {};
  }
  ~device_scope() {
    if (restore_) (void)cudaSetDevice(prev_);  // best effort: a destructor cannot report
  }

 private:
  int prev_ = -1;
  bool restore_ = false;
};

struct nccl_work;

// Everything a communicator and its work handles share; the last of them tears it down.
struct nccl_core {
  std::string name;   // "nccl:<group>"
  std::string where;  // "(rank 0 of 2, device 1)"
  int rank = 0;
  int size = 1;
  int device = 0;
  nccl_options opts;
  steady::time_point t0 = steady::now();

  std::mutex issue_mu;
  mutable std::mutex mu;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;  // the communicator's own stream
  float* scratch = nullptr;       // barrier's one element
  bool aborted = false;
  std::string abort_reason;
  std::uint64_t seq = 0;
  std::vector<flight_record> ring;
  std::vector<std::weak_ptr<nccl_work>> pending;

  ~nccl_core();

  double now_us() const {
    return std::chrono::duration<double, std::micro>(steady::now() - t0).count();
  }
  flight_record* record_locked(std::uint64_t s) {
    if (s == 0 || ring.empty()) return nullptr;
    flight_record& r = ring[(s - 1) % ring.size()];
    return r.seq == s ? &r : nullptr;
  }
  // The first of done/failed wins; the flight recorder follows it.
  void settle_locked(nccl_work& w, bool ok, const std::string& cause);
  void abort_locked(const std::string& reason);
  void refresh_locked();
  // Polls NCCL until the call in flight is no longer ncclInProgress; empty string when it
  // succeeded, the failure otherwise.
  std::string finish_call(const char* call, steady::time_point deadline,
                          std::chrono::milliseconds timeout);
};

struct nccl_work final : detail::work_state {
  nccl_work(op_kind k, std::uint64_t s, std::shared_ptr<nccl_core> c, steady::time_point dl,
            std::chrono::milliseconds to)
      : work_state(k, s, c->name), core(std::move(c)), deadline(dl), timeout(to) {}
  ~nccl_work() override {
    if (event != nullptr) (void)cudaEventDestroy(event);  // a destructor cannot report
  }

  bool test() override {
    poll();
    if (!finished()) return false;
    throw_if_failed();
    return true;
  }
  void wait() override {
    for (int i = 0; !poll(); ++i) backoff(i);
    throw_if_failed();
  }
  void wait_stream(void* s) override {
    if (finished()) {
      throw_if_failed();
      return;
    }
    cudaError_t e = cudaStreamWaitEvent(static_cast<cudaStream_t>(s), event, 0);
    if (e != cudaSuccess) {
      throw troupe::error(describe() + " " + core->where + ": " +
                          TROUPE_NCCL_CUDA_MSG(cudaStreamWaitEvent(s, event, 0), e));
    }
  }

  // One look at the event and at NCCL's asynchronous error; true once the op finished.
  bool poll();

  std::shared_ptr<nccl_core> core;
  cudaEvent_t event = nullptr;
  steady::time_point deadline;
  std::chrono::milliseconds timeout;
};

void nccl_core::settle_locked(nccl_work& w, bool ok, const std::string& cause) {
  bool won = ok ? w.complete() : w.fail(w.describe() + " " + where + " failed: " + cause);
  if (!won) return;
  if (flight_record* r = record_locked(w.seq)) {
    r->state = ok ? "done" : "failed: " + cause;
    r->end_us = now_us();
  }
}

void nccl_core::abort_locked(const std::string& reason) {
  if (aborted) return;  // the first reason stays
  aborted = true;
  abort_reason = reason.empty() ? std::string("aborted") : reason;
  if (comm != nullptr) {
    device_scope ds;
    std::string e = ds.enter(device);
    ncclResult_t r = ncclCommAbort(comm);
    if (r != ncclSuccess && r != ncclInProgress) {
      abort_reason += "; then " + nccl_msg("ncclCommAbort(comm)", r, nullptr, __FILE__, __LINE__);
    }
    if (!e.empty()) abort_reason += "; while aborting: " + e;
    comm = nullptr;
  }
  for (auto& p : pending) {
    if (auto w = p.lock()) settle_locked(*w, false, "aborted: " + abort_reason);
  }
  pending.clear();
}

void nccl_core::refresh_locked() {
  for (auto& p : pending) {
    auto w = p.lock();
    if (w == nullptr || w->finished()) continue;
    // Only completion is recorded here; errors and timeouts are the waiter's to report.
    if (cudaEventQuery(w->event) == cudaSuccess) settle_locked(*w, true, {});
  }
  std::erase_if(pending, [](const std::weak_ptr<nccl_work>& p) {
    auto w = p.lock();
    return w == nullptr || w->finished();
  });
}

std::string nccl_core::finish_call(const char* call, steady::time_point deadline,
                                   std::chrono::milliseconds timeout) {
  for (int i = 0;; ++i) {
    {
      std::lock_guard lock(mu);
      if (aborted) return "aborted: " + abort_reason;
      ncclResult_t state = ncclSuccess;
      ncclResult_t r = ncclCommGetAsyncError(comm, &state);
      if (r != ncclSuccess) {
        return nccl_msg("ncclCommGetAsyncError(comm, &state)", r, comm, __FILE__, __LINE__);
      }
      if (state == ncclSuccess) return {};
      if (state != ncclInProgress) return nccl_msg(call, state, comm, __FILE__, __LINE__);
    }
    if (steady::now() > deadline) {
      return std::string("timeout: ") + call + " still in progress after " +
             std::to_string(timeout.count()) + " ms" + at(__FILE__, __LINE__);
    }
    backoff(i);
  }
}

nccl_core::~nccl_core() {
  // Nobody else holds the core now. A healthy communicator is finalized (flushing what was issued)
  // and destroyed; if that fails or takes longer than the timeout, it is aborted. Failures cannot
  // be reported from here, so they end in the abort.
  device_scope ds;
  (void)ds.enter(device);
  if (comm != nullptr) {
    auto limit = opts.timeout.count() > 0 ? opts.timeout : std::chrono::milliseconds(60000);
    ncclResult_t r = ncclCommFinalize(comm);
    bool ok = r == ncclSuccess || r == ncclInProgress;
    ok = ok && finish_call("ncclCommFinalize(comm)", steady::now() + limit, limit).empty();
    if (ok) {
      (void)ncclCommDestroy(comm);  // finalized: destroy only frees local resources
    } else {
      (void)ncclCommAbort(comm);
    }
    comm = nullptr;
  }
  if (stream != nullptr) (void)cudaStreamDestroy(stream);
  if (scratch != nullptr) (void)cudaFree(scratch);
}

bool nccl_work::poll() {
  if (finished()) return true;
  cudaError_t q = cudaEventQuery(event);
  std::lock_guard lock(core->mu);
  if (q == cudaSuccess) {
    core->settle_locked(*this, true, {});
    return true;
  }
  if (q != cudaErrorNotReady) {
    std::string m = TROUPE_NCCL_CUDA_MSG(cudaEventQuery(event), q);
    // This op fails with its own cause first; the abort then fails the others naming it.
    core->settle_locked(*this, false, m);
    core->abort_locked("while waiting for " + describe() + ": " + m);
    return true;
  }
  if (core->aborted) {
    core->settle_locked(*this, false, "aborted: " + core->abort_reason);
    return true;
  }
  ncclResult_t state = ncclSuccess;
  ncclResult_t r = ncclCommGetAsyncError(core->comm, &state);
  std::string m, reason;
  if (r != ncclSuccess) {
    m = nccl_msg("ncclCommGetAsyncError(comm, &state)", r, core->comm, __FILE__, __LINE__);
  } else if (state != ncclSuccess && state != ncclInProgress) {
    m = nccl_msg("asynchronous NCCL operation", state, core->comm, __FILE__, __LINE__);
  } else if (steady::now() > deadline) {
    // The flight record says what the op moves; NCCL does not say which ranks have arrived.
    std::string after = " after " + std::to_string(timeout.count()) + " ms";
    if (const flight_record* fr = core->record_locked(seq))
      after += " (" + std::string(dtype_name(fr->type)) + " x " + std::to_string(fr->count) +
               " on ranks of " + core->name + "; NCCL does not say which ranks have arrived)";
    m = "timeout: not finished" + after + "; communicator aborted" + at(__FILE__, __LINE__);
    reason = "timeout: " + describe() + " not finished" + after;
  }
  if (m.empty()) return false;
  core->settle_locked(*this, false, m);
  core->abort_locked(reason.empty() ? "while waiting for " + describe() + ": " + m : reason);
  return true;
}

// The NCCL calls of one op: returns the result and names the call through `call`.
using enqueue_fn = std::function<ncclResult_t(ncclComm_t, cudaStream_t, const char** call)>;
// CUDA work the op needs on its stream before the NCCL calls (the self block of all_to_all).
using prepare_fn = std::function<std::string(cudaStream_t)>;

class nccl_communicator final : public communicator {
 public:
  explicit nccl_communicator(std::shared_ptr<nccl_core> c) : core_(std::move(c)) {}

  int rank() const override { return core_->rank; }
  int size() const override { return core_->size; }
  std::string name() const override { return core_->name; }

  work allreduce(void* data, std::size_t count, dtype t, const options& o) override {
    const char* op = "allreduce";
    ncclDataType_t nt = type_of(t, true, op);
    ncclRedOp_t rop = red_op_of(o.op, op);
    check_ptr(data, count, op, "data");
    return issue(op_kind::allreduce, t, count, -1, o, {},
                 [=](ncclComm_t comm, cudaStream_t s, const char** call) {
                   *call = "ncclAllReduce(data, data, count, type, op, comm, stream)";
                   return ncclAllReduce(data, data, count, nt, rop, comm, s);
                 });
  }

  work reduce_scatter(const void* in, void* out, std::size_t count, dtype t,
                      const options& o) override {
    const char* op = "reduce_scatter";
    ncclDataType_t nt = type_of(t, true, op);
    ncclRedOp_t rop = red_op_of(o.op, op);
    check_ptr(in, count, op, "in");
    check_ptr(out, count, op, "out");
    return issue(op_kind::reduce_scatter, t, count, -1, o, {},
                 [=](ncclComm_t comm, cudaStream_t s, const char** call) {
                   *call = "ncclReduceScatter(in, out, count, type, op, comm, stream)";
                   return ncclReduceScatter(in, out, count, nt, rop, comm, s);
                 });
  }

  work all_gather(const void* in, void* out, std::size_t count, dtype t,
                  const options& o) override {
    const char* op = "all_gather";
    ncclDataType_t nt = type_of(t, false, op);
    check_ptr(in, count, op, "in");
    check_ptr(out, count, op, "out");
    return issue(op_kind::all_gather, t, count, -1, o, {},
                 [=](ncclComm_t comm, cudaStream_t s, const char** call) {
                   *call = "ncclAllGather(in, out, count, type, comm, stream)";
                   return ncclAllGather(in, out, count, nt, comm, s);
                 });
  }

  work broadcast(void* data, std::size_t count, dtype t, const options& o) override {
    const char* op = "broadcast";
    ncclDataType_t nt = type_of(t, false, op);
    TROUPE_CHECK(o.root >= 0 && o.root < core_->size, ctx(op), ": root ", o.root,
                 " is not a rank of the group (size ", core_->size, ")");
    check_ptr(data, count, op, "data");
    int root = o.root;
    return issue(op_kind::broadcast, t, count, root, o, {},
                 [=](ncclComm_t comm, cudaStream_t s, const char** call) {
                   *call = "ncclBroadcast(data, data, count, type, root, comm, stream)";
                   return ncclBroadcast(data, data, count, nt, root, comm, s);
                 });
  }

  work all_to_all(const void* in, void* out, std::size_t count, dtype t,
                  const options& o) override {
    std::vector<std::size_t> counts(static_cast<std::size_t>(core_->size), count);
    return exchange(op_kind::all_to_all, in, counts, out, counts, t, o, count);
  }

  work all_to_allv(const void* in, std::span<const std::size_t> send_counts, void* out,
                   std::span<const std::size_t> recv_counts, dtype t, const options& o) override {
    auto n = static_cast<std::size_t>(core_->size);
    TROUPE_CHECK(send_counts.size() == n && recv_counts.size() == n, ctx("all_to_allv"), ": ",
                 send_counts.size(), " send counts and ", recv_counts.size(),
                 " receive counts for a group of size ", n);
    std::size_t total = 0;
    for (std::size_t c : send_counts) total += c;
    return exchange(op_kind::all_to_allv, in, send_counts, out, recv_counts, t, o, total);
  }

  work send(const void* data, std::size_t count, dtype t, int peer, const options& o) override {
    const char* op = "send";
    ncclDataType_t nt = type_of(t, false, op);
    check_peer(peer, op);
    check_ptr(data, count, op, "data");
    return issue(op_kind::send, t, count, peer, o, {},
                 [=](ncclComm_t comm, cudaStream_t s, const char** call) {
                   *call = "ncclSend(data, count, type, peer, comm, stream)";
                   return ncclSend(data, count, nt, peer, comm, s);
                 });
  }

  work recv(void* data, std::size_t count, dtype t, int peer, const options& o) override {
    const char* op = "recv";
    ncclDataType_t nt = type_of(t, false, op);
    check_peer(peer, op);
    check_ptr(data, count, op, "data");
    return issue(op_kind::recv, t, count, peer, o, {},
                 [=](ncclComm_t comm, cudaStream_t s, const char** call) {
                   *call = "ncclRecv(data, count, type, peer, comm, stream)";
                   return ncclRecv(data, count, nt, peer, comm, s);
                 });
  }

  work barrier(const options& o) override {
    float* scratch = core_->scratch;
    return issue(op_kind::barrier, dtype::f32, 1, -1, o, {},
                 [=](ncclComm_t comm, cudaStream_t s, const char** call) {
                   *call = "ncclAllReduce(scratch, scratch, 1, ncclFloat32, ncclSum, comm, stream)";
                   return ncclAllReduce(scratch, scratch, 1, ncclFloat32, ncclSum, comm, s);
                 });
  }

  void set_timeout(std::chrono::milliseconds timeout) override {
    std::lock_guard issue_lock(core_->issue_mu);  // issue() reads opts.timeout under it
    core_->opts.timeout = timeout;
  }

  void abort(const std::string& reason) override {
    std::lock_guard lock(core_->mu);
    core_->abort_locked(reason);
  }

  std::vector<flight_record> recent() const override {
    std::lock_guard lock(core_->mu);
    core_->refresh_locked();
    std::vector<flight_record> out;
    std::uint64_t last = core_->seq;
    std::uint64_t cap = core_->ring.size();
    for (std::uint64_t s = last > cap ? last - cap + 1 : 1; s <= last; ++s) {
      out.push_back(core_->ring[(s - 1) % cap]);
    }
    return out;
  }

 private:
  // "nccl:world allreduce (rank 0 of 2, device 0)": built only when a check fails.
  std::string ctx(const char* op) const { return core_->name + " " + op + " " + core_->where; }
  ncclDataType_t type_of(dtype t, bool reduction, const char* op) const {
    ncclDataType_t nt = ncclFloat32;
    TROUPE_CHECK(nccl_type(t, reduction, &nt), ctx(op), ": ", dtype_label(t), " is not supported",
                 reduction ? " by NCCL reductions here (f32, f64, bf16 and f16 are)" : "");
    return nt;
  }
  ncclRedOp_t red_op_of(reduce_op r, const char* op) const {
    ncclRedOp_t nr = ncclSum;
    TROUPE_CHECK(nccl_op(r, &nr), ctx(op), ": unknown reduce_op #", static_cast<int>(r));
    return nr;
  }
  void check_peer(int peer, const char* op) const {
    TROUPE_CHECK(peer >= 0 && peer < core_->size, ctx(op), ": peer ", peer,
                 " is not a rank of the group (size ", core_->size, ")");
    TROUPE_CHECK(peer != core_->rank, ctx(op), ": peer ", peer,
                 " is this rank; a rank cannot send to itself");
  }
  void check_ptr(const void* p, std::size_t count, const char* op, const char* arg) const {
    TROUPE_CHECK(p != nullptr || count == 0, ctx(op), ": ", arg, " is null for ", count,
                 " elements");
  }

  // all_to_all and all_to_allv: the self block is a device copy, the rest grouped send/recv.
  work exchange(op_kind k, const void* in, std::span<const std::size_t> send_counts, void* out,
                std::span<const std::size_t> recv_counts, dtype t, const options& o,
                std::size_t record_count) {
    const char* op = op_kind_name(k);
    ncclDataType_t nt = type_of(t, false, op);
    const int n = core_->size;
    const int me = core_->rank;
    const std::size_t es = dtype_size(t);
    std::vector<std::size_t> soff(n + 1, 0), roff(n + 1, 0);
    for (int j = 0; j < n; ++j) {
      soff[j + 1] = soff[j] + send_counts[j];
      roff[j + 1] = roff[j] + recv_counts[j];
    }
    TROUPE_CHECK(send_counts[me] == recv_counts[me], ctx(op), ": sends ", send_counts[me],
                 " elements to itself but expects ", recv_counts[me]);
    check_ptr(in, soff[n], op, "in");
    check_ptr(out, roff[n], op, "out");
    auto* src = static_cast<const char*>(in);
    auto* dst = static_cast<char*>(out);
    std::vector<std::size_t> sc(send_counts.begin(), send_counts.end());
    std::vector<std::size_t> rc(recv_counts.begin(), recv_counts.end());
    std::size_t self_bytes = sc[me] * es;
    prepare_fn prepare;
    if (self_bytes > 0) {
      const char* from = src + soff[me] * es;
      char* to = dst + roff[me] * es;
      prepare = [=](cudaStream_t s) -> std::string {
        cudaError_t e = cudaMemcpyAsync(to, from, self_bytes, cudaMemcpyDeviceToDevice, s);
        if (e == cudaSuccess) return {};
        return TROUPE_NCCL_CUDA_MSG(
            cudaMemcpyAsync(to, from, self_bytes, cudaMemcpyDeviceToDevice, stream), e);
      };
    }
    bool remote = false;
    for (int j = 0; j < n; ++j) remote = remote || (j != me && (sc[j] > 0 || rc[j] > 0));
    enqueue_fn enqueue;
    if (remote) {
      enqueue = [=](ncclComm_t comm, cudaStream_t s, const char** call) {
        *call = "ncclGroupStart()";
        ncclResult_t r = ncclGroupStart();
        if (r != ncclSuccess) return r;
        for (int j = 0; j < n && r == ncclSuccess; ++j) {
          if (j == me) continue;
          if (sc[j] > 0) {
            *call = "ncclSend(in + offset, count, type, peer, comm, stream)";
            r = ncclSend(src + soff[j] * es, sc[j], nt, j, comm, s);
          }
          if (r == ncclSuccess && rc[j] > 0) {
            *call = "ncclRecv(out + offset, count, type, peer, comm, stream)";
            r = ncclRecv(dst + roff[j] * es, rc[j], nt, j, comm, s);
          }
        }
        if (r != ncclSuccess) {
          (void)ncclGroupEnd();  // closes the group; the first failure is the one reported
          return r;
        }
        *call = "ncclGroupEnd()";
        return ncclGroupEnd();
      };
    }
    return issue(k, t, record_count, -1, o, std::move(prepare), std::move(enqueue));
  }

  // Records the op, enqueues it (prepare, then the NCCL calls under `mu`), waits until NCCL no
  // longer says ncclInProgress, and records the event the work handle polls. A failure aborts the
  // communicator and fails the returned work.
  work issue(op_kind k, dtype t, std::size_t count, int peer, const options& o,
             const prepare_fn& prepare, const enqueue_fn& enqueue) {
    nccl_core& c = *core_;
    std::lock_guard issue_lock(c.issue_mu);
    std::chrono::milliseconds timeout = o.timeout.count() > 0 ? o.timeout : c.opts.timeout;
    steady::time_point deadline =
        timeout.count() > 0 ? steady::now() + timeout : steady::time_point::max();
    std::shared_ptr<nccl_work> w;
    {
      std::lock_guard lock(c.mu);
      c.refresh_locked();
      std::uint64_t seq = ++c.seq;
      w = std::make_shared<nccl_work>(k, seq, core_, deadline, timeout);
      flight_record& r = c.ring[(seq - 1) % c.ring.size()];
      r = flight_record{seq, k, t, count, peer, "issued", c.now_us(), 0};
      if (c.aborted) {
        c.settle_locked(*w, false, "aborted: " + c.abort_reason);
        return work(w);
      }
    }
    // Nothing to move (every rank agrees on that): only the event is recorded. all_to_allv
    // decides from both count lists in exchange().
    static const enqueue_fn nothing;
    const enqueue_fn& calls = count == 0 && k != op_kind::all_to_allv ? nothing : enqueue;
    std::string failure = enqueue_on_stream(*w, o, prepare, calls, deadline, timeout);
    std::lock_guard lock(c.mu);
    if (!failure.empty()) {
      c.settle_locked(*w, false, failure);
      c.abort_locked(w->describe() + ": " + failure);
    } else if (c.aborted) {
      c.settle_locked(*w, false, "aborted: " + c.abort_reason);
    } else {
      if (flight_record* r = c.record_locked(w->seq)) r->state = "running";
      c.pending.push_back(w);
    }
    return work(w);
  }

  std::string enqueue_on_stream(nccl_work& w, const options& o, const prepare_fn& prepare,
                                const enqueue_fn& enqueue, steady::time_point deadline,
                                std::chrono::milliseconds timeout) {
    nccl_core& c = *core_;
    device_scope ds;
    if (std::string e = ds.enter(c.device); !e.empty()) return e;
    cudaStream_t s = o.stream != nullptr ? static_cast<cudaStream_t>(o.stream) : c.stream;
    cudaError_t e = cudaEventCreateWithFlags(&w.event, cudaEventDisableTiming);
    if (e != cudaSuccess) {
      return TROUPE_NCCL_CUDA_MSG(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), e);
    }
    if (prepare) {
      if (std::string m = prepare(s); !m.empty()) return m;
    }
    if (enqueue) {
      const char* call = "?";
      ncclResult_t r;
      {
        std::lock_guard lock(c.mu);
        if (c.aborted) return "aborted: " + c.abort_reason;
        r = enqueue(c.comm, s, &call);
        if (r != ncclSuccess && r != ncclInProgress) {
          return nccl_msg(call, r, c.comm, __FILE__, __LINE__);
        }
      }
      if (std::string m = c.finish_call(call, deadline, timeout); !m.empty()) return m;
    }
    e = cudaEventRecord(w.event, s);
    if (e != cudaSuccess) return TROUPE_NCCL_CUDA_MSG(cudaEventRecord(event, stream), e);
    return {};
  }

  std::shared_ptr<nccl_core> core_;
};

}  // namespace

nccl_unique_id make_nccl_unique_id() {
  ncclUniqueId uid;
  ncclResult_t r = ncclGetUniqueId(&uid);
  if (r != ncclSuccess) {
    throw troupe::error("make_nccl_unique_id: " +
                        nccl_msg("ncclGetUniqueId(&uid)", r, nullptr, __FILE__, __LINE__) +
                        " (NCCL_SOCKET_IFNAME names the interface for its bootstrap)");
  }
  nccl_unique_id id;
  std::memcpy(id.data(), uid.internal, id.size());
  return id;
}

std::unique_ptr<communicator> make_nccl_communicator(int rank, int size, const nccl_unique_id& id,
                                                     int device, nccl_options opts) {
  std::string what = "make_nccl_communicator(group '" + opts.group + "')";
  TROUPE_CHECK(size >= 1, what, ": size ", size, " must be at least 1");
  TROUPE_CHECK(rank >= 0 && rank < size, what, ": rank ", rank, " is outside 0..", size - 1);
  TROUPE_CHECK(device >= 0, what, ": rank ", rank, " device ", device, " is negative");
  TROUPE_CHECK(opts.flight_records >= 1, what, ": flight_records must be at least 1");
  int n = 0;  // left untouched on error
  cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    (void)cudaGetLastError();  // clear the error, as memory/gpu.cpp does
    TROUPE_FAIL(what, ": rank ", rank, " has no usable GPU (cudaGetDeviceCount: ",
                e == cudaSuccess ? "0 devices" : cudaGetErrorName(e), ")");
  }
  TROUPE_CHECK(device < n, what, ": rank ", rank, " asked for device ", device, " but only ", n,
               " GPU(s) are visible");

  auto core = std::make_shared<nccl_core>();
  core->name = "nccl:" + opts.group;
  core->where = "(rank " + std::to_string(rank) + " of " + std::to_string(size) + ", device " +
                std::to_string(device) + ")";
  core->rank = rank;
  core->size = size;
  core->device = device;
  core->opts = std::move(opts);
  core->ring.resize(core->opts.flight_records);
  std::string ctx = core->name + " init " + core->where;

  device_scope ds;
  if (std::string m = ds.enter(device); !m.empty()) throw troupe::error(ctx + ": " + m);
  // A blocking stream: it orders after work on the legacy default stream, so buffers written there
  // by the caller are ready when an op without options::stream starts.
  TROUPE_NCCL_CUDA_THROW(ctx, cudaStreamCreate(&core->stream));
  TROUPE_NCCL_CUDA_THROW(ctx, cudaMalloc(reinterpret_cast<void**>(&core->scratch), sizeof(float)));
  TROUPE_NCCL_CUDA_THROW(ctx, cudaMemset(core->scratch, 0, sizeof(float)));

  ncclUniqueId uid;
  std::memcpy(uid.internal, id.data(), id.size());
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.commName = core->name.c_str();
  ncclComm_t comm = nullptr;
  ncclResult_t r = ncclCommInitRankConfig(&comm, size, uid, rank, &config);
  std::string failure;
  {
    std::lock_guard lock(core->mu);
    core->comm = comm;  // from here the core aborts it on failure
    if (r != ncclSuccess && r != ncclInProgress) {
      failure = nccl_msg("ncclCommInitRankConfig(&comm, size, id, rank, &config)", r, comm,
                         __FILE__, __LINE__);
    } else if (comm == nullptr) {
      failure = "ncclCommInitRankConfig returned no communicator" + at(__FILE__, __LINE__);
    }
  }
  if (failure.empty()) {
    auto limit = core->opts.timeout;
    auto deadline = limit.count() > 0 ? steady::now() + limit : steady::time_point::max();
    failure = core->finish_call("ncclCommInitRankConfig", deadline, limit);
    if (failure.rfind("timeout", 0) == 0) {
      failure += " (did every rank of the group call make_nccl_communicator with the same id?)";
    }
  }
  if (!failure.empty()) {
    std::lock_guard lock(core->mu);
    core->abort_locked(failure);
    throw troupe::error(ctx + ": " + failure);
  }
  return std::make_unique<nccl_communicator>(std::move(core));
}

}  // namespace troupe::collective
