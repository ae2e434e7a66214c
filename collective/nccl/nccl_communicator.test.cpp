// Tests of the NCCL communicator on device buffers against host references computed here.
//
// The inputs are multiples of 1/4 in [-16, 16), so sums and averages of up to two ranks are exact
// in every float type and the results compare byte for byte. Without a GPU only the checks that
// need none run (the unique id, argument errors); a build without NCCL skips everything.
#include <catch2/catch.hpp>

#include "memory/gpu.hpp"

#ifdef TROUPE_HAVE_NCCL

#include <cuda_runtime_api.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "collective/nccl/nccl_communicator.hpp"
#include "memory/buffer.hpp"
#include "memory/error.hpp"
#include "tensor/dtype.hpp"

namespace {

using namespace troupe;
using namespace troupe::collective;
using Catch::Contains;
using bytes = std::vector<std::uint8_t>;

// NCCL's bootstrap picks a network interface; on one host the loopback one always works.
void use_loopback() {
  setenv("NCCL_SOCKET_IFNAME", "lo", 0);
}

float val(int rank, std::size_t i) {
  return static_cast<float>(
             static_cast<int>((i * 7 + static_cast<std::size_t>(rank) * 13 + 5) % 128) - 64) *
         0.25f;
}

bytes encode(dtype t, const std::vector<float>& v) {
  bytes b(v.size() * dtype_size(t));
  for (std::size_t i = 0; i < v.size(); ++i) {
    std::uint8_t* p = b.data() + i * dtype_size(t);
    if (t == dtype::f32) {
      std::memcpy(p, &v[i], 4);
    } else if (t == dtype::f64) {
      double d = v[i];
      std::memcpy(p, &d, 8);
    } else if (t == dtype::bf16) {
      std::uint16_t h = f32_to_bf16_bits(v[i]);
      std::memcpy(p, &h, 2);
    } else if (t == dtype::f16) {
      std::uint16_t h = f32_to_f16_bits(v[i]);
      std::memcpy(p, &h, 2);
    } else if (t == dtype::i32) {
      auto x = static_cast<std::int32_t>(v[i] * 4);
      std::memcpy(p, &x, 4);
    }
  }
  return b;
}

// Device memory holding `n` elements of `t`; filled with 0xff bytes (NaN) unless given values.
struct device_array {
  device_array(dtype t, std::size_t n) : t(t), n(n), buf(memory::buffer::device(bytes_of(t, n))) {
    bytes ff(bytes_of(t, n), 0xff);
    memory::copy_bytes(buf.data(), ff.data(), ff.size(), memory::copy_kind::host_to_device);
  }
  device_array(dtype t, const std::vector<float>& v) : device_array(t, v.size()) {
    bytes b = encode(t, v);
    memory::copy_bytes(buf.data(), b.data(), b.size(), memory::copy_kind::host_to_device);
  }
  static std::size_t bytes_of(dtype t, std::size_t n) {
    return std::max<std::size_t>(1, n) * dtype_size(t);
  }
  void* data() const { return buf.data(); }
  bytes read() const {
    bytes b(n * dtype_size(t));
    memory::copy_bytes(b.data(), buf.data(), b.size(), memory::copy_kind::device_to_host);
    return b;
  }
  dtype t;
  std::size_t n;
  memory::buffer buf;
};

// Collects mismatches as strings: the ranks run on threads, where Catch's assertions may not.
struct findings {
  std::vector<std::string> bad;
  void expect(const std::string& what, dtype t, const device_array& got,
              const std::vector<float>& want) {
    bytes g = got.read();
    bytes w = encode(t, want);
    if (g == w) return;
    std::size_t es = dtype_size(t);
    std::size_t i = 0;
    for (; i < want.size(); ++i) {
      if (std::memcmp(g.data() + i * es, w.data() + i * es, es) != 0) break;
    }
    bad.push_back(what + " " + std::string(dtype_name(t)) + ": element " + std::to_string(i) +
                  " differs from " + std::to_string(want[i]));
  }
};

std::size_t a2av_count(int src, int dst) {
  return (src + dst) % 3 == 2 ? 0 : static_cast<std::size_t>(3 + 5 * src + 2 * dst);
}

// Every op of the interface on device buffers, checked against the serial reference. Called by
// each rank (thread) of a group; returns what differed.
std::vector<std::string> run_every_op(communicator& c, dtype t) {
  const int r = c.rank();
  const int n = c.size();
  const std::size_t N = 1000;
  findings f;
  auto reduce = [&](reduce_op op, std::size_t i) {
    float acc = op == reduce_op::max ? val(0, i) : 0.0f;
    for (int q = 0; q < n; ++q)
      acc = op == reduce_op::max ? std::max(acc, val(q, i)) : acc + val(q, i);
    return op == reduce_op::avg ? acc / static_cast<float>(n) : acc;
  };

  for (reduce_op op : {reduce_op::sum, reduce_op::avg, reduce_op::max}) {
    std::vector<float> in(N), want(N);
    for (std::size_t i = 0; i < N; ++i) in[i] = val(r, i), want[i] = reduce(op, i);
    device_array d(t, in);
    options o;
    o.op = op;
    c.allreduce(d.data(), N, t, o).wait();
    f.expect(std::string("allreduce ") + reduce_op_name(op), t, d, want);
  }
  c.allreduce(nullptr, 0, t).wait();  // nothing to reduce is fine

  for (reduce_op op : {reduce_op::sum, reduce_op::max}) {
    std::vector<float> in(N * n), want(N);
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = val(r, i);
    for (std::size_t k = 0; k < N; ++k) want[k] = reduce(op, static_cast<std::size_t>(r) * N + k);
    device_array din(t, in), dout(t, N);
    options o;
    o.op = op;
    c.reduce_scatter(din.data(), dout.data(), N, t, o).wait();
    f.expect(std::string("reduce_scatter ") + reduce_op_name(op), t, dout, want);
  }

  {
    std::vector<float> in(N), want(N * n);
    for (std::size_t i = 0; i < N; ++i) in[i] = val(r, i);
    for (int q = 0; q < n; ++q)
      for (std::size_t i = 0; i < N; ++i) want[q * N + i] = val(q, i);
    device_array din(t, in), dout(t, N * n);
    c.all_gather(din.data(), dout.data(), N, t).wait();
    f.expect("all_gather", t, dout, want);
  }

  {
    const int root = n - 1;
    std::vector<float> in(N), want(N);
    for (std::size_t i = 0; i < N; ++i) in[i] = val(r, i), want[i] = val(root, i);
    device_array d(t, in);
    options o;
    o.root = root;
    c.broadcast(d.data(), N, t, o).wait();
    f.expect("broadcast", t, d, want);
  }

  {
    std::vector<float> in(N * n), want(N * n);
    for (std::size_t i = 0; i < in.size(); ++i) in[i] = val(r, i);
    for (int q = 0; q < n; ++q)
      for (std::size_t k = 0; k < N; ++k)
        want[q * N + k] = val(q, static_cast<std::size_t>(r) * N + k);
    device_array din(t, in), dout(t, N * n);
    c.all_to_all(din.data(), dout.data(), N, t).wait();
    f.expect("all_to_all", t, dout, want);
  }

  {
    std::vector<std::size_t> sc(n), rc(n);
    std::vector<float> in, want;
    for (int j = 0; j < n; ++j) {
      sc[j] = a2av_count(r, j);
      rc[j] = a2av_count(j, r);
      for (std::size_t k = 0; k < sc[j]; ++k) in.push_back(val(r, 1000 * j + k));
      for (std::size_t k = 0; k < rc[j]; ++k) want.push_back(val(j, 1000 * r + k));
    }
    device_array din(t, in), dout(t, want.size());
    c.all_to_allv(din.data(), sc, dout.data(), rc, t).wait();
    f.expect("all_to_allv", t, dout, want);
  }

  if (n > 1) {  // a ring: rank 0 sends first, every other rank receives first
    const int next = (r + 1) % n, prev = (r + n - 1) % n;
    std::vector<float> in(N), want(N);
    for (std::size_t i = 0; i < N; ++i) in[i] = val(r, i), want[i] = val(prev, i);
    device_array din(t, in), dout(t, N);
    if (r == 0) c.send(din.data(), N, t, next).wait();
    c.recv(dout.data(), N, t, prev).wait();
    if (r != 0) c.send(din.data(), N, t, next).wait();
    f.expect("send/recv", t, dout, want);
  }

  c.barrier().wait();
  return f.bad;
}

bool skip_without_gpu() {
  if (memory::gpu_available()) return false;
  WARN("troupe-skip: no GPU");
  return true;
}

}  // namespace

