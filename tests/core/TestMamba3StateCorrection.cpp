// The Mamba-3 incoming-state correction (kmamba/core/Mamba3StateCorrection.hpp) against the
// double-precision Mamba-3 reference (tests/reference/Mamba3ScanReference.hpp), SISO and MIMO. The
// scan is linear in its initial SSM state h, so the correction of h is ref(h) − ref(0) (outputs and
// final SSM state) with the reference's initial angle, k and v; the gradient with respect to h is the
// reference's dssm0 with no final-state cotangent; the initial k and v's gradients given
// ∂/∂Ĥ_{−1} are the reference's dk0, dv0 given its dssm0 (Ĥ_{−1} = h + β̃_0·Σ_r v_{−1,r} k_{−1,r}ᵀ and h
// enter the scan alike); a final-angle cotangent G adds ref(G) − ref(0) to dangles and ddt; the
// segment states are the reference's final angle, k and v and exp(Σ_t adt_t). The sweep covers
// SISO with and without the gate, one token, segments longer than a chunk, and MIMO of ranks 2 and 3,
// each also on packed rows (seq_idx) against the packed reference.
//
// Tolerances, relative to each tensor's largest |reference| (fp32, u = 2^-24 ≈ 6e-8):
// - correction, final state, segment states: each element is exp(cs_t) times a dot product of the
//   rotated q (dstate terms) with a state row, summed over ≤ R ranks and gated, the rotation by an
//   fp32 angle θ_t (|θ| ≤ 2π + the segment's sum for SISO, up to about 30 for MIMO, whose initial
//   angle is drawn in ±20): the angle's rounding, |θ|·u per step over ≤ seqlen steps, moves cos and
//   sin by ≤ 30·10·u ≈ 2e-5 relative in the worst case; random signs make it √-like. 1e-5 is the
//   scan's output tolerance (TestMamba3Scan.cpp), whose rotations are the same; observed below 1e-6.
// - gradients (dincoming, initial k and v, angles and dt): sums over seqlen tokens and ranks of such
//   terms: 1e-4, the scan's gradient tolerance.
// - the zero-state scan plus the correction against the scan from h (both fp32, different
//   summation orders): 2e-5, as the scan's segment-chaining tests.
// - central differences of F(h) = Σ out(h)·dout from the fp32 correction: F is linear in h, so the
//   difference has no truncation error, only the rounding of F at h ± εv, which the forward bound
//   r = 1e-5 limits to r·max|out|·Σ|dout| each: |fd − ⟨dh, v⟩| ≤ r·M·S/ε plus the gradient's own bound
//   times Σ|v|·max|dh|.
#include <kmamba/core/Core.hpp>
#include <kmamba/core/Mamba3Scan.hpp>
#include <kmamba/core/Mamba3StateCorrection.hpp>

#include "Backends.hpp"
#include "Checks.hpp"
#include "Mamba3DeviceProblem.hpp"
#include "Mamba3ScanReference.hpp"
#include "PackedIds.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace {

using namespace kmamba::reference::mamba3;
using namespace kmamba::test;

constexpr double output_tolerance = 1e-5, gradient_tolerance = 1e-4, chaining_tolerance = 2e-5;

std::vector<Config> sweep() {
  std::vector<Config> configs;
  Config c;
  c.seqlen = 13;
  c.chunk = 4;
  c.D = c.z = c.initial = true;
  configs.push_back(c);  // SISO with the gate, several chunks
  c.z = false;
  c.seed = 2;
  configs.push_back(c);  // SISO without the gate (the output norm's form)
  c.seqlen = 1;
  c.z = true;
  c.seed = 3;
  configs.push_back(c);  // one token
  c.seqlen = 11;
  c.rank = 2;
  c.ngroups = 1;
  c.nangles = 3;
  c.chunk = 0;
  c.seed = 4;
  configs.push_back(c);  // MIMO rank 2 with the gate
  c.rank = 3;
  c.z = false;
  c.chunk = 2;
  c.seed = 5;
  configs.push_back(c);  // MIMO rank 3 without it, several chunks
  return configs;
}

