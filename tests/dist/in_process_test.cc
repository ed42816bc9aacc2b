// Two data-parallel ranks in one process, on two threads over real c10d (Gloo on loopback): rank 0
// serves through ReplicatedRunner as the server does, rank 1 runs FollowerLoop, and rank 1's
// collectives go through the fault-injecting wrapper of faulty_collectives.h. A replica that
// diverges, or a follower that fails a command rank 0 completed, must stop the job (every later
// call UNAVAILABLE, the follower's loop ended with the reason); the same job without the fault is
// the control that must keep serving.
#include <thread>

#include "runner/dist/c10d_collectives.h"
#include "runner/dist/dist_config.h"
#include "runner/sample/policy.h"
#include "server/core/convert.h"
#include "server/core/replicated_runner.h"
#include "tests/e2e/e2e_util.h"
#include "tests/faulty_collectives.h"

namespace tinkerd::testing {
namespace {

struct RankOptions {
  Faults faults;
  int64_t memory_budget_bytes = 0;     // 0: half the machine's memory
  ShardMode shard = ShardMode::kNone;  // rank 0 takes rank 1's: the ranks must agree
};

std::unique_ptr<ModelRunner> MakeRank(const std::string& model, DistConfig dist,
                                      const RankOptions& o) {
  auto c10d = MakeC10dCollectives(dist);
  EXPECT_TRUE(c10d.ok()) << c10d.status().message();
  if (!c10d.ok()) return nullptr;
  RunnerConfig rc;
  rc.base_model_path = model;
  rc.compute_dtype = ComputeDType::kFloat64;
  rc.num_threads = 1;
  rc.memory_budget_bytes = o.memory_budget_bytes;
  rc.shard = o.shard;
  rc.collectives = std::make_shared<FaultyCollectives>(*c10d, o.faults);
  auto r = ModelRunner::Create(rc);
  EXPECT_TRUE(r.ok()) << r.status().message();
  return r.ok() ? std::move(*r) : nullptr;
}

// A job of two ranks; rank 1 follows on its own thread until shut down or broken.
class TwoRanks {
 public:
  TwoRanks(const std::string& model, const RankOptions& rank1) {
    DistConfig dist;
    dist.world_size = 2;
    dist.master_port = FreeLoopbackPort();
    dist.timeout = std::chrono::seconds(60);
    DistConfig dist1 = dist;
    dist1.rank = dist1.local_rank = 1;
    // Both ranks rendezvous at once: rank 0 hosts the store rank 1 connects to.
    std::thread follower([&] {
      runner1_ = MakeRank(model, dist1, rank1);
      if (runner1_ == nullptr) return;
      follower_ = std::thread([this] {
        follower_status_ =
            ReplicatedRunner::FollowerLoop(runner1_.get(), runner1_->config().collectives.get());
      });
    });
    RankOptions rank0;
    rank0.shard = rank1.shard;
    runner0_ = MakeRank(model, dist, rank0);
    follower.join();
    if (runner0_ != nullptr) {
      replicated_ =
          std::make_unique<ReplicatedRunner>(runner0_.get(), runner0_->config().collectives);
    }
  }
  ~TwoRanks() {
    if (replicated_ != nullptr) replicated_->Shutdown();
    if (follower_.joinable()) follower_.join();
  }
  bool ok() const { return replicated_ != nullptr && runner1_ != nullptr; }
  ReplicatedRunner& rank0() { return *replicated_; }
  // Waits for the follower's loop to end (after Shutdown, or on its own when broken).
  absl::Status FollowerEnd() {
    if (follower_.joinable()) follower_.join();
    return follower_status_;
  }

 private:
  std::unique_ptr<ModelRunner> runner0_, runner1_;
  std::unique_ptr<ReplicatedRunner> replicated_;
  std::thread follower_;
  absl::Status follower_status_;
};

// The datums of one forward_backward as a client sends them, and decoded as the edge does.
absl::StatusOr<ForwardBackwardResult> ForwardBackward(ReplicatedRunner& r, const std::string& id,
                                                      SplitMix64& g, const ModelLimits& limits) {
  v1::ForwardBackwardRequest req =
      MakeRequest(id, 0, RandomData(g, {7, 5, 9}, "cross_entropy", limits.vocab_size));
  absl::StatusOr<Batch> batch = BatchFromProto(req.data(), req.loss_fn(), limits);
  if (!batch.ok()) return batch.status();
  return r.ForwardBackward(std::move(req), *std::move(batch), /*backward=*/true);
}

// Creates a model, accumulates one batch and steps; the step's status.
absl::Status TrainOneStep(ReplicatedRunner& r) {
  v1::CreateModelRequest create;
  create.mutable_lora()->set_rank(4);
  create.mutable_lora()->set_alpha(8);
  create.mutable_lora()->set_train_attn(true);
  auto id = r.CreateModel(create);
  if (!id.ok()) return id.status();
  SplitMix64 g(7);
  auto fb = ForwardBackward(r, *id, g, r.local()->limits());
  if (!fb.ok()) return fb.status();
  v1::OptimStepRequest step;
  step.set_model_id(*id);
  step.mutable_adam_params()->set_learning_rate(1e-2);
  step.mutable_adam_params()->set_beta1(0.9);
  step.mutable_adam_params()->set_beta2(0.95);
  step.mutable_adam_params()->set_eps(1e-8);
  return r.OptimStep(step).status();
}

class InProcess : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    model_ = new std::string(WriteModel(*dir_, TinyConfig("llama")));
  }
  static void TearDownTestSuite() {
    delete model_;
    delete dir_;
  }
  static TempDir* dir_;
  static std::string* model_;
};
TempDir* InProcess::dir_ = nullptr;
std::string* InProcess::model_ = nullptr;

