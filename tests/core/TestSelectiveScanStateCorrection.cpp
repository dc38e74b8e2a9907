// The selective scan's incoming-state correction (kmamba/core/SelectiveScanStateCorrection.hpp)
// against a double-precision scan written from docs/algorithms.md §1.3 (token by token): the scan
// is linear in its initial state, so the correction of a state h is ref(h) − ref(0) (outputs and
// last states), the segment decay is exp(A·Σ_t δ_t), and the gradient with respect to h is
// Σ (ref(e_i) − ref(0))·dout for each unit state e_i (exact in double, F being linear). The sweep
// covers z or not, delta_bias, softplus or not, D (which must not enter the correction), 1 or 2
// groups, one token and a longer segment; packed rows (seq_idx) take the same reference, whose state
// restarts from zero at every document start.
//
// Tolerances, relative to each tensor's largest |reference| (fp32, u = 2^-24 ≈ 6e-8):
// - correction, last state and decay: every term is exp(A·Δ_t) with Δ_t an fp32 sum of ≤ t + 1
//   values δ_s, whose rounding, relative to exp(A·Δ_t), is ≤ (t + 1)·u·|A·Δ_t|, which the decay
//   outweighs for long t as for the SSD (TestSsdStateCorrection.cpp); each output sums dstate (≤ 4)
//   such terms. Bound 5e-6, as the SSD correction's.
// - the incoming-state gradient: sums over seqlen (≤ 37) tokens of such terms: 2e-5, as the SSD's.
// - the zero-state scan plus the correction against the scan from that state (both fp32, the state
//   carried by products of per-token factors in the scan, by one exp of the summed δ here): 1e-5.
// - central differences of F(h) = Σ out(h)·dout in double from the fp32 op: F is linear in h, so
//   the difference has only the rounding of F at h ± εv, which the forward bound r = 5e-6 limits to
//   r·max|out|·Σ|dout| each: |fd − ⟨dh, v⟩| ≤ r·M·S/ε plus the gradient's own bound times
//   Σ|v|·max|dh|.
#include <kmamba/core/Core.hpp>
#include <kmamba/core/SelectiveScan.hpp>
#include <kmamba/core/SelectiveScanStateCorrection.hpp>

#include "Backends.hpp"
#include "Checks.hpp"
#include "PackedIds.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace kmamba::test;

constexpr double output_tolerance = 5e-6, gradient_tolerance = 2e-5, chaining_tolerance = 1e-5;

struct Config {
  int batch = 2, dim = 4, seqlen = 37, dstate = 4, ngroups = 1;
  bool D = true, z = false, bias = false, softplus = true;
  std::uint64_t seed = 1;

  std::string describe() const {
    std::ostringstream s;
    s << "batch=" << batch << " dim=" << dim << " seqlen=" << seqlen << " dstate=" << dstate << " ngroups=" << ngroups
      << " D=" << D << " z=" << z << " bias=" << bias << " softplus=" << softplus;
    return s.str();
  }
};

// Row-major host copies of every input, in double (every value an fp32 number).
struct Problem {
  Config cfg;
  std::vector<double> u, delta, A, B, C, D, z, bias, h0, dout;
  std::vector<std::int64_t> ids;  // (batch, seqlen) packed sequence ids, empty for one sequence per row

  bool starts(int b, int t) const {
    const std::size_t i = static_cast<std::size_t>(b) * cfg.seqlen + t;
    return !ids.empty() && t > 0 && ids[i] != ids[i - 1];
  }

  std::size_t seq(int b, int d, int t) const { return (static_cast<std::size_t>(b) * cfg.dim + d) * cfg.seqlen + t; }
  std::size_t bc(int b, int g, int n, int t) const {
    return ((static_cast<std::size_t>(b) * cfg.ngroups + g) * cfg.dstate + n) * cfg.seqlen + t;
  }
  std::size_t st(int b, int d, int n) const { return (static_cast<std::size_t>(b) * cfg.dim + d) * cfg.dstate + n; }
  double delta_value(int b, int d, int t) const {
    const double pre = delta[seq(b, d, t)] + (cfg.bias ? bias[d] : 0.0);
    return cfg.softplus ? (pre > 20.0 ? pre : std::log1p(std::exp(pre))) : pre;
  }
};

