#include "kernels/attention.h"

#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/compat.h"
#include "kernels/decode_attention.h"  // AttentionForwardRows
#include "kernels/mixed_grad.h"        // AccumulateType

namespace tinkerd::kernels {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

double ScaleOf(const AttentionParams& p) {
  return p.scale > 0 ? p.scale : 1.0 / std::sqrt(static_cast<double>(p.q_THd.size(2)));
}

void Check(const AttentionParams& p) {
  TORCH_CHECK(p.q_THd.dim() == 3 && p.k_UKd.dim() == 3 && p.v_UKd.dim() == 3,
              "attention: q, k, v must be [tokens, heads, head_dim]");
  TORCH_CHECK(p.k_UKd.sizes() == p.v_UKd.sizes(), "attention: k and v differ in shape");
  TORCH_CHECK(p.q_THd.size(2) == p.k_UKd.size(2), "attention: q and k differ in head_dim");
  TORCH_CHECK(p.q_THd.size(1) % p.k_UKd.size(1) == 0,
              "attention: query heads must be a multiple of kv heads");
  TORCH_CHECK(p.cu_seqlens_q.size() == p.cu_seqlens_k.size() && !p.cu_seqlens_q.empty(),
              "attention: cu_seqlens_q and cu_seqlens_k must have the same length");
  TORCH_CHECK(p.cu_seqlens_q.back() == p.q_THd.size(0) && p.cu_seqlens_k.back() == p.k_UKd.size(0),
              "attention: cu_seqlens do not end at the token counts");
  for (size_t s = 0; s + 1 < p.cu_seqlens_q.size(); ++s) {
    const int64_t Lq = p.cu_seqlens_q[s + 1] - p.cu_seqlens_q[s];
    const int64_t Lk = p.cu_seqlens_k[s + 1] - p.cu_seqlens_k[s];
    TORCH_CHECK(Lq >= 0 && Lq <= Lk, "attention: sequence ", s, " has ", Lq, " queries for ", Lk,
                " keys");
  }
  TORCH_CHECK(p.window >= 0 && p.block_q > 0 && p.block_k > 0, "attention: bad window or blocks");
}

// Rows [start, start + n) of a [tokens, K·G, d] tensor as [K, G·n, d]: one bmm batch per kv
// head, the G query heads that share it stacked along the rows.
at::Tensor RowsByKvHead(const at::Tensor& x_THd, int64_t start, int64_t n, int64_t K,
                        at::ScalarType acc) {
  const int64_t d = x_THd.size(2), G = x_THd.size(1) / K;
  return x_THd.narrow(0, start, n)
      .view({n, K, G, d})
      .permute({1, 2, 0, 3})
      .reshape({K, G * n, d})
      .to(acc);
}

// The inverse of RowsByKvHead: [K, G·n, d] back to [n, K·G, d].
at::Tensor TokensByHead(const at::Tensor& x_KGnd, int64_t n, int64_t K) {
  const int64_t d = x_KGnd.size(2), G = x_KGnd.size(1) / n;
  return x_KGnd.view({K, G, n, d}).permute({2, 0, 1, 3}).reshape({n, K * G, d});
}

// Keys [start, start + n) as [K, n, d].
at::Tensor Keys(const at::Tensor& k_UKd, int64_t start, int64_t n, at::ScalarType acc) {
  return k_UKd.narrow(0, start, n).permute({1, 0, 2}).to(acc);
}

// One tile: queries at positions [first, first + bq), keys [j0, j0 + bk) of one sequence.
struct Tile {
  int64_t first, bq, j0, bk, window;
  // Whether any (query, key) pair of the tile is hidden.
  bool Masked() const {
    const bool future = j0 + bk - 1 > first;
    const bool past = window > 0 && (first + bq - 1) - j0 >= window;
    return future || past;
  }
};

// Scores S [K, G·bq, bk] with hidden pairs set to −inf.
void MaskScores(at::Tensor& S, const Tile& t, int64_t K) {
  if (!t.Masked()) return;
  const at::TensorOptions idx = at::TensorOptions().dtype(at::kLong).device(S.device());
  const at::Tensor i = at::arange(t.first, t.first + t.bq, idx).unsqueeze(1);
  const at::Tensor j = at::arange(t.j0, t.j0 + t.bk, idx).unsqueeze(0);
  at::Tensor hidden = j > i;
  if (t.window > 0) hidden = hidden.logical_or(i - j >= t.window);
  S.view({K, -1, t.bq, t.bk}).masked_fill_(hidden, kNegInf);
}

// For each block of queries (first packed row, the sequence's first packed key, rows): calls
// fn_block with the tiles of keys that block can see, in key order.
template <typename Fn>
void ForEachTile(const AttentionParams& p, Fn&& fn_block) {
  for (size_t s = 0; s + 1 < p.cu_seqlens_q.size(); ++s) {
    const int64_t q0 = p.cu_seqlens_q[s], Lq = p.cu_seqlens_q[s + 1] - q0;
    const int64_t k0 = p.cu_seqlens_k[s], Lk = p.cu_seqlens_k[s + 1] - k0;
    for (int64_t i0 = 0; i0 < Lq; i0 += p.block_q) {
      const int64_t bq = std::min(p.block_q, Lq - i0);
      const int64_t first = Lk - Lq + i0;  // position of the block's first query
      const int64_t lo = p.window > 0 ? std::max<int64_t>(0, first - p.window + 1) : 0;
      const int64_t hi = first + bq;  // one past the last visible key
      std::vector<Tile> tiles;
      for (int64_t j0 = lo; j0 < hi; j0 += p.block_k) {
        tiles.push_back({first, bq, j0, std::min(p.block_k, hi - j0), p.window});
      }
      fn_block(q0 + i0, k0, bq, tiles);
    }
  }
}

}  // namespace

