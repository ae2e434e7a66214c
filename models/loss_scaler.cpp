// loss_scaler (see loss_scaler.hpp).
#include "models/loss_scaler.hpp"

#include <nlohmann/json.hpp>

#include "memory/error.hpp"

namespace troupe::models {

loss_scaler::loss_scaler(double initial, std::int64_t growth_interval)
    : scale_(initial), growth_(growth_interval) {
  TROUPE_CHECK(initial > 0, "loss_scaler: train.loss_scale must be > 0, got ", initial);
  TROUPE_CHECK(growth_interval > 0, "loss_scaler: train.loss_scale_growth must be > 0, got ",
               growth_interval);
}

bool loss_scaler::update(bool overflow) {
  if (overflow) {  // skip the update, back off the scale
    scale_ *= 0.5;
    good_ = 0;
    return true;
  }
  if (++good_ == growth_) {
    scale_ *= 2.0;
    good_ = 0;
  }
  return false;
}

std::string loss_scaler::json() const {
  return nlohmann::json{{"loss_scale", scale_}, {"good_steps", good_}}.dump();
}

bool loss_scaler::resume_from(const std::string& extra_json) {
  auto extra = nlohmann::json::parse(extra_json, nullptr, false);
  if (!extra.is_object() || !extra.contains("loss_scale") ||
      extra.value("precision", std::string()) != "f16")
    return false;
  scale_ = extra.value("loss_scale", scale_);
  good_ = extra.value("good_steps", std::int64_t{0});
  return true;
}

}  // namespace troupe::models
