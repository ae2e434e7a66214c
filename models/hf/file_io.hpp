// file_io: the file plumbing of HF checkpoints: read-only memory maps, atomic writes, and the
// conversion of thrown errors into expected<T> at the module boundary.
//
// An atomic write goes to `<path>.tmp`, is fsync'ed and closed (finish), then renamed over `path`
// and the directory fsync'ed (commit). A crash or an error before commit leaves any existing
// `path` untouched; an atomic_file destroyed before commit removes its temporary file. Writers of
// several files (sharded checkpoints) finish all of them before committing any.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>

#include "memory/error.hpp"

namespace troupe::models::hf {

// Throws troupe::error with the message (no source location: these messages are for users).
template <class... Args>
[[noreturn]] void fail(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  throw troupe::error(os.str());
}

// 's' (for messages).
std::string in_quotes(std::string_view s);

// Runs f() and returns its value, or the message of a troupe::error it threw as a failure.
template <class F>
auto as_expected(F&& f) -> expected<decltype(f())> {
  using T = decltype(f());
  try {
    return expected<T>(f());
  } catch (const troupe::error& e) {
    return expected<T>::failure(e.what());
  }
}

// A whole file mapped read-only. Move-only; unmaps when destroyed.
class mapped_file {
 public:
  mapped_file() = default;
  explicit mapped_file(const std::filesystem::path& path);  // throws troupe::error
  mapped_file(mapped_file&& o) noexcept { *this = std::move(o); }
  mapped_file& operator=(mapped_file&& o) noexcept;
  mapped_file(const mapped_file&) = delete;
  mapped_file& operator=(const mapped_file&) = delete;
  ~mapped_file() { release(); }

  const std::byte* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  void release() noexcept;
  std::byte* data_ = nullptr;
  std::size_t size_ = 0;
};

// The contents of a (small) text file, e.g. config.json. Throws troupe::error naming the file.
std::string read_text_file(const std::filesystem::path& path);

class atomic_file {
 public:
  explicit atomic_file(std::filesystem::path path);  // creates `<path>.tmp`; throws
  atomic_file(atomic_file&& o) noexcept { *this = std::move(o); }
  atomic_file& operator=(atomic_file&& o) noexcept;
  atomic_file(const atomic_file&) = delete;
  atomic_file& operator=(const atomic_file&) = delete;
  ~atomic_file();  // removes the temporary file unless committed

  void write(const void* data, std::size_t bytes);  // throws troupe::error naming the file
  void write(std::string_view s) { write(s.data(), s.size()); }
  void finish();  // fsync and close the temporary file
  void commit();  // finish if needed, rename over the target, fsync the directory
  std::uint64_t bytes_written() const { return written_; }
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path temp_path() const;

 private:
  void discard() noexcept;
  std::filesystem::path path_;
  int fd_ = -1;
  bool committed_ = false;
  std::uint64_t written_ = 0;
};

// Writes a whole text file atomically.
void write_text_file_atomically(const std::filesystem::path& path, std::string_view text);

// fsync of a directory, so that a rename inside it is durable.
void sync_directory(const std::filesystem::path& dir);

// A folder replaced as one unit (hf::save_folder_atomically, hybrid_trainer::save). The new one
// is written in `<folder>.partial`, its files committed (atomic_file: synced), then put in place:
//   stage_folder(folder)    creates folder's missing parents (each synced into its own parent),
//                           empties `<folder>.partial` and creates it; returns it.
//   publish_folder(folder)  syncs `<folder>.partial`, swaps it with `folder` in one rename
//                           (renameat2 RENAME_EXCHANGE), syncs the parent, then removes the
//                           previous folder. So after a crash `folder` is the old or the new one,
//                           whole. On a file system without the exchange: `folder` -> `<folder>
//                           .old`, `<folder>.partial` -> `folder`, sync, remove `.old`; a crash
//                           between the two renames leaves only `<folder>.old` (complete), which
//                           interrupted_save_note names.
// Both throw troupe::error naming the folder; a failed publish leaves `folder` as it was.
// Neither removes or replaces a folder troupe did not write: stage_folder first checks `folder`,
// `<folder>.partial` and `<folder>.old` (checkpoint_folder.hpp: each absent, empty or a troupe
// checkpoint with nothing else in it) and writes the marker into the new `<folder>.partial`;
// publish_folder checks `folder` and `<folder>.old` again before it swaps.
std::filesystem::path staging_folder(const std::filesystem::path& folder);  // `<folder>.partial`
std::filesystem::path old_folder(const std::filesystem::path& folder);      // `<folder>.old`
std::filesystem::path stage_folder(const std::filesystem::path& folder);
// one_rename = false takes the two renames even where the exchange works (for tests).
void publish_folder(const std::filesystem::path& folder, bool one_rename = true);
// For errors about a missing `folder`: when `<folder>.old` is there instead (a save cut off while
// it replaced the folder), a note naming it and how to resume from it; else "".
std::string interrupted_save_note(const std::filesystem::path& folder);

}  // namespace troupe::models::hf
