// Issue 9's defects of the request path, each reproduced against the real server on loopback:
// nothing the client did not mean is ever applied.
#include <google/protobuf/util/message_differencer.h>
#include <grpcpp/impl/client_unary_call.h>
#include <grpcpp/support/sync_stream.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <set>
#include <thread>

#include "server/common/auth.h"
#include "tests/e2e/e2e_util.h"

namespace tinkerd::testing {
namespace {

constexpr char kStreamMethod[] = "/tinkerd.v1.Tinkerd/StreamForwardBackward";

v1::StreamForwardBackwardMessage Header(const std::string& model, int64_t seq,
                                        const std::string& loss = "cross_entropy") {
  v1::StreamForwardBackwardMessage m;
  m.mutable_header()->set_model_id(model);
  m.mutable_header()->set_seq_id(seq);
  m.mutable_header()->mutable_loss_fn()->set_name(loss);
  return m;
}

v1::StreamForwardBackwardMessage DatumMessage(const Datum& d) {
  v1::StreamForwardBackwardMessage m;
  *m.mutable_datum() = ToProto(d);
  return m;
}

// A whole stream: the header, every datum, half-close.
grpc::Status Stream(LiveServer& live, const std::string& model, int64_t seq,
                    const std::vector<Datum>& data, v1::ForwardBackwardOutput* out) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  auto writer = live.stub->StreamForwardBackward(&ctx, out);
  writer->Write(Header(model, seq));
  for (const Datum& d : data) writer->Write(DatumMessage(d));
  writer->WritesDone();
  return writer->Finish();
}

grpc::ByteBuffer Bytes(const std::string& s) {
  grpc::Slice slice(s);
  return grpc::ByteBuffer(&slice, 1);
}

// Defect 6: every Adam field is checked at the edge, with INVALID_ARGUMENT naming it.
TEST(RequestPath, AdamParamsAreValidatedAtTheEdge) {
  LiveServer live;
  const std::string model = live.CreateModel();
  SplitMix64 g(61);
  auto data = RandomData(g, {9, 5}, "cross_entropy", 128);
  v1::ForwardBackwardOutput out;
  ASSERT_TRUE(live.FwdBwd(MakeRequest(model, 1, data), &out).ok());
  const auto checksum = live.StateChecksum(model);
  int64_t seq = 2;
  struct Case {
    std::string field;
    std::function<void(v1::AdamParams&)> set;
  };
  const double inf = INFINITY, nan = NAN;
  const std::vector<Case> cases = {
      {"eps", [](auto& p) { p.set_eps(0); }},
      {"eps", [](auto& p) { p.set_eps(-1e-8); }},
      {"eps", [&](auto& p) { p.set_eps(nan); }},
      {"learning_rate", [](auto& p) { p.set_learning_rate(-1e-3); }},
      {"learning_rate", [&](auto& p) { p.set_learning_rate(inf); }},
      {"beta1", [](auto& p) { p.set_beta1(1.0); }},
      {"beta1", [&](auto& p) { p.set_beta1(nan); }},
      {"beta2", [](auto& p) { p.set_beta2(-0.1); }},
      {"weight_decay", [](auto& p) { p.set_weight_decay(-1); }},
      {"weight_decay", [&](auto& p) { p.set_weight_decay(nan); }},
      {"grad_clip_norm", [](auto& p) { p.set_grad_clip_norm(-1); }},
      {"grad_clip_norm", [&](auto& p) { p.set_grad_clip_norm(inf); }},
  };
  for (const Case& c : cases) {
    v1::OptimStepRequest req;
    req.set_model_id(model);
    req.set_seq_id(seq++);
    c.set(*req.mutable_adam_params());
    grpc::ClientContext ctx;
    v1::OptimStepResponse os;
    grpc::Status st = live.stub->OptimStep(&ctx, req, &os);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << c.field;
    EXPECT_NE(st.error_message().find("adam_params." + c.field), std::string::npos)
        << c.field << ": " << st.error_message();
    EXPECT_EQ(live.StateChecksum(model), checksum) << c.field;
    EXPECT_EQ(live.Info(model).next_seq_id(), seq) << c.field;  // the seq_id was taken
  }
  // The model still trains, and its logprobs stay finite.
  v1::OptimStepResponse os;
  ASSERT_TRUE(live.Optim(model, seq++, &os).ok());
  EXPECT_EQ(os.step(), 1);
  grpc::ClientContext ctx;
  ASSERT_TRUE(live.stub->Forward(&ctx, MakeRequest(model, seq++, data), &out).ok());
  for (const auto& o : out.outputs()) {
    const auto& bytes = o.logprobs().data();
    for (size_t i = 0; i + 4 <= bytes.size(); i += 4) {
      float v;
      std::memcpy(&v, bytes.data() + i, 4);
      EXPECT_TRUE(std::isfinite(v));
    }
  }
}

// Defect 4: the retry key includes which RPC was called.
TEST(RequestPath, SameSeqIdWithAnotherRpcIsAlreadyExists) {
  LiveServer live;
  const std::string model = live.CreateModel();
  {
    grpc::ClientContext ctx;
    v1::SaveStateRequest req;
    req.set_model_id(model);
    req.set_seq_id(1);
    req.set_name("ck");
    v1::SaveStateResponse resp;
    ASSERT_TRUE(live.stub->SaveState(&ctx, req, &resp).ok());
  }
  grpc::ClientContext ctx;
  v1::SaveWeightsForSamplerRequest req;
  req.set_model_id(model);
  req.set_seq_id(1);
  req.set_name("ck");
  v1::SaveWeightsForSamplerResponse resp;
  grpc::Status st = live.stub->SaveWeightsForSampler(&ctx, req, &resp);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ALREADY_EXISTS) << st.error_message();
  EXPECT_NE(st.error_message().find("SaveState"), std::string::npos) << st.error_message();
  grpc::ClientContext lctx;
  v1::ListCheckpointsRequest lreq;
  lreq.set_model_id(model);
  v1::ListCheckpointsResponse list;
  ASSERT_TRUE(live.stub->ListCheckpoints(&lctx, lreq, &list).ok());
  ASSERT_EQ(list.checkpoints_size(), 1);  // no sampler export was written
  EXPECT_EQ(list.checkpoints(0).kind(), "training");

