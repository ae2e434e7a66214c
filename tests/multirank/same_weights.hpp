// The final weights of two training runs compared: the model.safetensors of two checkpoint folders
// (HF layout, f32), tensor by tensor. The names must be the same sets, each tensor the same dtype
// and shape, and every element within `tol` of the reference scaled by max(1, |reference|).
//
// Why an absolute floor and not 1e-4 relative per element: AdamW moves every weight by up to about
// lr per step whatever its size, so a rounding difference in a gradient (a sum in another order
// across ranks) becomes an error of the order of the steps' learning rates, not of the weight. A
// weight near zero (a bias, a freshly decayed entry) then shows a large relative difference that
// means nothing: GPT-2's key bias gets a gradient that is zero in exact arithmetic (softmax does
// not see a shift of every score), so its updates are rounding noise normalised by Adam. Against
// the largest weights (the norm gains, 1 at the start) the floor is 1e-4 relative. A plan that
// drops a gradient, an update or a shard moves weights by lr-sized amounts (1e-3 here), ten times
// beyond.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <sstream>
#include <string>
#include <vector>

#include "models/hf/safetensors.hpp"

namespace troupe::tests {

// The default tolerance of same_weights.
inline constexpr double weights_tol = 1e-4;

struct weights_compared {
  std::size_t tensors = 0, elements = 0;
  std::size_t beyond = 0;  // elements further than tol * max(1, |want|)
  double max_abs = 0;      // the largest |got - want|
  std::string where;       // "name[i]: got vs want" of the largest
};

// Compares dir `got` with dir `want` (each holding a model.safetensors). Names, dtypes (f32) and
// shapes must agree (REQUIRE); the values are counted against `tol`.
inline weights_compared compare_weights(const std::string& got, const std::string& want,
                                        double tol = weights_tol) {
  using models::hf::safetensors_file;
  auto g = safetensors_file::open(got + "/model.safetensors");
  auto w = safetensors_file::open(want + "/model.safetensors");
  REQUIRE(g.has_value());
  REQUIRE(w.has_value());
  auto names = [](const safetensors_file& f) {
    std::vector<std::string> n;
    for (const auto& e : f.tensors()) n.push_back(e.name);
    std::sort(n.begin(), n.end());
    return n;
  };
  REQUIRE(names(*g) == names(*w));
  weights_compared out;
  for (const auto& we : w->tensors()) {
    const auto* ge = g->find(we.name);
    INFO(we.name);
    REQUIRE(ge != nullptr);
    REQUIRE(ge->type == dtype::f32);
    REQUIRE(we.type == dtype::f32);
    REQUIRE(ge->sizes == we.sizes);
    REQUIRE(ge->aligned());
    REQUIRE(we.aligned());
    const tensor gv = ge->view(), wv = we.view();
    const float* a = gv.data_as<float>();
    const float* b = wv.data_as<float>();
    for (std::int64_t i = 0; i < wv.numel(); ++i) {
      const double d = std::abs(static_cast<double>(a[i]) - b[i]);
      if (d > tol * std::max(1.0, std::abs(static_cast<double>(b[i])))) ++out.beyond;
      if (d > out.max_abs) {
        out.max_abs = d;
        std::ostringstream s;
        s << we.name << "[" << i << "]: " << a[i] << " vs " << b[i];
        out.where = s.str();
      }
    }
    ++out.tensors;
    out.elements += static_cast<std::size_t>(wv.numel());
  }
  return out;
}

// The weights of checkpoint `got` are those of `want` (compare_weights within weights_tol).
inline void same_weights(const std::string& got, const std::string& want) {
  const auto c = compare_weights(got, want);
  INFO(got << " vs " << want << ": " << c.tensors << " tensors, " << c.beyond << " of "
           << c.elements << " elements beyond " << weights_tol
           << " x max(1, |w|); largest difference " << c.max_abs << " at " << c.where);
  CHECK(c.tensors > 0);
  CHECK(c.beyond == 0);
}

}  // namespace troupe::tests
