// Tests of the CUDA backend in bf16 and f16, part 3: softmax, the norms, rope, embedding backward,
// cross-entropy and attention. Each op runs on the device on 16-bit tensors and on the CPU in f32
// on the same values (the random inputs rounded to 16 bits first); backwards get the statistics
// the device saved. The device computes in f32 and rounds each output once, so an output is off
// the f32 reference by at most half a 16-bit ulp plus the f32 rounding of both sides: each bound
// is the f32 bound of the op's helper in test_bounds.hpp (both sides' rounding for the kernels'
// structure, per element from the inputs) with the 16-bit rounding added (stored_as). All [gpu]:
// skipped without a GPU.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <vector>

#include "tensor/cuda/test_bounds.hpp"
#include "tensor/cuda/test_util.hpp"
#include "tensor/ops.hpp"

namespace {

using namespace troupe;
using namespace troupe::cuda_test;

owned_tensor gpu_empty(const shape& s, dtype t) {
  return empty(s, t, device::cuda());
}

// A device tensor of dtype t holding the f32 host tensor x (whose values are already t values).
owned_tensor gpu16(const tensor& x, dtype t) {
  return gpu(to_16bit(x, t));
}

// The f32 host copy of a contiguous tensor on any device in any floating dtype (exact).
owned_tensor f32_host(const tensor& x) {
  owned_tensor h = host(x);
  owned_tensor out = empty(h.sizes(), dtype::f32);
  ops::copy(h, out);
  return out;
}

// Random f32 host values that are exactly representable in t.
owned_tensor random16(const shape& s, std::uint32_t seed, dtype t, float lo = -1.0f,
                      float hi = 1.0f) {
  return rounded(random(s, seed, lo, hi), t);
}

// The dtypes tensor/ops.cpp accepts for the saved statistics (mean, rstd, lse, losses) of an op
// on t data: t itself, or f32.
std::vector<dtype> stat_types(dtype t) {
  return {t, dtype::f32};
}
// The dtypes ops.cpp accepts for the rope tables of t data: t (HF casts its f32 tables to the
// model's dtype). The kernels also take f32 tables.
std::vector<dtype> table_types(dtype t) {
  return {t};
}
constexpr dtype half_types[] = {dtype::bf16, dtype::f16};

}  // namespace

TEST_CASE("cuda softmax in bf16 and f16 matches f32 on the rounded inputs", "[gpu]") {
  TROUPE_NEED_GPU();
  for (dtype t : half_types) {
    for (shape s : {shape{3, 5, 67}, shape{2, 3001}}) {
      INFO(dtype_name(t) << " shape " << s.str());
      owned_tensor x = random16(s, 1, t, -3, 3), dy = random16(s, 2, t);
      owned_tensor gx = gpu16(x, t), gdy = gpu16(dy, t);
      owned_tensor y = empty(s), dx = empty(s), gy = gpu_empty(s, t), gdx = gpu_empty(s, t);
      ops::softmax(x, y);
      ops::softmax(gx, gy);
      require_within(gy, y, stored_as(t, softmax_bound(x), y), "softmax");
      // backward from the probabilities the device stored
      owned_tensor y16 = f32_host(gy);
      ops::softmax_backward(y16, dy, dx);
      ops::softmax_backward(gy, gdy, gdx);
      const std::vector<double> dx_bound = stored_as(t, softmax_backward_bound(y16, dy), dx);
      require_within(gdx, dx, dx_bound, "softmax_backward");
      // dx may alias dy
      ops::softmax_backward(gy, gdy, gdy);
      require_within(gdy, dx, dx_bound, "softmax_backward in place");
    }
  }
}

