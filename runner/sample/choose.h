// Drawing one token from a row of logits z_V, in double on the host.
//
//   temperature 0:  argmax_v z_v (the first index on ties)
//   otherwise:      p_v ∝ exp(z_v / temperature) over the kept set, where top_k keeps the k
//                   largest logits and top_p then keeps the smallest most-likely-first prefix whose
//                   mass reaches top_p (at least one token); a uniform u from the sequence's own
//                   generator picks by inverse CDF, in a fixed order (most likely first, then by
//                   index; without truncation, by index), so a seed gives the same token for the
//                   same logits on every machine, but for rounding: the exponentials are
//                   kernels/vec16.h's, whose last bits may differ between CPUs with and without
//                   FMA (kernels/cpu_clones.h).
// The logprob reported beside the token is the model's own, log softmax(z)_v (temperature 1, no
// truncation): what the trainer's Forward computes for that token.
#pragma once

#include <cstdint>

#include "runner/sample/sample_types.h"
#include "runner/util/rng.h"

namespace tinkerd {

struct Choice {
  int64_t token = 0;
  double logprob = 0;
  TopLogprobs top;  // when asked (MostLikely): the row's k most likely tokens
};

// lse: the row's log Σ_v exp(z_v) (LogSumExp), which the logprob subtracts.
Choice ChooseToken(const double* logits_V, int64_t V, double lse, const SamplingParams& params,
                   SplitMix64& rng);

// The k most likely tokens of a row with their logprobs z_v − lse, most likely first, ties by
// index (the order ChooseToken's truncation uses), so the drawn token's entry, when it is among
// them, carries its reported logprob bit for bit.
TopLogprobs MostLikely(const double* logits_V, int64_t V, double lse, int64_t k);

// `k` independent draws, with replacement, from one row at `temperature` (0: its argmax k times)
// with no truncation, each by inverse CDF over the row in index order; out[j] = (token, its
// logprob z_v − lse). For prompt_alt_tokens_k: alternatives to a prompt token.
void DrawIndependent(const double* logits_V, int64_t V, double lse, double temperature, int64_t k,
                     SplitMix64& rng, std::pair<int64_t, double>* out);

// log Σ_v exp(z_v) = m + log Σ_v exp(z_v − m), m = max_v z_v, in one pass for m and one for the
// sum, eight lanes at a time (kernels/vec16.h's Exp). The sum runs in one fixed order (lane v mod
// 8, then the lanes' halves folded: 4, 2, 1), so a row's result is the same bits whatever rows and
// threads share the step.
double LogSumExp(const double* logits_V, int64_t V);

}  // namespace tinkerd
