// Token files: round trips in both id widths, the errors of truncated or corrupt files, and batches
// as a pure function of (seed, step).
#include <catch2/catch.hpp>

#include <unistd.h>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>

#include "models/byte_data.hpp"
#include "models/text/batch_sampler.hpp"
#include "models/text/token_file.hpp"

namespace fs = std::filesystem;
using namespace troupe::models;

namespace {

struct temp_file {
  fs::path path;
  temp_file() {
    static int n = 0;
    path = fs::temp_directory_path() /
           ("troupe-tokens-" + std::to_string(::getpid()) + "-" + std::to_string(n++) + ".bin");
  }
  ~temp_file() { fs::remove(path); }
  std::string str() const { return path.string(); }
};

std::vector<std::int32_t> random_ids(std::size_t n, std::int32_t vocab, unsigned seed) {
  std::mt19937 gen(seed);
  std::vector<std::int32_t> ids(n);
  for (auto& id : ids) id = static_cast<std::int32_t>(gen() % vocab);
  return ids;
}

std::string file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void put_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

template <class T>
void poke(std::string& bytes, std::size_t offset, T value) {
  std::memcpy(bytes.data() + offset, &value, sizeof value);
}

}  // namespace

TEST_CASE("Token files round trip uint16 and uint32 ids", "[cpu]") {
  for (std::int64_t vocab : {256, 65536, 100000}) {
    INFO("vocab " << vocab);
    temp_file f;
    auto ids = random_ids(10007, static_cast<std::int32_t>(vocab), 3);
    ids[0] = static_cast<std::int32_t>(vocab - 1);
    {
      token_file_writer w(f.str(), vocab);
      w.append(std::span(ids).first(5000));
      w.append(std::span(ids).subspan(5000));
      CHECK(!fs::exists(f.path));  // only the temporary file exists until close
      w.close();
    }
    CHECK(!fs::exists(f.str() + ".tmp"));
    int width = vocab <= 65536 ? 2 : 4;
    CHECK(fs::file_size(f.path) == 32 + ids.size() * width);
    auto d = token_dataset::open(f.str(), vocab).value();
    CHECK(d.size() == ids.size());
    CHECK(d.id_bytes() == width);
    CHECK(d.vocab_size() == vocab);
    // The bytes are the documented little-endian layout.
    std::string raw = file_bytes(f.path);
    CHECK(raw.substr(0, 8) == "TROUPETK");
    for (std::size_t i : {std::size_t{0}, std::size_t{1}, ids.size() - 1}) {
      std::uint32_t v = 0;
      std::memcpy(&v, raw.data() + 32 + i * width, width);
      CHECK(v == static_cast<std::uint32_t>(ids[i]));
    }
    std::vector<std::int32_t> back(ids.size());
    d.read(0, back);
    CHECK(back == ids);
  }
}

TEST_CASE("An unfinished token file leaves nothing under its name", "[cpu]") {
  temp_file f;
  {
    token_file_writer w(f.str(), 256);
    std::vector<std::int32_t> ids = {1, 2, 3};
    w.append(ids);
  }
  CHECK(!fs::exists(f.path));
  CHECK(!fs::exists(f.str() + ".tmp"));
}

TEST_CASE("Writing an id outside the vocab is an error naming its position", "[cpu]") {
  temp_file f;
  token_file_writer w(f.str(), 100);
  std::vector<std::int32_t> ids = {5, 99, 100};
  REQUIRE_THROWS_WITH(w.append(ids), Catch::Contains("id 100 at position 2"));
  REQUIRE_THROWS_WITH(token_file_writer(f.str(), 70000, token_width::u16),
                      Catch::Contains("does not fit uint16"));
}

