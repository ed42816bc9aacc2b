// One rank of a data-parallel training scenario, launched by dist_test.cc with torchrun's
// environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). Writes what it ended with (every
// model's parameters, every step's gradient norm, every call's loss) as raw doubles to
// --out.<rank>, so the test can compare world sizes.
//   dist_worker --model_dir=D --out=F [--shard=none|optimizer|full] [--shard_base]
//       [--noprefetch_layers]
//       [--scenario=train|train_full|train_lora|save|load|load_without_optimizer|export
//        --checkpoint=PATH] [--rounds=N] [--nostep]
//       [--expert_parallel=E] [--lora_attn=false]
//       [--broken=none|no_world_size_factor|reduce_twice|diverge_rank1|gather_own_only|
//                 drop_sent_row]
// train: LoRA models in every reduction mode and a full fine-tune, two steps (--rounds) each;
// train_full: the full fine-tune alone; train_lora: the token-mean LoRA model alone.
// save: one step, then a call left accumulated is saved with the accumulation to --checkpoint,
//       and the run goes on (one more call, one step); load: the same continuation from that
//       checkpoint (load_without_optimizer: without its moments, a control). Each writes the
//       continuation's losses, norms and parameters.
// export: the token-mean LoRA model's calls and step (--rounds), then its merged sampler export
//       to --checkpoint; writes the step's losses and norms.
// With diverge_rank1, rank 1's replica is perturbed at the first step, and the worker exits 0 only
// if that step fails with "diverged" on its rank.
#include <cstdio>
#include <fstream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "runner/dist/c10d_collectives.h"
#include "runner/util/log.h"
#include "tests/faulty_collectives.h"
#include "tests/test_util.h"

ABSL_FLAG(std::string, model_dir, "", "tiny model directory");
ABSL_FLAG(std::string, out, "", "output prefix; the rank is appended");
ABSL_FLAG(std::string, shard, "none", "none, optimizer or full (RunnerConfig::shard)");
ABSL_FLAG(bool, shard_base, false, "RunnerConfig::shard_base");
ABSL_FLAG(bool, prefetch_layers, true, "RunnerConfig::prefetch_layers");
ABSL_FLAG(int, rounds, 2, "train scenarios: each model's calls and step, this many times");
ABSL_FLAG(bool, step, true,
          "train scenarios: step after each round's calls (false: the calls alone, which read the "
          "weights as gathered)");
ABSL_FLAG(int, expert_parallel, 1, "RunnerConfig::expert_parallel");
ABSL_FLAG(double, router_aux_loss_coef, 0,
          "every call's loss_fn_config router_aux_loss_coef (a mixture of experts)");
ABSL_FLAG(bool, lora_attn, true,
          "the LoRA models adapt attention and the head too (false: the MLPs, or experts, alone)");
ABSL_FLAG(
    std::string, scenario, "train",
    "train, train_full (the full fine-tune alone), train_lora (a LoRA model alone), save, load, "
    "load_without_optimizer or export (train_lora's model exported merged to --checkpoint)");
ABSL_FLAG(bool, full_model, false, "save: a full fine-tune instead of a LoRA model");
ABSL_FLAG(std::string, checkpoint, "", "the checkpoint the save scenario writes and load reads");
ABSL_FLAG(std::string, broken, "none",
          "none, no_world_size_factor, reduce_twice, diverge_rank1 or gather_own_only");

