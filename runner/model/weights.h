// Loading and saving named tensors in Hugging Face layout (torch side of safetensors.h).
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "runner/model/safetensors.h"  // FileDigest

namespace tinkerd {

using TensorMap = std::map<std::string, at::Tensor>;

// Which tensors a load reads, by name (expert parallelism: not other ranks' experts); null: all.
using TensorFilter = std::function<bool(const std::string& name)>;

using TensorTransform = std::function<at::Tensor(const std::string& name, const at::Tensor& t)>;

// Loads every tensor of a model directory (that `keep` keeps): model.safetensors, or the shards
// named by model.safetensors.index.json. Float tensors are converted to `float_dtype`. With
// `take`, as LoadSafetensorsFile's.
absl::StatusOr<TensorMap> LoadSafetensorsDir(const std::string& dir, at::ScalarType float_dtype,
                                             const TensorFilter& keep = nullptr,
                                             const TensorTransform& take = nullptr);
// A stretch of a tensor's flat (row-major) values: {begin, length}. Length 0: none of it (an empty
// tensor); negative: the tensor is refused (an undefined one).
using Stretch =
    std::function<std::pair<int64_t, int64_t>(const std::string& name, at::IntArrayRef shape)>;
// Of each tensor of a model directory, the stretch `stretch` names, read alone (the rest of each
// file is skipped, unread), as a flat tensor, float ones converted to `float_dtype`: what a rank
// of a sharded base reads, 1/W of the files, without holding a tensor whole.
absl::StatusOr<TensorMap> LoadSafetensorsDirStretches(const std::string& dir,
                                                      at::ScalarType float_dtype,
                                                      const Stretch& stretch);
// The tensors of a model directory as its headers describe them, on the meta device (shapes and
// dtypes, float ones `float_dtype`, no data): what a load will read, known before it reads.
absl::StatusOr<TensorMap> SafetensorsDirShapes(const std::string& dir, at::ScalarType float_dtype);

// Loads one safetensors file, a tensor at a time (the file is never held whole; a tensor `keep`
// leaves out is never read), and its digest when `digest` is set. With `take`, each tensor is
// kept as take(name, tensor) (a sharded model's slice of it), so that one is held whole at a time.
absl::StatusOr<TensorMap> LoadSafetensorsFile(const std::string& path, at::ScalarType float_dtype,
                                              FileDigest* digest = nullptr,
                                              const TensorFilter& keep = nullptr,
                                              const TensorTransform& take = nullptr);

// The dtype and the safetensors dtype of a stored dtype name: "float32", "bfloat16", "float16" or
// "float64".
absl::StatusOr<std::pair<at::ScalarType, std::string>> StoredType(const std::string& name);

// Writes `tensors` to `path` atomically, float tensors converted to `stored_dtype` ("float32",
// "bfloat16", "float16" or "float64") one at a time; the digest of the file written. With
// `transform`, each tensor is written as transform(name, tensor) (same shape), made when its turn
// comes: one transformed tensor is held at a time.
absl::StatusOr<FileDigest> SaveSafetensorsFile(const std::string& path, const TensorMap& tensors,
                                               const std::string& stored_dtype,
                                               const TensorTransform& transform = nullptr);

}  // namespace tinkerd
