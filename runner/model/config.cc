#include "runner/model/config.h"

#include <cmath>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace tinkerd {
namespace {

using json = nlohmann::json;

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

absl::Status ParseRopeScaling(const json& j, ModelConfig* c) {
  auto it = j.find("rope_scaling");
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_object()) return Bad("rope_scaling must be an object or null");
  const json& rs = *it;
  std::string type;
  if (rs.contains("rope_type") && rs["rope_type"].is_string()) {
    type = rs["rope_type"].get<std::string>();
  } else if (rs.contains("type") && rs["type"].is_string()) {
    type = rs["type"].get<std::string>();
  } else {
    return Bad("rope_scaling needs a string 'rope_type' (or 'type')");
  }
  RopeScaling& s = c->rope_scaling;
  if (type == "default") {
    s.type = RopeScaling::Type::kNone;
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
    return Bad(
        absl::StrCat("rope_scaling type '", type,
                     "' is not supported (supported: default, linear, dynamic, yarn, llama3)"));
  }
  auto f = [&](const char* k, double* v, bool req) { return ReadNumber(rs, k, v, req); };
  if (auto st = f("factor", &s.factor, true); !st.ok()) return st;
  if (!(s.factor >= 1.0)) return Bad("rope_scaling.factor must be >= 1");
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
    return Bad("rope_scaling: high_freq_factor must exceed low_freq_factor");
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
  } else {
    return Bad(absl::StrCat("architecture '", a,
                            "' is not supported (supported: LlamaForCausalLM, MistralForCausalLM, "
                            "Qwen2ForCausalLM, Qwen3ForCausalLM)"));
  }
  if (auto st = ReadNumber(j, "vocab_size", &c.vocab_size, true); !st.ok()) return st;
  if (auto st = ReadNumber(j, "hidden_size", &c.hidden_size, true); !st.ok()) return st;
  if (auto st = ReadNumber(j, "intermediate_size", &c.intermediate_size, true); !st.ok()) return st;
  if (auto st = ReadNumber(j, "num_hidden_layers", &c.num_hidden_layers, true); !st.ok()) return st;
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
  if (auto st = ReadNumber(j, "rope_theta", &c.rope_theta, false); !st.ok()) return st;
  if (auto st = ReadBool(j, "tie_word_embeddings", &c.tie_word_embeddings); !st.ok()) return st;
  if (c.architecture != "Qwen2ForCausalLM") {
    if (auto st = ReadBool(j, "attention_bias", &c.attention_bias); !st.ok()) return st;
  }
  if (auto st = ParseRopeScaling(j, &c); !st.ok()) return st;
  // Mistral always honours sliding_window; Qwen2/3 only with use_sliding_window = true.
  bool use_sw = c.model_type == "mistral";
  if (c.model_type != "mistral") {
    if (auto st = ReadBool(j, "use_sliding_window", &use_sw); !st.ok()) return st;
  }
  if (use_sw) {
    if (auto st = ReadNumber(j, "sliding_window", &c.sliding_window, false); !st.ok()) return st;
  }
  if (j.contains("torch_dtype") && j["torch_dtype"].is_string()) {
    c.torch_dtype = j["torch_dtype"].get<std::string>();
  }

  if (c.vocab_size <= 0 || c.hidden_size <= 0 || c.intermediate_size <= 0 ||
      c.num_hidden_layers <= 0 || c.num_attention_heads <= 0 || c.num_key_value_heads <= 0) {
    return Bad("sizes (vocab, hidden, intermediate, layers, heads) must be positive");
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    return Bad("num_attention_heads must be a multiple of num_key_value_heads");
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
  if (c.model_type != "qwen2") j["attention_bias"] = c.attention_bias;
  if (c.sliding_window > 0) {
    j["sliding_window"] = c.sliding_window;
    if (c.model_type != "mistral") j["use_sliding_window"] = true;
  } else if (c.model_type == "mistral") {
    j["sliding_window"] = nullptr;
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
  return j.dump(2);
}

std::string ModelConfig::DebugString() const {
  return absl::StrFormat(
      "%s: vocab=%d hidden=%d inter=%d layers=%d heads=%d kv_heads=%d head_dim=%d ctx=%d tied=%d "
      "bias=%d qk_norm=%d sliding_window=%d rope_theta=%g rope_scaling=%d(x%g)",
      architecture, vocab_size, hidden_size, intermediate_size, num_hidden_layers,
      num_attention_heads, num_key_value_heads, head_dim, max_position_embeddings,
      tie_word_embeddings, attention_bias, qk_norm, sliding_window, rope_theta,
      static_cast<int>(rope_scaling.type), rope_scaling.factor);
}

}  // namespace tinkerd
