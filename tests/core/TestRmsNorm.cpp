// RMSNorm (plain and gated, group-wise) forward and backward against a double-precision reference
// written from docs/algorithms.md §0, §2.3 and §4.2.
//
// Tolerances. fp32 kernels versus the double reference: |kernel − ref| ≤ 1e-5 · magnitude, where
// magnitude is the reference formula evaluated on absolute values (Σ|terms| instead of Σ terms).
// It equals |ref| wherever nothing cancels (y, rstd) and bounds the rounding error of any fp32
// evaluation order where something does (dx = (w·go − x̂·mean(x̂·w·go))·rstd, dweight =
// Σ_rows go·x̂, and silu′(z) = σ(z)(1 + z(1 − σ(z))), whose scale is taken as σ(z)(1 + |z|)). bf16 storage adds 2^-8
// relative for outputs rounded to bf16. The double reference backward is checked against central finite differences of
// the reference forward to 1e-6 relative + 1e-7 absolute.
#include <kmamba/core/Core.hpp>
#include <kmamba/core/RmsNorm.hpp>

#include "Activations.hpp"
#include "Backends.hpp"
#include "Checks.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace kmamba::test;
using namespace kmamba::reference;

enum class Mode {
  plain,       // rms_norm
  gate_first,  // gated_rms_norm, norm_before_gate = false: y = rmsnorm(x ⊙ silu(z)) ⊙ w
  norm_first,  // gated_rms_norm, norm_before_gate = true:  y = rmsnorm(x) ⊙ w ⊙ silu(z)
};

struct Problem {
  int rows;
  int dim;
  int group_size;
  Mode mode;
  float eps;
};

std::string describe(const Problem& p) {
  std::ostringstream os;
  os << "rows=" << p.rows << " dim=" << p.dim << " group_size=" << p.group_size << " mode="
     << (p.mode == Mode::plain        ? "plain"
         : p.mode == Mode::gate_first ? "norm_before_gate=false"
                                      : "norm_before_gate=true")
     << " eps=" << p.eps;
  return os.str();
}

// ---------------------------------------------------------------------------------------------
// Double-precision reference, straight from the spec.

// σ(v)·(1 + |v|): the scale of silu′(v)'s fp32 rounding error (1 + v(1 − σ) cancels near
// v ≈ −1.28, and 1 − σ carries an absolute error of about one ulp of 1).
double silu_derivative_magnitude(double v) { return sigmoid(v) * (1.0 + std::abs(v)); }

struct Inputs {
  std::vector<double> x, z, w, dy;  // (rows, dim), (rows, dim), (dim), (rows, dim)
};

struct Forward {
  std::vector<double> y, rstd;  // (rows, dim), (rows, groups)
};

struct Backward {
  std::vector<double> dx, dz, dweight;              // (rows, dim), (rows, dim), (dim)
  std::vector<double> dx_mag, dz_mag, dweight_mag;  // the same formulas on absolute values
};

// The normalised input v: x, or x ⊙ silu(z) when the gate comes first.
double ref_input(const Problem& p, const Inputs& in, std::size_t i) {
  return p.mode == Mode::gate_first ? in.x[i] * silu(in.z[i]) : in.x[i];
}

Forward reference_forward(const Problem& p, const Inputs& in) {
  const int groups = p.dim / p.group_size;
  Forward out{std::vector<double>(static_cast<std::size_t>(p.rows) * p.dim),
              std::vector<double>(static_cast<std::size_t>(p.rows) * groups)};
  for (int r = 0; r < p.rows; ++r) {
    for (int g = 0; g < groups; ++g) {
      const std::size_t begin = static_cast<std::size_t>(r) * p.dim + static_cast<std::size_t>(g) * p.group_size;
      double sumsq = 0.0;
      for (int k = 0; k < p.group_size; ++k) {
        const double v = ref_input(p, in, begin + k);
        sumsq += v * v;
      }
      const double rstd = 1.0 / std::sqrt(sumsq / p.group_size + static_cast<double>(p.eps));
      out.rstd[static_cast<std::size_t>(r) * groups + g] = rstd;
      for (int k = 0; k < p.group_size; ++k) {
        const std::size_t i = begin + k;
        double y = ref_input(p, in, i) * rstd * in.w[static_cast<std::size_t>(g) * p.group_size + k];
        if (p.mode == Mode::norm_first) y *= silu(in.z[i]);
        out.y[i] = y;
      }
    }
  }
  return out;
}

