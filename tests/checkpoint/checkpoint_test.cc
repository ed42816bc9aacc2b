// Checkpoints: bitwise resume across a restart, refusal of bad checkpoints with nothing changed,
// crash safety under SIGKILL, and sampler exports.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "runner/checkpoint/param_shard_io.h"
#include "runner/checkpoint/state_io.h"
#include "runner/checkpoint/store.h"
#include "runner/model/safetensors.h"
#include "runner/model/weights.h"
#include "runner/sample/policy.h"
#include "tests/built_binary.h"
#include "tests/faulty_collectives.h"
#include "tests/test_util.h"

namespace tinkerd::testing {
namespace {

namespace fs = std::filesystem;

CreateModelOptions Lora(LossReduction mode = LossReduction::kTokenMean, int64_t rank = 4) {
  CreateModelOptions o;
  o.loss_reduction = mode;
  o.seed = 11;
  o.lora = LoraConfig{rank, 8, true, true, true};
  return o;
}

// One training step on batch k of a fixed stream; returns the loss.
double Step(ModelRunner& r, const std::string& id, int k) {
  SplitMix64 g(1000 + k);
  auto fb =
      r.ForwardBackward(id, RandomData(g, {9, 23, 4}, "cross_entropy", 128), "cross_entropy", {});
  EXPECT_TRUE(fb.ok()) << fb.status().message();
  AdamParams p;
  p.learning_rate = 1e-2;
  p.weight_decay = 0.01;
  EXPECT_TRUE(r.OptimStep(id, p).ok());
  return fb.ok() ? fb->metrics.at("loss:sum") : 0;
}

TEST(Checkpoint, ResumeAfterRestartIsBitwise) {
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig("qwen2"));
  const int N = 3, M = 3;
  // Straight through: N + M steps.
  auto straight = MakeRunner(model, ComputeDType::kFloat32);
  const std::string a = *straight->CreateModel(Lora());
  std::vector<double> want;
  for (int k = 0; k < N + M; ++k) want.push_back(Step(*straight, a, k));
  // N steps, save, a brand-new runner (as after a restart), load, M steps.
  std::vector<double> got;
  {
    auto first = MakeRunner(model, ComputeDType::kFloat32);
    const std::string b = *first->CreateModel(Lora());
    for (int k = 0; k < N; ++k) got.push_back(Step(*first, b, k));
    SaveStateOptions so;
    so.last_seq_id = 2 * N;
    ASSERT_TRUE(first->SaveState(b, dir.Sub("ckpt/step3"), so).ok());
  }
  auto second = MakeRunner(model, ComputeDType::kFloat32);
  auto c = second->CreateModelFromState(dir.Sub("ckpt/step3"), /*with_optimizer=*/true);
  ASSERT_TRUE(c.ok()) << c.status().message();
  EXPECT_EQ(second->GetInfo(*c)->step, N);
  for (int k = N; k < N + M; ++k) got.push_back(Step(*second, *c, k));
  EXPECT_EQ(got, want);  // bitwise, losses
  for (StateKind kind : {StateKind::kParams, StateKind::kAdamExpAvg, StateKind::kAdamExpAvgSq}) {
    EXPECT_EQ(Flat(Snap(*second, *c, kind)), Flat(Snap(*straight, a, kind)));  // bitwise, state
  }
  // Control: loading without the optimizer restarts Adam, and the trajectory differs.
  auto d = second->CreateModelFromState(dir.Sub("ckpt/step3"), /*with_optimizer=*/false);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(second->GetInfo(*d)->step, 0);
  Step(*second, *d, N);
  EXPECT_NE(Flat(Snap(*second, *d, StateKind::kParams)),
            Flat(Snap(*second, *c, StateKind::kParams)));
}

TEST(Checkpoint, AccumulatedGradientsAreRefusedUnlessIncluded) {
  TempDir dir;
  auto r = MakeRunner(WriteModel(dir, TinyConfig("llama")));
  const std::string id = *r->CreateModel(Lora(LossReduction::kSeqMeanTokenSum));
  Step(*r, id, 0);
  SplitMix64 g(5);
  ASSERT_TRUE(
      r->ForwardBackward(id, RandomData(g, {7, 12}, "cross_entropy", 128), "cross_entropy", {})
          .ok());
  auto refused = r->SaveState(id, dir.Sub("c/x"), {});
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition) << refused.message();
  EXPECT_TRUE(ListCheckpoints(dir.Sub("c")).empty());
  SaveStateOptions with;
  with.include_accumulated = true;
  ASSERT_TRUE(r->SaveState(id, dir.Sub("c/x"), with).ok());
  auto copy = r->CreateModelFromState(dir.Sub("c/x"), true);
  ASSERT_TRUE(copy.ok()) << copy.status().message();
  EXPECT_EQ(r->GetInfo(*copy)->accumulated_tokens, r->GetInfo(id)->accumulated_tokens);
  EXPECT_EQ(Flat(Snap(*r, *copy, StateKind::kGrads)), Flat(Snap(*r, id, StateKind::kGrads)));
  auto s1 = r->OptimStep(id, AdamParams{});
  auto s2 = r->OptimStep(*copy, AdamParams{});
  EXPECT_EQ(s1->grad_norm, s2->grad_norm);
  EXPECT_EQ(Flat(Snap(*r, *copy, StateKind::kParams)), Flat(Snap(*r, id, StateKind::kParams)));
}

