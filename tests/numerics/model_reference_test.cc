// Checks ModelRunner's forward pass (compute_dtype float64) against an independent float64
// re-implementation of the Llama / Mistral / Qwen2 / Qwen3 decoder.
//
// Independence is the point: the reference reads config.json with nlohmann/json and the
// safetensors files with its own parser, never ParseModelConfig or the runner's loader, and its
// forward pass is written with plain loops over one sequence, one position and one head at a time
// (no batching, no packing, no masks). A bug would have to be written twice, in two different
// shapes, to slip through.
//
// Shape-suffix legend. Vectors are std::vector<double>; nested vectors follow the suffix order.
//   T  positions of one sequence     D  hidden size         I  intermediate (MLP) size
//   V  vocabulary                    H  query heads         G  key/value heads
//   E  head_dim                      F  rotary frequencies (head_dim / 2)
// e.g. h_TD[t][d], q_THE[t][h][e]. A RefMatrix is flat and row-major in Hugging Face's [out][in]
// layout, so a linear layer is y = W x (+ b), i.e. x Wᵀ for a row vector x.

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "runner/model/config.h"
#include "runner/model/tiny_model.h"
#include "runner/model_runner.h"
#include "runner/runner_config.h"
#include "runner/types.h"

namespace tinkerd {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Vec = std::vector<double>;

constexpr double kPi = 3.14159265358979323846;

// ============================================================================ config.json

struct RefRope {
  std::string type = "default";  // default | linear | dynamic | yarn | llama3
  double factor = 1.0;
  int64_t original_max_position_embeddings = 0;  // resolved: never 0 after parsing
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double beta_fast = 32.0;
  double beta_slow = 1.0;
  std::optional<double> attention_factor;  // yarn; unset: 0.1·ln(factor) + 1
};

struct RefConfig {
  std::string architecture;
  int64_t vocab = 0, hidden = 0, intermediate = 0, layers = 0;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;
  bool qk_norm = false;
  int64_t sliding_window = 0;      // 0: full causal attention
  std::vector<bool> layer_slides;  // which layers use the window; one entry per layer
  RefRope rope;
  // Mixtures of experts (Qwen2-MoE, Qwen3-MoE, Mixtral); experts = 0 for the dense families.
  int64_t experts = 0, top_k = 0, expert_intermediate = 0;
  int64_t shared_intermediate = 0;  // Qwen2-MoE's shared expert; 0: none
  bool renormalize = false;         // the k picked probabilities divided by their sum
  std::vector<bool> layer_routes;   // one entry per layer
  std::string moe_block, expert_gate, expert_up, expert_down;  // Hugging Face names
};

// A present-but-null field reads as absent, as Hugging Face's config classes treat it.
template <typename T>
T Field(const json& j, const char* key, T fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  return it->get<T>();
}

absl::StatusOr<RefConfig> ParseRefConfig(const std::string& text) {
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("reference: config.json is not a JSON object");
  }
  try {
    RefConfig c;
    c.architecture = j.at("architectures").at(0).get<std::string>();
    const bool llama = c.architecture == "LlamaForCausalLM";
    const bool mistral = c.architecture == "MistralForCausalLM";
    const bool qwen2 = c.architecture == "Qwen2ForCausalLM";
    const bool qwen3 = c.architecture == "Qwen3ForCausalLM";
    const bool qwen3_moe = c.architecture == "Qwen3MoeForCausalLM";
    const bool qwen2_moe = c.architecture == "Qwen2MoeForCausalLM";
    const bool mixtral = c.architecture == "MixtralForCausalLM";
    if (!(llama || mistral || qwen2 || qwen3 || qwen3_moe || qwen2_moe || mixtral)) {
      return absl::InvalidArgumentError(
          absl::StrCat("reference: architecture ", c.architecture, " is not modelled"));
    }
    c.vocab = j.at("vocab_size").get<int64_t>();
    c.hidden = j.at("hidden_size").get<int64_t>();
    c.intermediate = j.at("intermediate_size").get<int64_t>();
    c.layers = j.at("num_hidden_layers").get<int64_t>();
    c.heads = j.at("num_attention_heads").get<int64_t>();
    if (c.heads <= 0) return absl::InvalidArgumentError("reference: num_attention_heads <= 0");
    c.kv_heads = Field<int64_t>(j, "num_key_value_heads", c.heads);
    c.head_dim = Field<int64_t>(j, "head_dim", c.hidden / c.heads);
    c.max_position_embeddings = Field<int64_t>(j, "max_position_embeddings", 2048);
    c.rms_norm_eps = Field<double>(j, "rms_norm_eps", 1e-6);
    // transformers 5 moves rope_theta and the scaling into one `rope_parameters` block.
    const json no_block = nullptr;
    const json& rope_block = j.contains("rope_parameters") && !j["rope_parameters"].is_null()
                                 ? j["rope_parameters"]
                             : j.contains("rope_scaling") ? j["rope_scaling"]
                                                          : no_block;
    c.rope_theta = Field<double>(j, "rope_theta", 10000.0);
    if (rope_block.is_object())
      c.rope_theta = Field<double>(rope_block, "rope_theta", c.rope_theta);
    c.tie_word_embeddings = Field<bool>(j, "tie_word_embeddings", false);
    // Qwen2's q/k/v projections carry a bias unconditionally, Qwen2-MoE's unless qkv_bias says
    // otherwise; the others follow attention_bias.
    c.qkv_bias = qwen2       ? true
                 : qwen2_moe ? Field<bool>(j, "qkv_bias", true)
                             : Field<bool>(j, "attention_bias", false);
    c.qk_norm = qwen3 || qwen3_moe;
    // Mistral and Mixtral window every layer. Qwen2/3 window the layers from max_window_layers
    // (default 28) on, when use_sliding_window; an explicit layer_types list says which.
    c.layer_slides.assign(static_cast<size_t>(c.layers), mistral || mixtral);
    if (mistral || mixtral) c.sliding_window = Field<int64_t>(j, "sliding_window", 0);
    // Qwen3-MoE's config has no max_window_layers: with use_sliding_window every layer slides.
    if (qwen3_moe && Field<bool>(j, "use_sliding_window", false)) {
      c.sliding_window = Field<int64_t>(j, "sliding_window", 0);
      c.layer_slides.assign(static_cast<size_t>(c.layers), true);
    }
    if ((qwen2 || qwen3 || qwen2_moe) && Field<bool>(j, "use_sliding_window", false)) {
      c.sliding_window = Field<int64_t>(j, "sliding_window", 0);
      const int64_t first = Field<int64_t>(j, "max_window_layers", 28);
      for (int64_t l = first; l < c.layers; ++l) c.layer_slides[static_cast<size_t>(l)] = true;
    }
    if (j.contains("layer_types") && !j["layer_types"].is_null()) {
      for (int64_t l = 0; l < c.layers; ++l) {
        c.layer_slides[static_cast<size_t>(l)] =
            j["layer_types"].at(static_cast<size_t>(l)).get<std::string>() == "sliding_attention";
      }
    }
    // Mixtral routes every layer, always renormalizing; Qwen3-MoE routes layer l unless it is in
    // mlp_only_layers or (l + 1) is not a multiple of decoder_sparse_step.
    c.layer_routes.assign(static_cast<size_t>(c.layers), false);
    if (mixtral) {
      c.experts = Field<int64_t>(j, "num_local_experts", 8);
      c.top_k = Field<int64_t>(j, "num_experts_per_tok", 2);
      c.expert_intermediate = c.intermediate;
      c.renormalize = true;
      c.layer_routes.assign(static_cast<size_t>(c.layers), true);
      c.moe_block = "block_sparse_moe";
      c.expert_gate = "w1";
      c.expert_up = "w3";
      c.expert_down = "w2";
    }
    if (qwen3_moe || qwen2_moe) {
      // Qwen2MoeConfig's defaults differ from Qwen3MoeConfig's, and it adds the shared expert.
      c.experts = Field<int64_t>(j, "num_experts", qwen2_moe ? 60 : 128);
      c.top_k = Field<int64_t>(j, "num_experts_per_tok", qwen2_moe ? 4 : 8);
      c.expert_intermediate = Field<int64_t>(j, "moe_intermediate_size", qwen2_moe ? 1408 : 768);
      if (qwen2_moe) {
        c.shared_intermediate = Field<int64_t>(j, "shared_expert_intermediate_size", 5632);
      }
      c.renormalize = Field<bool>(j, "norm_topk_prob", false);
      const int64_t step = Field<int64_t>(j, "decoder_sparse_step", 1);
      const std::vector<int64_t> dense =
          Field<std::vector<int64_t>>(j, "mlp_only_layers", std::vector<int64_t>{});
      for (int64_t l = 0; l < c.layers; ++l) {
        c.layer_routes[static_cast<size_t>(l)] =
            c.experts > 0 && (l + 1) % step == 0 &&
            std::find(dense.begin(), dense.end(), l) == dense.end();
      }
      c.moe_block = "mlp";
      c.expert_gate = "gate_proj";
      c.expert_up = "up_proj";
      c.expert_down = "down_proj";
    }
    if (c.kv_heads <= 0 || c.heads % c.kv_heads != 0 || c.head_dim <= 0 || c.head_dim % 2 != 0) {
      return absl::InvalidArgumentError("reference: inconsistent head counts or odd head_dim");
    }

    const json* rs = &rope_block;
    if (rope_block.is_object()) {
      RefRope& r = c.rope;
      r.type = rs->contains("rope_type") ? rs->at("rope_type").get<std::string>()
                                         : rs->at("type").get<std::string>();
      if (r.type != "default" && r.type != "linear" && r.type != "dynamic" && r.type != "yarn" &&
          r.type != "llama3") {
        return absl::InvalidArgumentError(
            absl::StrCat("reference: rope type ", r.type, " is not modelled"));
      }
      r.factor = Field<double>(*rs, "factor", 1.0);
      r.original_max_position_embeddings =
          Field<int64_t>(*rs, "original_max_position_embeddings", 0);
      r.low_freq_factor = Field<double>(*rs, "low_freq_factor", 1.0);
      r.high_freq_factor = Field<double>(*rs, "high_freq_factor", 4.0);
      r.beta_fast = Field<double>(*rs, "beta_fast", 32.0);
      r.beta_slow = Field<double>(*rs, "beta_slow", 1.0);
      if (rs->contains("attention_factor") && !rs->at("attention_factor").is_null()) {
        r.attention_factor = rs->at("attention_factor").get<double>();
      }
    }
    if (c.rope.original_max_position_embeddings <= 0) {
      c.rope.original_max_position_embeddings = c.max_position_embeddings;
    }
    return c;
  } catch (const std::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("reference: config.json: ", e.what()));
  }
}

