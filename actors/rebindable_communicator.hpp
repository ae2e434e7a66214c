// A communicator whose backing communicator can be replaced: the stable object a training piece
// keeps (models/parallel/hybrid.hpp holds raw communicator pointers in its layers, its pipeline
// runner and its data-parallel engine), while elastic recovery (actors/training.hpp) puts a new
// communicator under it - a new group id, so no message of the old one can match, over the ranks
// of the new membership generation - after a lost rank was replaced.
//
// Every op forwards to the communicator bound when it is issued; a work handle keeps waiting on
// the one it came from. abort() and rebind() may run on any thread (abort from a membership
// callback while the trainer's thread is inside an op: that op fails, as with the backing one).
// The group rank and size must stay the same across rebinds (the same grid position, another
// process). The old communicator is destroyed by rebind(): call it once no op of the old one is
// waited for any more (the failed step has ended).
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "collective/communicator.hpp"

namespace troupe::actors {

class rebindable_communicator final : public collective::communicator {
 public:
  explicit rebindable_communicator(std::unique_ptr<collective::communicator> inner);
  ~rebindable_communicator() override;

  // Replaces the backing communicator (same rank and size, else troupe::error naming both;
  // `any_shape`: another group, e.g. a replica's survivors saving on their own).
  void rebind(std::unique_ptr<collective::communicator> inner, bool any_shape = false);

  // `f` runs once, on the thread that issues the next allreduce or reduce_scatter, before it is
  // issued (the elastic drill's "backward" kill: a step's first gradient reduction); an empty `f`
  // clears it.
  void before_next_reduction(std::function<void()> f);

  int rank() const override;
  int size() const override;
  std::string name() const override;
  collective::work allreduce(void* data, std::size_t count, dtype t,
                             const collective::options& o = {}) override;
  collective::work reduce_scatter(const void* in, void* out, std::size_t count, dtype t,
                                  const collective::options& o = {}) override;
  collective::work all_gather(const void* in, void* out, std::size_t count, dtype t,
                              const collective::options& o = {}) override;
  collective::work broadcast(void* data, std::size_t count, dtype t,
                             const collective::options& o = {}) override;
  collective::work all_to_all(const void* in, void* out, std::size_t count, dtype t,
                              const collective::options& o = {}) override;
  collective::work all_to_allv(const void* in, std::span<const std::size_t> send_counts, void* out,
                               std::span<const std::size_t> recv_counts, dtype t,
                               const collective::options& o = {}) override;
  collective::work send(const void* data, std::size_t count, dtype t, int peer,
                        const collective::options& o = {}) override;
  collective::work recv(void* data, std::size_t count, dtype t, int peer,
                        const collective::options& o = {}) override;
  collective::work barrier(const collective::options& o = {}) override;
  void set_timeout(std::chrono::milliseconds timeout) override;
  void abort(const std::string& reason) override;
  std::vector<collective::flight_record> recent() const override;

 private:
  std::shared_ptr<collective::communicator> current() const;
  void run_reduction_hook();
  mutable std::mutex mu_;
  std::shared_ptr<collective::communicator> inner_;
  std::chrono::milliseconds timeout_{0};
  bool timeout_set_ = false;
  std::function<void()> reduction_hook_;
};

}  // namespace troupe::actors
