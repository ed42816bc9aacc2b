// Loading Hugging Face model directories, and the runner's model (tenant) management.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include <ATen/Parallel.h>

#include <algorithm>
#include <mutex>

#include "kernels/parallel.h"
#include "runner/model/weights.h"
#include "runner/util/rng.h"
#include "tests/test_util.h"

namespace tinkerd::testing {
namespace {

absl::Status CreateStatus(const std::string& dir) {
  RunnerConfig rc;
  rc.base_model_path = dir;
  return ModelRunner::Create(rc).status();
}

TEST(ModelLoading, ShardedBf16LoadsTheSameWeightsRounded) {
  TempDir dir;
  TinyModelSpec spec{TinyConfig("qwen3")};
  ASSERT_TRUE(WriteTinyModel(dir.Sub("f32"), spec).ok());
  spec.stored_dtype = "bfloat16";
  spec.num_shards = 3;
  ASSERT_TRUE(WriteTinyModel(dir.Sub("bf16"), spec).ok());
  EXPECT_TRUE(std::filesystem::exists(dir.Sub("bf16/model.safetensors.index.json")));
  auto a = LoadSafetensorsDir(dir.Sub("f32"), at::kFloat);
  auto b = LoadSafetensorsDir(dir.Sub("bf16"), at::kFloat);
  ASSERT_TRUE(a.ok() && b.ok()) << a.status().message() << b.status().message();
  ASSERT_EQ(a->size(), b->size());
  for (const auto& [name, t] : *a) {
    // bf16 keeps 8 significant bits: relative rounding error at most 2^-8.
    EXPECT_TRUE(at::allclose(t, b->at(name), /*rtol=*/1.0 / 256, /*atol=*/0)) << name;
  }
  EXPECT_TRUE(CreateStatus(dir.Sub("bf16")).ok());
}

TEST(ModelLoading, WrittenWeightsAreTheGeneratedOnesConverted) {
  // WriteTinyModel stores each weight as soon as it is drawn; the files must hold exactly the
  // float64 weights of GenerateTinyWeights converted to the stored dtype by ATen.
  TempDir dir;
  TinyModelSpec spec{TinyConfig("qwen2")};
  auto want = GenerateTinyWeights(spec);
  ASSERT_TRUE(want.ok()) << want.status().message();
  for (const auto& [stored, dtype] : std::vector<std::pair<std::string, at::ScalarType>>{
           {"float32", at::kFloat}, {"bfloat16", at::kBFloat16}}) {
    spec.stored_dtype = stored;
    ASSERT_TRUE(WriteTinyModel(dir.Sub(stored), spec).ok());
    auto got = LoadSafetensorsDir(dir.Sub(stored), dtype);
    ASSERT_TRUE(got.ok()) << got.status().message();
    ASSERT_EQ(got->size(), want->size());
    for (const auto& [name, t] : *want) {
      EXPECT_TRUE(at::equal(got->at(name), t.to(dtype))) << stored << " " << name;
    }
  }
}

// Bytes this process has read through read(2) and pread(2) so far (/proc/self/io's rchar).
int64_t BytesRead() {
  std::ifstream f("/proc/self/io");
  std::string key;
  int64_t value = -1;
  while (f >> key >> value) {
    if (key == "rchar:") return value;
  }
  return -1;
}

// A sharded base's rank reads its stretch of each tensor alone: the stretches hold exactly the
// whole read's values there (bf16 files over three shards, read as float32), a negative length
// refuses a tensor, a stretch past a tensor's end is an error, and the rest of each file is
// skipped, not read: a stretch of 1/64 of a 4 MiB tensor reads well under a tenth of what the
// whole read reads (the control).
TEST(ModelLoading, StretchesReadTheirValuesAlone) {
  TempDir dir;
  TinyModelSpec spec{TinyConfig("qwen3")};
  spec.stored_dtype = "bfloat16";
  spec.num_shards = 3;
  ASSERT_TRUE(WriteTinyModel(dir.path(), spec).ok());
  auto whole = LoadSafetensorsDir(dir.path(), at::kFloat);
  ASSERT_TRUE(whole.ok()) << whole.status();
  auto middle = [](const std::string&, at::IntArrayRef shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return std::pair<int64_t, int64_t>(n / 3, n / 2 - n / 3);
  };
  auto got = LoadSafetensorsDirStretches(dir.path(), at::kFloat, middle);
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->size(), whole->size());
  for (const auto& [name, t] : *whole) {
    const auto [begin, length] = middle(name, t.sizes());
    EXPECT_TRUE(at::equal(got->at(name), t.reshape({-1}).narrow(0, begin, length))) << name;
  }
  auto refused = LoadSafetensorsDirStretches(
      dir.path(), at::kFloat, [](const std::string& name, at::IntArrayRef) {
        return std::pair<int64_t, int64_t>(0, name == "model.norm.weight" ? -1 : 0);
      });
  ASSERT_TRUE(refused.ok()) << refused.status();
  EXPECT_FALSE(refused->at("model.norm.weight").defined());
  EXPECT_EQ(refused->at("model.embed_tokens.weight").numel(), 0);
  auto past = LoadSafetensorsDirStretches(dir.path(), at::kFloat,
                                          [](const std::string&, at::IntArrayRef shape) {
                                            int64_t n = 1;
                                            for (int64_t d : shape) n *= d;
                                            return std::pair<int64_t, int64_t>(n, 1);
                                          });
  EXPECT_EQ(past.status().code(), absl::StatusCode::kInternal) << past.status();

