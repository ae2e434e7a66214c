// Bounds on |device - host| for the layer kernels of tensor/cuda (included by cuda_layers.test.cpp
// and cuda_16bit.test.cpp): per element, both sides' worst-case rounding for the kernels'
// structure (issue 21, docs/adr/0003-tolerances-from-an-f64-reference.md).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "tensor/cuda/test_util.hpp"

namespace troupe::cuda_test {

// ---- bounds on |device - host| for the layer kernels ----------------------------------------
// cuda_layers.test.cpp and cuda_16bit.test.cpp run each op on the device and on the host on the
// same f32 values. Each helper below returns, per element, the sum of both sides' worst-case
// rounding error against the exact result on those inputs, first order in u and valid for any
// summation order the kernel's structure allows (a sum of n terms, in any order or tree, errs by
// at most (n - 1) u sum |terms|; a tree with zeros at some leaves by fewer), times second_order
// for the terms of order u^2 (relative size below (n u)^2 / 2 < 1e-8 here). Magnitudes come
// from f64 loops over the inputs (their own error is ~1e-16 relative).
//
// The device (tensor/cuda/*.cu, built without --use_fast_math: IEEE division and sqrtf; FMA
// contraction only fuses roundings away): a row reduction is block_sum over 256 threads, each
// adding ceil(n / 256) values in sequence, then two 5-level shuffle trees. Its expf and logf are
// within 2 and 1 ulps of the correctly rounded result (CUDA Math API), so within 2.5 and 1.5 ulps
// of the exact one: 5 u and 3 u relative (one ulp is at most 2 u times the value).
// The host (tensor/cpu/*.cpp): row statistics are f64 sums (n 2^-53 of their magnitude in any
// order) rounded once to f32; softmax and cross_entropy take exp_fast (1.01 ulp: 3 u) and add the
// exps in f32 lanes of at most 32 terms (31 roundings) before f64.
inline constexpr double u64 = 0x1p-53;
inline constexpr double second_order = 2;
inline constexpr double dev_exp_u = 5, dev_log_u = 3, host_exp_u = 3;
// Roundings on the longest path of a device block_sum of n values (row_threads = 256).
inline double block_sum_depth(std::int64_t n) {
  return static_cast<double>((n + 255) / 256) + 10;
}

// The f32 bound of an output stored in t: a 16-bit output also carries its one rounding to
// nearest, half a 16-bit ulp of the value (at most |want| + bound) plus half f16's subnormal
// spacing (2^-25).
inline std::vector<double> stored_as(dtype t, std::vector<double> bound, const tensor& want) {
  if (t == dtype::f32) return bound;
  const std::vector<double> w = values(want);
  for (std::size_t i = 0; i < bound.size(); ++i)
    bound[i] += 0.5 * ulp16(t) * (std::abs(w[i]) + bound[i]) + (t == dtype::f16 ? 0x1p-25 : 0);
  return bound;
}

// softmax over rows of n = cols: y = exp(x - m) / S with S = sum exp(x - m), p = y, d = x - m.
// Each exp errs by u |d| (the rounded difference) plus the exp's own error; S by the mean of that
// over the row, P = sum p |d|, plus its sum (device: block_sum; host: the f32 lanes and f64);
// then 1 / S and the product round once each (host: f64 division, f32 cast, product).
inline std::vector<double> softmax_bound(const tensor& x) {
  const std::vector<double> xv = values(x);
  const std::int64_t cols = x.size(-1), rows = x.numel() / cols;
  std::vector<double> b(xv.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    const double* xr = &xv[r * cols];
    double m = -INFINITY, s = 0, sp = 0;
    for (std::int64_t c = 0; c < cols; ++c) m = std::max(m, xr[c]);
    for (std::int64_t c = 0; c < cols; ++c) s += std::exp(xr[c] - m);
    for (std::int64_t c = 0; c < cols; ++c) sp += std::exp(xr[c] - m) / s * (m - xr[c]);
    const double rel_s_dev = u32 * (sp + dev_exp_u + block_sum_depth(cols));
    const double rel_s_host = u32 * (sp + host_exp_u + 32) + cols * u64;
    for (std::int64_t c = 0; c < cols; ++c) {
      const double d = m - xr[c], y = std::exp(-d) / s;
      const double dev = u32 * (d + dev_exp_u + 2) + rel_s_dev;
      const double host = u32 * (d + host_exp_u + 2) + u64 + rel_s_host;
      b[r * cols + c] = second_order * y * (dev + host);
    }
  }
  return b;
}

// softmax_backward from the same y: dx = y (dy - s), s = sum y dy. Device: each product rounds,
// then block_sum; host: exact products summed in f64, s cast to f32. Then the difference and the
// product round once on each side.
inline std::vector<double> softmax_backward_bound(const tensor& y, const tensor& dy) {
  const std::vector<double> yv = values(y), gv = values(dy);
  const std::int64_t cols = y.size(-1), rows = y.numel() / cols;
  std::vector<double> b(yv.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    double s = 0, mag = 0;
    for (std::int64_t c = 0; c < cols; ++c) {
      s += yv[r * cols + c] * gv[r * cols + c];
      mag += std::abs(yv[r * cols + c] * gv[r * cols + c]);
    }
    const double ds_dev = (block_sum_depth(cols) + 1) * u32 * mag;
    const double ds_host = cols * u64 * mag + u32 * std::abs(s);
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::size_t i = static_cast<std::size_t>(r * cols + c);
      const double inner = std::abs(gv[i] - s);
      b[i] = second_order * std::abs(yv[i]) * (ds_dev + ds_host + 4 * u32 * inner);
    }
  }
  return b;
}

