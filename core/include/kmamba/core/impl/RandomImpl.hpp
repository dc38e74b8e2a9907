// Internals of kmamba/core/Random.hpp.
#ifndef KMAMBA_CORE_IMPL_RANDOMIMPL_HPP
#define KMAMBA_CORE_IMPL_RANDOMIMPL_HPP

#include <kmamba/core/Bf16.hpp>
#include <kmamba/core/Math.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <string>

namespace kmamba {
namespace impl {

KOKKOS_INLINE_FUNCTION void mulhilo32(std::uint32_t a, std::uint32_t b, std::uint32_t& hi, std::uint32_t& lo) {
  const std::uint64_t product = static_cast<std::uint64_t>(a) * static_cast<std::uint64_t>(b);
  hi = static_cast<std::uint32_t>(product >> 32);
  lo = static_cast<std::uint32_t>(product);
}

// Philox4x32 with 10 rounds (Salmon et al., SC'11), the constants of the Random123 reference.
KOKKOS_INLINE_FUNCTION Kokkos::Array<std::uint32_t, 4> philox4x32_10(Kokkos::Array<std::uint32_t, 4> c,
                                                                     std::uint32_t k0, std::uint32_t k1) {
  constexpr std::uint32_t m0 = 0xD2511F53u, m1 = 0xCD9E8D57u;
  constexpr std::uint32_t w0 = 0x9E3779B9u, w1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    std::uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(m0, c[0], hi0, lo0);
    mulhilo32(m1, c[2], hi1, lo1);
    const Kokkos::Array<std::uint32_t, 4> next = {{hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0}};
    c = next;
    k0 += w0;
    k1 += w1;
  }
  return c;
}

// One Philox block serves two consecutive indices: words (0,1) for even, (2,3) for odd.
KOKKOS_INLINE_FUNCTION void philox_pair(std::uint64_t seed, std::uint64_t index, std::uint32_t& a, std::uint32_t& b) {
  const std::uint64_t block = index >> 1;
  const Kokkos::Array<std::uint32_t, 4> counter = {
      {static_cast<std::uint32_t>(block), static_cast<std::uint32_t>(block >> 32), 0x6b6d616du, 0u}};
  const Kokkos::Array<std::uint32_t, 4> r =
      philox4x32_10(counter, static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
  const int half = static_cast<int>(index & 1u) * 2;
  a = r[half];
  b = r[half + 1];
}

// 24 high bits -> [0, 1) exactly representable in float.
KOKKOS_INLINE_FUNCTION float unit_float(std::uint32_t bits) {
  return static_cast<float>(bits >> 8) * (1.0f / 16777216.0f);
}

KOKKOS_INLINE_FUNCTION float uniform_at(std::uint64_t seed, std::uint64_t index) {
  std::uint32_t a, b;
  philox_pair(seed, index, a, b);
  return unit_float(a);
}

KOKKOS_INLINE_FUNCTION float normal_at(std::uint64_t seed, std::uint64_t index) {
  std::uint32_t a, b;
  philox_pair(seed, index, a, b);
  const float u1 = (static_cast<float>(a >> 8) + 0.5f) * (1.0f / 16777216.0f);  // (0, 1)
  const float u2 = unit_float(b);
  const float radius = kmamba::math::sqrt(-2.0f * kmamba::math::log(u1));
  return radius * kmamba::math::cos(6.28318530717958647692f * u2);
}

// lo + width * u rounded as two separate operations on every backend: nvcc would otherwise
// contract it into one fused multiply-add and the device values would differ from the host's.
KOKKOS_INLINE_FUNCTION float scale_shift_unfused(float u, float width, float lo) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(lo, __fmul_rn(width, u));
#else
  return lo + width * u;
#endif
}

struct UniformDraw {
  std::uint64_t seed, offset;
  float lo, width;
  KOKKOS_INLINE_FUNCTION float operator()(std::uint64_t i) const {
    return scale_shift_unfused(uniform_at(seed, offset + i), width, lo);
  }
};

struct NormalDraw {
  std::uint64_t seed, offset;
  float mean, stddev;
  KOKKOS_INLINE_FUNCTION float operator()(std::uint64_t i) const {
    return scale_shift_unfused(normal_at(seed, offset + i), stddev, mean);
  }
};

// Writes draw(flat row-major index) into every element of a View of rank <= 8, whatever its layout.
template <class ViewType, class Draw>
struct FillRandomFunctor {
  ViewType view;
  Draw draw;
  using value_type = typename ViewType::non_const_value_type;

  KOKKOS_INLINE_FUNCTION void operator()(const std::uint64_t flat) const {
    std::size_t idx[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::uint64_t rest = flat;
    for (int d = static_cast<int>(ViewType::rank) - 1; d >= 0; --d) {
      const std::uint64_t n = view.extent(static_cast<unsigned>(d));
      idx[d] = static_cast<std::size_t>(rest % n);
      rest /= n;
    }
    view.access(idx[0], idx[1], idx[2], idx[3], idx[4], idx[5], idx[6], idx[7]) = from_float<value_type>(draw(flat));
  }
};

template <class ExecutionSpace, class ViewType, class Draw>
void fill_random(const ExecutionSpace& exec, const ViewType& view, const Draw& draw, const std::string& label) {
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, typename ViewType::memory_space>::accessible,
                "kmamba::fill_*: the execution space cannot access the view's memory space");
  if (view.size() == 0) return;
  Kokkos::parallel_for(label,
                       Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::uint64_t>>(exec, 0, view.size()),
                       FillRandomFunctor<ViewType, Draw>{view, draw});
}

}  // namespace impl
}  // namespace kmamba

#endif
