// reshard: whole <-> tensor-parallel shard moves of flat per-parameter buffers, against what
// tp_gpt::load_from slices and against the whole model's own buffer.
#include <catch2/catch.hpp>

#include <cmath>
#include <string>
#include <string_view>
#include <vector>

#include "collective/local/local_transport.hpp"
#include "models/gpt.hpp"
#include "models/parallel/parallelize_gpt.hpp"
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

shape whole_shape(const gpt& m, std::string_view name) {
  for (const auto& s : m.slots().slots())
    if (s.name == name) return s.sizes;
  return {};
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
  const tensor& wbase = whole.memory().params();
  whole_layout wl{&whole.slots(), wbase};

  for (int tp : {2, 4}) {
    auto comms = collective::make_local_group(tp);
    owned_tensor back = zeros(wbase.sizes(), wbase.type());
    // A second buffer laid out like the whole model (as AdamW moments would be): 2 x params.
    owned_tensor twice = zeros(wbase.sizes(), wbase.type());
    ops::copy(wbase, twice);
    ops::scale(twice, 2.0);
    owned_tensor back2 = zeros(wbase.sizes(), wbase.type());
    for (int r = 0; r < tp; ++r) {
      tp_gpt shard(c, dims, tp_group{comms[r].get(), false});
      shard.load_from(whole);
      const tensor& pbase = shard.memory().params();
      piece_layout pl{&shard.slots(), pbase, r, tp, c.n_head, {}};
      // Replicated parameters (whole shape on every shard) are written by shard 0 only.
      pl.owns = [&, r](std::string_view name) {
        for (const auto& s : shard.slots().slots())
          if (s.name == name) return r == 0 || s.sizes != whole_shape(whole, name);
        return false;
      };
      owned_tensor mine = zeros(pbase.sizes(), pbase.type());
      scatter_to_piece(wl, wbase, pl, mine);
      INFO("tp " << tp << " shard " << r);
      CHECK(values(mine) == values(pbase));  // the same slices as tp_gpt::load_from
      gather_from_piece(pl, pbase, wl, back);
      owned_tensor mine2 = zeros(pbase.sizes(), pbase.type());
      scatter_to_piece(wl, twice, pl, mine2);
      gather_from_piece(pl, mine2, wl, back2);
    }
    CHECK(values(back) == values(wbase));
    CHECK(values(back2) == values(twice));
  }
}

TEST_CASE("A parameter no slicing explains is an error naming it", "[parallel]") {
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
  whole_layout wl{&b.slots(), b.memory().params()};
  piece_layout pl{&a.slots(), a.memory().params(), 0, 1, 4, {}};
  owned_tensor to = zeros(a.memory().params().sizes(), dtype::f32);
  REQUIRE_THROWS_WITH(scatter_to_piece(wl, b.memory().params(), pl, to),
                      Catch::Contains("no slicing matches") && Catch::Contains("'"));
}
