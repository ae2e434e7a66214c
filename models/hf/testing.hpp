// Helpers for the checkpoint tests: scratch folders, the checked-in fixtures, raw file surgery,
// and a simulated full disk.
#pragma once

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <csignal>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <stdexcept>
#include <string>
#include <vector>

namespace troupe::models::hf::testing {

namespace fs = std::filesystem;

// A fresh, empty folder under the system's temp directory, removed when destroyed.
class temp_dir {
 public:
  temp_dir() {
    static std::atomic<int> counter{0};
    path_ = fs::temp_directory_path() /
            ("troupe-hf-test-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~temp_dir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  temp_dir(const temp_dir&) = delete;
  temp_dir& operator=(const temp_dir&) = delete;
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& name) const { return path_ / name; }

 private:
  fs::path path_;
};

// tests/fixtures/hf/ of the source tree (TROUPE_SOURCE_DIR: set for test binaries by CMake).
inline fs::path fixture_dir() {
  return fs::path(TROUPE_SOURCE_DIR) / "tests" / "fixtures" / "hf";
}

inline std::string read_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// A safetensors file from a header text (not padded) and data bytes, for malformed cases.
inline std::string raw_safetensors(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  std::uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out + header + data;
}

// `s` with the first `from` replaced by `to` (throws when `from` is absent, failing the test).
inline std::string replace_first(const std::string& s, const std::string& from,
                                 const std::string& to) {
  const auto at = s.find(from);
  if (at == std::string::npos) throw std::runtime_error("replace_first: '" + from + "' not found");
  return s.substr(0, at) + to + s.substr(at + from.size());
}

// The names of the files in a folder, sorted.
inline std::vector<std::string> list_files(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// While alive, a file may not grow beyond `bytes` (RLIMIT_FSIZE): writes past it fail with EFBIG,
// as on a full disk. SIGXFSZ is ignored meanwhile so the process is not killed.
class file_size_limit {
 public:
  explicit file_size_limit(std::uint64_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &old_);
    old_handler_ = std::signal(SIGXFSZ, SIG_IGN);
    rlimit lim = old_;
    lim.rlim_cur = bytes;
    ::setrlimit(RLIMIT_FSIZE, &lim);
  }
  ~file_size_limit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    std::signal(SIGXFSZ, old_handler_);
  }
  file_size_limit(const file_size_limit&) = delete;
  file_size_limit& operator=(const file_size_limit&) = delete;

 private:
  rlimit old_{};
  void (*old_handler_)(int) = nullptr;
};

}  // namespace troupe::models::hf::testing