/// a − b element by element.
std::vector<double> difference(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> d(a.size());
  for (std::size_t i = 0; i < a.size(); ++i) d[i] = a[i] - b[i];
  return d;
}

/// The problem with its initial SSM state zero (angle, k and v kept).
RefProblem without_ssm(const RefProblem& P) {
  RefProblem Z = P;
  Z.ssm0.assign(P.ssm0.size(), 0.0);
  return Z;
}

/// Angles compared on the circle for SISO (both sides reduced into [0, 2π) may differ by a turn).
std::vector<double> unwrapped(const std::vector<double>& got, const std::vector<double>& ref, bool circle) {
  if (!circle) return got;
  std::vector<double> out(got.size());
  constexpr double two_pi = 6.283185307179586;
  for (std::size_t i = 0; i < got.size(); ++i) out[i] = got[i] - two_pi * std::round((got[i] - ref[i]) / two_pi);
  return out;
}

/// The correction ops of either variant on a Mamba3DeviceProblem.
template <class Exec>
struct Ops {
  using Mem = typename Exec::memory_space;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  const Mamba3DeviceProblem<Mem>& p;
  Exec exec;

  void correct(const T4& incoming, const T4& out, const T4& final_ssm) const {
    if (p.cfg.mimo()) {
      kmamba::mamba3_state_correction_forward(exec, p.mimo_args(), incoming, out, final_ssm);
    } else {
      kmamba::mamba3_state_correction_forward(exec, p.siso_args(), incoming, out, final_ssm);
    }
  }
  void gradient(const T4& dincoming) const {
    if (p.cfg.mimo()) {
      kmamba::mamba3_state_correction_backward(exec, p.mimo_args(), p.dout, dincoming);
    } else {
      kmamba::mamba3_state_correction_backward(exec, p.siso_args(), p.dout, dincoming);
    }
  }
  /// The final angle, k and v states and the decay, as host doubles in that order.
  std::vector<std::vector<double>> segment_states() const {
    const Config& c = p.cfg;
    const T3 angle = poisoned<T3>("angle", c.batch, c.nheads, c.nangles);
    const T2 decay = poisoned<T2>("decay", c.batch, c.nheads);
    const T4 k4 = poisoned<T4>("k", c.batch, c.nheads, c.R(), c.dstate);
    const T4 v4 = poisoned<T4>("v", c.batch, c.nheads, c.R(), c.headdim);
    if (c.mimo()) {
      kmamba::mamba3_segment_states(exec, p.mimo_args(), kmamba::Mamba3MimoStates<Mem>{angle, {}, k4, v4}, decay);
    } else {
      const T3 k3(k4.data(), c.batch, c.nheads, c.dstate), v3(v4.data(), c.batch, c.nheads, c.headdim);
      kmamba::mamba3_segment_states(exec, p.siso_args(), kmamba::Mamba3SisoStates<Mem>{angle, {}, k3, v3}, decay);
    }
    exec.fence();
    return {host_doubles(angle), host_doubles(k4), host_doubles(v4), host_doubles(decay)};
  }
  /// The initial k and v's gradients given ∂/∂Ĥ_{−1}, as host doubles.
  std::pair<std::vector<double>, std::vector<double>> initial_kv(const T4& dentering) const {
    const Config& c = p.cfg;
    const T4 dk = poisoned<T4>("dk0", c.batch, c.nheads, c.R(), c.dstate);
    const T4 dv = poisoned<T4>("dv0", c.batch, c.nheads, c.R(), c.headdim);
    if (c.mimo()) {
      kmamba::mamba3_initial_kv_backward(exec, p.mimo_args(), dentering, kmamba::Mamba3MimoStates<Mem>{{}, {}, dk, dv});
    } else {
      kmamba::mamba3_initial_kv_backward(
          exec, p.siso_args(), dentering,
          kmamba::Mamba3SisoStates<Mem>{
              {}, {}, T3(dk.data(), c.batch, c.nheads, c.dstate), T3(dv.data(), c.batch, c.nheads, c.headdim)});
    }
    exec.fence();
    return {host_doubles(dk), host_doubles(dv)};
  }
};

