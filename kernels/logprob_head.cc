#include "kernels/logprob_head.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "kernels/gemv.h"
#include "kernels/mixed_grad.h"

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
at::Tensor ChunkLogits(const Head& hd, const at::Tensor& h_tD, const at::Tensor& u_tr, int64_t v0,
                       int64_t vc, at::ScalarType acc) {
  at::Tensor z = at::mm(h_tD, hd.W_VD.narrow(0, v0, vc).t());
  if (u_tr.defined()) z.add_(at::mm(u_tr, hd.B_Vr.narrow(0, v0, vc).t()));
  return z.to(acc);
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
    const at::Tensor u = hd.lora() ? at::mm(h, hd.A_rD.t()).mul_(hd.s) : at::Tensor();
    at::Tensor m = at::full({tc}, -std::numeric_limits<double>::infinity(), to);
    at::Tensor l = at::zeros({tc}, to), target = at::zeros({tc, K}, to);
    for (int64_t v0 = 0; v0 < V; v0 += hd.chunk_v) {
      const int64_t vc = std::min(hd.chunk_v, V - v0);
      const at::Tensor z = ChunkLogits(hd, h, u, v0, vc, acc);
      const at::Tensor m_new = at::maximum(m, std::get<0>(z.max(1)));
      l = l * at::exp(m - m_new) + at::exp(z - m_new.unsqueeze(1)).sum(1);
      m = m_new;
      auto [in, col] = TargetColumns(y, v0, vc);
      target = at::where(in, z.gather(1, col), target);
    }
    const at::Tensor lse = m + at::log(l);
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
      const at::Tensor u = hd.lora() ? at::mm(h, hd.A_rD.t()).mul_(hd.s) : at::Tensor();
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
  if (hd.lora()) adapted.push_back({0, T, LinearProduct(hd.h_TD, hd.A_rD).mul_(hd.s), hd.B_Vr});
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

}  // namespace tinkerd::kernels
