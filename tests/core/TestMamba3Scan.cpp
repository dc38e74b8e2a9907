// Mamba-3 SISO and MIMO scans: forward, backward and decode steps against a sequential
// double-precision reference written from docs/algorithms.md §3.2, §3.3, §3.6 and §3.7 (the token-by-token
// recurrence, every state kept; its backward is the adjoint of that recurrence, derived here
// independently of the chunked form the kernels use), and against the golden files.
//
// SISO is checked as what it is for the reference: rank 1 with unit projections (the flat layouts
// of the SISO tensors are those of rank 1).
//
// Tolerances (each test prints the largest errors it saw):
// - kernel (fp32) against the double reference, per tensor: max|kernel − ref| ≤ tol·max|ref| with
//   tol = 1e-5 for outputs and final states, 1e-4 for gradients (sums over many tokens of fp32
//   products); a gradient that vanishes in exact arithmetic is measured against 1e-3 of the largest
//   gradient of the problem. Largest observed on Serial/OpenMP: 2.6e-6 (outputs, states) and 2.4e-5
//   (gradients).
// - the same with matmul_precision = TensorFloat32: where the backend has the tensor-core form
//   (Cuda) the chunk products take TF32 operands (relative rounding ≤ 2^-11 each): tol = 1e-2 for
//   outputs, states and gradients, vanishing gradients against 5e-2 of the largest. With the
//   host's TeamGemm temporarily rounding its operands as cvt.rna.tf32 does, these sweeps gave at
//   most 1.1e-3 (out, dk; every other tensor ≤ 9e-4) and, for the vanishing gradients against
//   1e-3 of the largest, 7.9e-2 (dinitial angle) and 3.9e-2 (dangles), i.e. 1.6e-3 and 7.7e-4
//   against 5e-2: the tolerances are 6–9× the emulated errors. Elsewhere the TensorFloat32
//   request computes in fp32 and the fp32 tolerances apply.
// - reference backward against central finite differences of the reference forward (double,
//   step 1e-6): |fd − analytic| ≤ 1e-6·(1 + |analytic|).
// - chunked forward against decode steps, and segments chained through the states (forward and
//   backward; both fp32, different summation orders): max|Δ| ≤ 2e-5·max|ref| for outputs and states,
//   1e-4 for gradients (observed 1.7e-6 and 4.9e-7).
// - golden data (fp32 references run in PyTorch): ‖Δ‖₂/‖ref‖₂ ≤ 1e-3 per tensor for the kernels, as
//   tests/data/golden/README.md suggests (observed 1.1e-6), and 1e-5 for the double reference
//   (observed 5.2e-7).
#include "TestData.hpp"
#include <kmamba/core/Core.hpp>
#include <kmamba/core/Mamba3Scan.hpp>

#include "Backends.hpp"
#include "SafeTensorsReader.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {

constexpr double pi = 3.14159265358979323846;

// ----------------------------------------------------------------------------------------------
// Problem description and the double reference.

struct Config {
  int batch = 2, seqlen = 10, nheads = 4, headdim = 3, ngroups = 2, dstate = 8, nangles = 2;
  int rank = 0;   // 0: SISO; ≥ 1: MIMO of that rank
  int chunk = 4;  // tokens per chunk (0 for MIMO: the default 64 / rank)
  bool D = false, z = false, initial = false, dfinal = false;
  std::uint64_t seed = 1;
  kmamba::MatmulPrecision precision = kmamba::MatmulPrecision::Float32;  // of the kernels' chunk products

  bool mimo() const { return rank > 0; }
  int R() const { return rank > 0 ? rank : 1; }
  std::string describe() const {
    std::ostringstream s;
    s << (mimo() ? "MIMO rank=" : "SISO") << (mimo() ? std::to_string(rank) : std::string()) << " batch=" << batch
      << " seqlen=" << seqlen << " nheads=" << nheads << " headdim=" << headdim << " ngroups=" << ngroups
      << " dstate=" << dstate << " nangles=" << nangles << " chunk=" << chunk << " D=" << D << " z=" << z
      << " initial=" << initial << " dfinal=" << dfinal << " seed=" << seed
      << " matmul_precision=" << kmamba::matmul_precision_name(precision);
    return s.str();
  }
};

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }
double silu(double v) { return v * sigmoid(v); }
double silu_derivative(double v) {
  const double s = sigmoid(v);
  return s * (1.0 + v * (1.0 - s));
}

// Row-major host copies of every input, in double, in the MIMO layouts (rank 1 for SISO). Absent
// optional inputs are empty; absent rank projections (SISO) read as 1.
struct RefProblem {
  Config cfg;
  std::vector<double> q, k;                    // (batch, seqlen, R, ngroups, dstate)
  std::vector<double> v, z;                    // (batch, seqlen, nheads, headdim)
  std::vector<double> adt, dt, trap;           // (batch, nheads, seqlen)
  std::vector<double> q_bias, k_bias;          // (nheads, R, dstate)
  std::vector<double> angles;                  // (batch, seqlen, nheads, nangles)
  std::vector<double> D;                       // (nheads)
  std::vector<double> mimo_v, mimo_z, mimo_o;  // (nheads, R, headdim)
  // Initial states (batch, nheads, nangles), (batch, nheads, headdim, dstate), (batch, nheads, R, dstate),
  // (batch, nheads, R, headdim); empty = zero.
  std::vector<double> angle0, ssm0, k0, v0;
  std::vector<double> dout;                  // (batch, seqlen, nheads, headdim)
  std::vector<double> dangle, dssm, dk, dv;  // cotangents of the final states (empty = zero)

  int R() const { return cfg.R(); }
  std::size_t iq(int b, int t, int r, int g, int n) const {
    return (((static_cast<std::size_t>(b) * cfg.seqlen + t) * R() + r) * cfg.ngroups + g) * cfg.dstate + n;
  }
  std::size_t iv(int b, int t, int h, int p) const {
    return ((static_cast<std::size_t>(b) * cfg.seqlen + t) * cfg.nheads + h) * cfg.headdim + p;
  }
  std::size_t it(int b, int h, int t) const { return (static_cast<std::size_t>(b) * cfg.nheads + h) * cfg.seqlen + t; }
  std::size_t ibias(int h, int r, int n) const { return (static_cast<std::size_t>(h) * R() + r) * cfg.dstate + n; }
  std::size_t iproj(int h, int r, int p) const { return (static_cast<std::size_t>(h) * R() + r) * cfg.headdim + p; }
  std::size_t iangle(int b, int t, int h, int i) const {
    return ((static_cast<std::size_t>(b) * cfg.seqlen + t) * cfg.nheads + h) * cfg.nangles + i;
  }
  std::size_t sangle(int b, int h, int i) const {
    return (static_cast<std::size_t>(b) * cfg.nheads + h) * cfg.nangles + i;
  }
  std::size_t sssm(int b, int h, int p, int n) const {
    return ((static_cast<std::size_t>(b) * cfg.nheads + h) * cfg.headdim + p) * cfg.dstate + n;
  }
  std::size_t sk(int b, int h, int r, int n) const {
    return ((static_cast<std::size_t>(b) * cfg.nheads + h) * R() + r) * cfg.dstate + n;
  }
  std::size_t sv(int b, int h, int r, int p) const {
    return ((static_cast<std::size_t>(b) * cfg.nheads + h) * R() + r) * cfg.headdim + p;
  }
  double mv(int h, int r, int p) const { return mimo_v.empty() ? 1.0 : mimo_v[iproj(h, r, p)]; }
  double mz(int h, int r, int p) const { return mimo_z.empty() ? 1.0 : mimo_z[iproj(h, r, p)]; }
  double mo(int h, int r, int p) const { return mimo_o.empty() ? 1.0 : mimo_o[iproj(h, r, p)]; }
  bool has_z() const { return cfg.z; }
  std::size_t states_angle_size() const { return static_cast<std::size_t>(cfg.batch) * cfg.nheads * cfg.nangles; }
  std::size_t states_ssm_size() const {
    return static_cast<std::size_t>(cfg.batch) * cfg.nheads * cfg.headdim * cfg.dstate;
  }
  std::size_t states_k_size() const { return static_cast<std::size_t>(cfg.batch) * cfg.nheads * R() * cfg.dstate; }
  std::size_t states_v_size() const { return static_cast<std::size_t>(cfg.batch) * cfg.nheads * R() * cfg.headdim; }
};

// Everything the recurrence computes for one (batch, head), token by token.
struct HeadTrace {
  std::vector<double> theta;           // seqlen·nangles: θ_t (not reduced)
  std::vector<double> qb, kb;          // seqlen·R·dstate: biased, before the rotation
  std::vector<double> q, k;            // seqlen·R·dstate: rotated
  std::vector<double> v;               // seqlen·R·headdim: projected
  std::vector<double> H;               // (seqlen + 1)·headdim·dstate: H[0] = initial, H[t + 1] after token t
  std::vector<double> y;               // seqlen·R·headdim: before the gate
  std::vector<double> k_init, v_init;  // R·dstate, R·headdim
  std::vector<double> theta_end;       // nangles
};

