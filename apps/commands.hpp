// Subcommands of the `troupe` command. Each apps/cmd_*.cpp adds one subcommand to the CLI11 app and
// returns the function that runs it once the command line has been parsed; that function returns
// -1 when its subcommand was not the one chosen, else the process exit code.
#pragma once

#include <functional>

namespace CLI {
class App;
}

namespace troupe::apps {

using command_fn = std::function<int()>;

command_fn add_bench_command(CLI::App& app);  // troupe bench ...   (apps/cmd_bench.cpp)
// troupe bench train (apps/cmd_bench_train.cpp), added to the `bench` subcommand by the above.
command_fn add_bench_train_command(CLI::App& bench);
command_fn add_train_command(CLI::App& app);  // troupe train ...   (apps/cmd_train.cpp)
command_fn add_sft_command(CLI::App& app);    // troupe sft ...     (apps/cmd_sft.cpp)
command_fn add_dpo_command(CLI::App& app);    // troupe dpo ...     (apps/cmd_dpo.cpp)
command_fn add_rm_command(CLI::App& app);     // troupe rm ...      (apps/cmd_rm.cpp)
command_fn add_grpo_command(CLI::App& app);   // troupe grpo ...    (apps/cmd_grpo.cpp)
command_fn add_ppo_command(CLI::App& app);    // troupe ppo ...     (apps/cmd_ppo.cpp)
command_fn add_tokenize_command(CLI::App& app);
command_fn add_eval_command(CLI::App& app);      // troupe eval ...      (apps/cmd_eval.cpp)
command_fn add_generate_command(CLI::App& app);  // troupe generate ...  (apps/cmd_generate.cpp)  //
                                                 // troupe tokenize ...  (apps/cmd_tokenize.cpp)
command_fn add_ps_command(CLI::App& app);        // troupe ps ...   (apps/cmd_ps.cpp)
command_fn add_top_command(CLI::App& app);       // troupe top ...  (apps/cmd_top.cpp)

command_fn add_launch_command(CLI::App& app);  // troupe launch ...   (apps/cmd_launch.cpp)
// troupe bench p2p (apps/cmd_bench_p2p.cpp), added to the `bench` subcommand by apps/troupe.cpp.
command_fn add_bench_p2p_command(CLI::App& bench);
command_fn add_bench_collective_command(CLI::App& bench);  // (apps/cmd_bench_collective.cpp)
command_fn add_bench_nvme_command(CLI::App& bench);        // (apps/cmd_bench_nvme.cpp)
command_fn add_bench_offload_command(CLI::App& bench);     // (apps/cmd_bench_offload.cpp)
command_fn add_bench_ring_command(CLI::App& bench);        // (apps/cmd_bench_ring.cpp)
command_fn add_bench_attention_command(CLI::App& bench);   // (apps/cmd_bench_attention.cpp)

}  // namespace troupe::apps
