// Causal depthwise conv1d (forward, backward, decode update) against a naive sequential
// double-precision reference written from the spec (docs/algorithms.md §1.2, §1.5, §1.6, §2.10).
//
// Tolerances: kernel (fp32) vs reference (double) |got - ref| <= 1e-5 * (1 + |ref|); the
// reference's own gradients vs central finite differences (double, h = 1e-5) within
// 1e-6 * (1 + |g|). Kernel outputs are poisoned with NaN before every run, so an element a
// kernel leaves unwritten fails the comparison. A packed row and its documents run one by one
// add the same products in the same order (a tap that does not read adds nothing), so their
// outputs and input gradients agree exactly; only the weight gradients, summed over the batch
// in another grouping, differ by rounding.
#include <kmamba/core/Conv1d.hpp>
#include <kmamba/core/Core.hpp>

#include "Activations.hpp"
#include "Backends.hpp"
#include "Checks.hpp"
#include "PackedIds.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace {

using namespace kmamba::test;
using namespace kmamba::reference;

using kmamba::Conv1dActivation;

constexpr double kernel_tolerance = 1e-5;
constexpr double fd_tolerance = 1e-6;
constexpr double fd_step = 1e-5;

struct Problem {
  int batch, seqlen, channels, width;
  bool bias, silu, initial_state, final_state;
  bool packed = false;  // seq_idx from packed_ids

  std::string name() const {
    std::ostringstream os;
    os << "batch=" << batch << " seqlen=" << seqlen << " channels=" << channels << " width=" << width
       << " bias=" << bias << " silu=" << silu << " initial_state=" << initial_state << " final_state=" << final_state
       << " packed=" << packed;
    return os.str();
  }
  Conv1dActivation activation() const { return silu ? Conv1dActivation::silu : Conv1dActivation::none; }
  int state_len() const { return width - 1; }
};

// Widths 2, 3, 4; seqlen 1, 2 (< width - 1 for width 4), 3 (= width - 1 for width 4) and 37;
// every combination of bias, SiLU, initial state, final state (with its gradient) and packing.
std::vector<Problem> sweep() {
  std::vector<Problem> problems;
  for (int width : {2, 3, 4}) {
    for (int seqlen : {1, 2, 3, 37}) {
      for (int mask = 0; mask < 32; ++mask) {
        problems.push_back(Problem{2, seqlen, 5, width, (mask & 1) != 0, (mask & 2) != 0, (mask & 4) != 0,
                                   (mask & 8) != 0, (mask & 16) != 0});
      }
    }
  }
  return problems;
}

// ----------------------------------------------------------------------------------------------
// Naive double-precision reference (row-major flat vectors).

struct RefInputs {
  Problem p;
  std::vector<double> x;          // (batch, seqlen, channels)
  std::vector<double> w;          // (channels, width)
  std::vector<double> bias;       // (channels), empty without bias
  std::vector<double> init;       // (batch, channels, width - 1), empty without initial state
  std::vector<std::int64_t> seq;  // (batch, seqlen), empty unless packed
};

struct RefOutputs {
  std::vector<double> y;            // (batch, seqlen, channels)
  std::vector<double> final_state;  // (batch, channels, width - 1)
};

struct RefGrads {
  std::vector<double> dx;     // (batch, seqlen, channels)
  std::vector<double> dw;     // (channels, width)
  std::vector<double> dbias;  // (channels)
  std::vector<double> dinit;  // (batch, channels, width - 1)
};

std::size_t x_index(const Problem& p, int b, int t, int c) {
  return (static_cast<std::size_t>(b) * p.seqlen + t) * p.channels + c;
}
std::size_t state_index(const Problem& p, int b, int c, int j) {
  return (static_cast<std::size_t>(b) * p.channels + c) * p.state_len() + j;
}

// Input at time s in [-(width-1), seqlen): the initial state (or 0) before time 0.
double ref_input(const RefInputs& in, int b, int s, int c) {
  if (s >= 0) return in.x[x_index(in.p, b, s, c)];
  return in.init.empty() ? 0.0 : in.init[state_index(in.p, b, c, s + in.p.width - 1)];
}

// Whether time t (up to seqlen) reads input s: no token in (s, t] before seqlen starts a document.
bool ref_reaches(const RefInputs& in, int b, int s, int t) {
  const int L = in.p.seqlen;
  for (int r = std::max(s + 1, 1); r <= t && r < L && !in.seq.empty(); ++r) {
    if (in.seq[static_cast<std::size_t>(b) * L + r] != in.seq[static_cast<std::size_t>(b) * L + r - 1]) return false;
  }
  return true;
}

double ref_pre(const RefInputs& in, int b, int t, int c) {
  const Problem& p = in.p;
  double pre = in.bias.empty() ? 0.0 : in.bias[c];
  for (int k = 0; k < p.width; ++k) {
    const int s = t - (p.width - 1) + k;
    if (ref_reaches(in, b, s, t)) pre += in.w[c * p.width + k] * ref_input(in, b, s, c);
  }
  return pre;
}

