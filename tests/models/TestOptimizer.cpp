#include <kmamba/core/Core.hpp>
#include <kmamba/models/Optimizer.hpp>
#include <kmamba/models/ParameterSlab.hpp>

#include "Backends.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

namespace {

KMAMBA_BACKEND_TEST_SUITE(Optimizer);

TYPED_TEST(Optimizer, SlabPutsDecayedParametersFirstAndViewsAliasIt) {
  using Mem = typename TypeParam::memory_space;
  kmamba::ParameterSlab<Mem> slab;
  slab.add("norm.weight", {4}, kmamba::WeightDecay::No);
  slab.add("in_proj.weight", {3, 4}, kmamba::WeightDecay::Yes);
  slab.add("D", {2}, kmamba::WeightDecay::No);
  slab.add("out_proj.weight", {4, 3}, kmamba::WeightDecay::Yes);
  EXPECT_THROW(slab.add("D", {2}, kmamba::WeightDecay::No), kmamba::UserError);
  slab.finalize("kmamba::test::slab");
  EXPECT_EQ(slab.size(), 30u);
  EXPECT_EQ(slab.decay_end(), 24u);
  EXPECT_EQ(slab.entry("in_proj.weight").offset, 0u);
  EXPECT_EQ(slab.entry("out_proj.weight").offset, 12u);
  EXPECT_EQ(slab.entry("norm.weight").offset, 24u);
  EXPECT_EQ(slab.entry("D").offset, 28u);
  auto w = slab.template param<2>("out_proj.weight");
  EXPECT_EQ(w.extent(0), 4u);
  EXPECT_EQ(w.extent(1), 3u);
  EXPECT_EQ(w.data(), slab.params().data() + 12);
  EXPECT_EQ(slab.template grad<1>("D").data(), slab.grads().data() + 28);
  EXPECT_THROW(slab.template param<1>("out_proj.weight"), kmamba::UserError);
  EXPECT_THROW(slab.entry("missing"), kmamba::UserError);
  EXPECT_THROW(slab.add("late", {1}, kmamba::WeightDecay::No), kmamba::UserError);
}

TYPED_TEST(Optimizer, AdamWMatchesHandComputedSteps) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const int n = 257, decay_end = 100;
  auto p = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::p", n);
  auto g = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::g", n);
  kmamba::fill_normal(Exec(), p, 1, 0.0f, 1.0f);
  const kmamba::AdamWConfig cfg{0.01, 0.9, 0.95, 1e-8, 0.1};
  kmamba::AdamW<Mem> opt(n, cfg);
  std::vector<double> ref_p(n), m(n, 0.0), v(n, 0.0);
  {
    auto ph = kmamba::test::to_host(p);
    for (int i = 0; i < n; ++i) ref_p[i] = ph(i);
  }
  const double lrs[] = {0.01, 0.005, 0.002};
  const double scales[] = {1.0, 0.5, 1.0};
  for (int t = 1; t <= 3; ++t) {
    kmamba::fill_normal(Exec(), g, 10 + t, 0.0f, 1.0f);
    auto gh = kmamba::test::to_host(g);
    opt.step(Exec(), p, kmamba::ConstTensor1<float, Mem>(g), decay_end, lrs[t - 1], scales[t - 1]);
    for (int i = 0; i < n; ++i) {
      const double gi = gh(i) * scales[t - 1];
      if (i < decay_end) ref_p[i] -= lrs[t - 1] * cfg.weight_decay * ref_p[i];
      m[i] = cfg.beta1 * m[i] + (1 - cfg.beta1) * gi;
      v[i] = cfg.beta2 * v[i] + (1 - cfg.beta2) * gi * gi;
      const double mhat = m[i] / (1 - std::pow(cfg.beta1, t)), vhat = v[i] / (1 - std::pow(cfg.beta2, t));
      ref_p[i] -= lrs[t - 1] * mhat / (std::sqrt(vhat) + cfg.eps);
    }
  }
  EXPECT_EQ(opt.steps_taken(), 3);
  auto ph = kmamba::test::to_host(p);
  for (int i = 0; i < n; ++i) ASSERT_NEAR(ph(i), ref_p[i], 1e-5 * (1 + std::fabs(ref_p[i]))) << "element " << i;
}

TYPED_TEST(Optimizer, GlobalNormAndClipping) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  auto g = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::g", 1000);
  kmamba::fill_normal(Exec(), g, 5, 0.0f, 2.0f);
  auto gh = kmamba::test::to_host(g);
  double sum = 0.0;
  for (int i = 0; i < 1000; ++i) sum += static_cast<double>(gh(i)) * gh(i);
  const double norm = kmamba::global_norm(Exec(), kmamba::ConstTensor1<float, Mem>(g));
  EXPECT_NEAR(norm, std::sqrt(sum), 1e-9 * std::sqrt(sum));
  EXPECT_NEAR(norm * kmamba::clip_scale(norm, 1.0), 1.0, 1e-5);
  EXPECT_EQ(kmamba::clip_scale(0.5, 1.0), 1.0);
  EXPECT_EQ(kmamba::clip_scale(50.0, 0.0), 1.0);
}

TEST(LearningRate, WarmsUpLinearlyThenDecaysByCosine) {
  EXPECT_DOUBLE_EQ(kmamba::learning_rate(0, 1e-3, 1e-4, 10, 110), 1e-4);
  EXPECT_DOUBLE_EQ(kmamba::learning_rate(9, 1e-3, 1e-4, 10, 110), 1e-3);
  EXPECT_DOUBLE_EQ(kmamba::learning_rate(10, 1e-3, 1e-4, 10, 110), 1e-3);
  EXPECT_NEAR(kmamba::learning_rate(60, 1e-3, 1e-4, 10, 110), 0.5 * (1e-3 + 1e-4), 1e-12);
  EXPECT_DOUBLE_EQ(kmamba::learning_rate(110, 1e-3, 1e-4, 10, 110), 1e-4);
  EXPECT_DOUBLE_EQ(kmamba::learning_rate(500, 1e-3, 1e-4, 10, 110), 1e-4);
  EXPECT_DOUBLE_EQ(kmamba::learning_rate(0, 1e-3, 0.0, 0, 100), 1e-3);
  EXPECT_THROW(kmamba::learning_rate(-1, 1e-3, 0.0, 0, 100), kmamba::UserError);
  EXPECT_THROW(kmamba::AdamW<Kokkos::HostSpace>(4, kmamba::AdamWConfig{1e-3, 1.0, 0.95, 1e-8, 0.1}), kmamba::UserError);
}

}  // namespace
