// Token files: the training data format, a stream of token ids written by `troupe tokenize` and
// read memory-mapped by the trainer.
//
// Format (all integers little-endian), version 1:
//   offset  size  field
//        0     8  magic "TROUPETK"
//        8     4  version = 1 (u32)
//       12     4  id_bytes (u32): 2 for uint16 ids, 4 for uint32 ids
//       16     8  count (u64): the number of ids
//       24     8  vocab_size (u64, 1..2^31): every id is below it (the tokenizer's vocab size)
//       32     .  count ids of id_bytes each; the file ends right after them
// Opening checks the magic, version, id width, that the size is exactly 32 + count * id_bytes (so
// a truncated or padded file is caught) and that every id is below the vocab size, and names the
// file (and the position of a bad id) when one fails. Documents are not marked beyond the eos ids
// the tokenizer may have put between them.
#pragma once

#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

#include "memory/error.hpp"

namespace troupe::models {

// The width of stored ids; `automatic` picks uint16 when the vocab fits (<= 65536), else uint32.
enum class token_width { automatic = 0, u16 = 2, u32 = 4 };

// Writes a token file: ids are streamed to "<path>.tmp", and close() writes the header, fsyncs and
// renames it to path, so a crash never leaves a half-written file under the final name.
class token_file_writer {
 public:
  token_file_writer(std::string path, std::int64_t vocab_size,
                    token_width width = token_width::automatic);
  ~token_file_writer();  // removes the temporary file when close() was not reached
  token_file_writer(const token_file_writer&) = delete;
  token_file_writer& operator=(const token_file_writer&) = delete;

  // Appends ids; each must lie in [0, vocab_size).
  void append(std::span<const std::int32_t> ids);
  void close();

  std::uint64_t count() const { return count_; }
  int id_bytes() const { return id_bytes_; }

 private:
  std::string path_, tmp_path_;
  std::int64_t vocab_size_;
  int id_bytes_;
  std::uint64_t count_ = 0;
  std::FILE* file_ = nullptr;
  std::vector<unsigned char> buffer_;
};

// Writes ids to a token file in one go.
void write_token_file(const std::string& path, std::span<const std::int32_t> ids,
                      std::int64_t vocab_size, token_width width = token_width::automatic);

// A token file mapped read-only into memory.
class token_dataset {
 public:
  // Opens and validates path. When vocab_size > 0, every id must also be below it (the vocab of
  // the model that will train on the file).
  static expected<token_dataset> open(const std::string& path, std::int64_t vocab_size = 0);

  token_dataset(token_dataset&& other) noexcept;
  token_dataset& operator=(token_dataset&& other) noexcept;
  ~token_dataset();

  const std::string& path() const { return path_; }
  std::uint64_t size() const { return count_; }
  int id_bytes() const { return id_bytes_; }
  std::int64_t vocab_size() const { return vocab_size_; }  // as the header records it
  std::uint32_t operator[](std::uint64_t i) const {
    return id_bytes_ == 2 ? static_cast<const std::uint16_t*>(ids_)[i]
                          : static_cast<const std::uint32_t*>(ids_)[i];
  }
  // Copies ids [start, start + out.size()) into out.
  void read(std::uint64_t start, std::span<std::int32_t> out) const;

  // Batch rows of t+1 tokens for (seed, step), as models/text/batch_sampler.hpp describes.
  void sample_batch(std::uint64_t seed, std::uint64_t step, int batch, int t,
                    std::vector<std::int32_t>& ids) const;

 private:
  token_dataset() = default;
  void unmap();

  std::string path_;
  void* map_ = nullptr;
  std::size_t map_bytes_ = 0;
  const void* ids_ = nullptr;
  std::uint64_t count_ = 0;
  int id_bytes_ = 0;
  std::int64_t vocab_size_ = 0;
};

}  // namespace troupe::models