// docs/algorithms.md §2.3: dv = (w⊙go − x̂·mean(x̂⊙w⊙go))·r, dw += go⊙x̂;
// go = dy (⊙ silu(z) if the
// gate comes after the norm); gate first: dz = dv⊙x⊙silu′(z), dx = dv⊙silu(z); norm first:
// dz = dy⊙(x̂⊙w)⊙silu′(z), dx = dv.
Backward reference_backward(const Problem& p, const Inputs& in) {
  const int groups = p.dim / p.group_size;
  const std::size_t n = static_cast<std::size_t>(p.rows) * p.dim;
  Backward out{std::vector<double>(n), std::vector<double>(n), std::vector<double>(p.dim, 0.0),
               std::vector<double>(n), std::vector<double>(n), std::vector<double>(p.dim, 0.0)};
  const Forward fwd = reference_forward(p, in);
  for (int r = 0; r < p.rows; ++r) {
    for (int g = 0; g < groups; ++g) {
      const std::size_t begin = static_cast<std::size_t>(r) * p.dim + static_cast<std::size_t>(g) * p.group_size;
      const std::size_t wbegin = static_cast<std::size_t>(g) * p.group_size;
      const double rstd = fwd.rstd[static_cast<std::size_t>(r) * groups + g];
      std::vector<double> go(p.group_size), xhat(p.group_size);
      double mean = 0.0, mean_mag = 0.0;
      for (int k = 0; k < p.group_size; ++k) {
        const std::size_t i = begin + k;
        go[k] = p.mode == Mode::norm_first ? in.dy[i] * silu(in.z[i]) : in.dy[i];
        xhat[k] = ref_input(p, in, i) * rstd;
        mean += xhat[k] * in.w[wbegin + k] * go[k];
        mean_mag += std::abs(xhat[k] * in.w[wbegin + k] * go[k]);
      }
      mean /= p.group_size;
      mean_mag /= p.group_size;
      for (int k = 0; k < p.group_size; ++k) {
        const std::size_t i = begin + k;
        const double w = in.w[wbegin + k];
        const double dv = (w * go[k] - xhat[k] * mean) * rstd;
        const double dv_mag = (std::abs(w * go[k]) + std::abs(xhat[k]) * mean_mag) * rstd;
        switch (p.mode) {
          case Mode::plain:
            out.dx[i] = dv;
            out.dx_mag[i] = dv_mag;
            break;
          case Mode::gate_first: {
            const double s = silu(in.z[i]), ds = silu_derivative(in.z[i]);
            out.dx[i] = dv * s;
            out.dx_mag[i] = dv_mag * std::abs(s);
            out.dz[i] = dv * in.x[i] * ds;
            out.dz_mag[i] = dv_mag * std::abs(in.x[i]) * silu_derivative_magnitude(in.z[i]);
            break;
          }
          case Mode::norm_first: {
            out.dx[i] = dv;
            out.dx_mag[i] = dv_mag;
            out.dz[i] = in.dy[i] * xhat[k] * w * silu_derivative(in.z[i]);
            out.dz_mag[i] = std::abs(in.dy[i] * xhat[k] * w) * silu_derivative_magnitude(in.z[i]);
            break;
          }
        }
        out.dweight[wbegin + k] += go[k] * xhat[k];
        out.dweight_mag[wbegin + k] += std::abs(go[k] * xhat[k]);
      }
    }
  }
  return out;
}

double ref_loss(const Problem& p, const Inputs& in) {
  const Forward f = reference_forward(p, in);
  double loss = 0.0;
  for (std::size_t i = 0; i < f.y.size(); ++i) loss += f.y[i] * in.dy[i];
  return loss;
}

std::vector<double> host_normal(std::size_t n, std::uint64_t seed, float mean, float stddev) {
  std::vector<double> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = mean + stddev * kmamba::normal_at(seed, i);
  return v;
}

// ---------------------------------------------------------------------------------------------
// The reference itself.

TEST(RmsNormReference, KnownValuesAndGroupWiseNormalisation) {
  Inputs in{{3.0, 4.0, 6.0, 8.0}, {0.0, 0.0, 0.0, 0.0}, {1.0, 2.0, 1.0, 2.0}, {}};
  const Forward whole = reference_forward({1, 4, 4, Mode::plain, 0.0f}, in);
  const double r = 1.0 / std::sqrt((9.0 + 16.0 + 36.0 + 64.0) / 4.0);
  EXPECT_DOUBLE_EQ(whole.rstd[0], r);
  EXPECT_DOUBLE_EQ(whole.y[0], 3.0 * r);
  EXPECT_DOUBLE_EQ(whole.y[3], 16.0 * r);
  // Two groups of two: (3, 4) and (6, 8) each normalised separately, so both become (0.6, 0.8)·√2.
  const Forward grouped =
      reference_forward({1, 4, 2, Mode::gate_first, 0.0f}, Inputs{in.x, {50.0, 50.0, 50.0, 50.0}, in.w, {}});
  EXPECT_NEAR(grouped.y[0], 0.6 * std::sqrt(2.0), 1e-12);
  EXPECT_NEAR(grouped.y[1], 1.6 * std::sqrt(2.0), 1e-12);
  EXPECT_NEAR(grouped.y[2], 0.6 * std::sqrt(2.0), 1e-12);
  EXPECT_NEAR(grouped.y[3], 1.6 * std::sqrt(2.0), 1e-12);
}

