// ModelRunner: trains many adapters ("models") of one frozen base model with Tinker's losses.
//
// Semantics (DESIGN.md §3): ForwardBackward back-propagates the raw summed loss of its datums into
// per-model gradient accumulators and adds the call's valid-token and valid-sequence counts to the
// model's counters; it never normalizes and never zeroes. OptimStep is the only place that
// normalizes (by the denominator of the model's LossReduction), reduces across data-parallel ranks,
// clips on the global norm and applies AdamW. The result is independent of how a logical batch was
// split into calls and micro-batches.
//
// Errors: every method returns absl::Status; no exception escapes. A method that fails leaves the
// model exactly as it was (weights, accumulators, counters, optimizer moments, step).
// Thread-safety: methods may be called from any thread; calls are serialized internally.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "runner/batch.h"
#include "runner/runner_config.h"
#include "runner/sample/base_forward.h"
#include "runner/sample/expert_forward.h"
#include "runner/types.h"
#include "runner/util/memory_account.h"
#include "runner/validate.h"

namespace tinkerd {

struct ModelState;
struct Policy;

// base_model_path naming the small default model generated deterministically in memory.
inline constexpr char kEmbeddedDefaultModel[] = "embedded:default";

class ModelRunner {
 public:
  // Loads the base model named by config.base_model_path (Hugging Face layout), or generates the
  // embedded default model in memory when that path is kEmbeddedDefaultModel.
  static absl::StatusOr<std::unique_ptr<ModelRunner>> Create(const RunnerConfig& config);
  ~ModelRunner();
  ModelRunner(const ModelRunner&) = delete;
  ModelRunner& operator=(const ModelRunner&) = delete;

  // `model_id` empty: a new id from NewModelId(). Data-parallel ranks pass rank 0's id.
  absl::StatusOr<std::string> CreateModel(const CreateModelOptions& options,
                                          const std::string& model_id = "");
  absl::Status DeleteModel(const std::string& model_id);
  absl::StatusOr<ModelInfo> GetInfo(const std::string& model_id) const;
  std::vector<std::string> ListModels() const;

  // Logprobs of target_tokens and the loss metrics, without touching any state.
  absl::StatusOr<ForwardBackwardResult> Forward(const std::string& model_id, const Batch& batch);
  // Accumulates the raw summed loss gradient of the batch. On error nothing is accumulated.
  absl::StatusOr<ForwardBackwardResult> ForwardBackward(const std::string& model_id,
                                                        const Batch& batch);
  // The same for callers holding unchecked datums (tests, benchmarks, embedders): Batch::Check
  // against this runner's limits, then the above.
  absl::StatusOr<ForwardBackwardResult> Forward(
      const std::string& model_id, const std::vector<Datum>& data, const std::string& loss_fn,
      const std::map<std::string, double>& loss_fn_config);
  absl::StatusOr<ForwardBackwardResult> ForwardBackward(
      const std::string& model_id, const std::vector<Datum>& data, const std::string& loss_fn,
      const std::map<std::string, double>& loss_fn_config);

  // Several models' calls of one direction (forward, or forward_backward with `backward`) in
  // shared passes over the base, for many tenants with small batches (runner/joint_call.h): the
  // base weights' products run once over every call's tokens, each LoRA model's over its own.
  // One result per call, in order, each what the call alone would give: its outputs, gradient
  // sums and counts, bitwise where the kernels are row-invariant (docs/kernels.md), and its
  // failure its own. Calls of full fine-tunes, of a model with an open stream, and a model's
  // second call run alone, in order. Under data parallelism every rank passes the same calls.
  struct Call {
    std::string model_id;
    const Batch* batch = nullptr;  // outlives the call
  };
  std::vector<absl::StatusOr<ForwardBackwardResult>> ForwardBackwardJoint(
      const std::vector<Call>& calls, bool backward);

  // Several models' optimizer steps, their AdamW as one multi-tensor call where their
  // hyperparameters and step numbers agree (runner/joint_call.h). One result per step, in order,
  // each what the step alone would give (bitwise on the CPU), its failure its own. A model's
  // second step runs alone, after. Under data parallelism every rank passes the same steps.
  struct Step {
    std::string model_id;
    AdamParams params;
  };
  std::vector<absl::StatusOr<OptimStepResult>> OptimStepJoint(const std::vector<Step>& steps);

