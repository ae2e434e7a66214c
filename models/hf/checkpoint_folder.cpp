// Which folders a checkpoint save may replace (see checkpoint_folder.hpp).
#include "models/hf/checkpoint_folder.hpp"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "models/hf/bounded_json.hpp"
#include "models/hf/file_io.hpp"
#include "models/hf/training_state.hpp"

namespace troupe::models::hf {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* marker_format = "troupe-checkpoint";
constexpr const char* state_file = trainer_state_file_name;
constexpr const char* state_format = trainer_state_format;

bool five_digits(std::string_view d) {
  return d.size() == 5 && d.find_first_not_of("0123456789") == std::string_view::npos;
}

// The JSON object in `file`, or null when it is missing, too large, too deep or not JSON.
json read_small_json(const fs::path& file, const json_bounds& b) {
  std::error_code ec;
  if (!fs::is_regular_file(fs::symlink_status(file, ec))) return nullptr;
  try {
    json j = read_bounded_json(file, b);
    return j.is_object() ? j : json(nullptr);
  } catch (const troupe::error&) {
    return nullptr;
  }
}

std::string some_names(const std::vector<std::string>& names) {
  std::string s;
  const std::size_t shown = std::min<std::size_t>(names.size(), 5);
  for (std::size_t i = 0; i < shown; ++i) s += (i ? ", " : "") + in_quotes(names[i]);
  if (names.size() > shown) s += ", ... (" + std::to_string(names.size()) + " in all)";
  return s;
}

fs::path plain(const fs::path& folder) {
  return folder.has_filename() ? folder : folder.parent_path();
}

}  // namespace

bool is_checkpoint_file_name(std::string_view n) {
  constexpr std::string_view tmp = ".tmp";
  if (n.size() > tmp.size() && n.substr(n.size() - tmp.size()) == tmp) n.remove_suffix(tmp.size());
  for (std::string_view fixed :
       {"config.json", "model.safetensors", "model.safetensors.index.json", "optimizer.safetensors",
        "trainer_state.json", "troupe_parallel.json", "troupe_checkpoint.json",
        ".troupe-write-probe"})
    if (n == fixed) return true;
  // model-00001-of-00005.safetensors
  constexpr std::string_view ext = ".safetensors";
  if (n.size() != 20 + ext.size() || n.substr(20) != ext) return false;
  return n.substr(0, 6) == "model-" && five_digits(n.substr(6, 5)) && n.substr(11, 4) == "-of-" &&
         five_digits(n.substr(15, 5));
}

bool folder_survey::replaceable() const {
  if (!exists) return true;
  if (!not_a_folder.empty()) return false;
  return entries == 0 || (marked && foreign.empty());
}

std::string folder_survey::describe() const {
  if (!exists) return "not there yet";
  if (!not_a_folder.empty()) return not_a_folder + ", not a folder";
  if (entries == 0) return "empty";
  if (!marked) return "not a troupe checkpoint";
  return step ? "the troupe checkpoint of step " + std::to_string(*step)
              : std::string("a troupe checkpoint (a save cut off before its training state)");
}

folder_survey survey_folder(const fs::path& folder) {
  folder_survey s;
  const fs::path dir = plain(folder);
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(dir, ec);
  if (ec || st.type() == fs::file_type::not_found) {
    s.exists = st.type() != fs::file_type::not_found;
    if (s.exists) s.not_a_folder = "something that cannot be examined (" + ec.message() + ")";
    return s;
  }
  s.exists = true;
  if (fs::is_symlink(st)) {
    s.not_a_folder = "a symbolic link";
    return s;
  }
  if (!fs::is_directory(st)) {
    s.not_a_folder = fs::is_regular_file(st) ? "a file" : "a special file";
    return s;
  }
  fs::directory_iterator it(dir, ec);
  if (ec) {
    ++s.entries;
    s.foreign.push_back("(its entries cannot be listed: " + ec.message() + ")");
    return s;
  }
  for (; it != fs::directory_iterator(); it.increment(ec)) {
    const std::string name = it->path().filename().string();
    ++s.entries;
    std::error_code e2;
    if (!is_checkpoint_file_name(name) || !fs::is_regular_file(it->symlink_status(e2)))
      s.foreign.push_back(name);
  }
  if (ec) s.foreign.push_back("(listing it failed: " + ec.message() + ")");
  std::sort(s.foreign.begin(), s.foreign.end());
  const json marker = read_small_json(dir / checkpoint_marker_file, checkpoint_marker_bounds);
  const json state = read_small_json(dir / state_file, trainer_state_bounds);
  const bool marker_ok = marker.is_object() && marker.value("format", "") == marker_format;
  const bool state_ok = state.is_object() && state.value("format", "") == state_format;
  s.marked = marker_ok || state_ok;
  if (state_ok && state.contains("step") && state["step"].is_number_integer())
    s.step = state["step"].get<std::int64_t>();
  return s;
}

void check_replaceable(const fs::path& folder, std::string_view role) {
  const folder_survey s = survey_folder(folder);
  if (s.replaceable()) return;
  const std::string where = std::string(role) + " " + in_quotes(plain(folder).string());
  if (!s.not_a_folder.empty())
    fail(where, " is ", s.not_a_folder, ", not a folder: a checkpoint save would replace it, so ",
         "troupe refuses; give a folder (an empty or new one, or one troupe saved into)");
  if (s.marked)
    fail(where, " is a troupe checkpoint but also holds what troupe did not write there: ",
         some_names(s.foreign), "; a save replaces the folder as a whole and would delete them, ",
         "so troupe refuses: move them out of it");
  std::vector<std::string> all;
  std::error_code ec;
  for (fs::directory_iterator it(plain(folder), ec), end; !ec && it != end; it.increment(ec))
    all.push_back(it->path().filename().string());
  std::sort(all.begin(), all.end());
  fail(where, " is not empty and not a troupe checkpoint (it has no ", checkpoint_marker_file,
       "): it holds ", some_names(all.empty() ? s.foreign : all),
       "; a save replaces the folder as a whole and would delete them, so troupe refuses: give ",
       "an empty or new folder, or one troupe saved into");
}

expected<std::string> check_checkpoint_dir(const fs::path& folder) {
  return as_expected([&] {
    check_replaceable(folder, "checkpoint folder");
    check_replaceable(staging_folder(folder),
                      "the folder a checkpoint save writes first (beside the checkpoint folder)");
    check_replaceable(old_folder(folder),
                      "the folder a checkpoint save moves the previous one to (beside the "
                      "checkpoint folder)");
    const folder_survey s = survey_folder(folder);
    const std::string where = "checkpoint folder " + in_quotes(plain(folder).string());
    if (!s.exists) return where + " does not exist yet: the first save creates it";
    if (s.entries == 0) return where + " is empty: the first save fills it";
    return where + " holds " + s.describe() + ": the next save replaces it";
  });
}

std::optional<std::int64_t> checkpoint_step(const fs::path& folder) {
  return survey_folder(folder).step;
}

std::string saved_line(const fs::path& folder, std::int64_t step,
                       std::optional<std::int64_t> replaced) {
  return "checkpoint: step " + std::to_string(step) + " saved in " +
         in_quotes(plain(folder).string()) +
         (replaced ? " (it held step " + std::to_string(*replaced) + " before)" : std::string());
}

void write_checkpoint_marker(const fs::path& dir) {
  write_text_file_atomically(
      dir / checkpoint_marker_file,
      std::string("{\"format\": \"") + marker_format + "\", \"format_version\": 1}\n");
}

}  // namespace troupe::models::hf
