// Role actors and actor scripts, without CAF types.
//
// Every rank runs the same binary and registers the same roles: a name and a factory that installs
// handlers on a role_builder. A driver (any rank, usually 0) then spawns role actors on chosen
// ranks and talks to them with typed requests:
//
//   struct sum_request { std::vector<int> xs; auto fields() { return std::tie(xs); } };
//   roles.add("worker", [](role_builder& b, role_context& ctx) {
//     b.on<sum_request>([](role_context& c, const sum_request& r) { return sum(r.xs); });
//   });
//   node_options o;
//   o.roles = &roles;
//   troupe::actors::node n(o);
//   if (n.rank() == 0) {
//     job j(n);
//     auto w = j.spawn("worker", 1);
//     long s = j.ask<long>(w, sum_request{{1, 2, 3}});
//     auto all = j.ask_all<long>(j.spawn_on_all("worker"), sum_request{{4}});
//   }
//   n.barrier("done");
//
// Each role actor runs on its own thread (a detached CAF actor), one message at a time, so a
// handler may block (receive a tensor, run a collective). Requests and replies are user structs
// encoded by actors/codec.hpp. Errors name the actor and its rank: a handler that throws, an
// unknown request kind, a timeout, a lost rank.
#pragma once

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "actors/codec.hpp"
#include "actors/node.hpp"

namespace troupe::actors {

// Names a role actor anywhere in the job; plain data, so it can travel inside requests.
struct role_handle {
  std::string name;  // unique in the job, e.g. "worker@2"
  std::string role;  // the registered role, e.g. "worker"
  int rank = -1;
  std::uint16_t channel = 0;  // the actor's tensor channel on its rank
  auto fields() { return std::tie(name, role, rank, channel); }
  bool valid() const { return rank >= 0 && channel != 0; }
};

class role_actor_state;

// What a handler sees of the actor it runs in.
class role_context {
 public:
  role_context(actors::node& n, role_handle self, std::shared_ptr<role_actor_state> state);
  const role_handle& self() const { return self_; }
  const std::string& name() const { return self_.name; }
  int rank() const { return self_.rank; }
  actors::node& node() const { return node_; }

  // Introspection: shown by `troupe ps` / `troupe top` and the HTTP endpoint.
  void set_activity(const std::string& activity);
  void set_metric(const std::string& key, double value);
  void set_mesh(const std::string& axis, int coordinate);
  // Records one finished step (1-based) in the actor's step history, the per-step series the
  // dashboard charts. The history spans the whole run in at most `step_history_limit` samples:
  // every step until it is full, then every 2nd, 4th, ... step (the stride doubles each time it
  // fills), always ending with the latest step. Also sets the values as metrics (`troupe ps`).
  static constexpr std::size_t step_history_limit = 200;
  void record_step(std::int64_t step, const std::map<std::string, double>& values);
  // Shows `c`'s recent operations (its flight recorder) in this actor's describe answer, so a
  // hang names the collective it waits in. Keep the handle next to the communicator, declared
  // after it: the communicator must outlive the registration (collective_watch, actors/node.hpp).
  [[nodiscard]] collective_watch watch(collective::communicator& c);

  // Tensors from and to this actor, counted in its statistics.
  received_tensor receive(const tensor_info& info,
                          std::chrono::milliseconds timeout = std::chrono::milliseconds{0});
  void receive(const tensor_info& info, void* dst, std::size_t bytes,
               std::chrono::milliseconds timeout = std::chrono::milliseconds{0});
  tensor_send send_tensor(const role_handle& dest, const void* data, dtype type,
                          std::span<const std::int64_t> shape, const std::string& name = {});
  tensor_send send_tensor(int dest, const void* data, dtype type,
                          std::span<const std::int64_t> shape, const std::string& name = {});

 private:
  actors::node& node_;
  role_handle self_;
  std::shared_ptr<role_actor_state> state_;
};

// Installs the handlers of one role actor.
class role_builder {
 public:
  using raw_handler = std::function<bytes(role_context&, const bytes&)>;
  struct raw_entry {
    raw_handler fn;
    std::string reply_kind;
  };

