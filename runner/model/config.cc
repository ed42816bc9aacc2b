#include "runner/model/config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "runner/util/status_macros.h"

namespace tinkerd {
namespace {

using json = nlohmann::json;

constexpr int64_t kMaxLayers = 4096;   // the largest published decoders have ~200
constexpr int64_t kMaxExperts = 4096;  // the largest published routers pick among ~400

// Mistral and Mixtral slide every layer when sliding_window is set; Qwen's families choose.
bool SlidesEveryLayer(const std::string& model_type) {
  return model_type == "mistral" || model_type == "mixtral";
}

absl::Status Bad(absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("config.json: ", what));
}

// A JSON number that is exactly an int64: an integer in range, or a float with an integral value
// (some exporters write 4096.0). The range check comes before the cast: converting an
// out-of-range float is undefined behaviour (found by tests/fuzz/fuzz_model_config).
std::optional<int64_t> ExactInt64(const json& v) {
  if (v.is_number_unsigned()) {
    const uint64_t u = v.get<uint64_t>();
    return u <= uint64_t{INT64_MAX} ? std::optional<int64_t>(static_cast<int64_t>(u))
                                    : std::nullopt;
  }
  if (v.is_number_integer()) return v.get<int64_t>();
  const double d = v.get<double>();
  if (std::isfinite(d) && std::floor(d) == d && std::fabs(d) < 9.2e18) {
    return static_cast<int64_t>(d);
  }
  return std::nullopt;
}

// Reads an optional number; a present value of the wrong type is an error, not a silent default.
template <typename T>
absl::Status ReadNumber(const json& j, const char* key, T* out, bool required) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    return required ? Bad(absl::StrCat("missing required field '", key, "'")) : absl::OkStatus();
  }
  if (!it->is_number()) return Bad(absl::StrCat("field '", key, "' must be a number"));
  if constexpr (std::is_integral_v<T>) {
    const std::optional<int64_t> v = ExactInt64(*it);
    if (!v) return Bad(absl::StrCat("field '", key, "' must be an integer in range"));
    *out = *v;
  } else {
    *out = it->get<T>();
  }
  return absl::OkStatus();
}

absl::Status ReadBool(const json& j, const char* key, bool* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_boolean()) return Bad(absl::StrCat("field '", key, "' must be a boolean"));
  *out = it->get<bool>();
  return absl::OkStatus();
}

// The keys a RoPE block may hold; any other changes the math in a way tinkerd does not implement
// (longrope's short_factor, DeepSeek's mscale, ...), so it fails the load by name.
constexpr const char* kRopeKeys[] = {"rope_type",
                                     "type",
                                     "rope_theta",
                                     "factor",
                                     "original_max_position_embeddings",
                                     "low_freq_factor",
                                     "high_freq_factor",
                                     "beta_fast",
                                     "beta_slow",
                                     "attention_factor",
                                     "truncate",
                                     "partial_rotary_factor"};

