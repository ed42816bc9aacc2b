#include "runner/model/config.h"

#include <gtest/gtest.h>

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
  };
  for (const Case& c : cases) {
    auto r = ParseModelConfig(c.json);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.json;
    EXPECT_NE(r.status().message().find(c.expect), absl::string_view::npos)
        << c.json << " -> " << r.status().message();
  }
}

}  // namespace
}  // namespace tinkerd
