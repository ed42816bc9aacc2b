// The gRPC front end (callback API): each handler authenticates the caller, parses its request
// and hands it to the shared operations (server/ops/ops.h), which check it completely before it is
// queued; the answer goes back as the call's status and response.
#pragma once

#include <memory>
#include <optional>

#include "server/common/auth.h"
#include "server/ops/ops.h"
#include "server/ops/sampling.h"
#include "tinkerd/v1/tinkerd.grpc.pb.h"

namespace tinkerd {

// A unary call whose request arrived as bytes and was parsed by the service: Reply serializes the
// typed response (when the status is OK) into the call's output and finishes the call.
class UnaryCall : public grpc::ServerUnaryReactor {
 public:
  void Reply(const grpc::Status& status) {
    if (status.ok()) SerializeResponse();
    Finish(status);
  }

 private:
  virtual void SerializeResponse() = 0;
};

// Every RPC is registered raw (bytes in, bytes out) and parses its request itself: gRPC's typed
// handlers answer a request that does not parse (say, a string field that is not UTF-8) with
// UNIMPLEMENTED and no message, where the client must get INVALID_ARGUMENT and the reason; and a
// stream must tell a message that does not parse from its end.
using RawSamplingMethods = v1::Tinkerd::WithRawCallbackMethod_CreateSampler<
    v1::Tinkerd::WithRawCallbackMethod_DeleteSampler<
        v1::Tinkerd::WithRawCallbackMethod_Sample<v1::Tinkerd::WithRawCallbackMethod_SampleStream<
            v1::Tinkerd::WithRawCallbackMethod_ComputeLogprobs<v1::Tinkerd::Service>>>>>;
using RawTinkerdService = v1::Tinkerd::WithRawCallbackMethod_CreateModel<
    v1::Tinkerd::WithRawCallbackMethod_GetInfo<v1::Tinkerd::WithRawCallbackMethod_ListModels<
        v1::Tinkerd::WithRawCallbackMethod_DeleteModel<v1::Tinkerd::WithRawCallbackMethod_Forward<
            v1::Tinkerd::WithRawCallbackMethod_ForwardBackward<
                v1::Tinkerd::WithRawCallbackMethod_StreamForwardBackward<
                    v1::Tinkerd::WithRawCallbackMethod_OptimStep<
                        v1::Tinkerd::WithRawCallbackMethod_SaveState<
                            v1::Tinkerd::WithRawCallbackMethod_LoadState<
                                v1::Tinkerd::WithRawCallbackMethod_CreateModelFromState<
                                    v1::Tinkerd::WithRawCallbackMethod_SaveWeightsForSampler<
                                        v1::Tinkerd::WithRawCallbackMethod_ListCheckpoints<
                                            v1::Tinkerd::WithRawCallbackMethod_DeleteCheckpoint<
                                                v1::Tinkerd::WithRawCallbackMethod_RetrieveResult<
                                                    RawSamplingMethods>>>>>>>>>>>>>>>;

class TinkerdService final : public RawTinkerdService {
 public:
  TinkerdService(Ops* ops, Sampling* sampling, ApiKeys keys);

