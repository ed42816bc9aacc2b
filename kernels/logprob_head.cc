#include "kernels/logprob_head.h"

#include <torch/csrc/autograd/custom_function.h>

#include <ATen/Dispatch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "kernels/cpu_clones.h"
#include "kernels/gemv.h"
#include "kernels/mixed_grad.h"
#include "kernels/parallel.h"
#include "kernels/vec16.h"

namespace tinkerd::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Head {
  at::Tensor h_TD, W_VD, A_rD, B_Vr;  // A and B already in h's dtype; undefined without LoRA
  double s;
  int64_t chunk_t, chunk_v;
  bool lora() const { return A_rD.defined(); }
};

// Logits of tokens [t0, t0 + tc) against vocabulary rows [v0, v0 + vc), in the accumulate type.
// u_tr = s·h·Aᵀ of the same tokens (undefined without LoRA).
// The products are HeadLogits' (LinearProduct), so a sampler's logits are these to the bit.
at::Tensor ChunkLogits(const Head& hd, const at::Tensor& h_tD, const at::Tensor& u_tr, int64_t v0,
                       int64_t vc, at::ScalarType acc) {
  at::Tensor z = LinearProduct(h_tD, hd.W_VD.narrow(0, v0, vc));
  if (u_tr.defined()) z.add_(LinearProduct(u_tr, hd.B_Vr.narrow(0, v0, vc)));
  return z.to(acc).contiguous();
}

// u = s·h·Aᵀ.
at::Tensor LowRank(const Head& hd, const at::Tensor& h_tD) {
  return LinearProduct(h_tD, hd.A_rD).mul_(hd.s);
}

// Folds n logits of one row into its running maximum m and sum l of exp(z − m):
//   m' = max(m, max_v z_v),   l' = l · e^(m − m') + Σ_v e^(z_v − m')
// In float the maximum and the sum run in sixteen lanes from the chunk's first logit (the last
// n mod 16 padded with −∞, added last), the sum then Total, the rescale by libm's expf; in double
// one running sum with libm's exp.
TINKERD_CPU_CLONES void Fold(const float* z, int64_t n, float& m, float& l) {
  const float inf = std::numeric_limits<float>::infinity();
  const V16 zero = {};
  const int64_t whole = n / 16 * 16;
  V16 rest = zero - inf;  // the last n mod 16, padded with −∞
  std::memcpy(&rest, z + whole, (n - whole) * sizeof(float));
  V16 top16 = rest;
  for (int64_t v = 0; v < whole; v += 16) {
    const V16 x = *reinterpret_cast<const V16u*>(z + v);
    top16 = x > top16 ? x : top16;
  }
  float top = m;
  for (int l16 = 0; l16 < 16; ++l16) top = std::max(top, top16[l16]);
  if (top == -inf) return;  // no finite logit yet: nothing to add
  V16 sum16 = {};
  for (int64_t v = 0; v < whole; v += 16) {
    V16 x = *reinterpret_cast<const V16u*>(z + v) - top;
    Exp(x);
    sum16 += x;
  }
  rest -= top;
  Exp(rest);
  sum16 += rest;
  l = l * std::exp(m - top) + Total(sum16);
  m = top;
}

void Fold(const double* z, int64_t n, double& m, double& l) {
  double top = m;
  for (int64_t v = 0; v < n; ++v) top = std::max(top, z[v]);
  if (top == -std::numeric_limits<double>::infinity()) return;
  double sum = 0;
  for (int64_t v = 0; v < n; ++v) sum += std::exp(z[v] - top);
  l = l * std::exp(m - top) + sum;
  m = top;
}

// Folds chunk z_tv (rows of contiguous logits, accumulate type, on the host) into each row's m_t
// and l_t.
void FoldChunk(const at::Tensor& z_tv, at::Tensor& m_t, at::Tensor& l_t) {
  TORCH_CHECK(z_tv.stride(1) == 1 || z_tv.size(1) <= 1, "logsumexp: rows must be contiguous");
  const int64_t rows = z_tv.size(0), n = z_tv.size(1), ld = z_tv.stride(0);
  AT_DISPATCH_FLOATING_TYPES(z_tv.scalar_type(), "logsumexp_fold", [&] {
    const scalar_t* z = z_tv.data_ptr<scalar_t>();
    scalar_t* m = m_t.data_ptr<scalar_t>();
    scalar_t* l = l_t.data_ptr<scalar_t>();
    ParallelFor(0, rows, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(n, 1)),
                [&](int64_t begin, int64_t end) {
                  for (int64_t t = begin; t < end; ++t) Fold(z + t * ld, n, m[t], l[t]);
                });
  });
}

