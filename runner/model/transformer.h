// The decoder (Llama / Mistral / Qwen2 / Qwen3) on a packed micro-batch.
//
// A micro-batch is one flat token tensor: S sequences concatenated, cu_seqlens [S+1] marking
// their boundaries. Positions restart at 0 in each sequence and attention never crosses a
// boundary, so a packed sequence computes exactly what it would alone; there is no padding.
//
// Shape suffixes: T tokens in the micro-batch, D hidden, V vocab, H query heads, K kv heads,
// d head_dim, I intermediate, L one sequence's length.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runner/model/config.h"
#include "runner/model/lora.h"
#include "runner/model/weights.h"

namespace tinkerd {

struct LayerWeights {
  at::Tensor input_norm_D, post_norm_D;
  at::Tensor q_proj, k_proj, v_proj, o_proj;  // [out, in]
  at::Tensor q_bias, k_bias, v_bias;          // undefined unless attention_bias
  at::Tensor q_norm_d, k_norm_d;              // undefined unless qk_norm
  at::Tensor gate_proj, up_proj, down_proj;
};

struct BaseWeights {
  at::Tensor embed_VD;
  at::Tensor final_norm_D;
  at::Tensor lm_head_VD;  // aliases embed_VD when embeddings are tied
  std::vector<LayerWeights> layers;

  // Every tensor by its Hugging Face name (lm_head.weight omitted when tied).
  std::map<std::string, at::Tensor> Named(bool tied) const;
};

// Takes tensors out of `tensors` (HF names), checking every name and shape against the config.
absl::StatusOr<BaseWeights> BaseWeightsFromTensors(const ModelConfig& config, TensorMap tensors);

struct PackedBatch {
  at::Tensor tokens_T;              // int64
  std::vector<int64_t> cu_seqlens;  // [S+1], cu_seqlens[0] = 0, cu_seqlens[S] = T
};

// Logits [T, V] of the packed batch. `lora` may be null (base model or full fine-tuning).
at::Tensor ForwardLogits(const ModelConfig& config, const BaseWeights& weights,
                         const LoraAdapter* lora, const PackedBatch& batch);

}  // namespace tinkerd