AttentionForward AttentionForwardTiled(const AttentionParams& p) {
  Check(p);
  const at::Tensor q = p.q_THd.contiguous(), k = p.k_UKd.contiguous(), v = p.v_UKd.contiguous();
  const int64_t T = q.size(0), H = q.size(1), K = k.size(1);
  const at::ScalarType acc = AccumulateType(q.scalar_type());
  const double scale = ScaleOf(p);
  AttentionForward out{at::empty_like(q), at::empty({H, T}, q.options().dtype(acc))};
  ForEachTile(p, [&](int64_t row, int64_t k0, int64_t bq, const std::vector<Tile>& tiles) {
    const at::Tensor q_t = RowsByKvHead(q, row, bq, K, acc);  // [K, G·bq, d]
    at::Tensor m = at::full({K, q_t.size(1)}, kNegInf, q_t.options());
    at::Tensor l = at::zeros({K, q_t.size(1)}, q_t.options());
    at::Tensor o = at::zeros_like(q_t);
    for (const Tile& t : tiles) {
      at::Tensor S = at::bmm(q_t, Keys(k, k0 + t.j0, t.bk, acc).transpose(1, 2)).mul_(scale);
      MaskScores(S, t, K);
      const at::Tensor m_new = at::maximum(m, std::get<0>(S.max(-1)));
      // A row whose keys so far are all hidden keeps max −inf; shift it by 0 instead.
      const at::Tensor shift = m_new.masked_fill(m_new.eq(kNegInf), 0.0);
      const at::Tensor P = at::exp(S - shift.unsqueeze(-1));
      const at::Tensor alpha = at::exp(m - shift);
      l = l * alpha + P.sum(-1);
      o = o * alpha.unsqueeze(-1) + at::bmm(P, Keys(v, k0 + t.j0, t.bk, acc));
      m = m_new;
    }
    out.o_THd.narrow(0, row, bq).copy_(TokensByHead(o / l.unsqueeze(-1), bq, K));
    out.lse_HT.narrow(1, row, bq).copy_((m + at::log(l)).view({H, bq}));
  });
  return out;
}

