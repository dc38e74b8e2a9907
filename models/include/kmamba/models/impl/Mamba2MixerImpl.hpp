// Internals of kmamba/models/Mamba2Mixer.hpp: the small elementwise kernels around the core ops
// (A from A_log, bias broadcast and bias gradients, gradient accumulation, parameter init).
#ifndef KMAMBA_MODELS_IMPL_MAMBA2MIXERIMPL_HPP
#define KMAMBA_MODELS_IMPL_MAMBA2MIXERIMPL_HPP

#include <kmamba/core/Random.hpp>
#include <kmamba/core/Tensor.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>

namespace kmamba {
namespace impl {

// A(h) = −exp(A_log(h)).
template <class MemorySpace>
struct Mamba2NegExpFunctor {
  ConstTensor1<float, MemorySpace> A_log;  // (nheads)
  Tensor1<float, MemorySpace> A;           // (nheads)
  KOKKOS_INLINE_FUNCTION void operator()(const int h) const { A(h) = -Kokkos::Experimental::exp(A_log(h)); }
};

// out(r, c) = bias(offset + c): the starting value of a GEMM with beta = 1 that adds a bias.
template <class MemorySpace>
struct Mamba2BroadcastBiasFunctor {
  ConstTensor1<float, MemorySpace> bias;  // (features), the whole bias vector
  Tensor2<float, MemorySpace> out;        // (rows, width)
  int offset;
  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const {
    const std::int64_t width = static_cast<std::int64_t>(out.extent(1));
    const std::int64_t c = i % width;
    out(i / width, c) = bias(offset + c);
  }
};

// grad(offset + c) += Σ_r g(r, c), rows summed in order (deterministic).
template <class MemorySpace>
struct Mamba2BiasGradFunctor {
  ConstTensor2<float, MemorySpace> g;  // (rows, width)
  Tensor1<float, MemorySpace> grad;    // (features), the whole bias gradient
  int offset;
  KOKKOS_INLINE_FUNCTION void operator()(const int c) const {
    float sum = 0.0f;
    const std::int64_t rows = static_cast<std::int64_t>(g.extent(0));
    for (std::int64_t r = 0; r < rows; ++r) sum += g(r, c);
    grad(offset + c) += sum;
  }
};

// grad(i) += value(i).
template <class MemorySpace>
struct Mamba2AccumulateFunctor {
  ConstTensor1<float, MemorySpace> value;  // (n)
  Tensor1<float, MemorySpace> grad;        // (n)
  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const { grad(i) += value(i); }
};

// grad_A_log(h) += dA(h) · A(h), since dA/dA_log = −exp(A_log) = A.
template <class MemorySpace>
struct Mamba2ALogGradFunctor {
  ConstTensor1<float, MemorySpace> dA;  // (nheads)
  ConstTensor1<float, MemorySpace> A;   // (nheads)
  Tensor1<float, MemorySpace> grad;     // (nheads)
  KOKKOS_INLINE_FUNCTION void operator()(const int h) const { grad(h) += dA(h) * A(h); }
};

// dt_bias(h) = invsp(max(floor, exp(U·(log dt_max − log dt_min) + log dt_min))), with
// invsp(y) = y + log(−expm1(−y)) the inverse of softplus.
template <class MemorySpace>
struct Mamba2DtBiasInitFunctor {
  Tensor1<float, MemorySpace> dt_bias;  // (nheads)
  std::uint64_t seed;
  float log_dt_min, log_dt_max, dt_floor;
  KOKKOS_INLINE_FUNCTION void operator()(const int h) const {
    const float u = uniform_at(seed, static_cast<std::uint64_t>(h));
    float dt = Kokkos::Experimental::exp(u * (log_dt_max - log_dt_min) + log_dt_min);
    dt = dt < dt_floor ? dt_floor : dt;
    dt_bias(h) = dt + Kokkos::Experimental::log(-Kokkos::Experimental::expm1(-dt));
  }
};

// A_log(h) = log(U[lo, hi)).
template <class MemorySpace>
struct Mamba2ALogInitFunctor {
  Tensor1<float, MemorySpace> A_log;  // (nheads)
  std::uint64_t seed;
  float lo, hi;
  KOKKOS_INLINE_FUNCTION void operator()(const int h) const {
    A_log(h) = Kokkos::Experimental::log(lo + (hi - lo) * uniform_at(seed, static_cast<std::uint64_t>(h)));
  }
};

}  // namespace impl
}  // namespace kmamba

#endif
