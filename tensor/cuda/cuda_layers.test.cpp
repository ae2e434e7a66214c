// Tests of the CUDA backend, part 2: softmax and the norms, rope, embedding, cross-entropy and
// attention, each against the CPU backend on the same inputs. All [gpu]: skipped without a GPU.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include "tensor/cuda/test_util.hpp"
#include "tensor/ops.hpp"

namespace {

using namespace troupe;
using namespace troupe::cuda_test;

owned_tensor gpu_empty(const shape& s, dtype t = dtype::f32) {
  return empty(s, t, device::cuda());
}

// Reductions over a row in a different order: a few f32 ulps of the row's scale.
constexpr double norm_rel = 1e-4, norm_abs = 1e-5;

}  // namespace

TEST_CASE("cuda softmax layernorm and rmsnorm match the cpu", "[gpu]") {
  TROUPE_NEED_GPU();
  for (shape s : {shape{3, 5, 67}, shape{2, 3001}}) {
    INFO("shape " << s.str());
    const std::int64_t rows = s.numel() / s[s.rank() - 1], cols = s[s.rank() - 1];
    owned_tensor x = random(s, 1, -3, 3), dy = random(s, 2);
    owned_tensor gx = gpu(x), gdy = gpu(dy);
    owned_tensor y = empty(s), dx = empty(s), gy = gpu_empty(s), gdx = gpu_empty(s);

    ops::softmax(x, y);
    ops::softmax(gx, gy);
    require_close(gy, y, norm_rel, 1e-7, "softmax");
    ops::softmax_backward(y, dy, dx);
    ops::softmax_backward(gy, gdy, gdx);
    require_close(gdx, dx, norm_rel, 1e-7, "softmax_backward");

    owned_tensor w = random({cols}, 3, 0.5f, 1.5f), b = random({cols}, 4);
    owned_tensor gw = gpu(w), gb = gpu(b);
    owned_tensor mean = empty({rows}), rstd = empty({rows});
    owned_tensor gmean = gpu_empty({rows}), grstd = gpu_empty({rows});
    for (bool bias : {true, false}) {
      INFO("bias " << bias);
      ops::layernorm(x, w, bias ? b.view() : tensor(), y, mean, rstd, 1e-5);
      ops::layernorm(gx, gw, bias ? gb.view() : tensor(), gy, gmean, grstd, 1e-5);
      require_close(gy, y, norm_rel, norm_abs, "layernorm y");
      require_close(gmean, mean, norm_rel, norm_abs, "layernorm mean");
      require_close(grstd, rstd, norm_rel, norm_abs, "layernorm rstd");
      // dw and db accumulate onto what is there
      owned_tensor dw = random({cols}, 5), db = random({cols}, 6);
      owned_tensor gdw = gpu(dw), gdb = gpu(db);
      ops::layernorm_backward(dy, x, w, mean, rstd, dx, dw, bias ? db.view() : tensor());
      ops::layernorm_backward(gdy, gx, gw, gmean, grstd, gdx, gdw, bias ? gdb.view() : tensor());
      require_close(gdx, dx, norm_rel, norm_abs, "layernorm dx");
      require_close(gdw, dw, norm_rel, norm_abs, "layernorm dw");
      require_close(gdb, db, norm_rel, norm_abs, "layernorm db");
    }

    ops::rmsnorm(x, w, y, rstd, 1e-6);
    ops::rmsnorm(gx, gw, gy, grstd, 1e-6);
    require_close(gy, y, norm_rel, norm_abs, "rmsnorm y");
    require_close(grstd, rstd, norm_rel, norm_abs, "rmsnorm rstd");
    owned_tensor dw = random({cols}, 7), gdw = gpu(dw);
    ops::rmsnorm_backward(dy, x, w, rstd, dx, dw);
    ops::rmsnorm_backward(gdy, gx, gw, grstd, gdx, gdw);
    require_close(gdx, dx, norm_rel, norm_abs, "rmsnorm dx");
    require_close(gdw, dw, norm_rel, norm_abs, "rmsnorm dw");

    // dx may alias dy
    ops::rmsnorm_backward(gdy, gx, gw, grstd, gdy, gdw);
    require_close(gdy, dx, norm_rel, norm_abs, "rmsnorm dx in place");
  }
}

