#include "runner/runner_config.h"

#include "absl/strings/str_format.h"

namespace tinkerd {

absl::Status RunnerConfig::Validate() const {
  if (base_model_path.empty())
    return absl::InvalidArgumentError("runner: base_model_path is empty");
  if (micro_batch_tokens < 1)
    return absl::InvalidArgumentError("runner: micro_batch_tokens must be >= 1");
  if (num_threads < 0) return absl::InvalidArgumentError("runner: num_threads must be >= 0");
  if (max_models < 1) return absl::InvalidArgumentError("runner: max_models must be >= 1");
  return absl::OkStatus();
}

std::string RunnerConfig::DebugString() const {
  return absl::StrFormat(
      "base_model_path=%s compute_dtype=%s micro_batch_tokens=%d num_threads=%d max_models=%d",
      base_model_path, compute_dtype == ComputeDType::kFloat64 ? "float64" : "float32",
      micro_batch_tokens, num_threads, max_models);
}

}  // namespace tinkerd
