// bf16: a 16-bit brain-float storage type usable in host and device code.
//
// kmamba computes in fp32 everywhere; bf16 is only how weights and activations may be *stored*.
// Conversion float -> bf16 rounds to nearest, ties to even; NaN stays NaN (quiet), infinities stay
// infinite, and values beyond the largest finite bf16 round to infinity as IEEE rounding does.
// Conversion bf16 -> float is exact. Works without Kokkos 4's bhalf_t.
#ifndef KMAMBA_CORE_BF16_HPP
#define KMAMBA_CORE_BF16_HPP

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <cstring>

namespace kmamba {

namespace impl {

KOKKOS_INLINE_FUNCTION std::uint32_t float_bits(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  std::uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
#endif
}

KOKKOS_INLINE_FUNCTION float float_from_bits(std::uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

}  // namespace impl

/// The bf16 bit pattern nearest to `value` (round to nearest, ties to even).
KOKKOS_INLINE_FUNCTION std::uint16_t float_to_bf16_bits(float value) {
  const std::uint32_t bits = impl::float_bits(value);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu) != 0u) {
    // NaN: keep sign and the top payload bits, force the quiet bit so it cannot become infinity.
    return static_cast<std::uint16_t>((bits >> 16) | 0x0040u);
  }
  const std::uint32_t lsb = (bits >> 16) & 1u;
  return static_cast<std::uint16_t>((bits + 0x7fffu + lsb) >> 16);
}

/// The float whose value the bf16 bit pattern `bits` holds (exact).
KOKKOS_INLINE_FUNCTION float bf16_bits_to_float(std::uint16_t bits) {
  return impl::float_from_bits(static_cast<std::uint32_t>(bits) << 16);
}

/// 16-bit storage type: 1 sign bit, 8 exponent bits, 7 mantissa bits.
struct bf16 {
  std::uint16_t bits;

  KOKKOS_DEFAULTED_FUNCTION bf16() = default;
  KOKKOS_INLINE_FUNCTION explicit bf16(float value) : bits(float_to_bf16_bits(value)) {}
  KOKKOS_INLINE_FUNCTION explicit operator float() const { return bf16_bits_to_float(bits); }

  KOKKOS_INLINE_FUNCTION static bf16 from_bits(std::uint16_t raw) {
    bf16 b;
    b.bits = raw;
    return b;
  }
};

static_assert(sizeof(bf16) == 2, "bf16 must be 16 bits");

/// Converts between fp32 compute values and a storage type (float, double or bf16).
template <class T>
KOKKOS_INLINE_FUNCTION T from_float(float value) {
  return static_cast<T>(value);
}
template <>
KOKKOS_INLINE_FUNCTION bf16 from_float<bf16>(float value) {
  return bf16(value);
}
template <class T>
KOKKOS_INLINE_FUNCTION float to_float(const T& value) {
  return static_cast<float>(value);
}

}  // namespace kmamba

#endif
