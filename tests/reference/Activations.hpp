// Double-precision references of the scalar activations the kernels use, one definition each.
// softplus follows PyTorch's (and the kernels') threshold: above 20 it is the identity, whose
// derivative is then 1.
#ifndef KMAMBA_TESTS_REFERENCE_ACTIVATIONS_HPP
#define KMAMBA_TESTS_REFERENCE_ACTIVATIONS_HPP

#include <cmath>

namespace kmamba {
namespace reference {

inline double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

inline double silu(double v) { return v * sigmoid(v); }

/// d silu / dv = σ(v)·(1 + v·(1 − σ(v))).
inline double silu_derivative(double v) {
  const double s = sigmoid(v);
  return s * (1.0 + v * (1.0 - s));
}

inline double softplus(double v) { return v > 20.0 ? v : std::log1p(std::exp(v)); }

inline double softplus_derivative(double v) { return v > 20.0 ? 1.0 : sigmoid(v); }

}  // namespace reference
}  // namespace kmamba

#endif
