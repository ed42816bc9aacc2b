// Data parallelism on real processes over Gloo (loopback): 2 and 3 ranks, replicas or with the
// optimizer state sharded over 1 to 4, must end where one process ends, for every loss and
// reduction mode, LoRA and full fine-tuning, with calls, streams, packing, top-K targets, unequal
// lengths and a rank that gets no datum; so must experts spread over the ranks. Deliberately
// broken reductions and dispatches must be caught.
//
// Tolerance: the runs differ only in how float64 sums are grouped (per rank, then all-reduced).
// As in accumulation_test.cc, that moves gradients by ~1e-11 relative; through two AdamW steps of
// lr 1e-2 parameters move by at most lr·(relative change)·(a few) ≈ 1e-12. kTol = 1e-9 absolute on
// parameters and losses of O(1)–O(100). The broken controls are off by O(1e-3) or more.
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "runner/dist/dist_config.h"
#include "runner/model/weights.h"
#include "tests/built_binary.h"
#include "tests/test_util.h"

namespace tinkerd::testing {
namespace {

constexpr double kTol = 1e-9;

// Runs `world` ranks of dist_worker with `flags` (and `rank1_flags` on rank 1) to completion,
// expecting each to exit with `exit_code`; returns each rank's output doubles.
std::vector<std::vector<double>> RunRanks(const std::string& model, const std::string& out,
                                          int world, std::vector<std::string> flags = {},
                                          const std::vector<std::string>& rank1_flags = {},
                                          int exit_code = 0) {
  const int port = FreeLoopbackPort();
  flags.insert(flags.begin(), {"dist_worker", "--model_dir=" + model, "--out=" + out});
  std::vector<pid_t> pids;
  const std::string worker = BuiltBinary(DIST_WORKER_BINARY);
  for (int rank = 0; rank < world; ++rank) {
    pid_t pid = fork();
    if (pid == 0) {
      SetLocalRankEnvironment(rank, world, port);
      if (rank == 1) flags.insert(flags.end(), rank1_flags.begin(), rank1_flags.end());
      std::vector<char*> argv;
      for (std::string& f : flags) argv.push_back(f.data());
      argv.push_back(nullptr);
      execv(worker.c_str(), argv.data());
      _exit(127);
    }
    pids.push_back(pid);
  }
  std::vector<std::vector<double>> results;
  for (int rank = 0; rank < world; ++rank) {
    int status = 0;
    waitpid(pids[rank], &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == exit_code)
        << "rank " << rank << " status " << status;
    std::ifstream f(out + "." + std::to_string(rank), std::ios::binary);
    std::vector<double> v;
    double x;
    while (f.read(reinterpret_cast<char*>(&x), sizeof(x))) v.push_back(x);
    results.push_back(std::move(v));
  }
  return results;
}

class DataParallel : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    model_ = new std::string(WriteModel(*dir_, TinyConfig("qwen3")));
    reference_ = new std::vector<double>(RunRanks(*model_, dir_->Sub("ref"), 1)[0]);
  }
  static void TearDownTestSuite() {
    delete reference_;
    delete model_;
    delete dir_;
  }
  static TempDir* dir_;
  static std::string* model_;
  static std::vector<double>* reference_;
};
TempDir* DataParallel::dir_ = nullptr;
std::string* DataParallel::model_ = nullptr;
std::vector<double>* DataParallel::reference_ = nullptr;

TEST_F(DataParallel, TwoAndThreeRanksEqualOneProcess) {
  ASSERT_GT(reference_->size(), 1000u);
  for (int world : {2, 3}) {
    auto ranks = RunRanks(*model_, dir_->Sub("w" + std::to_string(world)), world);
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(ranks[r].size(), reference_->size()) << "world " << world << " rank " << r;
      EXPECT_LE(MaxAbsDiff(ranks[r], *reference_), kTol) << "world " << world << " rank " << r;
      EXPECT_EQ(ranks[r], ranks[0]) << "ranks must hold identical replicas";
    }
  }
}

