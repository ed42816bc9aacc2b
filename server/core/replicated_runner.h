// Data parallelism at the server: rank 0 serves gRPC; every operation that changes runner state is
// broadcast to the other ranks as a Command and applied on all ranks in the same order, so their
// replicas stay identical and their collectives (inside the runner) line up. At world size 1 the
// broadcast is skipped.
//
// A sampler's forward on a base held in slices (--shard_base) is a command too (base_forward): rank
// 0 computes it while every rank takes part in gathering the base for it. So is one with the
// experts spread over ranks (expert_forward): rank 0 computes it while the rest of its group runs
// their experts for the rows it sends them.
//
// A failed broadcast or collective (a rank died, hangs, or the network broke; bounded by the
// collective timeout) marks the job broken: every later call answers UNAVAILABLE, and the
// on_broken callback turns health to NOT_SERVING. A heartbeat (Ping) keeps idle ranks within their
// collective timeout and notices dead ranks while no request is running.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "runner/dist/collectives.h"
#include "runner/model_runner.h"
#include "server/core/command.h"
#include "tinkerd/v1/internal.pb.h"
#include "tinkerd/v1/tinkerd.pb.h"

namespace tinkerd {

class ReplicatedRunner {
 public:
  ReplicatedRunner(ModelRunner* runner, std::shared_ptr<Collectives> collectives);

  absl::StatusOr<std::string> CreateModel(const v1::CreateModelRequest& req);
  absl::Status DeleteModel(const std::string& model_id);
  // `batch`: the request's datums, decoded and checked at the edge; `req` travels to the other
  // ranks (moved into the command, not copied).
  absl::StatusOr<ForwardBackwardResult> ForwardBackward(v1::ForwardBackwardRequest req, Batch batch,
                                                        bool backward);
  // Several models' calls in shared passes (ModelRunner::ForwardBackwardJoint): one result per
  // call, in order; `batches[i]` is `reqs[i]`'s datums, decoded and checked at the edge.
  std::vector<absl::StatusOr<ForwardBackwardResult>> ForwardBackwardJoint(
      std::vector<v1::ForwardBackwardRequest> reqs, std::vector<Batch> batches, bool backward);
  absl::StatusOr<OptimStepResult> OptimStep(const v1::OptimStepRequest& req);
  // Several models' steps (ModelRunner::OptimStepJoint): one result per request, in order.
  std::vector<absl::StatusOr<OptimStepResult>> OptimStepJoint(
      std::vector<v1::OptimStepRequest> reqs);
  absl::StatusOr<int64_t> BeginStream(const std::string& model_id, const v1::LossFn& loss);
  // `batch`: `data` decoded and checked against the stream's loss `loss`.
  absl::Status StreamAppend(int64_t stream_id, const v1::LossFn& loss, std::vector<v1::Datum> data,
                            Batch batch);
  absl::StatusOr<ForwardBackwardResult> FinishStream(int64_t stream_id);
  void AbortStream(int64_t stream_id);
  // Loads on every rank (the path must be readable by all ranks: shared storage across machines).
  // Every rank takes part (accumulated gradients are summed over ranks); rank 0 writes.
  absl::Status SaveState(const std::string& model_id, const std::string& fs_path,
                         const SaveStateOptions& options);
  absl::Status LoadState(const std::string& model_id, const std::string& fs_path,
                         bool with_optimizer);
  absl::StatusOr<std::string> CreateModelFromState(const std::string& fs_path, bool with_optimizer);
  // A sampler export, and a sampler's copy of a model's weights: on rank 0 alone, or, for a model
  // whose parameters are sharded (ModelRunner::Gathers), gathered by every rank for rank 0; with
  // the experts spread over ranks, a copy is made on every rank of rank 0's group.
  absl::Status SaveWeightsForSampler(const std::string& model_id, const std::string& fs_path,
                                     bool merged, bool overwrite);
  absl::StatusOr<std::shared_ptr<const Policy>> FreezePolicy(const std::string& model_id);
  // A sampler export's weights: read on rank 0 alone (from any thread), or, with the experts
  // spread over ranks, by each rank of rank 0's group for its experts (a command).
  absl::StatusOr<std::shared_ptr<const Policy>> LoadPolicy(const std::string& fs_path);
  // Heartbeat; a no-op at world size 1.
  absl::Status Ping();
  // Tells the other ranks to exit. Call once, after the last request.
  void Shutdown();

  bool healthy() const;
  void set_on_broken(std::function<void(const absl::Status&)> f);
  ModelRunner* local() const { return runner_; }
  int world_size() const { return collectives_->world_size(); }

  // The other ranks' main loop: applies rank 0's commands until `shutdown` (OK) or a failure.
  static absl::Status FollowerLoop(ModelRunner* runner, Collectives* collectives);

 private:
  // Broadcasts `cmd` (world size > 1), executes it here as every follower does, and agrees with
  // the other ranks on the outcome; one command at a time.
  absl::StatusOr<CommandResult> Replicate(Command cmd);
  absl::StatusOr<CommandResult> Replicate(v1::internal::Command wire) {
    Command c;
    c.wire = std::move(wire);
    return Replicate(std::move(c));
  }
  void MarkBroken(const absl::Status& why) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  ModelRunner* runner_;
  std::shared_ptr<Collectives> collectives_;
  mutable absl::Mutex mu_;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void(const absl::Status&)> on_broken_;
  std::atomic<int64_t> experts_keys_{0};  // the last key a freeze_policy drew
};

// After each command every rank shares whether it succeeded. DATA_LOSS when some succeeded and
// others failed: their states differ from then on (say, a rank that could not read a checkpoint,
// or one started with a smaller --memory_budget_mb that refused a model). UNAVAILABLE when the
// exchange itself fails.
absl::Status AgreeOnOutcome(Collectives* collectives, const absl::Status& mine);

}  // namespace tinkerd