HeadTrace trace_head(const RefProblem& P, int b, int h) {
  const Config& c = P.cfg;
  const int R = P.R(), N = c.dstate, Pd = c.headdim, S = c.nangles, L = c.seqlen;
  const int g = h / (c.nheads / c.ngroups);
  HeadTrace tr;
  tr.theta.assign(static_cast<std::size_t>(L) * S, 0.0);
  tr.qb.assign(static_cast<std::size_t>(L) * R * N, 0.0);
  tr.kb = tr.qb;
  tr.q = tr.qb;
  tr.k = tr.qb;
  tr.v.assign(static_cast<std::size_t>(L) * R * Pd, 0.0);
  tr.y = tr.v;
  tr.H.assign(static_cast<std::size_t>(L + 1) * Pd * N, 0.0);
  tr.k_init.assign(static_cast<std::size_t>(R) * N, 0.0);
  tr.v_init.assign(static_cast<std::size_t>(R) * Pd, 0.0);
  tr.theta_end.assign(S, 0.0);
  for (int r = 0; r < R; ++r) {
    for (int n = 0; n < N; ++n) tr.k_init[r * N + n] = P.k0.empty() ? 0.0 : P.k0[P.sk(b, h, r, n)];
    for (int p = 0; p < Pd; ++p) tr.v_init[r * Pd + p] = P.v0.empty() ? 0.0 : P.v0[P.sv(b, h, r, p)];
  }
  for (int p = 0; p < Pd; ++p)
    for (int n = 0; n < N; ++n) tr.H[p * N + n] = P.ssm0.empty() ? 0.0 : P.ssm0[P.sssm(b, h, p, n)];
  std::vector<double> theta(S);
  for (int i = 0; i < S; ++i) theta[i] = P.angle0.empty() ? 0.0 : P.angle0[P.sangle(b, h, i)];
  const double* kprev = tr.k_init.data();
  const double* vprev = tr.v_init.data();
  for (int t = 0; t < L; ++t) {
    const double d = P.dt[P.it(b, h, t)];
    for (int i = 0; i < S; ++i) {
      theta[i] += pi * std::tanh(P.angles[P.iangle(b, t, h, i)]) * d;
      tr.theta[t * S + i] = theta[i];
    }
    for (int r = 0; r < R; ++r) {
      const std::size_t row = (static_cast<std::size_t>(t) * R + r) * N;
      for (int n = 0; n < N; ++n) {
        tr.qb[row + n] = P.q[P.iq(b, t, r, g, n)] + P.q_bias[P.ibias(h, r, n)];
        tr.kb[row + n] = P.k[P.iq(b, t, r, g, n)] + P.k_bias[P.ibias(h, r, n)];
        tr.q[row + n] = tr.qb[row + n];
        tr.k[row + n] = tr.kb[row + n];
      }
      for (int i = 0; i < S; ++i) {
        const double cs = std::cos(theta[i]), sn = std::sin(theta[i]);
        const std::size_t a = row + 2 * i, e = a + 1;
        tr.q[a] = tr.qb[a] * cs - tr.qb[e] * sn;
        tr.q[e] = tr.qb[a] * sn + tr.qb[e] * cs;
        tr.k[a] = tr.kb[a] * cs - tr.kb[e] * sn;
        tr.k[e] = tr.kb[a] * sn + tr.kb[e] * cs;
      }
      for (int p = 0; p < Pd; ++p)
        tr.v[(static_cast<std::size_t>(t) * R + r) * Pd + p] = P.v[P.iv(b, t, h, p)] * P.mv(h, r, p);
    }
    const double lambda = sigmoid(P.trap[P.it(b, h, t)]);
    const double alpha = std::exp(P.adt[P.it(b, h, t)]);
    const double beta = (1.0 - lambda) * d * alpha, gamma = lambda * d;
    const double* kt = &tr.k[static_cast<std::size_t>(t) * R * N];
    const double* vt = &tr.v[static_cast<std::size_t>(t) * R * Pd];
    const double* Hp = &tr.H[static_cast<std::size_t>(t) * Pd * N];
    double* Hc = &tr.H[static_cast<std::size_t>(t + 1) * Pd * N];
    for (int p = 0; p < Pd; ++p)
      for (int n = 0; n < N; ++n) {
        double prev = 0.0, cur = 0.0;
        for (int r = 0; r < R; ++r) {
          prev += vprev[r * Pd + p] * kprev[r * N + n];
          cur += vt[r * Pd + p] * kt[r * N + n];
        }
        Hc[p * N + n] = alpha * Hp[p * N + n] + beta * prev + gamma * cur;
      }
    const double Dh = P.D.empty() ? 0.0 : P.D[h];
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < Pd; ++p) {
        double y = Dh * vt[r * Pd + p];
        for (int n = 0; n < N; ++n) y += Hc[p * N + n] * tr.q[(static_cast<std::size_t>(t) * R + r) * N + n];
        tr.y[(static_cast<std::size_t>(t) * R + r) * Pd + p] = y;
      }
    kprev = kt;
    vprev = vt;
  }
  tr.theta_end = theta;
  return tr;
}

struct RefOutputs {
  std::vector<double> out, angle, ssm, k, v;
};

RefOutputs ref_forward(const RefProblem& P) {
  const Config& c = P.cfg;
  const int R = P.R(), N = c.dstate, Pd = c.headdim, S = c.nangles, L = c.seqlen;
  RefOutputs o;
  o.out.assign(P.v.size(), 0.0);
  o.angle.assign(P.states_angle_size(), 0.0);
  o.ssm.assign(P.states_ssm_size(), 0.0);
  o.k.assign(P.states_k_size(), 0.0);
  o.v.assign(P.states_v_size(), 0.0);
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.nheads; ++h) {
      const HeadTrace tr = trace_head(P, b, h);
      for (int t = 0; t < L; ++t)
        for (int p = 0; p < Pd; ++p) {
          double sum = 0.0;
          for (int r = 0; r < R; ++r) {
            const double gate = !P.has_z() ? 1.0 : silu(P.z[P.iv(b, t, h, p)] * P.mz(h, r, p));
            sum += tr.y[(static_cast<std::size_t>(t) * R + r) * Pd + p] * gate * P.mo(h, r, p);
          }
          o.out[P.iv(b, t, h, p)] = sum;
        }
      for (int i = 0; i < S; ++i) {
        const double th = tr.theta_end[i];
        o.angle[P.sangle(b, h, i)] = c.mimo() ? th : th - 2.0 * pi * std::floor(th / (2.0 * pi));
      }
      for (int p = 0; p < Pd; ++p)
        for (int n = 0; n < N; ++n) o.ssm[P.sssm(b, h, p, n)] = tr.H[static_cast<std::size_t>(L) * Pd * N + p * N + n];
      for (int r = 0; r < R; ++r) {
        for (int n = 0; n < N; ++n)
          o.k[P.sk(b, h, r, n)] =
              L > 0 ? tr.k[(static_cast<std::size_t>(L - 1) * R + r) * N + n] : tr.k_init[r * N + n];
        for (int p = 0; p < Pd; ++p)
          o.v[P.sv(b, h, r, p)] =
              L > 0 ? tr.v[(static_cast<std::size_t>(L - 1) * R + r) * Pd + p] : tr.v_init[r * Pd + p];
      }
    }
  return o;
}

double dot(const std::vector<double>& a, const std::vector<double>& b) {
  double s = 0.0;
  for (std::size_t i = 0; i < a.size() && i < b.size(); ++i) s += a[i] * b[i];
  return s;
}

// sum(out·dout) + Σ sum(final state·its cotangent).
double ref_loss(const RefProblem& P) {
  const RefOutputs o = ref_forward(P);
  return dot(o.out, P.dout) + dot(o.angle, P.dangle) + dot(o.ssm, P.dssm) + dot(o.k, P.dk) + dot(o.v, P.dv);
}

struct RefGrads {
  std::vector<double> dq, dk, dv, dadt, ddt, dtrap, dq_bias, dk_bias, dangles, dD, dz, dmimo_v, dmimo_z, dmimo_o;
  std::vector<double> dangle0, dssm0, dk0, dv0;
};

