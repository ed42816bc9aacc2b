#include "server/service.h"

#include <chrono>
#include <deque>
#include <filesystem>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "runner/checkpoint/store.h"
#include "runner/loss/loss_spec.h"
#include "runner/util/echo.h"
#include "runner/util/hash.h"
#include "server/checkpoint_paths.h"
#include "server/convert.h"
#include "server/status_map.h"
#include "server/stream_reactor.h"

namespace tinkerd {

uint64_t PayloadHash(const google::protobuf::Message& m, uint64_t h) {
  std::string bytes;
  {
    google::protobuf::io::StringOutputStream out(&bytes);
    google::protobuf::io::CodedOutputStream coded(&out);
    coded.SetSerializationDeterministic(true);  // map order must not change the hash
    m.SerializeToCodedStream(&coded);
  }
  return Fnv64(bytes, h);
}

namespace {

// Errors of checkpoint storage name files under the server's root, and clients know checkpoints
// by their tinker:// paths only: <tenant_root>/<model>/<kind>/<name>... becomes
// tinker://<model>/<kind>/<name>..., and any other mention of the root is masked.
absl::Status HidePaths(const absl::Status& st, const std::string& tenant_root,
                       const std::string& root) {
  if (st.ok()) return st;
  std::string m = absl::StrReplaceAll(st.message(), {{tenant_root + "/", "tinker://"}});
  m = absl::StrReplaceAll(m, {{root, "<checkpoint_root>"}});
  return absl::Status(st.code(), m);
}

}  // namespace

TinkerdService::TinkerdService(ReplicatedRunner* runner, Scheduler* scheduler, ModelLimits limits,
                               std::string checkpoint_root, ApiKeys keys, Metrics* metrics)
    : runner_(runner),
      scheduler_(scheduler),
      limits_(limits),
      checkpoint_root_(std::move(checkpoint_root)),
      keys_(std::move(keys)),
      metrics_(metrics) {}

absl::Status TinkerdService::CheckOwner(const std::string& model_id, const std::string& tenant) {
  const std::optional<std::string> owner = scheduler_->Owner(model_id);
  if (owner.has_value() && *owner != tenant) {
    return absl::NotFoundError(absl::StrCat("model_id: no model '", Echo(model_id), "'"));
  }
  return absl::OkStatus();
}

void TinkerdService::CreateRegistered(const std::string& tenant,
                                      std::function<absl::StatusOr<std::string>()> create,
                                      v1::ModelInfo* resp, UnaryCall* reactor) {
  ModelRunner* local = runner_->local();
  scheduler_->CreateModel(tenant, std::move(create),
                          [local, resp, reactor](const absl::StatusOr<std::string>& id) {
                            absl::Status st = id.status();
                            if (st.ok()) {
                              auto info = local->GetInfo(*id);
                              st = info.status();
                              if (st.ok()) InfoToProto(*info, resp);
                              resp->set_next_seq_id(1);
                            }
                            reactor->Reply(ToGrpcStatus(st));
                          });
}

std::optional<std::string> TinkerdService::Admit(grpc::CallbackServerContext* ctx,
                                                 UnaryCall* reactor, const std::string* model_id) {
  auto tenant = keys_.Authenticate(ctx);
  absl::Status st = tenant.status();
  if (st.ok() && model_id != nullptr) st = CheckOwner(*model_id, *tenant);
  if (!st.ok()) {
    reactor->Reply(ToGrpcStatus(st));
    return std::nullopt;
  }
  return *tenant;
}

namespace {

// A unary call's parsed request and typed response.
template <typename Req, typename Resp>
class TypedCall final : public UnaryCall {
 public:
  explicit TypedCall(grpc::ByteBuffer* out) : out_(out) {}
  void OnDone() override { delete this; }

  Req req;
  Resp resp;

 private:
  void SerializeResponse() override {
    const std::string bytes = resp.SerializeAsString();
    grpc::Slice slice(bytes);
    *out_ = grpc::ByteBuffer(&slice, 1);
  }