/// The correction of the initial SSM state of P and its gradient against ref(h) − ref(0) and the
/// reference's dssm0 (P without a final-state cotangent).
template <class Exec>
void expect_correction_matches_reference(const RefProblem& P) {
  using Mem = typename Exec::memory_space;
  using T4 = kmamba::Tensor4<float, Mem>;
  const Config& cfg = P.cfg;
  const std::string ctx = cfg.describe() + (P.seq_idx.empty() ? "" : " packed");
  const RefOutputs from_h = ref_forward(P), from_zero = ref_forward(without_ssm(P));
  const Mamba3DeviceProblem<Mem> p(P);
  const Ops<Exec> ops{p, Exec()};
  const auto out = kmamba::allocate<T4>("kmamba::test::out", cfg.batch, cfg.seqlen, cfg.nheads, cfg.headdim);
  const auto fin = kmamba::allocate<T4>("kmamba::test::final", cfg.batch, cfg.nheads, cfg.headdim, cfg.dstate);
  const auto dh = poisoned<T4>("kmamba::test::dh", cfg.batch, cfg.nheads, cfg.headdim, cfg.dstate);
  // The initial states of the arguments hold h too: the correction must read only their angle.
  const T4 h = cfg.mimo() ? p.mimo_initial.ssm : p.siso_initial.ssm;
  ops.correct(h, out, fin);
  ops.gradient(dh);
  ops.exec.fence();
  const double out_error =
      expect_near_rel("out", host_doubles(out), difference(from_h.out, from_zero.out), output_tolerance, ctx);
  const double final_error =
      expect_near_rel("final ssm", host_doubles(fin), difference(from_h.ssm, from_zero.ssm), output_tolerance, ctx);
  const double grad_error =
      expect_near_rel("dincoming", host_doubles(dh), ref_backward(P).dssm0, gradient_tolerance, ctx);
  std::printf("[ measured ] %s: max|d|/max|ref| out %.1e final %.1e dincoming %.1e\n", ctx.c_str(), out_error,
              final_error, grad_error);
}