  // Streaming forward_backward, for rollout services that produce trajectories over time. Datums
  // appended to a stream run in packed micro-batches as soon as micro_batch_tokens of them are
  // buffered; FinishStream runs the rest and commits the whole stream as ONE forward_backward
  // (atomically: a stream that fails or is aborted changes nothing). Exact, because nothing is
  // normalized before OptimStep. While a stream is open its model takes no other ForwardBackward,
  // OptimStep or stream (FAILED_PRECONDITION); the server orders requests so this never happens.
  absl::StatusOr<int64_t> BeginStream(const std::string& model_id, const std::string& loss_fn,
                                      const std::map<std::string, double>& loss_fn_config);
  // The batch's loss must be the stream's. The vector form checks the datums first.
  absl::Status StreamAppend(int64_t stream_id, Batch batch);
  absl::Status StreamAppend(int64_t stream_id, std::vector<Datum> data);
  absl::StatusOr<ForwardBackwardResult> FinishStream(int64_t stream_id);
  void AbortStream(int64_t stream_id);

  // Normalizes, reduces, clips and applies AdamW, then clears accumulators and counters.
  // With no valid token accumulated it takes a zero-gradient step (num_tokens 0 in the result).
  absl::StatusOr<OptimStepResult> OptimStep(const std::string& model_id, const AdamParams& params);

  // Checkpoints. `path` names a checkpoint: a link to a complete directory, published atomically
  // (runner/checkpoint/store.h). SaveState refuses (FAILED_PRECONDITION) while gradients are
  // accumulated unless include_accumulated. LoadState needs a model with nothing accumulated and
  // the same adapter layout; corrupt, truncated or foreign checkpoints are refused and change
  // nothing. Without the optimizer, Adam moments and the step start from zero.
  // Under data parallelism every rank calls SaveState (accumulated gradients are summed over the
  // ranks, so the checkpoint holds the global sum at any world size) and rank 0 alone writes;
  // loading puts that sum on rank 0 and zeros elsewhere, so the next step reduces to it. Under
  // --shard=optimizer every rank writes its slices and loads its slice of any checkpoint. Every
  // rank returns rank 0's outcome.
  absl::Status SaveState(const std::string& model_id, const std::string& path,
                         const SaveStateOptions& options);
  absl::Status LoadState(const std::string& model_id, const std::string& path, bool with_optimizer);
  // A new model from a checkpoint (its adapter layout, loss_reduction and seed).
  absl::StatusOr<std::string> CreateModelFromState(const std::string& path, bool with_optimizer,
                                                   const std::string& model_id = "");
  // "model-" and 128 random bits in hex, from the kernel's CSPRNG: never reused, across restarts
  // too (an old model's checkpoints stay its own), and telling nothing of how many models exist.
  static absl::StatusOr<std::string> NewModelId();
  // For samplers: a PEFT adapter directory, or (merged) full weights in Hugging Face layout that
  // ModelRunner::Create loads as a base model. For a model whose parameters are sharded
  // (Gathers), every rank calls it in the same order, and rank 0 writes.
  absl::Status SaveWeightsForSampler(const std::string& model_id, const std::string& path,
                                     bool merged, bool overwrite);

