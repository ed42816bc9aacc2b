#include "runner/model/tiny_model.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/parallel.h"
#include "runner/model/safetensors.h"
#include "runner/model/weights.h"
#include "runner/util/rng.h"
#include "runner/util/status_macros.h"

namespace tinkerd {
namespace {

// A named, seeded stream of normal draws, so that each weight is independent of the order
// weights are generated in (adding a tensor never changes the others). Drawn in float64 and then
// stored in `dtype`; the draws are split across threads by skipping ahead in the stream, which
// gives the values of one pass: a large model is drawn on every core, not one.
at::Tensor Random(const std::string& name, std::vector<int64_t> shape, uint64_t seed, double mean,
                  double std, at::ScalarType dtype) {
  at::Tensor t = at::empty(shape, at::kDouble);
  double* p = t.data_ptr<double>();
  const uint64_t stream = MixSeed(seed, name.c_str());
  // kernels::ParallelFor: at::parallel_for compiled where OpenMP is on (kernels/), not here.
  kernels::ParallelFor(0, t.numel(), int64_t{1} << 16, [&](int64_t begin, int64_t end) {
    SplitMix64 g(stream);
    g.Skip(SplitMix64::kDrawsPerNormal * static_cast<uint64_t>(begin));
    for (int64_t i = begin; i < end; ++i) p[i] = mean + std * g.Normal();
  });
  return dtype == at::kDouble ? t : t.to(dtype);
}

// The weights of GenerateTinyWeights, each stored in `dtype` as soon as it is drawn: a large model
// is never held in float64 whole.
absl::StatusOr<TensorMap> GenerateWeights(const TinyModelSpec& spec, at::ScalarType dtype) {
  // Round-trip through the parser so an inconsistent spec fails here, not at load.
  ASSIGN_OR_RETURN(ModelConfig checked, ParseModelConfig(ModelConfigToJson(spec.config)));
  const int64_t D = checked.hidden_size, I = checked.intermediate_size, V = checked.vocab_size;
  const int64_t H = checked.num_attention_heads, Hkv = checked.num_key_value_heads;
  const int64_t hd = checked.head_dim;
  const double s = spec.init_std;
  const uint64_t seed = spec.seed;

  TensorMap w;
  auto add = [&](const std::string& n, std::vector<int64_t> shape, double mean, double std) {
    w[n] = Random(n, std::move(shape), seed, mean, std, dtype);
  };
  add("model.embed_tokens.weight", {V, D}, 0, s);
  add("model.norm.weight", {D}, 1.0, 0.1);
  if (!checked.tie_word_embeddings) add("lm_head.weight", {V, D}, 0, s);
  for (int64_t l = 0; l < checked.num_hidden_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    add(p + "input_layernorm.weight", {D}, 1.0, 0.1);
    add(p + "post_attention_layernorm.weight", {D}, 1.0, 0.1);
    add(p + "self_attn.q_proj.weight", {H * hd, D}, 0, s);
    add(p + "self_attn.k_proj.weight", {Hkv * hd, D}, 0, s);
    add(p + "self_attn.v_proj.weight", {Hkv * hd, D}, 0, s);
    add(p + "self_attn.o_proj.weight", {D, H * hd}, 0, s);
    if (checked.attention_bias) {
      add(p + "self_attn.q_proj.bias", {H * hd}, 0, s);
      add(p + "self_attn.k_proj.bias", {Hkv * hd}, 0, s);
      add(p + "self_attn.v_proj.bias", {Hkv * hd}, 0, s);
    }
    if (checked.qk_norm) {
      add(p + "self_attn.q_norm.weight", {hd}, 1.0, 0.1);
      add(p + "self_attn.k_norm.weight", {hd}, 1.0, 0.1);
    }
    if (checked.Routes(l)) {
      const MoeConfig& m = checked.moe;
      const int64_t Ie = m.expert_intermediate_size;
      // Router logits of order 1 (normalized inputs): picks that are clear, not near-ties a
      // rounding would flip, nor so peaked that only the first choice counts.
      add(p + m.names.Router() + ".weight", {m.num_experts, D}, 0,
          std::max(s, 1.0 / std::sqrt(static_cast<double>(D))));
      if (const int64_t Is = m.shared_expert_intermediate_size; Is > 0) {
        const std::string q = p + m.names.SharedExpert();
        add(q + m.names.gate + ".weight", {Is, D}, 0, s);
        add(q + m.names.up + ".weight", {Is, D}, 0, s);
        add(q + m.names.down + ".weight", {D, Is}, 0, s);
        // Gate logits of order 1, so that sigmoid's slope, not its saturation, is tested.
        add(p + m.names.SharedGate() + ".weight", {1, D}, 0,
            std::max(s, 1.0 / std::sqrt(static_cast<double>(D))));
      }
      for (int64_t e = 0; e < m.num_experts; ++e) {
        const std::string q = p + m.names.Expert(e);
        add(q + m.names.gate + ".weight", {Ie, D}, 0, s);
        add(q + m.names.up + ".weight", {Ie, D}, 0, s);
        add(q + m.names.down + ".weight", {D, Ie}, 0, s);
      }
    } else {
      add(p + "mlp.gate_proj.weight", {I, D}, 0, s);
      add(p + "mlp.up_proj.weight", {I, D}, 0, s);
      add(p + "mlp.down_proj.weight", {D, I}, 0, s);
    }
  }
  return w;
}

}  // namespace

ModelConfig TinyConfig(const std::string& family) {
  ModelConfig c;
  c.vocab_size = 128;
  c.hidden_size = 32;
  c.intermediate_size = 64;
  c.num_hidden_layers = 2;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 8;
  c.max_position_embeddings = 256;
  c.rms_norm_eps = 1e-6;
  c.rope_theta = 10000.0;
  if (family == "mistral") {
    c.architecture = "MistralForCausalLM";
    c.model_type = "mistral";
  } else if (family == "qwen2") {
    c.architecture = "Qwen2ForCausalLM";
    c.model_type = "qwen2";
    c.attention_bias = true;
    c.tie_word_embeddings = true;
    c.rope_theta = 1000000.0;
  } else if (family == "qwen3") {
    c.architecture = "Qwen3ForCausalLM";
    c.model_type = "qwen3";
    c.qk_norm = true;
    c.tie_word_embeddings = true;
    c.rope_theta = 1000000.0;
  } else if (family == "qwen3_moe") {
    // Eight experts, two per token, renormalized; layer 1 keeps the dense MLP (mlp_only_layers).
    c.architecture = "Qwen3MoeForCausalLM";
    c.model_type = "qwen3_moe";
    c.qk_norm = true;
    c.rope_theta = 1000000.0;
    c.moe.num_experts = 8;
    c.moe.top_k = 2;
    c.moe.expert_intermediate_size = 16;
    c.moe.norm_topk_prob = true;
    c.moe.layer_routes = {true, false};
  } else if (family == "qwen2_moe") {
    // Four experts, two per token, not renormalized (Qwen2-MoE's default), and a shared expert
    // of its own width; layer 0 keeps the dense MLP. Every width is a multiple of 16: on the CPU a
    // bf16 product over 24 was measured to round a row differently with the row count, which
    // would break the sampler's bitwise identity with Forward (docs/sampling.md) in the test.
    c.architecture = "Qwen2MoeForCausalLM";
    c.model_type = "qwen2_moe";
    c.attention_bias = true;
    c.rope_theta = 1000000.0;
    c.moe.num_experts = 4;
    c.moe.top_k = 2;
    c.moe.expert_intermediate_size = 16;
    c.moe.shared_expert_intermediate_size = 32;
    c.moe.norm_topk_prob = false;
    c.moe.layer_routes = {false, true};
  } else if (family == "mixtral") {
    // Four experts, two per token, in every layer.
    c.architecture = "MixtralForCausalLM";
    c.model_type = "mixtral";
    c.intermediate_size = 48;
    c.moe.num_experts = 4;
    c.moe.top_k = 2;
    c.moe.expert_intermediate_size = c.intermediate_size;
    c.moe.norm_topk_prob = true;
    c.moe.layer_routes = {true, true};
  } else {
    c.architecture = "LlamaForCausalLM";
    c.model_type = "llama";
  }
  if (c.moe.num_experts > 0) {
    // The parser fills in what the family implies (the tensors' names).
    absl::StatusOr<ModelConfig> parsed = ParseModelConfig(ModelConfigToJson(c));
    TORCH_CHECK(parsed.ok(), parsed.status().ToString());
    return *parsed;
  }
  return c;
}

ModelConfig DefaultDemoConfig() {
  ModelConfig c = TinyConfig("llama");
  c.vocab_size = 512;
  c.hidden_size = 256;
  c.intermediate_size = 688;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.head_dim = 32;
  c.max_position_embeddings = 1024;
  return c;
}

absl::StatusOr<TensorMap> GenerateTinyWeights(const TinyModelSpec& spec) {
  return GenerateWeights(spec, at::kDouble);
}

absl::Status WriteTinyModel(const std::string& dir, const TinyModelSpec& spec) {
  ASSIGN_OR_RETURN(ModelConfig checked, ParseModelConfig(ModelConfigToJson(spec.config)));
  ASSIGN_OR_RETURN(auto stored, StoredType(spec.stored_dtype));
  ASSIGN_OR_RETURN(TensorMap w, GenerateWeights(spec, stored.first));
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("create ", dir, ": ", ec.message()));
  ModelConfig out_cfg = checked;
  out_cfg.torch_dtype = spec.stored_dtype;
  RETURN_IF_ERROR(
      WriteFileAtomically((fs::path(dir) / "config.json").string(), ModelConfigToJson(out_cfg)));
  if (spec.num_shards <= 1) {
    return SaveSafetensorsFile((fs::path(dir) / "model.safetensors").string(), w, spec.stored_dtype)
        .status();
  }
  // Shards: names distributed round-robin so every shard is non-empty for any model.
  const int n = spec.num_shards;
  std::vector<TensorMap> shards(n);
  nlohmann::json weight_map = nlohmann::json::object();
  int k = 0;
  for (const auto& [name, t] : w) {
    shards[k % n][name] = t;
    weight_map[name] = absl::StrFormat("model-%05d-of-%05d.safetensors", k % n + 1, n);
    ++k;
  }
  for (int i = 0; i < n; ++i) {
    RETURN_IF_ERROR(
        SaveSafetensorsFile(
            (fs::path(dir) / absl::StrFormat("model-%05d-of-%05d.safetensors", i + 1, n)).string(),
            shards[i], spec.stored_dtype)
            .status());
  }
  nlohmann::json index = {{"metadata", nlohmann::json::object()}, {"weight_map", weight_map}};
  return WriteFileAtomically((fs::path(dir) / "model.safetensors.index.json").string(),
                             index.dump(2));
}

}  // namespace tinkerd
