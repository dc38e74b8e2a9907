// Moving tensors between the tests' double vectors and device views, poisoning outputs, and the
// comparisons the kernel tests share: one definition each.
#ifndef KMAMBA_TESTS_SUPPORT_CHECKS_HPP
#define KMAMBA_TESTS_SUPPORT_CHECKS_HPP

#include "Backends.hpp"

#include <kmamba/core/Bf16.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/Tensor.hpp>

#include <gtest/gtest.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

namespace kmamba {
namespace test {

/// Every element of any view (fp32 or bf16, any rank), in storage order, widened to double.
template <class View>
std::vector<double> host_doubles(const View& view) {
  const auto h = to_host(view);
  std::vector<double> out(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) out[i] = static_cast<double>(kmamba::to_float(h.data()[i]));
  return out;
}

/// The whole content of the file `path` (an expectation fails when it cannot be read).
inline std::string file_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

/// Both moments of a kmamba::AdamW (first, second), copied to the host from where they live.
template <class Exec, class Optimizer>
std::vector<std::vector<float>> optimizer_moments(const Optimizer& opt) {
  using HostFloats = Kokkos::View<float*, Kokkos::HostSpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  std::vector<std::vector<float>> mv(2, std::vector<float>(opt.size()));
  opt.store_moments(Exec(), 0, HostFloats(mv[0].data(), opt.size()), HostFloats(mv[1].data(), opt.size()));
  Exec().fence();
  return mv;
}

/// Every element of a contiguous float view, in storage order.
template <class View>
std::vector<float> host_floats(const View& view) {
  const auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), view);
  return std::vector<float>(h.data(), h.data() + h.span());
}

/// Expects two runs of a kernel to have written the same bits: every element of the contiguous
/// float view `view` equals `first` (an earlier run's host_floats) bit for bit.
template <class View>
void expect_same_bits(const std::string& what, const View& view, const std::vector<float>& first) {
  const std::vector<float> again = host_floats(view);
  ASSERT_EQ(again.size(), first.size()) << what;
  for (std::size_t i = 0; i < again.size(); ++i) {
    std::uint32_t a = 0, b = 0;
    std::memcpy(&a, &first[i], sizeof a);
    std::memcpy(&b, &again[i], sizeof b);
    ASSERT_EQ(a, b) << what << "[" << i << "]: " << first[i] << " in the first run, " << again[i] << " in this one";
  }
}

/// Copies `values` (storage order) into `view`, rounded to its element type.
template <class View>
void upload(const View& view, const std::vector<double>& values) {
  auto h = Kokkos::create_mirror_view(view);
  EXPECT_EQ(h.size(), values.size()) << view.label();
  for (std::size_t i = 0; i < h.size() && i < values.size(); ++i)
    h.data()[i] = kmamba::from_float<typename View::non_const_value_type>(static_cast<float>(values[i]));
  Kokkos::deep_copy(view, h);
}

/// A new tensor (n) in `Mem` holding the token ids (or targets) `values`, in order.
template <class Mem>
kmamba::Tensor1<std::int64_t, Mem> device_ids(const std::string& label, const std::vector<std::int64_t>& values) {
  auto ids = kmamba::allocate_uninitialized<kmamba::Tensor1<std::int64_t, Mem>>(label, values.size());
  auto h = Kokkos::create_mirror_view(ids);
  for (std::size_t i = 0; i < values.size(); ++i) h(i) = values[i];
  Kokkos::deep_copy(ids, h);
  return ids;
}

/// Fills an allocated view with NaN, so that an element a kernel fails to write fails the comparison.
template <class View>
void poison(const View& view) {
  if (view.is_allocated())
    Kokkos::deep_copy(view,
                      kmamba::from_float<typename View::non_const_value_type>(std::numeric_limits<float>::quiet_NaN()));
}

/// A new view of the given extents, filled with NaN (poison).
template <class View, class... Extents>
View poisoned(const std::string& label, Extents... extents) {
  View view = kmamba::allocate_uninitialized<View>(label, extents...);
  poison(view);
  return view;
}

/// Expects `call` to throw a kmamba::UserError whose message contains every one of `parts`.
inline void expect_user_error(const std::function<void()>& call, const std::vector<std::string>& parts) {
  try {
    call();
    ADD_FAILURE() << "no kmamba::UserError thrown";
  } catch (const kmamba::UserError& e) {
    const std::string message = e.what();
    for (const std::string& part : parts)
      EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' missing from: " << message;
  }
}

