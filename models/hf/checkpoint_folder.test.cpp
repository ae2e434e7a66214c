// Checkpoint saves never delete what troupe did not write: a folder holding a user's files, an HF
// folder the user downloaded, a troupe checkpoint with a user's file added, a file or a link where
// the folder should be, and user folders that happen to be called `<folder>.partial` or
// `<folder>.old` are all refused (before anything is written, and again just before the swap),
// naming the folder and its files, and are left byte for byte; empty folders and troupe's own
// checkpoints (with the marker, or from before it) are replaced, and the log line names the steps.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>

#include "models/hf/checkpoint.hpp"
#include "models/hf/checkpoint_folder.hpp"
#include "models/hf/file_io.hpp"
#include "models/hf/testing.hpp"

using namespace troupe;
using namespace troupe::models::hf;
using namespace troupe::models::hf::testing;
using Catch::Contains;

namespace {

// 's' (built by appending: GCC 12 at -O3 warns -Wrestrict inside "'" + std::string).
std::string q(const std::string& s) {
  std::string out(1, '\'');
  out += s;
  out += '\'';
  return out;
}

// A writer that puts a checkpoint's files into the staging folder: the weights and a
// trainer_state.json recording `step`.
auto checkpoint_of(int step) {
  return [step](const fs::path& dir) -> expected<fs::path> {
    write_bytes(dir / "model.safetensors", "weights of step " + std::to_string(step));
    write_bytes(dir / "trainer_state.json",
                R"({"format": "troupe-trainer-state", "format_version": 1, "step": )" +
                    std::to_string(step) + "}");
    return dir;
  };
}

// A user's folder: a file of theirs and a sub-folder with another.
void user_files(const fs::path& dir) {
  fs::create_directories(dir / "data");
  write_bytes(dir / "notes.txt", "my notes");
  write_bytes(dir / "data" / "corpus.txt", "my corpus");
}

void check_user_files(const fs::path& dir) {
  CHECK(read_bytes(dir / "notes.txt") == "my notes");
  CHECK(read_bytes(dir / "data" / "corpus.txt") == "my corpus");
}

}  // namespace

TEST_CASE("A checkpoint folder holding a user's files is refused and nothing is deleted",
          "[cpu][faults]") {
  temp_dir tmp;
  const fs::path ck = tmp / "ck";
  user_files(ck);
  // When the run is configured...
  auto configured = check_checkpoint_dir(ck);
  REQUIRE_FALSE(configured.has_value());
  CHECK_THAT(configured.error_message(), Contains(q(ck.string())) && Contains("'notes.txt'") &&
                                             Contains("'data'") &&
                                             Contains("not a troupe checkpoint"));
  // ... and at save time.
  auto saved = save_folder_atomically(ck, checkpoint_of(1));
  REQUIRE_FALSE(saved.has_value());
  CHECK_THAT(saved.error_message(),
             Contains(q(ck.string())) && Contains("'notes.txt'") && Contains("refuses"));
  check_user_files(ck);
  CHECK(list_files(ck) == std::vector<std::string>{"data", "notes.txt"});
  CHECK_FALSE(fs::exists(tmp / "ck.partial"));
  std::printf("faults: checkpoint dir holding user files -> refused: %s\n",
              saved.error_message().c_str());
}

TEST_CASE("An HF folder the user downloaded is not a troupe checkpoint and is not replaced",
          "[cpu][faults]") {
  temp_dir tmp;
  const fs::path hf = tmp / "gpt2";
  fs::copy(fixture_dir() / "gpt2_bare", hf);
  const std::vector<std::string> before = list_files(hf);
  REQUIRE(std::find(before.begin(), before.end(), "model.safetensors") != before.end());
  const std::string weights = read_bytes(hf / "model.safetensors");
  auto saved = save_folder_atomically(hf, checkpoint_of(3));
  REQUIRE_FALSE(saved.has_value());
  CHECK_THAT(saved.error_message(), Contains(q(hf.string())) && Contains("'model.safetensors'") &&
                                        Contains("troupe_checkpoint.json"));
  CHECK(list_files(hf) == before);
  CHECK(read_bytes(hf / "model.safetensors") == weights);
  std::printf("faults: checkpoint dir = a downloaded HF folder -> refused: %s\n",
              saved.error_message().c_str());
}