TEST_CASE("cuda layernorm and rmsnorm in bf16 and f16 match f32 on the rounded inputs", "[gpu]") {
  TROUPE_NEED_GPU();
  for (dtype t : half_types) {
    for (dtype st : stat_types(t)) {
      for (shape s : {shape{3, 5, 67}, shape{2, 3001}}) {
        INFO(dtype_name(t) << " statistics " << dtype_name(st) << " shape " << s.str());
        const std::int64_t rows = s.numel() / s[s.rank() - 1], cols = s[s.rank() - 1];
        owned_tensor x = random16(s, 1, t, -3, 3), dy = random16(s, 2, t);
        owned_tensor w = random16({cols}, 3, t, 0.5f, 1.5f), b = random16({cols}, 4, t);
        owned_tensor gx = gpu16(x, t), gdy = gpu16(dy, t), gw = gpu16(w, t), gb = gpu16(b, t);
        owned_tensor y = empty(s), dx = empty(s), gy = gpu_empty(s, t), gdx = gpu_empty(s, t);
        owned_tensor mean = empty({rows}), rstd = empty({rows});
        owned_tensor gmean = gpu_empty({rows}, st), grstd = gpu_empty({rows}, st);

        for (bool bias : {true, false}) {
          INFO("bias " << bias);
          ops::layernorm(x, w, bias ? b.view() : tensor(), y, mean, rstd, 1e-5);
          ops::layernorm(gx, gw, bias ? gb.view() : tensor(), gy, gmean, grstd, 1e-5);
          const norm_bounds nb = layernorm_bound(x, w, bias ? b.view() : tensor(), 1e-5);
          require_within(gy, y, stored_as(t, nb.y, y), "layernorm y");
          require_within(gmean, mean, stored_as(st, nb.mean, mean), "layernorm mean");
          require_within(grstd, rstd, stored_as(st, nb.rstd, rstd), "layernorm rstd");
          // dw and db accumulate onto what is there: one rounding of (old + f32 sum)
          owned_tensor dw = random16({cols}, 5, t), db = random16({cols}, 6, t);
          owned_tensor gdw = gpu16(dw, t), gdb = gpu16(db, t);
          owned_tensor hmean = f32_host(gmean), hrstd = f32_host(grstd);
          const param_bounds pb = norm_param_bound(dy, x, hmean, hrstd, dw, db);
          ops::layernorm_backward(dy, x, w, hmean, hrstd, dx, dw, bias ? db.view() : tensor());
          ops::layernorm_backward(gdy, gx, gw, gmean, grstd, gdx, gdw,
                                  bias ? gdb.view() : tensor());
          require_within(gdx, dx, stored_as(t, norm_dx_bound(dy, x, w, hmean, hrstd), dx),
                         "layernorm dx");
          require_within(gdw, dw, stored_as(t, pb.dw, dw), "layernorm dw");
          require_within(gdb, db, stored_as(t, pb.db, db), "layernorm db");
        }

        ops::rmsnorm(x, w, y, rstd, 1e-6);
        ops::rmsnorm(gx, gw, gy, grstd, 1e-6);
        const norm_bounds nb = rmsnorm_bound(x, w, 1e-6);
        require_within(gy, y, stored_as(t, nb.y, y), "rmsnorm y");
        require_within(grstd, rstd, stored_as(st, nb.rstd, rstd), "rmsnorm rstd");
        owned_tensor dw = random16({cols}, 7, t), gdw = gpu16(dw, t);
        owned_tensor hrstd = f32_host(grstd);
        const std::vector<double> dx32 = norm_dx_bound(dy, x, w, tensor(), hrstd);
        const std::vector<double> dw32 = norm_param_bound(dy, x, tensor(), hrstd, dw, tensor()).dw;
        ops::rmsnorm_backward(dy, x, w, hrstd, dx, dw);
        ops::rmsnorm_backward(gdy, gx, gw, grstd, gdx, gdw);
        const std::vector<double> dx_bound = stored_as(t, dx32, dx),
                                  dw_bound = stored_as(t, dw32, dw);
        require_within(gdx, dx, dx_bound, "rmsnorm dx");
        require_within(gdw, dw, dw_bound, "rmsnorm dw");
        // dx may alias dy (dw is computed first): the same computations, the same bounds
        owned_tensor gdw2 = gpu16(random16({cols}, 7, t), t);
        ops::rmsnorm_backward(gdy, gx, gw, grstd, gdy, gdw2);
        require_within(gdy, dx, dx_bound, "rmsnorm dx in place");
        require_within(gdw2, dw, dw_bound, "rmsnorm dw with dx in place");
      }
    }
  }
}