  // Handles requests of type Req; f(role_context&, const Req&) returns the reply (any encodable
  // type). A thrown exception becomes the asker's error.
  template <class Req, class F>
  role_builder& on(F f) {
    using Rep = std::decay_t<std::invoke_result_t<F&, role_context&, const Req&>>;
    raw_entry e;
    e.reply_kind = kind_of<Rep>();
    e.fn = [f = std::move(f)](role_context& ctx, const bytes& in) mutable -> bytes {
      Req req = decode<Req>(in);
      return encode(f(ctx, req));
    };
    handlers_[kind_of<Req>()] = std::move(e);
    return *this;
  }
  // Handles tensors sent to this actor (node::send_tensor(role_handle, ...)); the handler should
  // receive() them, else their senders wait.
  role_builder& on_tensor(std::function<void(role_context&, const tensor_info&)> f) {
    on_tensor_ = std::move(f);
    return *this;
  }
  // Runs when the actor stops (job end or stop()).
  role_builder& on_stop(std::function<void(role_context&)> f) {
    on_stop_ = std::move(f);
    return *this;
  }

  const std::map<std::string, raw_entry>& handlers() const { return handlers_; }
  const std::function<void(role_context&, const tensor_info&)>& tensor_handler() const {
    return on_tensor_;
  }
  const std::function<void(role_context&)>& stop_handler() const { return on_stop_; }

 private:
  std::map<std::string, raw_entry> handlers_;
  std::function<void(role_context&, const tensor_info&)> on_tensor_;
  std::function<void(role_context&)> on_stop_;
};

// The roles a binary can host: the same registry on every rank.
class role_registry {
 public:
  using factory = std::function<void(role_builder&, role_context&)>;
  role_registry& add(const std::string& role, factory f);
  const factory* find(const std::string& role) const;
  std::vector<std::string> names() const;

 private:
  std::map<std::string, factory> roles_;
};

// The driver's side: spawn role actors, ask them, gather replies. One job object belongs to the
// thread that uses it (it owns a CAF scoped actor); make one per thread.
class job {
 public:
  explicit job(actors::node& n);
  ~job();
  job(const job&) = delete;
  job& operator=(const job&) = delete;

  // Spawns a `role` actor on `rank` (name empty: "<role>@<rank>", made unique on that rank).
  role_handle spawn(const std::string& role, int rank, const std::string& name = {},
                    std::chrono::milliseconds timeout = std::chrono::milliseconds{10000});
  // One `role` actor on every rank in good standing, in rank order.
  std::vector<role_handle> spawn_on_all(
      const std::string& role,
      std::chrono::milliseconds timeout = std::chrono::milliseconds{10000});
  // Stops a role actor (its on_stop handler runs); a no-op when it is already gone.
  void stop(const role_handle& h);

  // Sends `request` and waits for the reply; throws troupe::error naming the actor and its rank.
  template <class Rep, class Req>
  Rep ask(const role_handle& h, const Req& request,
          std::chrono::milliseconds timeout = std::chrono::milliseconds{30000}) {
    auto replies = ask_raw(std::span<const role_handle>(&h, 1), kind_of<Req>(), encode(request),
                           kind_of<Rep>(), timeout, true);
    return decode<Rep>(replies.front().payload);
  }
  // Fans `request` out to every handle and gathers the replies in handle order; throws one error
  // listing every actor that failed.
  template <class Rep, class Req>
  std::vector<Rep> ask_all(std::span<const role_handle> handles, const Req& request,
                           std::chrono::milliseconds timeout = std::chrono::milliseconds{30000}) {
    auto replies = ask_raw(handles, kind_of<Req>(), encode(request), kind_of<Rep>(), timeout, true);
    std::vector<Rep> out;
    out.reserve(replies.size());
    for (auto& r : replies) out.push_back(decode<Rep>(r.payload));
    return out;
  }
  // The same without throwing: one expected per handle.
  template <class Rep, class Req>
  std::vector<expected<Rep>> try_ask_all(
      std::span<const role_handle> handles, const Req& request,
      std::chrono::milliseconds timeout = std::chrono::milliseconds{30000}) {
    auto replies =
        ask_raw(handles, kind_of<Req>(), encode(request), kind_of<Rep>(), timeout, false);
    std::vector<expected<Rep>> out;
    for (auto& r : replies) {
      if (!r.error.empty())
        out.push_back(expected<Rep>::failure(r.error));
      else
        out.emplace_back(decode<Rep>(r.payload));
    }
    return out;
  }

  struct raw_reply {
    bytes payload;
    std::string error;  // empty on success
  };
  // The untyped core of ask/ask_all: `kind` names the request type, `reply_kind` the expected
  // reply type. With `throw_on_error` any failure throws after all replies are in or timed out.
  std::vector<raw_reply> ask_raw(std::span<const role_handle> handles, const std::string& kind,
                                 const bytes& payload, const std::string& reply_kind,
                                 std::chrono::milliseconds timeout, bool throw_on_error);

  struct impl;

 private:
  std::unique_ptr<impl> impl_;
};

}  // namespace troupe::actors
