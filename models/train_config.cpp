#include "models/train_config.hpp"

#include "models/chaos_kills.hpp"

#include <toml++/toml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>

namespace troupe::models {
namespace {

constexpr std::uintmax_t max_job_file_bytes = 1 << 20;

// toml++ makes a table of every part of a dotted key ([a.b.c], a.b.c = 1) and frees them
// recursively: a key of 100000 parts (200 KB) overflows the stack. A job file's keys have two
// parts ("section.key"); a text with a key of more parts than this is refused before parsing.
constexpr std::size_t max_key_parts = 16;

// The most parts of a dotted key in TOML text: runs of bare parts (letters, digits, '_', '-', '+')
// and quoted ones joined by dots, outside strings and comments. A value chains at most two parts
// (1.5, 1e-3), so the count is an upper bound on the depth of tables a key makes.
std::size_t longest_dotted_key(std::string_view t) {
  std::size_t best = 1, dots = 0;
  bool last_part = false, after_dot = false;
  auto bare = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '+';
  };
  auto begin_part = [&] {
    if (!after_dot) dots = 0;
    after_dot = false;
    last_part = true;
  };
  std::size_t i = 0;
  while (i < t.size()) {
    const char c = t[i];
    if (c == ' ' || c == '\t') {
      ++i;
    } else if (c == '.') {
      if (last_part) {
        best = std::max(best, ++dots + 1);
        after_dot = true;
      } else {
        dots = 0;
        after_dot = false;
      }
      last_part = false;
      ++i;
    } else if (bare(c)) {
      begin_part();
      while (i < t.size() && bare(t[i])) ++i;
    } else if (c == '"' || c == '\'') {
      begin_part();
      const std::string_view triple = c == '"' ? "\"\"\"" : "'''";
      if (t.substr(i, 3) == triple) {  // a multi-line string
        const auto end = t.find(triple, i + 3);
        i = end == std::string_view::npos ? t.size() : end + 3;
      } else {
        for (++i; i < t.size() && t[i] != c && t[i] != '\n'; ++i)
          if (c == '"' && t[i] == '\\') ++i;  // an escaped character
        ++i;
      }
    } else {
      if (c == '#')
        while (i < t.size() && t[i] != '\n') ++i;
      dots = 0;
      last_part = after_dot = false;
      ++i;
    }
  }
  return best;
}

// One setter per "section.key", reading a toml node into a field of train_config.
using setter = std::function<void(train_config&, const toml::node&, const std::string& where)>;

template <class T>
setter set(T train_config::*field) {
  return [field](train_config& c, const toml::node& n, const std::string& where) {
    if constexpr (std::is_same_v<T, std::string>) {
      auto v = n.value<std::string>();
      if (!v) throw error(where + " must be a string");
      c.*field = *v;
    } else if constexpr (std::is_same_v<T, bool>) {
      auto v = n.value<bool>();
      if (!v) throw error(where + " must be true or false");
      c.*field = *v;
    } else if constexpr (std::is_floating_point_v<T>) {
      auto v = n.value<double>();
      if (!v) throw error(where + " must be a number");
      c.*field = static_cast<T>(*v);
    } else {
      auto v = n.value<std::int64_t>();
      if (!v || (std::is_unsigned_v<T> && *v < 0))
        throw error(where + " must be an integer" + (std::is_unsigned_v<T> ? " >= 0" : ""));
      c.*field = static_cast<T>(*v);
    }
  };
}

// parallel.<key>: a field of the plan.
setter set_plan(int scheduler::parallel_plan::*field) {
  return [field](train_config& c, const toml::node& n, const std::string& where) {
    auto v = n.value<std::int64_t>();
    if (!v || *v < -(1LL << 30) || *v > (1LL << 30)) throw error(where + " must be an integer");
    c.plan.*field = static_cast<int>(*v);
  };
}

// memory.<size>: an integer (bytes) or a string with a suffix.
setter set_size(std::uint64_t train_config::*field) {
  return [field](train_config& c, const toml::node& n, const std::string& where) {
    std::optional<std::uint64_t> v;
    if (auto i = n.value_exact<std::int64_t>(); i && *i >= 0) v = static_cast<std::uint64_t>(*i);
    if (auto t = n.value_exact<std::string>()) v = parse_byte_size(*t);
    if (!v) throw error(where + " must be a size: bytes, or a string like \"64M\" or \"2G\"");
    c.*field = *v;
  };
}

// parallel.dp_bucket_bytes: bytes, or a string with a suffix ("256K", "25M").
void set_plan_bucket_bytes(train_config& c, const toml::node& n, const std::string& where) {
  std::optional<std::uint64_t> v;
  if (auto i = n.value_exact<std::int64_t>(); i && *i >= 0) v = static_cast<std::uint64_t>(*i);
  if (auto t = n.value_exact<std::string>()) v = parse_byte_size(*t);
  if (!v || *v > (1ULL << 50))
    throw error(where + " must be a size: bytes, or a string like \"256K\" or \"25M\"");
  c.plan.dp_bucket_bytes = static_cast<long long>(*v);
}

void set_plan_order(train_config& c, const toml::node& n, const std::string& where) {
  const auto* arr = n.as_array();
  if (arr == nullptr)
    throw error(where + " must be an array of axis names, e.g. [\"dp\", \"pp\", \"tp\"]");
  c.plan.order.clear();
  for (const auto& e : *arr) {
    auto v = e.value<std::string>();
    if (!v) throw error(where + " must hold strings");
    c.plan.order.push_back(*v);
  }
}

const std::map<std::string, setter>& setters() {
  static const std::map<std::string, setter> s = {
      {"model.hf", set(&train_config::model_hf)},
      {"model.size", set(&train_config::model_size)},
      {"model.moe_capacity_factor", set(&train_config::moe_capacity_factor)},
      {"model.moe_aux_loss_coef", set(&train_config::moe_aux_loss_coef)},
      {"data.tokens", set(&train_config::data_tokens)},
      {"data.text", set(&train_config::data_text)},
      {"train.steps", set(&train_config::steps)},
      {"train.batch", set(&train_config::batch)},
      {"train.seq", set(&train_config::seq)},
      {"train.grad_accum", set(&train_config::grad_accum)},
      {"train.log_every", set(&train_config::log_every)},
      {"train.seed", set(&train_config::seed)},
      {"train.fixed_batch", set(&train_config::fixed_batch)},
      {"train.recompute", set(&train_config::recompute)},
      {"train.precision", set(&train_config::precision)},
      {"train.loss_scale", set(&train_config::loss_scale)},
      {"train.loss_scale_growth", set(&train_config::loss_scale_growth)},
      {"train.device", set(&train_config::compute_device)},
      {"optim.lr", set(&train_config::lr)},
      {"optim.min_lr", set(&train_config::min_lr)},
      {"optim.beta1", set(&train_config::beta1)},
      {"optim.beta2", set(&train_config::beta2)},
      {"optim.eps", set(&train_config::eps)},
      {"optim.weight_decay", set(&train_config::weight_decay)},
      {"optim.clip", set(&train_config::clip)},
      {"optim.warmup", set(&train_config::warmup)},
      {"optim.decay_exempt", set(&train_config::decay_exempt)},
      {"checkpoint.dir", set(&train_config::ckpt_dir)},
      {"checkpoint.every", set(&train_config::ckpt_every)},
      {"checkpoint.resume", set(&train_config::resume)},
      {"parallel.dp", set_plan(&scheduler::parallel_plan::dp)},
      {"parallel.tp", set_plan(&scheduler::parallel_plan::tp)},
      {"parallel.pp", set_plan(&scheduler::parallel_plan::pp)},
      {"parallel.ep", set_plan(&scheduler::parallel_plan::ep)},
      {"parallel.cp", set_plan(&scheduler::parallel_plan::cp)},
      {"parallel.cp_mode",
       [](train_config& c, const toml::node& n, const std::string& where) {
         auto v = n.value<std::string>();
         auto m = v ? scheduler::parse_cp_mode(*v) : std::nullopt;
         if (!m) throw error(where + " must be \"ulysses\" or \"ring\"");
         c.plan.cp_mode = *m;
       }},
      {"parallel.sp",
       [](train_config& c, const toml::node& n, const std::string& where) {
         auto v = n.value_exact<bool>();  // value<bool>() would take 1 as true
         if (!v) throw error(where + " must be true or false");
         c.plan.sp = *v;
       }},
      {"parallel.zero", set_plan(&scheduler::parallel_plan::zero)},
      {"parallel.microbatches", set_plan(&scheduler::parallel_plan::microbatches)},
      {"parallel.virtual_stages", set_plan(&scheduler::parallel_plan::virtual_stages)},
      {"parallel.schedule",
       [](train_config& c, const toml::node& n, const std::string& where) {
         auto v = n.value<std::string>();
         auto k = v ? scheduler::parse_schedule_kind(*v) : std::nullopt;
         if (!k)
           throw error(where + " must be \"gpipe\", \"1f1b\", \"eager-1f1b\", \"zero-bubble\" or " +
                       "\"interleaved\"");
         c.plan.schedule = *k;
       }},
      {"parallel.recompute",
       [](train_config& c, const toml::node& n, const std::string& where) {
         auto v = n.value<std::string>();
         auto r = v ? scheduler::parse_recompute_policy(*v) : std::nullopt;
         if (!r) throw error(where + " must be \"none\", \"selective\" or \"full\"");
         c.plan.recompute = *r;
       }},
      {"parallel.partition",
       [](train_config& c, const toml::node& n, const std::string& where) {
         auto v = n.value<std::string>();
         auto k = v ? scheduler::parse_partition_kind(*v) : std::nullopt;
         if (!k) throw error(where + " must be \"even\" or \"balanced\"");
         c.plan.partition = *k;
       }},
      {"parallel.order", set_plan_order},
      {"parallel.dp_overlap",
       [](train_config& c, const toml::node& n, const std::string& where) {
         auto v = n.value_exact<bool>();
         if (!v) throw error(where + " must be true or false");
         c.plan.dp_overlap = *v;
       }},
      {"parallel.dp_bucket_bytes", set_plan_bucket_bytes},
      {"parallel.pipe_p2p",
       [](train_config& c, const toml::node& n, const std::string& where) {
         auto v = n.value<std::string>();
         auto m = v ? scheduler::parse_p2p_mode(*v) : std::nullopt;
         if (!m) throw error(where + " must be \"async\" or \"batched\"");
         c.plan.pipe_p2p = *m;
       }},
      {"parallel.pipe_trace", set(&train_config::pipe_trace)},
      {"parallel.collective_timeout", set(&train_config::collective_timeout)},
      {"memory.device", set_size(&train_config::mem_device)},
      {"memory.host", set_size(&train_config::mem_host)},
      {"memory.nvme_dir", set(&train_config::mem_nvme_dir)},
      {"memory.nvme_capacity", set_size(&train_config::mem_nvme_capacity)},
      {"memory.offload", set(&train_config::mem_offload)},
      {"memory.offload_params", set(&train_config::mem_offload_params)},
      {"memory.offload_optimizer", set(&train_config::mem_offload_optimizer)},
      {"memory.params_tier", set(&train_config::mem_params_tier)},
      {"memory.optimizer_tier", set(&train_config::mem_optimizer_tier)},
      {"elastic.enabled",
       [](train_config& c, const toml::node& n, const std::string& where) {
         auto v = n.value_exact<bool>();
         if (!v) throw error(where + " must be true or false");
         c.elastic_enabled = *v;
       }},
      {"elastic.spares", set(&train_config::elastic_spares)},
      {"elastic.replica_interval", set(&train_config::elastic_replica_interval)},
      {"elastic.chaos_kill", set(&train_config::elastic_chaos_kill)},
      {"elastic.min_ranks", set(&train_config::elastic_min_ranks)},
      {"elastic.join_wait", set(&train_config::elastic_join_wait)},
      {"elastic.await_join", set(&train_config::elastic_await_join)},
  };
  return s;
}

void validate_memory(const train_config& c) {
  auto need = [](bool ok, const char* key, const std::string& what) {
    if (!ok) throw error(std::string(key) + " " + what);
  };
  const char* off = "(--device-memory): training with memory tiers";
  if (!c.tiers()) {
    const train_config d;
    need(c.mem_host == 0, "memory.host (--host-memory)", std::string("needs memory.device ") + off);
    need(c.mem_nvme_dir.empty(), "memory.nvme_dir (--nvme-dir)",
         std::string("needs memory.device ") + off);
    need(c.mem_nvme_capacity == 0 && c.mem_offload.empty() &&
             c.mem_offload_params == d.mem_offload_params &&
             c.mem_offload_optimizer == d.mem_offload_optimizer && c.mem_params_tier.empty() &&
             c.mem_optimizer_tier.empty(),
         "memory.*", std::string("keys need memory.device ") + off);
    return;
  }
  need(c.mem_offload.empty() || c.mem_offload == "fixed" || c.mem_offload == "auto",
       "memory.offload (--offload)", "must be \"fixed\" or \"auto\", got '" + c.mem_offload + "'");
  auto fraction = [&](double f, const char* key) {
    need(f == -1 || (f >= 0 && f <= 1), key, "must be in [0, 1]");
    need(f == -1 || c.mem_offload != "auto", key,
         "is a fixed placement: it does not go with memory.offload = \"auto\" (--offload auto)");
  };
  fraction(c.mem_offload_params, "memory.offload_params (--offload-params)");
  fraction(c.mem_offload_optimizer, "memory.offload_optimizer (--offload-optimizer)");
  for (auto [t, key] : {std::pair{&c.mem_params_tier, "memory.params_tier"},
                        std::pair{&c.mem_optimizer_tier, "memory.optimizer_tier"}}) {
    need(t->empty() || *t == "host" || *t == "nvme", key,
         "must be \"host\" or \"nvme\", got '" + *t + "'");
    need(*t != "nvme" || !c.mem_nvme_dir.empty(), key,
         "= \"nvme\" needs memory.nvme_dir (--nvme-dir)");
  }
  need(c.mem_nvme_capacity == 0 || !c.mem_nvme_dir.empty(), "memory.nvme_capacity",
       "needs memory.nvme_dir (--nvme-dir)");
  need(c.precision == "f32" || c.precision == "bf16", "memory.device (--device-memory)",
       "needs train.precision = \"f32\" or \"bf16\" (the tiers train in f32, or in bf16 with f32 "
       "master weights), got '" +
           c.precision + "'");
  // Several ranks: data parallelism with a ZeRO shard, whose moments the tiers hold
  // (models/parallel/paged_moments.hpp); the shard's parameters and gradients stay in the engine.
  if (c.plan.world_size() > 1) {
    const char* several = "memory.device (--device-memory) on several ranks";
    need(c.plan.tp == 1 && c.plan.pp == 1 && c.plan.zero >= 1, several,
         "pages the ZeRO shard's optimizer state of data-parallel ranks: it needs parallel.zero "
         ">= 1 (--zero) and parallel.tp = parallel.pp = 1");
    need(c.mem_offload_params <= 0, "memory.offload_params (--offload-params)",
         "on several ranks: the ZeRO shard's parameters stay with the data-parallel engine (only "
         "its optimizer state is paged)");
    need(c.mem_offload_optimizer == -1 || c.mem_offload_optimizer == 1,
         "memory.offload_optimizer (--offload-optimizer)",
         "on several ranks: the whole optimizer state is paged (1), not a fraction");
    need(c.mem_params_tier.empty(), "memory.params_tier",
         "on several ranks: the ZeRO shard's parameters stay with the data-parallel engine");
  }
}

}  // namespace