TEST_CASE("cuda rope tables follow the f32 arithmetic of the cpu and round once", "[gpu]") {
  TROUPE_NEED_GPU();
  // Far positions: an angle computed in f64 instead of HF's float(position) * float(inv_freq)
  // would differ by about position * 2^-24 (1e-4 here), far outside the tolerance.
  const std::int64_t T = 33, half = 32, start = 4000;
  const double theta = 500000.0;
  owned_tensor cs = empty({T, half}), sn = empty({T, half});
  ops::rope_tables(start, theta, cs, sn);
  owned_tensor gcs = gpu_empty({T, half}, dtype::f32), gsn = gpu_empty({T, half}, dtype::f32);
  ops::rope_tables(start, theta, gcs, gsn);
  // Both sides take cos/sin of the same f32 angle in f64 and round to f32: they differ only by
  // the f64 pow's and cos's ulps, so equal unless an f32 rounding boundary lies within them
  // (rope_table_range; then one f32 ulp). Was 1e-6 |want| + 1e-7.
  const table_range tr = rope_table_range(start, theta, T, half);
  require_within(gcs, cs, range_bound(tr.cos_lo, tr.cos_hi, cs, dtype::f32), "f32 cos");
  require_within(gsn, sn, range_bound(tr.sin_lo, tr.sin_hi, sn, dtype::f32), "f32 sin");
  for (dtype t : half_types) {
    INFO(dtype_name(t));
    owned_tensor hcs = gpu_empty({T, half}, t), hsn = gpu_empty({T, half}, t);
    ops::rope_tables(start, theta, hcs, hsn);
    // the f32 table rounded once to nearest even: the same 16-bit values, unless the f32 values
    // can differ (above) across a 16-bit rounding boundary. Was 1e-6 |want|.
    owned_tensor cs16 = to_16bit(cs, t), sn16 = to_16bit(sn, t);
    require_within(hcs, cs16, range_bound(tr.cos_lo, tr.cos_hi, cs16, t), "16-bit cos");
    require_within(hsn, sn16, range_bound(tr.sin_lo, tr.sin_hi, sn16, t), "16-bit sin");
  }
}

TEST_CASE("cuda rope in bf16 and f16 matches f32 on strided views and in place", "[gpu]") {
  TROUPE_NEED_GPU();
  const std::int64_t B = 2, T = 5, H = 3, D = 16, start = 3;
  for (dtype t : half_types) {
    for (dtype ct : table_types(t)) {
      INFO(dtype_name(t) << " tables " << dtype_name(ct));
      owned_tensor gcs = gpu_empty({T + 2, D / 2}, ct), gsn = gpu_empty({T + 2, D / 2}, ct);
      ops::rope_tables(start, 10000.0, gcs, gsn);
      owned_tensor cs = f32_host(gcs), sn = f32_host(gsn);  // the same table values on the cpu
      // x: the second third of a fused [B, T, 3H, D] buffer
      owned_tensor buf = random16({B, T, 3 * H, D}, 10, t, -2, 2), gbuf = gpu16(buf, t);
      tensor x = buf.narrow(2, H, H), gx = gbuf.narrow(2, H, H);
      owned_tensor y = empty({B, T, H, D}), gy = gpu_empty({B, T, H, D}, t);
      // 2 products and a sum per output on each side, with the same tables (rope_bound), then
      // the device's 16-bit rounding. Was ulp16 |want| + 1e-5 |want| + 1e-6.
      const std::vector<double> x_bound = rope_bound(buf, x, cs, sn);
      std::vector<double> y_bound;
      for (std::size_t k = 0; k < x_bound.size(); ++k) {
        const std::size_t head = (k / D) % (3 * H);
        if (head >= static_cast<std::size_t>(H) && head < static_cast<std::size_t>(2 * H))
          y_bound.push_back(x_bound[k]);  // the middle third, in order: y's layout
      }
      for (bool inverse : {false, true}) {
        INFO("inverse " << inverse);
        ops::rope(x, cs, sn, y, inverse);
        ops::rope(gx, gcs, gsn, gy, inverse);
        require_within(gy, y, stored_as(t, y_bound, y), "rope");
      }
      ops::rope(x, cs, sn, x);
      ops::rope(gx, gcs, gsn, gx);
      // the other heads stay as they were: bound 0 there
      std::vector<double> in_place = stored_as(t, x_bound, buf);
      for (std::size_t k = 0; k < in_place.size(); ++k)
        if (x_bound[k] == 0) in_place[k] = 0;
      require_within(gbuf, buf, in_place, "rope in place");
    }
  }
}