// Several LoRA models' calls in shared passes (runner/joint_call.h) under data parallelism: each
// rank plans every call's share as alone and commits the calls in order, so 2 and 3 ranks, and
// sharded optimizer state, end where one process ends.
TEST_F(DataParallel, SharedPassesOfSeveralModelsEqualOneProcess) {
  const auto reference = RunRanks(*model_, dir_->Sub("joint1"), 1, {"--scenario=train_joint"})[0];
  ASSERT_GT(reference.size(), 100u);
  for (const auto& [world, shard] :
       std::vector<std::pair<int, std::string>>{{2, "none"}, {3, "none"}, {2, "optimizer"}}) {
    auto ranks = RunRanks(*model_, dir_->Sub(absl::StrCat("joint", world, shard)), world,
                          {"--scenario=train_joint", "--shard=" + shard});
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(ranks[r].size(), reference.size()) << "world " << world << " rank " << r;
      EXPECT_LE(MaxAbsDiff(ranks[r], reference), kTol)
          << "world " << world << " " << shard << " rank " << r;
    }
  }
}

// A mixture of experts (Mixtral's layout) under data parallelism: its experts' adapters (LoRA)
// and, fully sharded, every expert and router weight end at 2 ranks where one process ends. Every
// rank routes its own tokens; the experts' gradients are reduced like any other. (Experts spread
// over the ranks: ExpertParallelEqualsOneProcess.)
TEST_F(DataParallel, AMixtureOfExpertsAtTwoRanksEqualsOneProcess) {
  TempDir moe;
  const std::string model = WriteModel(moe, TinyConfig("mixtral"));
  // The third: with the router's auxiliary loss, its layers recomputed from gathered weights.
  for (const std::vector<std::string>& flags :
       {std::vector<std::string>{}, std::vector<std::string>{"--scenario=train_full"},
        std::vector<std::string>{"--scenario=train_full", "--router_aux_loss_coef=0.5"}}) {
    const auto one = RunRanks(model, moe.Sub(absl::StrCat("one", flags.size())), 1, flags)[0];
    std::vector<std::string> sharded = flags;
    if (!flags.empty()) sharded.push_back("--shard=full");
    const auto two = RunRanks(model, moe.Sub(absl::StrCat("two", flags.size())), 2, sharded)[0];
    ASSERT_GT(one.size(), 100u);
    ASSERT_EQ(two.size(), one.size());
    EXPECT_LE(MaxAbsDiff(two, one), kTol) << absl::StrJoin(flags, " ");
  }
}

// Expert parallelism (runner/dist/expert_parallel.h): a Mixtral layout of 4 experts per layer
// spread over groups of E ranks, each rank holding 4 / E of them and its tokens travelling to them
// by all-to-all, ends where one process holding every expert ends: E = 2 and 4 (one group), and
// E = 2 at 4 ranks (two groups, each expert's gradient reduced over its two holders), for LoRA
// models in every reduction mode (each expert's adapter on its holder alone) and a full fine-tune
// (each expert's weights there), with calls that leave ranks only padding. The sums group
// otherwise than one process's: kTol. Every rank reports every expert (gathered), so all agree.
TEST_F(DataParallel, ExpertParallelEqualsOneProcess) {
  TempDir moe;
  const std::string model = WriteModel(moe, TinyConfig("mixtral"));
  const auto one = RunRanks(model, moe.Sub("one"), 1)[0];
  ASSERT_GT(one.size(), 100u);
  for (const auto& [world, E] : {std::pair{2, 2}, std::pair{4, 4}, std::pair{4, 2}}) {
    const auto ranks = RunRanks(model, moe.Sub(absl::StrCat("ep", world, E)), world,
                                {absl::StrCat("--expert_parallel=", E)});
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(ranks[r].size(), one.size()) << "world " << world << " E " << E << " rank " << r;
      EXPECT_LE(MaxAbsDiff(ranks[r], one), kTol)
          << "world " << world << " E " << E << " rank " << r;
      EXPECT_EQ(ranks[r], ranks[0]) << "world " << world << " E " << E << " rank " << r;
    }
  }
}

