#include "runner/model/config.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "runner/model/tiny_model.h"

namespace tinkerd {
namespace {

TEST(ModelConfig, EveryFamilyRoundTrips) {
  for (const char* family : {"llama", "mistral", "qwen2", "qwen3"}) {
    ModelConfig c = TinyConfig(family);
    auto parsed = ParseModelConfig(ModelConfigToJson(c));
    ASSERT_TRUE(parsed.ok()) << family << ": " << parsed.status().message();
    EXPECT_EQ(parsed->architecture, c.architecture);
    EXPECT_EQ(parsed->num_key_value_heads, 2);
    EXPECT_EQ(parsed->head_dim, 8);
    EXPECT_EQ(parsed->attention_bias, std::string(family) == "qwen2");
    EXPECT_EQ(parsed->qk_norm, std::string(family) == "qwen3");
  }
}

TEST(ModelConfig, MixturesOfExpertsRoundTrip) {
  for (const char* family : {"qwen2_moe", "qwen3_moe", "mixtral"}) {
    const ModelConfig c = TinyConfig(family);
    auto parsed = ParseModelConfig(ModelConfigToJson(c));
    ASSERT_TRUE(parsed.ok()) << family << ": " << parsed.status().message();
    EXPECT_EQ(parsed->moe.num_experts, c.moe.num_experts);
    EXPECT_EQ(parsed->moe.top_k, 2);
    EXPECT_EQ(parsed->moe.expert_intermediate_size, c.moe.expert_intermediate_size);
    EXPECT_EQ(parsed->moe.shared_expert_intermediate_size,
              std::string(family) == "qwen2_moe" ? 32 : 0);
    EXPECT_EQ(parsed->moe.norm_topk_prob, std::string(family) != "qwen2_moe");
    EXPECT_EQ(parsed->moe.layer_routes, c.moe.layer_routes);
    EXPECT_EQ(parsed->qk_norm, std::string(family) == "qwen3_moe");
    EXPECT_EQ(parsed->attention_bias, std::string(family) == "qwen2_moe");
  }
  EXPECT_EQ(TinyConfig("qwen3_moe").moe.layer_routes, (std::vector<bool>{true, false}));
  EXPECT_EQ(TinyConfig("mixtral").moe.names.Expert(3), "block_sparse_moe.experts.3.");
  EXPECT_EQ(TinyConfig("mixtral").moe.names.gate, "w1");
}

// Qwen3-30B-A3B's config.json as published (the keys that matter), and Mixtral-8x7B's.
TEST(ModelConfig, PublishedMixturesOfExpertsParse) {
  auto qwen = ParseModelConfig(R"({"architectures":["Qwen3MoeForCausalLM"],"model_type":"qwen3_moe",
    "vocab_size":151936,"hidden_size":2048,"intermediate_size":6144,"num_hidden_layers":48,
    "num_attention_heads":32,"num_key_value_heads":4,"head_dim":128,"moe_intermediate_size":768,
    "num_experts":128,"num_experts_per_tok":8,"norm_topk_prob":true,"decoder_sparse_step":1,
    "mlp_only_layers":[],"output_router_logits":false,"router_aux_loss_coef":0.001,
    "rope_theta":1000000.0,"rms_norm_eps":1e-06,"sliding_window":null,"use_sliding_window":false,
    "max_window_layers":48,"tie_word_embeddings":false,"hidden_act":"silu",
    "max_position_embeddings":40960})");
  ASSERT_TRUE(qwen.ok()) << qwen.status().message();
  EXPECT_EQ(qwen->moe.num_experts, 128);
  EXPECT_EQ(qwen->moe.top_k, 8);
  EXPECT_EQ(qwen->moe.expert_intermediate_size, 768);
  EXPECT_EQ(std::count(qwen->moe.layer_routes.begin(), qwen->moe.layer_routes.end(), true), 48);
  EXPECT_EQ(qwen->moe.names.Router(), "mlp.gate");
  auto mixtral = ParseModelConfig(R"({"architectures":["MixtralForCausalLM"],"model_type":"mixtral",
    "vocab_size":32000,"hidden_size":4096,"intermediate_size":14336,"num_hidden_layers":32,
    "num_attention_heads":32,"num_key_value_heads":8,"num_local_experts":8,
    "num_experts_per_tok":2,"router_aux_loss_coef":0.02,"rope_theta":1000000.0,
    "sliding_window":null,"rms_norm_eps":1e-05,"tie_word_embeddings":false,"hidden_act":"silu",
    "max_position_embeddings":32768})");
  ASSERT_TRUE(mixtral.ok()) << mixtral.status().message();
  EXPECT_EQ(mixtral->moe.expert_intermediate_size, 14336);
  EXPECT_TRUE(mixtral->moe.norm_topk_prob);
  EXPECT_EQ(mixtral->head_dim, 128);
  EXPECT_EQ(mixtral->sliding_window, 0);
  // Qwen1.5-MoE-A2.7B's: 60 experts, 4 per token, unnormalized, a shared expert of 5632.
  auto qwen2 =
      ParseModelConfig(R"({"architectures":["Qwen2MoeForCausalLM"],"model_type":"qwen2_moe",
    "vocab_size":151936,"hidden_size":2048,"intermediate_size":5632,"num_hidden_layers":24,
    "num_attention_heads":16,"num_key_value_heads":16,"moe_intermediate_size":1408,
    "shared_expert_intermediate_size":5632,"num_experts":60,"num_experts_per_tok":4,
    "norm_topk_prob":false,"decoder_sparse_step":1,"output_router_logits":false,
    "router_aux_loss_coef":0.001,"rope_theta":1000000.0,"rms_norm_eps":1e-06,
    "sliding_window":32768,"use_sliding_window":false,"max_window_layers":21,
    "tie_word_embeddings":false,"hidden_act":"silu","max_position_embeddings":8192})");
  ASSERT_TRUE(qwen2.ok()) << qwen2.status().message();
  EXPECT_EQ(qwen2->moe.num_experts, 60);
  EXPECT_EQ(qwen2->moe.top_k, 4);
  EXPECT_EQ(qwen2->moe.shared_expert_intermediate_size, 5632);
  EXPECT_FALSE(qwen2->moe.norm_topk_prob);
  EXPECT_TRUE(qwen2->attention_bias);
  EXPECT_EQ(qwen2->sliding_window, 0);
  EXPECT_EQ(qwen2->moe.names.SharedGate(), "mlp.shared_expert_gate");
  EXPECT_EQ(std::count(qwen2->moe.layer_routes.begin(), qwen2->moe.layer_routes.end(), true), 24);
}

