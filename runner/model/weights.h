// Loading and saving named tensors in Hugging Face layout (torch side of safetensors.h).
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <utility>

#include "absl/status/statusor.h"

namespace tinkerd {

using TensorMap = std::map<std::string, at::Tensor>;

// Loads every tensor of a model directory: model.safetensors, or the shards named by
// model.safetensors.index.json. Float tensors are converted to `float_dtype`.
absl::StatusOr<TensorMap> LoadSafetensorsDir(const std::string& dir, at::ScalarType float_dtype);

// Loads one safetensors file.
absl::StatusOr<TensorMap> LoadSafetensorsFile(const std::string& path, at::ScalarType float_dtype);

// The dtype and the safetensors dtype of a stored dtype name: "float32", "bfloat16", "float16" or
// "float64".
absl::StatusOr<std::pair<at::ScalarType, std::string>> StoredType(const std::string& name);

// The safetensors bytes of `tensors`, float tensors converted to `stored_dtype` ("float32",
// "bfloat16", "float16" or "float64").
absl::StatusOr<std::string> SerializeTensors(const TensorMap& tensors,
                                             const std::string& stored_dtype);

// SerializeTensors, written to `path` atomically.
absl::Status SaveSafetensorsFile(const std::string& path, const TensorMap& tensors,
                                 const std::string& stored_dtype);

}  // namespace tinkerd
