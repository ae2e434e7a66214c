// param_slices: copies by declared layout (see param_slices.hpp).
#include "models/parallel/param_slices.hpp"

#include <map>
#include <string>

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

void copy_slice(const tensor_slot& shard_slot, const tensor& full, const tensor& shard, int rank,
                int tp, bool into_shard, std::string_view what) {
  const param_spec& spec = shard_slot.spec;
  const shape& fs = full.sizes();
  const shape& ls = shard.sizes();
  auto copy = [&](const tensor& f, const tensor& l) {
    if (into_shard)
      ops::copy(f, l);
    else
      ops::copy(l, f);
  };
  auto mismatch = [&] {
    TROUPE_FAIL(what, ": parameter '", shard_slot.name, "' is ", ls.str(), " on shard ", rank,
                " of ", tp, " but ", fs.str(), " unsharded, which its declared layout (",
                spec.split ? "split along axis " + std::to_string(spec.axis) : "replicated",
                ") does not give");
  };
  if (fs.rank() != ls.rank()) mismatch();
  if (!spec.split || tp == 1) {
    if (fs != ls) mismatch();
    copy(full, shard);
    return;
  }
  const int a = spec.axis;
  for (int d = 0; d < fs.rank(); ++d)
    if (d != a ? fs[d] != ls[d] : fs[d] != ls[d] * tp) mismatch();
  // The shard's sections (its own extents) or the whole axis as one section.
  std::int64_t at_full = 0, at_shard = 0;
  auto take = [&](std::int64_t local) {
    copy(full.narrow(a, at_full + rank * local, local), shard.narrow(a, at_shard, local));
    at_full += local * tp;
    at_shard += local;
  };
  if (spec.sections.empty()) {
    take(ls[a]);
  } else {
    for (std::int64_t local : spec.sections) take(local);
  }
}

void copy_slices_by_name(const slot_list& piece, const slot_list& full, bool full_grads,
                         bool own_grads, bool into_piece, const tp_group& tp,
                         std::string_view who) {
  std::map<std::string, const tensor_slot*, std::less<>> by_name;
  for (const auto& s : full.slots())
    if (s.kind == slot_kind::param) by_name[s.name] = &s;
  for (const auto& s : piece.slots()) {
    if (s.kind != slot_kind::param) continue;
    auto it = by_name.find(s.name);
    TROUPE_CHECK(it != by_name.end(), who, ": the unsharded model has no parameter '", s.name, "'");
    const tensor& f = full_grads ? *it->second->grad : *it->second->field;
    const tensor& own = own_grads ? *s.grad : *s.field;
    copy_slice(s, f, own, tp.rank(), tp.size(), into_piece, who);
  }
}

void init_slices(const std::function<void(const init_sink&)>& draw, const slot_list& piece,
                 const tp_group& tp, std::string_view who) {
  std::map<std::string, const tensor_slot*, std::less<>> own;
  for (const auto& s : piece.slots())
    if (s.kind == slot_kind::param) own[s.name] = &s;
  draw([&](const tensor_slot& s, const tensor& values) {
    auto it = own.find(s.name);
    if (it == own.end()) return;  // someone else's: drawn all the same, the stream stays in step
    const tensor& mine = *it->second->field;
    owned_tensor full = empty(s.sizes, mine.type());  // the rounding store_param does
    ops::copy(values, full);
    copy_slice(*it->second, full, mine, tp.rank(), tp.size(), /*into_shard=*/true, who);
  });
}

}  // namespace troupe::models
