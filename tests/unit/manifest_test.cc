// The checkpoint manifest parser: round trip, and each kind of malformed manifest refused with its
// code (the fuzzer, tests/fuzz/fuzz_manifest.cc, covers the space in between).
#include <gtest/gtest.h>

#include "absl/strings/str_replace.h"
#include "runner/checkpoint/manifest.h"

namespace tinkerd {
namespace {

TrainingManifest Sample() {
  TrainingManifest m;
  m.model_id = "model-7";
  m.options.lora = LoraConfig{8, 16.5, true, false, true};
  m.options.loss_reduction = LossReduction::kSeqMeanTokenMean;
  m.options.seed = 18446744073709551615ull;  // needs all 64 bits: must not pass through a double
  m.step = 3;
  m.skipped_steps = 1;
  m.last_seq_id = 41;
  m.training_dtype = "float64";
  m.base_model = "embedded:default";
  m.base_fingerprint = 0x8000000000000001ull;
  m.accumulated = Accumulated{120, 4};
  m.shards = 3;
  m.files = {{"params.safetensors", {1000, 0xffffffffffffffffull}}};
  return m;
}

TEST(Manifest, RoundTripsEveryField) {
  const TrainingManifest m = Sample();
  auto back = ParseTrainingManifest(TrainingManifestToJson(m));
  ASSERT_TRUE(back.ok()) << back.status().message();
  EXPECT_EQ(back->model_id, m.model_id);
  ASSERT_TRUE(back->options.lora.has_value());
  EXPECT_EQ(back->options.lora->rank, 8);
  EXPECT_EQ(back->options.lora->alpha, 16.5);
  EXPECT_FALSE(back->options.lora->train_mlp);
  EXPECT_EQ(back->options.loss_reduction, LossReduction::kSeqMeanTokenMean);
  EXPECT_EQ(back->options.seed, m.options.seed);
  EXPECT_EQ(back->step, 3);
  EXPECT_EQ(back->skipped_steps, 1);
  EXPECT_EQ(back->last_seq_id, 41);
  EXPECT_EQ(back->training_dtype, "float64");
  EXPECT_EQ(back->base_fingerprint, m.base_fingerprint);
  EXPECT_EQ(back->accumulated, m.accumulated);
  EXPECT_EQ(back->shards, 3);
  EXPECT_EQ(back->files, m.files);

  TrainingManifest full = Sample();
  full.options.lora.reset();
  full.accumulated.reset();
  full.shards = 0;
  auto f = ParseTrainingManifest(TrainingManifestToJson(full));
  ASSERT_TRUE(f.ok()) << f.status().message();
  EXPECT_FALSE(f->options.lora.has_value());
  EXPECT_FALSE(f->accumulated.has_value());
  EXPECT_EQ(f->shards, 0);  // whole files: the field is left out
  EXPECT_EQ(TrainingManifestToJson(full).find("shards"), std::string::npos);
}

// Replaces one fragment of a valid manifest and returns the parser's code.
absl::StatusCode CodeWith(const std::string& from, const std::string& to) {
  const std::string text = TrainingManifestToJson(Sample());
  EXPECT_NE(text.find(from), std::string::npos) << from;
  return ParseTrainingManifest(absl::StrReplaceAll(text, {{from, to}})).status().code();
}

TEST(Manifest, MalformedFieldsAreDataLoss) {
  using C = absl::StatusCode;
  EXPECT_EQ(CodeWith("\"step\": 3", "\"step\": -3"), C::kDataLoss);
  EXPECT_EQ(CodeWith("\"step\": 3", "\"step\": 3.5"), C::kDataLoss);
  EXPECT_EQ(CodeWith("\"step\": 3", "\"step\": \"3\""), C::kDataLoss);
  EXPECT_EQ(CodeWith("\"step\": 3,", ""), C::kDataLoss);  // missing
  EXPECT_EQ(CodeWith("\"seed\": \"18446744073709551615\"", "\"seed\": \"18446744073709551616\""),
            C::kDataLoss);  // overflows u64
  EXPECT_EQ(CodeWith("\"seed\": \"18446744073709551615\"", "\"seed\": \"-1\""), C::kDataLoss);
  EXPECT_EQ(CodeWith("\"rank\": 8", "\"rank\": 0"), C::kDataLoss);
  EXPECT_EQ(CodeWith("\"alpha\": 16.5", "\"alpha\": -1"), C::kDataLoss);
  EXPECT_EQ(CodeWith("\"float64\"", "\"int8\""), C::kDataLoss);
  EXPECT_EQ(CodeWith("\"shards\": 3", "\"shards\": 0"), C::kDataLoss);
  EXPECT_EQ(CodeWith("\"shards\": 3", "\"shards\": 65537"), C::kDataLoss);  // one file each
  EXPECT_EQ(CodeWith("\"shards\": 3", "\"shards\": \"3\""), C::kDataLoss);
  EXPECT_EQ(CodeWith("\"seq_mean_token_mean\"", "\"mean\""), C::kDataLoss);
  EXPECT_EQ(CodeWith("\"params.safetensors\"", "\"../params.safetensors\""), C::kDataLoss);
  EXPECT_EQ(CodeWith("\"tinkerd-checkpoint\"", "\"something-else\""), C::kDataLoss);
  EXPECT_EQ(ParseTrainingManifest("{\"format\": ").status().code(), C::kDataLoss);
  EXPECT_EQ(ParseTrainingManifest("[]").status().code(), C::kDataLoss);
}

TEST(Manifest, OtherKindsAndVersionsHaveTheirOwnCodes) {
  EXPECT_EQ(CodeWith("\"kind\": \"training\"", "\"kind\": \"sampler\""),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CodeWith("\"format_version\": 1", "\"format_version\": 2"),
            absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace tinkerd