TEST_CASE("A troupe checkpoint with a user's file added is refused naming that file",
          "[cpu][faults]") {
  temp_dir tmp;
  const fs::path ck = tmp / "ck";
  REQUIRE(save_folder_atomically(ck, checkpoint_of(1)).has_value());
  write_bytes(ck / "eval-results.csv", "step,loss\n1,2.5\n");
  auto saved = save_folder_atomically(ck, checkpoint_of(2));
  REQUIRE_FALSE(saved.has_value());
  CHECK_THAT(saved.error_message(), Contains("is a troupe checkpoint but also holds") &&
                                        Contains("'eval-results.csv'") &&
                                        !Contains("'model.safetensors'"));
  CHECK(read_bytes(ck / "eval-results.csv") == "step,loss\n1,2.5\n");
  CHECK(read_bytes(ck / "model.safetensors") == "weights of step 1");
  std::printf("faults: troupe checkpoint with a user file added -> refused: %s\n",
              saved.error_message().c_str());
}

TEST_CASE("A file or a link where the checkpoint folder should be is refused", "[cpu][faults]") {
  temp_dir tmp;
  write_bytes(tmp / "ck", "a file of the user's");
  auto saved = save_folder_atomically(tmp / "ck", checkpoint_of(1));
  REQUIRE_FALSE(saved.has_value());
  CHECK_THAT(saved.error_message(), Contains("is a file, not a folder"));
  CHECK(read_bytes(tmp / "ck") == "a file of the user's");
  // A link to the user's folder: neither the link nor what it points to is touched.
  user_files(tmp / "mine");
  fs::create_directory_symlink(tmp / "mine", tmp / "link");
  auto linked = save_folder_atomically(tmp / "link", checkpoint_of(1));
  REQUIRE_FALSE(linked.has_value());
  CHECK_THAT(linked.error_message(), Contains("is a symbolic link"));
  CHECK(fs::is_symlink(tmp / "link"));
  check_user_files(tmp / "mine");
  std::printf("faults: checkpoint dir is a file -> refused: %s\n", saved.error_message().c_str());
}

// The sibling folders a save uses: `<folder>.partial` is emptied first and `<folder>.old` may be
// replaced; when a user's folder has that name, the save is refused and it is left alone.
TEST_CASE("User folders named like the save's .partial and .old siblings are never deleted",
          "[cpu][faults]") {
  temp_dir tmp;
  const fs::path ck = tmp / "ck";
  REQUIRE(save_folder_atomically(ck, checkpoint_of(1)).has_value());
  for (const char* sibling : {"ck.partial", "ck.old"}) {
    INFO(sibling);
    user_files(tmp / sibling);
    auto configured = check_checkpoint_dir(ck);
    REQUIRE_FALSE(configured.has_value());
    CHECK_THAT(configured.error_message(), Contains((tmp / sibling).string()));
    auto saved = save_folder_atomically(ck, checkpoint_of(2));
    REQUIRE_FALSE(saved.has_value());
    CHECK_THAT(saved.error_message(),
               Contains(q((tmp / sibling).string())) && Contains("'notes.txt'"));
    check_user_files(tmp / sibling);
    CHECK(read_bytes(ck / "model.safetensors") == "weights of step 1");
    std::printf("faults: a user folder named %s -> refused: %s\n", sibling,
                saved.error_message().c_str());
    fs::remove_all(tmp / sibling);
  }
  REQUIRE(save_folder_atomically(ck, checkpoint_of(2)).has_value());
  CHECK(read_bytes(ck / "model.safetensors") == "weights of step 2");
}

