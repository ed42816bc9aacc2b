// The training step: forward/backward over packed micro-batches into staged gradients, and the
// optimizer step. Shape suffixes: T tokens of a micro-batch, K targets per token (top-K
// cross_entropy; targets and weights are [T] otherwise).
#include "runner/train_step.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "kernels/adamw.h"
#include "kernels/logprob_head.h"
#include "runner/call_memory.h"
#include "runner/dist/layer_prefetch.h"
#include "runner/loss/losses.h"
#include "runner/loss/router_aux.h"
#include "runner/packing/karmarkar_karp.h"
#include "runner/packing/micro_batch.h"
#include "runner/util/exception_status.h"
#include "runner/util/status_macros.h"
#include "runner/validate.h"

namespace tinkerd {
namespace {

const BaseWeights& WeightsOf(const StepContext& ctx, const ModelState& t) {
  return t.full ? *t.full : *ctx.base;
}

// Concatenates a float input of the micro-batch's datums into one [T] (or [T·K]) tensor.
at::Tensor GatherFloat(const std::vector<Datum>& data, const std::vector<int>& mb,
                       const std::string& key, const at::TensorOptions& to) {
  std::vector<float> v;
  for (int i : mb) {
    const auto& f = data[i].loss_fn_inputs.at(key).float32_data;
    v.insert(v.end(), f.begin(), f.end());
  }
  // copy=true: from_blob aliases `v`, which dies on return; .to() alone does not copy when the
  // device and dtype already match.
  return at::from_blob(v.data(), {static_cast<int64_t>(v.size())}, at::kFloat)
      .to(to, /*non_blocking=*/false, /*copy=*/true);
}

at::Tensor GatherInt(const std::vector<Datum>& data, const std::vector<int>& mb, bool targets,
                     at::Device device) {
  std::vector<int64_t> v;
  for (int i : mb) {
    const auto& src =
        targets ? data[i].loss_fn_inputs.at("target_tokens").int64_data : data[i].tokens;
    v.insert(v.end(), src.begin(), src.end());
  }
  return at::from_blob(v.data(), {static_cast<int64_t>(v.size())}, at::kLong)
      .to(device, at::kLong, /*non_blocking=*/false, /*copy=*/true);
}

// A failed collective (UNAVAILABLE) stays one through the exception (ThrowStatus).
template <typename T>
T OrThrow(absl::StatusOr<T> v) {
  if (!v.ok()) ThrowStatus(v.status());
  return *std::move(v);
}

void OrThrow(const absl::Status& st) {
  if (!st.ok()) ThrowStatus(st);
}

// The number of micro-batches every rank runs under --shard=full: the most any rank planned.
size_t AgreedMicroBatches(Collectives& c, size_t mine) {
  std::vector<int64_t> counts(c.world_size(), 0);
  counts[c.rank()] = static_cast<int64_t>(mine);
  OrThrow(c.AllReduceSumCounts(counts));
  return static_cast<size_t>(*std::max_element(counts.begin(), counts.end()));
}

}  // namespace

CallStage::CallStage(const StepContext& ctx, ModelState& model, ResolvedLoss loss, bool backward)
    : ctx_(ctx), model_(model), loss_(std::move(loss)), backward_(backward) {
  for (const auto& [name, p] : model_.params) {
    params_.push_back(p);
    if (backward_) staged_.emplace_back();  // undefined until a micro-batch reaches it
  }
}

absl::Status CallStage::RunIf(absl::Status local, const std::vector<Datum>& data) {
  if (InStep()) {
    bool ok = local.ok();
    RETURN_IF_ERROR(ctx_.collectives->AllAgree(ok));
    if (!ok && local.ok()) {
      return absl::AbortedError("the call failed on another rank; nothing was applied");
    }
  }
  if (!local.ok()) return local;
  try {
    Run(data);
  } catch (...) {
    return ExceptionStatus("forward_backward", std::current_exception());
  }
  return absl::OkStatus();
}

void CallStage::Run(const std::vector<Datum>& data) {
  for (std::vector<int>& mb : Plan(data)) RunPacked(Pack({Piece{this, std::move(mb)}}));
}

std::vector<std::vector<int>> CallStage::Plan(const std::vector<Datum>& data) {
  data_ = &data;
  std::vector<int64_t> lengths;
  for (const Datum& d : data) lengths.push_back(static_cast<int64_t>(d.tokens.size()));
  first_output_ = result_.outputs.size();
  result_.outputs.resize(first_output_ + data.size());
  // Top-K targets: every datum of a call has the same K (Batch::Check); K = 0 means [T].
  const int64_t K = TargetWidth(data.front());
  for (size_t i = 0; i < data.size(); ++i) {
    result_.outputs[first_output_ + i].logprobs_shape =
        K > 0 ? std::vector<int64_t>{lengths[i], K} : std::vector<int64_t>{lengths[i]};
  }
  // This rank's datums. A rank may get none; it still takes part in every collective (Commit).
  std::vector<int> mine(data.size());
  std::iota(mine.begin(), mine.end(), 0);
  Collectives& c = *ctx_.collectives;
  if (c.world_size() > 1) mine = KarmarkarKarpPartition(lengths, c.world_size())[c.rank()];
  std::vector<int64_t> mine_lengths;
  for (int i : mine) mine_lengths.push_back(lengths[i]);

  std::vector<std::vector<int>> plan = PlanMicroBatches(mine_lengths, ctx_.micro_batch_tokens);
  for (std::vector<int>& mb : plan) {
    for (int& j : mb) j = mine[j];  // positions in `mine` -> indices into `data`
  }
  // Under --shard=full each micro-batch gathers every unit (runner/dist/param_shard.h), and under
  // expert parallelism each routed layer exchanges tokens (runner/dist/expert_parallel.h): the
  // ranks run as many, the shorter padding with empty ones (one masked token: nothing counted, a
  // zero gradient).
  if (InStep()) plan.resize(AgreedMicroBatches(c, plan.size()));
  if (model_.sharded && backward_ && staged_C_.empty()) {
    // Made here, once every rank has agreed to run (RunIf), not before: a rank failing to make
    // them alone would leave the others waiting in a gather.
    for (const ShardedUnit& u : model_.sharded->units()) {
      staged_C_.push_back(at::zeros_like(u.param_C));
    }
  }
  return plan;
}

PackedPieces Pack(std::vector<Piece> pieces) {
  PackedPieces packed;
  const at::Device device = pieces.front().stage->ctx_.device;
  std::vector<int64_t> tokens;
  packed.batch.cu_seqlens = {0};
  for (const Piece& piece : pieces) {
    const std::vector<Datum>& data = *piece.stage->data_;
    int64_t rows = 0;
    for (int i : piece.mb) {
      tokens.insert(tokens.end(), data[i].tokens.begin(), data[i].tokens.end());
      rows += static_cast<int64_t>(data[i].tokens.size());
      packed.batch.cu_seqlens.push_back(packed.batch.cu_seqlens.back() +
                                        static_cast<int64_t>(data[i].tokens.size()));
    }
    if (piece.mb.empty()) {  // a pad micro-batch: one masked token 0
      tokens.push_back(0);
      rows = 1;
      packed.batch.cu_seqlens.push_back(packed.batch.cu_seqlens.back() + 1);
    }
    packed.rows.push_back(rows);
  }
  packed.batch.tokens_T =
      at::from_blob(tokens.data(), {static_cast<int64_t>(tokens.size())}, at::kLong)
          .to(device, at::kLong, /*non_blocking=*/false, /*copy=*/true);
  // Router replay: the rows' routed_experts, [T, R, k] in packed order, -1 for the rows of datums
  // without them (they route themselves); undefined when no datum has them.
  const MoeConfig& moe = pieces.front().stage->ctx_.config->moe;
  const int64_t width = moe.RoutedLayers() * moe.top_k;
  const auto rows = static_cast<int64_t>(tokens.size());
  std::vector<int64_t> routes;
  int64_t row = 0;
  for (const Piece& piece : pieces) {
    const std::vector<Datum>& data = *piece.stage->data_;
    for (int i : piece.mb) {
      const auto it = data[i].loss_fn_inputs.find("routed_experts");
      if (it != data[i].loss_fn_inputs.end()) {
        if (routes.empty()) routes.assign(static_cast<size_t>(rows * width), -1);
        std::copy(it->second.int64_data.begin(), it->second.int64_data.end(),
                  routes.begin() + row * width);
      }
      row += static_cast<int64_t>(data[i].tokens.size());
    }
    if (piece.mb.empty()) ++row;  // the pad token
  }
  if (!routes.empty()) {
    packed.batch.routes_TRk =
        at::from_blob(routes.data(), {rows, moe.RoutedLayers(), moe.top_k}, at::kLong)
            .to(device, at::kLong, /*non_blocking=*/false, /*copy=*/true);
  }
  if (pieces.size() == 1) {
    const ModelState& m = pieces.front().stage->model_;
    packed.adapters = Adapters(m.lora ? &*m.lora : nullptr);
  } else {
    for (size_t p = 0; p < pieces.size(); ++p) {
      const ModelState& m = pieces[p].stage->model_;
      TORCH_CHECK(m.lora.has_value() && !m.sharded, "a shared pass takes LoRA models only");
      packed.adapters.runs.emplace_back(&*m.lora, packed.rows[p]);
    }
  }
  packed.pieces = std::move(pieces);
  return packed;
}

// The router's auxiliary loss of a packed micro-batch (runner/loss/router_aux.h), when its call
// asks for it: a call's own passes only.
std::optional<RouterAux> RouterLoss(const PackedPieces& packed) {
  const CallStage& first = *packed.pieces.front().stage;
  for (const Piece& piece : packed.pieces) {
    TORCH_CHECK(packed.pieces.size() == 1 || piece.stage->loss().router_aux_loss_coef == 0,
                "the router's loss runs in a call's own passes");
  }
  const double coef = first.loss().router_aux_loss_coef;
  if (coef == 0) return std::nullopt;
  const MoeConfig& moe = first.context().config->moe;
  return RouterAux(coef, moe.num_experts, moe.RoutedLayers(), packed.batch.cu_seqlens);
}

// ---- TRAINING SECTION BEGIN: one packed micro-batch ----
void RunPacked(const PackedPieces& packed) {
  CallStage& first = *packed.pieces.front().stage;
  const StepContext& ctx = first.ctx_;
  const bool backward = first.backward_;
  Collectives& c = *ctx.collectives;
  std::optional<at::NoGradGuard> no_grad;
  if (!backward) no_grad.emplace();

  // Under --shard=full (a call alone) the rest of the model is gathered whole for the
  // micro-batch and each layer as it runs; their gradients are reduced into staged_C_ as the
  // backward makes them. A LoRA model's frozen base under --shard_base is gathered the same way,
  // and only its pairs' gradients are made.
  std::optional<BaseWeights> gathered;
  std::vector<at::Tensor> rest;
  LayerSource source;
  std::optional<LayerPrefetch> prefetch;
  ForwardOptions forward = ctx.forward;
  const ParamShard* shard = first.model_.sharded ? &*first.model_.sharded : nullptr;
  // The layers of `s` as they run: each gathered then, or the next one ahead on its own group.
  auto layers_of = [&](const ParamShard* s) {
    if (ctx.gathers == nullptr) {
      source.gather = [s, &c](int64_t l) { return OrThrow(s->GatherLayer(c, l)); };
      return;
    }
    prefetch.emplace([s, g = ctx.gathers](int64_t l) { return OrThrow(s->GatherLayer(*g, l)); },
                     LayerPrefetch::Schedule(ctx.config->num_hidden_layers, backward), ctx.device);
    source.gather = [&prefetch](int64_t l) { return prefetch->Take(l); };
  };
  if (shard == nullptr && ctx.base_shard != nullptr) {
    TORCH_CHECK(packed.pieces.size() == 1, "a call on a sharded base runs alone");
    const ParamShard* base = ctx.base_shard;
    layers_of(base);
    gathered = OrThrow(base->GatherRest(c));
    forward.layers = &source;
  }
  if (shard != nullptr) {
    TORCH_CHECK(packed.pieces.size() == 1, "a sharded model's call runs alone");
    layers_of(shard);
    gathered = OrThrow(shard->GatherRest(c));
    rest = shard->RestTensors(*gathered);
    for (at::Tensor& p : rest) p.requires_grad_(backward);
    source.scatter = [&first, shard, &c](int64_t l, const LayerWeights& grads) {
      OrThrow(shard->units()[1 + l].ReduceScatterInto(c, shard->LayerTensors(l, grads),
                                                      first.staged_C_[1 + l]));
    };
    forward.layers = &source;
  }
  // The router's loss, per datum; its gradient comes in through hooks on the routers' p.
  std::optional<RouterAux> aux = RouterLoss(packed);
  if (aux) forward.on_router = aux->observer();
  const BaseWeights& weights = gathered ? *gathered : WeightsOf(ctx, first.model_);
  const at::Tensor hidden_TD =
      ForwardHidden(*ctx.config, weights, packed.adapters, packed.batch, forward);

  // Each piece's loss from its own rows; one backward over their sum reaches each piece's
  // parameters from its own tokens alone (attention stays within a sequence, and a row's
  // adapter is its piece's).
  at::Tensor total;
  std::vector<at::Tensor> params;
  std::vector<size_t> from;  // per piece: where its parameters begin in `params`
  // split: its backward joins the pieces' gradients in one tensor (see kernels/linear.cc).
  const std::vector<at::Tensor> hidden = hidden_TD.split_with_sizes(packed.rows);
  for (size_t p = 0; p < packed.pieces.size(); ++p) {
    CallStage& stage = *packed.pieces[p].stage;
    bool valid = false;
    std::vector<double> weight_S;
    at::Tensor raw = stage.PieceLoss(packed.pieces[p].mb, hidden[p], weights, &valid, &weight_S);
    if (aux) {
      aux->SetWeights(std::move(weight_S));
      stage.aux_sum_ += aux->Value();
    }
    from.push_back(params.size());
    // In step, every rank runs every backward: its reductions and exchanges are collectives.
    if (!backward || !(valid || stage.InStep())) continue;
    total = total.defined() ? total + raw : raw;
    const std::vector<at::Tensor>& mine = shard != nullptr ? rest : stage.params_;
    params.insert(params.end(), mine.begin(), mine.end());
  }
  from.push_back(params.size());
  if (!total.defined()) return;
  std::vector<at::Tensor> grads =
      torch::autograd::grad({total}, params, /*grad_outputs=*/{}, /*retain_graph=*/false,
                            /*create_graph=*/false, /*allow_unused=*/true);
  if (shard != nullptr) {
    OrThrow(shard->units()[0].ReduceScatterInto(c, grads, first.staged_C_[0]));
    return;
  }
  for (size_t p = 0; p < packed.pieces.size(); ++p) {
    if (from[p] == from[p + 1]) continue;
    packed.pieces[p].stage->Stage(
        std::vector<at::Tensor>(grads.begin() + static_cast<std::ptrdiff_t>(from[p]),
                                grads.begin() + static_cast<std::ptrdiff_t>(from[p + 1])));
  }
}
// ---- TRAINING SECTION END ----

at::Tensor CallStage::PieceLoss(const std::vector<int>& mb, const at::Tensor& hidden_TD,
                                const BaseWeights& weights, bool* valid,
                                std::vector<double>* weight_S) {
  const std::vector<Datum>& data = *data_;
  // Loss inputs, masks and per-token losses are fp32 (fp64 in fp64 runs) whatever the compute
  // dtype: the logprob head returns them in that precision.
  const at::ScalarType dt = ctx_.compute_dtype == at::kDouble ? at::kDouble : at::kFloat;
  const at::TensorOptions on_device = at::TensorOptions().dtype(dt).device(ctx_.device);
  const std::string& mask_key = loss_.spec->implicit_mask_input;
  const bool seq_token_mean = model_.options.loss_reduction == LossReduction::kSeqMeanTokenMean;
  const int64_t K = TargetWidth(data.front());
  const int64_t per_token = std::max<int64_t>(K, 1);
  const bool pad = mb.empty();
  const at::Tensor one_token = at::zeros({1}, at::TensorOptions(at::kLong).device(ctx_.device));
  at::Tensor targets_T =
      pad ? one_token.repeat({per_token}) : GatherInt(data, mb, /*targets=*/true, ctx_.device);
  if (K > 0) targets_T = targets_T.view({-1, K});
  auto floats = [&](const std::string& key, int64_t per) {
    return pad ? at::zeros({per}, on_device) : GatherFloat(data, mb, key, on_device);
  };
  std::vector<int64_t> cu_seqlens{0};
  for (int i : mb) {
    cu_seqlens.push_back(cu_seqlens.back() + static_cast<int64_t>(data[i].tokens.size()));
  }
  if (pad) cu_seqlens.push_back(1);

  // Mask: explicit "mask" if given, else the loss's implicit input != 0 (DESIGN.md §3); a
  // position of top-K weights is valid when any of its K weights is.
  // scale is 1, or 1/N_i under seq_mean_token_mean, kept in double until cast to `dt`.
  std::vector<double> mask, scale;
  for (int i : mb) {
    const auto& in = data[i].loss_fn_inputs;
    const bool explicit_mask = in.count("mask") > 0;
    const auto& src = explicit_mask ? in.at("mask").float32_data : in.at(mask_key).float32_data;
    const size_t stride = explicit_mask ? 1 : static_cast<size_t>(per_token);
    std::vector<bool> v(src.size() / stride);
    for (size_t p = 0; p < src.size(); ++p) v[p / stride] = v[p / stride] || src[p] != 0;
    int64_t n_i = 0;
    for (bool b : v) n_i += b;
    valid_tokens_ += n_i;
    valid_sequences_ += (n_i > 0);
    *valid = *valid || n_i > 0;
    const double s = seq_token_mean && n_i > 0 ? 1.0 / static_cast<double>(n_i) : 1.0;
    weight_S->push_back(static_cast<double>(n_i) * s);
    for (bool b : v) {
      mask.push_back(b ? 1.0 : 0.0);
      scale.push_back(b ? s : 0.0);
    }
  }
  if (pad) {
    mask = scale = {0.0};
    *weight_S = {0.0};
  }
  const int64_t T = static_cast<int64_t>(mask.size());
  at::Tensor keep_T = at::from_blob(mask.data(), {T}, at::kDouble).ne(0).to(ctx_.device);
  at::Tensor scale_T = at::from_blob(scale.data(), {T}, at::kDouble)
                           .to(on_device, /*non_blocking=*/false, /*copy=*/true);

  const LoraAdapter* lora = model_.lora ? &*model_.lora : nullptr;
  kernels::LogprobHeadParams head;
  head.hidden_TD = hidden_TD;
  head.weight_VD = weights.lm_head_VD;
  if (const LoraPair* pair = HeadAdapter(lora)) {
    head.lora_A_rD = pair->A_rI;
    head.lora_B_Vr = pair->B_Or;
    head.lora_scale = lora->scale();
  }
  head.targets_T = targets_T;
  at::Tensor logp_T = kernels::TokenLogprobs(head).logp_T;
  LossTokenInputs li;
  li.logp_T = logp_T;
  if (loss_.spec->name == "cross_entropy") {
    li.weights_T = floats("weights", per_token);
    if (K > 0) li.weights_T = li.weights_T.view({-1, K});
  } else {
    li.logq_T = floats("logprobs", 1);
    li.adv_T = floats("advantages", 1);
  }
  if (loss_.spec->name == "gspo") {
    li.ratio_mask_T = floats("sequence_ratio_mask", 1);
    li.cu_seqlens = cu_seqlens;
  }
  LossTokenOutputs lo = PerTokenLoss(loss_.spec->name, li, loss_.config);
  // where(), not multiply: a masked token's loss may be inf/nan and must not leak through.
  at::Tensor raw = at::where(keep_T, lo.loss_T * scale_T, at::zeros_like(lo.loss_T)).sum();
  if (lo.clipped_T.defined()) {
    clipped_tokens_ += lo.clipped_T.logical_and(keep_T).sum().item<int64_t>();
  }
  loss_sum_ += raw.item<double>();
  if (pad) return raw;
  at::Tensor logp_f = logp_T.detach().to(at::kCPU, at::kFloat).contiguous();
  const float* lp = logp_f.data_ptr<float>();
  for (size_t j = 0; j < mb.size(); ++j) {
    result_.outputs[first_output_ + mb[j]].logprobs.assign(lp + cu_seqlens[j] * per_token,
                                                           lp + cu_seqlens[j + 1] * per_token);
    owned_.push_back(first_output_ + mb[j]);
  }
  return raw;
}

void CallStage::Stage(std::vector<at::Tensor> grads) {
  for (size_t k = 0; k < grads.size(); ++k) {
    if (!grads[k].defined()) continue;
    // The first gradient is kept, not added to zeros: a call holds one gradient-sized buffer
    // beside autograd's result, not two (a stride-0 expansion is copied: it cannot be added to).
    if (!staged_[k].defined()) {
      staged_[k] = grads[k].contiguous();
    } else {
      staged_[k].add_(grads[k]);
    }
  }
}

absl::StatusOr<ForwardBackwardResult> CallStage::Commit(const absl::Status& local) {
  Collectives& c = *ctx_.collectives;
  bool all_ok = local.ok();
  if (auto st = c.AllAgree(all_ok); !st.ok()) return st;
  if (!all_ok) {
    if (!local.ok()) return local;
    return absl::AbortedError("the call failed on another rank; nothing was applied");
  }
  std::vector<int64_t> counts{valid_tokens_, valid_sequences_, clipped_tokens_};
  if (auto st = c.AllReduceSumCounts(counts); !st.ok()) return st;
  std::vector<double> sums{loss_sum_, aux_sum_};
  if (auto st = c.AllReduceSumDoubles(sums); !st.ok()) return st;
  ForwardBackwardResult result = std::move(result_);
  if (c.world_size() > 1) {
    // Outputs back in datum order: each rank sends (index, length, logprobs) of its datums.
    std::string mine;
    for (size_t i : owned_) {
      const auto& lp = result.outputs[i].logprobs;
      const uint64_t head[2] = {i, lp.size()};
      mine.append(reinterpret_cast<const char*>(head), sizeof(head));
      mine.append(reinterpret_cast<const char*>(lp.data()), lp.size() * sizeof(float));
    }
    auto all = c.AllGatherBytes(mine);
    if (!all.ok()) return all.status();
    for (const std::string& part : *all) {
      size_t pos = 0;
      while (pos + 16 <= part.size()) {
        uint64_t head[2];
        std::memcpy(head, part.data() + pos, sizeof(head));
        pos += sizeof(head);
        auto& lp = result.outputs.at(head[0]).logprobs;
        lp.resize(head[1]);
        if (head[1] > 0) std::memcpy(lp.data(), part.data() + pos, head[1] * sizeof(float));
        pos += head[1] * sizeof(float);
      }
    }
  }
  result.metrics["loss:sum"] = sums[0];
  if (loss_.router_aux_loss_coef > 0) result.metrics["router_aux_loss:sum"] = sums[1];
  result.metrics["num_tokens:sum"] = static_cast<double>(counts[0]);
  result.metrics["num_sequences:sum"] = static_cast<double>(counts[1]);
  if (loss_.spec->config.count("clip_low_threshold")) {
    result.metrics["clip_fraction:mean"] =
        counts[0] > 0 ? static_cast<double>(counts[2]) / static_cast<double>(counts[0]) : 0.0;
  }
  if (backward_) {
    at::Tensor reduced_C;  // see Note [Reduce once, sharded] in runner/dist/shard.h
    if (model_.shard) RETURN_IF_ERROR(model_.shard->ReduceScatter(c, staged_, reduced_C));
    // The only place a call changes training state.
    at::NoGradGuard no_grad;
    if (model_.shard) model_.shard->grad_sum_C.add_(reduced_C);
    for (size_t u = 0; u < staged_C_.size(); ++u) {
      model_.sharded->units()[u].state.grad_sum_C.add_(staged_C_[u]);
    }
    size_t k = 0;
    for (auto& [name, g] : model_.grad_sum) {
      if (staged_[k].defined()) g.add_(staged_[k]);
      ++k;
    }
    model_.accumulated_tokens += counts[0];
    model_.accumulated_sequences += counts[1];
  }
  return result;
}

absl::StatusOr<Reservation> ReserveCall(const StepContext& ctx, const ModelState& model,
                                        const std::vector<Datum>& data, bool backward,
                                        bool staged_gradient) {
  if (ctx.account == nullptr) return Reservation();
  int64_t total = 0, longest = 0;
  for (const Datum& d : data) {
    total += static_cast<int64_t>(d.tokens.size());
    longest = std::max<int64_t>(longest, static_cast<int64_t>(d.tokens.size()));
  }
  CallShape call;
  // A sequence longer than the budget runs alone; otherwise micro-batches stay within it.
  call.tokens = std::max(longest, std::min(total, ctx.micro_batch_tokens));
  call.backward = backward;
  call.checkpointing = ctx.forward.recompute_layers;
  call.compute_bytes = static_cast<int64_t>(at::elementSize(ctx.compute_dtype));
  for (const auto& [name, p] : model.params) {
    if (staged_gradient) call.trainable_values += p.numel();
    call.train_bytes = static_cast<int64_t>(p.element_size());
  }
  if (model.sharded) {
    for (const ShardedUnit& u : model.sharded->units()) {
      if (staged_gradient) call.trainable_values += u.param_C.numel();
      call.train_bytes = static_cast<int64_t>(u.param_C.element_size());
    }
  }
  // The model's own units under --shard=full, or the base's under --shard_base.
  if (const ParamShard* gathered = model.sharded ? &*model.sharded : ctx.base_shard) {
    call.checkpointing = true;  // every gathered layer is recomputed
    call.gathered_values = gathered->GatheredValues(ctx.gathers != nullptr ? 2 : 1);
    call.gathered_bytes = static_cast<int64_t>(gathered->units().front().param_C.element_size());
    call.gathered_frozen = !model.sharded;
  }
  if (ctx.experts != nullptr) call.expert_group = ctx.experts->size();
  // A refusal is the call's result in its model's order, as any failure is.
  return ctx.account->Reserve(
      CallBytes(*ctx.config, call),
      absl::StrCat(backward ? "forward_backward" : "forward", ": a call of ", total,
                   " tokens (micro-batches of up to ", call.tokens, ")"),
      ". The call is refused and its seq_id used: send it again under a new seq_id once memory "
      "is free (a sample or another call ends), or send fewer tokens at once");
}

absl::StatusOr<ForwardBackwardResult> RunForward(const StepContext& ctx, ModelState& model,
                                                 const std::vector<Datum>& data,
                                                 const ResolvedLoss& loss, bool backward) {
  CallStage stage(ctx, model, loss, backward);
  // Refused memory is this rank's outcome: it still commits, so that every rank's collectives
  // line up and all of them refuse the call.
  absl::StatusOr<Reservation> memory = ReserveCall(ctx, model, data, backward);
  return stage.Commit(stage.RunIf(memory.status(), data));
}

namespace {

// After an optimizer step every replica must hold the same bits: the same reduced gradient was
// applied to the same parameters. The ranks compare the step, the skipped steps and, per trainable
// tensor, its float64 sum and sum of squares, written exactly (%a). A difference means a rank
// diverged (a fault, a nondeterministic kernel, another base model): UNAVAILABLE, as for a failed
// collective, so the server stops serving instead of training on with replicas that disagree.
// After a step (or a skipped one): the accumulators and counters start again from zero.
void ClearAccumulated(ModelState& t) {
  at::NoGradGuard no_grad;
  if (t.shard) t.shard->grad_sum_C.zero_();
  if (t.sharded) {
    for (ShardedUnit& u : t.sharded->units()) u.state.grad_sum_C.zero_();
  }
  for (auto& [name, g] : t.grad_sum) g.zero_();
  t.accumulated_tokens = 0;
  t.accumulated_sequences = 0;
}

// Under expert parallelism the replicated tensors are compared over the world and the experts'
// over the ranks holding them (`experts`: which of the two). See ClearAccumulated's comment.
absl::Status CompareAcrossRanks(const StepContext& ctx, const ModelState& t, bool experts) {
  Collectives* over = ctx.collectives;
  if (experts) over = ctx.experts != nullptr ? ctx.experts->replicas() : nullptr;
  if (over == nullptr || over->world_size() == 1) return absl::OkStatus();
  Collectives& c = *over;
  std::string digest = absl::StrCat(t.step, "/", t.skipped_steps);
  for (const auto& [name, p] : t.params) {
    if (IsHeldExpert(ctx, name) != experts) continue;
    const at::Tensor p64 = p.detach().to(at::kDouble);
    absl::StrAppend(&digest, absl::StrFormat(" %a,%a", p64.sum().item<double>(),
                                             p64.square().sum().item<double>()));
  }
  ASSIGN_OR_RETURN(std::vector<std::string> all, c.AllGatherBytes(digest));
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] != all[0]) {
      return absl::UnavailableError(absl::StrCat("optim_step: the ranks diverged: after step ",
                                                 t.step, " of model ", t.id, ", rank ", r,
                                                 "'s trainable parameters differ from rank 0's"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

bool IsHeldExpert(const StepContext& ctx, const std::string& name) {
  return ctx.experts != nullptr && ExpertParallel::ExpertOf(name) >= 0;
}

absl::Status ReduceGradients(const StepContext& ctx, const std::map<std::string, at::Tensor>& names,
                             std::vector<at::Tensor>& grads) {
  std::vector<at::Tensor> replicated, held;  // the same tensors as `grads`, reduced in place
  size_t i = 0;
  for (const auto& [name, g] : names) {
    (IsHeldExpert(ctx, name) ? held : replicated).push_back(grads[i++]);
  }
  RETURN_IF_ERROR(ctx.collectives->AllReduceSumGradients(replicated));
  if (Collectives* same = ctx.experts != nullptr ? ctx.experts->replicas() : nullptr) {
    RETURN_IF_ERROR(same->AllReduceSumGradients(held));
  }
  return absl::OkStatus();
}

absl::StatusOr<PreparedStep> PrepareOptimStep(const StepContext& ctx, ModelState& t,
                                              const AdamParams& p) {
  if (auto st = ValidateAdamParams(p); !st.ok()) return st;
  PreparedStep prepared;
  prepared.model = &t;
  double denominator = 1.0;
  switch (t.options.loss_reduction) {
    case LossReduction::kTokenMean:
      denominator = static_cast<double>(t.accumulated_tokens);
      break;
    case LossReduction::kSum:
      denominator = 1.0;
      break;
    case LossReduction::kSeqMeanTokenMean:
    case LossReduction::kSeqMeanTokenSum:
      denominator = static_cast<double>(t.accumulated_sequences);
      break;
  }
  at::NoGradGuard no_grad;
  // The step's transient, reserved before anything changes: a copy of the gradients (or of this
  // rank's shard of them), AdamW's denominator (kernels/adamw.cc: as large again, allocated after
  // the moments have moved, so it must not fail then) and, one tensor at a time, a float64 square
  // for the norm. Only in a world of one: a rank refusing alone would leave the others waiting in
  // the collectives below.
  Reservation& memory = prepared.memory;
  if (ctx.account != nullptr && ctx.collectives->world_size() == 1) {
    int64_t copy = 0, largest = 0;
    for (const auto& [name, g] : t.grad_sum) {
      copy += g.numel() * static_cast<int64_t>(g.element_size());
      largest = std::max<int64_t>(largest, g.numel());
    }
    if (t.shard) copy = t.shard->grad_sum_C.numel() * t.shard->grad_sum_C.element_size();
    if (t.sharded) {
      for (const ShardedUnit& u : t.sharded->units()) {
        copy += u.param_C.numel() * u.param_C.element_size();
        largest = std::max<int64_t>(largest, u.param_C.numel());
      }
    }
    ASSIGN_OR_RETURN(memory,
                     ctx.account->Reserve(2 * copy + 2 * largest * int64_t{sizeof(double)},
                                          "optim_step: its copy of the gradients",
                                          ". Nothing changed: send optim_step again (under a new "
                                          "seq_id) once memory is free (a sample or a call ends)"));
  }
  // The whole gradients, or under --shard=optimizer this rank's slices of them (views of one
  // copy of its shard, cut at the tensors' boundaries).
  std::vector<at::Tensor> grads;
  if (t.shard) {
    grads = t.shard->Cut(t.shard->grad_sum_C.clone());
  } else if (t.sharded) {
    for (const ShardedUnit& u : t.sharded->units()) {
      for (at::Tensor& g : u.state.Cut(u.state.grad_sum_C.clone())) grads.push_back(std::move(g));
    }
  } else {
    for (auto& [name, g] : t.grad_sum) grads.push_back(g.clone());
    RETURN_IF_ERROR(ReduceGradients(ctx, t.grad_sum, grads));
  }
  // With nothing valid accumulated the step is still taken, with a zero gradient, as Tinker does:
  // 0/0 is 0 (every accumulator is exactly 0 then, since masked tokens add nothing), and AdamW's
  // moments decay and weight decay applies as torch's AdamW would with a zero gradient.
  if (!grads.empty()) at::_foreach_mul_(grads, denominator > 0 ? 1.0 / denominator : 0.0);
  // One host sync for the norm, not one per parameter; the squares summed in float64 and the
  // parameters added in their order, as a loop over them would. Shards add their partial sums.
  // Under expert parallelism the experts' squares (`held`) are summed over the group, each
  // expert's once.
  std::vector<at::Tensor> squares;
  for (const at::Tensor& g : grads) squares.push_back(g.to(at::kDouble).pow(2).sum());
  std::vector<double> sq{0.0}, held{0.0};
  if (!squares.empty()) {
    const at::Tensor squares_P = at::stack(squares).cpu();
    // Under expert parallelism grads are t.params' (no --shard goes with it).
    std::vector<bool> expert(static_cast<size_t>(squares_P.size(0)), false);
    if (ctx.experts != nullptr) {
      size_t i = 0;
      for (const auto& [name, p] : t.params) expert[i++] = IsHeldExpert(ctx, name);
    }
    for (int64_t i = 0; i < squares_P.size(0); ++i) {
      (expert[static_cast<size_t>(i)] ? held : sq)[0] += squares_P.data_ptr<double>()[i];
    }
  }
  if (t.shard || t.sharded) RETURN_IF_ERROR(ctx.collectives->AllReduceSumDoubles(sq));
  if (ctx.experts != nullptr) {
    RETURN_IF_ERROR(ctx.experts->group().AllReduceSumDoubles(held));
    sq[0] += held[0];
  }
  OptimStepResult& r = prepared.result;
  r.grad_norm = std::sqrt(sq[0]);
  r.learning_rate = p.learning_rate;
  r.denominator = denominator;
  r.num_tokens = t.accumulated_tokens;
  r.num_sequences = t.accumulated_sequences;
  if (!std::isfinite(r.grad_norm)) {
    // Every rank sees the same reduced norm, so every rank skips alike.
    ClearAccumulated(t);
    ++t.skipped_steps;
    r.skipped = true;
    r.step = t.step;
    return prepared;
  }
  double coef = 1.0;
  if (p.grad_clip_norm > 0) {
    coef = std::min(1.0, p.grad_clip_norm / (r.grad_norm + 1e-6));
    r.clipped = coef < 1.0;
  }
  const int64_t step = t.step + 1;
  if (coef != 1.0 && !grads.empty()) at::_foreach_mul_(grads, coef);
  kernels::AdamWParams& adam = prepared.adam;
  adam.grads = std::move(grads);
  std::vector<at::Tensor>& params = prepared.params;
  for (auto& [name, param] : t.params) params.push_back(param);
  if (t.shard) {
    // Each rank steps its slice of the parameters in place, then the slices are exchanged.
    adam.params = t.shard->Views(params);
    adam.exp_avgs = t.shard->Cut(t.shard->exp_avg_C);
    adam.exp_avg_sqs = t.shard->Cut(t.shard->exp_avg_sq_C);
  } else if (t.sharded) {
    // Each rank steps its slices and keeps them: a layer is gathered again when it next runs.
    for (const ShardedUnit& u : t.sharded->units()) {
      for (const at::Tensor& v : u.state.Cut(u.param_C)) adam.params.push_back(v);
      for (const at::Tensor& v : u.state.Cut(u.state.exp_avg_C)) adam.exp_avgs.push_back(v);
      for (const at::Tensor& v : u.state.Cut(u.state.exp_avg_sq_C)) adam.exp_avg_sqs.push_back(v);
    }
  } else {
    adam.params = params;
    for (auto& [name, param] : t.params) {
      adam.exp_avgs.push_back(t.exp_avg[name]);
      adam.exp_avg_sqs.push_back(t.exp_avg_sq[name]);
    }
  }
  adam.lr = p.learning_rate;
  adam.beta1 = p.beta1;
  adam.beta2 = p.beta2;
  adam.eps = p.eps;
  adam.weight_decay = p.weight_decay;
  adam.step = step;
  return prepared;
}

absl::StatusOr<OptimStepResult> FinishOptimStep(const StepContext& ctx, PreparedStep& prepared) {
  ModelState& t = *prepared.model;
  OptimStepResult r = prepared.result;
  if (r.skipped) return r;
  if (t.shard) RETURN_IF_ERROR(t.shard->AllGather(*ctx.collectives, prepared.params));
  ClearAccumulated(t);
  t.step = prepared.adam.step;
  r.step = t.step;
  RETURN_IF_ERROR(CompareAcrossRanks(ctx, t, /*experts=*/false));
  RETURN_IF_ERROR(CompareAcrossRanks(ctx, t, /*experts=*/true));
  return r;
}

absl::StatusOr<OptimStepResult> ApplyOptimStep(const StepContext& ctx, ModelState& t,
                                               const AdamParams& p) {
  ASSIGN_OR_RETURN(PreparedStep prepared, PrepareOptimStep(ctx, t, p));
  at::NoGradGuard no_grad;
  if (!prepared.result.skipped) kernels::AdamW(prepared.adam);
  return FinishOptimStep(ctx, prepared);
}

}  // namespace tinkerd