  TempDir big;
  const at::Tensor large = at::randn({1024, 1024});  // 4 MiB in float32
  ASSERT_TRUE(SaveSafetensorsFile(big.Sub("model.safetensors"), {{"w", large}}, "float32").ok());
  if (BytesRead() < 0) GTEST_SKIP() << "no /proc/self/io here";
  const int64_t before = BytesRead();
  auto all = LoadSafetensorsDir(big.path(), at::kFloat);
  const int64_t read_whole = BytesRead() - before;
  auto part =
      LoadSafetensorsDirStretches(big.path(), at::kFloat, [](const std::string&, at::IntArrayRef) {
        return std::pair<int64_t, int64_t>(500000, 16384);
      });
  const int64_t read_part = BytesRead() - before - read_whole;
  ASSERT_TRUE(all.ok() && part.ok());
  EXPECT_TRUE(at::equal(part->at("w"), large.reshape({-1}).narrow(0, 500000, 16384)));
  EXPECT_GE(read_whole, large.nbytes());
  EXPECT_LT(read_part * 10, read_whole) << read_part << " of " << read_whole;
}

TEST(TinyModel, SkipMovesAStreamOnAsItsDraws) {
  SplitMix64 a(5), b(5), c(5);
  a.Skip(7);
  for (int i = 0; i < 7; ++i) b.Next();
  c.Skip(6);  // control: one draw short
  const uint64_t next = b.Next();
  EXPECT_EQ(a.Next(), next);
  EXPECT_NE(c.Next(), next);
}

TEST(TinyModel, AWeightIsOneStreamWhateverTheThreadsThatDrewIt) {
  // 40,000 × 8 draws: split into chunks on two threads.
  TinyModelSpec spec{TinyConfig("llama")};
  spec.config.vocab_size = 40000;
  spec.config.hidden_size = 8;
  spec.config.intermediate_size = 16;
  spec.config.head_dim = 2;
  spec.seed = 11;
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  auto w = GenerateTinyWeights(spec);
  // Precondition: the draws of this weight are split (the loop the generator uses, at its grain).
  std::vector<int64_t> starts;
  std::mutex mu;
  kernels::ParallelFor(0, 320000, int64_t{1} << 16, [&](int64_t b, int64_t) {
    std::lock_guard<std::mutex> lock(mu);
    starts.push_back(b);
  });
  at::set_num_threads(before);
  ASSERT_GE(starts.size(), 2u) << "the draws ran as one chunk: nothing was split";
  const int64_t split = *std::max_element(starts.begin(), starts.end());
  ASSERT_TRUE(w.ok()) << w.status().message();
  const std::string name = "model.embed_tokens.weight";
  const at::Tensor got = w->at(name).flatten();
  ASSERT_EQ(got.numel(), 320000);
  // The definition: one SplitMix64 stream per name, two draws per normal, in index order.
  SplitMix64 g(MixSeed(spec.seed, name.c_str()));
  at::Tensor want = at::empty({got.numel()}, at::kDouble);
  double* p = want.data_ptr<double>();
  for (int64_t i = 0; i < want.numel(); ++i) p[i] = spec.init_std * g.Normal();
  EXPECT_TRUE(at::equal(got, want));
  // Control: the last chunk drawn from a fresh stream, as a split without the skip would be.
  SplitMix64 fresh(MixSeed(spec.seed, name.c_str()));
  at::Tensor broken = want.clone();
  double* q = broken.data_ptr<double>();
  for (int64_t i = split; i < want.numel(); ++i) q[i] = spec.init_std * fresh.Normal();
  EXPECT_FALSE(at::equal(got, broken));
}

TEST(Device, MalformedNamesAreInvalidAndMissingGpusAFailedPrecondition) {
  for (const std::string bad : {"gpu", "cuda:", "cuda:x", "cuda:-1", "cuda:1024", "CPU", ""}) {
    RunnerConfig rc;
    rc.base_model_path = kEmbeddedDefaultModel;
    rc.device = bad;
    EXPECT_EQ(rc.Validate().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  auto spec = ParseDevice("cuda:3");
  ASSERT_TRUE(spec.ok());
  EXPECT_TRUE(spec->cuda);
  EXPECT_EQ(spec->index, 3);
  EXPECT_FALSE(ParseDevice("cpu")->cuda);
  // Well-formed but absent: on a CPU-only LibTorch no CUDA device exists; on a GPU machine no
  // machine has 1000 GPUs. Either way a clear FAILED_PRECONDITION, not a crash.
  TempDir dir;
  RunnerConfig rc;
  rc.base_model_path = WriteModel(dir, TinyConfig("llama"));
  rc.device = "cuda:1000";
  auto r = ModelRunner::Create(rc);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kFailedPrecondition) << r.status().message();
  EXPECT_NE(r.status().message().find("cuda:1000"), absl::string_view::npos);
}

TEST(ModelLoading, BrokenDirectoriesGiveClearErrors) {
  TempDir dir;
  const std::string good = WriteModel(dir, TinyConfig("llama"));
  EXPECT_EQ(CreateStatus(dir.Sub("absent")).code(), absl::StatusCode::kNotFound);

  auto copy = [&](const std::string& name) {
    std::filesystem::copy(good, dir.Sub(name), std::filesystem::copy_options::recursive);
    return dir.Sub(name);
  };
  // Unknown architecture.
  {
    const std::string d = copy("arch");
    ModelConfig c = TinyConfig("llama");
    c.architecture = "LlamaForCausalLM";
    std::string text = ModelConfigToJson(c);
    text.replace(text.find("LlamaForCausalLM"), 16, "FalconForCausalLM");
    std::ofstream(d + "/config.json") << text;
    absl::Status st = CreateStatus(d);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("FalconForCausalLM"), absl::string_view::npos) << st.message();
  }
  // Truncated weights file.
  {
    const std::string d = copy("trunc");
    std::filesystem::resize_file(d + "/model.safetensors",
                                 std::filesystem::file_size(d + "/model.safetensors") / 2);
    absl::Status st = CreateStatus(d);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("model.safetensors"), absl::string_view::npos) << st.message();
  }
  // Config that disagrees with the weights (another hidden size).
  {
    const std::string d = copy("shape");
    ModelConfig c = TinyConfig("llama");
    c.intermediate_size = 48;
    std::ofstream(d + "/config.json") << ModelConfigToJson(c);
    absl::Status st = CreateStatus(d);
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(st.message().find("gate_proj.weight has shape"), absl::string_view::npos)
        << st.message();
  }
  // Weights of a deeper model: extra tensors are refused, not ignored.
  {
    ModelConfig c = TinyConfig("llama");
    c.num_hidden_layers = 3;
    const std::string deeper = WriteModel(dir, c, 1, "deeper");
    std::ofstream(deeper + "/config.json") << ModelConfigToJson(TinyConfig("llama"));
    absl::Status st = CreateStatus(deeper);
    EXPECT_NE(st.message().find("unexpected tensor model.layers.2"), absl::string_view::npos)
        << st.message();
  }
}