AttentionGrads AttentionBackwardTiled(const AttentionParams& p, const at::Tensor& o_THd,
                                      const at::Tensor& lse_HT, const at::Tensor& do_THd) {
  Check(p);
  const at::Tensor q = p.q_THd.contiguous(), k = p.k_UKd.contiguous(), v = p.v_UKd.contiguous();
  const at::Tensor o = o_THd.contiguous(), dout = do_THd.contiguous();
  const int64_t H = q.size(1), K = k.size(1);
  const at::ScalarType acc = AccumulateType(q.scalar_type());
  const double scale = ScaleOf(p);
  at::Tensor dq = at::zeros_like(q);
  at::Tensor dk = at::zeros(k.sizes(), k.options().dtype(acc));  // [U, K, d]
  at::Tensor dv = at::zeros(v.sizes(), v.options().dtype(acc));
  ForEachTile(p, [&](int64_t row, int64_t k0, int64_t bq, const std::vector<Tile>& tiles) {
    const at::Tensor q_t = RowsByKvHead(q, row, bq, K, acc);
    const at::Tensor do_t = RowsByKvHead(dout, row, bq, K, acc);
    const at::Tensor delta = (do_t * RowsByKvHead(o, row, bq, K, acc)).sum(-1);  // [K, G·bq]
    const at::Tensor lse = lse_HT.narrow(1, row, bq).to(acc).reshape({K, H / K * bq});
    at::Tensor dq_t = at::zeros_like(q_t);
    for (const Tile& t : tiles) {
      const at::Tensor k_t = Keys(k, k0 + t.j0, t.bk, acc);
      const at::Tensor v_t = Keys(v, k0 + t.j0, t.bk, acc);
      at::Tensor S = at::bmm(q_t, k_t.transpose(1, 2)).mul_(scale);
      MaskScores(S, t, K);
      const at::Tensor P = at::exp(S - lse.unsqueeze(-1));  // hidden pairs: exp(−inf) = 0
      dv.narrow(0, k0 + t.j0, t.bk).add_(at::bmm(P.transpose(1, 2), do_t).permute({1, 0, 2}));
      const at::Tensor dS = P * (at::bmm(do_t, v_t.transpose(1, 2)) - delta.unsqueeze(-1));
      dq_t.add_(at::bmm(dS, k_t));
      dk.narrow(0, k0 + t.j0, t.bk)
          .add_(at::bmm(dS.transpose(1, 2), q_t).permute({1, 0, 2}).mul(scale));
    }
    dq.narrow(0, row, bq).copy_(TokensByHead(dq_t.mul_(scale), bq, K));
  });
  return {dq, dk.to(k.scalar_type()), dv.to(v.scalar_type())};
}

bool UsesFlashAttention(const AttentionParams& p) {
#if TINKERD_HAS_FLASH_ATTENTION
  const at::ScalarType t = p.q_THd.scalar_type();
  const int64_t d = p.q_THd.size(2);
  return p.q_THd.is_cuda() && (t == at::kBFloat16 || t == at::kHalf) && d % 8 == 0 && d <= 256;
#else
  (void)p;
  return false;
#endif
}