// The adjoint of the recurrence, token by token backwards. The k and v of token t − 1 enter the
// state at token t (through β_t), so their gradients are completed one step later.
RefGrads ref_backward(const RefProblem& P) {
  const Config& c = P.cfg;
  const int R = P.R(), N = c.dstate, Pd = c.headdim, S = c.nangles, L = c.seqlen;
  RefGrads gr;
  gr.dq.assign(P.q.size(), 0.0);
  gr.dk.assign(P.k.size(), 0.0);
  gr.dv.assign(P.v.size(), 0.0);
  gr.dadt.assign(P.adt.size(), 0.0);
  gr.ddt.assign(P.dt.size(), 0.0);
  gr.dtrap.assign(P.trap.size(), 0.0);
  gr.dq_bias.assign(P.q_bias.size(), 0.0);
  gr.dk_bias.assign(P.k_bias.size(), 0.0);
  gr.dangles.assign(P.angles.size(), 0.0);
  gr.dD.assign(c.nheads, 0.0);
  if (P.has_z()) gr.dz.assign(P.z.size(), 0.0);
  if (c.mimo()) {
    gr.dmimo_v.assign(P.mimo_v.size(), 0.0);
    gr.dmimo_o.assign(P.mimo_o.size(), 0.0);
    if (P.has_z()) gr.dmimo_z.assign(P.mimo_z.size(), 0.0);
  }
  gr.dangle0.assign(P.states_angle_size(), 0.0);
  gr.dssm0.assign(P.states_ssm_size(), 0.0);
  gr.dk0.assign(P.states_k_size(), 0.0);
  gr.dv0.assign(P.states_v_size(), 0.0);
  std::vector<double> lam(static_cast<std::size_t>(Pd) * N), g(static_cast<std::size_t>(R) * Pd);
  std::vector<double> dqr(static_cast<std::size_t>(R) * N), dkr(dqr), dvr(g);
  std::vector<double> dk_next(dqr.size()), dv_next(g.size()), G(S);
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < c.nheads; ++h) {
      const int grp = h / (c.nheads / c.ngroups);
      const HeadTrace tr = trace_head(P, b, h);
      const double Dh = P.D.empty() ? 0.0 : P.D[h];
      for (int p = 0; p < Pd; ++p)
        for (int n = 0; n < N; ++n) lam[p * N + n] = P.dssm.empty() ? 0.0 : P.dssm[P.sssm(b, h, p, n)];
      std::fill(dk_next.begin(), dk_next.end(), 0.0);
      std::fill(dv_next.begin(), dv_next.end(), 0.0);
      for (int i = 0; i < S; ++i) G[i] = P.dangle.empty() ? 0.0 : P.dangle[P.sangle(b, h, i)];
      for (int t = L - 1; t >= 0; --t) {
        const double d = P.dt[P.it(b, h, t)];
        const double lambda = sigmoid(P.trap[P.it(b, h, t)]);
        const double alpha = std::exp(P.adt[P.it(b, h, t)]);
        const double beta = (1.0 - lambda) * d * alpha, gamma = lambda * d;
        const double* qt = &tr.q[static_cast<std::size_t>(t) * R * N];
        const double* kt = &tr.k[static_cast<std::size_t>(t) * R * N];
        const double* vt = &tr.v[static_cast<std::size_t>(t) * R * Pd];
        const double* yt = &tr.y[static_cast<std::size_t>(t) * R * Pd];
        const double* kp = t > 0 ? &tr.k[static_cast<std::size_t>(t - 1) * R * N] : tr.k_init.data();
        const double* vp = t > 0 ? &tr.v[static_cast<std::size_t>(t - 1) * R * Pd] : tr.v_init.data();
        const double* Hp = &tr.H[static_cast<std::size_t>(t) * Pd * N];
        const double* Hc = &tr.H[static_cast<std::size_t>(t + 1) * Pd * N];
        // Gate, rank projections of z and of the output.
        for (int r = 0; r < R; ++r)
          for (int p = 0; p < Pd; ++p) {
            const double go = P.dout[P.iv(b, t, h, p)];
            const double y = yt[r * Pd + p];
            if (P.has_z()) {
              const double zz = P.z[P.iv(b, t, h, p)];
              const double zr = zz * P.mz(h, r, p);
              g[r * Pd + p] = go * P.mo(h, r, p) * silu(zr);
              const double dzr = go * P.mo(h, r, p) * y * silu_derivative(zr);
              gr.dz[P.iv(b, t, h, p)] += dzr * P.mz(h, r, p);
              if (c.mimo()) {
                gr.dmimo_z[P.iproj(h, r, p)] += dzr * zz;
                gr.dmimo_o[P.iproj(h, r, p)] += go * y * silu(zr);
              }
            } else {
              g[r * Pd + p] = go * P.mo(h, r, p);
              if (c.mimo()) gr.dmimo_o[P.iproj(h, r, p)] += go * y;
            }
          }
        // y_t,r = H_t q_t,r + D v_t,r.
        for (int r = 0; r < R; ++r) {
          for (int n = 0; n < N; ++n) {
            double s = 0.0;
            for (int p = 0; p < Pd; ++p) s += Hc[p * N + n] * g[r * Pd + p];
            dqr[r * N + n] = s;
          }
          for (int p = 0; p < Pd; ++p) {
            dvr[r * Pd + p] = dv_next[r * Pd + p] + Dh * g[r * Pd + p];
            gr.dD[h] += g[r * Pd + p] * vt[r * Pd + p];
          }
        }
        for (int p = 0; p < Pd; ++p)
          for (int n = 0; n < N; ++n)
            for (int r = 0; r < R; ++r) lam[p * N + n] += g[r * Pd + p] * qt[r * N + n];
        // H_t = α_t H_{t−1} + β_t Σ_r v_{t−1,r} k_{t−1,r}ᵀ + γ_t Σ_r v_t,r k_t,rᵀ.
        double dalpha = 0.0, dbeta = 0.0, dgamma = 0.0;
        for (int p = 0; p < Pd; ++p)
          for (int n = 0; n < N; ++n) {
            const double l = lam[p * N + n];
            dalpha += l * Hp[p * N + n];
            for (int r = 0; r < R; ++r) {
              dbeta += l * vp[r * Pd + p] * kp[r * N + n];
              dgamma += l * vt[r * Pd + p] * kt[r * N + n];
            }
          }
        for (int r = 0; r < R; ++r) {
          for (int n = 0; n < N; ++n) {
            double s = 0.0, sp = 0.0;
            for (int p = 0; p < Pd; ++p) {
              s += lam[p * N + n] * vt[r * Pd + p];
              sp += lam[p * N + n] * vp[r * Pd + p];
            }
            dkr[r * N + n] = dk_next[r * N + n] + gamma * s;
            dk_next[r * N + n] = beta * sp;
          }
          for (int p = 0; p < Pd; ++p) {
            double s = 0.0, sp = 0.0;
            for (int n = 0; n < N; ++n) {
              s += lam[p * N + n] * kt[r * N + n];
              sp += lam[p * N + n] * kp[r * N + n];
            }
            dvr[r * Pd + p] += gamma * s;
            dv_next[r * Pd + p] = beta * sp;
          }
        }
        if (t == L - 1) {
          for (int r = 0; r < R; ++r) {
            if (!P.dk.empty())
              for (int n = 0; n < N; ++n) dkr[r * N + n] += P.dk[P.sk(b, h, r, n)];
            if (!P.dv.empty())
              for (int p = 0; p < Pd; ++p) dvr[r * Pd + p] += P.dv[P.sv(b, h, r, p)];
          }
        }
        for (double& l : lam) l *= alpha;
        gr.dadt[P.it(b, h, t)] = alpha * dalpha + beta * dbeta;
        double ddelta = (1.0 - lambda) * alpha * dbeta + lambda * dgamma;
        const double dlambda = -d * alpha * dbeta + d * dgamma;
        gr.dtrap[P.it(b, h, t)] = dlambda * lambda * (1.0 - lambda);
        // Rotations: ∂/∂θ_t, and the gradients of the biased, unrotated q and k.
        std::vector<double> dqb(dqr), dkb(dkr);
        for (int i = 0; i < S; ++i) {
          const double th = tr.theta[static_cast<std::size_t>(t) * S + i];
          const double cs = std::cos(th), sn = std::sin(th);
          double dtheta = 0.0;
          for (int r = 0; r < R; ++r) {
            const int a = r * N + 2 * i, e = a + 1;
            dtheta += dqr[e] * qt[a] - dqr[a] * qt[e] + dkr[e] * kt[a] - dkr[a] * kt[e];
            dqb[a] = dqr[a] * cs + dqr[e] * sn;
            dqb[e] = dqr[e] * cs - dqr[a] * sn;
            dkb[a] = dkr[a] * cs + dkr[e] * sn;
            dkb[e] = dkr[e] * cs - dkr[a] * sn;
          }
          G[i] += dtheta;
          const double ph = std::tanh(P.angles[P.iangle(b, t, h, i)]);
          gr.dangles[P.iangle(b, t, h, i)] = G[i] * d * pi * (1.0 - ph * ph);
          ddelta += G[i] * pi * ph;
        }
        gr.ddt[P.it(b, h, t)] = ddelta;
        for (int r = 0; r < R; ++r) {
          for (int n = 0; n < N; ++n) {
            gr.dq[P.iq(b, t, r, grp, n)] += dqb[r * N + n];
            gr.dk[P.iq(b, t, r, grp, n)] += dkb[r * N + n];
            gr.dq_bias[P.ibias(h, r, n)] += dqb[r * N + n];
            gr.dk_bias[P.ibias(h, r, n)] += dkb[r * N + n];
          }
          for (int p = 0; p < Pd; ++p) {
            gr.dv[P.iv(b, t, h, p)] += dvr[r * Pd + p] * P.mv(h, r, p);
            if (c.mimo()) gr.dmimo_v[P.iproj(h, r, p)] += dvr[r * Pd + p] * P.v[P.iv(b, t, h, p)];
          }
        }
      }
      // What is left flows into the initial states (with no token, the final states are the initial ones).
      for (int i = 0; i < S; ++i) gr.dangle0[P.sangle(b, h, i)] = G[i];
      for (int p = 0; p < Pd; ++p)
        for (int n = 0; n < N; ++n) gr.dssm0[P.sssm(b, h, p, n)] = lam[p * N + n];
      for (int r = 0; r < R; ++r) {
        for (int n = 0; n < N; ++n)
          gr.dk0[P.sk(b, h, r, n)] = L > 0 ? dk_next[r * N + n] : (P.dk.empty() ? 0.0 : P.dk[P.sk(b, h, r, n)]);
        for (int p = 0; p < Pd; ++p)
          gr.dv0[P.sv(b, h, r, p)] = L > 0 ? dv_next[r * Pd + p] : (P.dv.empty() ? 0.0 : P.dv[P.sv(b, h, r, p)]);
      }
    }
  return gr;
}

// Random inputs drawn on the host (rounded to float, as the kernels see them).
RefProblem make_reference_problem(const Config& cfg) {
  RefProblem P;
  P.cfg = cfg;
  const int R = cfg.R();
  std::mt19937_64 rng(cfg.seed * 7919 + 17);
  auto fill = [&](std::vector<double>& v, std::size_t n, auto&& draw) {
    v.resize(n);
    for (double& x : v) x = static_cast<double>(static_cast<float>(draw()));
  };
  std::normal_distribution<double> normal(0.0, 1.0);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  auto gauss = [&](double sd) { return [&, sd]() { return sd * normal(rng); }; };
  auto uniform = [&](double lo, double hi) { return [&, lo, hi]() { return lo + (hi - lo) * unit(rng); }; };
  const std::size_t B = cfg.batch, L = cfg.seqlen, H = cfg.nheads, Pd = cfg.headdim, N = cfg.dstate;
  fill(P.q, B * L * R * cfg.ngroups * N, gauss(0.5));
  fill(P.k, B * L * R * cfg.ngroups * N, gauss(0.5));
  fill(P.v, B * L * H * Pd, gauss(1.0));
  fill(P.dt, B * H * L, uniform(0.05, 0.6));
  P.adt.resize(P.dt.size());
  for (std::size_t i = 0; i < P.dt.size(); ++i) {
    P.adt[i] = static_cast<double>(static_cast<float>(-P.dt[i] * uniform(0.2, 1.5)()));
  }
  fill(P.trap, B * H * L, gauss(1.0));
  fill(P.q_bias, H * R * N, uniform(0.3, 1.2));
  fill(P.k_bias, H * R * N, uniform(0.3, 1.2));
  fill(P.angles, B * L * H * cfg.nangles, gauss(1.0));
  fill(P.dout, B * L * H * Pd, gauss(1.0));
  if (cfg.D) fill(P.D, H, uniform(0.5, 1.5));
  if (cfg.z) fill(P.z, B * L * H * Pd, gauss(1.0));
  if (cfg.mimo()) {
    fill(P.mimo_v, H * R * Pd, gauss(1.0 / std::sqrt(double(R))));
    fill(P.mimo_o, H * R * Pd, gauss(1.0 / std::sqrt(double(R))));
    if (cfg.z) fill(P.mimo_z, H * R * Pd, uniform(0.5, 1.5));
  }
  if (cfg.initial) {
    fill(P.angle0, B * H * cfg.nangles, uniform(cfg.mimo() ? -20.0 : 0.0, cfg.mimo() ? 20.0 : 6.28));
    fill(P.ssm0, B * H * Pd * N, gauss(0.5));
    fill(P.k0, B * H * R * N, gauss(0.7));
    fill(P.v0, B * H * R * Pd, gauss(1.0));
  }
  if (cfg.dfinal) {
    fill(P.dangle, B * H * cfg.nangles, gauss(1.0));
    fill(P.dssm, B * H * Pd * N, gauss(1.0));
    fill(P.dk, B * H * R * N, gauss(1.0));
    fill(P.dv, B * H * R * Pd, gauss(1.0));
  }
  return P;
}

// ----------------------------------------------------------------------------------------------
// The reference against itself: its backward against finite differences of its forward.

TEST(Mamba3Reference, BackwardMatchesFiniteDifferences) {
  std::vector<Config> configs;
  Config c;
  c.batch = 2;
  c.seqlen = 6;
  c.nheads = 2;
  c.headdim = 2;
  c.ngroups = 2;
  c.dstate = 6;
  c.nangles = 2;
  c.D = c.z = c.initial = c.dfinal = true;
  configs.push_back(c);  // SISO, two groups
  c.rank = 2;
  c.ngroups = 1;
  c.nangles = 3;
  c.seed = 2;
  configs.push_back(c);  // MIMO rank 2, rope on every pair
  c.rank = 3;
  c.batch = 1;
  c.z = false;
  c.nangles = 1;
  c.seed = 3;
  configs.push_back(c);  // MIMO rank 3 without the gate
  for (const Config& cfg : configs) {
    RefProblem P = make_reference_problem(cfg);
    const RefGrads g = ref_backward(P);
    const double eps = 1e-6;
    auto check = [&](const char* name, std::vector<double>& input, const std::vector<double>& analytic) {
      ASSERT_EQ(input.size(), analytic.size()) << name << " " << cfg.describe();
      ASSERT_FALSE(input.empty()) << name;
      for (std::size_t i = 0; i < input.size(); ++i) {
        const double saved = input[i];
        input[i] = saved + eps;
        const double up = ref_loss(P);
        input[i] = saved - eps;
        const double down = ref_loss(P);
        input[i] = saved;
        const double fd = (up - down) / (2 * eps);
        ASSERT_NEAR(fd, analytic[i], 1e-6 * (1.0 + std::fabs(analytic[i])))
            << name << "[" << i << "] " << cfg.describe();
      }
    };
    check("q", P.q, g.dq);
    check("k", P.k, g.dk);
    check("v", P.v, g.dv);
    check("adt", P.adt, g.dadt);
    check("dt", P.dt, g.ddt);
    check("trap", P.trap, g.dtrap);
    check("q_bias", P.q_bias, g.dq_bias);
    check("k_bias", P.k_bias, g.dk_bias);
    check("angles", P.angles, g.dangles);
    check("D", P.D, g.dD);
    if (cfg.z) check("z", P.z, g.dz);
    if (cfg.mimo()) {
      check("mimo_v", P.mimo_v, g.dmimo_v);
      check("mimo_o", P.mimo_o, g.dmimo_o);
      if (cfg.z) check("mimo_z", P.mimo_z, g.dmimo_z);
    }
    check("initial angle", P.angle0, g.dangle0);
    check("initial ssm", P.ssm0, g.dssm0);
    check("initial k", P.k0, g.dk0);
    check("initial v", P.v0, g.dv0);
  }
}

