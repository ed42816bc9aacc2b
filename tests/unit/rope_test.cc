// RoPE's one-pass host loop (outside autograd, float and double) against the ATen expression it
// replaces there, which autograd still runs: the two must be bitwise equal, so that sampling and
// Forward compute exactly what training computes.
#include "runner/model/rope.h"

#include <gtest/gtest.h>

#include <tuple>

namespace tinkerd::testing {
namespace {

at::Tensor Random(at::IntArrayRef shape, uint64_t seed, at::ScalarType dt) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  return at::randn(shape, gen, at::TensorOptions().dtype(at::kDouble)).to(dt);
}

TEST(Rope, OnePassEqualsTheAtenExpressionBitwise) {
  for (at::ScalarType dt : {at::kFloat, at::kDouble}) {
    for (auto [T, H, d] :
         {std::tuple<int64_t, int64_t, int64_t>{5, 3, 8}, {64, 8, 64}, {7, 2, 2}}) {
      const at::Tensor x = Random({T, H, d}, 1, dt);
      const RopeTables tables{Random({T, d}, 2, dt), Random({T, d}, 3, dt)};
      const at::Tensor one_pass = ApplyRope(x, tables);
      // With a graph to record, ApplyRope takes the ATen expression.
      const at::Tensor aten = ApplyRope(x.clone().requires_grad_(), tables);
      ASSERT_TRUE(aten.requires_grad());
      EXPECT_TRUE(at::equal(one_pass, aten.detach())) << at::toString(dt) << " d " << d;

      // Controls: the comparison sees the sum rounded once (an FMA-like result) and the halves
      // rotated the wrong way.
      const at::Tensor x1 = x.narrow(2, 0, d / 2), x2 = x.narrow(2, d / 2, d / 2);
      const at::Tensor c = tables.cos_Td.unsqueeze(1), s = tables.sin_Td.unsqueeze(1);
      const at::Tensor once = (x.to(at::kDouble) * c.to(at::kDouble) +
                               at::cat({-x2, x1}, 2).to(at::kDouble) * s.to(at::kDouble))
                                  .to(dt);
      if (dt == at::kFloat && T * H * d > 100) {
        EXPECT_FALSE(at::equal(one_pass, once)) << "d " << d;
      }
      EXPECT_FALSE(at::equal(one_pass, x * c + at::cat({x2, -x1}, 2) * s)) << "d " << d;
    }
  }
}

TEST(Rope, TheGradientFlowsThroughTheAtenExpression) {
  const at::Tensor x = Random({4, 2, 6}, 4, at::kDouble).requires_grad_();
  const RopeTables tables{Random({4, 6}, 5, at::kDouble), Random({4, 6}, 6, at::kDouble)};
  ApplyRope(x, tables).sum().backward();
  // d/dx of Σ (x·cos + rotate_half(x)·sin): cos_j, plus sin_{j+R} from the first half's rotation
  // into the second (x_j appears there with +), minus sin_{j-R} for the second half.
  const int64_t R = 3;
  const at::Tensor c = tables.cos_Td, s = tables.sin_Td;
  const at::Tensor expected =
      (c + at::cat({s.narrow(1, R, R), -s.narrow(1, 0, R)}, 1)).unsqueeze(1).expand({4, 2, 6});
  EXPECT_TRUE(at::allclose(x.grad(), expected, 0, 1e-15));
}

}  // namespace
}  // namespace tinkerd::testing