TEST(Checkpoint, BadCheckpointsAreRefusedAndChangeNothing) {
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig("llama"));
  auto r = MakeRunner(model);
  const std::string src = *r->CreateModel(Lora());
  Step(*r, src, 0);
  ASSERT_TRUE(r->SaveState(src, dir.Sub("c/good"), {}).ok());
  const std::string target = *r->CreateModel(Lora());
  const auto before = Flat(Snap(*r, target, StateKind::kParams));
  auto copy_ckpt = [&](const std::string& name) {
    const std::string d = dir.Sub("c/" + name);
    fs::copy(*ResolveCheckpoint(dir.Sub("c/good")), d, fs::copy_options::recursive);
    return d;
  };
  // A flipped byte in the weights.
  {
    const std::string d = copy_ckpt("flipped");
    std::fstream f(d + "/params.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-5, std::ios::end);
    f.put('\x7f');
  }
  // A truncated optimizer file.
  {
    const std::string d = copy_ckpt("truncated");
    fs::resize_file(d + "/optimizer.safetensors",
                    fs::file_size(d + "/optimizer.safetensors") - 100);
  }
  // No manifest: an interrupted save.
  {
    const std::string d = copy_ckpt("nomanifest");
    fs::remove(d + "/manifest.json");
  }
  struct Case {
    std::string path;
    absl::StatusCode code;
    std::string expect;
  };
  std::vector<Case> cases = {
      {dir.Sub("c/flipped"), absl::StatusCode::kDataLoss, "params.safetensors is corrupt"},
      {dir.Sub("c/truncated"), absl::StatusCode::kDataLoss, "optimizer.safetensors is corrupt"},
      {dir.Sub("c/nomanifest"), absl::StatusCode::kNotFound, "no checkpoint"},
      {dir.Sub("c/absent"), absl::StatusCode::kNotFound, "no checkpoint"}};
  for (const Case& c : cases) {
    absl::Status st = r->LoadState(target, c.path, true);
    EXPECT_EQ(st.code(), c.code) << c.path << ": " << st.message();
    EXPECT_NE(st.message().find(c.expect), absl::string_view::npos) << st.message();
    EXPECT_EQ(Flat(Snap(*r, target, StateKind::kParams)), before);
  }
  // Another LoRA rank.
  const std::string rank8 = *r->CreateModel(Lora(LossReduction::kTokenMean, 8));
  absl::Status st = r->LoadState(rank8, dir.Sub("c/good"), true);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("LoRA rank 4"), absl::string_view::npos) << st.message();
  // Another base model (same architecture, other weights).
  auto other = MakeRunner(WriteModel(dir, TinyConfig("llama"), /*seed=*/99, "other"));
  const std::string o = *other->CreateModel(Lora());
  const auto other_before = Flat(Snap(*other, o, StateKind::kParams));
  st = other->LoadState(o, dir.Sub("c/good"), true);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("another base model"), absl::string_view::npos) << st.message();
  EXPECT_EQ(Flat(Snap(*other, o, StateKind::kParams)), other_before);
  // Control: the good one loads.
  ASSERT_TRUE(r->LoadState(target, dir.Sub("c/good"), true).ok());
  EXPECT_EQ(Flat(Snap(*r, target, StateKind::kParams)), Flat(Snap(*r, src, StateKind::kParams)));
}

// Tensors by name, flattened in name order as Flat(Snap(...)) flattens a model's parameters.
std::vector<double> FlatTensors(const std::map<std::string, at::Tensor>& named) {
  std::vector<double> v;
  for (const auto& [name, t] : named) {
    const at::Tensor d = t.to(at::kDouble).contiguous();
    v.insert(v.end(), d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
  }
  return v;
}

// A fully sharded full fine-tune (--shard=full; one process here, the ranks' gathers are in
// tests/dist/dist_server_test.cc) freezes a sampler's copy of its weights and exports them merged,
// both gathered a unit at a time: bitwise its parameters (float64), and the copy stays as it was
// while the model steps on (the control: the parameters it no longer equals). An adapter export
// of it is refused by name and writes nothing. Its training checkpoint (the gathered, unsharded
// layout) loads into replicas and steps as the sharded one does, to rounding.
TEST(Checkpoint, AFullyShardedModelSamplesExportsAndSaves) {
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig("llama"));
  auto full = MakeRunner(model, ComputeDType::kFloat64, 4096, ShardMode::kFull);
  CreateModelOptions fine_tune;
  fine_tune.lora.reset();
  const std::string a = *full->CreateModel(fine_tune);
  Step(*full, a, 0);
  EXPECT_TRUE(full->Gathers(a));
  const auto before = Flat(Snap(*full, a, StateKind::kParams));
  auto policy = full->FreezePolicy(a);
  ASSERT_TRUE(policy.ok()) << policy.status().message();
  ASSERT_NE(*policy, nullptr);
  const ModelConfig config = TinyConfig("llama");
  EXPECT_EQ(FlatTensors((*policy)->weights.Named(config)), before);
  EXPECT_EQ((*policy)->step, 1);

  ASSERT_TRUE(full->SaveWeightsForSampler(a, dir.Sub("s/merged"), /*merged=*/true, false).ok());
  const std::string merged = *ResolveCheckpoint(dir.Sub("s/merged"));
  auto file = LoadSafetensorsFile(merged + "/model.safetensors", at::kDouble);
  ASSERT_TRUE(file.ok()) << file.status().message();
  EXPECT_EQ(FlatTensors(*file), before);
  auto loaded = full->LoadPolicy(dir.Sub("s/merged"));
  ASSERT_TRUE(loaded.ok()) << loaded.status().message();
  EXPECT_EQ(FlatTensors((*loaded)->weights.Named(config)), before);

  const absl::Status peft = full->SaveWeightsForSampler(a, dir.Sub("s/peft"), false, false);
  EXPECT_EQ(peft.code(), absl::StatusCode::kFailedPrecondition) << peft.message();
  EXPECT_NE(peft.message().find("merged"), absl::string_view::npos) << peft.message();
  EXPECT_FALSE(fs::exists(dir.Sub("s/peft")));

  Step(*full, a, 1);
  const auto stepped = Flat(Snap(*full, a, StateKind::kParams));
  EXPECT_NE(stepped, before);
  EXPECT_EQ(FlatTensors((*policy)->weights.Named(config)), before);
  EXPECT_EQ(FlatTensors(full->FreezePolicy(a).value()->weights.Named(config)), stepped);

  ASSERT_TRUE(full->SaveState(a, dir.Sub("c/full"), SaveStateOptions()).ok());
  const std::string saved = *ResolveCheckpoint(dir.Sub("c/full"));
  EXPECT_TRUE(fs::exists(saved + "/params.safetensors"));
  EXPECT_TRUE(fs::exists(saved + "/optimizer.safetensors"));
  auto replicas = MakeRunner(model);
  auto b = replicas->CreateModelFromState(dir.Sub("c/full"), /*with_optimizer=*/true);
  ASSERT_TRUE(b.ok()) << b.status().message();
  EXPECT_FALSE(replicas->Gathers(*b));
  EXPECT_EQ(Flat(Snap(*replicas, *b, StateKind::kParams)), stepped);
  Step(*full, a, 2);
  Step(*replicas, *b, 2);
  EXPECT_LE(MaxAbsDiff(Flat(Snap(*replicas, *b, StateKind::kParams)),
                       Flat(Snap(*full, a, StateKind::kParams))),
            1e-12);
}

