// Tests of the CUDA backend, part 2: softmax and the norms, rope, embedding, cross-entropy and
// attention, each against the CPU backend on the same inputs. All [gpu]: skipped without a GPU.
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

owned_tensor gpu_empty(const shape& s, dtype t = dtype::f32) {
  return empty(s, t, device::cuda());
}

}  // namespace

TEST_CASE("cuda softmax layernorm and rmsnorm match the cpu", "[gpu]") {
  TROUPE_NEED_GPU();
  for (shape s : {shape{3, 5, 67}, shape{2, 3001}}) {
    INFO("shape " << s.str());
    const std::int64_t rows = s.numel() / s[s.rank() - 1], cols = s[s.rank() - 1];
    owned_tensor x = random(s, 1, -3, 3), dy = random(s, 2);
    owned_tensor gx = gpu(x), gdy = gpu(dy);
    owned_tensor y = empty(s), dx = empty(s), gy = gpu_empty(s), gdx = gpu_empty(s);

    // Each bound: both sides' rounding for the kernels' structure (test_bounds.hpp, per helper),
    // per element from the inputs. The backwards on the host read the device's saved y, mean
    // and rstd, so both sides compute from the same values.
    ops::softmax(x, y);
    ops::softmax(gx, gy);
    require_within(gy, y, softmax_bound(x), "softmax");
    owned_tensor hy = host(gy);
    ops::softmax_backward(hy, dy, dx);
    ops::softmax_backward(gy, gdy, gdx);
    require_within(gdx, dx, softmax_backward_bound(hy, dy), "softmax_backward");

    owned_tensor w = random({cols}, 3, 0.5f, 1.5f), b = random({cols}, 4);
    owned_tensor gw = gpu(w), gb = gpu(b);
    owned_tensor mean = empty({rows}), rstd = empty({rows});
    owned_tensor gmean = gpu_empty({rows}), grstd = gpu_empty({rows});
    for (bool bias : {true, false}) {
      INFO("bias " << bias);
      ops::layernorm(x, w, bias ? b.view() : tensor(), y, mean, rstd, 1e-5);
      ops::layernorm(gx, gw, bias ? gb.view() : tensor(), gy, gmean, grstd, 1e-5);
      const norm_bounds nb = layernorm_bound(x, w, bias ? b.view() : tensor(), 1e-5);
      require_within(gy, y, nb.y, "layernorm y");
      require_within(gmean, mean, nb.mean, "layernorm mean");
      require_within(grstd, rstd, nb.rstd, "layernorm rstd");
      // dw and db accumulate onto what is there
      owned_tensor dw = random({cols}, 5), db = random({cols}, 6);
      owned_tensor gdw = gpu(dw), gdb = gpu(db);
      owned_tensor hmean = host(gmean), hrstd = host(grstd);
      const param_bounds pb = norm_param_bound(dy, x, hmean, hrstd, dw, db);
      ops::layernorm_backward(dy, x, w, hmean, hrstd, dx, dw, bias ? db.view() : tensor());
      ops::layernorm_backward(gdy, gx, gw, gmean, grstd, gdx, gdw, bias ? gdb.view() : tensor());
      require_within(gdx, dx, norm_dx_bound(dy, x, w, hmean, hrstd), "layernorm dx");
      require_within(gdw, dw, pb.dw, "layernorm dw");
      require_within(gdb, db, pb.db, "layernorm db");
    }

    ops::rmsnorm(x, w, y, rstd, 1e-6);
    ops::rmsnorm(gx, gw, gy, grstd, 1e-6);
    const norm_bounds nb = rmsnorm_bound(x, w, 1e-6);
    require_within(gy, y, nb.y, "rmsnorm y");
    require_within(grstd, rstd, nb.rstd, "rmsnorm rstd");
    owned_tensor dw = random({cols}, 7), gdw = gpu(dw);
    owned_tensor hrstd = host(grstd);
    const std::vector<double> dx_bound = norm_dx_bound(dy, x, w, tensor(), hrstd);
    const std::vector<double> dw_bound = norm_param_bound(dy, x, tensor(), hrstd, dw, tensor()).dw;
    ops::rmsnorm_backward(dy, x, w, hrstd, dx, dw);
    ops::rmsnorm_backward(gdy, gx, gw, grstd, gdx, gdw);
    require_within(gdx, dx, dx_bound, "rmsnorm dx");
    require_within(gdw, dw, dw_bound, "rmsnorm dw");

    // dx may alias dy: the same computation, so the same bound
    ops::rmsnorm_backward(gdy, gx, gw, grstd, gdy, gdw);
    require_within(gdy, dx, dx_bound, "rmsnorm dx in place");
  }
}