std::optional<std::uint64_t> parse_byte_size(std::string_view text) {
  std::size_t i = 0;
  std::uint64_t v = 0;
  while (i < text.size() && text[i] >= '0' && text[i] <= '9') {
    if (v > (UINT64_MAX - 9) / 10) return std::nullopt;
    v = v * 10 + static_cast<std::uint64_t>(text[i++] - '0');
  }
  if (i == 0) return std::nullopt;
  std::string_view unit = text.substr(i);
  int shift = 0;
  if (!unit.empty()) {
    const std::string_view units = "KMGT";
    const auto k = units.find(static_cast<char>(std::toupper(static_cast<unsigned char>(unit[0]))));
    if (k != std::string_view::npos) {
      shift = 10 * static_cast<int>(k + 1);
      unit.remove_prefix(1);
    }
  }
  if (!(unit.empty() || unit == "B" || (shift > 0 && unit == "iB"))) return std::nullopt;
  if (shift > 0 && v > (UINT64_MAX >> shift)) return std::nullopt;
  return v << shift;
}

bool trains_on_gpu(const train_config& c, bool gpu_visible, bool cuda_built) {
  if (c.compute_device == "cpu") return false;
  if (c.compute_device == "cuda") {
    if (!gpu_visible)
      throw error(
          std::string("train.device (--device) = \"cuda\": ") +
          (cuda_built ? "no GPU is visible to this process" : "troupe was built without CUDA"));
    return true;
  }
  return gpu_visible && c.plan.world_size() == 1 && !c.tiers() && !c.elastic() &&
         c.precision != "f64";
}

