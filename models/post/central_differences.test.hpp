// The f64 central-difference check of the post-training losses' gradients (SFT/DPO, reward model,
// GRPO tests): each listed parameter moved by +-1e-5, the loss recomputed by loss_at(). Truncation
// is ~1e-10 |f'''| and cancellation ~1e-16 / 1e-5, so 1e-7 + 1e-5 relative is far above both and
// far below a misplaced or misweighted term (which changes a gradient by O(its size)); the largest
// difference must show real gradients.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <vector>

#include "tensor/tensor.hpp"

namespace troupe::models::testing {

inline void check_central_differences(const tensor& params, const tensor& grads,
                                      const std::vector<std::int64_t>& indices,
                                      const std::function<double()>& loss_at) {
  double largest = 0;
  for (const std::int64_t i : indices) {
    double* w = params.data_as<double>() + i;
    const double keep = *w, h = 1e-5;
    *w = keep + h;
    const double up = loss_at();
    *w = keep - h;
    const double down = loss_at();
    *w = keep;
    const double fd = (up - down) / (2 * h);
    largest = std::max(largest, std::abs(fd));
    INFO("param " << i);
    CHECK(grads.data_as<double>()[i] == Approx(fd).margin(1e-7).epsilon(1e-5));
  }
  CHECK(largest > 1e-4);  // the check saw real gradients
}

}  // namespace troupe::models::testing