namespace tinkerd::testing {
namespace {

int Run() {
  auto dist = DistConfigFromEnv();
  if (!dist.ok()) return 2;
  dist->timeout = std::chrono::seconds(60);
  InitLogging(dist->rank, spdlog::level::warn);
  const std::string broken = absl::GetFlag(FLAGS_broken);
  auto c10d = MakeC10dCollectives(*dist);
  if (!c10d.ok()) {
    std::fprintf(stderr, "%s\n", std::string(c10d.status().message()).c_str());
    return 3;
  }
  Faults faults;
  faults.forget_world_size_factor = broken == "no_world_size_factor";
  faults.reduce_twice = broken == "reduce_twice";
  faults.gather_own_only = broken == "gather_own_only";
  if (broken == "diverge_rank1" && dist->rank == 1) faults.perturb_at_reduction = 0;
  faults.drop_sent_row = broken == "drop_sent_row";
  auto collectives = std::make_shared<FaultyCollectives>(*c10d, faults);
  RunnerConfig rc;
  rc.base_model_path = absl::GetFlag(FLAGS_model_dir);
  rc.compute_dtype = ComputeDType::kFloat64;
  rc.micro_batch_tokens = 16;
  rc.num_threads = 1;
  rc.collectives = collectives;
  auto shard = ParseShardMode(absl::GetFlag(FLAGS_shard));
  if (!shard.ok()) return 2;
  rc.shard = *shard;
  rc.shard_base = absl::GetFlag(FLAGS_shard_base);
  rc.prefetch_layers = absl::GetFlag(FLAGS_prefetch_layers);
  rc.expert_parallel = absl::GetFlag(FLAGS_expert_parallel);
  auto runner = ModelRunner::Create(rc);
  if (!runner.ok()) {
    const std::string why(runner.status().message());
    std::fprintf(stderr, "rank %d: %s\n", dist->rank, why.c_str());
    return absl::StrContains(why, "same base model, compute dtype and shard mode") ? 8 : 4;
  }
  ModelRunner& r = **runner;

  std::vector<double> out;
  auto check = [&](const absl::Status& st) {
    if (!st.ok()) {
      std::fprintf(stderr, "rank %d: %s\n", dist->rank, std::string(st.message()).c_str());
      std::exit(5);
    }
  };
  AdamParams adam;
  adam.learning_rate = 1e-2;
  // One step's calls: every loss, strongly unequal lengths, calls with fewer datums than ranks,
  // top-K cross-entropy targets, and a stream fed in three chunks, packed under the budget as it
  // fills.
  const double aux = absl::GetFlag(FLAGS_router_aux_loss_coef);
  std::map<std::string, double> aux_cfg;
  if (aux > 0) aux_cfg["router_aux_loss_coef"] = aux;
  auto record = [&](const absl::StatusOr<ForwardBackwardResult>& fb) {
    check(fb.status());
    out.push_back(fb->metrics.at("loss:sum"));
    if (aux > 0) out.push_back(fb->metrics.at("router_aux_loss:sum"));
    out.push_back(fb->outputs.back().logprobs.back());  // outputs gathered in datum order
  };
  auto calls = [&](const std::string& id, SplitMix64& g) {
    for (const auto& [lengths, loss] :
         std::vector<std::pair<std::vector<int>, std::string>>{{{2, 31, 5, 17, 3}, "cross_entropy"},
                                                               {{9}, "ppo"},
                                                               {{4, 22}, "dro"},
                                                               {{7, 3}, "cispo"},
                                                               {{11, 5, 2}, "gspo"}}) {
      std::map<std::string, double> cfg = aux_cfg;
      if (loss == "dro") cfg["beta"] = 0.2;
      record(r.ForwardBackward(id, RandomData(g, lengths, loss, 128), loss, cfg));
    }
    record(r.ForwardBackward(id, RandomTopKData(g, {6, 14}, 3, 128), "cross_entropy", aux_cfg));
    auto sid = r.BeginStream(id, "importance_sampling", aux_cfg);
    check(sid.status());
    for (const auto& chunk :
         {std::vector<int>{6, 11}, std::vector<int>{1}, std::vector<int>{13, 2, 8}}) {
      check(r.StreamAppend(*sid, RandomData(g, chunk, "importance_sampling", 128)));
    }
    auto fs = r.FinishStream(*sid);
    check(fs.status());
    out.push_back(fs->metrics.at("loss:sum"));
    if (aux > 0) out.push_back(fs->metrics.at("router_aux_loss:sum"));
  };
  auto step = [&](const std::string& id) {
    auto os = r.OptimStep(id, adam);
    if (broken == "diverge_rank1") {
      const bool caught = !os.ok() && absl::StrContains(os.status().message(), "diverged");
      if (!caught)
        std::fprintf(stderr, "rank %d: the diverged replica went unnoticed\n", dist->rank);
      std::exit(caught ? 0 : 7);
    }
    check(os.status());
    out.push_back(os->grad_norm);
    out.push_back(static_cast<double>(os->num_tokens));
  };
  auto params = [&](const std::string& id) {
    for (double v : Flat(Snap(r, id, StateKind::kParams))) out.push_back(v);
  };
  CreateModelOptions lora;
  lora.seed = 3;
  const bool attn = absl::GetFlag(FLAGS_lora_attn);
  lora.lora = LoraConfig{4, 8, attn, true, attn};
  const std::string scenario = absl::GetFlag(FLAGS_scenario);
  const std::string checkpoint = absl::GetFlag(FLAGS_checkpoint);
  if (scenario == "export") {
    auto id = r.CreateModel(lora);
    check(id.status());
    SplitMix64 g(17);
    for (int i = 0; i < absl::GetFlag(FLAGS_rounds); ++i) {
      calls(*id, g);
      step(*id);
    }
    check(r.SaveWeightsForSampler(*id, checkpoint, /*merged=*/true, /*overwrite=*/false));
  } else if (scenario == "train" || scenario == "train_full" || scenario == "train_lora") {
    std::vector<CreateModelOptions> models;
    for (LossReduction mode : {LossReduction::kTokenMean, LossReduction::kSum,
                               LossReduction::kSeqMeanTokenMean, LossReduction::kSeqMeanTokenSum}) {
      if (scenario == "train_full") break;  // the full fine-tune alone
      models.push_back(lora);
      models.back().loss_reduction = mode;
      if (scenario == "train_lora") break;  // the token-mean LoRA model alone
    }
    if (scenario != "train_lora") {
      models.emplace_back();
      models.back().lora.reset();  // full fine-tuning, token mean
    }
    for (const CreateModelOptions& o : models) {
      auto id = r.CreateModel(o);
      check(id.status());
      SplitMix64 g(17);  // the same data on every rank, as the server's broadcast delivers it
      for (int i = 0; i < absl::GetFlag(FLAGS_rounds); ++i) {
        calls(*id, g);
        if (absl::GetFlag(FLAGS_step)) step(*id);
      }
      params(*id);
    }
  } else if (scenario == "train_joint") {
    // Three LoRA models' calls in shared passes (ModelRunner::ForwardBackwardJoint), each rank
    // running its share of every call.
    std::vector<std::string> ids;
    for (LossReduction mode :
         {LossReduction::kTokenMean, LossReduction::kSum, LossReduction::kSeqMeanTokenMean}) {
      CreateModelOptions o = lora;
      o.loss_reduction = mode;
      o.seed = 3 + ids.size();
      auto id = r.CreateModel(o);
      check(id.status());
      ids.push_back(*id);
    }
    const std::vector<std::pair<std::vector<int>, std::string>> shapes = {
        {{2, 31, 5, 17, 3}, "cross_entropy"}, {{9}, "ppo"}, {{11, 5, 2}, "gspo"}};
    SplitMix64 g(17);
    for (int round = 0; round < 2; ++round) {
      std::vector<Batch> batches;
      for (const auto& [lengths, loss] : shapes) {
        auto b = Batch::Check(RandomData(g, lengths, loss, 128), loss, {}, r.limits());
        check(b.status());
        batches.push_back(*std::move(b));
      }
      std::vector<ModelRunner::Call> joint;
      for (size_t k = 0; k < ids.size(); ++k) joint.push_back({ids[k], &batches[k]});
      for (const auto& fb : r.ForwardBackwardJoint(joint, /*backward=*/true)) record(fb);
      for (const std::string& id : ids) step(id);
    }
    for (const std::string& id : ids) params(id);
  } else if (scenario == "save" || absl::StartsWith(scenario, "load")) {
    std::string id;
    SplitMix64 g(17);
    if (scenario == "save") {
      CreateModelOptions full;
      full.lora.reset();
      auto created = r.CreateModel(absl::GetFlag(FLAGS_full_model) ? full : lora);
      check(created.status());
      id = *created;
      calls(id, g);
      step(id);
      calls(id, g);  // left accumulated
      SaveStateOptions so;
      so.include_accumulated = true;
      check(r.SaveState(id, checkpoint, so));
      out.clear();  // what follows is what a resumed run must reproduce
    } else {
      auto loaded = r.CreateModelFromState(checkpoint, scenario == "load");
      check(loaded.status());
      id = *loaded;
    }
    SplitMix64 later(29);
    calls(id, later);
    step(id);
    params(id);
  } else {
    return 2;
  }
  std::ofstream f(absl::GetFlag(FLAGS_out) + "." + std::to_string(dist->rank), std::ios::binary);
  f.write(reinterpret_cast<const char*>(out.data()),
          static_cast<std::streamsize>(out.size() * sizeof(double)));
  return f.good() ? 0 : 6;
}

}  // namespace
}  // namespace tinkerd::testing

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return tinkerd::testing::Run();
}