// One RoPE block: transformers 4's `rope_scaling` or transformers 5's `rope_parameters`, which
// holds the same keys plus rope_theta. `where` names the block in errors.
absl::Status ParseRopeBlock(const json& rs, const std::string& where, RopeScaling* out,
                            std::optional<double>* theta) {
  if (!rs.is_object()) return Bad(absl::StrCat(where, " must be an object or null"));
  for (const auto& [key, value] : rs.items()) {
    if (value.is_object()) {
      return Bad(
          absl::StrCat(where, ".", key, ": RoPE parameters per layer type are not supported"));
    }
    if (std::find(std::begin(kRopeKeys), std::end(kRopeKeys), key) == std::end(kRopeKeys)) {
      return Bad(absl::StrCat(where, ".", key, " is not supported (it changes RoPE in a way ",
                              "tinkerd does not implement)"));
    }
  }
  std::string type;
  if (rs.contains("rope_type") && rs["rope_type"].is_string()) {
    type = rs["rope_type"].get<std::string>();
  } else if (rs.contains("type") && rs["type"].is_string()) {
    type = rs["type"].get<std::string>();
  } else {
    return Bad(absl::StrCat(where, " needs a string 'rope_type' (or 'type')"));
  }
  if (rs.contains("rope_theta")) {
    double t = 0;
    if (auto st = ReadNumber(rs, "rope_theta", &t, true); !st.ok()) {
      return Bad(absl::StrCat(where, ".rope_theta must be a number"));
    }
    *theta = t;
  }
  double partial = 1.0;
  if (auto st = ReadNumber(rs, "partial_rotary_factor", &partial, false); !st.ok()) return st;
  if (partial != 1.0) {
    return Bad(absl::StrCat(where, ".partial_rotary_factor ", partial,
                            " is not supported (only 1: RoPE over the whole head)"));
  }
  bool truncate = true;
  if (auto st = ReadBool(rs, "truncate", &truncate); !st.ok()) return st;
  if (!truncate) return Bad(absl::StrCat(where, ".truncate false is not supported"));

  RopeScaling s;
  if (type == "default") {
    *out = s;
    return absl::OkStatus();
  } else if (type == "linear") {
    s.type = RopeScaling::Type::kLinear;
  } else if (type == "dynamic") {
    s.type = RopeScaling::Type::kDynamic;
  } else if (type == "yarn") {
    s.type = RopeScaling::Type::kYarn;
  } else if (type == "llama3") {
    s.type = RopeScaling::Type::kLlama3;
  } else {
    return Bad(absl::StrCat(where, ": rope type '", type,
                            "' is not supported (supported: default, linear, dynamic, yarn, "
                            "llama3)"));
  }
  auto f = [&](const char* k, double* v, bool req) { return ReadNumber(rs, k, v, req); };
  if (auto st = f("factor", &s.factor, true); !st.ok()) return st;
  if (!(s.factor >= 1.0)) return Bad(absl::StrCat(where, ".factor must be >= 1"));
  if (auto st =
          ReadNumber(rs, "original_max_position_embeddings", &s.original_max_position_embeddings,
                     s.type == RopeScaling::Type::kLlama3);
      !st.ok())
    return st;
  if (auto st = f("low_freq_factor", &s.low_freq_factor, false); !st.ok()) return st;
  if (auto st = f("high_freq_factor", &s.high_freq_factor, false); !st.ok()) return st;
  if (auto st = f("beta_fast", &s.beta_fast, false); !st.ok()) return st;
  if (auto st = f("beta_slow", &s.beta_slow, false); !st.ok()) return st;
  if (auto st = f("attention_factor", &s.attention_factor, false); !st.ok()) return st;
  if (s.type == RopeScaling::Type::kLlama3 && !(s.high_freq_factor > s.low_freq_factor)) {
    return Bad(absl::StrCat(where, ": high_freq_factor must exceed low_freq_factor"));
  }
  *out = s;
  return absl::OkStatus();
}

bool SameRope(const RopeScaling& a, const RopeScaling& b) {
  return a.type == b.type && a.factor == b.factor &&
         a.original_max_position_embeddings == b.original_max_position_embeddings &&
         a.low_freq_factor == b.low_freq_factor && a.high_freq_factor == b.high_freq_factor &&
         a.beta_fast == b.beta_fast && a.beta_slow == b.beta_slow &&
         a.attention_factor == b.attention_factor;
}

// rope_theta and the scaling, from whichever layout the file uses. transformers 5 writes only
// `rope_parameters`; a file with both layouts must say the same thing in each, or which one
// wins would be a guess.
absl::Status ParseRope(const json& j, ModelConfig* c) {
  std::optional<double> top_theta;
  if (j.contains("rope_theta") && !j["rope_theta"].is_null()) {
    double t = 0;
    if (auto st = ReadNumber(j, "rope_theta", &t, true); !st.ok()) return st;
    top_theta = t;
  }
  std::optional<RopeScaling> v4, v5;
  std::optional<double> v4_theta, v5_theta;
  if (auto it = j.find("rope_scaling"); it != j.end() && !it->is_null()) {
    v4.emplace();
    if (auto st = ParseRopeBlock(*it, "rope_scaling", &*v4, &v4_theta); !st.ok()) return st;
  }
  if (auto it = j.find("rope_parameters"); it != j.end() && !it->is_null()) {
    v5.emplace();
    if (auto st = ParseRopeBlock(*it, "rope_parameters", &*v5, &v5_theta); !st.ok()) return st;
  }
  if (v4 && v5 && !SameRope(*v4, *v5)) {
    return Bad("rope_scaling and rope_parameters disagree; remove one of them");
  }
  std::optional<double> theta = top_theta;
  for (const std::optional<double>& t : {v4_theta, v5_theta}) {
    if (!t) continue;
    if (theta && *theta != *t) {
      return Bad(absl::StrFormat("rope_theta is given twice with different values (%g and %g)",
                                 *theta, *t));
    }
    theta = t;
  }
  if (theta) c->rope_theta = *theta;
  if (v5) {
    c->rope_scaling = *v5;
  } else if (v4) {
    c->rope_scaling = *v4;
  }
  return absl::OkStatus();
}

