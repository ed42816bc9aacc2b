// What each of Tinker's losses takes: its inputs, its config keys with their defaults, and which
// input masks it. Torch-free, so request validation at the server uses the same table.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace tinkerd {

struct LossSpec {
  std::string name;
  // Per-token float inputs the loss needs besides target_tokens.
  std::vector<std::string> required_inputs;
  // Config keys with defaults; a key mapped to nullopt is required.
  std::map<std::string, std::optional<double>> config;
  // Without an explicit "mask" input, tokens whose value of this input is 0 are masked out
  // ("weights" for cross_entropy, "advantages" for the RL losses: Tinker masks prompts that way).
  std::string implicit_mask_input;
};

// Every loss, by name: cross_entropy, importance_sampling, ppo, cispo, dro, gspo.
const std::vector<LossSpec>& AllLossSpecs();
const LossSpec* FindLossSpec(const std::string& name);

// The config key every loss takes on a mixture of experts: the coefficient of the router's
// auxiliary load-balancing loss (runner/loss/router_aux.h), Hugging Face's name for it. Default 0
// (not computed).
inline constexpr char kRouterAuxLossCoef[] = "router_aux_loss_coef";

// A loss with its config filled in from defaults and checked.
struct ResolvedLoss {
  const LossSpec* spec = nullptr;
  std::map<std::string, double> config;  // the loss's own keys
  double router_aux_loss_coef = 0;

  bool operator==(const ResolvedLoss& o) const {
    return spec == o.spec && config == o.config && router_aux_loss_coef == o.router_aux_loss_coef;
  }
};

// InvalidArgument for an unknown loss, an unknown or missing config key, a non-finite value, clip
// thresholds out of order, or a negative router_aux_loss_coef.
absl::StatusOr<ResolvedLoss> ResolveLoss(const std::string& name,
                                         const std::map<std::string, double>& config);

}  // namespace tinkerd
