// Products of a few rows with a weight matrix, the matmuls of a decode step:
//   y[n, o] = Σ_i x[n, i] · W[o, i]
// Each weight row is read once from memory and multiplied with every row of x while it is in
// cache; nothing is packed. A decode step at batch 8 multiplies each weight by 8 numbers, so its
// time is the time to read the weights, and a BLAS GEMM built for large products (which copies
// every weight into its own layout first) spends several times that. Longer inputs (a prefill)
// run as tiles of kGemvTileRows rows, each reading the weights once.
//
// Each y[n, o] is summed in the same order whatever the other rows are: sixteen partial sums
// over i in steps of 16 (the last I mod 16 elements in the first lanes), then added pairwise. A
// row's result does not change with the batch it is decoded or prefilled in, however many rows
// that is, or with the number of threads. That is what makes a sample's float32 tokens and
// logprobs independent of what else the sampler runs beside it (docs/sampling.md).
//
// Shape suffixes: N rows, I in features, O out features.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace tinkerd::kernels {

struct GemvParams {
  at::Tensor x_NI;  // rows of I contiguous elements
  at::Tensor w_OI;  // contiguous
};

// Rows per tile. Measured (bench/gemv_bench, a decode step of the bench model on 2 AVX-512
// cores, against OpenBLAS's AVX2 kernels): 4.5x LibTorch's at::mm at 1 row, 2.8x at 8, 1.6x at
// 64, where a tile's products are bound by arithmetic rather than by reading the weights; on 2
// AVX2 cores (EPYC, OpenBLAS's Zen kernels) 2.3x, 2.6x, 1.0x, and 0.8x at 256 rows. x is
// read again for each block of weight rows and should stay in the L2 cache (64 rows of 4,096
// floats take 1 MiB).
constexpr int64_t kGemvTileRows = 64;

// Whether Gemv runs on this CPU: one with AVX-512, whose 32 registers hold 4 × 4 blocks of
// sixteen-lane sums, or with AVX2 and FMA, where blocks of 3 × 2 are held as halves. Both sum in
// the order above, to the same bits. Without AVX2 the products are LibTorch's.
bool GemvRunsHere();

// Whether Gemv can take this product: float32 on a CPU where it runs.
bool GemvFits(const at::Tensor& x_NI, const at::Tensor& w_OI);

// Whether Gemv serves this product as it is called: it fits, with no gradient to record. Training
// reaches Gemv through kernels::Linear's autograd Function (kernels/mixed_grad.h), whose forward
// records nothing: every float32 CPU forward takes the same products.
bool GemvServes(const at::Tensor& x_NI, const at::Tensor& w_OI);

// y_NO in float32. Requires GemvServes' dtype and device.
at::Tensor Gemv(const GemvParams& p);

// x·Wᵀ, the product of a linear layer: by Gemv where it serves, else by LibTorch (at::mm).
at::Tensor LinearProduct(const at::Tensor& x_NI, const at::Tensor& w_OI);

}  // namespace tinkerd::kernels
