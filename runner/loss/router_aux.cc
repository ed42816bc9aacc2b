#include "runner/loss/router_aux.h"

#include <c10/util/Exception.h>

#include <mutex>

namespace tinkerd {

struct RouterAux::Counts {
  double coef = 0;
  int64_t experts = 0, layers = 0;
  std::vector<int64_t> cu_seqlens;
  std::vector<bool> seen;  // per routed layer: counted
  // On the probabilities' device, made at the first Observe: each row's sequence, and per
  // sequence and expert the picks c and the summed probabilities P (float64) over the layers seen.
  at::Tensor sequence_T, c_SE, P_SE;
  std::vector<double> weight_S;
  std::once_flag made;
  at::Tensor grad_TE;  // ∂/∂p for every row, made at the first hook

  int64_t Sequences() const { return static_cast<int64_t>(cu_seqlens.size()) - 1; }

  // α·M_s·E/(L·T_s)² per sequence: the gradient is scale_S·c_SE, the value Σ scale_S·(c·P)_S.
  at::Tensor Scale_S() const {
    TORCH_CHECK(static_cast<int64_t>(weight_S.size()) == Sequences(),
                "RouterAux: the sequences' weights are not set");
    std::vector<double> scale;
    for (int64_t s = 0; s < Sequences(); ++s) {
      const auto n = static_cast<double>(layers * (cu_seqlens[s + 1] - cu_seqlens[s]));
      scale.push_back(coef * weight_S[static_cast<size_t>(s)] * static_cast<double>(experts) /
                      (n * n));
    }
    return at::tensor(scale, at::kDouble).to(c_SE.device());
  }

  const at::Tensor& Gradient(const at::Tensor& like_TE) {
    std::call_once(made, [&] {
      grad_TE = (c_SE * Scale_S().unsqueeze(1)).index_select(0, sequence_T).to(like_TE.dtype());
    });
    return grad_TE;
  }
};

RouterAux::RouterAux(double coef, int64_t experts, int64_t routed_layers,
                     std::vector<int64_t> cu_seqlens)
    : counts_(std::make_shared<Counts>()) {
  Counts& c = *counts_;
  c.coef = coef;
  c.experts = experts;
  c.layers = routed_layers;
  c.cu_seqlens = std::move(cu_seqlens);
  c.seen.assign(static_cast<size_t>(routed_layers), false);
}

RouterAux::Observer RouterAux::observer() const {
  return
      [counts = counts_](int64_t routed, const at::Tensor& probs_TE, const at::Tensor& experts_Tk) {
        ObserveInto(counts, routed, probs_TE, experts_Tk);
      };
}

void RouterAux::ObserveInto(const std::shared_ptr<Counts>& counts, int64_t routed,
                            const at::Tensor& probs_TE, const at::Tensor& experts_Tk) {
  Counts& c = *counts;
  if (!c.sequence_T.defined()) {
    std::vector<int64_t> lengths;
    for (int64_t s = 0; s < c.Sequences(); ++s)
      lengths.push_back(c.cu_seqlens[s + 1] - c.cu_seqlens[s]);
    const at::TensorOptions on = probs_TE.options();
    c.sequence_T = at::repeat_interleave(at::arange(c.Sequences(), on.dtype(at::kLong)),
                                         at::tensor(lengths, on.dtype(at::kLong)));
    c.c_SE = at::zeros({c.Sequences(), c.experts}, on.dtype(at::kDouble));
    c.P_SE = at::zeros({c.Sequences(), c.experts}, on.dtype(at::kDouble));
  }
  if (!c.seen.at(static_cast<size_t>(routed))) {
    c.seen[static_cast<size_t>(routed)] = true;
    // Row by row in order on the CPU, so each datum's sums are its rows' alone, in position
    // order: what shares the micro-batch changes nothing. (On CUDA the order of P's additions,
    // which reach the reported value only, is the device's; c counts exactly either way.)
    c.P_SE.index_add_(0, c.sequence_T, probs_TE.detach().to(at::kDouble));
    const int64_t k = experts_Tk.size(1);
    c.c_SE.index_put_(
        {c.sequence_T.unsqueeze(1).expand({-1, k}).reshape({-1}), experts_Tk.reshape({-1})},
        at::ones({experts_Tk.numel()}, c.c_SE.options()), /*accumulate=*/true);
  }
  if (probs_TE.requires_grad()) {
    probs_TE.register_hook([counts](const at::Tensor& grad_TE) -> at::Tensor {
      if (!grad_TE.defined()) return grad_TE;
      return grad_TE + counts->Gradient(grad_TE);
    });
  }
}

void RouterAux::SetWeights(std::vector<double> weight_S) {
  TORCH_CHECK(static_cast<int64_t>(weight_S.size()) == counts_->Sequences(),
              "RouterAux: one weight per sequence");
  counts_->weight_S = std::move(weight_S);
}

double RouterAux::Value() const {
  const Counts& c = *counts_;
  for (bool seen : c.seen) TORCH_CHECK(seen, "RouterAux: a routed layer was not observed");
  return (c.Scale_S() * (c.c_SE * c.P_SE).sum(1)).sum().item<double>();
}

}  // namespace tinkerd
