#include "runner/model/lora.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "runner/util/rng.h"

namespace tinkerd {

absl::Status LoraAdapter::Validate(const LoraConfig& lora) {
  if (lora.rank <= 0 || lora.rank > 4096) {
    return absl::InvalidArgumentError("lora.rank: must be in [1, 4096]");
  }
  if (!(lora.alpha > 0) || !std::isfinite(lora.alpha)) {
    return absl::InvalidArgumentError("lora.alpha: must be a positive finite number");
  }
  if (!lora.train_attn && !lora.train_mlp && !lora.train_unembed) {
    return absl::InvalidArgumentError(
        "lora: at least one of train_attn, train_mlp, train_unembed must be true");
  }
  return absl::OkStatus();
}

std::vector<LoraAdapter::Module> LoraAdapter::Modules(const ModelConfig& c,
                                                      const LoraConfig& lora) {
  std::vector<Module> out;
  const int64_t D = c.hidden_size, I = c.intermediate_size;
  const int64_t q_out = c.num_attention_heads * c.head_dim;
  const int64_t kv_out = c.num_key_value_heads * c.head_dim;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    if (lora.train_attn) {
      out.push_back({p + "self_attn.q_proj", D, q_out});
      out.push_back({p + "self_attn.k_proj", D, kv_out});
      out.push_back({p + "self_attn.v_proj", D, kv_out});
      out.push_back({p + "self_attn.o_proj", q_out, D});
    }
    if (lora.train_mlp && c.Routes(l)) {
      // Each expert's own pair, under the names PEFT gives per-expert linears.
      const MoeNames& n = c.moe.names;
      const int64_t Ie = c.moe.expert_intermediate_size;
      if (const int64_t Is = c.moe.shared_expert_intermediate_size; Is > 0) {
        // The shared expert like a dense MLP; its sigmoid gate, like the router, is not adapted.
        out.push_back({p + n.SharedExpert() + n.gate, D, Is});
        out.push_back({p + n.SharedExpert() + n.up, D, Is});
        out.push_back({p + n.SharedExpert() + n.down, Is, D});
      }
      for (int64_t e = 0; e < c.moe.num_experts; ++e) {
        out.push_back({p + n.Expert(e) + n.gate, D, Ie});
        out.push_back({p + n.Expert(e) + n.up, D, Ie});
        out.push_back({p + n.Expert(e) + n.down, Ie, D});
      }
    } else if (lora.train_mlp) {
      out.push_back({p + "mlp.gate_proj", D, I});
      out.push_back({p + "mlp.up_proj", D, I});
      out.push_back({p + "mlp.down_proj", I, D});
    }
  }
  if (lora.train_unembed) out.push_back({"lm_head", D, c.vocab_size});
  return out;
}

int64_t LoraAdapter::CountValues(const ModelConfig& config, const LoraConfig& lora,
                                 const Keep& keep) {
  int64_t n = 0;
  for (const Module& m : Modules(config, lora)) {
    if (!keep || keep(m.name)) n += lora.rank * (m.in + m.out);
  }
  return n;
}

absl::StatusOr<LoraAdapter> LoraAdapter::Create(const ModelConfig& c, const LoraConfig& lora,
                                                uint64_t seed, at::ScalarType dtype,
                                                at::Device device, const Keep& keep) {
  if (absl::Status st = Validate(lora); !st.ok()) return st;
  LoraAdapter a;
  a.scale_ = lora.alpha / static_cast<double>(lora.rank);
  const int64_t r = lora.rank;
  for (const Module& m : Modules(c, lora)) {
    if (keep && !keep(m.name)) continue;
    at::Tensor A = at::empty({r, m.in}, at::kDouble);
    double* p = A.data_ptr<double>();
    SplitMix64 g(MixSeed(seed, m.name.c_str()));
    const double bound = 1.0 / std::sqrt(static_cast<double>(m.in));
    for (int64_t i = 0; i < A.numel(); ++i) p[i] = g.Uniform(-bound, bound);
    // Drawn on the host from a counter-based RNG, so the adapter is the same on every device.
    LoraPair pair{A.to(device, dtype),
                  at::zeros({m.out, r}, at::TensorOptions().dtype(dtype).device(device))};
    pair.A_rI.set_requires_grad(true);
    pair.B_Or.set_requires_grad(true);
    a.pairs_[m.name] = std::move(pair);
  }
  return a;
}

const LoraPair* LoraAdapter::Find(const std::string& module) const {
  auto it = pairs_.find(module);
  return it == pairs_.end() ? nullptr : &it->second;
}

LoraAdapter LoraAdapter::Frozen(at::ScalarType dtype) const {
  LoraAdapter copy = *this;
  for (auto& [module, pair] : copy.pairs_) {
    pair.A_rI = pair.A_rI.detach().to(dtype, /*non_blocking=*/false, /*copy=*/true);
    pair.B_Or = pair.B_Or.detach().to(dtype, /*non_blocking=*/false, /*copy=*/true);
  }
  return copy;
}

std::map<std::string, at::Tensor> LoraAdapter::Parameters() const {
  std::map<std::string, at::Tensor> out;
  for (const auto& [module, pair] : pairs_) {
    out[module + ".lora_A"] = pair.A_rI;
    out[module + ".lora_B"] = pair.B_Or;
  }
  return out;
}

}  // namespace tinkerd
