// Llama's tensor shard instantiated, and parallelize_llama (see parallelize_llama.hpp).
#include "models/parallel/parallelize_llama.hpp"

namespace troupe::models {

template class tp_trunk<llama_family>;
template class tp_model<llama_family>;

std::unique_ptr<tp_llama> parallelize_llama(const llama& model, batch_dims dims,
                                            collective::communicator& tp, bool sequence_parallel) {
  auto m = std::make_unique<tp_llama>(model.config(), dims, tp_group{&tp, sequence_parallel});
  m->load_from(model);
  return m;
}

}  // namespace troupe::models
