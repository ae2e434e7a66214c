// train.device (--device): where the single-process trainer puts its model (train_config.hpp).
#include <catch2/catch.hpp>

#include <cstdio>
#include <exception>

#include "models/train_config.hpp"

using namespace troupe;
using namespace troupe::models;

TEST_CASE("train.device auto takes a visible GPU only for runs the GPU path trains") {
  train_config c;
  REQUIRE(c.compute_device == "auto");
  CHECK(trains_on_gpu(c, true));
  CHECK_FALSE(trains_on_gpu(c, false));
  train_config f64 = c;
  f64.precision = "f64";
  CHECK_FALSE(trains_on_gpu(f64, true));
  train_config planned = c;
  planned.plan.dp = 2;
  CHECK_FALSE(trains_on_gpu(planned, true));
  train_config tiers = c;
  tiers.mem_device = 64 << 20;
  CHECK_FALSE(trains_on_gpu(tiers, true));
  train_config cpu = c;
  cpu.compute_device = "cpu";
  CHECK_FALSE(trains_on_gpu(cpu, true));
}

TEST_CASE("train.device cuda without a GPU or with what the GPU path lacks is refused by name",
          "[faults]") {
  train_config c;
  c.compute_device = "cuda";
  c.validate();
  CHECK(trains_on_gpu(c, true));
  REQUIRE_THROWS_WITH(trains_on_gpu(c, false), Catch::Contains("train.device (--device)") &&
                                                   Catch::Contains("no GPU is visible"));
  REQUIRE_THROWS_WITH(trains_on_gpu(c, false, false), Catch::Contains("built without CUDA"));
  train_config planned = c;
  planned.plan.tp = 2;
  REQUIRE_THROWS_WITH(planned.validate(), Catch::Contains("train.device (--device)") &&
                                              Catch::Contains("launched plans"));
  train_config f64 = c;
  f64.precision = "f64";
  REQUIRE_THROWS_WITH(f64.validate(), Catch::Contains("no f64 kernels"));
  train_config bad = c;
  bad.compute_device = "gpu";
  REQUIRE_THROWS_WITH(bad.validate(), Catch::Contains("must be auto, cpu or cuda, got 'gpu'"));
  try {
    bad.validate();
  } catch (const std::exception& e) {
    std::printf("faults: train.device = \"gpu\" -> refused: %s\n", e.what());
  }
}

TEST_CASE("train.device is read from the job file and written back") {
  auto c = parse_train_config("[train]\ndevice = \"cpu\"\n", "job.toml").value();
  CHECK(c.compute_device == "cpu");
  CHECK(parse_train_config(to_toml(c), "again").value().compute_device == "cpu");
  auto bad = parse_train_config("[train]\ndevice = \"tpu\"\n", "job.toml");
  REQUIRE_FALSE(bad.has_value());
  CHECK_THAT(bad.error_message(), Catch::Contains("job.toml") && Catch::Contains("train.device"));
}
