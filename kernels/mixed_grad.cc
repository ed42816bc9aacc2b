#include "kernels/mixed_grad.h"

#include <c10/core/GradMode.h>
#include <dlfcn.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstdint>
#include <optional>

#include "kernels/compat.h"
#include "kernels/gemv.h"

namespace tinkerd::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Rows per tile of RowProduct on CUDA.
constexpr int64_t kRowTile = 1024;

// Saves x and the cast weight (what autograd saves for the product it replaces). Without a bias, b
// is an empty stand-in: an autograd Function takes defined tensors only.
struct MixedLinearFunction : torch::autograd::Function<MixedLinearFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& b) {
    const at::Tensor w_dt = w.to(x.scalar_type());
    ctx->save_for_backward({x, w_dt});
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    ctx->saved_data["b_dtype"] = static_cast<int64_t>(b.scalar_type());
    return AffineProduct(x, w_dt, b.numel() > 0 ? b.to(x.scalar_type()) : at::Tensor());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &w_dt = s[1], &dy = grads[0];
    const auto w_dtype = static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt());
    const auto b_dtype = static_cast<at::ScalarType>(ctx->saved_data["b_dtype"].toInt());
    at::Tensor dx, dw, db;
    if (ctx->needs_input_grad(0)) dx = RowProduct({dy, w_dt});
    if (ctx->needs_input_grad(1)) dw = WideProduct({dy.t(), x}).to(w_dtype);
    if (ctx->needs_input_grad(2)) {
      db = at::sum(dy, {0}, /*keepdim=*/false, AccumulateType(dy.scalar_type())).to(b_dtype);
    }
    return {dx, dw, db};
  }
};

struct MixedScaleFunction : torch::autograd::Function<MixedScaleFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w) {
    const at::Tensor w_dt = w.to(x.scalar_type());
    ctx->save_for_backward({x, w_dt});
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    return x * w_dt;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const at::Tensor &x = s[0], &w_dt = s[1], &dy = grads[0];
    const auto w_dtype = static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt());
    at::Tensor dx, dw;
    if (ctx->needs_input_grad(0)) dx = dy * w_dt;
    if (ctx->needs_input_grad(1)) {
      // The products dy·x of two compute-dtype values, exact in the accumulate dtype, summed there.
      const at::ScalarType acc = AccumulateType(dy.scalar_type());
      const int64_t D = w_dt.size(0);
      dw = (dy.to(acc) * x.to(acc)).reshape({-1, D}).sum(0).to(w_dtype);
    }
    return {dx, dw};
  }
};

// oneDNN's row-major product of bf16 matrices into fp32, C = alpha·op(A)·op(B) + beta·C (its C API,
// dnnl.h). LibTorch's CPU build links oneDNN; where it is a shared library the symbol is found at
// run time, and a build without it widens the inputs instead.
using DnnlGemmBf16 = int (*)(char transa, char transb, int64_t M, int64_t N, int64_t K, float alpha,
                             const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                             float beta, float* C, int64_t ldc);

DnnlGemmBf16 FindDnnlGemmBf16() {
  static const DnnlGemmBf16 gemm =
      reinterpret_cast<DnnlGemmBf16>(dlsym(RTLD_DEFAULT, "dnnl_gemm_bf16bf16f32"));
  return gemm;
}

// A row-major operand for the product: its transpose flag and leading dimension, or nothing when
// its strides are neither rows nor columns of contiguous elements. A dimension of size 1 may have
// any stride (LibTorch calls such a tensor contiguous whatever it is).
struct Operand {
  char trans;
  int64_t ld;
};
std::optional<Operand> AsOperand(const at::Tensor& t) {
  const int64_t R = t.size(0), C = t.size(1);
  if ((C <= 1 || t.stride(1) == 1) && (R <= 1 || t.stride(0) >= std::max<int64_t>(1, C))) {
    return Operand{'N', R <= 1 ? std::max<int64_t>(1, C) : t.stride(0)};
  }
  if ((R <= 1 || t.stride(0) == 1) && (C <= 1 || t.stride(1) >= std::max<int64_t>(1, R))) {
    return Operand{'T', C <= 1 ? std::max<int64_t>(1, R) : t.stride(1)};
  }
  return std::nullopt;
}