TEST_CASE("cuda embedding backward in bf16 and f16 sums in f32 and rounds once", "[gpu]") {
  TROUPE_NEED_GPU();
  // Several steps of 256 positions and two column chunks of the owner kernel; ids repeat across
  // steps, one id is unique, and the last table row is used.
  const std::int64_t V = 50, C = 1100, N = 600;
  for (dtype t : half_types) {
    for (dtype id_type : {dtype::i32, dtype::i64}) {
      INFO(dtype_name(t) << " ids " << dtype_name(id_type));
      owned_tensor ids = empty({N}, id_type);
      std::vector<bool> used(V, false);
      for (std::int64_t i = 0; i < N; ++i) {
        std::int64_t id = i == 5 ? V - 1 : i == 300 ? 20 : (i * 7) % 9;
        used[id] = true;
        if (id_type == dtype::i32)
          ids.data_as<std::int32_t>()[i] = static_cast<std::int32_t>(id);
        else
          ids.data_as<std::int64_t>()[i] = id;
      }
      owned_tensor gids = gpu(ids);
      owned_tensor dout = random16({N, C}, 21, t), dtable = random16({V, C}, 22, t);
      owned_tensor old = rounded(dtable, t);  // a copy of the table before the update
      owned_tensor gdtable = gpu16(dtable, t);
      std::vector<std::int64_t> idv;
      for (double id : values(ids)) idv.push_back(static_cast<std::int64_t>(id));
      const std::vector<double> eb32 = embedding_backward_bound(idv, dout, old);
      ops::embedding_backward(ids, dout, dtable);
      ops::embedding_backward(gids, gpu16(dout, t), gdtable);
      // up to 67 terms per element, k f32 roundings on each side (embedding_backward_bound), then
      // one rounding to 16 bits. Was ulp16 |want| + 1e-4.
      require_within(gdtable, dtable, stored_as(t, eb32, dtable), "embedding_backward");
      // rows no id names are not touched at all
      std::vector<double> got = values(gdtable), before = values(old);
      for (std::int64_t r = 0; r < V; ++r) {
        if (used[r]) continue;
        for (std::int64_t c = 0; c < C; ++c) REQUIRE(got[r * C + c] == before[r * C + c]);
      }
    }

    // 512 gradients of 2e-4 onto 1.0: a rounding after each addition would never move 1.0 (2e-4
    // is under half a 16-bit ulp of 1); one rounding of the f32 sum gives round(1 + 512 r) with r
    // the rounded 2e-4. The f32 sums are exact here (at most 24 significant bits), so the result
    // is exact.
    const std::int64_t n = 512, c = 3;
    owned_tensor ids = zeros({n}, dtype::i64);
    owned_tensor dout = empty({n, c});
    ops::fill(dout, 2e-4);
    dout = rounded(dout, t);
    owned_tensor table = empty({2, c});
    ops::fill(table, 1.0);
    owned_tensor gtable = gpu16(table, t);
    ops::embedding_backward(gpu(ids), gpu16(dout, t), gtable);
    const double r = values(dout)[0];
    owned_tensor want = empty({2, c});
    for (std::int64_t i = 0; i < c; ++i) {
      want.data_as<float>()[i] = static_cast<float>(1.0 + n * r);
      want.data_as<float>()[c + i] = 1.0f;
    }
    REQUIRE(values(to_16bit(want, t))[0] != 1.0);
    require_close(gtable, to_16bit(want, t), 0, 0, "one rounding of the sum");

    // a bad id is reported
    ids.data_as<std::int64_t>()[7] = 2;
    REQUIRE_THROWS_WITH(ops::embedding_backward(gpu(ids), gpu16(dout, t), gtable),
                        Catch::Contains("cuda embedding_backward: id 2 at position 7") &&
                            Catch::Contains("out of range"));
  }
}

