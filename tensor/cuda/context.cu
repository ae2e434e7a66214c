// Per-device state of the CUDA backend: the cuBLAS handle and the scratch buffers, created on
// first use for the current device and kept for the life of the process (destroying them at exit
// would race the CUDA runtime's own teardown).
#include "tensor/cuda/check.cuh"

namespace troupe::cuda::detail {
namespace {

constexpr int max_devices = 64;

int current_device() {
  int d = 0;
  TROUPE_CUDA_CHECK(cudaGetDevice(&d));
  TROUPE_CHECK(d >= 0 && d < max_devices, "cuda: device ", d, " beyond the supported ",
               max_devices);
  return d;
}

std::mutex& handle_mutex() {
  static std::mutex m;
  return m;
}
std::mutex& scratch_mutex() {
  static std::mutex m;
  return m;
}
std::mutex& f32_scratch_mutex() {
  static std::mutex m;
  return m;
}

}  // namespace

cublasHandle_t cublas_handle() {
  static cublasHandle_t handles[max_devices] = {};
  int d = current_device();
  std::lock_guard<std::mutex> lock(handle_mutex());
  if (handles[d] == nullptr) {
    cublasHandle_t h = nullptr;
    TROUPE_CUBLAS_CHECK(cublasCreate(&h));
    // f32 GEMMs stay full f32 (no TF32); 16-bit GEMMs accumulate in f32 (see gemm.cu), split-K
    // partial sums included: by default cuBLAS may reduce them in the 16-bit output type, which
    // the first H200 run showed (bf16 40x96x24 with beta 1: up to 15 bf16 ulps off, docs/gpu.md).
    TROUPE_CUBLAS_CHECK(cublasSetMathMode(
        h, static_cast<cublasMath_t>(CUBLAS_DEFAULT_MATH |
                                     CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION)));
    TROUPE_CUBLAS_CHECK(cublasSetPointerMode(h, CUBLAS_POINTER_MODE_HOST));
    handles[d] = h;
  }
  return handles[d];
}

scratch_lease lease_scratch() {
  static scratch per_device[max_devices];
  int d = current_device();
  scratch_lease lease{std::unique_lock<std::mutex>(scratch_mutex()), &per_device[d]};
  scratch& s = per_device[d];
  if (s.partials == nullptr) {  // one allocation: partials, value, words
    void* p = nullptr;
    TROUPE_CUDA_CHECK(cudaMalloc(&p, (max_partials + 1 + 8) * sizeof(double)));
    s.partials = static_cast<double*>(p);
    s.value = s.partials + max_partials;
    s.words = reinterpret_cast<long long*>(s.value + 1);
  }
  return lease;
}

f32_scratch_lease lease_f32_scratch(std::int64_t n) {
  struct buffer {
    float* p = nullptr;
    std::int64_t n = 0;
  };
  static buffer per_device[max_devices];
  int d = current_device();
  f32_scratch_lease lease{std::unique_lock<std::mutex>(f32_scratch_mutex()), nullptr};
  buffer& b = per_device[d];
  if (b.n < n) {
    if (b.p != nullptr) TROUPE_CUDA_CHECK(cudaFree(b.p));  // waits for the kernels reading it
    b = buffer{};
    void* p = nullptr;
    TROUPE_CUDA_CHECK(cudaMalloc(&p, static_cast<std::size_t>(n) * sizeof(float)));
    b = buffer{static_cast<float*>(p), n};
  }
  lease.p = b.p;
  return lease;
}

}  // namespace troupe::cuda::detail
