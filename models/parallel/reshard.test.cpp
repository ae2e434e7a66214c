// reshard: whole <-> tensor-parallel shard moves of flat per-parameter buffers, against what
// tp_gpt::load_from, tp_llama::load_from and llama_stage::load_from slice and against the whole
// model's own buffer.
#include <catch2/catch.hpp>

#include <cmath>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "collective/local/local_transport.hpp"
#include "models/gpt.hpp"
#include "models/llama.hpp"
#include "models/parallel/llama_stage.hpp"
#include "models/parallel/parallelize_gpt.hpp"
#include "models/parallel/parallelize_llama.hpp"
#include "models/parallel/reshard.hpp"
#include "tensor/ops.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::parallel;

namespace {

std::vector<float> values(const tensor& t) {
  const float* p = t.data_as<float>();
  return std::vector<float>(p, p + t.numel());
}

shape whole_shape(const slot_list& whole, std::string_view name) {
  for (const auto& s : whole.slots())
    if (s.name == name) return s.sizes;
  return {};
}

// Scatters `whole`'s parameters (and twice them, as AdamW moments would be) to the pieces that
// make_pieces(group) builds for each tp shard (together they hold the whole model), compares with
// each piece's own load_from, gathers them back.
template <class Whole, class MakePieces>
void check_round_trip(Whole& whole, int tp, const MakePieces& make_pieces) {
  const tensor& wbase = whole.memory().params();
  const whole_layout wl = whole_layout::of(whole.slots());
  REQUIRE(wl.numel == wbase.numel());
  for (const auto& sl : whole.slots().slots())
    if (sl.kind == slot_kind::param) {
      INFO(sl.name);
      REQUIRE(wl.find(sl.name) != nullptr);
      CHECK(wl.find(sl.name)->offset == offset_in(*sl.field, wbase));  // as layer_memory placed it
    }
  auto comms = collective::make_local_group(tp);
  owned_tensor back = zeros(wbase.sizes(), wbase.type());
  owned_tensor twice = zeros(wbase.sizes(), wbase.type());
  ops::copy(wbase, twice);
  ops::scale(twice, 2.0);
  owned_tensor back2 = zeros(wbase.sizes(), wbase.type());
  for (int r = 0; r < tp; ++r)
    for (auto& shard : make_pieces(tp_group{comms[r].get(), false})) {
      shard->load_from(whole.slots());
      const tensor& pbase = shard->memory().params();
      piece_layout pl{&shard->slots(), pbase, r, tp, {}};
      // Replicated parameters (whole shape on every shard) are written by shard 0 only.
      pl.owns = [&, r](const tensor_slot& s) {
        return r == 0 || s.sizes != whole_shape(whole.slots(), s.name);
      };
      owned_tensor mine = zeros(pbase.sizes(), pbase.type());
      scatter_to_piece(wl, wbase, pl, mine);
      INFO("tp " << tp << " shard " << r);
      CHECK(values(mine) == values(pbase));  // the same slices as the shard's load_from
      gather_from_piece(pl, pbase, wl, back);
      owned_tensor mine2 = zeros(pbase.sizes(), pbase.type());
      scatter_to_piece(wl, twice, pl, mine2);
      gather_from_piece(pl, mine2, wl, back2);
    }
  CHECK(values(back) == values(wbase));
  CHECK(values(back2) == values(twice));
}

}  // namespace

TEST_CASE("Scattering a whole model to tensor shards and gathering them back is exact",
          "[parallel]") {
  gpt_config c;
  c.vocab = 64;
  c.dim = 32;
  c.n_layer = 2;
  c.n_head = 4;
  c.max_seq = 16;
  const batch_dims dims{2, 16};
  gpt whole(c, dims);
  whole.init_weights(7);
  for (int tp : {2, 4})
    check_round_trip(whole, tp, [&](tp_group g) {
      std::vector<std::unique_ptr<tp_gpt>> pieces;
      pieces.push_back(std::make_unique<tp_gpt>(c, dims, g));
      return pieces;
    });
}

TEST_CASE("Scattering a whole Llama to tensor shards and gathering them back is exact",
          "[parallel]") {
  llama_config c;
  c.vocab = 64;
  c.dim = 32;
  c.n_layer = 2;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.hidden = 48;
  c.max_seq = 16;
  c.attention_bias = true;
  const batch_dims dims{2, 16};
  for (bool tied : {false, true}) {
    INFO("tied " << tied);
    c.tie_embeddings = tied;
    llama whole(c, dims);
    whole.init_weights(7);
    check_round_trip(whole, 2, [&](tp_group g) {
      std::vector<std::unique_ptr<tp_llama>> pieces;
      pieces.push_back(std::make_unique<tp_llama>(c, dims, g));
      return pieces;
    });
    // Pipeline stages are pieces as well: tensor shards of both stages of a pp 2 plan.
    check_round_trip(whole, 2, [&](tp_group g) {
      std::vector<std::unique_ptr<llama_stage>> pieces;
      for (int st = 0; st < 2; ++st)
        pieces.push_back(std::make_unique<llama_stage>(
            c, dims, stage_options{.stage = st, .stages = 2, .virtual_stages = 1, .first = {}}, g));
      return pieces;
    });
  }
}

TEST_CASE("A parameter its declared layout does not explain is an error naming it", "[parallel]") {
  gpt_config c;
  c.vocab = 64;
  c.dim = 32;
  c.n_layer = 1;
  c.n_head = 4;
  c.max_seq = 8;
  gpt a(c, {1, 8});
  gpt_config wider = c;
  wider.dim = 48;
  wider.n_head = 4;
  gpt b(wider, {1, 8});
  const whole_layout wl = whole_layout::of(b.slots());
  piece_layout pl{&a.slots(), a.memory().params(), 0, 1, {}};
  owned_tensor to = zeros(a.memory().params().sizes(), dtype::f32);
  REQUIRE_THROWS_WITH(scatter_to_piece(wl, b.memory().params(), pl, to),
                      Catch::Contains("'wte.weight'") && Catch::Contains("declared layout"));
}