// ============================================================================ safetensors

struct RefTensor {
  std::vector<int64_t> shape;
  Vec values;
  std::string dtype;  // as stored: F32, BF16, F16, F64
  std::string file;   // which file it came from, to check the shard index
};
using TensorMap = std::map<std::string, RefTensor>;

// Assembled byte by byte so that the reader does not depend on the host's byte order.
uint64_t LoadLittleEndian(const unsigned char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

double FloatBitsToDouble(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

double HalfBitsToDouble(uint16_t bits) {
  const double sign = (bits & 0x8000) ? -1.0 : 1.0;
  const int exponent = (bits >> 10) & 0x1f;
  const int mantissa = bits & 0x3ff;
  if (exponent == 0) return sign * std::ldexp(mantissa, -24);  // zero and subnormals
  if (exponent == 31) return mantissa ? std::nan("") : sign * INFINITY;
  return sign * std::ldexp(mantissa + 1024, exponent - 25);  // (1 + m/2^10) · 2^(e-15)
}

int ElementSize(const std::string& dtype) {
  if (dtype == "F32") return 4;
  if (dtype == "BF16" || dtype == "F16") return 2;
  if (dtype == "F64") return 8;
  return 0;
}

double DecodeElement(const std::string& dtype, const unsigned char* p) {
  if (dtype == "F32") return FloatBitsToDouble(static_cast<uint32_t>(LoadLittleEndian(p, 4)));
  // bfloat16 is the upper half of a float32.
  if (dtype == "BF16")
    return FloatBitsToDouble(static_cast<uint32_t>(LoadLittleEndian(p, 2)) << 16);
  if (dtype == "F16") return HalfBitsToDouble(static_cast<uint16_t>(LoadLittleEndian(p, 2)));
  uint64_t bits = LoadLittleEndian(p, 8);
  double d;
  std::memcpy(&d, &bits, sizeof d);
  return d;
}

// Layout: u64 little-endian header length N, N bytes of JSON, then the data section; every
// tensor's data_offsets are relative to the start of the data section.
absl::Status ReadSafetensorsFile(const fs::path& path, const std::string& file_name,
                                 TensorMap* out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("reference: cannot open ", path.string()));
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (bytes.size() < 8)
    return absl::DataLossError(absl::StrCat(file_name, ": shorter than 8 bytes"));
  const auto* raw = reinterpret_cast<const unsigned char*>(bytes.data());
  const uint64_t header_len = LoadLittleEndian(raw, 8);
  if (header_len > bytes.size() - 8) {
    return absl::DataLossError(absl::StrCat(file_name, ": header runs past the end of the file"));
  }
  json header = json::parse(bytes.begin() + 8, bytes.begin() + 8 + static_cast<int64_t>(header_len),
                            nullptr, /*allow_exceptions=*/false);
  if (header.is_discarded() || !header.is_object()) {
    return absl::DataLossError(absl::StrCat(file_name, ": header is not a JSON object"));
  }
  const uint64_t data_begin = 8 + header_len;
  const uint64_t data_size = bytes.size() - data_begin;
  try {
    for (const auto& [name, info] : header.items()) {
      if (name == "__metadata__") continue;
      RefTensor t;
      t.file = file_name;
      t.dtype = info.at("dtype").get<std::string>();
      t.shape = info.at("shape").get<std::vector<int64_t>>();
      const auto offsets = info.at("data_offsets").get<std::vector<uint64_t>>();
      const int elem = ElementSize(t.dtype);
      if (elem == 0) {
        return absl::UnimplementedError(absl::StrCat(name, ": dtype ", t.dtype, " not read"));
      }
      uint64_t numel = 1;
      for (int64_t s : t.shape) numel *= static_cast<uint64_t>(s);
      if (offsets.size() != 2 || offsets[0] > offsets[1] || offsets[1] > data_size ||
          offsets[1] - offsets[0] != numel * elem) {
        return absl::DataLossError(absl::StrCat(file_name, ": bad data_offsets for ", name));
      }
      const unsigned char* p = raw + data_begin + offsets[0];
      t.values.resize(numel);
      for (uint64_t i = 0; i < numel; ++i) t.values[i] = DecodeElement(t.dtype, p + i * elem);
      if (!out->emplace(name, std::move(t)).second) {
        return absl::DataLossError(absl::StrCat("tensor ", name, " appears twice"));
      }
    }
  } catch (const std::exception& e) {
    return absl::DataLossError(absl::StrCat(file_name, ": ", e.what()));
  }
  return absl::OkStatus();
}

struct Checkpoint {
  RefConfig config;
  TensorMap tensors;
  bool sharded = false;
};

absl::StatusOr<std::string> ReadTextFile(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("reference: cannot open ", path.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<Checkpoint> LoadCheckpoint(const fs::path& dir) {
  Checkpoint ck;
  absl::StatusOr<std::string> config_text = ReadTextFile(dir / "config.json");
  if (!config_text.ok()) return config_text.status();
  absl::StatusOr<RefConfig> config = ParseRefConfig(*config_text);
  if (!config.ok()) return config.status();
  ck.config = *config;

  const fs::path index_path = dir / "model.safetensors.index.json";
  if (!fs::exists(index_path)) {
    absl::Status st =
        ReadSafetensorsFile(dir / "model.safetensors", "model.safetensors", &ck.tensors);
    if (!st.ok()) return st;
    return ck;
  }
  ck.sharded = true;
  absl::StatusOr<std::string> index_text = ReadTextFile(index_path);
  if (!index_text.ok()) return index_text.status();
  json index = json::parse(*index_text, nullptr, /*allow_exceptions=*/false);
  if (index.is_discarded() || !index.contains("weight_map") || !index["weight_map"].is_object()) {
    return absl::DataLossError("reference: index has no weight_map object");
  }
  const json& weight_map = index["weight_map"];
  std::set<std::string> files;
  for (const auto& [name, file] : weight_map.items()) {
    if (!file.is_string()) return absl::DataLossError("reference: weight_map value not a string");
    files.insert(file.get<std::string>());
  }
  for (const std::string& file : files) {
    absl::Status st = ReadSafetensorsFile(dir / file, file, &ck.tensors);
    if (!st.ok()) return st;
  }
  // The index must describe the shards exactly: a tensor in the wrong shard, or one the index
  // does not list, is a checkpoint Hugging Face would load differently.
  for (const auto& [name, file] : weight_map.items()) {
    auto it = ck.tensors.find(name);
    if (it == ck.tensors.end() || it->second.file != file.get<std::string>()) {
      return absl::DataLossError(absl::StrCat("reference: ", name, " is not in ", file.dump()));
    }
  }
  if (ck.tensors.size() != weight_map.size()) {
    return absl::DataLossError("reference: shards hold tensors the index does not list");
  }
  return ck;
}

// ============================================================================ the model

struct RefMatrix {
  int64_t rows = 0, cols = 0;
  Vec w;  // [rows][cols], row-major
};

struct RefLayer {
  Vec input_norm_D, post_norm_D;
  RefMatrix q, k, v, o;        // q: [H·E, D]  k, v: [G·E, D]  o: [D, H·E]
  Vec q_bias, k_bias, v_bias;  // empty without attention bias
  Vec q_norm_E, k_norm_E;      // empty without qk-norm
  RefMatrix gate, up, down;    // gate, up: [I, D]  down: [D, I]; empty where the layer routes
  RefMatrix router;            // [experts, D] where the layer routes
  std::vector<std::array<RefMatrix, 3>> experts;  // each one's gate, up [I', D] and down [D, I']
  std::array<RefMatrix, 3> shared;  // the shared expert's gate, up [I'', D], down [D, I'']
  RefMatrix shared_gate;            // [1, D]; empty without a shared expert
};

struct RefModel {
  RefConfig c;
  RefMatrix embed_VD;
  std::vector<RefLayer> layers;
  Vec final_norm_D;
  RefMatrix lm_head_VD;  // empty when tied: the embedding is the unembedding
};

// Takes tensors out of the map with shape checks, so that whatever is left at the end is a tensor
// the architecture does not use (e.g. lm_head.weight in a tied checkpoint).
class TensorTaker {
 public:
  explicit TensorTaker(TensorMap* tensors) : tensors_(tensors) {}

  RefMatrix Matrix(const std::string& name, int64_t rows, int64_t cols) {
    RefMatrix m;
    m.rows = rows;
    m.cols = cols;
    m.w = Take(name, {rows, cols});
    return m;
  }
  Vec Vector(const std::string& name, int64_t n) { return Take(name, {n}); }
  const absl::Status& status() const { return status_; }

 private:
  Vec Take(const std::string& name, const std::vector<int64_t>& shape) {
    auto it = tensors_->find(name);
    if (it == tensors_->end()) {
      Fail(absl::StrCat("reference: missing tensor ", name));
      return Vec(Numel(shape), 0.0);
    }
    if (it->second.shape != shape) {
      Fail(absl::StrCat("reference: tensor ", name, " has an unexpected shape"));
      return Vec(Numel(shape), 0.0);
    }
    Vec v = std::move(it->second.values);
    tensors_->erase(it);
    return v;
  }
  static size_t Numel(const std::vector<int64_t>& shape) {
    size_t n = 1;
    for (int64_t s : shape) n *= static_cast<size_t>(s);
    return n;
  }
  void Fail(std::string message) {
    if (status_.ok()) status_ = absl::DataLossError(std::move(message));
  }

  TensorMap* tensors_;
  absl::Status status_;
};

absl::StatusOr<RefModel> BuildModel(Checkpoint ck) {
  RefModel m;
  m.c = ck.config;
  const RefConfig& c = m.c;
  const int64_t D = c.hidden, I = c.intermediate, V = c.vocab, E = c.head_dim;
  const int64_t HE = c.heads * E, GE = c.kv_heads * E;
  TensorTaker take(&ck.tensors);
  m.embed_VD = take.Matrix("model.embed_tokens.weight", V, D);
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    RefLayer layer;
    layer.input_norm_D = take.Vector(p + "input_layernorm.weight", D);
    layer.post_norm_D = take.Vector(p + "post_attention_layernorm.weight", D);
    layer.q = take.Matrix(p + "self_attn.q_proj.weight", HE, D);
    layer.k = take.Matrix(p + "self_attn.k_proj.weight", GE, D);
    layer.v = take.Matrix(p + "self_attn.v_proj.weight", GE, D);
    layer.o = take.Matrix(p + "self_attn.o_proj.weight", D, HE);
    if (c.qkv_bias) {
      layer.q_bias = take.Vector(p + "self_attn.q_proj.bias", HE);
      layer.k_bias = take.Vector(p + "self_attn.k_proj.bias", GE);
      layer.v_bias = take.Vector(p + "self_attn.v_proj.bias", GE);
    }
    if (c.qk_norm) {
      layer.q_norm_E = take.Vector(p + "self_attn.q_norm.weight", E);
      layer.k_norm_E = take.Vector(p + "self_attn.k_norm.weight", E);
    }
    if (c.layer_routes[static_cast<size_t>(l)]) {
      const std::string b = p + c.moe_block + ".";
      const int64_t Ie = c.expert_intermediate;
      layer.router = take.Matrix(b + "gate.weight", c.experts, D);
      for (int64_t e = 0; e < c.experts; ++e) {
        const std::string x = absl::StrCat(b, "experts.", e, ".");
        layer.experts.push_back({take.Matrix(x + c.expert_gate + ".weight", Ie, D),
                                 take.Matrix(x + c.expert_up + ".weight", Ie, D),
                                 take.Matrix(x + c.expert_down + ".weight", D, Ie)});
      }
      if (const int64_t Is = c.shared_intermediate; Is > 0) {
        layer.shared = {take.Matrix(b + "shared_expert.gate_proj.weight", Is, D),
                        take.Matrix(b + "shared_expert.up_proj.weight", Is, D),
                        take.Matrix(b + "shared_expert.down_proj.weight", D, Is)};
        layer.shared_gate = take.Matrix(b + "shared_expert_gate.weight", 1, D);
      }
    } else {
      layer.gate = take.Matrix(p + "mlp.gate_proj.weight", I, D);
      layer.up = take.Matrix(p + "mlp.up_proj.weight", I, D);
      layer.down = take.Matrix(p + "mlp.down_proj.weight", D, I);
    }
    m.layers.push_back(std::move(layer));
  }
  m.final_norm_D = take.Vector("model.norm.weight", D);
  if (!c.tie_word_embeddings) m.lm_head_VD = take.Matrix("lm_head.weight", V, D);
  if (!take.status().ok()) return take.status();
  if (!ck.tensors.empty()) {
    return absl::DataLossError(
        absl::StrCat("reference: checkpoint has unused tensor ", ck.tensors.begin()->first));
  }
  return m;
}

// ============================================================================ reference forward

// Deliberate mistakes, for the controls that show the comparison is sensitive.
struct Variant {
  bool drop_rope_scaling = false;  // plain RoPE whatever rope_scaling says
  bool wrong_gqa_mapping = false;  // query head h reads kv head h mod G instead of h / (H/G)
  bool ignore_sliding_window = false;
  bool window_every_layer = false;    // Qwen's max_window_layers / layer_types ignored
  bool skip_renormalization = false;  // the picked probabilities used as they are
  bool first_choice_only = false;     // one expert per token, whatever num_experts_per_tok says
  bool skip_shared_expert = false;    // Qwen2-MoE's shared expert left out
  // Dynamic NTK measured against original_max_position_embeddings, as tinkerd did until
  // 2026-12-02 (transformers reads max_position_embeddings alone for this type).
  bool dynamic_from_original = false;
};

struct Rotary {
  Vec inv_freq_F;
  double attention_factor = 1.0;  // multiplies both cos and sin (yarn)
};

// The inverse frequencies of one sequence, as Hugging Face's rope init functions define them.
// seq_len matters only for dynamic NTK, which the runner evaluates per sequence, as if each
// packed sequence ran alone.
Rotary RotaryForSequence(const RefConfig& c, int64_t seq_len, const Variant& variant) {
  const int64_t E = c.head_dim, F = E / 2;
  const double theta = c.rope_theta;
  auto plain = [&](double base) {
    Vec inv_freq_F(F);
    for (int64_t j = 0; j < F; ++j) inv_freq_F[j] = 1.0 / std::pow(base, (2.0 * j) / E);
    return inv_freq_F;
  };
  Rotary r;
  r.inv_freq_F = plain(theta);
  const RefRope& s = c.rope;
  const double orig = static_cast<double>(s.original_max_position_embeddings);
  if (variant.drop_rope_scaling || s.type == "default") return r;

  if (s.type == "linear") {
    // Dividing positions by the factor is the same as dividing every frequency by it.
    for (double& f : r.inv_freq_F) f /= s.factor;
  } else if (s.type == "dynamic") {
    // NTK-aware: stretch the base, and only once the sequence outgrows max_position_embeddings
    // (transformers ignores original_max_position_embeddings for this type).
    const int64_t limit = variant.dynamic_from_original ? s.original_max_position_embeddings
                                                        : c.max_position_embeddings;
    const double context = static_cast<double>(limit);
    if (seq_len > limit) {
      const double base = theta * std::pow(s.factor * seq_len / context - (s.factor - 1.0),
                                           static_cast<double>(E) / (E - 2.0));
      r.inv_freq_F = plain(base);
    }
  } else if (s.type == "llama3") {
    // Short wavelengths untouched, long ones divided by the factor, a linear blend in between.
    const double low_freq_wavelen = orig / s.low_freq_factor;
    const double high_freq_wavelen = orig / s.high_freq_factor;
    for (double& f : r.inv_freq_F) {
      const double wavelen = 2.0 * kPi / f;
      if (wavelen < high_freq_wavelen) continue;
      if (wavelen > low_freq_wavelen) {
        f /= s.factor;
      } else {
        const double smooth =
            (orig / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        f = (1.0 - smooth) * f / s.factor + smooth * f;
      }
    }
  } else if (s.type == "yarn") {
    // Dimensions that rotate more than beta_fast times over the original context extrapolate,
    // fewer than beta_slow times interpolate, with a linear ramp over the dimension index between.
    auto correction_dim = [&](double rotations) {
      return E * std::log(orig / (rotations * 2.0 * kPi)) / (2.0 * std::log(theta));
    };
    const double low = std::max(std::floor(correction_dim(s.beta_fast)), 0.0);
    double high = std::min(std::ceil(correction_dim(s.beta_slow)), static_cast<double>(E - 1));
    if (low == high) high += 0.001;  // as HF: avoids a zero-width ramp
    for (int64_t j = 0; j < F; ++j) {
      const double ramp = std::clamp((j - low) / (high - low), 0.0, 1.0);
      const double extrapolation_weight = 1.0 - ramp;
      const double pos_freq = std::pow(theta, (2.0 * j) / E);
      const double extrapolated = 1.0 / pos_freq;
      const double interpolated = 1.0 / (s.factor * pos_freq);
      r.inv_freq_F[j] =
          interpolated * (1.0 - extrapolation_weight) + extrapolated * extrapolation_weight;
    }
    r.attention_factor = s.attention_factor ? *s.attention_factor : 0.1 * std::log(s.factor) + 1.0;
  }
  return r;
}

// HF's "rotate_half" convention: dimension e is paired with e ± E/2 (not with its neighbour) and
// turns at frequency inv_freq[e mod E/2].
Vec ApplyRotary(const Vec& x_E, int64_t position, const Rotary& rot) {
  const size_t E = x_E.size(), F = E / 2;
  Vec out_E(E);
  for (size_t e = 0; e < E; ++e) {
    const double angle = static_cast<double>(position) * rot.inv_freq_F[e % F];
    const double cos = std::cos(angle) * rot.attention_factor;
    const double sin = std::sin(angle) * rot.attention_factor;
    const double rotated = e < F ? -x_E[e + F] : x_E[e - F];
    out_E[e] = x_E[e] * cos + rotated * sin;
  }
  return out_E;
}

Vec RmsNorm(const Vec& x, const Vec& weight, double eps) {
  double sum_sq = 0;
  for (double v : x) sum_sq += v * v;
  const double inv_rms = 1.0 / std::sqrt(sum_sq / static_cast<double>(x.size()) + eps);
  Vec out(x.size());
  for (size_t i = 0; i < x.size(); ++i) out[i] = x[i] * inv_rms * weight[i];
  return out;
}

Vec Linear(const RefMatrix& W, const Vec& x, const Vec& bias = {}) {
  Vec y(W.rows);
  for (int64_t o = 0; o < W.rows; ++o) {
    double acc = 0;
    for (int64_t i = 0; i < W.cols; ++i) acc += W.w[o * W.cols + i] * x[i];
    y[o] = acc + (bias.empty() ? 0.0 : bias[o]);
  }
  return y;
}

Vec Slice(const Vec& v, int64_t begin, int64_t n) {
  return Vec(v.begin() + begin, v.begin() + begin + n);
}

double Silu(double x) {
  return x / (1.0 + std::exp(-x));
}

// What a sequence's routers did, summed over its routed layers: per expert, how many (token,
// choice) slots picked it, and the sum of its router probability over the tokens.
struct RouterTally {
  Vec picked_X, prob_X;  // X: experts
  int64_t routed_layers = 0;
};

// log p(targets[t] | tokens[0..t]) for one sequence, alone, starting at position 0; `tally`
// (optional) receives its routers' picks and probabilities.
Vec ReferenceLogprobs(const RefModel& m, const std::vector<int64_t>& tokens,
                      const std::vector<int64_t>& targets, const Variant& variant = {},
                      RouterTally* tally = nullptr) {
  const RefConfig& c = m.c;
  const int64_t T = static_cast<int64_t>(tokens.size());
  const int64_t D = c.hidden, H = c.heads, G = c.kv_heads, E = c.head_dim;
  const Rotary rot = RotaryForSequence(c, T, variant);

  std::vector<Vec> h_TD(T);
  for (int64_t t = 0; t < T; ++t) h_TD[t] = Slice(m.embed_VD.w, tokens[t] * D, D);

  if (tally != nullptr) *tally = {Vec(c.experts, 0.0), Vec(c.experts, 0.0), 0};
  for (size_t l = 0; l < m.layers.size(); ++l) {
    const RefLayer& layer = m.layers[l];
    if (tally != nullptr && !layer.experts.empty()) ++tally->routed_layers;
    const bool slides = variant.window_every_layer || c.layer_slides[l];
    const int64_t window = variant.ignore_sliding_window || !slides ? 0 : c.sliding_window;
    std::vector<std::vector<Vec>> q_THE(T, std::vector<Vec>(H));
    std::vector<std::vector<Vec>> k_TGE(T, std::vector<Vec>(G));
    std::vector<std::vector<Vec>> v_TGE(T, std::vector<Vec>(G));
    for (int64_t t = 0; t < T; ++t) {
      const Vec x_D = RmsNorm(h_TD[t], layer.input_norm_D, c.rms_norm_eps);
      const Vec q_flat = Linear(layer.q, x_D, layer.q_bias);
      const Vec k_flat = Linear(layer.k, x_D, layer.k_bias);
      const Vec v_flat = Linear(layer.v, x_D, layer.v_bias);
      for (int64_t h = 0; h < H; ++h) {
        Vec q_E = Slice(q_flat, h * E, E);
        if (c.qk_norm) q_E = RmsNorm(q_E, layer.q_norm_E, c.rms_norm_eps);  // before RoPE
        q_THE[t][h] = ApplyRotary(q_E, t, rot);
      }
      for (int64_t g = 0; g < G; ++g) {
        Vec k_E = Slice(k_flat, g * E, E);
        if (c.qk_norm) k_E = RmsNorm(k_E, layer.k_norm_E, c.rms_norm_eps);
        k_TGE[t][g] = ApplyRotary(k_E, t, rot);
        v_TGE[t][g] = Slice(v_flat, g * E, E);
      }
    }

    // Every q/k/v of this layer exists already, so the residual can be updated position by
    // position inside the attention loop.
    const double scale = 1.0 / std::sqrt(static_cast<double>(E));
    for (int64_t t = 0; t < T; ++t) {
      // Causal, and with a window only keys with t - j < window.
      const int64_t first = window > 0 ? std::max<int64_t>(0, t - window + 1) : 0;
      Vec attn_flat(H * E, 0.0);
      for (int64_t h = 0; h < H; ++h) {
        const int64_t g = variant.wrong_gqa_mapping ? h % G : h / (H / G);
        Vec score(t - first + 1);
        double max_score = -INFINITY;
        for (int64_t j = first; j <= t; ++j) {
          double dot = 0;
          for (int64_t e = 0; e < E; ++e) dot += q_THE[t][h][e] * k_TGE[j][g][e];
          score[j - first] = dot * scale;
          max_score = std::max(max_score, score[j - first]);
        }
        double z = 0;
        for (double& s : score) z += (s = std::exp(s - max_score));
        for (int64_t j = first; j <= t; ++j) {
          const double p = score[j - first] / z;
          for (int64_t e = 0; e < E; ++e) attn_flat[h * E + e] += p * v_TGE[j][g][e];
        }
      }
      const Vec o_D = Linear(layer.o, attn_flat);
      for (int64_t d = 0; d < D; ++d) h_TD[t][d] += o_D[d];
    }

    auto swiglu = [](const RefMatrix& gate, const RefMatrix& up, const RefMatrix& down,
                     const Vec& x_D) {
      const Vec gate_I = Linear(gate, x_D);
      const Vec up_I = Linear(up, x_D);
      Vec act_I(gate_I.size());
      for (size_t i = 0; i < act_I.size(); ++i) act_I[i] = Silu(gate_I[i]) * up_I[i];
      return Linear(down, act_I);
    };
    for (int64_t t = 0; t < T; ++t) {
      const Vec x_D = RmsNorm(h_TD[t], layer.post_norm_D, c.rms_norm_eps);
      if (layer.experts.empty()) {
        const Vec down_D = swiglu(layer.gate, layer.up, layer.down, x_D);
        for (int64_t d = 0; d < D; ++d) h_TD[t][d] += down_D[d];
        continue;
      }
      // The router's softmax, then the top_k experts by probability (the first index on a tie),
      // each one's output weighted by its probability (divided by the picked ones' sum).
      Vec p_X = Linear(layer.router, x_D);
      const double top = *std::max_element(p_X.begin(), p_X.end());
      double z = 0;
      for (double& v : p_X) z += (v = std::exp(v - top));
      for (double& v : p_X) v /= z;
      std::vector<int64_t> picked;
      const int64_t k = variant.first_choice_only ? 1 : c.top_k;
      while (static_cast<int64_t>(picked.size()) < k) {
        int64_t best = -1;
        for (int64_t e = 0; e < c.experts; ++e) {
          if (std::find(picked.begin(), picked.end(), e) != picked.end()) continue;
          if (best < 0 || p_X[e] > p_X[best]) best = e;
        }
        picked.push_back(best);
      }
      if (tally != nullptr) {
        for (int64_t e : picked) tally->picked_X[e] += 1;
        for (int64_t e = 0; e < c.experts; ++e) tally->prob_X[e] += p_X[e];
      }
      double kept = 0;
      for (int64_t e : picked) kept += p_X[e];
      for (int64_t e : picked) {
        const auto& [gate, up, down] = layer.experts[static_cast<size_t>(e)];
        const double weight =
            c.renormalize && !variant.skip_renormalization ? p_X[e] / kept : p_X[e];
        const Vec out_D = swiglu(gate, up, down, x_D);
        for (int64_t d = 0; d < D; ++d) h_TD[t][d] += weight * out_D[d];
      }
      // Qwen2-MoE: every token also through the shared expert, scaled by its sigmoid gate.
      if (!layer.shared_gate.w.empty() && !variant.skip_shared_expert) {
        const double logit = Linear(layer.shared_gate, x_D)[0];
        const double scale = 1.0 / (1.0 + std::exp(-logit));
        const Vec out_D = swiglu(layer.shared[0], layer.shared[1], layer.shared[2], x_D);
        for (int64_t d = 0; d < D; ++d) h_TD[t][d] += scale * out_D[d];
      }
    }
  }

  const RefMatrix& unembed_VD = c.tie_word_embeddings ? m.embed_VD : m.lm_head_VD;
  Vec logprob_T(T);
  for (int64_t t = 0; t < T; ++t) {
    const Vec logits_V = Linear(unembed_VD, RmsNorm(h_TD[t], m.final_norm_D, c.rms_norm_eps));
    const double max_logit = *std::max_element(logits_V.begin(), logits_V.end());
    double sum_exp = 0;
    for (double l : logits_V) sum_exp += std::exp(l - max_logit);
    logprob_T[t] = logits_V[targets[t]] - (max_logit + std::log(sum_exp));
  }
  return logprob_T;
}

// ============================================================================ tolerance

// The runner computes in float64 but returns float32 logprobs. Rounding a double x to the nearest
// float32 moves it by at most half an ulp, 2^-24·|x| relative. What remains is the difference
// between two float64 evaluations of this tiny network (other summation orders, ATen's
// vectorized exp/log/cos): a few ulp of quantities of order 10, i.e. about 1e-14..1e-12, far
// below 2^-24 ≈ 6e-8. So tol = 4·2^-24·max(1, |ref|): a 4x margin over the rounding bound, and the
// max(1, ·) keeps logprobs near 0 from demanding a relative precision that float64 noise alone
// could not guarantee. A real modelling error (a wrong frequency, a missing bias) moves some
// logprob by far more (see the ModelReferenceControl tests).
double LogprobTolerance(double ref) {
  return 4.0 * std::ldexp(1.0, -24) * std::max(1.0, std::abs(ref));
}

// ============================================================================ runner side

struct Case {
  std::string name;
  std::string family;  // TinyConfig family
  std::function<void(ModelConfig&)> tweak;
  std::string stored_dtype = "float32";
  int num_shards = 1;
  uint64_t seed = 1;
  // What the written checkpoint must show, so a writer that silently drops a feature cannot turn
  // the case into a plain-Llama comparison that passes for the wrong reason.
  std::string want_rope_type = "default";
  bool want_tied = false;
  bool want_qkv_bias = false;
  bool want_qk_norm = false;
  int64_t want_sliding_window = 0;
  int64_t want_sliding_layers = -1;  // -1: every layer when want_sliding_window > 0, else none
  int64_t want_routed_layers = 0;
  std::string want_safetensors_dtype = "F32";
  // How config.json is laid out: as tinkerd writes it (transformers 4's keys, with layer_types
  // for partly sliding models), as transformers 5 writes it, or as transformers < 4.53 wrote a
  // Qwen config (max_window_layers alone).
  enum class Layout { kAsWritten, kTransformers5, kNoLayerTypes };
  Layout layout = Layout::kAsWritten;
  std::function<void(json&)> edit_config = nullptr;  // applied last, for the controls
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.name;
}

// config.json as transformers 5 (5.24) writes the same model: rope_theta and the scaling move
// into `rope_parameters` (yarn keeps `type` beside `rope_type`), `torch_dtype` becomes `dtype`,
// and Qwen configs list `layer_types`. Checked against `save_pretrained` of transformers 5.24
// for every family and rope type the cases use.
void ToTransformers5(json& j) {
  json rope = j.contains("rope_scaling") && !j["rope_scaling"].is_null()
                  ? j["rope_scaling"]
                  : json{{"rope_type", "default"}};
  if (!rope.contains("rope_type")) rope["rope_type"] = rope["type"];
  if (rope["rope_type"] == "yarn") rope["type"] = "yarn";
  rope["rope_theta"] = j["rope_theta"];
  j.erase("rope_scaling");
  j.erase("rope_theta");
  j["rope_parameters"] = rope;
  j["dtype"] = j["torch_dtype"];
  j.erase("torch_dtype");
  const std::string type = j["model_type"].get<std::string>();
  if ((type == "qwen2" || type == "qwen3" || type == "qwen2_moe") && !j.contains("layer_types")) {
    const bool sliding = j.value("use_sliding_window", false);
    const int64_t first = j.value("max_window_layers", int64_t{28});
    json types = json::array();
    for (int64_t l = 0; l < j["num_hidden_layers"].get<int64_t>(); ++l) {
      types.push_back(sliding && l >= first ? "sliding_attention" : "full_attention");
    }
    j["layer_types"] = types;
  }
  j["transformers_version"] = "5.24.0";
}

void RewriteConfig(const fs::path& dir, const Case& c) {
  if (c.layout == Case::Layout::kAsWritten && !c.edit_config) return;
  const fs::path path = dir / "config.json";
  std::ifstream in(path);
  json j = json::parse(in);
  in.close();
  if (c.layout == Case::Layout::kTransformers5) ToTransformers5(j);
  if (c.layout == Case::Layout::kNoLayerTypes) j.erase("layer_types");
  if (c.edit_config) c.edit_config(j);
  std::ofstream(path) << j.dump(2);
}

// Strongly unequal lengths, out of order, so that the runner packs several sequences per
// micro-batch (16 tokens), runs the 20-token one alone, and so that some sequences exceed the
// sliding window (4), the dynamic-NTK case's original_max_position_embeddings (8) and the
// llama3/yarn original length (16) while others do not.
const std::vector<int64_t> kSequenceLengths = {12, 1, 20, 3, 9, 7};
constexpr int64_t kMicroBatchTokens = 16;

// Larger than TinyModelSpec's default 0.02, whose attention scores are ~0.01 and whose softmax is
// therefore nearly uniform: positions would hardly matter, and a RoPE or masking bug would move
// logprobs by only a few hundred tolerances. At this scale scores are O(1).
constexpr double kInitStd = 0.2;

void Llama3Theta500k(ModelConfig& m) {
  m.rope_theta = 500000.0;
  m.tie_word_embeddings = false;
  m.rope_scaling = RopeScaling{};
  m.rope_scaling.type = RopeScaling::Type::kLlama3;
  m.rope_scaling.factor = 8;
  m.rope_scaling.low_freq_factor = 1;
  m.rope_scaling.high_freq_factor = 4;
  m.rope_scaling.original_max_position_embeddings = 16;
}

void Qwen2SlidingFromLayer1(ModelConfig& m) {
  m.rope_scaling = RopeScaling{};
  m.tie_word_embeddings = false;
  m.sliding_window = 4;
  m.layer_slides = {false, true};
}

constexpr const char* kTransformers5Twins[] = {"LlamaTheta500kLlama3Rope",
                                               "Qwen2BiasYarnRope",
                                               "Qwen3QkNormTied",
                                               "MistralSlidingWindow4",
                                               "LlamaBf16TwoShards",
                                               "Qwen2SlidingFromLayer1",
                                               "Qwen2MoeSharedExpertSlidingFromLayer1"};

const Case& FindCaseIn(const std::vector<Case>& cases, const std::string& name) {
  for (const Case& c : cases) {
    if (c.name == name) return c;
  }
  std::abort();  // a typo in the case table
}

Case V5(const Case& c) {
  Case v = c;
  v.name += "V5";
  v.layout = Case::Layout::kTransformers5;
  return v;
}

std::vector<Case> AllCases() {
  RopeScaling none;
  std::vector<Case> cases = {
      Case{.name = "LlamaGqaUntied",
           .family = "llama",
           .tweak =
               [none](ModelConfig& m) {
                 m.num_attention_heads = 4;
                 m.num_key_value_heads = 2;
                 m.tie_word_embeddings = false;
                 m.rope_scaling = none;
               },
           .seed = 11},
      Case{.name = "LlamaTiedLlama3Rope",
           .family = "llama",
           .tweak =
               [](ModelConfig& m) {
                 m.tie_word_embeddings = true;
                 m.rope_scaling.type = RopeScaling::Type::kLlama3;
                 m.rope_scaling.factor = 8;
                 m.rope_scaling.low_freq_factor = 1;
                 m.rope_scaling.high_freq_factor = 4;
                 // Small enough that head_dim 8 has frequencies in all three llama3 bands.
                 m.rope_scaling.original_max_position_embeddings = 16;
               },
           .seed = 12,
           .want_rope_type = "llama3",
           .want_tied = true},
      Case{.name = "Qwen2BiasYarnRope",
           .family = "qwen2",
           .tweak =
               [](ModelConfig& m) {
                 m.attention_bias = true;
                 m.tie_word_embeddings = false;  // untied Qwen2 (tied is covered elsewhere)
                 m.rope_scaling.type = RopeScaling::Type::kYarn;
                 m.rope_scaling.factor = 4;
                 m.rope_scaling.original_max_position_embeddings = 16;
                 m.rope_scaling.beta_fast = 32;
                 m.rope_scaling.beta_slow = 1;
                 m.rope_scaling.attention_factor = 0;  // unset: 0.1·ln(4) + 1
                 // = factor · original, so that HF versions that derive the yarn factor as
                 // max_position_embeddings / original_max_position_embeddings agree with `factor`.
                 m.max_position_embeddings = 64;
               },
           .seed = 13,
           .want_rope_type = "yarn",
           .want_qkv_bias = true},
      Case{.name = "Qwen3QkNormTied",
           .family = "qwen3",
           .tweak =
               [none](ModelConfig& m) {
                 m.qk_norm = true;
                 m.tie_word_embeddings = true;
                 m.rope_scaling = none;
               },
           .seed = 14,
           .want_tied = true,
           .want_qk_norm = true},
      Case{.name = "MistralSlidingWindow4",
           .family = "mistral",
           .tweak =
               [none](ModelConfig& m) {
                 m.sliding_window = 4;
                 m.rope_scaling = none;
               },
           .seed = 15,
           .want_sliding_window = 4},
      Case{.name = "LlamaLinearRope",
           .family = "llama",
           .tweak =
               [](ModelConfig& m) {
                 m.rope_scaling = RopeScaling{};
                 m.rope_scaling.type = RopeScaling::Type::kLinear;
                 m.rope_scaling.factor = 2;
               },
           .seed = 16,
           .want_rope_type = "linear"},
      Case{.name = "LlamaDynamicRope",
           .family = "llama",
           .tweak =
               [](ModelConfig& m) {
                 m.rope_scaling = RopeScaling{};
                 m.rope_scaling.type = RopeScaling::Type::kDynamic;
                 m.rope_scaling.factor = 2;
                 // The context is the longest sequence (20): no sequence is scaled, while a
                 // reader that measured them against original_max_position_embeddings (8)
                 // would scale three of them (transformers ignores it for this type).
                 m.max_position_embeddings = 20;
                 m.rope_scaling.original_max_position_embeddings = 8;
               },
           .seed = 17,
           .want_rope_type = "dynamic"},
      Case{.name = "LlamaBf16TwoShards",
           .family = "llama",
           .tweak = [none](ModelConfig& m) { m.rope_scaling = none; },
           .stored_dtype = "bfloat16",
           .num_shards = 2,
           .seed = 18,
           .want_safetensors_dtype = "BF16"},
      Case{.name = "Qwen2Fp16ThreeShards",
           .family = "qwen2",
           .tweak =
               [none](ModelConfig& m) {
                 m.rope_scaling = none;
                 m.tie_word_embeddings = false;
               },
           .stored_dtype = "float16",
           .num_shards = 3,
           .seed = 19,
           .want_qkv_bias = true,
           .want_safetensors_dtype = "F16"},
      // Llama 3's own theta, where a silently dropped rope_theta (10000) moves logprobs by ~10%.
      Case{.name = "LlamaTheta500kLlama3Rope",
           .family = "llama",
           .tweak = Llama3Theta500k,
           .seed = 20,
           .want_rope_type = "llama3"},
      // Qwen2 sliding from layer 1 on (max_window_layers 1): layer 0 attends to everything.
      Case{.name = "Qwen2SlidingFromLayer1",
           .family = "qwen2",
           .tweak = Qwen2SlidingFromLayer1,
           .seed = 21,
           .want_qkv_bias = true,
           .want_sliding_window = 4,
           .want_sliding_layers = 1,
           .layout = Case::Layout::kNoLayerTypes},
      // Eight experts, two per token, renormalized; layer 1 is in mlp_only_layers.
      Case{.name = "Qwen3MoeDenseLayer1",
           .family = "qwen3_moe",
           .tweak = [none](ModelConfig& m) { m.rope_scaling = none; },
           .seed = 22,
           .want_qk_norm = true,
           .want_routed_layers = 1},
      Case{.name = "Qwen3MoeUnnormalizedTied",
           .family = "qwen3_moe",
           .tweak =
               [none](ModelConfig& m) {
                 m.rope_scaling = none;
                 m.moe.norm_topk_prob = false;
                 m.moe.top_k = 3;
                 m.moe.layer_routes = {true, true};
                 m.tie_word_embeddings = true;
               },
           .seed = 23,
           .want_tied = true,
           .want_qk_norm = true,
           .want_routed_layers = 2},
      // Four experts, two per token, not renormalized, a shared expert beside them (its output
      // scaled by a sigmoid gate); layer 0 is dense; sliding from layer 1 on.
      Case{.name = "Qwen2MoeSharedExpertSlidingFromLayer1",
           .family = "qwen2_moe",
           .tweak =
               [none](ModelConfig& m) {
                 m.rope_scaling = none;
                 m.sliding_window = 4;
                 m.layer_slides = {false, true};
               },
           .seed = 25,
           .want_qkv_bias = true,
           .want_sliding_window = 4,
           .want_sliding_layers = 1,
           .want_routed_layers = 1},
      Case{.name = "MixtralSlidingWindow4Bf16TwoShards",
           .family = "mixtral",
           .tweak =
               [none](ModelConfig& m) {
                 m.sliding_window = 4;
                 m.rope_scaling = none;
               },
           .stored_dtype = "bfloat16",
           .num_shards = 2,
           .seed = 24,
           .want_sliding_window = 4,
           .want_routed_layers = 2,
           .want_safetensors_dtype = "BF16"},
  };
  // transformers 5's layout of some of the cases above: their logprobs must be the same bits
  // (Transformers5Layout) and match the reference, which reads that layout itself.
  for (const char* name : kTransformers5Twins) cases.push_back(V5(FindCaseIn(cases, name)));
  return cases;
}

Case FindCase(const std::string& name) {
  for (const Case& c : AllCases()) {
    if (c.name == name) return c;
  }
  ADD_FAILURE() << "no case named " << name;
  return {};
}

class TempDir {
 public:
  explicit TempDir(const std::string& tag) {
    static int counter = 0;
    path_ = fs::temp_directory_path() /
            absl::StrCat("tinkerd_model_reference_", tag, "_", getpid(), "_", counter++);
    std::error_code ec;
    fs::remove_all(path_, ec);
    fs::create_directories(path_, ec);
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

struct Scenario {
  std::unique_ptr<TempDir> dir;
  RefModel model;
  std::vector<Datum> data;
  std::vector<std::vector<float>> runner_logprobs;  // [datum][T]
  std::map<std::string, double> metrics;
};

// Writes the case's checkpoint, loads it into the reference, and runs the runner's Forward on it
// (with the router's auxiliary loss at `router_aux_loss_coef`, for a model of `reduction`).
void RunScenario(const Case& c, Scenario* s, double router_aux_loss_coef = 0,
                 LossReduction reduction = LossReduction::kTokenMean) {
  ModelConfig config = TinyConfig(c.family);
  c.tweak(config);
  s->dir = std::make_unique<TempDir>(c.name);
  const absl::Status written =
      WriteTinyModel(s->dir->path().string(),
                     TinyModelSpec{config, c.seed, c.stored_dtype, c.num_shards, kInitStd});
  ASSERT_TRUE(written.ok()) << written.message();
  RewriteConfig(s->dir->path(), c);

  absl::StatusOr<Checkpoint> ck = LoadCheckpoint(s->dir->path());
  ASSERT_TRUE(ck.ok()) << ck.status().message();
  std::set<std::string> dtypes, files;
  for (const auto& [name, t] : ck->tensors) {
    dtypes.insert(t.dtype);
    files.insert(t.file);
  }
  EXPECT_EQ(dtypes, std::set<std::string>{c.want_safetensors_dtype});
  EXPECT_EQ(ck->sharded, c.num_shards > 1);
  if (c.num_shards > 1) {
    EXPECT_GE(files.size(), 2u) << "a sharded case must span several files";
  }

  absl::StatusOr<RefModel> model = BuildModel(*std::move(ck));
  ASSERT_TRUE(model.ok()) << model.status().message();
  s->model = *std::move(model);
  const RefConfig& rc = s->model.c;
  EXPECT_EQ(rc.rope.type, c.want_rope_type);
  EXPECT_EQ(rc.tie_word_embeddings, c.want_tied);
  EXPECT_EQ(rc.qkv_bias, c.want_qkv_bias);
  EXPECT_EQ(rc.qk_norm, c.want_qk_norm);
  EXPECT_EQ(rc.sliding_window, c.want_sliding_window);
  const int64_t sliding_layers = std::count(rc.layer_slides.begin(), rc.layer_slides.end(), true);
  EXPECT_EQ(sliding_layers, c.want_sliding_layers >= 0  ? c.want_sliding_layers
                            : c.want_sliding_window > 0 ? rc.layers
                                                        : 0);
  EXPECT_LT(rc.kv_heads, rc.heads) << "every case should exercise grouped-query attention";
  EXPECT_EQ(std::count(rc.layer_routes.begin(), rc.layer_routes.end(), true), c.want_routed_layers);

  std::mt19937_64 rng(c.seed * 7919 + 1);  // the raw engine: identical on every platform
  for (int64_t len : kSequenceLengths) {
    Datum d;
    std::vector<int64_t> targets;
    for (int64_t t = 0; t < len; ++t) {
      d.tokens.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(rc.vocab)));
      targets.push_back(static_cast<int64_t>(rng() % static_cast<uint64_t>(rc.vocab)));
    }
    d.loss_fn_inputs["target_tokens"] = TensorData::Int64(std::move(targets));
    d.loss_fn_inputs["weights"] = TensorData::Float32(std::vector<float>(len, 1.0f));
    s->data.push_back(std::move(d));
  }

  RunnerConfig runner_config;
  runner_config.base_model_path = s->dir->path().string();
  runner_config.compute_dtype = ComputeDType::kFloat64;
  runner_config.micro_batch_tokens = kMicroBatchTokens;
  absl::StatusOr<std::unique_ptr<ModelRunner>> runner = ModelRunner::Create(runner_config);
  ASSERT_TRUE(runner.ok()) << runner.status().message();
  // A LoRA adapter starts with B = 0, so the adapted model is exactly the base model.
  CreateModelOptions options;
  options.loss_reduction = reduction;
  absl::StatusOr<std::string> model_id = (*runner)->CreateModel(options);
  ASSERT_TRUE(model_id.ok()) << model_id.status().message();
  absl::StatusOr<ForwardBackwardResult> result = (*runner)->Forward(
      *model_id, s->data, "cross_entropy",
      router_aux_loss_coef > 0
          ? std::map<std::string, double>{{"router_aux_loss_coef", router_aux_loss_coef}}
          : std::map<std::string, double>{});
  ASSERT_TRUE(result.ok()) << result.status().message();
  ASSERT_EQ(result->outputs.size(), s->data.size());
  for (size_t i = 0; i < s->data.size(); ++i) {
    ASSERT_EQ(result->outputs[i].logprobs.size(), s->data[i].tokens.size()) << "datum " << i;
    s->runner_logprobs.push_back(result->outputs[i].logprobs);
  }
  s->metrics = result->metrics;
}

std::vector<int64_t> Targets(const Datum& d) {
  return d.loss_fn_inputs.at("target_tokens").int64_data;
}

// max over every token of |runner - reference| / tolerance.
double WorstDeviationInTolerances(const Scenario& s, const Variant& variant) {
  double worst = 0;
  for (size_t i = 0; i < s.data.size(); ++i) {
    const Vec ref = ReferenceLogprobs(s.model, s.data[i].tokens, Targets(s.data[i]), variant);
    for (size_t t = 0; t < ref.size(); ++t) {
      worst =
          std::max(worst, std::abs(s.runner_logprobs[i][t] - ref[t]) / LogprobTolerance(ref[t]));
    }
  }
  return worst;
}

// ============================================================================ tests

class ModelReferenceTest : public ::testing::TestWithParam<Case> {};

TEST_P(ModelReferenceTest, LogprobsMatchFloat64Reference) {
  Scenario s;
  ASSERT_NO_FATAL_FAILURE(RunScenario(GetParam(), &s));

  int mismatches = 0;
  std::string report;
  double ref_loss_sum = 0, loss_tolerance = 0;
  for (size_t i = 0; i < s.data.size(); ++i) {
    const Vec ref = ReferenceLogprobs(s.model, s.data[i].tokens, Targets(s.data[i]));
    for (size_t t = 0; t < ref.size(); ++t) {
      const double got = s.runner_logprobs[i][t];
      ref_loss_sum -= ref[t];  // weights are all 1
      loss_tolerance += LogprobTolerance(ref[t]);
      if (!(std::abs(got - ref[t]) <= LogprobTolerance(ref[t]))) {  // NaN counts as a mismatch
        if (++mismatches <= 8) {
          absl::StrAppend(&report, "\n  datum ", i, " (length ", ref.size(), ") position ", t,
                          ": runner ", got, " reference ", ref[t], " diff ", got - ref[t], " tol ",
                          LogprobTolerance(ref[t]));
        }
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << "logprobs outside tolerance (first 8):" << report;

  // Cross-entropy's summed loss is -Σ w·logprob; the same per-token bound summed covers it.
  auto loss = s.metrics.find("loss:sum");
  ASSERT_NE(loss, s.metrics.end()) << "Forward should report the metric \"loss:sum\"";
  EXPECT_NEAR(loss->second, ref_loss_sum, loss_tolerance);
}

INSTANTIATE_TEST_SUITE_P(Families, ModelReferenceTest, ::testing::ValuesIn(AllCases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

// The router's auxiliary loss (runner/loss/router_aux.h) is Hugging Face's load_balancing_loss_func
// on each datum alone, E·Σ_e (c_e / (L·T))·(P_e / (L·T)) with c_e the picks and P_e the summed
// probabilities over the datum's T tokens and L routed layers, weighted by the datum's valid
// tokens (all T here: every weight is 1) under token_mean, and by 1 under seq_mean_token_mean.
// Both sides are float64 sums of a few hundred terms of order 1: 1e-12 relative. Control: the same
// formula over the whole batch at once (Hugging Face's batched form), which a split cannot
// reproduce.
TEST(RouterAuxLoss, TheRunnersValueIsTheReferencesPerDatumFormula) {
  for (const auto& [name, reduction] :
       {std::pair{"Qwen3MoeUnnormalizedTied", LossReduction::kTokenMean},
        std::pair{"MixtralSlidingWindow4Bf16TwoShards", LossReduction::kTokenMean},
        std::pair{"Qwen3MoeDenseLayer1", LossReduction::kSeqMeanTokenMean}}) {
    const double alpha = 0.25;
    const bool per_sequence = reduction == LossReduction::kSeqMeanTokenMean;
    Scenario s;
    ASSERT_NO_FATAL_FAILURE(RunScenario(FindCase(name), &s, alpha, reduction));
    const int64_t E = s.model.c.experts;
    double per_datum = 0;
    RouterTally batch{Vec(E, 0.0), Vec(E, 0.0), 0};
    double batch_rows = 0, batch_tokens = 0;
    for (const Datum& d : s.data) {
      RouterTally t;
      ReferenceLogprobs(s.model, d.tokens, Targets(d), {}, &t);
      ASSERT_GT(t.routed_layers, 0) << name;
      const double T = static_cast<double>(d.tokens.size());
      const double rows = static_cast<double>(t.routed_layers) * T;
      double aux = 0;
      for (int64_t e = 0; e < E; ++e) {
        aux += (t.picked_X[e] / rows) * (t.prob_X[e] / rows);
        batch.picked_X[e] += t.picked_X[e];
        batch.prob_X[e] += t.prob_X[e];
      }
      per_datum += alpha * (per_sequence ? 1.0 : T) * static_cast<double>(E) * aux;
      batch_rows += rows;
      batch_tokens += per_sequence ? 1.0 : T;
    }
    double batch_aux = 0;
    for (int64_t e = 0; e < E; ++e) {
      batch_aux += (batch.picked_X[e] / batch_rows) * (batch.prob_X[e] / batch_rows);
    }
    const double batchwide = alpha * batch_tokens * static_cast<double>(E) * batch_aux;
    const auto got = s.metrics.find("router_aux_loss:sum");
    ASSERT_NE(got, s.metrics.end()) << name;
    EXPECT_NEAR(got->second, per_datum, 1e-12 * per_datum) << name;
    EXPECT_GT(std::abs(batchwide - per_datum), 1e-4 * per_datum) << name << ": the control";
  }
}

// Sensitivity controls: a reference with one deliberate mistake must miss the runner by far more
// than the tolerance, or the agreement above would prove little. 1000 tolerances is ~2e-3 in
// logprob here. With kInitStd = 0.2, a batched LibTorch stand-in for the runner put every one of
// these mistakes at 3e5 tolerances or more; with init_std 0.02 (near-uniform attention) the RoPE
// mistakes were only ~100-400, which is why kInitStd is raised.
constexpr double kBrokenMinToleranceMultiple = 1000;

void ExpectMistakeDetected(const std::string& case_name, const Variant& mistake) {
  Scenario s;
  ASSERT_NO_FATAL_FAILURE(RunScenario(FindCase(case_name), &s));
  EXPECT_LE(WorstDeviationInTolerances(s, Variant{}), 1.0) << "the correct reference must agree";
  EXPECT_GE(WorstDeviationInTolerances(s, mistake), kBrokenMinToleranceMultiple);
}

TEST(ModelReferenceControl, DroppingLlama3ScalingIsDetected) {
  ExpectMistakeDetected("LlamaTiedLlama3Rope", Variant{.drop_rope_scaling = true});
}

TEST(ModelReferenceControl, DroppingYarnScalingIsDetected) {
  ExpectMistakeDetected("Qwen2BiasYarnRope", Variant{.drop_rope_scaling = true});
}

// Within the served context (at most max_position_embeddings tokens) dynamic scaling changes
// nothing, so dropping it cannot be detected; reading its threshold from the wrong key can.
TEST(ModelReferenceControl, DynamicScalingFromTheOriginalLengthIsDetected) {
  ExpectMistakeDetected("LlamaDynamicRope", Variant{.dynamic_from_original = true});
}

TEST(ModelReferenceControl, WrongGqaHeadMappingIsDetected) {
  ExpectMistakeDetected("LlamaGqaUntied", Variant{.wrong_gqa_mapping = true});
}

TEST(ModelReferenceControl, IgnoringSlidingWindowIsDetected) {
  ExpectMistakeDetected("MistralSlidingWindow4", Variant{.ignore_sliding_window = true});
}

// tinkerd before 2026-11-26 windowed every layer of a Qwen model with use_sliding_window.
TEST(ModelReferenceControl, WindowingEveryQwenLayerIsDetected) {
  ExpectMistakeDetected("Qwen2SlidingFromLayer1", Variant{.window_every_layer = true});
  ExpectMistakeDetected("Qwen2SlidingFromLayer1V5", Variant{.window_every_layer = true});
}

TEST(ModelReferenceControl, IgnoringTopKRenormalizationIsDetected) {
  ExpectMistakeDetected("Qwen3MoeDenseLayer1", Variant{.skip_renormalization = true});
}

TEST(ModelReferenceControl, LeavingOutTheSharedExpertIsDetected) {
  ExpectMistakeDetected("Qwen2MoeSharedExpertSlidingFromLayer1",
                        Variant{.skip_shared_expert = true});
}

TEST(ModelReferenceControl, RoutingToOneExpertIsDetected) {
  ExpectMistakeDetected("MixtralSlidingWindow4Bf16TwoShards", Variant{.first_choice_only = true});
}

// The same weights under a transformers-5 config compute the same logprobs, bit for bit, as
// under their transformers-4 twin: the loader resolves both layouts to one ModelConfig.
TEST(Transformers5Layout, LogprobsEqualTheTransformers4TwinBitwise) {
  for (const char* name : kTransformers5Twins) {
    SCOPED_TRACE(name);
    Scenario v4, v5;
    ASSERT_NO_FATAL_FAILURE(RunScenario(FindCase(name), &v4));
    ASSERT_NO_FATAL_FAILURE(RunScenario(FindCase(absl::StrCat(name, "V5")), &v5));
    EXPECT_EQ(v5.runner_logprobs, v4.runner_logprobs);
  }
}

// Control: a loader that did not read `rope_parameters` (tinkerd before 2026-11-26) computed
// with rope_theta 10000 and no llama3 scaling: far outside the tolerance of the reference.
TEST(Transformers5Layout, IgnoringRopeParametersIsDetected) {
  Scenario right, blind;
  ASSERT_NO_FATAL_FAILURE(RunScenario(FindCase("LlamaTheta500kLlama3RopeV5"), &right));
  Case c = FindCase("LlamaTheta500kLlama3RopeV5");
  c.edit_config = [](json& j) { j.erase("rope_parameters"); };
  c.want_rope_type = "default";
  ASSERT_NO_FATAL_FAILURE(RunScenario(c, &blind));
  blind.model = right.model;  // judge the blind load against the file's true meaning
  EXPECT_LE(WorstDeviationInTolerances(right, Variant{}), 1.0);
  EXPECT_GE(WorstDeviationInTolerances(blind, Variant{}), kBrokenMinToleranceMultiple);
}

}  // namespace
}  // namespace tinkerd
