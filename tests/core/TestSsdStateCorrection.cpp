// The SSD's incoming-state correction (kmamba/core/SsdStateCorrection.hpp) against the
// double-precision SSD reference (tests/reference/SsdReference.hpp): the SSD is linear in its
// initial state, so the correction of a state h is ref(h) − ref(0) (outputs and final states), the
// segment decay is exp(Σ_t a_t), and the gradient with respect to h is the reference's dh0 with no
// final-state cotangent. The sweep covers dt_bias, softplus or not, dt limits that clamp, a given
// log decay, 1 or 2 groups, one token, segments longer than a chunk, and heads wider than the
// kernels' 64-column product blocks (headdim 67, dstate 70); D is given and must not enter the
// correction.
//
// Tolerances, relative to each tensor's largest |reference| (fp32, u = 2^-24 ≈ 6e-8):
// - correction and decay: every element is exp(cs_t) times a dot product of dstate (5, or 70) terms,
//   cs_t an fp32 sum of ≤ t + 1 terms a_s; the dot product's rounding is ≤ dstate·u relative to its
//   terms' magnitude and the cumsum's, relative to exp(cs_t), ≤ (t + 1)·u·|cs_t|, which the decay
//   exp(cs_t) outweighs for long t (max over t of t²·e^{-t/2}·u < 10 u here). Bound 5e-6 (the SSD's
//   output tolerance, TestSsd.cpp), about 20× those at dstate 5; at dstate 70 the worst case
//   (4e-6) nears it, but the terms' random signs make the rounding grow like √dstate·u (measured
//   4e-7).
// - the incoming-state gradient: sums over seqlen (≤ 37) tokens of such terms: 2e-5 (the SSD's
//   gradient tolerance).
// - the zero-state SSD plus the correction against the SSD from that state (both fp32, different
//   summation orders): 1e-5, as the SSD's segment chaining test.
// - central differences of F(h) = Σ out(h)·dout computed in double from the fp32 op: F is linear in
//   h, so the difference has no truncation error, only the rounding of F at h ± εv, which the
//   forward bound r = 5e-6 limits to r·max|out|·Σ|dout| each: |fd − ⟨dh, v⟩| ≤ r·M·S/ε plus the
//   gradient's own bound times Σ|v|·max|dh|.
#include <kmamba/core/Core.hpp>
#include <kmamba/core/Ssd.hpp>
#include <kmamba/core/SsdStateCorrection.hpp>

#include "Backends.hpp"
#include "Checks.hpp"
#include "PackedIds.hpp"
#include "SsdReference.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace kmamba::reference::ssd;
using namespace kmamba::test;

constexpr double output_tolerance = 5e-6, gradient_tolerance = 2e-5, chaining_tolerance = 1e-5;

std::vector<double> random_values(std::mt19937_64& rng, std::size_t n, double lo, double hi) {
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) x = static_cast<double>(static_cast<float>(d(rng)));
  return v;
}

/// A problem with D and an incoming state h0 (the reference's), every value an fp32 number.
RefProblem make_reference(const Config& cfg) {
  std::mt19937_64 rng(cfg.seed);
  RefProblem P;
  P.cfg = cfg;
  const std::size_t tokens = static_cast<std::size_t>(cfg.batch) * cfg.seqlen;
  P.x = random_values(rng, tokens * cfg.nheads * cfg.headdim, -1.5, 1.5);
  P.dt = cfg.softplus ? random_values(rng, tokens * cfg.nheads, -2.0, 0.5)
                      : random_values(rng, tokens * cfg.nheads, 0.05, 0.8);
  if (cfg.log_decay) {
    P.log_decay = random_values(rng, tokens * cfg.nheads, -1.0, -0.02);
  } else {
    P.A = random_values(rng, static_cast<std::size_t>(cfg.nheads), -1.5, -0.2);
  }
  P.B = random_values(rng, tokens * cfg.ngroups * cfg.dstate, -1.0, 1.0);
  P.C = random_values(rng, tokens * cfg.ngroups * cfg.dstate, -1.0, 1.0);
  P.D = random_values(rng, static_cast<std::size_t>(cfg.nheads), 0.5, 1.5);
  if (cfg.bias) P.bias = random_values(rng, static_cast<std::size_t>(cfg.nheads), -0.5, 0.5);
  P.h0 = random_values(rng, static_cast<std::size_t>(cfg.batch) * cfg.nheads * cfg.headdim * cfg.dstate, -1.0, 1.0);
  P.dout = random_values(rng, tokens * cfg.nheads * cfg.headdim, -1.0, 1.0);
  return P;
}

