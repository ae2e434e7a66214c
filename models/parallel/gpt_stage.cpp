// gpt_stage: stage<gpt_family> instantiated (see gpt_stage.hpp).
#include "models/parallel/gpt_stage.hpp"

namespace troupe::models::parallel {

template class stage<gpt_family>;

}  // namespace troupe::models::parallel