// A checkpoint of sharded optimizer state (one process here, so one shard: the multi-rank
// resumes are in tests/dist/dist_test.cc) holds per-rank files of flat slices; an unsharded model
// loads it as whole tensors, mid-accumulation, and steps exactly as the sharded one does. A
// truncated shard is refused by name.
TEST(Checkpoint, ShardedSavesLoadIntoReplicasAndBadShardsAreRefused) {
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig("llama"));
  auto sharded = MakeRunner(model, ComputeDType::kFloat64, 4096, ShardMode::kOptimizer);
  const std::string a = *sharded->CreateModel(Lora(LossReduction::kSeqMeanTokenMean));
  Step(*sharded, a, 0);
  SplitMix64 g(21);
  ASSERT_TRUE(
      sharded->ForwardBackward(a, RandomData(g, {5, 17}, "cross_entropy", 128), "cross_entropy", {})
          .ok());
  SaveStateOptions with;
  with.include_accumulated = true;
  ASSERT_TRUE(sharded->SaveState(a, dir.Sub("c/sharded"), with).ok());
  const std::string saved = *ResolveCheckpoint(dir.Sub("c/sharded"));
  EXPECT_TRUE(fs::exists(saved + "/optimizer-0-of-1.safetensors"));
  EXPECT_TRUE(fs::exists(saved + "/accumulators-0-of-1.safetensors"));
  EXPECT_FALSE(fs::exists(saved + "/optimizer.safetensors"));

  auto replicas = MakeRunner(model);
  auto b = replicas->CreateModelFromState(dir.Sub("c/sharded"), /*with_optimizer=*/true);
  ASSERT_TRUE(b.ok()) << b.status().message();
  // At one rank a shard's slices are its tensors flattened in name order: the same values.
  for (StateKind kind : {StateKind::kGrads, StateKind::kAdamExpAvg, StateKind::kAdamExpAvgSq}) {
    EXPECT_EQ(Flat(Snap(*replicas, *b, kind)), Flat(Snap(*sharded, a, kind)));
  }
  auto s1 = sharded->OptimStep(a, AdamParams{});
  auto s2 = replicas->OptimStep(*b, AdamParams{});
  ASSERT_TRUE(s1.ok() && s2.ok());
  EXPECT_EQ(s1->grad_norm, s2->grad_norm);
  EXPECT_EQ(Flat(Snap(*replicas, *b, StateKind::kParams)),
            Flat(Snap(*sharded, a, StateKind::kParams)));

  const std::string bad = dir.Sub("c/truncated_shard");
  fs::copy(saved, bad, fs::copy_options::recursive);
  fs::resize_file(bad + "/optimizer-0-of-1.safetensors",
                  fs::file_size(bad + "/optimizer-0-of-1.safetensors") - 8);
  const std::string target = *replicas->CreateModel(Lora(LossReduction::kSeqMeanTokenMean));
  const auto before = Flat(Snap(*replicas, target, StateKind::kParams));
  absl::Status st = replicas->LoadState(target, bad, true);
  EXPECT_EQ(st.code(), absl::StatusCode::kDataLoss) << st.message();
  EXPECT_NE(st.message().find("optimizer-0-of-1.safetensors is corrupt"), absl::string_view::npos)
      << st.message();
  EXPECT_EQ(Flat(Snap(*replicas, target, StateKind::kParams)), before);
}

