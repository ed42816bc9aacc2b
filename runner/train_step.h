// Internal: the two functions that change a model's training state, forward(_backward) into its
// gradient sums and the optimizer step, and the call stage they share with streams. Shape
// suffixes: T tokens of a micro-batch, V vocab.
#pragma once

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/adamw.h"
#include "runner/dist/collectives.h"
#include "runner/dist/expert_parallel.h"
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
  // Set under --expert_parallel > 1: every call runs in step on every rank (as sharded ones do),
  // and an optimizer step reduces the experts' gradients over their replicas alone.
  const ExpertParallel* experts = nullptr;
  // Set under --shard_base: the frozen base's slices (`base` then holds none of its tensors), its
  // units gathered for every micro-batch of every model, so that every call runs in step.
  const ParamShard* base_shard = nullptr;
  // Set under --shard=full --prefetch_layers: the group a micro-batch's layers are prefetched on
  // (runner/dist/layer_prefetch.h).
  Collectives* gathers = nullptr;
};

class CallStage;

// One call's datums (indices into the data its stage planned) in a packed micro-batch.
struct Piece {
  CallStage* stage = nullptr;
  std::vector<int> mb;  // empty: a pad micro-batch under --shard=full (one masked token)
};

// A packed micro-batch of one or more calls' pieces, their tokens in piece order. Several pieces
// are calls of different LoRA models of one base run in one pass (runner/joint_call.h): the base
// weights' products run once over every token, `adapters` gives each piece's rows its own model's
// adapter, and each piece's loss, counts, outputs and gradients go to its own stage alone.
struct PackedPieces {
  std::vector<Piece> pieces;
  std::vector<int64_t> rows;  // per piece, its token rows
  PackedBatch batch;
  Adapters adapters;  // one piece: its model's adapter; several: one run per piece
};

// Packs `pieces` (each stage planned, all of one direction; several only of LoRA models).
PackedPieces Pack(std::vector<Piece> pieces);
// Runs a packed micro-batch: forward, each piece's loss, and with backward one backward pass
// whose gradients are staged in each piece's stage. Throws on LibTorch errors.
void RunPacked(const PackedPieces& packed);

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
  // turned into statuses. Under --shard=full and expert parallelism the ranks first agree on
  // `local`, so that every rank runs (and its collectives line up) or none does.
  absl::Status RunIf(absl::Status local, const std::vector<Datum>& data);
  // Run in two halves, for passes shared with other calls: Plan returns this rank's micro-batches
  // of `data` (indices into it; `data` must outlive their runs) and makes room for its outputs;
  // RunPacked then runs them, alone or beside other calls' pieces.
  std::vector<std::vector<int>> Plan(const std::vector<Datum>& data);
  // Agrees with every rank on `local` (this rank's outcome), sums counts and losses over ranks,
  // gathers per-datum outputs, and only if every rank succeeded adds the staged gradient.
  absl::StatusOr<ForwardBackwardResult> Commit(const absl::Status& local);
  const std::string& model_id() const { return model_.id; }
  const ResolvedLoss& loss() const { return loss_; }
  const StepContext& context() const { return ctx_; }

 private:
  friend PackedPieces Pack(std::vector<Piece> pieces);
  friend void RunPacked(const PackedPieces& packed);

  // The piece's raw summed loss (a scalar in the graph) from its rows `hidden_TD` of the
  // micro-batch's final hidden states; records its counts and outputs. `*valid`: whether any of
  // its tokens counts; `*weight_S`: each datum's weight Σ_t m_t·s_t (1/N_i or 1 per valid token).
  at::Tensor PieceLoss(const std::vector<int>& mb, const at::Tensor& hidden_TD,
                       const BaseWeights& weights, bool* valid, std::vector<double>* weight_S);
  // Adds one micro-batch's gradients (params_'s order; undefined: not reached) to staged_.
  void Stage(std::vector<at::Tensor> grads);
  // Whether every rank runs this call's micro-batches in step, each a collective: under
  // --shard=full (its model's or the base's units gathered) and expert parallelism.
  bool InStep() const {
    return model_.sharded.has_value() || ctx_.experts != nullptr || ctx_.base_shard != nullptr;
  }

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
  double aux_sum_ = 0;  // the router's loss (runner/loss/router_aux.h)
  int64_t valid_tokens_ = 0, valid_sequences_ = 0, clipped_tokens_ = 0;
  std::vector<size_t> owned_;  // indices into result_.outputs computed on this rank
  // The data planned last (Plan) and where its outputs begin in result_.outputs.
  const std::vector<Datum>* data_ = nullptr;
  size_t first_output_ = 0;
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

// Whether a trainable tensor is an expert's that this rank holds alone in its group (expert
// parallelism, runner/dist/expert_parallel.h).
bool IsHeldExpert(const StepContext& ctx, const std::string& name);

// Sums a replica's accumulated gradients `grads` (in the order of `names`' keys) in place over the
// ranks that share them (Note [Reduce once] in runner/dist/collectives.h): every rank for the
// replicated tensors, and under expert parallelism an expert's holders for its. Collectives.
absl::Status ReduceGradients(const StepContext& ctx, const std::map<std::string, at::Tensor>& names,
                             std::vector<at::Tensor>& grads);

// Normalize, reduce, clip, AdamW, clear. See ModelRunner::OptimStep.
absl::StatusOr<OptimStepResult> ApplyOptimStep(const StepContext& ctx, ModelState& model,
                                               const AdamParams& params);

// ApplyOptimStep in halves, so that several models' AdamW run as one multi-tensor call
// (runner/joint_call.h): Prepare normalizes, reduces, measures the norm and clips (or, with a
// non-finite norm, skips the step and clears); kernels::AdamW(adam) then steps the parameters,
// unless the step was skipped; Finish gathers shards, clears and counts. Every rank runs both
// halves of its models in the same order.
struct PreparedStep {
  ModelState* model = nullptr;
  OptimStepResult result;          // .skipped: nothing more to run but Finish
  kernels::AdamWParams adam;       // the step's lists and scalars
  std::vector<at::Tensor> params;  // the whole parameters (a shard's slices are views of them)
  Reservation memory;              // the step's transient
};
absl::StatusOr<PreparedStep> PrepareOptimStep(const StepContext& ctx, ModelState& model,
                                              const AdamParams& params);
absl::StatusOr<OptimStepResult> FinishOptimStep(const StepContext& ctx, PreparedStep& prepared);

}  // namespace tinkerd
