#include "runner/validate.h"

#include <gtest/gtest.h>

#include <functional>

namespace tinkerd {
namespace {

Datum Good(int n) {
  Datum d;
  std::vector<int64_t> t;
  for (int i = 0; i < n; ++i) {
    d.tokens.push_back(i);
    t.push_back(i + 1);
  }
  d.loss_fn_inputs["target_tokens"] = TensorData::Int64(t);
  d.loss_fn_inputs["advantages"] = TensorData::Float32(std::vector<float>(n, 1.0f));
  d.loss_fn_inputs["logprobs"] = TensorData::Float32(std::vector<float>(n, -2.0f));
  return d;
}

TEST(ValidateData, AcceptsGoodBatch) {
  EXPECT_TRUE(ValidateData({Good(3), Good(7)}, *FindLossSpec("ppo"), {16, 8}).ok());
}

TEST(ValidateData, EachBadInputNamesDatumFieldAndReason) {
  struct Case {
    const char* expect;
    std::function<void(std::vector<Datum>&)> mutate;
  };
  const Case cases[] = {
      {"no datums", [](auto& b) { b.clear(); }},
      {"data[1].model_input: empty", [](auto& b) { b[1].tokens.clear(); }},
      {"exceeds the model's context length 8", [](auto& b) { b[1] = Good(9); }},
      {"data[1].model_input: token 16 at position 2", [](auto& b) { b[1].tokens[2] = 16; }},
      {"token -1", [](auto& b) { b[0].tokens[0] = -1; }},
      {"[\"target_tokens\"]: token 99",
       [](auto& b) { b[1].loss_fn_inputs["target_tokens"].int64_data[1] = 99; }},
      {"[\"target_tokens\"]: missing", [](auto& b) { b[0].loss_fn_inputs.erase("target_tokens"); }},
      {"[\"logprobs\"]: missing", [](auto& b) { b[1].loss_fn_inputs.erase("logprobs"); }},
      {"[\"weights\"]: not an input of ppo",
       [](auto& b) {
         b[0].loss_fn_inputs["weights"] = TensorData::Float32({1, 1, 1});
       }},
      {"[\"advantages\"]: shape [2] does not match model_input: want [3]",
       [](auto& b) {
         b[0].loss_fn_inputs["advantages"] = TensorData::Float32({1, 1});
       }},
      {"[\"advantages\"]: value at position 1 is not finite",
       [](auto& b) { b[0].loss_fn_inputs["advantages"].float32_data[1] = INFINITY; }},
      {"[\"logprobs\"]: must be float32",
       [](auto& b) {
         b[0].loss_fn_inputs["logprobs"] = TensorData::Int64({1, 1, 1});
       }},
      {"[\"target_tokens\"]: must be int64",
       [](auto& b) {
         b[0].loss_fn_inputs["target_tokens"] = TensorData::Float32({1, 1, 1});
       }},
      {"[\"advantages\"]: shape [3, 1] does not match model_input: want [3]",
       [](auto& b) {
         b[0].loss_fn_inputs["advantages"].shape = {3, 1};
       }},
      {"[\"target_tokens\"]: shape [3, 1] is top-K; ppo takes [T] targets (only cross_entropy "
       "takes [T, K])",
       [](auto& b) {
         b[0].loss_fn_inputs["target_tokens"].shape = {3, 1};
       }},
      {"shape [4] does not match", [](auto& b) { b[0].loss_fn_inputs["advantages"].shape = {4}; }},
      {"[\"mask\"]: value at position 0 is 0.5",
       [](auto& b) {
         b[0].loss_fn_inputs["mask"] = TensorData::Float32({0.5f, 1, 1});
       }},
  };
  for (const Case& c : cases) {
    std::vector<Datum> batch{Good(3), Good(5)};
    c.mutate(batch);
    absl::Status st = ValidateData(batch, *FindLossSpec("ppo"), {16, 8});
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.expect;
    EXPECT_NE(st.message().find(c.expect), absl::string_view::npos)
        << "want '" << c.expect << "', got '" << st.message() << "'";
  }
}

// cross_entropy's top-K form: [T, K] targets and weights, one K for the whole batch.
Datum TopK(int n, int k) {
  Datum d;
  std::vector<int64_t> t;
  for (int i = 0; i < n; ++i) {
    d.tokens.push_back(i);
    for (int j = 0; j < k; ++j) t.push_back((i + j) % 16);
  }
  d.loss_fn_inputs["target_tokens"] = TensorData::Int64(t);
  d.loss_fn_inputs["target_tokens"].shape = {n, k};
  d.loss_fn_inputs["weights"] = TensorData::Float32(std::vector<float>(n * k, 0.5f));
  d.loss_fn_inputs["weights"].shape = {n, k};
  return d;
}

TEST(ValidateData, TopKTargetsForCrossEntropy) {
  const LossSpec& ce = *FindLossSpec("cross_entropy");
  EXPECT_TRUE(ValidateData({TopK(3, 4), TopK(5, 4)}, ce, {16, 8}).ok());
  EXPECT_EQ(TargetWidth(TopK(3, 4)), 4);
  struct Case {
    const char* expect;
    std::function<void(std::vector<Datum>&)> mutate;
  };
  const Case cases[] = {
      {"data[1].loss_fn_inputs[\"target_tokens\"]: K = 2 targets per position, where data[0] "
       "has K = 4",
       [](auto& b) { b[1] = TopK(5, 2); }},
      {"data[1].loss_fn_inputs[\"target_tokens\"]: [T] targets per position, where data[0] has "
       "K = 4",
       [](auto& b) {
         b[1].loss_fn_inputs["target_tokens"] = TensorData::Int64({1, 2, 3, 4, 5});
         b[1].loss_fn_inputs["weights"] = TensorData::Float32({1, 1, 1, 1, 1});
       }},
      {"[\"weights\"]: shape [3] does not match model_input: want [3, 4]",
       [](auto& b) {
         b[0].loss_fn_inputs["weights"] = TensorData::Float32({1, 1, 1});
       }},
      {"[\"target_tokens\"]: K = 17 targets per position must be in [1, 16]",
       [](auto& b) { b[0] = TopK(3, 17); }},
      {"[\"target_tokens\"]: token 16 at position 2, column 1 is outside [0, 16)",
       [](auto& b) { b[0].loss_fn_inputs["target_tokens"].int64_data[9] = 16; }},
      {"[\"weights\"]: value at position 1, column 3 is not finite",
       [](auto& b) { b[0].loss_fn_inputs["weights"].float32_data[7] = NAN; }},
      {"[\"mask\"]: shape [3, 4] does not match model_input: want [3]",
       [](auto& b) {
         b[0].loss_fn_inputs["mask"] = TensorData::Float32(std::vector<float>(12, 1.0f));
         b[0].loss_fn_inputs["mask"].shape = {3, 4};
       }},
      {"[\"target_tokens\"]: shape [3, 4, 1] must be [T] or [T, K]",
       [](auto& b) {
         b[0].loss_fn_inputs["target_tokens"].shape = {3, 4, 1};
       }},
  };
  for (const Case& c : cases) {
    std::vector<Datum> batch{TopK(3, 4), TopK(5, 4)};
    c.mutate(batch);
    absl::Status st = ValidateData(batch, ce, {16, 8});
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << c.expect;
    EXPECT_NE(st.message().find(c.expect), absl::string_view::npos)
        << "want '" << c.expect << "', got '" << st.message() << "'";
  }
}

}  // namespace
}  // namespace tinkerd