TEST(Checkpoint, OverwriteListAndDelete) {
  TempDir dir;
  auto r = MakeRunner(WriteModel(dir, TinyConfig("llama")));
  const std::string id = *r->CreateModel(Lora());
  ASSERT_TRUE(r->SaveState(id, dir.Sub("c/a"), {}).ok());
  EXPECT_EQ(r->SaveState(id, dir.Sub("c/a"), {}).code(), absl::StatusCode::kAlreadyExists);
  Step(*r, id, 0);
  SaveStateOptions over;
  over.overwrite = true;
  ASSERT_TRUE(r->SaveState(id, dir.Sub("c/a"), over).ok());
  ASSERT_TRUE(r->SaveState(id, dir.Sub("c/b"), {}).ok());
  EXPECT_EQ(ListCheckpoints(dir.Sub("c")), (std::vector<std::string>{"a", "b"}));
  // One version directory per checkpoint: the overwritten one was removed.
  int dirs = 0;
  for (const auto& e : fs::directory_iterator(dir.Sub("c")))
    dirs += fs::is_directory(e.symlink_status());
  EXPECT_EQ(dirs, 2);
  auto loaded = r->CreateModelFromState(dir.Sub("c/a"), true);
  EXPECT_EQ(r->GetInfo(*loaded)->step, 1);
  ASSERT_TRUE(DeleteCheckpoint(dir.Sub("c/a")).ok());
  EXPECT_EQ(ListCheckpoints(dir.Sub("c")), std::vector<std::string>{"b"});
  EXPECT_EQ(DeleteCheckpoint(dir.Sub("c/a")).code(), absl::StatusCode::kNotFound);
}

TEST(Checkpoint, SigkillWhileSavingLeavesThePreviousCheckpointIntact) {
  TempDir dir;
  ModelConfig big = DefaultDemoConfig();  // full fine-tune of 3.2M weights: saves take a while
  TinyModelSpec spec{big};
  ASSERT_TRUE(WriteTinyModel(dir.Sub("base"), spec).ok());
  const std::string path = dir.Sub("c/ckpt");
  auto r = MakeRunner(dir.Sub("base"), ComputeDType::kFloat32);
  CreateModelOptions full;
  full.lora.reset();
  const std::string fresh = *r->CreateModel(full);
  const std::string saver = BuiltBinary(CKPT_SAVER_BINARY);
  for (int delay_ms : {5, 60, 150}) {
    int out[2];
    ASSERT_EQ(pipe(out), 0);
    pid_t pid = fork();
    if (pid == 0) {
      dup2(out[1], STDOUT_FILENO);
      const std::string a1 = "--model_dir=" + dir.Sub("base"), a2 = "--path=" + path;
      execl(saver.c_str(), "ckpt_saver", a1.c_str(), a2.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    close(out[1]);
    char buf[8] = {0};
    ASSERT_GT(read(out[0], buf, 6), 0) << "saver never completed a first save";
    close(out[0]);
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    // Whatever the moment of death, the name resolves to a complete, loadable checkpoint.
    EXPECT_EQ(ListCheckpoints(dir.Sub("c")), std::vector<std::string>{"ckpt"}) << delay_ms;
    auto loaded = r->CreateModelFromState(path, true);
    ASSERT_TRUE(loaded.ok()) << delay_ms << " ms: " << loaded.status().message();
    EXPECT_EQ(Flat(Snap(*r, *loaded, StateKind::kParams)),
              Flat(Snap(*r, fresh, StateKind::kParams)));
    ASSERT_TRUE(r->DeleteModel(*loaded).ok());
  }
}

TEST(SamplerExport, MergedModelLoadsAsBaseWithTheAdaptersLogits) {
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig("qwen3"));  // tied embeddings
  auto r = MakeRunner(model);
  const std::string id = *r->CreateModel(Lora());
  for (int k = 0; k < 3; ++k) Step(*r, id, k);
  ASSERT_TRUE(r->SaveWeightsForSampler(id, dir.Sub("s/merged"), /*merged=*/true, false).ok());
  auto merged = MakeRunner(*ResolveCheckpoint(dir.Sub("s/merged")));
  ASSERT_NE(merged, nullptr);
  const std::string plain = *merged->CreateModel(Lora());  // fresh adapter: B = 0, the base itself
  SplitMix64 g(4);
  auto data = RandomData(g, {17, 5}, "cross_entropy", 128);
  auto want = r->Forward(id, data, "cross_entropy", {});
  auto got = merged->Forward(plain, data, "cross_entropy", {});
  ASSERT_TRUE(want.ok() && got.ok());
  // float64 both ways; merging reassociates W·x + s·B·(A·x) into (W + s·B·A)·x: ~1e-15 relative.
  EXPECT_NEAR(got->metrics.at("loss:sum"), want->metrics.at("loss:sum"), 1e-9);
  for (size_t t = 0; t < want->outputs[0].logprobs.size(); ++t) {
    EXPECT_NEAR(got->outputs[0].logprobs[t], want->outputs[0].logprobs[t], 2e-6);
  }
  // Control: the untrained base differs.
  auto base_runner = MakeRunner(model);
  auto base = base_runner->Forward(*base_runner->CreateModel(Lora()), data, "cross_entropy", {});
  EXPECT_GT(std::abs(base->metrics.at("loss:sum") - want->metrics.at("loss:sum")), 1e-3);
}

TEST(SamplerExport, PeftAdapterHasPeftNamesAndConfig) {
  TempDir dir;
  auto r = MakeRunner(WriteModel(dir, TinyConfig("llama")));
  CreateModelOptions o = Lora();
  o.lora->train_unembed = false;
  const std::string id = *r->CreateModel(o);
  ASSERT_TRUE(r->SaveWeightsForSampler(id, dir.Sub("s/peft"), false, false).ok());
  const std::string d = *ResolveCheckpoint(dir.Sub("s/peft"));
  auto cfg = nlohmann::json::parse(*ReadFileToString(d + "/adapter_config.json"));
  EXPECT_EQ(cfg["peft_type"], "LORA");
  EXPECT_EQ(cfg["r"], 4);
  EXPECT_EQ(cfg["lora_alpha"], 8.0);
  EXPECT_EQ(cfg["target_modules"].size(), 7u);  // q k v o gate up down
  auto bytes = ReadFileToString(d + "/adapter_model.safetensors");
  auto h = ParseSafetensors(*bytes);
  ASSERT_TRUE(h.ok());
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& e : h->entries) shapes[e.name] = e.shape;
  EXPECT_EQ(shapes.size(), 2u * 7 * 2);  // 2 layers × 7 modules × {A, B}
  EXPECT_EQ(shapes.at("base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"),
            (std::vector<int64_t>{4, 32}));
  EXPECT_EQ(shapes.at("base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"),
            (std::vector<int64_t>{16, 4}));
  // A full fine-tune has no adapter to export.
  CreateModelOptions full;
  full.lora.reset();
  EXPECT_EQ(r->SaveWeightsForSampler(*r->CreateModel(full), dir.Sub("s/x"), false, false).code(),
            absl::StatusCode::kFailedPrecondition);
}

