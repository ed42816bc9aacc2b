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

// StreamForwardBackward reads raw bytes and parses each message itself: a message that does not
// parse must fail the stream with INVALID_ARGUMENT, and gRPC's typed reader would report it as
// the end of the stream.
class TinkerdService final : public v1::Tinkerd::WithRawCallbackMethod_StreamForwardBackward<
                                 v1::Tinkerd::CallbackService> {
 public:
  // `runner` applies state changes on every rank; reads go to its local replica.
  TinkerdService(ReplicatedRunner* runner, Scheduler* scheduler, ModelLimits limits,
                 std::string checkpoint_root, ApiKeys keys, Metrics* metrics);

  grpc::ServerUnaryReactor* CreateModel(grpc::CallbackServerContext* ctx,
                                        const v1::CreateModelRequest* req,
                                        v1::ModelInfo* resp) override;
  grpc::ServerUnaryReactor* GetInfo(grpc::CallbackServerContext* ctx, const v1::ModelRef* req,
                                    v1::ModelInfo* resp) override;
  grpc::ServerUnaryReactor* ListModels(grpc::CallbackServerContext* ctx,
                                       const v1::ListModelsRequest* req,
                                       v1::ListModelsResponse* resp) override;
  grpc::ServerUnaryReactor* DeleteModel(grpc::CallbackServerContext* ctx, const v1::ModelRef* req,
                                        v1::DeleteModelResponse* resp) override;
  grpc::ServerUnaryReactor* Forward(grpc::CallbackServerContext* ctx,
                                    const v1::ForwardBackwardRequest* req,
                                    v1::ForwardBackwardOutput* resp) override;
  grpc::ServerUnaryReactor* ForwardBackward(grpc::CallbackServerContext* ctx,
                                            const v1::ForwardBackwardRequest* req,
                                            v1::ForwardBackwardOutput* resp) override;
  // Requests StreamForwardBackwardMessage; responds ForwardBackwardOutput.
  grpc::ServerReadReactor<grpc::ByteBuffer>* StreamForwardBackward(grpc::CallbackServerContext* ctx,
                                                                   grpc::ByteBuffer* resp) override;
  grpc::ServerUnaryReactor* OptimStep(grpc::CallbackServerContext* ctx,
                                      const v1::OptimStepRequest* req,
                                      v1::OptimStepResponse* resp) override;
  grpc::ServerUnaryReactor* SaveState(grpc::CallbackServerContext* ctx,
                                      const v1::SaveStateRequest* req,
                                      v1::SaveStateResponse* resp) override;
  grpc::ServerUnaryReactor* LoadState(grpc::CallbackServerContext* ctx,
                                      const v1::LoadStateRequest* req,
                                      v1::LoadStateResponse* resp) override;
  grpc::ServerUnaryReactor* CreateModelFromState(grpc::CallbackServerContext* ctx,
                                                 const v1::CreateModelFromStateRequest* req,
                                                 v1::ModelInfo* resp) override;
  grpc::ServerUnaryReactor* SaveWeightsForSampler(grpc::CallbackServerContext* ctx,
                                                  const v1::SaveWeightsForSamplerRequest* req,
                                                  v1::SaveWeightsForSamplerResponse* resp) override;
  grpc::ServerUnaryReactor* ListCheckpoints(grpc::CallbackServerContext* ctx,
                                            const v1::ListCheckpointsRequest* req,
                                            v1::ListCheckpointsResponse* resp) override;
  grpc::ServerUnaryReactor* DeleteCheckpoint(grpc::CallbackServerContext* ctx,
                                             const v1::DeleteCheckpointRequest* req,
                                             v1::DeleteCheckpointResponse* resp) override;
  grpc::ServerUnaryReactor* RetrieveResult(grpc::CallbackServerContext* ctx,
                                           const v1::RetrieveResultRequest* req,
                                           v1::RetrieveResultResponse* resp) override;

  ReplicatedRunner* runner() const { return runner_; }
  Scheduler* scheduler() const { return scheduler_; }
  const ModelLimits& limits() const { return limits_; }
  const ApiKeys& keys() const { return keys_; }
  // NOT_FOUND when the model belongs to another tenant (indistinguishable from a missing model).
  absl::Status CheckOwner(const std::string& model_id, const std::string& tenant);

 private:
  grpc::ServerUnaryReactor* FwdBwd(grpc::CallbackServerContext* ctx,
                                   const v1::ForwardBackwardRequest* req,
                                   v1::ForwardBackwardOutput* resp, bool backward);

  ReplicatedRunner* runner_;
  Scheduler* scheduler_;
  // The caller's tenant, after checking its key and (when model_id is given) that the model is
  // its own; otherwise finishes `reactor` with the error and returns nullopt. Another tenant's
  // model is NOT_FOUND, exactly like a model that does not exist.
  std::optional<std::string> Admit(grpc::CallbackServerContext* ctx,
                                   grpc::ServerUnaryReactor* reactor, const std::string* model_id);
  // A model just created for `tenant`: records the owner, opens its queue, describes it.
  absl::Status RegisterNewModel(const std::string& model_id, const std::string& tenant,
                                v1::ModelInfo* resp);
  std::string TenantRoot(const std::string& tenant) const {
    return checkpoint_root_ + "/" + tenant;
  }

  ModelLimits limits_;
  std::string checkpoint_root_;
  ApiKeys keys_;
  Metrics* metrics_;
  absl::Mutex owners_mu_;
  std::map<std::string, std::string> owners_ ABSL_GUARDED_BY(owners_mu_);  // model_id -> tenant
};

// FNV-1a over the deterministic serialization: the idempotency check of (model_id, seq_id).
// `h` continues an earlier hash (a stream's digest covers its header and every datum in order).
uint64_t PayloadHash(const google::protobuf::Message& m, uint64_t h = kFnv64Basis);

}  // namespace tinkerd
