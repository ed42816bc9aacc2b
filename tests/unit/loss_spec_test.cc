#include "runner/loss/loss_spec.h"

#include <gtest/gtest.h>

#include <cmath>

namespace tinkerd {
namespace {

TEST(LossSpec, DefaultsAreTinkers) {
  auto ppo = ResolveLoss("ppo", {});
  ASSERT_TRUE(ppo.ok());
  EXPECT_EQ(ppo->config.at("clip_low_threshold"), 0.8);
  EXPECT_EQ(ppo->config.at("clip_high_threshold"), 1.2);
  auto cispo = ResolveLoss("cispo", {{"clip_high_threshold", 3.0}});
  ASSERT_TRUE(cispo.ok());
  EXPECT_EQ(cispo->config.at("clip_low_threshold"), 0.0);
  EXPECT_EQ(cispo->config.at("clip_high_threshold"), 3.0);
  EXPECT_TRUE(ResolveLoss("cross_entropy", {})->config.empty());
  EXPECT_EQ(FindLossSpec("importance_sampling")->implicit_mask_input, "advantages");
  EXPECT_EQ(FindLossSpec("cross_entropy")->implicit_mask_input, "weights");
}

TEST(LossSpec, BadNamesAndKeysAreInvalidArgument) {
  struct Case {
    std::string loss;
    std::map<std::string, double> cfg;
    const char* expect;
  };
  const Case cases[] = {
      {"mse", {}, "unknown loss 'mse'"},
      {"cross_entropy", {{"beta", 1}}, "takes none"},
      {"ppo", {{"clip_epsilon", 0.2}}, "clip_epsilon"},
      {"dro", {}, "requires 'beta'"},
      {"dro", {{"beta", -1}}, "beta must be >= 0"},
      {"ppo", {{"clip_low_threshold", 1.5}}, "clip_low_threshold <= clip_high_threshold"},
      {"ppo", {{"clip_high_threshold", NAN}}, "finite"},
      {"cross_entropy", {{"router_aux_loss_coef", -0.01}}, "router_aux_loss_coef must be >= 0"},
      {"gspo", {{"router_aux_loss_coef", INFINITY}}, "finite"},
  };
  for (const Case& c : cases) {
    auto r = ResolveLoss(c.loss, c.cfg);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.expect;
    EXPECT_NE(r.status().message().find(c.expect), absl::string_view::npos)
        << c.expect << " vs " << r.status().message();
  }
}

// The router's loss is every loss's key, kept apart from the loss's own config (which the
// per-token losses read), 0 unless set.
TEST(LossSpec, EveryLossTakesTheRoutersCoefficient) {
  for (const LossSpec& spec : AllLossSpecs()) {
    std::map<std::string, double> cfg{{"router_aux_loss_coef", 0.01}};
    if (spec.name == "dro") cfg["beta"] = 0.1;
    auto r = ResolveLoss(spec.name, cfg);
    ASSERT_TRUE(r.ok()) << spec.name << ": " << r.status().message();
    EXPECT_EQ(r->router_aux_loss_coef, 0.01) << spec.name;
    EXPECT_EQ(r->config.count("router_aux_loss_coef"), 0u) << spec.name;
  }
  EXPECT_EQ(ResolveLoss("ppo", {})->router_aux_loss_coef, 0);
}

}  // namespace
}  // namespace tinkerd
