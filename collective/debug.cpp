// The debug wrapper (see debug.hpp): signature all-gather and comparison before every op.
#include "collective/debug.hpp"

#include <cstring>
#include <optional>
#include <sstream>

#include "memory/error.hpp"

namespace troupe::collective {

namespace {

// The fixed-size description of one op that every rank all-gathers.
struct signature {
  std::uint64_t seq = 0;
  std::uint64_t count = 0;
  std::int32_t peer = -1;  // broadcast root, send/recv peer
  std::uint8_t kind = 0;
  std::uint8_t type = 0;
  std::uint8_t op = 0xff;  // reduce op, 0xff when none
  std::uint8_t pad = 0;
};
static_assert(sizeof(signature) == 24);

std::string describe(const signature& s) {
  std::ostringstream os;
  const auto k = static_cast<op_kind>(s.kind);
  os << op_kind_name(k);
  if (k == op_kind::barrier) return os.str() + "()";
  os << "(" << dtype_name(static_cast<dtype>(s.type)) << ", " << s.count;
  if (s.op != 0xff) os << ", " << reduce_op_name(static_cast<reduce_op>(s.op));
  if (k == op_kind::broadcast) os << ", root " << s.peer;
  if (k == op_kind::send) os << ", to " << s.peer;
  if (k == op_kind::recv) os << ", from " << s.peer;
  os << ")";
  return os.str();
}

bool same(const signature& a, const signature& b) {
  return a.seq == b.seq && a.count == b.count && a.peer == b.peer && a.kind == b.kind &&
         a.type == b.type && a.op == b.op;
}

class debug_communicator final : public communicator {
 public:
  explicit debug_communicator(std::unique_ptr<communicator> inner) : inner_(std::move(inner)) {
    TROUPE_CHECK(inner_ != nullptr, "make_debug_communicator: no communicator to wrap");
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string name() const override { return inner_->name(); }
  void set_timeout(std::chrono::milliseconds timeout) override { inner_->set_timeout(timeout); }

  work allreduce(void* data, std::size_t count, dtype t, const options& o) override {
    check(op_kind::allreduce, t, count, -1, o.op, o);
    return inner_->allreduce(data, count, t, o);
  }
  work reduce_scatter(const void* in, void* out, std::size_t count, dtype t,
                      const options& o) override {
    check(op_kind::reduce_scatter, t, count, -1, o.op, o);
    return inner_->reduce_scatter(in, out, count, t, o);
  }
  work all_gather(const void* in, void* out, std::size_t count, dtype t,
                  const options& o) override {
    check(op_kind::all_gather, t, count, -1, std::nullopt, o);
    return inner_->all_gather(in, out, count, t, o);
  }
  work broadcast(void* data, std::size_t count, dtype t, const options& o) override {
    check(op_kind::broadcast, t, count, o.root, std::nullopt, o);
    return inner_->broadcast(data, count, t, o);
  }
  work all_to_all(const void* in, void* out, std::size_t count, dtype t,
                  const options& o) override {
    check(op_kind::all_to_all, t, count, -1, std::nullopt, o);
    return inner_->all_to_all(in, out, count, t, o);
  }
  work all_to_allv(const void* in, std::span<const std::size_t> send_counts, void* out,
                   std::span<const std::size_t> recv_counts, dtype t, const options& o) override {
    check(op_kind::all_to_allv, t, 0, -1, std::nullopt, o);
    check_splits(send_counts, recv_counts, o);
    return inner_->all_to_allv(in, send_counts, out, recv_counts, t, o);
  }
  work send(const void* data, std::size_t count, dtype t, int peer, const options& o) override {
    check(op_kind::send, t, count, peer, std::nullopt, o);
    return inner_->send(data, count, t, peer, o);
  }
  work recv(void* data, std::size_t count, dtype t, int peer, const options& o) override {
    check(op_kind::recv, t, count, peer, std::nullopt, o);
    return inner_->recv(data, count, t, peer, o);
  }
  work barrier(const options& o) override {
    check(op_kind::barrier, dtype::u8, 0, -1, std::nullopt, o);
    return inner_->barrier(o);
  }

  void abort(const std::string& reason) override { inner_->abort(reason); }
  std::vector<flight_record> recent() const override { return inner_->recent(); }

 private:
  // All-gathers this rank's signature and throws on every rank if any rank differs.
  void check(op_kind k, dtype t, std::size_t count, int peer, std::optional<reduce_op> rop,
             const options& o) {
    signature mine;
    mine.seq = ++seq_;
    mine.count = count;
    mine.peer = peer;
    mine.kind = static_cast<std::uint8_t>(k);
    mine.type = static_cast<std::uint8_t>(t);
    mine.op = rop ? static_cast<std::uint8_t>(*rop) : 0xff;
    const int n = size();
    std::vector<signature> all(n);
    options go;
    go.timeout = o.timeout;
    inner_->all_gather(&mine, all.data(), sizeof(signature), dtype::u8, go).wait();

    std::ostringstream why;
    const bool p2p = k == op_kind::send || k == op_kind::recv;
    if (!p2p) {
      std::vector<int> differ;
      for (int r = 0; r < n; ++r)
        if (!same(all[r], all[0])) differ.push_back(r);
      if (!differ.empty()) {
        why << "rank 0 issued " << describe(all[0]) << " but ";
        for (std::size_t i = 0; i < differ.size(); ++i)
          why << (i ? ", " : "") << "rank " << differ[i] << " issued " << describe(all[differ[i]]);
      }
    } else {
      for (int a = 0; a < n && why.tellp() == 0; ++a) {
        const auto ka = static_cast<op_kind>(all[a].kind);
        if (ka != op_kind::send && ka != op_kind::recv) {
          why << "rank " << rank_issued(a, all) << " but rank " << a << " issued "
              << describe(all[a]);
          break;
        }
        const int b = all[a].peer;
        if (b < 0 || b >= n || b == a) {
          why << "rank " << a << " issued " << describe(all[a]) << " to no other rank";
          break;
        }
        signature want = all[a];
        want.kind = static_cast<std::uint8_t>(ka == op_kind::send ? op_kind::recv : op_kind::send);
        want.peer = a;
        if (!same(all[b], want))
          why << "rank " << a << " issued " << describe(all[a]) << " but rank " << b << " issued "
              << describe(all[b]);
      }
    }
    if (why.tellp() != 0)
      TROUPE_FAIL("collective mismatch at op #", mine.seq, " on ", name(), ": ", why.str());
  }

  // "<r> issued <op>" for the first rank that issued a send or recv (for the p2p message).
  static std::string rank_issued(int not_this, const std::vector<signature>& all) {
    for (std::size_t r = 0; r < all.size(); ++r) {
      const auto k = static_cast<op_kind>(all[r].kind);
      if (static_cast<int>(r) != not_this && (k == op_kind::send || k == op_kind::recv))
        return std::to_string(r) + " issued " + describe(all[r]);
    }
    return "?";
  }

  void check_splits(std::span<const std::size_t> sc, std::span<const std::size_t> rc,
                    const options& o) {
    const int n = size();
    TROUPE_CHECK(sc.size() == static_cast<std::size_t>(n) && rc.size() == sc.size(),
                 "all_to_allv on ", name(), ": ", sc.size(), " send counts and ", rc.size(),
                 " receive counts for a group of ", n);
    std::vector<std::uint64_t> mine(2 * n), all(2 * n * n);
    for (int j = 0; j < n; ++j) {
      mine[j] = sc[j];
      mine[n + j] = rc[j];
    }
    options go;
    go.timeout = o.timeout;
    inner_->all_gather(mine.data(), all.data(), 2 * n, dtype::i64, go).wait();
    for (int i = 0; i < n; ++i)
      for (int j = 0; j < n; ++j) {
        const std::uint64_t sent = all[i * 2 * n + j], expected = all[j * 2 * n + n + i];
        if (sent != expected)
          TROUPE_FAIL("collective mismatch at op #", seq_, " on ", name(), ": all_to_allv rank ", i,
                      " sends ", sent, " elements to rank ", j, " but rank ", j, " expects ",
                      expected);
      }
  }

  std::unique_ptr<communicator> inner_;
  std::uint64_t seq_ = 0;
};

}  // namespace

std::unique_ptr<communicator> make_debug_communicator(std::unique_ptr<communicator> inner) {
  return std::make_unique<debug_communicator>(std::move(inner));
}

}  // namespace troupe::collective