TEST(ModelConfig, SparseStepAndDenseLayersChooseTheRoutedLayers) {
  auto c = ParseModelConfig(R"({"architectures":["Qwen3MoeForCausalLM"],"vocab_size":10,
    "hidden_size":16,"intermediate_size":32,"num_hidden_layers":6,"num_attention_heads":2,
    "num_experts":4,"num_experts_per_tok":1,"moe_intermediate_size":8,"decoder_sparse_step":2,
    "mlp_only_layers":[3]})");
  ASSERT_TRUE(c.ok()) << c.status().message();
  // (l + 1) % 2 == 0 routes layers 1, 3, 5; layer 3 is listed dense.
  EXPECT_EQ(c->moe.layer_routes, (std::vector<bool>{false, true, false, false, false, true}));
  EXPECT_EQ(c->head_dim, 8) << "Qwen3-MoE's head_dim defaults to hidden / heads";
}

// transformers 5 writes Qwen3-MoE's expert count as num_local_experts; its sliding window (when
// use_sliding_window) covers every layer, with no max_window_layers.
TEST(ModelConfig, Transformers5Qwen3MoeKeysParse) {
  const std::string base = R"({"architectures":["Qwen3MoeForCausalLM"],"vocab_size":10,
    "hidden_size":16,"intermediate_size":32,"num_hidden_layers":3,"num_attention_heads":2,
    "num_experts_per_tok":2,"moe_intermediate_size":8,)";
  auto alias = ParseModelConfig(base + R"("num_local_experts":6})");
  ASSERT_TRUE(alias.ok()) << alias.status().message();
  EXPECT_EQ(alias->moe.num_experts, 6);
  auto both = ParseModelConfig(base + R"("num_local_experts":6,"num_experts":6})");
  ASSERT_TRUE(both.ok()) << both.status().message();
  auto disagree = ParseModelConfig(base + R"("num_local_experts":6,"num_experts":4})");
  EXPECT_NE(disagree.status().message().find("num_local_experts"), std::string::npos);
  auto sliding = ParseModelConfig(
      base +
      R"("num_experts":4,"use_sliding_window":true,"sliding_window":16,"max_window_layers":2})");
  ASSERT_TRUE(sliding.ok()) << sliding.status().message();
  for (int64_t l = 0; l < 3; ++l) EXPECT_EQ(sliding->WindowOf(l), 16) << l;
  auto again = ParseModelConfig(ModelConfigToJson(*sliding));
  ASSERT_TRUE(again.ok()) << again.status().message();
  for (int64_t l = 0; l < 3; ++l) EXPECT_EQ(again->WindowOf(l), 16) << l;
}

