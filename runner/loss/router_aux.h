// The router's auxiliary load-balancing loss of a mixture of experts (loss_fn_config
// "router_aux_loss_coef" = α > 0), counted per datum so that it is exact under any split:
// Hugging Face's load_balancing_loss_func applied to one datum's tokens alone,
//   aux_d = E · Σ_e f_de · P_de,   f_de = c_de / (L·T_d),   P_de = Σ_l Σ_t p^l_te / (L·T_d),
// over the datum's T_d tokens and the model's L routed layers, c_de counting the (token, layer,
// choice) slots that went to expert e (the experts used: a replayed route counts as replayed) and
// p^l_t the router's softmax. α·aux_d is added to the loss of each of the datum's valid tokens, so
// it enters with the datum's weight M_d = Σ_t m_t·s_t (N_d, or 1 under seq_mean_token_mean) and
// is normalized with the token losses at optim_step. Hugging Face computes the same over the
// whole batch; a batch-wide f·P is a product of sums that no split into calls can add up.
//
// f is a count and passes no gradient, so ∂(α·M_d·aux_d)/∂p^l_te = α·M_d·E·c_de/(L·T_d)², which
// needs every layer's counts: a hook on each layer's p adds it in the backward, after the forward
// has counted them all (and again on a recomputed layer's rerun, which counts nothing twice).
//
// Shape suffixes: T tokens of the packed micro-batch, E experts, k choices, S its sequences.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace tinkerd {

class RouterAux {
 public:
  // One micro-batch: its sequences (one per datum) by cu_seqlens [S+1].
  RouterAux(double coef, int64_t experts, int64_t routed_layers, std::vector<int64_t> cu_seqlens);

  using Observer =
      std::function<void(int64_t routed, const at::Tensor& probs_TE, const at::Tensor& experts_Tk)>;
  // What ForwardOptions::on_router calls; it may outlive this.
  Observer observer() const;
  void Observe(int64_t routed, const at::Tensor& probs_TE, const at::Tensor& experts_Tk) {
    observer()(routed, probs_TE, experts_Tk);
  }
  // Each sequence's M_d, known once the loss has read its masks; before the backward.
  void SetWeights(std::vector<double> weight_S);
  // Σ_d α·M_d·aux_d, the term whose gradient the backward adds; after the forward.
  double Value() const;

 private:
  struct Counts;
  static void ObserveInto(const std::shared_ptr<Counts>& counts, int64_t routed,
                          const at::Tensor& probs_TE, const at::Tensor& experts_Tk);
  std::shared_ptr<Counts> counts_;  // shared with the observer and the hooks
};

}  // namespace tinkerd