  // Forward and ForwardBackward of the same payload are different requests too, and a stream
  // is not a retry of a unary call.
  SplitMix64 g(41);
  auto data = RandomData(g, {6}, "cross_entropy", 128);
  grpc::ClientContext fctx;
  v1::ForwardBackwardOutput out;
  ASSERT_TRUE(live.stub->Forward(&fctx, MakeRequest(model, 2, data), &out).ok());
  EXPECT_EQ(live.FwdBwd(MakeRequest(model, 2, data), &out).error_code(),
            grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(Stream(live, model, 2, data, &out).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(live.Info(model).accumulated_tokens(), 0);
}

// Defect 3: a stream's retry key covers every datum, not only its header.
TEST(RequestPath, RetriedStreamWithOtherDatumsIsAlreadyExists) {
  LiveServer live({}, /*micro_batch_tokens=*/10);
  const std::string model = live.CreateModel();
  SplitMix64 g(31);
  auto data = RandomData(g, {7, 12, 5}, "cross_entropy", 128);
  v1::ForwardBackwardOutput first;
  ASSERT_TRUE(Stream(live, model, 1, data, &first).ok());
  const auto after = live.StateChecksum(model);

  auto other = data;
  other[1] = RandomData(g, {12}, "cross_entropy", 128)[0];
  v1::ForwardBackwardOutput out;
  grpc::Status st = Stream(live, model, 1, other, &out);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::ALREADY_EXISTS) << st.error_message();
  auto fewer = data;
  fewer.pop_back();
  EXPECT_EQ(Stream(live, model, 1, fewer, &out).error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_EQ(live.StateChecksum(model), after);

  // The same stream again is a retry: the first result, not applied twice.
  v1::ForwardBackwardOutput retry;
  st = Stream(live, model, 1, data, &retry);
  ASSERT_TRUE(st.ok()) << st.error_message();
  EXPECT_TRUE(google::protobuf::util::MessageDifferencer::Equals(first, retry));
  EXPECT_EQ(live.StateChecksum(model), after);
  EXPECT_EQ(live.Info(model).next_seq_id(), 2);
}

// Defect 1: a stream the client cancels before half-closing changes nothing, however the cancel
// and the server's last read interleave.
TEST(RequestPath, StreamCancelledBeforeHalfCloseIsNeverApplied) {
  LiveServer live({}, /*micro_batch_tokens=*/8);
  const std::string model = live.CreateModel();
  const auto before = live.StateChecksum(model);
  SplitMix64 g(11);
  auto data = RandomData(g, {5, 6}, "cross_entropy", 128);
  Scheduler* scheduler = live.server->scheduler();
  for (int64_t seq = 1; seq <= 40; ++seq) {
    grpc::ClientContext ctx;
    v1::ForwardBackwardOutput out;
    auto writer = live.stub->StreamForwardBackward(&ctx, &out);
    ASSERT_TRUE(writer->Write(Header(model, seq)));
    for (const Datum& d : data) writer->Write(DatumMessage(d));
    // The header is queued (so the seq_id is taken), then the client goes away.
    WaitFor([&] { return scheduler->QueueDepth() > 0; }, "the stream's header");
    ctx.TryCancel();
    EXPECT_FALSE(writer->Finish().ok());
    WaitFor([&] { return scheduler->QueueDepth() == 0; }, "the stream's end");
    ASSERT_EQ(live.StateChecksum(model), before) << "try " << seq << " was applied";
    ASSERT_EQ(live.Info(model).next_seq_id(), seq + 1);
  }
}

// Defect 2: an unparsable message mid-stream fails the whole stream and applies nothing.
TEST(RequestPath, UnparsableMessageMidStreamFailsTheStream) {
  LiveServer live({}, /*micro_batch_tokens=*/8);
  const std::string model = live.CreateModel();
  const auto before = live.StateChecksum(model);
  SplitMix64 g(12);
  auto data = RandomData(g, {9, 7}, "cross_entropy", 128);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  grpc::ByteBuffer response;
  std::unique_ptr<grpc::ClientWriter<grpc::ByteBuffer>> writer(
      grpc::internal::ClientWriterFactory<grpc::ByteBuffer>::Create(
          live.channel.get(),
          grpc::internal::RpcMethod(kStreamMethod, grpc::internal::RpcMethod::CLIENT_STREAMING),
          &ctx, &response));
  writer->Write(Bytes(Header(model, 1).SerializeAsString()));
  writer->Write(Bytes(DatumMessage(data[0]).SerializeAsString()));
  writer->Write(Bytes("\x12\x7f\x01"));  // a datum of 127 bytes, cut after one
  writer->Write(Bytes(DatumMessage(data[1]).SerializeAsString()));
  writer->WritesDone();
  grpc::Status st = writer->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_NE(st.error_message().find("stream message 2"), std::string::npos) << st.error_message();
  EXPECT_EQ(live.StateChecksum(model), before);
  EXPECT_EQ(live.Info(model).next_seq_id(), 2);
}

grpc::Status Save(LiveServer& live, const std::string& model, int64_t seq, const std::string& name,
                  bool overwrite = false) {
  grpc::ClientContext ctx;
  v1::SaveStateRequest req;
  req.set_model_id(model);
  req.set_seq_id(seq);
  req.set_name(name);
  req.set_overwrite(overwrite);
  v1::SaveStateResponse resp;
  return live.stub->SaveState(&ctx, req, &resp);
}

std::vector<std::string> Entries(const std::string& folder) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(folder))
    out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// Defect 5: the clean-up of one checkpoint's save touches only its own temporaries and versions.
TEST(RequestPath, SavingACheckpointKeepsCheckpointsWithSimilarNames) {
  LiveServer live;
  const std::string model = live.CreateModel();
  int64_t seq = 1;
  for (const char* name : {"run.valid", "run.v2", "run-1", "run"}) {
    ASSERT_TRUE(Save(live, model, seq++, name).ok()) << name;
  }
  ASSERT_TRUE(Save(live, model, seq++, "run", /*overwrite=*/true).ok());
  grpc::ClientContext ctx;
  v1::ListCheckpointsRequest req;
  req.set_model_id(model);
  v1::ListCheckpointsResponse list;
  ASSERT_TRUE(live.stub->ListCheckpoints(&ctx, req, &list).ok());
  std::vector<std::string> paths;
  for (const auto& c : list.checkpoints()) paths.push_back(c.path());
  const std::string w = "tinker://" + model + "/weights/";
  EXPECT_EQ(paths,
            (std::vector<std::string>{w + "run", w + "run-1", w + "run.v2", w + "run.valid"}));
  grpc::ClientContext lctx;
  v1::LoadStateRequest load;
  load.set_model_id(model);
  load.set_seq_id(seq++);
  load.set_path(w + "run.valid");
  v1::LoadStateResponse loaded;
  grpc::Status st = live.stub->LoadState(&lctx, load, &loaded);
  EXPECT_TRUE(st.ok()) << st.error_message();
}

// Defect 11: leftovers of saves killed mid-way (here by a process id that cannot be alive) are
// swept by any save in their folder, and by the server's start-up.
TEST(RequestPath, LeftoversOfKilledSavesAreSwept) {
  auto plant = [](const std::string& folder) {
    std::filesystem::create_directories(folder);
    for (const char* d :
         {".tmp-dead-999999999-1-0", "dead.v999999999-1-1", ".tmp-run-999999999-5-0"})
      std::filesystem::create_directories(folder + "/" + d + "/sub");
    std::filesystem::create_directory_symlink("dead.v999999999-1-1",
                                              folder + "/.link-dead-999999999-1-2");
  };
  LiveServer live;
  const std::string model = live.CreateModel();
  const std::string root = live.dir.Sub("checkpoints");
  const std::string folder = root + "/default/" + model + "/weights";
  plant(folder);
  ASSERT_TRUE(Save(live, model, 1, "other").ok());  // another name, same folder
  auto entries = Entries(folder);
  ASSERT_EQ(entries.size(), 2u) << ::testing::PrintToString(entries);
  EXPECT_EQ(entries[0], "other");
  EXPECT_EQ(entries[1].rfind("other.v", 0), 0u);

  // At start-up, in every model's folders under the root.
  const std::string other_folder = root + "/default/model-x/sampler_weights";
  plant(other_folder);
  ServerConfig sc;
  sc.listen_address = "127.0.0.1:0";
  sc.checkpoint_root = root;
  auto second = TinkerdServer::Start(sc, MakeRunner(live.model_dir, ComputeDType::kFloat64, 4096));
  ASSERT_TRUE(second.ok()) << second.status().message();
  EXPECT_TRUE(Entries(other_folder).empty()) << ::testing::PrintToString(Entries(other_folder));
  EXPECT_EQ(Entries(folder).size(), 2u);  // the live checkpoint is kept
}

// Defect 9: request bytes that do not parse are INVALID_ARGUMENT with a reason, on every RPC.
TEST(RequestPath, UnparsableRequestIsInvalidArgument) {
  LiveServer live;
  const std::string model = live.CreateModel();
  const std::vector<std::string> methods = {"CreateModel",
                                            "GetInfo",
                                            "ListModels",
                                            "DeleteModel",
                                            "Forward",
                                            "ForwardBackward",
                                            "OptimStep",
                                            "SaveState",
                                            "LoadState",
                                            "CreateModelFromState",
                                            "SaveWeightsForSampler",
                                            "ListCheckpoints",
                                            "DeleteCheckpoint",
                                            "RetrieveResult"};
  // Field 1 (a string in every request) holding invalid UTF-8, then a field cut short.
  for (const std::string& bytes :
       {std::string("\x0a\x01\xff", 3), std::string("\x0a\x7f\x01", 3)}) {
    for (const std::string& m : methods) {
      if (m == "ListModels" && bytes[1] == 1) continue;  // no string field: an unknown field
      grpc::ClientContext ctx;
      grpc::ByteBuffer resp;
      grpc::Status st = grpc::internal::BlockingUnaryCall<grpc::ByteBuffer, grpc::ByteBuffer>(
          live.channel.get(),
          grpc::internal::RpcMethod(("/tinkerd.v1.Tinkerd/" + m).c_str(),
                                    grpc::internal::RpcMethod::NORMAL_RPC),
          &ctx, Bytes(bytes), &resp);
      EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << m;
      EXPECT_NE(st.error_message().find("does not parse"), std::string::npos)
          << m << ": " << st.error_message();
    }
  }
  EXPECT_EQ(live.Info(model).next_seq_id(), 1);
}

// Defect 10: "not yours" and "does not exist" answer alike, and no message names a server path.
TEST(RequestPath, CheckpointErrorsDoNotTellTenantsApartOrNameServerPaths) {
  constexpr char kKeyA[] = "tml-aaaaaaaaaaaaaaaaaaaa";
  constexpr char kKeyB[] = "tml-bbbbbbbbbbbbbbbbbbbb";
  TempDir keys_dir;
  std::ofstream(keys_dir.Sub("keys")) << "alice " << kKeyA << "\nbob " << kKeyB << "\n";
  ServerConfig sc;
  auto keys = ApiKeys::LoadFile(keys_dir.Sub("keys"));
  ASSERT_TRUE(keys.ok());
  sc.api_keys = *keys;
  LiveServer live(sc);
  v1::ModelInfo info;
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-api-key", kKeyA);
    ASSERT_TRUE(live.stub->CreateModel(&ctx, v1::CreateModelRequest(), &info).ok());
  }
  const std::string alices = info.model_id();
  auto list = [&](const char* key, const std::string& model) {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-api-key", key);
    v1::ListCheckpointsRequest req;
    req.set_model_id(model);
    v1::ListCheckpointsResponse resp;
    return live.stub->ListCheckpoints(&ctx, req, &resp);
  };
  EXPECT_TRUE(list(kKeyA, alices).ok());
  const grpc::Status theirs = list(kKeyB, alices);
  const grpc::Status unknown = list(kKeyB, "model-unknown");
  EXPECT_EQ(theirs.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(unknown.error_code(), grpc::StatusCode::NOT_FOUND);
  std::string masked = theirs.error_message();
  masked.replace(masked.find(alices), alices.size(), "model-unknown");
  EXPECT_EQ(masked, unknown.error_message());

  // Checkpoints that are not there: the answers name the tinker:// path, never the server's.
  const std::string root = live.dir.Sub("checkpoints");
  std::vector<grpc::Status> answers;
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-api-key", kKeyA);
    v1::LoadStateRequest req;
    req.set_model_id(alices);
    req.set_seq_id(1);
    req.set_path("tinker://" + alices + "/weights/absent");
    v1::LoadStateResponse resp;
    answers.push_back(live.stub->LoadState(&ctx, req, &resp));
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-api-key", kKeyA);
    v1::CreateModelFromStateRequest req;
    req.set_path("tinker://" + alices + "/weights/absent");
    v1::ModelInfo resp;
    answers.push_back(live.stub->CreateModelFromState(&ctx, req, &resp));
  }
  {
    grpc::ClientContext ctx;
    ctx.AddMetadata("x-api-key", kKeyA);
    v1::DeleteCheckpointRequest req;
    req.set_path("tinker://" + alices + "/weights/absent");
    v1::DeleteCheckpointResponse resp;
    answers.push_back(live.stub->DeleteCheckpoint(&ctx, req, &resp));
  }
  for (const grpc::Status& st : answers) {
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
    EXPECT_EQ(st.error_message().find(root), std::string::npos) << st.error_message();
    EXPECT_EQ(st.error_message().find(live.dir.Sub("")), std::string::npos) << st.error_message();
    EXPECT_NE(st.error_message().find("tinker://" + alices + "/weights/absent"), std::string::npos)
        << st.error_message();
  }
}