// llama3 scaling (tensor/rope_frequency.hpp): the device runs the CPU's code for the frequency.
// Both sides take the same f32 steps; the f64 pow and cos / sin differ by ulps (u once rounded to
// f32), and nvcc may fuse the smoothing's multiply-adds: L / w - low (L / w <= high = 4) then
// moves by up to 4 u, the weight s by that over high - low = 3, and the result (at least
// inv / factor) by s's change times factor 8, about 11 u of the frequency; one u more for the
// fused final sum. The angles differ by at most angle * 32 u, cos and sin by that plus their own
// rounding on each side.
TEST_CASE("cuda rope tables with llama3 scaling match the cpu", "[gpu]") {
  TROUPE_NEED_GPU();
  const std::int64_t T = 40, D = 128, start = 2000;
  const ops::rope_options o{.theta = 500000.0,
                            .type = ops::rope_options::scaling::llama3,
                            .factor = 8.0,
                            .low_freq_factor = 1.0,
                            .high_freq_factor = 4.0,
                            .original_max_position = 8192};
  owned_tensor cs = empty({T, D / 2}), sn = empty({T, D / 2});
  owned_tensor gcs = gpu_empty({T, D / 2}), gsn = gpu_empty({T, D / 2});
  ops::rope_tables(start, o, cs, sn);
  ops::rope_tables(start, o, gcs, gsn);
  std::vector<double> bound(static_cast<std::size_t>(T * D / 2));
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t i = 0; i < D / 2; ++i) {
      const double angle = double(start + t) * std::pow(o.theta, -2.0 * double(i) / double(D));
      bound[t * (D / 2) + i] = angle * 32 * u32 + 2 * u32;
    }
  require_within(gcs, cs, bound, "llama3 cos");
  require_within(gsn, sn, bound, "llama3 sin");
}