TEST(ModelConfig, BadExpertSettingsAreNamed) {
  const std::string base = R"({"architectures":["Qwen3MoeForCausalLM"],"vocab_size":10,
    "hidden_size":16,"intermediate_size":32,"num_hidden_layers":2,"num_attention_heads":2,)";
  for (const auto& [json, needle] : std::vector<std::pair<std::string, std::string>>{
           {R"("num_experts":4,"num_experts_per_tok":5})", "num_experts_per_tok"},
           {R"("num_experts":4,"num_experts_per_tok":0})", "num_experts_per_tok"},
           {R"("num_experts":100000,"num_experts_per_tok":2})", "experts"},
           {R"("num_experts":4,"num_experts_per_tok":2,"moe_intermediate_size":0})",
            "intermediate"},
           {R"("num_experts":4,"num_experts_per_tok":2,"decoder_sparse_step":0})",
            "decoder_sparse_step"},
           {R"("num_experts":4,"num_experts_per_tok":2,"mlp_only_layers":[2]})", "mlp_only_layers"},
           {R"("num_experts":4,"num_experts_per_tok":2,"mlp_only_layers":"0"})", "mlp_only_layers"},
           {R"("num_experts":4,"num_experts_per_tok":2,"norm_topk_prob":"yes"})",
            "norm_topk_prob"}}) {
    auto c = ParseModelConfig(base + json);
    EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument) << json;
    EXPECT_NE(c.status().message().find(needle), std::string::npos) << c.status().message();
  }
  auto jitter = ParseModelConfig(R"({"architectures":["MixtralForCausalLM"],"vocab_size":10,
    "hidden_size":16,"intermediate_size":32,"num_hidden_layers":2,"num_attention_heads":2,
    "router_jitter_noise":0.1})");
  EXPECT_NE(jitter.status().message().find("router_jitter_noise"), std::string::npos);
}

TEST(ModelConfig, HeadDimDefaultsToHiddenOverHeads) {
  auto c = ParseModelConfig(R"({"architectures":["LlamaForCausalLM"],"vocab_size":10,
    "hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,"num_attention_heads":4})");
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->head_dim, 16);
  EXPECT_EQ(c->num_key_value_heads, 4);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kNone);
}

