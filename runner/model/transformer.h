// The decoder (Llama / Mistral / Qwen2 / Qwen3) on a packed micro-batch.
//
// A micro-batch is one flat token tensor: S sequences concatenated, cu_seqlens [S+1] marking
// their boundaries. Positions restart at 0 in each sequence and attention never crosses a
// boundary, so a packed sequence computes exactly what it would alone; there is no padding.
//
// Shape suffixes: T tokens in the micro-batch, D hidden, V vocab, H query heads, K kv heads,
// d head_dim, I intermediate, L one sequence's length.
#pragma once

#include <ATen/ATen.h>

#include <array>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/routed_experts.h"
#include "runner/model/config.h"
#include "runner/model/lora.h"
#include "runner/model/rope.h"
#include "runner/model/weights.h"

namespace tinkerd {

// One expert of a routed MLP (SwiGLU, like the dense MLP), [out, in].
struct ExpertWeights {
  at::Tensor gate_ID, up_ID, down_DI;
};

struct LayerWeights {
  at::Tensor input_norm_D, post_norm_D;
  at::Tensor q_proj, k_proj, v_proj, o_proj;  // [out, in]
  at::Tensor q_bias, k_bias, v_bias;          // undefined unless attention_bias
  at::Tensor q_norm_d, k_norm_d;              // undefined unless qk_norm
  at::Tensor gate_proj, up_proj, down_proj;   // undefined where the layer routes
  at::Tensor router_ED;                       // defined where the layer routes
  // Defined where the layer routes and the family has a shared expert (Qwen2-MoE): its SwiGLU
  // and its gate [1, D].
  ExpertWeights shared;
  at::Tensor shared_gate_1D;
  std::vector<ExpertWeights> experts;  // as many as the config's experts where it routes

  // Every field above, defined or not, expert by expert at the end; Names gives each one's
  // Hugging Face name in the layer, and FromAll reverses All.
  std::vector<const at::Tensor*> All() const;
  std::vector<at::Tensor*> All();
  std::vector<std::string> Names(const MoeNames& names) const;
  static LayerWeights FromAll(std::vector<at::Tensor> fields);
  // A layer of `experts` experts, every field undefined.
  static LayerWeights Shaped(size_t experts);
};

struct BaseWeights {
  at::Tensor embed_VD;
  at::Tensor final_norm_D;
  at::Tensor lm_head_VD;  // aliases embed_VD when embeddings are tied
  std::vector<LayerWeights> layers;