TEST_CASE("cuda rope matches the cpu on strided views and in place", "[gpu]") {
  TROUPE_NEED_GPU();
  const std::int64_t B = 2, T = 5, H = 3, D = 8, start = 3;
  const double theta = 10000.0;
  owned_tensor cs = empty({T + 2, D / 2}), sn = empty({T + 2, D / 2});
  owned_tensor gcs = gpu_empty({T + 2, D / 2}), gsn = gpu_empty({T + 2, D / 2});
  ops::rope_tables(start, theta, cs, sn);
  ops::rope_tables(start, theta, gcs, gsn);
  // The same f32 steps on both sides; only the f64 pow and cos / sin differ (by ulps): equal
  // unless an f32 rounding boundary lies that close (then one f32 ulp). Was 1e-6 + 1e-6 |want|.
  const table_range tr = rope_table_range(start, theta, T + 2, D / 2);
  require_within(gcs, cs, range_bound(tr.cos_lo, tr.cos_hi, cs, dtype::f32), "cos");
  require_within(gsn, sn, range_bound(tr.sin_lo, tr.sin_hi, sn, dtype::f32), "sin");
  std::vector<double> c = values(gcs);
  for (std::int64_t t = 0; t < T + 2; ++t)
    for (std::int64_t i = 0; i < D / 2; ++i) {  // the definition in ops.hpp, in f64
      // The f32 angle: 2i / D rounds (u), so theta^expo errs by |ln theta| expo u; pow's f32
      // rounding and ulps, 1 / and the product by position add 3 u + 2^-50. cos moves by at most
      // the angle's error, then rounds to f32 (u) after f64 ulps. Looser than the old margin 1e-6
      // (1.7e-6 at position 9, doubled for the second-order terms): the worst case of three f32
      // roundings of the angle.
      const double expo = 2.0 * i / D, angle = (start + t) * std::pow(theta, -expo);
      const double bound =
          second_order * (angle * ((std::log(theta) * expo + 3) * u32 + 0x1p-50) + u32 + 0x1p-50);
      REQUIRE(std::abs(c[t * (D / 2) + i] - std::cos(angle)) <= bound);
    }

  // x: the second third of a fused [B, T, 3H, D] buffer
  owned_tensor buf = random({B, T, 3 * H, D}, 10), gbuf = gpu(buf);
  tensor x = buf.narrow(2, H, H), gx = gbuf.narrow(2, H, H);
  owned_tensor y = empty({B, T, H, D}), gy = gpu_empty({B, T, H, D});
  // The host rotates with the device's tables, so both sides use the same values: 2 products
  // and a sum per output, three roundings on each side (rope_bound). Was 1e-5 |want| + 1e-6.
  owned_tensor hcs = host(gcs), hsn = host(gsn);
  const std::vector<double> x_bound = rope_bound(buf, x, hcs, hsn);
  std::vector<double> y_bound;
  for (std::size_t k = 0; k < x_bound.size(); ++k) {
    const std::size_t head = (k / D) % (3 * H);
    if (head >= static_cast<std::size_t>(H) && head < static_cast<std::size_t>(2 * H))
      y_bound.push_back(x_bound[k]);  // the middle third, in order: y's layout
  }
  for (bool inverse : {false, true}) {
    INFO("inverse " << inverse);
    ops::rope(x, hcs, hsn, y, inverse);
    ops::rope(gx, gcs, gsn, gy, inverse);
    require_within(gy, y, y_bound, "rope");
  }
  ops::rope(x, hcs, hsn, x);
  ops::rope(gx, gcs, gsn, gx);
  require_within(gbuf, buf, x_bound, "rope in place");  // 0 outside the view: bit for bit
  ops::rope(gx, gcs, gsn, gx, true);                    // the inverse undoes the rotation
  // |R(-s) R(s) x - x| <= |c^2 + s^2 - 1| (|x1| + |x2|) for the f32 tables, plus the forward's
  // rounding (3 u (|x1| + |x2|), through a rotation: times |c| + |s|) and the inverse's own
  // (3 u of its inputs' magnitudes). Was 1e-5 |x| + 1e-6.
  owned_tensor orig = random({B, T, 3 * H, D}, 10);
  const std::vector<double> xv = values(orig), cv = values(hcs), sv = values(hsn);
  std::vector<double> rt(xv.size(), 0.0);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t h = H; h < 2 * H; ++h)
        for (std::int64_t i = 0; i < D / 2; ++i) {
          const std::int64_t o = ((b * T + t) * 3 * H + h) * D + i;
          const double cc = cv[t * (D / 2) + i], ss = sv[t * (D / 2) + i];
          const double mag = std::abs(xv[o]) + std::abs(xv[o + D / 2]), fwd = 3 * u32 * mag;
          rt[o] = rt[o + D / 2] =
              second_order * (std::abs(cc * cc + ss * ss - 1) * mag +
                              (std::abs(cc) + std::abs(ss)) * fwd + 3 * u32 * (2 * mag + fwd));
        }
  require_within(gbuf, orig, rt, "rope round trip");
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
    std::vector<std::int64_t> idv;
    for (double id : values(ids)) idv.push_back(static_cast<std::int64_t>(id));
    // k ids naming a row: k f32 additions in another order on each side (rows no id names stay
    // bit for bit). Was 1e-5 |want| + 1e-6.
    const std::vector<double> eb_bound = embedding_backward_bound(idv, dout, dtable);
    ops::embedding_backward(ids, dout, dtable);
    ops::embedding_backward(gids, gpu(dout), gdtable);
    require_within(gdtable, dtable, eb_bound, "embedding_backward");

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
    // logsumexp of 1003 terms (block_sum and f32 lanes), the logs and the last roundings, and the
    // gradient's exps and scalings, per element (cross_entropy_bound); ignored rows bit for bit.
    // Was 1e-5 |loss| + 1e-5 and 1e-4 |dl| + 1e-8.
    std::vector<std::int64_t> tv;
    for (double t : values(targets)) tv.push_back(static_cast<std::int64_t>(t));
    const loss_bounds lb = cross_entropy_bound(logits, tv, ignore, 1.0 / 7);
    require_within(glosses, losses, lb.losses, "losses");
    require_within(gdl, dl, lb.dlogits, "dlogits");
    std::vector<double> gl = values(glosses);
    REQUIRE(gl[2] == 0.0);
    REQUIRE(gl[6] == 0.0);

    // no gradient, then the gradient written over the logits
    owned_tensor glosses2 = gpu_empty({N});
    REQUIRE(ops::cross_entropy(glogits, gtargets, glosses2, tensor(), 1.0 / 7, ignore) == 7);
    require_within(glosses2, losses, lb.losses, "losses without dlogits");
    REQUIRE(ops::cross_entropy(glogits, gtargets, glosses2, glogits, 1.0 / 7, ignore) == 7);
    require_within(glosses2, losses, lb.losses, "losses with aliased dlogits");
    require_within(glogits, dl, lb.dlogits, "aliased dlogits");
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
    // Per element, the CPU attention test's first-order bound for each side's tiles and exp
    // (attention_bound); each backward reads its own side's out and lse. Was 1e-4 |want| + 1e-5:
    // this worst case is looser (n u sum |terms| over 70 keys and 210 queries: up to 2e-3 on
    // dk, 200 times the old bound on small elements); the old one held by typical rounding only.
    owned_tensor dout = random(qshape, 41), gdout = gpu(dout);
    const attention_bounds ab =
        attention_bound(h.q, h.k, h.v, dout, c.causal, c.scale, false, dtype::f32, dtype::f32);
    require_within(gout, out, ab.out, "out");
    require_within(glse, lse, ab.lse, "lse");

    qkv hg = make_qkv(c, 50, device::cpu()), gg = make_qkv(c, 50, device::cuda());  // gradients
    ops::attention_backward(h.q, h.k, h.v, out, dout, lse, hg.q, hg.k, hg.v, opt);
    ops::attention_backward(g.q, g.k, g.v, gout, gdout, glse, gg.q, gg.k, gg.v, opt);
    std::vector<double> qb, kb, vb;
    place(qb, hg.q_store, hg.q, ab.dq);
    place(c.fused ? qb : kb, c.fused ? hg.q_store : hg.k_store, hg.k, ab.dk);
    place(c.fused ? qb : vb, c.fused ? hg.q_store : hg.v_store, hg.v, ab.dv);
    require_within(gg.q_store, hg.q_store, qb, c.fused ? "dq dk dv" : "dq");
    if (!c.fused) {
      require_within(gg.k_store, hg.k_store, kb, "dk");
      require_within(gg.v_store, hg.v_store, vb, "dv");
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