TEST(ModelConfig, IntegerSizesMustBeExactIntegers) {
  auto with_vocab = [](const std::string& v) {
    return ParseModelConfig(R"({"architectures":["LlamaForCausalLM"],"vocab_size":)" + v +
                            R"(,"hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,
                            "num_attention_heads":4})");
  };
  auto integral_float = with_vocab("4096.0");  // some exporters write sizes as floats
  ASSERT_TRUE(integral_float.ok()) << integral_float.status().message();
  EXPECT_EQ(integral_float->vocab_size, 4096);
  // Out of int64's range (converting would be undefined behaviour), fractional, or too large.
  for (const std::string bad : {"9.2e21", "1.5", "18446744073709551615", "1e308"}) {
    EXPECT_EQ(with_vocab(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(ModelConfig, RopeScalingVariantsParse) {
  const std::string base = R"({"architectures":["LlamaForCausalLM"],"vocab_size":10,
    "hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,"num_attention_heads":4,
    "max_position_embeddings":4096,"rope_scaling":)";
  auto llama3 = ParseModelConfig(base + R"({"rope_type":"llama3","factor":8,"low_freq_factor":1,
    "high_freq_factor":4,"original_max_position_embeddings":8192}})");
  ASSERT_TRUE(llama3.ok()) << llama3.status().message();
  EXPECT_EQ(llama3->rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_EQ(llama3->rope_scaling.original_max_position_embeddings, 8192);
  auto yarn = ParseModelConfig(base + R"({"type":"yarn","factor":4}})");
  ASSERT_TRUE(yarn.ok());
  EXPECT_EQ(yarn->rope_scaling.type, RopeScaling::Type::kYarn);
  EXPECT_EQ(yarn->rope_scaling.original_max_position_embeddings, 4096);  // defaults to ctx
  auto longrope = ParseModelConfig(base + R"({"rope_type":"longrope","factor":4}})");
  EXPECT_EQ(longrope.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(longrope.status().message().find("longrope"), absl::string_view::npos);
  auto no_factor = ParseModelConfig(base + R"({"rope_type":"linear"}})");
  EXPECT_NE(no_factor.status().message().find("factor"), absl::string_view::npos);
}

TEST(ModelConfig, MalformedConfigsAreClearErrors) {
  struct Case {
    const char* json;
    const char* expect;
  };
  const Case cases[] = {
      {"not json", "not valid JSON"},
      {"[1,2]", "top level"},
      {R"({"vocab_size":1})", "architectures"},
      {R"({"architectures":["GPT2LMHeadModel"]})", "GPT2LMHeadModel"},
      {R"({"architectures":["LlamaForCausalLM"],"vocab_size":10})", "hidden_size"},
      {R"({"architectures":["LlamaForCausalLM"],"vocab_size":"10","hidden_size":8,
          "intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":2})",
       "vocab_size"},
      {R"({"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":8,
          "intermediate_size":8,"num_hidden_layers":1,"num_attention_heads":3,
          "num_key_value_heads":2})",
       "multiple"},
      {R"({"architectures":["LlamaForCausalLM"],"vocab_size":10,"hidden_size":8,
          "intermediate_size":8,"num_hidden_layers":0,"num_attention_heads":2})",
       "positive"},
      {R"({"architectures":["Qwen2ForCausalLM"],"vocab_size":10,"hidden_size":8,
          "intermediate_size":8,"num_hidden_layers":1000000000,"num_attention_heads":2,
          "use_sliding_window":true,"sliding_window":4})",
       "at most 4096"},
  };
  for (const Case& c : cases) {
    auto r = ParseModelConfig(c.json);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_NE(r.status().message().find(c.expect), absl::string_view::npos)
        << c.json << " -> " << r.status().message();
  }
}

// The same Llama 3.1-style model as transformers 4 and 5 write it (the v5 text as
// `LlamaConfig.save_pretrained` of transformers 5.24 writes it, abridged to the keys that matter).
constexpr const char* kLlamaV4 = R"({"architectures":["LlamaForCausalLM"],"vocab_size":10,
  "hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,
  "max_position_embeddings":131072,"rope_theta":500000.0,"torch_dtype":"bfloat16",
  "rope_scaling":{"factor":8.0,"high_freq_factor":4.0,"low_freq_factor":1.0,
  "original_max_position_embeddings":8192,"rope_type":"llama3"}})";
constexpr const char* kLlamaV5 = R"({"architectures":["LlamaForCausalLM"],"vocab_size":10,
  "hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,
  "max_position_embeddings":131072,"dtype":"bfloat16","hidden_act":"silu","mlp_bias":false,
  "rope_parameters":{"factor":8.0,"high_freq_factor":4.0,"low_freq_factor":1.0,
  "original_max_position_embeddings":8192,"rope_theta":500000.0,"rope_type":"llama3"}})";