// ----------------------------------------------------------------------------------------------
// Device side.

template <class View>
std::vector<double> host_doubles(const View& v) {
  auto h = kmamba::test::to_host(v);
  std::vector<double> out(h.size());
  for (std::size_t i = 0; i < h.size(); ++i) out[i] = static_cast<double>(h.data()[i]);
  return out;
}

template <class View>
void poison(const View& v) {
  Kokkos::deep_copy(v, std::numeric_limits<float>::quiet_NaN());
}

// A new device tensor holding `values` (row-major).
template <class View, class... Extents>
View upload(const std::string& name, const std::vector<double>& values, Extents... extents) {
  View v = kmamba::allocate_uninitialized<View>("kmamba::test::" + name, extents...);
  auto h = Kokkos::create_mirror_view(v);
  EXPECT_EQ(h.size(), values.size()) << name;
  for (std::size_t i = 0; i < h.size() && i < values.size(); ++i) h.data()[i] = static_cast<float>(values[i]);
  Kokkos::deep_copy(v, h);
  return v;
}

// The same for an optional input: an unallocated view (absent) unless `present`.
template <class View, class... Extents>
View upload_optional(const std::string& name, const std::vector<double>& values, bool present, Extents... extents) {
  return present ? upload<View>(name, values, extents...) : View();
}

// A state or a state's cotangent: absent when the problem has none.
template <class View, class... Extents>
View upload_states(const std::string& name, const std::vector<double>& values, Extents... extents) {
  return upload_optional<View>(name, values, !values.empty(), extents...);
}

template <class View, class... Extents>
View allocate_poisoned(const std::string& name, Extents... extents) {
  View v = kmamba::allocate_uninitialized<View>("kmamba::test::" + name, extents...);
  poison(v);
  return v;
}

template <class Mem>
struct DeviceProblem {
  using T1 = kmamba::Tensor1<float, Mem>;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  using T5 = kmamba::Tensor5<float, Mem>;
  Config cfg;
  T4 q4, k4;
  T5 q5, k5;
  T4 v, z, angles, dout;
  T3 adt, dt, trap;
  T2 q_bias2, k_bias2;
  T3 q_bias3, k_bias3, mimo_v, mimo_z, mimo_o;
  T1 D;
  kmamba::Mamba3SisoStates<Mem> siso_initial, siso_dfinal;
  kmamba::Mamba3MimoStates<Mem> mimo_initial, mimo_dfinal;

  explicit DeviceProblem(const RefProblem& P) : cfg(P.cfg) {
    const int B = cfg.batch, L = cfg.seqlen, H = cfg.nheads, Pd = cfg.headdim, G = cfg.ngroups, N = cfg.dstate;
    const int S = cfg.nangles, R = cfg.R();
    if (cfg.mimo()) {
      q5 = upload<T5>("q", P.q, B, L, R, G, N);
      k5 = upload<T5>("k", P.k, B, L, R, G, N);
      q_bias3 = upload<T3>("q_bias", P.q_bias, H, R, N);
      k_bias3 = upload<T3>("k_bias", P.k_bias, H, R, N);
      mimo_v = upload<T3>("mimo_v", P.mimo_v, H, R, Pd);
      mimo_z = upload_optional<T3>("mimo_z", P.mimo_z, cfg.z, H, R, Pd);
      mimo_o = upload<T3>("mimo_o", P.mimo_o, H, R, Pd);
      mimo_initial = {upload_states<T3>("angle0", P.angle0, B, H, S), upload_states<T4>("ssm0", P.ssm0, B, H, Pd, N),
                      upload_states<T4>("k0", P.k0, B, H, R, N), upload_states<T4>("v0", P.v0, B, H, R, Pd)};
      mimo_dfinal = {upload_states<T3>("dangle", P.dangle, B, H, S), upload_states<T4>("dssm", P.dssm, B, H, Pd, N),
                     upload_states<T4>("dk_final", P.dk, B, H, R, N), upload_states<T4>("dv_final", P.dv, B, H, R, Pd)};
    } else {
      q4 = upload<T4>("q", P.q, B, L, G, N);
      k4 = upload<T4>("k", P.k, B, L, G, N);
      q_bias2 = upload<T2>("q_bias", P.q_bias, H, N);
      k_bias2 = upload<T2>("k_bias", P.k_bias, H, N);
      siso_initial = {upload_states<T3>("angle0", P.angle0, B, H, S), upload_states<T4>("ssm0", P.ssm0, B, H, Pd, N),
                      upload_states<T3>("k0", P.k0, B, H, N), upload_states<T3>("v0", P.v0, B, H, Pd)};
      siso_dfinal = {upload_states<T3>("dangle", P.dangle, B, H, S), upload_states<T4>("dssm", P.dssm, B, H, Pd, N),
                     upload_states<T3>("dk_final", P.dk, B, H, N), upload_states<T3>("dv_final", P.dv, B, H, Pd)};
    }
    v = upload<T4>("v", P.v, B, L, H, Pd);
    z = upload_optional<T4>("z", P.z, cfg.z, B, L, H, Pd);
    angles = upload<T4>("angles", P.angles, B, L, H, S);
    dout = upload<T4>("dout", P.dout, B, L, H, Pd);
    adt = upload<T3>("adt", P.adt, B, H, L);
    dt = upload<T3>("dt", P.dt, B, H, L);
    trap = upload<T3>("trap", P.trap, B, H, L);
    D = upload_optional<T1>("D", P.D, cfg.D, H);
  }

  kmamba::Mamba3SisoArgs<Mem> siso_args() const {
    kmamba::Mamba3SisoArgs<Mem> a;
    a.q = q4;
    a.k = k4;
    a.v = v;
    a.adt = adt;
    a.dt = dt;
    a.trap = trap;
    a.q_bias = q_bias2;
    a.k_bias = k_bias2;
    a.angles = angles;
    a.D = D;
    a.z = z;
    a.initial = siso_initial;
    a.chunk_size = cfg.chunk;
    a.matmul_precision = cfg.precision;
    return a;
  }
  kmamba::Mamba3MimoArgs<Mem> mimo_args() const {
    kmamba::Mamba3MimoArgs<Mem> a;
    a.q = q5;
    a.k = k5;
    a.v = v;
    a.adt = adt;
    a.dt = dt;
    a.trap = trap;
    a.q_bias = q_bias3;
    a.k_bias = k_bias3;
    a.angles = angles;
    a.mimo_v = mimo_v;
    a.mimo_z = mimo_z;
    a.mimo_o = mimo_o;
    a.D = D;
    a.z = z;
    a.initial = mimo_initial;
    a.chunk_size = cfg.chunk;
    a.matmul_precision = cfg.precision;
    return a;
  }
};

