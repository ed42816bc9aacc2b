#include "runner/model/transformer.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "kernels/attention.h"
#include "kernels/decode_attention.h"
#include "kernels/linear.h"
#include "kernels/recompute.h"
#include "kernels/rms_norm.h"
#include "kernels/routed_experts.h"
#include "runner/model/rope.h"
#include "runner/util/status_macros.h"

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

// SwiGLU: down(silu(gate(x)) ⊙ up(x)), each projection adapted under its module name.
at::Tensor Mlp(const at::Tensor& x_ND, const at::Tensor& gate, const at::Tensor& up,
               const at::Tensor& down, const Adapters& lora, const std::string& module,
               const std::array<std::string, 3>& names) {
  using kernels::Linear;
  const at::Tensor none;
  const at::Tensor gate_NI = Linear(Proj(x_ND, gate, none, lora, module + names[0]));
  const at::Tensor up_NI = Linear(Proj(x_ND, up, none, lora, module + names[1]));
  return Linear(Proj(kernels::SwiGLU(gate_NI, up_NI), down, none, lora, module + names[2]));
}

// A forward's router replay and recording (PackedBatch::routes_TRk, ForwardOptions::on_routes),
// and where its experts run (ForwardOptions::expert_slots, expert_slots_of).
struct RouteIo {
  at::Tensor replay_TRk;
  std::function<void(int64_t routed, const at::Tensor& experts_Tk)> record;
  kernels::SlotsFn slots;
  std::function<void(int64_t routed, const at::Tensor& probs_TE, const at::Tensor& experts_Tk)>
      observe;
  std::function<kernels::SlotsFn(int64_t layer, size_t run)> slots_of;
};

// Layer `p`'s expert e of the routed MLP: a SwiGLU, each projection adapted under its name.
at::Tensor Expert(const MoeConfig& m, const LayerWeights& L, const Adapters& lora,
                  const std::string& p, int64_t e, const at::Tensor& x_ND) {
  const ExpertWeights& W = L.experts[static_cast<size_t>(e)];
  return Mlp(x_ND, W.gate_ID, W.up_ID, W.down_DI, lora, p + m.names.Expert(e),
             {m.names.gate, m.names.up, m.names.down});
}

// The routed MLP (kernels/routed_experts.h), the rows' experts given by replay_Tk where it is
// defined (a row of -1 routes itself), `chosen_Tk` (when set) receiving the experts used and
// `probs_TE` (when set; not with runs) the router's probabilities. Rows in runs (Adapters::runs)
// route run by run, each with its adapter as `all`: a run's tokens meet only their own model's
// expert adapters, in products over that run's rows alone, so a call computes what it would alone.
// `slots_of` (when set) gives each run's slots, `slots` else.
at::Tensor RoutedMlp(const MoeConfig& m, const LayerWeights& L, const Adapters& lora,
                     const std::string& p, const at::Tensor& replay_Tk, const at::Tensor& x_TD,
                     const kernels::SlotsFn& slots,
                     const std::function<kernels::SlotsFn(size_t run)>& slots_of,
                     at::Tensor* chosen_Tk, at::Tensor* probs_TE) {
  if (!lora.runs.empty()) {
    // Run by run, a run of no rows skipped: not a collective every rank takes part in alike
    // (slots_of's are led by this rank: runner/dist/expert_parallel.h).
    TORCH_CHECK(!slots, "RoutedMlp: experts spread over ranks route the batch whole");
    TORCH_CHECK(probs_TE == nullptr, "RoutedMlp: the router's loss takes one model's rows");
    std::vector<int64_t> rows;
    for (const auto& [adapter, n] : lora.runs) rows.push_back(n);
    std::vector<at::Tensor> out = x_TD.split_with_sizes(rows);
    std::vector<at::Tensor> replay(rows.size());
    if (replay_Tk.defined()) replay = replay_Tk.split_with_sizes(rows);
    std::vector<at::Tensor> chosen(rows.size());
    for (size_t i = 0; i < out.size(); ++i) {
      if (rows[i] == 0) {
        chosen[i] = at::empty({0, m.top_k}, x_TD.options().dtype(at::kLong));
        continue;
      }
      out[i] = RoutedMlp(m, L, Adapters(lora.runs[i].first), p, replay[i], out[i],
                         slots_of ? slots_of(i) : slots, nullptr, &chosen[i], nullptr);
    }
    if (chosen_Tk != nullptr) *chosen_Tk = at::cat(chosen);
    return at::cat(out);
  }
  const at::Tensor none;
  kernels::RouteParams route;
  route.logits_TE = kernels::Linear(Proj(x_TD, L.router_ED, none, Adapters(), ""));
  route.top_k = m.top_k;
  route.normalize = m.norm_topk_prob;
  route.wide_weights = m.wide_weights;
  route.experts_Tk = replay_Tk;
  const kernels::Routing routing = kernels::Route(route);
  if (chosen_Tk != nullptr) *chosen_Tk = routing.experts_Tk;
  if (probs_TE != nullptr) *probs_TE = routing.probs_TE;
  return kernels::RoutedExperts(
      {x_TD, &routing,
       [&](int64_t e, const at::Tensor& x_ND) { return Expert(m, L, lora, p, e, x_ND); },
       slots_of ? slots_of(0) : slots});
}