TEST_CASE("make_nccl_unique_id works without a GPU", "[collective]") {
  use_loopback();
  nccl_unique_id a = make_nccl_unique_id();
  nccl_unique_id b = make_nccl_unique_id();
  CHECK(a != b);
  CHECK(std::any_of(a.begin(), a.end(), [](char ch) { return ch != 0; }));
}

TEST_CASE("make_nccl_communicator rejects a bad rank or size before touching the GPU",
          "[collective]") {
  nccl_unique_id id{};
  nccl_options o;
  o.group = "tp#3";
  REQUIRE_THROWS_AS(make_nccl_communicator(2, 2, id, 0, o), troupe::error);
  REQUIRE_THROWS_WITH(make_nccl_communicator(2, 2, id, 0, o),
                      Contains("tp#3") && Contains("rank 2 is outside 0..1"));
  REQUIRE_THROWS_WITH(make_nccl_communicator(-1, 2, id, 0, o), Contains("rank -1"));
  REQUIRE_THROWS_WITH(make_nccl_communicator(0, 0, id, 0, o), Contains("size 0"));
  REQUIRE_THROWS_WITH(make_nccl_communicator(0, 1, id, -1, o), Contains("device -1"));
}

TEST_CASE("make_nccl_communicator without a GPU says that there is none", "[collective]") {
  if (memory::gpu_available()) return;  // the GPU tests below cover this machine
  nccl_unique_id id{};
  REQUIRE_THROWS_WITH(make_nccl_communicator(0, 1, id, 0), Contains("no usable GPU"));
}