  // Every tensor by its Hugging Face name (lm_head.weight omitted when tied).
  std::map<std::string, at::Tensor> Named(const ModelConfig& config) const;
  // Whether every tensor is `other`'s very tensor (shared storage, not equal values), as the
  // policies of LoRA models on one base share it.
  bool Shares(const BaseWeights& other) const;
};

// Takes tensors out of `tensors` (HF names), checking every name and shape against the config.
// `holds` (expert parallelism): the experts this process holds; the others' tensors need not be
// there and are left undefined. Null: every expert.
absl::StatusOr<BaseWeights> BaseWeightsFromTensors(
    const ModelConfig& config, TensorMap tensors,
    const std::function<bool(int64_t expert)>& holds = nullptr);

struct PackedBatch {
  at::Tensor tokens_T;              // int64
  std::vector<int64_t> cu_seqlens;  // [S+1], cu_seqlens[0] = 0, cu_seqlens[S] = T
  // Router replay (mixtures of experts): each row's experts in every routed layer, int64
  // [T, R, k] (R: MoeConfig::RoutedLayers), used instead of the router's top-k. Undefined: every
  // row routes itself; so does a row of -1.
  at::Tensor routes_TRk = at::Tensor();
};

// Keys and values of one layer for every sequence of a batch, packed: cu_seqlens_k [S+1].
struct KvPacked {
  at::Tensor k_UKd, v_UKd;
  std::vector<int64_t> cu_seqlens_k;
};

// Keys and values of one layer when every sequence has one new token (a decode step): each
// sequence's [n, K, d] pieces in position order, read where they lie (kernels/decode_attention.h)
// instead of being packed, which would copy the whole cache per layer and step.
struct KvPieces {
  std::vector<std::vector<at::Tensor>> k, v;
  std::vector<int64_t> lengths;  // per sequence, its keys: the first rows of its pieces
};

// Decoder layers whose weights each rank holds in slices (--shard=full,
// runner/dist/param_shard.h): layer l's are gathered whole just before it runs, in the forward
// and again in its backward (such a layer is always recomputed), and dropped after it; their
// gradients leave through `scatter` (undefined fields and unreached weights undefined), not
// through the graph. Without `scatter` the weights are frozen (a sharded base under LoRA, whose
// pairs' gradients flow through the graph as usual). Both are collectives and throw when one
// fails.
struct LayerSource {
  std::function<LayerWeights(int64_t layer)> gather;
  std::function<void(int64_t layer, const LayerWeights& grads)> scatter;
};

// A forward that continues sequences whose earlier tokens' keys and values are cached (sampling:
// a prompt's prefill, then one token per decode step). Sequence s of the batch holds the tokens
// after its past[s] cached ones, so its positions start at past[s]. Before each layer's attention,
// `extend(layer, k_TKd, v_TKd)` stores the new tokens' keys (RoPE applied) and values and returns
// every sequence's keys and values, cached then new: packed, or in pieces when each sequence has
// one new token. Inference only: no graph is kept.
struct KvStep {
  std::vector<int64_t> past;
  std::function<std::variant<KvPacked, KvPieces>(int64_t layer, const at::Tensor& k_TKd,
                                                 const at::Tensor& v_TKd)>
      extend;
};

struct ForwardOptions {
  // Activation checkpointing per decoder layer (kernels/recompute.h): backward reruns each layer,
  // so activation memory is the residual stream plus one layer's intermediates.
  bool recompute_layers = false;
  // The activations' dtype; weights held in another (fp32 masters of a full fine-tune under
  // bf16 compute) are cast to it where they are used. Unset: the embedding's dtype.
  std::optional<at::ScalarType> compute_dtype;
  // The model's RoPE rows (in the compute dtype, on the weights' device); null builds the
  // micro-batch's tables on the host.
  RopeCache* rope = nullptr;
  // Set: attend to cached keys as well (see KvStep); recompute_layers is then ignored.
  const KvStep* kv = nullptr;
  // Set: the decoder layers' weights come from here, not from the BaseWeights' `layers`.
  const LayerSource* layers = nullptr;
  // Set: called with each routed layer's routed index and every row's experts there, [T, k]
  // int64 (what a sampler returns for router replay).
  std::function<void(int64_t routed, const at::Tensor& experts_Tk)> on_routes = nullptr;
  // Set: called in each routed layer's forward with its routed index, the router's probabilities
  // p_TE (fp32, fp64 in fp64 runs; in the graph when grad mode is on) and every row's experts
  // [T, k] (the router's auxiliary loss, runner/loss/router_aux.h). Unlike on_routes it is called
  // again when a recomputed layer reruns in the backward, with that rerun's p.
  std::function<void(int64_t routed, const at::Tensor& probs_TE, const at::Tensor& experts_Tk)>
      on_router = nullptr;
  // Set: where each routed layer's experts run (expert parallelism, runner/dist/expert_parallel.h:
  // a collective, so every rank runs its forwards in step); unset: here.
  kernels::SlotsFn expert_slots = nullptr;
  // Set (sampling where the experts are spread over ranks): decoder layer `layer`'s slots for
  // the rows of run `run` (Adapters::runs, in order; 0 without runs). Unlike expert_slots these
  // are not a collective every rank runs alike: this rank leads its group's exchanges
  // (runner/dist/expert_parallel.h), so a run of no rows may skip them.
  std::function<kernels::SlotsFn(int64_t layer, size_t run)> expert_slots_of = nullptr;
};

// The LoRA adapters a forward applies: one for every row (null: none, the base model or full
// fine-tuning), or one per run of consecutive token rows, so that policies sharing the base
// weights decode in one forward (a null adapter leaves its run unadapted) and the calls of
// several LoRA models train in one pass (each run's gradient reaches its own adapter alone).
// A run's rows round as they would with that adapter as `all` (kernels/linear.h).
struct Adapters {
  Adapters(const LoraAdapter* all = nullptr) : all(all) {}  // NOLINT(google-explicit-constructor)
  const LoraAdapter* all = nullptr;
  std::vector<std::pair<const LoraAdapter*, int64_t>> runs;  // (adapter, rows) in row order
};

// Hidden states [T, D] of the packed batch after the final norm: the input of the logprob head
// (kernels/logprob_head.h), which never forms the [T, V] logits.
at::Tensor ForwardHidden(const ModelConfig& config, const BaseWeights& weights,
                         const Adapters& lora, const PackedBatch& batch,
                         const ForwardOptions& options = {});

// Decoder layer `layer`'s experts (weights `L`, adapted by `lora` when set) as its routed MLP runs
// them: what a rank holding some of them runs for rows another rank routed to it. Keeps
// references to `c`, `L` and `lora`.
kernels::ExpertFn LayerExperts(const ModelConfig& c, const LayerWeights& L, const LoraAdapter* lora,
                               int64_t layer);

// The pair adapting the unembedding, or null.
const LoraPair* HeadAdapter(const LoraAdapter* lora);

}  // namespace tinkerd
