// The Mamba-3 mixer's elementwise kernels between in_proj and the Mamba-3 scan
// (docs/algorithms.md §3.2) and their backward.
#ifndef KMAMBA_MODELS_SRC_MAMBA3KERNELS_HPP
#define KMAMBA_MODELS_SRC_MAMBA3KERNELS_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Tensor.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>

namespace kmamba {
namespace impl {

// The heavy-tail activation f(v) = 1 + v (v ≥ 0), 1/(1 − v) (v < 0), positive and continuous.
KOKKOS_INLINE_FUNCTION float mamba3_heavy_tail(const float v) { return v >= 0.0f ? 1.0f + v : 1.0f / (1.0f - v); }

// Per token (row = b·seqlen + t) and head h:
//   dt(b, h, t)  = softplus(dd_dt(row, h) + dt_bias(h))
//   adt(b, h, t) = min(−f(dd_A(row, h)), −A_floor)·dt(b, h, t)
//   trap(b, h, t) = trap_in(row, h);  angles(b, t, h, :) = angle(row, :)
template <class MemorySpace>
struct Mamba3PreprocessFunctor {
  ConstTensor2<float, MemorySpace> dd_dt;    // (rows, nheads)
  ConstTensor2<float, MemorySpace> dd_A;     // (rows, nheads)
  ConstTensor2<float, MemorySpace> trap_in;  // (rows, nheads)
  ConstTensor2<float, MemorySpace> angle;    // (rows, nangles)
  ConstTensor1<float, MemorySpace> dt_bias;  // (nheads)
  Tensor3<float, MemorySpace> dt;            // (batch, nheads, seqlen)
  Tensor3<float, MemorySpace> adt;           // (batch, nheads, seqlen)
  Tensor3<float, MemorySpace> trap;          // (batch, nheads, seqlen)
  Tensor4<float, MemorySpace> angles;        // (batch, seqlen, nheads, nangles)
  float A_floor;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const {
    const std::int64_t nheads = static_cast<std::int64_t>(dt.extent(1));
    const std::int64_t seqlen = static_cast<std::int64_t>(dt.extent(2));
    const std::int64_t row = i / nheads;
    const int h = static_cast<int>(i % nheads);
    const std::int64_t b = row / seqlen, t = row % seqlen;
    const float delta = softplus(dd_dt(row, h) + dt_bias(h));
    float A = -mamba3_heavy_tail(dd_A(row, h));
    A = A < -A_floor ? A : -A_floor;
    dt(b, h, t) = delta;
    adt(b, h, t) = A * delta;
    trap(b, h, t) = trap_in(row, h);
    for (int s = 0; s < static_cast<int>(angle.extent(1)); ++s) angles(b, t, h, s) = angle(row, s);
  }
};

// Backward of Mamba3PreprocessFunctor, per token and head: with dΔ = ddt + dadt·A and dA = dadt·Δ,
//   d_dd_dt = dΔ·σ(dd_dt + dt_bias) (1 above the softplus threshold)
//   d_dd_A  = −dA·f′(dd_A), 0 where A is clamped at −A_floor
//   d_trap  = dtrap
template <class MemorySpace>
struct Mamba3PreprocessBackwardFunctor {
  ConstTensor2<float, MemorySpace> dd_dt;    // (rows, nheads)
  ConstTensor2<float, MemorySpace> dd_A;     // (rows, nheads)
  ConstTensor1<float, MemorySpace> dt_bias;  // (nheads)
  ConstTensor3<float, MemorySpace> ddt;      // (batch, nheads, seqlen)
  ConstTensor3<float, MemorySpace> dadt;     // (batch, nheads, seqlen)
  ConstTensor3<float, MemorySpace> dtrap;    // (batch, nheads, seqlen)
  Tensor2<float, MemorySpace> d_dd_dt;       // (rows, nheads)
  Tensor2<float, MemorySpace> d_dd_A;        // (rows, nheads)
  Tensor2<float, MemorySpace> d_trap;        // (rows, nheads)
  float A_floor;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const {
    const std::int64_t nheads = static_cast<std::int64_t>(ddt.extent(1));
    const std::int64_t seqlen = static_cast<std::int64_t>(ddt.extent(2));
    const std::int64_t row = i / nheads;
    const int h = static_cast<int>(i % nheads);
    const std::int64_t b = row / seqlen, t = row % seqlen;
    const float pre = dd_dt(row, h) + dt_bias(h);
    const float delta = softplus(pre);
    const float v = dd_A(row, h);
    const float f = mamba3_heavy_tail(v);
    const bool clamped = -f >= -A_floor;
    const float A = clamped ? -A_floor : -f;
    const float g_adt = dadt(b, h, t);
    const float g_delta = ddt(b, h, t) + g_adt * A;
    d_dd_dt(row, h) = g_delta * softplus_derivative(pre);
    const float df = v >= 0.0f ? 1.0f : 1.0f / ((1.0f - v) * (1.0f - v));
    d_dd_A(row, h) = clamped ? 0.0f : -g_adt * delta * df;
    d_trap(row, h) = dtrap(b, h, t);
  }
};

// d_angle(row, s) = Σ_h dangles(b, t, h, s): the angles are shared by every head.
template <class MemorySpace>
struct Mamba3AngleGradFunctor {
  ConstTensor4<float, MemorySpace> dangles;  // (batch, seqlen, nheads, nangles)
  Tensor2<float, MemorySpace> d_angle;       // (rows, nangles)

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const {
    const std::int64_t nangles = static_cast<std::int64_t>(d_angle.extent(1));
    const std::int64_t seqlen = static_cast<std::int64_t>(dangles.extent(1));
    const std::int64_t row = i / nangles;
    const int s = static_cast<int>(i % nangles);
    const std::int64_t b = row / seqlen, t = row % seqlen;
    float sum = 0.0f;
    for (int h = 0; h < static_cast<int>(dangles.extent(2)); ++h) sum += dangles(b, t, h, s);
    d_angle(row, s) = sum;
  }
};

}  // namespace impl
}  // namespace kmamba

#endif