// Loads and sampler copies hold memory a client asked for: they reserve it in the runner's account
// first, and past it they are RESOURCE_EXHAUSTED, naming the call, with nothing changed; with room
// again the same calls succeed.
TEST(Checkpoint, LoadsAndSamplerCopiesReserveTheirMemoryFirst) {
  TempDir dir;
  const std::string model = WriteModel(dir, TinyConfig("llama"));
  auto r = MakeRunner(model);
  const std::string src = *r->CreateModel(Lora());
  Step(*r, src, 0);
  ASSERT_TRUE(r->SaveState(src, dir.Sub("c/one"), {}).ok());
  ASSERT_TRUE(r->SaveWeightsForSampler(src, dir.Sub("c/export"), /*merged=*/false, false).ok());
  const std::string target = *r->CreateModel(Lora());
  const auto before = Flat(Snap(*r, target, StateKind::kParams));
  const std::shared_ptr<MemoryAccount> account = r->memory_account();
  const int64_t held = account->reserved();
  {
    auto full = account->Reserve(account->capacity() - held, "the test", "");
    ASSERT_TRUE(full.ok()) << full.status();
    const absl::Status load = r->LoadState(target, dir.Sub("c/one"), true);
    EXPECT_EQ(load.code(), absl::StatusCode::kResourceExhausted) << load;
    EXPECT_NE(load.message().find("load_state: the checkpoint's tensors"), std::string::npos)
        << load;
    EXPECT_EQ(Flat(Snap(*r, target, StateKind::kParams)), before) << "a refused load changed it";
    const auto copy = r->FreezePolicy(src);
    EXPECT_EQ(copy.status().code(), absl::StatusCode::kResourceExhausted) << copy.status();
    EXPECT_NE(copy.status().message().find("create_sampler: the sampler's copy"), std::string::npos)
        << copy.status();
    EXPECT_EQ(r->CreateModelFromState(dir.Sub("c/one"), true, "").status().code(),
              absl::StatusCode::kResourceExhausted);
    const auto loaded = r->LoadPolicy(dir.Sub("c/export"));
    EXPECT_EQ(loaded.status().code(), absl::StatusCode::kResourceExhausted) << loaded.status();
    // Saves hold little beside the model, files being written a tensor at a time: a copy of the
    // gradient sum they include, one merged weight of a merged export.
    SaveStateOptions with_sums;
    with_sums.include_accumulated = true;
    const absl::Status sums = r->SaveState(src, dir.Sub("c/sums"), with_sums);
    EXPECT_EQ(sums.code(), absl::StatusCode::kResourceExhausted) << sums;
    EXPECT_NE(sums.message().find("save_state: a copy of the gradient sum"), std::string::npos)
        << sums;
    const absl::Status merged = r->SaveWeightsForSampler(src, dir.Sub("c/merged"), true, false);
    EXPECT_EQ(merged.code(), absl::StatusCode::kResourceExhausted) << merged;
    EXPECT_NE(merged.message().find("save_weights_for_sampler: merging one weight"),
              std::string::npos)
        << merged;
    EXPECT_FALSE(fs::exists(dir.Sub("c/sums")) || fs::exists(dir.Sub("c/merged")));
    // Without one of them, a save goes through: its files take no memory of the account.
    EXPECT_TRUE(r->SaveState(src, dir.Sub("c/plain"), {}).ok());
  }
  EXPECT_EQ(account->reserved(), held) << "refusals hold nothing";
  ASSERT_TRUE(r->LoadState(target, dir.Sub("c/one"), true).ok());
  EXPECT_EQ(Flat(Snap(*r, target, StateKind::kParams)), Flat(Snap(*r, src, StateKind::kParams)));
  EXPECT_EQ(account->reserved(), held) << "a load holds its tensors only while it runs";
  auto copy = r->FreezePolicy(src);
  ASSERT_TRUE(copy.ok()) << copy.status();
  EXPECT_EQ(account->reserved(), held + (*copy)->bytes) << "a sampler's copy is held";
  copy = absl::StatusOr<std::shared_ptr<const Policy>>(nullptr);
  EXPECT_EQ(account->reserved(), held);
  auto loaded = r->LoadPolicy(dir.Sub("c/export"));
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_GT((*loaded)->bytes, 0);
  EXPECT_EQ(account->reserved(), held + (*loaded)->bytes) << "an export's copy is held, exactly";
}