TEST(ModelConfig, Transformers5LayoutReadsAsItsTransformers4Twin) {
  auto v4 = ParseModelConfig(kLlamaV4);
  auto v5 = ParseModelConfig(kLlamaV5);
  ASSERT_TRUE(v4.ok()) << v4.status().message();
  ASSERT_TRUE(v5.ok()) << v5.status().message();
  EXPECT_EQ(v5->rope_theta, 500000.0);
  EXPECT_EQ(v5->rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_EQ(v5->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_EQ(v5->torch_dtype, "bfloat16");
  EXPECT_EQ(v5->DebugString(), v4->DebugString());
  // A v5 file written for a plain model: theta only.
  auto plain = ParseModelConfig(R"({"architectures":["Qwen2ForCausalLM"],"vocab_size":10,
    "hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,"num_attention_heads":4,
    "rope_parameters":{"rope_theta":1000000.0,"rope_type":"default"}})");
  ASSERT_TRUE(plain.ok()) << plain.status().message();
  EXPECT_EQ(plain->rope_theta, 1000000.0);
  EXPECT_EQ(plain->rope_scaling.type, RopeScaling::Type::kNone);
}

TEST(ModelConfig, BothLayoutsInOneFileMustAgree) {
  const std::string head = R"({"architectures":["LlamaForCausalLM"],"vocab_size":10,
    "hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,"num_attention_heads":4,)";
  auto same = ParseModelConfig(head + R"("rope_theta":500000,
    "rope_parameters":{"rope_theta":500000,"rope_type":"default"}})");
  ASSERT_TRUE(same.ok()) << same.status().message();
  EXPECT_EQ(same->rope_theta, 500000.0);
  auto theta = ParseModelConfig(head + R"("rope_theta":10000,
    "rope_parameters":{"rope_theta":500000,"rope_type":"default"}})");
  EXPECT_EQ(theta.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(theta.status().message().find("rope_theta"), absl::string_view::npos);
  auto scaling = ParseModelConfig(head + R"("rope_scaling":{"rope_type":"linear","factor":2},
    "rope_parameters":{"rope_theta":10000,"rope_type":"linear","factor":4}})");
  EXPECT_EQ(scaling.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(scaling.status().message().find("disagree"), absl::string_view::npos);
}

TEST(ModelConfig, MathTinkerdDoesNotImplementFailsNamingTheKey) {
  const std::string head = R"({"architectures":["LlamaForCausalLM"],"vocab_size":10,
    "hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,)";
  struct Case {
    std::string tail;
    const char* expect;
  };
  const Case cases[] = {
      {R"("rope_parameters":{"rope_theta":1e4,"rope_type":"longrope","factor":4}})", "longrope"},
      {R"("rope_parameters":{"rope_theta":1e4,"rope_type":"yarn","factor":4,"mscale":1}})",
       "rope_parameters.mscale"},
      {R"("rope_scaling":{"rope_type":"yarn","factor":4,"mscale_all_dim":1}})",
       "rope_scaling.mscale_all_dim"},
      {R"("rope_parameters":{"full_attention":{"rope_theta":1e4,"rope_type":"default"}}})",
       "rope_parameters.full_attention"},
      {R"("rope_parameters":{"rope_theta":1e4,"rope_type":"default",
          "partial_rotary_factor":0.5}})",
       "partial_rotary_factor"},
      {R"("rope_parameters":{"rope_theta":1e4,"rope_type":"yarn","factor":4,"truncate":false}})",
       "truncate"},
      {R"("hidden_act":"gelu"})", "hidden_act"},
      {R"("mlp_bias":true})", "mlp_bias"},
      {R"("final_logit_softcapping":30.0})", "final_logit_softcapping"},
      {R"("layer_types":["full_attention","chunked_attention"]})", "layer_types[1]"},
      {R"("layer_types":["full_attention"]})", "layer_types"},
  };
  for (const Case& c : cases) {
    auto r = ParseModelConfig(head + c.tail);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.tail;
    EXPECT_NE(r.status().message().find(c.expect), absl::string_view::npos)
        << c.tail << " -> " << r.status().message();
  }
  // Control: the same head with the defaults those keys take is accepted.
  auto fine = ParseModelConfig(head + R"("hidden_act":"silu","mlp_bias":false,
    "layer_types":["full_attention","full_attention"]})");
  EXPECT_TRUE(fine.ok()) << fine.status().message();
}

