// The `troupe` command: one binary, subcommands, --help everywhere, errors that name the flag.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "apps/commands.hpp"

namespace {

// The first argument before "--" that looks like a flag but is none of its (sub)command's. CLI11
// may report other arguments instead: `troupe launch --nprocz 2 -- prog` takes "--nprocz" for a
// value and names only "prog", after "--". Empty when every flag is known.
std::string unknown_flag(CLI::App& app, int argc, char** argv) {
  CLI::App* at = &app;
  int i = 1;
  for (; i < argc; ++i) {  // down the subcommands named first ("bench p2p ...")
    CLI::App* sub = nullptr;
    try {
      sub = at->get_subcommand(argv[i]);
    } catch (const CLI::OptionNotFound&) {
      break;
    }
    at = sub;
  }
  for (; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--") break;
    if (a.size() < 2 || a[0] != '-' || (a[1] >= '0' && a[1] <= '9') || a[1] == '.') continue;
    if (const auto eq = a.find('='); eq != std::string::npos) a.resize(eq);
    if (at->get_option_no_throw(a) == nullptr && app.get_option_no_throw(a) == nullptr) return a;
  }
  return "";
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"troupe: train transformer models across many devices, on actors"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "troupe 0.1.0");
  std::vector<troupe::apps::command_fn> commands;
  commands.push_back(troupe::apps::add_train_command(app));
  commands.push_back(troupe::apps::add_sft_command(app));
  commands.push_back(troupe::apps::add_dpo_command(app));
  commands.push_back(troupe::apps::add_rm_command(app));
  commands.push_back(troupe::apps::add_grpo_command(app));
  commands.push_back(troupe::apps::add_ppo_command(app));
  commands.push_back(troupe::apps::add_eval_command(app));
  commands.push_back(troupe::apps::add_generate_command(app));
  commands.push_back(troupe::apps::add_bench_command(app));
  commands.push_back(troupe::apps::add_bench_p2p_command(*app.get_subcommand("bench")));
  commands.push_back(troupe::apps::add_bench_collective_command(*app.get_subcommand("bench")));
  commands.push_back(troupe::apps::add_bench_nvme_command(*app.get_subcommand("bench")));
  commands.push_back(troupe::apps::add_bench_offload_command(*app.get_subcommand("bench")));
  commands.push_back(troupe::apps::add_bench_ring_command(*app.get_subcommand("bench")));
  commands.push_back(troupe::apps::add_bench_attention_command(*app.get_subcommand("bench")));
  commands.push_back(troupe::apps::add_launch_command(app));
  commands.push_back(troupe::apps::add_tokenize_command(app));
  commands.push_back(troupe::apps::add_ps_command(app));
  commands.push_back(troupe::apps::add_top_command(app));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() != 0)  // not --help or --version
      if (const std::string flag = unknown_flag(app, argc, argv); !flag.empty()) {
        std::fprintf(stderr, "troupe: unknown flag '%s' (--help lists the flags)\n", flag.c_str());
        return e.get_exit_code();
      }
    return app.exit(e);
  }
  try {
    for (auto& run : commands)
      if (run) {
        int rc = run();
        if (rc >= 0) return rc;
      }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "troupe: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
