// Job files: values land in the config; every mistake names the file and the key.
#include <catch2/catch.hpp>

#include <unistd.h>
#include <cstdio>
#include <fstream>
#include <string>

#include "models/train_config.hpp"

#include "models/chaos_kills.hpp"

using namespace troupe::models;

namespace {
std::string write_job(const std::string& text) {
  static int n = 0;
  std::string path =
      "/tmp/troupe_job_" + std::to_string(::getpid()) + "_" + std::to_string(n++) + ".toml";
  std::ofstream(path) << text;
  return path;
}
}  // namespace

TEST_CASE("a TOML job file sets the fields it names and keeps the defaults of the rest") {
  auto path = write_job(R"(
[model]
size = "llama-tiny"
[train]
steps = 12
batch = 4
fixed_batch = true
recompute = true
[optim]
lr = 0.001
decay_exempt = true
[checkpoint]
dir = "/tmp/ck"
every = 5
)");
  auto c = load_train_config(path);
  REQUIRE(c.has_value());
  CHECK(c->model_size == "llama-tiny");
  CHECK(c->steps == 12);
  CHECK(c->batch == 4);
  CHECK(c->fixed_batch);
  CHECK(c->recompute);
  CHECK(c->lr == Approx(0.001));
  CHECK(c->decay_exempt);
  CHECK(c->ckpt_every == 5);
  CHECK(c->seq == train_config{}.seq);
  std::remove(path.c_str());
}

TEST_CASE("job file mistakes are errors naming the file and the key", "[faults]") {
  struct bad_case {
    const char* text;
    const char* says;
  };
  for (auto [text, says] :
       {bad_case{"[train]\nstepz = 3\n", "unknown key 'train.stepz'"},
        bad_case{"[train]\nsteps = \"many\"\n", "train.steps must be an integer"},
        bad_case{"[train]\nsteps = 0\n", "train.steps must be > 0"},
        bad_case{"[optim]\nbeta2 = 1.5\n", "optim.beta2 must be in [0, 1)"},
        bad_case{"[train]\nrecompute = \"yes\"\n", "train.recompute must be true or false"},
        bad_case{"[checkpoint]\nevery = 5\n", "checkpoint.every needs checkpoint.dir"},
        bad_case{"steps = 3\n", "'steps' must be a [section]"}, bad_case{"[train\n", ".toml:"},
        bad_case{"[train]\nsteps = 3\nbatch = = 4\n", ".toml:3:"},
        bad_case{"[train]\nsteps = 3\nsteps = 4\n", ".toml:3:"}}) {
    auto path = write_job(text);
    auto c = load_train_config(path);
    INFO(text);
    REQUIRE(!c.has_value());
    CHECK_THAT(c.error_message(), Catch::Contains(says) && Catch::Contains(path));
    std::printf("faults: job file %s -> refused: %s\n", says, c.error_message().c_str());
    std::remove(path.c_str());
  }
  // A job file is small: one over the bound (1 MiB) is refused before it is parsed.
  auto huge = write_job("[train]\nsteps = 3\n# " + std::string(std::size_t{2} << 20, 'x') + "\n");
  auto c = load_train_config(huge);
  REQUIRE(!c.has_value());
  CHECK_THAT(c.error_message(),
             Catch::Contains(huge) && Catch::Contains("more than the 1 MiB bound for a job file"));
  std::printf("faults: job file of 2 MiB -> refused: %s\n", c.error_message().c_str());
  std::remove(huge.c_str());
  // A dotted key of 100000 parts (toml++ would build, then free recursively, 100000 nested tables
  // and overflow the stack) is refused before parsing, in a header or in an inline table; keys
  // and values of a real job file are far from the bound.
  std::string parts = "a";
  for (int i = 0; i < 100000; ++i) parts += ".a";
  for (const std::string& text :
       {"[" + parts + "]\nx = 1\n", "[train]\nx = {" + parts + " = 1}\n"}) {
    auto deep = write_job(text);
    auto d = load_train_config(deep);
    REQUIRE(!d.has_value());
    CHECK_THAT(
        d.error_message(),
        Catch::Contains(deep) && Catch::Contains("a dotted key of 100001 parts, more than the 16"));
    std::printf("faults: job file with a dotted key of 100001 parts -> refused: %s\n",
                d.error_message().c_str());
    std::remove(deep.c_str());
  }
  auto fine = write_job(
      "# a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q.r (a comment)\n[model]\nhf = "
      "\"/m/a.b.c.d.e.f.g.h.i.j.k.l.m.n.o.p.q\"\n"
      "[optim]\nlr = 1.5e-2\n");
  auto fine_config = load_train_config(fine);
  INFO((fine_config.has_value() ? std::string() : fine_config.error_message()));
  CHECK(fine_config.has_value());
  std::remove(fine.c_str());
  auto missing = load_train_config("/no/such/job.toml");
  REQUIRE(!missing.has_value());
  CHECK_THAT(missing.error_message(), Catch::Contains("/no/such/job.toml"));
}