// The router's auxiliary loss (runner/loss/router_aux.h) on every call, streams included: each
// datum's routers are its own rank's, so expert parallelism changes nothing but the grouping of
// sums. E = 2 at 2 ranks, with one process as the reference; its reported value is compared too.
// Mixtral, and Qwen2-MoE, whose shared expert, which every token meets, is every rank's, like
// attention.
TEST_F(DataParallel, ExpertParallelWithTheRoutersLossEqualsOneProcess) {
  for (const char* family : {"mixtral", "qwen2_moe"}) {
    TempDir moe;
    const std::string model = WriteModel(moe, TinyConfig(family));
    const std::string aux = "--router_aux_loss_coef=0.5";
    const auto one = RunRanks(model, moe.Sub("one"), 1, {aux})[0];
    ASSERT_GT(one.size(), 100u) << family;
    const auto ranks = RunRanks(model, moe.Sub("ep22"), 2, {aux, "--expert_parallel=2"});
    for (int r = 0; r < 2; ++r) {
      ASSERT_EQ(ranks[r].size(), one.size()) << family << " rank " << r;
      EXPECT_LE(MaxAbsDiff(ranks[r], one), kTol) << family << " rank " << r;
    }
  }
}

// LoRA models that adapt the experts alone: nothing below a layer's experts trains, so a rank
// whose experts receive no rows (4 experts over 4 ranks, calls that leave ranks only a padding
// token) must still run the return exchange's backward its group waits in. They end where one
// process ends, as above.
TEST_F(DataParallel, ExpertParallelAdaptersOnExpertsAloneEqualOneProcess) {
  TempDir moe;
  const std::string model = WriteModel(moe, TinyConfig("mixtral"));
  const auto one = RunRanks(model, moe.Sub("one"), 1, {"--lora_attn=false"})[0];
  ASSERT_GT(one.size(), 100u);
  const auto ranks =
      RunRanks(model, moe.Sub("ep44"), 4, {"--lora_attn=false", "--expert_parallel=4"});
  for (int r = 0; r < 4; ++r) {
    ASSERT_EQ(ranks[r].size(), one.size()) << "rank " << r;
    EXPECT_LE(MaxAbsDiff(ranks[r], one), kTol) << "rank " << r;
  }
}

// The broken control: every all-to-all delivers the first row a rank sends as zeros (one token's
// slot dropped on its way to its expert, and its gradient on the way back).
TEST_F(DataParallel, AnExpertParallelDispatchThatDropsATokenIsCaught) {
  TempDir moe;
  const std::string model = WriteModel(moe, TinyConfig("mixtral"));
  const auto one = RunRanks(model, moe.Sub("one"), 1, {"--scenario=train_full"})[0];
  const auto dropped =
      RunRanks(model, moe.Sub("drop"), 2,
               {"--scenario=train_full", "--expert_parallel=2", "--broken=drop_sent_row"})[0];
  ASSERT_EQ(dropped.size(), one.size());
  EXPECT_GT(MaxAbsDiff(dropped, one), 1e3 * kTol);
}

// An expert-parallel full fine-tune's checkpoint holds every expert: saved mid-accumulation at
// 2 ranks with E = 2, it resumes at 1 process holding every expert, and at 4 ranks with E = 2
// (two groups: the accumulated expert gradients go to their first holders); a checkpoint of one
// process resumes at E = 2 likewise. The control: a resume without the moments ends elsewhere.
TEST_F(DataParallel, AnExpertParallelCheckpointResumesWithAnyExperts) {
  constexpr double kResumeTol = 1e-12;
  TempDir moe;
  const std::string model = WriteModel(moe, TinyConfig("mixtral"));
  const std::string ckpt = moe.Sub("ep_ckpt"), one_ckpt = moe.Sub("one_ckpt");
  const std::vector<std::string> full{"--full_model", "--checkpoint=" + ckpt};
  auto with = [](std::vector<std::string> flags, std::vector<std::string> more) {
    flags.insert(flags.end(), more.begin(), more.end());
    return flags;
  };
  const auto saved = RunRanks(model, moe.Sub("save2"), 2,
                              with(full, {"--expert_parallel=2", "--scenario=save"}))[0];
  ASSERT_GT(saved.size(), 100u);
  const auto one = RunRanks(model, moe.Sub("load1"), 1, with(full, {"--scenario=load"}))[0];
  const auto four = RunRanks(model, moe.Sub("load4"), 4,
                             with(full, {"--expert_parallel=2", "--scenario=load"}))[0];
  RunRanks(model, moe.Sub("save1"), 1,
           {"--full_model", "--scenario=save", "--checkpoint=" + one_ckpt});
  const auto from_one =
      RunRanks(model, moe.Sub("load2"), 2,
               {"--expert_parallel=2", "--scenario=load", "--checkpoint=" + one_ckpt})[0];
  for (const auto* resumed : {&one, &four, &from_one}) {
    ASSERT_EQ(resumed->size(), saved.size());
    EXPECT_LE(MaxAbsDiff(*resumed, saved), kResumeTol);
  }
  const auto fresh =
      RunRanks(model, moe.Sub("fresh2"), 2,
               with(full, {"--expert_parallel=2", "--scenario=load_without_optimizer"}))[0];
  ASSERT_EQ(fresh.size(), saved.size());
  EXPECT_GT(MaxAbsDiff(fresh, saved), 1e3 * kResumeTol);
}