  grpc::ByteBuffer* out_;
};

}  // namespace

template <typename Req, typename Resp>
grpc::ServerUnaryReactor* TinkerdService::Unary(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in, grpc::ByteBuffer* out,
    void (TinkerdService::*handler)(grpc::CallbackServerContext*, Req*, Resp*, UnaryCall*)) {
  auto* call = new TypedCall<Req, Resp>(out);
  grpc::ByteBuffer bytes(*in);  // shares the slices; Deserialize clears the buffer it reads
  if (!grpc::SerializationTraits<Req>::Deserialize(&bytes, &call->req).ok()) {
    call->Reply(ToGrpcStatus(absl::InvalidArgumentError(
        absl::StrCat("request: does not parse as ", Req::descriptor()->full_name(),
                     " (malformed bytes, or a string field that is not valid UTF-8)"))));
    return call;
  }
  (this->*handler)(ctx, &call->req, &call->resp, call);
  return call;
}

grpc::ServerUnaryReactor* TinkerdService::CreateModel(grpc::CallbackServerContext* ctx,
                                                      const grpc::ByteBuffer* req,
                                                      grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, &TinkerdService::DoCreateModel);
}

grpc::ServerUnaryReactor* TinkerdService::GetInfo(grpc::CallbackServerContext* ctx,
                                                  const grpc::ByteBuffer* req,
                                                  grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, &TinkerdService::DoGetInfo);
}

grpc::ServerUnaryReactor* TinkerdService::ListModels(grpc::CallbackServerContext* ctx,
                                                     const grpc::ByteBuffer* req,
                                                     grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, &TinkerdService::DoListModels);
}

grpc::ServerUnaryReactor* TinkerdService::DeleteModel(grpc::CallbackServerContext* ctx,
                                                      const grpc::ByteBuffer* req,
                                                      grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, &TinkerdService::DoDeleteModel);
}

grpc::ServerUnaryReactor* TinkerdService::Forward(grpc::CallbackServerContext* ctx,
                                                  const grpc::ByteBuffer* req,
                                                  grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, &TinkerdService::DoForward);
}

grpc::ServerUnaryReactor* TinkerdService::ForwardBackward(grpc::CallbackServerContext* ctx,
                                                          const grpc::ByteBuffer* req,
                                                          grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, &TinkerdService::DoForwardBackward);
}

grpc::ServerUnaryReactor* TinkerdService::OptimStep(grpc::CallbackServerContext* ctx,
                                                    const grpc::ByteBuffer* req,
                                                    grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, &TinkerdService::DoOptimStep);
}

grpc::ServerUnaryReactor* TinkerdService::SaveState(grpc::CallbackServerContext* ctx,
                                                    const grpc::ByteBuffer* req,
                                                    grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, &TinkerdService::DoSaveState);
}

grpc::ServerUnaryReactor* TinkerdService::LoadState(grpc::CallbackServerContext* ctx,
                                                    const grpc::ByteBuffer* req,
                                                    grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, &TinkerdService::DoLoadState);
}

grpc::ServerUnaryReactor* TinkerdService::CreateModelFromState(grpc::CallbackServerContext* ctx,
                                                               const grpc::ByteBuffer* req,
                                                               grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, &TinkerdService::DoCreateModelFromState);
}

grpc::ServerUnaryReactor* TinkerdService::SaveWeightsForSampler(grpc::CallbackServerContext* ctx,
                                                                const grpc::ByteBuffer* req,
                                                                grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, &TinkerdService::DoSaveWeightsForSampler);
}

grpc::ServerUnaryReactor* TinkerdService::ListCheckpoints(grpc::CallbackServerContext* ctx,
                                                          const grpc::ByteBuffer* req,
                                                          grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, &TinkerdService::DoListCheckpoints);
}

grpc::ServerUnaryReactor* TinkerdService::DeleteCheckpoint(grpc::CallbackServerContext* ctx,
                                                           const grpc::ByteBuffer* req,
                                                           grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, &TinkerdService::DoDeleteCheckpoint);
}

grpc::ServerUnaryReactor* TinkerdService::RetrieveResult(grpc::CallbackServerContext* ctx,
                                                         const grpc::ByteBuffer* req,
                                                         grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, &TinkerdService::DoRetrieveResult);
}

