// Pipeline stages and the pipeline runner against the single-process models: ranks are threads of
// one local_world with a pp communicator (and a tp one for pp x tp); one step of m weighted
// microbatches must give the loss sum_k w_k loss_k and, gathered by name from every stage and
// shard, the gradient sum_k w_k d loss_k / d params of the unsharded model at the same weights.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "collective/grid.hpp"
#include "collective/local/local_transport.hpp"
#include "collective/p2p_communicator.hpp"
#include "models/causal_lm.hpp"
#include "models/gpt.hpp"
#include "models/llama.hpp"
#include "models/parallel/data_parallel.hpp"
#include "models/parallel/gpt_stage.hpp"
#include "models/parallel/llama_stage.hpp"
#include "models/parallel/parallelize_gpt.hpp"
#include "models/parallel/pipeline_runner.hpp"
#include "models/parallel/testing.hpp"
#include "models/targets.hpp"
#include "models/trainer.hpp"
#include "tensor/ops.hpp"
#include "tensor/parallel.hpp"
#include "tests/rounding.hpp"

using namespace troupe;
using namespace troupe::models;
using namespace troupe::models::parallel;
using scheduler::schedule_kind;

namespace {

constexpr int rows = 2, seq = 16, vocab = 64;

gpt_config tiny_gpt() {
  return testing::gpt_shape(vocab, seq, 32, 4, 4);
}

// llama3x: Llama 3.x's pieces, biases on the attention and the MLP and llama3 RoPE scaling.
llama_config tiny_llama(bool tied = false, bool llama3x = false) {
  llama_config c;
  c.vocab = vocab;
  c.dim = 32;
  c.n_layer = 4;
  c.n_head = 4;
  c.n_kv_head = 2;
  c.hidden = 64;
  c.max_seq = seq;
  c.tie_embeddings = tied;
  if (llama3x) {
    c.attention_bias = c.mlp_bias = true;
    c.rope_theta = 100.0;
    c.rope_scale = {.type = rope_scaling::kind::llama3,
                    .factor = 8.0,
                    .low_freq_factor = 1.0,
                    .high_freq_factor = 4.0,
                    .original_max_position = 32};
  }
  return c;
}

// m microbatches of random tokens with unequal weights (k + 1) / (m (m + 1) / 2).
struct batches {
  std::vector<owned_tensor> ids, targets;
  std::vector<double> weight;
  explicit batches(int m) {
    std::mt19937_64 g(11);
    for (int k = 0; k < m; ++k) {
      ids.push_back(empty({rows, seq}, dtype::i32));
      targets.push_back(empty({rows, seq}, dtype::i32));
      for (std::int64_t i = 0; i < rows * seq; ++i)
        ids[k].data_as<std::int32_t>()[i] = static_cast<std::int32_t>(g() % vocab);
      next_token_targets(ids[k], targets[k]);
      weight.push_back((k + 1) / (m * (m + 1) / 2.0));
    }
  }
  microbatch_data operator()(int k) const { return {ids[k], targets[k], weight[k]}; }
};

// The single-process reference: sum_k w_k loss_k, with the gradient accumulated in the model.
template <class M>
double reference(M& model, const batches& data) {
  model.memory().zero_grads();
  double loss = 0;
  for (std::size_t k = 0; k < data.ids.size(); ++k) {
    loss += data.weight[k] * model.forward(data.ids[k], data.targets[k]);
    model.backward(data.weight[k]);
  }
  return loss;
}

// The single-process model `full` after reference()'s step, and its f64 twin after the same step:
// what a pipeline's loss and gradients are judged by (tests/rounding.hpp).
template <class M>
struct single_process {
  M& full;
  std::unique_ptr<M> exact;
  double loss, exact_loss;
  single_process(M& f, const batches& data)
      : full(f),
        exact(testing::f64_twin(f, {rows, seq})),
        loss(reference(f, data)),
        exact_loss(reference(*exact, data)) {}
};

// Largest |a - b| over the largest |b| (f64 accumulation of f32 tensors).
double rel_err(const tensor& a, const tensor& b) {
  REQUIRE(a.sizes() == b.sizes());
  const float* x = a.data_as<float>();
  const float* y = b.data_as<float>();
  double m = 0, s = 1e-30;
  for (std::int64_t i = 0; i < a.numel(); ++i) {
    m = std::max(m, std::abs(static_cast<double>(x[i]) - y[i]));
    s = std::max(s, std::abs(static_cast<double>(y[i])));
  }
  return m / s;
}

const tensor& grad_of(const slot_list& s, const std::string& name) {
  for (const auto& x : s.slots())
    if (x.kind == slot_kind::param && x.name == name) return *x.grad;
  FAIL("no parameter " << name);
  static tensor none;
  return none;
}

double sum_squares(const tensor& t) {
  double s = 0;
  for (double x : testing::as_f64(t)) s += x * x;
  return s;
}

// One pipeline rank's view of the world: its communicators (tp: null without tensor parallelism).
struct rank_comms {
  std::unique_ptr<collective::communicator> pp, tp, norm;
};

// What a run leaves behind for the checks: every rank's stage, runner and returned loss.
struct pipeline_run {
  std::vector<std::unique_ptr<pipeline_stage>> stages;
  std::vector<std::unique_ptr<pipeline_runner>> runners;
  std::vector<double> loss;
  std::vector<std::map<std::int64_t, double>> hooked;  // per rank: block -> |grad| sum at the hook
  std::vector<rank_comms> comms;
};

using stage_factory = std::function<std::unique_ptr<pipeline_stage>(const scheduler::parallel_plan&,
                                                                    int stage, tp_group tp)>;

double abs_sum_of_block(const pipeline_stage& st, std::int64_t block, const std::string& scope) {
  std::string prefix = scope + "." + std::to_string(block) + ".";
  double s = 0;
  for (const auto& x : st.slots().slots())
    if (x.kind == slot_kind::param && x.name.rfind(prefix, 0) == 0) {
      const float* p = x.grad->data_as<float>();
      for (std::int64_t i = 0; i < x.grad->numel(); ++i) s += std::abs(p[i]);
    }
  return s;
}

// Runs one step of plan on pp x tp threads (rank = stage * tp + tensor rank).
pipeline_run run_pipeline(const scheduler::parallel_plan& plan, const stage_factory& make,
                          const batches& data, const std::string& block_scope) {
  const int n = plan.pp * plan.tp;
  auto world = std::make_shared<collective::local_world>(n);
  collective::rank_grid grid({{"pp", plan.pp}, {"tp", plan.tp}});
  pipeline_run run;
  run.stages.resize(n);
  run.runners.resize(n);
  run.loss.assign(n, 0.0);
  run.hooked.resize(n);
  run.comms.resize(n);
  for (int r = 0; r < n; ++r) {
    run.comms[r].pp = collective::make_communicator(world->transport(r), grid.group(r, {"pp"}),
                                                    "local:pp", world);
    if (plan.tp > 1)
      run.comms[r].tp = collective::make_communicator(world->transport(r), grid.group(r, {"tp"}),
                                                      "local:tp", world);
    run.comms[r].norm = collective::make_communicator(
        world->transport(r), grid.group(r, {"pp", "tp"}), "local:mp", world);
  }
  std::vector<std::exception_ptr> err(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r)
    threads.emplace_back([&, r] {
      try {
        auto& c = run.comms[r];
        int s = grid.coord(r, "pp");
        run.stages[r] = make(plan, s, tp_group{c.tp.get(), plan.sp});
        run.stages[r]->init_weights(5);
        run.runners[r] =
            std::make_unique<pipeline_runner>(*run.stages[r], *c.pp, plan, c.norm.get());
        auto& st = *run.stages[r];
        run.runners[r]->set_block_grads_hook([&, r](std::int64_t block) {
          run.hooked[r][block] = abs_sum_of_block(st, block, block_scope);
        });
        st.memory().zero_grads();
        run.loss[r] =
            run.runners[r]->forward_backward(plan.microbatches, [&data](int k) { return data(k); });
      } catch (...) {
        err[r] = std::current_exception();
        for (auto& c : run.comms) {
          c.pp->abort("rank " + std::to_string(r) + " failed");
          if (c.tp) c.tp->abort("rank " + std::to_string(r) + " failed");
        }
      }
    });
  for (auto& t : threads) t.join();
  for (auto& e : err)
    if (e) std::rethrow_exception(e);
  return run;
}

scheduler::parallel_plan make_plan(int pp, schedule_kind kind, int m, int v = 1, int tp = 1,
                                   bool sp = false) {
  scheduler::parallel_plan p;
  p.pp = pp;
  p.tp = tp;
  p.sp = sp;
  p.schedule = kind;
  p.microbatches = m;
  p.virtual_stages = v;
  return p;
}

// The checks every configuration gets: loss, the gathered gradient, the tied gradient on both
// ends, the norm contract (counts_in_norm over the ranks = the full model's norm), the block hook
// (called once per block the rank holds, with the block's final gradients) and the bubble. Loss,
// gradients and norm must be as accurate as the single process's against its f64 twin
// (tests/rounding.hpp; each parameter by its own scale): pp only runs the same f32 operations
// but for the loss's f64 sums and the tied gradient's summation order, tp splits sums across
// shards. A gradient left out, a microbatch weighted wrongly or a parameter counted twice in the
// norm is off by O(|gradient|), 1e3 or more times the bound.
template <class M>
void check_run(const single_process<M>& want, pipeline_run& run,
               const scheduler::parallel_plan& plan, const std::string& tied,
               std::int64_t n_layer) {
  const M& full = want.full;
  const int n = plan.pp * plan.tp;
  for (int r = 0; r < n; ++r) {
    auto v = tests::as_accurate_as(std::vector<double>{run.loss[r]}, std::vector<double>{want.loss},
                                   std::vector<double>{want.exact_loss});
    INFO("rank " << r << " loss " << run.loss[r] << " vs " << want.loss << ": " << v.str());
    CHECK(v.ok());
  }
  // Gather every rank's gradients by name into a full-shaped model's gradient buffer.
  M got(full.config(), {1, 1});
  got.memory().zero_grads();
  for (int r = 0; r < n; ++r) run.stages[r]->store_to(got.slots(), true, true);
  const auto worst = testing::worst_by_name(got.slots(), full.slots(), want.exact->slots());
  INFO("worst gradient " << worst.name << ": " << worst.v.str());
  CHECK(worst.v.ok());
  // The tied gradient on the first and on the last stage (each tensor shard's slice).
  if (!tied.empty() && plan.pp > 1) {
    const tensor& ref = grad_of(full.slots(), tied);
    const tensor& exact = grad_of(want.exact->slots(), tied);
    for (int r = 0; r < n; ++r) {
      auto& st = *run.stages[r];
      bool holds = st.stage() == 0 || st.stage() == plan.pp - 1;
      CHECK(st.tied_parameter() == (holds ? tied : std::string()));
      if (!holds) continue;
      auto slice = empty(st.tied_grad().sizes(), dtype::f32);
      auto exact_slice = empty(st.tied_grad().sizes(), dtype::f64);
      const tensor_slot* own = testing::param_slot(st.slots(), tied);
      REQUIRE(own != nullptr);
      copy_slice(*own, ref, slice, st.tp().rank(), st.tp().size(), true, "test");
      copy_slice(*own, exact, exact_slice, st.tp().rank(), st.tp().size(), true, "test");
      auto v = tests::as_accurate_as(testing::as_f64(st.tied_grad()), testing::as_f64(slice),
                                     testing::as_f64(exact_slice));
      INFO("tied gradient on rank " << r << ": " << v.str());
      CHECK(v.ok());
    }
  }
  // Norm: each rank counts its parameters once across the model-parallel group.
  auto sum_squares_of = [](const slot_list& slots) {
    double sq = 0;
    for (const auto& s : slots.slots())
      if (s.kind == slot_kind::param) sq += sum_squares(*s.grad);
    return sq;
  };
  double got_sq = 0;
  for (int r = 0; r < n; ++r) {
    CHECK(run.runners[r]->norm_group() == run.comms[r].norm.get());
    for (const auto& s : run.stages[r]->slots().slots())
      if (s.kind == slot_kind::param && run.runners[r]->counts_in_norm(s))
        got_sq += sum_squares(*s.grad);
  }
  auto vn = tests::as_accurate_as(std::vector<double>{got_sq},
                                  std::vector<double>{sum_squares_of(full.slots())},
                                  std::vector<double>{sum_squares_of(want.exact->slots())});
  INFO("squared norm: " << vn.str());
  CHECK(vn.ok());
  // Block hook: every block once on the ranks holding it, after its last gradient.
  for (int r = 0; r < n; ++r) {
    auto& st = *run.stages[r];
    std::int64_t held = 0;
    for (int c = 0; c < st.chunks(); ++c) held += st.end_block(c) - st.first_block(c);
    CHECK(static_cast<std::int64_t>(run.hooked[r].size()) == held);
    for (auto [block, at_hook] : run.hooked[r]) {
      INFO("rank " << r << " block " << block);
      CHECK(block >= 0);
      CHECK(block < n_layer);
    }
  }
  for (int r = 0; r < n; ++r) {
    const auto& runner = *run.runners[r];
    double b = runner.bubble_fraction();
    CHECK(b >= 0.0);
    CHECK(b < 1.0);
    // The pipelined section lies inside the step, so its idle share is at most the step's.
    const auto& t = runner.last_timing();
    CHECK(t.compute_s <= t.schedule_s);
    CHECK(t.schedule_s <= t.wall_s);
    CHECK(b <= runner.step_bubble_fraction() + 1e-12);
    // The trace: every compute action and send of the schedule once, in the schedule's order,
    // each inside the step; a receive only where a compute action waited for its input.
    std::vector<scheduler::action> traced, listed;
    for (const auto& e : runner.last_trace()) {
      CHECK(e.start_s >= 0.0);
      CHECK(e.start_s <= e.end_s);
      CHECK(e.end_s <= t.wall_s);
      if (!scheduler::is_recv(e.what.kind)) traced.push_back(e.what);
    }
    for (const auto& a : run.runners[r]->schedule(plan.microbatches))
      if (!scheduler::is_recv(a.kind)) listed.push_back(a);
    CHECK(traced == listed);
  }
}

void check_hook_final(pipeline_run& run, const std::string& scope) {
  for (std::size_t r = 0; r < run.stages.size(); ++r)
    for (auto [block, at_hook] : run.hooked[r]) {
      INFO("rank " << r << " block " << block);
      CHECK(at_hook == abs_sum_of_block(*run.stages[r], block, scope));
      CHECK(at_hook > 0);
    }
}

}  // namespace

