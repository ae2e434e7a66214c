// The "expert-group" role (see expert_group.hpp).
#include "actors/expert_group.hpp"

#include <fmt/core.h>

#include <algorithm>
#include <memory>

#include "memory/error.hpp"

namespace troupe::actors {

std::map<std::string, double> expert_load_values(const expert_load_report& r) {
  const auto n = static_cast<std::int64_t>(r.tokens.size());
  const auto count = static_cast<std::int64_t>(r.served.size());
  TROUPE_CHECK(r.first_expert >= 0 && r.first_expert + count <= n, "expert load of step ", r.step,
               ": experts ", r.first_expert, "-", r.first_expert + count - 1, " served, but ",
               "its tokens cover ", n, " experts");
  std::map<std::string, double> v;
  v["experts.first"] = r.first_expert;
  v["experts.count"] = static_cast<double>(count);
  double group = 0;
  for (std::int64_t j = 0; j < count; ++j) {
    const auto e = r.first_expert + j;
    const auto t = static_cast<double>(r.tokens[static_cast<std::size_t>(e)]);
    v[fmt::format("tokens.expert{}", e)] = t;
    v[fmt::format("served.expert{}", e)] =
        static_cast<double>(r.served[static_cast<std::size_t>(j)]);
    group += t;
  }
  v["tokens.group"] = group;
  v["dropped"] = static_cast<double>(r.dropped);
  v["imbalance"] = r.imbalance;
  v["all_to_all_s"] = r.all_to_all_s;
  v["all_to_all_share"] = r.compute_s > 0 ? r.all_to_all_s / r.compute_s : 0.0;
  return v;
}

void add_expert_group_role(role_registry& roles) {
  roles.add("expert-group", [](role_builder& b, role_context& ctx) {
    ctx.set_activity("waiting for its trainer's first step");
    b.on<expert_load_report>([](role_context& c, const expert_load_report& r) {
      const auto values = expert_load_values(r);
      c.set_mesh("dp", r.dp);
      c.set_mesh("ep", r.ep);
      c.set_mesh("edp", r.edp);
      c.record_step(r.step, values);
      std::string served;
      for (auto s : r.served) served += fmt::format(" {}", s);
      c.set_activity(fmt::format("experts {}-{}: step {} served{} rows, imbalance {:.2f}",
                                 r.first_expert,
                                 r.first_expert + static_cast<std::int64_t>(r.served.size()) - 1,
                                 r.step, served, r.imbalance));
      return expert_load_ack{r.step};
    });
  });
}

}  // namespace troupe::actors