// The norms over rows of n = cols with A = sum |x| / n. Device (norms.cu): the mean errs by
// G u A (block_sum, G = block_sum_depth(n)) + 2 u |mean| (1/n and the product); the variance's
// terms (x - mean)^2 by 3 u each (the mean's error cancels to first order: sum (x - mean) = 0;
// its square enters as d_mean^2), then G u, 1/n, + eps, sqrtf and 1/ a u each, so rstd by half
// the variance's relative error + 2 u. Host (norms.cpp): f64 sums (n 2^-53), one f32 rounding
// of mean and of rstd. y = (x - mean) rstd w + b rounds 4 times on each side.
struct norm_bounds {
  std::vector<double> y, mean, rstd;
};
inline norm_bounds layernorm_bound(const tensor& x, const tensor& w, const tensor& b, double eps) {
  const std::vector<double> xv = values(x), wv = values(w);
  const std::vector<double> bv = b.defined() ? values(b) : std::vector<double>(wv.size(), 0.0);
  const std::int64_t cols = x.size(-1), rows = x.numel() / cols;
  const double n = static_cast<double>(cols), G = block_sum_depth(cols);
  norm_bounds r{std::vector<double>(xv.size()), std::vector<double>(rows),
                std::vector<double>(rows)};
  for (std::int64_t k = 0; k < rows; ++k) {
    const double* xr = &xv[k * cols];
    double mu = 0, a = 0, var = 0;
    for (std::int64_t c = 0; c < cols; ++c) mu += xr[c] / n, a += std::abs(xr[c]) / n;
    for (std::int64_t c = 0; c < cols; ++c) var += (xr[c] - mu) * (xr[c] - mu) / n;
    const double rs = 1 / std::sqrt(var + eps);
    const double dmu_dev = u32 * (G * a + 2 * std::abs(mu));
    const double dmu_host = u32 * std::abs(mu) + (n + 1) * u64 * a;
    const double rel_dev =
        0.5 * (u32 * ((G + 5) * var + (var + eps)) + dmu_dev * dmu_dev) / (var + eps) + 2 * u32;
    const double rel_host = u32 + (n + 4) * u64;
    r.mean[k] = second_order * (dmu_dev + dmu_host);
    r.rstd[k] = second_order * rs * (rel_dev + rel_host);
    for (std::int64_t c = 0; c < cols; ++c) {
      const double d = std::abs(xr[c] - mu), aw = std::abs(wv[c]);
      const double y = std::abs((xr[c] - mu) * rs * wv[c] + bv[c]);
      r.y[k * cols + c] =
          second_order *
          (aw * rs * (d * (rel_dev + rel_host + 6 * u32) + dmu_dev + dmu_host) + 2 * u32 * y);
    }
  }
  return r;
}