TEST_CASE("A single rank NCCL communicator does every op on device buffers", "[gpu][collective]") {
  if (skip_without_gpu()) return;
  use_loopback();
  auto c = make_nccl_communicator(0, 1, make_nccl_unique_id(), 0);
  REQUIRE(c->rank() == 0);
  REQUIRE(c->size() == 1);
  REQUIRE(c->name() == "nccl:world");
  for (dtype t : {dtype::f32, dtype::bf16, dtype::f16, dtype::f64}) {
    INFO("dtype " << dtype_name(t));
    std::vector<std::string> bad = run_every_op(*c, t);
    for (const auto& b : bad) FAIL_CHECK(b);
  }
  // Data movement takes integer types too.
  std::vector<float> in(64);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = val(0, i);
  device_array din(dtype::i32, in), dout(dtype::i32, in.size());
  c->all_gather(din.data(), dout.data(), in.size(), dtype::i32).wait();
  bool same = dout.read() == encode(dtype::i32, in);
  CHECK(same);
}

TEST_CASE("NCCL work handles test and order a user stream", "[gpu][collective]") {
  if (skip_without_gpu()) return;
  use_loopback();
  nccl_options no;
  no.flight_records = 4;
  auto c = make_nccl_communicator(0, 1, make_nccl_unique_id(), 0, no);
  const std::size_t n = 1 << 20;
  std::vector<float> in(n);
  for (std::size_t i = 0; i < n; ++i) in[i] = val(3, i);
  device_array d(dtype::f32, in);
  memory::device_synchronize();  // `mine` does not order after the legacy stream's copies

  cudaStream_t mine = nullptr, later = nullptr;
  REQUIRE(cudaStreamCreateWithFlags(&mine, cudaStreamNonBlocking) == cudaSuccess);
  REQUIRE(cudaStreamCreateWithFlags(&later, cudaStreamNonBlocking) == cudaSuccess);
  options o;
  o.stream = mine;
  o.op = reduce_op::max;
  work w = c->allreduce(d.data(), n, dtype::f32, o);
  w.wait_stream(later);  // `later` now orders after the allreduce
  std::vector<float> back(n);
  REQUIRE(cudaMemcpyAsync(back.data(), d.data(), n * 4, cudaMemcpyDeviceToHost, later) ==
          cudaSuccess);
  REQUIRE(cudaStreamSynchronize(later) == cudaSuccess);
  bool same = back == in;  // (not CHECK(back == in): Catch would print a million floats)
  CHECK(same);
  for (int i = 0; !w.test(); ++i) std::this_thread::sleep_for(std::chrono::microseconds(10));
  w.wait();  // finished work waits no more

  for (int i = 0; i < 5; ++i) c->barrier().wait();
  std::vector<flight_record> rec = c->recent();
  REQUIRE(rec.size() == 4);  // the ring keeps the newest 4 of 6
  for (std::size_t i = 0; i < rec.size(); ++i) {
    CHECK(rec[i].seq == 3 + i);
    CHECK(rec[i].kind == op_kind::barrier);
    CHECK(rec[i].state == "done");
    CHECK(rec[i].end_us >= rec[i].start_us);
  }
  REQUIRE(cudaStreamDestroy(mine) == cudaSuccess);
  REQUIRE(cudaStreamDestroy(later) == cudaSuccess);
}