// Between the start of a save and its swap (hours, for a large model) the user may put a file
// into the folder: the swap is refused, the file stays, and the error says where the new one is.
TEST_CASE("A user's file put into the folder while a save runs stops the swap", "[cpu][faults]") {
  temp_dir tmp;
  const fs::path ck = tmp / "ck";
  REQUIRE(save_folder_atomically(ck, checkpoint_of(1)).has_value());
  auto saved = save_folder_atomically(ck, [&](const fs::path& dir) -> expected<fs::path> {
    write_bytes(ck / "notes.txt", "written during the save");
    return checkpoint_of(2)(dir);
  });
  REQUIRE_FALSE(saved.has_value());
  CHECK_THAT(saved.error_message(),
             Contains("'notes.txt'") && Contains(std::string("the new checkpoint is in ") +
                                                 q((tmp / "ck.partial").string())));
  CHECK(read_bytes(ck / "notes.txt") == "written during the save");
  CHECK(read_bytes(ck / "model.safetensors") == "weights of step 1");
  CHECK(read_bytes(tmp / "ck.partial" / "model.safetensors") == "weights of step 2");
}

TEST_CASE("Empty folders and troupe's own checkpoints are replaced and the log names the steps",
          "[cpu]") {
  temp_dir tmp;
  const fs::path ck = tmp / "ck";
  auto line = check_checkpoint_dir(ck);
  REQUIRE(line.has_value());
  CHECK_THAT(*line, Contains("does not exist yet"));
  fs::create_directory(ck);
  CHECK_THAT(check_checkpoint_dir(ck).value(), Contains("is empty"));
  REQUIRE(save_folder_atomically(ck, checkpoint_of(10)).has_value());
  CHECK(fs::exists(ck / checkpoint_marker_file));
  CHECK(checkpoint_step(ck) == 10);
  CHECK_THAT(check_checkpoint_dir(ck).value(),
             Contains("holds the troupe checkpoint of step 10: the next save replaces it"));
  CHECK(saved_line(ck, 20, checkpoint_step(ck)) == std::string("checkpoint: step 20 saved in ") +
                                                       q(ck.string()) +
                                                       " (it held step 10 before)");
  REQUIRE(save_folder_atomically(ck, checkpoint_of(20)).has_value());
  CHECK(checkpoint_step(ck) == 20);
  // A failed save names the step the folder still holds.
  auto failed = save_folder_atomically(ck, [](const fs::path&) -> expected<fs::path> {
    return expected<fs::path>::failure("cannot write 'x.tmp': No space left on device");
  });
  REQUIRE_FALSE(failed.has_value());
  CHECK_THAT(failed.error_message(), Contains("step 20, is unchanged"));
  // A checkpoint from before the marker (trainer_state.json only) is troupe's too.
  fs::remove(ck / checkpoint_marker_file);
  CHECK(survey_folder(ck).marked);
  REQUIRE(save_folder_atomically(ck, checkpoint_of(30)).has_value());
  CHECK(checkpoint_step(ck) == 30);
  // A marker that is not troupe's does not make a folder troupe's.
  const fs::path other = tmp / "other";
  fs::create_directory(other);
  write_bytes(other / checkpoint_marker_file, R"({"format": "something else"})");
  write_bytes(other / "model.safetensors", "theirs");
  CHECK_FALSE(survey_folder(other).replaceable());
}

TEST_CASE("Only the names troupe writes into a checkpoint count as its files", "[cpu]") {
  for (const char* n : {"config.json", "model.safetensors", "model-00001-of-00002.safetensors",
                        "model.safetensors.index.json", "optimizer.safetensors",
                        "trainer_state.json", "troupe_parallel.json", "troupe_checkpoint.json",
                        "model.safetensors.tmp", "trainer_state.json.tmp"})
    CHECK(is_checkpoint_file_name(n));
  for (const char* n : {"tokenizer.json", "notes.txt", "model-1-of-2.safetensors",
                        "pytorch_model.bin", "generation_config.json", ".tmp", "data"})
    CHECK_FALSE(is_checkpoint_file_name(n));
}
