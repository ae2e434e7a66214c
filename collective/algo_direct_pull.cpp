// The direct pull ops between processes of one host: reduce_scatter, all_gather, all_to_all and
// all_to_allv. Each rank reads what it receives straight from its peers' input buffers with
// process_vm_readv (one copy per byte, by the receiver, into its own output); messages over the
// transport only synchronise (direct_sync.cpp: a hello per pair with the address to read, then
// "done with your buffer"). Nobody writes into another rank's memory, and a rank's inputs are
// read only while it is inside the op: it returns only when every peer said "done" (or, after a
// failure, stopped, was lost or is gone).
//
//   all_gather: rank me reads peer g's input into block g of its output, peers in the order me+1,
//     me+2, ... (so that at 4 ranks no two ranks read the same peer at once), in pieces of
//     direct_copy_bytes; its own block is a memcpy while the hellos travel.
//   all_to_all, all_to_allv: the same with the block peer g sends to me; the hello of all_to_allv
//     carries both counts of the pair (what g sends me, what g expects from me), so a pair whose
//     counts differ fails the op on both of its ranks naming them, and every other rank fails
//     through the stop protocol instead of waiting for the deadline.
//   reduce_scatter: rank me reads block me of every peer's input in pieces of direct_piece_bytes
//     into scratch and reduces each into its output at once (16-bit types accumulate in f32 and
//     round once), the own block first, then peers me+1, me+2, ...
#include <algorithm>
#include <cstring>

#include "collective/algo.hpp"
#include "collective/reduce.hpp"
#include "memory/error.hpp"