TEST_CASE("An aborted NCCL communicator fails later ops with the reason", "[gpu][collective]") {
  if (skip_without_gpu()) return;
  use_loopback();
  auto c = make_nccl_communicator(0, 1, make_nccl_unique_id(), 0);
  c->barrier().wait();
  c->abort("rank 3 lost: heartbeat missed");
  device_array d(dtype::f32, std::vector<float>(16, 1.0f));
  work w = c->allreduce(d.data(), 16, dtype::f32);
  REQUIRE_THROWS_WITH(w.wait(), Contains("allreduce #2") && Contains("rank 3 lost"));
  REQUIRE_THROWS_WITH(c->barrier().wait(), Contains("barrier #3") && Contains("rank 3 lost"));
  auto rec = c->recent();
  REQUIRE(rec.size() == 3);
  CHECK(rec[0].state == "done");
  CHECK(rec[2].state.rfind("failed: aborted: rank 3 lost", 0) == 0);
}

TEST_CASE("NCCL ops reject bad dtypes and peers with the op named", "[gpu][collective]") {
  if (skip_without_gpu()) return;
  use_loopback();
  auto c = make_nccl_communicator(0, 1, make_nccl_unique_id(), 0);
  device_array d(dtype::f32, 8);
  REQUIRE_THROWS_WITH(c->allreduce(d.data(), 8, dtype::i32),
                      Contains("allreduce") && Contains("dtype i32"));
  REQUIRE_THROWS_WITH(c->reduce_scatter(d.data(), d.data(), 8, dtype::u8),
                      Contains("reduce_scatter") && Contains("dtype u8"));
  REQUIRE_THROWS_WITH(c->all_gather(d.data(), d.data(), 1, static_cast<dtype>(42)),
                      Contains("dtype #42"));
  REQUIRE_THROWS_WITH(c->send(d.data(), 8, dtype::f32, 0), Contains("send") && Contains("itself"));
  REQUIRE_THROWS_WITH(c->recv(d.data(), 8, dtype::f32, 1), Contains("peer 1"));
  options o;
  o.root = 1;
  REQUIRE_THROWS_WITH(c->broadcast(d.data(), 8, dtype::f32, o), Contains("root 1"));
  REQUIRE_THROWS_WITH(make_nccl_communicator(0, 1, make_nccl_unique_id(), memory::gpu_count()),
                      Contains("device"));
  c->barrier().wait();  // argument errors leave the communicator usable
}

TEST_CASE("Two NCCL ranks on two GPUs match the serial reference", "[gpu][collective]") {
  if (skip_without_gpu()) return;
  if (memory::gpu_count() < 2) {
    WARN("troupe-skip: needs 2 GPUs, found " << memory::gpu_count());
    return;
  }
  use_loopback();
  const nccl_unique_id id = make_nccl_unique_id();
  std::vector<std::string> bad[2];
  std::string timeout_error;
  std::barrier sync(2);
  auto rank_main = [&](int r) {
    try {
      if (cudaSetDevice(r) != cudaSuccess) throw troupe::error("cudaSetDevice failed");
      nccl_options no;
      no.group = "pair";
      no.timeout = std::chrono::seconds(60);
      auto c = make_nccl_communicator(r, 2, id, r, no);
      for (dtype t : {dtype::f32, dtype::bf16, dtype::f16, dtype::f64}) {
        for (auto& b : run_every_op(*c, t)) bad[r].push_back(b);
      }
      sync.arrive_and_wait();
      // Rank 1 never joins this allreduce: rank 0 times out, naming the op.
      if (r == 0) {
        device_array d(dtype::f32, std::vector<float>(16, 1.0f));
        options o;
        o.timeout = std::chrono::milliseconds(300);
        try {
          c->allreduce(d.data(), 16, dtype::f32, o).wait();
        } catch (const troupe::error& e) {
          timeout_error = e.what();
        }
      }
      sync.arrive_and_wait();
      c->abort("test over");  // rank 0's peer is gone: no finalize
    } catch (const std::exception& e) {
      bad[r].push_back(std::string("rank ") + std::to_string(r) + ": " + e.what());
      sync.arrive_and_drop();
    }
  };
  std::thread t0(rank_main, 0), t1(rank_main, 1);
  t0.join();
  t1.join();
  for (int r = 0; r < 2; ++r)
    for (const auto& b : bad[r]) FAIL_CHECK("rank " << r << ": " << b);
  CHECK_THAT(timeout_error, Contains("timeout") && Contains("allreduce"));
}

#else  // no NCCL in this build

TEST_CASE("NCCL communicator tests need a build with CUDA and NCCL", "[gpu][collective]") {
  WARN("troupe-skip: no GPU (troupe was built without CUDA and NCCL)");
}

#endif