// Runs the forward (and, with `backward`, the backward) of the problem's variant and returns every
// result in the reference's layouts. Every output is poisoned before the run.
template <class Exec>
std::pair<RefOutputs, RefGrads> run_kernels(const DeviceProblem<typename Exec::memory_space>& p, bool backward) {
  using Mem = typename Exec::memory_space;
  using DP = DeviceProblem<Mem>;
  const Config& c = p.cfg;
  const int B = c.batch, L = c.seqlen, H = c.nheads, Pd = c.headdim, G = c.ngroups, N = c.dstate, S = c.nangles;
  const int R = c.R();
  const Exec exec;
  RefOutputs o;
  RefGrads g;
  auto out = allocate_poisoned<typename DP::T4>("out", B, L, H, Pd);
  if (c.mimo()) {
    kmamba::Mamba3MimoStates<Mem> fin{allocate_poisoned<typename DP::T3>("final_angle", B, H, S),
                                      allocate_poisoned<typename DP::T4>("final_ssm", B, H, Pd, N),
                                      allocate_poisoned<typename DP::T4>("final_k", B, H, R, N),
                                      allocate_poisoned<typename DP::T4>("final_v", B, H, R, Pd)};
    kmamba::mamba3_mimo_forward(exec, p.mimo_args(), out, fin);
    exec.fence();
    o = {host_doubles(out), host_doubles(fin.angle), host_doubles(fin.ssm), host_doubles(fin.k), host_doubles(fin.v)};
    if (!backward) return {o, g};
    kmamba::Mamba3MimoGrads<Mem> d;
    d.dq = allocate_poisoned<typename DP::T5>("dq", B, L, R, G, N);
    d.dk = allocate_poisoned<typename DP::T5>("dk", B, L, R, G, N);
    d.dq_bias = allocate_poisoned<typename DP::T3>("dq_bias", H, R, N);
    d.dk_bias = allocate_poisoned<typename DP::T3>("dk_bias", H, R, N);
    d.dmimo_v = allocate_poisoned<typename DP::T3>("dmimo_v", H, R, Pd);
    d.dmimo_o = allocate_poisoned<typename DP::T3>("dmimo_o", H, R, Pd);
    if (c.z) d.dmimo_z = allocate_poisoned<typename DP::T3>("dmimo_z", H, R, Pd);
    d.dv = allocate_poisoned<typename DP::T4>("dv", B, L, H, Pd);
    d.dadt = allocate_poisoned<typename DP::T3>("dadt", B, H, L);
    d.ddt = allocate_poisoned<typename DP::T3>("ddt", B, H, L);
    d.dtrap = allocate_poisoned<typename DP::T3>("dtrap", B, H, L);
    d.dangles = allocate_poisoned<typename DP::T4>("dangles", B, L, H, S);
    d.dD = allocate_poisoned<typename DP::T1>("dD", H);
    if (c.z) d.dz = allocate_poisoned<typename DP::T4>("dz", B, L, H, Pd);
    d.dinitial = {allocate_poisoned<typename DP::T3>("dangle0", B, H, S),
                  allocate_poisoned<typename DP::T4>("dssm0", B, H, Pd, N),
                  allocate_poisoned<typename DP::T4>("dk0", B, H, R, N),
                  allocate_poisoned<typename DP::T4>("dv0", B, H, R, Pd)};
    kmamba::mamba3_mimo_backward(exec, p.mimo_args(), p.dout, p.mimo_dfinal, d);
    exec.fence();
    g.dq = host_doubles(d.dq);
    g.dk = host_doubles(d.dk);
    g.dq_bias = host_doubles(d.dq_bias);
    g.dk_bias = host_doubles(d.dk_bias);
    g.dmimo_v = host_doubles(d.dmimo_v);
    g.dmimo_o = host_doubles(d.dmimo_o);
    if (c.z) g.dmimo_z = host_doubles(d.dmimo_z);
    g.dv = host_doubles(d.dv);
    g.dadt = host_doubles(d.dadt);
    g.ddt = host_doubles(d.ddt);
    g.dtrap = host_doubles(d.dtrap);
    g.dangles = host_doubles(d.dangles);
    g.dD = host_doubles(d.dD);
    if (c.z) g.dz = host_doubles(d.dz);
    g.dangle0 = host_doubles(d.dinitial.angle);
    g.dssm0 = host_doubles(d.dinitial.ssm);
    g.dk0 = host_doubles(d.dinitial.k);
    g.dv0 = host_doubles(d.dinitial.v);
    return {o, g};
  }
  kmamba::Mamba3SisoStates<Mem> fin{allocate_poisoned<typename DP::T3>("final_angle", B, H, S),
                                    allocate_poisoned<typename DP::T4>("final_ssm", B, H, Pd, N),
                                    allocate_poisoned<typename DP::T3>("final_k", B, H, N),
                                    allocate_poisoned<typename DP::T3>("final_v", B, H, Pd)};
  kmamba::mamba3_siso_forward(exec, p.siso_args(), out, fin);
  exec.fence();
  o = {host_doubles(out), host_doubles(fin.angle), host_doubles(fin.ssm), host_doubles(fin.k), host_doubles(fin.v)};
  if (!backward) return {o, g};
  kmamba::Mamba3SisoGrads<Mem> d;
  d.dq = allocate_poisoned<typename DP::T4>("dq", B, L, G, N);
  d.dk = allocate_poisoned<typename DP::T4>("dk", B, L, G, N);
  d.dq_bias = allocate_poisoned<typename DP::T2>("dq_bias", H, N);
  d.dk_bias = allocate_poisoned<typename DP::T2>("dk_bias", H, N);
  d.dv = allocate_poisoned<typename DP::T4>("dv", B, L, H, Pd);
  d.dadt = allocate_poisoned<typename DP::T3>("dadt", B, H, L);
  d.ddt = allocate_poisoned<typename DP::T3>("ddt", B, H, L);
  d.dtrap = allocate_poisoned<typename DP::T3>("dtrap", B, H, L);
  d.dangles = allocate_poisoned<typename DP::T4>("dangles", B, L, H, S);
  d.dD = allocate_poisoned<typename DP::T1>("dD", H);
  if (c.z) d.dz = allocate_poisoned<typename DP::T4>("dz", B, L, H, Pd);
  d.dinitial = {
      allocate_poisoned<typename DP::T3>("dangle0", B, H, S), allocate_poisoned<typename DP::T4>("dssm0", B, H, Pd, N),
      allocate_poisoned<typename DP::T3>("dk0", B, H, N), allocate_poisoned<typename DP::T3>("dv0", B, H, Pd)};
  kmamba::mamba3_siso_backward(exec, p.siso_args(), p.dout, p.siso_dfinal, d);
  exec.fence();
  g.dq = host_doubles(d.dq);
  g.dk = host_doubles(d.dk);
  g.dq_bias = host_doubles(d.dq_bias);
  g.dk_bias = host_doubles(d.dk_bias);
  g.dv = host_doubles(d.dv);
  g.dadt = host_doubles(d.dadt);
  g.ddt = host_doubles(d.ddt);
  g.dtrap = host_doubles(d.dtrap);
  g.dangles = host_doubles(d.dangles);
  g.dD = host_doubles(d.dD);
  if (c.z) g.dz = host_doubles(d.dz);
  g.dangle0 = host_doubles(d.dinitial.angle);
  g.dssm0 = host_doubles(d.dinitial.ssm);
  g.dk0 = host_doubles(d.dinitial.k);
  g.dv0 = host_doubles(d.dinitial.v);
  return {o, g};
}

// The largest relative errors seen since the last reset (printed by each test, for the record).
struct Worst {
  double forward = 0.0, gradient = 0.0, golden = 0.0;
};
Worst& worst() {
  static Worst w;
  return w;
}
void print_worst(const char* what) {
  std::printf("%s: largest max|Δ|/max|ref| outputs and states %.2e, gradients %.2e\n", what, worst().forward,
              worst().gradient);
  worst() = Worst();
}

// max|kernel − ref| ≤ tol·max(max|ref|, floor) (every kernel value finite). Returns the relative error.
double expect_near_rel(const std::string& what, const std::vector<double>& kernel, const std::vector<double>& ref,
                       double tol, const std::string& context, double floor = 0.0) {
  EXPECT_EQ(kernel.size(), ref.size()) << what << " " << context;
  if (kernel.size() != ref.size()) return 0.0;
  double scale = 0.0, err = 0.0;
  std::size_t worst_at = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(kernel[i])) {
      ADD_FAILURE() << what << "[" << i << "] = " << kernel[i] << " " << context;
      return 0.0;
    }
    scale = std::max(scale, std::fabs(ref[i]));
    if (std::fabs(kernel[i] - ref[i]) > err) {
      err = std::fabs(kernel[i] - ref[i]);
      worst_at = i;
    }
  }
  scale = std::max(scale, floor);
  EXPECT_LE(err, tol * std::max(scale, 1e-30))
      << what << ": max|Δ| = " << err << " at " << worst_at << " (kernel " << kernel[worst_at] << ", ref "
      << ref[worst_at] << "), scale = " << scale << " " << context;
  return scale > 0.0 ? err / scale : err;
}

constexpr double forward_tol = 1e-5;
constexpr double gradient_tol = 1e-4;
constexpr double tf32_forward_tol = 1e-2;
constexpr double tf32_gradient_tol = 1e-2;
constexpr double tf32_vanishing = 5e-2;
constexpr double chain_tol = 2e-5;
constexpr double chain_gradient_tol = 1e-4;
constexpr double kernel_golden_tol = 1e-3;
constexpr double reference_golden_tol = 1e-5;

void compare_outputs(const RefOutputs& kernel, const RefOutputs& ref, double tol, const std::string& ctx) {
  double w = 0.0;
  w = std::max(w, expect_near_rel("out", kernel.out, ref.out, tol, ctx));
  w = std::max(w, expect_near_rel("final angle", kernel.angle, ref.angle, tol, ctx));
  w = std::max(w, expect_near_rel("final ssm", kernel.ssm, ref.ssm, tol, ctx));
  w = std::max(w, expect_near_rel("final k", kernel.k, ref.k, tol, ctx));
  w = std::max(w, expect_near_rel("final v", kernel.v, ref.v, tol, ctx));
  worst().forward = std::max(worst().forward, w);
}

void compare_grads(const RefGrads& kernel, const RefGrads& ref, double tol, const std::string& ctx,
                   double vanishing = 1e-3) {
  const std::vector<std::pair<const char*, std::pair<const std::vector<double>*, const std::vector<double>*>>> all = {
      {"dq", {&kernel.dq, &ref.dq}},
      {"dk", {&kernel.dk, &ref.dk}},
      {"dv", {&kernel.dv, &ref.dv}},
      {"dadt", {&kernel.dadt, &ref.dadt}},
      {"ddt", {&kernel.ddt, &ref.ddt}},
      {"dtrap", {&kernel.dtrap, &ref.dtrap}},
      {"dq_bias", {&kernel.dq_bias, &ref.dq_bias}},
      {"dk_bias", {&kernel.dk_bias, &ref.dk_bias}},
      {"dangles", {&kernel.dangles, &ref.dangles}},
      {"dD", {&kernel.dD, &ref.dD}},
      {"dz", {&kernel.dz, &ref.dz}},
      {"dmimo_v", {&kernel.dmimo_v, &ref.dmimo_v}},
      {"dmimo_z", {&kernel.dmimo_z, &ref.dmimo_z}},
      {"dmimo_o", {&kernel.dmimo_o, &ref.dmimo_o}},
      {"dinitial angle", {&kernel.dangle0, &ref.dangle0}},
      {"dinitial ssm", {&kernel.dssm0, &ref.dssm0}},
      {"dinitial k", {&kernel.dk0, &ref.dk0}},
      {"dinitial v", {&kernel.dv0, &ref.dv0}}};
  // A gradient that vanishes in exact arithmetic (∂/∂θ where only rotation-invariant terms depend on
  // θ) is rounding noise in the kernels: it is measured against `vanishing` (fp32: 1e-3) of the
  // largest gradient.
  double largest = 0.0;
  for (const auto& e : all)
    for (const double x : *e.second.second) largest = std::max(largest, std::fabs(x));
  double w = 0.0;
  for (const auto& e : all) {
    w = std::max(w, expect_near_rel(e.first, *e.second.first, *e.second.second, tol, ctx, vanishing * largest));
  }
  worst().gradient = std::max(worst().gradient, w);
}

template <class Exec>
void check_against_reference(const Config& cfg) {
  const bool tf32 = cfg.precision == kmamba::MatmulPrecision::TensorFloat32 &&
                    kmamba::impl::TeamGemm<Exec, kmamba::MatmulPrecision::TensorFloat32>::tensor_cores;
  const RefProblem P = make_reference_problem(cfg);
  const DeviceProblem<typename Exec::memory_space> p(P);
  const auto result = run_kernels<Exec>(p, true);
  const std::string ctx = cfg.describe();
  compare_outputs(result.first, ref_forward(P), tf32 ? tf32_forward_tol : forward_tol, ctx);
  if (tf32) {
    compare_grads(result.second, ref_backward(P), tf32_gradient_tol, ctx, tf32_vanishing);
  } else {
    compare_grads(result.second, ref_backward(P), gradient_tol, ctx);
  }
}

// The sweep with the kernels' chunk products in TensorFloat32.
std::vector<Config> in_tensor_float32(std::vector<Config> list) {
  for (Config& c : list) c.precision = kmamba::MatmulPrecision::TensorFloat32;
  return list;
}