// rmsnorm: the device's sum of squares errs by (G + 1) u of itself, then 1/n, + eps, sqrtf and 1/
// (rstd: half that + 2 u); the host's by f64 sums and one f32 rounding; y = x rstd w rounds twice.
inline norm_bounds rmsnorm_bound(const tensor& x, const tensor& w, double eps) {
  const std::vector<double> xv = values(x), wv = values(w);
  const std::int64_t cols = x.size(-1), rows = x.numel() / cols;
  const double n = static_cast<double>(cols), G = block_sum_depth(cols);
  norm_bounds r{std::vector<double>(xv.size()), {}, std::vector<double>(rows)};
  for (std::int64_t k = 0; k < rows; ++k) {
    double ms = 0;
    for (std::int64_t c = 0; c < cols; ++c) ms += xv[k * cols + c] * xv[k * cols + c] / n;
    const double rs = 1 / std::sqrt(ms + eps);
    const double rel = 0.5 * (G + 4) * u32 + 2 * u32 + u32 + (n + 4) * u64;
    r.rstd[k] = second_order * rs * rel;
    for (std::int64_t c = 0; c < cols; ++c)
      r.y[k * cols + c] = second_order * std::abs(xv[k * cols + c] * rs * wv[c]) * (rel + 4 * u32);
  }
  return r;
}

// The weight (and bias) gradients of the norms, from the statistics both sides use: dw += sum_r
// dy xhat, db += sum_r dy over the R rows. Each term dy ((x - mean) rstd) rounds 3 times on either
// side; the device adds them in f32 (a thread per 8th row, then 8 partials: ceil(R / 8) + 8
// roundings), the host in f64 then one f32 rounding; each side rounds old + sum once.
struct param_bounds {
  std::vector<double> dw, db;
};
inline param_bounds norm_param_bound(const tensor& dy, const tensor& x, const tensor& mean,
                                     const tensor& rstd, const tensor& dw_old,
                                     const tensor& db_old) {
  const std::vector<double> gv = values(dy), xv = values(x), rv = values(rstd);
  const std::vector<double> mv =
      mean.defined() ? values(mean) : std::vector<double>(rv.size(), 0.0);
  const std::vector<double> wo = values(dw_old);
  const std::vector<double> bo = db_old.defined() ? values(db_old) : wo;
  const std::int64_t cols = x.size(-1), rows = x.numel() / cols;
  const double depth = static_cast<double>((rows + 7) / 8) + 8;
  param_bounds r{std::vector<double>(cols), std::vector<double>(cols)};
  for (std::int64_t c = 0; c < cols; ++c) {
    double sw = 0, aw = 0, sb = 0, ab = 0;
    for (std::int64_t k = 0; k < rows; ++k) {
      const double g = gv[k * cols + c], xh = (xv[k * cols + c] - mv[k]) * rv[k];
      sw += g * xh, aw += std::abs(g * xh), sb += g, ab += std::abs(g);
    }
    r.dw[c] = second_order * ((6 + depth) * u32 * aw + rows * u64 * aw + u32 * std::abs(sw) +
                              2 * u32 * std::abs(wo[c] + sw));
    r.db[c] = second_order * (depth * u32 * ab + rows * u64 * ab + u32 * std::abs(sb) +
                              2 * u32 * std::abs(bo[c] + sb));
  }
  return r;
}

