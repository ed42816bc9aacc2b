// Batched multi-adapter training on the real server: the calls of many models, queued together,
// run in shared passes over the base (--join_tokens), their optim_steps in shared AdamW calls
// (--join_optim_steps), and each model's results and state equal
// those of the same requests on a server that runs every call alone (--join_tokens=0), bitwise
// in float32 (tests/numerics/joint_call_test.cc says why).
#include <httplib.h>

#include <future>

#include "tests/e2e/e2e_util.h"

namespace tinkerd::testing {
namespace {

TEST(SharedPass, EachModelGetsWhatItGetsOnAServerThatRunsCallsAlone) {
  ServerConfig shared_config, alone_config;
  shared_config.metrics_port = 0;
  shared_config.join_optim_steps = true;
  alone_config.scheduler.join_tokens = 0;
  LiveServer shared(shared_config, /*micro_batch_tokens=*/48, ComputeDType::kFloat32);
  LiveServer alone(alone_config, /*micro_batch_tokens=*/48, ComputeDType::kFloat32);
  constexpr int kModels = 6, kRounds = 3;
  const std::vector<std::string> losses = {"cross_entropy", "ppo", "importance_sampling"};
  std::vector<std::string> on_shared, on_alone;
  for (int k = 0; k < kModels; ++k) {
    on_shared.push_back(shared.CreateModel(k % 2 ? "sum" : "token_mean", 10 + k));
    on_alone.push_back(alone.CreateModel(k % 2 ? "sum" : "token_mean", 10 + k));
  }
  // Per model and round: a forward_backward (seq 2r+1) and an optim_step (seq 2r+2).
  SplitMix64 g(8);
  std::vector<std::vector<std::vector<Datum>>> data(kModels);
  for (int k = 0; k < kModels; ++k) {
    for (int r = 0; r < kRounds; ++r) {
      data[k].push_back(RandomData(g, {5 + 3 * k, 9 + r}, losses[k % 3], 128));
    }
  }
  // On the shared server every request is in flight at once, so calls queue behind each other
  // and the scheduler joins them; on the other, each runs alone, one after another.
  std::vector<std::future<std::pair<grpc::Status, v1::ForwardBackwardOutput>>> fbs;
  std::vector<std::future<std::pair<grpc::Status, v1::OptimStepResponse>>> steps;
  for (int r = 0; r < kRounds; ++r) {
    for (int k = 0; k < kModels; ++k) {
      auto req = MakeRequest(on_shared[k], 2 * r + 1, data[k][r], losses[k % 3]);
      fbs.push_back(std::async(std::launch::async, [&shared, req] {
        v1::ForwardBackwardOutput out;
        grpc::Status st = shared.FwdBwd(req, &out);
        return std::make_pair(st, out);
      }));
      steps.push_back(std::async(std::launch::async, [&shared, &on_shared, k, r] {
        v1::OptimStepResponse out;
        grpc::Status st = shared.Optim(on_shared[k], 2 * r + 2, &out);
        return std::make_pair(st, out);
      }));
    }
  }
  size_t i = 0;
  for (int r = 0; r < kRounds; ++r) {
    for (int k = 0; k < kModels; ++k, ++i) {
      auto [st, got] = fbs[i].get();
      ASSERT_TRUE(st.ok()) << st.error_message();
      v1::ForwardBackwardOutput want;
      ASSERT_TRUE(
          alone.FwdBwd(MakeRequest(on_alone[k], 2 * r + 1, data[k][r], losses[k % 3]), &want).ok());
      EXPECT_EQ(got.metrics().at("loss:sum"), want.metrics().at("loss:sum"));
      ASSERT_EQ(got.outputs_size(), want.outputs_size());
      for (int o = 0; o < got.outputs_size(); ++o) {
        EXPECT_EQ(got.outputs(o).logprobs().data(), want.outputs(o).logprobs().data())
            << "model " << k << " round " << r << " output " << o;
      }
      auto [step_st, step] = steps[i].get();
      ASSERT_TRUE(step_st.ok()) << step_st.error_message();
      v1::OptimStepResponse want_step;
      ASSERT_TRUE(alone.Optim(on_alone[k], 2 * r + 2, &want_step).ok());
      EXPECT_EQ(step.grad_norm(), want_step.grad_norm()) << "model " << k << " round " << r;
    }
  }
  for (int k = 0; k < kModels; ++k) {
    EXPECT_EQ(shared.StateChecksum(on_shared[k]), alone.StateChecksum(on_alone[k]))
        << "model " << k;
  }
  // The comparison saw shared passes: the scheduler counted calls that ran beside others.
  httplib::Client c("127.0.0.1", shared.server->metrics_port());
  auto res = c.Get("/metrics");
  ASSERT_TRUE(res && res->status == 200);
  EXPECT_GT(CounterSum(res->body, "tinkerd_tenant_shared_jobs_total"), 0)
      << "no call shared a pass: the comparison was of solo runs only";
}

}  // namespace
}  // namespace tinkerd::testing
