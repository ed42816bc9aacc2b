// Several base models in one server (--base_model given again): a teacher beside the student, as
// on-policy distillation samples it. Each base computes with its own weights and is checked
// against its own limits; a model lives on the base it was made on, through its checkpoints too;
// the bases share one memory budget; and calls of models on different bases never share a pass.
#include <httplib.h>

#include <cmath>
#include <future>

#include "runner/model/weights.h"
#include "runner/util/memory_account.h"
#include "tests/e2e/e2e_util.h"

namespace tinkerd::testing {
namespace {

constexpr int64_t kTeacherVocab = 96;  // below the student's 128: the limits differ

ModelConfig TeacherConfig() {
  ModelConfig c = TinyConfig("qwen3");
  c.vocab_size = kTeacherVocab;
  return c;
}

// A server on loopback serving the tiny llama as "student" (the default) and a tiny qwen3 of
// another vocabulary as "teacher".
struct TwoBases {
  TempDir dir;
  std::string student_dir, teacher_dir;
  int64_t student_reserved = 0;  // the account's reservations before the teacher loaded
  std::unique_ptr<TinkerdServer> server;
  std::unique_ptr<v1::Tinkerd::Stub> stub;

  explicit TwoBases(ServerConfig sc = {}, ComputeDType dtype = ComputeDType::kFloat64) {
    student_dir = WriteModel(dir, TinyConfig("llama"), 1, "student");
    teacher_dir = WriteModel(dir, TeacherConfig(), 2, "teacher");
    sc.listen_address = "127.0.0.1:0";
    sc.checkpoint_root = dir.Sub("checkpoints");
    sc.tinker_http.served_model_name = "student";
    auto student = MakeRunner(student_dir, dtype);
    student_reserved = student->memory_account()->reserved();
    RunnerConfig rc = student->config();
    rc.base_model_path = teacher_dir;
    rc.account = student->memory_account();
    auto teacher = ModelRunner::Create(rc);
    EXPECT_TRUE(teacher.ok()) << teacher.status().message();
    std::vector<ServedRunner> more;
    more.push_back({"teacher", *std::move(teacher)});
    auto s = TinkerdServer::Start(sc, std::move(student), std::move(more));
    EXPECT_TRUE(s.ok()) << s.status().message();
    server = std::move(*s);
    stub = v1::Tinkerd::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(server->port()),
                                                    grpc::InsecureChannelCredentials()));
  }

  grpc::Status CreateModel(const std::string& base, uint64_t seed, v1::ModelInfo* info) {
    grpc::ClientContext ctx;
    v1::CreateModelRequest req;
    req.set_base_model(base);
    req.set_seed(seed);
    req.set_loss_reduction("sum");
    req.mutable_lora()->set_rank(4);
    req.mutable_lora()->set_alpha(8);
    req.mutable_lora()->set_train_attn(true);
    req.mutable_lora()->set_train_mlp(true);
    req.mutable_lora()->set_train_unembed(true);
    return stub->CreateModel(&ctx, req, info);
  }
  std::string Model(const std::string& base, uint64_t seed = 3) {
    v1::ModelInfo info;
    const grpc::Status st = CreateModel(base, seed, &info);
    EXPECT_TRUE(st.ok()) << st.error_message();
    return info.model_id();
  }
  grpc::Status FwdBwd(const v1::ForwardBackwardRequest& req, v1::ForwardBackwardOutput* out,
                      bool backward = true) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return backward ? stub->ForwardBackward(&ctx, req, out) : stub->Forward(&ctx, req, out);
  }
  grpc::Status Step(const std::string& model, int64_t seq, v1::OptimStepResponse* out) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::OptimStepRequest req;
    req.set_model_id(model);
    req.set_seq_id(seq);
    req.mutable_adam_params()->set_learning_rate(1e-2);
    return stub->OptimStep(&ctx, req, out);
  }
  // ComputeLogprobs of `tokens` through a sampler, a model or a base (by name).
  grpc::Status Logprobs(const std::string& sampler, const std::string& model,
                        const std::string& base, const std::vector<int64_t>& tokens,
                        std::vector<double>* out) {
    grpc::ClientContext ctx;
    v1::ComputeLogprobsRequest req;
    req.set_sampler_id(sampler);
    req.set_model_id(model);
    req.set_base_model(base);
    for (int64_t t : tokens)
      req.mutable_prompt()->add_chunks()->mutable_encoded_text()->add_tokens(t);
    v1::ComputeLogprobsResponse resp;
    const grpc::Status st = stub->ComputeLogprobs(&ctx, req, &resp);
    out->assign(resp.logprobs().begin(), resp.logprobs().end());
    return st;
  }
};