// Defect 13: the smaller inconsistencies.
TEST(RequestPath, FieldNamesEchoCapsAndStreamsMatchUnaryCalls) {
  LiveServer live;
  const std::string model = live.CreateModel();
  {  // ListCheckpoints names the field it checks.
    grpc::ClientContext ctx;
    v1::ListCheckpointsRequest req;
    req.set_model_id("../etc");
    v1::ListCheckpointsResponse resp;
    grpc::Status st = live.stub->ListCheckpoints(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
    EXPECT_EQ(st.error_message().rfind("model_id:", 0), 0u) << st.error_message();
  }
  // An 8 KB id keeps its code; the message quotes a capped prefix only.
  const std::string huge(8 << 10, 'm');
  {
    grpc::ClientContext ctx;
    v1::ModelRef ref;
    ref.set_model_id(huge);
    v1::ModelInfo info;
    grpc::Status st = live.stub->GetInfo(&ctx, ref, &info);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message().size();
    EXPECT_LT(st.error_message().size(), 200u);
  }
  {
    SplitMix64 g(13);
    v1::ForwardBackwardOutput out;
    grpc::Status st =
        live.FwdBwd(MakeRequest(huge, 1, RandomData(g, {5}, "cross_entropy", 128)), &out);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message().size();
    EXPECT_LT(st.error_message().size(), 200u);
  }
  {
    grpc::ClientContext ctx;
    v1::DeleteCheckpointRequest req;
    req.set_path("tinker://" + huge);
    v1::DeleteCheckpointResponse resp;
    grpc::Status st = live.stub->DeleteCheckpoint(&ctx, req, &resp);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message().size();
    EXPECT_LT(st.error_message().size(), 300u);
  }
  {
    SplitMix64 g(14);
    v1::ForwardBackwardOutput out;
    grpc::Status st =
        live.FwdBwd(MakeRequest(model, 1, RandomData(g, {5}, "cross_entropy", 128), huge), &out);
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message().size();
    EXPECT_LT(st.error_message().size(), 300u);
  }
  // A header-only stream is an empty batch, as for a unary call: INVALID_ARGUMENT, seq_id taken.
  v1::ForwardBackwardOutput out;
  grpc::Status st = Stream(live, model, 2, {}, &out);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
  EXPECT_EQ(live.Info(model).next_seq_id(), 3);
  // An invalid header takes its seq_id too, so the next request need not wait for it.
  {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto writer = live.stub->StreamForwardBackward(&ctx, &out);
    writer->Write(Header(model, 3, "no_such_loss"));
    writer->WritesDone();
    st = writer->Finish();
    EXPECT_EQ(st.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << st.error_message();
    EXPECT_NE(st.error_message().find("unknown loss"), std::string::npos) << st.error_message();
  }
  EXPECT_EQ(live.Info(model).next_seq_id(), 4);
}

// Defect 7: model ids are never reused, across restarts too, and do not count models.
TEST(RequestPath, ModelIdsAreNeverReusedAndRevealNoCounts) {
  std::set<std::string> ids;
  auto check = [&](const std::string& id) {
    EXPECT_EQ(id.size(), 6u + 32u) << id;
    EXPECT_EQ(id.rfind("model-", 0), 0u) << id;
    EXPECT_EQ(id.find_first_not_of("0123456789abcdef", 6), std::string::npos) << id;
    EXPECT_TRUE(ids.insert(id).second) << id << " was reused";
  };
  LiveServer live;
  check(live.CreateModel());
  check(live.CreateModel());
  // A restarted server (same base model, same checkpoint root) gives new ids.
  ServerConfig sc;
  sc.listen_address = "127.0.0.1:0";
  sc.checkpoint_root = live.dir.Sub("checkpoints");
  live.server.reset();
  auto again = TinkerdServer::Start(sc, MakeRunner(live.model_dir, ComputeDType::kFloat64, 4096));
  ASSERT_TRUE(again.ok()) << again.status().message();
  auto stub = v1::Tinkerd::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string((*again)->port()), grpc::InsecureChannelCredentials()));
  for (int i = 0; i < 2; ++i) {
    grpc::ClientContext ctx;
    v1::ModelInfo info;
    ASSERT_TRUE(stub->CreateModel(&ctx, v1::CreateModelRequest(), &info).ok());
    check(info.model_id());
  }
}