TEST_CASE("cuda rope matches the cpu on strided views and in place", "[gpu]") {
  TROUPE_NEED_GPU();
  const std::int64_t B = 2, T = 5, H = 3, D = 8, start = 3;
  const double theta = 10000.0;
  owned_tensor cs = empty({T + 2, D / 2}), sn = empty({T + 2, D / 2});
  owned_tensor gcs = gpu_empty({T + 2, D / 2}), gsn = gpu_empty({T + 2, D / 2});
  ops::rope_tables(start, theta, cs, sn);
  ops::rope_tables(start, theta, gcs, gsn);
  require_close(gcs, cs, 1e-6, 1e-6, "cos");
  require_close(gsn, sn, 1e-6, 1e-6, "sin");
  std::vector<double> c = values(gcs);
  for (std::int64_t t = 0; t < T + 2; ++t)
    for (std::int64_t i = 0; i < D / 2; ++i)  // the definition in ops.hpp, in f64
      REQUIRE(c[t * (D / 2) + i] ==
              Approx(std::cos((start + t) * std::pow(theta, -2.0 * i / D))).margin(1e-6));

  // x: the second third of a fused [B, T, 3H, D] buffer
  owned_tensor buf = random({B, T, 3 * H, D}, 10), gbuf = gpu(buf);
  tensor x = buf.narrow(2, H, H), gx = gbuf.narrow(2, H, H);
  owned_tensor y = empty({B, T, H, D}), gy = gpu_empty({B, T, H, D});
  for (bool inverse : {false, true}) {
    INFO("inverse " << inverse);
    ops::rope(x, cs, sn, y, inverse);
    ops::rope(gx, gcs, gsn, gy, inverse);
    require_close(gy, y, 1e-5, 1e-6, "rope");
  }
  ops::rope(x, cs, sn, x);
  ops::rope(gx, gcs, gsn, gx);
  require_close(gbuf, buf, 1e-5, 1e-6, "rope in place");
  ops::rope(gx, gcs, gsn, gx, true);  // the inverse undoes the rotation
  require_close(gbuf, random({B, T, 3 * H, D}, 10), 1e-5, 1e-6, "rope round trip");
}

TEST_CASE("cuda embedding and its backward match the cpu", "[gpu]") {
  TROUPE_NEED_GPU();
  const std::int64_t V = 50, C = 12, N = 14;
  owned_tensor table = random({V, C}, 20), gtable = gpu(table);
  for (dtype id_type : {dtype::i32, dtype::i64}) {
    INFO(dtype_name(id_type));
    owned_tensor ids = empty({2, N / 2}, id_type);
    for (std::int64_t i = 0; i < N; ++i) {
      std::int64_t id = i == 5 ? V - 1 : (i * 7) % 9;  // repeats, and the last row
      if (id_type == dtype::i32)
        ids.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(id);
      else
        ids.data_as<std::int64_t>()[i] = id;
    }
    owned_tensor gids = gpu(ids);
    owned_tensor out = empty({2, N / 2, C}), gout = gpu_empty({2, N / 2, C});
    ops::embedding(ids, table, out);
    ops::embedding(gids, gtable, gout);
    require_close(gout, out, 0, 0, "embedding");

    owned_tensor dout = random({N, C}, 21), dtable = random({V, C}, 22);
    owned_tensor gdtable = gpu(dtable);
    ops::embedding_backward(ids, dout, dtable);
    ops::embedding_backward(gids, gpu(dout), gdtable);
    require_close(gdtable, dtable, 1e-5, 1e-6, "embedding_backward");  // sums in another order

    // a bf16 table is copied bit for bit
    owned_tensor g16 = gpu(to_16bit(table, dtype::bf16));
    owned_tensor gout16 = gpu_empty({N, C}, dtype::bf16);
    ops::embedding(gids, g16, gout16);
    require_close(gout16, to_16bit(out, dtype::bf16), 0, 0, "embedding bf16");

    if (id_type == dtype::i64)
      ids.data_as<std::int64_t>()[3] = V;
    else
      ids.data_as<std::int32_t>()[3] = -1;
    owned_tensor bad = gpu(ids);
    REQUIRE_THROWS_WITH(ops::embedding(bad, gtable, gout),
                        Catch::Contains("cuda embedding: id") && Catch::Contains("out of range"));
    REQUIRE_THROWS_WITH(ops::embedding_backward(bad, gpu(dout), gdtable),
                        Catch::Contains("out of range"));
  }
}