// A next-token datum over `tokens`, every target weighted 1.
Datum NextToken(const std::vector<int64_t>& tokens) {
  Datum d;
  d.tokens.assign(tokens.begin(), tokens.end() - 1);
  d.loss_fn_inputs["target_tokens"] = TensorData::Int64({tokens.begin() + 1, tokens.end()});
  d.loss_fn_inputs["weights"] = TensorData::Float32(std::vector<float>(d.tokens.size(), 1.f));
  return d;
}

std::vector<float> OutputLogprobs(const v1::ForwardBackwardOutput& out) {
  std::vector<float> logp;
  if (out.outputs_size() != 1) return logp;
  const std::string& bytes = out.outputs(0).logprobs().data();
  logp.resize(bytes.size() / 4);
  std::memcpy(logp.data(), bytes.data(), bytes.size());
  return logp;
}

// Position 0 has no logprob (NaN): compared from 1.
std::vector<double> Scored(const std::vector<double>& logprobs) {
  return logprobs.empty() ? logprobs : std::vector<double>(logprobs.begin() + 1, logprobs.end());
}

double MaxDiff(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0;
  for (size_t i = 1; i < std::min(a.size(), b.size()); ++i) d = std::max(d, std::abs(a[i] - b[i]));
  return d;
}

const std::vector<int64_t> kTokens = {5, 17, 3, 29, 41, 7, 13, 60};

TEST(Bases, ATeacherBesideTheStudentComputesWithItsOwnWeights) {
  TwoBases two;
  // The teacher's weights are held in the account the student's runner made, once each.
  auto teacher_weights = LoadSafetensorsDir(two.teacher_dir, at::kDouble);
  ASSERT_TRUE(teacher_weights.ok());
  int64_t teacher_bytes = 0;
  for (const auto& [name, w] : *teacher_weights) teacher_bytes += w.nbytes();
  EXPECT_EQ(two.server->runner()->memory_account()->reserved() - two.student_reserved,
            teacher_bytes);

  std::vector<double> teacher, student, by_default;
  ASSERT_TRUE(two.Logprobs("", "", "teacher", kTokens, &teacher).ok());
  ASSERT_TRUE(two.Logprobs("", "", "student", kTokens, &student).ok());
  ASSERT_TRUE(two.Logprobs("", "", "", kTokens, &by_default).ok());
  EXPECT_EQ(Scored(by_default), Scored(student)) << "the first base is the default";
  // The broken control: were both names served by one runner, these would be equal.
  EXPECT_GT(MaxDiff(teacher, student), 1e-3);

  // A fresh adapter adds nothing, so a model on the teacher computes the teacher's logprobs.
  v1::ModelInfo info;
  ASSERT_TRUE(two.CreateModel("teacher", 3, &info).ok());
  EXPECT_EQ(info.base_model(), two.teacher_dir);
  v1::ForwardBackwardOutput fwd;
  ASSERT_TRUE(two.FwdBwd(MakeRequest(info.model_id(), 1, {NextToken(kTokens)}), &fwd, false).ok());
  const std::vector<float> lp = OutputLogprobs(fwd);
  ASSERT_EQ(lp.size(), kTokens.size() - 1);
  for (size_t t = 1; t < kTokens.size(); ++t) {
    // float64 model, float32 on the Forward wire: within float32 rounding.
    EXPECT_NEAR(lp[t - 1], teacher[t], 1e-6 * std::max(1.0, std::abs(teacher[t])));
  }

  // A sampler of the teacher's base says so, and samples it.
  grpc::ClientContext ctx;
  v1::CreateSamplerRequest sreq;
  sreq.set_base_model("teacher");
  v1::SamplerInfo sampler;
  ASSERT_TRUE(two.stub->CreateSampler(&ctx, sreq, &sampler).ok());
  EXPECT_EQ(sampler.base_model(), "teacher");
  std::vector<double> through_sampler;
  ASSERT_TRUE(two.Logprobs(sampler.sampler_id(), "", "", kTokens, &through_sampler).ok());
  EXPECT_EQ(Scored(through_sampler), Scored(teacher));
}