std::vector<Config> siso_sweep() {
  std::vector<Config> list;
  Config c;
  c.seqlen = 1;  // one token, no options
  c.ngroups = 1;
  list.push_back(c);
  c = Config();
  c.seqlen = 3;  // chunk − 1
  c.D = c.z = true;
  c.seed = 2;
  list.push_back(c);
  c = Config();
  c.seqlen = 4;  // exactly one chunk
  c.ngroups = 1;
  c.initial = c.dfinal = true;
  c.seed = 3;
  list.push_back(c);
  c = Config();
  c.seqlen = 29;  // seven chunks + 1, rope_fraction 0.5
  c.D = c.z = c.initial = c.dfinal = true;
  c.seed = 4;
  list.push_back(c);
  c.nangles = 4;  // rope_fraction 1.0
  c.ngroups = 1;
  c.chunk = 8;
  c.seed = 5;
  list.push_back(c);
  c.nangles = 0;  // no rotation at all
  c.D = c.z = false;
  c.seed = 6;
  list.push_back(c);
  c = Config();
  c.batch = 1;  // the default chunk 64: two full chunks and a partial one
  c.seqlen = 150;
  c.chunk = 64;
  c.nheads = 2;
  c.headdim = 8;
  c.ngroups = 1;
  c.dstate = 16;
  c.nangles = 4;
  c.D = c.z = c.initial = c.dfinal = true;
  c.seed = 7;
  list.push_back(c);
  c.seqlen = 170;  // chunks longer than a scratch tile (64 rows)
  c.chunk = 80;
  c.ngroups = 2;
  c.seed = 8;
  list.push_back(c);
  return list;
}

std::vector<Config> mimo_sweep() {
  std::vector<Config> list;
  Config c;
  c.rank = 1;  // one token, rank 1
  c.seqlen = 1;
  c.ngroups = 1;
  list.push_back(c);
  c = Config();
  c.rank = 2;  // chunk − 1
  c.seqlen = 3;
  c.D = c.z = true;
  c.seed = 12;
  list.push_back(c);
  c = Config();
  c.rank = 4;  // several chunks and a remainder, every option
  c.seqlen = 29;
  c.D = c.z = c.initial = c.dfinal = true;
  c.seed = 13;
  list.push_back(c);
  c.rank = 2;  // rope_fraction 1.0, no gate
  c.nangles = 4;
  c.ngroups = 1;
  c.z = false;
  c.chunk = 8;
  c.seed = 14;
  list.push_back(c);
  c.rank = 1;  // rank 1 through the MIMO path
  c.z = true;
  c.nangles = 2;
  c.seed = 15;
  list.push_back(c);
  c = Config();
  c.batch = 1;  // the default chunk 64 / 4 = 16
  c.rank = 4;
  c.seqlen = 40;
  c.chunk = 0;
  c.nheads = 2;
  c.headdim = 8;
  c.ngroups = 1;
  c.dstate = 16;
  c.nangles = 4;
  c.D = c.z = c.initial = c.dfinal = true;
  c.seed = 16;
  list.push_back(c);
  c.seqlen = 70;  // chunks of more rows than a scratch tile
  c.chunk = 32;
  c.ngroups = 2;
  c.seed = 17;
  list.push_back(c);
  return list;
}

template <class ExecSpace>
class Mamba3Scan : public ::testing::Test {};
TYPED_TEST_SUITE(Mamba3Scan, kmamba::test::Backends, kmamba::test::BackendNames);

TYPED_TEST(Mamba3Scan, SisoMatchesReference) {
  worst() = Worst();
  for (const Config& cfg : siso_sweep()) check_against_reference<TypeParam>(cfg);
  print_worst("SISO kernels vs reference");
}

TYPED_TEST(Mamba3Scan, MimoMatchesReference) {
  worst() = Worst();
  for (const Config& cfg : mimo_sweep()) check_against_reference<TypeParam>(cfg);
  print_worst("MIMO kernels vs reference");
}

TYPED_TEST(Mamba3Scan, TensorFloat32SisoMatchesReference) {
  worst() = Worst();
  for (const Config& cfg : in_tensor_float32(siso_sweep())) check_against_reference<TypeParam>(cfg);
  print_worst("SISO kernels (TensorFloat32 chunk products) vs reference");
}

TYPED_TEST(Mamba3Scan, TensorFloat32MimoMatchesReference) {
  worst() = Worst();
  for (const Config& cfg : in_tensor_float32(mimo_sweep())) check_against_reference<TypeParam>(cfg);
  print_worst("MIMO kernels (TensorFloat32 chunk products) vs reference");
}

// ----------------------------------------------------------------------------------------------
// Decode steps and segments.

// Tokens [t0, t1) of a row-major tensor laid out as (outer, seqlen, inner).
std::vector<double> slice_tokens(const std::vector<double>& v, int outer, int seqlen, int inner, int t0, int t1) {
  std::vector<double> out;
  if (v.empty()) return out;
  for (int o = 0; o < outer; ++o)
    for (int t = t0; t < t1; ++t)
      for (int i = 0; i < inner; ++i) out.push_back(v[(static_cast<std::size_t>(o) * seqlen + t) * inner + i]);
  return out;
}

// The tokens of `a` followed by those of `b`, both laid out as (outer, length, inner).
std::vector<double> join_tokens(const std::vector<double>& a, const std::vector<double>& b, int outer, int la, int lb,
                                int inner) {
  std::vector<double> out;
  for (int o = 0; o < outer; ++o) {
    for (int t = 0; t < la; ++t)
      for (int i = 0; i < inner; ++i) out.push_back(a[(static_cast<std::size_t>(o) * la + t) * inner + i]);
    for (int t = 0; t < lb; ++t)
      for (int i = 0; i < inner; ++i) out.push_back(b[(static_cast<std::size_t>(o) * lb + t) * inner + i]);
  }
  return out;
}

std::vector<double> add(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> out(a);
  for (std::size_t i = 0; i < out.size() && i < b.size(); ++i) out[i] += b[i];
  return out;
}

// Tokens [t0, t1) of a problem (the states and cotangents are left to the caller).
RefProblem slice_problem(const RefProblem& P, int t0, int t1) {
  RefProblem S = P;
  const Config& c = P.cfg;
  const int R = P.R(), L = c.seqlen;
  S.cfg.seqlen = t1 - t0;
  S.q = slice_tokens(P.q, c.batch, L, R * c.ngroups * c.dstate, t0, t1);
  S.k = slice_tokens(P.k, c.batch, L, R * c.ngroups * c.dstate, t0, t1);
  S.v = slice_tokens(P.v, c.batch, L, c.nheads * c.headdim, t0, t1);
  S.z = slice_tokens(P.z, c.batch, L, c.nheads * c.headdim, t0, t1);
  S.dout = slice_tokens(P.dout, c.batch, L, c.nheads * c.headdim, t0, t1);
  S.angles = slice_tokens(P.angles, c.batch, L, c.nheads * c.nangles, t0, t1);
  S.adt = slice_tokens(P.adt, c.batch * c.nheads, L, 1, t0, t1);
  S.dt = slice_tokens(P.dt, c.batch * c.nheads, L, 1, t0, t1);
  S.trap = slice_tokens(P.trap, c.batch * c.nheads, L, 1, t0, t1);
  return S;
}

template <class Exec>
void check_decode_steps(const Config& cfg) {
  using Mem = typename Exec::memory_space;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  const std::string ctx = cfg.describe();
  const RefProblem P = make_reference_problem(cfg);
  const DeviceProblem<Mem> p(P);
  const RefOutputs chunked = run_kernels<Exec>(p, false).first;
  const Exec exec;
  const int B = cfg.batch, H = cfg.nheads, Pd = cfg.headdim, G = cfg.ngroups, N = cfg.dstate, S = cfg.nangles;
  const int R = cfg.R();
  // The carried states start from the initial states (zero when absent).
  auto or_zeros = [](const std::vector<double>& v, std::size_t n) {
    return v.empty() ? std::vector<double>(n, 0.0) : v;
  };
  const std::vector<double> a0 = or_zeros(P.angle0, P.states_angle_size()), s0 = or_zeros(P.ssm0, P.states_ssm_size());
  const std::vector<double> k0 = or_zeros(P.k0, P.states_k_size()), v0 = or_zeros(P.v0, P.states_v_size());
  kmamba::Mamba3SisoStates<Mem> siso_states;
  kmamba::Mamba3MimoStates<Mem> mimo_states;
  if (cfg.mimo()) {
    mimo_states = {upload<T3>("angle_state", a0, B, H, S), upload<T4>("ssm_state", s0, B, H, Pd, N),
                   upload<T4>("k_state", k0, B, H, R, N), upload<T4>("v_state", v0, B, H, R, Pd)};
  } else {
    siso_states = {upload<T3>("angle_state", a0, B, H, S), upload<T4>("ssm_state", s0, B, H, Pd, N),
                   upload<T3>("k_state", k0, B, H, N), upload<T3>("v_state", v0, B, H, Pd)};
  }
  std::vector<double> stepped(P.v.size(), 0.0);
  for (int t = 0; t < cfg.seqlen; ++t) {
    const RefProblem one = slice_problem(P, t, t + 1);
    const T3 v1 = upload<T3>("v1", one.v, B, H, Pd);
    const T3 z1 = upload_optional<T3>("z1", one.z, cfg.z, B, H, Pd);
    const T2 adt1 = upload<T2>("adt1", one.adt, B, H), dt1 = upload<T2>("dt1", one.dt, B, H);
    const T2 trap1 = upload<T2>("trap1", one.trap, B, H);
    const T3 angles1 = upload<T3>("angles1", one.angles, B, H, S);
    auto y = allocate_poisoned<T3>("y1", B, H, Pd);
    if (cfg.mimo()) {
      kmamba::Mamba3MimoStepArgs<Mem> a;
      a.q = upload<T4>("q1", one.q, B, R, G, N);
      a.k = upload<T4>("k1", one.k, B, R, G, N);
      a.v = v1;
      a.z = z1;
      a.adt = adt1;
      a.dt = dt1;
      a.trap = trap1;
      a.angles = angles1;
      a.q_bias = p.q_bias3;
      a.k_bias = p.k_bias3;
      a.mimo_v = p.mimo_v;
      a.mimo_z = p.mimo_z;
      a.mimo_o = p.mimo_o;
      a.D = p.D;
      kmamba::mamba3_mimo_step(exec, a, mimo_states, y);
    } else {
      kmamba::Mamba3SisoStepArgs<Mem> a;
      a.q = upload<T3>("q1", one.q, B, G, N);
      a.k = upload<T3>("k1", one.k, B, G, N);
      a.v = v1;
      a.z = z1;
      a.adt = adt1;
      a.dt = dt1;
      a.trap = trap1;
      a.angles = angles1;
      a.q_bias = p.q_bias2;
      a.k_bias = p.k_bias2;
      a.D = p.D;
      kmamba::mamba3_siso_step(exec, a, siso_states, y);
    }
    const std::vector<double> hy = host_doubles(y);
    for (int b = 0; b < B; ++b)
      for (int h = 0; h < H; ++h)
        for (int q = 0; q < Pd; ++q) stepped[P.iv(b, t, h, q)] = hy[(static_cast<std::size_t>(b) * H + h) * Pd + q];
  }
  RefOutputs steps;
  steps.out = stepped;
  if (cfg.mimo()) {
    steps.angle = host_doubles(mimo_states.angle);
    steps.ssm = host_doubles(mimo_states.ssm);
    steps.k = host_doubles(mimo_states.k);
    steps.v = host_doubles(mimo_states.v);
  } else {
    steps.angle = host_doubles(siso_states.angle);
    steps.ssm = host_doubles(siso_states.ssm);
    steps.k = host_doubles(siso_states.k);
    steps.v = host_doubles(siso_states.v);
  }
  compare_outputs(steps, chunked, chain_tol, ctx + " (decode steps vs chunked forward)");
}