// Every GPT-2 configuration: loss and gradients as accurate as the single process's against its
// f64 twin (check_run; pp only: the same f32 operations but the loss's f64 sums and the tied
// gradient's summation order; tp: sums split across shards). `batched`: run with
// parallel.pipe_p2p = batched (each batch of the list's transfers posted together and waited where
// it stands, as Megatron runs them).
TEST_CASE("GPT-2 pipeline stages match the single process loss and gradients", "[parallel]") {
  struct config {
    int pp;
    schedule_kind kind;
    int m, v, tp;
    bool sp;
    bool batched = false;
  };
  for (auto c : {config{2, schedule_kind::gpipe, 4, 1, 1, false},
                 config{2, schedule_kind::one_f_one_b, 4, 1, 1, false},
                 config{2, schedule_kind::interleaved, 4, 2, 1, false},
                 config{4, schedule_kind::one_f_one_b, 6, 1, 1, false},
                 config{4, schedule_kind::eager_1f1b, 6, 1, 1, false},
                 config{2, schedule_kind::one_f_one_b, 4, 1, 2, false},
                 config{2, schedule_kind::interleaved, 4, 2, 2, true},
                 config{2, schedule_kind::one_f_one_b, 5, 1, 1, false, true},
                 config{2, schedule_kind::eager_1f1b, 5, 1, 1, false, true},
                 config{4, schedule_kind::zero_bubble, 6, 1, 1, false},
                 config{2, schedule_kind::zero_bubble, 5, 1, 2, true},
                 config{2, schedule_kind::zero_bubble, 5, 1, 1, false, true}}) {
    auto plan = make_plan(c.pp, c.kind, c.m, c.v, c.tp, c.sp);
    if (c.batched) plan.pipe_p2p = scheduler::p2p_mode::batched;
    INFO(scheduler::describe(plan));
    batches data(c.m);
    gpt full(tiny_gpt(), {rows, seq});
    full.init_weights(5);
    const single_process want(full, data);
    auto run = run_pipeline(
        plan,
        [](const scheduler::parallel_plan& p, int s, tp_group tp) {
          return std::make_unique<gpt_stage>(tiny_gpt(), batch_dims{rows, seq},
                                             stage_options::of(p, s), tp);
        },
        data, "h");
    check_run(want, run, plan, "wte.weight", 4);
    check_hook_final(run, "h");
  }
}

