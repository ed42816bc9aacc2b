// The operations every front end shares (gRPC, the Tinker HTTP API): each checks what the client
// sent, builds the scheduler job or registry change, and answers `done` exactly once with the
// typed response or the reason. Front ends only authenticate, parse their wire format, and turn
// the answer back into it; so a request means the same thing, and is applied at most once by
// (model_id, seq_id, kind, payload), whichever edge it came through.
//
// Every op that names a model checks that the tenant owns it: another tenant's model is NOT_FOUND,
// exactly like a model that does not exist. `done` runs on the scheduler thread or, for an
// immediate answer, on the caller's thread before the op returns; it must not block.
//
// Ops is the edges' one door to the core: it hands out neither the runner nor the scheduler (both
// only forward-declared here), so what an edge may do to them is what this class offers.
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "runner/util/hash.h"
#include "runner/util/memory_account.h"
#include "runner/validate.h"
#include "server/common/metrics.h"
#include "server/core/bases.h"
#include "server/core/checkpoint_paths.h"
#include "tinkerd/v1/tinkerd.pb.h"

namespace tinkerd {

class Scheduler;
struct StreamState;

template <typename T>
using Done = std::function<void(absl::StatusOr<T>)>;

// A checkpoint as listings show it.
struct CheckpointEntry {
  std::string path;  // tinker://<model_id>/<kind folder>/<name>
  std::string kind;  // "training", "sampler" or "external" (CheckpointKindName)
  absl::Time time;   // when it was committed
  int64_t size_bytes = 0;
  std::optional<absl::Time> expires_at;  // unset: never (SetCheckpointExpiry)
};

// In a checkpoint's directory, when it expires: seconds since the epoch, in decimal.
inline constexpr char kExpiryFile[] = ".expires_at";

// A file of a checkpoint, for its archive.
struct CheckpointFile {
  std::string name;  // relative to the checkpoint's folder
  std::string path;  // on disk
};

class Ops {
 public:
  // `bases`: the served base models and their runners. `account`: where a queued training
  // call's request and decoded batch are held until it has run (runner/util/memory_account.h);
  // null where queued requests are not accounted (ranks that must admit alike). `join_steps`:
  // queued optim_steps of several models may share one multi-tensor AdamW
  // (ServerConfig::join_optim_steps).
  Ops(Bases* bases, Scheduler* scheduler, std::string checkpoint_root, Metrics* metrics,
      std::shared_ptr<MemoryAccount> account = nullptr, bool join_steps = false);

  // The served base models, the default first.
  std::vector<BaseModel> BaseModels() const;
  // The base clients name `name` in `field` (empty: the default), or INVALID_ARGUMENT naming the
  // field and the served bases.
  absl::StatusOr<BaseModel> BaseNamed(absl::string_view name, absl::string_view field) const;
  // The base model `model_id` was created on (the default for a model that does not exist).
  const BaseModel& BaseOf(const std::string& model_id) const { return bases_->Of(model_id).base; }
  // The base a training checkpoint of the tenant (tinker://...) was trained on; the default where
  // its manifest does not say.
  const BaseModel& BaseOfCheckpoint(const std::string& tenant, const std::string& path) const;

  // Registry changes, on the scheduler thread between jobs. CreateModel trains on req.base_model;
  // CreateModelFromState on the base the checkpoint was trained on.
  void CreateModel(const std::string& tenant, v1::CreateModelRequest req, Done<v1::ModelInfo> done);
  void CreateModelFromState(const std::string& tenant, v1::CreateModelFromStateRequest req,
                            Done<v1::ModelInfo> done);
  void DeleteModel(const std::string& tenant, const std::string& model_id,
                   Done<v1::DeleteModelResponse> done);

  // Reads, answered at once.
  absl::StatusOr<v1::ModelInfo> GetInfo(const std::string& tenant, const std::string& model_id);
  v1::ListModelsResponse ListModels(const std::string& tenant);
  absl::StatusOr<v1::ListCheckpointsResponse> ListCheckpoints(const std::string& tenant,
                                                              const std::string& model_id);
  // The same, with times and sizes: training checkpoints, then sampler ones, each by name.
  absl::StatusOr<std::vector<CheckpointEntry>> Checkpoints(const std::string& tenant,
                                                           const std::string& model_id);
  // The models `tenant` has checkpoints of, existing or deleted since, by id.
  std::vector<std::string> CheckpointedModels(const std::string& tenant) const;
  absl::Status DeleteCheckpoint(const std::string& tenant, const std::string& path);
  // When checkpoint `path` of `tenant` expires (nullopt: never). Kept beside its files as store
  // metadata (kExpiryFile): an overwrite, a copy and an archive leave it behind.
  absl::Status SetCheckpointExpiry(const std::string& tenant, const std::string& path,
                                   std::optional<absl::Time> at);
  // Deletes every checkpoint of every tenant that expired by `now`; how many.
  int ExpireCheckpoints(absl::Time now);
  // Checkpoint `path` of `tenant` again, under a new run id with the same kind and name:
  // tinker://<new id>/<kind>/<name>. Its files are hard links to the source's (copies where the
  // file system cannot link), so no bytes are duplicated and deleting either leaves the other
  // whole. The new run holds the checkpoint only: nothing trains on it until a model loads it.
  absl::StatusOr<std::string> CopyCheckpoint(const std::string& tenant, const std::string& path);
  // The regular files of a checkpoint of this tenant (tinker://model/kind/name), sorted by name;
  // symbolic links and what they point at are left out.
  absl::StatusOr<std::vector<CheckpointFile>> CheckpointFiles(const std::string& tenant,
                                                              const std::string& path);
  absl::StatusOr<v1::RetrieveResultResponse> RetrieveResult(const std::string& tenant,
                                                            const std::string& model_id,
                                                            int64_t seq_id);
  // The training manifest of a checkpoint `path` (tinker://...) the tenant owns.
  absl::StatusOr<v1::ModelInfo> CheckpointInfo(const std::string& tenant, const std::string& path);
  // When the model last got a request (its creation, or an ordered call), or NOT_FOUND.
  absl::StatusOr<absl::Time> LastRequest(const std::string& tenant, const std::string& model_id);