TYPED_TEST(Mamba3Scan, ChunkedForwardMatchesDecodeSteps) {
  worst() = Worst();
  Config c;
  c.seqlen = 13;  // three chunks + 1
  c.D = c.z = true;
  c.seed = 20;
  check_decode_steps<TypeParam>(c);
  c.initial = true;
  c.ngroups = 1;
  c.nangles = 4;
  c.seed = 21;
  check_decode_steps<TypeParam>(c);
  c.rank = 3;
  c.seed = 22;
  check_decode_steps<TypeParam>(c);
  c.rank = 2;
  c.z = c.initial = false;
  c.ngroups = 2;
  c.nangles = 2;
  c.seed = 23;
  check_decode_steps<TypeParam>(c);
  print_worst("decode steps vs chunked forward");
}

// Segment 1 and segment 2 run separately, segment 2 from the final states of segment 1 (and its
// backward's initial-state gradients as the cotangents of segment 1's final states), against one
// pass over the whole sequence.
template <class Exec>
void check_segments(const Config& cfg, int split) {
  using Mem = typename Exec::memory_space;
  const std::string ctx = cfg.describe() + " split=" + std::to_string(split);
  const Config& c = cfg;
  const int B = c.batch, L = c.seqlen, H = c.nheads, Pd = c.headdim, R = c.R();
  const RefProblem P = make_reference_problem(cfg);
  const auto whole = run_kernels<Exec>(DeviceProblem<Mem>(P), true);

  RefProblem first = slice_problem(P, 0, split), second = slice_problem(P, split, L);
  first.dangle.clear();
  first.dssm.clear();
  first.dk.clear();
  first.dv.clear();
  const auto forward1 = run_kernels<Exec>(DeviceProblem<Mem>(first), false).first;
  second.angle0 = forward1.angle;
  second.ssm0 = forward1.ssm;
  second.k0 = forward1.k;
  second.v0 = forward1.v;
  const auto run2 = run_kernels<Exec>(DeviceProblem<Mem>(second), true);
  first.dangle = run2.second.dangle0;
  first.dssm = run2.second.dssm0;
  first.dk = run2.second.dk0;
  first.dv = run2.second.dv0;
  const auto run1 = run_kernels<Exec>(DeviceProblem<Mem>(first), true);

  RefOutputs chained = run2.first;
  chained.out = join_tokens(run1.first.out, run2.first.out, B, split, L - split, H * Pd);
  compare_outputs(chained, whole.first, chain_tol, ctx + " (segments vs one pass)");

  const RefGrads& g1 = run1.second;
  const RefGrads& g2 = run2.second;
  RefGrads joined;
  const int qk_inner = R * c.ngroups * c.dstate;
  joined.dq = join_tokens(g1.dq, g2.dq, B, split, L - split, qk_inner);
  joined.dk = join_tokens(g1.dk, g2.dk, B, split, L - split, qk_inner);
  joined.dv = join_tokens(g1.dv, g2.dv, B, split, L - split, H * Pd);
  if (c.z) joined.dz = join_tokens(g1.dz, g2.dz, B, split, L - split, H * Pd);
  joined.dangles = join_tokens(g1.dangles, g2.dangles, B, split, L - split, H * c.nangles);
  joined.dadt = join_tokens(g1.dadt, g2.dadt, B * H, split, L - split, 1);
  joined.ddt = join_tokens(g1.ddt, g2.ddt, B * H, split, L - split, 1);
  joined.dtrap = join_tokens(g1.dtrap, g2.dtrap, B * H, split, L - split, 1);
  joined.dq_bias = add(g1.dq_bias, g2.dq_bias);
  joined.dk_bias = add(g1.dk_bias, g2.dk_bias);
  joined.dD = add(g1.dD, g2.dD);
  joined.dmimo_v = add(g1.dmimo_v, g2.dmimo_v);
  joined.dmimo_z = add(g1.dmimo_z, g2.dmimo_z);
  joined.dmimo_o = add(g1.dmimo_o, g2.dmimo_o);
  joined.dangle0 = g1.dangle0;
  joined.dssm0 = g1.dssm0;
  joined.dk0 = g1.dk0;
  joined.dv0 = g1.dv0;
  compare_grads(joined, whole.second, chain_gradient_tol, ctx + " (segments vs one pass, gradients)");
}

TYPED_TEST(Mamba3Scan, SegmentsChainThroughTheStates) {
  worst() = Worst();
  Config c;
  c.seqlen = 21;
  c.D = c.z = c.initial = c.dfinal = true;
  c.seed = 30;
  check_segments<TypeParam>(c, 11);  // inside the third chunk
  c.rank = 2;
  c.seed = 31;
  check_segments<TypeParam>(c, 8);  // on a chunk boundary
  c.rank = 4;
  c.z = c.initial = false;
  c.seed = 32;
  check_segments<TypeParam>(c, 1);  // a one-token first segment
  print_worst("segments vs one pass");
}

TYPED_TEST(Mamba3Scan, EmptySequencePassesTheStates) {
  Config c;
  c.seqlen = 0;
  c.D = c.z = c.initial = c.dfinal = true;
  check_against_reference<TypeParam>(c);
  c.rank = 2;
  check_against_reference<TypeParam>(c);
  c.initial = c.dfinal = false;  // zero states in, zero gradients out
  check_against_reference<TypeParam>(c);
}

// ----------------------------------------------------------------------------------------------
// Argument checks.

template <class Fn>
void expect_user_error(Fn&& fn, const std::vector<std::string>& fragments) {
  try {
    fn();
    ADD_FAILURE() << "expected kmamba::UserError";
  } catch (const kmamba::UserError& e) {
    const std::string what = e.what();
    for (const std::string& f : fragments)
      EXPECT_NE(what.find(f), std::string::npos) << "'" << f << "' not in: " << what;
  }
}

