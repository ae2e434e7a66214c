// validate(): every rule a parallel plan must meet, each failure a sentence naming the field.
#include "scheduler/plan.hpp"

#include <algorithm>
#include <sstream>

namespace troupe::scheduler {

std::string_view name(schedule_kind k) {
  switch (k) {
    case schedule_kind::gpipe:
      return "gpipe";
    case schedule_kind::one_f_one_b:
      return "1f1b";
    case schedule_kind::interleaved:
      return "interleaved";
    case schedule_kind::eager_1f1b:
      return "eager-1f1b";
    case schedule_kind::zero_bubble:
      return "zero-bubble";
  }
  return "?";
}

std::optional<schedule_kind> parse_schedule_kind(std::string_view s) {
  for (auto k : {schedule_kind::gpipe, schedule_kind::one_f_one_b, schedule_kind::interleaved,
                 schedule_kind::eager_1f1b, schedule_kind::zero_bubble})
    if (name(k) == s) return k;
  return std::nullopt;
}

std::string_view name(recompute_policy p) {
  switch (p) {
    case recompute_policy::none:
      return "none";
    case recompute_policy::selective:
      return "selective";
    case recompute_policy::full:
      return "full";
  }
  return "?";
}

std::optional<recompute_policy> parse_recompute_policy(std::string_view s) {
  for (auto p : {recompute_policy::none, recompute_policy::selective, recompute_policy::full})
    if (name(p) == s) return p;
  return std::nullopt;
}

std::string_view name(partition_kind k) {
  return k == partition_kind::even ? "even" : "balanced";
}

std::optional<partition_kind> parse_partition_kind(std::string_view s) {
  for (auto k : {partition_kind::even, partition_kind::balanced})
    if (name(k) == s) return k;
  return std::nullopt;
}

std::string_view name(p2p_mode m) {
  switch (m) {
    case p2p_mode::batched:
      return "batched";
    case p2p_mode::blocking:
      return "blocking";
    case p2p_mode::async:
      return "async";
  }
  return "?";
}

std::optional<p2p_mode> parse_p2p_mode(std::string_view s) {
  for (auto m : {p2p_mode::batched, p2p_mode::blocking, p2p_mode::async})
    if (name(m) == s) return m;
  return std::nullopt;
}

std::string_view name(cp_mode_kind m) {
  return m == cp_mode_kind::ring ? "ring" : "ulysses";
}

std::optional<cp_mode_kind> parse_cp_mode(std::string_view s) {
  for (auto m : {cp_mode_kind::ulysses, cp_mode_kind::ring})
    if (name(m) == s) return m;
  return std::nullopt;
}

std::vector<std::string> grid_order(const parallel_plan& p) {
  std::vector<std::string> out = p.order;
  if (std::find(out.begin(), out.end(), "cp") != out.end()) return out;
  auto dp = std::find(out.begin(), out.end(), "dp");
  out.insert(dp == out.end() ? out.begin() : dp + 1, "cp");
  return out;
}

int degree_of(const parallel_plan& p, std::string_view axis) {
  return axis == "dp" ? p.dp : axis == "cp" ? p.cp : axis == "pp" ? p.pp : axis == "tp" ? p.tp : 1;
}

namespace {

// Collects problems as sentences built from streamable pieces.
struct problems {
  std::vector<std::string> list;
  template <class... Args>
  void add(Args&&... args) {
    std::ostringstream os;
    (os << ... << args);
    list.push_back(os.str());
  }
};

std::string quoted_list(const std::vector<std::string>& v) {
  std::string s = "[";
  for (std::size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += '"';
    s += v[i];
    s += '"';
  }
  return s + "]";
}

}  // namespace

std::vector<std::string> validate(const parallel_plan& p, const model_shape& m, int world_size) {
  problems out;
  // Degrees and ranges first: later checks divide by them.
  const bool degrees_ok = p.dp >= 1 && p.tp >= 1 && p.pp >= 1 && p.cp >= 1;
  if (p.dp < 1) out.add("parallel.dp = ", p.dp, " must be >= 1");
  if (p.tp < 1) out.add("parallel.tp = ", p.tp, " must be >= 1");
  if (p.pp < 1) out.add("parallel.pp = ", p.pp, " must be >= 1");
  if (p.cp < 1) out.add("parallel.cp = ", p.cp, " must be >= 1");
  if (degrees_ok && world_size > 0 && p.world_size() != world_size) {
    if (p.cp == 1)
      out.add("parallel.dp x parallel.tp x parallel.pp = ", p.dp, " x ", p.tp, " x ", p.pp, " = ",
              p.world_size(), " does not equal the world size ", world_size);
    else
      out.add("parallel.dp x parallel.cp x parallel.tp x parallel.pp = ", p.dp, " x ", p.cp, " x ",
              p.tp, " x ", p.pp, " = ", p.world_size(), " does not equal the world size ",
              world_size);
  }
  if (p.ep < 1) out.add("parallel.ep = ", p.ep, " must be >= 1");
  if (p.ep > 1 && p.dp >= 1 && p.dp % p.ep != 0)
    out.add("parallel.ep = ", p.ep, " does not divide parallel.dp = ", p.dp,
            " (the expert-parallel groups are carved out of the data-parallel ranks)");
  if (p.sp && p.tp == 1)
    out.add("parallel.sp = true needs parallel.tp > 1 (it splits activations over the tp group)");
  if (p.cp > 1) {
    // Ulysses and ring run on a whole model per rank or inside pipeline stages
    // (models/parallel/context_parallel.hpp, context_pipeline.hpp); not on tensor shards yet.
    if (p.tp > 1)
      out.add("parallel.cp = ", p.cp, " with parallel.tp = ", p.tp,
              ": context parallelism runs on unsharded stages only so far (parallel.tp = 1; "
              "Ulysses or ring inside tensor-parallel attention is not written)");
  }
  if (p.zero < 0 || p.zero > 3) out.add("parallel.zero = ", p.zero, " must be 0, 1, 2 or 3");
  if (p.microbatches < 1) out.add("parallel.microbatches = ", p.microbatches, " must be >= 1");
  if (p.virtual_stages < 1)
    out.add("parallel.virtual_stages = ", p.virtual_stages, " must be >= 1");
  if (p.dp_bucket_bytes < 4)
    out.add("parallel.dp_bucket_bytes = ", p.dp_bucket_bytes,
            " must be at least 4 (one f32 gradient)");
  if (p.pipe_p2p == p2p_mode::blocking)
    out.add("parallel.pipe_p2p = \"blocking\" is the simulator's only: pipeline stages run ",
            "\"async\" or \"batched\"");

  // The schedule and its virtual stages.
  if (p.schedule == schedule_kind::interleaved) {
    if (p.pp < 2) out.add("parallel.schedule = \"interleaved\" needs parallel.pp >= 2");
    if (p.virtual_stages < 2)
      out.add("parallel.virtual_stages = ", p.virtual_stages,
              " must be >= 2 for parallel.schedule = \"interleaved\"");
    if (p.pp >= 1 && p.microbatches >= 1 && p.microbatches % p.pp != 0)
      out.add("parallel.microbatches = ", p.microbatches,
              " must be a multiple of parallel.pp = ", p.pp,
              " for parallel.schedule = \"interleaved\"");
  } else if (p.virtual_stages != 1) {
    out.add("parallel.virtual_stages = ", p.virtual_stages,
            " needs parallel.schedule = ", "\"interleaved\" (parallel.schedule = \"",
            name(p.schedule), "\")");
  }

  // The grid order: each axis once ("cp" may be left out: grid_order places it after "dp").
  {
    std::vector<std::string> sorted = p.order;
    std::sort(sorted.begin(), sorted.end());
    if (sorted != std::vector<std::string>{"dp", "pp", "tp"} &&
        sorted != std::vector<std::string>{"cp", "dp", "pp", "tp"})
      out.add(
          "parallel.order = ", quoted_list(p.order),
          " must name each of \"dp\", \"pp\" and \"tp\" exactly once",
          std::count(p.order.begin(), p.order.end(), "cp") > 0 ? " (and \"cp\" at most once)" : "");
    const auto cp = std::find(p.order.begin(), p.order.end(), "cp");
    if (cp != p.order.end() && std::find(cp, p.order.end(), "dp") != p.order.end())
      out.add(
          "parallel.order = ", quoted_list(p.order),
          " must name \"cp\" after \"dp\" (the dp x cp group reads data by dp rank, cp fastest)");
  }

  // Against the model.
  if (p.tp >= 1) {
    auto divides = [&](long long value, const char* what) {
      if (value > 0 && value % p.tp != 0)
        out.add("parallel.tp = ", p.tp, " does not divide ", what, " = ", value);
    };
    divides(m.heads, "heads");
    divides(m.kv_heads, "kv_heads");
    divides(m.hidden, "hidden");
    divides(m.vocab, "vocab");
    if (p.sp && m.seq > 0 && m.seq % p.tp != 0)
      out.add("parallel.tp = ", p.tp, " does not divide seq = ", m.seq,
              " (needed by parallel.sp = true)");
  }
  if (p.ep > 1 && m.experts > 0 && m.experts % p.ep != 0)
    out.add("parallel.ep = ", p.ep, " does not divide experts = ", m.experts);
  if (p.cp > 1) {
    auto divides = [&](long long value, const char* what, const char* why) {
      if (value > 0 && value % p.cp != 0)
        out.add("parallel.cp = ", p.cp, " does not divide ", what, " = ", value, why);
    };
    divides(m.seq, "seq", " (every rank holds seq / cp tokens of each sample)");
    if (p.cp_mode == cp_mode_kind::ring && m.seq > 0 && m.seq % (2 * p.cp) != 0)
      out.add("parallel.cp = ", p.cp, " with parallel.cp_mode = \"ring\": 2 x cp = ", 2 * p.cp,
              " does not divide seq = ", m.seq,
              " (every rank holds two zigzag chunks of seq / (2 cp) tokens of each sample)");
    if (p.cp_mode == cp_mode_kind::ulysses) {
      divides(m.heads, "heads", " (Ulysses gives each rank heads / cp heads)");
      // Fewer kv heads than ranks: each is repeated to cp / kv_heads ranks.
      if (m.kv_heads > 0 && m.kv_heads % p.cp != 0 && p.cp % m.kv_heads != 0)
        out.add("parallel.cp = ", p.cp, " neither divides kv_heads = ", m.kv_heads,
                " nor is a multiple of it (Ulysses gives each rank kv_heads / cp kv heads, or one "
                "kv head repeated to cp / kv_heads ranks)");
    }
  }
  if (p.pp >= 1 && p.virtual_stages >= 1 && m.layers > 0 &&
      m.layers < static_cast<long long>(p.pp) * p.virtual_stages)
    out.add("parallel.pp x parallel.virtual_stages = ", p.pp, " x ", p.virtual_stages, " = ",
            static_cast<long long>(p.pp) * p.virtual_stages, " exceeds layers = ", m.layers,
            " (every model chunk needs a layer)");
  if (p.dp >= 1 && m.batch > 0) {
    if (m.batch % p.dp != 0) {
      out.add("parallel.dp = ", p.dp, " does not divide the global batch = ", m.batch);
    } else if (p.microbatches >= 1 && (m.batch / p.dp) % p.microbatches != 0) {
      out.add("parallel.microbatches = ", p.microbatches,
              " does not divide the batch per data-parallel rank = ", m.batch / p.dp,
              " (global batch ", m.batch, " / parallel.dp ", p.dp, ")");
    }
  }
  return out.list;
}

std::string join(const std::vector<std::string>& problems) {
  std::string s;
  for (const auto& p : problems) s += (s.empty() ? "" : "; ") + p;
  return s;
}

std::string describe(const parallel_plan& p) {
  std::ostringstream os;
  bool first = true;
  for (const auto& a : grid_order(p)) {
    if (a == "cp" && p.cp == 1) continue;  // named only when the sequence is split
    os << (first ? "" : " x ") << a << degree_of(p, a);
    if (a == "cp") os << " (" << name(p.cp_mode) << ")";
    if (a == "dp" && p.ep != 1) os << " (ep" << p.ep << ")";
    first = false;
  }
  if (p.sp) os << " (sp)";
  os << ", zero " << p.zero << ", " << name(p.schedule);
  if (p.schedule == schedule_kind::interleaved) os << " (" << p.virtual_stages << " chunks)";
  os << " x " << p.microbatches << " microbatches, recompute " << name(p.recompute);
  const parallel_plan defaults;
  if (p.dp_bucket_bytes != defaults.dp_bucket_bytes)
    os << ", dp buckets " << p.dp_bucket_bytes << " bytes";
  if (!p.dp_overlap) os << ", dp overlap off";
  if (p.pipe_p2p != defaults.pipe_p2p) os << ", pipe p2p " << name(p.pipe_p2p);
  return os.str();
}

}  // namespace troupe::scheduler
