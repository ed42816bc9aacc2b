#include "kernels/recompute.h"

#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <memory>
#include <string>
#include <utility>

namespace tinkerd::kernels {
namespace {

using torch::autograd::variable_list;

// The backward node of one checkpointed call. Its next edges are x's, then each param's; it holds
// x detached (no reference into the graph below it) and reruns fn under grad mode.
class RecomputeNode : public torch::autograd::Node {
 public:
  RecomputeNode(LayerFn fn, at::Tensor x, std::vector<at::Tensor> params)
      : fn_(std::move(fn)),
        x_(x.detach()),
        x_needs_grad_(x.requires_grad()),
        params_(std::move(params)) {}

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(x_.defined(), "recompute: backward ran twice through a checkpointed layer");
    at::AutoGradMode grad_on(true);
    const at::Tensor x = x_.detach().requires_grad_(x_needs_grad_);
    const at::Tensor y = fn_(x);
    variable_list wrt;
    if (x_needs_grad_) wrt.push_back(x);
    for (const at::Tensor& p : params_) {
      if (p.requires_grad()) wrt.push_back(p);
    }
    const variable_list g = torch::autograd::grad({y}, wrt, {grads[0]}, /*retain_graph=*/false,
                                                  /*create_graph=*/false, /*allow_unused=*/true);
    variable_list out;
    size_t k = 0;
    out.push_back(x_needs_grad_ ? g[k++] : at::Tensor());
    for (const at::Tensor& p : params_) out.push_back(p.requires_grad() ? g[k++] : at::Tensor());
    return out;
  }

  std::string name() const override { return "tinkerd::RecomputeBackward"; }
  void release_variables() override {
    x_.reset();
    params_.clear();
  }

 private:
  LayerFn fn_;
  at::Tensor x_;
  bool x_needs_grad_;
  std::vector<at::Tensor> params_;
};

// The gathered weights whole; with a scatter, each (defined one) a leaf that records its
// gradient, and without (frozen weights) none.
std::vector<at::Tensor> GatherLeaves(const Gathered& weights) {
  std::vector<at::Tensor> w = weights.gather();
  for (at::Tensor& t : w) {
    if (t.defined()) t = t.detach().requires_grad_(static_cast<bool>(weights.scatter));
  }
  return w;
}

// The backward node of RecomputeGathered: its next edges are x's, then each param's.
class GatheredNode : public torch::autograd::Node {
 public:
  GatheredNode(GatheredFn fn, Gathered weights, const at::Tensor& x, std::vector<at::Tensor> params)
      : fn_(std::move(fn)),
        weights_(std::move(weights)),
        x_(x.detach()),
        x_needs_grad_(x.requires_grad()),
        params_(std::move(params)) {}

  variable_list apply(variable_list&& grads) override {
    TORCH_CHECK(x_.defined(), "recompute: backward ran twice through a gathered layer");
    at::AutoGradMode grad_on(true);
    const at::Tensor x = x_.detach().requires_grad_(x_needs_grad_);
    const std::vector<at::Tensor> w = GatherLeaves(weights_);
    const at::Tensor y = fn_(x, w);
    // x, then the params that need a gradient, then the gathered weights that record one.
    variable_list wrt;
    if (x_needs_grad_) wrt.push_back(x);
    for (const at::Tensor& p : params_) {
      if (p.requires_grad()) wrt.push_back(p);
    }
    for (const at::Tensor& t : w) {
      if (t.defined() && t.requires_grad()) wrt.push_back(t);
    }
    const variable_list g = torch::autograd::grad({y}, wrt, {grads[0]}, /*retain_graph=*/false,
                                                  /*create_graph=*/false, /*allow_unused=*/true);
    variable_list out;
    size_t k = 0;
    out.push_back(x_needs_grad_ ? g[k++] : at::Tensor());
    for (const at::Tensor& p : params_) out.push_back(p.requires_grad() ? g[k++] : at::Tensor());
    if (weights_.scatter) {
      std::vector<at::Tensor> dw(w.size());
      for (size_t i = 0; i < w.size(); ++i) {
        if (w[i].defined()) dw[i] = g[k++];
      }
      weights_.scatter(dw);
    }
    return out;
  }

  std::string name() const override { return "tinkerd::RecomputeGatheredBackward"; }
  void release_variables() override {
    x_.reset();
    params_.clear();
  }

 private:
  GatheredFn fn_;
  Gathered weights_;
  at::Tensor x_;
  bool x_needs_grad_;
  std::vector<at::Tensor> params_;
};

}  // namespace

at::Tensor RecomputeGathered(GatheredFn fn, Gathered weights, const at::Tensor& x,
                             const std::vector<at::Tensor>& params) {
  bool any = x.requires_grad() || static_cast<bool>(weights.scatter);
  for (const at::Tensor& p : params) any = any || p.requires_grad();
  if (!at::GradMode::is_enabled() || !any) return fn(x, weights.gather());
  // As in Recompute: the forward runs as the recompute will, so that it takes the same kernels.
  at::Tensor y = fn(x.detach().requires_grad_(x.requires_grad()), GatherLeaves(weights)).detach();
  variable_list inputs{x};
  inputs.insert(inputs.end(), params.begin(), params.end());
  auto node = std::make_shared<GatheredNode>(std::move(fn), std::move(weights), x, params);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  torch::autograd::create_gradient_edge(y, node);
  return y;
}

at::Tensor Recompute(LayerFn fn, const at::Tensor& x, const std::vector<at::Tensor>& params) {
  bool any = x.requires_grad();
  for (const at::Tensor& p : params) any = any || p.requires_grad();
  if (!at::GradMode::is_enabled() || !any) return fn(x);
  // The forward runs as the recompute will, grad mode on and x's own requires_grad, so that it
  // takes the same kernels: without a gradient to record, float32 products and norms on the CPU
  // take inference loops (kernels/gemv.h, rms_norm.h) that round otherwise than autograd's ops,
  // and the recomputed layer would not be the one that ran. The detach drops its graph at once:
  // one layer's activations live at a time, as in the backward.
  at::Tensor y = fn(x.detach().requires_grad_(x.requires_grad())).detach();
  variable_list inputs{x};
  inputs.insert(inputs.end(), params.begin(), params.end());
  auto node = std::make_shared<RecomputeNode>(std::move(fn), x, params);
  node->set_next_edges(torch::autograd::collect_next_edges(inputs));
  torch::autograd::create_gradient_edge(y, node);
  return y;
}

}  // namespace tinkerd::kernels