// parallel.pipe_p2p reaches the runner: seen in the order the transfers reach the pp communicator
// (its flight recorder). Batched, a receive is posted with its batch, after every send the list
// has before it; async (the default), receives are posted one compute action ahead, so in 1F1B
// the first stage posts its first gradient receive before the activation send that precedes it in
// the list. A pipe_p2p of "blocking" is refused naming the setting.
TEST_CASE("The pipe_p2p setting decides when a stage posts its receives", "[parallel]") {
  const int m = 4;
  batches data(m);
  auto make = [](const scheduler::parallel_plan& p, int s, tp_group tp) {
    return std::make_unique<gpt_stage>(tiny_gpt(), batch_dims{rows, seq}, stage_options::of(p, s),
                                       tp);
  };
  // For each receive of the step's first transfers, the sends posted before it: as the list has
  // them (list), and as the communicator saw them (posted).
  struct order {
    std::vector<int> list, posted;
  };
  auto orders = [&](scheduler::p2p_mode mode) {
    auto plan = make_plan(2, schedule_kind::one_f_one_b, m);
    plan.pipe_p2p = mode;
    auto run = run_pipeline(plan, make, data, "h");
    std::vector<order> out(2);
    for (int r = 0; r < 2; ++r) {
      int sends = 0;
      std::size_t transfers = 0;
      for (const auto& a : run.runners[r]->schedule(m)) {
        if (scheduler::is_recv(a.kind)) out[r].list.push_back(sends);
        if (scheduler::is_send(a.kind)) ++sends;
        if (!scheduler::is_compute(a.kind)) ++transfers;
      }
      const auto records = run.comms[r].pp->recent();  // the schedule's, then the loss exchange
      REQUIRE(records.size() >= transfers);
      sends = 0;
      for (std::size_t i = 0; i < transfers; ++i) {
        if (records[i].kind == collective::op_kind::recv) out[r].posted.push_back(sends);
        if (records[i].kind == collective::op_kind::send) ++sends;
      }
      REQUIRE(out[r].posted.size() == out[r].list.size());
    }
    return out;
  };
  const auto batched = orders(scheduler::p2p_mode::batched);
  const auto async = orders(scheduler::p2p_mode::async);
  bool ahead = false;  // some receive posted before a send the list has before it
  for (int r = 0; r < 2; ++r) {
    INFO("stage " << r);
    for (std::size_t k = 0; k < batched[r].list.size(); ++k) {
      CHECK(batched[r].posted[k] >= batched[r].list[k]);
      ahead = ahead || async[r].posted[k] < async[r].list[k];
    }
  }
  CHECK(ahead);
  auto plan = make_plan(2, schedule_kind::one_f_one_b, m);
  plan.pipe_p2p = scheduler::p2p_mode::blocking;
  CHECK_THROWS_WITH(run_pipeline(plan, make, data, "h"),
                    Catch::Contains("parallel.pipe_p2p = \"blocking\""));
}

