// Batched multi-adapter training on the real server: the calls of many models, queued together,
// run in shared passes over the base (--join_tokens), their optim_steps in shared AdamW calls
// (--join_optim_steps), and each model's results and state equal
// those of the same requests on a server that runs every call alone (--join_tokens=0), bitwise
// in float32 (tests/numerics/joint_call_test.cc says why). On a CPU whose float32 gradients round
// by the rows (CpuFloat32RoundsByRows: one without Gemv) both servers run in float64 instead, and
// agree to 1e-12 relative: a float64 sum of the tiny model's at most K = 128 products is within
// K·2^-53 ≈ 1.4e-14 relative of itself in any order the BLAS adds it, and the layers, the head and
// three AdamW steps compound that by far less than the 70× left. The outputs' float32 wire values
// then agree to one float32 ulp besides (2^-23 relative at most: two float64 values that close may
// round to neighbouring floats).
#include <httplib.h>

#include <cmath>
#include <cstring>
#include <future>

#include "tests/e2e/e2e_util.h"

namespace tinkerd::testing {
namespace {

TEST(SharedPass, EachModelGetsWhatItGetsOnAServerThatRunsCallsAlone) {
  ServerConfig shared_config, alone_config;
  shared_config.metrics_port = 0;
  shared_config.join_optim_steps = true;
  alone_config.scheduler.join_tokens = 0;
  const bool bitwise = !CpuFloat32RoundsByRows();
  const ComputeDType dtype = bitwise ? ComputeDType::kFloat32 : ComputeDType::kFloat64;
  LiveServer shared(shared_config, /*micro_batch_tokens=*/48, dtype);
  LiveServer alone(alone_config, /*micro_batch_tokens=*/48, dtype);
  // |got - want| within `rel` of |want|: 0 where the products are row-invariant.
  auto agree = [bitwise](double got, double want, double rel) {
    return bitwise ? got == want : std::abs(got - want) <= rel * std::abs(want);
  };
  auto floats = [](const std::string& bytes) {
    std::vector<float> v(bytes.size() / sizeof(float));
    std::memcpy(v.data(), bytes.data(), v.size() * sizeof(float));
    return v;
  };
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
      EXPECT_TRUE(agree(got.metrics().at("loss:sum"), want.metrics().at("loss:sum"), 1e-12))
          << got.metrics().at("loss:sum") << " vs " << want.metrics().at("loss:sum");
      ASSERT_EQ(got.outputs_size(), want.outputs_size());
      for (int o = 0; o < got.outputs_size(); ++o) {
        const std::vector<float> a = floats(got.outputs(o).logprobs().data()),
                                 b = floats(want.outputs(o).logprobs().data());
        ASSERT_EQ(a.size(), b.size());
        for (size_t t = 0; t < a.size(); ++t) {
          EXPECT_TRUE(agree(a[t], b[t], 1e-12 + 0x1p-23))
              << "model " << k << " round " << r << " output " << o << " token " << t << ": "
              << a[t] << " vs " << b[t];
        }
      }
      auto [step_st, step] = steps[i].get();
      ASSERT_TRUE(step_st.ok()) << step_st.error_message();
      v1::OptimStepResponse want_step;
      ASSERT_TRUE(alone.Optim(on_alone[k], 2 * r + 2, &want_step).ok());
      EXPECT_TRUE(agree(step.grad_norm(), want_step.grad_norm(), 1e-12))
          << "model " << k << " round " << r << ": " << step.grad_norm() << " vs "
          << want_step.grad_norm();
    }
  }
  for (int k = 0; k < kModels; ++k) {
    const std::vector<double> a = shared.StateChecksum(on_shared[k]),
                              b = alone.StateChecksum(on_alone[k]);
    ASSERT_EQ(a.size(), b.size());
    double scale = 0;
    for (double x : b) scale = std::max(scale, std::abs(x));
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_TRUE(bitwise ? a[i] == b[i] : std::abs(a[i] - b[i]) <= 1e-12 * scale)
          << "model " << k << " state value " << i << ": " << a[i] << " vs " << b[i];
    }
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