RefOutputs ref_forward(const RefInputs& in) {
  const Problem& p = in.p;
  RefOutputs out;
  out.y.assign(static_cast<std::size_t>(p.batch) * p.seqlen * p.channels, 0.0);
  out.final_state.assign(static_cast<std::size_t>(p.batch) * p.channels * p.state_len(), 0.0);
  for (int b = 0; b < p.batch; ++b) {
    for (int t = 0; t < p.seqlen; ++t) {
      for (int c = 0; c < p.channels; ++c) {
        const double pre = ref_pre(in, b, t, c);
        out.y[x_index(p, b, t, c)] = p.silu ? pre * sigmoid(pre) : pre;
      }
    }
    for (int c = 0; c < p.channels; ++c) {
      for (int j = 0; j < p.state_len(); ++j) {
        const int s = p.seqlen - p.state_len() + j;
        out.final_state[state_index(p, b, c, j)] = ref_reaches(in, b, s, p.seqlen) ? ref_input(in, b, s, c) : 0.0;
      }
    }
  }
  return out;
}

// Scatter form of docs/algorithms.md §1.5: every output t adds its dpre to the taps it read.
// dfinal may be empty.
RefGrads ref_backward(const RefInputs& in, const std::vector<double>& dy, const std::vector<double>& dfinal) {
  const Problem& p = in.p;
  const int pad = p.state_len();
  RefGrads g;
  g.dx.assign(in.x.size(), 0.0);
  g.dw.assign(static_cast<std::size_t>(p.channels) * p.width, 0.0);
  g.dbias.assign(static_cast<std::size_t>(p.channels), 0.0);
  g.dinit.assign(static_cast<std::size_t>(p.batch) * p.channels * pad, 0.0);
  auto dinput = [&](int b, int s, int c) -> double& {
    return s >= 0 ? g.dx[x_index(p, b, s, c)] : g.dinit[state_index(p, b, c, s + pad)];
  };
  for (int b = 0; b < p.batch; ++b) {
    for (int c = 0; c < p.channels; ++c) {
      for (int t = 0; t < p.seqlen; ++t) {
        const double pre = ref_pre(in, b, t, c);
        const double s = sigmoid(pre);
        const double dpre = dy[x_index(p, b, t, c)] * (p.silu ? s * (1.0 + pre * (1.0 - s)) : 1.0);
        g.dbias[c] += dpre;
        for (int k = 0; k < p.width; ++k) {
          const int src = t - pad + k;
          if (!ref_reaches(in, b, src, t)) continue;
          g.dw[c * p.width + k] += dpre * ref_input(in, b, src, c);
          dinput(b, src, c) += in.w[c * p.width + k] * dpre;
        }
      }
      if (!dfinal.empty()) {
        for (int j = 0; j < pad; ++j) {
          const int s = p.seqlen - pad + j;
          if (ref_reaches(in, b, s, p.seqlen)) dinput(b, s, c) += dfinal[state_index(p, b, c, j)];
        }
      }
    }
  }
  return g;
}

double ref_loss(const RefInputs& in, const std::vector<double>& gy, const std::vector<double>& gfinal) {
  const RefOutputs out = ref_forward(in);
  double loss = 0.0;
  for (std::size_t i = 0; i < gy.size(); ++i) loss += out.y[i] * gy[i];
  for (std::size_t i = 0; i < gfinal.size(); ++i) loss += out.final_state[i] * gfinal[i];
  return loss;
}

std::vector<double> normal_vector(std::size_t n, std::uint64_t seed) {
  std::vector<double> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = kmamba::normal_at(seed, i);
  return v;
}

// All elements of `got` within kernel_tolerance of `ref`; reports the first mismatch and the count.
::testing::AssertionResult all_close(const char* what, const std::vector<double>& ref, const std::vector<double>& got,
                                     double tolerance = kernel_tolerance) {
  if (ref.size() != got.size()) {
    return ::testing::AssertionFailure() << what << ": " << got.size() << " values, expected " << ref.size();
  }
  std::size_t bad = 0, first = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!(std::abs(got[i] - ref[i]) <= tolerance * (1.0 + std::abs(ref[i])))) {
      if (bad++ == 0) first = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << bad << " of " << ref.size()
                                       << " values differ; first at flat index " << first << ": got " << got[first]
                                       << ", expected " << ref[first];
}

// ----------------------------------------------------------------------------------------------
// The reference against itself: analytic gradients == central finite differences.

TEST(Conv1dReference, GradientsMatchFiniteDifferences) {
  std::uint64_t seed = 500;
  for (const Problem& p : sweep()) {
    SCOPED_TRACE(p.name());
    RefInputs in{p,
                 normal_vector(static_cast<std::size_t>(p.batch) * p.seqlen * p.channels, seed + 1),
                 normal_vector(static_cast<std::size_t>(p.channels) * p.width, seed + 2),
                 p.bias ? normal_vector(static_cast<std::size_t>(p.channels), seed + 3) : std::vector<double>{},
                 p.initial_state
                     ? normal_vector(static_cast<std::size_t>(p.batch) * p.channels * p.state_len(), seed + 4)
                     : std::vector<double>{},
                 p.packed ? packed_ids(p.batch, p.seqlen) : std::vector<std::int64_t>{}};
    const std::vector<double> gy = normal_vector(in.x.size(), seed + 5);
    const std::vector<double> gfinal =
        p.final_state ? normal_vector(static_cast<std::size_t>(p.batch) * p.channels * p.state_len(), seed + 6)
                      : std::vector<double>{};
    seed += 10;
    const RefGrads g = ref_backward(in, gy, gfinal);
    auto check = [&](const char* what, std::vector<double>& param, const std::vector<double>& grad) {
      std::vector<double> fd(param.size());
      for (std::size_t i = 0; i < param.size(); ++i) {
        const double saved = param[i];
        param[i] = saved + fd_step;
        const double up = ref_loss(in, gy, gfinal);
        param[i] = saved - fd_step;
        const double down = ref_loss(in, gy, gfinal);
        param[i] = saved;
        fd[i] = (up - down) / (2.0 * fd_step);
      }
      EXPECT_TRUE(all_close(what, fd, grad, fd_tolerance));
    };
    check("dx", in.x, g.dx);
    check("dweight", in.w, g.dw);
    if (p.bias) check("dbias", in.bias, g.dbias);
    if (p.initial_state) check("dinitial_state", in.init, g.dinit);
  }
}