// a·b of bf16 CPU matrices into fp32 by oneDNN, or an undefined tensor where it does not serve.
at::Tensor DnnlWideProduct(at::Tensor a, at::Tensor b) {
  const DnnlGemmBf16 gemm = FindDnnlGemmBf16();
  if (gemm == nullptr || a.scalar_type() != at::kBFloat16 || !a.device().is_cpu()) return {};
  if (!AsOperand(a)) a = a.contiguous();
  if (!AsOperand(b)) b = b.contiguous();
  const std::optional<Operand> oa = AsOperand(a), ob = AsOperand(b);
  if (!oa || !ob) return {};
  const int64_t M = a.size(0), K = a.size(1), N = b.size(1);
  at::Tensor c = at::empty({M, N}, a.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return c;
  if (K == 0) return c.zero_();
  const int status =
      gemm(oa->trans, ob->trans, M, N, K, 1.0f, static_cast<const uint16_t*>(a.data_ptr()), oa->ld,
           static_cast<const uint16_t*>(b.data_ptr()), ob->ld, 0.0f, c.data_ptr<float>(),
           std::max<int64_t>(1, N));
  return status == 0 ? c : at::Tensor();
}

}  // namespace

bool MixedInUse(const at::Tensor& x, const at::Tensor& w) {
  return c10::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad()) &&
         AccumulateType(x.scalar_type()) != x.scalar_type();
}

at::ScalarType AccumulateType(at::ScalarType t) {
  return t == at::kBFloat16 || t == at::kHalf ? at::kFloat : t;
}

at::Tensor AffineProduct(const at::Tensor& x_NI, const at::Tensor& w_OI, const at::Tensor& b_O) {
  if (GemvServes(x_NI, w_OI)) {
    at::Tensor y = Gemv({x_NI, w_OI});
    if (b_O.defined()) y.add_(b_O);
    return y;
  }
  return b_O.defined() ? at::addmm(b_O, x_NI, w_OI.t()) : at::mm(x_NI, w_OI.t());
}

at::Tensor MixedLinear(const MixedLinearParams& p) {
  return MixedLinearFunction::apply(p.x_NI, p.w_OI,
                                    p.b_O.defined() ? p.b_O : at::empty({0}, p.w_OI.options()));
}

at::Tensor MixedScale(const MixedScaleParams& p) {
  TORCH_CHECK(p.w_D.dim() == 1 && p.x_ND.size(-1) == p.w_D.size(0),
              "MixedScale: x [..., D] and w [D] do not match");
  return MixedScaleFunction::apply(p.x_ND, p.w_D);
}

at::Tensor RowProduct(const ProductParams& p) {
  const at::Tensor &a = p.a_MK, &b = p.b_KN;
  const at::ScalarType dt = a.scalar_type();
  if (AccumulateType(dt) == dt) {
    // Gemv copies bᵀ contiguous once per product: K·M values against N·K·M multiply-adds.
    const at::Tensor w_MK = b.t();
    return GemvFits(a, w_MK) ? Gemv({a, w_MK}) : at::mm(a, b);
  }
  if (a.device().is_cpu()) return at::mm(a, b.t().contiguous().t());
  // cuBLAS chooses its kernel (split-K among them) by the product's shape (and a batched one may
  // by its batch count), so every row is multiplied within a product of exactly kRowTile rows: the
  // whole tiles one by one, written in place, the rest zero-padded to a tile.
  const int64_t N = a.size(0), K = a.size(1), M = b.size(1);
  const int64_t whole = N / kRowTile * kRowTile;
  at::Tensor out = at::empty({N, M}, a.options());
  for (int64_t r = 0; r < whole; r += kRowTile) {
    at::Tensor tile = out.narrow(0, r, kRowTile);
    at::mm_out(tile, a.narrow(0, r, kRowTile), b);
  }
  if (whole < N) {
    at::Tensor rest = at::zeros({kRowTile, K}, a.options());
    rest.narrow(0, 0, N - whole).copy_(a.narrow(0, whole, N - whole));
    out.narrow(0, whole, N - whole).copy_(at::mm(rest, b).narrow(0, 0, N - whole));
  }
  return out;
}

at::Tensor WideProduct(const ProductParams& p) {
  const at::ScalarType dt = p.a_MK.scalar_type(), acc = AccumulateType(dt);
  if (acc == dt) return at::mm(p.a_MK, p.b_KN);
#if TINKERD_HAS_MM_OUT_DTYPE
  if (p.a_MK.is_cuda()) return at::mm(p.a_MK, p.b_KN, acc);
#endif
  if (at::Tensor c = DnnlWideProduct(p.a_MK, p.b_KN); c.defined()) return c;
  return at::mm(p.a_MK.to(acc), p.b_KN.to(acc));
}

}  // namespace tinkerd::kernels
