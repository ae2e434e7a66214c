#include "models/layers/sequence_split.hpp"

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

const char* sequence_layout_name(sequence_layout l) {
  return l == sequence_layout::zigzag ? "zigzag" : "contiguous";
}

std::vector<sequence_piece> sequence_pieces(std::int64_t t, int cp, int rank, sequence_layout l) {
  TROUPE_CHECK(cp >= 1 && rank >= 0 && rank < cp, "sequence split: rank ", rank,
               " is not in a context-parallel group of ", cp);
  if (l == sequence_layout::contiguous) {
    TROUPE_CHECK(t % cp == 0, "sequence split: ", t, " tokens do not split over cp = ", cp,
                 " ranks");
    const std::int64_t n = t / cp;
    return {{rank * n, n, 0}};
  }
  TROUPE_CHECK(t % (2 * cp) == 0, "sequence split: ", t,
               " tokens do not split into 2 cp = ", 2 * cp, " zigzag chunks");
  const std::int64_t c = t / (2 * cp);
  return {{rank * c, c, 0}, {(2 * cp - 1 - rank) * c, c, c}};
}

std::vector<std::int64_t> local_positions(std::int64_t t, int cp, int rank, sequence_layout l) {
  std::vector<std::int64_t> pos;
  pos.reserve(static_cast<std::size_t>(t / cp));
  for (const auto& p : sequence_pieces(t, cp, rank, l))
    for (std::int64_t i = 0; i < p.length; ++i) pos.push_back(p.start + i);
  return pos;
}

namespace {
void check_parts(const char* op, const tensor& full, int cp, const tensor& local) {
  TROUPE_CHECK(full.dim() >= 2 && local.dim() == full.dim(), op,
               ": full and local must be [B, T, ...] of one rank, got ", full.describe(), " and ",
               local.describe());
  bool same = local.size(0) == full.size(0) && local.size(1) * cp == full.size(1);
  for (int d = 2; d < full.dim(); ++d) same = same && local.size(d) == full.size(d);
  TROUPE_CHECK(same, op, ": local must be full with T / cp (cp = ", cp, ") tokens, got full ",
               full.describe(), " and local ", local.describe());
}
}  // namespace

void split_sequence(const tensor& full, int cp, int rank, sequence_layout l, const tensor& local) {
  check_parts("split_sequence", full, cp, local);
  for (const auto& p : sequence_pieces(full.size(1), cp, rank, l))
    ops::copy(full.narrow(1, p.start, p.length), local.narrow(1, p.local, p.length));
}

void unsplit_sequence(const tensor& local, int cp, int rank, sequence_layout l,
                      const tensor& full) {
  check_parts("unsplit_sequence", full, cp, local);
  for (const auto& p : sequence_pieces(full.size(1), cp, rank, l))
    ops::copy(local.narrow(1, p.local, p.length), full.narrow(1, p.start, p.length));
}

}  // namespace troupe::models
