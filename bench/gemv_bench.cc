// The matmuls of one decode step of the bench model, by kernels::Gemv and by at::mm (LibTorch's
// BLAS), at several batch sizes, on the same weights and threads: the figures behind
// kGemvTileRows (kernels/gemv.h); batches over it show a prefill's tiles against the BLAS. Per
// batch: the median over --reps of the step's products (7 per layer and the output head), each
// side's weight bytes read per second, and the largest relative difference between the two results
// (rounding only).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "kernels/gemv.h"
#include "runner/util/cpu_environment.h"

ABSL_FLAG(int64_t, vocab, 8192, "vocabulary size");
ABSL_FLAG(int64_t, hidden, 512, "hidden size");
ABSL_FLAG(int64_t, intermediate, 1408, "MLP intermediate size");
ABSL_FLAG(int64_t, layers, 6, "decoder layers");
ABSL_FLAG(int64_t, heads, 8, "attention heads");
ABSL_FLAG(int64_t, kv_heads, 4, "key/value heads");
ABSL_FLAG(int64_t, head_dim, 64, "per-head dimension");
ABSL_FLAG(std::string, batches, "1,2,4,8,12,16,24,32,64", "rows per product");
ABSL_FLAG(int64_t, reps, 20, "timed steps (median)");
ABSL_FLAG(int64_t, num_threads, 2, "intra-op threads");

namespace {

using Clock = std::chrono::steady_clock;

template <typename F>
double MedianSeconds(int64_t reps, F&& step) {
  step();  // warm-up
  std::vector<double> s;
  for (int64_t r = 0; r < reps; ++r) {
    const Clock::time_point t0 = Clock::now();
    step();
    s.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  std::nth_element(s.begin(), s.begin() + s.size() / 2, s.end());
  return s[s.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  tinkerd::PrepareCpuEnvironment(argv);
  absl::ParseCommandLine(argc, argv);
  at::set_num_threads(static_cast<int>(absl::GetFlag(FLAGS_num_threads)));
  at::NoGradGuard no_grad;
  const int64_t D = absl::GetFlag(FLAGS_hidden), I = absl::GetFlag(FLAGS_intermediate);
  const int64_t q = absl::GetFlag(FLAGS_heads) * absl::GetFlag(FLAGS_head_dim);
  const int64_t kv = absl::GetFlag(FLAGS_kv_heads) * absl::GetFlag(FLAGS_head_dim);
  std::vector<at::Tensor> weights;
  for (int64_t l = 0; l < absl::GetFlag(FLAGS_layers); ++l) {
    for (auto [o, i] : std::vector<std::pair<int64_t, int64_t>>{
             {q, D}, {kv, D}, {kv, D}, {D, q}, {I, D}, {I, D}, {D, I}}) {
      weights.push_back(at::randn({o, i}));
    }
  }
  weights.push_back(at::randn({absl::GetFlag(FLAGS_vocab), D}));
  double bytes = 0;
  for (const at::Tensor& w : weights) bytes += static_cast<double>(w.numel()) * sizeof(float);
  std::printf("threads %d, BLAS core %s, %zu products, %.1f MB of float32 weights a step\n",
              at::get_num_threads(), tinkerd::BlasCore().c_str(), weights.size(), bytes / 1e6);
  std::printf("| rows | gemv ms | at::mm ms | at::mm / gemv | gemv GB/s | max rel diff |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|\n");
  for (const auto& piece : absl::StrSplit(absl::GetFlag(FLAGS_batches), ',')) {
    int64_t N = 0;
    if (!absl::SimpleAtoi(piece, &N) || N <= 0) {
      std::fprintf(stderr, "gemv_bench: bad --batches entry '%s'\n", std::string(piece).c_str());
      return 2;
    }
    // One input per in-features size, as a step's products read the norms' and MLP's outputs.
    const at::Tensor x_D = at::randn({N, D}), x_q = at::randn({N, q}), x_I = at::randn({N, I});
    auto input = [&](const at::Tensor& w) {
      return w.size(1) == D ? x_D : w.size(1) == q ? x_q : x_I;
    };
    const int64_t reps = absl::GetFlag(FLAGS_reps);
    const double gemv = MedianSeconds(reps, [&] {
      for (const at::Tensor& w : weights) tinkerd::kernels::Gemv({input(w), w});
    });
    const double mm = MedianSeconds(reps, [&] {
      for (const at::Tensor& w : weights) at::mm(input(w), w.t());
    });
    double diff = 0;
    for (const at::Tensor& w : weights) {
      const at::Tensor want = at::mm(input(w), w.t());
      const at::Tensor got = tinkerd::kernels::Gemv({input(w), w});
      diff = std::max(diff, ((got - want).abs().max() / want.abs().max()).item<double>());
    }
    std::printf("| %lld | %.3f | %.3f | %.2fx | %.1f | %.2g |\n", static_cast<long long>(N),
                gemv * 1e3, mm * 1e3, mm / gemv, bytes / gemv / 1e9, diff);
  }
  return 0;
}
