// The direct pull ops (reduce_scatter, all_gather, all_to_all, all_to_allv: each rank reads its
// peers' inputs with process_vm_readv) on ranks as threads of one process (a local_world made
// with same_host, so the direct path runs here as between processes), against serial references,
// next to the message path of the same ops; and all_to_allv's count check on both paths.
//
// Inputs are small integers, so every reduction is exact in every dtype and results compare byte
// for byte. Which path an op took is checked through the transport's byte count: the direct path
// sends only its small synchronisation messages, the message path sends the data.
// Catch2 assertions are not thread-safe: rank threads only fill buffers and note errors; the main
// thread checks.
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <thread>

#include "collective/local/local_transport.hpp"
#include "collective/p2p_communicator.hpp"
#include "memory/error.hpp"

using namespace troupe;
using namespace troupe::collective;

namespace {

using bytes = std::vector<std::byte>;

double value(int rank, std::size_t i, int salt) {
  return static_cast<double>(static_cast<int>((i * 7 + rank * 13 + salt * 5) % 17) - 8);
}

void put(bytes& b, dtype t, std::size_t i, double v) {
  if (t == dtype::f32) {
    float f = static_cast<float>(v);
    std::memcpy(&b[i * 4], &f, 4);
  } else if (t == dtype::f64) {
    std::memcpy(&b[i * 8], &v, 8);
  } else {
    std::uint16_t h = t == dtype::bf16 ? f32_to_bf16_bits(static_cast<float>(v))
                                       : f32_to_f16_bits(static_cast<float>(v));
    std::memcpy(&b[i * 2], &h, 2);
  }
}

// `count` elements of rank `rank`'s input, element i holding value(rank, first + i, salt).
bytes make(dtype t, std::size_t count, int rank, int salt, std::size_t first = 0) {
  bytes b(count * dtype_size(t));
  for (std::size_t i = 0; i < count; ++i) put(b, t, i, value(rank, first + i, salt));
  return b;
}

// The paths of the copy ops: the pull ops (process_vm_readv), the staged ones (shared-memory
// rings: reduce_scatter still pulls) and messages.
enum class path { pull, shm, messages };
const char* path_name(path p) {
  return p == path::pull ? "pull" : p == path::shm ? "staged" : "messages";
}

// A group of n threads over a same_host local world taking path `p` from 1 byte, with small pieces
// and slots so that every size crosses piece boundaries and wraps the rings.
struct group {
  std::shared_ptr<local_world> world;
  std::vector<std::unique_ptr<communicator>> comms;
  group(int n, path p, bool stream = false) : world(std::make_shared<local_world>(n, true)) {
    comms = make_local_group(world);
    algo_tuning tu;
    tu.pull_direct = p != path::messages;
    tu.shm = p == path::shm;
    tu.all_gather_direct_min = tu.reduce_scatter_direct_min = tu.all_to_all_direct_min = 1;
    tu.shm_min = 1;
    tu.shm_slot_bytes = 4096;
    tu.shm_slots = 3;
    if (stream) tu.shm_stream_min = 1;  // every staged output written with streaming stores
    tu.direct_piece_bytes = 4096;
    tu.direct_copy_bytes = 4096;
    for (auto& c : comms) dynamic_cast<p2p_communicator&>(*c).set_tuning(tu);
  }
  int size() const { return static_cast<int>(comms.size()); }
  // Runs body(rank) on one thread per rank; the error text of each rank ("" where none).
  std::vector<std::string> run(const std::function<void(int)>& body) {
    const int n = size();
    std::vector<std::string> errors(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r)
      threads.emplace_back([&, r] {
        try {
          body(r);
        } catch (const std::exception& e) {
          errors[r] = e.what();
          if (errors[r].empty()) errors[r] = "(empty error)";
        }
      });
    for (auto& th : threads) th.join();
    return errors;
  }
  std::uint64_t sent(int r) { return world->transport(r).bytes_sent(); }
};

// Rank i sends rank j this many elements: uneven, zero for some pairs, and nothing at all from
// rank 1 to anyone at salt 3.
std::size_t split(int i, int j, std::size_t scale, int salt) {
  if (salt == 3 && i == 1) return 0;
  return static_cast<std::size_t>((i * 3 + j * 5 + salt) % 4) * scale + (i == j ? 1 : 0);
}

std::string joined(const std::vector<std::string>& errors) {
  std::string s;
  for (std::size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) s += "rank " + std::to_string(r) + ": " + errors[r] + "\n";
  return s;
}

// Runs every pull op at `count` elements per block on `g` and checks results and the path taken.
void check_ops(group& g, path p, std::size_t count, dtype t) {
  const bool direct = p != path::messages;
  const int n = g.size();
  const std::size_t es = dtype_size(t);
  std::vector<bytes> in(n), out(n), want(n);
  std::vector<std::uint64_t> sent(n);
  const std::string where = std::string(path_name(p)) + " n=" + std::to_string(n) +
                            " count=" + std::to_string(count) + " " + std::string(dtype_name(t));
  // Asserts that every rank's result is `want` and that the op took the expected path: the
  // direct path sends at most a few hundred bytes of messages per peer, the message path the data
  // (a rank whose own share is below that bound is not checked for it).
  auto verify = [&](const char* op, std::size_t data_bytes) {
    INFO(op << " " << where);
    for (int r = 0; r < n; ++r) {
      INFO("rank " << r);
      REQUIRE(out[r] == want[r]);
      const std::size_t bound = 256 * static_cast<std::size_t>(n);
      if (data_bytes > 2 * bound) CHECK((sent[r] < bound) == direct);
    }
  };
  auto timed = [&](const std::function<void(int)>& body) {
    auto errors = g.run([&](int r) {
      const std::uint64_t before = g.sent(r);
      body(r);
      sent[r] = g.sent(r) - before;
    });
    INFO(joined(errors));
    REQUIRE(joined(errors).empty());
  };

  // all_gather: block q of every rank's output is rank q's input.
  for (int r = 0; r < n; ++r) {
    in[r] = make(t, count, r, 1);
    out[r].assign(count * n * es, std::byte{0x5a});
    want[r].clear();
    for (int q = 0; q < n; ++q) {
      bytes b = make(t, count, q, 1);
      want[r].insert(want[r].end(), b.begin(), b.end());
    }
  }
  timed([&](int r) { g.comms[r]->all_gather(in[r].data(), out[r].data(), count, t).wait(); });
  verify("all_gather", count * es);

  // all_to_all: block q of rank r's output is block r of rank q's input.
  for (int r = 0; r < n; ++r) {
    in[r] = make(t, count * n, r, 2);
    out[r].assign(count * n * es, std::byte{0x5a});
    want[r].clear();
    for (int q = 0; q < n; ++q) {
      bytes b = make(t, count, q, 2, r * count);
      want[r].insert(want[r].end(), b.begin(), b.end());
    }
  }
  timed([&](int r) { g.comms[r]->all_to_all(in[r].data(), out[r].data(), count, t).wait(); });
  verify("all_to_all", count * es);

  // all_to_allv, two splits (the second with a rank that sends nothing).
  for (int salt : {2, 3}) {
    std::vector<std::vector<std::size_t>> sc(n), rc(n);
    for (int r = 0; r < n; ++r)
      for (int q = 0; q < n; ++q) {
        sc[r].push_back(split(r, q, count, salt));
        rc[r].push_back(split(q, r, count, salt));
      }
    std::size_t least = SIZE_MAX;
    for (int r = 0; r < n; ++r) {
      std::size_t total = 0;
      for (auto x : sc[r]) total += x;
      in[r] = make(t, total, r, 4 + salt);
      std::size_t rtotal = 0;
      for (auto x : rc[r]) rtotal += x;
      out[r].assign(rtotal * es, std::byte{0x5a});
      want[r].clear();
      for (int q = 0; q < n; ++q) {
        std::size_t off = 0;
        for (int j = 0; j < r; ++j) off += sc[q][j];
        bytes b = make(t, sc[q][r], q, 4 + salt, off);
        want[r].insert(want[r].end(), b.begin(), b.end());
      }
      least = std::min(least, total - sc[r][r]);
    }
    timed([&](int r) {
      g.comms[r]->all_to_allv(in[r].data(), sc[r], out[r].data(), rc[r], t).wait();
    });
    // The path check needs data on every rank; with a rank that sends nothing it checks results.
    verify("all_to_allv", salt == 3 ? 0 : least * es);
  }

  // reduce_scatter (sum, and avg where it is exact: 16-bit avg rounds once like the reference).
  for (reduce_op op : {reduce_op::sum, reduce_op::max}) {
    options o;
    o.op = op;
    for (int r = 0; r < n; ++r) {
      in[r] = make(t, count * n, r, 6);
      out[r].assign(count * es, std::byte{0x5a});
      want[r].assign(count * es, std::byte{0});
      for (std::size_t i = 0; i < count; ++i) {
        double acc = value(0, r * count + i, 6);
        for (int q = 1; q < n; ++q) {
          const double v = value(q, r * count + i, 6);
          acc = op == reduce_op::max ? std::max(acc, v) : acc + v;
        }
        put(want[r], t, i, acc);
      }
    }
    timed([&](int r) {
      g.comms[r]->reduce_scatter(in[r].data(), out[r].data(), count, t, o).wait();
    });
    verify("reduce_scatter", count * es * (n - 1));
  }
}

}  // namespace

