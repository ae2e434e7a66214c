// Pipeline schedules as data: the list of actions one pipeline stage performs in one training step.
//
// A stage actor runs its list front to back: forward and backward of (microbatch, chunk), and the
// point-to-point transfers of activations (downstream) and their gradients (upstream). A chunk is
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
  backward,
  send_activation,  // to the next virtual stage (peer: its stage)
  recv_activation,  // from the previous virtual stage, the input of forward(microbatch, chunk)
  send_grad,        // the gradient of this chunk's input, to the previous virtual stage
  recv_grad,        // the gradient of this chunk's output, from the next virtual stage
};
std::string_view name(action_kind k);
inline bool is_compute(action_kind k) {
  return k == action_kind::forward || k == action_kind::backward;
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