TEST(RmsNormReference, BackwardMatchesFiniteDifferences) {
  const std::vector<Problem> problems = {
      {3, 12, 12, Mode::plain, 1e-5f},     {3, 12, 12, Mode::gate_first, 1e-5f}, {3, 12, 6, Mode::gate_first, 1e-5f},
      {3, 12, 3, Mode::gate_first, 1e-5f}, {3, 12, 12, Mode::norm_first, 1e-5f}, {3, 12, 6, Mode::norm_first, 1e-5f},
      {3, 12, 3, Mode::norm_first, 0.5f},  {4, 1, 1, Mode::plain, 0.1f},         {4, 1, 1, Mode::gate_first, 0.1f},
      {4, 1, 1, Mode::norm_first, 0.1f},
  };
  std::uint64_t seed = 1000;
  for (const Problem& p : problems) {
    SCOPED_TRACE(describe(p));
    const std::size_t n = static_cast<std::size_t>(p.rows) * p.dim;
    Inputs in{host_normal(n, seed, 0.0f, 1.0f), host_normal(n, seed + 1, 0.0f, 2.0f),
              host_normal(p.dim, seed + 2, 1.0f, 0.5f), host_normal(n, seed + 3, 0.0f, 1.0f)};
    seed += 10;
    const Backward b = reference_backward(p, in);
    auto check = [&](std::vector<double>& param, const std::vector<double>& analytic, const char* name) {
      for (std::size_t i = 0; i < param.size(); ++i) {
        const double saved = param[i];
        const double h = 1e-5 * std::max(1.0, std::abs(saved));
        param[i] = saved + h;
        const double up = ref_loss(p, in);
        param[i] = saved - h;
        const double down = ref_loss(p, in);
        param[i] = saved;
        const double fd = (up - down) / (2.0 * h);
        EXPECT_NEAR(analytic[i], fd, 1e-7 + 1e-6 * std::abs(fd)) << name << "[" << i << "]";
      }
    };
    check(in.x, b.dx, "dx");
    check(in.w, b.dweight, "dweight");
    if (p.mode != Mode::plain) check(in.z, b.dz, "dz");
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels against the reference.

// Every element must satisfy |got − ref| ≤ rtol·mag + extra_rtol·|ref| (a NaN never does).
template <class ViewType>
void expect_close(const char* what, const ViewType& view, const std::vector<double>& ref,
                  const std::vector<double>& mag, double rtol, double extra_rtol = 0.0) {
  const std::vector<double> got = host_doubles(view);
  ASSERT_EQ(got.size(), ref.size()) << what;
  std::size_t bad = 0;
  std::ostringstream first;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double tol = rtol * mag[i] + extra_rtol * std::abs(ref[i]);
    if (!(std::abs(got[i] - ref[i]) <= tol)) {
      if (bad < 5)
        first << "\n  " << what << "[" << i << "] = " << got[i] << ", reference " << ref[i] << ", tolerance " << tol;
      ++bad;
    }
  }
  EXPECT_EQ(bad, 0u) << bad << " of " << got.size() << " elements of " << what << " off:" << first.str();
}

std::vector<double> abs_of(const std::vector<double>& v) {
  std::vector<double> a(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) a[i] = std::abs(v[i]);
  return a;
}

constexpr double rtol = 1e-5;

// Runs the forward (with and without rstd) and the backward (saved and recomputed rstd) of one
// problem on fresh random inputs and compares every output with the reference. With
// use_instance = false it calls the overloads without an execution space instance (which run on
// the default execution space of Exec's memory space).
template <class Exec>
void check_problem(const Problem& p, std::uint64_t seed, bool use_instance = true) {
  using Mem = typename Exec::memory_space;
  using T1 = kmamba::Tensor1<float, Mem>;
  using T2 = kmamba::Tensor2<float, Mem>;
  SCOPED_TRACE(describe(p));
  const int groups = p.dim / p.group_size;
  auto x = kmamba::allocate_uninitialized<T2>("kmamba::test::x", p.rows, p.dim);
  auto z = kmamba::allocate_uninitialized<T2>("kmamba::test::z", p.rows, p.dim);
  auto w = kmamba::allocate_uninitialized<T1>("kmamba::test::w", p.dim);
  auto dy = kmamba::allocate_uninitialized<T2>("kmamba::test::dy", p.rows, p.dim);
  kmamba::fill_normal(Exec(), x, seed, 0.0f, 1.0f);
  kmamba::fill_normal(Exec(), z, seed + 1, 0.0f, 2.0f);
  kmamba::fill_normal(Exec(), w, seed + 2, 1.0f, 0.5f);
  kmamba::fill_normal(Exec(), dy, seed + 3, 0.0f, 1.0f);
  const Inputs in{host_doubles(x), host_doubles(z), host_doubles(w), host_doubles(dy)};
  const Forward fwd = reference_forward(p, in);
  const Backward bwd = reference_backward(p, in);
  const kmamba::ConstTensor2<float, Mem> cx = x, cz = z, cdy = dy;
  const kmamba::ConstTensor1<float, Mem> cw = w;

  auto y = kmamba::allocate_uninitialized<T2>("kmamba::test::y", p.rows, p.dim);
  auto dx = kmamba::allocate_uninitialized<T2>("kmamba::test::dx", p.rows, p.dim);
  auto dz = kmamba::allocate_uninitialized<T2>("kmamba::test::dz", p.rows, p.dim);
  auto dw = kmamba::allocate_uninitialized<T1>("kmamba::test::dw", p.dim);
  const bool nbg = p.mode == Mode::norm_first;

  if (p.mode == Mode::plain) {
    auto rstd = kmamba::allocate_uninitialized<T1>("kmamba::test::rstd", p.rows);
    poison(y);
    poison(rstd);
    if (use_instance) {
      kmamba::rms_norm(Exec(), cx, cw, p.eps, y, rstd);
    } else {
      kmamba::rms_norm(cx, cw, p.eps, y, rstd);
    }
    expect_close("y", y, fwd.y, abs_of(fwd.y), rtol);
    expect_close("rstd", rstd, fwd.rstd, fwd.rstd, rtol);
    poison(y);
    if (use_instance) {
      kmamba::rms_norm(Exec(), cx, cw, p.eps, y);
    } else {
      kmamba::rms_norm(cx, cw, p.eps, y);
    }
    expect_close("y (no rstd)", y, fwd.y, abs_of(fwd.y), rtol);

    const kmamba::ConstTensor1<float, Mem> crstd = rstd;
    poison(dx);
    poison(dw);
    if (use_instance) {
      kmamba::rms_norm_backward(Exec(), cdy, cx, cw, crstd, dx, dw);
    } else {
      kmamba::rms_norm_backward(cdy, cx, cw, crstd, dx, dw);
    }
    expect_close("dx (saved rstd)", dx, bwd.dx, bwd.dx_mag, rtol);
    expect_close("dweight (saved rstd)", dw, bwd.dweight, bwd.dweight_mag, rtol);
    poison(dx);
    poison(dw);
    if (use_instance) {
      kmamba::rms_norm_backward(Exec(), cdy, cx, cw, p.eps, dx, dw);
    } else {
      kmamba::rms_norm_backward(cdy, cx, cw, p.eps, dx, dw);
    }
    expect_close("dx (recomputed rstd)", dx, bwd.dx, bwd.dx_mag, rtol);
    expect_close("dweight (recomputed rstd)", dw, bwd.dweight, bwd.dweight_mag, rtol);
  } else {
    auto rstd = kmamba::allocate_uninitialized<T2>("kmamba::test::rstd", p.rows, groups);
    poison(y);
    poison(rstd);
    if (use_instance) {
      kmamba::gated_rms_norm(Exec(), cx, cz, cw, p.eps, p.group_size, nbg, y, rstd);
    } else {
      kmamba::gated_rms_norm(cx, cz, cw, p.eps, p.group_size, nbg, y, rstd);
    }
    expect_close("y", y, fwd.y, abs_of(fwd.y), rtol);
    expect_close("rstd", rstd, fwd.rstd, fwd.rstd, rtol);
    poison(y);
    if (use_instance) {
      kmamba::gated_rms_norm(Exec(), cx, cz, cw, p.eps, p.group_size, nbg, y);
    } else {
      kmamba::gated_rms_norm(cx, cz, cw, p.eps, p.group_size, nbg, y);
    }
    expect_close("y (no rstd)", y, fwd.y, abs_of(fwd.y), rtol);

    const kmamba::ConstTensor2<float, Mem> crstd = rstd;
    poison(dx);
    poison(dz);
    poison(dw);
    if (use_instance) {
      kmamba::gated_rms_norm_backward(Exec(), cdy, cx, cz, cw, crstd, p.group_size, nbg, dx, dz, dw);
    } else {
      kmamba::gated_rms_norm_backward(cdy, cx, cz, cw, crstd, p.group_size, nbg, dx, dz, dw);
    }
    expect_close("dx (saved rstd)", dx, bwd.dx, bwd.dx_mag, rtol);
    expect_close("dz (saved rstd)", dz, bwd.dz, bwd.dz_mag, rtol);
    expect_close("dweight (saved rstd)", dw, bwd.dweight, bwd.dweight_mag, rtol);
    poison(dx);
    poison(dz);
    poison(dw);
    if (use_instance) {
      kmamba::gated_rms_norm_backward(Exec(), cdy, cx, cz, cw, p.eps, p.group_size, nbg, dx, dz, dw);
    } else {
      kmamba::gated_rms_norm_backward(cdy, cx, cz, cw, p.eps, p.group_size, nbg, dx, dz, dw);
    }
    expect_close("dx (recomputed rstd)", dx, bwd.dx, bwd.dx_mag, rtol);
    expect_close("dz (recomputed rstd)", dz, bwd.dz, bwd.dz_mag, rtol);
    expect_close("dweight (recomputed rstd)", dw, bwd.dweight, bwd.dweight_mag, rtol);
  }
}

// dims 1, odd, 64, 512; rows 1 and many; group sizes dim, dim/2, dim/4 where they divide dim.
std::vector<Problem> sweep(Mode mode) {
  std::vector<Problem> problems;
  for (const int dim : {1, 7, 21, 64, 512}) {
    std::vector<int> group_sizes = {dim};
    if (mode != Mode::plain) {
      if (dim == 21) group_sizes.push_back(7);
      if (dim % 2 == 0) group_sizes.push_back(dim / 2);
      if (dim % 4 == 0) group_sizes.push_back(dim / 4);
    }
    for (const int rows : {1, 67}) {
      for (const int gs : group_sizes) problems.push_back({rows, dim, gs, mode, 1e-5f});
    }
  }
  return problems;
}

KMAMBA_BACKEND_TEST_SUITE(RmsNorm);

TYPED_TEST(RmsNorm, PlainMatchesReference) {
  std::uint64_t seed = 1;
  for (const Problem& p : sweep(Mode::plain)) {
    check_problem<TypeParam>(p, seed);
    seed += 10;
  }
  check_problem<TypeParam>({5, 64, 64, Mode::plain, 0.25f}, seed);  // a large eps matters
}

TYPED_TEST(RmsNorm, GatedNormAfterGateMatchesReference) {
  std::uint64_t seed = 2001;
  for (const Problem& p : sweep(Mode::gate_first)) {
    check_problem<TypeParam>(p, seed);
    seed += 10;
  }
}

TYPED_TEST(RmsNorm, GatedNormBeforeGateMatchesReference) {
  std::uint64_t seed = 4001;
  for (const Problem& p : sweep(Mode::norm_first)) {
    check_problem<TypeParam>(p, seed);
    seed += 10;
  }
}

// 4099 rows: several rows per backward block and a short last block.
TYPED_TEST(RmsNorm, ManyRowsMatchReference) {
  check_problem<TypeParam>({4099, 24, 24, Mode::plain, 1e-5f}, 6001);
  check_problem<TypeParam>({4099, 24, 8, Mode::gate_first, 1e-5f}, 6011);
  check_problem<TypeParam>({4099, 24, 12, Mode::norm_first, 1e-5f}, 6021);
}

// Groups wider than the level-0 team scratch of the host backends (32 KiB = 8192 floats).
TYPED_TEST(RmsNorm, WideGroupsMatchReference) {
  check_problem<TypeParam>({3, 9000, 9000, Mode::plain, 1e-5f}, 7001);
  check_problem<TypeParam>({3, 18000, 9000, Mode::gate_first, 1e-5f}, 7011);
}

TYPED_TEST(RmsNorm, OverloadsWithoutInstanceMatchReference) {
  check_problem<TypeParam>({6, 40, 40, Mode::plain, 1e-5f}, 8001, false);
  check_problem<TypeParam>({6, 40, 10, Mode::gate_first, 1e-5f}, 8011, false);
  check_problem<TypeParam>({6, 40, 20, Mode::norm_first, 1e-5f}, 8021, false);
}

// dweight sums many row blocks (4099 rows): on a parallel backend, runs of the backward write the
// same bits however their threads are timed, plain and gated.
TYPED_TEST(RmsNorm, BackwardRepeatsBitForBit) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using T1 = kmamba::Tensor1<float, Mem>;
  using T2 = kmamba::Tensor2<float, Mem>;
  const int rows = 4099, dim = 48, group_size = 16;
  auto x = kmamba::allocate_uninitialized<T2>("kmamba::test::x", rows, dim);
  auto z = kmamba::allocate_uninitialized<T2>("kmamba::test::z", rows, dim);
  auto dy = kmamba::allocate_uninitialized<T2>("kmamba::test::dy", rows, dim);
  auto w = kmamba::allocate_uninitialized<T1>("kmamba::test::w", dim);
  kmamba::fill_normal(Exec(), x, 9001, 0.0f, 1.0f);
  kmamba::fill_normal(Exec(), z, 9002, 0.0f, 2.0f);
  kmamba::fill_normal(Exec(), dy, 9003, 0.0f, 1.0f);
  kmamba::fill_normal(Exec(), w, 9004, 1.0f, 0.5f);
  auto dx = kmamba::allocate_uninitialized<T2>("kmamba::test::dx", rows, dim);
  auto dz = kmamba::allocate_uninitialized<T2>("kmamba::test::dz", rows, dim);
  auto dw = kmamba::allocate_uninitialized<T1>("kmamba::test::dw", dim);
  const kmamba::ConstTensor2<float, Mem> cx = x, cz = z, cdy = dy;
  const kmamba::ConstTensor1<float, Mem> cw = w;
  std::vector<float> plain, gated;
  for (int run = 0; run < 20; ++run) {
    kmamba::rms_norm_backward(Exec(), cdy, cx, cw, 1e-5f, dx, dw);
    if (run == 0) plain = host_floats(dw);
    expect_same_bits("plain dweight, run " + std::to_string(run), dw, plain);
    kmamba::gated_rms_norm_backward(Exec(), cdy, cx, cz, cw, 1e-5f, group_size, false, dx, dz, dw);
    if (run == 0) gated = host_floats(dw);
    expect_same_bits("gated dweight, run " + std::to_string(run), dw, gated);
  }
}