TEST_CASE("A job written as TOML text reads back equal") {
  train_config c;
  c.model_size = "llama-tiny";
  c.data_text = "/tmp/some text with \"quotes\"";
  c.steps = 17;
  c.seed = 99;
  c.lr = 1.25e-3;
  c.clip = 0.5;
  c.fixed_batch = true;
  c.ckpt_dir = "/tmp/ck";
  c.moe_aux_loss_coef = 0;  // written only when set (>= 0)
  c.plan.dp = 2;
  c.plan.pp = 2;
  c.plan.zero = 1;
  c.plan.microbatches = 4;
  c.plan.schedule = troupe::scheduler::schedule_kind::gpipe;
  c.plan.order = {"pp", "dp", "tp"};
  auto back = parse_train_config(to_toml(c), "sent");
  REQUIRE(back.has_value());
  CHECK(*back == c);
  auto defaults = parse_train_config(to_toml(train_config{}), "defaults");
  REQUIRE(defaults.has_value());
  CHECK(*defaults == train_config{});
  auto bad = parse_train_config("[train]\nsteps = 0\n", "from rank 0");
  REQUIRE(!bad.has_value());
  CHECK_THAT(bad.error_message(), Catch::Contains("from rank 0") && Catch::Contains("train.steps"));
}

TEST_CASE("The memory table turns the tiers on and reads sizes with suffixes") {
  auto c = parse_train_config(R"(
[memory]
device = "64M"
host = "2G"
nvme_dir = "/tmp/tiers"
nvme_capacity = 1048576
offload_params = 0.5
)",
                              "job.toml");
  REQUIRE(c.has_value());
  CHECK(c->tiers());
  CHECK(c->mem_device == 64ull << 20);
  CHECK(c->mem_host == 2ull << 30);
  CHECK(c->mem_nvme_dir == "/tmp/tiers");
  CHECK(c->mem_nvme_capacity == 1048576);
  CHECK(c->mem_offload_params == 0.5);
  CHECK(c->mem_offload_optimizer == -1);
  CHECK_FALSE(train_config{}.tiers());
  auto back = parse_train_config(to_toml(*c), "sent");
  REQUIRE(back.has_value());
  CHECK(*back == *c);
  CHECK(parse_byte_size("4096") == 4096u);
  CHECK(parse_byte_size("64K") == 65536u);
  CHECK(parse_byte_size("3MiB") == 3u << 20);
  CHECK(parse_byte_size("1t") == 1ull << 40);
  for (const char* bad : {"", "M", "12Q", "1.5G", "-3", "64 M", "99999999999999999999"})
    CHECK_FALSE(parse_byte_size(bad).has_value());
}