void TinkerdService::DoCreateModel(grpc::CallbackServerContext* ctx, v1::CreateModelRequest* req,
                                   v1::ModelInfo* resp, UnaryCall* reactor) {
  auto tenant = Admit(ctx, reactor, nullptr);
  if (!tenant) return;
  // Checked here so that a bad request is never queued nor broadcast.
  if (auto opts = CreateOptionsFromProto(*req); !opts.ok()) {
    reactor->Reply(ToGrpcStatus(opts.status()));
    return;
  }
  auto request = std::make_shared<v1::CreateModelRequest>(std::move(*req));
  ReplicatedRunner* runner = runner_;
  CreateRegistered(
      *tenant, [runner, request] { return runner->CreateModel(*request); }, resp, reactor);
}

void TinkerdService::DoGetInfo(grpc::CallbackServerContext* ctx, v1::ModelRef* req,
                               v1::ModelInfo* resp, UnaryCall* reactor) {
  auto tenant = Admit(ctx, reactor, &req->model_id());
  if (!tenant) return;
  absl::Status st = [&]() -> absl::Status {
    auto next = scheduler_->NextSeqId(req->model_id());
    if (!next.ok()) return next.status();
    auto info = runner_->local()->GetInfo(req->model_id());
    if (!info.ok()) return info.status();
    InfoToProto(*info, resp);
    resp->set_next_seq_id(*next);
    return absl::OkStatus();
  }();
  reactor->Reply(ToGrpcStatus(st));
}

void TinkerdService::DoListModels(grpc::CallbackServerContext* ctx, v1::ListModelsRequest*,
                                  v1::ListModelsResponse* resp, UnaryCall* reactor) {
  auto tenant = Admit(ctx, reactor, nullptr);
  if (!tenant) return;
  for (const std::string& id : scheduler_->Models(*tenant)) {  // others' models are invisible
    auto info = runner_->local()->GetInfo(id);
    auto next = scheduler_->NextSeqId(id);
    if (!info.ok() || !next.ok()) continue;  // deleted meanwhile
    v1::ModelInfo* m = resp->add_models();
    InfoToProto(*info, m);
    m->set_next_seq_id(*next);
  }
  reactor->Reply(grpc::Status::OK);
}

void TinkerdService::DoDeleteModel(grpc::CallbackServerContext* ctx, v1::ModelRef* req,
                                   v1::DeleteModelResponse*, UnaryCall* reactor) {
  auto tenant = Admit(ctx, reactor, &req->model_id());
  if (!tenant) return;
  ReplicatedRunner* runner = runner_;
  scheduler_->DeleteModel(
      req->model_id(), [runner, id = req->model_id()] { return runner->DeleteModel(id); },
      [reactor](const absl::Status& st) { reactor->Reply(ToGrpcStatus(st)); });
}

void TinkerdService::FwdBwd(grpc::CallbackServerContext* ctx, v1::ForwardBackwardRequest* req,
                            v1::ForwardBackwardOutput* resp, bool backward, UnaryCall* reactor) {
  auto tenant = Admit(ctx, reactor, &req->model_id());
  if (!tenant) return;
  // Decoded and checked once, here, before queueing; the runner and the other ranks take the
  // result as it is. An invalid request still takes its seq_id slot (answered with the error) so
  // the model's later requests are not held up behind it.
  JobSpec job;
  job.kind = backward ? "ForwardBackward" : "Forward";
  job.payload_hash = PayloadHash(*req);
  const std::string model_id = req->model_id();
  const int64_t seq_id = req->seq_id();
  absl::StatusOr<Batch> batch = BatchFromProto(req->data(), req->loss_fn(), limits_);
  // The job runs once; shared only because std::function must be copyable.
  struct Pending {
    v1::ForwardBackwardRequest request;
    absl::StatusOr<Batch> batch;
  };
  auto pending = std::make_shared<Pending>();
  pending->request.Swap(req);
  pending->batch = std::move(batch);
  ReplicatedRunner* runner = runner_;
  Metrics* metrics = metrics_;
  job.run = [runner, pending, backward, metrics]() -> JobStep {
    if (!pending->batch.ok()) return {true, pending->batch.status()};
    auto r =
        runner->ForwardBackward(std::move(pending->request), *std::move(pending->batch), backward);
    if (!r.ok()) return {true, r.status()};
    if (backward) metrics->AddTokens(static_cast<int64_t>(r->metrics.at("num_tokens:sum")));
    v1::RetrieveResultResponse out;
    ResultToProto(*r, out.mutable_forward_backward());
    return {true, out};
  };
  scheduler_->Submit(model_id, seq_id, std::move(job), [reactor, resp](const JobResult& r) {
    if (r.ok()) *resp = r->forward_backward();
    reactor->Reply(ToGrpcStatus(r.status()));
  });
}

