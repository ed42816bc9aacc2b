// The training step: forward/backward over packed micro-batches into staged gradients, and the
// optimizer step. Shape suffixes: T tokens of a micro-batch, V vocab.
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <cmath>
#include <stdexcept>

#include "absl/strings/str_cat.h"
#include "runner/loss/losses.h"
#include "runner/optim/adamw.h"
#include "runner/packing/micro_batch.h"
#include "runner/tenant.h"

namespace tinkerd {
namespace {

const BaseWeights& WeightsOf(const StepContext& ctx, const Tenant& t) {
  return t.full ? *t.full : *ctx.base;
}

// Concatenates a float input of the micro-batch's datums into one [T] tensor.
at::Tensor GatherFloat(const std::vector<Datum>& data, const std::vector<int>& mb,
                       const std::string& key, at::ScalarType dtype) {
  std::vector<float> v;
  for (int i : mb) {
    const auto& f = data[i].loss_fn_inputs.at(key).float32_data;
    v.insert(v.end(), f.begin(), f.end());
  }
  // copy=true: from_blob aliases `v`, which dies on return; .to() alone does not copy when the
  // dtype already matches.
  return at::from_blob(v.data(), {static_cast<int64_t>(v.size())}, at::kFloat)
      .to(dtype, /*non_blocking=*/false, /*copy=*/true);
}

at::Tensor GatherInt(const std::vector<Datum>& data, const std::vector<int>& mb, bool targets) {
  std::vector<int64_t> v;
  for (int i : mb) {
    const auto& src = targets ? data[i].loss_fn_inputs.at("target_tokens").int64_data : data[i].tokens;
    v.insert(v.end(), src.begin(), src.end());
  }
  return at::from_blob(v.data(), {static_cast<int64_t>(v.size())}, at::kLong).clone();
}

}  // namespace

absl::StatusOr<ForwardBackwardResult> RunForward(const StepContext& ctx, Tenant& tenant,
                                                 const std::vector<Datum>& data,
                                                 const ResolvedLoss& loss, bool backward) {
  const at::ScalarType dt = ctx.compute_dtype;
  const std::string& mask_key = loss.spec->implicit_mask_input;
  const bool seq_token_mean =
      tenant.options.loss_reduction == LossReduction::kSeqMeanTokenMean;
  std::vector<std::string> names;
  std::vector<at::Tensor> params;
  for (const auto& [n, p] : tenant.params) {
    names.push_back(n);
    params.push_back(p);
  }
  std::vector<at::Tensor> staged;  // this call's gradient; committed only at the end
  if (backward) {
    for (const at::Tensor& p : params) staged.push_back(at::zeros_like(p));
  }

  std::vector<int64_t> lengths;
  for (const Datum& d : data) lengths.push_back(static_cast<int64_t>(d.tokens.size()));
  ForwardBackwardResult result;
  result.outputs.resize(data.size());
  double loss_sum = 0;
  int64_t valid_tokens = 0, valid_sequences = 0, clipped_tokens = 0;

  // ---- TRAINING SECTION BEGIN: one packed micro-batch per iteration ----
  int mb_index = 0;
  for (const std::vector<int>& mb : PlanMicroBatches(lengths, ctx.micro_batch_tokens)) {
    if (ctx.test_hooks && ctx.test_hooks->fail_at_micro_batch == mb_index++) {
      ctx.test_hooks->fail_at_micro_batch = -1;
      throw std::runtime_error("injected fault (test hook)");
    }
    std::optional<at::NoGradGuard> no_grad;
    if (!backward) no_grad.emplace();
    PackedBatch batch{GatherInt(data, mb, /*targets=*/false), {0}};
    for (int i : mb) batch.cu_seqlens.push_back(batch.cu_seqlens.back() + lengths[i]);
    at::Tensor targets_T = GatherInt(data, mb, /*targets=*/true);

    // Mask: explicit "mask" if given, else the loss's implicit input != 0 (DESIGN.md §3).
    // scale is 1, or 1/N_i under seq_mean_token_mean, kept in double until cast to `dt`.
    std::vector<double> mask, scale;
    for (int i : mb) {
      const auto& in = data[i].loss_fn_inputs;
      const auto& src = in.count("mask") ? in.at("mask").float32_data : in.at(mask_key).float32_data;
      int64_t n_i = 0;
      for (float v : src) n_i += (v != 0.0f);
      valid_tokens += n_i;
      valid_sequences += (n_i > 0);
      const double s = seq_token_mean && n_i > 0 ? 1.0 / static_cast<double>(n_i) : 1.0;
      for (float v : src) {
        mask.push_back(v != 0.0f ? 1.0 : 0.0);
        scale.push_back(v != 0.0f ? s : 0.0);
      }
    }
    const int64_t T = static_cast<int64_t>(mask.size());
    at::Tensor keep_T = at::from_blob(mask.data(), {T}, at::kDouble).ne(0);
    at::Tensor scale_T =
        at::from_blob(scale.data(), {T}, at::kDouble).to(dt, /*non_blocking=*/false, /*copy=*/true);

    at::Tensor logits_TV = ForwardLogits(*ctx.config, WeightsOf(ctx, tenant),
                                         tenant.lora ? &*tenant.lora : nullptr, batch);
    at::Tensor logp_T = logits_TV.gather(1, targets_T.unsqueeze(1)).squeeze(1) -
                        at::logsumexp(logits_TV, 1);
    LossTokenInputs li{logp_T, {}, {}, {}};
    if (loss.spec->name == "cross_entropy") {
      li.weights_T = GatherFloat(data, mb, "weights", dt);
    } else {
      li.logq_T = GatherFloat(data, mb, "logprobs", dt);
      li.adv_T = GatherFloat(data, mb, "advantages", dt);
    }
    LossTokenOutputs lo = PerTokenLoss(loss.spec->name, li, loss.config);
    // where(), not multiply: a masked token's loss may be inf/nan and must not leak through.
    at::Tensor raw = at::where(keep_T, lo.loss_T * scale_T, at::zeros_like(lo.loss_T)).sum();
    if (lo.clipped_T.defined()) clipped_tokens += lo.clipped_T.logical_and(keep_T).sum().item<int64_t>();

    if (backward && keep_T.any().item<bool>()) {
      std::vector<at::Tensor> grads =
          torch::autograd::grad({raw}, params, /*grad_outputs=*/{}, /*retain_graph=*/false,
                                /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t k = 0; k < grads.size(); ++k) {
        if (grads[k].defined()) staged[k].add_(grads[k]);
      }
    }
    loss_sum += raw.item<double>();
    at::Tensor logp_f = logp_T.detach().to(at::kFloat).contiguous();
    const float* lp = logp_f.data_ptr<float>();
    for (size_t j = 0; j < mb.size(); ++j) {
      const int i = mb[j];
      result.outputs[i].logprobs.assign(lp + batch.cu_seqlens[j], lp + batch.cu_seqlens[j + 1]);
    }
  }
  // ---- TRAINING SECTION END ----

  std::vector<int64_t> counts{valid_tokens, valid_sequences};
  if (auto st = ctx.collectives->AllReduceSumCounts(counts); !st.ok()) return st;
  result.metrics["loss:sum"] = loss_sum;
  result.metrics["num_tokens:sum"] = static_cast<double>(counts[0]);
  result.metrics["num_sequences:sum"] = static_cast<double>(counts[1]);
  if (loss.spec->config.count("clip_low_threshold")) {
    result.metrics["clip_fraction:mean"] =
        valid_tokens > 0 ? static_cast<double>(clipped_tokens) / valid_tokens : 0.0;
  }
  if (backward) {
    // Commit: the only place a call changes training state.
    at::NoGradGuard no_grad;
    for (size_t k = 0; k < names.size(); ++k) tenant.grad_sum[names[k]].add_(staged[k]);
    tenant.accumulated_tokens += counts[0];
    tenant.accumulated_sequences += counts[1];
  }
  return result;
}

absl::StatusOr<OptimStepResult> ApplyOptimStep(const StepContext& ctx, Tenant& t,
                                               const AdamParams& p) {
  if (auto st = ValidateAdamParams(p); !st.ok()) return st;
  if (t.accumulated_tokens == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        "optim_step: model ", t.id,
        " has no accumulated valid tokens; call forward_backward with unmasked tokens first"));
  }
  double denominator = 1.0;
  switch (t.options.loss_reduction) {
    case LossReduction::kTokenMean: denominator = static_cast<double>(t.accumulated_tokens); break;
    case LossReduction::kSum: denominator = 1.0; break;
    case LossReduction::kSeqMeanTokenMean:
    case LossReduction::kSeqMeanTokenSum:
      denominator = static_cast<double>(t.accumulated_sequences);
      break;
  }
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (auto& [name, g] : t.grad_sum) grads.push_back(g.clone());
  // See Note [Reduce once] in runner/dist/collectives.h.
  if (auto st = ctx.collectives->AllReduceSumGradients(grads); !st.ok()) return st;
  double sq = 0;
  for (at::Tensor& g : grads) {
    g.mul_(1.0 / denominator);
    sq += g.to(at::kDouble).pow(2).sum().item<double>();
  }
  OptimStepResult r;
  r.grad_norm = std::sqrt(sq);
  r.learning_rate = p.learning_rate;
  r.denominator = denominator;
  r.num_tokens = t.accumulated_tokens;
  r.num_sequences = t.accumulated_sequences;
  auto clear = [&] {
    for (auto& [name, g] : t.grad_sum) g.zero_();
    t.accumulated_tokens = 0;
    t.accumulated_sequences = 0;
  };
  if (!std::isfinite(r.grad_norm)) {
    // Every rank sees the same reduced norm, so every rank skips alike.
    clear();
    ++t.skipped_steps;
    r.skipped = true;
    r.step = t.step;
    return r;
  }
  double coef = 1.0;
  if (p.grad_clip_norm > 0) {
    coef = std::min(1.0, p.grad_clip_norm / (r.grad_norm + 1e-6));
    r.clipped = coef < 1.0;
  }
  const int64_t step = t.step + 1;
  size_t k = 0;
  for (auto& [name, param] : t.params) {
    at::Tensor& g = grads[k++];
    if (coef != 1.0) g.mul_(coef);
    AdamWUpdate(p, step, g, param, t.exp_avg[name], t.exp_avg_sq[name]);
  }
  clear();
  t.step = step;
  r.step = step;
  return r;
}

}  // namespace tinkerd
