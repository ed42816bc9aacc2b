// API keys and tenants over the wire: no key, a wrong key, another tenant's model or checkpoint;
// each refused with its code, nothing changed.
#include <cstdio>
#include <fstream>
#include <optional>

#include "server/common/auth.h"
#include "tests/e2e/e2e_util.h"

namespace tinkerd::testing {
namespace {

constexpr char kKeyA[] = "tml-aaaaaaaaaaaaaaaaaaaa";
constexpr char kKeyB[] = "tml-bbbbbbbbbbbbbbbbbbbb";

ServerConfig WithKeys(const TempDir& dir) {
  std::ofstream(dir.Sub("keys")) << "# tenant key\nalice " << kKeyA << "\nbob " << kKeyB << "\n";
  ServerConfig sc;
  auto keys = ApiKeys::LoadFile(dir.Sub("keys"));
  EXPECT_TRUE(keys.ok()) << keys.status().message();
  sc.api_keys = *keys;
  return sc;
}

void Key(grpc::ClientContext& ctx, const char* key) {
  if (key != nullptr) ctx.AddMetadata("x-api-key", key);
}

TEST(ConstantTimeEquals, IsEquality) {
  EXPECT_TRUE(ConstantTimeEquals("abc", "abc"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abd"));
  EXPECT_FALSE(ConstantTimeEquals("abc", "abcd"));
  EXPECT_FALSE(ConstantTimeEquals("", "a"));
  EXPECT_TRUE(ConstantTimeEquals("", ""));
}

TEST(ApiKeysFile, MalformedFilesAreRefused) {
  TempDir dir;
  std::ofstream(dir.Sub("short")) << "alice short\n";
  EXPECT_EQ(ApiKeys::LoadFile(dir.Sub("short")).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::ofstream(dir.Sub("three")) << "alice aaaaaaaaaaaaaaaaaaaa extra\n";
  EXPECT_EQ(ApiKeys::LoadFile(dir.Sub("three")).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ApiKeys::LoadFile(dir.Sub("absent")).status().code(), absl::StatusCode::kNotFound);
}

// A keys file line may carry its tenant's own limits after the key; each field is checked, and
// two lines of one tenant may repeat them but not contradict them.
TEST(ApiKeysFile, TenantLimitsAreReadAndMalformedOnesRefused) {
  TempDir dir;
  std::ofstream(dir.Sub("keys")) << "alice " << kKeyA << " max_models=2 max_samples=0\n"
                                 << "alice tml-cccccccccccccccccccc\n"
                                 << "bob " << kKeyB << "\ncarol tml-dddddddddddddddddddd"
                                 << " max_pending=5\n";
  auto keys = ApiKeys::LoadFile(dir.Sub("keys"));
  ASSERT_TRUE(keys.ok()) << keys.status();
  const TenantLimitTable& limits = keys->limits();
  EXPECT_EQ(limits.size(), 2u) << "bob sets none";
  EXPECT_EQ(limits.at("alice"), (TenantLimits{2, std::nullopt, 0}));
  EXPECT_EQ(limits.at("carol"), (TenantLimits{std::nullopt, 5, std::nullopt}));
  for (const char* fields : {"max_models=-1", "max_pending=0", "max_models=two", "max_modles=2",
                             "max_models", "max_models=2 max_models=3"}) {
    std::ofstream(dir.Sub("bad")) << "alice " << kKeyA << " " << fields << "\n";
    const absl::Status st = ApiKeys::LoadFile(dir.Sub("bad")).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << fields;
    EXPECT_NE(st.message().find(":1: "), std::string::npos) << "names the line: " << st;
  }
  std::ofstream(dir.Sub("contradicts"))
      << "alice " << kKeyA << " max_models=2\nalice " << kKeyB << " max_models=3\n";
  EXPECT_EQ(ApiKeys::LoadFile(dir.Sub("contradicts")).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// The file's limits reach the server: alice may hold one model and two running samples, whatever
// the flags say, while bob has the flags' bounds (none here).
TEST(Auth, ATenantsOwnLimitsFromTheKeysFileAreEnforced) {
  TempDir dir;
  std::ofstream(dir.Sub("keys")) << "alice " << kKeyA << " max_models=1 max_samples=2\nbob "
                                 << kKeyB << "\n";
  ServerConfig sc;
  sc.api_keys = *ApiKeys::LoadFile(dir.Sub("keys"));
  LiveServer live(sc);
  auto create = [&](const char* key) {
    grpc::ClientContext ctx;
    Key(ctx, key);
    v1::ModelInfo info;
    return live.stub->CreateModel(&ctx, v1::CreateModelRequest(), &info);
  };
  ASSERT_TRUE(create(kKeyA).ok());
  const grpc::Status second = create(kKeyA);
  EXPECT_EQ(second.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(second.error_message().find("max_models in the API keys file"), std::string::npos)
      << second.error_message();
  EXPECT_TRUE(create(kKeyB).ok());
  EXPECT_TRUE(create(kKeyB).ok()) << "bob has no bound of his own";

  auto sample = [&](const char* key, int n) {
    grpc::ClientContext ctx;
    Key(ctx, key);
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::SampleRequest req;
    for (int64_t t : {4, 40, 9}) {
      req.mutable_prompt()->add_chunks()->mutable_encoded_text()->add_tokens(t);
    }
    req.set_num_samples(n);
    req.mutable_sampling_params()->set_max_tokens(2);
    v1::SampleResponse out;
    return live.stub->Sample(&ctx, req, &out);
  };
  const grpc::Status over = sample(kKeyA, 3);
  EXPECT_EQ(over.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_NE(over.error_message().find("max_samples in the API keys file"), std::string::npos)
      << over.error_message();
  EXPECT_TRUE(sample(kKeyA, 2).ok());
  EXPECT_TRUE(sample(kKeyB, 3).ok());
}

TEST(Auth, KeysAndTenantsAreEnforcedAndNothingChanges) {
  TempDir keys_dir;
  LiveServer live(WithKeys(keys_dir));
  // Alice creates a model, trains a little and saves it.
  v1::ModelInfo info;
  {
    grpc::ClientContext ctx;
    Key(ctx, kKeyA);
    v1::CreateModelRequest req;
    ASSERT_TRUE(live.stub->CreateModel(&ctx, req, &info).ok());
  }
  const std::string model = info.model_id();
  SplitMix64 g(3);
  auto fb = MakeRequest(model, 1, RandomData(g, {9}, "cross_entropy", 128));
  {
    grpc::ClientContext ctx;
    Key(ctx, kKeyA);
    v1::ForwardBackwardOutput out;
    ASSERT_TRUE(live.stub->ForwardBackward(&ctx, fb, &out).ok());
  }
  {
    grpc::ClientContext ctx;
    Key(ctx, kKeyA);
    v1::SaveStateRequest req;
    req.set_model_id(model);
    req.set_seq_id(2);
    req.set_name("mine");
    req.set_include_accumulated(true);
    v1::SaveStateResponse resp;
    ASSERT_TRUE(live.stub->SaveState(&ctx, req, &resp).ok());
  }
  const auto checksum = live.StateChecksum(model);

  // No key, a wrong key: UNAUTHENTICATED, for every kind of call.
  for (const char* key : {static_cast<const char*>(nullptr), "tml-wrongwrongwrongwrong"}) {
    grpc::ClientContext c1;
    Key(c1, key);
    v1::ModelRef ref;
    ref.set_model_id(model);
    EXPECT_EQ(live.stub->GetInfo(&c1, ref, &info).error_code(), grpc::StatusCode::UNAUTHENTICATED);
    grpc::ClientContext c2;
    Key(c2, key);
    v1::ForwardBackwardOutput out;
    auto req = fb;
    req.set_seq_id(3);
    EXPECT_EQ(live.stub->ForwardBackward(&c2, req, &out).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
    grpc::ClientContext c3;
    Key(c3, key);
    v1::ListModelsResponse list;
    EXPECT_EQ(live.stub->ListModels(&c3, v1::ListModelsRequest(), &list).error_code(),
              grpc::StatusCode::UNAUTHENTICATED);
  }
  // Bob: Alice's model and checkpoints do not exist for him.
  {
    grpc::ClientContext ctx;
    Key(ctx, kKeyB);
    v1::ModelRef ref;
    ref.set_model_id(model);
    EXPECT_EQ(live.stub->GetInfo(&ctx, ref, &info).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    Key(ctx, kKeyB);
    v1::ForwardBackwardOutput out;
    auto req = fb;
    req.set_seq_id(3);
    EXPECT_EQ(live.stub->ForwardBackward(&ctx, req, &out).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    Key(ctx, kKeyB);
    v1::OptimStepRequest req;
    req.set_model_id(model);
    req.set_seq_id(3);
    v1::OptimStepResponse resp;
    EXPECT_EQ(live.stub->OptimStep(&ctx, req, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    Key(ctx, kKeyB);
    v1::ModelRef ref;
    ref.set_model_id(model);
    v1::DeleteModelResponse resp;
    EXPECT_EQ(live.stub->DeleteModel(&ctx, ref, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    Key(ctx, kKeyB);
    v1::ListModelsResponse list;
    ASSERT_TRUE(live.stub->ListModels(&ctx, v1::ListModelsRequest(), &list).ok());
    EXPECT_EQ(list.models_size(), 0);
  }
  {
    grpc::ClientContext ctx;
    Key(ctx, kKeyB);
    v1::CreateModelFromStateRequest req;
    req.set_path("tinker://" + model + "/weights/mine");
    EXPECT_EQ(live.stub->CreateModelFromState(&ctx, req, &info).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  {
    grpc::ClientContext ctx;
    Key(ctx, kKeyB);
    v1::DeleteCheckpointRequest req;
    req.set_path("tinker://" + model + "/weights/mine");
    v1::DeleteCheckpointResponse resp;
    EXPECT_EQ(live.stub->DeleteCheckpoint(&ctx, req, &resp).error_code(),
              grpc::StatusCode::NOT_FOUND);
  }
  {  // a stream into Alice's model
    grpc::ClientContext ctx;
    Key(ctx, kKeyB);
    v1::ForwardBackwardOutput out;
    auto w = live.stub->StreamForwardBackward(&ctx, &out);
    v1::StreamForwardBackwardMessage h;
    h.mutable_header()->set_model_id(model);
    h.mutable_header()->set_seq_id(3);
    h.mutable_header()->mutable_loss_fn()->set_name("cross_entropy");
    w->Write(h);
    w->WritesDone();
    EXPECT_EQ(w->Finish().error_code(), grpc::StatusCode::NOT_FOUND);
  }
  EXPECT_EQ(live.StateChecksum(model), checksum);
  // Alice still sees everything, and her checkpoint is intact.
  grpc::ClientContext ctx;
  Key(ctx, kKeyA);
  v1::ListCheckpointsRequest lr;
  lr.set_model_id(model);
  v1::ListCheckpointsResponse lresp;
  ASSERT_TRUE(live.stub->ListCheckpoints(&ctx, lr, &lresp).ok());
  EXPECT_EQ(lresp.checkpoints_size(), 1);
}

}  // namespace
}  // namespace tinkerd::testing