// Safetensors files are written and read a tensor at a time. Under an address-space limit that
// leaves 48 MiB beside 64 MiB of tensors, a save of them finishes, and once they are freed so
// does a load back (64 MiB of tensors in 112 MiB of room). Broken control: the whole-file way
// saves used (the file serialized into memory, 64 MiB) dies under the same limit, as does the
// whole-file way loads used (the file read into memory beside its tensors, 128 MiB).
void SaveAndLoad(bool whole_file) {
  TempDir dir;
  const std::string path = dir.Sub("big.safetensors");
  TensorMap tensors;
  for (int i = 0; i < 4; ++i) tensors[absl::StrCat("w", i)] = at::rand({4 << 20}, at::kFloat);
  if (!LimitAddressSpace(48 << 20)) _exit(2);
  if (whole_file) {
    std::vector<SafetensorsOutput> outs;
    for (const auto& [name, t] : tensors) {
      outs.push_back({name, "F32", t.sizes().vec(),
                      absl::string_view(static_cast<const char*>(t.data_ptr()), t.nbytes())});
    }
    const auto bytes = SerializeSafetensors(outs, {});
    if (!bytes.ok() || !WriteFileAtomically(path, *bytes).ok()) _exit(3);
  } else if (!SaveSafetensorsFile(path, tensors, "float32").ok()) {
    _exit(3);
  }
  tensors.clear();
  if (whole_file) {
    const auto bytes = ReadFileToString(path);
    if (!bytes.ok()) _exit(4);
  }
  const auto back = LoadSafetensorsFile(path, at::kFloat);
  if (!back.ok() || back->size() != 4) _exit(5);
}

void SaveAndLoadUnderALimit(bool whole_file) {
  try {
    SaveAndLoad(whole_file);
  } catch (const std::exception&) {  // std::bad_alloc
    _exit(6);
  }
  _exit(0);
}

TEST(CheckpointFilesDeathTest, ASaveAndALoadHoldNoCopyOfTheWholeFile) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "a sanitizer's allocator maps memory of its own, which the limit refuses";
#endif
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(SaveAndLoadUnderALimit(/*whole_file=*/false), ::testing::ExitedWithCode(0), "");
  EXPECT_EXIT(
      SaveAndLoadUnderALimit(/*whole_file=*/true),
      [](int status) { return !WIFEXITED(status) || WEXITSTATUS(status) != 0; }, "");
}