// The zero-bubble schedule runs eager 1F1B's list with the backwards of stages > 0 split into the
// input gradient and a later weight pass: every stage's gradients and the loss must be those of
// eager 1F1B bit for bit (the same kernels, each parameter's sum in microbatch order), and only
// the split stages hold weight queues.
TEST_CASE("Zero-bubble stages give eager 1F1B's gradients bit for bit", "[parallel]") {
  for (int pp : {2, 4}) {
    INFO("pp " << pp);
    const int m = 6;
    batches data(m);
    auto make = [](const scheduler::parallel_plan& p, int s, tp_group tp) {
      return std::make_unique<gpt_stage>(tiny_gpt(), batch_dims{rows, seq}, stage_options::of(p, s),
                                         tp);
    };
    auto eager = run_pipeline(make_plan(pp, schedule_kind::eager_1f1b, m), make, data, "h");
    auto zb = run_pipeline(make_plan(pp, schedule_kind::zero_bubble, m), make, data, "h");
    for (int r = 0; r < pp; ++r) {
      INFO("stage " << r);
      const tensor& a = eager.stages[r]->memory().grads();
      const tensor& b = zb.stages[r]->memory().grads();
      REQUIRE(a.nbytes() == b.nbytes());
      CHECK(std::memcmp(a.data(), b.data(), a.nbytes()) == 0);
      CHECK(zb.loss[r] == eager.loss[r]);
      CHECK(zb.stages[r]->in_flight() == 0);
      CHECK((zb.stages[r]->weight_queue_bytes() > 0) == (r > 0));
      CHECK(eager.stages[r]->weight_queue_bytes() == 0);
      int weights = 0;
      for (const auto& e : zb.runners[r]->last_trace())
        weights += e.what.kind == scheduler::action_kind::weight;
      CHECK(weights == (r > 0 ? m : 0));
    }
  }
}

// A recomputing pipeline against the storing one: as many stash buffers, each at least 4 x
// smaller, and a recompute wherever a microbatch was stashed.
void check_recompute_stash(const pipeline_run& run, const pipeline_run& stored) {
  for (std::size_t r = 0; r < run.stages.size(); ++r) {
    const auto &a = *run.stages[r], &b = *stored.stages[r];
    INFO("rank " << r << " stash " << a.stash_bytes() << " bytes vs " << b.stash_bytes());
    CHECK(a.recomputes());
    CHECK(a.stash_buffers() == b.stash_buffers());
    CHECK(a.stash_bytes() * 4 <= b.stash_bytes());
    CHECK((a.recomputed() > 0) == (b.stash_buffers() > 0));
  }
}

// Recompute (parallel.recompute full): stashes keep each in-flight microbatch's stage input only
// and a restored microbatch's chunk runs forward again before its backward. The same checks as
// without (against the storing single-process model); then against the storing pipeline: as many
// stash buffers, each at least 4 x smaller, and a recompute wherever a microbatch was stashed.
TEST_CASE("GPT-2 pipeline stages with activation recompute match the single process",
          "[parallel]") {
  struct config {
    int pp;
    schedule_kind kind;
    int m, v, tp;
    bool sp;
  };
  for (auto c : {config{2, schedule_kind::gpipe, 4, 1, 1, false},
                 config{2, schedule_kind::one_f_one_b, 4, 1, 1, false},
                 config{2, schedule_kind::interleaved, 4, 2, 1, false},
                 config{2, schedule_kind::one_f_one_b, 4, 1, 2, true},
                 config{2, schedule_kind::zero_bubble, 4, 1, 1, false}}) {
    auto plan = make_plan(c.pp, c.kind, c.m, c.v, c.tp, c.sp);
    INFO(scheduler::describe(plan));
    batches data(c.m);
    gpt full(tiny_gpt(), {rows, seq});
    full.init_weights(5);
    const single_process want(full, data);
    auto factory = [](bool recompute) {
      return [recompute](const scheduler::parallel_plan& p, int s, tp_group tp) {
        gpt_config cfg = tiny_gpt();
        cfg.recompute = recompute;
        return std::make_unique<gpt_stage>(cfg, batch_dims{rows, seq}, stage_options::of(p, s), tp);
      };
    };
    auto stored = run_pipeline(plan, factory(false), data, "h");
    plan.recompute = scheduler::recompute_policy::full;
    auto run = run_pipeline(plan, factory(true), data, "h");
    check_run(want, run, plan, "wte.weight", 4);
    check_hook_final(run, "h");
    check_recompute_stash(run, stored);
  }
}