TEST_CASE("cuda cross entropy matches the cpu with ignored rows and aliasing", "[gpu]") {
  TROUPE_NEED_GPU();
  const std::int64_t N = 9, V = 1003;
  owned_tensor logits = random({N, V}, 30, -5, 5);
  for (dtype id_type : {dtype::i64, dtype::i32}) {
    INFO(dtype_name(id_type));
    const std::int64_t ignore = id_type == dtype::i64 ? -100 : 7;
    owned_tensor targets = empty({N}, id_type);
    for (std::int64_t i = 0; i < N; ++i) {
      std::int64_t t = (i == 2 || i == 6) ? ignore : (i * 389 + 11) % V;
      if (t == 7 && ignore == 7 && i != 2 && i != 6) t = 8;
      if (id_type == dtype::i64)
        targets.data_as<std::int64_t>()[i] = t;
      else
        targets.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(t);
    }
    owned_tensor glogits = gpu(logits), gtargets = gpu(targets);
    owned_tensor losses = empty({N}), dl = empty({N, V});
    owned_tensor glosses = gpu_empty({N}), gdl = gpu_empty({N, V});
    std::int64_t n = ops::cross_entropy(logits, targets, losses, dl, 1.0 / 7, ignore);
    std::int64_t gn = ops::cross_entropy(glogits, gtargets, glosses, gdl, 1.0 / 7, ignore);
    REQUIRE(n == 7);
    REQUIRE(gn == 7);
    require_close(glosses, losses, 1e-5, 1e-5, "losses");  // logsumexp of 1003 terms in f32
    require_close(gdl, dl, 1e-4, 1e-8, "dlogits");
    std::vector<double> gl = values(glosses);
    REQUIRE(gl[2] == 0.0);
    REQUIRE(gl[6] == 0.0);

    // no gradient, then the gradient written over the logits
    owned_tensor glosses2 = gpu_empty({N});
    REQUIRE(ops::cross_entropy(glogits, gtargets, glosses2, tensor(), 1.0 / 7, ignore) == 7);
    require_close(glosses2, losses, 1e-5, 1e-5, "losses without dlogits");
    REQUIRE(ops::cross_entropy(glogits, gtargets, glosses2, glogits, 1.0 / 7, ignore) == 7);
    require_close(glosses2, losses, 1e-5, 1e-5, "losses with aliased dlogits");
    require_close(glogits, dl, 1e-4, 1e-8, "aliased dlogits");
  }
  owned_tensor targets = zeros({N}, dtype::i64);
  targets.data_as<std::int64_t>()[4] = V;
  owned_tensor glosses = gpu_empty({N});
  REQUIRE_THROWS_WITH(
      ops::cross_entropy(gpu(logits), gpu(targets), glosses, tensor(), 1.0, -100),
      Catch::Contains("cuda cross_entropy: target") && Catch::Contains("out of range"));
}

