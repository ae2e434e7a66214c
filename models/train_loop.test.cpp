// The one training loop: steps from the resumed step to train.steps, the checkpoint cadence and
// the final save, failures handed to the mode's policy, a stop request; and the single-process
// trainer on it, checkpointing and resuming like an uninterrupted run.
#include <catch2/catch.hpp>

#include <unistd.h>

#include <filesystem>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "models/causal_lm.hpp"
#include "models/train_loop.hpp"
#include "models/trainer.hpp"

using namespace troupe;
using namespace troupe::models;

namespace {

// A mode that trains nothing: step k (0-based) reports loss 10 - k over 100 tokens in 0.5 s.
struct counting_mode {
  std::vector<std::int64_t> asked;  // the `done` of every step call
  std::vector<std::string> saved;   // "<steps done> <folder>" per save
  std::int64_t done = 0;
  train_policy policy() {
    train_policy p;
    p.step = [this](std::int64_t d) {
      asked.push_back(d);
      step_result r;
      r.step = ++done;
      r.loss = 10.0 - static_cast<double>(d);
      r.tokens = 100;
      r.seconds = 0.5;
      return r;
    };
    p.save = [this](const std::string& folder) {
      saved.push_back(std::to_string(done) + " " + folder);
    };
    return p;
  }
};

train_config with_checkpoints(std::int64_t steps, std::int64_t every) {
  train_config c;
  c.steps = steps;
  c.ckpt_dir = "/nonexistent/troupe-loop-test";
  c.ckpt_every = every;
  return c;
}

void rows_of(std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
  rows.resize(static_cast<std::size_t>(batch) * seq);
  for (std::size_t i = 0; i < rows.size(); ++i)
    rows[i] = static_cast<std::int32_t>((draw * 131 + i * i * 7 + i * 3) % 251);
}

}  // namespace

TEST_CASE("The loop runs from the resumed step to train.steps and saves at the cadence and last") {
  const auto cfg = with_checkpoints(7, 3);
  counting_mode mode;
  mode.done = 1;  // resumed after one step
  std::vector<std::int64_t> reported;
  std::vector<std::string> heard;
  train_hooks hooks;
  hooks.on_step = [&](const step_result& r) { reported.push_back(r.step); };
  hooks.on_save = [&](std::int64_t step, const std::string& folder,
                      std::optional<std::int64_t> held) {
    heard.push_back(std::to_string(step) + " " + folder + (held ? " held" : ""));
  };
  const auto p = run_train_loop(cfg, 1, mode.policy(), hooks);
  CHECK(mode.asked == std::vector<std::int64_t>{1, 2, 3, 4, 5, 6});
  CHECK(reported == std::vector<std::int64_t>{2, 3, 4, 5, 6, 7});
  CHECK(mode.saved ==
        std::vector<std::string>{"3 " + cfg.ckpt_dir, "6 " + cfg.ckpt_dir, "7 " + cfg.ckpt_dir});
  CHECK(heard == mode.saved);  // the folder holds no checkpoint: nothing held before
  CHECK(p.first == 1);
  CHECK(p.step == 7);
  CHECK(p.ran == 6);
  CHECK(p.tokens == 600);
  CHECK(p.seconds == 3.0);
  CHECK(p.first_loss == 9.0);
  CHECK(p.last_loss == 4.0);
  CHECK(p.saved == 7);
  CHECK_FALSE(p.stopped);
  CHECK(trained_line(p) == "trained to step 7 in 3.0 s (200 tokens/s); loss 9.000 -> 4.000");
}

TEST_CASE("Checkpoints are due at every checkpoint.every-th step and the last, with a folder") {
  auto c = with_checkpoints(10, 4);
  std::vector<std::int64_t> due;
  for (std::int64_t s = 1; s <= 10; ++s)
    if (checkpoint_due(c, s)) due.push_back(s);
  CHECK(due == std::vector<std::int64_t>{4, 8, 10});
  c.ckpt_every = 0;
  CHECK_FALSE(checkpoint_due(c, 4));
  CHECK(checkpoint_due(c, 10));
  c.ckpt_dir.clear();
  CHECK_FALSE(checkpoint_due(c, 10));
}

