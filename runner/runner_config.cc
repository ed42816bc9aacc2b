#include "runner/runner_config.h"

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"

namespace tinkerd {

absl::Status RunnerConfig::Validate() const {
  if (base_model_path.empty())
    return absl::InvalidArgumentError("runner: base_model_path is empty");
  if (micro_batch_tokens < 1)
    return absl::InvalidArgumentError("runner: micro_batch_tokens must be >= 1");
  if (num_threads < 0) return absl::InvalidArgumentError("runner: num_threads must be >= 0");
  if (max_models < 1) return absl::InvalidArgumentError("runner: max_models must be >= 1");
  if (max_model_bytes < 0)
    return absl::InvalidArgumentError("runner: max_model_bytes must be >= 0 (0: the budget)");
  if (memory_budget_bytes < 0)
    return absl::InvalidArgumentError(
        "runner: memory_budget_bytes must be >= 0 (0: from the memory the process may use)");
  if (auto d = ParseDevice(device); !d.ok()) return d.status();
  if (expert_parallel < 1)
    return absl::InvalidArgumentError("runner: expert_parallel must be >= 1");
  if (expert_parallel > 1 && shard != ShardMode::kNone) {
    return absl::InvalidArgumentError(
        "runner: expert_parallel > 1 goes with shard none (sharding a model whose experts are "
        "spread over the ranks is not built yet)");
  }
  if (shard_base && shard != ShardMode::kFull) {
    return absl::InvalidArgumentError(
        "runner: shard_base goes with shard full (the base's layers are gathered as a fully "
        "sharded model's are)");
  }
  return absl::OkStatus();
}

absl::StatusOr<ComputeDType> ParseComputeDType(absl::string_view name) {
  for (ComputeDType d : {ComputeDType::kFloat32, ComputeDType::kFloat64, ComputeDType::kBFloat16,
                         ComputeDType::kFloat16}) {
    if (name == ComputeDTypeName(d)) return d;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("runner: compute_dtype must be float32, float64, bfloat16 or float16, not \"",
                   std::string(name), "\""));
}

const char* ComputeDTypeName(ComputeDType dtype) {
  switch (dtype) {
    case ComputeDType::kFloat32:
      return "float32";
    case ComputeDType::kFloat64:
      return "float64";
    case ComputeDType::kBFloat16:
      return "bfloat16";
    case ComputeDType::kFloat16:
      return "float16";
  }
  return "?";
}

absl::StatusOr<ShardMode> ParseShardMode(absl::string_view name) {
  for (ShardMode m : {ShardMode::kNone, ShardMode::kOptimizer, ShardMode::kFull}) {
    if (name == ShardModeName(m)) return m;
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "runner: shard must be none, optimizer or full, not \"", std::string(name), "\""));
}

const char* ShardModeName(ShardMode mode) {
  switch (mode) {
    case ShardMode::kNone:
      return "none";
    case ShardMode::kOptimizer:
      return "optimizer";
    case ShardMode::kFull:
      return "full";
  }
  return "?";
}

absl::StatusOr<DeviceSpec> ParseDevice(absl::string_view device) {
  if (device == "cpu") return DeviceSpec{false, 0};
  if (device == "cuda") return DeviceSpec{true, 0};
  int index = -1;
  absl::string_view n = device;
  if (absl::ConsumePrefix(&n, "cuda:") && absl::SimpleAtoi(n, &index) && index >= 0 &&
      index < 1024) {
    return DeviceSpec{true, index};
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "runner: device must be \"cpu\", \"cuda\" or \"cuda:N\", not \"", std::string(device), "\""));
}

std::string RunnerConfig::DebugString() const {
  return absl::StrFormat(
      "base_model_path=%s device=%s compute_dtype=%s micro_batch_tokens=%d "
      "activation_checkpointing=%s num_threads=%d max_models=%d max_model_bytes=%d "
      "memory_budget_bytes=%d shard=%s shard_base=%s expert_parallel=%d",
      base_model_path, device, ComputeDTypeName(compute_dtype), micro_batch_tokens,
      activation_checkpointing ? "true" : "false", num_threads, max_models, max_model_bytes,
      memory_budget_bytes, ShardModeName(shard), shard_base ? "true" : "false", expert_parallel);
}

}  // namespace tinkerd