// Which layers attend through the sliding window. Mistral and Mixtral: all of them. Qwen2/3: those
// at index max_window_layers and above (Hugging Face's rule, default 28), when use_sliding_window
// is true. Qwen3-MoE: all of them when use_sliding_window is true (its config has no
// max_window_layers).
// `layer_types` (transformers >= 4.53 and 5) lists them explicitly and wins.
absl::Status ParseSlidingWindow(const json& j, ModelConfig* c) {
  const bool mistral = SlidesEveryLayer(c->model_type);
  bool use_sw = mistral;
  if (!mistral) {
    if (auto st = ReadBool(j, "use_sliding_window", &use_sw); !st.ok()) return st;
  }
  if (use_sw) {
    if (auto st = ReadNumber(j, "sliding_window", &c->sliding_window, false); !st.ok()) return st;
  }
  const int64_t n = c->num_hidden_layers;
  if (auto it = j.find("layer_types"); it != j.end() && !it->is_null()) {
    if (!it->is_array() || static_cast<int64_t>(it->size()) != n) {
      return Bad(absl::StrCat("layer_types must be a list of num_hidden_layers (", n, ") strings"));
    }
    c->layer_slides.assign(static_cast<size_t>(n), false);
    for (int64_t i = 0; i < n; ++i) {
      const json& t = (*it)[static_cast<size_t>(i)];
      const std::string type = t.is_string() ? t.get<std::string>() : "";
      if (type == "sliding_attention") {
        c->layer_slides[static_cast<size_t>(i)] = true;
      } else if (type != "full_attention") {
        return Bad(absl::StrCat("layer_types[", i, "] '", type,
                                "' is not supported (supported: full_attention, "
                                "sliding_attention)"));
      }
    }
  } else if (!mistral && c->model_type != "qwen3_moe" && c->sliding_window > 0) {
    int64_t first = 28;  // Qwen2Config's and Qwen3Config's default
    if (auto st = ReadNumber(j, "max_window_layers", &first, false); !st.ok()) return st;
    c->layer_slides.assign(static_cast<size_t>(n), false);
    for (int64_t i = std::max<int64_t>(first, 0); i < n; ++i) {
      c->layer_slides[static_cast<size_t>(i)] = true;
    }
  }
  return absl::OkStatus();
}

// eos_token_id: an id, a list of ids, or null; each must be a token of the vocabulary.
absl::Status ReadEos(const json& j, int64_t vocab, std::vector<int64_t>* out) {
  out->clear();
  auto it = j.find("eos_token_id");
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  const json list = it->is_array() ? *it : json::array({*it});
  for (const json& v : list) {
    const std::optional<int64_t> id = v.is_number() ? ExactInt64(v) : std::nullopt;
    if (!id || *id < 0 || *id >= vocab) {
      return Bad(absl::StrCat("eos_token_id must be token ids in [0, ", vocab, ")"));
    }
    out->push_back(*id);
  }
  return absl::OkStatus();
}