TEST_CASE("A failed step reaches the mode's failure policy with the progress before it") {
  const auto cfg = with_checkpoints(6, 2);
  counting_mode mode;
  auto policy = mode.policy();
  auto inner = policy.step;
  policy.step = [inner](std::int64_t d) {
    if (d == 3) throw std::runtime_error("the device fell over");
    return inner(d);
  };
  std::optional<train_progress> before;
  policy.failed = [&](std::exception_ptr, const train_progress& p) { before = p; };
  CHECK_THROWS_WITH(run_train_loop(cfg, 0, policy), "the device fell over");
  REQUIRE(before.has_value());
  CHECK(before->step == 3);
  CHECK(before->saved == 2);
  // A policy may replace the error with its own.
  policy.failed = [](std::exception_ptr, const train_progress& p) {
    throw std::runtime_error("stopped in step " + std::to_string(p.step + 1));
  };
  counting_mode again;
  policy.step = [&again, inner = again.policy().step](std::int64_t d) {
    if (d == 3) throw std::runtime_error("the device fell over");
    return inner(d);
  };
  CHECK_THROWS_WITH(run_train_loop(cfg, 0, policy), "stopped in step 4");
}

TEST_CASE("A stop request ends the run before the next step and saves the last one run") {
  const auto cfg = with_checkpoints(10, 4);
  counting_mode mode;
  train_hooks hooks;
  int asked = 0;
  hooks.stop = [&] { return ++asked > 5; };  // asked before each step: stops after step 5
  const auto p = run_train_loop(cfg, 0, mode.policy(), hooks);
  CHECK(p.stopped);
  CHECK(p.step == 5);
  CHECK(mode.saved == std::vector<std::string>{"4 " + cfg.ckpt_dir, "5 " + cfg.ckpt_dir});
  // Stopped before any step: the state is the resumed one, nothing is saved.
  counting_mode idle;
  hooks.stop = [] { return true; };
  const auto q = run_train_loop(cfg, 0, idle.policy(), hooks);
  CHECK(q.stopped);
  CHECK(q.ran == 0);
  CHECK(idle.saved.empty());
}

TEST_CASE("A mode that skips or repeats a step is refused naming the steps") {
  train_config cfg;
  cfg.steps = 3;
  train_policy p;
  p.step = [](std::int64_t) {
    step_result r;
    r.step = 1;  // always the first step
    return r;
  };
  CHECK_THROWS_WITH(run_train_loop(cfg, 0, p),
                    Catch::Contains("the step after 1 steps reported step 1"));
  cfg.ckpt_dir = "/tmp/x";
  train_policy no_save;
  no_save.step = p.step;
  CHECK_THROWS_WITH(run_train_loop(cfg, 0, no_save),
                    Catch::Contains("checkpoint.dir /tmp/x is set but the policy cannot save"));
}

// The single-process trainer's policy: a run of 6 steps checkpointed every 2 steps and stopped
// after 4, then resumed from its checkpoint by a new trainer, gives the losses of the 6 steps run
// at once bit for bit (the learning rate spans train.steps in both); each save hears the step the
// folder held before.
TEST_CASE("The single-process trainer on the loop stops and resumes like an uninterrupted run") {
  const auto dir =
      std::filesystem::temp_directory_path() / ("troupe_loop_" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  auto model = named_model_config("gpt2-demo").value();
  train_config c;
  c.batch = 2;
  c.seq = 16;
  c.steps = 6;
  c.warmup = 2;
  c.seed = 5;
  struct run {
    std::vector<double> losses;
    std::vector<std::string> saves;
    train_progress progress;
  };
  auto train = [&](const train_config& cfg, std::int64_t stop_after) {
    auto m = make_causal_lm(model, {cfg.batch, cfg.seq});
    if (cfg.resume.empty()) m->init_weights(cfg.seed);
    trainer t(*m, cfg);
    if (!cfg.resume.empty()) t.resume(cfg.resume, model).value();
    run out;
    train_hooks hooks;
    hooks.on_step = [&](const step_result& r) { out.losses.push_back(r.loss); };
    hooks.on_save = [&](std::int64_t step, const std::string&, std::optional<std::int64_t> held) {
      out.saves.push_back(std::to_string(step) + (held ? " held " + std::to_string(*held) : ""));
    };
    hooks.stop = [&] { return t.steps_done() == stop_after; };
    out.progress = run_train_loop(cfg, t.steps_done(), trainer_policy(t, model, rows_of), hooks);
    return out;
  };
  const auto whole = train(c, -1);
  REQUIRE(whole.losses.size() == 6);
  auto first = c;
  first.ckpt_dir = (dir / "ck").string();
  first.ckpt_every = 2;
  const auto head = train(first, 4);
  CHECK(head.progress.stopped);
  CHECK(head.saves == std::vector<std::string>{"2", "4 held 2"});
  auto rest = c;
  rest.resume = first.ckpt_dir;
  const auto tail = train(rest, -1);
  CHECK(tail.progress.first == 4);
  std::vector<double> both = head.losses;
  both.insert(both.end(), tail.losses.begin(), tail.losses.end());
  CHECK(both == whole.losses);
  std::filesystem::remove_all(dir);
}