TEST_CASE("Truncated and corrupt token files give errors naming the file", "[cpu]") {
  temp_file f;
  auto ids = random_ids(1000, 500, 5);
  write_token_file(f.str(), ids, 500);
  const std::string good = file_bytes(f.path);
  auto error_of = [&](const std::string& bytes, std::int64_t vocab = 0) {
    put_bytes(f.path, bytes);
    auto r = token_dataset::open(f.str(), vocab);
    REQUIRE(!r.has_value());
    CHECK_THAT(r.error_message(), Catch::Contains("token file " + f.str()));
    return r.error_message();
  };
  CHECK_THAT(error_of(good.substr(0, good.size() - 1)), Catch::Contains("truncated"));
  CHECK_THAT(error_of(good.substr(0, 20)), Catch::Contains("too short"));
  CHECK_THAT(error_of(good + "xx"), Catch::Contains("longer than its header says"));
  std::string bad = good;
  bad[0] = 'X';
  CHECK_THAT(error_of(bad), Catch::Contains("not a troupe token file"));
  bad = good;
  poke<std::uint32_t>(bad, 8, 7);
  CHECK_THAT(error_of(bad), Catch::Contains("version 7 is not supported"));
  bad = good;
  poke<std::uint32_t>(bad, 12, 3);
  CHECK_THAT(error_of(bad), Catch::Contains("id width of 3 bytes"));
  bad = good;
  poke<std::uint64_t>(bad, 16, ~std::uint64_t{0});
  CHECK_THAT(error_of(bad), Catch::Contains("truncated"));
  bad = good;
  poke<std::uint16_t>(bad, 32 + 2 * 777, 500);
  CHECK_THAT(error_of(bad), Catch::Contains("id 500 at position 777") &&
                                Catch::Contains("header's vocab size 500"));
  // The model's vocab is smaller than the file's: the first id beyond it is named.
  std::size_t first =
      std::find_if(ids.begin(), ids.end(), [](auto id) { return id >= 300; }) - ids.begin();
  CHECK_THAT(error_of(good, 300), Catch::Contains("id " + std::to_string(ids[first]) +
                                                  " at position " + std::to_string(first)) &&
                                      Catch::Contains("model's vocab size 300"));
  put_bytes(f.path, good);
  CHECK(token_dataset::open(f.str(), 500).has_value());
  CHECK_THAT(token_dataset::open(f.str() + ".missing").error_message(),
             Catch::Contains(".missing: cannot open"));
}

TEST_CASE("Batches are a pure function of seed and step", "[cpu]") {
  temp_file f;
  auto ids = random_ids(5000, 50000, 9);
  write_token_file(f.str(), ids, 50000);
  auto d = token_dataset::open(f.str()).value();
  const int batch = 4, t = 16;
  std::vector<std::int32_t> a, b, c;
  d.sample_batch(42, 7, batch, t, a);
  d.sample_batch(42, 7, batch, t, b);
  CHECK(a == b);
  REQUIRE(a.size() == static_cast<std::size_t>(batch * (t + 1)));
  // Every row is t+1 consecutive tokens of the file, at the sampler's offset for (seed, step, row).
  for (int r = 0; r < batch; ++r) {
    std::uint64_t start = batch_row_start(42, 7, r, ids.size(), t);
    REQUIRE(start + t + 1 <= ids.size());
    for (int i = 0; i <= t; ++i) CHECK(a[r * (t + 1) + i] == ids[start + i]);
  }
  // Other steps and seeds draw other rows; a reopened file gives the same batches.
  std::set<std::vector<std::int32_t>> seen;
  for (std::uint64_t step = 0; step < 20; ++step) {
    d.sample_batch(42, step, batch, t, c);
    seen.insert(c);
  }
  d.sample_batch(43, 7, batch, t, c);
  seen.insert(c);
  CHECK(seen.size() == 21);
  auto again = token_dataset::open(f.str()).value();
  again.sample_batch(42, 7, batch, t, c);
  CHECK(c == a);
  REQUIRE_THROWS_WITH(d.sample_batch(1, 1, 1, 5000, c), Catch::Contains("shorter than a row"));
}

TEST_CASE("Byte corpora and token files share one batch sampler", "[cpu]") {
  std::vector<std::uint8_t> corpus(3000);
  std::mt19937 gen(1);
  for (auto& byte : corpus) byte = static_cast<std::uint8_t>(gen());
  temp_file f;
  write_token_file(f.str(), std::vector<std::int32_t>(corpus.begin(), corpus.end()), 256);
  auto d = token_dataset::open(f.str(), 256).value();
  std::vector<std::int32_t> from_bytes, from_file;
  for (std::uint64_t step : {0, 1, 1000}) {
    sample_batch(corpus, 5, step, 3, 32, from_bytes);
    d.sample_batch(5, step, 3, 32, from_file);
    CHECK(from_bytes == from_file);
  }
}
