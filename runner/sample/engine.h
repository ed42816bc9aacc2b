// The sampling engine: continuous batching over frozen policies with a KV cache per sample.
//
// A request is admitted (bounded by running samples and reserved KV-cache bytes), prefilled in the
// next Step (one packed forward over the prompts admitted since the last step; a prompt's keys
// and values are shared by all its samples), and then decoded one token per Step together with
// every other running sample; requests join and leave the running batch between steps. The
// samples of every policy on one base model (the base itself and LoRA adapters of any ranks)
// decode in one forward, each adapter applied to its own rows; a full fine-tune's policy, which
// holds its own weights, decodes in its own. On a base the ranks hold in slices (--shard_base),
// each of those forwards gathers the base as it runs (Policy::gathered).
// The decoder is the trainer's own (runner/model/transformer.h with a KvStep, kernels/attention.h
// with queries against cached keys, the logprob head's logits), so the logprobs a sample reports
// are those Forward computes for the same tokens, to rounding.
//
// Shape suffixes: S samples in a decode step, P prompt tokens, T the prompts of a prefill packed,
// J their number, K kv heads, d head_dim, V vocab, D hidden, N a sample's token capacity.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "runner/sample/choose.h"
#include "runner/sample/policy.h"
#include "runner/sample/sample_types.h"

namespace tinkerd {
namespace kernels {
class SpinningTeam;
}  // namespace kernels

class SampleEngine {
 public:
  using Done = std::function<void(const absl::StatusOr<SampleResult>&)>;
  using Progress = SampleProgress;  // called from Step; see sample_types.h

  explicit SampleEngine(EngineLimits limits);
  ~SampleEngine();  // fails what is still admitted with UNAVAILABLE

  // Queues a request already checked by ValidateSampleRequest; `done` is called exactly once,
  // from Step (or FailAll). RESOURCE_EXHAUSTED (retry later) while its samples or KV cache do not
  // fit beside those admitted; INVALID_ARGUMENT when they never could. `progress` may be empty.
  absl::Status Admit(std::shared_ptr<const Policy> policy, SampleRequest request, Done done,
                     Progress progress = nullptr);

  // On one thread at a time: prefills the requests admitted since the last step, in order, up to
  // limits.prefill_tokens_per_step prompt tokens (the rest wait for the next steps), then decodes
  // one token for every running sample, and answers the requests whose samples all finished.
  // Returns whether work remains (another Step would do something).
  bool Step();
  // Fails every admitted request (shutdown). On the stepping thread, or once it has stopped.
  void FailAll(const absl::Status& status);

  // KV-cache bytes a request reserves: every layer's keys and values for its prompt once and for
  // each sample's own tokens.
  static int64_t KvBytes(const Policy& policy, const SampleRequest& request);

  int64_t running_sequences() const;
  int64_t reserved_bytes() const;
  // Decode forwards run so far (the stepping thread's count): one per base model per step.
  int64_t decode_forwards() const { return decode_forwards_; }

 private:
  struct Job;
  struct Sample;
  // One forward over the prompts of `jobs` (one policy), then Begin for each. A failure is
  // returned or thrown (Step's Guard takes both).
  absl::Status Prefill(const std::vector<Job*>& jobs);
  // From a job's prompt hidden states [P, D] and next-token logits z_V (lse: their log-sum-exp):
  // its prompt logprobs, and each sample's first token and KV cache. `w`: the base weights the
  // forward ran on (the head's). `score` sets a choice's reported logprobs to the trainer's
  // (HeadLogprobs).
  void Begin(Job& job, const BaseWeights& w, const at::Tensor& hidden_PD, const double* z_V,
             int64_t V, double lse, absl::FunctionRef<void(Choice&)> score);
  // One token for each of `batch`: samples of policies sharing one base, each policy's together.
  absl::Status Decode(const std::vector<std::pair<Job*, Sample*>>& batch);
  void Release(Job& job);
  // Hands the job's new tokens to its Progress; false when the listener has gone.
  static bool Report(Job& job);

  const EngineLimits limits_;
  // The decode steps' loops run on it (kernels/parallel.h), sized to LibTorch's thread count.
  std::unique_ptr<kernels::SpinningTeam> team_;
  mutable absl::Mutex mu_;
  std::deque<std::unique_ptr<Job>> admitted_ ABSL_GUARDED_BY(mu_);
  int64_t sequences_ ABSL_GUARDED_BY(mu_) = 0;
  int64_t bytes_ ABSL_GUARDED_BY(mu_) = 0;
  uint64_t unseeded_ ABSL_GUARDED_BY(mu_);     // seeds requests that name none
  std::vector<std::unique_ptr<Job>> running_;  // the stepping thread's
  int64_t decode_forwards_ = 0;                // the stepping thread's
};

}  // namespace tinkerd