TEST_CASE("cuda cross entropy in bf16 and f16 matches f32 on the rounded logits", "[gpu]") {
  TROUPE_NEED_GPU();
  const std::int64_t N = 9, V = 1003, ignore = -100;
  owned_tensor targets = empty({N}, dtype::i64);
  for (std::int64_t i = 0; i < N; ++i)
    targets.data_as<std::int64_t>()[i] = (i == 2 || i == 6) ? ignore : (i * 389 + 11) % V;
  owned_tensor gtargets = gpu(targets);
  std::vector<std::int64_t> tv;
  for (double x : values(targets)) tv.push_back(static_cast<std::int64_t>(x));
  for (dtype t : half_types) {
    for (dtype lt : stat_types(t)) {
      INFO(dtype_name(t) << " losses " << dtype_name(lt));
      owned_tensor logits = random16({N, V}, 30, t, -5, 5), glogits = gpu16(logits, t);
      owned_tensor losses = empty({N}), dl = empty({N, V});
      owned_tensor glosses = gpu_empty({N}, lt), gdl = gpu_empty({N, V}, t);
      REQUIRE(ops::cross_entropy(logits, targets, losses, dl, 1.0 / 7, ignore) == 7);
      REQUIRE(ops::cross_entropy(glogits, gtargets, glosses, gdl, 1.0 / 7, ignore) == 7);
      // the f32 bounds (cross_entropy_bound) and the 16-bit roundings. Was ulp16 |want| plus
      // 1e-5 |loss| + 1e-5 and 1e-4 |dl| + 1e-8 + f16's subnormal spacing.
      const loss_bounds lb = cross_entropy_bound(logits, tv, ignore, 1.0 / 7);
      const std::vector<double> loss_bound = stored_as(lt, lb.losses, losses);
      const std::vector<double> dl_bound = stored_as(t, lb.dlogits, dl);
      require_within(glosses, losses, loss_bound, "losses");
      require_within(gdl, dl, dl_bound, "dlogits");
      std::vector<double> gl = values(glosses);
      REQUIRE(gl[2] == 0.0);
      REQUIRE(gl[6] == 0.0);
      // the gradient written over the logits
      REQUIRE(ops::cross_entropy(glogits, gtargets, glosses, glogits, 1.0 / 7, ignore) == 7);
      require_within(glosses, losses, loss_bound, "losses with aliased dlogits");
      require_within(glogits, dl, dl_bound, "aliased dlogits");
    }
  }
}

namespace {

struct attention_case {
  std::int64_t B, T, S, Hq, Hkv, D;
  bool causal;
  bool fused;  // q, k, v (and their gradients) are views of one [B, T, Hq + 2 Hkv, D] buffer
};

// q, k, v views of storage as in the case (fused buffer, or k and v stored [B, H, S, D] and viewed
// as [B, S, H, D]): on the host in f32 with values representable in t, or on the device in t.
struct qkv {
  owned_tensor q_store, k_store, v_store;
  tensor q, k, v;
};
qkv make_qkv(const attention_case& c, std::uint32_t seed, dtype t, bool on_gpu) {
  qkv r;
  auto place = [&](const shape& s, std::uint32_t sd) {
    owned_tensor h = random16(s, sd, t);
    return on_gpu ? gpu16(h, t) : std::move(h);
  };
  if (c.fused) {
    r.q_store = place({c.B, c.T, c.Hq + 2 * c.Hkv, c.D}, seed);
    r.q = r.q_store.narrow(2, 0, c.Hq);
    r.k = r.q_store.narrow(2, c.Hq, c.Hkv);
    r.v = r.q_store.narrow(2, c.Hq + c.Hkv, c.Hkv);
  } else {
    r.q_store = place({c.B, c.T, c.Hq, c.D}, seed);
    r.k_store = place({c.B, c.Hkv, c.S, c.D}, seed + 1);
    r.v_store = place({c.B, c.Hkv, c.S, c.D}, seed + 2);
    r.q = r.q_store.view();
    r.k = r.k_store.transpose(1, 2);
    r.v = r.v_store.transpose(1, 2);
  }
  return r;
}

}  // namespace