std::vector<double> random_values(std::mt19937_64& rng, std::size_t n, double lo, double hi) {
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) x = static_cast<double>(static_cast<float>(d(rng)));
  return v;
}

Problem make_problem(const Config& cfg) {
  std::mt19937_64 rng(cfg.seed);
  Problem p;
  p.cfg = cfg;
  const std::size_t seq = static_cast<std::size_t>(cfg.batch) * cfg.dim * cfg.seqlen;
  const std::size_t bc = static_cast<std::size_t>(cfg.batch) * cfg.ngroups * cfg.dstate * cfg.seqlen;
  p.u = random_values(rng, seq, -1.5, 1.5);
  p.delta = cfg.softplus ? random_values(rng, seq, -2.0, 0.5) : random_values(rng, seq, 0.05, 0.6);
  p.A = random_values(rng, static_cast<std::size_t>(cfg.dim) * cfg.dstate, -1.5, -0.2);
  p.B = random_values(rng, bc, -1.0, 1.0);
  p.C = random_values(rng, bc, -1.0, 1.0);
  p.D = random_values(rng, static_cast<std::size_t>(cfg.dim), 0.5, 1.5);
  if (cfg.z) p.z = random_values(rng, seq, -2.0, 2.0);
  if (cfg.bias) p.bias = random_values(rng, static_cast<std::size_t>(cfg.dim), -0.5, 0.5);
  p.h0 = random_values(rng, static_cast<std::size_t>(cfg.batch) * cfg.dim * cfg.dstate, -1.0, 1.0);
  p.dout = random_values(rng, seq, -1.0, 1.0);
  return p;
}

struct Scan {
  std::vector<double> out, last;
};

double silu(double v) { return v / (1.0 + std::exp(-v)); }

/// The scan of docs/algorithms.md §1.3 in double from the initial state `h` (batch, dim, dstate).
Scan reference_scan(const Problem& p, const std::vector<double>& h) {
  const Config& c = p.cfg;
  Scan s;
  s.out.assign(p.u.size(), 0.0);
  s.last = h;
  for (int b = 0; b < c.batch; ++b) {
    for (int d = 0; d < c.dim; ++d) {
      const int g = d / (c.dim / c.ngroups);
      for (int t = 0; t < c.seqlen; ++t) {
        const double dt = p.delta_value(b, d, t), u = p.u[p.seq(b, d, t)];
        double y = c.D ? p.D[d] * u : 0.0;
        for (int n = 0; n < c.dstate; ++n) {
          double& state = s.last[p.st(b, d, n)];
          if (p.starts(b, t)) state = 0.0;
          state =
              std::exp(dt * p.A[static_cast<std::size_t>(d) * c.dstate + n]) * state + dt * p.B[p.bc(b, g, n, t)] * u;
          y += p.C[p.bc(b, g, n, t)] * state;
        }
        s.out[p.seq(b, d, t)] = c.z ? y * silu(p.z[p.seq(b, d, t)]) : y;
      }
    }
  }
  return s;
}

/// d Σ out·dout / d h, column by column: F is linear in h, so F(e_i) − F(0) is the derivative.
std::vector<double> reference_dincoming(const Problem& p) {
  const std::vector<double> zero(p.h0.size(), 0.0);
  const Scan base = reference_scan(p, zero);
  std::vector<double> grad(p.h0.size());
  for (std::size_t i = 0; i < grad.size(); ++i) {
    std::vector<double> unit = zero;
    unit[i] = 1.0;
    const Scan s = reference_scan(p, unit);
    double sum = 0.0;
    for (std::size_t j = 0; j < s.out.size(); ++j) sum += (s.out[j] - base.out[j]) * p.dout[j];
    grad[i] = sum;
  }
  return grad;
}

