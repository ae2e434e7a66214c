// The run's identity in trainer_state.json and the resume checks (run_state.hpp).
#include "models/run_state.hpp"

#include <filesystem>
#include <system_error>

#include <fmt/core.h>
#include <nlohmann/json.hpp>

#include "memory/error.hpp"
#include "models/hf/training_state.hpp"
#include "scheduler/plan.hpp"

namespace troupe::models {

std::string data_identity(const train_config& cfg) {
  const bool tokens = !cfg.data_tokens.empty();
  const std::filesystem::path path = tokens ? cfg.data_tokens : cfg.data_text;
  std::error_code ec;
  auto absolute = std::filesystem::weakly_canonical(path, ec);
  return fmt::format("{} {}", tokens ? "data.tokens" : "data.text",
                     ec ? path.string() : absolute.string());
}

std::string run_extra_json(const train_config& cfg) {
  nlohmann::json j = {{"seed", cfg.seed},
                      {"precision", cfg.precision},
                      {"loss_scale", 1.0},
                      {"good_steps", 0},
                      {"data", data_identity(cfg)},
                      {"batch", cfg.batch},
                      {"grad_accum", cfg.grad_accum},
                      {"seq", cfg.seq},
                      {"fixed_batch", cfg.fixed_batch},
                      {"lr", cfg.lr},
                      {"min_lr", cfg.min_lr},
                      {"warmup", cfg.warmup},
                      {"steps", cfg.steps},
                      {"plan", scheduler::describe(cfg.plan)}};
  return j.dump();
}

void check_data_position(const std::string& extra_json, const train_config& cfg,
                         const std::string& file) {
  auto j = nlohmann::json::parse(extra_json, nullptr, false);
  if (!j.is_object()) return;
  auto same = [&](const char* key, const char* setting, const auto& now) {
    if (!j.contains(key)) return;
    TROUPE_CHECK(j[key] == nlohmann::json(now), "checkpoint.resume: '", file,
                 "' was written by a run with ", setting, " = ", j[key].dump(),
                 " but this run has ", nlohmann::json(now).dump(),
                 ": its steps would not read the batches the saved run was to read next");
  };
  same("seed", "train.seed (--seed)", cfg.seed);
  same("data", "the data (data.tokens / data.text, --tokens / --text)", data_identity(cfg));
  same("batch", "train.batch (--batch)", cfg.batch);
  same("grad_accum", "train.grad_accum (--grad-accum)", cfg.grad_accum);
  same("seq", "train.seq (--seq)", cfg.seq);
  same("fixed_batch", "train.fixed_batch (--fixed-batch)", cfg.fixed_batch);
}

void check_steps_left(std::int64_t saved_step, const train_config& cfg, const std::string& folder) {
  TROUPE_CHECK(saved_step < cfg.steps, "checkpoint.resume: '", folder, "' is at step ", saved_step,
               " but train.steps (--steps) is ", cfg.steps,
               ": nothing is left to train; give train.steps (--steps) above ", saved_step,
               " to go on (the learning-rate schedule spans train.steps)");
}

std::string run_state_extra(const train_config& cfg, const std::string& own) {
  auto extra = nlohmann::json::parse(run_extra_json(cfg));
  extra.update(nlohmann::json::parse(own));
  return extra.dump();
}

expected<hf::training_state> resumable_state(const std::filesystem::path& folder,
                                             const train_config& cfg, const shape& moments) {
  auto file = hf::training_state_file::open(folder, moments);
  if (!file) return expected<hf::training_state>::failure(file.error_message());
  try {
    check_data_position(file->state().extra_json, cfg, (folder / "trainer_state.json").string());
  } catch (const error& e) {
    return expected<hf::training_state>::failure(e.what());
  }
  return file->state();
}

}  // namespace troupe::models
