// Internal: several LoRA models' forward(_backward) calls in shared passes over the base model
// (batched multi-adapter training; ModelRunner::ForwardBackwardJoint).
//
// Each call is planned as it would be alone: the same rank share and the same micro-batches
// (runner/packing/micro_batch.h). Those micro-batches are then packed side by side, at most one
// of each call per pass and micro_batch_tokens in all (a micro-batch over the budget alone runs
// alone), keeping each call's order. So each call's tokens meet its adapter's products over the
// same rows as alone, its micro-batches' gradients are summed in the same order, and what a call
// gets does not depend on who shared its passes: bitwise where the kernels are row-invariant
// (docs/kernels.md), to rounding otherwise.
#pragma once

#include <functional>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "runner/batch.h"
#include "runner/model_state.h"
#include "runner/train_step.h"

namespace tinkerd {

// One call of a shared pass: its model (LoRA, not sharded) and its checked batch.
struct JointCall {
  ModelState* model = nullptr;
  const Batch* batch = nullptr;
};

// The calls' results in order. Collectives line up across ranks when every rank passes the same
// calls. A call whose memory is not admitted beside the others' runs alone afterwards, through
// `alone` (which reserves again); when the shared pass fails on some rank, every call runs
// alone, so one call's failure is never another's.
using RunAlone = std::function<absl::StatusOr<ForwardBackwardResult>(const JointCall&)>;
std::vector<absl::StatusOr<ForwardBackwardResult>> RunJoint(const StepContext& ctx,
                                                            const std::vector<JointCall>& calls,
                                                            bool backward, const RunAlone& alone);

// Several models' optimizer steps (ModelRunner::OptimStepJoint): each prepared as alone
// (PrepareOptimStep), their AdamW run as one multi-tensor call per set of equal hyperparameters
// and step number, then each finished in order. On the CPU a parameter's update does not depend on
// which others share the call (kernels/adamw.h), so each model's step is bitwise its solo one. A
// model whose step fails (its parameters invalid) fails alone; one refused memory beside the
// others steps alone after them. With other ranks, an exception inside fails the job
// (UNAVAILABLE): this rank's collectives may be out of step with theirs.
struct JointStep {
  ModelState* model = nullptr;
  AdamParams params;
};
std::vector<absl::StatusOr<OptimStepResult>> StepJoint(const StepContext& ctx,
                                                       const std::vector<JointStep>& steps);

// The passes: for per-call micro-batch token counts (each call's in its order), which micro-batch
// of which call each pass takes, as (call, index) pairs in row order. Each pass holds at most one
// micro-batch per call and at most `budget` tokens, unless one micro-batch alone exceeds it.
std::vector<std::vector<std::pair<int, int>>> PlanPasses(
    const std::vector<std::vector<int64_t>>& tokens, int64_t budget);

}  // namespace tinkerd