// layernorm_backward's dx from the statistics both sides use: with g = dy w and xhat, a = mean(g),
// c = mean(g xhat), dx = rstd (g - a - xhat c). Device: a's terms round once, c's 4 times, then
// block_sum and 1/n and the product; host: the same terms in f64 sums, one f32 rounding each.
// Then g, xhat (2), xhat c, the two differences and the product by rstd round on each side.
// rmsnorm (mean undefined): xhat = x rstd, dx = rstd (g - xhat c); the device forms
// x rstd rstd mean(g x) (its terms round twice), the host x rstd mean(g x rstd) (three times).
inline std::vector<double> norm_dx_bound(const tensor& dy, const tensor& x, const tensor& w,
                                         const tensor& mean, const tensor& rstd) {
  const std::vector<double> gv = values(dy), xv = values(x), wv = values(w), rv = values(rstd);
  const bool ln = mean.defined();
  const std::vector<double> mv = ln ? values(mean) : std::vector<double>(rv.size(), 0.0);
  const std::int64_t cols = x.size(-1), rows = x.numel() / cols;
  const double n = static_cast<double>(cols), G = block_sum_depth(cols);
  std::vector<double> b(xv.size());
  for (std::int64_t k = 0; k < rows; ++k) {
    const double rs = rv[k];
    double a = 0, ma = 0, c = 0, mc = 0;
    for (std::int64_t j = 0; j < cols; ++j) {
      const double g = gv[k * cols + j] * wv[j], xh = (xv[k * cols + j] - mv[k]) * rs;
      if (ln) a += g / n, ma += std::abs(g) / n;
      c += g * xh / n, mc += std::abs(g * xh) / n;
    }
    const double da = ln ? (G + 1) * u32 * ma + 2 * u32 * std::abs(a) + (u32 + n * u64) * ma +
                               2 * u32 * std::abs(a)
                         : 0.0;
    const double dc = (G + 4) * u32 * mc + 2 * u32 * std::abs(c) + (4 * u32 + n * u64) * mc +
                      2 * u32 * std::abs(c);
    for (std::int64_t j = 0; j < cols; ++j) {
      const double g = gv[k * cols + j] * wv[j], xh = (xv[k * cols + j] - mv[k]) * rs;
      const double inner = g - a - xh * c;
      b[k * cols + j] =
          second_order *
          (rs * (2 * u32 * std::abs(g) + da + 2 * u32 * std::abs(g - a) + std::abs(xh) * dc +
                 8 * u32 * std::abs(xh * c) + 2 * u32 * std::abs(inner)) +
           2 * u32 * std::abs(rs * inner));
    }
  }
  return b;
}