// bf16 storage for x, z, weight, y, dy and dx; fp32 compute, rstd and dweight.
TYPED_TEST(RmsNorm, Bf16StorageComputesInFp32) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using H2 = kmamba::Tensor2<kmamba::bf16, Mem>;
  const Problem p{9, 64, 16, Mode::gate_first, 1e-5f};
  auto x = kmamba::allocate_uninitialized<H2>("kmamba::test::x", p.rows, p.dim);
  auto z = kmamba::allocate_uninitialized<H2>("kmamba::test::z", p.rows, p.dim);
  auto dy = kmamba::allocate_uninitialized<H2>("kmamba::test::dy", p.rows, p.dim);
  auto w = kmamba::allocate_uninitialized<kmamba::Tensor1<kmamba::bf16, Mem>>("kmamba::test::w", p.dim);
  kmamba::fill_normal(Exec(), x, 11, 0.0f, 1.0f);
  kmamba::fill_normal(Exec(), z, 12, 0.0f, 2.0f);
  kmamba::fill_normal(Exec(), dy, 13, 0.0f, 1.0f);
  kmamba::fill_normal(Exec(), w, 14, 1.0f, 0.5f);
  const Inputs in{host_doubles(x), host_doubles(z), host_doubles(w), host_doubles(dy)};
  const Forward fwd = reference_forward(p, in);
  const Backward bwd = reference_backward(p, in);

  auto y = kmamba::allocate_uninitialized<H2>("kmamba::test::y", p.rows, p.dim);
  auto rstd = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::rstd", p.rows, 4);
  poison(y);
  poison(rstd);
  kmamba::gated_rms_norm(Exec(), x, z, w, p.eps, p.group_size, false, y, rstd);
  expect_close("y", y, fwd.y, abs_of(fwd.y), rtol, 1.0 / 256.0);
  expect_close("rstd", rstd, fwd.rstd, fwd.rstd, rtol);

  auto dx = kmamba::allocate_uninitialized<H2>("kmamba::test::dx", p.rows, p.dim);
  auto dz = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::dz", p.rows, p.dim);
  auto dw = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::dw", p.dim);
  poison(dx);
  poison(dz);
  poison(dw);
  kmamba::gated_rms_norm_backward(Exec(), dy, x, z, w, rstd, p.group_size, false, dx, dz, dw);
  expect_close("dx", dx, bwd.dx, bwd.dx_mag, rtol, 1.0 / 256.0);
  expect_close("dz", dz, bwd.dz, bwd.dz_mag, rtol);
  expect_close("dweight", dw, bwd.dweight, bwd.dweight_mag, rtol);

  auto plain_rstd = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::plain_rstd", p.rows);
  const Problem plain{p.rows, p.dim, p.dim, Mode::plain, p.eps};
  const Forward plain_fwd = reference_forward(plain, in);
  const Backward plain_bwd = reference_backward(plain, in);
  poison(y);
  poison(plain_rstd);
  kmamba::rms_norm(Exec(), x, w, p.eps, y, plain_rstd);
  expect_close("plain y", y, plain_fwd.y, abs_of(plain_fwd.y), rtol, 1.0 / 256.0);
  poison(dx);
  poison(dw);
  kmamba::rms_norm_backward(Exec(), dy, x, w, plain_rstd, dx, dw);
  expect_close("plain dx", dx, plain_bwd.dx, plain_bwd.dx_mag, rtol, 1.0 / 256.0);
  expect_close("plain dweight", dw, plain_bwd.dweight, plain_bwd.dweight_mag, rtol);
}