template <class Mem>
struct Device {
  using T1 = kmamba::Tensor1<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  T4 x, B, C, h0, dout;
  T3 dt, log_decay;
  T1 A, D, bias;
  kmamba::Tensor2<std::int64_t, Mem> seq_idx;  // the problem's packed ids, if any
  Config cfg;

  explicit Device(const RefProblem& P) : cfg(P.cfg) {
    using kmamba::allocate_uninitialized;
    const Config& c = P.cfg;
    x = allocate_uninitialized<T4>("kmamba::test::x", c.batch, c.seqlen, c.nheads, c.headdim);
    dt = allocate_uninitialized<T3>("kmamba::test::dt", c.batch, c.seqlen, c.nheads);
    B = allocate_uninitialized<T4>("kmamba::test::B", c.batch, c.seqlen, c.ngroups, c.dstate);
    C = allocate_uninitialized<T4>("kmamba::test::C", c.batch, c.seqlen, c.ngroups, c.dstate);
    D = allocate_uninitialized<T1>("kmamba::test::D", c.nheads);
    h0 = allocate_uninitialized<T4>("kmamba::test::h0", c.batch, c.nheads, c.headdim, c.dstate);
    dout = allocate_uninitialized<T4>("kmamba::test::dout", c.batch, c.seqlen, c.nheads, c.headdim);
    for (const auto& [view, values] : {std::make_pair(x, &P.x), std::make_pair(B, &P.B), std::make_pair(C, &P.C),
                                       std::make_pair(h0, &P.h0), std::make_pair(dout, &P.dout)}) {
      upload(view, *values);
    }
    upload(dt, P.dt);
    upload(D, P.D);
    if (c.log_decay) {
      log_decay = allocate_uninitialized<T3>("kmamba::test::log_decay", c.batch, c.seqlen, c.nheads);
      upload(log_decay, P.log_decay);
    } else {
      A = allocate_uninitialized<T1>("kmamba::test::A", c.nheads);
      upload(A, P.A);
    }
    if (c.bias) {
      bias = allocate_uninitialized<T1>("kmamba::test::dt_bias", c.nheads);
      upload(bias, P.bias);
    }
    if (!P.seq.empty()) {
      seq_idx = allocate_uninitialized<kmamba::Tensor2<std::int64_t, Mem>>("kmamba::test::seq_idx", c.batch, c.seqlen);
      const auto host = Kokkos::create_mirror_view(seq_idx);
      std::copy(P.seq.begin(), P.seq.end(), host.data());
      Kokkos::deep_copy(seq_idx, host);
    }
  }

  /// The SSD's arguments from a zero initial state.
  kmamba::SsdArgs<Mem> args() const {
    kmamba::SsdArgs<Mem> a;
    a.x = x;
    a.dt = dt;
    a.A = A;
    a.B = B;
    a.C = C;
    a.D = D;
    a.dt_bias = bias;
    a.log_decay = log_decay;
    a.dt_softplus = cfg.softplus;
    a.dt_min = cfg.dt_min;
    a.dt_max = cfg.dt_max;
    a.chunk_size = cfg.chunk;
    a.seq_idx = seq_idx;
    return a;
  }
};

std::vector<Config> sweep() {
  std::vector<Config> configs;
  Config base;
  base.seqlen = 37;
  base.chunk = 8;
  configs.push_back(base);
  Config c = base;
  c.bias = true;
  c.ngroups = 1;
  c.seed = 2;
  configs.push_back(c);
  c = base;
  c.softplus = false;
  c.seed = 3;
  configs.push_back(c);
  c = base;
  c.bias = true;
  c.dt_min = 0.2f;
  c.dt_max = 0.6f;
  c.seed = 4;
  configs.push_back(c);
  c = base;
  c.log_decay = true;
  c.seed = 5;
  configs.push_back(c);
  c = base;
  c.seqlen = 1;
  c.seed = 6;
  configs.push_back(c);
  // More state columns and head channels than one 64-wide block of the kernels' products.
  c = base;
  c.headdim = 67;
  c.dstate = 70;
  c.seed = 7;
  configs.push_back(c);
  return configs;
}

