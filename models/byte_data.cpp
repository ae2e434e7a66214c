#include "models/byte_data.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <sstream>

#include "memory/error.hpp"
#include "models/text/batch_sampler.hpp"

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

}  // namespace

std::vector<std::uint8_t> read_text_corpus(const std::string& path) {
  std::error_code ec;
  TROUPE_CHECK(fs::exists(path, ec), "corpus path ", path, " does not exist");
  std::vector<std::uint8_t> out;
  if (fs::is_directory(path, ec)) {
    std::vector<fs::path> files;
    for (const auto& e : fs::directory_iterator(path))
      // fortune(6) folders hold each file twice (NAME and a NAME.u8 symlink): skip links.
      if (e.is_regular_file() && !e.is_symlink() && e.path().extension() != ".dat")
        files.push_back(e.path());
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
  sample_batch_rows(std::span<const std::uint8_t>(corpus), "byte corpus", seed, step, batch, t,
                    ids);
}

}  // namespace troupe::models