std::optional<chaos_kill> parse_chaos_kill(std::string_view text) {
  const auto a = text.find(':');
  const auto b = a == std::string_view::npos ? a : text.find(':', a + 1);
  if (b == std::string_view::npos) return std::nullopt;
  auto number = [](std::string_view t) -> std::optional<std::int64_t> {
    if (t.empty() || t.size() > 12) return std::nullopt;
    std::int64_t v = 0;
    for (char ch : t) {
      if (ch < '0' || ch > '9') return std::nullopt;
      v = v * 10 + (ch - '0');
    }
    return v;
  };
  const auto rank = number(text.substr(0, a)), step = number(text.substr(a + 1, b - a - 1));
  const std::string_view phase = text.substr(b + 1);
  if (!rank || !step || *step < 1) return std::nullopt;
  for (const char* known : chaos_phases)
    if (phase == known) return chaos_kill{static_cast<int>(*rank), *step, std::string(phase)};
  return std::nullopt;
}

std::optional<std::vector<chaos_kill>> parse_chaos_kills(std::string_view text) {
  std::vector<chaos_kill> out;
  while (true) {
    const auto comma = text.find(',');
    auto one = parse_chaos_kill(text.substr(0, comma));
    if (!one) return std::nullopt;
    out.push_back(std::move(*one));
    if (comma == std::string_view::npos) return out;
    text.remove_prefix(comma + 1);
  }
}

