#include "tensor/parallel.hpp"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

namespace troupe::parallel {
namespace {

thread_local int t_index = 0;
thread_local bool t_in_parallel = false;

class pool {
 public:
  explicit pool(int n) { resize(n); }
  ~pool() { stop(); }

  int size() const { return n_; }

  void resize(int n) {
    stop();
    n_ = std::max(1, n);
    quit_ = false;
    // A new worker starts at the current generation, or it would rerun the last (finished) region.
    for (int i = 1; i < n_; ++i) workers_.emplace_back([this, i, g = generation_] { work(i, g); });
  }

  void run(std::int64_t begin, std::int64_t end, std::int64_t grain, range_fn fn) {
    std::int64_t n = end - begin;
    std::int64_t chunks =
        std::min<std::int64_t>(n_, (n + grain - 1) / std::max<std::int64_t>(grain, 1));
    if (chunks <= 1 || t_in_parallel) {
      fn(begin, end);
      return;
    }
    std::unique_lock run_lock(run_mu_);  // one parallel region at a time from outside
    {
      std::lock_guard lk(mu_);
      fn_ = &fn;
      begin_ = begin;
      end_ = end;
      chunks_ = chunks;
      pending_.store(static_cast<int>(chunks - 1));
      ++generation_;
    }
    cv_.notify_all();
    t_in_parallel = true;
    run_chunk(0);
    t_in_parallel = false;
    // Wait for the workers: spin briefly, then sleep.
    for (int spin = 0; pending_.load(std::memory_order_acquire) != 0; ++spin) {
      if (spin > 2000) {
        std::unique_lock lk(mu_);
        done_cv_.wait(lk, [&] { return pending_.load() == 0; });
        break;
      }
      std::this_thread::yield();
    }
  }

 private:
  void run_chunk(std::int64_t c) {
    std::int64_t n = end_ - begin_;
    std::int64_t lo = begin_ + n * c / chunks_;
    std::int64_t hi = begin_ + n * (c + 1) / chunks_;
    if (lo < hi) (*fn_)(lo, hi);
  }

  void work(int index, std::uint64_t seen) {
    t_index = index;
    t_in_parallel = true;
    for (;;) {
      {
        std::unique_lock lk(mu_);
        cv_.wait(lk, [&] { return quit_ || generation_ != seen; });
        if (quit_) return;
        seen = generation_;
      }
      if (index < chunks_) {
        run_chunk(index);
        if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
          std::lock_guard lk(mu_);
          done_cv_.notify_all();
        }
      }
    }
  }

  void stop() {
    {
      std::lock_guard lk(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
    workers_.clear();
  }

  int n_ = 1;
  std::vector<std::thread> workers_;
  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::uint64_t generation_ = 0;
  bool quit_ = false;
  const range_fn* fn_ = nullptr;
  std::int64_t begin_ = 0, end_ = 0, chunks_ = 0;
  std::atomic<int> pending_{0};
};

int default_threads() {
  if (const char* e = std::getenv("TROUPE_NUM_THREADS")) {
    int n = std::atoi(e);
    if (n > 0) return n;
  }
  // The CPUs this process may run on (a launcher pins each rank to its own), not the machine's.
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  return std::max(1u, std::thread::hardware_concurrency());
}

pool& the_pool() {
  static pool p(default_threads());
  return p;
}

}  // namespace

void set_blas_threads(int n);  // tensor/cpu/gemm.cpp

int num_threads() {
  return the_pool().size();
}
void set_num_threads(int n) {
  the_pool().resize(n);
  set_blas_threads(n);
}
int thread_index() {
  return t_index;
}

void parallel_for_impl(std::int64_t begin, std::int64_t end, std::int64_t grain, range_fn fn) {
  if (end <= begin) return;
  the_pool().run(begin, end, grain, fn);
}

}  // namespace troupe::parallel
