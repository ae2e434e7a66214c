// Token files: the writer (temporary file, header, fsync, rename) and the memory-mapped reader.
#include "models/text/token_file.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <utility>

#include "models/text/batch_sampler.hpp"

namespace troupe::models {
namespace {

static_assert(std::endian::native == std::endian::little,
              "token files are little-endian and read in place: a big-endian host needs swaps");

constexpr char kMagic[8] = {'T', 'R', 'O', 'U', 'P', 'E', 'T', 'K'};
constexpr std::uint32_t kVersion = 1;
constexpr std::size_t kHeaderBytes = 32;

struct header {
  char magic[8];
  std::uint32_t version;
  std::uint32_t id_bytes;
  std::uint64_t count;
  std::uint64_t vocab_size;
};
static_assert(sizeof(header) == kHeaderBytes);

// The position of the first id >= limit in ids[0, n), or n. Scans in blocks whose maximum
// vectorizes; only a block holding a bad id is searched element by element.
template <class Id>
std::uint64_t first_id_at_or_above(const Id* ids, std::uint64_t n, std::uint64_t limit) {
  constexpr std::uint64_t kBlock = 1 << 16;
  for (std::uint64_t lo = 0; lo < n; lo += kBlock) {
    std::uint64_t hi = std::min(n, lo + kBlock);
    Id mx = 0;
    for (std::uint64_t i = lo; i < hi; ++i) mx = std::max(mx, ids[i]);
    if (mx < limit) continue;
    for (std::uint64_t i = lo; i < hi; ++i)
      if (ids[i] >= limit) return i;
  }
  return n;
}

}  // namespace

// ---- writer ------------------------------------------------------------------------------------

token_file_writer::token_file_writer(std::string path, std::int64_t vocab_size, token_width width)
    : path_(std::move(path)), tmp_path_(path_ + ".tmp"), vocab_size_(vocab_size) {
  TROUPE_CHECK(vocab_size > 0 && vocab_size <= (std::int64_t{1} << 31), "token file ", path_,
               ": vocab size ", vocab_size, " must lie in [1, 2^31]");
  if (width == token_width::automatic)
    width = vocab_size <= 65536 ? token_width::u16 : token_width::u32;
  id_bytes_ = static_cast<int>(width);
  TROUPE_CHECK(id_bytes_ == 4 || vocab_size <= 65536, "token file ", path_, ": vocab size ",
               vocab_size, " does not fit uint16 ids");
  file_ = std::fopen(tmp_path_.c_str(), "wb");
  TROUPE_CHECK(file_, "token file: cannot create ", tmp_path_, ": ", std::strerror(errno));
  header h{};  // placeholder until close() knows the count
  TROUPE_CHECK(std::fwrite(&h, sizeof h, 1, file_) == 1, "token file: cannot write ", tmp_path_,
               ": ", std::strerror(errno));
}

token_file_writer::~token_file_writer() {
  if (file_) {
    std::fclose(file_);
    std::remove(tmp_path_.c_str());
  }
}

void token_file_writer::append(std::span<const std::int32_t> ids) {
  TROUPE_CHECK(file_, "token file ", path_, ": append after close");
  buffer_.resize(ids.size() * id_bytes_);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    std::int64_t id = ids[i];
    TROUPE_CHECK(id >= 0 && id < vocab_size_, "token file ", path_, ": id ", id, " at position ",
                 count_ + i, " is outside the vocab [0, ", vocab_size_, ")");
    if (id_bytes_ == 2) {
      auto v = static_cast<std::uint16_t>(id);
      std::memcpy(buffer_.data() + 2 * i, &v, 2);
    } else {
      auto v = static_cast<std::uint32_t>(id);
      std::memcpy(buffer_.data() + 4 * i, &v, 4);
    }
  }
  TROUPE_CHECK(std::fwrite(buffer_.data(), 1, buffer_.size(), file_) == buffer_.size(),
               "token file: cannot write ", tmp_path_, ": ", std::strerror(errno));
  count_ += ids.size();
}

void token_file_writer::close() {
  TROUPE_CHECK(file_, "token file ", path_, ": closed twice");
  header h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.version = kVersion;
  h.id_bytes = static_cast<std::uint32_t>(id_bytes_);
  h.count = count_;
  h.vocab_size = static_cast<std::uint64_t>(vocab_size_);
  bool ok = std::fseek(file_, 0, SEEK_SET) == 0 && std::fwrite(&h, sizeof h, 1, file_) == 1 &&
            std::fflush(file_) == 0 && ::fsync(fileno(file_)) == 0;
  int err = errno;
  ok = std::fclose(file_) == 0 && ok;
  file_ = nullptr;
  if (!ok) std::remove(tmp_path_.c_str());
  TROUPE_CHECK(ok, "token file: cannot write ", tmp_path_, ": ", std::strerror(err));
  std::error_code ec;
  std::filesystem::rename(tmp_path_, path_, ec);
  TROUPE_CHECK(!ec, "token file: cannot rename ", tmp_path_, " to ", path_, ": ", ec.message());
}

void write_token_file(const std::string& path, std::span<const std::int32_t> ids,
                      std::int64_t vocab_size, token_width width) {
  token_file_writer w(path, vocab_size, width);
  w.append(ids);
  w.close();
}

// ---- reader ------------------------------------------------------------------------------------

