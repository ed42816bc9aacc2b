// Writes a small random decoder model in exact Hugging Face layout (config.json +
// model.safetensors, or sharded with model.safetensors.index.json). Used by tests, benchmarks and
// the demo; nothing is ever downloaded. Weight names are the HF ones:
//   model.embed_tokens.weight [V, D]; model.norm.weight [D]; lm_head.weight [V, D] (untied only)
//   model.layers.{i}.input_layernorm.weight [D], .post_attention_layernorm.weight [D]
//   model.layers.{i}.self_attn.{q,k,v,o}_proj.weight  q:[H·hd, D] k,v:[Hkv·hd, D] o:[D, H·hd]
//   model.layers.{i}.self_attn.{q,k,v}_proj.bias (attention_bias), .{q,k}_norm.weight [hd] (Qwen3)
//   model.layers.{i}.mlp.{gate,up}_proj.weight [I, D], .down_proj.weight [D, I]
//   routed layers instead: model.layers.{i}.mlp.gate.weight [E, D] and
//   model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight (Qwen3-MoE), or
//   model.layers.{i}.block_sparse_moe.gate.weight and .block_sparse_moe.experts.{e}.w{1,3,2}.weight
//   (Mixtral); Qwen2-MoE adds model.layers.{i}.mlp.shared_expert.{gate,up,down}_proj.weight and
//   model.layers.{i}.mlp.shared_expert_gate.weight [1, D]
#pragma once

#include <ATen/ATen.h>
#include <cstdint>

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runner/model/config.h"

namespace tinkerd {

struct TinyModelSpec {
  ModelConfig config;
  uint64_t seed = 0;
  std::string stored_dtype = "float32";  // "float32", "bfloat16" or "float16"
  int num_shards = 1;                    // > 1 writes model-0000k-of-0000n.safetensors + index
  double init_std = 0.02;                // normal(0, init_std) for matrices; norms ~ 1 ± 0.1
};

// A ready-made config of the given family: "llama", "mistral", "qwen2", "qwen3", "qwen2_moe" (4
// experts, top 2, a shared expert, layer 0 dense), "qwen3_moe" (8 experts, top 2, layer 1 dense)
// or "mixtral" (4 experts, top 2). Small sizes (vocab 128, hidden 32, 2 layers, 4 heads / 2 kv
// heads, head_dim 8).
ModelConfig TinyConfig(const std::string& family);

// The embedded default model of the server and demo: a Llama-style model of 3.2M parameters.
ModelConfig DefaultDemoConfig();

absl::Status WriteTinyModel(const std::string& dir, const TinyModelSpec& spec);

// The same weights in memory, as float64 tensors by HF name (no files). The config is checked.
absl::StatusOr<std::map<std::string, at::Tensor>> GenerateTinyWeights(const TinyModelSpec& spec);

}  // namespace tinkerd
