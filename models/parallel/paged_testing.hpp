// The dp2 runs the paged ZeRO tests share (paged_moments.test.cpp, paged_shard.test.cpp): the
// rows, the run's settings and a temporary NVMe folder.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "models/train_config.hpp"

namespace troupe::models::testing {

// A trainer::batch_source: draw `draw`'s rows, a fixed function of the draw and the position.
inline void paged_rows(std::uint64_t draw, int batch, int seq, std::vector<std::int32_t>& rows) {
  rows.resize(static_cast<std::size_t>(batch) * seq);
  for (std::size_t i = 0; i < rows.size(); ++i)
    rows[i] = static_cast<std::int32_t>((draw * 131 + i * i * 7 + i * 3 + (i * draw) % 5) % 29);
}

// dp 2, ZeRO `zero`, 4 steps of grad_accum 2 with clipping that acts in the first steps.
inline train_config paged_run(int zero, bool bf16) {
  train_config c;
  c.steps = 4;
  c.batch = 4;
  c.seq = 8;
  c.grad_accum = 2;
  c.lr = 3e-3;
  c.warmup = 2;
  c.clip = 0.5;  // the first steps' norms exceed it
  c.decay_exempt = true;
  c.plan.dp = 2;
  c.plan.zero = zero;
  if (bf16) c.precision = "bf16";
  return c;
}

// A folder under the temporary directory named for the test and this process, removed at the end.
struct temp_folder {
  temp_folder(const std::string& test, const std::string& what)
      : path(std::filesystem::temp_directory_path() /
             ("troupe_" + test + "_" + what + "_" + std::to_string(::getpid()))) {
    std::filesystem::remove_all(path);
  }
  ~temp_folder() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::filesystem::path path;
};

}  // namespace troupe::models::testing