/// The segment states of P (with a final-state cotangent) against the reference's final angle, k, v
/// and its decay (0 for a row where a document starts), the initial k and v's gradients given the
/// reference's ∂/∂Ĥ_{−1}, and a final-angle cotangent's share of dangles and ddt.
template <class Exec>
void expect_segment_states_match_reference(const RefProblem& P) {
  using Mem = typename Exec::memory_space;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  const Exec exec;
  const Config& cfg = P.cfg;
  const std::string ctx = cfg.describe() + (P.seq_idx.empty() ? "" : " packed");
  const Mamba3DeviceProblem<Mem> p(P);
  const Ops<Exec> ops{p, exec};
  // The segment's final angle, k, v and decay, without the scan.
  const RefOutputs ref = ref_forward(P);
  const std::vector<std::vector<double>> got = ops.segment_states();
  std::vector<double> decay;
  for (int b = 0; b < cfg.batch; ++b) {
    bool starts = false;
    for (int t = 0; t < cfg.seqlen; ++t) starts = starts || P.starts(b, t);
    for (int h = 0; h < cfg.nheads; ++h) {
      double sum = 0.0;
      for (int t = 0; t < cfg.seqlen; ++t) sum += P.adt[P.it(b, h, t)];
      decay.push_back(starts ? 0.0 : std::exp(sum));
    }
  }
  expect_near_rel("final angle", unwrapped(got[0], ref.angle, !cfg.mimo()), ref.angle, output_tolerance, ctx);
  expect_near_rel("final k", got[1], ref.k, output_tolerance, ctx);
  expect_near_rel("final v", got[2], ref.v, output_tolerance, ctx);
  expect_near_rel("decay", got[3], decay, output_tolerance, ctx);
  // The initial k and v's gradients from the reference's ∂/∂Ĥ_{−1} (its dssm0).
  const RefGrads g = ref_backward(P);
  const auto dentering =
      kmamba::allocate_uninitialized<T4>("kmamba::test::dentering", cfg.batch, cfg.nheads, cfg.headdim, cfg.dstate);
  upload(dentering, g.dssm0);
  const auto [dk, dv] = ops.initial_kv(dentering);
  expect_near_rel("dk0", dk, g.dk0, gradient_tolerance, ctx);
  expect_near_rel("dv0", dv, g.dv0, gradient_tolerance, ctx);
  // A final-angle cotangent's share of dangles and dt: ref(with it) − ref(without).
  RefProblem no_angle = P;
  no_angle.dangle.assign(P.dangle.size(), 0.0);
  const RefGrads g0 = ref_backward(no_angle);
  const auto dangles = kmamba::allocate<T4>("kmamba::test::dangles", cfg.batch, cfg.seqlen, cfg.nheads, cfg.nangles);
  const auto ddt = kmamba::allocate<T3>("kmamba::test::ddt", cfg.batch, cfg.nheads, cfg.seqlen);
  const auto dangle = kmamba::allocate_uninitialized<T3>("kmamba::test::dangle", cfg.batch, cfg.nheads, cfg.nangles);
  upload(dangle, P.dangle);
  kmamba::mamba3_final_angle_backward(exec, p.angles, p.dt, dangle, dangles, ddt, p.seq_idx);
  exec.fence();
  expect_near_rel("dangles", host_doubles(dangles), difference(g.dangles, g0.dangles), gradient_tolerance, ctx);
  expect_near_rel("ddt", host_doubles(ddt), difference(g.ddt, g0.ddt), gradient_tolerance, ctx);
}

/// The scan of P from a zero SSM state plus the correction by P's initial SSM state against the
/// scan from that state (outputs, final SSM state, SISO's kept ungated output).
template <class Exec>
void expect_zero_state_scan_plus_correction_equals_scan(const RefProblem& P) {
  using Mem = typename Exec::memory_space;
  using T4 = kmamba::Tensor4<float, Mem>;
  const Exec exec;
  const Config& cfg = P.cfg;
  const std::string ctx = cfg.describe() + (P.seq_idx.empty() ? "" : " packed");
  const Mamba3DeviceProblem<Mem> p(P);
  const int B = cfg.batch, L = cfg.seqlen, H = cfg.nheads, Pd = cfg.headdim, N = cfg.dstate;
  const auto out = poisoned<T4>("kmamba::test::out", B, L, H, Pd);
  const auto want = poisoned<T4>("kmamba::test::want_out", B, L, H, Pd);
  const auto fin = poisoned<T4>("kmamba::test::final", B, H, Pd, N);
  const auto want_fin = poisoned<T4>("kmamba::test::want_final", B, H, Pd, N);
  const auto ungated = poisoned<T4>("kmamba::test::ungated", B, L, H, Pd);
  const auto want_ungated = poisoned<T4>("kmamba::test::want_ungated", B, L, H, Pd);
  if (cfg.mimo()) {
    kmamba::Mamba3MimoArgs<Mem> from_zero = p.mimo_args();
    from_zero.initial.ssm = {};
    kmamba::mamba3_mimo_forward(exec, from_zero, out, kmamba::Mamba3MimoStates<Mem>{{}, fin, {}, {}});
    kmamba::mamba3_state_correction_forward(exec, from_zero, p.mimo_initial.ssm, out, fin);
    kmamba::mamba3_mimo_forward(exec, p.mimo_args(), want, kmamba::Mamba3MimoStates<Mem>{{}, want_fin, {}, {}});
  } else {
    kmamba::Mamba3SisoArgs<Mem> from_zero = p.siso_args(), from_state = p.siso_args();
    from_zero.initial.ssm = {};
    if (cfg.z) {
      from_zero.ungated_out = ungated;
      from_state.ungated_out = want_ungated;
    }
    kmamba::mamba3_siso_forward(exec, from_zero, out, kmamba::Mamba3SisoStates<Mem>{{}, fin, {}, {}});
    kmamba::mamba3_state_correction_forward(exec, from_zero, p.siso_initial.ssm, out, fin);
    kmamba::mamba3_siso_forward(exec, from_state, want, kmamba::Mamba3SisoStates<Mem>{{}, want_fin, {}, {}});
  }
  exec.fence();
  expect_near_rel("out", host_doubles(out), host_doubles(want), chaining_tolerance, ctx);
  expect_near_rel("final ssm", host_doubles(fin), host_doubles(want_fin), chaining_tolerance, ctx);
  if (!cfg.mimo() && cfg.z) {
    expect_near_rel("ungated out", host_doubles(ungated), host_doubles(want_ungated), chaining_tolerance, ctx);
  }
}