// ----------------------------------------------------------------------------------------------
// Kernels against the reference, per backend.

KMAMBA_BACKEND_TEST_SUITE(Conv1d);

template <class Exec>
struct DeviceInputs {
  using Mem = typename Exec::memory_space;
  Problem p;
  kmamba::Tensor3<float, Mem> x;           // (batch, seqlen, channels)
  kmamba::Tensor2<float, Mem> w;           // (channels, width)
  kmamba::Tensor1<float, Mem> bias;        // (channels) or empty
  kmamba::Tensor3<float, Mem> init;        // (batch, channels, width - 1) or empty
  kmamba::Tensor3<float, Mem> dy;          // (batch, seqlen, channels)
  kmamba::Tensor3<float, Mem> dfinal;      // (batch, channels, width - 1) or empty
  kmamba::Tensor2<std::int64_t, Mem> seq;  // (batch, seqlen) or empty

  DeviceInputs(const Problem& problem, std::uint64_t seed) : p(problem) {
    const Exec exec;
    x = kmamba::allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::x", p.batch, p.seqlen, p.channels);
    w = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::w", p.channels, p.width);
    dy = kmamba::allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::dy", p.batch, p.seqlen, p.channels);
    kmamba::fill_normal(exec, x, seed + 1, 0.0f, 1.0f);
    kmamba::fill_uniform(exec, w, seed + 2, -0.5f, 0.5f);
    kmamba::fill_normal(exec, dy, seed + 5, 0.0f, 1.0f);
    if (p.bias) {
      bias = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::bias", p.channels);
      kmamba::fill_uniform(exec, bias, seed + 3, -0.5f, 0.5f);
    }
    if (p.initial_state) {
      init = kmamba::allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::init", p.batch, p.channels,
                                                                         p.state_len());
      kmamba::fill_normal(exec, init, seed + 4, 0.0f, 1.0f);
    }
    if (p.final_state) {
      dfinal = kmamba::allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::dfinal", p.batch, p.channels,
                                                                           p.state_len());
      kmamba::fill_normal(exec, dfinal, seed + 6, 0.0f, 1.0f);
    }
    exec.fence();
    if (p.packed) seq = device_packed_ids<Mem>(p.batch, p.seqlen);
  }

  RefInputs reference() const {
    return RefInputs{p,
                     host_doubles(x),
                     host_doubles(w),
                     p.bias ? host_doubles(bias) : std::vector<double>{},
                     p.initial_state ? host_doubles(init) : std::vector<double>{},
                     p.packed ? packed_ids(p.batch, p.seqlen) : std::vector<std::int64_t>{}};
  }
};

// Runs forward and backward on `d` and compares every output and gradient with the reference.
template <class Exec>
void check_against_reference(const DeviceInputs<Exec>& d) {
  using Mem = typename Exec::memory_space;
  const Problem& p = d.p;
  const Exec exec;
  const RefInputs in = d.reference();
  const RefOutputs ref = ref_forward(in);

  auto y = poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::y", p.batch, p.seqlen, p.channels);
  kmamba::Tensor3<float, Mem> final_state;
  if (p.final_state)
    final_state =
        poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::final_state", p.batch, p.channels, p.state_len());
  kmamba::causal_conv1d(exec, d.x, d.w, d.bias, d.init, y, final_state, p.activation(), d.seq);
  EXPECT_TRUE(all_close("y", ref.y, host_doubles(y)));
  if (p.final_state) {
    EXPECT_TRUE(all_close("final_state", ref.final_state, host_doubles(final_state)));
  }

  const RefGrads g =
      ref_backward(in, host_doubles(d.dy), p.final_state ? host_doubles(d.dfinal) : std::vector<double>{});
  auto dx = poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::dx", p.batch, p.seqlen, p.channels);
  auto dw = poisoned<kmamba::Tensor2<float, Mem>>("kmamba::test::dw", p.channels, p.width);
  kmamba::Tensor1<float, Mem> dbias;
  if (p.bias) dbias = poisoned<kmamba::Tensor1<float, Mem>>("kmamba::test::dbias", p.channels);
  kmamba::Tensor3<float, Mem> dinit;
  if (p.initial_state)
    dinit = poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::dinit", p.batch, p.channels, p.state_len());
  kmamba::causal_conv1d_backward(exec, d.x, d.w, d.bias, d.init, d.dy, d.dfinal, dx, dw, dbias, dinit, p.activation(),
                                 d.seq);
  EXPECT_TRUE(all_close("dx", g.dx, host_doubles(dx)));
  EXPECT_TRUE(all_close("dweight", g.dw, host_doubles(dw)));
  if (p.bias) {
    EXPECT_TRUE(all_close("dbias", g.dbias, host_doubles(dbias)));
  }
  if (p.initial_state) {
    EXPECT_TRUE(all_close("dinitial_state", g.dinit, host_doubles(dinit)));
  }
}

