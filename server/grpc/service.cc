#include "server/grpc/service.h"

#include "absl/strings/str_cat.h"
#include "server/common/status_map.h"
#include "server/grpc/sample_stream.h"
#include "server/grpc/stream_reactor.h"

namespace tinkerd {

TinkerdService::TinkerdService(Ops* ops, Sampling* sampling, ApiKeys keys)
    : ops_(ops), sampling_(sampling), keys_(std::move(keys)) {}

std::optional<std::string> TinkerdService::Admit(grpc::CallbackServerContext* ctx,
                                                 UnaryCall* reactor) {
  auto tenant = keys_.Authenticate(ctx);
  if (!tenant.ok()) {
    reactor->Reply(ToGrpcStatus(tenant.status()));
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

grpc::ServerUnaryReactor* TinkerdService::CreateSampler(grpc::CallbackServerContext* ctx,
                                                        const grpc::ByteBuffer* req,
                                                        grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, &TinkerdService::DoCreateSampler);
}

grpc::ServerUnaryReactor* TinkerdService::DeleteSampler(grpc::CallbackServerContext* ctx,
                                                        const grpc::ByteBuffer* req,
                                                        grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, &TinkerdService::DoDeleteSampler);
}

grpc::ServerUnaryReactor* TinkerdService::Sample(grpc::CallbackServerContext* ctx,
                                                 const grpc::ByteBuffer* req,
                                                 grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, &TinkerdService::DoSample);
}

grpc::ServerUnaryReactor* TinkerdService::ComputeLogprobs(grpc::CallbackServerContext* ctx,
                                                          const grpc::ByteBuffer* req,
                                                          grpc::ByteBuffer* resp) {
  return Unary(ctx, req, resp, &TinkerdService::DoComputeLogprobs);
}

namespace {

// The op's answer into the call: the response when OK, then the status.
template <typename Resp>
Done<Resp> Into(Resp* resp, UnaryCall* reactor) {
  return [resp, reactor](absl::StatusOr<Resp> r) {
    if (r.ok()) *resp = *std::move(r);
    reactor->Reply(ToGrpcStatus(r.status()));
  };
}

}  // namespace

void TinkerdService::DoCreateModel(grpc::CallbackServerContext* ctx, v1::CreateModelRequest* req,
                                   v1::ModelInfo* resp, UnaryCall* reactor) {
  if (auto tenant = Admit(ctx, reactor))
    ops_->CreateModel(*tenant, std::move(*req), Into(resp, reactor));
}

void TinkerdService::DoGetInfo(grpc::CallbackServerContext* ctx, v1::ModelRef* req,
                               v1::ModelInfo* resp, UnaryCall* reactor) {
  if (auto tenant = Admit(ctx, reactor))
    Into(resp, reactor)(ops_->GetInfo(*tenant, req->model_id()));
}

void TinkerdService::DoListModels(grpc::CallbackServerContext* ctx, v1::ListModelsRequest*,
                                  v1::ListModelsResponse* resp, UnaryCall* reactor) {
  if (auto tenant = Admit(ctx, reactor)) Into(resp, reactor)(ops_->ListModels(*tenant));
}

void TinkerdService::DoDeleteModel(grpc::CallbackServerContext* ctx, v1::ModelRef* req,
                                   v1::DeleteModelResponse* resp, UnaryCall* reactor) {
  if (auto tenant = Admit(ctx, reactor))
    ops_->DeleteModel(*tenant, req->model_id(), Into(resp, reactor));
}

void TinkerdService::DoForward(grpc::CallbackServerContext* ctx, v1::ForwardBackwardRequest* req,
                               v1::ForwardBackwardOutput* resp, UnaryCall* reactor) {
  if (auto tenant = Admit(ctx, reactor)) {
    ops_->ForwardBackward(*tenant, req, /*backward=*/false, Into(resp, reactor));
  }
}

void TinkerdService::DoForwardBackward(grpc::CallbackServerContext* ctx,
                                       v1::ForwardBackwardRequest* req,
                                       v1::ForwardBackwardOutput* resp, UnaryCall* reactor) {
  if (auto tenant = Admit(ctx, reactor)) {
    ops_->ForwardBackward(*tenant, req, /*backward=*/true, Into(resp, reactor));
  }
}

void TinkerdService::DoOptimStep(grpc::CallbackServerContext* ctx, v1::OptimStepRequest* req,
                                 v1::OptimStepResponse* resp, UnaryCall* reactor) {
  if (auto tenant = Admit(ctx, reactor))
    ops_->OptimStep(*tenant, std::move(*req), Into(resp, reactor));
}