/// `cfg`'s problem on three rows packed as PackedIds.hpp lays them out (first starts at tokens 1, 2
/// and 5, last ones at 4, seqlen − 1 and 8, none in a one-token row).
RefProblem packed_problem(Config cfg) {
  cfg.batch = 3;
  RefProblem P = make_reference_problem(cfg);
  P.seq_idx = packed_ids(cfg.batch, cfg.seqlen);
  return P;
}

KMAMBA_BACKEND_TEST_SUITE(Mamba3StateCorrection);

TYPED_TEST(Mamba3StateCorrection, CorrectionAndItsGradientMatchTheReference) {
  for (const Config& cfg : sweep()) expect_correction_matches_reference<TypeParam>(make_reference_problem(cfg));
}

TYPED_TEST(Mamba3StateCorrection, SegmentStatesAndStateGradientsMatchTheReference) {
  for (Config cfg : sweep()) {
    cfg.dfinal = true;
    expect_segment_states_match_reference<TypeParam>(make_reference_problem(cfg));
  }
}

TYPED_TEST(Mamba3StateCorrection, ZeroStateScanPlusCorrectionEqualsTheScanFromTheState) {
  for (const Config& cfg : sweep()) {
    expect_zero_state_scan_plus_correction_equals_scan<TypeParam>(make_reference_problem(cfg));
  }
}

// Packed rows (seq_idx): the state entering a segment belongs to its first document, the final
// states are its last one's; every check above on packed rows against the packed reference.
TYPED_TEST(Mamba3StateCorrection, PackedRowsMatchTheReference) {
  for (Config cfg : sweep()) {
    expect_correction_matches_reference<TypeParam>(packed_problem(cfg));
    expect_zero_state_scan_plus_correction_equals_scan<TypeParam>(packed_problem(cfg));
    cfg.dfinal = true;
    expect_segment_states_match_reference<TypeParam>(packed_problem(cfg));
  }
}