// One decoder layer on the residual stream h_TD: h + attn(norm(h)), then + mlp(norm(·)).
// With `kv`, layer `layer`'s attention also reads the cached keys and values (KvStep).
at::Tensor DecoderLayer(const ModelConfig& c, const LayerWeights& L, const Adapters& lora,
                        const std::string& p, const RopeTables& rope,
                        const std::vector<int64_t>& cu_seqlens, const KvStep* kv,
                        const RouteIo& routes, int64_t layer, const at::Tensor& h_TD) {
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
  if (!c.Routes(layer)) {
    return out_TD + Mlp(x_TD, L.gate_proj, L.up_proj, L.down_proj, lora, p + "mlp.",
                        {"gate_proj", "up_proj", "down_proj"});
  }
  const int64_t routed = c.moe.RoutedIndex(layer);
  at::Tensor chosen_Tk, probs_TE;
  std::function<kernels::SlotsFn(size_t run)> slots_of;
  if (routes.slots_of) {
    slots_of = [&routes, layer](size_t run) { return routes.slots_of(layer, run); };
  }
  const at::Tensor mlp_TD = RoutedMlp(
      c.moe, L, lora, p, routes.replay_TRk.defined() ? routes.replay_TRk.select(1, routed) : none,
      x_TD, routes.slots, slots_of, routes.record || routes.observe ? &chosen_Tk : nullptr,
      routes.observe ? &probs_TE : nullptr);
  if (routes.record) routes.record(routed, chosen_Tk);
  if (routes.observe) routes.observe(routed, probs_TE, chosen_Tk);
  if (!L.shared_gate_1D.defined()) return out_TD + mlp_TD;
  // Qwen2-MoE's shared expert, which every token meets, added after the routed ones.
  const at::Tensor shared_TD =
      Mlp(x_TD, L.shared.gate_ID, L.shared.up_ID, L.shared.down_DI, lora,
          p + c.moe.names.SharedExpert(), {c.moe.names.gate, c.moe.names.up, c.moe.names.down});
  const at::Tensor gate_T1 =
      at::sigmoid(Linear(Proj(x_TD, L.shared_gate_1D, none, Adapters(), "")));
  return out_TD + (mlp_TD + gate_T1 * shared_TD);
}

// The trainable tensors a layer reads: its LoRA pairs, or its own weights under full fine-tuning.
std::vector<at::Tensor> LayerParams(const MoeNames& moe, const LayerWeights& L,
                                    const Adapters& lora, const std::string& p) {
  std::vector<at::Tensor> out;
  for (const at::Tensor* t : L.All()) {
    if (t->defined() && t->requires_grad()) out.push_back(*t);
  }
  std::vector<const LoraAdapter*> adapters{lora.all};
  for (const auto& [adapter, rows] : lora.runs) adapters.push_back(adapter);
  std::vector<std::string> modules{"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                   "self_attn.o_proj", "mlp.gate_proj",    "mlp.up_proj",
                                   "mlp.down_proj"};
  for (const std::string* name : {&moe.gate, &moe.up, &moe.down}) {
    modules.push_back(moe.SharedExpert() + *name);
  }
  for (size_t e = 0; e < L.experts.size(); ++e) {
    for (const std::string* name : {&moe.gate, &moe.up, &moe.down}) {
      modules.push_back(moe.Expert(static_cast<int64_t>(e)) + *name);
    }
  }
  for (const LoraAdapter* adapter : adapters) {
    if (adapter == nullptr) continue;
    for (const std::string& m : modules) {
      if (const LoraPair* pair = adapter->Find(p + m)) {
        out.push_back(pair->A_rI);
        out.push_back(pair->B_Or);
      }
    }
  }
  return out;
}

