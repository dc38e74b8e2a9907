#include <kmamba/core/Core.hpp>

#include "Backends.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

float from_bits(std::uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}
std::uint32_t to_bits(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, sizeof(b));
  return b;
}

// Reference rounding in double: pick the nearer of the two neighbouring bf16 values, ties to the
// one with an even mantissa; overflow past the largest finite value rounds to infinity.
std::uint16_t reference_bf16(float value) {
  const std::uint32_t bits = to_bits(value);
  const std::uint16_t down = static_cast<std::uint16_t>(bits >> 16);  // truncation (toward zero)
  if ((bits & 0xffffu) == 0u) return down;
  const std::uint16_t up = static_cast<std::uint16_t>(down + 1);  // next magnitude
  const double dv = value;
  const double d_down = std::fabs(dv - static_cast<double>(kmamba::bf16_bits_to_float(down)));
  const double d_up_value = static_cast<double>(kmamba::bf16_bits_to_float(up));
  const double d_up = std::isinf(d_up_value) ? std::ldexp(1.0, 128) - std::fabs(dv) : std::fabs(d_up_value - dv);
  if (d_down < d_up) return down;
  if (d_up < d_down) return up;
  return (down & 1u) ? up : down;
}

TEST(Bf16, EveryPatternRoundTripsExactly) {
  for (std::uint32_t b = 0; b < 65536u; ++b) {
    const std::uint16_t bits = static_cast<std::uint16_t>(b);
    const float f = kmamba::bf16_bits_to_float(bits);
    const std::uint16_t back = kmamba::float_to_bf16_bits(f);
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(kmamba::bf16_bits_to_float(back))) << "pattern " << b;
    } else {
      ASSERT_EQ(back, bits) << "pattern " << b;
    }
  }
}

TEST(Bf16, RoundsToNearestTiesToEven) {
  // 1 + 2^-8 lies halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(static_cast<float>(kmamba::bf16(1.0f + std::ldexp(1.0f, -8))), 1.0f);
  // 1 + 3*2^-8 lies halfway between 1 + 2^-7 (odd) and 1 + 2^-6 (even).
  EXPECT_EQ(static_cast<float>(kmamba::bf16(1.0f + 3.0f * std::ldexp(1.0f, -8))), 1.0f + std::ldexp(1.0f, -6));
  // Just above the tie rounds up.
  EXPECT_EQ(static_cast<float>(kmamba::bf16(1.0f + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20))),
            1.0f + std::ldexp(1.0f, -7));
  EXPECT_EQ(static_cast<float>(kmamba::bf16(-2.5f)), -2.5f);
  EXPECT_TRUE(std::isinf(static_cast<float>(kmamba::bf16(std::numeric_limits<float>::max()))));
  EXPECT_TRUE(std::isinf(static_cast<float>(kmamba::bf16(-std::numeric_limits<float>::infinity()))));
  EXPECT_TRUE(std::isnan(static_cast<float>(kmamba::bf16(std::numeric_limits<float>::quiet_NaN()))));
  // A signalling NaN whose payload sits only in the low bits must not become infinity.
  EXPECT_TRUE(std::isnan(static_cast<float>(kmamba::bf16(from_bits(0x7f800001u)))));
  EXPECT_EQ(kmamba::bf16(-0.0f).bits, 0x8000u);
}

TEST(Bf16, MatchesReferenceRoundingOnRandomFloats) {
  for (std::uint64_t i = 0; i < 200000; ++i) {
    std::uint32_t a, b;
    kmamba::impl::philox_pair(0x5eedull, i, a, b);
    const float f = from_bits(a);
    if (std::isnan(f)) continue;
    ASSERT_EQ(kmamba::float_to_bf16_bits(f), reference_bf16(f)) << "float bits 0x" << std::hex << a;
  }
}

// Functors, not lambdas: nvcc rejects extended lambdas inside GoogleTest's private TestBody().
template <class Mem>
struct ConvertOnDevice {
  Kokkos::View<const std::uint32_t*, Mem> in;
  Kokkos::View<std::uint16_t*, Mem> out;
  Kokkos::View<std::uint32_t*, Mem> back;
  KOKKOS_INLINE_FUNCTION void operator()(const int i) const {
    const kmamba::bf16 h(kmamba::impl::float_from_bits(in(i)));
    out(i) = h.bits;
    back(i) = kmamba::impl::float_bits(static_cast<float>(h));
  }
};

KMAMBA_BACKEND_TEST_SUITE(Bf16Backend);

TYPED_TEST(Bf16Backend, DeviceConversionEqualsHost) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const int n = 1 << 18;
  Kokkos::View<std::uint32_t*, Mem> in("kmamba::test::in", n);
  Kokkos::View<std::uint16_t*, Mem> out("kmamba::test::out", n);
  Kokkos::View<std::uint32_t*, Mem> back("kmamba::test::back", n);
  auto in_h = Kokkos::create_mirror_view(in);
  for (int i = 0; i < n; ++i) {
    std::uint32_t a, b;
    kmamba::impl::philox_pair(77, static_cast<std::uint64_t>(i), a, b);
    in_h(i) = (i % 7 == 0) ? (a & 0x80ffffffu) : a;  // include subnormals and small values
  }
  in_h(0) = 0x7f800000u;  // +inf
  in_h(1) = 0x7fc00000u;  // quiet NaN
  in_h(2) = 0x3f808000u;  // exact tie 1 + 2^-8
  Kokkos::deep_copy(in, in_h);
  Kokkos::parallel_for("kmamba::test::bf16_convert", Kokkos::RangePolicy<Exec>(0, n),
                       ConvertOnDevice<Mem>{in, out, back});
  auto out_h = kmamba::test::to_host(out);
  auto back_h = kmamba::test::to_host(back);
  for (int i = 0; i < n; ++i) {
    ASSERT_EQ(out_h(i), kmamba::float_to_bf16_bits(from_bits(in_h(i)))) << "element " << i;
    ASSERT_EQ(back_h(i), static_cast<std::uint32_t>(out_h(i)) << 16) << "element " << i;
  }
}

}  // namespace