TYPED_TEST(Mamba3Scan, RejectsBadShapes) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  using T5 = kmamba::Tensor5<float, Mem>;
  using kmamba::allocate;
  const Exec exec;
  Config cfg;  // batch 2, seqlen 10, nheads 4, headdim 3, ngroups 2, dstate 8, nangles 2
  cfg.D = cfg.z = true;
  const DeviceProblem<Mem> siso(make_reference_problem(cfg));
  auto out = allocate<T4>("kmamba::test::out", 2, 10, 4, 3);
  const kmamba::Mamba3SisoStates<Mem> no_states;

  kmamba::Mamba3SisoArgs<Mem> a = siso.siso_args();
  a.q = allocate<T4>("kmamba::test::q", 2, 9, 2, 8);
  expect_user_error(
      [&] { kmamba::mamba3_siso_forward(exec, a, out, no_states); },
      {"kmamba::mamba3_siso_forward", "q", "(2, 9, 2, 8)", "(2, 10, 2, 8)", "(batch, seqlen, ngroups, dstate)"});
  a = siso.siso_args();
  a.k = allocate<T4>("kmamba::test::k", 2, 10, 3, 8);
  expect_user_error([&] { kmamba::mamba3_siso_forward(exec, a, out, no_states); },
                    {"k", "(2, 10, 3, 8)", "(2, 10, 2, 8)"});
  a = siso.siso_args();
  a.q = allocate<T4>("kmamba::test::q", 2, 10, 3, 8);
  a.k = a.q;
  expect_user_error([&] { kmamba::mamba3_siso_forward(exec, a, out, no_states); }, {"ngroups = 3", "nheads = 4"});
  a = siso.siso_args();
  a.angles = allocate<T4>("kmamba::test::angles", 2, 10, 4, 5);
  expect_user_error([&] { kmamba::mamba3_siso_forward(exec, a, out, no_states); },
                    {"angles", "2·nangles = 10", "dstate = 8"});
  a = siso.siso_args();
  a.adt = allocate<T3>("kmamba::test::adt", 2, 10, 4);
  expect_user_error([&] { kmamba::mamba3_siso_forward(exec, a, out, no_states); },
                    {"adt", "(2, 10, 4)", "(2, 4, 10)", "(batch, nheads, seqlen)"});
  a = siso.siso_args();
  a.q_bias = allocate<T2>("kmamba::test::q_bias", 4, 7);
  expect_user_error([&] { kmamba::mamba3_siso_forward(exec, a, out, no_states); }, {"q_bias", "(4, 7)", "(4, 8)"});
  a = siso.siso_args();
  a.initial.k = allocate<T3>("kmamba::test::k0", 2, 4, 3);
  expect_user_error([&] { kmamba::mamba3_siso_forward(exec, a, out, no_states); },
                    {"initial.k", "(2, 4, 3)", "(2, 4, 8)"});
  a = siso.siso_args();
  a.angles = kmamba::ConstTensor4<float, Mem>();
  expect_user_error([&] { kmamba::mamba3_siso_forward(exec, a, out, no_states); }, {"are required"});
  a = siso.siso_args();
  kmamba::Mamba3SisoStates<Mem> bad_final;
  bad_final.ssm = allocate<T4>("kmamba::test::ssm", 2, 4, 8, 3);
  expect_user_error([&] { kmamba::mamba3_siso_forward(exec, a, out, bad_final); },
                    {"final_states.ssm", "(2, 4, 8, 3)", "(2, 4, 3, 8)", "(batch, nheads, headdim, dstate)"});
  expect_user_error(
      [&] { kmamba::mamba3_siso_forward(exec, a, allocate<T4>("kmamba::test::o", 2, 10, 4, 4), no_states); },
      {"out", "(2, 10, 4, 4)", "(2, 10, 4, 3)"});
  a.chunk_size = 0;
  expect_user_error([&] { kmamba::mamba3_siso_forward(exec, a, out, no_states); }, {"chunk_size"});
  a.chunk_size = 1 << 20;
  expect_user_error([&] { kmamba::mamba3_siso_forward(exec, a, out, no_states); }, {"chunk_size", "scratch"});

  a = siso.siso_args();
  kmamba::Mamba3SisoGrads<Mem> g;
  g.dq = allocate<T4>("kmamba::test::dq", 2, 10, 2, 8);
  g.dk = allocate<T4>("kmamba::test::dk", 2, 10, 2, 8);
  g.dv = allocate<T4>("kmamba::test::dv", 2, 10, 4, 3);
  g.dadt = allocate<T3>("kmamba::test::dadt", 2, 4, 10);
  g.ddt = allocate<T3>("kmamba::test::ddt", 2, 4, 10);
  g.dtrap = allocate<T3>("kmamba::test::dtrap", 2, 4, 10);
  g.dq_bias = allocate<T2>("kmamba::test::dq_bias", 4, 8);
  g.dk_bias = allocate<T2>("kmamba::test::dk_bias", 4, 8);
  g.dangles = allocate<T4>("kmamba::test::dangles", 2, 10, 4, 2);
  expect_user_error([&] { kmamba::mamba3_siso_backward(exec, a, siso.dout, {}, g); },
                    {"kmamba::mamba3_siso_backward", "dz"});
  g.dz = allocate<T4>("kmamba::test::dz", 2, 10, 4, 3);
  g.dk = allocate<T4>("kmamba::test::dk", 2, 10, 1, 8);
  expect_user_error([&] { kmamba::mamba3_siso_backward(exec, a, siso.dout, {}, g); },
                    {"dk", "(2, 10, 1, 8)", "(2, 10, 2, 8)"});
  g.dk = g.dq;
  expect_user_error(
      [&] { kmamba::mamba3_siso_backward(exec, a, allocate<T4>("kmamba::test::dout", 2, 10, 4, 2), {}, g); },
      {"dout", "(2, 10, 4, 2)", "(2, 10, 4, 3)"});

  cfg.rank = 2;
  const DeviceProblem<Mem> mimo(make_reference_problem(cfg));
  const kmamba::Mamba3MimoStates<Mem> no_mimo_states;
  kmamba::Mamba3MimoArgs<Mem> m = mimo.mimo_args();
  m.mimo_z = kmamba::ConstTensor3<float, Mem>();
  expect_user_error([&] { kmamba::mamba3_mimo_forward(exec, m, out, no_mimo_states); },
                    {"kmamba::mamba3_mimo_forward", "mimo_z", "exactly when z"});
  m = mimo.mimo_args();
  m.q = allocate<T5>("kmamba::test::q", 2, 10, 3, 2, 8);
  expect_user_error([&] { kmamba::mamba3_mimo_forward(exec, m, out, no_mimo_states); },
                    {"k", "(2, 10, 2, 2, 8)", "(2, 10, 3, 2, 8)", "(batch, seqlen, rank, ngroups, dstate)"});
  m.k = m.q;
  expect_user_error([&] { kmamba::mamba3_mimo_forward(exec, m, out, no_mimo_states); },
                    {"q_bias", "(4, 2, 8)", "(4, 3, 8)", "(nheads, rank, dstate)"});
  m = mimo.mimo_args();
  m.mimo_o = allocate<T3>("kmamba::test::mimo_o", 4, 2, 4);
  expect_user_error([&] { kmamba::mamba3_mimo_forward(exec, m, out, no_mimo_states); },
                    {"mimo_o", "(4, 2, 4)", "(4, 2, 3)", "(nheads, rank, headdim)"});
  m = mimo.mimo_args();
  m.chunk_size = -1;
  expect_user_error([&] { kmamba::mamba3_mimo_forward(exec, m, out, no_mimo_states); }, {"chunk_size"});
  m = mimo.mimo_args();
  m.initial.v = allocate<T4>("kmamba::test::v0", 2, 4, 1, 3);
  expect_user_error([&] { kmamba::mamba3_mimo_forward(exec, m, out, no_mimo_states); },
                    {"initial.v", "(2, 4, 1, 3)", "(2, 4, 2, 3)", "(batch, nheads, rank, headdim)"});

  kmamba::Mamba3SisoStepArgs<Mem> step;
  step.q = allocate<T3>("kmamba::test::q1", 2, 2, 8);
  step.k = allocate<T3>("kmamba::test::k1", 2, 2, 8);
  step.v = allocate<T3>("kmamba::test::v1", 2, 4, 3);
  step.adt = allocate<T2>("kmamba::test::adt1", 2, 4);
  step.dt = allocate<T2>("kmamba::test::dt1", 2, 4);
  step.trap = allocate<T2>("kmamba::test::trap1", 2, 4);
  step.q_bias = siso.q_bias2;
  step.k_bias = siso.k_bias2;
  step.angles = allocate<T3>("kmamba::test::angles1", 2, 4, 2);
  auto y = allocate<T3>("kmamba::test::y1", 2, 4, 3);
  kmamba::Mamba3SisoStates<Mem> states{
      allocate<T3>("kmamba::test::angle_state", 2, 4, 2), allocate<T4>("kmamba::test::ssm_state", 2, 4, 8, 3),
      allocate<T3>("kmamba::test::k_state", 2, 4, 8), allocate<T3>("kmamba::test::v_state", 2, 4, 3)};
  expect_user_error([&] { kmamba::mamba3_siso_step(exec, step, states, y); },
                    {"kmamba::mamba3_siso_step", "states.ssm", "(2, 4, 8, 3)", "(2, 4, 3, 8)"});
  states.ssm = kmamba::Tensor4<float, Mem>();
  expect_user_error([&] { kmamba::mamba3_siso_step(exec, step, states, y); }, {"all four states"});
  step.trap = allocate<T2>("kmamba::test::trap1", 2, 3);
  states.ssm = allocate<T4>("kmamba::test::ssm_state", 2, 4, 3, 8);
  expect_user_error([&] { kmamba::mamba3_siso_step(exec, step, states, y); }, {"trap", "(2, 3)", "(2, 4)"});
}

// ----------------------------------------------------------------------------------------------
// Golden data.

std::vector<double> golden_doubles(const kmamba::test::SafeTensorsFile& file, const std::string& name) {
  const std::vector<float> f = file.floats(name);
  return std::vector<double>(f.begin(), f.end());
}

// The inputs of a golden file as a reference problem (the golden layouts are the reference's).
RefProblem golden_problem(const kmamba::test::SafeTensorsFile& file, bool mimo) {
  const auto& v = file.entry("V").shape;
  const auto& q = file.entry("Q").shape;
  RefProblem P;
  Config& c = P.cfg;
  c.batch = static_cast<int>(v[0]);
  c.seqlen = static_cast<int>(v[1]);
  c.nheads = static_cast<int>(v[2]);
  c.headdim = static_cast<int>(v[3]);
  c.rank = mimo ? static_cast<int>(q[2]) : 0;
  c.ngroups = static_cast<int>(q[q.size() - 2]);
  c.dstate = static_cast<int>(q[q.size() - 1]);
  c.nangles = static_cast<int>(file.entry("Angles").shape[3]);
  c.chunk = mimo ? 0 : 64;  // the reference defaults
  c.D = c.z = true;
  P.q = golden_doubles(file, "Q");
  P.k = golden_doubles(file, "K");
  P.v = golden_doubles(file, "V");
  P.z = golden_doubles(file, "Z");
  P.adt = golden_doubles(file, "ADT");
  P.dt = golden_doubles(file, "DT");
  P.trap = golden_doubles(file, "Trap");
  P.q_bias = golden_doubles(file, "Q_bias");
  P.k_bias = golden_doubles(file, "K_bias");
  P.angles = golden_doubles(file, "Angles");
  P.D = golden_doubles(file, "D");
  P.dout = golden_doubles(file, "dout");
  if (mimo) {
    P.mimo_v = golden_doubles(file, "MIMO_V");
    P.mimo_z = golden_doubles(file, "MIMO_Z");
    P.mimo_o = golden_doubles(file, "MIMO_O");
  }
  return P;
}

// ‖result − golden‖₂ ≤ tol·‖golden‖₂ for every output and gradient of the file.
void expect_golden(const kmamba::test::SafeTensorsFile& file, const RefOutputs& o, const RefGrads& g, bool mimo,
                   double tol, const std::string& context) {
  std::vector<std::pair<std::string, const std::vector<double>*>> all = {{"out", &o.out},
                                                                         {"final_angle", &o.angle},
                                                                         {"final_ssm", &o.ssm},
                                                                         {"final_k", &o.k},
                                                                         {"final_v", &o.v},
                                                                         {"grad.Q", &g.dq},
                                                                         {"grad.K", &g.dk},
                                                                         {"grad.V", &g.dv},
                                                                         {"grad.Z", &g.dz},
                                                                         {"grad.ADT", &g.dadt},
                                                                         {"grad.DT", &g.ddt},
                                                                         {"grad.Trap", &g.dtrap},
                                                                         {"grad.Q_bias", &g.dq_bias},
                                                                         {"grad.K_bias", &g.dk_bias},
                                                                         {"grad.Angles", &g.dangles},
                                                                         {"grad.D", &g.dD}};
  if (mimo) {
    all.push_back({"grad.MIMO_V", &g.dmimo_v});
    all.push_back({"grad.MIMO_Z", &g.dmimo_z});
    all.push_back({"grad.MIMO_O", &g.dmimo_o});
  }
  for (const auto& e : all) {
    const std::vector<float> ref = file.floats(e.first);
    const std::vector<double>& got = *e.second;
    ASSERT_EQ(got.size(), ref.size()) << e.first << " " << context;
    double err = 0.0, norm = 0.0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      ASSERT_TRUE(std::isfinite(got[i])) << e.first << "[" << i << "] " << context;
      err += (got[i] - ref[i]) * (got[i] - ref[i]);
      norm += double(ref[i]) * ref[i];
    }
    EXPECT_LE(std::sqrt(err), tol * std::sqrt(norm))
        << e.first << ": ‖Δ‖ = " << std::sqrt(err) << ", ‖ref‖ = " << std::sqrt(norm) << " " << context;
    worst().golden = std::max(worst().golden, std::sqrt(err) / std::max(std::sqrt(norm), 1e-30));
  }
  std::printf("%s: largest ‖Δ‖/‖ref‖ %.2e\n", context.c_str(), worst().golden);
  worst() = Worst();
}

const char* golden_name(bool mimo) { return mimo ? "mamba3_mimo_small" : "mamba3_siso_small"; }

TEST(Mamba3Reference, MatchesGoldenFiles) {
  for (const bool mimo : {false, true}) {
    const kmamba::test::SafeTensorsFile file(kmamba::test::golden_dir() + "/" + golden_name(mimo) + ".safetensors");
    const RefProblem P = golden_problem(file, mimo);
    expect_golden(file, ref_forward(P), ref_backward(P), mimo, reference_golden_tol,
                  std::string("double reference vs ") + golden_name(mimo));
  }
}

template <class Exec>
void check_golden(bool mimo) {
  const kmamba::test::SafeTensorsFile file(kmamba::test::golden_dir() + "/" + golden_name(mimo) + ".safetensors");
  const RefProblem P = golden_problem(file, mimo);
  const auto result = run_kernels<Exec>(DeviceProblem<typename Exec::memory_space>(P), true);
  expect_golden(file, result.first, result.second, mimo, kernel_golden_tol,
                std::string("kernels vs ") + golden_name(mimo));
}

TYPED_TEST(Mamba3Scan, MatchesGoldenSiso) { check_golden<TypeParam>(false); }

TYPED_TEST(Mamba3Scan, MatchesGoldenMimo) { check_golden<TypeParam>(true); }

}  // namespace
