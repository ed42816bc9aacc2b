// Internal: the two functions that change a model's training state, forward(_backward) into its
// gradient sums and the optimizer step, and the call stage they share with streams. Shape
// suffixes: T tokens of a micro-batch, V vocab.
#pragma once

#include <ATen/ATen.h>

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "runner/dist/collectives.h"
#include "runner/loss/loss_spec.h"
#include "runner/model/config.h"
#include "runner/model/transformer.h"
#include "runner/model_state.h"
#include "runner/runner_config.h"
#include "runner/types.h"
#include "runner/util/memory_account.h"

namespace tinkerd {

// Everything a training step needs besides the model's state.
struct StepContext {
  const ModelConfig* config;
  const BaseWeights* base;
  Collectives* collectives;
  at::ScalarType compute_dtype;
  at::Device device;  // of the weights; each micro-batch's inputs are moved there
  int64_t micro_batch_tokens;
  ForwardOptions forward;            // activation checkpointing
  MemoryAccount* account = nullptr;  // where a call reserves its memory; null: nowhere
};

// One logical forward(_backward) call in progress. Run() may be called many times (a stream);
// each runs its datums in packed micro-batches into a staged gradient. Commit() adds the staged
// gradient and the global counts to the model's state, once. Destroying a stage without Commit()
// discards its contribution: the state is untouched until Commit.
class CallStage {
 public:
  CallStage(const StepContext& ctx, ModelState& model, ResolvedLoss loss, bool backward);
  // Runs this rank's share of `data` (Karmarkar–Karp over token counts, the same partition on
  // every rank). Data must already be validated. Throws on LibTorch errors; the caller passes the
  // outcome to Commit, which every rank must reach so collectives line up.
  void Run(const std::vector<Datum>& data);
  // Run, unless `local` (this rank's outcome so far) failed; returns the outcome, exceptions
  // turned into statuses. Under --shard=full the ranks first agree on `local`, so that every rank
  // runs (and its gathers line up) or none does.
  absl::Status RunIf(absl::Status local, const std::vector<Datum>& data);
  // Agrees with every rank on `local` (this rank's outcome), sums counts and losses over ranks,
  // gathers per-datum outputs, and only if every rank succeeded adds the staged gradient.
  absl::StatusOr<ForwardBackwardResult> Commit(const absl::Status& local);
  const std::string& model_id() const { return model_.id; }

 private:
  StepContext ctx_;
  ModelState& model_;
  ResolvedLoss loss_;
  bool backward_;
  std::vector<at::Tensor> params_;
  // This call's gradient, in model_.params' order; undefined where no micro-batch reached it yet.
  std::vector<at::Tensor> staged_;
  // Under --shard=full: this rank's slice of the call's gradient summed over ranks, per unit of
  // model_.sharded (reduced as each layer's backward ends).
  std::vector<at::Tensor> staged_C_;
  ForwardBackwardResult result_;
  double loss_sum_ = 0;
  int64_t valid_tokens_ = 0, valid_sequences_ = 0, clipped_tokens_ = 0;
  std::vector<size_t> owned_;  // indices into result_.outputs computed on this rank
};

// Reserves in ctx.account (when set) what a call over `data` may take beyond the model's state
// (runner/call_memory.h); RESOURCE_EXHAUSTED, with nothing reserved, when it does not fit.
// `staged_gradient`: count the call's gradient too (a stream holds its own for its lifetime).
absl::StatusOr<Reservation> ReserveCall(const StepContext& ctx, const ModelState& model,
                                        const std::vector<Datum>& data, bool backward,
                                        bool staged_gradient = true);

// Runs `data` as one call: a CallStage run once and committed.
absl::StatusOr<ForwardBackwardResult> RunForward(const StepContext& ctx, ModelState& model,
                                                 const std::vector<Datum>& data,
                                                 const ResolvedLoss& loss, bool backward);

// Normalize, reduce, clip, AdamW, clear. See ModelRunner::OptimStep.
absl::StatusOr<OptimStepResult> ApplyOptimStep(const StepContext& ctx, ModelState& model,
                                               const AdamParams& params);

}  // namespace tinkerd