/// The message of the kmamba::UserError `call` throws; a test failure and "" when it throws none.
inline std::string user_error(const std::function<void()>& call) {
  try {
    call();
  } catch (const kmamba::UserError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no kmamba::UserError thrown";
  return "";
}

/// Expects every `got` finite and max|got − ref| ≤ tol·max(max|ref|, floor); returns
/// max|got − ref| / max(max|ref|, floor) (the absolute error where that scale is 0).
inline double expect_near_rel(const std::string& what, const std::vector<double>& got, const std::vector<double>& ref,
                              double tol, const std::string& context, double floor = 0.0) {
  EXPECT_EQ(got.size(), ref.size()) << what << " " << context;
  if (got.size() != ref.size()) return 0.0;
  double scale = 0.0, err = 0.0;
  std::size_t worst_at = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ADD_FAILURE() << what << "[" << i << "] = " << got[i] << " " << context;
      return 0.0;
    }
    scale = std::max(scale, std::fabs(ref[i]));
    if (std::fabs(got[i] - ref[i]) > err) {
      err = std::fabs(got[i] - ref[i]);
      worst_at = i;
    }
  }
  scale = std::max(scale, floor);
  EXPECT_LE(err, tol * std::max(scale, 1e-30))
      << what << ": max|Δ| = " << err << " at " << worst_at << " (got " << got[worst_at] << ", ref " << ref[worst_at]
      << "), scale = " << scale << " " << context;
  return scale > 0.0 ? err / scale : err;
}

/// max|got − ref| / max|ref| over two equally long vectors.
template <class T>
double max_relative_error(const std::vector<T>& got, const std::vector<T>& ref) {
  EXPECT_EQ(got.size(), ref.size());
  double diff = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < std::min(got.size(), ref.size()); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(got[i]) - static_cast<double>(ref[i])));
    scale = std::max(scale, std::abs(static_cast<double>(ref[i])));
  }
  return diff / std::max(scale, 1e-30);
}

/// ‖got − ref‖₂ / ‖ref‖₂ over two equally long vectors.
template <class T>
double l2_relative_error(const std::vector<T>& got, const std::vector<T>& ref) {
  EXPECT_EQ(got.size(), ref.size());
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < std::min(got.size(), ref.size()); ++i) {
    const double d = static_cast<double>(got[i]) - static_cast<double>(ref[i]);
    diff += d * d;
    norm += static_cast<double>(ref[i]) * static_cast<double>(ref[i]);
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

/// The gradient `grad` of F(h) = Σ outputs(h)·dout at h0 against the central difference
/// (F(h0 + ε·v) − F(h0 − ε·v)) / 2ε along the direction v, where outputs(h) runs an fp32 op on the
/// state h. Bound: each fp32 output within output_tolerance of the largest puts F within
/// output_tolerance·max|out|·Σ|dout|, which the difference divides by ε; each gradient element within
/// gradient_tolerance of the largest puts g·v within gradient_tolerance·max|g|·Σ|v|.
inline void expect_gradient_matches_central_difference(
    const std::function<std::vector<double>(const std::vector<double>&)>& outputs, const std::vector<double>& h0,
    const std::vector<double>& dout, const std::vector<double>& grad, const std::vector<double>& v, double eps,
    double output_tolerance, double gradient_tolerance, const std::string& ctx) {
  double max_out = 0.0, sum_dout = 0.0;
  for (const double g : dout) sum_dout += std::fabs(g);
  const auto F = [&](double s) {
    std::vector<double> h(h0.size());
    for (std::size_t i = 0; i < h.size(); ++i) h[i] = h0[i] + s * eps * v[i];
    const std::vector<double> o = outputs(h);
    double f = 0.0;
    for (std::size_t i = 0; i < o.size(); ++i) {
      f += o[i] * dout[i];
      max_out = std::max(max_out, std::fabs(o[i]));
    }
    return f;
  };
  const double fd = (F(1.0) - F(-1.0)) / (2.0 * eps);
  double analytic = 0.0, max_g = 0.0, sum_v = 0.0;
  for (std::size_t i = 0; i < grad.size(); ++i) {
    analytic += grad[i] * v[i];
    max_g = std::max(max_g, std::fabs(grad[i]));
    sum_v += std::fabs(v[i]);
  }
  const double bound = output_tolerance * max_out * sum_dout / eps + gradient_tolerance * max_g * sum_v;
  EXPECT_LE(std::fabs(fd - analytic), bound) << "fd " << fd << " analytic " << analytic << " " << ctx;
}

}  // namespace test
}  // namespace kmamba

#endif
