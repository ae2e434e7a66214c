// The kernels a numeric test pass ran under (scripts/test_numerics.sh): the OpenBLAS core and the
// thread count, checked against what the pass asked for, so that a pass meant to run OpenBLAS's
// AVX2 kernels cannot silently run the AVX-512 ones (or the reverse) and prove nothing.
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "tensor/cpu/blas_info.hpp"
#include "tensor/parallel.hpp"

using namespace troupe;

TEST_CASE("A numeric pass runs the OpenBLAS core and the threads it asked for", "[.blas_core]") {
  const char* core = std::getenv("TROUPE_EXPECT_BLAS_CORE");
  const char* threads = std::getenv("TROUPE_NUM_THREADS");
  REQUIRE(core != nullptr);  // set by scripts/test_numerics.sh, with TROUPE_NUM_THREADS
  REQUIRE(threads != nullptr);
  const auto& c = cpu::ensure_blas_core();
  std::printf("numerics: OpenBLAS core %s (%s), %d threads\n", c.after.c_str(), c.reason.c_str(),
              parallel::num_threads());
  if (std::string(core) == "avx512")
    CHECK(cpu::is_avx512_core(c.after));
  else
    CHECK(c.after == core);
  CHECK(parallel::num_threads() == std::atoi(threads));
}
