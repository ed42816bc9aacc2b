#include "runner/model/transformer.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/attention.h"
#include "kernels/decode_attention.h"
#include "kernels/linear.h"
#include "kernels/recompute.h"
#include "kernels/rms_norm.h"
#include "runner/model/rope.h"

namespace tinkerd {
namespace {

kernels::LinearParams Proj(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                           const Adapters& lora, const std::string& module) {
  kernels::LinearParams p;
  p.x_NI = x;
  p.w_OI = w;
  p.b_O = b;
  if (lora.all != nullptr) {
    if (const LoraPair* pair = lora.all->Find(module)) {
      p.A_rI = pair->A_rI;
      p.B_Or = pair->B_Or;
      p.scale = lora.all->scale();
    }
  }
  for (const auto& [adapter, rows] : lora.runs) {
    kernels::LoraRun& run = p.runs.emplace_back();
    run.rows = rows;
    if (const LoraPair* pair = adapter != nullptr ? adapter->Find(module) : nullptr) {
      run.A_rI = pair->A_rI;
      run.B_Or = pair->B_Or;
      run.scale = adapter->scale();
    }
  }
  return p;
}

at::Tensor Norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return kernels::RmsNorm({x, w, eps});
}

// One decoder layer on the residual stream h_TD: h + attn(norm(h)), then + mlp(norm(·)).
// With `kv`, layer `layer`'s attention also reads the cached keys and values (KvStep).
at::Tensor DecoderLayer(const ModelConfig& c, const LayerWeights& L, const Adapters& lora,
                        const std::string& p, const RopeTables& rope,
                        const std::vector<int64_t>& cu_seqlens, const KvStep* kv, int64_t layer,
                        const at::Tensor& h_TD) {
  using kernels::Linear;
  const int64_t T = h_TD.size(0), H = c.num_attention_heads, K = c.num_key_value_heads;
  const int64_t d = c.head_dim;
  const double eps = c.rms_norm_eps;
  const at::Tensor none;
  at::Tensor x_TD = Norm(h_TD, L.input_norm_D, eps);
  at::Tensor q_THd =
      Linear(Proj(x_TD, L.q_proj, L.q_bias, lora, p + "self_attn.q_proj")).view({T, H, d});
  at::Tensor k_TKd =
      Linear(Proj(x_TD, L.k_proj, L.k_bias, lora, p + "self_attn.k_proj")).view({T, K, d});
  at::Tensor v_TKd =
      Linear(Proj(x_TD, L.v_proj, L.v_bias, lora, p + "self_attn.v_proj")).view({T, K, d});
  if (c.qk_norm) {
    q_THd = Norm(q_THd, L.q_norm_d, eps);
    k_TKd = Norm(k_TKd, L.k_norm_d, eps);
  }
  kernels::AttentionParams attn;
  attn.q_THd = ApplyRope(q_THd, rope);
  attn.cu_seqlens_q = cu_seqlens;
  attn.window = c.WindowOf(layer);
  at::Tensor out_THd;
  if (kv == nullptr) {
    attn.k_UKd = ApplyRope(k_TKd, rope);
    attn.v_UKd = v_TKd;
    attn.cu_seqlens_k = cu_seqlens;
    out_THd = kernels::Attention(attn);
  } else if (auto all = kv->extend(layer, ApplyRope(k_TKd, rope), v_TKd);
             auto* pieces = std::get_if<KvPieces>(&all)) {
    out_THd = kernels::DecodeAttention({attn.q_THd, std::move(pieces->k), std::move(pieces->v),
                                        std::move(pieces->lengths), attn.window, attn.scale});
  } else {
    KvPacked& packed = std::get<KvPacked>(all);
    attn.k_UKd = std::move(packed.k_UKd);
    attn.v_UKd = std::move(packed.v_UKd);
    attn.cu_seqlens_k = std::move(packed.cu_seqlens_k);
    out_THd = kernels::Attention(attn);
  }
  const at::Tensor attn_TD = out_THd.reshape({T, H * d});
  at::Tensor out_TD = h_TD + Linear(Proj(attn_TD, L.o_proj, none, lora, p + "self_attn.o_proj"));

  x_TD = Norm(out_TD, L.post_norm_D, eps);
  const at::Tensor gate_TI = Linear(Proj(x_TD, L.gate_proj, none, lora, p + "mlp.gate_proj"));
  const at::Tensor up_TI = Linear(Proj(x_TD, L.up_proj, none, lora, p + "mlp.up_proj"));
  return out_TD + Linear(Proj(kernels::SwiGLU(gate_TI, up_TI), L.down_proj, none, lora,
                              p + "mlp.down_proj"));
}

// The trainable tensors a layer reads: its LoRA pairs, or its own weights under full fine-tuning.
std::vector<at::Tensor> LayerParams(const LayerWeights& L, const Adapters& lora,
                                    const std::string& p) {
  std::vector<at::Tensor> out;
  for (const at::Tensor* t : L.All()) {
    if (t->defined() && t->requires_grad()) out.push_back(*t);
  }
  std::vector<const LoraAdapter*> adapters{lora.all};
  for (const auto& [adapter, rows] : lora.runs) adapters.push_back(adapter);
  for (const LoraAdapter* adapter : adapters) {
    if (adapter == nullptr) continue;
    for (const char* m : {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}) {
      if (const LoraPair* pair = adapter->Find(p + m)) {
        out.push_back(pair->A_rI);
        out.push_back(pair->B_Or);
      }
    }
  }
  return out;
}

// Layer `layer` of `source` on h_TD: its weights gathered for the forward and again for the
// backward (kernels/recompute.h).
at::Tensor GatheredLayer(const LayerSource& source, int64_t layer,
                         std::function<at::Tensor(const LayerWeights&, const at::Tensor&)> fn,
                         const at::Tensor& h_TD) {
  kernels::Gathered weights;
  weights.gather = [&source, layer] {
    const LayerWeights L = source.gather(layer);
    std::vector<at::Tensor> out;
    for (const at::Tensor* t : L.All()) out.push_back(*t);
    return out;
  };
  weights.scatter = [&source, layer](const std::vector<at::Tensor>& grads) {
    LayerWeights g;
    const auto fields = g.All();
    for (size_t f = 0; f < fields.size(); ++f) *fields[f] = grads[f];
    source.scatter(layer, g);
  };
  return kernels::RecomputeGathered(
      [fn = std::move(fn)](const at::Tensor& h, const std::vector<at::Tensor>& tensors) {
        LayerWeights L;
        const auto fields = L.All();
        for (size_t f = 0; f < fields.size(); ++f) *fields[f] = tensors[f];
        return fn(L, h);
      },
      std::move(weights), h_TD);
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
    const auto fields = layers[l].All();
    for (size_t f = 0; f < fields.size(); ++f) {
      if (fields[f]->defined()) m[p + LayerWeights::kNames[f]] = *fields[f];
    }
  }
  return m;
}

