// JSON files read within stated bounds (see bounded_json.hpp).
#include "models/hf/bounded_json.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "models/hf/file_io.hpp"

namespace troupe::models::hf {

namespace fs = std::filesystem;

namespace {

std::string size_text(std::uint64_t bytes) {
  if (bytes >= (1ull << 20) && bytes % (1ull << 20) == 0)
    return std::to_string(bytes >> 20) + " MiB";
  if (bytes >= (1ull << 10) && bytes % (1ull << 10) == 0)
    return std::to_string(bytes >> 10) + " KiB";
  return std::to_string(bytes) + " bytes";
}

}  // namespace

void check_json_depth(int depth, const json_bounds& b, std::string_view where) {
  if (depth > b.max_depth)
    fail(where, ": nested deeper than ", b.max_depth, " levels, the bound for ", b.kind);
}

std::string read_bounded_text(const fs::path& path, const json_bounds& b) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open '", path.string(), "': ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    fail("cannot stat '", path.string(), "': ", std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("'", path.string(), "' is not a regular file");
  }
  const auto size = static_cast<std::uint64_t>(st.st_size);
  if (size > b.max_bytes) {
    ::close(fd);
    fail("'", path.string(), "': ", size, " bytes, more than the ", size_text(b.max_bytes),
         " bound for ", b.kind, " (refused unread)");
  }
  std::string text(static_cast<std::size_t>(size), '\0');
  std::size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::read(fd, text.data() + got, text.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int e = errno;
      ::close(fd);
      fail("cannot read '", path.string(), "': ", std::strerror(e));
    }
    if (n == 0) break;  // shrank meanwhile: parse what is there
    got += static_cast<std::size_t>(n);
  }
  text.resize(got);
  ::close(fd);
  return text;
}

template <class Json>
Json parse_bounded_json(std::string_view text, const json_bounds& b, std::string_view where) {
  if (text.size() > b.max_bytes)
    fail(where, ": ", text.size(), " bytes, more than the ", size_text(b.max_bytes), " bound for ",
         b.kind, " (refused unread)");
  // The callback sees a container before it is filled; its depth counts the containers around
  // it, so the container itself is at depth + 1. Throwing stops the parser there.
  typename Json::parser_callback_t deep = [&](int depth, typename Json::parse_event_t ev, Json&) {
    if (ev == Json::parse_event_t::object_start || ev == Json::parse_event_t::array_start)
      check_json_depth(depth + 1, b, where);
    return true;
  };
  try {
    return Json::parse(text.begin(), text.end(), deep);
  } catch (const typename Json::exception& e) {
    fail(where, ": not valid JSON (", e.what(), ")");
  }
}

template <class Json>
Json read_bounded_json(const fs::path& path, const json_bounds& b) {
  return parse_bounded_json<Json>(read_bounded_text(path, b), b, in_quotes(path.string()));
}

template nlohmann::json parse_bounded_json<nlohmann::json>(std::string_view, const json_bounds&,
                                                           std::string_view);
template nlohmann::ordered_json parse_bounded_json<nlohmann::ordered_json>(std::string_view,
                                                                           const json_bounds&,
                                                                           std::string_view);
template nlohmann::json read_bounded_json<nlohmann::json>(const fs::path&, const json_bounds&);
template nlohmann::ordered_json read_bounded_json<nlohmann::ordered_json>(const fs::path&,
                                                                          const json_bounds&);

}  // namespace troupe::models::hf