void train_config::validate() const {
  auto need = [](bool ok, const char* key, const std::string& what) {
    if (!ok) throw error(std::string(key) + " " + what);
  };
  need(moe_capacity_factor >= 0, "model.moe_capacity_factor", "must be >= 0 (0: dropless)");
  need(steps > 0, "train.steps", "must be > 0");
  need(batch > 0, "train.batch", "must be > 0");
  need(seq > 1, "train.seq", "must be > 1");
  need(grad_accum > 0, "train.grad_accum", "must be > 0");
  need(log_every > 0, "train.log_every", "must be > 0");
  need(precision == "f32" || precision == "bf16" || precision == "f16" || precision == "f64",
       "train.precision", "must be f32, bf16, f16 or f64, got '" + precision + "'");
  need(loss_scale > 0, "train.loss_scale (--loss-scale)", "must be > 0");
  need(loss_scale_growth > 0, "train.loss_scale_growth (--loss-scale-growth)", "must be > 0");
  need(compute_device == "auto" || compute_device == "cpu" || compute_device == "cuda",
       "train.device (--device)", "must be auto, cpu or cuda, got '" + compute_device + "'");
  if (compute_device == "cuda") {
    const char* cuda = "train.device (--device) = \"cuda\"";
    need(plan.world_size() == 1, cuda,
         "trains one process; launched plans (parallel.*) train on the CPU for now");
    need(!tiers(), cuda,
         "cannot be combined with memory.device (--device-memory): the tiers "
         "page between host memory and NVMe");
    need(!elastic(), cuda, "cannot be combined with elastic.* (elastic runs train on the CPU)");
    need(precision != "f64", cuda, "has no f64 kernels: train.precision f32, bf16 or f16");
  }
  need(lr > 0, "optim.lr", "must be > 0");
  need(min_lr >= 0 && min_lr <= lr, "optim.min_lr", "must be in [0, optim.lr]");
  need(beta1 >= 0 && beta1 < 1, "optim.beta1", "must be in [0, 1)");
  need(beta2 >= 0 && beta2 < 1, "optim.beta2", "must be in [0, 1)");
  need(eps > 0, "optim.eps", "must be > 0");
  need(weight_decay >= 0, "optim.weight_decay", "must be >= 0");
  need(clip >= 0, "optim.clip", "must be >= 0 (0: no clipping)");
  need(warmup >= 0, "optim.warmup", "must be >= 0");
  need(ckpt_every >= 0, "checkpoint.every", "must be >= 0");
  need(ckpt_every == 0 || !ckpt_dir.empty(), "checkpoint.every", "needs checkpoint.dir");
  need(collective_timeout >= 0 && collective_timeout <= 1e7, "parallel.collective_timeout",
       "must be seconds in [0, 1e7] (0: no deadline)");
  validate_memory(*this);
  need(elastic_spares >= 0 && elastic_spares <= 1024, "elastic.spares (--spares)",
       "must be in [0, 1024]");
  need(elastic_replica_interval >= 0, "elastic.replica_interval (--replica-interval)",
       "must be >= 0 (0: no buddy replicas)");
  need(elastic_chaos_kill.empty() || parse_chaos_kills(elastic_chaos_kill).has_value(),
       "elastic.chaos_kill (--chaos-kill)",
       "must be \"RANK:STEP:PHASE\" entries separated by commas, PHASE one of forward, backward, "
       "optimizer, commit or replicate, got '" +
           elastic_chaos_kill + "'");
  {
    const int whole = plan.world_size(), piece = whole / std::max(plan.dp, 1);
    need(elastic_min_ranks == 0 || (elastic_min_ranks >= piece && elastic_min_ranks <= whole),
         "elastic.min_ranks (--min-ranks)",
         "must be 0 (the full plan: no shrinking) or from " + std::to_string(piece) +
             " (one copy of the model: the plan's ranks over parallel.dp) to the plan's " +
             std::to_string(whole) + " ranks, got " + std::to_string(elastic_min_ranks));
  }
  need(elastic_join_wait >= 0 && elastic_join_wait <= 1e6, "elastic.join_wait (--join-wait)",
       "must be seconds in [0, 1e6] (0: no wait for a joiner)");
  need(elastic_await_join >= 0, "elastic.await_join (--await-join)",
       "must be a step (1-based) or 0 (no drill)");
  need(!elastic() || !tiers(), "elastic.*", "cannot be combined with memory.device (tiers)");
  // The plan, as far as it can be checked before the model and the world size are known.
  scheduler::model_shape shape;
  shape.seq = seq;
  shape.batch = batch * grad_accum;
  auto problems = scheduler::validate(plan, shape);
  if (!problems.empty()) throw error(scheduler::join(problems));
}

