#include <catch2/catch.hpp>

#include <unistd.h>
#include <cstdio>
#include <fstream>

#include "models/data_source.hpp"
#include "models/text/token_file.hpp"

using namespace troupe::models;

TEST_CASE("a token file source gives rows of seq consecutive tokens, the same for the same draw") {
  std::string path = "/tmp/troupe_ds_" + std::to_string(::getpid()) + ".tok";
  std::vector<std::int32_t> ids(5000);
  for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<std::int32_t>(i % 1000);
  write_token_file(path, ids, 1000);
  auto ds = open_data_source(path, "", 1000, 42);
  REQUIRE(ds.has_value());
  CHECK(ds->tokens == 5000);
  std::vector<std::int32_t> a, b, c;
  ds->rows(3, 4, 16, a);
  ds->rows(3, 4, 16, b);
  ds->rows(4, 4, 16, c);
  REQUIRE(a.size() == 64);
  CHECK(a == b);
  CHECK(a != c);
  for (int r = 0; r < 4; ++r)
    for (int i = 1; i < 16; ++i) CHECK((a[r * 16 + i - 1] + 1) % 1000 == a[r * 16 + i]);
  // A model whose vocabulary is smaller than the file's ids is refused, naming the file.
  auto small = open_data_source(path, "", 500, 42);
  REQUIRE(!small.has_value());
  CHECK_THAT(small.error_message(), Catch::Contains(path));
  std::remove(path.c_str());
}

TEST_CASE("a text source needs a byte vocabulary and names a missing path") {
  std::string path = "/tmp/troupe_ds_" + std::to_string(::getpid()) + ".txt";
  std::ofstream(path) << "hello world, hello troupe\n";
  CHECK(open_data_source("", path, 256, 1).has_value());
  auto tiny = open_data_source("", path, 100, 1);
  REQUIRE(!tiny.has_value());
  CHECK_THAT(tiny.error_message(), Catch::Contains("at least 256"));
  auto missing = open_data_source("", "/no/such/text", 256, 1);
  REQUIRE(!missing.has_value());
  CHECK_THAT(missing.error_message(), Catch::Contains("/no/such/text"));
  std::remove(path.c_str());
}