TEST_F(DataParallel, ForgettingTheWorldSizeFactorIsCaught) {
  auto ranks = RunRanks(*model_, dir_->Sub("nofactor"), 2, {"--broken=no_world_size_factor"});
  ASSERT_EQ(ranks[0].size(), reference_->size());
  EXPECT_GT(MaxAbsDiff(ranks[0], *reference_), 1e3 * kTol);
}

// Rank 1's replica is perturbed at the first optimizer step (tests/faulty_collectives.h):
// every rank must fail that step with "diverged" (each worker exits 0 only then). The control is
// TwoAndThreeRanksEqualOneProcess, where the same comparison runs at every step and never fires.
TEST_F(DataParallel, ADivergedReplicaIsCaughtAtTheStep) {
  RunRanks(*model_, dir_->Sub("diverge"), 2, {"--broken=diverge_rank1"});
}

TEST_F(DataParallel, ReducingTheAccumulatorTwiceIsCaught) {
  auto ranks = RunRanks(*model_, dir_->Sub("twice"), 2, {"--broken=reduce_twice"});
  ASSERT_EQ(ranks[0].size(), reference_->size());
  EXPECT_GT(MaxAbsDiff(ranks[0], *reference_), 1e3 * kTol);
}

// --shard=optimizer (runner/dist/shard.h): each rank holds 1/W of the gradient sums and moments,
// reduce-scattered per call. W = 3 cuts the flat space unevenly. At W = 1 the shard is the whole
// state and every sum runs in the replica's order: bitwise. Otherwise the sums group differently
// (per call over ranks, instead of per rank over calls): kTol, derived above.
TEST_F(DataParallel, ShardedOptimizerStateEqualsOneProcess) {
  for (int world : {1, 2, 3, 4}) {
    auto ranks =
        RunRanks(*model_, dir_->Sub("shard" + std::to_string(world)), world, {"--shard=optimizer"});
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(ranks[r].size(), reference_->size()) << "world " << world << " rank " << r;
      if (world == 1) {
        EXPECT_EQ(ranks[r], *reference_);
      } else {
        EXPECT_LE(MaxAbsDiff(ranks[r], *reference_), kTol) << "world " << world << " rank " << r;
      }
      EXPECT_EQ(ranks[r], ranks[0]) << "ranks must hold identical parameters";
    }
  }
}