// A sharded full fine-tune (--shard=full) reads a checkpoint in parts: each of W = 3 or 4 ranks
// keeps only its slice of each tensor as the tensor is read (SlicesOf), and ends with exactly the
// slices a whole read would have given it (params, moments and accumulated sums, bitwise; at W = 3
// the slices cut tensors unevenly), having admitted well under half the bytes; from a replica's
// checkpoint and from one of --shard=optimizer alike. A tensor of another
// shape, or one the model lacks, is kept as nothing, and the load is refused.
TEST(ShardedLoad, EachRankReadsOnlyItsSlicesOfTheCheckpoint) {
  TempDir dir;
  const ModelConfig config = TinyConfig("qwen3");
  const std::string model = WriteModel(dir, config);
  auto r = MakeRunner(model);
  CreateModelOptions full;
  full.lora.reset();
  const std::string id = *r->CreateModel(full);
  SplitMix64 g(3);
  ASSERT_TRUE(
      r->ForwardBackward(id, RandomData(g, {7, 12}, "cross_entropy", 128), "cross_entropy", {})
          .ok());
  ASSERT_TRUE(r->OptimStep(id, AdamParams{}).ok());
  ASSERT_TRUE(
      r->ForwardBackward(id, RandomData(g, {9}, "cross_entropy", 128), "cross_entropy", {}).ok());
  SaveStateOptions with;
  with.include_accumulated = true;
  const std::string ckpt = dir.Sub("c/full");
  ASSERT_TRUE(r->SaveState(id, ckpt, with).ok());
  std::ifstream manifest(ckpt + "/manifest.json");
  const uint64_t fingerprint =
      std::stoull(nlohmann::json::parse(manifest)["base_fingerprint"].get<std::string>());
  // The same state in the layout of --shard=optimizer (per-rank files of flat stretches; one
  // process here: tests/dist/dist_test.cc cuts them at N = 4).
  auto o = MakeRunner(model, ComputeDType::kFloat64, 4096, ShardMode::kOptimizer);
  const std::string from_optimizer = dir.Sub("c/optimizer");
  {
    auto copy = o->CreateModelFromState(ckpt, /*with_optimizer=*/true);
    ASSERT_TRUE(copy.ok()) << copy.status().message();
    ASSERT_TRUE(o->SaveState(*copy, from_optimizer, with).ok());
    ASSERT_TRUE(fs::exists(*ResolveCheckpoint(from_optimizer) + "/optimizer-0-of-1.safetensors"));
  }
  // And as 64 ranks would have saved it: their stretches cut most tensors across several files.
  const std::string from_64 = dir.Sub("c/optimizer64");
  {
    auto whole =
        ReadTrainingState(ckpt, fingerprint, at::kDouble, [](int64_t) { return absl::OkStatus(); });
    ASSERT_TRUE(whole.ok()) << whole.status().message();
    ModelState t;
    t.id = id;
    t.options = whole->options;
    t.params = whole->params;
    t.step = whole->step;
    t.accumulated_tokens = whole->accumulated_tokens;
    t.accumulated_sequences = whole->accumulated_sequences;
    std::vector<int64_t> numels;
    std::vector<at::Tensor> params, avg, avg_sq, sums;
    for (const auto& [name, p] : t.params) {
      numels.push_back(p.numel());
      params.push_back(p);
      avg.push_back(whole->exp_avg.at(name));
      avg_sq.push_back(whole->exp_avg_sq.at(name));
      sums.push_back(whole->grad_sum.at(name));
    }
    fs::create_directories(from_64);
    std::map<std::string, FileDigest> files;
    for (int rank = 0; rank < 64; ++rank) {
      OptimizerShard shard(ShardLayout(numels, 64, rank), at::TensorOptions().dtype(at::kDouble));
      shard.Scatter(avg, shard.exp_avg_C);
      shard.Scatter(avg_sq, shard.exp_avg_sq_C);
      shard.Scatter(sums, shard.grad_sum_C);
      auto written = WriteStateShard(shard, /*accumulated=*/true, "float64", from_64);
      ASSERT_TRUE(written.ok()) << written.status().message();
      files.insert(written->begin(), written->end());
    }
    const CheckpointMeta meta{0, fingerprint, model, "float64"};
    ASSERT_TRUE(WriteShardedTrainingState(t, meta, true, 64, files, from_64).ok());
    // Its largest tensor spans at least three files.
    ASSERT_GT(*std::max_element(numels.begin(), numels.end()),
              2 * ShardLayout(numels, 64, 0).chunk());
  }

  auto tensors = LoadSafetensorsDir(model, at::kDouble);
  ASSERT_TRUE(tensors.ok()) << tensors.status().message();
  auto base = BaseWeightsFromTensors(config, *tensors);
  ASSERT_TRUE(base.ok()) << base.status().message();
  const at::TensorOptions f64 = at::TensorOptions().dtype(at::kDouble);
  for (const auto& [world, rank, read] :
       {std::tuple{3, 0, ckpt}, std::tuple{3, 1, ckpt}, std::tuple{3, 2, ckpt},
        std::tuple{4, 0, ckpt}, std::tuple{4, 1, ckpt}, std::tuple{4, 2, ckpt},
        std::tuple{4, 3, ckpt}, std::tuple{3, 1, from_optimizer}, std::tuple{4, 3, from_optimizer},
        std::tuple{3, 0, from_64}, std::tuple{3, 2, from_64}, std::tuple{4, 1, from_64}}) {
    ModelState whole_read, part_read;
    whole_read.sharded.emplace(*base, config, world, rank, f64);
    part_read.sharded.emplace(*base, config, world, rank, f64);
    int64_t whole_bytes = 0, part_bytes = 0;
    auto whole = ReadTrainingState(read, fingerprint, at::kDouble, [&](int64_t b) {
      whole_bytes = b;
      return absl::OkStatus();
    });
    const ReadSlices slices = SlicesOf(part_read);
    auto parts = ReadTrainingState(
        read, fingerprint, at::kDouble,
        [&](int64_t b) {
          part_bytes = b;
          return absl::OkStatus();
        },
        &slices);
    ASSERT_TRUE(whole.ok() && parts.ok()) << parts.status().message();
    ASSERT_TRUE(CheckShardedCompatible(whole_read, *whole).ok());
    ASSERT_TRUE(CheckShardedCompatible(part_read, *parts).ok());
    int64_t kept = 0, owned = 0;
    for (const auto& [name, t] : parts->params) kept += t.numel();
    for (const ShardedUnit& u : part_read.sharded->units()) owned += u.param_C.numel();
    EXPECT_LE(kept, owned) << world << " rank " << rank;  // the last rank's may be short of C
    EXPECT_GT(kept, 0) << world << " rank " << rank;
    EXPECT_LT(part_bytes, whole_bytes / 2) << world << " rank " << rank;
    ScatterLoadedState(whole_read, *whole, true);
    ScatterLoadedState(part_read, *parts, true);
    for (size_t u = 0; u < part_read.sharded->units().size(); ++u) {
      const ShardedUnit &a = whole_read.sharded->units()[u], &b = part_read.sharded->units()[u];
      EXPECT_TRUE(at::equal(a.param_C, b.param_C)) << world << " rank " << rank << " unit " << u;
      EXPECT_TRUE(at::equal(a.state.exp_avg_C, b.state.exp_avg_C));
      EXPECT_TRUE(at::equal(a.state.exp_avg_sq_C, b.state.exp_avg_sq_C));
      EXPECT_TRUE(at::equal(a.state.grad_sum_C, b.state.grad_sum_C));
    }
    EXPECT_EQ(part_read.accumulated_tokens, whole_read.accumulated_tokens);
    EXPECT_GT(part_read.accumulated_tokens, 0);
  }
  // The controls: what is not the model's is kept as nothing, and such a read is refused.
  ModelState other;
  other.sharded.emplace(*base, config, 4, 1, f64);
  const ReadSlices slices = SlicesOf(other);
  EXPECT_FALSE(slices.take("model.layers.0.mlp.nothing.weight", at::zeros({4})).defined());
  EXPECT_FALSE(slices.take("model.norm.weight", at::zeros({config.hidden_size + 1})).defined());
  EXPECT_TRUE(slices.take("model.norm.weight", at::zeros({config.hidden_size})).defined());
  auto parts = ReadTrainingState(
      ckpt, fingerprint, at::kDouble, [](int64_t) { return absl::OkStatus(); }, &slices);
  ASSERT_TRUE(parts.ok());
  parts->params["model.norm.weight"] = at::Tensor();
  EXPECT_EQ(CheckShardedCompatible(other, *parts).code(), absl::StatusCode::kFailedPrecondition);
}