// cross_entropy over rows of V logits, targets t (rows with t == ignore: loss and gradient exactly
// 0 on both sides), grad_scale gs. With m the row max, d = x - m, p = softmax, P = sum p |d|:
// S = sum exp(d) errs relatively as in softmax_bound. Device: lse = m + logf(S) (logf: 3 u of
// ln S), the sum and lse - x_t round once each; dl = (expf(x - lse) - [c == t]) gs: x - lse
// carries lse's error and rounds, expf, the subtraction, float(gs) and the product. Host: the
// loss in f64 from S, one f32 rounding; dl = exp_fast(d) * float(gs / S), minus float(gs) at t.
struct loss_bounds {
  std::vector<double> losses, dlogits;
};
inline loss_bounds cross_entropy_bound(const tensor& logits, const std::vector<std::int64_t>& tgt,
                                       std::int64_t ignore, double gs) {
  const std::vector<double> xv = values(logits);
  const std::int64_t cols = logits.size(-1), rows = logits.numel() / cols;
  const double n = static_cast<double>(cols);
  loss_bounds r{std::vector<double>(rows, 0.0), std::vector<double>(xv.size(), 0.0)};
  for (std::int64_t k = 0; k < rows; ++k) {
    if (tgt[k] == ignore) continue;
    const double* xr = &xv[k * cols];
    double m = -INFINITY, s = 0, sp = 0;
    for (std::int64_t c = 0; c < cols; ++c) m = std::max(m, xr[c]);
    for (std::int64_t c = 0; c < cols; ++c) s += std::exp(xr[c] - m);
    for (std::int64_t c = 0; c < cols; ++c) sp += std::exp(xr[c] - m) / s * (m - xr[c]);
    const double lse = m + std::log(s), loss = std::abs(lse - xr[tgt[k]]);
    const double rel_s_dev = u32 * (sp + dev_exp_u + block_sum_depth(cols));
    const double rel_s_host = u32 * (sp + host_exp_u + 32) + n * u64;
    const double dlse_dev = rel_s_dev + dev_log_u * u32 * std::log(s) + u32 * std::abs(lse);
    const double dloss_dev = dlse_dev + u32 * loss;
    const double dloss_host =
        rel_s_host + 4 * u64 * (std::abs(lse) + std::abs(m) + loss + 1) + u32 * loss;
    r.losses[k] = second_order * (dloss_dev + dloss_host);
    for (std::int64_t c = 0; c < cols; ++c) {
      const double p = std::exp(xr[c] - lse), d = m - xr[c], one = c == tgt[k] ? 1.0 : 0.0;
      const double dev = p * (dlse_dev + u32 * std::abs(xr[c] - lse) + dev_exp_u * u32) +
                         3 * u32 * std::abs(p - one);
      const double host =
          p * (u32 * (d + host_exp_u + 2) + u64 + rel_s_host) + one * u32 * (1 + std::abs(p - one));
      r.dlogits[k * cols + c] = second_order * gs * (dev + host);
    }
  }
  return r;
}

// embedding_backward onto a table: an element named by k ids gets old + k dout values. f32: both
// sides add them in f32 one at a time (device: atomicAdd, any order): k roundings each. 16-bit
// (the device sums the k values in f32, adds the old value in f32 and rounds once to 16 bits;
// stored_as adds that last rounding): still at most k f32 roundings.
inline std::vector<double> embedding_backward_bound(const std::vector<std::int64_t>& ids,
                                                    const tensor& dout, const tensor& old) {
  const std::vector<double> dv = values(dout), ov = values(old);
  const std::int64_t cols = old.size(1);
  std::vector<double> mag(ov.size(), 0.0), count(ov.size() / cols, 0.0), b(ov.size());
  for (std::size_t p = 0; p < ids.size(); ++p) {
    count[ids[p]] += 1;
    for (std::int64_t c = 0; c < cols; ++c) mag[ids[p] * cols + c] += std::abs(dv[p * cols + c]);
  }
  for (std::size_t i = 0; i < b.size(); ++i)
    b[i] = second_order * 2 * count[i / cols] * u32 * (mag[i] + std::abs(ov[i]));
  return b;
}

// rope on [B, T, H, D] views with the same tables on both sides: each output is x1 c -/+ x2 s,
// two products and a sum, rounded 3 times (fewer with FMA) on each side. Returned in the layout of
// `store`, which x views (0 outside the view: elements not rotated are left as they were).
inline std::vector<double> rope_bound(const tensor& store, const tensor& x, const tensor& cos,
                                      const tensor& sin) {
  const std::vector<double> sv = values(store), cv = values(cos), nv = values(sin);
  const std::int64_t half = x.size(3) / 2;
  const std::int64_t base =
      (static_cast<const char*>(x.data()) - static_cast<const char*>(store.data())) /
      static_cast<std::int64_t>(x.element_size());
  std::vector<double> b(sv.size(), 0.0);
  for (std::int64_t bi = 0; bi < x.size(0); ++bi)
    for (std::int64_t t = 0; t < x.size(1); ++t)
      for (std::int64_t h = 0; h < x.size(2); ++h)
        for (std::int64_t i = 0; i < half; ++i) {
          const std::int64_t o = base + bi * x.stride(0) + t * x.stride(1) + h * x.stride(2) + i;
          const double x1 = std::abs(sv[o]), x2 = std::abs(sv[o + half]);
          const double c = std::abs(cv[t * half + i]), s = std::abs(nv[t * half + i]);
          b[o] = second_order * 2 * 2 * u32 * (x1 * c + x2 * s);
          b[o + half] = second_order * 2 * 2 * u32 * (x2 * c + x1 * s);
        }
  return b;
}