// No rows: the forward writes nothing and the backward writes dweight = 0.
TYPED_TEST(RmsNorm, NoRowsGiveZeroDweight) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using T1 = kmamba::Tensor1<float, Mem>;
  using T2 = kmamba::Tensor2<float, Mem>;
  auto x = kmamba::allocate<T2>("kmamba::test::x", 0, 8);
  auto w = kmamba::allocate<T1>("kmamba::test::w", 8);
  auto rstd = kmamba::allocate<kmamba::Tensor2<float, Mem>>("kmamba::test::rstd", 0, 2);
  auto dw = kmamba::allocate_uninitialized<T1>("kmamba::test::dw", 8);
  kmamba::gated_rms_norm(Exec(), x, x, w, 1e-5f, 4, false, x, rstd);
  poison(dw);
  kmamba::gated_rms_norm_backward(Exec(), x, x, x, w, rstd, 4, false, x, x, dw);
  expect_close("dweight", dw, std::vector<double>(8, 0.0), std::vector<double>(8, 0.0), rtol);
  poison(dw);
  kmamba::rms_norm_backward(Exec(), x, x, w, 1e-5f, x, dw);
  expect_close("plain dweight", dw, std::vector<double>(8, 0.0), std::vector<double>(8, 0.0), rtol);
}

