// Routed experts, the sparse MLP of a mixture of experts, in Hugging Face's math:
//   p_TE = softmax(logits_TE)            in fp32 (fp64 for fp64 logits)
//   (w_Tk, e_Tk) = top-k of p per token, in descending order; w /= Σ_k w when `normalize`
//   y_t = Σ_j cast(w_tj · expert_{e_tj}(x_t)), j in ascending expert order
// with w cast to the logits' dtype first unless `wide_weights` (Qwen3-MoE casts, Mixtral not),
// computed by grouping, never as a dense [T, E, D] product: the T·k (token, choice) slots are
// sorted by expert, stably, so each expert's rows keep token order; each expert with rows runs
// once over exactly its rows (a split, so the backward is linear in the number of experts); the
// outputs return to their slots through the inverse permutation and are summed over a token's
// choices. Every step is a gather or a row-wise product, with no atomics, so a
// token's output depends on its own row and its experts only: on the CPU it is the same bits
// whatever else is in the batch wherever the experts' products are row-invariant
// (kernels/linear.h).
//
// The routing (choices, permutation, counts) is computed once, by Route, and the backward reuses
// it: autograd keeps the gathers' indices. Gradients reach the router through w; the choices
// themselves are a discrete function of the logits and pass none.
//
// Shape suffixes: T tokens, D hidden, E experts, k choices per token, S = T·k slots, N one
// expert's rows.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <vector>

namespace tinkerd::kernels {

struct RouteParams {
  at::Tensor logits_TE;
  int64_t top_k = 1;
  bool normalize = false;
  bool wide_weights = false;  // w kept in fp32 (fp64), as Mixtral keeps it
  // Defined: these choices [T, k] (int64, each in [0, E); a row holding a -1: that token's top-k)
  // are used instead of the top-k (router replay); w is then p at them.
  at::Tensor experts_Tk;
};

// A token's choices in ascending expert order.
struct Routing {
  at::Tensor probs_TE;          // p, in fp32 (fp64); differentiable in the logits
  at::Tensor weights_Tk;        // w (see wide_weights); differentiable in the logits
  at::Tensor experts_Tk;        // e, int64
  at::Tensor order_S;           // the slots t·k + j sorted by expert (stably)
  at::Tensor inverse_S;         // where slot t·k + j went in the sorted order
  std::vector<int64_t> rows_E;  // slots per expert (on the host)
};

Routing Route(const RouteParams& p);

// expert(e, x_ND) -> [N, D]: expert e on its rows (called only for experts with rows).
using ExpertFn = std::function<at::Tensor(int64_t expert, const at::Tensor& x_ND)>;

// The outputs [S, D] of the slots x_SD, sorted by expert (rows_E per expert), in that order.
// Unset: each expert with rows runs here, once, over them. Expert parallelism sends the rows to the
// ranks holding their experts and brings the outputs back (runner/dist/expert_parallel.h).
using SlotsFn = std::function<at::Tensor(const at::Tensor& x_SD, const std::vector<int64_t>& rows_E,
                                         const ExpertFn& expert)>;

struct RoutedExpertsParams {
  at::Tensor x_TD;
  const Routing* routing = nullptr;
  ExpertFn expert;
  SlotsFn slots;
};

at::Tensor RoutedExperts(const RoutedExpertsParams& p);

// SlotsFn's default: `expert` over each expert's rows of x_SD, here; with `every_expert`, also
// over none (so that the result is in every expert's graph whatever the routing).
at::Tensor RunSlots(const at::Tensor& x_SD, const std::vector<int64_t>& rows_E,
                    const ExpertFn& expert, bool every_expert = false);

}  // namespace tinkerd::kernels