// Layer `layer` of `source` on h_TD: its weights gathered for the forward and again for the
// backward (kernels/recompute.h); `params` the trainable tensors fn reads besides them.
at::Tensor GatheredLayer(const LayerSource& source, int64_t layer,
                         std::function<at::Tensor(const LayerWeights&, const at::Tensor&)> fn,
                         const at::Tensor& h_TD, const std::vector<at::Tensor>& params) {
  kernels::Gathered weights;
  weights.gather = [&source, layer] {
    const LayerWeights L = source.gather(layer);
    std::vector<at::Tensor> out;
    for (const at::Tensor* t : L.All()) out.push_back(*t);
    return out;
  };
  if (source.scatter) {
    weights.scatter = [&source, layer](const std::vector<at::Tensor>& grads) {
      source.scatter(layer, LayerWeights::FromAll(grads));
    };
  }
  return kernels::RecomputeGathered(
      [fn = std::move(fn)](const at::Tensor& h, const std::vector<at::Tensor>& tensors) {
        return fn(LayerWeights::FromAll(tensors), h);
      },
      std::move(weights), h_TD, params);
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

// A layer's fields by name: these, then the family's router and shared expert (kFamilyFields of
// them), then the experts.
constexpr size_t kFamilyFields = 5;
constexpr std::array<const char*, 14> kFixedNames = {
    "input_layernorm.weight",  "post_attention_layernorm.weight",
    "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight",
    "self_attn.q_proj.bias",   "self_attn.k_proj.bias",
    "self_attn.v_proj.bias",   "self_attn.q_norm.weight",
    "self_attn.k_norm.weight", "mlp.gate_proj.weight",
    "mlp.up_proj.weight",      "mlp.down_proj.weight"};

// LayerWeights::All for either constness.
template <typename Layer, typename Ptr>
std::vector<Ptr> AllOf(Layer& L) {
  std::vector<Ptr> out{&L.input_norm_D, &L.post_norm_D,    &L.q_proj,        &L.k_proj,
                       &L.v_proj,       &L.o_proj,         &L.q_bias,        &L.k_bias,
                       &L.v_bias,       &L.q_norm_d,       &L.k_norm_d,      &L.gate_proj,
                       &L.up_proj,      &L.down_proj,      &L.router_ED,     &L.shared.gate_ID,
                       &L.shared.up_ID, &L.shared.down_DI, &L.shared_gate_1D};
  for (auto& e : L.experts) {
    out.push_back(&e.gate_ID);
    out.push_back(&e.up_ID);
    out.push_back(&e.down_DI);
  }
  return out;
}

}  // namespace

std::vector<const at::Tensor*> LayerWeights::All() const {
  return AllOf<const LayerWeights, const at::Tensor*>(*this);
}
std::vector<at::Tensor*> LayerWeights::All() {
  return AllOf<LayerWeights, at::Tensor*>(*this);
}

std::vector<std::string> LayerWeights::Names(const MoeNames& moe) const {
  std::vector<std::string> out(kFixedNames.begin(), kFixedNames.end());
  out.push_back(moe.Router() + ".weight");
  for (const std::string* name : {&moe.gate, &moe.up, &moe.down}) {
    out.push_back(moe.SharedExpert() + *name + ".weight");
  }
  out.push_back(moe.SharedGate() + ".weight");
  for (size_t e = 0; e < experts.size(); ++e) {
    for (const std::string* name : {&moe.gate, &moe.up, &moe.down}) {
      out.push_back(moe.Expert(static_cast<int64_t>(e)) + *name + ".weight");
    }
  }
  return out;
}

LayerWeights LayerWeights::Shaped(size_t experts) {
  LayerWeights L;
  L.experts.resize(experts);
  return L;
}

LayerWeights LayerWeights::FromAll(std::vector<at::Tensor> fields) {
  const size_t fixed = kFixedNames.size() + kFamilyFields;
  TORCH_CHECK(fields.size() >= fixed && (fields.size() - fixed) % 3 == 0,
              "LayerWeights::FromAll: ", fields.size(), " fields");
  LayerWeights L = Shaped((fields.size() - fixed) / 3);
  const auto all = L.All();
  for (size_t f = 0; f < all.size(); ++f) *all[f] = std::move(fields[f]);
  return L;
}

