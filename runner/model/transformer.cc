#include "runner/model/transformer.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "runner/model/rope.h"

namespace tinkerd {
namespace {

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return x * at::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps) * w;
}

// x·Wᵀ + b, plus the adapter's low-rank update when `module` is adapted.
at::Tensor Linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                  const LoraAdapter* lora, const std::string& module) {
  at::Tensor y = b.defined() ? at::addmm(b, x, w.t()) : at::mm(x, w.t());
  if (lora != nullptr) {
    if (const LoraPair* p = lora->Find(module)) {
      const at::Tensor A = p->A_rI.to(x.scalar_type());
      const at::Tensor B = p->B_Or.to(x.scalar_type());
      y = y + at::mm(at::mm(x, A.t()), B.t()) * lora->scale();
    }
  }
  return y;
}

// Additive causal mask [L, L] (0 where allowed, -inf elsewhere), with an optional window:
// query i sees keys j with i - window < j <= i.
at::Tensor CausalMask(int64_t L, int64_t window, const at::TensorOptions& to) {
  const at::TensorOptions index = to.dtype(at::kLong);
  at::Tensor i = at::arange(L, index).unsqueeze(1);
  at::Tensor j = at::arange(L, index).unsqueeze(0);
  at::Tensor blocked = j > i;
  if (window > 0) blocked = blocked.logical_or(i - j >= window);
  return at::zeros({L, L}, to).masked_fill(blocked, -std::numeric_limits<double>::infinity());
}

// Attention of each sequence on its own keys. GQA: query head h reads kv head h / G.
at::Tensor VarlenAttention(const at::Tensor& q_THd, const at::Tensor& k_TKd,
                           const at::Tensor& v_TKd, const std::vector<int64_t>& cu_seqlens,
                           int64_t window) {
  const int64_t H = q_THd.size(1), K = k_TKd.size(1), d = q_THd.size(2);
  const int64_t G = H / K;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<at::Tensor> outs;
  outs.reserve(cu_seqlens.size() - 1);
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t start = cu_seqlens[s];
    const int64_t L = cu_seqlens[s + 1] - start;
    at::Tensor q_KGLd = q_THd.narrow(0, start, L).permute({1, 0, 2}).reshape({K, G * L, d});
    at::Tensor k_KLd = k_TKd.narrow(0, start, L).permute({1, 0, 2});
    at::Tensor v_KLd = v_TKd.narrow(0, start, L).permute({1, 0, 2});
    at::Tensor scores = at::bmm(q_KGLd, k_KLd.transpose(1, 2)).mul(scale).view({K, G, L, L});
    scores = scores + CausalMask(L, window, scores.options());
    at::Tensor probs = at::softmax(scores, -1).view({K, G * L, L});
    at::Tensor o_KGLd = at::bmm(probs, v_KLd);                  // [K, G·L, d]
    outs.push_back(o_KGLd.view({H, L, d}).permute({1, 0, 2}));  // [L, H, d]
  }
  return at::cat(outs, 0).reshape({q_THd.size(0), H * d});
}

