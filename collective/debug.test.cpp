// The debug wrapper: matching sequences pass through; a mismatch throws on every rank, no hang.
#include <catch2/catch.hpp>

#include <functional>
#include <thread>

#include "collective/debug.hpp"
#include "collective/local/local_transport.hpp"
#include "memory/error.hpp"

using namespace troupe;
using namespace troupe::collective;

namespace {

std::vector<std::unique_ptr<communicator>> debug_group(int n) {
  auto comms = make_local_group(n);
  for (auto& c : comms) c = make_debug_communicator(std::move(c));
  return comms;
}

// Runs body(rank) on one thread per rank and returns each rank's error text ("" if none).
std::vector<std::string> run_ranks(int n, const std::function<void(int)>& body) {
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        body(r);
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace

TEST_CASE("the debug wrapper passes matching sequences through unchanged", "[collective][debug]") {
  auto comms = debug_group(3);
  std::vector<std::vector<float>> d(3, std::vector<float>(100));
  std::vector<std::vector<double>> tx(3, std::vector<double>(6)), rx(3, std::vector<double>(6));
  auto errors = run_ranks(3, [&](int r) {
    for (int i = 0; i < 100; ++i) d[r][i] = static_cast<float>(r + i);
    comms[r]->allreduce(d[r].data(), 100, dtype::f32).wait();
    comms[r]->barrier().wait();
    // all_to_allv with uneven splits: rank i sends i + j elements to rank j.
    std::vector<std::size_t> sc(3), rc(3);
    for (int j = 0; j < 3; ++j) {
      sc[j] = r + j;
      rc[j] = j + r;
    }
    std::vector<float> in(3 * r + 3, 1.0f), out(3 * r + 3);
    comms[r]->all_to_allv(in.data(), sc, out.data(), rc, dtype::f32).wait();
    // Ranks 0 and 1 do a send/recv step; rank 2 issues a barrier instead, which the wrapper
    // reports on all three ranks (through the wrapper every rank takes part in each p2p step).
    for (int i = 0; i < 6; ++i) tx[r][i] = r * 10 + i;
    if (r == 0) comms[r]->send(tx[r].data(), 6, dtype::f64, 1).wait();
    if (r == 1) comms[r]->recv(rx[r].data(), 6, dtype::f64, 0).wait();
    if (r == 2) comms[r]->barrier().wait();
  });
  for (int r = 0; r < 3; ++r) {
    INFO("rank " << r << ": " << errors[r]);
    REQUIRE(errors[r].find("collective mismatch at op #4 on local#0[0,1,2]") == 0);
  }
  for (int r = 0; r < 3; ++r)
    for (int i = 0; i < 100; ++i) REQUIRE(d[r][i] == static_cast<float>(3 + 3 * i));
}

TEST_CASE("the debug wrapper names the ranks and ops of a mismatched collective",
          "[collective][debug]") {
  auto comms = debug_group(2);
  std::vector<std::vector<float>> a(2, std::vector<float>(1024)), b(2, std::vector<float>(1024));
  auto errors = run_ranks(2, [&](int r) {
    comms[r]->barrier().wait();
    if (r == 0)
      comms[r]->allreduce(a[r].data(), 1024, dtype::f32).wait();
    else
      comms[r]->all_gather(a[r].data(), b[r].data(), 512, dtype::f32).wait();
  });
  for (int r = 0; r < 2; ++r) {
    INFO(errors[r]);
    REQUIRE(errors[r].find("collective mismatch at op #2 on local#0[0,1]: rank 0 issued "
                           "allreduce(f32, 1024, sum) but rank 1 issued all_gather(f32, 512)") ==
            0);
  }
}

TEST_CASE("the debug wrapper catches a rank that skipped an op on every rank",
          "[collective][debug]") {
  auto comms = debug_group(4);
  std::vector<std::vector<float>> d(4, std::vector<float>(16));
  auto errors = run_ranks(4, [&](int r) {
    if (r != 2) comms[r]->barrier().wait();  // rank 2 skips the barrier
    options o;
    o.op = reduce_op::max;
    comms[r]->allreduce(d[r].data(), 16, dtype::bf16, o).wait();
  });
  for (int r = 0; r < 4; ++r) {
    INFO(errors[r]);
    REQUIRE(errors[r].find("collective mismatch at op #1 on local#0[0,1,2,3]: rank 0 issued "
                           "barrier() but rank 2 issued allreduce(bf16, 16, max)") == 0);
  }
}

TEST_CASE("the debug wrapper checks send and recv pairs and all_to_allv splits",
          "[collective][debug]") {
  auto comms = debug_group(2);
  std::vector<float> x(11);
  auto errors = run_ranks(2, [&](int r) {
    if (r == 0)
      comms[r]->send(x.data(), 10, dtype::f32, 1).wait();
    else
      comms[r]->recv(x.data(), 11, dtype::f32, 0).wait();
  });
  for (int r = 0; r < 2; ++r) {
    INFO(errors[r]);
    REQUIRE(errors[r].find("collective mismatch at op #1 on local#0[0,1]: rank 0 issued "
                           "send(f32, 10, to 1) but rank 1 issued recv(f32, 11, from 0)") == 0);
  }
  auto comms2 = debug_group(2);
  std::vector<float> in(8), out(8);
  errors = run_ranks(2, [&](int r) {
    std::vector<std::size_t> sc{2, 2}, rc{r == 1 ? 3u : 2u, 2};
    comms2[r]->all_to_allv(in.data(), sc, out.data(), rc, dtype::f32).wait();
  });
  for (int r = 0; r < 2; ++r) {
    INFO(errors[r]);
    REQUIRE(errors[r].find("collective mismatch at op #1 on local#0[0,1]: all_to_allv rank 0 "
                           "sends 2 elements to rank 1 but rank 1 expects 3") == 0);
  }
}
