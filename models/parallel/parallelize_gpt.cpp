// GPT-2's tensor-parallel parts and its tensor shard (see parallelize_gpt.hpp).
#include "models/parallel/parallelize_gpt.hpp"

#include "memory/error.hpp"
#include "tensor/ops.hpp"

namespace troupe::models {

tp_gpt_front::tp_gpt_front(const gpt_config& c, tp_group g)
    : tp(g),
      dim(c.dim),
      wte({.vocab = c.vocab, .dim = c.dim}, g),
      wpe({.vocab = c.max_seq, .dim = c.dim, .split_vocab = false}),
      positions(empty({c.max_seq}, dtype::i32)) {
  for (std::int64_t i = 0; i < c.max_seq; ++i)
    positions.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(i);
}

void tp_gpt_front::declare(slot_list& s, batch_dims d) {
  wte.declare(s, "wte", d);
  wpe.declare(s, "wpe", {1, d.seq});
  const std::int64_t seq = tp.sequence_parallel ? d.seq / tp.size() : d.seq;
  s.activation("pos_emb", {seq, dim}, pos_emb);
}

void tp_gpt_front::declare_scratch(slot_list& s, batch_dims d) {
  s.scratch("dpos", {d.seq, dim}, dpos);
  if (!tp.sequence_parallel) return;
  s.scratch("dx0_full", {d.batch, d.seq, dim}, dx0_full);
  s.scratch("dx0_gather_buf", {d.rows() * dim}, gather_buf);
}

void tp_gpt_front::add_positions(const tensor& pos_ids, const tensor& x0) {
  tensor pos = planned_view(pos_emb, {pos_ids.size(0), dim}, "tp_gpt front", "pos_emb");
  wpe.forward(pos_ids, pos);
  for (std::int64_t r = 0; r < x0.size(0); ++r) {
    tensor xr = x0.select(0, r);
    ops::add(xr, pos, xr);
  }
}

void tp_gpt_front::forward(const tensor& ids, const tensor& x0) {
  const std::int64_t rows = x0.size(1);  // the shard's positions: rank * rows.. with SP
  const std::int64_t from = tp.sequence_parallel ? tp.rank() * rows : 0;
  wte.forward(ids, x0);
  if (!row_positions.defined()) {
    add_positions(context_positions.defined() ? context_positions.narrow(0, 0, rows)
                                              : positions.narrow(0, from, rows),
                  x0);
    return;
  }
  // Packed rows: each row's own positions (the whole model's gpt_ends::embed, row by row).
  TROUPE_CHECK(row_positions.type() == dtype::i32 && row_positions.dim() == 2 &&
                   row_positions.size(0) == x0.size(0) && row_positions.size(1) >= from + rows,
               "tp_gpt front: packed positions must be i32 [", x0.size(0),
               ", T] like the ids, got ", describe(row_positions));
  tensor pos = planned_view(pos_emb, {rows, dim}, "tp_gpt front", "pos_emb");
  for (std::int64_t r = 0; r < x0.size(0); ++r) {
    ops::embedding(row_positions.select(0, r).narrow(0, from, rows), wpe.weight, pos);
    tensor xr = x0.select(0, r);
    ops::add(xr, pos, xr);
  }
}

void tp_gpt_front::forward_step(const tensor& ids, std::int64_t start, const tensor& x0) {
  wte.forward_full_sequence(ids, x0);
  add_positions(positions.narrow(0, start, ids.size(1)), x0);
}

void tp_gpt_front::backward(const tensor& dx0) {
  // Tokens, then positions (SP: gathered so every shard adds all positions).
  wte.backward(dx0);
  const std::int64_t b = dx0.size(0);
  const std::int64_t t = tp.sequence_parallel ? dx0.size(1) * tp.size() : dx0.size(1);
  tensor d0 = dx0;
  if (tp.sequence_parallel) {
    d0 = planned_view(dx0_full, {b, t, dim}, "tp_gpt front", "dx0_full");
    gather_sequence(tp, dx0, d0, gather_buf);
  }
  if (row_positions.defined()) {  // packed rows: each row's positions of its own
    for (std::int64_t r = 0; r < b; ++r)
      ops::embedding_backward(row_positions.select(0, r), d0.select(0, r), wpe.dweight);
    return;
  }
  tensor d = planned_view(dpos, {t, dim}, "tp_gpt front", "dpos");
  ops::fill(d, 0.0);
  for (std::int64_t r = 0; r < b; ++r) ops::add(d, d0.select(0, r), d);
  // Every position, as d0 covers them all (context parallelism: the stage's own).
  wpe.ids =
      context_positions.defined() ? context_positions.narrow(0, 0, t) : positions.narrow(0, 0, t);
  wpe.backward(d);
}

gpt_config tp_parts<gpt_family>::checked(const gpt_config& c, const tp_group& tp,
                                         std::string_view who) {
  (void)tp;  // tp_attention and the vocab-parallel layers check what the group must divide
  TROUPE_CHECK(c.n_layer > 0 && c.n_head > 0 && c.dim % c.n_head == 0, who,
               ": n_layer and n_head must be > 0 and dim (", c.dim, ") a multiple of n_head (",
               c.n_head, ")");
  return gpt_family::checked(c);
}

tp_parts<gpt_family>::back::config tp_parts<gpt_family>::head_config(const gpt_config& c) {
  return {.dim = c.dim,
          .vocab = c.vocab,
          .norm = {.dim = c.dim, .eps = c.ln_eps},
          .tied = true,
          .norm_name = "ln_f",
          .norm_out_name = "ln_f_out"};
}

template class tp_trunk<gpt_family>;
template class tp_model<gpt_family>;

std::unique_ptr<tp_gpt> parallelize_gpt(const gpt& model, batch_dims dims,
                                        collective::communicator& tp, bool sequence_parallel) {
  auto m = std::make_unique<tp_gpt>(model.config(), dims, tp_group{&tp, sequence_parallel});
  m->load_from(model);
  return m;
}

}  // namespace troupe::models