TEST_CASE("memory table mistakes name the key and the flag") {
  struct bad_case {
    const char* text;
    const char* says;
  };
  for (auto [text, says] : {
           bad_case{"[memory]\ndevic = \"1M\"\n", "unknown key 'memory.devic'"},
           bad_case{"[memory]\ndevice = \"lots\"\n", "memory.device must be a size"},
           bad_case{"[memory]\nhost = \"1G\"\n", "memory.host (--host-memory) needs memory.device"},
           bad_case{"[memory]\nnvme_dir = \"/x\"\n", "memory.nvme_dir (--nvme-dir) needs"},
           bad_case{"[memory]\ndevice = \"8M\"\noffload = \"some\"\n",
                    "memory.offload (--offload) must be"},
           bad_case{"[memory]\ndevice = \"8M\"\noffload_params = 1.5\n",
                    "memory.offload_params (--offload-params) must be in [0, 1]"},
           bad_case{"[memory]\ndevice = \"8M\"\noffload = \"auto\"\noffload_optimizer = 1\n",
                    "memory.offload_optimizer (--offload-optimizer) is a fixed placement"},
           bad_case{"[memory]\ndevice = \"8M\"\nparams_tier = \"nvme\"\n",
                    "memory.params_tier = \"nvme\" needs memory.nvme_dir"},
           bad_case{"[memory]\ndevice = \"8M\"\nnvme_capacity = \"1G\"\n",
                    "memory.nvme_capacity needs memory.nvme_dir"},
           bad_case{"[memory]\ndevice = \"8M\"\n[train]\nprecision = \"f16\"\n",
                    "needs train.precision = \"f32\" or \"bf16\""},
           bad_case{"[memory]\ndevice = \"8M\"\n[parallel]\ndp = 2\n", "parallel.zero >= 1"},
           bad_case{"[memory]\ndevice = \"8M\"\n[parallel]\ndp = 2\ntp = 2\nzero = 1\n",
                    "parallel.tp = parallel.pp = 1"},
           bad_case{"[memory]\ndevice = \"8M\"\noffload_params = 1\n[parallel]\ndp = 2\nzero = 3\n",
                    "memory.offload_params (--offload-params) on several ranks"},
       }) {
    auto c = parse_train_config(text, "job.toml");
    INFO(text);
    REQUIRE(!c.has_value());
    CHECK_THAT(c.error_message(), Catch::Contains(says) && Catch::Contains("job.toml"));
  }
}

TEST_CASE("parallel.collective_timeout is 600 s unless the job file says otherwise") {
  CHECK(train_config{}.collective_timeout == 600);
  auto c = parse_train_config("[parallel]\ncollective_timeout = 2.5\n", "job.toml");
  REQUIRE(c.has_value());
  CHECK(c->collective_timeout == 2.5);
  auto none = parse_train_config("[parallel]\ncollective_timeout = 0\n", "job.toml");
  REQUIRE(none.has_value());
  CHECK(none->collective_timeout == 0);
  CHECK(parse_train_config(to_toml(*c), "again").value() == *c);
  auto bad = parse_train_config("[parallel]\ncollective_timeout = -1\n", "job.toml");
  REQUIRE(!bad.has_value());
  CHECK(bad.error_message().find(
            "job.toml: parallel.collective_timeout must be seconds in [0, 1e7]") !=
        std::string::npos);
}

TEST_CASE("The memory tiers take bf16 and data-parallel ZeRO ranks") {
  auto bf16 = parse_train_config("[memory]\ndevice = \"8M\"\n[train]\nprecision = \"bf16\"\n", "a");
  REQUIRE(bf16.has_value());
  CHECK(bf16->tiers());
  auto zero3 = parse_train_config(
      "[memory]\ndevice = \"8M\"\noffload = \"auto\"\nnvme_dir = \"/tmp/t\"\n[parallel]\ndp = 2\n"
      "zero = 3\n",
      "b");
  REQUIRE(zero3.has_value());
  CHECK(zero3->plan.world_size() == 2);
}

TEST_CASE("The [elastic] table's joiner settings: a wait and the drill, checked and sent whole") {
  auto c = parse_train_config("[elastic]\njoin_wait = 30\nawait_join = 5\n", "job.toml");
  REQUIRE(c.has_value());
  CHECK(c->elastic());  // a wait for joiners makes the run elastic
  CHECK(c->elastic_join_wait == 30.0);
  CHECK(c->elastic_await_join == 5);
  CHECK(parse_train_config(to_toml(*c), "again").value() == *c);
  auto neg = parse_train_config("[elastic]\njoin_wait = -1\n", "job.toml");
  REQUIRE(!neg.has_value());
  CHECK(neg.error_message().find("elastic.join_wait (--join-wait) must be seconds") !=
        std::string::npos);
  CHECK(!parse_train_config("[elastic]\nawait_join = -2\n", "job.toml").has_value());
}

