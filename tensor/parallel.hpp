// The CPU thread pool that runs the vectorized loops of tensor/cpu.
//
// parallel_for splits [begin, end) into at most num_threads() contiguous chunks of at least
// `grain` items and runs fn(chunk_begin, chunk_end) on them, the calling thread taking one chunk.
// Calls made from inside a chunk run serially. It never allocates. The thread count comes from
// TROUPE_NUM_THREADS, else the number of CPUs; set_num_threads changes it (and OpenBLAS's).
#pragma once

#include <cstdint>
#include <type_traits>
#include <utility>

namespace troupe::parallel {

// A non-owning reference to a callable void(int64_t, int64_t).
class range_fn {
 public:
  template <class F>
  range_fn(F& f)
      : obj_(&f),
        call_([](void* o, std::int64_t a, std::int64_t b) { (*static_cast<F*>(o))(a, b); }) {}
  void operator()(std::int64_t a, std::int64_t b) const { call_(obj_, a, b); }

 private:
  void* obj_;
  void (*call_)(void*, std::int64_t, std::int64_t);
};

int num_threads();
void set_num_threads(int n);
int thread_index();  // 0 for the caller, 1..n-1 for pool workers; stable within a chunk

void parallel_for_impl(std::int64_t begin, std::int64_t end, std::int64_t grain, range_fn fn);

template <class F>
void parallel_for(std::int64_t begin, std::int64_t end, std::int64_t grain, F&& fn) {
  auto& f = fn;
  parallel_for_impl(begin, end, grain, range_fn(f));
}

}  // namespace troupe::parallel
