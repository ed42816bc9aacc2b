// Writes the fuzzers' seed corpus: valid inputs of every shape each parser accepts, plus a few
// near-misses, so that fuzzing starts from deep inside the accepted language instead of from
// random bytes. Usage: make_fuzz_seeds OUT_DIR (writes OUT_DIR/<fuzzer>/<seed>).
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "runner/checkpoint/manifest.h"
#include "runner/model/config.h"
#include "runner/model/safetensors.h"
#include "server/core/convert.h"

namespace {

namespace fs = std::filesystem;
using namespace tinkerd;

fs::path g_out;
int g_wrong = 0;

// A seed meant to be accepted (or refused) that is not is a bug in this file or in a parser.
void Expect(bool accepted, bool want, const std::string& seed, const absl::Status& s) {
  if (accepted == want) return;
  std::fprintf(stderr, "seed %s: expected %s, got: %s\n", seed.c_str(),
               want ? "accepted" : "refused", s.ToString().c_str());
  ++g_wrong;
}

void Write(const std::string& fuzzer, const std::string& name, const std::string& bytes) {
  fs::create_directories(g_out / fuzzer);
  std::ofstream(g_out / fuzzer / name, std::ios::binary) << bytes;
}

template <typename T>
std::string Bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

v1::Tensor Int64s(const std::vector<int64_t>& v) {
  v1::Tensor t;
  t.set_dtype(v1::INT64);
  t.add_shape(static_cast<int64_t>(v.size()));
  t.set_data(Bytes(v));
  return t;
}

v1::Tensor Floats(const std::vector<float>& v) {
  v1::Tensor t;
  t.set_dtype(v1::FLOAT32);
  t.set_data(Bytes(v));  // no shape: 1-D of the data's length
  return t;
}

// One datum of `n` tokens for `loss`, its tokens split over `chunks` chunks.
v1::Datum MakeDatum(const std::string& loss, int n, int chunks, bool mask) {
  v1::Datum d;
  std::vector<int64_t> tokens, targets;
  std::vector<float> weights, logprobs, advantages, m;
  for (int i = 0; i < n; ++i) {
    tokens.push_back((i * 37 + 5) % 128);
    targets.push_back((i * 53 + 11) % 128);
    weights.push_back(i < n / 3 ? 0.0f : 1.0f);
    logprobs.push_back(-0.5f - 0.01f * i);
    advantages.push_back(i % 2 ? 0.75f : -0.25f);
    m.push_back(i % 4 == 0 ? 0.0f : 1.0f);
  }
  const int per = (n + chunks - 1) / chunks;
  for (int c = 0; c < chunks; ++c) {
    auto* chunk = d.mutable_model_input()->add_chunks()->mutable_encoded_text();
    for (int i = c * per; i < std::min(n, (c + 1) * per); ++i) chunk->add_tokens(tokens[i]);
  }
  auto& in = *d.mutable_loss_fn_inputs();
  in["target_tokens"] = Int64s(targets);
  if (loss == "cross_entropy") {
    in["weights"] = Floats(weights);
  } else {
    in["logprobs"] = Floats(logprobs);
    in["advantages"] = Floats(advantages);
  }
  if (mask) in["mask"] = Floats(m);
  return d;
}

void WriteRefused(const std::string& name, const v1::ForwardBackwardRequest& r) {
  const absl::Status s = BatchFromProto(r.data(), r.loss_fn(), {128, 256}).status();
  Expect(s.ok(), false, name, s);
  Write("fuzz_request", name, r.SerializeAsString());
}

void RequestSeeds() {
  struct Case {
    std::string loss;
    std::vector<std::pair<std::string, double>> config;
  };
  const std::vector<Case> cases = {
      {"cross_entropy", {}},
      {"importance_sampling", {}},
      {"ppo", {{"clip_low_threshold", 0.8}, {"clip_high_threshold", 1.2}}},
      {"cispo", {}},
      {"dro", {{"beta", 0.1}}}};
  for (const Case& c : cases) {
    v1::ForwardBackwardRequest r;
    r.set_model_id("model-0");
    r.set_seq_id(7);
    r.mutable_loss_fn()->set_name(c.loss);
    for (const auto& [k, v] : c.config) (*r.mutable_loss_fn()->mutable_config())[k] = v;
    *r.add_data() = MakeDatum(c.loss, 9, 1, false);
    *r.add_data() = MakeDatum(c.loss, 17, 3, true);
    const absl::Status s = BatchFromProto(r.data(), r.loss_fn(), {128, 256}).status();
    Expect(s.ok(), true, c.loss, s);
    Write("fuzz_request", c.loss, r.SerializeAsString());
  }
  // Near-misses: each refused for one reason.
  v1::ForwardBackwardRequest base;
  base.mutable_loss_fn()->set_name("cross_entropy");
  *base.add_data() = MakeDatum("cross_entropy", 6, 2, false);
  auto bad = base;
  (*bad.mutable_data(0)->mutable_loss_fn_inputs())["weights"] = Floats({1, 1, NAN, 1, 1, 1});
  WriteRefused("nan_weight", bad);
  bad = base;
  bad.mutable_data(0)->mutable_model_input()->mutable_chunks(0)->mutable_encoded_text()->set_tokens(
      0, 128);
  WriteRefused("token_out_of_vocab", bad);
  bad = base;
  (*bad.mutable_data(0)->mutable_loss_fn_inputs())["target_tokens"] = Int64s({1, 2, 3});
  WriteRefused("short_targets", bad);
  bad = base;
  (*bad.mutable_data(0)->mutable_loss_fn_inputs())["weights"].add_shape(2);
  WriteRefused("bad_shape", bad);
}

void SafetensorsSeeds() {
  const std::vector<float> f32 = {1.5f, -2.0f, 0.0f, 3.25f, 1e-3f, -7.0f};
  const std::vector<double> f64 = {0.5, -1.25};
  const std::vector<int64_t> i64 = {1, -2, 3};
  const std::vector<uint16_t> half = {0x3c00, 0xc000, 0x0000, 0x7bff};  // f16 / bf16 bit patterns
  // SafetensorsOutput holds views: every byte string it points at must outlive the calls.
  const std::string a = Bytes(f32), b = Bytes(f64), c = Bytes(i64), h = Bytes(half);
  const std::string b8 = b.substr(0, 8), a12 = a.substr(0, 12);
  const std::vector<std::pair<std::string, std::vector<SafetensorsOutput>>> files = {
      {"one_f32", {{"w", "F32", {2, 3}, a}}},
      {"mixed",
       {{"a.weight", "F32", {6}, a},
        {"b", "F64", {2}, b},
        {"c", "I64", {3}, c},
        {"d", "F16", {2, 2}, h},
        {"e", "BF16", {4}, h}}},
      {"scalar_and_empty", {{"s", "F64", {}, b8}, {"z", "F32", {0, 4}, ""}}},
  };
  for (const auto& [name, tensors] : files) {
    const std::string bytes = *SerializeSafetensors(tensors, {{"format", "pt"}});
    Expect(ParseSafetensors(bytes).ok(), true, name, ParseSafetensors(bytes).status());
    Write("fuzz_safetensors", name, bytes);
  }
  Write("fuzz_safetensors", "no_metadata", *SerializeSafetensors({{"w", "F32", {3}, a12}}, {}));
  std::string truncated = *SerializeSafetensors(files[1].second, {});
  Write("fuzz_safetensors", "truncated", truncated.substr(0, truncated.size() - 5));
}

void WriteManifest(const std::string& name, const std::string& text, bool valid) {
  auto m = ParseTrainingManifest(text);
  Expect(m.ok(), valid, name, m.status());
  Write("fuzz_manifest", name, text);
}

void ManifestSeeds() {
  TrainingManifest m;
  m.model_id = "model-3";
  m.step = 12;
  m.skipped_steps = 1;
  m.last_seq_id = 40;
  m.training_dtype = "float32";
  m.base_model = "embedded:default";
  m.base_fingerprint = 0xfedcba9876543210ull;
  m.options.seed = 18446744073709551615ull;
  m.files = {{"params.safetensors", {7340032, 123456789}},
             {"optimizer.safetensors", {14680064, 42}}};
  WriteManifest("lora", TrainingManifestToJson(m), true);
  m.options.lora.reset();
  m.options.loss_reduction = LossReduction::kSeqMeanTokenSum;
  m.training_dtype = "float64";
  WriteManifest("full", TrainingManifestToJson(m), true);
  m.accumulated = Accumulated{1234, 8};
  m.files["accumulators.safetensors"] = {99, 1};
  WriteManifest("accumulated", TrainingManifestToJson(m), true);
  WriteManifest(
      "sampler",
      R"({"format": "tinkerd-checkpoint", "format_version": 1, "kind": "sampler", "step": 3, "layout": "peft"})",
      false);
  WriteManifest("future_version",
                R"({"format": "tinkerd-checkpoint", "format_version": 2, "kind": "training"})",
                false);
}

void ModelConfigSeeds() {
  const std::string common =
      R"("vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
      "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "bfloat16")";
  auto cfg = [&](const std::string& arch, const std::string& extra) {
    return "{\"architectures\": [\"" + arch + "\"], " + common + extra + "}";
  };
  auto write = [](const std::string& name, const std::string& text) {
    auto c = ParseModelConfig(text);
    Expect(c.ok(), true, name, c.status());
    Write("fuzz_model_config", name, text);
  };
  write("llama", cfg("LlamaForCausalLM", R"(, "tie_word_embeddings": true)"));
  write("llama3_rope",
        cfg("LlamaForCausalLM",
            R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 128})"));
  write("yarn", cfg("Qwen2ForCausalLM", R"(, "rope_scaling": {"type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 128, "beta_fast": 32, "beta_slow": 1})"));
  write("dynamic",
        cfg("LlamaForCausalLM", R"(, "rope_scaling": {"type": "dynamic", "factor": 2.0})"));
  write("linear",
        cfg("LlamaForCausalLM", R"(, "rope_scaling": {"type": "linear", "factor": 2.0})"));
  write("mistral", cfg("MistralForCausalLM", R"(, "sliding_window": 64, "head_dim": 16)"));
  write("qwen3",
        cfg("Qwen3ForCausalLM", R"(, "use_sliding_window": false, "attention_bias": false)"));
  // transformers 5's layout: rope_theta and scaling in rope_parameters, layer_types.
  write("transformers5",
        cfg("Qwen2ForCausalLM",
            R"(, "dtype": "bfloat16", "use_sliding_window": true, "sliding_window": 64,
            "max_window_layers": 1, "layer_types": ["full_attention", "sliding_attention"],
            "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128})"));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_fuzz_seeds OUT_DIR\n");
    return 2;
  }
  g_out = argv[1];
  RequestSeeds();
  SafetensorsSeeds();
  ManifestSeeds();
  ModelConfigSeeds();
  return g_wrong == 0 ? 0 : 1;
}
