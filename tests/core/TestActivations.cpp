// Scalar activations (docs/algorithms.md §0) against double-precision formulas, and the elementwise SiLU ops.
// Tolerance: fp32 vs double relative 1e-6 (a few ulp) for the scalar functions, 1e-5 for the
// elementwise ops; derivatives also checked against central differences of the double formulas.
#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Core.hpp>

#include "Activations.hpp"
#include "Backends.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace {

using namespace kmamba::reference;

const std::vector<float> sample_points = {-100.0f, -30.0f, -20.5f, -8.0f, -1.0f,   -1e-3f, 0.0f,  1e-3f,
                                          0.5f,    3.0f,   19.9f,  20.0f, 20.001f, 20.5f,  25.0f, 100.0f};

::testing::AssertionResult close(float got, double ref, double rel) {
  if (std::abs(got - ref) <= rel * (std::abs(ref) + 1e-30) || std::abs(got - ref) <= 1e-37) {
    return ::testing::AssertionSuccess();
  }
  return ::testing::AssertionFailure() << "got " << got << ", expected " << ref;
}

TEST(Activations, ScalarFunctionsMatchSpecFormulas) {
  for (const float v : sample_points) {
    SCOPED_TRACE("v = " + std::to_string(v));
    const double s = sigmoid(v);
    EXPECT_TRUE(close(kmamba::sigmoid(v), s, 1e-6));
    EXPECT_TRUE(close(kmamba::silu(v), silu(v), 1e-6));
    EXPECT_TRUE(close(kmamba::silu_derivative(v), s * (1.0 + v * (1.0 - s)), 1e-6));
    EXPECT_TRUE(close(kmamba::softplus(v), softplus(v), 1e-6));
    EXPECT_TRUE(close(kmamba::softplus_derivative(v), v > 20.0f ? 1.0 : s, 1e-6));
  }
  // Threshold 20: above it softplus is the identity with derivative exactly 1.
  EXPECT_EQ(kmamba::softplus(20.5f), 20.5f);
  EXPECT_EQ(kmamba::softplus_derivative(20.5f), 1.0f);
  EXPECT_EQ(kmamba::softplus_derivative(20.0f), kmamba::sigmoid(20.0f));
  // Saturation gives exact limits and never NaN.
  EXPECT_EQ(kmamba::silu(-200.0f), -0.0f);
  EXPECT_EQ(kmamba::silu_derivative(-200.0f), 0.0f);
  EXPECT_EQ(kmamba::silu(200.0f), 200.0f);
  EXPECT_EQ(kmamba::silu_derivative(200.0f), 1.0f);
}

TEST(Activations, DerivativesMatchFiniteDifferences) {
  const double h = 1e-6;
  for (const float v : sample_points) {
    if (std::abs(v - 20.0f) < 0.01f) continue;  // softplus has a (tiny) kink at the threshold
    SCOPED_TRACE("v = " + std::to_string(v));
    EXPECT_NEAR(kmamba::silu_derivative(v), (silu(v + h) - silu(v - h)) / (2 * h), 1e-6);
    EXPECT_NEAR(kmamba::softplus_derivative(v), (softplus(v + h) - softplus(v - h)) / (2 * h), 1e-6);
  }
}

KMAMBA_BACKEND_TEST_SUITE(Activations);

template <class Exec, class ViewType>
void check_silu_ops(const ViewType& x, const ViewType& dy, const ViewType& y, const ViewType& dx) {
  const Exec exec;
  const float nan_value = std::numeric_limits<float>::quiet_NaN();
  kmamba::fill_normal(exec, x, 11, 0.0f, 4.0f);
  kmamba::fill_normal(exec, dy, 12, 0.0f, 1.0f);
  Kokkos::deep_copy(y, nan_value);
  Kokkos::deep_copy(dx, nan_value);
  kmamba::silu_forward(exec, x, y);
  kmamba::silu_backward(exec, x, dy, dx);
  const auto xh = kmamba::test::to_host(x);
  const auto dyh = kmamba::test::to_host(dy);
  const auto yh = kmamba::test::to_host(y);
  const auto dxh = kmamba::test::to_host(dx);
  for (std::size_t i = 0; i < xh.size(); ++i) {
    const double v = xh.data()[i];
    const double s = sigmoid(v);
    ASSERT_NEAR(yh.data()[i], v * s, 1e-5 * (1.0 + std::abs(v * s))) << "flat index " << i;
    const double g = dyh.data()[i] * s * (1.0 + v * (1.0 - s));
    ASSERT_NEAR(dxh.data()[i], g, 1e-5 * (1.0 + std::abs(g))) << "flat index " << i;
  }
  // In place: y = silu(y) and dy = dy * silu'(x).
  Kokkos::deep_copy(y, x);
  kmamba::silu_forward(exec, y, y);
  kmamba::silu_backward(exec, x, dy, dy);
  const auto y2 = kmamba::test::to_host(y);
  const auto dy2 = kmamba::test::to_host(dy);
  for (std::size_t i = 0; i < xh.size(); ++i) {
    ASSERT_EQ(y2.data()[i], yh.data()[i]) << "flat index " << i;
    ASSERT_EQ(dy2.data()[i], dxh.data()[i]) << "flat index " << i;
  }
}

TYPED_TEST(Activations, ElementwiseSiluOverRanksOneToFour) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  {
    using V = kmamba::Tensor1<float, Mem>;
    check_silu_ops<Exec>(V("kmamba::test::x", 37), V("kmamba::test::dy", 37), V("kmamba::test::y", 37),
                         V("kmamba::test::dx", 37));
  }
  {
    using V = kmamba::Tensor2<float, Mem>;
    check_silu_ops<Exec>(V("kmamba::test::x", 3, 5), V("kmamba::test::dy", 3, 5), V("kmamba::test::y", 3, 5),
                         V("kmamba::test::dx", 3, 5));
  }
  {
    using V = kmamba::Tensor3<float, Mem>;
    check_silu_ops<Exec>(V("kmamba::test::x", 2, 3, 4), V("kmamba::test::dy", 2, 3, 4), V("kmamba::test::y", 2, 3, 4),
                         V("kmamba::test::dx", 2, 3, 4));
  }
  {
    using V = kmamba::Tensor4<float, Mem>;
    check_silu_ops<Exec>(V("kmamba::test::x", 2, 2, 3, 5), V("kmamba::test::dy", 2, 2, 3, 5),
                         V("kmamba::test::y", 2, 2, 3, 5), V("kmamba::test::dx", 2, 2, 3, 5));
  }
}

TYPED_TEST(Activations, ElementwiseSiluRejectsMismatchedShapes) {
  using Exec = TypeParam;
  using V = kmamba::Tensor2<float, typename Exec::memory_space>;
  const V x("kmamba::test::x", 3, 5), y("kmamba::test::y", 5, 3);
  try {
    kmamba::silu_forward(Exec(), x, y);
    FAIL() << "no exception";
  } catch (const kmamba::UserError& e) {
    EXPECT_EQ(std::string(e.what()),
              "kmamba::silu_forward: y has shape (5, 3) but x has shape (3, 5); they must be equal");
  }
  try {
    kmamba::silu_backward(Exec(), x, x, y);
    FAIL() << "no exception";
  } catch (const kmamba::UserError& e) {
    EXPECT_EQ(std::string(e.what()),
              "kmamba::silu_backward: dx has shape (5, 3) but x has shape (3, 5); they must be equal");
  }
}

}  // namespace
