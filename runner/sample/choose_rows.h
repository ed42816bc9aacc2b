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
  SplitMix64 rng{0};  // advanced past the draw
  Choice choice;
};

// rows[s] takes row s of z_SV (S rows of V logits, row-major); m_S holds each row's largest
// logit and e_SV exp(z_sv − m_s), from which each row's log-sum-exp is taken (choose.h).
void ChooseTokens(const double* z_SV, const double* e_SV, const double* m_S, int64_t V,
                  std::vector<RowChoice>& rows);

}  // namespace tinkerd