absl::StatusOr<BaseWeights> BaseWeightsFromTensors(const ModelConfig& c, TensorMap m,
                                                   const std::function<bool(int64_t)>& holds) {
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
             {"self_attn.o_proj.weight", {D, qo}, &L.o_proj}}) {
      if (auto st = take(p + name, shape, out); !st.ok()) return st;
    }
    if (c.Routes(l)) {
      const MoeConfig& moe = c.moe;
      const int64_t Ie = moe.expert_intermediate_size;
      RETURN_IF_ERROR(take(p + moe.names.Router() + ".weight", {moe.num_experts, D}, &L.router_ED));
      if (const int64_t Is = moe.shared_expert_intermediate_size; Is > 0) {
        const std::string q = p + moe.names.SharedExpert();
        RETURN_IF_ERROR(take(q + moe.names.gate + ".weight", {Is, D}, &L.shared.gate_ID));
        RETURN_IF_ERROR(take(q + moe.names.up + ".weight", {Is, D}, &L.shared.up_ID));
        RETURN_IF_ERROR(take(q + moe.names.down + ".weight", {D, Is}, &L.shared.down_DI));
        RETURN_IF_ERROR(take(p + moe.names.SharedGate() + ".weight", {1, D}, &L.shared_gate_1D));
      }
      L.experts.resize(static_cast<size_t>(moe.num_experts));
      for (int64_t e = 0; e < moe.num_experts; ++e) {
        if (holds && !holds(e)) continue;
        const std::string q = p + moe.names.Expert(e);
        ExpertWeights& W = L.experts[static_cast<size_t>(e)];
        RETURN_IF_ERROR(take(q + moe.names.gate + ".weight", {Ie, D}, &W.gate_ID));
        RETURN_IF_ERROR(take(q + moe.names.up + ".weight", {Ie, D}, &W.up_ID));
        RETURN_IF_ERROR(take(q + moe.names.down + ".weight", {D, Ie}, &W.down_DI));
      }
    } else {
      RETURN_IF_ERROR(take(p + "mlp.gate_proj.weight", {I, D}, &L.gate_proj));
      RETURN_IF_ERROR(take(p + "mlp.up_proj.weight", {I, D}, &L.up_proj));
      RETURN_IF_ERROR(take(p + "mlp.down_proj.weight", {D, I}, &L.down_proj));
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

std::map<std::string, at::Tensor> BaseWeights::Named(const ModelConfig& config) const {
  std::map<std::string, at::Tensor> m;
  m["model.embed_tokens.weight"] = embed_VD;
  m["model.norm.weight"] = final_norm_D;
  if (!config.tie_word_embeddings) m["lm_head.weight"] = lm_head_VD;
  for (size_t l = 0; l < layers.size(); ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    const auto fields = layers[l].All();
    const std::vector<std::string> names = layers[l].Names(config.moe.names);
    for (size_t f = 0; f < fields.size(); ++f) {
      if (fields[f]->defined()) m[p + names[f]] = *fields[f];
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
    if (mine.size() != theirs.size()) return false;
    for (size_t i = 0; i < mine.size(); ++i) {
      if (!mine[i]->is_same(*theirs[i])) return false;
    }
  }
  return true;
}

kernels::ExpertFn LayerExperts(const ModelConfig& c, const LayerWeights& L, const LoraAdapter* lora,
                               int64_t layer) {
  return
      [&m = c.moe, &L, lora, p = absl::StrCat("model.layers.", layer, ".")](
          int64_t e, const at::Tensor& x_ND) { return Expert(m, L, Adapters(lora), p, e, x_ND); };
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
  // A recomputed layer would record its routes again in the backward: recording is inference's.
  const bool recomputes =
      (options.recompute_layers && options.kv == nullptr) || options.layers != nullptr;
  const RouteIo routes{batch.routes_TRk, recomputes ? nullptr : options.on_routes,
                       options.expert_slots, options.on_router, options.expert_slots_of};
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    const auto index = static_cast<int64_t>(l);
    if (options.layers != nullptr) {
      h_TD = GatheredLayer(
          *options.layers, index,
          [&c, lora, p, rope, cu = batch.cu_seqlens, kv = options.kv, routes, index](
              const LayerWeights& L, const at::Tensor& h) {
            return DecoderLayer(c, L, lora, p, rope, cu, kv, routes, index, h);
          },
          h_TD, LayerParams(c.moe.names, w.layers[l], lora, p));
      continue;
    }
    const LayerWeights& L = w.layers[l];
    auto layer = [&c, &L, lora, p, rope, cu = batch.cu_seqlens, kv = options.kv, routes,
                  index](const at::Tensor& h) {
      return DecoderLayer(c, L, lora, p, rope, cu, kv, routes, index, h);
    };
    h_TD = options.recompute_layers && options.kv == nullptr
               ? kernels::Recompute(layer, h_TD, LayerParams(c.moe.names, L, lora, p))
               : layer(h_TD);
  }
  return Norm(h_TD, w.final_norm_D, c.rms_norm_eps);
}

}  // namespace tinkerd