TEST_CASE("The [elastic] table: spares, buddy replicas and the drill, checked and sent whole") {
  const train_config d;
  CHECK(!d.elastic());
  auto c = parse_train_config(
      "[elastic]\nspares = 2\nreplica_interval = 5\nchaos_kill = \"3:7:commit\"\n", "job.toml");
  REQUIRE(c.has_value());
  CHECK(c->elastic());
  CHECK(c->elastic_spares == 2);
  CHECK(c->elastic_replica_interval == 5);
  CHECK(parse_train_config(to_toml(*c), "again").value() == *c);
  auto kill = parse_chaos_kill(c->elastic_chaos_kill);
  REQUIRE(kill.has_value());
  CHECK(kill->rank == 3);
  CHECK(kill->step == 7);
  CHECK(kill->phase == "commit");
  CHECK(parse_train_config("[elastic]\nenabled = true\n", "a").value().elastic());
  for (const char* bad : {"3:7", "3:0:forward", "x:1:forward", "1:1:later", ""}) {
    INFO(bad);
    CHECK(!parse_chaos_kill(bad).has_value());
    CHECK(!parse_chaos_kills(bad).has_value());
  }
  // Several entries, every phase a step reaches.
  auto several = parse_chaos_kills("1:5:forward,3:12:replicate,2:7:backward,4:9:optimizer");
  REQUIRE(several.has_value());
  REQUIRE(several->size() == 4);
  CHECK((*several)[1].rank == 3);
  CHECK((*several)[1].step == 12);
  CHECK((*several)[1].phase == "replicate");
  CHECK((*several)[2].phase == "backward");
  CHECK((*several)[3].phase == "optimizer");
  CHECK(!parse_chaos_kills("1:5:forward,").has_value());
  CHECK(!parse_chaos_kills("1:5:forward,,2:3:commit").has_value());
  CHECK(parse_train_config("[elastic]\nchaos_kill = \"1:5:backward,2:9:replicate\"\n", "job.toml")
            .has_value());
  auto wrong = parse_train_config("[elastic]\nchaos_kill = \"1:2:later\"\n", "job.toml");
  REQUIRE(!wrong.has_value());
  CHECK(wrong.error_message().find("job.toml: elastic.chaos_kill (--chaos-kill) must be "
                                   "\"RANK:STEP:PHASE\" entries separated by commas") !=
        std::string::npos);
  auto negative = parse_train_config("[elastic]\nspares = -1\n", "job.toml");
  REQUIRE(!negative.has_value());
  CHECK(negative.error_message().find("elastic.spares (--spares) must be in [0, 1024]") !=
        std::string::npos);
  auto tiers = parse_train_config("[elastic]\nspares = 1\n[memory]\ndevice = \"8M\"\n", "job.toml");
  REQUIRE(!tiers.has_value());
  CHECK(tiers.error_message().find("elastic.* cannot be combined with memory.device") !=
        std::string::npos);
}

TEST_CASE("elastic.min_ranks: 0 keeps the full plan, else one model copy up to the plan's ranks",
          "[faults]") {
  CHECK(train_config{}.elastic_min_ranks == 0);  // the default: no shrinking
  auto c = parse_train_config("[parallel]\ndp = 2\npp = 2\n[elastic]\nmin_ranks = 2\n", "job.toml");
  REQUIRE(c.has_value());
  CHECK(c->elastic());  // implies enabled
  CHECK(c->elastic_min_ranks == 2);
  CHECK(parse_train_config(to_toml(*c), "again").value() == *c);
  for (const char* bad : {"1", "5", "-1"}) {
    INFO(bad);
    auto wrong = parse_train_config(
        std::string("[parallel]\ndp = 2\npp = 2\n[elastic]\nmin_ranks = ") + bad + "\n",
        "job.toml");
    REQUIRE(!wrong.has_value());
    CHECK(wrong.error_message().find("job.toml: elastic.min_ranks (--min-ranks) must be 0 (the "
                                     "full plan: no shrinking) or from 2") != std::string::npos);
    std::printf("faults: elastic.min_ranks = %s on dp2 x pp2 -> refused: %s\n", bad,
                wrong.error_message().c_str());
  }
}