// A sharded model's save gathers each unit whole on every rank in turn: it reserves the largest
// unit (and the gather's staging) first, and a save refused for memory writes nothing and holds
// nothing after; a merged export and a sampler's copy reserve alike.
TEST(ShardedSave, WhatIsGatheredWholeIsReserved) {
  TempDir dir;
  auto r = MakeRunner(WriteModel(dir, TinyConfig("qwen3")), ComputeDType::kFloat64, 4096,
                      ShardMode::kFull);
  CreateModelOptions full;
  full.lora.reset();
  const std::string id = *r->CreateModel(full);
  const std::shared_ptr<MemoryAccount> account = r->memory_account();
  const int64_t held = account->reserved();
  {
    auto all = account->Reserve(account->capacity() - held, "the test", "");
    ASSERT_TRUE(all.ok()) << all.status();
    const absl::Status refused = r->SaveState(id, dir.Sub("c/s"), {});
    EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
    EXPECT_NE(refused.message().find("save_state: the largest unit"), std::string::npos) << refused;
    EXPECT_FALSE(fs::exists(dir.Sub("c/s")));
    // A merged export and a sampler's copy gather the same way, and are refused alike.
    const absl::Status exported = r->SaveWeightsForSampler(id, dir.Sub("s/m"), true, false);
    EXPECT_EQ(exported.code(), absl::StatusCode::kResourceExhausted) << exported;
    EXPECT_NE(exported.message().find("save_weights_for_sampler: the largest unit"),
              std::string::npos)
        << exported;
    EXPECT_FALSE(fs::exists(dir.Sub("s/m")));
    const absl::Status frozen = r->FreezePolicy(id).status();
    EXPECT_EQ(frozen.code(), absl::StatusCode::kResourceExhausted) << frozen;
    EXPECT_NE(frozen.message().find("create_sampler"), std::string::npos) << frozen;
  }
  EXPECT_EQ(account->reserved(), held) << "a refusal holds nothing";
  ASSERT_TRUE(r->SaveState(id, dir.Sub("c/s"), {}).ok());
  EXPECT_TRUE(fs::exists(dir.Sub("c/s/manifest.json")));
  EXPECT_EQ(account->reserved(), held) << "a save holds its unit only while it runs";
  ASSERT_TRUE(r->SaveWeightsForSampler(id, dir.Sub("s/m"), true, false).ok());
  EXPECT_EQ(account->reserved(), held);
  int64_t copy = 0;
  {
    auto policy = r->FreezePolicy(id);
    ASSERT_TRUE(policy.ok()) << policy.status();
    copy = (*policy)->bytes;
    EXPECT_EQ(account->reserved(), held + copy) << "the copy, held while it lives";
  }
  EXPECT_EQ(account->reserved(), held);
  {
    // Room for the copy, not for the unit gathered beside it.
    auto most = account->Reserve(account->capacity() - held - copy - 1, "the test", "");
    ASSERT_TRUE(most.ok()) << most.status();
    const absl::Status frozen = r->FreezePolicy(id).status();
    EXPECT_EQ(frozen.code(), absl::StatusCode::kResourceExhausted) << frozen;
    EXPECT_NE(frozen.message().find("create_sampler: the largest unit"), std::string::npos)
        << frozen;
  }
  EXPECT_EQ(account->reserved(), held);
}

// Each unit is gathered once per file: the rest (embedding, norm and head), whose tensors are not
// adjacent in a file (the head and embedding sort first, the norm last), is held until the norm is
// written rather than gathered again. A save without the gradient sums so gathers every value
// three times (the parameters and two moments), a merged export once.
TEST(ShardedSave, EachUnitIsGatheredOncePerFile) {
  TempDir dir;
  RunnerConfig rc;
  rc.base_model_path = WriteModel(dir, TinyConfig("llama"));
  rc.compute_dtype = ComputeDType::kFloat64;
  rc.shard = ShardMode::kFull;
  rc.device = TestDevice();
  auto counting = std::make_shared<FaultyCollectives>(MakeLocalCollectives(), Faults{});
  rc.collectives = counting;
  auto r = ModelRunner::Create(rc);
  ASSERT_TRUE(r.ok()) << r.status();
  CreateModelOptions full;
  full.lora.reset();
  const std::string id = *(*r)->CreateModel(full);
  int64_t values = 0;
  for (const NamedValues& n : Snap(**r, id, StateKind::kParams)) values += std::ssize(n.values);
  ASSERT_GT(values, 0);

  counting->gathered_values = 0;
  ASSERT_TRUE((*r)->SaveState(id, dir.Sub("c/s"), {}).ok());
  EXPECT_EQ(counting->gathered_values, 3 * values);
  counting->gathered_values = 0;
  ASSERT_TRUE((*r)->SaveWeightsForSampler(id, dir.Sub("s/m"), /*merged=*/true, false).ok());
  EXPECT_EQ(counting->gathered_values, values);
}

}  // namespace
}  // namespace tinkerd::testing