TYPED_TEST(RmsNorm, ShapeErrorsNameBothShapes) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using T1 = kmamba::Tensor1<float, Mem>;
  using T2 = kmamba::Tensor2<float, Mem>;
  const Exec exec;
  auto x = kmamba::allocate<T2>("kmamba::test::x", 5, 8);
  auto x_narrow = kmamba::allocate<T2>("kmamba::test::x_narrow", 5, 7);
  auto x_short = kmamba::allocate<T2>("kmamba::test::x_short", 4, 8);
  auto w = kmamba::allocate<T1>("kmamba::test::w", 8);
  auto w_long = kmamba::allocate<T1>("kmamba::test::w_long", 9);
  auto rstd = kmamba::allocate<T1>("kmamba::test::rstd", 5);
  auto rstd_short = kmamba::allocate<T1>("kmamba::test::rstd_short", 4);
  auto grstd = kmamba::allocate<T2>("kmamba::test::grstd", 5, 4);  // group_size 2
  auto grstd_bad = kmamba::allocate<T2>("kmamba::test::grstd_bad", 5, 2);

  expect_user_error([&] { kmamba::rms_norm(exec, x, w_long, 1e-5f, x); },
                    {"kmamba::rms_norm", "weight", "(9,)", "(8,)"});
  expect_user_error([&] { kmamba::rms_norm(exec, x, w, 1e-5f, x_narrow); },
                    {"kmamba::rms_norm", "y", "(5, 7)", "(5, 8)"});
  expect_user_error([&] { kmamba::rms_norm(exec, x, w, 1e-5f, x, rstd_short); },
                    {"kmamba::rms_norm", "rstd", "(4,)", "(5,)"});
  expect_user_error([&] { kmamba::rms_norm_backward(exec, x_short, x, w, rstd, x, w); },
                    {"kmamba::rms_norm_backward", "dy", "(4, 8)", "(5, 8)"});
  expect_user_error([&] { kmamba::rms_norm_backward(exec, x, x, w, rstd_short, x, w); },
                    {"kmamba::rms_norm_backward", "rstd", "(4,)", "(5,)"});
  expect_user_error([&] { kmamba::rms_norm_backward(exec, x, x, w, 1e-5f, x_narrow, w); },
                    {"kmamba::rms_norm_backward", "dx", "(5, 7)", "(5, 8)"});
  expect_user_error([&] { kmamba::rms_norm_backward(exec, x, x, w, 1e-5f, x, w_long); },
                    {"kmamba::rms_norm_backward", "dweight", "(9,)", "(8,)"});

  expect_user_error([&] { kmamba::gated_rms_norm(exec, x, x_narrow, w, 1e-5f, 2, false, x, grstd); },
                    {"kmamba::gated_rms_norm", "z", "(5, 7)", "(5, 8)"});
  expect_user_error([&] { kmamba::gated_rms_norm(exec, x, x, w, 1e-5f, 2, true, x, grstd_bad); },
                    {"kmamba::gated_rms_norm", "rstd", "(5, 2)", "(5, 4)"});
  expect_user_error([&] { kmamba::gated_rms_norm(exec, x, x, w_long, 1e-5f, 2, true, x); },
                    {"kmamba::gated_rms_norm", "weight", "(9,)", "(8,)"});
  expect_user_error([&] { kmamba::gated_rms_norm_backward(exec, x, x, x, w, grstd_bad, 2, false, x, x, w); },
                    {"kmamba::gated_rms_norm_backward", "rstd", "(5, 2)", "(5, 4)"});
  expect_user_error([&] { kmamba::gated_rms_norm_backward(exec, x, x, x, w, grstd, 2, false, x, x_short, w); },
                    {"kmamba::gated_rms_norm_backward", "dz", "(4, 8)", "(5, 8)"});
  expect_user_error(
      [&] {
        kmamba::gated_rms_norm_backward(exec, x_narrow, x_narrow, x_narrow, w, 1e-5f, 7, false, x_narrow, x_narrow, w);
      },
      {"kmamba::gated_rms_norm_backward", "weight", "(8,)", "(7,)"});
}