TYPED_TEST(Conv1d, ForwardAndBackwardMatchReferenceOverSweep) {
  using Exec = TypeParam;
  std::uint64_t seed = 1000;
  for (const Problem& p : sweep()) {
    SCOPED_TRACE(p.name());
    check_against_reference(DeviceInputs<Exec>(p, seed));
    seed += 10;
  }
}

// Sequences of several backward segments (64 rows each, a partial last one), and widths that take
// the 8- and 16-tap register windows of the backward, up to the largest width.
TYPED_TEST(Conv1d, LargerProblemMatchesReference) {
  using Exec = TypeParam;
  for (const Problem& p :
       {Problem{3, 257, 19, 4, true, true, true, true}, Problem{4, 130, 33, 3, false, true, false, true},
        Problem{1, 64, 8, 1, true, false, false, false}, Problem{2, 150, 7, 7, true, true, true, true},
        Problem{2, 70, 5, kmamba::conv1d_max_width, true, true, true, true},
        Problem{3, 257, 19, 4, true, true, true, true, true}, Problem{3, 150, 7, 7, true, true, true, true, true},
        Problem{3, 70, 5, kmamba::conv1d_max_width, true, true, true, true, true}}) {
    SCOPED_TRACE(p.name());
    check_against_reference(DeviceInputs<Exec>(p, 77));
  }
}

// Decode steps over a sequence reproduce the full forward, token by token, and leave the conv
// state equal to the forward's final state.
TYPED_TEST(Conv1d, DecodeStepsEqualFullForward) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const Exec exec;
  std::uint64_t seed = 9000;
  for (int width : {2, 3, 4}) {
    for (int mask = 0; mask < 8; ++mask) {
      const Problem p{2, 9, 5, width, (mask & 1) != 0, (mask & 2) != 0, (mask & 4) != 0, true};
      SCOPED_TRACE(p.name());
      const DeviceInputs<Exec> d(p, seed);
      seed += 10;
      const RefOutputs ref = ref_forward(d.reference());
      auto y_full = poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::y", p.batch, p.seqlen, p.channels);
      auto final_state =
          poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::final_state", p.batch, p.channels, p.state_len());
      kmamba::causal_conv1d(exec, d.x, d.w, d.bias, d.init, y_full, final_state, p.activation());
      const std::vector<double> y_full_h = host_doubles(y_full);

      auto conv_state =
          kmamba::allocate<kmamba::Tensor3<float, Mem>>("kmamba::test::conv_state", p.batch, p.channels, p.state_len());
      if (p.initial_state) Kokkos::deep_copy(conv_state, d.init);
      auto x_t = kmamba::allocate<kmamba::Tensor2<float, Mem>>("kmamba::test::x_t", p.batch, p.channels);
      auto y_t = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::y_t", p.batch, p.channels);
      auto x_t_h = Kokkos::create_mirror_view(x_t);
      const auto x_h = kmamba::test::to_host(d.x);
      for (int t = 0; t < p.seqlen; ++t) {
        for (int b = 0; b < p.batch; ++b)
          for (int c = 0; c < p.channels; ++c) x_t_h(b, c) = x_h(b, t, c);
        Kokkos::deep_copy(x_t, x_t_h);
        kmamba::test::poison(y_t);
        kmamba::causal_conv1d_update(exec, x_t, d.w, d.bias, conv_state, y_t, p.activation());
        const auto y_t_h = kmamba::test::to_host(y_t);
        std::vector<double> got, from_forward, from_ref;
        for (int b = 0; b < p.batch; ++b)
          for (int c = 0; c < p.channels; ++c) {
            got.push_back(y_t_h(b, c));
            from_forward.push_back(y_full_h[x_index(p, b, t, c)]);
            from_ref.push_back(ref.y[x_index(p, b, t, c)]);
          }
        EXPECT_TRUE(all_close("decode y vs forward y", from_forward, got)) << "token " << t;
        EXPECT_TRUE(all_close("decode y vs reference", from_ref, got)) << "token " << t;
      }
      EXPECT_TRUE(all_close("conv_state vs forward final_state", host_doubles(final_state), host_doubles(conv_state)));
      EXPECT_TRUE(all_close("conv_state vs reference", ref.final_state, host_doubles(conv_state)));
    }
  }
}

// A decode step may write its output over its input token.
TYPED_TEST(Conv1d, UpdateMayWriteYIntoX) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const Exec exec;
  const Problem p{2, 1, 5, 4, true, true, true, true};
  const DeviceInputs<Exec> d(p, 43000);
  const RefOutputs ref = ref_forward(d.reference());  // seqlen 1: y is laid out as (batch, channels)
  auto x_t = kmamba::allocate<kmamba::Tensor2<float, Mem>>("kmamba::test::x_t", p.batch, p.channels);
  Kokkos::deep_copy(x_t, Kokkos::subview(d.x, Kokkos::ALL, 0, Kokkos::ALL));
  auto state = kmamba::allocate<kmamba::Tensor3<float, Mem>>("kmamba::test::state", p.batch, p.channels, 3);
  Kokkos::deep_copy(state, d.init);
  kmamba::causal_conv1d_update(exec, x_t, d.w, d.bias, state, x_t, p.activation());
  EXPECT_TRUE(all_close("y", ref.y, host_doubles(x_t)));
  EXPECT_TRUE(all_close("state", ref.final_state, host_doubles(state)));
}