namespace {

struct attention_case {
  std::int64_t B, T, S, Hq, Hkv, D;
  bool causal;
  bool fused;  // q, k, v (and their gradients) are views of one [B, T, Hq + 2 Hkv, D] buffer
  double scale;
};

// q, k, v views of storage laid out as in the case: fused buffer, or k and v stored [B, H, S, D]
// and viewed as [B, S, H, D].
struct qkv {
  owned_tensor q_store, k_store, v_store;
  tensor q, k, v;
};
qkv make_qkv(const attention_case& c, std::uint32_t seed, device dev) {
  qkv r;
  auto place = [&](owned_tensor t) { return dev.is_cpu() ? std::move(t) : gpu(t); };
  if (c.fused) {
    r.q_store = place(random({c.B, c.T, c.Hq + 2 * c.Hkv, c.D}, seed));
    r.q = r.q_store.narrow(2, 0, c.Hq);
    r.k = r.q_store.narrow(2, c.Hq, c.Hkv);
    r.v = r.q_store.narrow(2, c.Hq + c.Hkv, c.Hkv);
  } else {
    r.q_store = place(random({c.B, c.T, c.Hq, c.D}, seed));
    r.k_store = place(random({c.B, c.Hkv, c.S, c.D}, seed + 1));
    r.v_store = place(random({c.B, c.Hkv, c.S, c.D}, seed + 2));
    r.q = r.q_store.view();
    r.k = r.k_store.transpose(1, 2);
    r.v = r.v_store.transpose(1, 2);
  }
  return r;
}

}  // namespace

TEST_CASE("cuda attention forward and backward match the cpu", "[gpu]") {
  TROUPE_NEED_GPU();
  for (attention_case c : {attention_case{2, 5, 5, 4, 2, 16, true, false, 0.0},
                           attention_case{1, 3, 7, 2, 2, 32, true, false, 0.0},
                           attention_case{1, 70, 70, 3, 1, 72, true, true, 0.0},
                           attention_case{2, 33, 40, 2, 1, 128, false, false, 0.0},
                           attention_case{1, 9, 9, 2, 2, 8, true, false, 0.3}}) {
    INFO("B " << c.B << " T " << c.T << " S " << c.S << " Hq " << c.Hq << " Hkv " << c.Hkv << " D "
              << c.D << " causal " << c.causal << " fused " << c.fused);
    ops::attention_options opt;
    opt.causal = c.causal;
    opt.scale = c.scale;
    qkv h = make_qkv(c, 40, device::cpu()), g = make_qkv(c, 40, device::cuda());
    const shape qshape{c.B, c.T, c.Hq, c.D};
    owned_tensor out = empty(qshape), lse = empty({c.B, c.Hq, c.T});
    owned_tensor gout = gpu_empty(qshape), glse = gpu_empty({c.B, c.Hq, c.T});
    ops::attention(h.q, h.k, h.v, out, lse, opt);
    ops::attention(g.q, g.k, g.v, gout, glse, opt);
    // f32 dot products of D terms and softmax sums of S terms in another order
    require_close(gout, out, 1e-4, 1e-5, "out");
    require_close(glse, lse, 1e-4, 1e-5, "lse");

    owned_tensor dout = random(qshape, 41), gdout = gpu(dout);
    qkv hg = make_qkv(c, 50, device::cpu()), gg = make_qkv(c, 50, device::cuda());  // gradients
    ops::attention_backward(h.q, h.k, h.v, out, dout, lse, hg.q, hg.k, hg.v, opt);
    ops::attention_backward(g.q, g.k, g.v, gout, gdout, glse, gg.q, gg.k, gg.v, opt);
    require_close(gg.q_store, hg.q_store, 1e-4, 1e-5, c.fused ? "dq dk dv" : "dq");
    if (!c.fused) {
      require_close(gg.k_store, hg.k_store, 1e-4, 1e-5, "dk");
      require_close(gg.v_store, hg.v_store, 1e-4, 1e-5, "dv");
    }
  }
}

TEST_CASE("cuda attention rejects head dimensions above 128", "[gpu]") {
  TROUPE_NEED_GPU();
  owned_tensor q = zeros({1, 2, 1, 136}, dtype::f32, device::cuda());
  owned_tensor out = zeros({1, 2, 1, 136}, dtype::f32, device::cuda());
  owned_tensor lse = zeros({1, 1, 2}, dtype::f32, device::cuda());
  REQUIRE_THROWS_WITH(ops::attention(q, q, q, out, lse),
                      Catch::Contains("cuda attention: head dimension 136 exceeds 128"));
}
