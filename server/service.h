// The gRPC service (callback API). Handlers validate a request completely before it is queued,
// then hand it to the scheduler; the runner is only ever driven from the scheduler thread (model
// management aside, which the runner serializes itself).
#pragma once

#include <memory>

#include <optional>
#include "runner/model_runner.h"
#include "runner/util/hash.h"
#include "runner/validate.h"

#include "server/auth.h"
#include "server/metrics.h"
#include "server/replicated_runner.h"
#include "server/scheduler.h"
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
                                                    v1::Tinkerd::Service>>>>>>>>>>>>>>>;

class TinkerdService final : public RawTinkerdService {
 public:
  // `runner` applies state changes on every rank; reads go to its local replica.
  TinkerdService(ReplicatedRunner* runner, Scheduler* scheduler, ModelLimits limits,
                 std::string checkpoint_root, ApiKeys keys, Metrics* metrics);

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
  grpc::ServerReadReactor<grpc::ByteBuffer>* StreamForwardBackward(grpc::CallbackServerContext* ctx,
                                                                   grpc::ByteBuffer* resp) override;

  ReplicatedRunner* runner() const { return runner_; }
  Scheduler* scheduler() const { return scheduler_; }
  const ModelLimits& limits() const { return limits_; }
  const ApiKeys& keys() const { return keys_; }
  // NOT_FOUND when the model belongs to another tenant (indistinguishable from a missing model).
  absl::Status CheckOwner(const std::string& model_id, const std::string& tenant);

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
  void FwdBwd(grpc::CallbackServerContext* ctx, v1::ForwardBackwardRequest* req,
              v1::ForwardBackwardOutput* resp, bool backward, UnaryCall* reactor);

  ReplicatedRunner* runner_;
  Scheduler* scheduler_;
  // The caller's tenant, after checking its key and (when model_id is given) that the model is
  // its own; otherwise finishes `reactor` with the error and returns nullopt. Another tenant's
  // model is NOT_FOUND, exactly like a model that does not exist.
  std::optional<std::string> Admit(grpc::CallbackServerContext* ctx, UnaryCall* reactor,
                                   const std::string* model_id);
  // Creates a model on the scheduler thread (the registry's), registered to `tenant`, and answers
  // with its description; `create` makes it in the runner.
  void CreateRegistered(const std::string& tenant,
                        std::function<absl::StatusOr<std::string>()> create, v1::ModelInfo* resp,
                        UnaryCall* reactor);
  std::string TenantRoot(const std::string& tenant) const {
    return checkpoint_root_ + "/" + tenant;
  }

  ModelLimits limits_;
  std::string checkpoint_root_;
  ApiKeys keys_;
  Metrics* metrics_;
};

// FNV-1a over the deterministic serialization: the idempotency check of (model_id, seq_id).
// `h` continues an earlier hash (a stream's digest covers its header and every datum in order).
uint64_t PayloadHash(const google::protobuf::Message& m, uint64_t h = kFnv64Basis);

}  // namespace tinkerd