// Copies tokens [t0, t1) of a (batch, seqlen, channels) tensor into a new tensor.
template <class Mem>
kmamba::Tensor3<float, Mem> slice_tokens(const kmamba::Tensor3<float, Mem>& v, int t0, int t1) {
  auto out = kmamba::allocate<kmamba::Tensor3<float, Mem>>("kmamba::test::slice", v.extent(0), t1 - t0, v.extent(2));
  Kokkos::deep_copy(out, Kokkos::subview(v, Kokkos::ALL, Kokkos::make_pair(t0, t1), Kokkos::ALL));
  return out;
}

// Segment 1's final state fed to segment 2 as its initial state gives the one-pass result, and
// segment 2's dinitial_state fed to segment 1 as dfinal_state gives the one-pass gradients.
TYPED_TEST(Conv1d, SegmentsEqualOnePass) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using T1 = kmamba::Tensor1<float, Mem>;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  const Exec exec;
  std::uint64_t seed = 20000;
  const int seqlen = 23;
  for (int width : {2, 3, 4}) {
    for (int split : {1, 2, 11, 22}) {
      for (int mask = 0; mask < 4; ++mask) {
        const Problem p{2, seqlen, 6, width, true, (mask & 1) != 0, (mask & 2) != 0, true};
        SCOPED_TRACE(p.name() + " split=" + std::to_string(split));
        const DeviceInputs<Exec> d(p, seed);
        seed += 10;
        const auto act = p.activation();
        const int pad = p.state_len();

        auto y = poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::y", p.batch, seqlen, p.channels);
        auto final_state = poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::final", p.batch, p.channels, pad);
        kmamba::causal_conv1d(exec, d.x, d.w, d.bias, d.init, y, final_state, act);
        auto dx = poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::dx", p.batch, seqlen, p.channels);
        auto dw = poisoned<T2>("kmamba::test::dw", p.channels, width);
        auto dbias = poisoned<T1>("kmamba::test::dbias", p.channels);
        auto dinit = p.initial_state
                         ? poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::dinit", p.batch, p.channels, pad)
                         : T3();
        kmamba::causal_conv1d_backward(exec, d.x, d.w, d.bias, d.init, d.dy, d.dfinal, dx, dw, dbias, dinit, act);

        const T3 x1 = slice_tokens(d.x, 0, split), x2 = slice_tokens(d.x, split, seqlen);
        const T3 dy1 = slice_tokens(d.dy, 0, split), dy2 = slice_tokens(d.dy, split, seqlen);
        auto y1 = poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::y1", p.batch, split, p.channels);
        auto y2 = poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::y2", p.batch, seqlen - split, p.channels);
        auto state1 = poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::state1", p.batch, p.channels, pad);
        auto state2 = poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::state2", p.batch, p.channels, pad);
        kmamba::causal_conv1d(exec, x1, d.w, d.bias, d.init, y1, state1, act);
        kmamba::causal_conv1d(exec, x2, d.w, d.bias, state1, y2, state2, act);
        EXPECT_TRUE(all_close("y segment 1", host_doubles(slice_tokens(y, 0, split)), host_doubles(y1)));
        EXPECT_TRUE(all_close("y segment 2", host_doubles(slice_tokens(y, split, seqlen)), host_doubles(y2)));
        EXPECT_TRUE(all_close("final state", host_doubles(final_state), host_doubles(state2)));

        auto dx1 = poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::dx1", p.batch, split, p.channels);
        auto dx2 = poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::dx2", p.batch, seqlen - split, p.channels);
        auto dstate1 = poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::dstate1", p.batch, p.channels, pad);
        auto dinit1 = p.initial_state
                          ? poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::dinit1", p.batch, p.channels, pad)
                          : T3();
        auto dw1 = poisoned<T2>("kmamba::test::dw1", p.channels, width);
        auto dw2 = poisoned<T2>("kmamba::test::dw2", p.channels, width);
        auto dbias1 = poisoned<T1>("kmamba::test::dbias1", p.channels);
        auto dbias2 = poisoned<T1>("kmamba::test::dbias2", p.channels);
        kmamba::causal_conv1d_backward(exec, x2, d.w, d.bias, state1, dy2, d.dfinal, dx2, dw2, dbias2, dstate1, act);
        kmamba::causal_conv1d_backward(exec, x1, d.w, d.bias, d.init, dy1, dstate1, dx1, dw1, dbias1, dinit1, act);
        EXPECT_TRUE(all_close("dx segment 1", host_doubles(slice_tokens(dx, 0, split)), host_doubles(dx1)));
        EXPECT_TRUE(all_close("dx segment 2", host_doubles(slice_tokens(dx, split, seqlen)), host_doubles(dx2)));
        if (p.initial_state) {
          EXPECT_TRUE(all_close("dinitial_state", host_doubles(dinit), host_doubles(dinit1)));
        }
        std::vector<double> dw_sum = host_doubles(dw1), dbias_sum = host_doubles(dbias1);
        const std::vector<double> dw2_h = host_doubles(dw2), dbias2_h = host_doubles(dbias2);
        for (std::size_t i = 0; i < dw_sum.size(); ++i) dw_sum[i] += dw2_h[i];
        for (std::size_t i = 0; i < dbias_sum.size(); ++i) dbias_sum[i] += dbias2_h[i];
        EXPECT_TRUE(all_close("dweight", host_doubles(dw), dw_sum));
        EXPECT_TRUE(all_close("dbias", host_doubles(dbias), dbias_sum));
      }
    }
  }
}