bool BaseWeights::Shares(const BaseWeights& other) const {
  if (!embed_VD.is_same(other.embed_VD) || !final_norm_D.is_same(other.final_norm_D) ||
      !lm_head_VD.is_same(other.lm_head_VD) || layers.size() != other.layers.size()) {
    return false;
  }
  for (size_t l = 0; l < layers.size(); ++l) {
    const auto mine = layers[l].All(), theirs = other.layers[l].All();
    for (size_t i = 0; i < mine.size(); ++i) {
      if (!mine[i]->is_same(*theirs[i])) return false;
    }
  }
  return true;
}

const LoraPair* HeadAdapter(const LoraAdapter* lora) {
  return lora != nullptr ? lora->Find("lm_head") : nullptr;
}

at::Tensor ForwardHidden(const ModelConfig& c, const BaseWeights& w, const Adapters& lora,
                         const PackedBatch& batch, const ForwardOptions& options) {
  const at::ScalarType dt = options.compute_dtype.value_or(w.embed_VD.scalar_type());
  const std::vector<int64_t> no_past;
  const std::vector<int64_t>& past = options.kv != nullptr ? options.kv->past : no_past;
  const RopeTables rope =
      options.rope != nullptr
          ? options.rope->Tables(batch.cu_seqlens, past)
          : BuildRopeTables(c, batch.cu_seqlens, w.embed_VD.options().dtype(dt), past);
  at::Tensor h_TD = at::embedding(w.embed_VD, batch.tokens_T).to(dt);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    const auto index = static_cast<int64_t>(l);
    if (options.layers != nullptr) {
      h_TD = GatheredLayer(
          *options.layers, index,
          [&c, lora, p, rope, cu = batch.cu_seqlens, kv = options.kv, index](const LayerWeights& L,
                                                                             const at::Tensor& h) {
            return DecoderLayer(c, L, lora, p, rope, cu, kv, index, h);
          },
          h_TD);
      continue;
    }
    const LayerWeights& L = w.layers[l];
    auto layer = [&c, &L, lora, p, rope, cu = batch.cu_seqlens, kv = options.kv,
                  index](const at::Tensor& h) {
      return DecoderLayer(c, L, lora, p, rope, cu, kv, index, h);
    };
    h_TD = options.recompute_layers && options.kv == nullptr
               ? kernels::Recompute(layer, h_TD, LayerParams(L, lora, p))
               : layer(h_TD);
  }
  return Norm(h_TD, w.final_norm_D, c.rms_norm_eps);
}

}  // namespace tinkerd