namespace {

expected<train_config> from_table(const toml::table& doc, const std::string& path) {
  train_config c;
  try {
    for (const auto& [section, node] : doc) {
      const auto* tbl = node.as_table();
      if (tbl == nullptr) throw error("'" + std::string(section.str()) + "' must be a [section]");
      for (const auto& [key, value] : *tbl) {
        std::string name = std::string(section.str()) + "." + std::string(key.str());
        auto it = setters().find(name);
        if (it == setters().end()) throw error("unknown key '" + name + "'");
        it->second(c, value, name);
      }
    }
    c.validate();
  } catch (const error& e) {
    return expected<train_config>::failure(path + ": " + e.what());
  }
  return c;
}

expected<train_config> parse_failure(const std::string& origin, const toml::parse_error& e) {
  std::ostringstream os;
  os << origin << ":" << e.source().begin.line << ":" << e.source().begin.column << ": "
     << e.description();
  return expected<train_config>::failure(os.str());
}

}  // namespace

expected<train_config> load_train_config(const std::string& path) {
  // A job file is a few lines: one over the bound is refused unread.
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (!ec && size > max_job_file_bytes)
    return expected<train_config>::failure(path + ": " + std::to_string(size) +
                                           " bytes, more than the 1 MiB bound for a job file " +
                                           "(refused unread)");
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return expected<train_config>::failure(path + ": cannot open it: " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return expected<train_config>::failure(path + ": cannot read it");
  return parse_train_config(text.str(), path);
}

expected<train_config> parse_train_config(std::string_view text, const std::string& origin) {
  if (const std::size_t parts = longest_dotted_key(text); parts > max_key_parts)
    return expected<train_config>::failure(
        origin + ": a dotted key of " + std::to_string(parts) + " parts, more than the " +
        std::to_string(max_key_parts) + " a job file may have (refused unparsed)");
  try {
    return from_table(toml::parse(text, origin), origin);
  } catch (const toml::parse_error& e) {
    return parse_failure(origin, e);
  }
}

std::string to_toml(const train_config& c) {
  toml::table model, data, train, optim, ckpt, par;
  if (!c.model_hf.empty()) model.insert("hf", c.model_hf);
  model.insert("size", c.model_size);
  model.insert("moe_capacity_factor", c.moe_capacity_factor);
  if (c.moe_aux_loss_coef >= 0) model.insert("moe_aux_loss_coef", c.moe_aux_loss_coef);
  if (!c.data_tokens.empty()) data.insert("tokens", c.data_tokens);
  data.insert("text", c.data_text);
  train.insert("steps", c.steps);
  train.insert("batch", c.batch);
  train.insert("seq", c.seq);
  train.insert("grad_accum", c.grad_accum);
  train.insert("log_every", c.log_every);
  train.insert("seed", static_cast<std::int64_t>(c.seed));
  train.insert("fixed_batch", c.fixed_batch);
  train.insert("recompute", c.recompute);
  train.insert("precision", c.precision);
  train.insert("loss_scale", c.loss_scale);
  train.insert("loss_scale_growth", c.loss_scale_growth);
  train.insert("device", c.compute_device);
  optim.insert("lr", c.lr);
  optim.insert("min_lr", c.min_lr);
  optim.insert("beta1", c.beta1);
  optim.insert("beta2", c.beta2);
  optim.insert("eps", c.eps);
  optim.insert("weight_decay", c.weight_decay);
  optim.insert("clip", c.clip);
  optim.insert("warmup", c.warmup);
  optim.insert("decay_exempt", c.decay_exempt);
  if (!c.ckpt_dir.empty()) ckpt.insert("dir", c.ckpt_dir);
  ckpt.insert("every", c.ckpt_every);
  if (!c.resume.empty()) ckpt.insert("resume", c.resume);
  par.insert("dp", c.plan.dp);
  par.insert("tp", c.plan.tp);
  par.insert("pp", c.plan.pp);
  if (c.plan.ep != 1) par.insert("ep", c.plan.ep);
  par.insert("sp", c.plan.sp);
  par.insert("cp", c.plan.cp);
  par.insert("cp_mode", std::string(scheduler::name(c.plan.cp_mode)));
  par.insert("zero", c.plan.zero);
  par.insert("microbatches", c.plan.microbatches);
  par.insert("schedule", std::string(scheduler::name(c.plan.schedule)));
  par.insert("virtual_stages", c.plan.virtual_stages);
  par.insert("recompute", std::string(scheduler::name(c.plan.recompute)));
  par.insert("partition", std::string(scheduler::name(c.plan.partition)));
  par.insert("dp_overlap", c.plan.dp_overlap);
  par.insert("dp_bucket_bytes", static_cast<std::int64_t>(c.plan.dp_bucket_bytes));
  par.insert("pipe_p2p", std::string(scheduler::name(c.plan.pipe_p2p)));
  par.insert("collective_timeout", c.collective_timeout);
  if (!c.pipe_trace.empty()) par.insert("pipe_trace", c.pipe_trace);
  toml::table mem;
  mem.insert("device", static_cast<std::int64_t>(c.mem_device));
  mem.insert("host", static_cast<std::int64_t>(c.mem_host));
  mem.insert("nvme_dir", c.mem_nvme_dir);
  mem.insert("nvme_capacity", static_cast<std::int64_t>(c.mem_nvme_capacity));
  mem.insert("offload", c.mem_offload);
  mem.insert("offload_params", c.mem_offload_params);
  mem.insert("offload_optimizer", c.mem_offload_optimizer);
  mem.insert("params_tier", c.mem_params_tier);
  mem.insert("optimizer_tier", c.mem_optimizer_tier);
  toml::table elastic;
  elastic.insert("enabled", c.elastic_enabled);
  elastic.insert("spares", c.elastic_spares);
  elastic.insert("replica_interval", c.elastic_replica_interval);
  elastic.insert("chaos_kill", c.elastic_chaos_kill);
  elastic.insert("min_ranks", c.elastic_min_ranks);
  elastic.insert("join_wait", c.elastic_join_wait);
  elastic.insert("await_join", c.elastic_await_join);
  toml::array order;
  for (const auto& a : c.plan.order) order.push_back(a);
  par.insert("order", order);
  toml::table doc;
  doc.insert("model", model);
  doc.insert("data", data);
  doc.insert("train", train);
  doc.insert("optim", optim);
  doc.insert("checkpoint", ckpt);
  doc.insert("parallel", par);
  doc.insert("memory", mem);
  doc.insert("elastic", elastic);
  std::ostringstream os;
  os << doc;
  return os.str();
}

}  // namespace troupe::models
