// The hardware's approximate transcendental functions for the chunk kernels' decays and gates,
// with the exact functions of kmamba/core/Math.hpp on every backend without them.
//
// Where they are used, their results become operands of bf16 products or scale fp32 sums whose
// terms already carry a relative error of 2^-9 (the bf16 rounding of their operands), so their
// own errors, far smaller, do not show:
// - exp2_approx: ex2.approx.ftz, relative error about 2^-22; results below 2^-126 flushed to zero
//   (a decay that small is zero either way);
// - exp_approx(x) = exp2_approx(x·log2 e): the rounding of the product adds a relative error of
//   |x|·2^-24 (below 2^-14 for |x| < 1024; beyond that the decay underflows or the kernel's
//   inputs are out of range anyway);
// - sigmoid_approx, silu_approx: exp_approx and rcp.approx (relative error 2^-23).
#ifndef KMAMBA_CORE_IMPL_DEVICEMATH_HPP
#define KMAMBA_CORE_IMPL_DEVICEMATH_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Math.hpp>

#include <Kokkos_Core.hpp>

namespace kmamba {
namespace impl {

constexpr float device_math_log2e = 1.4426950408889634f;

/// 2^x.
KOKKOS_INLINE_FUNCTION float exp2_approx(const float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return kmamba::math::exp2(x);
#endif
}

/// e^x.
KOKKOS_INLINE_FUNCTION float exp_approx(const float x) {
#if defined(__CUDA_ARCH__)
  return exp2_approx(x * device_math_log2e);
#else
  return kmamba::math::exp(x);
#endif
}

/// 1 / (1 + e^-x).
KOKKOS_INLINE_FUNCTION float sigmoid_approx(const float x) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(1.0f + exp_approx(-x)));
  return r;
#else
  return kmamba::sigmoid(x);
#endif
}

/// x · sigmoid(x).
KOKKOS_INLINE_FUNCTION float silu_approx(const float x) { return x * sigmoid_approx(x); }

}  // namespace impl
}  // namespace kmamba

#endif
