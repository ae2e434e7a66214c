// CPU backend: embedding lookup and its scatter-add backward.
//
// Ids are checked against the table's rows before any work starts, so an out-of-range id is a
// clear error (naming the id and its position) rather than a stray read. The backward adds rows of
// dout into dtable rows chosen by ids; repeated ids would race if rows were split across threads,
// so threads split the columns instead and each walks all ids in order.
#include <cstring>

#include "memory/error.hpp"
#include "tensor/backend.hpp"
#include "tensor/cpu/half.hpp"
#include "tensor/cpu/kernel_util.hpp"
#include "tensor/parallel.hpp"

namespace troupe::cpu {
namespace {

template <class I>
void check_ids(const char* op, const I* ids, std::int64_t n, std::int64_t rows) {
  for (std::int64_t i = 0; i < n; ++i) {
    TROUPE_CHECK(ids[i] >= 0 && static_cast<std::int64_t>(ids[i]) < rows, "cpu ", op, ": id ",
                 static_cast<std::int64_t>(ids[i]), " at position ", i, " is outside the table's ",
                 rows, " rows");
  }
}

// Calls f(I{}) with I the C++ type of the ids (i32 or i64).
template <class F>
void dispatch_ids(const char* op, const tensor& ids, F&& f) {
  switch (ids.type()) {
    case dtype::i32:
      return f(std::int32_t{});
    case dtype::i64:
      return f(std::int64_t{});
    default:
      break;
  }
  TROUPE_FAIL("cpu ", op, ": ids must be i32 or i64, got ", dtype_name(ids.type()));
}

}  // namespace

// A row copy does not look at the values, so any element type works.
void embedding(const tensor& ids, const tensor& table, const tensor& out) {
  dispatch_ids("embedding", ids, [&]<class I>(I) {
    const I* ip = static_cast<const I*>(ids.data());
    const std::int64_t n = ids.numel(), rows = table.size(0);
    check_ids("embedding", ip, n, rows);
    const std::size_t row_bytes = static_cast<std::size_t>(table.size(1)) * table.element_size();
    const char* tp = static_cast<const char*>(table.data());
    char* op = static_cast<char*>(out.data());
    parallel::parallel_for(0, n, row_grain(table.size(1)), [&](std::int64_t lo, std::int64_t hi) {
      for (std::int64_t i = lo; i < hi; ++i)
        std::memcpy(op + i * row_bytes, tp + static_cast<std::int64_t>(ip[i]) * row_bytes,
                    row_bytes);
    });
  });
}

// 16-bit tables: each += is formed in f32 and rounded once, per id in order (like the f32 path).
void embedding_backward(const tensor& ids, const tensor& dout, const tensor& dtable) {
  dispatch_floating("embedding_backward", dtable.type(), [&]<class S>(S) {
    dispatch_ids("embedding_backward", ids, [&]<class I>(I) {
      const I* ip = static_cast<const I*>(ids.data());
      const std::int64_t n = ids.numel(), rows = dtable.size(0), c = dtable.size(1);
      check_ids("embedding_backward", ip, n, rows);
      const S* g = static_cast<const S*>(dout.data());
      S* d = static_cast<S*>(dtable.data());
      for_column_tiles(n, c, [&](std::int64_t c0, std::int64_t c1) {
        for (std::int64_t i = 0; i < n; ++i) {
          const S* src = g + i * c;
          S* dst = d + static_cast<std::int64_t>(ip[i]) * c;
          if constexpr (is_half<S>) {
            float t[max_col_tile];
            widen_n(src + c0, t, c1 - c0);
            accumulate_n(dst + c0, t, c1 - c0);
          } else {
            for (std::int64_t j = c0; j < c1; ++j) dst[j] += src[j];
          }
        }
      });
    });
  });
}

}  // namespace troupe::cpu
