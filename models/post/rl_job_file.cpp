// rl_job_file: the job-file machinery of troupe grpo and troupe ppo (rl_job_file.hpp).
#include "models/post/rl_job_file.hpp"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace troupe::models {
namespace {

constexpr std::uintmax_t max_job_file_bytes = 1 << 20;
// These files' keys have two parts and their values few dots (numbers, paths).
constexpr std::size_t max_dots = 4096;

}  // namespace

expected<std::string> read_job_file(const std::string& path) {
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (!ec && size > max_job_file_bytes)
    return expected<std::string>::failure(path + ": " + std::to_string(size) +
                                          " bytes, more than the 1 MiB bound for a job file " +
                                          "(refused unread)");
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return expected<std::string>::failure(path + ": cannot open it: " + std::strerror(errno));
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return expected<std::string>::failure(path + ": cannot read it");
  return text.str();
}

void walk_job_text(std::string_view text, const std::string& origin, std::string_view command,
                   const std::function<bool(const std::string& name, const toml::node&)>& set,
                   const std::function<std::string(const std::string& name)>& unknown_key) {
  if (const auto dots = static_cast<std::size_t>(std::count(text.begin(), text.end(), '.'));
      dots > max_dots)
    throw error(origin + ": " + std::to_string(dots) + " dots, more than a " +
                std::string(command) + " job file needs (" + std::to_string(max_dots) +
                "; refused unparsed)");
  toml::table doc;
  try {
    doc = toml::parse(text, origin);
  } catch (const toml::parse_error& e) {
    std::ostringstream os;
    os << origin << ":" << e.source().begin.line << ":" << e.source().begin.column << ": "
       << e.description();
    throw error(os.str());
  }
  for (const auto& [section, node] : doc) {
    const auto* tbl = node.as_table();
    if (tbl == nullptr) throw error("'" + std::string(section.str()) + "' must be a [section]");
    for (const auto& [key, value] : *tbl) {
      const std::string name = std::string(section.str()) + "." + std::string(key.str());
      if (!set(name, value)) throw error(unknown_key(name));
    }
  }
}

std::string rl_unknown_key(const std::string& name, std::string_view command, std::string_view rows,
                           std::string_view sections) {
  const std::string section = name.substr(0, name.find('.'));
  if (section == "train" || section == "data" || section == "parallel" || section == "memory" ||
      section == "elastic")
    return "'" + name + "' is a key of troupe train's job files that " + std::string(command) +
           " does not read (its rows are " + std::string(rows) + "; its settings are " +
           std::string(sections) + ")";
  std::string list(sections);
  const auto and_at = list.rfind(" and ");
  if (and_at != std::string::npos) list.replace(and_at, 5, ", ");
  return "unknown key '" + name + "' (" + std::string(command) + " reads " + list + ")";
}

}  // namespace troupe::models
