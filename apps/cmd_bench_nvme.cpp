// `troupe bench nvme`: sequential write then read throughput of the NVMe tier's store
// (memory/io/nvme_store.hpp), laid out like fio's `--rw=write` / `--rw=read` jobs so that
// scripts/bench/nvme_vs_fio.sh can put the two side by side: one file of --size bytes, pages of
// --block bytes (one page per block, keys 0..n-1 in file order), --depth requests in flight, the
// caller's buffers registered with the store. GB/s = 1e9 bytes per second of wall time from the
// first request to the last completion (no fsync, as fio's default). Reads are verified twice: the
// store's CRC32C per 4 KiB block, and the block number stamped into each block on write.
// --via actor runs the same requests through the NVMe actor (actors/nvme_actor.hpp: a CAF actor
// owning the store, on an actor system of its own) via its page_io client; --via store (the
// default) calls the store directly.
#include <fmt/core.h>
#include <CLI/CLI.hpp>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "actors/nvme_actor.hpp"
#include "apps/commands.hpp"
#include "memory/buffer.hpp"
#include "memory/error.hpp"
#include "memory/io/nvme_store.hpp"

namespace troupe::apps {
namespace {

namespace io = memory::io;
using clock_type = std::chrono::steady_clock;

struct nvme_args {
  std::string dir = "/var/tmp";
  std::string size = "1G";
  std::string block = "1M";
  unsigned depth = 8;
  std::string backend;        // "" = default (io_uring unless refused or TROUPE_NVME_BACKEND)
  std::string via = "store";  // "store" or "actor"
  bool json = false;
};

// "4096", "512K", "1M", "1G" (binary units, as fio).
std::uint64_t parse_bytes(const std::string& s, const char* flag) {
  TROUPE_CHECK(!s.empty(), "troupe bench nvme: ", flag, " is empty");
  std::size_t used = 0;
  std::uint64_t v = 0;
  try {
    v = std::stoull(s, &used);
  } catch (const std::exception&) {
    TROUPE_FAIL("troupe bench nvme: ", flag, " ", s, " is not a size like 4096, 512K, 1M or 1G");
  }
  std::string unit = s.substr(used);
  std::uint64_t mult = 1;
  if (unit == "K" || unit == "k" || unit == "KiB")
    mult = 1ull << 10;
  else if (unit == "M" || unit == "m" || unit == "MiB")
    mult = 1ull << 20;
  else if (unit == "G" || unit == "g" || unit == "GiB")
    mult = 1ull << 30;
  else
    TROUPE_CHECK(unit.empty(), "troupe bench nvme: ", flag, " ", s, " has an unknown unit '", unit,
                 "' (use K, M or G)");
  return v * mult;
}

int run_bench(const nvme_args& a) {
  const std::uint64_t size = parse_bytes(a.size, "--size");
  const std::uint64_t block = parse_bytes(a.block, "--block");
  TROUPE_CHECK(block >= io::nvme_block && block % io::nvme_block == 0,
               "troupe bench nvme: --block ", a.block, " must be a multiple of 4 KiB");
  TROUPE_CHECK(size >= block && size % block == 0, "troupe bench nvme: --size ", a.size,
               " must be a multiple of --block ", a.block);
  const std::uint64_t n = size / block;

  io::nvme_store_options o;
  o.dir = a.dir;
  o.name = "troupe_bench_nvme";
  o.queue_depth = a.depth;
  if (a.backend == "pread")
    o.backend = io::io_backend::pread;
  else if (a.backend == "io_uring")
    o.backend = io::io_backend::io_uring;
  else
    TROUPE_CHECK(a.backend.empty(), "troupe bench nvme: --backend ", a.backend,
                 " is not one of io_uring, pread");
  TROUPE_CHECK(a.via == "store" || a.via == "actor", "troupe bench nvme: --via ", a.via,
               " is not one of store, actor");
  std::unique_ptr<io::nvme_store> own;
  std::unique_ptr<actors::nvme_actor> actor;
  std::shared_ptr<io::page_io> client;
  io::page_io* store = nullptr;
  if (a.via == "actor") {
    actor = std::make_unique<actors::nvme_actor>(o);
    client = actor->client();
    store = client.get();
  } else {
    own = std::make_unique<io::nvme_store>(o);
    store = own.get();
  }
  auto registration = [&](void* p, std::size_t bytes) {
    if (actor)
      bytes ? actor->register_buffer(p, bytes) : actor->unregister_buffer(p);
    else
      bytes ? own->register_buffer(p, bytes) : own->unregister_buffer(p);
  };

  // One slot per request in flight, in one registered pinned (4 KiB aligned) buffer.
  memory::buffer slots = memory::buffer::pinned(a.depth * block);
  auto* base = static_cast<unsigned char*>(slots.data());
  std::mt19937_64 rng(1234);
  for (std::uint64_t i = 0; i < a.depth * block; i += 8) {
    std::uint64_t w = rng();
    std::memcpy(base + i, &w, 8);
  }
  registration(base, a.depth * block);
  std::vector<io::io_ticket> tickets(a.depth);

  auto t0 = clock_type::now();
  for (std::uint64_t k = 0; k < n; ++k) {
    unsigned s = static_cast<unsigned>(k % a.depth);
    tickets[s].wait();
    unsigned char* p = base + s * block;
    std::memcpy(p, &k, sizeof k);  // stamp: the block number
    tickets[s] = store->write(k, p, block);
  }
  for (auto& t : tickets) t.wait();
  double write_s = std::chrono::duration<double>(clock_type::now() - t0).count();

  std::uint64_t bad_stamps = 0;
  std::vector<std::uint64_t> slot_key(a.depth, UINT64_MAX);
  auto check_slot = [&](unsigned s) {
    tickets[s].wait();
    if (slot_key[s] == UINT64_MAX) return;
    std::uint64_t got;
    std::memcpy(&got, base + s * block, sizeof got);
    bad_stamps += got != slot_key[s];
  };
  t0 = clock_type::now();
  for (std::uint64_t k = 0; k < n; ++k) {
    unsigned s = static_cast<unsigned>(k % a.depth);
    check_slot(s);
    slot_key[s] = k;
    tickets[s] = store->read(k, base + s * block, block);
  }
  for (unsigned s = 0; s < a.depth; ++s) check_slot(s);
  double read_s = std::chrono::duration<double>(clock_type::now() - t0).count();
  TROUPE_CHECK(bad_stamps == 0, "troupe bench nvme: ", bad_stamps,
               " blocks read back with the wrong block number from ", store->path());
  registration(base, 0);

  const double wgb = size / write_s / 1e9, rgb = size / read_s / 1e9;
  const auto st = store->stats();
  if (a.json) {
    fmt::print(
        "{{\"via\": \"{}\", \"backend\": \"{}\", \"direct\": {}, \"size\": {}, \"block\": {}, "
        "\"depth\": {}, "
        "\"write_s\": {:.4f}, \"read_s\": {:.4f}, \"write_gbps\": {:.4f}, \"read_gbps\": "
        "{:.4f}}}\n",
        a.via, io::backend_name(store->backend()), store->direct_io() ? "true" : "false", size,
        block, a.depth, write_s, read_s, wgb, rgb);
    return 0;
  }
  fmt::print("troupe bench nvme: {} ({:.2f} GiB), block {} KiB, depth {}, via {}, backend {}{}\n",
             store->path(), size / double(1ull << 30), block >> 10, a.depth, a.via,
             io::backend_name(store->backend()), store->direct_io() ? ", O_DIRECT" : ", buffered");
  if (!store->backend_note().empty()) fmt::print("  note: {}\n", store->backend_note());
  fmt::print("  write: {:8.3f} s  {:6.2f} GB/s  (busy {:.3f} s)\n", write_s, wgb, st.write_busy_s);
  fmt::print(
      "  read:  {:8.3f} s  {:6.2f} GB/s  (busy {:.3f} s; CRC32C and block stamps verified)\n",
      read_s, rgb, st.read_busy_s);
  return 0;
}

}  // namespace

command_fn add_bench_nvme_command(CLI::App& bench) {
  auto a = std::make_shared<nvme_args>();
  auto* sub = bench.add_subcommand(
      "nvme", "Sequential write and read GB/s of the NVMe tier's store (io_uring, O_DIRECT)");
  sub->add_option("--dir", a->dir, "Directory for the store's file (on the disk to measure)");
  sub->add_option("--size", a->size, "File size, e.g. 1G");
  sub->add_option("--block", a->block, "Bytes per request (one page), e.g. 1M");
  sub->add_option("--depth", a->depth, "Requests in flight")->check(CLI::Range(1, 4096));
  sub->add_option("--backend", a->backend, "Force io_uring or pread");
  sub->add_option("--via", a->via, "store (direct calls) or actor (through the NVMe actor)");
  sub->add_flag("--json", a->json, "Print one JSON line");
  return [sub, a]() -> int {
    if (!sub->parsed()) return -1;
    return run_bench(*a);
  };
}

}  // namespace troupe::apps