TEST(Models, CreateInfoListDelete) {
  TempDir dir;
  auto r = MakeRunner(WriteModel(dir, TinyConfig("llama")), ComputeDType::kFloat32);
  CreateModelOptions o;
  o.lora = LoraConfig{4, 8, true, false, true};
  o.loss_reduction = LossReduction::kSeqMeanTokenSum;
  auto id = r->CreateModel(o);
  ASSERT_TRUE(id.ok());
  auto info = r->GetInfo(*id);
  ASSERT_TRUE(info.ok());
  // attention: per layer q(32→32) k(32→16) v(32→16) o(32→32); unembed 32→128; r·(in+out) each.
  const int64_t per_layer = 4 * ((32 + 32) + (32 + 16) + (32 + 16) + (32 + 32));
  EXPECT_EQ(info->trainable_parameters, 2 * per_layer + 4 * (32 + 128));
  EXPECT_EQ(info->loss_reduction, LossReduction::kSeqMeanTokenSum);
  EXPECT_EQ(info->vocab_size, 128);
  EXPECT_EQ(r->ListModels(), std::vector<std::string>{*id});
  EXPECT_TRUE(r->DeleteModel(*id).ok());
  EXPECT_EQ(r->DeleteModel(*id).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(r->GetInfo(*id).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(r->OptimStep(*id, AdamParams{}).status().code(), absl::StatusCode::kNotFound);
  o.lora = LoraConfig{0, 8, true, true, true};
  EXPECT_EQ(r->CreateModel(o).status().code(), absl::StatusCode::kInvalidArgument);
  o.lora = LoraConfig{4, 8, false, false, false};
  EXPECT_EQ(r->CreateModel(o).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(r->ListModels().empty());
}

TEST(Models, FreshAdapterLeavesBaseFunctionUnchanged) {
  TempDir dir;
  auto r = MakeRunner(WriteModel(dir, TinyConfig("qwen2")), ComputeDType::kFloat64);
  CreateModelOptions lora, full;
  full.lora.reset();
  auto a = r->CreateModel(lora);
  auto b = r->CreateModel(full);
  SplitMix64 g(1);
  auto data = RandomData(g, {6, 11}, "cross_entropy", 128);
  auto fa = r->Forward(*a, data, "cross_entropy", {});
  auto fb = r->Forward(*b, data, "cross_entropy", {});
  ASSERT_TRUE(fa.ok() && fb.ok());
  EXPECT_EQ(fa->outputs[1].logprobs, fb->outputs[1].logprobs);
  EXPECT_DOUBLE_EQ(fa->metrics.at("loss:sum"), fb->metrics.at("loss:sum"));
  EXPECT_EQ(r->GetInfo(*a)->accumulated_tokens, 0);  // Forward changes no state
}

}  // namespace
}  // namespace tinkerd::testing
