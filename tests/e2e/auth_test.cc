// API keys and tenants over the wire: no key, a wrong key, another tenant's model or checkpoint;
// each refused with its code, nothing changed.
#include <cstdio>
#include <fstream>

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
