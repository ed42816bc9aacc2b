// A LoRA adapter: for each adapted linear W [out, in], y = x·Wᵀ + (alpha/r)·(x·Aᵀ)·Bᵀ with
// A [r, in] and B [out, r]. A starts uniform in ±1/sqrt(in) (PEFT's kaiming-uniform bound), B at
// zero, so a fresh adapter leaves the base model's function unchanged.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runner/model/config.h"
#include "runner/types.h"

namespace tinkerd {

struct LoraPair {
  at::Tensor A_rI;  // [r, in]
  at::Tensor B_Or;  // [out, r]
};

class LoraAdapter {
 public:
  // Which modules a rank holds (expert parallelism: not other ranks' experts); null: all.
  using Keep = std::function<bool(const std::string& module)>;
  // Adapts q,k,v,o (train_attn), gate,up,down (train_mlp: each expert's, where a layer routes;
  // never the router) and lm_head (train_unembed); of those, the ones `keep` keeps. A pair's
  // values depend on the seed and its module's name alone.
  static absl::StatusOr<LoraAdapter> Create(const ModelConfig& config, const LoraConfig& lora,
                                            uint64_t seed, at::ScalarType dtype, at::Device device,
                                            const Keep& keep = nullptr);
  // INVALID_ARGUMENT naming the field when `lora` cannot make an adapter.
  static absl::Status Validate(const LoraConfig& lora);
  // Trainable values the adapter would hold, counted without allocating (admission control).
  // `lora` must be valid.
  static int64_t CountValues(const ModelConfig& config, const LoraConfig& lora,
                             const Keep& keep = nullptr);

  // The pair adapting `module` (an HF module path such as "model.layers.3.self_attn.q_proj"),
  // or null when that module is not adapted.
  const LoraPair* Find(const std::string& module) const;
  double scale() const { return scale_; }

  // A copy holding its own tensors (no graph) in `dtype`, which training no longer changes: for
  // sampling. Every use casts an adapter to the compute dtype, so a copy made in that dtype is
  // bitwise what a use of the trainable one reads.
  LoraAdapter Frozen(at::ScalarType dtype) const;

  // Trainable tensors by name: "<module>.lora_A" and "<module>.lora_B".
  std::map<std::string, at::Tensor> Parameters() const;

 private:
  struct Module {
    std::string name;
    int64_t in, out;
  };
  static std::vector<Module> Modules(const ModelConfig& config, const LoraConfig& lora);

  double scale_ = 1.0;
  std::map<std::string, LoraPair> pairs_;
};

}  // namespace tinkerd