TEST_F(InProcess, HealthyReplicasTrainAndShutDownCleanly) {  // the control
  TwoRanks job(*model_, {});
  ASSERT_TRUE(job.ok());
  absl::Status st = TrainOneStep(job.rank0());
  EXPECT_TRUE(st.ok()) << st;
  EXPECT_TRUE(job.rank0().healthy());
  EXPECT_TRUE(job.rank0().Ping().ok());
  job.rank0().Shutdown();
  EXPECT_TRUE(job.FollowerEnd().ok());
}

TEST_F(InProcess, APerturbedReplicaStopsTheJobAtTheStep) {
  RankOptions rank1;
  rank1.faults.perturb_at_reduction = 0;  // rank 1's first reduced gradient is off by 1e-3
  TwoRanks job(*model_, rank1);
  ASSERT_TRUE(job.ok());
  absl::Status st = TrainOneStep(job.rank0());
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_NE(std::string(st.message()).find("diverged"), std::string::npos) << st;
  EXPECT_FALSE(job.rank0().healthy());
  EXPECT_EQ(job.rank0().Ping().code(), absl::StatusCode::kUnavailable);
  const absl::Status follower = job.FollowerEnd();
  EXPECT_FALSE(follower.ok());
  EXPECT_NE(std::string(follower.message()).find("diverged"), std::string::npos) << follower;
}

TEST_F(InProcess, AFollowerThatFailsACommandStopsTheJob) {
  RankOptions rank1;
  rank1.memory_budget_bytes = 1;  // rank 1 admits no model; rank 0 does
  TwoRanks job(*model_, rank1);
  ASSERT_TRUE(job.ok());
  v1::CreateModelRequest create;
  create.mutable_lora()->set_rank(4);
  create.mutable_lora()->set_alpha(8);
  create.mutable_lora()->set_train_attn(true);
  auto id = job.rank0().CreateModel(create);
  EXPECT_EQ(id.status().code(), absl::StatusCode::kUnavailable) << id.status();
  EXPECT_FALSE(job.rank0().healthy());
  const absl::Status follower = job.FollowerEnd();
  EXPECT_EQ(follower.code(), absl::StatusCode::kDataLoss) << follower;
  EXPECT_NE(std::string(follower.message()).find("RESOURCE_EXHAUSTED"), std::string::npos)
      << follower;
}

// A sharded full fine-tune's sampler copy is gathered by both ranks for rank 0, which alone keeps
// it. Where rank 0 has no room for the copy (the test fills its memory account) while rank 1 has
// room for the unit it gathers, the ranks agree to refuse before any gather: RESOURCE_EXHAUSTED
// naming the copy, and the job serves on. The control: once the room is back, the same freeze
// succeeds and equals the first.
TEST_F(InProcess, AFreezeRankZeroHasNoRoomForIsRefusedOnBothRanksAndTheJobServesOn) {
  RankOptions rank1;
  rank1.shard = ShardMode::kFull;
  TwoRanks job(*model_, rank1);
  ASSERT_TRUE(job.ok());
  v1::CreateModelRequest create;
  create.set_full_finetune(true);
  auto id = job.rank0().CreateModel(create);
  ASSERT_TRUE(id.ok()) << id.status();
  ASSERT_TRUE(job.rank0().local()->Gathers(*id));
  auto first = job.rank0().FreezePolicy(*id);
  ASSERT_TRUE(first.ok()) << first.status();
  ASSERT_NE(*first, nullptr);
  const int64_t copy = (*first)->bytes;
  ASSERT_GT(copy, 0);
  MemoryAccount& account = *job.rank0().local()->memory_account();
  {
    auto most = account.Reserve(account.capacity() - account.reserved() - copy / 2, "the test", "");
    ASSERT_TRUE(most.ok()) << most.status();
    auto refused = job.rank0().FreezePolicy(*id);
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
    EXPECT_NE(refused.status().message().find("the sampler's copy"), std::string::npos)
        << refused.status();
    EXPECT_TRUE(job.rank0().healthy());
    EXPECT_TRUE(job.rank0().Ping().ok());
  }
  SplitMix64 g(3);
  auto fb = ForwardBackward(job.rank0(), *id, g, job.rank0().local()->limits());
  EXPECT_TRUE(fb.ok()) << fb.status();
  auto again = job.rank0().FreezePolicy(*id);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_NE(*again, nullptr);
  EXPECT_TRUE(at::equal((*again)->weights.embed_VD, (*first)->weights.embed_VD));
  EXPECT_TRUE(at::equal((*again)->weights.layers.back().down_proj,
                        (*first)->weights.layers.back().down_proj));
  EXPECT_TRUE(job.rank0().healthy());
}

}  // namespace
}  // namespace tinkerd::testing