TEST_CASE(
    "the direct pull ops and their message path match the serial reference on 2 3 and 4 "
    "ranks",
    "[collective]") {
  // Tiny, not a multiple of the 4 KiB pieces, and several pieces per block.
  for (path p : {path::pull, path::shm, path::messages})
    for (int n : {2, 3, 4}) {
      group g(n, p);
      for (std::size_t count : {std::size_t{1}, std::size_t{7}, std::size_t{1023},
                                std::size_t{4099}, std::size_t{20011}})
        for (dtype t : {dtype::f32, dtype::f64, dtype::bf16, dtype::f16}) check_ops(g, p, count, t);
    }
}

TEST_CASE("the direct pull ops take the message path below their thresholds", "[collective]") {
  // Default tuning: a 1 MiB all_gather of f32 on 2 ranks goes direct, 16 KiB does not.
  group g(2, path::pull);
  algo_tuning pull;
  pull.shm = false;
  for (auto& c : g.comms) dynamic_cast<p2p_communicator&>(*c).set_tuning(pull);
  for (std::size_t count : {std::size_t{2048}, std::size_t{131072}}) {
    std::vector<bytes> in(2), out(2);
    std::vector<std::uint64_t> sent(2);
    for (int r = 0; r < 2; ++r) {
      in[r] = make(dtype::f32, count, r, 1);
      out[r].assign(count * 8, std::byte{0});
    }
    auto errors = g.run([&](int r) {
      const std::uint64_t before = g.sent(r);
      g.comms[r]->all_gather(in[r].data(), out[r].data(), count, dtype::f32).wait();
      sent[r] = g.sent(r) - before;
    });
    REQUIRE(joined(errors).empty());
    const bool direct = count == 131072;
    REQUIRE((count * 2 * 4 >= algo_tuning{}.all_gather_direct_min) == direct);
    INFO("count " << count << " sent " << sent[0]);
    CHECK((sent[0] < count * 4) == direct);
    CHECK(std::memcmp(out[0].data() + count * 4, in[1].data(), count * 4) == 0);
  }
}

