// Helpers for the tensor-parallel model tests (parallelize_gpt.test.cpp,
// parallelize_llama.test.cpp): one thread per rank of a local group, and comparisons of flat f32
// buffers.
#pragma once

#include <algorithm>
#include <cmath>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "collective/local/local_transport.hpp"
#include "tensor/tensor.hpp"

namespace troupe::models::testing {

inline std::vector<float> flat(const tensor& t) {
  const float* p = t.data_as<float>();
  return std::vector<float>(p, p + t.numel());
}

// max |a - b| over max |b| (a and b of the same length).
inline double rel_err(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  double m = 0, s = 1e-12;
  for (std::size_t i = 0; i < a.size(); ++i) {
    m = std::max(m, static_cast<double>(std::abs(a[i] - b[i])));
    s = std::max(s, static_cast<double>(std::abs(b[i])));
  }
  return m / s;
}

// fn(rank, communicator) on one thread per rank of a local group of n; the first failure is
// rethrown after every thread has ended.
inline void run_ranks(int n, const std::function<void(int, collective::communicator&)>& fn) {
  auto comms = collective::make_local_group(n);
  std::vector<std::exception_ptr> err(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r, *comms[r]);
      } catch (...) {
        err[r] = std::current_exception();
        for (auto& c : comms) c->abort("rank " + std::to_string(r) + " failed");
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : err)
    if (e) std::rethrow_exception(e);
}

}  // namespace troupe::models::testing