// A packed row equals its documents run one by one: the first with the row's initial state, the
// others from a zero state; the row's final state is its last document's, and dinitial_state its
// first document's.
TYPED_TEST(Conv1d, PackedRowEqualsDocumentsAlone) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using T1 = kmamba::Tensor1<float, Mem>;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  const Exec exec;
  for (int width : {2, 4, 7}) {
    const Problem p{3, 41, 6, width, true, true, true, true, true};
    SCOPED_TRACE(p.name());
    const DeviceInputs<Exec> d(p, 52000 + width);
    const auto act = p.activation();
    const int pad = p.state_len();
    auto y = poisoned<T3>("kmamba::test::y", p.batch, p.seqlen, p.channels);
    auto final_state = poisoned<T3>("kmamba::test::final", p.batch, p.channels, pad);
    kmamba::causal_conv1d(exec, d.x, d.w, d.bias, d.init, y, final_state, act, d.seq);
    auto dx = poisoned<T3>("kmamba::test::dx", p.batch, p.seqlen, p.channels);
    auto dw = poisoned<T2>("kmamba::test::dw", p.channels, width);
    auto dbias = poisoned<T1>("kmamba::test::dbias", p.channels);
    auto dinit = poisoned<T3>("kmamba::test::dinit", p.batch, p.channels, pad);
    kmamba::causal_conv1d_backward(exec, d.x, d.w, d.bias, d.init, d.dy, d.dfinal, dx, dw, dbias, dinit, act, d.seq);

    std::vector<double> dw_sum(static_cast<std::size_t>(p.channels) * width, 0.0), dbias_sum(p.channels, 0.0);
    const std::vector<std::int64_t> ids = packed_ids(p.batch, p.seqlen);
    for (int b = 0; b < p.batch; ++b) {
      const auto docs = documents(ids, p.seqlen, b);
      for (std::size_t i = 0; i < docs.size(); ++i) {
        const int t0 = docs[i].first, t1 = docs[i].second;
        const bool first = i == 0, last = i + 1 == docs.size();
        SCOPED_TRACE("row " + std::to_string(b) + " document [" + std::to_string(t0) + ", " + std::to_string(t1) + ")");
        auto row = [&](const T3& v, int lo, int hi) {
          return slice_tokens(T3(Kokkos::subview(v, Kokkos::make_pair(b, b + 1), Kokkos::ALL, Kokkos::ALL)), lo, hi);
        };
        auto state_row = [&](const T3& v) {
          auto out = kmamba::allocate<T3>("kmamba::test::state_row", 1, p.channels, pad);
          Kokkos::deep_copy(out, Kokkos::subview(v, Kokkos::make_pair(b, b + 1), Kokkos::ALL, Kokkos::ALL));
          return out;
        };
        const T3 init = first ? state_row(d.init) : T3();
        const T3 dfinal = last ? state_row(d.dfinal) : T3();
        auto y1 = poisoned<T3>("kmamba::test::y1", 1, t1 - t0, p.channels);
        auto final1 = poisoned<T3>("kmamba::test::final1", 1, p.channels, pad);
        kmamba::causal_conv1d(exec, row(d.x, t0, t1), d.w, d.bias, init, y1, final1, act);
        EXPECT_TRUE(all_close("y", host_doubles(row(y, t0, t1)), host_doubles(y1), 0.0));
        if (last) {
          EXPECT_TRUE(all_close("final state", host_doubles(state_row(final_state)), host_doubles(final1), 0.0));
        }
        auto dx1 = poisoned<T3>("kmamba::test::dx1", 1, t1 - t0, p.channels);
        auto dw1 = poisoned<T2>("kmamba::test::dw1", p.channels, width);
        auto dbias1 = poisoned<T1>("kmamba::test::dbias1", p.channels);
        auto dinit1 = poisoned<T3>("kmamba::test::dinit1", 1, p.channels, pad);
        kmamba::causal_conv1d_backward(exec, row(d.x, t0, t1), d.w, d.bias, init, row(d.dy, t0, t1), dfinal, dx1, dw1,
                                       dbias1, first ? dinit1 : T3(), act);
        EXPECT_TRUE(all_close("dx", host_doubles(row(dx, t0, t1)), host_doubles(dx1), 0.0));
        if (first) {
          EXPECT_TRUE(all_close("dinitial_state", host_doubles(state_row(dinit)), host_doubles(dinit1), 0.0));
        }
        const std::vector<double> dw1_h = host_doubles(dw1), dbias1_h = host_doubles(dbias1);
        for (std::size_t k = 0; k < dw_sum.size(); ++k) dw_sum[k] += dw1_h[k];
        for (std::size_t k = 0; k < dbias_sum.size(); ++k) dbias_sum[k] += dbias1_h[k];
      }
    }
    EXPECT_TRUE(all_close("dweight", host_doubles(dw), dw_sum));
    EXPECT_TRUE(all_close("dbias", host_doubles(dbias), dbias_sum));
  }
}

