// The tokens of a decode step's rows (runner/sample/choose.h for one row), the rows spread over
// the intra-op threads. A row's choice reads only its logits, its parameters and its own generator,
// so the tokens do not depend on the thread count or on the other rows.
#pragma once

#include <cstdint>
#include <vector>

#include "runner/sample/choose.h"

namespace tinkerd {

struct RowChoice {
  const SamplingParams* params = nullptr;
  int64_t topk = 0;   // > 0: choice.top holds the row's topk most likely tokens
  SplitMix64 rng{0};  // advanced past the draw
  Choice choice;
};

// rows[s] takes row s of z_SV (S rows of V logits, row-major), with its log-sum-exp (choose.h).
void ChooseTokens(const double* z_SV, int64_t V, std::vector<RowChoice>& rows);
// The same on float32 logits, each row widened to double (exactly) by its own task: a float32
// step's logits need no copy of their own.
void ChooseTokens(const float* z_SV, int64_t V, std::vector<RowChoice>& rows);

}  // namespace tinkerd