// parallel.partition balanced (the default): a vocabulary of 512 makes the head cost 1.3 blocks
// of the tiny GPT-2, so of 4 blocks the first stage takes 3 and the last 1 (even: 2 and 2); the
// uneven stages still give the single process's loss and gradients.
TEST_CASE("Pipeline stages cut by the cost estimate match the single process", "[parallel]") {
  gpt_config cfg = tiny_gpt();
  cfg.vocab = 512;
  scheduler::model_shape shape;
  shape.layers = cfg.n_layer, shape.heads = cfg.n_head, shape.kv_heads = cfg.n_head;
  shape.hidden = cfg.dim, shape.vocab = cfg.vocab, shape.seq = seq;
  auto plan = make_plan(2, schedule_kind::one_f_one_b, 4);
  REQUIRE(plan.partition == scheduler::partition_kind::balanced);
  CHECK(stage_options::of(plan, 1, shape).first == std::vector<int>{0, 3, 4});
  auto even = plan;
  even.partition = scheduler::partition_kind::even;
  CHECK(stage_options::of(even, 1, shape).first == std::vector<int>{0, 2, 4});
  batches data(4);
  gpt full(cfg, {rows, seq});
  full.init_weights(5);
  const single_process want(full, data);
  auto run = run_pipeline(
      plan,
      [&](const scheduler::parallel_plan& p, int s, tp_group tp) {
        return std::make_unique<gpt_stage>(cfg, batch_dims{rows, seq},
                                           stage_options::of(p, s, shape), tp);
      },
      data, "h");
  CHECK(run.stages[0]->end_block(0) == 3);
  CHECK(run.stages[1]->first_block(0) == 3);
  check_run(want, run, plan, "wte.weight", 4);
}

TEST_CASE("Llama pipeline stages match the single process loss and gradients", "[parallel]") {
  struct config {
    int pp;
    schedule_kind kind;
    int m, v;
    bool tied;
    int tp = 1;
    bool sp = false;
    bool llama3x = false;  // biases on attention and MLP (one replicated per block: counted once)
  };
  for (auto c : {config{2, schedule_kind::gpipe, 4, 1, false},
                 config{2, schedule_kind::one_f_one_b, 4, 1, false},
                 config{2, schedule_kind::interleaved, 4, 2, false},
                 config{4, schedule_kind::one_f_one_b, 6, 1, false},
                 config{2, schedule_kind::eager_1f1b, 5, 1, true},
                 config{2, schedule_kind::one_f_one_b, 3, 1, true},
                 config{2, schedule_kind::one_f_one_b, 4, 1, false, 2, false},
                 config{2, schedule_kind::interleaved, 4, 2, false, 2, true},
                 config{2, schedule_kind::one_f_one_b, 2, 1, true, 2, true},
                 config{2, schedule_kind::zero_bubble, 5, 1, true},
                 config{4, schedule_kind::zero_bubble, 6, 1, false},
                 config{2, schedule_kind::zero_bubble, 4, 1, false, 2, true},
                 config{2, schedule_kind::one_f_one_b, 4, 1, false, 2, false, true},
                 config{2, schedule_kind::one_f_one_b, 4, 1, true, 2, true, true}}) {
    auto plan = make_plan(c.pp, c.kind, c.m, c.v, c.tp, c.sp);
    INFO(scheduler::describe(plan) << (c.tied ? " tied" : "") << (c.llama3x ? " llama3x" : ""));
    batches data(c.m);
    llama full(tiny_llama(c.tied, c.llama3x), {rows, seq});
    full.init_weights(5);
    const single_process want(full, data);
    auto run = run_pipeline(
        plan,
        [tied = c.tied, l3 = c.llama3x](const scheduler::parallel_plan& p, int s, tp_group tp) {
          return std::make_unique<llama_stage>(tiny_llama(tied, l3), batch_dims{rows, seq},
                                               stage_options::of(p, s), tp);
        },
        data, "layers");
    check_run(want, run, plan, c.tied ? "embed_tokens.weight" : "", 4);
    check_hook_final(run, "layers");
  }
}

// Llama stages recompute as GPT-2's do (pipeline_stage): the same checks, tied and tp 2 + SP.
TEST_CASE("Llama pipeline stages with activation recompute match the single process",
          "[parallel]") {
  struct config {
    schedule_kind kind;
    int m, v;
    bool tied;
    int tp;
    bool sp;
  };
  for (auto c : {config{schedule_kind::one_f_one_b, 4, 1, false, 1, false},
                 config{schedule_kind::interleaved, 4, 2, true, 2, true}}) {
    auto plan = make_plan(2, c.kind, c.m, c.v, c.tp, c.sp);
    INFO(scheduler::describe(plan) << (c.tied ? " tied" : ""));
    batches data(c.m);
    llama full(tiny_llama(c.tied), {rows, seq});
    full.init_weights(5);
    const single_process want(full, data);
    auto factory = [tied = c.tied](bool recompute) {
      return [tied, recompute](const scheduler::parallel_plan& p, int s, tp_group tp) {
        llama_config cfg = tiny_llama(tied);
        cfg.recompute = recompute;
        return std::make_unique<llama_stage>(cfg, batch_dims{rows, seq}, stage_options::of(p, s),
                                             tp);
      };
    };
    auto stored = run_pipeline(plan, factory(false), data, "layers");
    plan.recompute = scheduler::recompute_policy::full;
    auto run = run_pipeline(plan, factory(true), data, "layers");
    check_run(want, run, plan, c.tied ? "embed_tokens.weight" : "", 4);
    check_hook_final(run, "layers");
    check_recompute_stash(run, stored);
  }
}

