// The double-precision reference of a linear layer, which the mixer references apply to their
// projections.
#ifndef KMAMBA_TESTS_REFERENCE_LINEAR_HPP
#define KMAMBA_TESTS_REFERENCE_LINEAR_HPP

#include <cstddef>
#include <vector>

namespace kmamba {
namespace reference {

/// y (rows, out) = x (rows, in) · wᵀ + bias, with w (out, in) row-major and bias (out) or null for
/// none; each sum starts at the bias and adds the products in the order of the inner index.
inline std::vector<double> linear(const std::vector<double>& x, int rows, int in, const std::vector<double>& w, int out,
                                  const std::vector<double>* bias) {
  std::vector<double> y(std::size_t(rows) * out);
  for (int r = 0; r < rows; ++r)
    for (int o = 0; o < out; ++o) {
      double s = bias ? (*bias)[o] : 0.0;
      for (int k = 0; k < in; ++k) s += x[std::size_t(r) * in + k] * w[std::size_t(o) * in + k];
      y[std::size_t(r) * out + o] = s;
    }
  return y;
}

}  // namespace reference
}  // namespace kmamba

#endif