absl::Status Expect(const TensorMap& m, const std::string& name, std::vector<int64_t> shape) {
  auto it = m.find(name);
  if (it == m.end()) return absl::InvalidArgumentError(absl::StrCat("weights: missing ", name));
  if (it->second.sizes().vec() != shape) {
    return absl::InvalidArgumentError(
        absl::StrCat("weights: ", name, " has shape ", c10::str(it->second.sizes()),
                     ", config implies ", c10::str(at::IntArrayRef(shape))));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<BaseWeights> BaseWeightsFromTensors(const ModelConfig& c, TensorMap m) {
  const int64_t D = c.hidden_size, I = c.intermediate_size, V = c.vocab_size;
  const int64_t qo = c.num_attention_heads * c.head_dim;
  const int64_t kvo = c.num_key_value_heads * c.head_dim;
  auto take = [&](const std::string& name, std::vector<int64_t> shape,
                  at::Tensor* out) -> absl::Status {
    if (auto st = Expect(m, name, shape); !st.ok()) return st;
    *out = m[name];
    m.erase(name);
    return absl::OkStatus();
  };
  BaseWeights w;
  if (auto st = take("model.embed_tokens.weight", {V, D}, &w.embed_VD); !st.ok()) return st;
  if (auto st = take("model.norm.weight", {D}, &w.final_norm_D); !st.ok()) return st;
  if (c.tie_word_embeddings) {
    w.lm_head_VD = w.embed_VD;
    m.erase("lm_head.weight");  // some tied checkpoints still carry a copy
  } else if (auto st = take("lm_head.weight", {V, D}, &w.lm_head_VD); !st.ok()) {
    return st;
  }
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    LayerWeights L;
    for (auto [name, shape, out] :
         std::vector<std::tuple<std::string, std::vector<int64_t>, at::Tensor*>>{
             {"input_layernorm.weight", {D}, &L.input_norm_D},
             {"post_attention_layernorm.weight", {D}, &L.post_norm_D},
             {"self_attn.q_proj.weight", {qo, D}, &L.q_proj},
             {"self_attn.k_proj.weight", {kvo, D}, &L.k_proj},
             {"self_attn.v_proj.weight", {kvo, D}, &L.v_proj},
             {"self_attn.o_proj.weight", {D, qo}, &L.o_proj},
             {"mlp.gate_proj.weight", {I, D}, &L.gate_proj},
             {"mlp.up_proj.weight", {I, D}, &L.up_proj},
             {"mlp.down_proj.weight", {D, I}, &L.down_proj}}) {
      if (auto st = take(p + name, shape, out); !st.ok()) return st;
    }
    if (c.attention_bias) {
      if (auto st = take(p + "self_attn.q_proj.bias", {qo}, &L.q_bias); !st.ok()) return st;
      if (auto st = take(p + "self_attn.k_proj.bias", {kvo}, &L.k_bias); !st.ok()) return st;
      if (auto st = take(p + "self_attn.v_proj.bias", {kvo}, &L.v_bias); !st.ok()) return st;
    }
    if (c.qk_norm) {
      if (auto st = take(p + "self_attn.q_norm.weight", {c.head_dim}, &L.q_norm_d); !st.ok())
        return st;
      if (auto st = take(p + "self_attn.k_norm.weight", {c.head_dim}, &L.k_norm_d); !st.ok())
        return st;
    }
    w.layers.push_back(std::move(L));
  }
  for (const auto& [name, t] : m) {
    // Rotary caches some exporters write are recomputed here; anything else is a mismatch.
    if (name.find("rotary_emb.inv_freq") != std::string::npos) continue;
    return absl::InvalidArgumentError(
        absl::StrCat("weights: unexpected tensor ", name, " for ", c.architecture));
  }
  return w;
}

std::map<std::string, at::Tensor> BaseWeights::Named(bool tied) const {
  std::map<std::string, at::Tensor> m;
  m["model.embed_tokens.weight"] = embed_VD;
  m["model.norm.weight"] = final_norm_D;
  if (!tied) m["lm_head.weight"] = lm_head_VD;
  for (size_t l = 0; l < layers.size(); ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    const LayerWeights& L = layers[l];
    m[p + "input_layernorm.weight"] = L.input_norm_D;
    m[p + "post_attention_layernorm.weight"] = L.post_norm_D;
    m[p + "self_attn.q_proj.weight"] = L.q_proj;
    m[p + "self_attn.k_proj.weight"] = L.k_proj;
    m[p + "self_attn.v_proj.weight"] = L.v_proj;
    m[p + "self_attn.o_proj.weight"] = L.o_proj;
    if (L.q_bias.defined()) {
      m[p + "self_attn.q_proj.bias"] = L.q_bias;
      m[p + "self_attn.k_proj.bias"] = L.k_bias;
      m[p + "self_attn.v_proj.bias"] = L.v_bias;
    }
    if (L.q_norm_d.defined()) {
      m[p + "self_attn.q_norm.weight"] = L.q_norm_d;
      m[p + "self_attn.k_norm.weight"] = L.k_norm_d;
    }
    m[p + "mlp.gate_proj.weight"] = L.gate_proj;
    m[p + "mlp.up_proj.weight"] = L.up_proj;
    m[p + "mlp.down_proj.weight"] = L.down_proj;
  }
  return m;
}

at::Tensor ForwardLogits(const ModelConfig& c, const BaseWeights& w, const LoraAdapter* lora,
                         const PackedBatch& batch) {
  const int64_t T = batch.tokens_T.size(0);
  const int64_t H = c.num_attention_heads, K = c.num_key_value_heads, d = c.head_dim;
  const double eps = c.rms_norm_eps;
  const RopeTables rope = BuildRopeTables(c, batch.cu_seqlens, w.embed_VD.options());
  const at::Tensor none;

  at::Tensor h_TD = at::embedding(w.embed_VD, batch.tokens_T);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    const std::string p = absl::StrCat("model.layers.", l, ".");
    at::Tensor x_TD = RmsNorm(h_TD, L.input_norm_D, eps);
    at::Tensor q_THd =
        Linear(x_TD, L.q_proj, L.q_bias, lora, p + "self_attn.q_proj").view({T, H, d});
    at::Tensor k_TKd =
        Linear(x_TD, L.k_proj, L.k_bias, lora, p + "self_attn.k_proj").view({T, K, d});
    at::Tensor v_TKd =
        Linear(x_TD, L.v_proj, L.v_bias, lora, p + "self_attn.v_proj").view({T, K, d});
    if (c.qk_norm) {
      q_THd = RmsNorm(q_THd, L.q_norm_d, eps);
      k_TKd = RmsNorm(k_TKd, L.k_norm_d, eps);
    }
    q_THd = ApplyRope(q_THd, rope);
    k_TKd = ApplyRope(k_TKd, rope);
    at::Tensor attn_TD = VarlenAttention(q_THd, k_TKd, v_TKd, batch.cu_seqlens, c.sliding_window);
    h_TD = h_TD + Linear(attn_TD, L.o_proj, none, lora, p + "self_attn.o_proj");

    x_TD = RmsNorm(h_TD, L.post_norm_D, eps);
    at::Tensor gate_TI = Linear(x_TD, L.gate_proj, none, lora, p + "mlp.gate_proj");
    at::Tensor up_TI = Linear(x_TD, L.up_proj, none, lora, p + "mlp.up_proj");
    h_TD = h_TD + Linear(at::silu(gate_TI) * up_TI, L.down_proj, none, lora, p + "mlp.down_proj");
  }
  h_TD = RmsNorm(h_TD, w.final_norm_D, eps);
  return Linear(h_TD, w.lm_head_VD, none, lora, "lm_head");
}

}  // namespace tinkerd