TEST_CASE("Pipeline stages hold the blocks of their virtual stages", "[parallel]") {
  auto plan = make_plan(2, schedule_kind::interleaved, 4, 2);
  gpt_stage s0(tiny_gpt(), {rows, seq}, stage_options::of(plan, 0));
  gpt_stage s1(tiny_gpt(), {rows, seq}, stage_options::of(plan, 1));
  // Virtual stages 0..3 hold one block each: stage 0 has blocks 0 and 2, stage 1 blocks 1 and 3.
  CHECK(s0.first_block(0) == 0);
  CHECK(s0.first_block(1) == 2);
  CHECK(s1.first_block(0) == 1);
  CHECK(s1.first_block(1) == 3);
  std::vector<std::string> p0, p1;
  for (const auto& s : s0.slots().slots())
    if (s.kind == slot_kind::param) p0.push_back(s.name);
  for (const auto& s : s1.slots().slots())
    if (s.kind == slot_kind::param) p1.push_back(s.name);
  CHECK(p0.front() == "wte.weight");
  CHECK(p0[1] == "wpe.weight");
  CHECK(std::count(p1.begin(), p1.end(), "wte.weight") == 1);  // the tied head's copy
  CHECK(std::count(p1.begin(), p1.end(), "ln_f.weight") == 1);
  CHECK(std::count(p0.begin(), p0.end(), "ln_f.weight") == 0);
  CHECK(std::count(p0.begin(), p0.end(), "h.2.attn.qkv_proj.weight") == 1);
  CHECK(std::count(p1.begin(), p1.end(), "h.2.attn.qkv_proj.weight") == 0);
  // Weights round-trip by name: init as the full model, store back into a full model.
  gpt full(tiny_gpt(), {1, 1});
  full.init_weights(9);
  s0.init_weights(9);
  s1.init_weights(9);
  gpt back(tiny_gpt(), {1, 1});
  ops::fill(back.memory().params(), 0.0);
  s0.store_to(back.slots());
  s1.store_to(back.slots());
  CHECK(rel_err(back.memory().params(), full.memory().params()) == 0.0);
}

TEST_CASE("Wrong pipeline configurations fail with a clear error", "[parallel]") {
  using Catch::Matchers::Contains;
  // More virtual stages than layers.
  CHECK_THROWS_WITH(gpt_stage(tiny_gpt(), {rows, seq},
                              {.stage = 0, .stages = 5, .virtual_stages = 1, .first = {}}),
                    Contains("need at least as many layers") && Contains("n_layer is 4"));
  CHECK_THROWS_WITH(llama_stage(tiny_llama(), {rows, seq},
                                {.stage = 1, .stages = 3, .virtual_stages = 2, .first = {}}),
                    Contains("6 virtual stages"));
  // Llama with more tensor shards than key/value heads (GQA 4:2).
  auto comms4 = collective::make_local_group(4);
  CHECK_THROWS_WITH(llama_stage(tiny_llama(), {rows, seq},
                                {.stage = 0, .stages = 2, .virtual_stages = 1, .first = {}},
                                tp_group{comms4[0].get(), false}),
                    Contains("parallel.tp = 4") && Contains("n_kv_head"));
  auto comms = collective::make_local_group(2);
  // Interleaved with microbatches not a multiple of the stages.
  auto plan = make_plan(2, schedule_kind::interleaved, 3, 2);
  gpt_stage s0(tiny_gpt(), {rows, seq}, stage_options::of(plan, 0));
  CHECK_THROWS_WITH(pipeline_runner(s0, *comms[0], plan),
                    Contains("interleaved") && Contains("multiple of stages"));
  // A plan that does not match the stage or the communicator.
  auto plan1 = make_plan(2, schedule_kind::one_f_one_b, 4);
  gpt_stage s1(tiny_gpt(), {rows, seq}, stage_options::of(plan1, 1));
  CHECK_THROWS_WITH(pipeline_runner(s1, *comms[0], plan1), Contains("must run stage 0"));
  plan1.recompute = scheduler::recompute_policy::full;
  CHECK_THROWS_WITH(pipeline_runner(s1, *comms[1], plan1), Contains("parallel.recompute"));
}

TEST_CASE("A microbatch of the wrong shape fails naming the planned shape", "[parallel]") {
  auto plan = make_plan(1, schedule_kind::one_f_one_b, 2);
  auto comms = collective::make_local_group(1);
  gpt_stage st(tiny_gpt(), {rows, seq}, stage_options::of(plan, 0));
  st.init_weights(1);
  pipeline_runner run(st, *comms[0], plan);
  auto ids = zeros({1, seq}, dtype::i32);
  auto fetch = [&](int) { return microbatch_data{ids, ids, 0.5}; };
  CHECK_THROWS_WITH(run.forward_backward(2, fetch), Catch::Matchers::Contains("[2, 16]"));
}

// pp 1 (one stage holding everything) is the plain model; the bubble is then the share of the step
// outside forward and backward, and the ideal one is 0. Loss and gradients as accurate as the
// plain model's against its f64 twin (tests/rounding.hpp).
TEST_CASE("The pipeline bubble fraction is a fraction", "[parallel]") {
  CHECK(pipeline_runner::ideal_bubble_fraction(4, 8) == Approx(3.0 / 11.0));
  CHECK(pipeline_runner::ideal_bubble_fraction(2, 4, 2) == Approx(1.0 / 9.0));
  auto plan = make_plan(1, schedule_kind::gpipe, 2);
  auto comms = collective::make_local_group(1);
  batches data(2);
  gpt full(tiny_gpt(), {rows, seq});
  full.init_weights(5);
  const single_process want(full, data);
  gpt_stage st(tiny_gpt(), {rows, seq}, stage_options::of(plan, 0));
  st.init_weights(5);
  pipeline_runner run(st, *comms[0], plan);
  CHECK(run.bubble_fraction() == 0.0);
  st.memory().zero_grads();
  double got = run.forward_backward(2, [&data](int k) { return data(k); });
  auto vl = tests::as_accurate_as(std::vector<double>{got}, std::vector<double>{want.loss},
                                  std::vector<double>{want.exact_loss});
  INFO("loss " << got << " vs " << want.loss << ": " << vl.str());
  CHECK(vl.ok());
  gpt got_grads(tiny_gpt(), {1, 1});
  got_grads.memory().zero_grads();
  st.store_to(got_grads.slots(), true, true);
  const auto vg = testing::worst_by_name(got_grads.slots(), full.slots(), want.exact->slots());
  INFO("worst gradient " << vg.name << ": " << vg.v.str());
  CHECK(vg.v.ok());
  CHECK(run.bubble_fraction() >= 0.0);
  CHECK(run.bubble_fraction() < 1.0);
  CHECK(run.last_timing().compute_s > 0);
  CHECK(run.last_timing().compute_s <= run.last_timing().wall_s);
}

