// Pipeline schedules as data: the list of actions one pipeline stage performs in one training step.
//
// A stage actor runs its list front to back: forward and backward of (microbatch, chunk), the
// weight pass of a split backward (zero-bubble only), and the point-to-point transfers of
// activations (downstream) and their gradients (upstream). A chunk is
// a model piece on a stage; with v chunks per stage the model has p * v virtual stages and chunk c
// of stage s is virtual stage c * p + s (Megatron's layout), so activations flow stage 0 -> 1 ->
// ... -> p-1 -> (next chunk) 0 -> ... and the last stage's chunk c feeds chunk c + 1 of stage 0.
//
// Communication follows Megatron-LM's schedules.py: consecutive communication actions form one
// batch that is posted together and waited on together (batch_isend_irecv), listed in the order
// Megatron's _p2p_ops posts them (even stages send first, odd stages receive first). For GPipe
// and 1F1B the send/receive sequences on each link are mirror images (the k-th send of one side
// meets the k-th receive of the other), so they cannot deadlock even when every transfer blocks on
// its own. Interleaved lists add a ring link (last stage -> first); the tests run them with
// blocking transfers too (stages <= 8, microbatches <= 16, v <= 4), a check rather than a proof.
//
//   gpipe        all forwards, then all backwards: every stage holds m microbatches' activations.
//   1f1b         stage s runs min(p - s - 1, m) warmup forwards, then alternates one forward and
//                one backward, then drains the remaining backwards: at most p - s in flight.
//   eager-1f1b   1F1B with 2 (p - s - 1) warmup forwards: every link holds one spare
//                microbatch, so a stage's next input was sent a forward and a backward before it
//                is needed and, with sends that do not wait for their receive (pipeline_runner's
//                default), the steady state pays no transfer time: only the ramp does, once per
//                link each way (1F1B pays about one per steady-state step). Same ideal bubble
//                as 1F1B; stage s holds min(2 (p - s) - 1, m) microbatches instead of p - s. Its
//                links are not mirrored: it needs each batch posted together (Megatron's
//                batch_isend_irecv) or sends that do not wait; with every transfer blocking on its
//                own it deadlocks (simulate.hpp's p2p_mode::blocking), and in batches it is slower
//                than 1F1B (each early send waits for a receive its peer posts a step later).
//   zero-bubble  eager 1F1B with split backwards (Qi et al., "Zero Bubble Pipeline Parallelism",
//                2024): stage s's list is eager 1F1B's (same forwards, backwards, transfers and
//                order) plus a `weight` action per microbatch. A backward whose (microbatch,
//                chunk) has a weight action computes only its input's gradient (B), which is sent
//                upstream right after as before; the weight action adds the parameter gradients
//                later (W). Stage s keeps up to d = 2 s weight passes pending: right after the
//                transfer batch that follows backward k (after the backward when none follows) it
//                runs the weight pass of microbatch k - d if k - d >= 0, and after its last
//                backward's batch the rest, so weight passes run in microbatch order (gradients
//                accumulate in the order of the unsplit schedule). Stage 0 sends no input gradient,
//                so a split gains it nothing: its list is eager 1F1B's, full backwards, no weight.
//                Why: every stage then runs one microbatch per F + B + W, and stage s runs its
//                cycle 2 W earlier than stage s - 1 (it deferred two more weight passes). Against
//                stage s - 1, the gradient stage s sends has F - B + 2 W of slack before it is
//                needed (eager 1F1B's full backward has F - (B + W), late whenever the backward
//                outlasts the forward, which is what its bubble is made of), and the activation
//                stage s - 1 sends keeps 2 B of the spare microbatch's 2 (B + W). So once the
//                forwards have reached the last stage nobody waits: with unit F, B and W, free
//                transfers and m >= 2 p - 1 the makespan is m (F + B + W) + (p - 1) F, the forward
//                ramp alone (eager 1F1B: (m + p - 1)(F + B + W)); transfers of l = F / 4 add only
//                (p - 1) l, on that ramp (both checked in the tests). Stage s holds eager 1F1B's
//                2 (p - s - 1) + 1 microbatches plus d whose weight pass is pending:
//                min(2 p - 1, m) on every stage, eager 1F1B's stage-0 peak. Its transfers are
//                eager 1F1B's: run it batched or async, never with each transfer blocking alone.
//   interleaved  1F1B over chunks, Megatron's forward_backward_pipelining_with_interleaving:
//                forward k runs chunk (k mod pv) / p on microbatch (k / pv) * p + k mod p, warmup
//                (p - s - 1) * 2 + (v - 1) * p forwards (all m * v when m == p); m a multiple of p.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "scheduler/plan.hpp"

namespace troupe::scheduler {

enum class action_kind : std::uint8_t {
  forward,
  backward,  // the full backward, or only the input gradient when the list has a weight action
  weight,    // the parameter gradients of a split backward (zero-bubble); no transfer follows it
  send_activation,  // to the next virtual stage (peer: its stage)
  recv_activation,  // from the previous virtual stage, the input of forward(microbatch, chunk)
  send_grad,        // the gradient of this chunk's input, to the previous virtual stage
  recv_grad,        // the gradient of this chunk's output, from the next virtual stage
};
std::string_view name(action_kind k);
// Compute actions occupy the stage (forward, backward, weight); the others are transfers.
inline bool is_compute(action_kind k) {
  return k == action_kind::forward || k == action_kind::backward || k == action_kind::weight;
}
inline bool is_send(action_kind k) {
  return k == action_kind::send_activation || k == action_kind::send_grad;
}
inline bool is_recv(action_kind k) {
  return k == action_kind::recv_activation || k == action_kind::recv_grad;
}

struct action {
  action_kind kind = action_kind::forward;
  int microbatch = 0;
  int chunk = 0;  // this stage's chunk the action belongs to (what it computes, sends or feeds)
  int peer = -1;  // the other stage of a transfer; -1 for compute
  friend bool operator==(const action&, const action&) = default;
};
// e.g. "forward microbatch 3 chunk 0", "recv_grad microbatch 1 chunk 1 from stage 2"
std::string describe(const action& a);

// The actions of `stage` (0-based) of `stages` for one step of `microbatches`; virtual_stages is
// the number of chunks per stage (1 except for interleaved). Throws std::invalid_argument naming
// the argument when the combination is not schedulable (see validate() in plan.hpp).
std::vector<action> make_schedule(schedule_kind kind, int stage, int stages, int microbatches,
                                  int virtual_stages = 1);
// Every stage's list, index = stage.
std::vector<std::vector<action>> make_schedules(schedule_kind kind, int stages, int microbatches,
                                                int virtual_stages = 1);

// Megatron's num_warmup_microbatches: the forwards `stage` runs before its steady state (one more
// forward precedes the first backward when there is a steady state); all of them for GPipe.
int warmup_forwards(schedule_kind kind, int stage, int stages, int microbatches,
                    int virtual_stages = 1);

}  // namespace troupe::scheduler