// Defect 8: a model is admitted only within the per-model limit and the server's memory budget,
// RESOURCE_EXHAUSTED before anything is allocated; deleting a model frees its share.
TEST(RequestPath, ModelsAreAdmittedWithinSizeLimitAndMemoryBudget) {
  TempDir dir;
  RunnerConfig rc;
  rc.base_model_path = WriteModel(dir, TinyConfig("llama"));
  rc.compute_dtype = ComputeDType::kFloat64;
  rc.device = TestDevice();
  // LoRA on every module of the tiny model holds 1184 * rank trainable values; with their
  // gradients and AdamW moments in float64, rank 4 is 151,552 bytes.
  rc.max_model_bytes = 1 << 20;
  rc.memory_budget_bytes = 400 << 10;
  auto runner = ModelRunner::Create(rc);
  ASSERT_TRUE(runner.ok()) << runner.status().message();
  ServerConfig sc;
  sc.listen_address = "127.0.0.1:0";
  sc.checkpoint_root = dir.Sub("checkpoints");
  auto server = TinkerdServer::Start(sc, std::move(*runner));
  ASSERT_TRUE(server.ok()) << server.status().message();
  auto stub = v1::Tinkerd::NewStub(grpc::CreateChannel(
      "127.0.0.1:" + std::to_string((*server)->port()), grpc::InsecureChannelCredentials()));
  auto create = [&](int64_t rank, v1::ModelInfo* info) {
    grpc::ClientContext ctx;
    v1::CreateModelRequest req;
    req.mutable_lora()->set_rank(rank);
    req.mutable_lora()->set_train_attn(true);
    req.mutable_lora()->set_train_mlp(true);
    req.mutable_lora()->set_train_unembed(true);
    return stub->CreateModel(&ctx, req, info);
  };
  v1::ModelInfo a, b, c;
  grpc::Status st = create(64, &c);  // 2.4 MB: over the per-model limit
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_NE(st.error_message().find("per-model limit"), std::string::npos) << st.error_message();
  ASSERT_TRUE(create(4, &a).ok());
  EXPECT_EQ(a.trainable_parameters(), 1184 * 4);
  ASSERT_TRUE(create(4, &b).ok());
  st = create(4, &c);  // a third would pass the budget
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_NE(st.error_message().find("memory budget"), std::string::npos) << st.error_message();
  {
    grpc::ClientContext ctx;
    v1::ModelRef ref;
    ref.set_model_id(a.model_id());
    v1::DeleteModelResponse resp;
    ASSERT_TRUE(stub->DeleteModel(&ctx, ref, &resp).ok());
  }
  st = create(4, &c);
  EXPECT_TRUE(st.ok()) << st.error_message();
}