// lse_t = m_t + log l_t, by libm's log.
at::Tensor Lse(const at::Tensor& m_t, const at::Tensor& l_t) {
  at::Tensor lse = at::empty_like(m_t);
  AT_DISPATCH_FLOATING_TYPES(m_t.scalar_type(), "logsumexp", [&] {
    const scalar_t* m = m_t.data_ptr<scalar_t>();
    const scalar_t* l = l_t.data_ptr<scalar_t>();
    scalar_t* out = lse.data_ptr<scalar_t>();
    for (int64_t t = 0; t < m_t.numel(); ++t) out[t] = m[t] + std::log(l[t]);
  });
  return lse;
}

// For targets y_tK of a token chunk: whether each falls in [v0, v0 + vc) and its column there.
std::pair<at::Tensor, at::Tensor> TargetColumns(const at::Tensor& y_tK, int64_t v0, int64_t vc) {
  const at::Tensor in = y_tK.ge(v0).logical_and(y_tK.lt(v0 + vc));
  return {in, (y_tK - v0).clamp(0, vc - 1)};
}

// logp_TK and lse_T for targets y_TK (K = 1 for one target per token).
LogprobHeadOutput Forward(const Head& hd, const at::Tensor& y_TK) {
  const at::ScalarType acc = AccumulateType(hd.h_TD.scalar_type());
  const int64_t T = hd.h_TD.size(0), V = hd.W_VD.size(0), K = y_TK.size(1);
  const at::TensorOptions to = hd.h_TD.options().dtype(acc);
  LogprobHeadOutput out{at::empty({T, K}, to), at::empty({T}, to)};
  for (int64_t t0 = 0; t0 < T; t0 += hd.chunk_t) {
    const int64_t tc = std::min(hd.chunk_t, T - t0);
    const at::Tensor h = hd.h_TD.narrow(0, t0, tc), y = y_TK.narrow(0, t0, tc);
    const at::Tensor u = hd.lora() ? LowRank(hd, h) : at::Tensor();
    const bool cpu = h.device().is_cpu();
    at::Tensor m = at::full({tc}, -std::numeric_limits<double>::infinity(), to);
    at::Tensor l = at::zeros({tc}, to), target = at::zeros({tc, K}, to);
    for (int64_t v0 = 0; v0 < V; v0 += hd.chunk_v) {
      const int64_t vc = std::min(hd.chunk_v, V - v0);
      const at::Tensor z = ChunkLogits(hd, h, u, v0, vc, acc);
      if (cpu) {
        FoldChunk(z, m, l);  // the sampler's order (LogitsLse)
      } else {
        const at::Tensor m_new = at::maximum(m, std::get<0>(z.max(1)));
        l = l * at::exp(m - m_new) + at::exp(z - m_new.unsqueeze(1)).sum(1);
        m = m_new;
      }
      auto [in, col] = TargetColumns(y, v0, vc);
      target = at::where(in, z.gather(1, col), target);
    }
    const at::Tensor lse = cpu ? Lse(m, l) : m + at::log(l);
    out.lse_T.narrow(0, t0, tc).copy_(lse);
    out.logp_T.narrow(0, t0, tc).copy_(target - lse.unsqueeze(1));
  }
  return out;
}