void TinkerdService::DoSaveState(grpc::CallbackServerContext* ctx, v1::SaveStateRequest* req,
                                 v1::SaveStateResponse* resp, UnaryCall* reactor) {
  if (auto tenant = Admit(ctx, reactor))
    ops_->SaveState(*tenant, std::move(*req), Into(resp, reactor));
}

void TinkerdService::DoLoadState(grpc::CallbackServerContext* ctx, v1::LoadStateRequest* req,
                                 v1::LoadStateResponse* resp, UnaryCall* reactor) {
  if (auto tenant = Admit(ctx, reactor))
    ops_->LoadState(*tenant, std::move(*req), Into(resp, reactor));
}

void TinkerdService::DoCreateModelFromState(grpc::CallbackServerContext* ctx,
                                            v1::CreateModelFromStateRequest* req,
                                            v1::ModelInfo* resp, UnaryCall* reactor) {
  if (auto tenant = Admit(ctx, reactor)) {
    ops_->CreateModelFromState(*tenant, std::move(*req), Into(resp, reactor));
  }
}

void TinkerdService::DoSaveWeightsForSampler(grpc::CallbackServerContext* ctx,
                                             v1::SaveWeightsForSamplerRequest* req,
                                             v1::SaveWeightsForSamplerResponse* resp,
                                             UnaryCall* reactor) {
  if (auto tenant = Admit(ctx, reactor)) {
    ops_->SaveWeightsForSampler(*tenant, std::move(*req), Into(resp, reactor));
  }
}

void TinkerdService::DoListCheckpoints(grpc::CallbackServerContext* ctx,
                                       v1::ListCheckpointsRequest* req,
                                       v1::ListCheckpointsResponse* resp, UnaryCall* reactor) {
  if (auto tenant = Admit(ctx, reactor)) {
    Into(resp, reactor)(ops_->ListCheckpoints(*tenant, req->model_id()));
  }
}

void TinkerdService::DoDeleteCheckpoint(grpc::CallbackServerContext* ctx,
                                        v1::DeleteCheckpointRequest* req,
                                        v1::DeleteCheckpointResponse*, UnaryCall* reactor) {
  if (auto tenant = Admit(ctx, reactor)) {
    reactor->Reply(ToGrpcStatus(ops_->DeleteCheckpoint(*tenant, req->path())));
  }
}

void TinkerdService::DoRetrieveResult(grpc::CallbackServerContext* ctx,
                                      v1::RetrieveResultRequest* req,
                                      v1::RetrieveResultResponse* resp, UnaryCall* reactor) {
  if (auto tenant = Admit(ctx, reactor)) {
    Into(resp, reactor)(ops_->RetrieveResult(*tenant, req->model_id(), req->seq_id()));
  }
}

grpc::ServerReadReactor<grpc::ByteBuffer>* TinkerdService::StreamForwardBackward(
    grpc::CallbackServerContext* ctx, grpc::ByteBuffer* resp) {
  return NewStreamReactor(this, ctx, resp, keys_.Authenticate(ctx));
}

grpc::ServerWriteReactor<grpc::ByteBuffer>* TinkerdService::SampleStream(
    grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req) {
  return NewSampleStreamReactor(sampling_, req, keys_.Authenticate(ctx));
}

void TinkerdService::DoCreateSampler(grpc::CallbackServerContext* ctx,
                                     v1::CreateSamplerRequest* req, v1::SamplerInfo* resp,
                                     UnaryCall* reactor) {
  if (auto tenant = Admit(ctx, reactor))
    sampling_->CreateSampler(*tenant, *req, Into(resp, reactor));
}

void TinkerdService::DoDeleteSampler(grpc::CallbackServerContext* ctx, v1::SamplerRef* req,
                                     v1::DeleteSamplerResponse* resp, UnaryCall* reactor) {
  if (auto tenant = Admit(ctx, reactor)) {
    absl::Status st = sampling_->DeleteSampler(*tenant, req->sampler_id());
    Into(resp, reactor)(
        st.ok() ? absl::StatusOr<v1::DeleteSamplerResponse>(v1::DeleteSamplerResponse()) : st);
  }
}

void TinkerdService::DoSample(grpc::CallbackServerContext* ctx, v1::SampleRequest* req,
                              v1::SampleResponse* resp, UnaryCall* reactor) {
  if (auto tenant = Admit(ctx, reactor)) sampling_->Sample(*tenant, *req, Into(resp, reactor));
}

void TinkerdService::DoComputeLogprobs(grpc::CallbackServerContext* ctx,
                                       v1::ComputeLogprobsRequest* req,
                                       v1::ComputeLogprobsResponse* resp, UnaryCall* reactor) {
  if (auto tenant = Admit(ctx, reactor))
    sampling_->ComputeLogprobs(*tenant, *req, Into(resp, reactor));
}

}  // namespace tinkerd