template <class Mem>
struct Device {
  using T1 = kmamba::Tensor1<float, Mem>;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  T3 u, delta, z, h0, dout;
  T2 A;
  kmamba::Tensor2<std::int64_t, Mem> seq_idx;
  T4 B, C;
  T1 D, bias;
  Config cfg;

  explicit Device(const Problem& p) : cfg(p.cfg) {
    using kmamba::allocate_uninitialized;
    const Config& c = p.cfg;
    const auto seq = [&](const char* label, const std::vector<double>& values) {
      const auto v = allocate_uninitialized<T3>(label, c.batch, c.dim, c.seqlen);
      upload(v, values);
      return v;
    };
    u = seq("kmamba::test::u", p.u);
    delta = seq("kmamba::test::delta", p.delta);
    dout = seq("kmamba::test::dout", p.dout);
    if (c.z) z = seq("kmamba::test::z", p.z);
    A = allocate_uninitialized<T2>("kmamba::test::A", c.dim, c.dstate);
    upload(A, p.A);
    B = allocate_uninitialized<T4>("kmamba::test::B", c.batch, c.ngroups, c.dstate, c.seqlen);
    upload(B, p.B);
    C = allocate_uninitialized<T4>("kmamba::test::C", c.batch, c.ngroups, c.dstate, c.seqlen);
    upload(C, p.C);
    D = allocate_uninitialized<T1>("kmamba::test::D", c.dim);
    upload(D, p.D);
    if (c.bias) {
      bias = allocate_uninitialized<T1>("kmamba::test::delta_bias", c.dim);
      upload(bias, p.bias);
    }
    h0 = allocate_uninitialized<T3>("kmamba::test::h0", c.batch, c.dim, c.dstate);
    upload(h0, p.h0);
    if (!p.ids.empty()) {
      seq_idx = allocate_uninitialized<kmamba::Tensor2<std::int64_t, Mem>>("kmamba::test::seq_idx", c.batch, c.seqlen);
      const auto host = Kokkos::create_mirror_view(seq_idx);
      std::copy(p.ids.begin(), p.ids.end(), host.data());
      Kokkos::deep_copy(seq_idx, host);
    }
  }

  /// The scan's arguments from a zero initial state.
  kmamba::SelectiveScanArgs<Mem> args() const {
    kmamba::SelectiveScanArgs<Mem> a;
    a.u = u;
    a.delta = delta;
    a.A = A;
    a.B = B;
    a.C = C;
    if (cfg.D) a.D = D;
    a.z = z;
    a.delta_bias = bias;
    a.delta_softplus = cfg.softplus;
    a.seq_idx = seq_idx;
    return a;
  }
};

std::vector<Config> sweep() {
  std::vector<Config> configs;
  Config base;
  configs.push_back(base);
  Config c = base;
  c.z = true;
  c.bias = true;
  c.seed = 2;
  configs.push_back(c);
  c = base;
  c.softplus = false;
  c.ngroups = 2;
  c.z = true;
  c.seed = 3;
  configs.push_back(c);
  c = base;
  c.seqlen = 1;
  c.seed = 4;
  configs.push_back(c);
  return configs;
}

