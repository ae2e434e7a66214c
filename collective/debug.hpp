// The debug wrapper: checks that every rank of a communicator issues the same sequence of ops.
//
// Before each op the ranks all-gather a fixed-size signature of it (op number, kind, dtype, count,
// root, reduce op; for send/recv the peer) on the wrapped communicator, so the check itself can
// never hang on mismatched sizes. A difference throws troupe::error on every rank at issue time,
// naming the op number, the communicator and what each differing rank issued, e.g.
//   collective mismatch at op #7 on ucx#3[0,1]: rank 0 issued allreduce(f32, 1024, sum) but
//   rank 1 issued all_gather(f32, 512)
// instead of a hang or silently wrong data. all_to_allv also all-gathers the split sizes and checks
// that rank i's send count to j equals j's receive count from i. send/recv pass when, at that op
// number, every rank issued one and each send(to b) on rank a meets recv(from a) on rank b with the
// same count and dtype: so through the wrapper, every rank of the group takes part in each p2p
// step (make a two-rank communicator per pipeline edge).
//
// The check costs one small all-gather and a host wait per op: a tool for development and for
// reproducing hangs, not for production runs.
#pragma once

#include <memory>

#include "collective/communicator.hpp"

namespace troupe::collective {

std::unique_ptr<communicator> make_debug_communicator(std::unique_ptr<communicator> inner);

}  // namespace troupe::collective