// final_state may be initial_state itself: the state advances in place.
TYPED_TEST(Conv1d, FinalStateMayBeInitialState) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const Exec exec;
  for (int seqlen : {1, 2, 5}) {
    const Problem p{2, seqlen, 7, 4, true, true, true, true};
    SCOPED_TRACE(p.name());
    const DeviceInputs<Exec> d(p, 31000 + seqlen);
    const RefOutputs ref = ref_forward(d.reference());
    auto state = kmamba::allocate<kmamba::Tensor3<float, Mem>>("kmamba::test::state", p.batch, p.channels, 3);
    Kokkos::deep_copy(state, d.init);
    auto y = poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::y", p.batch, p.seqlen, p.channels);
    kmamba::causal_conv1d(exec, d.x, d.w, d.bias, state, y, state, p.activation());
    EXPECT_TRUE(all_close("y", ref.y, host_doubles(y)));
    EXPECT_TRUE(all_close("state", ref.final_state, host_doubles(state)));
  }
}

// The overloads without an execution space instance run on the view's execution space.
TYPED_TEST(Conv1d, OverloadsWithoutInstance) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const Problem p{2, 6, 4, 3, true, true, true, true};
  const DeviceInputs<Exec> d(p, 42000);
  const RefInputs in = d.reference();
  const RefOutputs ref = ref_forward(in);
  const RefGrads g = ref_backward(in, host_doubles(d.dy), host_doubles(d.dfinal));
  auto y = poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::y", p.batch, p.seqlen, p.channels);
  auto final_state = poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::final_state", p.batch, p.channels, 2);
  kmamba::causal_conv1d(d.x, d.w, d.bias, d.init, y, final_state, p.activation());
  EXPECT_TRUE(all_close("y", ref.y, host_doubles(y)));
  EXPECT_TRUE(all_close("final_state", ref.final_state, host_doubles(final_state)));
  auto dx = poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::dx", p.batch, p.seqlen, p.channels);
  auto dw = poisoned<kmamba::Tensor2<float, Mem>>("kmamba::test::dw", p.channels, 3);
  auto dbias = poisoned<kmamba::Tensor1<float, Mem>>("kmamba::test::dbias", p.channels);
  auto dinit = poisoned<kmamba::Tensor3<float, Mem>>("kmamba::test::dinit", p.batch, p.channels, 2);
  kmamba::causal_conv1d_backward(d.x, d.w, d.bias, d.init, d.dy, d.dfinal, dx, dw, dbias, dinit, p.activation());
  EXPECT_TRUE(all_close("dx", g.dx, host_doubles(dx)));
  EXPECT_TRUE(all_close("dweight", g.dw, host_doubles(dw)));
  EXPECT_TRUE(all_close("dbias", g.dbias, host_doubles(dbias)));
  EXPECT_TRUE(all_close("dinitial_state", g.dinit, host_doubles(dinit)));
  auto x_t = kmamba::allocate<kmamba::Tensor2<float, Mem>>("kmamba::test::x_t", p.batch, p.channels);
  auto y_t = poisoned<kmamba::Tensor2<float, Mem>>("kmamba::test::y_t", p.batch, p.channels);
  Kokkos::deep_copy(x_t, Kokkos::subview(d.x, Kokkos::ALL, 0, Kokkos::ALL));
  auto state = kmamba::allocate<kmamba::Tensor3<float, Mem>>("kmamba::test::state", p.batch, p.channels, 2);
  kmamba::causal_conv1d_update(x_t, d.w, d.bias, state, y_t, p.activation());
  RefInputs first = in;
  first.p.seqlen = 1;
  first.init.clear();
  first.x.clear();
  for (int b = 0; b < p.batch; ++b)
    for (int c = 0; c < p.channels; ++c) first.x.push_back(in.x[x_index(p, b, 0, c)]);
  const RefOutputs ref_first = ref_forward(first);
  EXPECT_TRUE(all_close("update y", ref_first.y, host_doubles(y_t)));
  EXPECT_TRUE(all_close("update state", ref_first.final_state, host_doubles(state)));
}