void TinkerdService::DoForward(grpc::CallbackServerContext* ctx, v1::ForwardBackwardRequest* req,
                               v1::ForwardBackwardOutput* resp, UnaryCall* reactor) {
  FwdBwd(ctx, req, resp, /*backward=*/false, reactor);
}

void TinkerdService::DoForwardBackward(grpc::CallbackServerContext* ctx,
                                       v1::ForwardBackwardRequest* req,
                                       v1::ForwardBackwardOutput* resp, UnaryCall* reactor) {
  FwdBwd(ctx, req, resp, /*backward=*/true, reactor);
}

void TinkerdService::DoOptimStep(grpc::CallbackServerContext* ctx, v1::OptimStepRequest* req,
                                 v1::OptimStepResponse* resp, UnaryCall* reactor) {
  auto tenant = Admit(ctx, reactor, &req->model_id());
  if (!tenant) return;
  // Checked here, before the request is queued, hashed and broadcast; like any invalid request it
  // still takes its seq_id (answered with the error) so later requests are not held up.
  const absl::Status invalid = ValidateAdamParams(AdamFromProto(req->adam_params()));
  JobSpec job;
  job.kind = "OptimStep";
  job.payload_hash = PayloadHash(*req);
  ReplicatedRunner* runner = runner_;
  auto request = std::make_shared<v1::OptimStepRequest>(*req);
  Metrics* metrics = metrics_;
  job.run = [runner, request, invalid, metrics]() -> JobStep {
    if (!invalid.ok()) return {true, invalid};
    auto r = runner->OptimStep(*request);
    if (!r.ok()) return {true, r.status()};
    metrics->AddOptimStep(r->skipped);
    v1::RetrieveResultResponse out;
    OptimStepToProto(*r, out.mutable_optim_step());
    return {true, out};
  };
  scheduler_->Submit(req->model_id(), req->seq_id(), std::move(job),
                     [reactor, resp](const JobResult& r) {
                       if (r.ok()) *resp = r->optim_step();
                       reactor->Reply(ToGrpcStatus(r.status()));
                     });
}

namespace {

// Submits an ordered job whose result is one field of RetrieveResultResponse.
template <typename Resp>
void SubmitOrdered(Scheduler* scheduler, const std::string& model_id, int64_t seq_id,
                   std::string kind, uint64_t hash,
                   std::function<absl::StatusOr<v1::RetrieveResultResponse>()> run,
                   UnaryCall* reactor, Resp* resp,
                   const Resp& (v1::RetrieveResultResponse::*field)() const) {
  JobSpec job;
  job.kind = std::move(kind);
  job.payload_hash = hash;
  job.run = [run]() -> JobStep { return {true, run()}; };
  scheduler->Submit(model_id, seq_id, std::move(job), [reactor, resp, field](const JobResult& r) {
    if (r.ok()) *resp = ((*r).*field)();
    reactor->Reply(ToGrpcStatus(r.status()));
  });
}

}  // namespace

