#include <kmamba/core/Core.hpp>
#include <kmamba/models/Optimizer.hpp>
#include <kmamba/models/ParameterSlab.hpp>

#include "Backends.hpp"
#include "Checks.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <type_traits>
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

// The offloaded AdamW (moments in host memory, the update on host threads in staged groups) is the
// device's AdamW: over runs of the slab with packed moments (a ZeRO-1 rank's shards), in groups of
// 7 elements (runs cut across groups, both staging buffers reused many times), it writes the same
// parameters and moments and leaves the elements outside the runs alone. On host backends the two
// memories coincide but the offloaded update takes the GPU's path (copies into the staging buffers
// on the execution space, the host threads' update, the copies back): the same float operations per
// element, so the same bits. On CUDA the device kernel may fuse a·b + c into one FMA where the host
// rounds twice: a few ulps of the values that enter (|g|, |p| < 6, |m| < 6, v < 36), so 1e-5 absolute.
TYPED_TEST(Optimizer, OffloadedAdamWUpdatesLikeTheDeviceOne) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const std::size_t n = 301, decay_end = 120, moments = 171;
  const std::vector<kmamba::SlabRun> runs = {{3, 0, 50}, {100, 50, 31}, {200, 81, 90}};
  auto p_device = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::p_device", n);
  auto p_host = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::p_host", n);
  auto g = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::g", n);
  kmamba::fill_normal(Exec(), p_device, 3, 0.0f, 1.0f);
  Kokkos::deep_copy(p_host, p_device);
  const auto p_start = kmamba::test::to_host(p_device);  // an alias of p_device on host backends: copy it
  const std::vector<float> p0(p_start.data(), p_start.data() + n);
  const kmamba::AdamWConfig cfg{0.01, 0.9, 0.95, 1e-8, 0.1};
  kmamba::AdamW<Mem> device(moments, cfg);
  kmamba::AdamW<Mem> host(moments, cfg, kmamba::OptimizerPlacement::Host, 7);
  EXPECT_EQ(device.placement(), kmamba::OptimizerPlacement::Device);
  EXPECT_EQ(host.placement(), kmamba::OptimizerPlacement::Host);
  EXPECT_EQ(device.device_bytes(), 2 * moments * sizeof(float));
  EXPECT_EQ(host.device_bytes(), 0u);
  EXPECT_EQ(host.host_bytes(), (2 * moments + 4 * 7) * sizeof(float));
  for (int t = 1; t <= 3; ++t) {
    kmamba::fill_normal(Exec(), g, 20 + t, 0.0f, 1.0f);
    const kmamba::ConstTensor1<float, Mem> grads(g);
    device.update(Exec(), t, p_device, grads, runs, decay_end, 0.01 / t, t == 2 ? 0.5 : 1.0);
    host.update(Exec(), t, p_host, grads, runs, decay_end, 0.01 / t, t == 2 ? 0.5 : 1.0);
  }
  Exec().fence();
  const bool same_bits = std::is_same<Mem, Kokkos::HostSpace>::value;
  const auto expect_equal = [&](const float* a, const float* b, std::size_t count, const char* what) {
    for (std::size_t i = 0; i < count; ++i) {
      if (same_bits) {
        ASSERT_EQ(a[i], b[i]) << what << " element " << i;
      } else {
        ASSERT_NEAR(a[i], b[i], 1e-5) << what << " element " << i;
      }
    }
  };
  const auto pd = kmamba::test::to_host(p_device), ph = kmamba::test::to_host(p_host);
  expect_equal(ph.data(), pd.data(), n, "parameter");
  const auto md = kmamba::test::optimizer_moments<Exec>(device), mh = kmamba::test::optimizer_moments<Exec>(host);
  expect_equal(mh[0].data(), md[0].data(), moments, "first moment");
  expect_equal(mh[1].data(), md[1].data(), moments, "second moment");
  std::size_t untouched = 0, changed = 0;
  for (std::size_t i = 0; i < n; ++i) {
    const bool in_run = (i >= 3 && i < 53) || (i >= 100 && i < 131) || (i >= 200 && i < 290);
    if (in_run) {
      changed += ph(i) != p0[i] ? 1 : 0;
    } else {
      EXPECT_EQ(ph(i), p0[i]) << "element " << i << " lies outside the runs";
      ++untouched;
    }
  }
  EXPECT_EQ(changed, moments);
  EXPECT_EQ(untouched, n - moments);
  EXPECT_THROW(host.first_moment(), kmamba::UserError);
  EXPECT_THROW(
      host.update(Exec(), 4, p_host, kmamba::ConstTensor1<float, Mem>(g), {{290, 160, 12}}, decay_end, 0.01, 1.0),
      kmamba::UserError);
}

TEST(Optimizer, SplitRunsCutsEachRunIntoGroups) {
  const std::vector<kmamba::SlabRun> groups = kmamba::impl::split_runs({{3, 0, 10}, {20, 10, 0}, {40, 10, 4}}, 4);
  ASSERT_EQ(groups.size(), 4u);
  EXPECT_EQ(groups[0].slab_begin, 3u);
  EXPECT_EQ(groups[2].slab_begin, 11u);
  EXPECT_EQ(groups[2].moment_offset, 8u);
  EXPECT_EQ(groups[2].size, 2u);
  EXPECT_EQ(groups[3].slab_begin, 40u);
  EXPECT_EQ(groups[3].moment_offset, 10u);
  EXPECT_EQ(groups[3].size, 4u);
  EXPECT_THROW(kmamba::impl::split_runs({{0, 0, 1}}, 0), kmamba::UserError);
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