/// a − b element by element.
std::vector<double> difference(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> d(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return d;
}

KMAMBA_BACKEND_TEST_SUITE(SsdStateCorrection);

// The correction, the segment decay and the incoming-state gradient of `with_state` (its h0 the
// incoming state) against the reference's differences, exp(Σ a_t) (0 past a document start) and dh0.
template <class Exec>
void check_against_reference(const RefProblem& with_state) {
  using Mem = typename Exec::memory_space;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  const Exec exec;
  const Config& cfg = with_state.cfg;
  const std::string ctx = cfg.describe() + (with_state.seq.empty() ? "" : " packed");
  RefProblem zero_state = with_state;
  zero_state.h0.clear();
  const RefForward from_h = ref_forward(with_state), from_zero = ref_forward(zero_state);
  const Device<Mem> d(with_state);
  const auto out = kmamba::allocate<T4>("kmamba::test::out", cfg.batch, cfg.seqlen, cfg.nheads, cfg.headdim);
  const auto fin = kmamba::allocate<T4>("kmamba::test::final", cfg.batch, cfg.nheads, cfg.headdim, cfg.dstate);
  const auto decay = poisoned<T2>("kmamba::test::decay", cfg.batch, cfg.nheads);
  const auto dh = poisoned<T4>("kmamba::test::dh", cfg.batch, cfg.nheads, cfg.headdim, cfg.dstate);
  kmamba::ssd_state_correction_forward(exec, d.args(), d.h0, out, fin);
  kmamba::ssd_segment_decay(exec, d.args(), decay);
  kmamba::ssd_state_correction_backward(exec, d.args(), d.dout, dh);
  exec.fence();
  const double out_error =
      expect_near_rel("out", host_doubles(out), difference(from_h.out, from_zero.out), output_tolerance, ctx);
  const double final_error =
      expect_near_rel("final_states", host_doubles(fin), difference(from_h.final_states, from_zero.final_states),
                      output_tolerance, ctx);
  std::vector<double> want_decay;
  for (int b = 0; b < cfg.batch; ++b) {
    for (int h = 0; h < cfg.nheads; ++h) {
      double sum = 0.0;
      bool restarted = false;
      for (int t = 0; t < cfg.seqlen; ++t) {
        restarted = restarted || with_state.restart(b, t);
        sum += with_state.token_log_decay(b, t, h, with_state.delta(with_state.pre(b, t, h)));
      }
      want_decay.push_back(restarted ? 0.0 : std::exp(sum));
    }
  }
  const double decay_error = expect_near_rel("decay", host_doubles(decay), want_decay, output_tolerance, ctx);
  const double grad_error =
      expect_near_rel("dincoming", host_doubles(dh), ref_backward(with_state).dh0, gradient_tolerance, ctx);
  std::printf("[ measured ] %s: max|d|/max|ref| out %.1e final %.1e decay %.1e dincoming %.1e\n", ctx.c_str(),
              out_error, final_error, decay_error, grad_error);
}

TYPED_TEST(SsdStateCorrection, ForwardDecayAndGradientMatchTheReference) {
  for (const Config& cfg : sweep()) check_against_reference<TypeParam>(make_reference(cfg));
}

// Packed rows (SsdArgs::seq_idx, PackedIds.hpp: documents of one token, across chunks, one at a
// row's last token): the incoming state reaches the tokens before a row's first document start
// only, and a row with a start has decay 0.
TYPED_TEST(SsdStateCorrection, PackedRowsMatchTheReference) {
  for (Config cfg : sweep()) {
    cfg.batch = 3;
    RefProblem P = make_reference(cfg);
    P.seq = kmamba::test::packed_ids(cfg.batch, cfg.seqlen);
    check_against_reference<TypeParam>(P);
  }
}

TYPED_TEST(SsdStateCorrection, ZeroStateScanPlusCorrectionEqualsTheScanFromTheState) {
  using Mem = typename TypeParam::memory_space;
  using T4 = kmamba::Tensor4<float, Mem>;
  const TypeParam exec;
  Config cfg;
  cfg.seqlen = 21;
  cfg.bias = true;
  cfg.seed = 11;
  const Device<Mem> d(make_reference(cfg));
  const auto out = poisoned<T4>("kmamba::test::out", cfg.batch, cfg.seqlen, cfg.nheads, cfg.headdim);
  const auto fin = poisoned<T4>("kmamba::test::final", cfg.batch, cfg.nheads, cfg.headdim, cfg.dstate);
  const auto want_out = poisoned<T4>("kmamba::test::want_out", cfg.batch, cfg.seqlen, cfg.nheads, cfg.headdim);
  const auto want_fin = poisoned<T4>("kmamba::test::want_final", cfg.batch, cfg.nheads, cfg.headdim, cfg.dstate);
  kmamba::ssd_forward(exec, d.args(), out, fin);
  kmamba::ssd_state_correction_forward(exec, d.args(), d.h0, out, fin);
  kmamba::SsdArgs<Mem> from_state = d.args();
  from_state.initial_states = d.h0;
  kmamba::ssd_forward(exec, from_state, want_out, want_fin);
  exec.fence();
  const std::string ctx = cfg.describe();
  expect_near_rel("out", host_doubles(out), host_doubles(want_out), chaining_tolerance, ctx);
  expect_near_rel("final_states", host_doubles(fin), host_doubles(want_fin), chaining_tolerance, ctx);
}

TYPED_TEST(SsdStateCorrection, GradientMatchesCentralDifferences) {
  using Mem = typename TypeParam::memory_space;
  using T4 = kmamba::Tensor4<float, Mem>;
  const TypeParam exec;
  Config cfg;
  cfg.seqlen = 19;
  cfg.bias = true;
  cfg.seed = 12;
  const RefProblem P = make_reference(cfg);
  const Device<Mem> d(P);
  const auto dh = poisoned<T4>("kmamba::test::dh", cfg.batch, cfg.nheads, cfg.headdim, cfg.dstate);
  kmamba::ssd_state_correction_backward(exec, d.args(), d.dout, dh);
  std::mt19937_64 rng(99);
  const std::vector<double> v = random_values(rng, P.h0.size(), -1.0, 1.0);
  constexpr double eps = 0.25;
  // out from the fp32 correction of a zero output.
  const auto outputs = [&](const std::vector<double>& h) {
    const auto state =
        kmamba::allocate_uninitialized<T4>("kmamba::test::h", cfg.batch, cfg.nheads, cfg.headdim, cfg.dstate);
    upload(state, h);
    const auto out = kmamba::allocate<T4>("kmamba::test::out", cfg.batch, cfg.seqlen, cfg.nheads, cfg.headdim);
    kmamba::ssd_state_correction_forward(exec, d.args(), state, out, T4());
    exec.fence();
    return host_doubles(out);
  };
  expect_gradient_matches_central_difference(outputs, P.h0, P.dout, host_doubles(dh), v, eps, output_tolerance,
                                             gradient_tolerance, "ssd");
}

TYPED_TEST(SsdStateCorrection, RejectsAGateAndBadShapes) {
  using Mem = typename TypeParam::memory_space;
  using T4 = kmamba::Tensor4<float, Mem>;
  const TypeParam exec;
  Config cfg;
  const Device<Mem> d(make_reference(cfg));
  const auto out = kmamba::allocate<T4>("kmamba::test::out", cfg.batch, cfg.seqlen, cfg.nheads, cfg.headdim);
  kmamba::SsdArgs<Mem> gated = d.args();
  gated.z = out;
  expect_user_error([&] { kmamba::ssd_state_correction_forward(exec, gated, d.h0, out, T4()); },
                    {"kmamba::ssd_state_correction_forward", "z must be absent"});
  const auto wrong = kmamba::allocate<T4>("kmamba::test::wrong", cfg.batch, cfg.nheads, cfg.headdim + 1, cfg.dstate);
  expect_user_error([&] { kmamba::ssd_state_correction_forward(exec, d.args(), wrong, out, T4()); },
                    {"kmamba::ssd_state_correction_forward", "incoming"});
  expect_user_error([&] { kmamba::ssd_segment_decay(exec, d.args(), kmamba::Tensor2<float, Mem>()); },
                    {"kmamba::ssd_segment_decay", "decay"});
}

}  // namespace
