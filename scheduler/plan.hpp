// parallel_plan: how one training job is spread over its ranks, as plain data.
//
// The degrees dp x pp x tp make the rank grid (collective/grid.hpp) in the order `order` (first
// axis slowest, so the default {"dp", "pp", "tp"} keeps tensor-parallel peers on neighbouring
// ranks). Sequence parallelism (sp) reuses the tensor-parallel group, so it is a switch, not a
// degree. Expert parallelism (ep) is carved out of the data-parallel ranks (DeepSpeed's and
// Colossal-AI's convention), so it is not a grid axis either: the world is still dp x cp x pp x
// tp, ep divides dp, dp rank d is rank d % ep of the expert-parallel group of the ep consecutive
// dp ranks d / ep * ep ..., and holds experts [(d % ep) * n / ep, (d % ep + 1) * n / ep) of every
// MoE layer. Non-expert parameters are reduced over all dp ranks, expert parameters over their
// expert-data-parallel group of dp / ep ranks (those with the same d % ep). Context parallelism
// (cp, cp_mode) is a degree: the sequence of every sample split over cp ranks; its grid axis "cp"
// sits right after "dp" unless `order` names it (grid_order). validate() checks a plan against a
// model's shape and the world size and returns every problem at once, each naming the field as
// "parallel.<key>", so a job file can be fixed in one go.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace troupe::scheduler {

enum class schedule_kind {
  gpipe,        // all forwards, then all backwards (Huang et al. 2019)
  one_f_one_b,  // warmup, steady one-forward-one-backward, cooldown (PipeDream-Flush / Megatron)
  interleaved,  // 1F1B over virtual stages (Narayanan et al. 2021, Megatron's interleaved schedule)
  eager_1f1b,   // 1F1B with 2 (p - s - 1) warmup forwards: one spare microbatch per link
  zero_bubble,  // eager 1F1B with split backwards, weight passes deferred (Qi et al. 2024)
};
// "gpipe", "1f1b", "interleaved", "eager-1f1b", "zero-bubble"
std::string_view name(schedule_kind k);
std::optional<schedule_kind> parse_schedule_kind(std::string_view s);

enum class recompute_policy {
  none,       // keep every activation backward reads
  selective,  // recompute only the attention core (Korthikanti et al. 2022)
  full,       // keep each block's input only; run the block's forward again in backward
};
std::string_view name(recompute_policy p);  // "none", "selective", "full"
std::optional<recompute_policy> parse_recompute_policy(std::string_view s);

// How the blocks are cut into pipeline stages (partition.hpp): the same number each, or the split
// that minimises the most expensive stage under the FLOP estimate of transformer_costs (the
// embedding on the first stage, the head and the loss on the last).
enum class partition_kind { even, balanced };
std::string_view name(partition_kind k);  // "even", "balanced"
std::optional<partition_kind> parse_partition_kind(std::string_view s);

// How a stage posts and waits for its transfers (simulate.hpp models all three; pipeline stages
// run async or batched, models/parallel/pipeline_runner.hpp). batched: each batch of consecutive
// transfers posted together and waited for where it stands (Megatron's batch_isend_irecv);
// blocking: each transfer posted once the one before it completed; async: sends never waited for
// in place, receives posted one compute action ahead, each compute waiting only for its input.
enum class p2p_mode { batched, blocking, async };
std::string_view name(p2p_mode m);  // "batched", "blocking", "async"
std::optional<p2p_mode> parse_p2p_mode(std::string_view s);

// How context parallelism (parallel.cp > 1) runs attention over a sequence split across ranks.
// ulysses: an all-to-all turns [T/cp, heads] into [T, heads/cp] around attention and back
// (DeepSpeed-Ulysses; models/parallel/context_parallel.hpp). ring: key/value blocks passed
// around the ring (models/parallel/ring_context.hpp). Both with dp and pp, not with tp.
enum class cp_mode_kind { ulysses, ring };
std::string_view name(cp_mode_kind m);  // "ulysses", "ring"
std::optional<cp_mode_kind> parse_cp_mode(std::string_view s);

