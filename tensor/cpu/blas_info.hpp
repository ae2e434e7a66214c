// Which OpenBLAS kernels run the CPU GEMMs, and the one-time choice of them (docs/adr/0002).
//
// Debian's OpenBLAS is built with DYNAMIC_ARCH and picks a "core" (a kernel set) when it loads:
// from OPENBLAS_CORETYPE if set, else from CPUID. Both can leave an AVX-512 CPU on AVX2 or even
// SSE3 kernels (an environment that sets OPENBLAS_CORETYPE=Haswell; a CPU model newer than the
// library, which 0.3.21 detects as "Prescott"). Before the first GEMM, select_blas_core() compares
// the chosen core with what the CPU supports and, when the core is weaker, re-runs OpenBLAS's
// selection: first with OPENBLAS_CORETYPE hidden (OpenBLAS's own detection), then, if that still
// falls short, naming the best core for the CPU (SkylakeX for AVX-512, Haswell for AVX2). The
// variable is restored afterwards. TROUPE_KEEP_OPENBLAS_CORETYPE=1 keeps OpenBLAS's choice.
#pragma once

#include <string>

namespace troupe::cpu {

struct blas_core_choice {
  std::string before;       // core OpenBLAS had chosen, e.g. "Haswell"
  std::string after;        // core running now, e.g. "SkylakeX"
  bool overridden = false;  // true when troupe re-selected the core
  std::string reason;       // one line saying what happened and why
};

// Performs the selection once per process (later calls return the first result). Every BLAS call
// in troupe goes through it: matmul and attention call it before their first BLAS call, and so
// must any code that calls cblas_* directly (e.g. a benchmark's peak measurement).
const blas_core_choice& ensure_blas_core();

// Performs the selection now, whatever happened before (for tests and benchmarks that change
// OPENBLAS_CORETYPE on purpose). Must not run while any thread is inside OpenBLAS.
blas_core_choice select_blas_core();

// The core OpenBLAS runs now ("unknown" when the library does not say).
std::string blas_core();

// True when the named OpenBLAS core uses AVX-512 kernels (SkylakeX, Cooperlake, SapphireRapids).
bool is_avx512_core(const std::string& core);

// True when this CPU (and the OS) can run AVX-512 F/BW/VL/DQ code.
bool cpu_has_avx512();

}  // namespace troupe::cpu
