#include "models/byte_data.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "memory/error.hpp"

namespace troupe::models {
namespace fs = std::filesystem;

namespace {
void append_file(const fs::path& p, std::vector<std::uint8_t>& out) {
  std::ifstream in(p, std::ios::binary);
  TROUPE_CHECK(in.good(), "cannot read corpus file ", p.string());
  std::string line;
  while (std::getline(in, line)) {
    if (line == "%") line.clear();  // fortune(6) separator
    out.insert(out.end(), line.begin(), line.end());
    out.push_back('\n');
  }
}

std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}
}  // namespace

std::vector<std::uint8_t> read_text_corpus(const std::string& path) {
  std::error_code ec;
  TROUPE_CHECK(fs::exists(path, ec), "corpus path ", path, " does not exist");
  std::vector<std::uint8_t> out;
  if (fs::is_directory(path, ec)) {
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(path))
      if (e.is_regular_file() && e.path().extension() != ".dat") files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) append_file(f, out);
  } else {
    append_file(path, out);
  }
  TROUPE_CHECK(!out.empty(), "corpus ", path, " holds no text");
  return out;
}

void sample_batch(const std::vector<std::uint8_t>& corpus, std::uint64_t seed, std::uint64_t step,
                  int batch, int t, std::vector<std::int32_t>& ids) {
  TROUPE_CHECK(batch > 0 && t > 0, "sample_batch: batch and sequence length must be positive");
  TROUPE_CHECK(corpus.size() > static_cast<std::size_t>(t) + 1, "sample_batch: corpus of ",
               corpus.size(), " bytes is shorter than a row of ", t + 1, " tokens");
  ids.resize(static_cast<std::size_t>(batch) * (t + 1));
  std::uint64_t span = corpus.size() - static_cast<std::size_t>(t) - 1;
  for (int b = 0; b < batch; ++b) {
    std::uint64_t r = splitmix64(splitmix64(seed) ^ splitmix64(step * 1315423911ull + b));
    std::size_t start = r % span;
    for (int i = 0; i <= t; ++i) ids[static_cast<std::size_t>(b) * (t + 1) + i] = corpus[start + i];
  }
}

}  // namespace troupe::models