TYPED_TEST(RmsNorm, RejectsBadGroupSizeAndEps) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using T1 = kmamba::Tensor1<float, Mem>;
  using T2 = kmamba::Tensor2<float, Mem>;
  const Exec exec;
  auto x = kmamba::allocate<T2>("kmamba::test::x", 5, 8);
  auto w = kmamba::allocate<T1>("kmamba::test::w", 8);
  auto rstd = kmamba::allocate<T2>("kmamba::test::rstd", 5, 2);
  auto empty_dim = kmamba::allocate<T2>("kmamba::test::empty_dim", 5, 0);
  auto empty_w = kmamba::allocate<T1>("kmamba::test::empty_w", 0);

  expect_user_error([&] { kmamba::gated_rms_norm(exec, x, x, w, 1e-5f, 3, false, x, rstd); },
                    {"kmamba::gated_rms_norm", "group_size 3", "dim 8"});
  expect_user_error([&] { kmamba::gated_rms_norm(exec, x, x, w, 1e-5f, 0, true, x); },
                    {"kmamba::gated_rms_norm", "group_size 0"});
  expect_user_error([&] { kmamba::gated_rms_norm(exec, x, x, w, 1e-5f, 16, true, x); },
                    {"kmamba::gated_rms_norm", "group_size 16", "dim 8"});
  expect_user_error([&] { kmamba::gated_rms_norm_backward(exec, x, x, x, w, rstd, 5, false, x, x, w); },
                    {"kmamba::gated_rms_norm_backward", "group_size 5", "dim 8"});
  expect_user_error([&] { kmamba::gated_rms_norm_backward(exec, x, x, x, w, 1e-5f, 6, true, x, x, w); },
                    {"kmamba::gated_rms_norm_backward", "group_size 6", "dim 8"});
  expect_user_error([&] { kmamba::rms_norm(exec, x, w, -1.0f, x); }, {"kmamba::rms_norm", "eps"});
  expect_user_error([&] { kmamba::gated_rms_norm(exec, x, x, w, -1e-5f, 4, false, x); },
                    {"kmamba::gated_rms_norm", "eps"});
  expect_user_error([&] { kmamba::rms_norm(exec, empty_dim, empty_w, 1e-5f, empty_dim); },
                    {"kmamba::rms_norm", "(5, 0)", "dim >= 1"});
}