// --shard=full (runner/dist/param_shard.h): the full fine-tune keeps 1/W of its parameters as
// well, each decoder layer gathered while it runs and its gradient reduce-scattered as its
// backward ends; the ranks pad to the same number of micro-batches (calls here give some ranks
// none). The LoRA models shard their optimizer state as under --shard=optimizer. W = 3 cuts every
// unit unevenly; at W = 4 the calls of one or two datums leave two or three ranks only padding.
// The sums group otherwise than one process's (per micro-batch over ranks): kTol.
// The broken control, on the full fine-tune alone (the LoRA models' stepped slices are
// all-gathered too, and their replicas would be caught diverging first): every gather keeps this
// rank's slices alone. The LoRA models run every reduction mode, the full fine-tune token_mean.
TEST_F(DataParallel, FullyShardedParametersEqualOneProcess) {
  for (int world : {1, 2, 3, 4}) {
    auto ranks =
        RunRanks(*model_, dir_->Sub("full" + std::to_string(world)), world, {"--shard=full"});
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(ranks[r].size(), reference_->size()) << "world " << world << " rank " << r;
      EXPECT_LE(MaxAbsDiff(ranks[r], *reference_), kTol) << "world " << world << " rank " << r;
      EXPECT_EQ(ranks[r], ranks[0]) << "ranks must gather identical parameters";
    }
  }
  const auto alone = RunRanks(*model_, dir_->Sub("full_ref"), 1, {"--scenario=train_full"})[0];
  const auto own =
      RunRanks(*model_, dir_->Sub("full_own"), 2,
               {"--shard=full", "--scenario=train_full", "--broken=gather_own_only"})[0];
  ASSERT_GT(alone.size(), 100u);
  ASSERT_EQ(own.size(), alone.size());
  // The first call's loss and logprob, before any step: what the gathered weights computed (the
  // parameters recorded at the end are gathered by the broken collective too).
  EXPECT_GT(std::abs(own[0] - alone[0]), 1e3 * kTol);
  EXPECT_GT(std::abs(own[1] - alone[1]), 1e3 * kTol);
  // Other units: an untied head (the rest unit's third tensor) and layers without q/k norms
  // (llama, at W = 3), and layers with biases (qwen2, at W = 2).
  for (const auto& [family, world] : {std::pair{"llama", 3}, std::pair{"qwen2", 2}}) {
    TempDir other;
    const std::string model = WriteModel(other, TinyConfig(family));
    const auto one = RunRanks(model, other.Sub("ref"), 1, {"--scenario=train_full"})[0];
    const auto sharded =
        RunRanks(model, other.Sub("full"), world, {"--shard=full", "--scenario=train_full"})[0];
    ASSERT_GT(one.size(), 100u) << family;
    ASSERT_EQ(sharded.size(), one.size()) << family;
    EXPECT_LE(MaxAbsDiff(sharded, one), kTol) << family;
  }
}

// A fully sharded full fine-tune's checkpoint is gathered into the unsharded layout: saved
// mid-accumulation at W = 4, it resumes bitwise at W = 4 (each rank takes back exactly its
// slices), and within kResumeTol (AShardedCheckpointResumesAtAnyWorldSize's) at W = 2 sharded and
// at W = 1 as a replica; a replica's checkpoint resumes sharded at W = 2 likewise, and one of
// --shard=optimizer saved at W = 4 at W = 3. The control: a resume without the moments ends
// elsewhere.
TEST_F(DataParallel, AFullyShardedCheckpointResumesAtAnyWorldSize) {
  constexpr double kResumeTol = 1e-12;
  const std::string ckpt = dir_->Sub("full_ckpt"), replica_ckpt = dir_->Sub("replica_ckpt");
  const std::vector<std::string> full{"--shard=full", "--full_model"};
  auto with = [](std::vector<std::string> flags, std::vector<std::string> more) {
    flags.insert(flags.end(), more.begin(), more.end());
    return flags;
  };
  auto saved = RunRanks(*model_, dir_->Sub("fsave4"), 4,
                        with(full, {"--scenario=save", "--checkpoint=" + ckpt}))[0];
  ASSERT_GT(saved.size(), 100u);
  EXPECT_EQ(RunRanks(*model_, dir_->Sub("fload4"), 4,
                     with(full, {"--scenario=load", "--checkpoint=" + ckpt}))[0],
            saved);
  const auto two = RunRanks(*model_, dir_->Sub("fload2"), 2,
                            with(full, {"--scenario=load", "--checkpoint=" + ckpt}))[0];
  const auto one =
      RunRanks(*model_, dir_->Sub("fload1"), 1, {"--scenario=load", "--checkpoint=" + ckpt})[0];
  RunRanks(*model_, dir_->Sub("rsave1"), 1,
           {"--full_model", "--scenario=save", "--checkpoint=" + replica_ckpt});
  const auto from_replica =
      RunRanks(*model_, dir_->Sub("rload2"), 2,
               with(full, {"--scenario=load", "--checkpoint=" + replica_ckpt}))[0];
  for (const auto* resumed : {&two, &one, &from_replica}) {
    ASSERT_EQ(resumed->size(), saved.size());
    EXPECT_LE(MaxAbsDiff(*resumed, saved), kResumeTol);
  }
  // A checkpoint of sharded optimizer state (flat per-rank files, cut at N = 4 where tensors
  // span files) resumes under --shard=full at N = 3, each rank reading its slices in parts.
  const std::string opt_ckpt = dir_->Sub("opt_full_ckpt");
  const auto opt_saved = RunRanks(
      *model_, dir_->Sub("osave4"), 4,
      {"--shard=optimizer", "--full_model", "--scenario=save", "--checkpoint=" + opt_ckpt})[0];
  const auto from_optimizer =
      RunRanks(*model_, dir_->Sub("oload3"), 3,
               with(full, {"--scenario=load", "--checkpoint=" + opt_ckpt}))[0];
  ASSERT_EQ(from_optimizer.size(), opt_saved.size());
  EXPECT_LE(MaxAbsDiff(from_optimizer, opt_saved), kResumeTol);
  const auto fresh =
      RunRanks(*model_, dir_->Sub("ffresh2"), 2,
               with(full, {"--scenario=load_without_optimizer", "--checkpoint=" + ckpt}))[0];
  ASSERT_EQ(fresh.size(), saved.size());
  EXPECT_GT(MaxAbsDiff(fresh, saved), 1e3 * kResumeTol);
}

