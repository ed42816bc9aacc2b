#include "kernels/routed_experts.h"

#include <c10/util/Exception.h>

namespace tinkerd::kernels {

Routing Route(const RouteParams& p) {
  TORCH_CHECK(p.logits_TE.dim() == 2, "Route: logits must be [T, E]");
  const int64_t E = p.logits_TE.size(1);
  TORCH_CHECK(p.top_k >= 1 && p.top_k <= E, "Route: top_k must be in [1, E]");
  const at::ScalarType wide = p.logits_TE.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const at::Tensor p_TE = at::softmax(p.logits_TE.to(wide), -1);
  Routing r;
  r.probs_TE = p_TE;
  at::Tensor w_Tk, e_Tk;  // by descending p
  std::tie(w_Tk, e_Tk) = at::topk(p_TE, p.top_k, -1, /*largest=*/true, /*sorted=*/true);
  if (p.experts_Tk.defined()) {
    TORCH_CHECK(p.experts_Tk.dim() == 2 && p.experts_Tk.size(0) == p.logits_TE.size(0) &&
                    p.experts_Tk.size(1) == p.top_k,
                "Route: replayed experts must be [T, top_k]");
    const at::Tensor replay_Tk = p.experts_Tk.to(p.logits_TE.device(), at::kLong);
    TORCH_CHECK(replay_Tk.numel() == 0 ||
                    (replay_Tk.min().item<int64_t>() >= -1 && replay_Tk.max().item<int64_t>() < E),
                "Route: a replayed expert is out of range");
    // p at the chosen experts, ordered as top-k orders them, so that the renormalizing sum adds
    // in the same order (a row that routes itself gets its top-k values back, bit for bit).
    const at::Tensor chosen_Tk =
        at::where((replay_Tk < 0).any(1, /*keepdim=*/true), e_Tk, replay_Tk);
    at::Tensor by_p_Tk;
    std::tie(w_Tk, by_p_Tk) =
        at::sort(p_TE.gather(1, chosen_Tk), /*stable=*/true, /*dim=*/1, /*descending=*/true);
    e_Tk = chosen_Tk.gather(1, by_p_Tk);
  }
  // Replayed experts the router gives no probability at all would divide 0 by 0; honest ones
  // never reach the floor (the sum is at least the largest p, ≥ 1/E).
  if (p.normalize) w_Tk = w_Tk / w_Tk.sum(-1, /*keepdim=*/true).clamp_min(1e-30);
  // A token's choices in ascending expert order: the order in which Hugging Face adds its
  // experts' outputs, and the order routes are returned and replayed in.
  at::Tensor by_expert_Tk;
  std::tie(r.experts_Tk, by_expert_Tk) = at::sort(e_Tk, /*stable=*/true, /*dim=*/1, false);
  w_Tk = w_Tk.gather(1, by_expert_Tk);
  r.weights_Tk = p.wide_weights ? w_Tk : w_Tk.to(p.logits_TE.scalar_type());

  const at::Tensor experts_S = r.experts_Tk.reshape({-1});
  const at::Tensor order_S = std::get<1>(at::sort(experts_S, /*stable=*/true, 0, false));
  r.order_S = order_S;
  r.inverse_S = at::empty_like(order_S);
  r.inverse_S.index_put_({order_S}, at::arange(order_S.numel(), order_S.options()));
  const at::Tensor rows_E = at::bincount(experts_S, {}, E).cpu();
  r.rows_E.assign(rows_E.data_ptr<int64_t>(), rows_E.data_ptr<int64_t>() + E);
  return r;
}

at::Tensor RunSlots(const at::Tensor& x_SD, const std::vector<int64_t>& rows_E,
                    const ExpertFn& expert, bool every_expert) {
  const std::vector<at::Tensor> x_ND = x_SD.split_with_sizes(rows_E);
  std::vector<at::Tensor> y_ND;
  for (size_t e = 0; e < rows_E.size(); ++e) {
    if (rows_E[e] > 0 || every_expert) y_ND.push_back(expert(static_cast<int64_t>(e), x_ND[e]));
  }
  // No rows: empty, and still in x's graph, so that a backward reaches whatever produced x_SD
  // (expert parallelism's exchange, which every rank's backward must run).
  if (y_ND.empty()) return x_SD * 0;
  return at::cat(y_ND);
}

at::Tensor RoutedExperts(const RoutedExpertsParams& p) {
  const Routing& r = *p.routing;
  const int64_t T = p.x_TD.size(0), D = p.x_TD.size(1), k = r.experts_Tk.size(1);
  TORCH_CHECK(r.experts_Tk.size(0) == T, "RoutedExperts: routing is for another batch");
  if (T == 0 && !p.slots) return at::zeros_like(p.x_TD);
  // Each token's row k times, then the slots in expert order: a permutation, so the backward's
  // index_add writes every row once (no colliding adds), and the sum over a token's k copies is
  // the expand's, in a fixed order.
  const at::Tensor x_SD =
      p.x_TD.unsqueeze(1).expand({T, k, D}).reshape({T * k, D}).index_select(0, r.order_S);
  const at::Tensor y_SD =
      p.slots ? p.slots(x_SD, r.rows_E, p.expert) : RunSlots(x_SD, r.rows_E, p.expert);
  const at::Tensor y_TkD = y_SD.index_select(0, r.inverse_S).view({T, k, D});
  const at::ScalarType dt = p.x_TD.scalar_type();
  // Choice by choice in ascending expert order, each product (in the weights' dtype) cast to x's
  // dtype before it is added, as Hugging Face's index_add into an x-typed sum does.
  at::Tensor out_TD = (y_TkD.select(1, 0) * r.weights_Tk.select(1, 0).unsqueeze(1)).to(dt);
  for (int64_t j = 1; j < k; ++j) {
    out_TD = out_TD + (y_TkD.select(1, j) * r.weights_Tk.select(1, j).unsqueeze(1)).to(dt);
  }
  return out_TD;
}

}  // namespace tinkerd::kernels