TEST_CASE("all_to_allv counts that differ within a pair fail on both of its ranks naming them",
          "[collective][faults]") {
  for (path p : {path::pull, path::shm, path::messages}) {
    const bool direct = p != path::messages;
    INFO(path_name(p));
    group g(3, p);
    // Everybody sends everybody 4096 elements, but rank 0 expects 4097 from rank 2.
    std::vector<std::vector<float>> in(3, std::vector<float>(3 * 4096, 1.0f)),
        out(3, std::vector<float>(3 * 4096 + 1, 0.0f));
    auto errors = g.run([&](int r) {
      std::vector<std::size_t> sc(3, 4096), rc(3, 4096);
      if (r == 0) rc[2] = 4097;
      g.comms[r]->all_to_allv(in[r].data(), sc, out[r].data(), rc, dtype::f32).wait();
    });
    const std::string want =
        "all_to_allv: rank 2 sends 4096 elements to rank 0, which expects "
        "4097 from it";
    INFO(joined(errors));
    CHECK(errors[0].find(want) != std::string::npos);
    CHECK(errors[2].find(want) != std::string::npos);
    if (direct)  // rank 1 learns it from their "stop"
      CHECK(errors[1].find("failed its part of the op and stopped it") != std::string::npos);
    else  // rank 1's pairs agree: its part of the op completes
      CHECK(errors[1].empty());
    std::printf(
        "faults: all_to_allv counts that differ between ranks 0 and 2 (%s) -> refused: %s\n",
        path_name(p), errors[0].c_str());
  }
}