// --shard_base: the frozen base too is held in slices, read a tensor at a time, and every call
// of every model gathers its units as a fully sharded full fine-tune does (its pairs' gradients
// alone are made); a full fine-tune starts from the base's own slices. At W = 1..4 the LoRA
// models (every reduction mode) and the full fine-tune end where one process with the base whole
// ends: kTol, as above (W = 1 runs the same sums as the replica, but through gathered layers,
// each recomputed). Also: an untied head and no q/k norms (llama, W = 3), biases (qwen2, W = 2),
// experts (mixtral, W = 2); a LoRA checkpoint saved on a sharded base at W = 3 resumes on a
// replica (the same base fingerprint, computed from tensors no rank keeps whole) within
// kResumeTol (AShardedCheckpointResumesAtAnyWorldSize's). The broken control (calls without
// steps): every gather keeps this rank's slices alone, so the first call's loss reads a base of
// zeros elsewhere.
TEST_F(DataParallel, AShardedBaseTrainsAsOneProcess) {
  const std::vector<std::string> base{"--shard=full", "--shard_base"};
  auto with = [](std::vector<std::string> flags, std::vector<std::string> more) {
    flags.insert(flags.end(), more.begin(), more.end());
    return flags;
  };
  for (int world : {1, 2, 3, 4}) {
    auto ranks = RunRanks(*model_, dir_->Sub("base" + std::to_string(world)), world, base);
    for (int r = 0; r < world; ++r) {
      ASSERT_EQ(ranks[r].size(), reference_->size()) << "world " << world << " rank " << r;
      EXPECT_LE(MaxAbsDiff(ranks[r], *reference_), kTol) << "world " << world << " rank " << r;
      EXPECT_EQ(ranks[r], ranks[0]) << "ranks must hold identical parameters";
    }
  }
  for (const auto& [family, world] :
       {std::pair{"llama", 3}, std::pair{"qwen2", 2}, std::pair{"mixtral", 2}}) {
    TempDir other;
    const std::string model = WriteModel(other, TinyConfig(family));
    const auto one = RunRanks(model, other.Sub("ref"), 1, {"--scenario=train_lora"})[0];
    const auto sharded =
        RunRanks(model, other.Sub("base"), world, with(base, {"--scenario=train_lora"}))[0];
    ASSERT_GT(one.size(), 50u) << family;
    ASSERT_EQ(sharded.size(), one.size()) << family;
    EXPECT_LE(MaxAbsDiff(sharded, one), kTol) << family;
  }
  constexpr double kResumeTol = 1e-12;
  const std::string ckpt = dir_->Sub("base_ckpt");
  const auto saved = RunRanks(*model_, dir_->Sub("bsave3"), 3,
                              with(base, {"--scenario=save", "--checkpoint=" + ckpt}))[0];
  const auto resumed =
      RunRanks(*model_, dir_->Sub("bload1"), 1, {"--scenario=load", "--checkpoint=" + ckpt})[0];
  ASSERT_GT(saved.size(), 50u);
  ASSERT_EQ(resumed.size(), saved.size());
  EXPECT_LE(MaxAbsDiff(resumed, saved), kResumeTol);
  const auto alone =
      RunRanks(*model_, dir_->Sub("lora_ref"), 1, {"--scenario=train_lora", "--nostep"})[0];
  // Without steps: a step's broken all-gather of the LoRA slices would be caught as diverged.
  const auto own =
      RunRanks(*model_, dir_->Sub("lora_own"), 2,
               with(base, {"--scenario=train_lora", "--nostep", "--broken=gather_own_only"}))[0];
  ASSERT_GT(alone.size(), 50u);
  ASSERT_EQ(own.size(), alone.size());
  EXPECT_GT(std::abs(own[0] - alone[0]), 1e3 * kTol);
  EXPECT_GT(std::abs(own[1] - alone[1]), 1e3 * kTol);
}

