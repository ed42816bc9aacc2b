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

// A loss with its config filled in from defaults and checked.
struct ResolvedLoss {
  const LossSpec* spec = nullptr;
  std::map<std::string, double> config;
};

// InvalidArgument for an unknown loss, an unknown or missing config key, a non-finite value, or
// clip thresholds out of order.
absl::StatusOr<ResolvedLoss> ResolveLoss(const std::string& name,
                                         const std::map<std::string, double>& config);

}  // namespace tinkerd