// The f32 values a rope table element can take on the device, given that the host and the device
// follow the same f32 steps (rope.cu, rope.cpp) and differ only in their f64 pow and cos / sin:
// glibc's within 1 ulp, CUDA's within 2.5 (CUDA Math API: 2 from the correctly rounded result),
// so the device's f64 value lies within 3.5 f64 ulps (< 2^-49 relative) of the host's. Rounding
// to f32 is monotonic, so the device's f32 lies between the roundings of the window's ends:
// equal to the host's except where an f32 rounding boundary falls inside the window.
struct table_range {
  std::vector<float> cos_lo, cos_hi, sin_lo, sin_hi;  // [rows, half]
};
inline table_range rope_table_range(std::int64_t start, double theta, std::int64_t rows,
                                    std::int64_t half) {
  constexpr double w = 0x1p-49;
  auto lo = [](double v) { return static_cast<float>(v - std::abs(v) * w); };
  auto hi = [](double v) { return static_cast<float>(v + std::abs(v) * w); };
  table_range r;
  for (std::int64_t t = 0; t < rows; ++t)
    for (std::int64_t i = 0; i < half; ++i) {
      const float expo = static_cast<float>(2 * i) / static_cast<float>(2 * half);
      const double p = std::pow(static_cast<double>(static_cast<float>(theta)), double(expo));
      float clo = INFINITY, chi = -INFINITY, slo = INFINITY, shi = -INFINITY;
      for (float base_pow : {lo(p), hi(p)}) {
        const float inv_freq = 1.0f / base_pow;
        const double angle = static_cast<double>(static_cast<float>(start + t) * inv_freq);
        clo = std::min(clo, lo(std::cos(angle))), chi = std::max(chi, hi(std::cos(angle)));
        slo = std::min(slo, lo(std::sin(angle))), shi = std::max(shi, hi(std::sin(angle)));
      }
      r.cos_lo.push_back(clo), r.cos_hi.push_back(chi);
      r.sin_lo.push_back(slo), r.sin_hi.push_back(shi);
    }
  return r;
}
// Per element, the largest distance from want (the host's table, f32 values) to a value the
// device can produce in [lo, hi], rounded to t (monotonic, so the ends suffice).
inline std::vector<double> range_bound(const std::vector<float>& lo, const std::vector<float>& hi,
                                       const tensor& want, dtype t) {
  const std::vector<double> w = values(want);
  auto r = [t](float v) {
    if (t == dtype::bf16) return static_cast<double>(bf16_bits_to_f32(f32_to_bf16_bits(v)));
    if (t == dtype::f16) return static_cast<double>(f16_bits_to_f32(f32_to_f16_bits(v)));
    return static_cast<double>(v);
  };
  std::vector<double> b(w.size());
  for (std::size_t i = 0; i < w.size(); ++i)
    b[i] = std::max(std::abs(r(lo[i]) - w[i]), std::abs(r(hi[i]) - w[i]));
  return b;
}