// Qwen2/3 slide only from layer max_window_layers on (Hugging Face's rule, default 28);
// transformers >= 4.53 and 5 also write the list as layer_types. Mistral slides everywhere.
TEST(ModelConfig, SlidingLayersFollowMaxWindowLayersOrLayerTypes) {
  const std::string qwen2 = R"({"architectures":["Qwen2ForCausalLM"],"vocab_size":10,
    "hidden_size":64,"intermediate_size":128,"num_hidden_layers":3,"num_attention_heads":4,
    "use_sliding_window":true,"sliding_window":4)";
  auto windows = [](const ModelConfig& c) {
    std::vector<int64_t> w;
    for (int64_t i = 0; i < c.num_hidden_layers; ++i) w.push_back(c.WindowOf(i));
    return w;
  };
  auto v4 = ParseModelConfig(qwen2 + R"(,"max_window_layers":1})");
  ASSERT_TRUE(v4.ok()) << v4.status().message();
  EXPECT_EQ(windows(*v4), (std::vector<int64_t>{0, 4, 4}));
  auto v5 = ParseModelConfig(qwen2 + R"(,"max_window_layers":1,
    "layer_types":["full_attention","sliding_attention","sliding_attention"]})");
  ASSERT_TRUE(v5.ok()) << v5.status().message();
  EXPECT_EQ(windows(*v5), (std::vector<int64_t>{0, 4, 4}));
  auto defaulted = ParseModelConfig(qwen2 + "}");  // max_window_layers 28 > 3 layers
  ASSERT_TRUE(defaulted.ok()) << defaulted.status().message();
  EXPECT_EQ(windows(*defaulted), (std::vector<int64_t>{0, 0, 0}));
  auto off = ParseModelConfig(R"({"architectures":["Qwen3ForCausalLM"],"vocab_size":10,
    "hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,
    "head_dim":16,"use_sliding_window":false,"sliding_window":4,"max_window_layers":0})");
  ASSERT_TRUE(off.ok()) << off.status().message();
  EXPECT_EQ(windows(*off), (std::vector<int64_t>{0, 0}));
  auto mistral = ParseModelConfig(R"({"architectures":["MistralForCausalLM"],"vocab_size":10,
    "hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,"num_attention_heads":4,
    "sliding_window":4})");
  ASSERT_TRUE(mistral.ok()) << mistral.status().message();
  EXPECT_EQ(windows(*mistral), (std::vector<int64_t>{4, 4}));
  // What tinkerd writes reads back the same, by Hugging Face's rule too (max_window_layers).
  auto back = ParseModelConfig(ModelConfigToJson(*v4));
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(windows(*back), windows(*v4));
  EXPECT_NE(ModelConfigToJson(*v4).find("\"max_window_layers\": 1"), std::string::npos);
}

TEST(ModelConfig, EndOfSequenceIdsFromConfigOrGenerationConfig) {
  const std::string head = R"({"architectures":["LlamaForCausalLM"],"vocab_size":10,
    "hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,"num_attention_heads":4)";
  auto one = ParseModelConfig(head + R"(,"eos_token_id":2})");
  ASSERT_TRUE(one.ok()) << one.status().message();
  EXPECT_EQ(one->eos_token_ids, (std::vector<int64_t>{2}));
  auto several = ParseModelConfig(head + R"(,"eos_token_id":[2,9]})");
  ASSERT_TRUE(several.ok()) << several.status().message();
  EXPECT_EQ(several->eos_token_ids, (std::vector<int64_t>{2, 9}));
  auto back = ParseModelConfig(ModelConfigToJson(*several));
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->eos_token_ids, (std::vector<int64_t>{2, 9}));
  auto none = ParseModelConfig(head + R"(,"eos_token_id":null})");
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->eos_token_ids.empty());
  for (const char* bad :
       {R"(,"eos_token_id":10})", R"(,"eos_token_id":"2"})", R"(,"eos_token_id":[1,-1]})"}) {
    auto r = ParseModelConfig(head + bad);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("eos_token_id"), absl::string_view::npos) << bad;
  }
  auto gen = ParseGenerationEos(R"({"bos_token_id": 1, "eos_token_id": [7, 8]})", 10);
  ASSERT_TRUE(gen.ok()) << gen.status().message();
  EXPECT_EQ(*gen, (std::vector<int64_t>{7, 8}));
  EXPECT_TRUE(ParseGenerationEos(R"({"do_sample": true})", 10)->empty());
  auto bad_gen = ParseGenerationEos(R"({"eos_token_id": 12})", 10);
  EXPECT_EQ(bad_gen.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad_gen.status().message().find("generation_config.json: eos_token_id"),
            absl::string_view::npos)
      << bad_gen.status().message();
}

TEST(ModelConfig, Qwen3HeadDimDefaultsTo128AsQwen3ConfigDoes) {
  auto c = ParseModelConfig(R"({"architectures":["Qwen3ForCausalLM"],"vocab_size":10,
    "hidden_size":64,"intermediate_size":128,"num_hidden_layers":1,"num_attention_heads":4})");
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(c->head_dim, 128);
}

}  // namespace
}  // namespace tinkerd