namespace {

void synthetic_rows(std::uint64_t draw, int batch, int len, std::vector<std::int32_t>& out) {
  out.resize(static_cast<std::size_t>(batch) * len);
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = static_cast<std::int32_t>((draw * 131 + i * i * 7 + i * 3 + (i * draw) % 5) % vocab);
}

}  // namespace

// dp 2 x pp 2 (4 threads): dp_trainer drives each pipeline_runner as its grad_producer, ZeRO 1,
// clipping on (the norm sums the counted parameters over the pp group through norm_group()).
// Losses and gradient norms per step, and the final weights gathered by name (each parameter by
// its own scale), as accurate as the single-process trainer's against the same run in f64
// (tests/rounding.hpp; AdamW magnifies rounding-level gradient differences, up to lr per step, in
// both f32 runs alike). A microbatch or a reduction left out moves the weights by O(lr).
TEST_CASE("Data parallel training over pipeline stages equals the single process trainer",
          "[parallel]") {
  train_config tc;
  tc.steps = 5;
  tc.batch = rows;
  tc.seq = seq;
  tc.grad_accum = 8;
  tc.lr = 3e-3;
  tc.min_lr = 1e-3;
  tc.warmup = 2;
  tc.clip = 0.5;
  gpt_config cfg = tiny_gpt();
  causal_lm_of<gpt> single(cfg, batch_dims{rows, seq});
  causal_lm_of<gpt> exact(cfg, batch_dims{rows, seq}, dtype::f64);
  std::vector<double> ref_loss, ref_norm, exact_loss, exact_norm;
  for (bool f64 : {false, true}) {
    causal_lm& m = f64 ? static_cast<causal_lm&>(exact) : single;
    m.init_weights(5);
    train_config c = tc;
    if (f64) c.precision = "f64";
    trainer t(m, c);
    for (int s = 0; s < tc.steps; ++s) {
      auto res = t.step(synthetic_rows);
      (f64 ? exact_loss : ref_loss).push_back(res.loss);
      (f64 ? exact_norm : ref_norm).push_back(res.grad_norm);
    }
  }
  for (auto kind : {schedule_kind::one_f_one_b, schedule_kind::interleaved}) {
    train_config c = tc;
    c.plan.dp = 2;
    c.plan.pp = 2;
    c.plan.zero = 1;
    c.plan.microbatches = 4;
    c.plan.schedule = kind;
    c.plan.virtual_stages = kind == schedule_kind::interleaved ? 2 : 1;
    INFO(scheduler::describe(c.plan));
    auto world = std::make_shared<collective::local_world>(4);
    collective::rank_grid grid({{"dp", 2}, {"pp", 2}});
    std::vector<std::unique_ptr<collective::communicator>> dp(4), pp(4), mp(4);
    for (int r = 0; r < 4; ++r) {
      dp[r] = collective::make_communicator(world->transport(r), grid.group(r, {"dp"}), "local:dp",
                                            world);
      pp[r] = collective::make_communicator(world->transport(r), grid.group(r, {"pp"}), "local:pp",
                                            world);
      mp[r] = collective::make_communicator(world->transport(r), grid.group(r, {"pp"}), "local:mp",
                                            world);
    }
    std::vector<std::vector<step_result>> got(4);
    std::vector<std::unique_ptr<gpt_stage>> stages(4);
    std::vector<std::exception_ptr> err(4);
    std::vector<std::thread> threads;
    for (int r = 0; r < 4; ++r)
      threads.emplace_back([&, r] {
        try {
          stages[r] = std::make_unique<gpt_stage>(cfg, batch_dims{rows, seq},
                                                  stage_options::of(c.plan, grid.coord(r, "pp")));
          stages[r]->init_weights(5);
          pipeline_runner run(*stages[r], *pp[r], c.plan, mp[r].get());
          dp_trainer t(run, c, *dp[r], {.bucket_bytes = 4 * 1001});
          for (int s = 0; s < c.steps; ++s) got[r].push_back(t.step(synthetic_rows));
        } catch (...) {
          err[r] = std::current_exception();
          for (int q = 0; q < 4; ++q) {
            dp[q]->abort("rank " + std::to_string(r) + " failed");
            pp[q]->abort("rank " + std::to_string(r) + " failed");
            mp[q]->abort("rank " + std::to_string(r) + " failed");
          }
        }
      });
    for (auto& t : threads) t.join();
    for (auto& e : err)
      if (e) std::rethrow_exception(e);
    for (int r = 0; r < 4; ++r) {
      std::vector<double> loss, norm;
      for (const auto& g : got[r]) loss.push_back(g.loss), norm.push_back(g.grad_norm);
      auto vl = tests::as_accurate_as(loss, ref_loss, exact_loss, tests::trajectory_k);
      auto vn = tests::as_accurate_as(norm, ref_norm, exact_norm, tests::trajectory_k);
      INFO("rank " << r << " losses: " << vl.str() << "; norms: " << vn.str());
      CHECK(vl.ok());
      CHECK(vn.ok());
    }
    gpt back(cfg, {1, 1});
    ops::fill(back.memory().params(), 0.0);
    for (int r = 0; r < 4; ++r) stages[r]->store_to(back.slots());
    const auto vw = testing::worst_by_name(back.slots(), single.slots(), exact.slots(),
                                           /*grads=*/false);
    INFO("worst weight " << vw.name << ": " << vw.v.str());
    CHECK(vw.v.ok());
    // The two copies of the tied embedding stay equal under the same update.
    auto param = [](const pipeline_stage& st, const std::string& name) {
      for (const auto& x : st.slots().slots())
        if (x.kind == slot_kind::param && x.name == name) return *x.field;
      return tensor{};
    };
    CHECK(rel_err(param(*stages[0], "wte.weight"), param(*stages[1], "wte.weight")) == 0.0);
  }
}

