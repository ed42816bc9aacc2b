#include "runner/types.h"

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace tinkerd {

absl::StatusOr<LossReduction> ParseLossReduction(absl::string_view name) {
  if (name == "token_mean" || name.empty()) return LossReduction::kTokenMean;
  if (name == "sum") return LossReduction::kSum;
  if (name == "seq_mean_token_mean") return LossReduction::kSeqMeanTokenMean;
  if (name == "seq_mean_token_sum") return LossReduction::kSeqMeanTokenSum;
  return absl::InvalidArgumentError(
      absl::StrCat("loss_reduction: unknown mode '", name,
                   "' (expected token_mean, sum, seq_mean_token_mean or seq_mean_token_sum)"));
}

absl::string_view LossReductionName(LossReduction r) {
  switch (r) {
    case LossReduction::kTokenMean:
      return "token_mean";
    case LossReduction::kSum:
      return "sum";
    case LossReduction::kSeqMeanTokenMean:
      return "seq_mean_token_mean";
    case LossReduction::kSeqMeanTokenSum:
      return "seq_mean_token_sum";
  }
  return "unknown";
}

TensorData TensorData::Int64(std::vector<int64_t> v) {
  TensorData t;
  t.dtype = DType::kInt64;
  t.shape = {static_cast<int64_t>(v.size())};
  t.int64_data = std::move(v);
  return t;
}

TensorData TensorData::Float32(std::vector<float> v) {
  TensorData t;
  t.dtype = DType::kFloat32;
  t.shape = {static_cast<int64_t>(v.size())};
  t.float32_data = std::move(v);
  return t;
}

int64_t TensorData::NumElements() const {
  return dtype == DType::kInt64 ? static_cast<int64_t>(int64_data.size())
                                : static_cast<int64_t>(float32_data.size());
}

}  // namespace tinkerd
