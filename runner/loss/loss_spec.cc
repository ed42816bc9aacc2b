#include "runner/loss/loss_spec.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "runner/util/echo.h"

namespace tinkerd {

const std::vector<LossSpec>& AllLossSpecs() {
  static const auto* specs = new std::vector<LossSpec>{
      {"cross_entropy", {"weights"}, {}, "weights"},
      {"importance_sampling", {"logprobs", "advantages"}, {}, "advantages"},
      {"ppo",
       {"logprobs", "advantages"},
       {{"clip_low_threshold", 0.8}, {"clip_high_threshold", 1.2}},
       "advantages"},
      {"cispo",
       {"logprobs", "advantages"},
       {{"clip_low_threshold", 0.0}, {"clip_high_threshold", 4.0}},
       "advantages"},
      {"dro", {"logprobs", "advantages"}, {{"beta", std::nullopt}}, "advantages"},
      // The ratio bounds default to GSPO's published clip ranges (3e-4 below, 4e-4 above 1).
      {"gspo",
       {"logprobs", "advantages", "sequence_ratio_mask"},
       {{"clip_low_threshold", 1.0 - 3e-4}, {"clip_high_threshold", 1.0 + 4e-4}},
       "advantages"},
  };
  return *specs;
}

const LossSpec* FindLossSpec(const std::string& name) {
  for (const LossSpec& s : AllLossSpecs()) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

absl::StatusOr<ResolvedLoss> ResolveLoss(const std::string& name,
                                         const std::map<std::string, double>& config) {
  const LossSpec* spec = FindLossSpec(name);
  if (spec == nullptr) {
    std::vector<std::string> names;
    for (const LossSpec& s : AllLossSpecs()) names.push_back(s.name);
    return absl::InvalidArgumentError(absl::StrCat("loss_fn: unknown loss '", Echo(name),
                                                   "' (expected one of ",
                                                   absl::StrJoin(names, ", "), ")"));
  }
  ResolvedLoss r{spec, {}};
  for (const auto& [key, value] : config) {
    if (!spec->config.count(key) && key != kRouterAuxLossCoef) {
      std::vector<std::string> keys;
      for (const auto& [k, v] : spec->config) keys.push_back(k);
      return absl::InvalidArgumentError(absl::StrCat(
          "loss_fn_config: key '", Echo(key), "' is not a parameter of ", name,
          keys.empty() ? " (it takes none" : absl::StrCat(" (expected ", absl::StrJoin(keys, ", ")),
          "; every loss also takes ", kRouterAuxLossCoef, " on a mixture of experts)"));
    }
    if (!std::isfinite(value)) {
      return absl::InvalidArgumentError(
          absl::StrCat("loss_fn_config: '", Echo(key), "' must be finite"));
    }
  }
  if (auto it = config.find(kRouterAuxLossCoef); it != config.end()) {
    if (it->second < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("loss_fn_config: ", kRouterAuxLossCoef, " must be >= 0, got ", it->second));
    }
    r.router_aux_loss_coef = it->second;
  }
  for (const auto& [key, def] : spec->config) {
    auto it = config.find(key);
    if (it != config.end()) {
      r.config[key] = it->second;
    } else if (def.has_value()) {
      r.config[key] = *def;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("loss_fn_config: ", name, " requires '", key, "'"));
    }
  }
  if (r.config.count("clip_low_threshold")) {
    const double lo = r.config["clip_low_threshold"], hi = r.config["clip_high_threshold"];
    if (lo < 0 || !(lo <= hi)) {
      return absl::InvalidArgumentError(
          absl::StrCat("loss_fn_config: need 0 <= clip_low_threshold <= clip_high_threshold, got ",
                       lo, ", ", hi));
    }
  }
  if (r.config.count("beta") && r.config["beta"] < 0) {
    return absl::InvalidArgumentError("loss_fn_config: beta must be >= 0");
  }
  return r;
}

}  // namespace tinkerd