// Saved for backward: the inputs (references, no copies) and lse_T; no logits.
struct LogprobHeadFunction : torch::autograd::Function<LogprobHeadFunction> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& W,
                               const at::Tensor& A, const at::Tensor& B,
                               const LogprobHeadParams* p) {
    const Head hd = MakeHead(h, W, A, B, *p);
    const bool one_per_token = p->targets_T.dim() == 1;
    const at::Tensor y_TK = one_per_token ? p->targets_T.unsqueeze(1) : p->targets_T;
    LogprobHeadOutput out = Forward(hd, y_TK);
    if (one_per_token) out.logp_T = out.logp_T.squeeze(1);
    ctx->save_for_backward({h, W, A, B, y_TK, out.lse_T});
    ctx->saved_data["s"] = p->lora_scale;
    ctx->saved_data["chunk_t"] = p->chunk_tokens;
    ctx->saved_data["chunk_v"] = p->chunk_vocab;
    ctx->mark_non_differentiable({out.lse_T});
    return {out.logp_T, out.lse_T};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    LogprobHeadParams p;
    p.lora_scale = ctx->saved_data["s"].toDouble();
    p.chunk_tokens = ctx->saved_data["chunk_t"].toInt();
    p.chunk_vocab = ctx->saved_data["chunk_v"].toInt();
    const Head hd = MakeHead(s[0], s[1], s[2], s[3], p);
    const at::Tensor& y_TK = s[4];
    const at::Tensor& lse_T = s[5];
    const at::ScalarType acc = lse_T.scalar_type(), dt = hd.h_TD.scalar_type();
    const bool need_W = ctx->needs_input_grad(1);
    const int64_t T = hd.h_TD.size(0), V = hd.W_VD.size(0), K = y_TK.size(1);
    const at::Tensor g_TK =
        grads[0].defined() ? grads[0].to(acc).reshape({T, K}) : at::zeros({T, K}, lse_T.options());
    at::Tensor dh = at::empty_like(hd.h_TD);
    at::Tensor dW =
        need_W ? at::zeros(hd.W_VD.sizes(), hd.W_VD.options().dtype(acc)) : at::Tensor();
    at::Tensor dA, dB;
    if (hd.lora()) {
      dA = at::zeros(hd.A_rD.sizes(), hd.A_rD.options().dtype(acc));
      dB = at::zeros(hd.B_Vr.sizes(), hd.B_Vr.options().dtype(acc));
    }
    for (int64_t t0 = 0; t0 < T; t0 += hd.chunk_t) {
      const int64_t tc = std::min(hd.chunk_t, T - t0);
      const at::Tensor h = hd.h_TD.narrow(0, t0, tc), y = y_TK.narrow(0, t0, tc);
      const at::Tensor g = g_TK.narrow(0, t0, tc), lse = lse_T.narrow(0, t0, tc);
      // Σ_k g_tk weighs each row's softmax term; with K = 1 it is g itself, bit for bit.
      const at::Tensor g_sum = K == 1 ? g.squeeze(1) : g.sum(1);
      const at::Tensor u = hd.lora() ? LowRank(hd, h) : at::Tensor();
      at::Tensor dh_t = at::zeros({tc, hd.h_TD.size(1)}, h.options().dtype(acc));
      at::Tensor du_t = hd.lora() ? at::zeros({tc, hd.A_rD.size(0)}, dh_t.options()) : at::Tensor();
      for (int64_t v0 = 0; v0 < V; v0 += hd.chunk_v) {
        const int64_t vc = std::min(hd.chunk_v, V - v0);
        at::Tensor dz = at::exp(ChunkLogits(hd, h, u, v0, vc, acc) - lse.unsqueeze(1))
                            .mul_(g_sum.neg().unsqueeze(1));
        auto [in, col] = TargetColumns(y, v0, vc);
        dz.scatter_add_(1, col, at::where(in, g, at::zeros_like(g)));
        // The matmuls take compute-dtype inputs: a token's gradient is its own row's (RowProduct),
        // the weights', sums over tokens, come out unrounded (WideProduct; kernels/mixed_grad.h).
        const at::Tensor dz_dt = dz.to(dt);
        dh_t.add_(RowProduct({dz_dt, hd.W_VD.narrow(0, v0, vc)}));
        if (need_W) dW.narrow(0, v0, vc).add_(WideProduct({dz_dt.t(), h}));
        if (hd.lora()) {
          du_t.add_(RowProduct({dz_dt, hd.B_Vr.narrow(0, v0, vc)}));
          dB.narrow(0, v0, vc).add_(WideProduct({dz_dt.t(), u}));
        }
      }
      if (hd.lora()) {
        const at::Tensor du_dt = du_t.to(dt);
        dh_t.add_(RowProduct({du_dt, hd.A_rD}).mul_(hd.s));
        dA.add_(WideProduct({du_dt.t(), h}).mul_(hd.s));
      }
      dh.narrow(0, t0, tc).copy_(dh_t);
    }
    auto as = [](const at::Tensor& g, const at::Tensor& like) {
      return g.defined() ? g.to(like.scalar_type()) : g;
    };
    return {dh, as(dW, s[1]), as(dA, s[2]), as(dB, s[3]), at::Tensor()};
  }

  static Head MakeHead(const at::Tensor& h, const at::Tensor& W, const at::Tensor& A,
                       const at::Tensor& B, const LogprobHeadParams& p) {
    // Weights held wider than h (fp32 masters under bf16 compute) are cast to h's dtype.
    Head hd{h,
            W.to(h.scalar_type()),
            at::Tensor(),
            at::Tensor(),
            p.lora_scale,
            p.chunk_tokens,
            p.chunk_vocab};
    if (A.numel() > 0) {
      hd.A_rD = A.to(h.scalar_type());
      hd.B_Vr = B.to(h.scalar_type());
    }
    return hd;
  }
};

}  // namespace

