// Work handles: completion, waiting (spin briefly, then sleep), and the default host hooks.
#include "collective/work.hpp"

#include <chrono>
#include <thread>

#include "memory/error.hpp"

namespace troupe::collective {

namespace detail {

namespace {
inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}
}  // namespace

std::string work_state::describe() const {
  return std::string(op_kind_name(kind)) + " #" + std::to_string(seq) + " on " + comm;
}

bool work_state::finish(int to, std::string* message) {
  // One finisher wins; it writes `error` before publishing the status, so a reader that sees
  // `failed` sees the whole message.
  if (claimed_.exchange(true, std::memory_order_acq_rel)) return false;
  if (message != nullptr) error = std::move(*message);
  status.store(to, std::memory_order_release);
  status.notify_all();
  return true;
}

bool work_state::complete() {
  return finish(done, nullptr);
}
bool work_state::fail(std::string message) {
  return finish(failed, &message);
}

void work_state::throw_if_failed() const {
  if (status.load(std::memory_order_acquire) == failed) throw troupe::error(error);
}

bool work_state::test() {
  if (!finished()) return false;
  throw_if_failed();
  return true;
}

void work_state::wait() {
  using clock = std::chrono::steady_clock;
  if (!finished()) {
    // Short ops finish within microseconds: spin a little, then yield (cores are shared), then
    // sleep in the kernel until the finisher's notify.
    auto t0 = clock::now();
    int spins = 0;
    while (!finished()) {
      if (spin && ++spins < 2000) {
        cpu_relax();
        continue;
      }
      if (clock::now() - t0 > std::chrono::microseconds(50)) break;
      std::this_thread::yield();
    }
    while (!finished()) status.wait(pending, std::memory_order_acquire);
  }
  throw_if_failed();
}

void work_state::wait_stream(void*) {
  wait();
}

}  // namespace detail

void work::wait() {
  TROUPE_CHECK(s_ != nullptr, "work::wait on an empty work handle");
  s_->wait();
}

bool work::test() {
  TROUPE_CHECK(s_ != nullptr, "work::test on an empty work handle");
  return s_->test();
}

void work::wait_stream(void* stream) {
  TROUPE_CHECK(s_ != nullptr, "work::wait_stream on an empty work handle");
  s_->wait_stream(stream);
}

}  // namespace troupe::collective