// The routed MLP of Qwen2MoeForCausalLM, Qwen3MoeForCausalLM and MixtralForCausalLM, with their
// config classes'
// defaults for absent keys. The router's auxiliary loss keys (output_router_logits,
// router_aux_loss_coef) do not change the forward and are not read: Tinker's losses are the ones
// a client asks for.
absl::Status ParseMoe(const json& j, ModelConfig* c) {
  MoeConfig& m = c->moe;
  const auto n = static_cast<size_t>(c->num_hidden_layers);
  if (c->architecture == "MixtralForCausalLM") {
    m.names = {"block_sparse_moe", "gate", "w1", "w3", "w2"};
    m.num_experts = 8;
    m.top_k = 2;
    RETURN_IF_ERROR(ReadNumber(j, "num_local_experts", &m.num_experts, false));
    RETURN_IF_ERROR(ReadNumber(j, "num_experts_per_tok", &m.top_k, false));
    m.expert_intermediate_size = c->intermediate_size;
    m.norm_topk_prob = true;
    m.wide_weights = true;
    double jitter = 0;
    RETURN_IF_ERROR(ReadNumber(j, "router_jitter_noise", &jitter, false));
    if (jitter != 0) {
      return Bad("router_jitter_noise other than 0 is not supported (it makes routing random)");
    }
    m.layer_routes.assign(n, true);
  } else if (c->architecture == "Qwen3MoeForCausalLM" || c->architecture == "Qwen2MoeForCausalLM") {
    // One layout, Qwen2-MoE's with a shared expert beside the routed ones (and other defaults).
    const bool qwen2 = c->architecture == "Qwen2MoeForCausalLM";
    m.names = {"mlp", "gate", "gate_proj", "up_proj", "down_proj"};
    m.num_experts = qwen2 ? 60 : 128;
    m.top_k = qwen2 ? 4 : 8;
    m.expert_intermediate_size = qwen2 ? 1408 : 768;
    if (qwen2) {
      m.shared_expert_intermediate_size = 5632;
      RETURN_IF_ERROR(ReadNumber(j, "shared_expert_intermediate_size",
                                 &m.shared_expert_intermediate_size, false));
      if (m.shared_expert_intermediate_size <= 0) {
        return Bad("shared_expert_intermediate_size must be positive");
      }
    }
    int64_t step = 1;
    // transformers 5 writes the count as num_local_experts (an alias of num_experts).
    RETURN_IF_ERROR(ReadNumber(j, "num_experts", &m.num_experts, false));
    int64_t alias = m.num_experts;
    RETURN_IF_ERROR(ReadNumber(j, "num_local_experts", &alias, false));
    if (j.contains("num_experts") && !j["num_experts"].is_null() && alias != m.num_experts) {
      return Bad("num_experts and num_local_experts disagree; remove one of them");
    }
    m.num_experts = alias;
    RETURN_IF_ERROR(ReadNumber(j, "num_experts_per_tok", &m.top_k, false));
    RETURN_IF_ERROR(ReadNumber(j, "moe_intermediate_size", &m.expert_intermediate_size, false));
    RETURN_IF_ERROR(ReadBool(j, "norm_topk_prob", &m.norm_topk_prob));
    RETURN_IF_ERROR(ReadNumber(j, "decoder_sparse_step", &step, false));
    if (step <= 0) return Bad("decoder_sparse_step must be positive");
    m.layer_routes.assign(n, false);
    for (size_t l = 0; l < n; ++l) m.layer_routes[l] = (l + 1) % static_cast<size_t>(step) == 0;
    if (auto it = j.find("mlp_only_layers"); it != j.end() && !it->is_null()) {
      if (!it->is_array()) return Bad("mlp_only_layers must be a list of layer indices");
      for (const json& v : *it) {
        const std::optional<int64_t> l = v.is_number() ? ExactInt64(v) : std::nullopt;
        if (!l || *l < 0 || *l >= c->num_hidden_layers) {
          return Bad(absl::StrCat("mlp_only_layers must hold layer indices in [0, ",
                                  c->num_hidden_layers, ")"));
        }
        m.layer_routes[static_cast<size_t>(*l)] = false;
      }
    }
    if (m.num_experts == 0) m.layer_routes.assign(n, false);
  } else {
    return absl::OkStatus();
  }
  if (m.num_experts < 0 || m.num_experts > kMaxExperts) {
    return Bad(absl::StrCat("the number of experts must be in [0, ", kMaxExperts, "]"));
  }
  if (m.num_experts > 0 && (m.top_k < 1 || m.top_k > m.num_experts)) {
    return Bad("num_experts_per_tok must be in [1, the number of experts]");
  }
  if (m.num_experts > 0 && m.expert_intermediate_size <= 0) {
    return Bad("the experts' intermediate size must be positive");
  }
  return absl::OkStatus();
}