// A LoRA model's merged export on a sharded base (every rank gathers the base a unit at a time,
// and rank 0 merges each weight as its file reaches it) holds what the same model's export on the
// base whole holds, at W = 2 and 3: the same tensors, the tied head untied (lm_head.weight, the
// embedding merged with the head's pair), the same config.json, each tensor within kTol (the
// training's sums grouped by rank, as above). The control: every adapted weight is off the
// base's by far more than kTol, every other one equals it, so an export that dropped or
// misplaced a merge, or wrote a unit's slices alone, could not pass.
TEST_F(DataParallel, AMergedExportOnAShardedBaseEqualsOneProcess) {
  auto read = [](const std::string& dir) {
    auto t = LoadSafetensorsFile(dir + "/model.safetensors", at::kDouble);
    EXPECT_TRUE(t.ok()) << dir << ": " << t.status();
    return t.ok() ? *std::move(t) : TensorMap{};
  };
  auto text = [](const std::string& path) {
    std::ifstream f(path);
    return std::string(std::istreambuf_iterator<char>(f), {});
  };
  auto off = [](const at::Tensor& a, const at::Tensor& b) {
    return (a - b).abs().max().item<double>();
  };
  const std::string whole = dir_->Sub("export_whole");
  RunRanks(*model_, dir_->Sub("ewhole"), 1, {"--scenario=export", "--checkpoint=" + whole});
  const TensorMap want = read(whole), base = read(*model_);
  ASSERT_TRUE(want.count("lm_head.weight")) << "the adapted head of a tied base is untied";
  ASSERT_FALSE(base.count("lm_head.weight"));
  for (int world : {2, 3}) {
    const std::string sharded = dir_->Sub("export_base" + std::to_string(world));
    RunRanks(*model_, dir_->Sub("ebase" + std::to_string(world)), world,
             {"--shard=full", "--shard_base", "--scenario=export", "--checkpoint=" + sharded});
    const TensorMap got = read(sharded);
    ASSERT_EQ(got.size(), want.size()) << "world " << world;
    for (const auto& [name, w] : want) {
      ASSERT_TRUE(got.count(name)) << name;
      ASSERT_EQ(got.at(name).sizes(), w.sizes()) << name;
      EXPECT_LE(off(got.at(name), w), kTol) << name << " world " << world;
    }
    EXPECT_EQ(text(sharded + "/config.json"), text(whole + "/config.json"));
  }
  for (const auto& [name, w] : want) {
    const at::Tensor& b = base.at(name == "lm_head.weight" ? "model.embed_tokens.weight" : name);
    const bool adapted = absl::StrContains(name, "_proj.") || name == "lm_head.weight";
    if (adapted) {
      EXPECT_GT(off(w, b), 1e3 * kTol) << name;
    } else {
      EXPECT_EQ(off(w, b), 0) << name;
    }
  }
}