TEST_CASE("cuda attention in bf16 and f16 matches f32 on the rounded inputs", "[gpu]") {
  TROUPE_NEED_GPU();
  for (dtype t : half_types) {
    for (dtype lt : stat_types(t)) {
      for (attention_case c : {attention_case{2, 5, 5, 4, 2, 16, true, false},
                               attention_case{1, 70, 70, 3, 1, 72, true, true},
                               attention_case{2, 33, 40, 2, 1, 128, false, false}}) {
        INFO(dtype_name(t) << " lse " << dtype_name(lt) << " B " << c.B << " T " << c.T << " S "
                           << c.S << " Hq " << c.Hq << " Hkv " << c.Hkv << " D " << c.D
                           << " causal " << c.causal << " fused " << c.fused);
        ops::attention_options opt;
        opt.causal = c.causal;
        // The CUDA-core kernel, whose arithmetic these bounds follow (D 128 would otherwise take
        // the tensor-core kernel: attention_mma.test.cpp tests that one).
        opt.kernel = ops::attention_kernel::cuda_cores;
        qkv h = make_qkv(c, 40, t, false), g = make_qkv(c, 40, t, true);
        const shape qshape{c.B, c.T, c.Hq, c.D};
        owned_tensor out = empty(qshape), lse = empty({c.B, c.Hq, c.T});
        owned_tensor gout = gpu_empty(qshape, t), glse = gpu_empty({c.B, c.Hq, c.T}, lt);
        ops::attention(h.q, h.k, h.v, out, lse, opt);
        ops::attention(g.q, g.k, g.v, gout, glse, opt);
        // The f32 bounds of attention_bound (both backwards read the device's out and lse, with
        // their 16-bit rounding), and the 16-bit roundings of the outputs. Was ulp16 |want| plus
        // 1e-4 |want| + 1e-5: looser in f32 terms (worst case, see the f32 test), while the
        // 16-bit rounding, now half an ulp16 instead of one, dominates most elements.
        owned_tensor dout = random16(qshape, 41, t), gdout = gpu16(dout, t);
        const attention_bounds ab =
            attention_bound(h.q, h.k, h.v, dout, c.causal, 0.0, true, t, lt);
        require_within(gout, out, stored_as(t, ab.out, out), "out");
        require_within(glse, lse, stored_as(lt, ab.lse, lse), "lse");

        // backward from the output and lse the device stored
        qkv hg = make_qkv(c, 50, t, false), gg = make_qkv(c, 50, t, true);  // gradients
        ops::attention_backward(h.q, h.k, h.v, f32_host(gout), dout, f32_host(glse), hg.q, hg.k,
                                hg.v, opt);
        ops::attention_backward(g.q, g.k, g.v, gout, gdout, glse, gg.q, gg.k, gg.v, opt);
        std::vector<double> qb, kb, vb;
        place(qb, hg.q_store, hg.q, ab.dq);
        place(c.fused ? qb : kb, c.fused ? hg.q_store : hg.k_store, hg.k, ab.dk);
        place(c.fused ? qb : vb, c.fused ? hg.q_store : hg.v_store, hg.v, ab.dv);
        require_within(gg.q_store, hg.q_store, stored_as(t, qb, hg.q_store),
                       c.fused ? "dq dk dv" : "dq");
        if (!c.fused) {
          require_within(gg.k_store, hg.k_store, stored_as(t, kb, hg.k_store), "dk");
          require_within(gg.v_store, hg.v_store, stored_as(t, vb, hg.v_store), "dv");
        }
      }
    }
  }
}

TEST_CASE("cuda 16-bit ops reject statistics of another 16-bit dtype", "[gpu]") {
  TROUPE_NEED_GPU();
  owned_tensor q = zeros({1, 2, 1, 8}, dtype::bf16, device::cuda());
  owned_tensor out = zeros({1, 2, 1, 8}, dtype::bf16, device::cuda());
  owned_tensor lse = zeros({1, 1, 2}, dtype::f16, device::cuda());
  REQUIRE_THROWS_WITH(ops::attention(q, q, q, out, lse), Catch::Contains("attention: lse"));
  owned_tensor x = zeros({2, 8}, dtype::f16, device::cuda());
  owned_tensor w = zeros({8}, dtype::f16, device::cuda());
  owned_tensor rstd = zeros({2}, dtype::bf16, device::cuda());
  REQUIRE_THROWS_WITH(ops::rmsnorm(x, w, x, rstd, 1e-6), Catch::Contains("rmsnorm: rstd"));
}
