// Names of the communicator enums, for messages, the flight recorder and introspection.
#include "collective/communicator.hpp"

namespace troupe::collective {

const char* reduce_op_name(reduce_op op) {
  switch (op) {
    case reduce_op::sum:
      return "sum";
    case reduce_op::avg:
      return "avg";
    case reduce_op::max:
      return "max";
  }
  return "?";
}

const char* op_kind_name(op_kind k) {
  switch (k) {
    case op_kind::allreduce:
      return "allreduce";
    case op_kind::reduce_scatter:
      return "reduce_scatter";
    case op_kind::all_gather:
      return "all_gather";
    case op_kind::broadcast:
      return "broadcast";
    case op_kind::all_to_all:
      return "all_to_all";
    case op_kind::all_to_allv:
      return "all_to_allv";
    case op_kind::send:
      return "send";
    case op_kind::recv:
      return "recv";
    case op_kind::barrier:
      return "barrier";
  }
  return "?";
}

}  // namespace troupe::collective
