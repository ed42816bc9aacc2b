#include "runner/sample/choose_rows.h"

#include <ATen/Parallel.h>

namespace tinkerd {

// Built with OpenMP (runner/CMakeLists.txt): LibTorch 1.13's at::parallel_for is inline and runs
// on one thread in a translation unit built without it. One row's choice is a pass or two of exp
// over the vocabulary; at a decode batch of 64 the rows took a tenth of the step on one thread.
void ChooseTokens(const double* z_SV, int64_t V, std::vector<RowChoice>& rows) {
  at::parallel_for(0, static_cast<int64_t>(rows.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t s = begin; s < end; ++s) {
      RowChoice& row = rows[s];
      const double lse = LogSumExp(z_SV + s * V, V);
      row.choice = ChooseToken(z_SV + s * V, V, lse, *row.params, row.rng);
    }
  });
}

}  // namespace tinkerd
