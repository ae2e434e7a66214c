// The `troupe` command: one binary, subcommands, --help everywhere, errors that name the flag.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>
#include <vector>

#include "apps/commands.hpp"

int main(int argc, char** argv) {
  CLI::App app{"troupe: train transformer models across many devices, on actors"};
  app.require_subcommand(1);
  app.set_version_flag("--version", "troupe 0.1.0");
  std::vector<troupe::apps::command_fn> commands;
  commands.push_back(troupe::apps::add_train_command(app));
  commands.push_back(troupe::apps::add_eval_command(app));
  commands.push_back(troupe::apps::add_generate_command(app));
  commands.push_back(troupe::apps::add_bench_command(app));
  commands.push_back(troupe::apps::add_bench_p2p_command(*app.get_subcommand("bench")));
  commands.push_back(troupe::apps::add_bench_collective_command(*app.get_subcommand("bench")));
  commands.push_back(troupe::apps::add_bench_nvme_command(*app.get_subcommand("bench")));
  commands.push_back(troupe::apps::add_bench_offload_command(*app.get_subcommand("bench")));
  commands.push_back(troupe::apps::add_launch_command(app));
  commands.push_back(troupe::apps::add_tokenize_command(app));
  commands.push_back(troupe::apps::add_ps_command(app));
  commands.push_back(troupe::apps::add_top_command(app));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
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
