// Sampling's public types (Tinker's SamplingParams, SampleRequest and SampleResponse) and their
// validation. Torch-free: the server checks a request with these before anything is queued.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "runner/util/memory_account.h"
#include "runner/validate.h"

namespace tinkerd {

struct SamplingParams {
  int64_t max_tokens = 16;
  double temperature = 1.0;  // 0: greedy (argmax, first index on ties)
  int64_t top_k = 0;         // <= 0: every token
  double top_p = 1.0;        // in (0, 1]; 1: every token
  // Set: the same tokens for the same request on every run, whatever else is sampled beside it.
  std::optional<uint64_t> seed;
  // A sample ends after emitting any of these token sequences (a single stop token is a sequence
  // of one); the stop tokens are part of the sample.
  std::vector<std::vector<int64_t>> stop;
  // A sample ends once the text its tokens decode to contains any of these (UTF-8, non-empty);
  // the token that completed the match is the sample's last. Needs the model's tokenizer.
  std::vector<std::string> stop_strings;
  // false: a sample also ends after emitting one of the model's end-of-sequence tokens
  // (ModelConfig::eos_token_ids), which it keeps; true: they are tokens like any other (Tinker's
  // stop = []).
  bool ignore_eos = false;
};

struct SampleRequest {
  std::vector<int64_t> prompt;
  int64_t num_samples = 1;  // samples of one prompt share its prefill and KV cache
  SamplingParams params;
  bool prompt_logprobs = false;      // logp(prompt[t] | prompt[<t]) for t >= 1
  int64_t topk_prompt_logprobs = 0;  // the k most likely tokens at every prompt position
  // > 0: prompt_logprobs and topk_prompt_logprobs score only the last n prompt positions (the
  // earlier ones are NaN and empty, and are not computed). In [1, P - 1]; needs prompt_logprobs.
  int64_t prompt_logprobs_last_n = 0;
  int64_t topk_sample_logprobs = 0;  // the k most likely tokens at every sampled position
  // K > 0: [P - 1, K] token ids, row-major; row i is scored at prompt position i + 1 (what
  // predicts prompt[i + 1]); -1 asks for nothing. At least one id.
  std::vector<int64_t> target_prompt_ids;
  int64_t target_prompt_k = 0;
  // k > 0: k independent draws at params.temperature (no top-k or top-p) from the model's
  // distribution at every prompt position after the first: alternatives to each prompt token.
  int64_t prompt_alt_tokens_k = 0;
  // A mixture of experts: return the experts every token met in every routed layer (the prompt's
  // and each sample's), for the trainer's router replay (the `routed_experts` input).
  bool routed_experts = false;
};

// The k most likely tokens of one position: (token, logprob), most likely first, ties by id.
using TopLogprobs = std::vector<std::pair<int64_t, double>>;

enum class StopReason { kLength, kStop };

struct SampledSequence {
  std::vector<int64_t> tokens;
  // logp(tokens[i] | prompt, tokens[<i]) under the model itself: temperature 1, before top-k and
  // top-p. This is what the trainer's Forward computes for the same tokens.
  std::vector<double> logprobs;
  StopReason stop_reason = StopReason::kLength;
  // When topk_sample_logprobs > 0: one row per token, from the logits the token was drawn from.
  std::vector<TopLogprobs> topk_logprobs;
  // When asked (SampleRequest::routed_experts): [tokens - 1, R, k] row-major, the experts each
  // token fed back to the model (every one but the last) met in each routed layer.
  std::vector<int64_t> routed_experts;
};

// What one sample gained in one engine step, for a caller that streams tokens as they come.
struct SampleDelta {
  int64_t index = 0;  // which of the request's samples
  std::vector<int64_t> tokens;
  std::vector<double> logprobs;
  std::vector<TopLogprobs> topk_logprobs;  // when asked, one row per token
  std::optional<StopReason> stop;          // set on the sample's last delta
};

// Receives a request's new tokens after each engine step in which some of its samples gained
// any; returns false when nobody is listening any more (a cancelled call): the request then ends
// at once with CANCELLED, and its samples' place is free for others.
using SampleProgress = std::function<bool(std::vector<SampleDelta>)>;

struct SampleResult {
  std::vector<SampledSequence> sequences;  // num_samples of them, in order
  // When asked: [P] with NaN at position 0 (no context predicts the first token).
  std::vector<double> prompt_logprobs;
  // When asked: [P][k] (token, logprob) pairs, most likely first; position 0 is empty.
  std::vector<TopLogprobs> topk_prompt_logprobs;
  // When asked: [P - 1, K] row-major, the logprob of each asked id; NaN where the id was -1.
  std::vector<double> target_prompt_logprobs;
  // When asked: [P - 1, k] row-major; row i holds the draws at prompt position i + 1 and their
  // logprobs (temperature 1, as every logprob here).
  std::vector<int64_t> prompt_alt_tokens;
  std::vector<double> prompt_alt_logprobs;
  // When asked: [P, R, k] row-major, the experts of each prompt token in each routed layer. A
  // sample's datum prompt + tokens[:-1] replays prompt_routed_experts then its routed_experts.
  std::vector<int64_t> prompt_routed_experts;
  int64_t routed_layers = 0, experts_per_token = 0;  // R and k, when asked
};

struct SampleLimits {
  int64_t max_num_samples = 64;
  int64_t max_topk_prompt_logprobs = 20;
  int64_t max_topk_sample_logprobs = 20;
  // K of target_prompt_logprobs, bounded as the top-k widths are: the request holds P·K ids and
  // the answer P·K logprobs.
  int64_t max_target_prompt_k = 20;
  int64_t max_prompt_alt_tokens_k = 20;
  int64_t max_stop_strings = 32;
  int64_t max_stop_string_bytes = 1024;
};

// What the sampling engine holds at once (runner/sample/engine.h).
struct EngineLimits {
  int64_t max_sequences = 256;  // samples admitted and not finished
  // Prompt tokens that start prefilling in one step (at least one prompt, however long): a step
  // is what a queued training call may wait for, so its prefill is bounded.
  int64_t prefill_tokens_per_step = 8192;
  int64_t kv_cache_bytes = int64_t{2} << 30;  // reserved for their keys and values
  // Set: each request's KV-cache bytes are also reserved here (the process's one account,
  // runner/util/memory_account.h, shared with training) until it finishes.
  std::shared_ptr<MemoryAccount> account = nullptr;
};

// INVALID_ARGUMENT naming `prompt` when its `tokens` alone exceed the model's context.
absl::Status CheckPromptFits(int64_t tokens, const ModelLimits& model);

// INVALID_ARGUMENT naming sampling_params.stop when a request has stop strings and the model has
// no tokenizer to match them with: an edge may answer it before queueing the request.
absl::Status CheckStopStringsMatchable(size_t stop_strings, const ModelLimits& model);

// INVALID_ARGUMENT naming the field: an empty prompt, one with ids outside [0, vocab) or one
// longer than the context; max_tokens <= 0; prompt + max_tokens beyond the context; temperature
// negative or not finite; top_p outside (0, 1]; num_samples outside [1, max]; topk_prompt_logprobs
// or topk_sample_logprobs outside [0, max] (and the vocabulary); prompt_logprobs_last_n outside
// [1, P - 1] or without prompt_logprobs; target_prompt_ids not [P - 1, K] with K in [1, max], an id
// outside the vocabulary other than -1, or none at all; an empty stop sequence or one with ids
// outside the vocabulary; prompt_alt_tokens_k outside [0, max] or with a one-token prompt; stop
// strings for a model without a tokenizer, empty ones, or more or longer ones than the limits.
absl::Status ValidateSampleRequest(const SampleRequest& request, const ModelLimits& model,
                                   const SampleLimits& limits);

}  // namespace tinkerd