std::vector<double> difference(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> d(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return d;
}

KMAMBA_BACKEND_TEST_SUITE(SelectiveScanStateCorrection);

// The correction, the decay and the incoming state's gradient of problem p against the reference.
template <class Exec>
void expect_matches_reference(const Problem& p) {
  using Mem = typename Exec::memory_space;
  using T3 = kmamba::Tensor3<float, Mem>;
  const Exec exec;
  const Config& cfg = p.cfg;
  const std::string ctx = cfg.describe() + (p.ids.empty() ? "" : " packed");
  const Scan from_h = reference_scan(p, p.h0), from_zero = reference_scan(p, std::vector<double>(p.h0.size()));
  const Device<Mem> d(p);
  const auto out = kmamba::allocate<T3>("kmamba::test::out", cfg.batch, cfg.dim, cfg.seqlen);
  const auto last = kmamba::allocate<T3>("kmamba::test::last", cfg.batch, cfg.dim, cfg.dstate);
  const auto decay = poisoned<T3>("kmamba::test::decay", cfg.batch, cfg.dim, cfg.dstate);
  const auto dh = poisoned<T3>("kmamba::test::dh", cfg.batch, cfg.dim, cfg.dstate);
  kmamba::selective_scan_state_correction_forward(exec, d.args(), d.h0, out, last);
  kmamba::selective_scan_segment_decay(exec, d.args(), decay);
  kmamba::selective_scan_state_correction_backward(exec, d.args(), d.dout, dh);
  exec.fence();
  std::vector<double> want_decay;
  for (int b = 0; b < cfg.batch; ++b) {
    bool start = false;  // a row with a document start passes no state across the segment
    for (int t = 0; t < cfg.seqlen; ++t) start = start || p.starts(b, t);
    for (int c = 0; c < cfg.dim; ++c) {
      double sum = 0.0;
      for (int t = 0; t < cfg.seqlen; ++t) sum += p.delta_value(b, c, t);
      for (int n = 0; n < cfg.dstate; ++n) want_decay.push_back(start ? 0.0 : std::exp(p.A[c * cfg.dstate + n] * sum));
    }
  }
  const double out_error =
      expect_near_rel("out", host_doubles(out), difference(from_h.out, from_zero.out), output_tolerance, ctx);
  const double last_error =
      expect_near_rel("last_state", host_doubles(last), difference(from_h.last, from_zero.last), output_tolerance, ctx);
  const double decay_error = expect_near_rel("decay", host_doubles(decay), want_decay, output_tolerance, ctx);
  const double grad_error =
      expect_near_rel("dincoming", host_doubles(dh), reference_dincoming(p), gradient_tolerance, ctx);
  std::printf("[ measured ] %s: max|d|/max|ref| out %.1e last %.1e decay %.1e dincoming %.1e\n", ctx.c_str(), out_error,
              last_error, decay_error, grad_error);
}

TYPED_TEST(SelectiveScanStateCorrection, ForwardDecayAndGradientMatchTheReference) {
  for (const Config& cfg : sweep()) expect_matches_reference<TypeParam>(make_problem(cfg));
}

// Packed rows (PackedIds.hpp: documents of one token, a start at the last token, a row of 37
// tokens with starts only up to token 8) and a row without a start (the fourth row's ids are all
// equal): the incoming state reaches the first document only, a row with a start has decay 0.
TYPED_TEST(SelectiveScanStateCorrection, PackedRowsMatchTheReference) {
  for (Config cfg : sweep()) {
    cfg.batch = 4;
    Problem p = make_problem(cfg);
    p.ids = kmamba::test::packed_ids(3, cfg.seqlen);
    p.ids.resize(static_cast<std::size_t>(cfg.batch) * cfg.seqlen, 7);
    expect_matches_reference<TypeParam>(p);
  }
}

// Also on packed rows: the scan from a state with the same ids.
TYPED_TEST(SelectiveScanStateCorrection, ZeroStateScanPlusCorrectionEqualsTheScanFromTheState) {
  using Mem = typename TypeParam::memory_space;
  using T3 = kmamba::Tensor3<float, Mem>;
  const TypeParam exec;
  for (const bool packed : {false, true}) {
    Config cfg;
    cfg.seqlen = 21;
    cfg.z = true;
    cfg.bias = true;
    cfg.seed = 11;
    Problem p = make_problem(cfg);
    if (packed) p.ids = kmamba::test::packed_ids(cfg.batch, cfg.seqlen);
    const Device<Mem> d(p);
    const auto out = poisoned<T3>("kmamba::test::out", cfg.batch, cfg.dim, cfg.seqlen);
    const auto last = poisoned<T3>("kmamba::test::last", cfg.batch, cfg.dim, cfg.dstate);
    const auto want_out = poisoned<T3>("kmamba::test::want_out", cfg.batch, cfg.dim, cfg.seqlen);
    const auto want_last = poisoned<T3>("kmamba::test::want_last", cfg.batch, cfg.dim, cfg.dstate);
    kmamba::selective_scan_forward(exec, d.args(), out, last);
    kmamba::selective_scan_state_correction_forward(exec, d.args(), d.h0, out, last);
    kmamba::SelectiveScanArgs<Mem> from_state = d.args();
    from_state.initial_state = d.h0;
    kmamba::selective_scan_forward(exec, from_state, want_out, want_last);
    exec.fence();
    const std::string ctx = cfg.describe() + (packed ? " packed" : "");
    expect_near_rel("out", host_doubles(out), host_doubles(want_out), chaining_tolerance, ctx);
    expect_near_rel("last_state", host_doubles(last), host_doubles(want_last), chaining_tolerance, ctx);
  }
}

TYPED_TEST(SelectiveScanStateCorrection, GradientMatchesCentralDifferences) {
  using Mem = typename TypeParam::memory_space;
  using T3 = kmamba::Tensor3<float, Mem>;
  const TypeParam exec;
  Config cfg;
  cfg.seqlen = 19;
  cfg.z = true;
  cfg.bias = true;
  cfg.seed = 12;
  const Problem p = make_problem(cfg);
  const Device<Mem> d(p);
  const auto dh = poisoned<T3>("kmamba::test::dh", cfg.batch, cfg.dim, cfg.dstate);
  kmamba::selective_scan_state_correction_backward(exec, d.args(), d.dout, dh);
  std::mt19937_64 rng(99);
  const std::vector<double> v = random_values(rng, p.h0.size(), -1.0, 1.0);
  constexpr double eps = 0.25;
  // out from the fp32 correction of a zero output.
  const auto outputs = [&](const std::vector<double>& h) {
    const auto state = kmamba::allocate_uninitialized<T3>("kmamba::test::h", cfg.batch, cfg.dim, cfg.dstate);
    upload(state, h);
    const auto out = kmamba::allocate<T3>("kmamba::test::out", cfg.batch, cfg.dim, cfg.seqlen);
    kmamba::selective_scan_state_correction_forward(exec, d.args(), state, out, T3());
    exec.fence();
    return host_doubles(out);
  };
  expect_gradient_matches_central_difference(outputs, p.h0, p.dout, host_doubles(dh), v, eps, output_tolerance,
                                             gradient_tolerance, "selective scan");
}

TYPED_TEST(SelectiveScanStateCorrection, RejectsBadShapes) {
  using Mem = typename TypeParam::memory_space;
  using T3 = kmamba::Tensor3<float, Mem>;
  const TypeParam exec;
  Config cfg;
  const Device<Mem> d(make_problem(cfg));
  const auto out = kmamba::allocate<T3>("kmamba::test::out", cfg.batch, cfg.dim, cfg.seqlen);
  kmamba::SelectiveScanArgs<Mem> packed = d.args();
  packed.seq_idx =
      kmamba::allocate<kmamba::Tensor2<std::int64_t, Mem>>("kmamba::test::seq_idx", cfg.batch, cfg.seqlen + 1);
  expect_user_error([&] { kmamba::selective_scan_state_correction_backward(exec, packed, d.dout, d.h0); },
                    {"kmamba::selective_scan_state_correction_backward", "seq_idx"});
  const auto wrong = kmamba::allocate<T3>("kmamba::test::wrong", cfg.batch, cfg.dim, cfg.dstate + 1);
  expect_user_error([&] { kmamba::selective_scan_state_correction_forward(exec, d.args(), wrong, out, T3()); },
                    {"kmamba::selective_scan_state_correction_forward", "incoming"});
  expect_user_error([&] { kmamba::selective_scan_segment_decay(exec, d.args(), T3()); },
                    {"kmamba::selective_scan_segment_decay", "decay"});
}

}  // namespace