LogprobHeadOutput TokenLogprobs(const LogprobHeadParams& p) {
  TORCH_CHECK(p.hidden_TD.dim() == 2 && p.weight_VD.dim() == 2 &&
                  p.hidden_TD.size(1) == p.weight_VD.size(1),
              "logprob head: hidden [T, D] and weight [V, D] do not match");
  TORCH_CHECK(p.lora_runs.empty(), "logprob head: lora_runs are for HeadLogits only");
  TORCH_CHECK((p.targets_T.dim() == 1 || p.targets_T.dim() == 2) &&
                  p.targets_T.size(0) == p.hidden_TD.size(0),
              "logprob head: targets must be [T] or [T, K]");
  TORCH_CHECK(p.lora_A_rD.defined() == p.lora_B_Vr.defined(),
              "logprob head: LoRA needs both A and B");
  TORCH_CHECK(p.chunk_tokens > 0 && p.chunk_vocab > 0, "logprob head: chunks must be positive");
  // Without LoRA, empty stand-ins: the autograd Function takes defined tensors only.
  const at::Tensor none = at::empty({0}, p.hidden_TD.options());
  variable_list out = LogprobHeadFunction::apply(p.hidden_TD, p.weight_VD,
                                                 p.lora_A_rD.defined() ? p.lora_A_rD : none,
                                                 p.lora_B_Vr.defined() ? p.lora_B_Vr : none, &p);
  return {out[0], out[1]};
}

at::Tensor HeadLogits(const LogprobHeadParams& p) {
  TORCH_CHECK(p.hidden_TD.dim() == 2 && p.weight_VD.dim() == 2 &&
                  p.hidden_TD.size(1) == p.weight_VD.size(1),
              "logprob head: hidden [T, D] and weight [V, D] do not match");
  TORCH_CHECK(p.chunk_vocab > 0, "logprob head: chunks must be positive");
  TORCH_CHECK(p.lora_runs.empty() || !p.lora_A_rD.defined(),
              "logprob head: lora_runs and a single adapter are exclusive");
  at::NoGradGuard no_grad;
  const at::Tensor none = at::empty({0}, p.hidden_TD.options());
  const Head hd = LogprobHeadFunction::MakeHead(p.hidden_TD, p.weight_VD,
                                                p.lora_A_rD.defined() ? p.lora_A_rD : none,
                                                p.lora_B_Vr.defined() ? p.lora_B_Vr : none, p);
  const at::ScalarType dt = hd.h_TD.scalar_type(), acc = AccumulateType(dt);
  const int64_t T = hd.h_TD.size(0), V = hd.W_VD.size(0);
  // Each adapted run's rows, u = s·h·Aᵀ of them and B; a single adapter is one run of every row.
  // Each chunk then adds u·Bᵀ to the base logits of its rows in h's dtype, as ChunkLogits does.
  struct Adapted {
    int64_t row, rows;
    at::Tensor u_tr, B_Vr;
  };
  std::vector<Adapted> adapted;
  if (hd.lora()) adapted.push_back({0, T, LowRank(hd, hd.h_TD), hd.B_Vr});
  int64_t row = 0;
  for (const LoraRun& run : p.lora_runs) {
    if (run.A_rI.defined()) {
      const at::Tensor h = hd.h_TD.narrow(0, row, run.rows);
      adapted.push_back(
          {row, run.rows, LinearProduct(h, run.A_rI.to(dt)).mul_(run.scale), run.B_Or.to(dt)});
    }
    row += run.rows;
  }
  TORCH_CHECK(p.lora_runs.empty() || row == T, "logprob head: lora_runs cover ", row, " rows of ",
              T);
  // Gemv sums each logit in one order whatever the columns beside it, so one product over the
  // whole vocabulary gives the chunks' bits without their concatenation, a serial copy of every
  // logit (a fiftieth of a batch-64 decode step).
  const int64_t chunk_v = GemvServes(hd.h_TD, hd.W_VD) ? V : hd.chunk_v;
  std::vector<at::Tensor> chunks;
  for (int64_t v0 = 0; v0 < V; v0 += chunk_v) {
    const int64_t vc = std::min(chunk_v, V - v0);
    at::Tensor z = LinearProduct(hd.h_TD, hd.W_VD.narrow(0, v0, vc));
    for (const Adapted& a : adapted) {
      z.narrow(0, a.row, a.rows).add_(LinearProduct(a.u_tr, a.B_Vr.narrow(0, v0, vc)));
    }
    chunks.push_back(z.to(acc));
  }
  return chunks.size() == 1 ? chunks.front() : at::cat(chunks, 1);
}

at::Tensor LogitsLse(const at::Tensor& z_TV, int64_t chunk_vocab) {
  TORCH_CHECK(z_TV.dim() == 2 && chunk_vocab > 0, "logsumexp: logits [T, V], positive chunks");
  at::Tensor z = z_TV.cpu();
  if (z.size(1) > 1 && z.stride(1) != 1) z = z.contiguous();
  const int64_t T = z.size(0), V = z.size(1);
  at::Tensor m = at::full({T}, -std::numeric_limits<double>::infinity(), z.options());
  at::Tensor l = at::zeros({T}, z.options());
  for (int64_t v0 = 0; v0 < V; v0 += chunk_vocab) {
    FoldChunk(z.narrow(1, v0, std::min(chunk_vocab, V - v0)), m, l);
  }
  return Lse(m, l);
}

}  // namespace tinkerd::kernels