struct parallel_plan {
  int dp = 1, tp = 1, pp = 1;
  bool sp = false;  // sequence parallel norms/dropout over the tp group (needs tp > 1)
  int cp = 1;       // context-parallel degree: every sample's sequence split over cp ranks
  cp_mode_kind cp_mode = cp_mode_kind::ulysses;
  int ep = 1;            // expert-parallel degree, out of the dp ranks (see the top; MoE only)
  int zero = 0;          // ZeRO stage: 1 optimizer state, 2 + gradients, 3 + parameters
  int microbatches = 1;  // per data-parallel rank and step (gradient accumulation)
  schedule_kind schedule = schedule_kind::one_f_one_b;
  int virtual_stages = 1;  // model chunks per pipeline stage (interleaved only; 1 otherwise)
  recompute_policy recompute = recompute_policy::none;
  partition_kind partition = partition_kind::balanced;
  // Data-parallel gradient reduction (models/parallel/data_parallel.hpp): buckets of this many
  // bytes (25 MiB, PyTorch DDP's default), issued during backward as soon as their blocks'
  // gradients are final (dp_overlap), else all after backward.
  bool dp_overlap = true;
  long long dp_bucket_bytes = 25LL << 20;
  p2p_mode pipe_p2p = p2p_mode::async;  // how pipeline stages wait for their transfers
  // Grid axes, slowest first. (Initialized by a call: a braced list here makes GCC 12 crash,
  // "internal compiler error in check_noexcept_r", on `train_config{}.*field` in apps/.)
  std::vector<std::string> order = default_order();
  static std::vector<std::string> default_order() { return {"dp", "pp", "tp"}; }

  int world_size() const { return dp * tp * pp * cp; }
  friend bool operator==(const parallel_plan&, const parallel_plan&) = default;
};

// The grid axes, slowest first: `order`, with "cp" inserted right after "dp" when order does not
// name it (so a default plan's context-parallel peers are neighbours within a data-parallel rank).
std::vector<std::string> grid_order(const parallel_plan& plan);
// The degree of grid axis `axis` ("dp", "cp", "pp", "tp"; 1 for any other name).
int degree_of(const parallel_plan& plan, std::string_view axis);

// What a plan is checked against. A field left 0 is unknown and its checks are skipped (a job
// file is checked before the model is loaded, and before the world size is known).
struct model_shape {
  long long layers = 0, heads = 0, kv_heads = 0, hidden = 0, vocab = 0;
  long long seq = 0;       // tokens per sample
  long long batch = 0;     // global batch in samples per optimizer step
  long long ffn = 0;       // MLP width (0: 4 x hidden)
  bool gated_mlp = false;  // three MLP matrices (Llama's SwiGLU) instead of two (GPT-2)
  long long experts = 0;   // MoE experts per layer (0: a dense model, or unknown)
};

// Every problem of `plan` for model `m` on `world_size` ranks (0: unknown), in field order, each a
// sentence that starts with "parallel.<key>"; empty when the plan is valid.
std::vector<std::string> validate(const parallel_plan& plan, const model_shape& m,
                                  int world_size = 0);

// The problems joined by "; " (empty when there are none), for an error message.
std::string join(const std::vector<std::string>& problems);

// One line, e.g. "dp2 x pp2 x tp2 (sp), zero 1, 1f1b x 8 microbatches, recompute none" (with
// context parallelism the axis "cp2 (ulysses)" in its grid place, e.g. "dp2 x cp2 (ulysses) x
// pp1 x tp1, ..."); the expert-parallel degree follows dp where it is not 1 ("dp4 (ep2) x pp1 x
// tp1"); the
// gradient buckets, overlap and pipeline transfers are named only where they differ from the
// defaults (", dp buckets 262144 bytes, dp overlap off, pipe p2p batched").
std::string describe(const parallel_plan& plan);

}  // namespace troupe::scheduler
