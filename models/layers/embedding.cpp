// embedding: forward and backward through ops::embedding (see embedding.hpp).
#include "models/layers/embedding.hpp"

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

void embedding::declare(slot_list& s, std::string_view name, batch_dims) {
  TROUPE_CHECK(cfg.vocab > 0 && cfg.dim > 0, "embedding '", name,
               "': vocab and dim must be > 0, got ", cfg.vocab, " and ", cfg.dim);
  auto scope = s.enter(name);
  label = "embedding '" + s.prefix() + "'";
  param_spec spec = cfg.split_vocab ? param_spec::split_along(0) : param_spec::replicated();
  spec.embedding = true;
  s.param("weight", {cfg.vocab, cfg.dim}, weight, dweight, std::move(spec));
}

void embedding::forward(const tensor& ids_in, const tensor& y) {
  TROUPE_CHECK(weight.defined(), label, ": parameters are not bound");
  TROUPE_CHECK(ids_in.defined() && (ids_in.type() == dtype::i32 || ids_in.type() == dtype::i64),
               label, ": ids must be i32 or i64, got ", describe(ids_in));
  shape want = ids_in.sizes();
  want.push_back(cfg.dim);
  TROUPE_CHECK(y.defined() && y.sizes() == want, label, ": y must be ", want.str(), ", got ",
               describe(y));
  ids = ids_in;
  ops::embedding(ids, weight, y);
}

void embedding::backward(const tensor& dy) {
  TROUPE_CHECK(ids.defined(), label, ": backward called before forward");
  shape want = ids.sizes();
  want.push_back(cfg.dim);
  TROUPE_CHECK(dy.defined() && dy.sizes() == want, label, ": dy must be ", want.str(), ", got ",
               describe(dy));
  ops::embedding_backward(ids, dy, dweight);
}

}  // namespace troupe::models