// A training call holds its request and decoded batch in the memory account from its queueing to
// its end: where there is no room it is RESOURCE_EXHAUSTED before the scheduler sees it (its
// seq_id stays free), except the model's next seq_id, which the scheduler always admits (later
// ones may be queued, holding their share, waiting for it); and its share returns after.
TEST(RequestPath, AQueuedCallHoldsItsRequestInTheMemoryAccount) {
  if (TestDevice() != "cpu") GTEST_SKIP() << "queued requests take the CPU's account only";
  LiveServer live;
  const std::string model = live.CreateModel();
  std::shared_ptr<MemoryAccount> account = live.server->runner()->memory_account();
  SplitMix64 g(36);
  const auto data = RandomData(g, {120, 90, 100}, "cross_entropy", 128);
  const int64_t used = account->reserved();
  absl::StatusOr<Reservation> others =
      account->Reserve(account->capacity() - used - 1024, "others", "");
  ASSERT_TRUE(others.ok()) << others.status();
  v1::ForwardBackwardOutput out;
  // seq_id 2, ahead of 1: refused at the queue, its seq_id left free.
  grpc::Status st = live.FwdBwd(MakeRequest(model, 2, data), &out);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_NE(st.error_message().find("ForwardBackward: the request while it is queued needs"),
            std::string::npos)
      << st.error_message();
  EXPECT_EQ(account->reserved(), used + others->bytes());
  // seq_id 1, the next: queued all the same; it is its run that finds no room.
  st = live.FwdBwd(MakeRequest(model, 1, data), &out);
  EXPECT_EQ(st.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << st.error_message();
  EXPECT_EQ(st.error_message().find("while it is queued"), std::string::npos) << st.error_message();
  EXPECT_EQ(account->reserved(), used + others->bytes());
  *others = Reservation();
  // seq_id 3 waits for 2 in the queue, holding its share; then both run, and the shares return.
  auto later = std::async(std::launch::async, [&] {
    v1::ForwardBackwardOutput o;
    return live.FwdBwd(MakeRequest(model, 3, data), &o);
  });
  WaitFor([&] { return account->reserved() > used; }, "seq_id 3's share");
  ASSERT_TRUE(live.FwdBwd(MakeRequest(model, 2, data), &out).ok());
  EXPECT_EQ(out.outputs_size(), 3);
  const grpc::Status third = later.get();
  EXPECT_TRUE(third.ok()) << third.error_message();
  EXPECT_EQ(account->reserved(), used) << "a call's share outlived it";
}

// The registry: models are created and deleted on the scheduler thread, between jobs. A model
// deleted while its stream waits for datums takes the stream with it (NOT_FOUND), and under
// concurrent creations, deletions and training the registry and the runner hold the same models.
TEST(RequestPath, DeletingAModelEndsItsOpenStreamAndRegistryMatchesRunner) {
  LiveServer live({}, /*micro_batch_tokens=*/8);
  const std::string model = live.CreateModel();
  SplitMix64 g(21);
  auto data = RandomData(g, {5, 6}, "cross_entropy", 128);
  grpc::ClientContext stream_ctx;
  stream_ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  v1::ForwardBackwardOutput out;
  auto writer = live.stub->StreamForwardBackward(&stream_ctx, &out);
  ASSERT_TRUE(writer->Write(Header(model, 1)));
  ASSERT_TRUE(writer->Write(DatumMessage(data[0])));
  WaitFor([&] { return live.server->scheduler()->Used(model, 1); }, "the stream's header");
  auto remove = [&](const std::string& id) {
    grpc::ClientContext ctx;
    v1::ModelRef ref;
    ref.set_model_id(id);
    v1::DeleteModelResponse resp;
    return live.stub->DeleteModel(&ctx, ref, &resp);
  };
  ASSERT_TRUE(remove(model).ok());
  writer->Write(DatumMessage(data[1]));  // may fail: the stream has its answer
  writer->WritesDone();
  grpc::Status st = writer->Finish();
  EXPECT_EQ(st.error_code(), grpc::StatusCode::NOT_FOUND) << st.error_message();
  EXPECT_EQ(remove(model).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_TRUE(live.server->runner()->ListModels().empty());

  // Four clients create a model, train it a little, and delete every other one, all at once.
  std::vector<std::thread> clients;
  for (int c = 0; c < 4; ++c) {
    clients.emplace_back([&live, &remove, c] {
      SplitMix64 gc(100 + c);
      for (int i = 0; i < 3; ++i) {
        const std::string id = live.CreateModel();
        v1::ForwardBackwardOutput o;
        EXPECT_TRUE(
            live.FwdBwd(MakeRequest(id, 1, RandomData(gc, {4, 7}, "cross_entropy", 128)), &o).ok());
        if (i % 2 == 0) {
          EXPECT_TRUE(remove(id).ok());
        }
      }
    });
  }
  for (std::thread& t : clients) t.join();
  std::vector<std::string> registered = live.server->scheduler()->Models("default");  // no API keys
  std::vector<std::string> in_runner = live.server->runner()->ListModels();
  std::sort(registered.begin(), registered.end());
  std::sort(in_runner.begin(), in_runner.end());
  EXPECT_EQ(registered.size(), 4u);  // each client kept the second of its three models
  EXPECT_EQ(registered, in_runner);
}

}  // namespace
}  // namespace tinkerd::testing
