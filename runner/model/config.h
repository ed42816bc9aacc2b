// The architecture hyper-parameters read from a Hugging Face config.json. Torch-free.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace tinkerd {

// RoPE frequency scaling, as the `rope_scaling` block of Llama / Qwen / Mistral configs.
struct RopeScaling {
  enum class Type { kNone, kLinear, kDynamic, kYarn, kLlama3 };
  Type type = Type::kNone;
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;  // 0: use max_position_embeddings
  double low_freq_factor = 1.0;                  // llama3
  double high_freq_factor = 4.0;                 // llama3
  double beta_fast = 32.0;                       // yarn
  double beta_slow = 1.0;                        // yarn
  double attention_factor = 0.0;                 // yarn; 0: derived as 0.1·ln(factor) + 1
};

// Where a mixture-of-experts family keeps its router and experts, by Hugging Face name within a
// layer: `<block>.<router>.weight` [E, D] and `<block>.experts.<e>.<gate|up|down>.weight`, and a
// shared expert where the family has one (Qwen2-MoE): `<block>.shared_expert.<gate|up|down>.weight`
// and its gate `<block>.shared_expert_gate.weight` [1, D]. A new family with this router and
// SwiGLU experts is a new entry of these names, not a new decoder.
struct MoeNames {
  std::string block;           // "mlp" (Qwen3-MoE), "block_sparse_moe" (Mixtral)
  std::string router;          // "gate"
  std::string gate, up, down;  // "gate_proj", "up_proj", "down_proj"; Mixtral: "w1", "w3", "w2"

  // "<block>.experts.<e>." and "<block>.<router>".
  std::string Expert(int64_t e) const;
  std::string Router() const { return block + "." + router; }
  // "<block>.shared_expert." and "<block>.shared_expert_gate".
  std::string SharedExpert() const { return block + ".shared_expert."; }
  std::string SharedGate() const { return block + ".shared_expert_gate"; }
};

// The routed MLP (kernels/routed_experts.h): a softmax router picks top_k of num_experts SwiGLU
// experts per token, their outputs weighted by the picked probabilities (renormalized to sum to 1
// when norm_topk_prob); with a shared expert (Qwen2-MoE), every token also goes through one more
// SwiGLU whose output is scaled by sigmoid(shared_expert_gate·x) and added. num_experts 0: a dense
// model.
struct MoeConfig {
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t expert_intermediate_size = 0;         // each expert's I
  int64_t shared_expert_intermediate_size = 0;  // the shared expert's I; 0: none
  bool norm_topk_prob = false;
  bool wide_weights = false;       // the weights multiply in fp32, not the compute dtype (Mixtral)
  std::vector<bool> layer_routes;  // per layer: routed (true) or the dense MLP (Qwen3-MoE's
                                   // mlp_only_layers / decoder_sparse_step)
  MoeNames names;

  // How many layers route, and which of them `layer` is (its routed index: the routed layers
  // before it). Router replay and recorded routes count layers this way.
  int64_t RoutedLayers() const;
  int64_t RoutedIndex(int64_t layer) const;
};

struct ModelConfig {
  std::string architecture;  // "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", ...
  std::string model_type;    // "llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", ...
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // bias on q/k/v projections (Qwen2 always)
  bool qk_norm = false;         // per-head RMSNorm on q and k before RoPE (Qwen3)
  int64_t sliding_window = 0;   // 0: full causal attention
  // Which layers slide (Qwen2/3's max_window_layers, or `layer_types`); empty: every layer does
  // when sliding_window > 0 (Mistral).
  std::vector<bool> layer_slides;
  std::string torch_dtype;  // informational
  // The end-of-sequence tokens a sample stops at (config.json's eos_token_id; the runner prefers
  // generation_config.json's, as Hugging Face's generate does). Empty: none.
  std::vector<int64_t> eos_token_ids;
  MoeConfig moe;

  // Whether `layer`'s MLP is routed experts (else the dense gate/up/down of intermediate_size).
  bool Routes(int64_t layer) const {
    return moe.num_experts > 0 && moe.layer_routes[static_cast<size_t>(layer)];
  }

  // The attention window of `layer`: sliding_window where it slides, else 0 (full).
  int64_t WindowOf(int64_t layer) const {
    const bool slides = layer_slides.empty() || layer_slides[static_cast<size_t>(layer)];
    return slides ? sliding_window : 0;
  }
  std::string DebugString() const;
};

// Parses config.json text, in the layout of transformers 4 (`rope_theta` and `rope_scaling` at
// the top level, `torch_dtype`) or 5 (`rope_parameters` holding theta, type and scaling; `dtype`;
// `layer_types`). Every key that changes the math is read from either layout; where both are
// present they must agree. Unknown architectures, missing or inconsistent sizes, and keys whose
// math tinkerd does not implement (an unknown rope type, `mlp_bias`, another activation, ...)
// are InvalidArgument naming the key.
absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text);
// eos_token_id of a generation_config.json (an id or a list of ids, each in [0, vocab)); empty
// when it names none. InvalidArgument naming the key otherwise.
absl::StatusOr<std::vector<int64_t>> ParseGenerationEos(absl::string_view json_text,
                                                        int64_t vocab_size);
// Serializes back to a config.json that ParseModelConfig and Hugging Face both read.
std::string ModelConfigToJson(const ModelConfig& config);

}  // namespace tinkerd