TYPED_TEST(Mamba3StateCorrection, GradientMatchesCentralDifferences) {
  using Mem = typename TypeParam::memory_space;
  using T4 = kmamba::Tensor4<float, Mem>;
  const TypeParam exec;
  for (const Config& cfg : {sweep()[0], sweep()[3]}) {
    const RefProblem P = make_reference_problem(cfg);
    const Mamba3DeviceProblem<Mem> p(P);
    const Ops<TypeParam> ops{p, exec};
    const auto dh = poisoned<T4>("kmamba::test::dh", cfg.batch, cfg.nheads, cfg.headdim, cfg.dstate);
    ops.gradient(dh);
    std::mt19937_64 rng(cfg.seed + 99);
    std::uniform_real_distribution<double> unit(-1.0, 1.0);
    std::vector<double> v(P.ssm0.size());
    for (double& x : v) x = unit(rng);
    constexpr double eps = 0.25;
    // out from the fp32 correction of a zero output.
    const auto outputs = [&](const std::vector<double>& h) {
      const auto state =
          kmamba::allocate_uninitialized<T4>("kmamba::test::h", cfg.batch, cfg.nheads, cfg.headdim, cfg.dstate);
      upload(state, h);
      const auto out = kmamba::allocate<T4>("kmamba::test::out", cfg.batch, cfg.seqlen, cfg.nheads, cfg.headdim);
      ops.correct(state, out, T4());
      exec.fence();
      return host_doubles(out);
    };
    expect_gradient_matches_central_difference(outputs, P.ssm0, P.dout, host_doubles(dh), v, eps, output_tolerance,
                                               gradient_tolerance, cfg.describe());
  }
}

TYPED_TEST(Mamba3StateCorrection, RejectsBadArguments) {
  using Mem = typename TypeParam::memory_space;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  const TypeParam exec;
  Config cfg;
  cfg.initial = true;
  const Mamba3DeviceProblem<Mem> p(make_reference_problem(cfg));
  const auto out = kmamba::allocate<T4>("kmamba::test::out", cfg.batch, cfg.seqlen, cfg.nheads, cfg.headdim);
  const auto wrong = kmamba::allocate<T4>("kmamba::test::wrong", cfg.batch, cfg.nheads, cfg.headdim + 1, cfg.dstate);
  expect_user_error([&] { kmamba::mamba3_state_correction_forward(exec, p.siso_args(), wrong, out, T4()); },
                    {"kmamba::mamba3_state_correction_forward", "incoming"});
  expect_user_error([&] { kmamba::mamba3_state_correction_backward(exec, p.siso_args(), p.dout, wrong); },
                    {"kmamba::mamba3_state_correction_backward", "dincoming"});
  expect_user_error(
      [&] {
        kmamba::mamba3_segment_states(exec, p.siso_args(),
                                      kmamba::Mamba3SisoStates<Mem>{{}, p.siso_initial.ssm, {}, {}},
                                      kmamba::Tensor2<float, Mem>());
      },
      {"kmamba::mamba3_segment_states", "states.ssm must be absent"});
  expect_user_error(
      [&] {
        kmamba::mamba3_initial_kv_backward(exec, p.siso_args(), p.siso_initial.ssm,
                                           kmamba::Mamba3SisoStates<Mem>{p.siso_initial.angle, {}, {}, {}});
      },
      {"kmamba::mamba3_initial_kv_backward", "must be absent"});
  const auto short_dt = kmamba::allocate<T3>("kmamba::test::dt", cfg.batch, cfg.nheads, cfg.seqlen - 1);
  expect_user_error(
      [&] { kmamba::mamba3_final_angle_backward(exec, p.angles, short_dt, p.siso_initial.angle, p.angles, short_dt); },
      {"kmamba::mamba3_final_angle_backward", "dt"});
  const auto short_ids =
      kmamba::allocate<kmamba::Tensor2<std::int64_t, Mem>>("kmamba::test::seq_idx", cfg.batch, cfg.seqlen - 1);
  const auto dt_grad = kmamba::allocate<T3>("kmamba::test::ddt", cfg.batch, cfg.nheads, cfg.seqlen);
  const auto dangles = kmamba::allocate<T4>("kmamba::test::dangles", cfg.batch, cfg.seqlen, cfg.nheads, cfg.nangles);
  expect_user_error(
      [&] {
        kmamba::mamba3_final_angle_backward(exec, p.angles, p.dt, p.siso_initial.angle, dangles, dt_grad, short_ids);
      },
      {"kmamba::mamba3_final_angle_backward", "seq_idx"});
}

}  // namespace
