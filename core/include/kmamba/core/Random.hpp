// Deterministic counter-based random numbers (Philox4x32-10).
//
// The value written to an element depends only on (seed, the element's row-major flat index), never
// on the thread count or the order of work, and a tensor can be filled in pieces (offsets) with the
// same result as in one go. Uniform values are bit-identical on every backend. Normal values are
// bit-identical among the host backends; on CUDA they agree with the host to a few units in the last
// place, because the device's log and cos are not the host's libm.
#ifndef KMAMBA_CORE_RANDOM_HPP
#define KMAMBA_CORE_RANDOM_HPP

#include <kmamba/core/Bf16.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/Profiling.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/impl/RandomImpl.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>

namespace kmamba {

/// Philox4x32-10 block: four 32-bit outputs for a 128-bit counter and a 64-bit key.
KOKKOS_INLINE_FUNCTION Kokkos::Array<std::uint32_t, 4> philox4x32(Kokkos::Array<std::uint32_t, 4> counter,
                                                                  std::uint32_t key0, std::uint32_t key1) {
  return impl::philox4x32_10(counter, key0, key1);
}

/// Uniform float in [0, 1) for stream position `index` of generator `seed` (24 random bits).
KOKKOS_INLINE_FUNCTION float uniform_at(std::uint64_t seed, std::uint64_t index) {
  return impl::uniform_at(seed, index);
}

/// Standard normal float for stream position `index` of generator `seed` (Box-Muller).
KOKKOS_INLINE_FUNCTION float normal_at(std::uint64_t seed, std::uint64_t index) { return impl::normal_at(seed, index); }

/// Fills `view` (any rank <= 8, element type float, double or bf16) with values uniform in
/// [lo, hi). Element with row-major flat index i gets lo + (hi - lo) * uniform_at(seed, offset + i).
/// Non-blocking on `exec`.
template <class ExecutionSpace, class ViewType>
void fill_uniform(const ExecutionSpace& exec, const ViewType& view, std::uint64_t seed, float lo, float hi,
                  std::uint64_t offset = 0) {
  const ProfilingRegion region("kmamba::fill_uniform");
  KMAMBA_REQUIRE(lo <= hi, "kmamba::fill_uniform: lo must not exceed hi, got lo=" << lo << " hi=" << hi);
  check_allocated("kmamba::fill_uniform", "view", view);
  impl::fill_random(exec, view, impl::UniformDraw{seed, offset, lo, hi - lo}, "kmamba::random::fill_uniform");
}

template <class ViewType>
void fill_uniform(const ViewType& view, std::uint64_t seed, float lo, float hi, std::uint64_t offset = 0) {
  fill_uniform(typename ViewType::execution_space(), view, seed, lo, hi, offset);
}

/// Fills `view` with normal values of the given mean and standard deviation; element with
/// row-major flat index i gets mean + stddev * normal_at(seed, offset + i). Non-blocking on `exec`.
template <class ExecutionSpace, class ViewType>
void fill_normal(const ExecutionSpace& exec, const ViewType& view, std::uint64_t seed, float mean, float stddev,
                 std::uint64_t offset = 0) {
  const ProfilingRegion region("kmamba::fill_normal");
  KMAMBA_REQUIRE(stddev >= 0.0f, "kmamba::fill_normal: stddev must be >= 0, got " << stddev);
  check_allocated("kmamba::fill_normal", "view", view);
  impl::fill_random(exec, view, impl::NormalDraw{seed, offset, mean, stddev}, "kmamba::random::fill_normal");
}

template <class ViewType>
void fill_normal(const ViewType& view, std::uint64_t seed, float mean, float stddev, std::uint64_t offset = 0) {
  fill_normal(typename ViewType::execution_space(), view, seed, mean, stddev, offset);
}

}  // namespace kmamba

#endif