// Attention's bounds. Per side, the first-order bound of the CPU attention test
// (tensor/cpu/attention.test.cpp, naive<float>): scores err by (D + 3) u of sum |scale q k|, each
// exp by u |s - max| per rescale and c_exp u, the running sums and the output are rescaled once per
// tile of keys and add n terms; the backward recomputes P from the stored lse and forms
// rowsum(dO * O) from the stored out, whose errors enter. The host takes tiles of 64 keys and an
// exp good to 4 u, lse = m + log(l) in f64; the device (attention.cu) tiles of 32, expf (5 u) and
// logf (3 u of ln l). shared: both backwards read the device's out and lse, rounded to out_type and
// lse_type (the 16-bit test); else each side reads its own forward's.
struct attention_bounds {
  std::vector<double> out, lse, dq, dk, dv;  // [B, T, Hq, D], [B, Hq, T], [B, S, Hkv, D]
};
inline attention_bounds attention_bound(const tensor& q, const tensor& k, const tensor& v,
                                        const tensor& dout, bool causal, double scale, bool shared,
                                        dtype out_type, dtype lse_type) {
  const std::int64_t B = q.size(0), T = q.size(1), Hq = q.size(2), D = q.size(3);
  const std::int64_t S = k.size(1), Hkv = k.size(2), group = Hq / Hkv, off = S - T;
  if (scale == 0) scale = 1 / std::sqrt(static_cast<double>(D));
  auto at = [](const tensor& x, std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t d) {
    return static_cast<double>(
        x.data_as<float>()[b * x.stride(0) + t * x.stride(1) + h * x.stride(2) + d * x.stride(3)]);
  };
  struct side {
    double tile, c_exp, log_u;
  };
  const side sides[2] = {{64, 4, 0}, {32, dev_exp_u, dev_log_u}};  // host, device
  const double u = u32, nk = static_cast<double>(group * T);
  const double o_rel = out_type == dtype::f32 ? 0 : 0.5 * ulp16(out_type);
  const double o_abs = out_type == dtype::f16 ? 0x1p-25 : 0;
  const double l_rel = lse_type == dtype::f32 ? 0 : 0.5 * ulp16(lse_type);
  attention_bounds r;
  r.out.assign(B * T * Hq * D, 0.0);
  r.dq = r.out;
  r.lse.assign(B * Hq * T, 0.0);
  r.dk.assign(B * S * Hkv * D, 0.0);
  r.dv = r.dk;
  auto qi = [&](std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t d) {
    return ((b * T + t) * Hq + h) * D + d;
  };
  auto ki = [&](std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d) {
    return ((b * S + s) * Hkv + h) * D + d;
  };
  std::vector<double> score(S), mag(S), prob(S), o(D), mo(D), eo[2] = {o, o};
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < Hq; ++h) {
      const std::int64_t hk = h / group;
      for (std::int64_t i = 0; i < T; ++i) {
        const std::int64_t n = causal ? std::min(S, i + off + 1) : S;
        double mx = -INFINITY;
        for (std::int64_t j = 0; j < n; ++j) {
          double sc = 0, a = 0;
          for (std::int64_t d = 0; d < D; ++d) {
            sc += at(q, b, i, h, d) * at(k, b, j, hk, d);
            a += std::abs(at(q, b, i, h, d) * at(k, b, j, hk, d));
          }
          score[j] = sc * scale, mag[j] = a * scale, mx = std::max(mx, score[j]);
        }
        double sum = 0;
        for (std::int64_t j = 0; j < n; ++j) sum += std::exp(score[j] - mx);
        const double lse = mx + std::log(sum);
        for (std::int64_t j = 0; j < n; ++j) prob[j] = std::exp(score[j] - lse);
        for (std::int64_t d = 0; d < D; ++d) {
          o[d] = mo[d] = 0;
          for (std::int64_t j = 0; j < n; ++j) {
            o[d] += prob[j] * at(v, b, j, hk, d);
            mo[d] += prob[j] * std::abs(at(v, b, j, hk, d));
          }
        }
        double el[2];
        for (int sd = 0; sd < 2; ++sd) {
          const side& x = sides[sd];
          const double tiles = std::ceil(static_cast<double>(n) / x.tile);
          double dp_max = 0;
          for (std::int64_t j = 0; j < n; ++j)
            dp_max =
                std::max(dp_max, (D + 3) * u * mag[j] + (tiles + 2) * u * std::abs(score[j] - mx) +
                                     u * std::abs(mx));
          const double dw = 2 * dp_max + ((tiles + 2) * x.c_exp + n + 4) * u;
          el[sd] = dp_max + ((tiles + 1) * x.c_exp + n + 2) * u + u * std::abs(lse) +
                   x.log_u * u * std::log(sum);
          for (std::int64_t d = 0; d < D; ++d) eo[sd][d] = (dw + (n + 2 * tiles + 2) * u) * mo[d];
        }
        r.lse[(b * Hq + h) * T + i] = second_order * (el[0] + el[1]);
        for (std::int64_t d = 0; d < D; ++d)
          r.out[qi(b, i, h, d)] = second_order * (eo[0][d] + eo[1][d]);
        // Backward: the errors of the out and lse each side reads.
        double di = 0, adi = 0, di_err[2] = {0, 0}, el_in[2];
        for (std::int64_t d = 0; d < D; ++d) {
          const double g = at(dout, b, i, h, d);
          di += g * o[d], adi += std::abs(g * o[d]);
          for (int sd = 0; sd < 2; ++sd)
            di_err[sd] +=
                std::abs(g) * (shared ? eo[1][d] + o_rel * std::abs(o[d]) + o_abs : eo[sd][d]);
        }
        for (int sd = 0; sd < 2; ++sd) {
          di_err[sd] += (D + 1) * u * adi;
          el_in[sd] = shared ? el[1] + l_rel * std::abs(lse) : el[sd];
        }
        for (std::int64_t j = 0; j < n; ++j) {
          double dp = 0, adp = 0;
          for (std::int64_t d = 0; d < D; ++d) {
            dp += at(dout, b, i, h, d) * at(v, b, j, hk, d);
            adp += std::abs(at(dout, b, i, h, d) * at(v, b, j, hk, d));
          }
          const double ds = std::abs(prob[j] * (dp - di));
          for (int sd = 0; sd < 2; ++sd) {
            const double rho = (D + 3) * u * mag[j] + el_in[sd] +
                               u * (std::abs(score[j] - lse) + 2 * std::abs(lse)) +
                               sides[sd].c_exp * u;
            const double ds_err = (rho + 2 * u) * ds + prob[j] * ((D + 1) * u * adp + di_err[sd] +
                                                                  u * std::abs(dp - di));
            for (std::int64_t d = 0; d < D; ++d) {
              const double qv = std::abs(at(q, b, i, h, d)), kv = std::abs(at(k, b, j, hk, d));
              const double g = std::abs(at(dout, b, i, h, d));
              r.dv[ki(b, j, hk, d)] += second_order * (rho + (nk + 2) * u) * prob[j] * g;
              r.dk[ki(b, j, hk, d)] += second_order * scale * (ds_err + (nk + 3) * u * ds) * qv;
              r.dq[qi(b, i, h, d)] += second_order * scale * (ds_err + (n + 3) * u * ds) * kv;
            }
          }
        }
      }
    }
  return r;
}

// Writes bounds given in the logical [B, L, H, D] order of view (a view of store's buffer) into a
// vector laid out like store.
inline void place(std::vector<double>& into, const tensor& store, const tensor& view,
                  const std::vector<double>& logical) {
  into.resize(static_cast<std::size_t>(store.numel()), 0.0);
  const std::int64_t base =
      (static_cast<const char*>(view.data()) - static_cast<const char*>(store.data())) /
      static_cast<std::int64_t>(view.element_size());
  std::size_t i = 0;
  for (std::int64_t b = 0; b < view.size(0); ++b)
    for (std::int64_t t = 0; t < view.size(1); ++t)
      for (std::int64_t h = 0; h < view.size(2); ++h)
        for (std::int64_t d = 0; d < view.size(3); ++d)
          into[base + b * view.stride(0) + t * view.stride(1) + h * view.stride(2) +
               d * view.stride(3)] = logical[i++];
}

}  // namespace troupe::cuda_test
