// vocab_entropy: the entropy of vocab-parallel logits (see vocab_entropy.hpp).
#include "models/parallel/vocab_entropy.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "collective/communicator.hpp"
#include "memory/error.hpp"
#include "models/layers/slots.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

std::vector<double> vocab_parallel_entropy(const tensor& logits, const tp_group& g) {
  TROUPE_CHECK(logits.defined() && logits.dim() == 2 && logits.size(1) > 0,
               "vocab_parallel_entropy: logits must be [N, V/tp], got ", describe(logits));
  owned_tensor host;
  if (!logits.is_cpu()) host = to_device(logits, device::cpu());
  const tensor& src = logits.is_cpu() ? logits : host.view();
  owned_tensor wide = empty(src.sizes(), dtype::f64);
  ops::copy(src, wide);
  const std::int64_t n = src.size(0), v = src.size(1);
  const double* z = wide.data_as<double>();
  std::vector<double> top(static_cast<std::size_t>(n), -std::numeric_limits<double>::infinity());
  for (std::int64_t r = 0; r < n; ++r) top[r] = *std::max_element(z + r * v, z + (r + 1) * v);
  if (g.size() > 1 && n > 0)
    g.comm->allreduce(top.data(), top.size(), dtype::f64, {.op = collective::reduce_op::max})
        .wait();
  // [0, n): sum exp(z - M); [n, 2n): sum exp(z - M) z, this shard's columns, then the group's.
  std::vector<double> sums(static_cast<std::size_t>(2 * n), 0.0);
  for (std::int64_t r = 0; r < n; ++r) {
    const double* row = z + r * v;
    double s = 0, zs = 0;
    for (std::int64_t k = 0; k < v; ++k) {
      const double e = std::exp(row[k] - top[r]);
      s += e;
      zs += e * row[k];
    }
    sums[r] = s;
    sums[n + r] = zs;
  }
  if (g.size() > 1 && n > 0) g.comm->allreduce(sums.data(), sums.size(), dtype::f64).wait();
  std::vector<double> out(static_cast<std::size_t>(n));
  for (std::int64_t r = 0; r < n; ++r) out[r] = top[r] + std::log(sums[r]) - sums[n + r] / sums[r];
  return out;
}

}  // namespace troupe::models