  // The RPCs as registered, bytes in and bytes out: each parses its request (see Unary) and
  // calls its handler below. The stream requests StreamForwardBackwardMessage and responds
  // ForwardBackwardOutput.
  grpc::ServerUnaryReactor* CreateModel(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* req,
                                        grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                    grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* ctx,
                                       const grpc::ByteBuffer* req,
                                       grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* DeleteModel(grpc::CallbackServerContext* ctx,
                                        const grpc::ByteBuffer* req,
                                        grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                    grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* ForwardBackward(grpc::CallbackServerContext* ctx,
                                            const grpc::ByteBuffer* req,
                                            grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* OptimStep(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                      grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* SaveState(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                      grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* LoadState(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                      grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* CreateModelFromState(grpc::CallbackServerContext* ctx,
                                                 const grpc::ByteBuffer* req,
                                                 grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* SaveWeightsForSampler(grpc::CallbackServerContext* ctx,
                                                  const grpc::ByteBuffer* req,
                                                  grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* ListCheckpoints(grpc::CallbackServerContext* ctx,
                                            const grpc::ByteBuffer* req,
                                            grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* DeleteCheckpoint(grpc::CallbackServerContext* ctx,
                                             const grpc::ByteBuffer* req,
                                             grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* RetrieveResult(grpc::CallbackServerContext* ctx,
                                           const grpc::ByteBuffer* req,
                                           grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* CreateSampler(grpc::CallbackServerContext* ctx,
                                          const grpc::ByteBuffer* req,
                                          grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* DeleteSampler(grpc::CallbackServerContext* ctx,
                                          const grpc::ByteBuffer* req,
                                          grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* Sample(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* req,
                                   grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* ComputeLogprobs(grpc::CallbackServerContext* ctx,
                                            const grpc::ByteBuffer* req,
                                            grpc::ByteBuffer* resp) override;
  grpc::ServerWriteReactor<grpc::ByteBuffer>* SampleStream(grpc::CallbackServerContext* ctx,
                                                           const grpc::ByteBuffer* req) override;
  grpc::ServerReadReactor<grpc::ByteBuffer>* StreamForwardBackward(grpc::CallbackServerContext* ctx,
                                                                   grpc::ByteBuffer* resp) override;

  // For the stream's reactor (stream_reactor.cc), which outlives no call of this service.
  Ops* ops() const { return ops_; }
  const ApiKeys& keys() const { return keys_; }

 private:
  // Parses the request and calls `handler` with it; a request that does not parse is
  // INVALID_ARGUMENT with the reason.
  template <typename Req, typename Resp>
  grpc::ServerUnaryReactor* Unary(grpc::CallbackServerContext* ctx, const grpc::ByteBuffer* in,
                                  grpc::ByteBuffer* out,
                                  void (TinkerdService::*handler)(grpc::CallbackServerContext*,
                                                                  Req*, Resp*, UnaryCall*));
  // The handlers, on parsed requests (theirs to consume); each answers through `reactor`.
  void DoCreateModel(grpc::CallbackServerContext* ctx, v1::CreateModelRequest* req,
                     v1::ModelInfo* resp, UnaryCall* reactor);
  void DoGetInfo(grpc::CallbackServerContext* ctx, v1::ModelRef* req, v1::ModelInfo* resp,
                 UnaryCall* reactor);
  void DoListModels(grpc::CallbackServerContext* ctx, v1::ListModelsRequest* req,
                    v1::ListModelsResponse* resp, UnaryCall* reactor);
  void DoDeleteModel(grpc::CallbackServerContext* ctx, v1::ModelRef* req,
                     v1::DeleteModelResponse* resp, UnaryCall* reactor);
  void DoForward(grpc::CallbackServerContext* ctx, v1::ForwardBackwardRequest* req,
                 v1::ForwardBackwardOutput* resp, UnaryCall* reactor);
  void DoForwardBackward(grpc::CallbackServerContext* ctx, v1::ForwardBackwardRequest* req,
                         v1::ForwardBackwardOutput* resp, UnaryCall* reactor);
  void DoOptimStep(grpc::CallbackServerContext* ctx, v1::OptimStepRequest* req,
                   v1::OptimStepResponse* resp, UnaryCall* reactor);
  void DoSaveState(grpc::CallbackServerContext* ctx, v1::SaveStateRequest* req,
                   v1::SaveStateResponse* resp, UnaryCall* reactor);
  void DoLoadState(grpc::CallbackServerContext* ctx, v1::LoadStateRequest* req,
                   v1::LoadStateResponse* resp, UnaryCall* reactor);
  void DoCreateModelFromState(grpc::CallbackServerContext* ctx,
                              v1::CreateModelFromStateRequest* req, v1::ModelInfo* resp,
                              UnaryCall* reactor);
  void DoSaveWeightsForSampler(grpc::CallbackServerContext* ctx,
                               v1::SaveWeightsForSamplerRequest* req,
                               v1::SaveWeightsForSamplerResponse* resp, UnaryCall* reactor);
  void DoListCheckpoints(grpc::CallbackServerContext* ctx, v1::ListCheckpointsRequest* req,
                         v1::ListCheckpointsResponse* resp, UnaryCall* reactor);
  void DoDeleteCheckpoint(grpc::CallbackServerContext* ctx, v1::DeleteCheckpointRequest* req,
                          v1::DeleteCheckpointResponse* resp, UnaryCall* reactor);
  void DoRetrieveResult(grpc::CallbackServerContext* ctx, v1::RetrieveResultRequest* req,
                        v1::RetrieveResultResponse* resp, UnaryCall* reactor);
  void DoCreateSampler(grpc::CallbackServerContext* ctx, v1::CreateSamplerRequest* req,
                       v1::SamplerInfo* resp, UnaryCall* reactor);
  void DoDeleteSampler(grpc::CallbackServerContext* ctx, v1::SamplerRef* req,
                       v1::DeleteSamplerResponse* resp, UnaryCall* reactor);
  void DoSample(grpc::CallbackServerContext* ctx, v1::SampleRequest* req, v1::SampleResponse* resp,
                UnaryCall* reactor);
  void DoComputeLogprobs(grpc::CallbackServerContext* ctx, v1::ComputeLogprobsRequest* req,
                         v1::ComputeLogprobsResponse* resp, UnaryCall* reactor);
  // The caller's tenant; otherwise finishes `reactor` with UNAUTHENTICATED and returns nullopt.
  std::optional<std::string> Admit(grpc::CallbackServerContext* ctx, UnaryCall* reactor);

  Ops* ops_;
  Sampling* sampling_;
  ApiKeys keys_;
};

}  // namespace tinkerd