expected<token_dataset> token_dataset::open(const std::string& path, std::int64_t vocab_size) {
  using result = expected<token_dataset>;
  auto fail = [&](auto&&... parts) {
    std::ostringstream os;
    os << "token file " << path << ": ";
    (os << ... << parts);
    return result::failure(os.str());
  };
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return fail("cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return fail("cannot stat: ", std::strerror(err));
  }
  auto file_bytes = static_cast<std::uint64_t>(st.st_size);
  header h{};
  if (file_bytes < kHeaderBytes || ::pread(fd, &h, sizeof h, 0) != sizeof h) {
    ::close(fd);
    return fail("too short for the ", kHeaderBytes, "-byte header (", file_bytes,
                " bytes); write token files with `troupe tokenize`");
  }
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0) {
    ::close(fd);
    return fail(
        "not a troupe token file (the magic is not \"TROUPETK\"); write token files with "
        "`troupe tokenize`");
  }
  std::string bad;
  if (h.version != kVersion) {
    bad = "version " + std::to_string(h.version) + " is not supported (this build reads version " +
          std::to_string(kVersion) + ")";
  } else if (h.id_bytes != 2 && h.id_bytes != 4) {
    bad = "id width of " + std::to_string(h.id_bytes) + " bytes: expected 2 or 4";
  } else if (h.vocab_size == 0 || (h.id_bytes == 2 && h.vocab_size > 65536) ||
             h.vocab_size > (std::uint64_t{1} << 31)) {
    bad = "vocab size " + std::to_string(h.vocab_size) + " in the header is not valid for " +
          std::to_string(h.id_bytes) + "-byte ids";
  } else if (h.count > (file_bytes - kHeaderBytes) / h.id_bytes ||
             kHeaderBytes + h.count * h.id_bytes != file_bytes) {
    std::uint64_t want = h.count <= (~std::uint64_t{0} - kHeaderBytes) / h.id_bytes
                             ? kHeaderBytes + h.count * h.id_bytes
                             : ~std::uint64_t{0};
    bad = (file_bytes < want ? "truncated" : "longer than its header says") +
          std::string(": the header says ") + std::to_string(h.count) + " ids of " +
          std::to_string(h.id_bytes) + " bytes (" + std::to_string(want) + " bytes in all), the " +
          "file has " + std::to_string(file_bytes) + " bytes";
  }
  if (!bad.empty()) {
    ::close(fd);
    return fail(bad);
  }
  void* map = ::mmap(nullptr, file_bytes, PROT_READ, MAP_SHARED, fd, 0);
  int map_err = errno;
  ::close(fd);
  if (map == MAP_FAILED) return fail("cannot map ", file_bytes, " bytes: ", std::strerror(map_err));

  token_dataset d;
  d.path_ = path;
  d.map_ = map;
  d.map_bytes_ = file_bytes;
  d.ids_ = static_cast<const char*>(map) + kHeaderBytes;
  d.count_ = h.count;
  d.id_bytes_ = static_cast<int>(h.id_bytes);
  d.vocab_size_ = static_cast<std::int64_t>(h.vocab_size);

  // Every id must be below the header's vocab size and below the caller's.
  std::uint64_t limit = h.vocab_size;
  const char* bound = "the header's vocab size";
  if (vocab_size > 0 && static_cast<std::uint64_t>(vocab_size) < limit) {
    limit = static_cast<std::uint64_t>(vocab_size);
    bound = "the model's vocab size";
  }
  std::uint64_t at =
      d.id_bytes_ == 2
          ? first_id_at_or_above(static_cast<const std::uint16_t*>(d.ids_), d.count_, limit)
          : first_id_at_or_above(static_cast<const std::uint32_t*>(d.ids_), d.count_, limit);
  if (at < d.count_)
    return fail("id ", d[at], " at position ", at, " is not below ", bound, " ", limit);
  return result(std::move(d));
}

token_dataset::token_dataset(token_dataset&& o) noexcept {
  *this = std::move(o);
}

token_dataset& token_dataset::operator=(token_dataset&& o) noexcept {
  if (this != &o) {
    unmap();
    path_ = std::move(o.path_);
    map_ = std::exchange(o.map_, nullptr);
    map_bytes_ = std::exchange(o.map_bytes_, 0);
    ids_ = std::exchange(o.ids_, nullptr);
    count_ = std::exchange(o.count_, 0);
    id_bytes_ = std::exchange(o.id_bytes_, 0);
    vocab_size_ = std::exchange(o.vocab_size_, 0);
  }
  return *this;
}

token_dataset::~token_dataset() {
  unmap();
}

void token_dataset::unmap() {
  if (map_) ::munmap(map_, map_bytes_);
  map_ = nullptr;
}

void token_dataset::read(std::uint64_t start, std::span<std::int32_t> out) const {
  TROUPE_CHECK(start <= count_ && out.size() <= count_ - start, "token file ", path_,
               ": read of ids [", start, ", ", start + out.size(), ") beyond its ", count_, " ids");
  for (std::size_t i = 0; i < out.size(); ++i)
    out[i] = static_cast<std::int32_t>((*this)[start + i]);
}

void token_dataset::sample_batch(std::uint64_t seed, std::uint64_t step, int batch, int t,
                                 std::vector<std::int32_t>& ids) const {
  if (id_bytes_ == 2)
    sample_batch_rows(std::span(static_cast<const std::uint16_t*>(ids_), count_), path_.c_str(),
                      seed, step, batch, t, ids);
  else
    sample_batch_rows(std::span(static_cast<const std::uint32_t*>(ids_), count_), path_.c_str(),
                      seed, step, batch, t, ids);
}

}  // namespace troupe::models
