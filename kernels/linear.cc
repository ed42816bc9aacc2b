#include "kernels/linear.h"

#include <ATen/Dispatch.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "kernels/cpu_clones.h"
#include "kernels/gemv.h"
#include "kernels/mixed_grad.h"
#include "kernels/parallel.h"
#include "kernels/vec16.h"

namespace tinkerd::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// y = g / (1 + e^−g) · u, sixteen at a time: ATen's silu and product, in its order of operations,
// with vec16.h's Exp; in bf16 silu is rounded to bf16 before the product, as ATen's two ops round.
template <typename T>
TINKERD_CPU_CLONES void SwiGLULoop(const T* g, const T* u, T* y, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const int64_t m = std::min<int64_t>(16, n - i);  // the last n mod 16 zero-padded
    V16 gate, up;
    Widen(g + i, m, gate);
    Widen(u + i, m, up);
    V16 e = -gate;
    Exp(e);
    V16 silu = gate / (1.0f + e);
    if constexpr (!std::is_same_v<T, float>) {
      for (int64_t j = 0; j < m; ++j) silu[j] = static_cast<float>(static_cast<T>(silu[j]));
    }
    const V16 out = silu * up;
    if constexpr (std::is_same_v<T, float>) {
      if (m == 16) {
        *reinterpret_cast<V16u*>(y + i) = out;
        continue;
      }
      std::memcpy(y + i, &out, m * sizeof(float));
    } else {
      for (int64_t j = 0; j < m; ++j) y[i + j] = static_cast<T>(out[j]);
    }
  }
}

// Whether the loop serves: float or bf16 on the CPU, gate and up alike.
bool LoopServes(const at::Tensor& g, const at::Tensor& u) {
  const at::ScalarType dt = g.scalar_type();
  return (dt == at::kFloat || dt == at::kBFloat16) && u.scalar_type() == dt &&
         g.device().is_cpu() && u.device().is_cpu() && g.sizes() == u.sizes();
}

// ATen's two ops, each a parallel region and an allocation, took 0.55 ms of a 22 ms batch-64
// decode step on a 2-vCPU Xeon. Tasks of at least 32 Ki elements: a batch-64 step's 90 Ki split
// on its team (kernels/parallel.h), whose loops cost a few microseconds to start.
at::Tensor Loop(const at::Tensor& gate, const at::Tensor& up) {
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  at::Tensor y = at::empty_like(g);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, g.scalar_type(), "swiglu", [&] {
    if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, at::BFloat16>) {
      const scalar_t* gp = g.data_ptr<scalar_t>();
      const scalar_t* up_ = u.data_ptr<scalar_t>();
      scalar_t* yp = y.data_ptr<scalar_t>();
      ParallelFor(0, g.numel(), int64_t{1} << 15, [&](int64_t begin, int64_t end) {
        SwiGLULoop(gp + begin, up_ + begin, yp + begin, end - begin);
      });
    }
  });
  return y;
}

// The loop, differentiated by its formula in fp32: with σ = sigmoid(g),
//   dg = dy · u · σ · (1 + g · (1 − σ)),   du = dy · g · σ
struct SwiGLUFunction : torch::autograd::Function<SwiGLUFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& g, const at::Tensor& u) {
    ctx->save_for_backward({g, u});
    return Loop(g, u);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const at::ScalarType dt = s[0].scalar_type();
    const at::Tensor g = s[0].to(at::kFloat), u = s[1].to(at::kFloat);
    const at::Tensor dy = grads[0].to(at::kFloat), sig = at::sigmoid(g);
    const at::Tensor dg = dy * u * sig * (1 + g * (1 - sig));
    const at::Tensor du = dy * g * sig;
    return {dg.to(dt), du.to(dt)};
  }
};