// The measured bubble against (p - 1) / (v m + p - 1), not a test: a GPT-2 of 8 x 128 (seq 64,
// 4 rows per microbatch), one compute thread per rank, one warm-up step, then the median over 3
// steps of each rank's bubble_fraction(), with the runner's default transfers and with
// parallel.pipe_p2p = batched. Run: troupe_models_tests "[.pipe_bench]".
TEST_CASE("Pipeline bubble against the schedule's ideal", "[.pipe_bench]") {
  troupe::parallel::set_num_threads(1);
  const gpt_config cfg = testing::gpt_shape(256, 64, 128, 8, 4);
  const batch_dims dims{4, 64};
  struct config {
    int pp;
    schedule_kind kind;
    int m, v;
  };
  for (auto c :
       {config{2, schedule_kind::gpipe, 2, 1}, config{2, schedule_kind::gpipe, 8, 1},
        config{2, schedule_kind::one_f_one_b, 2, 1}, config{2, schedule_kind::one_f_one_b, 4, 1},
        config{2, schedule_kind::one_f_one_b, 8, 1}, config{2, schedule_kind::interleaved, 4, 2},
        config{4, schedule_kind::one_f_one_b, 8, 1}})
    for (auto mode : {scheduler::p2p_mode::async, scheduler::p2p_mode::batched}) {
      auto plan = make_plan(c.pp, c.kind, c.m, c.v);
      plan.pipe_p2p = mode;
      auto comms = collective::make_local_group(c.pp);
      std::vector<std::vector<double>> bubble(c.pp), wall(c.pp);
      std::vector<std::thread> threads;
      for (int r = 0; r < c.pp; ++r)
        threads.emplace_back([&, r] {
          gpt_stage st(cfg, dims, stage_options::of(plan, r));
          st.init_weights(1);
          pipeline_runner run(st, *comms[r], plan);
          std::vector<owned_tensor> ids;
          for (int k = 0; k < c.m; ++k) {
            ids.push_back(empty({dims.batch, dims.seq}, dtype::i32));
            for (std::int64_t i = 0; i < ids[k].numel(); ++i)
              ids[k].data_as<std::int32_t>()[i] = static_cast<std::int32_t>((i * 31 + k) % 256);
          }
          auto fetch = [&](int k) { return microbatch_data{ids[k], ids[k], 1.0 / c.m}; };
          for (int step = 0; step < 4; ++step) {
            st.memory().zero_grads();
            run.forward_backward(c.m, fetch);
            if (step == 0) continue;
            bubble[r].push_back(run.bubble_fraction());
            wall[r].push_back(run.last_timing().wall_s);
          }
        });
      for (auto& t : threads) t.join();
      std::string label = std::string(scheduler::name(c.kind)) + " pp" + std::to_string(c.pp) +
                          " m" + std::to_string(c.m) + " v" + std::to_string(c.v) + " " +
                          std::string(scheduler::name(mode));
      std::printf("%-22s ideal %.3f measured", label.c_str(),
                  pipeline_runner::ideal_bubble_fraction(c.pp, c.m, c.v));
      for (int r = 0; r < c.pp; ++r) {
        std::sort(bubble[r].begin(), bubble[r].end());
        std::sort(wall[r].begin(), wall[r].end());
        std::printf(" s%d %.3f", r, bubble[r][1]);
      }
      std::printf("  (step %.0f ms)\n", wall[0][1] * 1e3);
    }
}

// Memory with and without recompute, not a test: gpt2-demo's shape (4 x 128, vocabulary 256), one
// row of 128 tokens per microbatch, pp 2 with 8 microbatches; per stage the activation arena and
// the stash after one step. Run: troupe_models_tests "[.pipe_memory]".
TEST_CASE("Pipeline stash memory with and without recompute", "[.pipe_memory]") {
  const gpt_config cfg = testing::gpt_shape(256, 128, 128, 4, 4);  // gpt2-demo at 128 tokens
  const batch_dims dims{1, 128};
  for (auto kind : {schedule_kind::gpipe, schedule_kind::one_f_one_b})
    for (bool recompute : {false, true}) {
      auto plan = make_plan(2, kind, 8);
      if (recompute) plan.recompute = scheduler::recompute_policy::full;
      auto comms = collective::make_local_group(2);
      std::vector<std::string> line(2);
      std::vector<std::thread> threads;
      for (int r = 0; r < 2; ++r)
        threads.emplace_back([&, r] {
          gpt_config c = cfg;
          c.recompute = recompute;
          gpt_stage st(c, dims, stage_options::of(plan, r));
          st.init_weights(1);
          pipeline_runner run(st, *comms[r], plan);
          auto ids = empty({dims.batch, dims.seq}, dtype::i32);
          for (std::int64_t i = 0; i < ids.numel(); ++i)
            ids.data_as<std::int32_t>()[i] = static_cast<std::int32_t>((i * 31) % 256);
          st.memory().zero_grads();
          run.forward_backward(8, [&](int) { return microbatch_data{ids, ids, 1.0 / 8}; });
          char buf[200];
          std::snprintf(buf, sizeof buf, " s%d arena %.2f MB stash %zu x %.3f MB = %.2f MB", r,
                        st.memory().activation_bytes() / 1e6, st.stash_buffers(),
                        st.stash_buffers() ? st.stash_bytes() / 1e6 / st.stash_buffers() : 0.0,
                        st.stash_bytes() / 1e6);
          line[r] = buf;
        });
      for (auto& t : threads) t.join();
      std::printf("%-6s recompute %-4s%s%s\n", std::string(scheduler::name(kind)).c_str(),
                  recompute ? "full" : "none", line[0].c_str(), line[1].c_str());
    }
}