namespace {

#if TINKERD_HAS_FLASH_ATTENTION
at::Tensor CuSeqlens(const std::vector<int64_t>& cu, const at::Device& device) {
  std::vector<int32_t> v(cu.begin(), cu.end());
  return at::tensor(v, at::kInt).to(device);
}

int64_t MaxLength(const std::vector<int64_t>& cu) {
  int64_t m = 0;
  for (size_t s = 0; s + 1 < cu.size(); ++s) m = std::max(m, cu[s + 1] - cu[s]);
  return m;
}
#endif

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Saved for backward: q, k, v, o and lse, O(tokens × heads × head_dim); plus, on the flash path,
// its RNG state tensors (unused without dropout, but part of its backward signature).
struct AttentionFunction : torch::autograd::Function<AttentionFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const AttentionParams* params) {
    AttentionParams p = *params;
    p.q_THd = q;
    p.k_UKd = k;
    p.v_UKd = v;
    ctx->saved_data["cu_q"] = at::IntArrayRef(p.cu_seqlens_q);
    ctx->saved_data["cu_k"] = at::IntArrayRef(p.cu_seqlens_k);
    ctx->saved_data["window"] = p.window;
    ctx->saved_data["scale"] = ScaleOf(p);
    ctx->saved_data["block_q"] = p.block_q;
    ctx->saved_data["block_k"] = p.block_k;
    const bool flash = UsesFlashAttention(p);
    ctx->saved_data["flash"] = flash;
#if TINKERD_HAS_FLASH_ATTENTION
    if (flash) {
      const at::Tensor cu_q = CuSeqlens(p.cu_seqlens_q, q.device());
      const at::Tensor cu_k = CuSeqlens(p.cu_seqlens_k, q.device());
      const std::optional<int64_t> left =
          p.window > 0 ? std::optional<int64_t>(p.window - 1) : std::nullopt;
      const std::optional<int64_t> right = p.window > 0 ? std::optional<int64_t>(0) : std::nullopt;
      auto [o, lse, rng, unused, debug] = at::_flash_attention_forward(
          q.contiguous(), k.contiguous(), v.contiguous(), cu_q, cu_k, MaxLength(p.cu_seqlens_q),
          MaxLength(p.cu_seqlens_k), /*dropout_p=*/0.0, /*is_causal=*/true,
          /*return_debug_mask=*/false, ScaleOf(p), left, right);
      ctx->save_for_backward({q, k, v, o, lse, rng, unused, cu_q, cu_k});
      return o;
    }
#endif
    // On the CPU each query as a decode step attends it, so that the sampler's logprobs are the
    // trainer's to the bit (kernels/decode_attention.h).
    AttentionForward f = q.device().is_cpu() ? AttentionForwardRows(p) : AttentionForwardTiled(p);
    ctx->save_for_backward({q, k, v, f.o_THd, f.lse_HT});
    return f.o_THd;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    AttentionParams p;
    p.q_THd = s[0];
    p.k_UKd = s[1];
    p.v_UKd = s[2];
    p.cu_seqlens_q = ctx->saved_data["cu_q"].toIntVector();
    p.cu_seqlens_k = ctx->saved_data["cu_k"].toIntVector();
    p.window = ctx->saved_data["window"].toInt();
    p.scale = ctx->saved_data["scale"].toDouble();
    p.block_q = ctx->saved_data["block_q"].toInt();
    p.block_k = ctx->saved_data["block_k"].toInt();
#if TINKERD_HAS_FLASH_ATTENTION
    if (ctx->saved_data["flash"].toBool()) {
      const std::optional<int64_t> left =
          p.window > 0 ? std::optional<int64_t>(p.window - 1) : std::nullopt;
      const std::optional<int64_t> right = p.window > 0 ? std::optional<int64_t>(0) : std::nullopt;
      auto [dq, dk, dv] = at::_flash_attention_backward(
          grads[0].contiguous(), s[0].contiguous(), s[1].contiguous(), s[2].contiguous(), s[3],
          s[4], s[7], s[8], MaxLength(p.cu_seqlens_q), MaxLength(p.cu_seqlens_k), 0.0,
          /*is_causal=*/true, s[5], s[6], p.scale, left, right);
      return {dq, dk, dv, at::Tensor()};
    }
#endif
    AttentionGrads g = AttentionBackwardTiled(p, s[3], s[4], grads[0]);
    return {g.dq_THd, g.dk_UKd, g.dv_UKd, at::Tensor()};
  }
};

}  // namespace

at::Tensor Attention(const AttentionParams& p) {
  Check(p);
  return AttentionFunction::apply(p.q_THd, p.k_UKd, p.v_UKd, &p);
}

}  // namespace tinkerd::kernels
