// plan_checkpoint (see plan_checkpoint.hpp): moments between the ranks' runs and the whole layout.
#include "models/parallel/plan_checkpoint.hpp"

#include <algorithm>
#include <cstring>
#include <exception>
#include <filesystem>
#include <map>
#include <vector>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "memory/error.hpp"
#include "models/parallel/param_slices.hpp"
#include "scheduler/plan.hpp"
#include "tensor/ops.hpp"

namespace troupe::models::parallel {
namespace {

using run_list = std::vector<dp_trainer::optimizer_run>;

// One of the piece's parameters and its whole counterpart.
struct place {
  const tensor_slot* piece = nullptr;
  const whole_param* whole = nullptr;
  std::int64_t piece_at = 0, whole_at = 0;  // offsets in the flat buffers
  bool owned = true;
};

// The piece's parameters, by their offset in the whole layout.
std::vector<place> places_of(const piece_layout& p, const whole_layout& w, const char* what) {
  TROUPE_CHECK(p.slots != nullptr, what, ": the piece's layout has no slot list");
  std::vector<place> out;
  for (const auto& s : p.slots->slots()) {
    if (s.kind != slot_kind::param) continue;
    const whole_param* wp = w.find(s.name);
    TROUPE_CHECK(wp != nullptr, what, ": the whole model has no parameter '", s.name, "'");
    out.push_back({&s, wp, offset_in(*s.field, p.base), wp->offset, !p.owns || p.owns(s)});
  }
  std::sort(out.begin(), out.end(),
            [](const place& a, const place& b) { return a.whole_at < b.whole_at; });
  return out;
}

run_list by_flat(run_list runs) {
  std::sort(runs.begin(), runs.end(), [](const auto& a, const auto& b) { return a.flat < b.flat; });
  return runs;
}

// Between [begin, begin + part.numel()) of the piece's flat buffer (`part`, contiguous f32) and the
// state (laid out by `runs`, sorted by flat): the elements the runs hold.
void copy_runs(const run_list& runs, const tensor& state, std::int64_t begin, const tensor& part,
               bool into_state) {
  const std::int64_t end = begin + part.numel();
  auto r = std::upper_bound(runs.begin(), runs.end(), begin,
                            [](std::int64_t x, const auto& run) { return x < run.flat; });
  if (r != runs.begin()) --r;
  float* s = static_cast<float*>(state.data());
  float* p = static_cast<float*>(part.data());
  for (; r != runs.end() && r->flat < end; ++r) {
    const std::int64_t lo = std::max(begin, r->flat), hi = std::min(end, r->flat + r->length);
    if (lo >= hi) continue;
    float* at_state = s + r->state + (lo - r->flat);
    float* at_part = p + (lo - begin);
    const auto bytes = static_cast<std::size_t>(hi - lo) * sizeof(float);
    if (into_state)
      std::memcpy(at_state, at_part, bytes);
    else
      std::memcpy(at_part, at_state, bytes);
  }
}

tensor view_of(const tensor& flat, std::int64_t at, const whole_param& p) {
  return flat.narrow(0, at, p.numel()).reshape(p.sizes);
}

void check_state(const dp_trainer::optimizer_view& mine, const char* what) {
  TROUPE_CHECK(mine.m.type() == dtype::f32 && mine.v.type() == dtype::f32 &&
                   mine.m.numel() == mine.v.numel(),
               what, ": the optimizer state must be two f32 buffers of one size, got ",
               mine.m.describe(), " and ", mine.v.describe());
}

}  // namespace

void throw_if_any_failed(std::exception_ptr failed, float failures, collective::communicator& dp,
                         collective::communicator& mp, std::string_view what) {
  if (failed) std::rethrow_exception(failed);
  TROUPE_CHECK(failures == 0.0f, what, ": rank ", dp.rank(), " of dp and ", mp.rank(),
               " of mp: ", failures,
               " other rank(s) failed their checks or writes (see their errors)");
}

void agree_on_failure(std::exception_ptr failed, collective::communicator& dp,
                      collective::communicator& mp, std::string_view what) {
  // A sum over dp, then over mp, reaches every rank.
  float failures = failed ? 1.0f : 0.0f;
  collective::options sum;
  sum.op = collective::reduce_op::sum;
  if (dp.size() > 1) dp.allreduce(&failures, 1, dtype::f32, sum).wait();
  if (mp.size() > 1) mp.allreduce(&failures, 1, dtype::f32, sum).wait();
  throw_if_any_failed(failed, failures, dp, mp, what);
}

void gather_moment_windows(const piece_layout& piece, const dp_trainer::optimizer_view& mine,
                           const whole_layout& whole, collective::communicator& dp,
                           collective::communicator& mp, const moment_sink& sink,
                           which_moments which, std::int64_t window_elems, std::string_view what) {
  const std::int64_t n = whole.numel;
  const bool root = dp.rank() == 0 && mp.rank() == 0;
  const bool with_m = which != which_moments::v, with_v = which != which_moments::m;
  const std::int64_t per = (with_m ? 1 : 0) + (with_v ? 1 : 0);
  const bool writes = !mine.whole || dp.rank() == 0;  // ZeRO 0: the replicas hold the same state
  // Every rank checks its state and allocates its buffers, then learns whether any rank failed
  // before the windows' collectives: a bad argument or a failed allocation fails every rank
  // instead of leaving the others waiting.
  std::vector<place> places;
  run_list runs;
  std::vector<std::int64_t> starts{0};
  owned_tensor buf, scratch;  // buf: a window of m and/or v, then the failure flag
  std::exception_ptr failed;
  try {
    check_state(mine, "gather_moments");
    places = places_of(piece, whole, "gather_moments");
    runs = by_flat(mine.runs);
    // Windows: [starts[k], starts[k + 1]) cut at whole parameters' starts, the same on every rank.
    std::vector<std::pair<std::int64_t, std::int64_t>> whole_params;  // offset, numel
    for (const auto& p : whole.params) whole_params.emplace_back(p.offset, p.numel());
    std::sort(whole_params.begin(), whole_params.end());
    for (const auto& [at, len] : whole_params)
      if (at > starts.back() && at + len - starts.back() > window_elems) starts.push_back(at);
    starts.push_back(n);
    std::int64_t widest = 1, scratch_elems = 1;
    for (std::size_t k = 0; k + 1 < starts.size(); ++k)
      widest = std::max(widest, starts[k + 1] - starts[k]);
    for (const auto& p : places) scratch_elems = std::max(scratch_elems, p.piece->field->numel());
    buf = zeros({per * widest + 1}, dtype::f32, device::cpu());
    scratch = zeros({scratch_elems}, dtype::f32, device::cpu());
  } catch (...) {
    failed = std::current_exception();
  }
  agree_on_failure(failed, dp, mp, std::string(what) + " (nothing was gathered)");
  collective::options sum;
  sum.op = collective::reduce_op::sum;

  float failures = 0.0f;  // ranks failed so far, the same on every rank after each window
  auto next = places.begin();
  for (std::size_t k = 0; k + 1 < starts.size(); ++k) {
    const std::int64_t a = starts[k], len = starts[k + 1] - a;
    const tensor all = buf.narrow(0, 0, per * len + 1);
    const tensor wm = with_m ? all.narrow(0, 0, len) : tensor{};
    const tensor wv = with_v ? all.narrow(0, with_m ? len : 0, len) : tensor{};
    ops::fill(all, 0.0);
    try {
      for (; next != places.end() && next->whole_at < a + len; ++next) {
        if (failed || !writes || !next->owned) continue;
        const auto& p = *next;
        const tensor part = scratch.narrow(0, 0, p.piece->field->numel());
        for (auto [state, window] : {std::pair{mine.m, wm}, std::pair{mine.v, wv}}) {
          if (!window.defined()) continue;
          ops::fill(part, 0.0);
          copy_runs(runs, state, p.piece_at, part, false);
          copy_slice(*p.piece, view_of(window, p.whole_at - a, *p.whole),
                     part.reshape(p.piece->sizes), piece.tp_rank, piece.tp, false,
                     "gather_moments");
        }
      }
    } catch (...) {
      failed = std::current_exception();
    }
    float* flag = static_cast<float*>(all.data()) + per * len;
    *flag = failed ? 1.0f : 0.0f;
    const auto count = static_cast<std::size_t>(per * len + 1);
    if (dp.size() > 1) dp.allreduce(all.data(), count, dtype::f32, sum).wait();
    if (mp.size() > 1) mp.allreduce(all.data(), count, dtype::f32, sum).wait();
    failures = *flag;
    if (failures > 0.0f) break;  // every rank sees the same sum: all stop here
    if (root) {
      try {
        sink(a, wm, wv);
      } catch (...) {
        failed = std::current_exception();
      }
    }
  }
  if (failures > 0.0f)
    throw_if_any_failed(failed, failures, dp, mp, what);
  else
    agree_on_failure(failed, dp, mp, what);  // the sink's failure in the last window
}

void gather_moments(const piece_layout& piece, const dp_trainer::optimizer_view& mine,
                    const whole_layout& whole, collective::communicator& dp,
                    collective::communicator& mp, const tensor& m, const tensor& v,
                    std::int64_t window_elems) {
  const std::int64_t n = whole.numel;
  const bool root = dp.rank() == 0 && mp.rank() == 0;
  // Only the root is given m and v: it checks them and every rank learns the outcome.
  std::exception_ptr failed;
  try {
    TROUPE_CHECK(!root || (m.numel() == n && v.numel() == n && m.type() == dtype::f32 &&
                           v.type() == dtype::f32),
                 "gather_moments: m ", m.describe(), " and v ", v.describe(),
                 " are not laid out like the whole model's ", n, " parameters");
  } catch (...) {
    failed = std::current_exception();
  }
  agree_on_failure(failed, dp, mp, "gather_moments (nothing was gathered)");
  gather_moment_windows(
      piece, mine, whole, dp, mp,
      [&](std::int64_t at, const tensor& wm, const tensor& wv) {
        ops::copy(wm, m.narrow(0, at, wm.numel()));
        ops::copy(wv, v.narrow(0, at, wv.numel()));
      },
      which_moments::both, window_elems);
}

void scatter_moments(const whole_layout& whole, const tensor& m, const tensor& v,
                     const piece_layout& piece, const dp_trainer::optimizer_view& mine) {
  check_state(mine, "scatter_moments");
  const std::int64_t n = whole.numel;
  TROUPE_CHECK(m.numel() == n && v.numel() == n && m.type() == dtype::f32 && v.type() == dtype::f32,
               "scatter_moments: m ", m.describe(), " and v ", v.describe(),
               " are not laid out like the whole model's ", n, " parameters");
  const auto places = places_of(piece, whole, "scatter_moments");
  const auto runs = by_flat(mine.runs);
  std::int64_t scratch_elems = 1;
  for (const auto& p : places) scratch_elems = std::max(scratch_elems, p.piece->field->numel());
  owned_tensor scratch = zeros({scratch_elems}, dtype::f32, device::cpu());
  for (const auto& p : places) {
    const tensor part = scratch.narrow(0, 0, p.piece->field->numel());
    for (auto [from, state] : {std::pair{m, mine.m}, std::pair{v, mine.v}}) {
      copy_slice(*p.piece, view_of(from, p.whole_at, *p.whole), part.reshape(p.piece->sizes),
                 piece.tp_rank, piece.tp, true, "scatter_moments");
      copy_runs(runs, state, p.piece_at, part, true);
    }
  }
}

}  // namespace troupe::models::parallel