// add_rms_norm: the residual becomes the fp32 sum residual + delta exactly (one rounding, as a
// separate add), y the reference plain norm of that sum (tolerance as above).
TYPED_TEST(RmsNorm, AddThenNormMatchesReference) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using T1 = kmamba::Tensor1<float, Mem>;
  using T2 = kmamba::Tensor2<float, Mem>;
  const Exec exec;
  std::uint64_t seed = 9001;
  for (const int dim : {1, 7, 64, 768, 9000}) {
    for (const int rows : {1, 67}) {
      const Problem p{rows, dim, dim, Mode::plain, dim == 7 ? 0.25f : 1e-5f};
      SCOPED_TRACE(describe(p));
      auto residual = kmamba::allocate_uninitialized<T2>("kmamba::test::residual", rows, dim);
      auto delta = kmamba::allocate_uninitialized<T2>("kmamba::test::delta", rows, dim);
      auto w = kmamba::allocate_uninitialized<T1>("kmamba::test::w", dim);
      auto y = kmamba::allocate_uninitialized<T2>("kmamba::test::y", rows, dim);
      kmamba::fill_normal(exec, residual, seed, 0.5f, 1.0f);
      kmamba::fill_normal(exec, delta, seed + 1, -0.5f, 2.0f);
      kmamba::fill_normal(exec, w, seed + 2, 1.0f, 0.5f);
      seed += 10;
      poison(y);
      const auto r0 = kmamba::test::to_host(residual);
      const auto d0 = kmamba::test::to_host(delta);
      std::vector<double> sum(r0.size());
      for (std::size_t i = 0; i < sum.size(); ++i) sum[i] = static_cast<float>(r0.data()[i] + d0.data()[i]);
      const Forward fwd = reference_forward(p, Inputs{sum, {}, host_doubles(w), {}});
      if (rows == 1) {
        kmamba::add_rms_norm(exec, residual, delta, w, p.eps, y);
      } else {
        kmamba::add_rms_norm(residual, delta, w, p.eps, y);  // the overload without an instance
      }
      exec.fence();
      expect_close("residual", residual, sum, abs_of(sum), 0.0);
      expect_close("y", y, fwd.y, abs_of(fwd.y), rtol);
    }
  }
  auto r = kmamba::allocate<T2>("kmamba::test::r", 5, 8);
  auto w = kmamba::allocate<T1>("kmamba::test::w", 8);
  expect_user_error([&] { kmamba::add_rms_norm(exec, r, kmamba::allocate<T2>("kmamba::test::d", 5, 7), w, 1e-5f, r); },
                    {"kmamba::add_rms_norm", "delta", "(5, 7)", "(5, 8)"});
  expect_user_error([&] { kmamba::add_rms_norm(exec, r, r, kmamba::allocate<T1>("kmamba::test::w9", 9), 1e-5f, r); },
                    {"kmamba::add_rms_norm", "weight", "(9,)", "(8,)"});
}

}  // namespace
