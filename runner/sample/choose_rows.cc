#include "runner/sample/choose_rows.h"

#include <algorithm>

#include "kernels/parallel.h"

namespace tinkerd {

// One row's choice is a pass or two of exp over the vocabulary; at a decode batch of 64 the rows
// took a tenth of the step on one thread.
void ChooseTokens(const double* z_SV, int64_t V, std::vector<RowChoice>& rows) {
  kernels::ParallelFor(0, static_cast<int64_t>(rows.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      RowChoice& row = rows[s];
      const double lse = LogSumExp(z_SV + s * V, V);
      row.choice = ChooseToken(z_SV + s * V, V, lse, *row.params, row.rng);
    }
  });
}

void ChooseTokens(const float* z_SV, int64_t V, std::vector<RowChoice>& rows) {
  kernels::ParallelFor(0, static_cast<int64_t>(rows.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<double> z_V(V);
    for (int64_t s = begin; s < end; ++s) {
      std::copy(z_SV + s * V, z_SV + (s + 1) * V, z_V.begin());
      RowChoice& row = rows[s];
      row.choice = ChooseToken(z_V.data(), V, LogSumExp(z_V.data(), V), *row.params, row.rng);
    }
  });
}

}  // namespace tinkerd
