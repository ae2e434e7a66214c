// troupe tokenize: turns text files into a token file (models/text/token_file.hpp) for training.
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>

#include "apps/commands.hpp"
#include "memory/error.hpp"
#include "models/text/token_file.hpp"
#include "models/text/tokenizer.hpp"

namespace troupe::apps {
namespace {
namespace fs = std::filesystem;

struct tokenize_args {
  std::vector<std::string> inputs;
  std::string out;
  std::string tokenizer = "byte";
  std::string separator;
  std::string dtype = "auto";
  bool eos = false, bos = false;
};

// The files of the inputs: files as given, folders as their regular files in sorted order (not
// recursive), skipping fortune(6) index files (*.dat) and second names of one file (symlinks).
std::vector<fs::path> input_files(const std::vector<std::string>& inputs) {
  std::vector<fs::path> files;
  std::set<fs::path> seen;
  auto add = [&](const fs::path& p) {
    if (seen.insert(fs::canonical(p)).second) files.push_back(p);
  };
  for (const auto& in : inputs) {
    std::error_code ec;
    TROUPE_CHECK(fs::exists(in, ec), "tokenize: input ", in, " does not exist");
    if (!fs::is_directory(in, ec)) {
      add(in);
      continue;
    }
    std::vector<fs::path> inside;
    for (const auto& e : fs::directory_iterator(in))
      if (e.is_regular_file() && e.path().extension() != ".dat") inside.push_back(e.path());
    std::sort(inside.begin(), inside.end());
    for (const auto& p : inside) add(p);
  }
  return files;
}

// The documents of one file: the whole file, or the parts between lines equal to `separator`.
std::vector<std::string> read_documents(const fs::path& p, const std::string& separator) {
  std::ifstream in(p, std::ios::binary);
  TROUPE_CHECK(in.good(), "tokenize: cannot read ", p.string());
  std::ostringstream all;
  all << in.rdbuf();
  if (separator.empty()) return {all.str()};
  std::vector<std::string> docs;
  std::istringstream lines(all.str());
  std::string line, doc;
  while (std::getline(lines, line)) {
    if (line == separator || line == separator + "\r") {
      if (!doc.empty()) docs.push_back(std::move(doc));
      doc.clear();
    } else {
      doc += line;
      doc += '\n';
    }
  }
  if (!doc.empty()) docs.push_back(std::move(doc));
  return docs;
}

int run_tokenize(const tokenize_args& a) {
  auto t0 = std::chrono::steady_clock::now();
  auto tok = models::load_tokenizer(a.tokenizer);
  TROUPE_CHECK(tok.has_value(), "--tokenizer: ", tok.error_message());
  auto& tk = *tok.value();
  TROUPE_CHECK(!a.eos || tk.eos_id() >= 0, "--eos: tokenizer ", tk.name(), " has no eos token");
  TROUPE_CHECK(!a.bos || tk.bos_id() >= 0, "--bos: tokenizer ", tk.name(), " has no bos token");
  auto width = a.dtype == "u16"   ? models::token_width::u16
               : a.dtype == "u32" ? models::token_width::u32
                                  : models::token_width::automatic;
  auto files = input_files(a.inputs);
  TROUPE_CHECK(!files.empty(), "tokenize: no input files in the ", a.inputs.size(),
               " input path(s)");

  models::token_file_writer out(a.out, tk.vocab_size(), width);
  std::uint64_t docs = 0, bytes = 0;
  std::vector<std::int32_t> ids;
  for (const auto& f : files) {
    for (const auto& doc : read_documents(f, a.separator)) {
      ids.clear();
      if (a.bos) ids.push_back(tk.bos_id());
      tk.encode(doc, ids);
      if (a.eos) ids.push_back(tk.eos_id());
      out.append(ids);
      bytes += doc.size();
      ++docs;
    }
  }
  TROUPE_CHECK(out.count() > 0, "tokenize: the inputs hold no text");
  out.close();
  double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("troupe tokenize: {} files, {} documents, {} bytes of text\n", files.size(), docs,
             bytes);
  fmt::print("tokenizer {}: vocab {}{}{}\n", tk.name(), tk.vocab_size(),
             a.bos ? fmt::format(", bos {} before each document", tk.bos_id()) : "",
             a.eos ? fmt::format(", eos {} after each document", tk.eos_id()) : "");
  fmt::print(
      "wrote {}: {} tokens as uint{} ({:.2f} bytes of text per token) in {:.2f} s ({:.2f} M "
      "tokens/s)\n",
      a.out, out.count(), 8 * out.id_bytes(),
      static_cast<double>(bytes) / static_cast<double>(out.count()), secs,
      static_cast<double>(out.count()) / secs / 1e6);
  return 0;
}

}  // namespace

command_fn add_tokenize_command(CLI::App& app) {
  auto a = std::make_shared<tokenize_args>();
  auto* sub = app.add_subcommand("tokenize", "Turn text files into a token file for training");
  sub->add_option("inputs", a->inputs, "Text files, or folders of text files")->required();
  sub->add_option("--out,-o", a->out, "The token file to write")->required();
  sub->add_option("--tokenizer", a->tokenizer,
                  "byte | gpt2:<dir with vocab.json and merges.txt> | spm:<tokenizer.model>")
      ->capture_default_str();
  sub->add_flag("--eos", a->eos, "Append the tokenizer's eos token after every document");
  sub->add_flag("--bos", a->bos, "Put the tokenizer's bos token before every document");
  sub->add_option("--doc-separator", a->separator,
                  "A line that ends a document (e.g. % for fortune files); default: one document "
                  "per file");
  sub->add_option("--dtype", a->dtype,
                  "Stored id width: auto (uint16 when the vocab fits), u16, u32")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "u16", "u32"}));
  return [sub, a]() -> int {
    if (!sub->parsed()) return -1;
    return run_tokenize(*a);
  };
}

}  // namespace troupe::apps
