// Memory maps and atomic writes (see file_io.hpp).
#include "models/hf/file_io.hpp"

#include "models/hf/checkpoint_folder.hpp"

#include <fcntl.h>
#include <stdio.h>  // renameat2
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

// ---- folders replaced as one unit ------------------------------------------------------------

namespace {

// `folder` without a trailing separator ("ck/" -> "ck").
fs::path plain(const fs::path& folder) {
  return folder.has_filename() ? folder : folder.parent_path();
}

fs::path with_suffix(const fs::path& folder, const char* suffix) {
  fs::path p = plain(folder);
  p += suffix;
  return p;
}

fs::path parent_of(const fs::path& dir) {
  return dir.has_parent_path() ? dir.parent_path() : fs::path(".");
}

// create_directories, each new folder's entry synced into its parent.
void create_directories_synced(const fs::path& dir) {
  std::error_code ec;
  if (dir.empty() || fs::is_directory(dir, ec)) return;
  if (dir.has_parent_path() && dir.parent_path() != dir)
    create_directories_synced(dir.parent_path());
  if (!fs::create_directory(dir, ec) && ec)
    fail("cannot create folder '", dir.string(), "': ", ec.message());
  sync_directory(parent_of(dir));
}

}  // namespace

fs::path staging_folder(const fs::path& folder) {
  return with_suffix(folder, ".partial");
}

fs::path old_folder(const fs::path& folder) {
  return with_suffix(folder, ".old");
}

fs::path stage_folder(const fs::path& folder) {
  const fs::path dir = plain(folder), staged = staging_folder(folder);
  // Nothing is removed or replaced that troupe did not write (checkpoint_folder.hpp).
  check_replaceable(dir, "checkpoint folder");
  check_replaceable(staged, "the folder a checkpoint save writes first");
  check_replaceable(old_folder(folder), "the folder a checkpoint save moves the previous one to");
  create_directories_synced(parent_of(dir));
  std::error_code ec;
  fs::remove_all(staged, ec);
  if (ec) fail("cannot empty '", staged.string(), "': ", ec.message());
  fs::create_directory(staged, ec);
  if (ec) fail("cannot create folder '", staged.string(), "': ", ec.message());
  write_checkpoint_marker(staged);  // first: a save cut off from here on is recognised as ours
  return staged;
}

void publish_folder(const fs::path& folder, bool one_rename) {
  const fs::path dir = plain(folder), staged = staging_folder(folder);
  const fs::path old = old_folder(folder), parent = parent_of(dir);
  // Checked again: the folder may have changed since the save began (hours, for a large model).
  try {
    check_replaceable(dir, "checkpoint folder");
    check_replaceable(old, "the folder a checkpoint save moves the previous one to");
  } catch (const troupe::error& e) {
    fail(e.what(), " (the new checkpoint is in '", staged.string(), "')");
  }
  sync_directory(staged);
  std::error_code ec;
  const bool had = fs::exists(dir, ec);
  bool swapped = false;
  if (had && one_rename) {
    swapped = ::renameat2(AT_FDCWD, staged.c_str(), AT_FDCWD, dir.c_str(), RENAME_EXCHANGE) == 0;
    const int e = errno;
    if (!swapped && e != EINVAL && e != ENOSYS && e != ENOTSUP)
      fail("cannot swap '", staged.string(), "' with the previous checkpoint '", dir.string(),
           "': ", errno_text(e), " (the new one is in '", staged.string(), "')");
  }
  if (had && !swapped) {  // no RENAME_EXCHANGE here: two renames
    fs::remove_all(old, ec);
    fs::rename(dir, old, ec);
    if (ec)
      fail("cannot move the previous checkpoint '", dir.string(), "' to '", old.string(),
           "': ", ec.message(), " (the new one is in '", staged.string(), "')");
  }
  if (!swapped) {
    fs::rename(staged, dir, ec);
    if (ec) {
      std::error_code back;
      if (had) fs::rename(old, dir, back);
      fail("cannot rename '", staged.string(), "' to '", dir.string(), "': ", ec.message());
    }
  }
  sync_directory(parent);  // the new `folder` is durable before the previous one goes
  if (swapped) fs::remove_all(staged, ec);  // the previous one, now under `.partial`
  // The previous one moved there, or one an earlier save cut off between its renames left
  // (checked above; checked again as the remove is the one step that deletes).
  if (survey_folder(old).replaceable()) fs::remove_all(old, ec);
}

std::string interrupted_save_note(const fs::path& folder) {
  const fs::path dir = plain(folder), old = old_folder(folder);
  std::error_code ec;
  if (fs::exists(dir, ec) || !fs::is_directory(old, ec)) return "";
  const auto step = checkpoint_step(old);
  return " ('" + dir.string() + "' is missing but '" + old.string() +
         "' is there: a save was cut off while it replaced the checkpoint, and '" + old.string() +
         "' is the previous one" + (step ? ", step " + std::to_string(*step) : std::string()) +
         ", complete; rename it to '" + dir.string() + "' to resume from it)";
}

}  // namespace troupe::models::hf
