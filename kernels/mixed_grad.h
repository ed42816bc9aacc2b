// Training under bf16 (or fp16) compute: the backward of the layers that hold weights, written so
// that every row's gradient is its own and every weight's gradient is an fp32 sum, whatever the
// tokens' grouping into micro-batches and calls. Weights may be fp32 masters (cast to the compute
// dtype for use) or frozen compute-dtype weights (a LoRA model's base). kernels::Linear also
// trains float32 products through MixedLinear where Gemv takes them (kernels/linear.cc): its
// forward is then Gemv's, the sampler's order, its input gradient Gemv's too (RowProduct), and
// its weight gradient the BLAS's.
//
//   MixedLinear: y_NO = x_NI·c(w_OI)ᵀ + c(b_O)   dx = dy·c(w)   dw = dyᵀ·x   db = Σ_n dy
//   MixedScale:  y_ND = x_ND ⊙ c(w_D)            dx = dy ⊙ c(w)  dw = Σ_n dy ⊙ x
//   WideProduct: out_MN = a_MK·b_KN in the accumulate type from compute-dtype inputs
//   RowProduct:  out_NM = a_NK·b_KM, each row of out a function of its own row of a alone
//
// c() casts to x's dtype. The forward is the layer's own without a gradient to record, bit for
// bit, so Forward and forward_backward agree.
// - dx is a row's own, by RowProduct. LibTorch's bf16 CPU product rounds a·b differently with the
//   number of rows of a when b is a plain [K, M] matrix (small products take another kernel), and
//   not when b is the transpose of a contiguous [M, K] one, the forward's x·Wᵀ (measured on
//   LibTorch 1.13: every row count 1-300, offsets 0 and 7, shapes from 4×32 to 2048×2048, every
//   dimension a multiple of 16; on a Sapphire Rapids Xeon a product with a dimension of 24 rounded
//   differently with the row count, so the claim is for such shapes only).
// - dw and db sum over rows, the tokens of a micro-batch: WideProduct forms them from
//   compute-dtype values and never rounds them to the compute dtype. A product of two bf16 values
//   is exact in fp32 (8-bit significands, a 16-bit product), so a weight's gradient is an fp32 sum
//   of exact terms and only the order of that sum depends on the packing (docs/semantics.md).
//   Autograd through the cast would round each micro-batch's sum to bf16 first.
//
// Shape suffixes: N rows (any leading shape for MixedScale), I in features, O out features,
// D normalized features, M/K/N a product's dimensions.
#pragma once

#include <ATen/ATen.h>

namespace tinkerd::kernels {

// The accumulate type of a compute dtype: fp32 for bf16/fp16, else the dtype itself.
at::ScalarType AccumulateType(at::ScalarType t);

// Whether a product of x with w records a gradient under a compute dtype narrower than its
// accumulate type: the case MixedLinear and MixedScale are for. Elsewhere ATen's ops serve.
bool MixedInUse(const at::Tensor& x, const at::Tensor& w);

struct MixedLinearParams {
  at::Tensor x_NI;
  at::Tensor w_OI;
  at::Tensor b_O;  // undefined: no bias
};
at::Tensor MixedLinear(const MixedLinearParams& p);

struct MixedScaleParams {
  at::Tensor x_ND;
  at::Tensor w_D;
};
at::Tensor MixedScale(const MixedScaleParams& p);

struct ProductParams {
  at::Tensor a_MK;
  at::Tensor b_KN;
};
// One product with fp32 output where the library has it: cuBLAS on CUDA (LibTorch ≥ 2.8), oneDNN's
// bf16 GEMM on the CPU (as fast as the bf16 product itself; widening the inputs and multiplying in
// fp32 instead took 2-3x as long on a 2-vCPU Cooperlake Xeon). Elsewhere the inputs are widened,
// exactly, and multiplied in fp32.
at::Tensor WideProduct(const ProductParams& p);
// In bf16/fp16 on the CPU, b is copied to its transpose's layout first. On CUDA the rows are
// multiplied in products of a fixed row count (1,024; the last zero-padded): cuBLAS picks its
// kernel, split-K among them, by the shape, and a plain product's rows moved with the row count
// on an H100 (a 32→4 product). In fp32 on a CPU where Gemv runs, Gemv with b's transpose as its
// weights: each output summed over K in Gemv's order (kernels/gemv.h), which the rows beside it
// never change. OpenBLAS's AVX2 (Zen) kernels round a row by the rows beside it (352 of 450 shapes
// differed on a 2-vCPU EPYC; tests/kernels/mixed_grad_test.cc reports it), so a float32 input
// gradient moved with the packing. Elsewhere in fp32, and in fp64, at::mm.
at::Tensor RowProduct(const ProductParams& p);

// x·wᵀ + b with w and b in x's dtype, as a linear layer computes it without a gradient to record:
// Gemv where it serves (kernels/gemv.h), else one ATen product (the bias inside, addmm).
at::Tensor AffineProduct(const at::Tensor& x_NI, const at::Tensor& w_OI, const at::Tensor& b_O);

}  // namespace tinkerd::kernels