void TinkerdService::DoSaveState(grpc::CallbackServerContext* ctx, v1::SaveStateRequest* req,
                                 v1::SaveStateResponse* resp, UnaryCall* reactor) {
  auto tenant = Admit(ctx, reactor, &req->model_id());
  if (!tenant) return;
  const absl::Status invalid = ValidateCheckpointName(req->name());
  const CheckpointPath path{req->model_id(), "weights", req->name()};
  const std::string fs = path.Fs(TenantRoot(*tenant));
  const std::string tenant_root = TenantRoot(*tenant), root = checkpoint_root_;
  ReplicatedRunner* runner = runner_;
  auto request = std::make_shared<v1::SaveStateRequest>(*req);
  SubmitOrdered<v1::SaveStateResponse>(
      scheduler_, req->model_id(), req->seq_id(), "SaveState", PayloadHash(*req),
      [invalid, runner, request, fs, path, tenant_root, root,
       metrics = metrics_]() -> absl::StatusOr<v1::RetrieveResultResponse> {
        if (!invalid.ok()) return invalid;
        SaveStateOptions o;
        o.overwrite = request->overwrite();
        o.include_accumulated = request->include_accumulated();
        o.last_seq_id = request->seq_id();
        const auto t0 = std::chrono::steady_clock::now();
        if (auto st = runner->SaveState(request->model_id(), fs, o); !st.ok())
          return HidePaths(st, tenant_root, root);
        metrics->ObserveCheckpoint(
            "save", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        v1::RetrieveResultResponse out;
        out.mutable_save_state()->set_path(path.Uri());
        return out;
      },
      reactor, resp, &v1::RetrieveResultResponse::save_state);
}

void TinkerdService::DoLoadState(grpc::CallbackServerContext* ctx, v1::LoadStateRequest* req,
                                 v1::LoadStateResponse* resp, UnaryCall* reactor) {
  auto tenant = Admit(ctx, reactor, &req->model_id());
  if (!tenant) return;
  auto path = ParseCheckpointPath(req->path());
  absl::Status invalid = path.status();
  if (invalid.ok() && path->kind != "weights") {
    invalid =
        absl::InvalidArgumentError("path: sampler weights cannot be loaded as training state");
  }
  const std::string fs = invalid.ok() ? path->Fs(TenantRoot(*tenant)) : "";
  const std::string tenant_root = TenantRoot(*tenant), root = checkpoint_root_;
  ReplicatedRunner* runner = runner_;
  auto request = std::make_shared<v1::LoadStateRequest>(*req);
  SubmitOrdered<v1::LoadStateResponse>(
      scheduler_, req->model_id(), req->seq_id(), "LoadState", PayloadHash(*req),
      [invalid, runner, request, fs, tenant_root,
       root]() -> absl::StatusOr<v1::RetrieveResultResponse> {
        if (!invalid.ok()) return invalid;
        if (auto st = runner->LoadState(request->model_id(), fs, request->with_optimizer());
            !st.ok())
          return HidePaths(st, tenant_root, root);
        v1::RetrieveResultResponse out;
        out.mutable_load_state()->set_path(request->path());
        return out;
      },
      reactor, resp, &v1::RetrieveResultResponse::load_state);
}

void TinkerdService::DoCreateModelFromState(grpc::CallbackServerContext* ctx,
                                            v1::CreateModelFromStateRequest* req,
                                            v1::ModelInfo* resp, UnaryCall* reactor) {
  auto tenant = Admit(ctx, reactor, nullptr);
  if (!tenant) return;
  auto path = ParseCheckpointPath(req->path());
  absl::Status invalid = path.status();
  if (invalid.ok() && path->kind != "weights") {
    invalid =
        absl::InvalidArgumentError("path: sampler weights cannot be loaded as training state");
  }
  if (!invalid.ok()) {
    reactor->Reply(ToGrpcStatus(invalid));
    return;
  }
  ReplicatedRunner* runner = runner_;
  const std::string fs = path->Fs(TenantRoot(*tenant)), tenant_root = TenantRoot(*tenant),
                    root = checkpoint_root_;
  const bool with_optimizer = req->with_optimizer();
  CreateRegistered(
      *tenant,
      [runner, fs, with_optimizer, tenant_root, root]() -> absl::StatusOr<std::string> {
        auto id = runner->CreateModelFromState(fs, with_optimizer);
        if (!id.ok()) return HidePaths(id.status(), tenant_root, root);
        return id;
      },
      resp, reactor);
}

void TinkerdService::DoSaveWeightsForSampler(grpc::CallbackServerContext* ctx,
                                             v1::SaveWeightsForSamplerRequest* req,
                                             v1::SaveWeightsForSamplerResponse* resp,
                                             UnaryCall* reactor) {
  auto tenant = Admit(ctx, reactor, &req->model_id());
  if (!tenant) return;
  const absl::Status invalid = ValidateCheckpointName(req->name());
  const CheckpointPath path{req->model_id(), "sampler_weights", req->name()};
  const std::string fs = path.Fs(TenantRoot(*tenant));
  const std::string tenant_root = TenantRoot(*tenant), root = checkpoint_root_;
  ModelRunner* local = runner_->local();
  auto request = std::make_shared<v1::SaveWeightsForSamplerRequest>(*req);
  SubmitOrdered<v1::SaveWeightsForSamplerResponse>(
      scheduler_, req->model_id(), req->seq_id(), "SaveWeightsForSampler", PayloadHash(*req),
      [invalid, local, request, fs, path, tenant_root,
       root]() -> absl::StatusOr<v1::RetrieveResultResponse> {
        if (!invalid.ok()) return invalid;
        if (auto st = local->SaveWeightsForSampler(request->model_id(), fs, request->merged(),
                                                   request->overwrite());
            !st.ok())
          return HidePaths(st, tenant_root, root);
        v1::RetrieveResultResponse out;
        out.mutable_save_weights_for_sampler()->set_path(path.Uri());
        return out;
      },
      reactor, resp, &v1::RetrieveResultResponse::save_weights_for_sampler);
}

void TinkerdService::DoListCheckpoints(grpc::CallbackServerContext* ctx,
                                       v1::ListCheckpointsRequest* req,
                                       v1::ListCheckpointsResponse* resp, UnaryCall* reactor) {
  auto tenant = Admit(ctx, reactor, &req->model_id());
  if (!tenant) return;
  absl::Status st = ValidateCheckpointName(req->model_id(), "model_id");
  // A model this tenant has now, or had checkpoints of; anything else, another tenant's model
  // included (Admit), is NOT_FOUND alike, so that no tenant can probe which ids exist.
  std::error_code ec;
  if (st.ok() && !scheduler_->HasModel(req->model_id()) &&
      !std::filesystem::is_directory(TenantRoot(*tenant) + "/" + req->model_id(), ec)) {
    st = absl::NotFoundError(absl::StrCat("model_id: no model '", Echo(req->model_id()), "'"));
  }
  if (st.ok()) {
    for (const char* kind : {"weights", "sampler_weights"}) {
      for (const std::string& name : tinkerd::ListCheckpoints(
               absl::StrCat(TenantRoot(*tenant), "/", req->model_id(), "/", kind))) {
        v1::CheckpointInfo* c = resp->add_checkpoints();
        c->set_path(CheckpointPath{req->model_id(), kind, name}.Uri());
        c->set_kind(std::string(kind) == "weights" ? "training" : "sampler");
      }
    }
  }
  reactor->Reply(ToGrpcStatus(st));
}

void TinkerdService::DoDeleteCheckpoint(grpc::CallbackServerContext* ctx,
                                        v1::DeleteCheckpointRequest* req,
                                        v1::DeleteCheckpointResponse*, UnaryCall* reactor) {
  auto tenant = Admit(ctx, reactor, nullptr);
  if (!tenant) return;
  auto path = ParseCheckpointPath(req->path());
  absl::Status st = path.status();
  if (st.ok()) {
    st = HidePaths(tinkerd::DeleteCheckpoint(path->Fs(TenantRoot(*tenant))), TenantRoot(*tenant),
                   checkpoint_root_);
  }
  reactor->Reply(ToGrpcStatus(st));
}

void TinkerdService::DoRetrieveResult(grpc::CallbackServerContext* ctx,
                                      v1::RetrieveResultRequest* req,
                                      v1::RetrieveResultResponse* resp, UnaryCall* reactor) {
  auto tenant = Admit(ctx, reactor, &req->model_id());
  if (!tenant) return;
  JobResult r = scheduler_->Retrieve(req->model_id(), req->seq_id());
  if (r.ok()) *resp = *r;
  reactor->Reply(ToGrpcStatus(r.status()));
}

grpc::ServerReadReactor<grpc::ByteBuffer>* TinkerdService::StreamForwardBackward(
    grpc::CallbackServerContext* ctx, grpc::ByteBuffer* resp) {
  return NewStreamReactor(this, ctx, resp, keys_.Authenticate(ctx));
}

}  // namespace tinkerd