// Keys of Hugging Face configs that change the math of these families when they are not at their
// default: refused by name rather than ignored.
absl::Status RefuseUnsupportedMath(const json& j) {
  if (auto it = j.find("hidden_act"); it != j.end() && !it->is_null()) {
    const std::string act = it->is_string() ? it->get<std::string>() : "";
    if (act != "silu" && act != "swish") {
      return Bad(absl::StrCat("hidden_act '", act, "' is not supported (only silu)"));
    }
  }
  bool mlp_bias = false;
  if (auto st = ReadBool(j, "mlp_bias", &mlp_bias); !st.ok()) return st;
  if (mlp_bias) return Bad("mlp_bias true is not supported");
  double partial = 1.0;
  if (auto st = ReadNumber(j, "partial_rotary_factor", &partial, false); !st.ok()) return st;
  if (partial != 1.0) return Bad("partial_rotary_factor other than 1 is not supported");
  for (const char* key : {"attn_logit_softcapping", "final_logit_softcapping", "logits_scaling",
                          "embedding_multiplier", "residual_multiplier", "attention_multiplier"}) {
    if (auto it = j.find(key); it != j.end() && !it->is_null()) {
      return Bad(absl::StrCat("'", key, "' is not supported by these model families"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ParseImpl(const json& j) {
  if (!j.is_object()) return Bad("top level must be an object");
  ModelConfig c;
  if (!j.contains("architectures") || !j["architectures"].is_array() ||
      j["architectures"].empty() || !j["architectures"][0].is_string()) {
    return Bad("missing 'architectures' (a non-empty list of strings)");
  }
  c.architecture = j["architectures"][0].get<std::string>();
  if (j.contains("model_type") && j["model_type"].is_string()) {
    c.model_type = j["model_type"].get<std::string>();
  }
  const std::string& a = c.architecture;
  if (a == "LlamaForCausalLM") {
    if (c.model_type.empty()) c.model_type = "llama";
  } else if (a == "MistralForCausalLM") {
    if (c.model_type.empty()) c.model_type = "mistral";
  } else if (a == "Qwen2ForCausalLM") {
    if (c.model_type.empty()) c.model_type = "qwen2";
    c.attention_bias = true;
  } else if (a == "Qwen3ForCausalLM") {
    if (c.model_type.empty()) c.model_type = "qwen3";
    c.qk_norm = true;
  } else if (a == "Qwen2MoeForCausalLM") {
    if (c.model_type.empty()) c.model_type = "qwen2_moe";
    c.attention_bias = true;  // transformers 5 names it qkv_bias
  } else if (a == "Qwen3MoeForCausalLM") {
    if (c.model_type.empty()) c.model_type = "qwen3_moe";
    c.qk_norm = true;
  } else if (a == "MixtralForCausalLM") {
    if (c.model_type.empty()) c.model_type = "mixtral";
  } else {
    return Bad(absl::StrCat("architecture '", a,
                            "' is not supported (supported: LlamaForCausalLM, MistralForCausalLM, "
                            "Qwen2ForCausalLM, Qwen3ForCausalLM, Qwen2MoeForCausalLM, "
                            "Qwen3MoeForCausalLM, MixtralForCausalLM)"));
  }
  if (auto st = ReadNumber(j, "vocab_size", &c.vocab_size, true); !st.ok()) return st;
  if (auto st = ReadNumber(j, "hidden_size", &c.hidden_size, true); !st.ok()) return st;
  if (auto st = ReadNumber(j, "intermediate_size", &c.intermediate_size, true); !st.ok()) return st;
  if (auto st = ReadNumber(j, "num_hidden_layers", &c.num_hidden_layers, true); !st.ok()) return st;
  // Per-layer state is sized by it (layer_types): bound it before anything is allocated.
  if (c.num_hidden_layers > kMaxLayers) {
    return Bad(absl::StrCat("num_hidden_layers must be at most ", kMaxLayers));
  }
  if (auto st = ReadNumber(j, "num_attention_heads", &c.num_attention_heads, true); !st.ok())
    return st;
  c.num_key_value_heads = c.num_attention_heads;
  if (auto st = ReadNumber(j, "num_key_value_heads", &c.num_key_value_heads, false); !st.ok())
    return st;
  if (auto st = ReadNumber(j, "head_dim", &c.head_dim, false); !st.ok()) return st;
  c.max_position_embeddings = 2048;
  if (auto st = ReadNumber(j, "max_position_embeddings", &c.max_position_embeddings, false);
      !st.ok())
    return st;
  if (auto st = ReadNumber(j, "rms_norm_eps", &c.rms_norm_eps, false); !st.ok()) return st;
  if (auto st = ReadBool(j, "tie_word_embeddings", &c.tie_word_embeddings); !st.ok()) return st;
  if (c.architecture == "Qwen2MoeForCausalLM") {
    if (auto st = ReadBool(j, "qkv_bias", &c.attention_bias); !st.ok()) return st;
  } else if (c.architecture != "Qwen2ForCausalLM") {
    if (auto st = ReadBool(j, "attention_bias", &c.attention_bias); !st.ok()) return st;
  }
  if (auto st = RefuseUnsupportedMath(j); !st.ok()) return st;
  if (auto st = ParseRope(j, &c); !st.ok()) return st;
  if (c.num_hidden_layers > 0) {
    if (auto st = ParseSlidingWindow(j, &c); !st.ok()) return st;
    if (auto st = ParseMoe(j, &c); !st.ok()) return st;
  }
  for (const char* key : {"torch_dtype", "dtype"}) {  // transformers 4, 5
    if (j.contains(key) && j[key].is_string()) c.torch_dtype = j[key].get<std::string>();
  }

  if (c.vocab_size <= 0 || c.hidden_size <= 0 || c.intermediate_size <= 0 ||
      c.num_hidden_layers <= 0 || c.num_attention_heads <= 0 || c.num_key_value_heads <= 0) {
    return Bad("sizes (vocab, hidden, intermediate, layers, heads) must be positive");
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return Bad("num_attention_heads must be a multiple of num_key_value_heads");
  }
  if (c.head_dim == 0 && c.model_type == "qwen3") {
    c.head_dim = 128;  // Qwen3Config's default, not hidden_size / num_attention_heads
  }
  if (c.head_dim == 0) {
    if (c.hidden_size % c.num_attention_heads != 0) {
      return Bad("hidden_size must be a multiple of num_attention_heads when head_dim is absent");
    }
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  if (c.head_dim <= 0 || c.head_dim % 2 != 0) return Bad("head_dim must be positive and even");
  if (c.max_position_embeddings <= 0) return Bad("max_position_embeddings must be positive");
  if (!(c.rms_norm_eps > 0) || !(c.rope_theta > 1))
    return Bad("rms_norm_eps/rope_theta out of range");
  if (c.sliding_window < 0) return Bad("sliding_window must be >= 0");
  if (c.rope_scaling.original_max_position_embeddings == 0) {
    c.rope_scaling.original_max_position_embeddings = c.max_position_embeddings;
  }
  if (auto st = ReadEos(j, c.vocab_size, &c.eos_token_ids); !st.ok()) return st;
  return c;
}

}  // namespace

absl::StatusOr<ModelConfig> ParseModelConfig(absl::string_view json_text) {
  json j = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Bad("not valid JSON");
  try {
    return ParseImpl(j);
  } catch (const std::exception& e) {  // a number out of range for its type, for example
    return Bad(e.what());
  }
}

absl::StatusOr<std::vector<int64_t>> ParseGenerationEos(absl::string_view json_text,
                                                        int64_t vocab_size) {
  json j = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("generation_config.json: not a JSON object");
  }
  std::vector<int64_t> eos;
  if (auto st = ReadEos(j, vocab_size, &eos); !st.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("generation_config.json: ", absl::StripPrefix(st.message(), "config.json: ")));
  }
  return eos;
}

std::string ModelConfigToJson(const ModelConfig& c) {
  json j;
  j["architectures"] = {c.architecture};
  j["model_type"] = c.model_type;
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_hidden_layers;
  j["num_attention_heads"] = c.num_attention_heads;
  j["num_key_value_heads"] = c.num_key_value_heads;
  j["head_dim"] = c.head_dim;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["hidden_act"] = "silu";
  if (c.architecture == "Qwen2MoeForCausalLM") {  // the parser's choice, by architecture
    j["qkv_bias"] = c.attention_bias;
  } else if (c.model_type != "qwen2") {
    j["attention_bias"] = c.attention_bias;
  }
  if (c.sliding_window > 0) {
    j["sliding_window"] = c.sliding_window;
    if (c.model_type == "qwen3_moe") {
      j["use_sliding_window"] = true;
    } else if (!SlidesEveryLayer(c.model_type)) {
      j["use_sliding_window"] = true;
      // Hugging Face's rule for readers without layer_types: layers from this index on slide.
      int64_t first = 0;
      while (first < c.num_hidden_layers && !c.WindowOf(first)) ++first;
      j["max_window_layers"] = first;
    }
    if (!c.layer_slides.empty()) {
      json types = json::array();
      for (bool slides : c.layer_slides) {
        types.push_back(slides ? "sliding_attention" : "full_attention");
      }
      j["layer_types"] = types;
    }
  } else if (SlidesEveryLayer(c.model_type)) {
    j["sliding_window"] = nullptr;
  }
  const MoeConfig& m = c.moe;
  if (c.architecture == "MixtralForCausalLM") {
    j["num_local_experts"] = m.num_experts;
    j["num_experts_per_tok"] = m.top_k;
    j["router_jitter_noise"] = 0.0;
  } else if (c.architecture == "Qwen3MoeForCausalLM" || c.architecture == "Qwen2MoeForCausalLM") {
    if (m.shared_expert_intermediate_size > 0) {
      j["shared_expert_intermediate_size"] = m.shared_expert_intermediate_size;
    }
    j["num_experts"] = m.num_experts;
    j["num_experts_per_tok"] = m.top_k;
    j["moe_intermediate_size"] = m.expert_intermediate_size;
    j["norm_topk_prob"] = m.norm_topk_prob;
    j["decoder_sparse_step"] = 1;
    json dense = json::array();
    for (size_t l = 0; l < m.layer_routes.size(); ++l) {
      if (!m.layer_routes[l]) dense.push_back(l);
    }
    j["mlp_only_layers"] = dense;
  }
  const RopeScaling& s = c.rope_scaling;
  if (s.type == RopeScaling::Type::kNone) {
    j["rope_scaling"] = nullptr;
  } else {
    json rs;
    switch (s.type) {
      case RopeScaling::Type::kLinear:
        rs["rope_type"] = "linear";
        break;
      case RopeScaling::Type::kDynamic:
        rs["rope_type"] = "dynamic";
        break;
      case RopeScaling::Type::kYarn:
        rs["rope_type"] = "yarn";
        rs["beta_fast"] = s.beta_fast;
        rs["beta_slow"] = s.beta_slow;
        if (s.attention_factor > 0) rs["attention_factor"] = s.attention_factor;
        break;
      case RopeScaling::Type::kLlama3:
        rs["rope_type"] = "llama3";
        rs["low_freq_factor"] = s.low_freq_factor;
        rs["high_freq_factor"] = s.high_freq_factor;
        break;
      case RopeScaling::Type::kNone:
        break;
    }
    rs["factor"] = s.factor;
    rs["original_max_position_embeddings"] = s.original_max_position_embeddings;
    j["rope_scaling"] = rs;
  }
  j["torch_dtype"] = c.torch_dtype.empty() ? "float32" : c.torch_dtype;
  if (c.eos_token_ids.size() == 1) {
    j["eos_token_id"] = c.eos_token_ids[0];
  } else if (!c.eos_token_ids.empty()) {
    j["eos_token_id"] = c.eos_token_ids;
  }
  return j.dump(2);
}

std::string ModelConfig::DebugString() const {
  return absl::StrFormat(
             "%s: vocab=%d hidden=%d inter=%d layers=%d heads=%d kv_heads=%d head_dim=%d ctx=%d "
             "tied=%d "
             "bias=%d qk_norm=%d sliding_window=%d(%s) rope_theta=%g rope_scaling=%d(x%g)",
             architecture, vocab_size, hidden_size, intermediate_size, num_hidden_layers,
             num_attention_heads, num_key_value_heads, head_dim, max_position_embeddings,
             tie_word_embeddings, attention_bias, qk_norm, sliding_window,
             layer_slides.empty()
                 ? "every layer"
                 : absl::StrCat(std::count(layer_slides.begin(), layer_slides.end(), true), " of ",
                                layer_slides.size(), " layers"),
             rope_theta, static_cast<int>(rope_scaling.type), rope_scaling.factor) +
         (moe.num_experts == 0
              ? ""
              : absl::StrFormat(
                    " experts=%d top_k=%d expert_inter=%d shared_inter=%d norm_topk=%d "
                    "routed_layers=%d",
                    moe.num_experts, moe.top_k, moe.expert_intermediate_size,
                    moe.shared_expert_intermediate_size, moe.norm_topk_prob,
                    std::count(moe.layer_routes.begin(), moe.layer_routes.end(), true)));
}

int64_t MoeConfig::RoutedLayers() const {
  return num_experts == 0 ? 0 : std::count(layer_routes.begin(), layer_routes.end(), true);
}

int64_t MoeConfig::RoutedIndex(int64_t layer) const {
  return std::count(layer_routes.begin(), layer_routes.begin() + layer, true);
}

std::string MoeNames::Expert(int64_t e) const {
  return absl::StrCat(block, ".experts.", e, ".");
}

}  // namespace tinkerd