namespace troupe::collective::detail {

namespace {

// Reads `bytes` bytes at `remote` of peer g into `dst` in pieces of direct_copy_bytes, checking
// between pieces for abort, the deadline and a peer's "stop".
void pull(op_context& c, int g, char* dst, std::uint64_t remote, std::size_t bytes,
          std::vector<p2p_request>& ends, std::vector<char>& seen) {
  const std::size_t piece = c.tune.direct_copy_bytes;
  for (std::size_t off = 0; off < bytes; off += piece) {
    c.check();
    poll_stops(c, ends, seen);
    copy_peer(c, g, dst + off, remote + off, std::min(piece, bytes - off));
  }
}

std::string kind_text(std::int32_t kind) {
  const auto k = static_cast<op_kind>(kind >> 16 & 0xff);
  return std::string(op_kind_name(k)) + " of " +
         std::string(dtype_name(static_cast<dtype>(kind >> 8 & 0xff)));
}

// Peer g's hello says the same op (kind) and count as this rank's, else throws naming both.
void check_same(op_context& c, int g, std::int32_t kind, std::size_t count) {
  const direct_msg& h = c.direct->in[g];
  TROUPE_CHECK(h.kind == kind && h.count == count, "direct ", c.direct->op, ": rank ", c.ranks[g],
               " issued ", kind_text(h.kind), " x ", h.count, " but rank ", c.ranks[c.me],
               " issued ", kind_text(kind), " x ", count);
}

}  // namespace

void all_gather_direct(op_context& c, const void* in, void* out, std::size_t count, dtype t) {
  direct_state& d = *c.direct;
  const std::size_t bytes = count * dtype_size(t);
  const std::int32_t kind = direct_kind(op_kind::all_gather, t, reduce_op::sum);
  for (direct_msg& m : d.outs)
    m = direct_msg{0, reinterpret_cast<std::uint64_t>(in), count, 0, 0, kind};
  char* o = static_cast<char*>(out);
  direct_round(
      c,
      [&] {
        char* own = o + c.me * bytes;
        if (own != in) std::memmove(own, in, bytes);
      },
      [&](int g) { check_same(c, g, kind, count); },
      [&](std::vector<p2p_request>& ends) {
        std::vector<char> seen(c.n, 0);
        for (int j = 1; j < c.n; ++j) {
          const int g = (c.me + j) % c.n;
          pull(c, g, o + g * bytes, d.in[g].addr, bytes, ends, seen);
        }
      });
}

void all_to_allv_direct(op_context& c, op_kind k, const void* in,
                        const std::vector<std::size_t>& send_counts, void* out,
                        const std::vector<std::size_t>& recv_counts, dtype t) {
  direct_state& d = *c.direct;
  const int n = c.n, me = c.me;
  const std::size_t es = dtype_size(t);
  const std::int32_t kind = direct_kind(k, t, reduce_op::sum);
  const std::vector<std::size_t> soff = offsets_of(send_counts), roff = offsets_of(recv_counts);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  for (int g = 0; g < n; ++g)
    d.outs[g] = direct_msg{
        0,   reinterpret_cast<std::uint64_t>(src + soff[g] * es), send_counts[g], recv_counts[g], 0,
        kind};
  direct_round(
      c,
      [&] {
        if (send_counts[me] > 0)
          std::memmove(dst + roff[me] * es, src + soff[me] * es, send_counts[me] * es);
      },
      [&](int g) {
        const direct_msg& h = d.in[g];
        if (k == op_kind::all_to_all || h.kind != kind)
          return check_same(c, g, kind, recv_counts[g]);
        const std::string who = std::to_string(c.ranks[g]), mine = std::to_string(c.ranks[me]);
        TROUPE_CHECK(h.count == recv_counts[g], "all_to_allv: rank ", who, " sends ", h.count,
                     " elements to rank ", mine, ", which expects ", recv_counts[g], " from it");
        TROUPE_CHECK(h.aux == send_counts[g], "all_to_allv: rank ", mine, " sends ", send_counts[g],
                     " elements to rank ", who, ", which expects ", h.aux, " from it");
      },
      [&](std::vector<p2p_request>& ends) {
        std::vector<char> seen(n, 0);
        for (int j = 1; j < n; ++j) {
          const int g = (me + j) % n;
          pull(c, g, dst + roff[g] * es, d.in[g].addr, recv_counts[g] * es, ends, seen);
        }
      });
}

void reduce_scatter_direct(op_context& c, const void* in, void* out, std::size_t count, dtype t,
                           reduce_op op) {
  direct_state& d = *c.direct;
  const int n = c.n, me = c.me;
  const std::size_t tsz = dtype_size(t);
  const bool same = t == dtype::f32 || t == dtype::f64;
  const std::int32_t kind = direct_kind(op_kind::reduce_scatter, t, op);
  const char* src = static_cast<const char*>(in);
  for (int g = 0; g < n; ++g)
    d.outs[g] =
        direct_msg{0, reinterpret_cast<std::uint64_t>(src + g * count * tsz), count, 0, 0, kind};
  direct_round(
      c, [] {}, [&](int g) { check_same(c, g, kind, count); },
      [&](std::vector<p2p_request>& ends) {
        std::vector<char> seen(n, 0);
        const std::size_t piece = std::max<std::size_t>(c.tune.direct_piece_bytes / tsz, 1);
        char* tmp = static_cast<char*>(c.scratch->get(0, piece * tsz));
        float* acc = same ? nullptr : static_cast<float*>(c.scratch->get(1, piece * 4));
        const float divisor = op == reduce_op::avg ? static_cast<float>(n) : 1.0f;
        for (std::size_t off = 0; off < count; off += piece) {
          c.check();
          poll_stops(c, ends, seen);
          const std::size_t len = std::min(piece, count - off);
          const char* own = src + (me * count + off) * tsz;
          char* res = static_cast<char*>(out) + off * tsz;
          if (!same) widen(acc, reinterpret_cast<const std::uint16_t*>(own), len, t);
          for (int j = 1; j < n; ++j) {
            const int g = (me + j) % n;
            copy_peer(c, g, tmp, d.in[g].addr + off * tsz, len * tsz);
            const auto* b16 = reinterpret_cast<const std::uint16_t*>(tmp);
            if (same)
              reduce_same(res, j == 1 ? own : res, tmp, len, t, op);
            else if (j + 1 < n)
              reduce_widen(acc, acc, b16, len, t, op);
            else
              reduce_narrow(reinterpret_cast<std::uint16_t*>(res), acc, b16, len, t, op, divisor);
          }
          if (same && op == reduce_op::avg) divide(res, len, t, n);
        }
      });
}

}  // namespace troupe::collective::detail
