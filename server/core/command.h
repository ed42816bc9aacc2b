// A command to the runner of every data-parallel rank, and the one dispatch that executes it.
//
// Rank 0 decodes and checks a request once, at the edge, into a Command: the wire form it
// broadcasts (the client's datums, moved, not copied) and the decoded batch its own runner uses.
// A follower decodes the wire form it receives into the same Command (DecodeCommand). Every rank
// then runs it through Execute, so rank 0 and the followers share one dispatch.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runner/batch.h"
#include "runner/model_runner.h"
#include "runner/sample/policy.h"
#include "tinkerd/v1/internal.pb.h"

namespace tinkerd {

struct Command {
  v1::internal::Command wire;
  // The datums of a forward, forward_backward or stream_append, decoded and checked.
  std::optional<Batch> batch;
  // A joint command's: one per call, in order.
  std::vector<Batch> batches;
  // A base_forward's, on rank 0: the sampler's forward (followers have none: they gather alone).
  BaseForward forward;
  // An expert_forward's, on rank 0 (followers have none: they serve their experts).
  ExpertForward lead;
};

// What a command answers; rank 0 returns it to the client, followers drop it.
struct CommandResult {
  std::string model_id;           // create_model, load_state into a new model
  int64_t stream_id = 0;          // stream_begin
  ForwardBackwardResult forward;  // forward, forward_backward, stream_finish
  OptimStepResult step;           // optim_step
  // A joint command's: one per call, in order (the command itself succeeds when they ran).
  std::vector<absl::StatusOr<ForwardBackwardResult>> joint;
  std::vector<absl::StatusOr<OptimStepResult>> joint_steps;  // likewise, joint_steps
  std::shared_ptr<const Policy> policy;                      // freeze_policy (rank 0's)
};

// A follower's decoding of a command rank 0 broadcast: the batch of a datum-carrying command is
// decoded and checked against this rank's limits.
absl::StatusOr<Command> DecodeCommand(v1::internal::Command wire, const ModelLimits& limits);

// Runs `cmd` on this rank's runner. A datum-carrying command without its batch is refused
// (INTERNAL): it was not decoded.
absl::StatusOr<CommandResult> Execute(ModelRunner* runner, Command cmd);

}  // namespace tinkerd
