#include <kmamba/core/Core.hpp>

#include "Backends.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>

namespace {

TEST(Philox, KnownAnswers) {
  // Known-answer vectors of the Random123 reference implementation (philox4x32, 10 rounds).
  auto r = kmamba::philox4x32({{0u, 0u, 0u, 0u}}, 0u, 0u);
  EXPECT_EQ(r[0], 0x6627e8d5u);
  EXPECT_EQ(r[1], 0xe169c58du);
  EXPECT_EQ(r[2], 0xbc57ac4cu);
  EXPECT_EQ(r[3], 0x9b00dbd8u);
  r = kmamba::philox4x32({{0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu}}, 0xffffffffu, 0xffffffffu);
  EXPECT_EQ(r[0], 0x408f276du);
  EXPECT_EQ(r[1], 0x41c83b0eu);
  EXPECT_EQ(r[2], 0xa20bc7c6u);
  EXPECT_EQ(r[3], 0x6d5451fdu);
  r = kmamba::philox4x32({{0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u}}, 0xa4093822u, 0x299f31d0u);
  EXPECT_EQ(r[0], 0xd16cfe09u);
  EXPECT_EQ(r[1], 0x94fdccebu);
  EXPECT_EQ(r[2], 0x5001e420u);
  EXPECT_EQ(r[3], 0x24126ea1u);
}

KMAMBA_BACKEND_TEST_SUITE(RandomFill);

TYPED_TEST(RandomFill, UniformDependsOnlyOnSeedAndFlatIndex) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const std::uint64_t seed = 0x1234abcdull;
  auto x = kmamba::allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::x", 3, 50, 7);
  kmamba::fill_uniform(Exec(), x, seed, -2.0f, 3.0f);
  auto h = kmamba::test::to_host(x);
  std::uint64_t flat = 0;
  double sum = 0.0, sumsq = 0.0;
  for (std::size_t i = 0; i < 3; ++i)
    for (std::size_t j = 0; j < 50; ++j)
      for (std::size_t k = 0; k < 7; ++k, ++flat) {
        const float expected = -2.0f + 5.0f * kmamba::uniform_at(seed, flat);
        ASSERT_EQ(h(i, j, k), expected) << "(" << i << ", " << j << ", " << k << ")";
        ASSERT_GE(h(i, j, k), -2.0f);
        ASSERT_LT(h(i, j, k), 3.0f);
        sum += h(i, j, k);
        sumsq += static_cast<double>(h(i, j, k)) * h(i, j, k);
      }
  const double n = 3.0 * 50 * 7;
  const double mean = sum / n, var = sumsq / n - mean * mean;
  EXPECT_NEAR(mean, 0.5, 5.0 * std::sqrt(25.0 / 12.0 / n));
  EXPECT_NEAR(var, 25.0 / 12.0, 0.25);
}

TYPED_TEST(RandomFill, NormalHasRightMoments) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const int n = 1 << 20;
  auto x = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::x", n);
  kmamba::fill_normal(Exec(), x, 99, 1.5f, 2.0f);
  auto h = kmamba::test::to_host(x);
  double sum = 0.0, sumsq = 0.0, fourth = 0.0;
  for (int i = 0; i < n; ++i) {
    ASSERT_TRUE(std::isfinite(h(i)));
    const float z_host = kmamba::normal_at(99, static_cast<std::uint64_t>(i));
    const double tolerance = kmamba::test::libm_relative_tolerance<Exec>() * (1.5 + 2.0 * (std::fabs(z_host) + 1.0));
    ASSERT_NEAR(h(i), 1.5f + 2.0f * z_host, tolerance) << "element " << i;
    const double z = (h(i) - 1.5) / 2.0;
    sum += z;
    sumsq += z * z;
    fourth += z * z * z * z;
  }
  EXPECT_NEAR(sum / n, 0.0, 5.0 / std::sqrt(double(n)));
  EXPECT_NEAR(sumsq / n, 1.0, 0.01);
  EXPECT_NEAR(fourth / n, 3.0, 0.05);  // kurtosis of a normal
}

TYPED_TEST(RandomFill, PiecesWithOffsetsEqualOneFill) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const int n = 1001;
  auto whole = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::whole", n);
  auto piece_a = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::a", 400);
  auto piece_b = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::b", n - 400);
  kmamba::fill_normal(Exec(), whole, 7, 0.0f, 1.0f);
  kmamba::fill_normal(Exec(), piece_a, 7, 0.0f, 1.0f, 0);
  kmamba::fill_normal(Exec(), piece_b, 7, 0.0f, 1.0f, 400);
  auto w = kmamba::test::to_host(whole);
  auto a = kmamba::test::to_host(piece_a);
  auto b = kmamba::test::to_host(piece_b);
  for (int i = 0; i < 400; ++i) ASSERT_EQ(a(i), w(i));
  for (int i = 400; i < n; ++i) ASSERT_EQ(b(i - 400), w(i));
  // A different seed gives a different stream.
  kmamba::fill_normal(Exec(), piece_a, 8, 0.0f, 1.0f, 0);
  auto a8 = kmamba::test::to_host(piece_a);
  int equal = 0;
  for (int i = 0; i < 400; ++i) equal += (a8(i) == w(i));
  EXPECT_LT(equal, 2);
}

TYPED_TEST(RandomFill, LayoutAndStorageTypeDoNotChangeValues) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  Kokkos::View<float**, Kokkos::LayoutLeft, Mem> left("kmamba::test::left", 9, 13);
  auto right = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::right", 9, 13);
  auto half = kmamba::allocate_uninitialized<kmamba::Tensor2<kmamba::bf16, Mem>>("kmamba::test::half", 9, 13);
  kmamba::fill_uniform(Exec(), left, 5, 0.0f, 1.0f);
  kmamba::fill_uniform(Exec(), right, 5, 0.0f, 1.0f);
  kmamba::fill_uniform(Exec(), half, 5, 0.0f, 1.0f);
  auto l = kmamba::test::to_host(left);
  auto r = kmamba::test::to_host(right);
  auto h = kmamba::test::to_host(half);
  for (int i = 0; i < 9; ++i)
    for (int j = 0; j < 13; ++j) {
      ASSERT_EQ(l(i, j), r(i, j));
      ASSERT_EQ(h(i, j).bits, kmamba::bf16(r(i, j)).bits);
    }
}

TYPED_TEST(RandomFill, RejectsBadArguments) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  auto x = kmamba::allocate<kmamba::Tensor1<float, Mem>>("kmamba::test::x", 4);
  EXPECT_THROW(kmamba::fill_uniform(Exec(), x, 1, 2.0f, 1.0f), kmamba::UserError);
  EXPECT_THROW(kmamba::fill_normal(Exec(), x, 1, 0.0f, -1.0f), kmamba::UserError);
  kmamba::Tensor1<float, Mem> empty;
  EXPECT_NO_THROW(kmamba::fill_uniform(Exec(), empty, 1, 0.0f, 1.0f));
}

}  // namespace