// Whether x·wᵀ records its gradient through MixedLinear: under a narrow compute dtype
// (mixed_grad.h), and in float32 where Gemv takes the product, so that training's forward is the
// sampler's and Forward's product to the bit.
bool ThroughMixedLinear(const at::Tensor& x, const at::Tensor& w) {
  const bool grad = c10::GradMode::is_enabled() && (x.requires_grad() || w.requires_grad());
  return MixedInUse(x, w) || (grad && GemvFits(x, w));
}

// x·c(w)ᵀ with w cast to x's dtype.
at::Tensor Product(const at::Tensor& x_NI, const at::Tensor& w_OI) {
  if (ThroughMixedLinear(x_NI, w_OI)) return MixedLinear({x_NI, w_OI, {}});
  return LinearProduct(x_NI, w_OI.to(x_NI.scalar_type()));
}

}  // namespace

at::Tensor Linear(const LinearParams& p) {
  const at::ScalarType dt = p.x_NI.scalar_type();
  const bool bias = p.b_O.defined();
  at::Tensor y = ThroughMixedLinear(p.x_NI, p.w_OI) || (bias && ThroughMixedLinear(p.x_NI, p.b_O))
                     ? MixedLinear({p.x_NI, p.w_OI, p.b_O})
                     : AffineProduct(p.x_NI, p.w_OI.to(dt), bias ? p.b_O.to(dt) : at::Tensor());
  if (p.A_rI.defined()) {
    const at::Tensor low_Nr = Product(p.x_NI, p.A_rI);
    y = y + Product(low_Nr, p.B_Or) * p.scale;
  }
  // Each run: the single adapter's arithmetic on the run's rows, so each row rounds as it would
  // alone. Recording a graph, the terms are joined and added out of place (one add per row, as
  // the single adapter's), so each run's pair gets the gradient of its own rows alone.
  const bool graph = c10::GradMode::is_enabled() &&
                     std::any_of(p.runs.begin(), p.runs.end(), [](const LoraRun& r) {
                       return r.A_rI.requires_grad() || r.B_Or.requires_grad();
                     });
  // split, not narrow: its backward joins the runs' input gradients in one tensor, where each
  // narrow's would make a zero-filled one of all N rows (quadratic in the number of runs).
  std::vector<at::Tensor> x_runs;
  if (graph) {
    std::vector<int64_t> rows;
    for (const LoraRun& run : p.runs) rows.push_back(run.rows);
    x_runs = p.x_NI.split_with_sizes(rows);
  }
  std::vector<at::Tensor> terms;
  int64_t row = 0;
  for (size_t i = 0; i < p.runs.size(); ++i) {
    const LoraRun& run = p.runs[i];
    TORCH_CHECK(!p.A_rI.defined(), "Linear: runs and a single adapter are exclusive");
    if (run.A_rI.defined()) {
      const at::Tensor low_Nr =
          Product(graph ? x_runs[i] : p.x_NI.narrow(0, row, run.rows), run.A_rI);
      at::Tensor term = Product(low_Nr, run.B_Or) * run.scale;
      if (graph) {
        terms.push_back(std::move(term));
      } else {
        y.narrow(0, row, run.rows).add_(term);
      }
    } else if (graph) {
      terms.push_back(at::zeros({run.rows, y.size(1)}, y.options()));
    }
    row += run.rows;
  }
  TORCH_CHECK(p.runs.empty() || row == p.x_NI.size(0), "Linear: runs cover ", row, " rows of ",
              p.x_NI.size(0));
  if (graph) y = y + at::cat(terms);
  return y;
}

at::Tensor SwiGLU(const at::Tensor& gate_NI, const at::Tensor& up_NI) {
  if (!LoopServes(gate_NI, up_NI)) return at::silu(gate_NI) * up_NI;
  const bool grad =
      c10::GradMode::is_enabled() && (gate_NI.requires_grad() || up_NI.requires_grad());
  return grad ? SwiGLUFunction::apply(gate_NI, up_NI) : Loop(gate_NI, up_NI);
}

}  // namespace tinkerd::kernels
