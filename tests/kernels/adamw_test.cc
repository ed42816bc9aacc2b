// kernels/adamw against a scalar float64 loop of torch.optim.AdamW's update, in float64 and in
// float32 on the device under test; each parameter's update independent of the others in the
// call; a broken control (no bias correction) that the same comparison rejects.
#include "kernels/adamw.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tests/kernels/kernel_test_util.h"

namespace tinkerd::testing {
namespace {

struct Hyper {
  double lr = 0.01, beta1 = 0.9, beta2 = 0.95, eps = 1e-8, weight_decay = 0.1;
};

// torch.optim.AdamW's update, element by element in double, for `grads.size()` steps from step 1.
// `bias_correction` false is the broken control.
void Reference(const Hyper& h, const std::vector<at::Tensor>& grads, at::Tensor& p, at::Tensor& m,
               at::Tensor& v, bool bias_correction = true) {
  double* pp = p.data_ptr<double>();
  double* mp = m.data_ptr<double>();
  double* vp = v.data_ptr<double>();
  for (size_t s = 0; s < grads.size(); ++s) {
    const double t = static_cast<double>(s + 1);
    const double bias1 = bias_correction ? 1 - std::pow(h.beta1, t) : 1.0;
    const double bias2 = bias_correction ? 1 - std::pow(h.beta2, t) : 1.0;
    const at::Tensor g = grads[s].contiguous();
    const double* gp = g.data_ptr<double>();
    for (int64_t i = 0; i < p.numel(); ++i) {
      pp[i] *= 1 - h.lr * h.weight_decay;
      mp[i] = h.beta1 * mp[i] + (1 - h.beta1) * gp[i];
      vp[i] = h.beta2 * vp[i] + (1 - h.beta2) * gp[i] * gp[i];
      pp[i] -= h.lr / bias1 * mp[i] / (std::sqrt(vp[i]) / std::sqrt(bias2) + h.eps);
    }
  }
}

// Parameters of several shapes (one empty), their gradients for `steps` steps, in float64. The
// runs below copy the parameters (`to` alone would alias them in float64 on the CPU).
struct Case {
  std::vector<at::Tensor> params;
  std::vector<std::vector<at::Tensor>> grads;  // [parameter][step]
};

Case MakeCase(int steps) {
  Case c;
  const std::vector<std::vector<int64_t>> shapes = {{5, 7}, {13}, {0, 4}, {2, 3, 4}};
  uint64_t seed = 100;
  for (const auto& shape : shapes) {
    c.params.push_back(Randn(shape, seed++));
    c.grads.emplace_back();
    for (int s = 0; s < steps; ++s) c.grads.back().push_back(Randn(shape, seed++, 0.5));
  }
  return c;
}

// Runs the kernel for every step over all parameters at once, in `dtype` on `device`; returns
// the parameters, moments appended (p..., m..., v...) on the CPU in float64.
std::vector<at::Tensor> RunKernel(const Hyper& h, const Case& c, at::ScalarType dtype,
                                  at::Device device, const std::vector<size_t>& which) {
  kernels::AdamWParams a;
  for (size_t k : which) {
    a.params.push_back(c.params[k].to(device, dtype, /*non_blocking=*/false, /*copy=*/true));
    a.exp_avgs.push_back(at::zeros_like(a.params.back()));
    a.exp_avg_sqs.push_back(at::zeros_like(a.params.back()));
  }
  a.lr = h.lr;
  a.beta1 = h.beta1;
  a.beta2 = h.beta2;
  a.eps = h.eps;
  a.weight_decay = h.weight_decay;
  for (size_t s = 0; s < c.grads[0].size(); ++s) {
    a.grads.clear();
    for (size_t k : which) a.grads.push_back(c.grads[k][s].to(device, dtype));
    a.step = static_cast<int64_t>(s + 1);
    kernels::AdamW(a);
  }
  std::vector<at::Tensor> out;
  for (const auto* list : {&a.params, &a.exp_avgs, &a.exp_avg_sqs}) {
    for (const at::Tensor& t : *list) out.push_back(t.to(at::kCPU, at::kDouble));
  }
  return out;
}

std::vector<size_t> All(const Case& c) {
  std::vector<size_t> k(c.params.size());
  for (size_t i = 0; i < k.size(); ++i) k[i] = i;
  return k;
}

// The reference's p..., m..., v... for every parameter, from `c`'s values rounded to `dtype`.
std::vector<at::Tensor> RunReference(const Hyper& h, const Case& c, at::ScalarType dtype,
                                     bool bias_correction = true) {
  std::vector<at::Tensor> p, m, v;
  for (size_t k = 0; k < c.params.size(); ++k) {
    p.push_back(c.params[k].to(dtype).to(at::kDouble, /*non_blocking=*/false, /*copy=*/true));
    m.push_back(at::zeros_like(p.back()));
    v.push_back(at::zeros_like(p.back()));
    std::vector<at::Tensor> g;
    for (const at::Tensor& gs : c.grads[k]) g.push_back(gs.to(dtype).to(at::kDouble));
    Reference(h, g, p.back(), m.back(), v.back(), bias_correction);
  }
  std::vector<at::Tensor> out = p;
  out.insert(out.end(), m.begin(), m.end());
  out.insert(out.end(), v.begin(), v.end());
  return out;
}

double WorstRelErr(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want) {
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i].numel() > 0) worst = std::max(worst, RelErr(got[i], want[i]));
  }
  return worst;
}