TEST_CASE("ranks that issue different pull ops fail naming both", "[collective][faults]") {
  group g(2, path::pull);
  std::vector<std::vector<float>> in(2, std::vector<float>(2048, 1.0f)),
      out(2, std::vector<float>(2048, 0.0f));
  auto errors = g.run([&](int r) {
    if (r == 0)
      g.comms[r]->all_gather(in[r].data(), out[r].data(), 1024, dtype::f32).wait();
    else
      g.comms[r]->all_to_all(in[r].data(), out[r].data(), 1024, dtype::f32).wait();
  });
  INFO(joined(errors));
  CHECK(errors[0].find("rank 1 issued all_to_all of f32 x 1024 but rank 0 issued all_gather of "
                       "f32 x 1024") != std::string::npos);
  CHECK(!errors[1].empty());
  std::printf("faults: all_gather on rank 0, all_to_all on rank 1 (direct) -> refused: %s\n",
              errors[0].c_str());
}

TEST_CASE(
    "staged ops back to back match the reference at chunk and ring boundaries and with zero "
    "counts",
    "[collective]") {
  // Slots of 4096 bytes, 3 per ring: f32 counts of one slot less one element, one slot, one
  // slot and one element, a full ring and a ring and a bit, issued one after another on the same
  // communicators, so each op starts mid-ring where the last one stopped and its header check
  // meets the chunk that op left. all_to_allv adds splits with zero counts (empty chunks that
  // still carry the header) and splits that are not multiples of anything.
  // With streaming stores too (whole 4 KiB chunks, at destinations that are not 16-byte aligned
  // where a block starts at an odd element).
  for (int n : {2, 3})
    for (bool stream : {false, true}) {
      INFO("streaming stores " << stream);
      group g(n, path::shm, stream);
      for (std::size_t count : {std::size_t{1023}, std::size_t{1024}, std::size_t{1025},
                                std::size_t{3072}, std::size_t{3073}, std::size_t{1}}) {
        check_ops(g, path::shm, count, dtype::f32);
      }
    }
}

TEST_CASE("ranks that issue different staged ops or counts fail naming both",
          "[collective][faults]") {
  // Rank 0 gathers 1024 elements, rank 1 1025: the header of the first chunk tells each.
  {
    group g(2, path::shm);
    std::vector<std::vector<float>> in(2, std::vector<float>(1025, 1.0f)),
        out(2, std::vector<float>(2050, 0.0f));
    auto errors = g.run([&](int r) {
      const std::size_t count = r == 0 ? 1024 : 1025;
      g.comms[r]->all_gather(in[r].data(), out[r].data(), count, dtype::f32).wait();
    });
    INFO(joined(errors));
    CHECK(errors[0].find("staged all_gather: rank 1 issued another op or count (1025 elements") !=
          std::string::npos);
    CHECK(errors[0].find("than rank 0 (1024 elements") != std::string::npos);
    CHECK(!errors[1].empty());
    std::printf("faults: staged all_gather of 1024 on rank 0, 1025 on rank 1 -> refused: %s\n",
                errors[0].c_str());
  }
  // Three ranks; rank 2 issues all_to_all where ranks 0 and 1 issue all_gather of the same size.
  {
    group g(3, path::shm);
    std::vector<std::vector<float>> in(3, std::vector<float>(3 * 512, 1.0f)),
        out(3, std::vector<float>(3 * 512, 0.0f));
    auto errors = g.run([&](int r) {
      if (r == 2)
        g.comms[r]->all_to_all(in[r].data(), out[r].data(), 512, dtype::f32).wait();
      else
        g.comms[r]->all_gather(in[r].data(), out[r].data(), 512, dtype::f32).wait();
    });
    INFO(joined(errors));
    CHECK(errors[0].find("rank 2 issued another op or count") != std::string::npos);
    CHECK(errors[1].find("rank 2 issued another op or count") != std::string::npos);
    CHECK(errors[2].find("issued another op or count") != std::string::npos);
    std::printf("faults: staged all_gather on ranks 0-1, all_to_all on rank 2 -> refused: %s\n",
                errors[0].c_str());
  }
}