TEST(Bases, EachBaseChecksRequestsAgainstItsOwnLimits) {
  TwoBases two;
  const std::string on_teacher = two.Model("teacher"), on_student = two.Model("student");
  // Token 100 is in the student's vocabulary (128), not in the teacher's (96).
  const std::vector<int64_t> wide = {5, 100, 7};
  v1::ForwardBackwardOutput out;
  grpc::Status st = two.FwdBwd(MakeRequest(on_teacher, 1, {NextToken(wide)}), &out);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_NE(st.error_message().find("outside [0, 96)"), std::string::npos) << st.error_message();
  st = two.FwdBwd(MakeRequest(on_student, 1, {NextToken(wide)}), &out);
  EXPECT_TRUE(st.ok()) << st.error_message();
  // A stream's datums too, each checked as it arrives against its model's base.
  for (const auto& [model, refused] : {std::pair{on_teacher, true}, std::pair{on_student, false}}) {
    grpc::ClientContext ctx;
    v1::ForwardBackwardOutput streamed;
    auto writer = two.stub->StreamForwardBackward(&ctx, &streamed);
    v1::StreamForwardBackwardMessage header;
    header.mutable_header()->set_model_id(model);
    header.mutable_header()->set_seq_id(2);  // after each model's call above
    header.mutable_header()->mutable_loss_fn()->set_name("cross_entropy");
    writer->Write(header);
    v1::StreamForwardBackwardMessage datum;
    *datum.mutable_datum() = ToProto(NextToken(wide));
    writer->Write(datum);
    writer->WritesDone();
    st = writer->Finish();
    if (refused) {
      EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
      EXPECT_NE(st.error_message().find("outside [0, 96)"), std::string::npos)
          << st.error_message();
    } else {
      EXPECT_TRUE(st.ok()) << st.error_message();
    }
  }
  std::vector<double> lp;
  st = two.Logprobs("", "", "teacher", wide, &lp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_TRUE(two.Logprobs("", "", "", wide, &lp).ok());

  // A base the server does not serve: refused, naming the field and the served names, and no
  // model is made.
  v1::ModelInfo info;
  st = two.CreateModel("no-such-base", 3, &info);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_NE(st.error_message().find("base_model"), std::string::npos) << st.error_message();
  EXPECT_NE(st.error_message().find("'teacher'"), std::string::npos) << st.error_message();
  grpc::ClientContext ctx;
  v1::ListModelsResponse listed;
  ASSERT_TRUE(two.stub->ListModels(&ctx, v1::ListModelsRequest(), &listed).ok());
  EXPECT_EQ(listed.models_size(), 2);
  st = two.Logprobs("", "", "no-such-base", kTokens, &lp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST(Bases, AModelOnTheTeacherTrainsAndComesBackFromItsCheckpointOnTheTeacher) {
  TwoBases two;
  const std::string model = two.Model("teacher");
  v1::ForwardBackwardOutput out;
  ASSERT_TRUE(two.FwdBwd(MakeRequest(model, 1, {NextToken(kTokens)}), &out).ok());
  v1::OptimStepResponse step;
  ASSERT_TRUE(two.Step(model, 2, &step).ok());
  EXPECT_GT(step.grad_norm(), 0);
  v1::ForwardBackwardOutput trained;
  ASSERT_TRUE(two.FwdBwd(MakeRequest(model, 3, {NextToken(kTokens)}), &trained, false).ok());
  EXPECT_NE(OutputLogprobs(trained), OutputLogprobs(out)) << "the step changed nothing";

  grpc::ClientContext save_ctx;
  v1::SaveStateRequest save;
  save.set_model_id(model);
  save.set_seq_id(4);
  save.set_name("after-one-step");
  v1::SaveStateResponse saved;
  grpc::Status st = two.stub->SaveState(&save_ctx, save, &saved);
  ASSERT_TRUE(st.ok()) << st.error_message();
  grpc::ClientContext load_ctx;
  v1::CreateModelFromStateRequest load;
  load.set_path(saved.path());
  load.set_with_optimizer(true);
  v1::ModelInfo loaded;
  st = two.stub->CreateModelFromState(&load_ctx, load, &loaded);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_EQ(loaded.base_model(), two.teacher_dir);
  v1::ForwardBackwardOutput again;
  ASSERT_TRUE(
      two.FwdBwd(MakeRequest(loaded.model_id(), 1, {NextToken(kTokens)}), &again, false).ok());
  EXPECT_EQ(OutputLogprobs(again), OutputLogprobs(trained));

  // Its sampler exports, in either layout, sample on the teacher once the model is gone too:
  // each records the fingerprint of the base it was made on.
  std::vector<std::string> exports;
  for (const bool merged : {false, true}) {
    grpc::ClientContext ctx;
    v1::SaveWeightsForSamplerRequest req;
    req.set_model_id(loaded.model_id());
    req.set_seq_id(merged ? 3 : 2);
    req.set_name(merged ? "merged" : "adapter");
    req.set_merged(merged);
    v1::SaveWeightsForSamplerResponse resp;
    st = two.stub->SaveWeightsForSampler(&ctx, req, &resp);
    ASSERT_TRUE(st.ok()) << st.error_message();
    exports.push_back(resp.path());
  }
  grpc::ClientContext gone_ctx;
  v1::ModelRef gone;
  gone.set_model_id(loaded.model_id());
  v1::DeleteModelResponse gone_resp;
  ASSERT_TRUE(two.stub->DeleteModel(&gone_ctx, gone, &gone_resp).ok());
  const std::vector<float> want = OutputLogprobs(trained);
  for (const std::string& path : exports) {
    grpc::ClientContext ctx;
    v1::CreateSamplerRequest sreq;
    sreq.set_path(path);
    v1::SamplerInfo sampler;
    st = two.stub->CreateSampler(&ctx, sreq, &sampler);
    ASSERT_TRUE(st.ok()) << path << ": " << st.error_message();
    EXPECT_EQ(sampler.base_model(), "teacher") << path;
    std::vector<double> lp;
    ASSERT_TRUE(two.Logprobs(sampler.sampler_id(), "", "", kTokens, &lp).ok());
    ASSERT_EQ(lp.size(), kTokens.size());
    for (size_t t = 1; t < kTokens.size(); ++t) {
      EXPECT_NEAR(lp[t], want[t - 1], 1e-6 * std::max(1.0, std::abs(lp[t]))) << path;
    }
  }

  // Deleted, the model is gone from its base.
  grpc::ClientContext del_ctx;
  v1::ModelRef ref;
  ref.set_model_id(model);
  v1::DeleteModelResponse deleted;
  ASSERT_TRUE(two.stub->DeleteModel(&del_ctx, ref, &deleted).ok());
  st = two.FwdBwd(MakeRequest(model, 5, {NextToken(kTokens)}), &out, false);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
}

// Models on both bases with every call in flight at once: the scheduler joins calls of one base
// only, and each model gets what it gets on a server that runs every call alone: bitwise in
// float32, or in float64 to 1e-12 relative on a CPU whose float32 products round by the rows
// (tests/e2e/shared_pass_test.cc derives the bound).
TEST(Bases, CallsOfModelsOnDifferentBasesNeverShareAPass) {
  ServerConfig shared_config, alone_config;
  shared_config.metrics_port = 0;
  shared_config.join_optim_steps = true;
  alone_config.scheduler.join_tokens = 0;
  const bool bitwise = !CpuFloat32RoundsByRows();
  const ComputeDType dtype = bitwise ? ComputeDType::kFloat32 : ComputeDType::kFloat64;
  auto agree = [bitwise](double got, double want) {
    return bitwise ? got == want : std::abs(got - want) <= 1e-12 * std::abs(want);
  };
  TwoBases shared(shared_config, dtype);
  TwoBases alone(alone_config, dtype);
  constexpr int kModels = 4;
  std::vector<std::string> on_shared, on_alone;
  for (int k = 0; k < kModels; ++k) {
    const std::string base = k % 2 ? "teacher" : "student";
    on_shared.push_back(shared.Model(base, 10 + k));
    on_alone.push_back(alone.Model(base, 10 + k));
  }
  SplitMix64 g(8);
  std::vector<std::vector<Datum>> data;
  for (int k = 0; k < kModels; ++k) data.push_back(RandomData(g, {6 + k, 9}, "cross_entropy", 96));
  std::vector<std::future<std::pair<grpc::Status, v1::ForwardBackwardOutput>>> fbs;
  std::vector<std::future<std::pair<grpc::Status, v1::OptimStepResponse>>> steps;
  for (int round = 0; round < 2; ++round) {
    for (int k = 0; k < kModels; ++k) {
      auto req = MakeRequest(on_shared[k], 2 * round + 1, data[k]);
      fbs.push_back(std::async(std::launch::async, [&shared, req] {
        v1::ForwardBackwardOutput out;
        grpc::Status st = shared.FwdBwd(req, &out);
        return std::make_pair(st, out);
      }));
      steps.push_back(std::async(std::launch::async, [&shared, &on_shared, k, round] {
        v1::OptimStepResponse out;
        grpc::Status st = shared.Step(on_shared[k], 2 * round + 2, &out);
        return std::make_pair(st, out);
      }));
    }
  }
  size_t i = 0;
  for (int round = 0; round < 2; ++round) {
    for (int k = 0; k < kModels; ++k, ++i) {
      auto [st, got] = fbs[i].get();
      ASSERT_TRUE(st.ok()) << st.error_message();
      v1::ForwardBackwardOutput want;
      ASSERT_TRUE(alone.FwdBwd(MakeRequest(on_alone[k], 2 * round + 1, data[k]), &want).ok());
      EXPECT_TRUE(agree(got.metrics().at("loss:sum"), want.metrics().at("loss:sum")))
          << "model " << k << " round " << round << ": " << got.metrics().at("loss:sum") << " vs "
          << want.metrics().at("loss:sum");
      auto [step_st, step] = steps[i].get();
      ASSERT_TRUE(step_st.ok()) << step_st.error_message();
      v1::OptimStepResponse want_step;
      ASSERT_TRUE(alone.Step(on_alone[k], 2 * round + 2, &want_step).ok());
      EXPECT_TRUE(agree(step.grad_norm(), want_step.grad_norm()))
          << "model " << k << " round " << round << ": " << step.grad_norm() << " vs "
          << want_step.grad_norm();
    }
  }
  httplib::Client c("127.0.0.1", shared.server->metrics_port());
  auto res = c.Get("/metrics");
  ASSERT_TRUE(res && res->status == 200);
  EXPECT_GT(CounterSum(res->body, "tinkerd_tenant_shared_jobs_total"), 0)
      << "no call shared a pass: the comparison was of solo runs only";
}

TEST(Bases, ServingIsRefusedWhereTheBasesWouldNotShareOneBudget) {
  TempDir dir;
  const std::string student_dir = WriteModel(dir, TinyConfig("llama"), 1, "student");
  const std::string teacher_dir = WriteModel(dir, TeacherConfig(), 2, "teacher");
  ServerConfig sc;
  sc.listen_address = "127.0.0.1:0";
  sc.checkpoint_root = dir.Sub("checkpoints");
  sc.tinker_http.served_model_name = "student";
  // A teacher with an account of its own would double the budget: refused.
  {
    std::vector<ServedRunner> more;
    more.push_back({"teacher", MakeRunner(teacher_dir)});
    auto s = TinkerdServer::Start(sc, MakeRunner(student_dir), std::move(more));
    ASSERT_FALSE(s.ok());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(s.status().message().find("memory account"), std::string::npos)
        << s.status().message();
  }
  // Two bases under one name: refused.
  {
    auto student = MakeRunner(student_dir);
    RunnerConfig rc = student->config();
    rc.base_model_path = teacher_dir;
    rc.account = student->memory_account();
    auto teacher = ModelRunner::Create(rc);
    ASSERT_TRUE(teacher.ok());
    std::vector<ServedRunner> more;
    more.push_back({"student", *std::move(teacher)});
    auto s = TinkerdServer::Start(sc, std::move(student), std::move(more));
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.status().message().find("two base models"), std::string::npos)
        << s.status().message();
  }
  // A teacher whose weights do not fit what the budget has left: its runner is not made.
  {
    auto student = MakeRunner(student_dir, ComputeDType::kFloat64, 4096, ShardMode::kNone,
                              /*memory_budget_bytes=*/4096);
    RunnerConfig rc = student->config();
    rc.base_model_path = teacher_dir;
    rc.account = student->memory_account();
    auto teacher = ModelRunner::Create(rc);
    ASSERT_FALSE(teacher.ok());
    EXPECT_EQ(teacher.status().code(), absl::StatusCode::kResourceExhausted);
    EXPECT_NE(teacher.status().message().find(teacher_dir), std::string::npos)
        << teacher.status().message();
    EXPECT_EQ(student->memory_account()->reserved(), 0) << "the refused base holds nothing";
  }
}

}  // namespace
}  // namespace tinkerd::testing
