// `troupe bench offload`: heterogeneous memory (models/offload, memory/tier_manager) on this
// machine, in two short parts:
//   1. capacity: the largest tiny GPT (by layers, at a fixed width) whose training step fits a
//      "device" budget, all resident (parameters, gradients, AdamW m and v and the activations on
//      the device) and with the tiers (chunks offloaded to the host, streamed to the device one
//      unit at a time); the tiered one is then trained for two steps under the budget to prove it.
//   2. speed: the step time with the optimizer state on NVMe (paged through a small host budget)
//      and with parameters and state on NVMe, relative to all resident, on one model.
// The device tier is an accounted, capped region of host memory (see memory/tier_manager.hpp), so
// this runs without a GPU. Random tokens; the step is the f32 AdamW step of models/trainer.hpp.
#include <fmt/core.h>
#include <unistd.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "apps/commands.hpp"
#include "memory/error.hpp"
#include "memory/io/page_io.hpp"
#include "models/offload/offload_trainer.hpp"

namespace troupe::apps {
namespace {

using memory::tier;

struct offload_args {
  double device_mib = 16;
  std::int64_t dim = 128, heads = 4, vocab = 256, batch = 1, seq = 16;
  std::int64_t speed_layers = 8, speed_batch = 4, speed_seq = 64, steps = 3;
  std::int64_t host_chunks = 12;  // speed part: the host budget in chunks
  std::string nvme_dir = "/tmp";  // the bench works in <nvme_dir>/troupe_bench_offload.<pid>
};

models::gpt_config model(const offload_args& a, std::int64_t layers, std::int64_t seq) {
  return {.vocab = a.vocab, .max_seq = seq, .dim = a.dim, .n_layer = layers, .n_head = a.heads};
}

models::train_config training(std::int64_t batch, std::int64_t seq) {
  models::train_config c;
  c.batch = batch;
  c.seq = seq;
  c.steps = 100;
  c.warmup = 0;
  return c;
}

void random_rows(std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
  std::mt19937_64 gen(draw + 1);
  rows.resize(static_cast<std::size_t>(batch) * seq);
  for (auto& r : rows) r = static_cast<std::int32_t>(gen() % 256);
}

models::offload_options resident(std::size_t device_bytes) {
  models::offload_options o;
  o.device_bytes = device_bytes;
  o.placement = {.param_fraction = 0, .optim_fraction = 0};
  return o;
}

models::offload_options tiered(std::size_t device_bytes) {
  models::offload_options o;
  o.device_bytes = device_bytes;
  o.placement = {.param_fraction = 1, .optim_fraction = 1};
  return o;
}

bool fits(const offload_args& a, std::int64_t layers, const models::offload_options& o) {
  try {
    models::offload_trainer t(model(a, layers, a.seq), training(a.batch, a.seq), o);
    t.check_budgets();
    return true;
  } catch (const troupe::error&) {
    return false;
  }
}

// The largest layer count in [1, 4096] that fits (0 when none does).
std::int64_t largest(const offload_args& a, const models::offload_options& o) {
  if (!fits(a, 1, o)) return 0;
  std::int64_t lo = 1, hi = 2;
  while (hi <= 4096 && fits(a, hi, o)) {
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > 1) {
    std::int64_t mid = (lo + hi) / 2;
    (fits(a, mid, o) ? lo : hi) = mid;
  }
  return lo;
}

struct timing {
  double median_s = 0;
  memory::tier_report report;
  std::size_t chunk_bytes = 0, waste = 0;
  std::int32_t chunks = 0;
  std::string nvme;  // the NVMe tier's backend and O_DIRECT mode ("" without one)
};

timing time_steps(const offload_args& a, std::int64_t layers, std::int64_t batch, std::int64_t seq,
                  const models::offload_options& o, int steps) {
  models::offload_trainer t(model(a, layers, seq), training(batch, seq), o);
  t.check_budgets();
  t.step(random_rows);  // warm-up: first touch of every chunk
  t.tiers().reset_stats();
  std::vector<double> s;
  for (int i = 0; i < steps; ++i) s.push_back(t.step(random_rows).seconds);
  std::sort(s.begin(), s.end());
  timing r;
  r.median_s = s[s.size() / 2];
  r.report = t.tiers().report();
  r.chunk_bytes = t.chunking().layout.chunk_bytes;
  r.waste = t.chunking().layout.wasted_bytes();
  r.chunks = t.chunk_count();
  if (const auto* io = t.tiers().nvme_io()) r.nvme = io->describe_backend();
  return r;
}

double mib(std::size_t b) {
  return static_cast<double>(b) / (1 << 20);
}

int run(const offload_args& a) {
  const auto budget = static_cast<std::size_t>(a.device_mib * (1 << 20));
  fmt::print("troupe bench offload: tiny GPT-2, dim {}, {} heads, vocab {}\n", a.dim, a.heads,
             a.vocab);
  fmt::print("\n1. capacity under a device budget of {:.1f} MiB (batch {} x seq {})\n",
             a.device_mib, a.batch, a.seq);
  const std::int64_t plain = largest(a, resident(budget));
  const std::int64_t tiers = largest(a, tiered(budget));
  auto describe = [&](const char* what, std::int64_t layers, const models::offload_options& o) {
    if (layers == 0) {
      fmt::print("  {:<28} no layer count fits\n", what);
      return;
    }
    models::offload_trainer t(model(a, layers, a.seq), training(a.batch, a.seq), o);
    fmt::print(
        "  {:<28} {:>5} layers, {:>7.2f} M parameters, model state {:>8.1f} MiB, non-model "
        "{:.2f} MiB, chunk {} KiB x {} (waste {:.1f}%)\n",
        what, layers, static_cast<double>(t.chunking().layout.payload_bytes) / 4e6,
        mib(t.model_state_bytes()), mib(t.non_model_bytes()), t.chunking().layout.chunk_bytes >> 10,
        t.chunk_count(),
        100.0 * static_cast<double>(t.chunking().layout.wasted_bytes()) /
            static_cast<double>(t.chunking().layout.total_bytes()));
  };
  describe("all resident:", plain, resident(budget));
  describe("with tiers (host):", tiers, tiered(budget));
  if (plain > 0) fmt::print("  ratio: {:.1f}x the layers\n", double(tiers) / double(plain));
  if (tiers > 0) {
    timing t = time_steps(a, tiers, a.batch, a.seq, tiered(budget), 2);
    fmt::print(
        "  trained {} layers under the budget: step {:.3f} s, device peak {:.2f} of {:.2f} "
        "MiB, prefetch hit rate {:.2f}, {:.2f} GB/s\n",
        tiers, t.median_s, mib(t.report.device_peak), mib(t.report.device_budget),
        t.report.hit_rate(), t.report.io_gbps());
  }

  fmt::print("\n2. step time, {} layers, batch {} x seq {} (median of {} steps after one)\n",
             a.speed_layers, a.speed_batch, a.speed_seq, a.steps);
  // The NVMe tier works in a subdirectory of its own, and only that is removed at the end: the
  // --nvme-dir given may be shared (/var/tmp).
  const std::filesystem::path work =
      std::filesystem::path(a.nvme_dir) / ("troupe_bench_offload." + std::to_string(::getpid()));
  std::filesystem::create_directories(a.nvme_dir);
  TROUPE_CHECK(std::filesystem::create_directory(work), "bench offload: --nvme-dir ", a.nvme_dir,
               ": the work directory ", work.string(), " exists already");
  struct remove_work {
    std::filesystem::path dir;
    ~remove_work() {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);
    }
  } cleanup{work};
  const std::size_t roomy = std::size_t{8} << 30;
  timing base =
      time_steps(a, a.speed_layers, a.speed_batch, a.speed_seq, resident(roomy), int(a.steps));
  const std::size_t cb = base.chunk_bytes;
  models::offload_options os = resident(roomy);
  os.placement = {.param_fraction = 0, .optim_fraction = 1, .optim_tier = tier::nvme};
  os.host_bytes = static_cast<std::size_t>(a.host_chunks) * cb;
  os.nvme_dir = work.string();
  os.overlap_optimizer = false;
  timing serial = time_steps(a, a.speed_layers, a.speed_batch, a.speed_seq, os, int(a.steps));
  os.overlap_optimizer = true;
  timing state = time_steps(a, a.speed_layers, a.speed_batch, a.speed_seq, os, int(a.steps));
  models::offload_options all = os;
  all.placement = {
      .param_fraction = 1, .optim_fraction = 1, .param_tier = tier::nvme, .optim_tier = tier::nvme};
  models::offload_trainer probe(model(a, a.speed_layers, a.speed_seq),
                                training(a.speed_batch, a.speed_seq), all);
  all.device_bytes = probe.non_model_bytes() + 16 * cb;
  timing both = time_steps(a, a.speed_layers, a.speed_batch, a.speed_seq, all, int(a.steps));
  fmt::print("  chunk {} KiB x {} (waste {:.1f} KiB)\n", cb >> 10, base.chunks,
             static_cast<double>(base.waste) / 1024);
  auto row = [&](const char* what, const timing& t) {
    fmt::print(
        "  {:<58} {:>8.3f} s  {:>5.2f}x  NVMe read {:>7.1f} MiB write {:>7.1f} MiB per "
        "step, hit rate {:.2f}, {:.2f} GB/s\n",
        what, t.median_s, t.median_s / base.median_s,
        mib(t.report.nvme_read_bytes) / double(a.steps),
        mib(t.report.nvme_write_bytes) / double(a.steps), t.report.hit_rate(), t.report.io_gbps());
  };
  row("all resident", base);
  const std::string host = fmt::format("host {} chunks", a.host_chunks);
  row(("optimizer state on NVMe, " + host + ", AdamW serial").c_str(), serial);
  row(("optimizer state on NVMe, " + host + ", overlapped").c_str(), state);
  row("parameters and state on NVMe", both);
  fmt::print("  NVMe store: {}\n", both.nvme);
  return 0;
}

}  // namespace

command_fn add_bench_offload_command(CLI::App& bench) {
  auto a = std::make_shared<offload_args>();
  CLI::App* c = bench.add_subcommand(
      "offload",
      "Largest model under a device budget with and without the memory tiers, and the "
      "step time with optimizer state on NVMe");
  c->add_option("--device-mib", a->device_mib, "the device budget in MiB")->capture_default_str();
  c->add_option("--dim", a->dim, "model width")->capture_default_str();
  c->add_option("--batch", a->batch, "capacity part: batch")->capture_default_str();
  c->add_option("--seq", a->seq, "capacity part: sequence length")->capture_default_str();
  c->add_option("--speed-layers", a->speed_layers, "speed part: layers")->capture_default_str();
  c->add_option("--steps", a->steps, "speed part: timed steps")->capture_default_str();
  c->add_option("--host-chunks", a->host_chunks, "speed part: the host budget in chunks")
      ->capture_default_str();
  c->add_option(
       "--nvme-dir", a->nvme_dir,
       "directory for the NVMe tier (the bench works in a subdirectory it creates and removes)")
      ->capture_default_str();
  return [c, a]() -> int {
    if (!c->parsed()) return -1;
    return run(*a);
  };
}

}  // namespace troupe::apps