  // The weights a sampler reads (runner/sample/policy.h): the model's as they are now, copied so
  // that later training does not change them; `model_id` empty: the base model. For a model
  // whose parameters are sharded (Gathers), every rank calls it in the same order; rank 0 gets
  // the whole copy and the others, which only take part in the gathers, null. With the experts
  // spread over ranks (SpreadsExperts), every rank calls it for a model, with the same
  // `experts_key` (> 0, new for each call), and each rank of rank 0's group keeps its own
  // experts' copy under that key until DropFrozen; rank 0 gets the policy, the others null.
  absl::StatusOr<std::shared_ptr<const Policy>> FreezePolicy(const std::string& model_id,
                                                             int64_t experts_key = 0) const;
  // Whether the model's parameters are spread over the ranks (a full fine-tune under
  // --shard=full), so that exporting or freezing it is a collective; false for no such model.
  bool Gathers(const std::string& model_id) const;
  // The weights of a SaveWeightsForSampler export at `path` (either layout), to sample from.
  // Takes no lock: callable from any thread while training runs. With the experts spread over
  // ranks (an adapter export only), a collective with a key, as FreezePolicy.
  absl::StatusOr<std::shared_ptr<const Policy>> LoadPolicy(const std::string& path,
                                                           int64_t experts_key = 0) const;
  // Under --shard_base, one forward of a policy on the base (Policy::gathered): `forward` runs
  // with the base's rest gathered whole and each decoder layer gathered as it asks for it, in
  // order; the layers it does not reach are gathered after it. A collective: every rank calls it
  // alike, the others with a null `forward` (they take part in the gathers alone), and rank 0's
  // outcome is theirs. RESOURCE_EXHAUSTED on every rank when one has no room for the units whole.
  absl::Status ForwardGatheredBase(const BaseForward& forward) const;
  // How the policies of a sharded base run their forwards: `gather` must have every rank call
  // ForwardGatheredBase (the server broadcasts a command for each); until it is set, this rank
  // calls it alone. Before the first policy is made; a no-op on a base held whole.
  void SetGatherBase(GatherBase gather);

  // Whether each layer's experts are spread over the ranks (--expert_parallel > 1).
  bool SpreadsExperts() const;
  // Then one forward of a policy (Policy::spread): rank 0 runs `forward`, whose routed layers
  // send their rows to the ranks of its group holding their experts, which run them on the
  // policy's frozen copy (FreezePolicy's key); the other ranks of the group serve, and the rest
  // return. A collective: every rank calls it alike, the others with a null `forward`. A failure
  // on any rank is every rank's.
  absl::Status ForwardSpreadExperts(const ExpertForward& forward) const;
  // How the policies run those forwards: `spread` must have every rank call ForwardSpreadExperts
  // (the server broadcasts a command for each); until it is set, this rank calls it alone. Before
  // the first policy is made; a no-op where every rank holds every expert.
  void SetSpreadExperts(SpreadExperts spread);
  // On rank 0: the keys of frozen policies that are gone (their last copy dropped) since the last
  // call; the server sends them to every rank, which calls DropFrozen with them.
  std::vector<int64_t> TakeDropped() const;
  void DropFrozen(const std::vector<int64_t>& keys) const;

  // Copies of a model's trainable tensors (or their gradients / Adam moments), sorted by name.
  // Under --shard=optimizer, gradients and moments are this rank's slices, each named
  // "<tensor>[begin:end]" by its range in the flattened tensor; so under --shard=full, where the
  // parameters of a full fine-tune are gathered whole (a collective: every rank calls it). Under
  // expert parallelism every expert's tensors are gathered (a collective likewise).
  absl::StatusOr<std::vector<NamedValues>> Snapshot(const std::string& model_id,
                                                    StateKind kind) const;

  const RunnerConfig& config() const;
  // The base model's fingerprint (its config and weights), which its checkpoints record.
  uint64_t base_fingerprint() const;
  // The process's one memory account (runner/util/memory_account.h): models and training calls
  // reserve in it here; the server's sampling engine reserves its KV caches in it too.
  std::shared_ptr<MemoryAccount> memory_account() const;
  // The base model's vocabulary and context length, for validating requests up front.
  ModelLimits limits() const;

 private:
  struct Impl;
  explicit ModelRunner(std::unique_ptr<Impl> impl);
  // FreezePolicy's part with the experts spread over ranks; `policy` holds the fields every
  // policy takes from the runner.
  absl::StatusOr<std::shared_ptr<const Policy>> FreezeSpread(const ModelState& t, int64_t key,
                                                             std::shared_ptr<Policy> policy) const;
  // LoadPolicy's part likewise.
  absl::StatusOr<std::shared_ptr<const Policy>> LoadSpread(const std::string& path,
                                                           int64_t key) const;
  std::unique_ptr<Impl> impl_;
};

}  // namespace tinkerd
