// Judging an f32 computation by the rounding error of its reference, not by a bound fitted to one
// machine.
//
// Two f32 computations of one quantity - a parallel plan and the single process, accumulated
// micro-batches and the whole batch, recompute and stored activations - add the same terms in
// different orders, so they differ by rounding. How much depends on the machine: the GEMM kernel's
// blocking (OpenBLAS's AVX2 and AVX-512 cores split the inner dimension differently), the thread
// count, the vector width of the reductions. A constant fitted on one CPU (issue 21: 6e-5 measured
// against 6.46e-5 seen on another) fails on the next. So both f32 results are compared with the
// same quantity computed in f64 ("exact": its own rounding is ~1e-16 relative, 1e-9 of f32's),
// and the computation under test must be about as accurate as the reference computation on the
// same machine, with the same kernels:
//
//   err(got) = max_i |got_i - exact_i|   <=   k * max( err(ref), floor * u * max_i |exact_i| )
//
// with u = 2^-24 (f32's unit roundoff). Why this holds for a correct computation, on any CPU:
// - Each f32 result is exact + (the sum of its roundings). For a sum of n terms in any order the
//   error is at most ~n u sum|terms| and typically ~sqrt(n) u sum|terms| (a random walk); two
//   orders of the same terms have errors of the same size, so err(got) / err(ref) is O(1) whatever
//   the kernels are: both scale together when the CPU changes. The ratio of the largest errors
//   over thousands of elements is stable; k = default_k leaves room for a computation that adds
//   a few roundings more (one more addition per accumulated micro-batch or rank, a reduction tree
//   instead of a loop) and for AdamW, which divides by sqrt(v) and so magnifies the rounding of
//   gradients near zero by the same factor in both runs. A few scalars along a trajectory get
//   trajectory_k (below).
// - floor guards the case where err(ref) is small by chance (few elements, or a quantity the
//   reference computes exactly): a few ulps of the largest element.
// Why it still catches mistakes: a wrong computation (a micro-batch left out, a gradient not
// reduced, a shard in the wrong place, a step too many) is off by O(|exact|) or by an lr-sized
// step, 1e3 to 1e7 times its rounding.
//
// Standard library only: usable from every module's tests and from tests/multirank.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <sstream>
#include <string>

namespace troupe::tests {

// f32's unit roundoff.
inline constexpr double f32_u = 1.0 / 16777216.0;  // 2^-24
// The accuracy ratio allowed for one quantity of many elements (a gradient, the weights): the
// ratio of the largest errors over thousands of elements is stable (measured 0.2 to 3.7 across
// the data-parallel, ZeRO and accumulation tests, AVX2 and AVX-512 kernels, 1 and 2 threads).
inline constexpr double default_k = 8.0;
// The ratio allowed for a few scalars along a training trajectory (each step's loss or gradient
// norm): each is dominated by the few weights whose near-zero gradients AdamW turned into
// lr-sized moves in one run and not the other, so the ratio of two runs' largest errors over ten
// steps is heavy-tailed (measured up to 20: Llama dp 2, the gradient norm of step 8). 64 keeps the
// loss bound near 1e-5 relative and the norm bound near 1e-4 relative, where the fixed bounds
// stood; a plan that is wrong changes the losses by 1e-3 relative and more.
inline constexpr double trajectory_k = 64.0;
// The default floor, in units of u * max|exact|.
inline constexpr double default_floor = 4.0;

struct rounding_verdict {
  double err_got = 0;     // max |got - exact|
  double err_ref = 0;     // max |ref - exact|
  double scale = 0;       // max |exact|
  double bound = 0;       // k * max(err_ref, floor * u * scale)
  std::size_t where = 0;  // the index of err_got
  std::size_t n = 0;
  bool sizes_match = true;
  bool ok() const { return sizes_match && err_got <= bound; }
  // err_got / err_ref: how much less accurate the computation under test is.
  double ratio() const { return err_ref > 0 ? err_got / err_ref : INFINITY; }
  std::string str() const {
    std::ostringstream s;
    if (!sizes_match) return "sizes differ";
    s << "max |got - exact| " << err_got << " (at " << where << " of " << n
      << "), max |ref - exact| " << err_ref << " (ratio " << ratio() << "), max |exact| " << scale
      << ", bound " << bound;
    return s.str();
  }
};

// got, ref and exact: indexable containers of the same length (float or double elements).
template <class Got, class Ref, class Exact>
rounding_verdict as_accurate_as(const Got& got, const Ref& ref, const Exact& exact,
                                double k = default_k, double floor = default_floor) {
  rounding_verdict v;
  v.n = std::size(exact);
  if (std::size(got) != v.n || std::size(ref) != v.n) {
    v.sizes_match = false;
    return v;
  }
  for (std::size_t i = 0; i < v.n; ++i) {
    const double e = static_cast<double>(exact[i]);
    const double dg = std::abs(static_cast<double>(got[i]) - e);
    if (!(dg <= v.err_got)) {  // NaN in got lands here and stays
      v.err_got = std::isnan(dg) ? INFINITY : dg;
      v.where = i;
    }
    v.err_ref = std::max(v.err_ref, std::abs(static_cast<double>(ref[i]) - e));
    v.scale = std::max(v.scale, std::abs(e));
  }
  v.bound = k * std::max(v.err_ref, floor * f32_u * v.scale);
  return v;
}

}  // namespace troupe::tests