  // Ordered by (model_id, seq_id). An invalid request still takes its seq_id slot, answered with
  // the error, so the model's later requests are not held up behind it. ForwardBackward consumes
  // `req` (its datums move into the job).
  void ForwardBackward(const std::string& tenant, v1::ForwardBackwardRequest* req, bool backward,
                       Done<v1::ForwardBackwardOutput> done);
  void OptimStep(const std::string& tenant, v1::OptimStepRequest req,
                 Done<v1::OptimStepResponse> done);
  void SaveState(const std::string& tenant, v1::SaveStateRequest req,
                 Done<v1::SaveStateResponse> done);
  void LoadState(const std::string& tenant, v1::LoadStateRequest req,
                 Done<v1::LoadStateResponse> done);
  // `external`: Tinker's save_weights_external, under external_weights/: a LoRA model's PEFT
  // adapter, a full fine-tune's merged weights (req.merged unused), for download.
  void SaveWeightsForSampler(const std::string& tenant, v1::SaveWeightsForSamplerRequest req,
                             Done<v1::SaveWeightsForSamplerResponse> done, bool external = false);

  // StreamForwardBackward, header (model_id, seq_id, loss_fn): a job in the model's order that
  // takes the datums the edge appends to `state` (ops/stream_job.h) as they arrive, and commits
  // them as one forward_backward once `state` is closed. A new seq_id is submitted at once (its
  // digest taken when it finishes); a retry (`replay`: SeqIdUsed said so) only once complete,
  // with its whole digest, to be compared with the first request's.
  void StreamForwardBackward(const std::string& tenant, const std::string& model_id, int64_t seq_id,
                             v1::LossFn loss_fn, std::shared_ptr<StreamState> state, bool replay,
                             Done<v1::ForwardBackwardOutput> done);
  // Whether (model_id, seq_id) was applied already or is queued: a stream for it is a retry.
  bool SeqIdUsed(const std::string& model_id, int64_t seq_id) const;
  // A stream's state changed (a datum, its close, an error): its job looks again.
  void WakeStreams();

  // Takes (model_id, seq_id) for a request its front end could not decode and answers it with
  // `error`: the slot is used up like any invalid request's, so later ones are not held up.
  void Refuse(const std::string& tenant, const std::string& model_id, int64_t seq_id,
              std::string kind, uint64_t payload_hash, absl::Status error,
              Done<v1::RetrieveResultResponse> done);

  // Where checkpoint `path` of `tenant` lies on disk, and a storage error as the client may see
  // it (paths under the root become tinker:// paths; the root itself is masked).
  std::string CheckpointDir(const std::string& tenant, const CheckpointPath& path) const {
    return path.Fs(TenantRoot(tenant));
  }
  absl::Status HideCheckpointPaths(const std::string& tenant, const absl::Status& st) const;

  // NOT_FOUND when the model belongs to another tenant (indistinguishable from a missing model).
  absl::Status CheckOwner(const std::string& model_id, const std::string& tenant) const;

  Metrics* metrics() const { return metrics_; }

 private:
  // Creates a model on the scheduler thread, registered to `tenant`; `create` makes it in the
  // runner. Answers with its description.
  void CreateRegistered(const std::string& tenant, const Bases::Served& base,
                        std::function<absl::StatusOr<std::string>()> create,
                        Done<v1::ModelInfo> done);
  // Submits an ordered job whose result is one field of RetrieveResultResponse.
  template <typename Resp>
  void SubmitOrdered(const std::string& model_id, int64_t seq_id, std::string kind, uint64_t hash,
                     std::function<absl::StatusOr<v1::RetrieveResultResponse>()> run,
                     const Resp& (v1::RetrieveResultResponse::*field)() const, Done<Resp> done);
  std::string TenantRoot(const std::string& tenant) const {
    return checkpoint_root_ + "/" + tenant;
  }

  Bases* bases_;
  Scheduler* scheduler_;
  std::string checkpoint_root_;
  Metrics* metrics_;
  std::shared_ptr<MemoryAccount> account_;
};

// FNV-1a over the deterministic serialization: the idempotency check of (model_id, seq_id).
// `h` continues an earlier hash (a stream's digest covers its header and every datum in order).
uint64_t PayloadHash(const google::protobuf::Message& m, uint64_t h = kFnv64Basis);

}  // namespace tinkerd