TEST(AdamW, MatchesAScalarLoopFloat64) {
  const Hyper h;
  const Case c = MakeCase(5);
  const auto got = RunKernel(h, c, at::kDouble, at::kCPU, All(c));
  // The same expression in the same order in double: a few ulps per step, ~1e-15 after five
  // steps relative to each tensor's largest element; 1e-13 leaves margin.
  EXPECT_LT(WorstRelErr(got, RunReference(h, c, at::kDouble)), 1e-13);
  // Without bias correction the first steps move by 0.45·lr instead of lr: ~2e-3 of |p| ~ 1.
  EXPECT_GT(WorstRelErr(got, RunReference(h, c, at::kDouble, /*bias_correction=*/false)), 1e-4)
      << "the broken control agreed";
}

TEST(AdamW, Float32OnTheDeviceWithinRounding) {
  // From the same fp32-rounded values, each step rounds p once (2^-24 of |p|) and its update of
  // size ≤ ~3·lr through about ten fp32 ops (≤ 10 · 2^-24 of the update, far below the first
  // term); m and v are a few fp32 ops each step. Five steps: ≤ 5 · 2 · 2^-24 ≈ 6e-7 of each
  // tensor's largest element (fused multiply-adds on a GPU only round less). Bound 2e-6.
  const Hyper h;
  const Case c = MakeCase(5);
  const auto got = RunKernel(h, c, at::kFloat, KernelDevice(), All(c));
  const double err = WorstRelErr(got, RunReference(h, c, at::kFloat));
  EXPECT_LT(err, 2e-6);
  EXPECT_GT(err, 0.0) << "float32 equal to float64 to the last bit: the float32 path did not run";
}

// The per-tensor op sequence the runner used before kernels/adamw (one parameter at a time).
void PerTensor(const Hyper& h, int64_t step, const at::Tensor& g, at::Tensor& p, at::Tensor& m,
               at::Tensor& v) {
  const double bias1 = 1.0 - std::pow(h.beta1, static_cast<double>(step));
  const double bias2 = 1.0 - std::pow(h.beta2, static_cast<double>(step));
  p.mul_(1.0 - h.lr * h.weight_decay);
  m.mul_(h.beta1).add_(g, 1.0 - h.beta1);
  v.mul_(h.beta2).addcmul_(g, g, 1.0 - h.beta2);
  const at::Tensor denom = (v.sqrt() / std::sqrt(bias2)).add_(h.eps);
  p.addcdiv_(m, denom, -h.lr / bias1);
}

TEST(AdamW, BitwiseThePerTensorUpdateOnTheCpu) {
  // What the float64 exactness tests held the runner to before, kept to the bit; the control is
  // the same update one step further along, which must differ.
  const Hyper h;
  const Case c = MakeCase(3);
  for (at::ScalarType dtype : {at::kDouble, at::kFloat}) {
    const auto together = RunKernel(h, c, dtype, at::kCPU, All(c));
    const size_t n = c.params.size();
    for (size_t k = 0; k < n; ++k) {
      at::Tensor p = c.params[k].to(dtype, false, /*copy=*/true);
      at::Tensor m = at::zeros_like(p), v = at::zeros_like(p), shifted = p.clone();
      at::Tensor ms = at::zeros_like(p), vs = at::zeros_like(p);
      for (int64_t s = 0; s < 3; ++s) {
        const at::Tensor g = c.grads[k][s].to(dtype);
        PerTensor(h, s + 1, g, p, m, v);
        PerTensor(h, s + 2, g, shifted, ms, vs);
      }
      EXPECT_TRUE(at::equal(together[k], p.to(at::kDouble))) << "parameter " << k;
      EXPECT_TRUE(at::equal(together[n + k], m.to(at::kDouble))) << "m of parameter " << k;
      EXPECT_TRUE(at::equal(together[2 * n + k], v.to(at::kDouble))) << "v of parameter " << k;
      if (p.numel() > 0) {
        EXPECT_FALSE(at::equal(together[k], shifted.to(at::kDouble)));
      }
    }
  }
}

TEST(AdamW, EachParameterIsUpdatedAsIfAlone) {
  const Hyper h;
  const Case c = MakeCase(3);
  const auto together = RunKernel(h, c, at::kFloat, KernelDevice(), All(c));
  const size_t n = c.params.size();
  for (size_t k = 0; k < n; ++k) {
    const auto alone = RunKernel(h, c, at::kFloat, KernelDevice(), {k});
    for (size_t j = 0; j < 3; ++j) {
      EXPECT_TRUE(at::equal(alone[j], together[j * n + k])) << "parameter " << k << " list " << j;
    }
  }
}

}  // namespace
}  // namespace tinkerd::testing
