// Memory maps and atomic writes (see file_io.hpp).
#include "models/hf/file_io.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

namespace troupe::models::hf {

namespace fs = std::filesystem;

namespace {

std::string errno_text(int e) {
  return std::strerror(e);
}

}  // namespace

std::string in_quotes(std::string_view s) {
  std::string q;
  q.reserve(s.size() + 2);
  q += '\'';
  q += s;
  q += '\'';
  return q;
}

// ---- mapped_file ----------------------------------------------------------------------------

mapped_file::mapped_file(const fs::path& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open '", path.string(), "': ", errno_text(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    fail("cannot stat '", path.string(), "': ", errno_text(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("'", path.string(), "' is not a regular file");
  }
  size_ = static_cast<std::size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      size_ = 0;
      fail("cannot map '", path.string(), "': ", errno_text(e));
    }
    data_ = static_cast<std::byte*>(p);
  }
  ::close(fd);  // the mapping keeps the file alive
}

mapped_file& mapped_file::operator=(mapped_file&& o) noexcept {
  if (this != &o) {
    release();
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

void mapped_file::release() noexcept {
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
  size_ = 0;
}

std::string read_text_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open '", path.string(), "': ", errno_text(errno));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) fail("cannot read '", path.string(), "'");
  return text;
}

// ---- atomic_file ----------------------------------------------------------------------------

atomic_file::atomic_file(fs::path path) : path_(std::move(path)) {
  const fs::path tmp = temp_path();
  fd_ = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail("cannot create '", tmp.string(), "': ", errno_text(errno));
}

atomic_file& atomic_file::operator=(atomic_file&& o) noexcept {
  if (this != &o) {
    discard();
    path_ = std::move(o.path_);
    fd_ = std::exchange(o.fd_, -1);
    committed_ = std::exchange(o.committed_, true);
    written_ = o.written_;
  }
  return *this;
}

atomic_file::~atomic_file() {
  discard();
}

void atomic_file::discard() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!committed_ && !path_.empty()) ::unlink(temp_path().c_str());
  committed_ = true;
}

fs::path atomic_file::temp_path() const {
  fs::path tmp = path_;
  tmp += ".tmp";
  return tmp;
}

void atomic_file::write(const void* data, std::size_t bytes) {
  if (fd_ < 0) fail("'", temp_path().string(), "' is already closed");
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::write(fd_, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      fail("cannot write '", temp_path().string(), "' (", written_,
           " bytes written): ", errno_text(n < 0 ? errno : ENOSPC));
    p += n;
    bytes -= static_cast<std::size_t>(n);
    written_ += static_cast<std::uint64_t>(n);
  }
}

void atomic_file::finish() {
  if (fd_ < 0) return;
  if (::fsync(fd_) != 0) fail("cannot sync '", temp_path().string(), "': ", errno_text(errno));
  int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) fail("cannot close '", temp_path().string(), "': ", errno_text(errno));
}

void atomic_file::commit() {
  if (committed_) fail("'", path_.string(), "' is already committed");
  finish();
  const fs::path tmp = temp_path();
  if (::rename(tmp.c_str(), path_.c_str()) != 0)
    fail("cannot rename '", tmp.string(), "' to '", path_.string(), "': ", errno_text(errno));
  committed_ = true;
  sync_directory(path_.has_parent_path() ? path_.parent_path() : fs::path("."));
}

void write_text_file_atomically(const fs::path& path, std::string_view text) {
  atomic_file f(path);
  f.write(text);
  f.commit();
}

void sync_directory(const fs::path& dir) {
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) fail("cannot open directory '", dir.string(), "': ", errno_text(errno));
  int rc = ::fsync(fd);
  int e = errno;
  ::close(fd);
  if (rc != 0 && e != EINVAL) fail("cannot sync directory '", dir.string(), "': ", errno_text(e));
}

}  // namespace troupe::models::hf