// The next layer's gather run ahead on a group of its own (--prefetch_layers, the default) moves
// no bit: the same gathers, reductions and steps as each layer gathered when it runs, for a full
// fine-tune sharded at W = 3 (uneven slices) and LoRA on a sharded base at W = 2. The control is
// that the runs compared train (AShardedBaseTrainsAsOneProcess: they end within kTol of one
// process, not at their start).
TEST_F(DataParallel, PrefetchedGathersMoveNoBit) {
  for (const auto& [world, flags] :
       {std::pair{3, std::vector<std::string>{"--shard=full", "--scenario=train_full"}},
        std::pair{2, std::vector<std::string>{"--shard=full", "--shard_base",
                                              "--scenario=train_lora"}}}) {
    auto serial = flags;
    serial.push_back("--noprefetch_layers");
    const auto ahead = RunRanks(*model_, dir_->Sub("ahead"), world, flags)[0];
    const auto when = RunRanks(*model_, dir_->Sub("when"), world, serial)[0];
    ASSERT_GT(ahead.size(), 50u) << world;
    EXPECT_EQ(ahead, when) << world;
  }
}

// Without --shard=full a sharded base is refused before anything loads (the worker exits 4 on a
// runner that fails to start); the control is the test above, where the same flag starts.
TEST_F(DataParallel, AShardedBaseNeedsFullSharding) {
  RunRanks(*model_, dir_->Sub("base_opt"), 2, {"--shard=optimizer", "--shard_base"}, {},
           /*exit_code=*/4);
}

// Ranks that split the state differently would issue different collectives: the job refuses to
// start: each rank's runner fails naming what differs (the worker exits 8 on that message only).
// The control is every test above, where the same comparison passes.
TEST_F(DataParallel, RanksWithAnotherShardModeRefuseToStart) {
  RunRanks(*model_, dir_->Sub("mixed"), 2, {}, {"--shard=optimizer"}, /*exit_code=*/8);
}

// The broken control of the sharded path: each call's gradient reduce-scattered into its shard
// twice.
TEST_F(DataParallel, ReduceScatteringTwiceIsCaught) {
  auto ranks =
      RunRanks(*model_, dir_->Sub("rs_twice"), 2, {"--shard=optimizer", "--broken=reduce_twice"});
  ASSERT_EQ(ranks[0].size(), reference_->size());
  EXPECT_GT(MaxAbsDiff(ranks[0], *reference_), 1e3 * kTol);
}

// A checkpoint saved mid-accumulation at W = 4 with sharded state resumes: bitwise at W = 4 (each
// rank takes back exactly its slices), and to rounding at W = 2 sharded and at W = 1 as a
// replica (the gradient sum is the global one; kResumeTol: one step's sums grouped otherwise,
// ~1e-15 relative on O(1) values through one AdamW step).
TEST_F(DataParallel, AShardedCheckpointResumesAtAnyWorldSize) {
  constexpr double kResumeTol = 1e-12;
  const std::string ckpt = dir_->Sub("sharded_ckpt");
  auto saved = RunRanks(*model_, dir_->Sub("save4"), 4,
                        {"--shard=optimizer", "--scenario=save", "--checkpoint=" + ckpt});
  ASSERT_GT(saved[0].size(), 100u);
  auto same = RunRanks(*model_, dir_->Sub("load4"), 4,
                       {"--shard=optimizer", "--scenario=load", "--checkpoint=" + ckpt});
  EXPECT_EQ(same[0], saved[0]);
  auto two = RunRanks(*model_, dir_->Sub("load2"), 2,
                      {"--shard=optimizer", "--scenario=load", "--checkpoint=" + ckpt});
  auto one = RunRanks(*model_, dir_->Sub("load1"), 1, {"--scenario=load", "--checkpoint=" + ckpt});
  for (const auto* resumed : {&two[0], &one[0]}) {
    ASSERT_EQ(resumed->size(), saved[0].size());
    EXPECT_LE(MaxAbsDiff(*resumed, saved[0]), kResumeTol);
  }
  // The control: a resume that leaves the moments behind ends elsewhere.
  auto fresh = RunRanks(*model_, dir_->Sub("fresh1"), 1,
                        {"--scenario=load_without_optimizer", "--checkpoint=" + ckpt});
  ASSERT_EQ(fresh[0].size(), saved[0].size());
  EXPECT_GT(MaxAbsDiff(fresh[0], saved[0]), 1e3 * kResumeTol);
}

}  // namespace
}  // namespace tinkerd::testing