TYPED_TEST(Conv1d, RejectsBadShapesNamingBothShapes) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using T1 = kmamba::Tensor1<float, Mem>;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  const Exec exec;
  const auto x = kmamba::allocate<T3>("kmamba::test::x", 2, 6, 4);
  const auto w = kmamba::allocate<T2>("kmamba::test::w", 4, 3);
  const auto bias = kmamba::allocate<T1>("kmamba::test::bias", 4);
  const auto state = kmamba::allocate<T3>("kmamba::test::state", 2, 4, 2);
  const auto y = kmamba::allocate<T3>("kmamba::test::y", 2, 6, 4);
  const auto act = Conv1dActivation::silu;

  EXPECT_EQ(user_error([&] {
              kmamba::causal_conv1d(exec, x, w, bias, state, kmamba::allocate<T3>("kmamba::test::y", 2, 5, 4), T3(),
                                    act);
            }),
            "kmamba::causal_conv1d: y has shape (2, 5, 4) but (batch, seqlen, channels) = (2, 6, 4) was expected");
  EXPECT_EQ(user_error([&] {
              kmamba::causal_conv1d(exec, x, kmamba::allocate<T2>("kmamba::test::w", 5, 3), bias, state, y, T3(), act);
            }),
            "kmamba::causal_conv1d: weight has shape (5, 3) but (channels, width) = (4, *) was expected");
  EXPECT_EQ(user_error([&] {
              kmamba::causal_conv1d(exec, x, w, kmamba::allocate<T1>("kmamba::test::bias", 3), state, y, T3(), act);
            }),
            "kmamba::causal_conv1d: bias has shape (3,) but (channels) = (4,) was expected");
  EXPECT_EQ(user_error([&] {
              kmamba::causal_conv1d(exec, x, w, bias, kmamba::allocate<T3>("kmamba::test::s", 2, 4, 3), y, T3(), act);
            }),
            "kmamba::causal_conv1d: initial_state has shape (2, 4, 3) but (batch, channels, width - 1) = (2, 4, 2) was "
            "expected");
  EXPECT_EQ(user_error([&] {
              kmamba::causal_conv1d(exec, x, w, bias, state, y, kmamba::allocate<T3>("kmamba::test::s", 1, 4, 2), act);
            }),
            "kmamba::causal_conv1d: final_state has shape (1, 4, 2) but (batch, channels, width - 1) = (2, 4, 2) was "
            "expected");
  EXPECT_NE(user_error([&] {
              kmamba::causal_conv1d(exec, x, kmamba::allocate<T2>("kmamba::test::w", 4, 0), bias, T3(), y, T3(), act);
            }).find("at least 1"),
            std::string::npos);
  const int too_wide = kmamba::conv1d_max_width + 1;
  EXPECT_NE(user_error([&] {
              kmamba::causal_conv1d(exec, x, kmamba::allocate<T2>("kmamba::test::w", 4, too_wide), bias, T3(), y, T3(),
                                    act);
            }).find("at most " + std::to_string(kmamba::conv1d_max_width)),
            std::string::npos);
  EXPECT_NE(user_error([&] { kmamba::causal_conv1d(exec, x, w, bias, state, x, T3(), act); }).find("y must not be x"),
            std::string::npos);
  EXPECT_EQ(user_error([&] {
              kmamba::causal_conv1d(exec, x, w, bias, state, y, T3(), act,
                                    kmamba::allocate<kmamba::Tensor2<std::int64_t, Mem>>("kmamba::test::seq", 2, 5));
            }),
            "kmamba::causal_conv1d: seq_idx has shape (2, 5) but (batch, seqlen) = (2, 6) was expected");

  const auto dx = kmamba::allocate<T3>("kmamba::test::dx", 2, 6, 4);
  const auto dw = kmamba::allocate<T2>("kmamba::test::dw", 4, 3);
  EXPECT_EQ(
      user_error([&] {
        kmamba::causal_conv1d_backward(exec, x, w, bias, state, kmamba::allocate<T3>("kmamba::test::dy", 2, 6, 5), T3(),
                                       dx, dw, T1(), T3(), act);
      }),
      "kmamba::causal_conv1d_backward: dy has shape (2, 6, 5) but (batch, seqlen, channels) = (2, 6, 4) was expected");
  EXPECT_EQ(user_error([&] {
              kmamba::causal_conv1d_backward(exec, x, w, bias, state, y, T3(), dx,
                                             kmamba::allocate<T2>("kmamba::test::dw", 4, 2), T1(), T3(), act);
            }),
            "kmamba::causal_conv1d_backward: dweight has shape (4, 2) but (channels, width) = (4, 3) was expected");
  EXPECT_EQ(user_error([&] {
              kmamba::causal_conv1d_backward(exec, x, w, bias, state, y,
                                             kmamba::allocate<T3>("kmamba::test::df", 2, 2, 4), dx, dw, T1(), T3(),
                                             act);
            }),
            "kmamba::causal_conv1d_backward: dfinal_state has shape (2, 2, 4) but (batch, channels, width - 1) = (2, "
            "4, 2) was expected");
  EXPECT_EQ(user_error([&] {
              kmamba::causal_conv1d_backward(exec, x, w, bias, state, y, T3(), dx, dw,
                                             kmamba::allocate<T1>("kmamba::test::db", 2), T3(), act);
            }),
            "kmamba::causal_conv1d_backward: dbias has shape (2,) but (channels) = (4,) was expected");
  EXPECT_EQ(user_error([&] {
              kmamba::causal_conv1d_backward(exec, x, w, bias, state, y, T3(), dx, dw, T1(),
                                             kmamba::allocate<T3>("kmamba::test::di", 2, 4, 1), act);
            }),
            "kmamba::causal_conv1d_backward: dinitial_state has shape (2, 4, 1) but (batch, channels, width - 1) = (2, "
            "4, 2) was expected");

  const auto x_t = kmamba::allocate<T2>("kmamba::test::x_t", 2, 4);
  EXPECT_EQ(user_error([&] {
              kmamba::causal_conv1d_update(exec, x_t, w, bias, kmamba::allocate<T3>("kmamba::test::s", 2, 4, 3), x_t,
                                           act);
            }),
            "kmamba::causal_conv1d_update: conv_state has shape (2, 4, 3) but (batch, channels, width - 1) = (2, 4, 2) "
            "was expected");
  EXPECT_EQ(user_error([&] {
              kmamba::causal_conv1d_update(exec, x_t, w, bias, state, kmamba::allocate<T2>("kmamba::test::y", 4, 2),
                                           act);
            }),
            "kmamba::causal_conv1d_update: y has shape (4, 2) but (batch, channels) = (2, 4) was expected");
  EXPECT_EQ(user_error([&] {
              kmamba::causal_conv1d_update(exec, x_t, kmamba::allocate<T2>("kmamba::test::w", 3, 3), bias, state, x_t,
                                           act);
            }),
            "kmamba::causal_conv1d_update: weight has shape (3, 3) but (channels, width) = (4, *) was expected");
}

}  // namespace
