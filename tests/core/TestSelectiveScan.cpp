// Mamba-1 selective scan: forward, backward and decode step against a sequential double-precision
// reference written from docs/algorithms.md §1.3, §1.4, §1.6 (token by token, every state kept).
//
// Tolerances: kernel (fp32) against the double reference, per tensor,
//   max|kernel − ref| ≤ tol · max|ref|,  tol = 1e-5 for sequences of ≤ 14 tokens, 2e-5 for the
//   300-token sequence (fp32 rounding of the recurrence and of the seqlen/batch/channel sums grows
//   with the number of terms; the largest error observed on Serial/OpenMP is 5e-7).
// Reference backward against central finite differences of the reference forward (double,
// step 1e-6): |fd − analytic| ≤ 1e-6 · (1 + |analytic|).
// Scan vs decode steps and segment chaining (fp32 vs fp32, same operations): 1e-6; a packed batch
// against its documents run one by one: 1e-6 for per-token values (the same operations, a state
// scaled by 0 in place of one that starts at 0), 1e-5 for the sums over tokens and batch rows
// (another grouping, as for the segments).
// Golden data (selective_scan_small, float64 autograd stored as float32): ‖Δ‖₂/‖ref‖₂ ≤ 1e-3
// per tensor, as tests/data/golden/README.md suggests.
#include "TestData.hpp"
#include <kmamba/core/Core.hpp>
#include <kmamba/core/SelectiveScan.hpp>

#include "Activations.hpp"
#include "Backends.hpp"
#include "Checks.hpp"
#include "PackedIds.hpp"
#include "SafeTensorsReader.hpp"

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

// ----------------------------------------------------------------------------------------------
// Problem description and the double reference.

struct Config {
  int batch = 2, dim = 4, seqlen = 5, dstate = 3, ngroups = 1;
  int chunk = 4;  // 0: let kmamba choose
  bool D = false, z = false, bias = false, softplus = false, initial_state = false, dlast = false;
  bool packed = false;                      // seq_idx from packed_ids
  float delta_lo = 0.05f, delta_hi = 0.6f;  // raw delta range (before bias and softplus)
  std::uint64_t seed = 1;

  std::string describe() const {
    std::ostringstream s;
    s << "batch=" << batch << " dim=" << dim << " seqlen=" << seqlen << " dstate=" << dstate << " ngroups=" << ngroups
      << " chunk=" << chunk << " D=" << D << " z=" << z << " bias=" << bias << " softplus=" << softplus
      << " initial_state=" << initial_state << " dlast=" << dlast << " packed=" << packed << " delta=[" << delta_lo
      << ", " << delta_hi << ")";
    return s.str();
  }
};

// Row-major host copies of every input, in double.
struct RefProblem {
  Config cfg;
  std::vector<double> u, delta, A, B, C, D, z, bias, h0, dout, dlast;
  std::vector<std::int64_t> ids;  // (batch, seqlen) packed sequence ids, when packed

  // 0 where token t starts a packed sequence, else 1: the factor on the carried state.
  double carry(int b, int t) const {
    const std::size_t i = static_cast<std::size_t>(b) * cfg.seqlen + t;
    return cfg.packed && t > 0 && ids[i] != ids[i - 1] ? 0.0 : 1.0;
  }

  std::size_t seq(int b, int d, int t) const { return (static_cast<std::size_t>(b) * cfg.dim + d) * cfg.seqlen + t; }
  std::size_t bc(int b, int g, int n, int t) const {
    return ((static_cast<std::size_t>(b) * cfg.ngroups + g) * cfg.dstate + n) * cfg.seqlen + t;
  }
  std::size_t st(int b, int d, int n) const { return (static_cast<std::size_t>(b) * cfg.dim + d) * cfg.dstate + n; }
};

struct RefResult {
  std::vector<double> out, last;
  std::vector<double> du, ddelta, dA, dB, dC, dD, dz, dbias, dh0;
};

// Forward (out, last) and, when `backward`, every gradient of sum(out·dout) + sum(last·dlast).
RefResult reference(const RefProblem& p, bool backward) {
  const Config& c = p.cfg;
  const int L = c.seqlen, N = c.dstate, per_group = c.dim / c.ngroups;
  RefResult r;
  r.out.assign(static_cast<std::size_t>(c.batch) * c.dim * L, 0.0);
  r.last.assign(static_cast<std::size_t>(c.batch) * c.dim * N, 0.0);
  if (backward) {
    r.du.assign(r.out.size(), 0.0);
    r.ddelta.assign(r.out.size(), 0.0);
    r.dz.assign(r.out.size(), 0.0);
    r.dA.assign(static_cast<std::size_t>(c.dim) * N, 0.0);
    r.dB.assign(static_cast<std::size_t>(c.batch) * c.ngroups * N * L, 0.0);
    r.dC.assign(r.dB.size(), 0.0);
    r.dD.assign(c.dim, 0.0);
    r.dbias.assign(c.dim, 0.0);
    r.dh0.assign(r.last.size(), 0.0);
  }
  std::vector<double> h(static_cast<std::size_t>(L + 1) * N), pre(L), dt(L), y(L), mu(N);
  for (int b = 0; b < c.batch; ++b) {
    for (int d = 0; d < c.dim; ++d) {
      const int g = d / per_group;
      const double Dd = c.D ? p.D[d] : 0.0;
      for (int n = 0; n < N; ++n) h[n] = c.initial_state ? p.h0[p.st(b, d, n)] : 0.0;
      for (int t = 0; t < L; ++t) {
        pre[t] = p.delta[p.seq(b, d, t)] + (c.bias ? p.bias[d] : 0.0);
        dt[t] = c.softplus ? softplus(pre[t]) : pre[t];
        const double u = p.u[p.seq(b, d, t)];
        double acc = 0.0;
        for (int n = 0; n < N; ++n) {
          const double a = p.carry(b, t) * std::exp(dt[t] * p.A[static_cast<std::size_t>(d) * N + n]);
          h[(t + 1) * N + n] = a * h[t * N + n] + dt[t] * p.B[p.bc(b, g, n, t)] * u;
          acc += p.C[p.bc(b, g, n, t)] * h[(t + 1) * N + n];
        }
        y[t] = acc;
        double o = acc + Dd * u;
        if (c.z) o *= silu(p.z[p.seq(b, d, t)]);
        r.out[p.seq(b, d, t)] = o;
      }
      for (int n = 0; n < N; ++n) r.last[p.st(b, d, n)] = h[L * N + n];
      if (!backward) continue;
      for (int n = 0; n < N; ++n) mu[n] = c.dlast ? p.dlast[p.st(b, d, n)] : 0.0;
      for (int t = L - 1; t >= 0; --t) {
        const double u = p.u[p.seq(b, d, t)];
        const double dout = p.dout[p.seq(b, d, t)];
        const double gsum = c.z ? dout * silu(p.z[p.seq(b, d, t)]) : dout;
        if (c.z) r.dz[p.seq(b, d, t)] = dout * (y[t] + Dd * u) * silu_derivative(p.z[p.seq(b, d, t)]);
        r.dD[d] += gsum * u;
        double sum_du = 0.0, sum_ddt = 0.0;
        for (int n = 0; n < N; ++n) {
          const double An = p.A[static_cast<std::size_t>(d) * N + n];
          const double a = p.carry(b, t) * std::exp(dt[t] * An);
          const double Bn = p.B[p.bc(b, g, n, t)];
          const double lambda = gsum * p.C[p.bc(b, g, n, t)] + mu[n];
          r.dC[p.bc(b, g, n, t)] += gsum * h[(t + 1) * N + n];
          r.dB[p.bc(b, g, n, t)] += lambda * dt[t] * u;
          sum_du += lambda * Bn;
          sum_ddt += lambda * (Bn * u + An * a * h[t * N + n]);
          r.dA[static_cast<std::size_t>(d) * N + n] += lambda * dt[t] * a * h[t * N + n];
          mu[n] = a * lambda;
        }
        r.du[p.seq(b, d, t)] = Dd * gsum + dt[t] * sum_du;
        const double dpre = sum_ddt * (c.softplus ? softplus_derivative(pre[t]) : 1.0);
        r.ddelta[p.seq(b, d, t)] = dpre;
        r.dbias[d] += dpre;
      }
      for (int n = 0; n < N; ++n) r.dh0[p.st(b, d, n)] = mu[n];
    }
  }
  return r;
}

double reference_loss(const RefProblem& p) {
  const RefResult r = reference(p, false);
  double loss = 0.0;
  for (std::size_t i = 0; i < r.out.size(); ++i) loss += r.out[i] * p.dout[i];
  if (p.cfg.dlast) {
    for (std::size_t i = 0; i < r.last.size(); ++i) loss += r.last[i] * p.dlast[i];
  }
  return loss;
}

// ----------------------------------------------------------------------------------------------
// Device-side problem: random inputs from kmamba's fills, distinct seeds per tensor.

template <class Exec>
struct ScanProblem {
  using Mem = typename Exec::memory_space;
  Config cfg;
  kmamba::Tensor3<float, Mem> u, delta, z, h0, dout, dlast;
  kmamba::Tensor2<float, Mem> A;
  kmamba::Tensor4<float, Mem> B, C;
  kmamba::Tensor1<float, Mem> D, bias;
  kmamba::Tensor2<std::int64_t, Mem> seq;

  explicit ScanProblem(const Config& c) : cfg(c) {
    using kmamba::allocate_uninitialized;
    const Exec exec;
    const std::uint64_t s = c.seed * 100;
    u = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::u", c.batch, c.dim, c.seqlen);
    delta = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::delta", c.batch, c.dim, c.seqlen);
    A = allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::A", c.dim, c.dstate);
    B = allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::test::B", c.batch, c.ngroups, c.dstate, c.seqlen);
    C = allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::test::C", c.batch, c.ngroups, c.dstate, c.seqlen);
    dout = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::dout", c.batch, c.dim, c.seqlen);
    kmamba::fill_normal(exec, u, s + 1, 0.0f, 1.0f);
    kmamba::fill_uniform(exec, delta, s + 2, c.delta_lo, c.delta_hi);
    kmamba::fill_uniform(exec, A, s + 3, -2.0f, -0.1f);
    kmamba::fill_normal(exec, B, s + 4, 0.0f, 1.0f);
    kmamba::fill_normal(exec, C, s + 5, 0.0f, 1.0f);
    kmamba::fill_normal(exec, dout, s + 6, 0.0f, 1.0f);
    if (c.D) {
      D = allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::D", c.dim);
      kmamba::fill_normal(exec, D, s + 7, 0.5f, 1.0f);
    }
    if (c.z) {
      z = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::z", c.batch, c.dim, c.seqlen);
      kmamba::fill_normal(exec, z, s + 8, 0.0f, 1.5f);
    }
    if (c.bias) {
      bias = allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::bias", c.dim);
      kmamba::fill_uniform(exec, bias, s + 9, -0.5f, 0.5f);
    }
    if (c.initial_state) {
      h0 = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::h0", c.batch, c.dim, c.dstate);
      kmamba::fill_normal(exec, h0, s + 10, 0.0f, 1.0f);
    }
    if (c.dlast) {
      dlast = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::dlast", c.batch, c.dim, c.dstate);
      kmamba::fill_normal(exec, dlast, s + 11, 0.0f, 1.0f);
    }
    exec.fence();
    if (c.packed) seq = device_packed_ids<Mem>(c.batch, c.seqlen);
  }

  kmamba::SelectiveScanArgs<Mem> args() const {
    kmamba::SelectiveScanArgs<Mem> a;
    a.u = u;
    a.delta = delta;
    a.A = A;
    a.B = B;
    a.C = C;
    a.D = D;
    a.z = z;
    a.delta_bias = bias;
    a.initial_state = h0;
    a.seq_idx = seq;
    a.delta_softplus = cfg.softplus;
    a.chunk_size = cfg.chunk;
    return a;
  }

  RefProblem host() const {
    RefProblem p;
    p.cfg = cfg;
    p.u = host_doubles(u);
    p.delta = host_doubles(delta);
    p.A = host_doubles(A);
    p.B = host_doubles(B);
    p.C = host_doubles(C);
    p.dout = host_doubles(dout);
    if (cfg.D) p.D = host_doubles(D);
    if (cfg.z) p.z = host_doubles(z);
    if (cfg.bias) p.bias = host_doubles(bias);
    if (cfg.initial_state) p.h0 = host_doubles(h0);
    if (cfg.dlast) p.dlast = host_doubles(dlast);
    if (cfg.packed) p.ids = packed_ids(cfg.batch, cfg.seqlen);
    return p;
  }
};

template <class Mem>
struct ScanOutputs {
  kmamba::Tensor3<float, Mem> out, last;
  kmamba::SelectiveScanGrads<Mem> grads;
};

// The public ops.
struct PublicOps {
  template <class Exec, class Args, class Out, class Dout, class Grads>
  void operator()(const Exec& exec, const Args& args, const Out& out, const Out& last, const Dout& dout,
                  const Dout& dlast, const Grads& grads) const {
    kmamba::selective_scan_forward(exec, args, out, last);
    kmamba::selective_scan_backward(exec, args, dout, dlast, grads);
  }
};

// Runs forward and backward on the kernel (through `ops`), every output poisoned with NaN beforehand.
template <class Exec, class Ops = PublicOps>
ScanOutputs<typename Exec::memory_space> run_kernel(const ScanProblem<Exec>& p, const Ops& ops = Ops()) {
  using Mem = typename Exec::memory_space;
  using kmamba::allocate_uninitialized;
  const Config& c = p.cfg;
  ScanOutputs<Mem> o;
  o.out = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::out", c.batch, c.dim, c.seqlen);
  o.last = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::last", c.batch, c.dim, c.dstate);
  auto& g = o.grads;
  g.du = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::du", c.batch, c.dim, c.seqlen);
  g.ddelta = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::ddelta", c.batch, c.dim, c.seqlen);
  g.dA = allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::dA", c.dim, c.dstate);
  g.dB =
      allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::test::dB", c.batch, c.ngroups, c.dstate, c.seqlen);
  g.dC =
      allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::test::dC", c.batch, c.ngroups, c.dstate, c.seqlen);
  g.dD = allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::dD", c.dim);
  g.ddelta_bias = allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::ddelta_bias", c.dim);
  g.dinitial_state =
      allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::dinitial_state", c.batch, c.dim, c.dstate);
  if (c.z) g.dz = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::dz", c.batch, c.dim, c.seqlen);
  for (auto* v : {&o.out, &o.last, &g.du, &g.ddelta, &g.dz, &g.dinitial_state}) poison(*v);
  for (auto* v : {&g.dB, &g.dC}) poison(*v);
  for (auto* v : {&g.dD, &g.ddelta_bias}) poison(*v);
  poison(g.dA);
  const Exec exec;
  ops(exec, p.args(), o.out, o.last, p.dout, p.dlast, g);
  exec.fence();
  return o;
}

// max|kernel − ref| ≤ tol · max|ref| (and every kernel value finite).
template <class View>
void expect_close(const std::string& what, const View& kernel, const std::vector<double>& ref, double tol,
                  const std::string& context) {
  const std::vector<double> k = host_doubles(kernel);
  ASSERT_EQ(k.size(), ref.size()) << what << " " << context;
  double max_err = 0.0, max_ref = 0.0;
  std::size_t worst = 0;
  for (std::size_t i = 0; i < k.size(); ++i) {
    ASSERT_TRUE(std::isfinite(k[i])) << what << "[" << i << "] = " << k[i] << " " << context;
    const double e = std::abs(k[i] - ref[i]);
    if (e > max_err) {
      max_err = e;
      worst = i;
    }
    max_ref = std::max(max_ref, std::abs(ref[i]));
  }
  EXPECT_LE(max_err, tol * std::max(max_ref, 1e-30))
      << what << ": max error " << max_err << " at " << worst << " (kernel " << k[worst] << ", ref " << ref[worst]
      << "), max |ref| " << max_ref << "; " << context;
}

template <class Exec, class Ops = PublicOps>
void check_against_reference(const Config& c, double tol, const Ops& ops = Ops()) {
  const ScanProblem<Exec> p(c);
  const auto o = run_kernel(p, ops);
  const RefProblem hp = p.host();
  const RefResult r = reference(hp, true);
  const std::string ctx = c.describe();
  expect_close("out", o.out, r.out, tol, ctx);
  expect_close("last_state", o.last, r.last, tol, ctx);
  expect_close("du", o.grads.du, r.du, tol, ctx);
  expect_close("ddelta", o.grads.ddelta, r.ddelta, tol, ctx);
  expect_close("dA", o.grads.dA, r.dA, tol, ctx);
  expect_close("dB", o.grads.dB, r.dB, tol, ctx);
  expect_close("dC", o.grads.dC, r.dC, tol, ctx);
  expect_close("dD", o.grads.dD, r.dD, tol, ctx);
  expect_close("ddelta_bias", o.grads.ddelta_bias, r.dbias, tol, ctx);
  expect_close("dinitial_state", o.grads.dinitial_state, r.dh0, tol, ctx);
  if (c.z) expect_close("dz", o.grads.dz, r.dz, tol, ctx);
}

// ----------------------------------------------------------------------------------------------
// The reference itself: backward against finite differences of its forward.

TEST(SelectiveScanReference, BackwardMatchesFiniteDifferences) {
  using Host = Kokkos::DefaultHostExecutionSpace;
  Config all;
  all.batch = 2;
  all.dim = 4;
  all.seqlen = 6;
  all.dstate = 3;
  all.ngroups = 2;
  all.D = all.z = all.bias = all.softplus = all.initial_state = all.dlast = true;
  all.delta_lo = -2.0f;
  all.delta_hi = 1.0f;
  all.seed = 71;
  Config bare;
  bare.batch = 1;
  bare.dim = 3;
  bare.seqlen = 5;
  bare.dstate = 2;
  bare.seed = 72;
  Config large_delta = all;  // softplus beyond its threshold of 20 for most tokens
  large_delta.delta_lo = 15.0f;
  large_delta.delta_hi = 25.0f;
  large_delta.seed = 73;
  Config packed = all;
  packed.seqlen = 12;
  packed.packed = true;
  packed.seed = 74;
  for (const Config& c : {all, bare, large_delta, packed}) {
    RefProblem p = ScanProblem<Host>(c).host();
    const RefResult r = reference(p, true);
    const double eps = 1e-6;
    auto check = [&](const char* name, std::vector<double>& x, const std::vector<double>& analytic) {
      ASSERT_EQ(x.size(), analytic.size()) << name;
      for (std::size_t i = 0; i < x.size(); ++i) {
        const double saved = x[i];
        x[i] = saved + eps;
        const double plus = reference_loss(p);
        x[i] = saved - eps;
        const double minus = reference_loss(p);
        x[i] = saved;
        const double fd = (plus - minus) / (2 * eps);
        ASSERT_NEAR(fd, analytic[i], 1e-6 * (1.0 + std::abs(analytic[i]))) << name << "[" << i << "] " << c.describe();
      }
    };
    check("u", p.u, r.du);
    check("delta", p.delta, r.ddelta);
    check("A", p.A, r.dA);
    check("B", p.B, r.dB);
    check("C", p.C, r.dC);
    if (c.D) check("D", p.D, r.dD);
    if (c.z) check("z", p.z, r.dz);
    if (c.bias) check("delta_bias", p.bias, r.dbias);
    if (c.initial_state) check("initial_state", p.h0, r.dh0);
  }
}

// ----------------------------------------------------------------------------------------------
// Kernels, per backend.

KMAMBA_BACKEND_TEST_SUITE(SelectiveScan);

TYPED_TEST(SelectiveScan, ForwardAndBackwardMatchReferenceSweep) {
  using Exec = TypeParam;
  // Options: none; all; D + bias + softplus + initial state; z + dlast + bias without softplus.
  struct Options {
    bool D, z, bias, softplus, initial_state, dlast;
  };
  const Options option_sets[] = {{false, false, false, false, false, false},
                                 {true, true, true, true, true, true},
                                 {true, false, true, true, true, false},
                                 {false, true, true, false, false, true}};
  const int chunk = 4;
  std::uint64_t seed = 1000;
  for (int seqlen : {1, chunk - 1, chunk, 3 * chunk + 2}) {
    for (int ngroups : {1, 2}) {
      for (const Options& o : option_sets) {
        for (bool packed : {false, true}) {
          Config c;
          c.batch = 2;
          c.dim = 20;  // 20 / ngroups channels per group: several teams per group
          c.seqlen = seqlen;
          c.dstate = 5;
          c.ngroups = ngroups;
          c.chunk = chunk;
          c.D = o.D;
          c.z = o.z;
          c.bias = o.bias;
          c.softplus = o.softplus;
          c.initial_state = o.initial_state;
          c.dlast = o.dlast;
          c.packed = packed;
          if (c.softplus) {
            c.delta_lo = -2.5f;
            c.delta_hi = 0.5f;
          }
          c.seed = ++seed;
          check_against_reference<Exec>(c, 1e-5);
        }
      }
    }
  }
}

// The sequences of the walk forms' sweeps: one token, one tile and the tokens either side of a
// tile boundary, and several tiles (host tiles of 64 tokens forward, 32 backward; Cuda the same).
std::vector<int> walk_form_lengths(int chunk) { return {1, chunk - 1, chunk, chunk + 1, 2 * chunk + 37}; }

// Every option set through the walk forms (dstate within their bound, kmamba's chunk): 72
// channels per group, so that the teams' channel blocks (Cuda: 32 channels at dstate 16, 64 at
// dstate 5) leave a partial block and dB, dC are summed over several blocks. The bound is that of
// the long sequence (2e-5): the recurrence runs over up to 2·tile + 37 tokens, and the sums over
// states, channels and tokens are grouped otherwise than in the reference.
TYPED_TEST(SelectiveScan, WalkFormMatchesReferenceSweep) {
  using Exec = TypeParam;
  using Shapes = kmamba::impl::SelectiveScanDefaultShapes<Exec>;
  std::vector<int> lengths = walk_form_lengths(Shapes::forward::tile);
  for (const int seqlen : walk_form_lengths(Shapes::backward::tile)) lengths.push_back(seqlen);
  std::uint64_t seed = 1500;
  for (const int seqlen : lengths) {
    for (const int dstate : {5, kmamba::impl::selective_scan_walk_states}) {
      for (const int ngroups : {1, 2}) {
        Config c;
        c.batch = 2;
        c.dim = 72 * ngroups;
        c.seqlen = seqlen;
        c.dstate = dstate;
        c.ngroups = ngroups;
        c.chunk = 0;
        const bool all = (seqlen + dstate + ngroups) % 2 == 0;
        c.D = c.z = c.initial_state = c.dlast = all;
        c.bias = c.softplus = true;
        c.packed = !all;
        c.delta_lo = -3.0f;
        c.delta_hi = 0.5f;
        c.seed = ++seed;
        check_against_reference<Exec>(c, 2e-5);
      }
    }
  }
}

// The walk forms with the team shapes a host backend does not run by itself: several threads of a
// few tokens each (Cuda's 128 × 4 among them), run in turn by one thread, so that the tiles (the
// backward's last to first), lanes, checkpoints and padding are checked here against the
// reference too. dstate 3, 7 and 16 give the walk 1, 2 and 4 lanes a channel.
template <class WalkShape, class Shape>
struct WalkShapeOps {
  template <class Exec, class Args, class Out, class Dout, class Grads>
  void operator()(const Exec& exec, const Args& args, const Out& out, const Out& last, const Dout& dout,
                  const Dout& dlast, const Grads& grads) const {
    const kmamba::impl::SelectiveScanDims dims{
        static_cast<std::int64_t>(args.u.extent(0)), static_cast<std::int64_t>(args.u.extent(1)),
        static_cast<std::int64_t>(args.u.extent(2)), static_cast<std::int64_t>(args.A.extent(1)),
        static_cast<std::int64_t>(args.B.extent(1))};
    kmamba::impl::selective_scan_forward_impl<WalkShape>(exec, "test", dims, args, out, last);
    using Const = kmamba::ConstTensor3<float, typename Exec::memory_space>;
    kmamba::impl::selective_scan_backward_impl<WalkShape, Shape>(exec, "test", dims, args, Const(dout), Const(dlast),
                                                                 grads);
  }
};

template <class WalkShape, class Shape>
void check_walk_shape() {
  using Host = Kokkos::DefaultHostExecutionSpace;
  std::uint64_t seed = 1700;
  std::vector<int> lengths = walk_form_lengths(Shape::tile);
  for (const int seqlen : walk_form_lengths(WalkShape::tile)) lengths.push_back(seqlen);
  for (const int seqlen : lengths) {
    for (const int dstate : {3, 7, 16}) {
      const bool all = (seqlen + dstate) % 2 == 0;
      Config c;
      c.batch = 2;
      c.dim = 36;
      c.seqlen = seqlen;
      c.dstate = dstate;
      c.ngroups = 2;
      c.chunk = 0;
      c.D = c.z = c.initial_state = c.dlast = all;
      c.bias = c.softplus = true;
      c.packed = !all;
      c.delta_lo = -3.0f;
      c.delta_hi = 0.5f;
      c.seed = ++seed;
      SCOPED_TRACE("walk threads " + std::to_string(WalkShape::threads) + " items " + std::to_string(WalkShape::items) +
                   " steps " + std::to_string(WalkShape::steps) + "; backward threads " +
                   std::to_string(Shape::threads) + " items " + std::to_string(Shape::items) + " steps " +
                   std::to_string(Shape::steps));
      check_against_reference<Host>(c, 2e-5, WalkShapeOps<WalkShape, Shape>());
    }
  }
}

TEST(SelectiveScanWalkShapes, ThreadsRunInTurnMatchReference) {
  using kmamba::impl::SelectiveScanWalkShape;
  check_walk_shape<SelectiveScanWalkShape<8, 4, 2, false>, SelectiveScanWalkShape<8, 4, 4, false>>();
  check_walk_shape<SelectiveScanWalkShape<5, 3, 5, false>, SelectiveScanWalkShape<5, 3, 2, false>>();
  check_walk_shape<SelectiveScanWalkShape<32, 1, 3, false>, SelectiveScanWalkShape<32, 1, 3, false>>();
  // Cuda's shapes, run in turn.
  check_walk_shape<SelectiveScanWalkShape<128, 4, 16, false>, SelectiveScanWalkShape<128, 4, 8, false>>();
}

TYPED_TEST(SelectiveScan, SoftplusBeyondThresholdMatchesReference) {
  using Exec = TypeParam;
  Config c;
  c.batch = 2;
  c.dim = 6;
  c.seqlen = 11;
  c.dstate = 4;
  c.ngroups = 2;
  c.chunk = 4;
  c.D = c.z = c.bias = c.softplus = c.initial_state = c.dlast = true;
  c.delta_lo = 15.0f;
  c.delta_hi = 25.0f;
  c.seed = 2001;
  check_against_reference<Exec>(c, 1e-5);
}

TYPED_TEST(SelectiveScan, LongSequenceWithChosenChunkMatchesReference) {
  using Exec = TypeParam;
  for (int chunk : {0, 7}) {
    Config c;
    c.batch = 3;
    c.dim = 24;
    c.seqlen = 300;
    c.packed = chunk == 7;
    c.dstate = 16;
    c.ngroups = 2;
    c.chunk = chunk;
    c.D = c.z = c.bias = c.softplus = c.initial_state = c.dlast = true;
    c.delta_lo = -4.0f;
    c.delta_hi = -1.0f;
    c.seed = 3001 + static_cast<std::uint64_t>(chunk);
    check_against_reference<Exec>(c, 2e-5);
  }
}

// dstate above what the forward keeps in registers: the forward takes the vector-lane form, with
// and without a chunk of the caller's choosing; a state count just below the register bound too.
TYPED_TEST(SelectiveScan, WideAndRegisterBoundStatesMatchReference) {
  using Exec = TypeParam;
  std::uint64_t seed = 4000;
  for (int dstate : {kmamba::impl::selective_scan_walk_states - 1, kmamba::impl::selective_scan_walk_states + 1, 40}) {
    for (int chunk : {0, 5}) {
      Config c;
      c.batch = 2;
      c.dim = 140;  // per group, more channels than one register-form team takes
      c.seqlen = 23;
      c.dstate = dstate;
      c.ngroups = 2;
      c.chunk = chunk;
      c.D = c.z = c.bias = c.softplus = c.initial_state = c.dlast = true;
      c.delta_lo = -3.0f;
      c.delta_hi = 0.0f;
      c.packed = chunk == 5;
      c.seed = ++seed;
      check_against_reference<Exec>(c, 2e-5);
    }
  }
}

// dB and dC sum the channel blocks of a group (the walk form at dstate 16: 3 blocks of 32 channels
// on Cuda, 24 of 4 on host backends; the lane form at 24): on a parallel backend, runs of the
// backward write the same bits however their threads are timed.
TYPED_TEST(SelectiveScan, BackwardRepeatsBitForBit) {
  using Exec = TypeParam;
  for (int dstate : {16, 24}) {
    Config c;
    c.batch = 2;
    c.dim = 96;
    c.seqlen = 64;
    c.dstate = dstate;
    c.chunk = 0;
    c.D = c.z = c.bias = c.softplus = c.initial_state = c.dlast = true;
    c.delta_lo = -3.0f;
    c.delta_hi = 0.0f;
    c.seed = 5001 + static_cast<std::uint64_t>(dstate);
    SCOPED_TRACE(c.describe());
    const ScanProblem<Exec> p(c);
    const auto first = run_kernel(p);
    const std::vector<float> dB = host_floats(first.grads.dB), dC = host_floats(first.grads.dC);
    const std::vector<float> du = host_floats(first.grads.du), dA = host_floats(first.grads.dA);
    for (int run = 1; run < 10; ++run) {
      const auto again = run_kernel(p);
      expect_same_bits("dB, run " + std::to_string(run), again.grads.dB, dB);
      expect_same_bits("dC, run " + std::to_string(run), again.grads.dC, dC);
      expect_same_bits("du, run " + std::to_string(run), again.grads.du, du);
      expect_same_bits("dA, run " + std::to_string(run), again.grads.dA, dA);
    }
  }
}

// Copies the token t of src (batch, x, seqlen) / (batch, g, n, seqlen) into a contiguous tensor.
template <class Dst, class Src>
void copy_token(const Dst& dst, const Src& src, int t) {
  Kokkos::deep_copy(dst, Kokkos::subview(src, Kokkos::ALL, Kokkos::ALL, t));
}
template <class Dst, class Src>
void copy_token4(const Dst& dst, const Src& src, int t) {
  Kokkos::deep_copy(dst, Kokkos::subview(src, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL, t));
}

TYPED_TEST(SelectiveScan, ChunkedScanEqualsDecodeSteps) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using kmamba::allocate_uninitialized;
  Config c;
  c.batch = 2;
  c.dim = 10;
  c.seqlen = 9;
  c.dstate = 6;
  c.ngroups = 2;
  c.chunk = 4;
  c.D = c.z = c.bias = c.softplus = c.initial_state = true;
  c.delta_lo = -2.0f;
  c.delta_hi = 1.0f;
  c.seed = 4001;
  const ScanProblem<Exec> p(c);
  auto out = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::out", c.batch, c.dim, c.seqlen);
  auto last = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::last", c.batch, c.dim, c.dstate);
  poison(out);
  poison(last);
  kmamba::selective_scan_forward(Exec(), p.args(), out, last);

  auto state = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::state", c.batch, c.dim, c.dstate);
  Kokkos::deep_copy(state, p.h0);
  auto u = allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::u_t", c.batch, c.dim);
  auto delta = allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::delta_t", c.batch, c.dim);
  auto z = allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::z_t", c.batch, c.dim);
  auto B = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::B_t", c.batch, c.ngroups, c.dstate);
  auto C = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::C_t", c.batch, c.ngroups, c.dstate);
  auto y = allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::y_t", c.batch, c.dim);
  kmamba::SelectiveScanStepArgs<Mem> step;
  step.u = u;
  step.delta = delta;
  step.A = p.A;
  step.B = B;
  step.C = C;
  step.D = p.D;
  step.z = z;
  step.delta_bias = p.bias;
  step.delta_softplus = true;
  const auto scan_out = kmamba::test::to_host(out);
  for (int t = 0; t < c.seqlen; ++t) {
    copy_token(u, p.u, t);
    copy_token(delta, p.delta, t);
    copy_token(z, p.z, t);
    copy_token4(B, p.B, t);
    copy_token4(C, p.C, t);
    poison(y);
    kmamba::selective_scan_step(Exec(), step, state, y);
    Exec().fence();
    const auto yh = kmamba::test::to_host(y);
    double max_ref = 0.0, max_err = 0.0;
    for (int b = 0; b < c.batch; ++b)
      for (int d = 0; d < c.dim; ++d) {
        ASSERT_TRUE(std::isfinite(yh(b, d)));
        max_ref = std::max(max_ref, std::abs(double(scan_out(b, d, t))));
        max_err = std::max(max_err, std::abs(double(yh(b, d)) - scan_out(b, d, t)));
      }
    EXPECT_LE(max_err, 1e-6 * max_ref) << "token " << t;
  }
  const auto sh = kmamba::test::to_host(state);
  const auto lh = kmamba::test::to_host(last);
  for (int b = 0; b < c.batch; ++b)
    for (int d = 0; d < c.dim; ++d)
      for (int n = 0; n < c.dstate; ++n) {
        EXPECT_NEAR(sh(b, d, n), lh(b, d, n), 1e-6 * (1.0 + std::abs(lh(b, d, n)))) << b << " " << d << " " << n;
      }
}

// The tokens [t0, t0 + len) of a (batch, x, seqlen) or (batch, g, n, seqlen) tensor, contiguous.
template <class Mem>
kmamba::Tensor3<float, Mem> slice3(const kmamba::Tensor3<float, Mem>& src, int t0, int len) {
  auto dst = kmamba::allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::slice", src.extent(0),
                                                                         src.extent(1), len);
  Kokkos::deep_copy(dst, Kokkos::subview(src, Kokkos::ALL, Kokkos::ALL, std::make_pair(t0, t0 + len)));
  return dst;
}
template <class Mem>
kmamba::Tensor4<float, Mem> slice4(const kmamba::Tensor4<float, Mem>& src, int t0, int len) {
  auto dst = kmamba::allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::test::slice", src.extent(0),
                                                                         src.extent(1), src.extent(2), len);
  Kokkos::deep_copy(dst, Kokkos::subview(src, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL, std::make_pair(t0, t0 + len)));
  return dst;
}

// Compares a token range of a one-pass result with a segment's result (host mirrors).
template <class HostWhole, class HostPart>
void expect_segment(const char* what, const HostWhole& whole, const HostPart& part, int t0, double tol) {
  double max_ref = 0.0, max_err = 0.0;
  const std::size_t rows = part.size() / part.extent(part.rank - 1);
  const std::size_t len = part.extent(part.rank - 1), full = whole.extent(whole.rank - 1);
  for (std::size_t r = 0; r < rows; ++r)
    for (std::size_t t = 0; t < len; ++t) {
      const double w = whole.data()[r * full + t0 + t];
      const double s = part.data()[r * len + t];
      ASSERT_TRUE(std::isfinite(s)) << what;
      max_ref = std::max(max_ref, std::abs(w));
      max_err = std::max(max_err, std::abs(w - s));
    }
  EXPECT_LE(max_err, tol * max_ref) << what << " tokens from " << t0;
}

TYPED_TEST(SelectiveScan, SegmentsChainedThroughStatesEqualOnePass) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using kmamba::allocate_uninitialized;
  Config c;
  c.batch = 2;
  c.dim = 6;
  c.seqlen = 13;
  c.dstate = 4;
  c.ngroups = 2;
  c.chunk = 4;
  c.D = c.z = c.bias = c.softplus = c.initial_state = c.dlast = true;
  c.delta_lo = -2.0f;
  c.delta_hi = 1.0f;
  c.seed = 5001;
  const int split = 6;
  const ScanProblem<Exec> p(c);
  const auto whole = run_kernel(p);

  // Segment problems: same parameters, the tokens of each segment.
  auto segment = [&](int t0, int len) {
    ScanProblem<Exec> s = p;
    s.cfg.seqlen = len;
    s.u = slice3(p.u, t0, len);
    s.delta = slice3(p.delta, t0, len);
    s.z = slice3(p.z, t0, len);
    s.dout = slice3(p.dout, t0, len);
    s.B = slice4(p.B, t0, len);
    s.C = slice4(p.C, t0, len);
    return s;
  };
  ScanProblem<Exec> first = segment(0, split);
  ScanProblem<Exec> second = segment(split, c.seqlen - split);
  // Forward: the final state of the first segment is the initial state of the second.
  first.dlast = kmamba::Tensor3<float, Mem>();
  first.cfg.dlast = false;
  auto out1 = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::out1", c.batch, c.dim, split);
  auto last1 = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::last1", c.batch, c.dim, c.dstate);
  poison(out1);
  poison(last1);
  kmamba::selective_scan_forward(Exec(), first.args(), out1, last1);
  second.h0 = last1;
  const auto o2 = run_kernel(second);
  // Backward: d(initial state) of the second segment is d(last state) of the first.
  first.dlast = o2.grads.dinitial_state;
  first.cfg.dlast = true;
  const auto o1 = run_kernel(first);

  const auto w_out = kmamba::test::to_host(whole.out);
  expect_segment("out", w_out, kmamba::test::to_host(o1.out), 0, 1e-6);
  expect_segment("out", w_out, kmamba::test::to_host(o2.out), split, 1e-6);
  expect_segment("last_state", kmamba::test::to_host(whole.last), kmamba::test::to_host(o2.last), 0, 1e-6);
  const double tol = 1e-5;  // the backward sums differ in order between one pass and two segments
  const auto w_du = kmamba::test::to_host(whole.grads.du);
  expect_segment("du", w_du, kmamba::test::to_host(o1.grads.du), 0, tol);
  expect_segment("du", w_du, kmamba::test::to_host(o2.grads.du), split, tol);
  const auto w_dd = kmamba::test::to_host(whole.grads.ddelta);
  expect_segment("ddelta", w_dd, kmamba::test::to_host(o1.grads.ddelta), 0, tol);
  expect_segment("ddelta", w_dd, kmamba::test::to_host(o2.grads.ddelta), split, tol);
  const auto w_dz = kmamba::test::to_host(whole.grads.dz);
  expect_segment("dz", w_dz, kmamba::test::to_host(o1.grads.dz), 0, tol);
  expect_segment("dz", w_dz, kmamba::test::to_host(o2.grads.dz), split, tol);
  const auto w_dB = kmamba::test::to_host(whole.grads.dB);
  expect_segment("dB", w_dB, kmamba::test::to_host(o1.grads.dB), 0, tol);
  expect_segment("dB", w_dB, kmamba::test::to_host(o2.grads.dB), split, tol);
  const auto w_dC = kmamba::test::to_host(whole.grads.dC);
  expect_segment("dC", w_dC, kmamba::test::to_host(o1.grads.dC), 0, tol);
  expect_segment("dC", w_dC, kmamba::test::to_host(o2.grads.dC), split, tol);
  expect_segment("dinitial_state", kmamba::test::to_host(whole.grads.dinitial_state),
                 kmamba::test::to_host(o1.grads.dinitial_state), 0, tol);
  // Parameter gradients add up over the segments.
  const auto wA = kmamba::test::to_host(whole.grads.dA);
  const auto a1 = kmamba::test::to_host(o1.grads.dA);
  const auto a2 = kmamba::test::to_host(o2.grads.dA);
  for (std::size_t i = 0; i < wA.size(); ++i) {
    EXPECT_NEAR(a1.data()[i] + a2.data()[i], wA.data()[i], tol * (1.0 + std::abs(wA.data()[i]))) << "dA " << i;
  }
  const auto wD = kmamba::test::to_host(whole.grads.dD);
  const auto d1 = kmamba::test::to_host(o1.grads.dD);
  const auto d2 = kmamba::test::to_host(o2.grads.dD);
  const auto wb = kmamba::test::to_host(whole.grads.ddelta_bias);
  const auto b1 = kmamba::test::to_host(o1.grads.ddelta_bias);
  const auto b2 = kmamba::test::to_host(o2.grads.ddelta_bias);
  for (int d = 0; d < c.dim; ++d) {
    EXPECT_NEAR(d1(d) + d2(d), wD(d), tol * (1.0 + std::abs(wD(d)))) << "dD " << d;
    EXPECT_NEAR(b1(d) + b2(d), wb(d), tol * (1.0 + std::abs(wb(d)))) << "ddelta_bias " << d;
  }
}

// Tokens [t0, t0 + len) of batch row b of a (batch, x, seqlen) or (batch, g, n, seqlen) tensor, as
// a new tensor of batch 1.
template <class Mem>
kmamba::Tensor3<float, Mem> row_slice3(const kmamba::Tensor3<float, Mem>& src, int b, int t0, int len) {
  return slice3(kmamba::Tensor3<float, Mem>(Kokkos::subview(src, std::make_pair(b, b + 1), Kokkos::ALL, Kokkos::ALL)),
                t0, len);
}
template <class Mem>
kmamba::Tensor4<float, Mem> row_slice4(const kmamba::Tensor4<float, Mem>& src, int b, int t0, int len) {
  return slice4(kmamba::Tensor4<float, Mem>(
                    Kokkos::subview(src, std::make_pair(b, b + 1), Kokkos::ALL, Kokkos::ALL, Kokkos::ALL)),
                t0, len);
}

// A packed batch equals its documents run one by one (outputs, last state, every gradient): the
// first document of a row with the row's initial state, the others from a zero state, the last
// with the row's dlast_state; the parameter gradients add up over the documents. Register and
// lane forms, documents across chunk boundaries.
TYPED_TEST(SelectiveScan, PackedBatchEqualsDocumentsAlone) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  for (int dstate : {4, kmamba::impl::selective_scan_walk_states + 3}) {
    Config c;
    c.batch = 3;
    c.dim = 6;
    c.seqlen = 41;
    c.dstate = dstate;
    c.ngroups = 2;
    c.chunk = 5;
    c.D = c.z = c.bias = c.softplus = c.initial_state = c.dlast = c.packed = true;
    c.delta_lo = -2.0f;
    c.delta_hi = 1.0f;
    c.seed = 5501 + static_cast<std::uint64_t>(dstate);
    SCOPED_TRACE(c.describe());
    const ScanProblem<Exec> p(c);
    const auto whole = run_kernel(p);
    const auto w_out = to_host(whole.out), w_last = to_host(whole.last);
    const auto w_du = to_host(whole.grads.du), w_dd = to_host(whole.grads.ddelta), w_dz = to_host(whole.grads.dz);
    const auto w_dB = to_host(whole.grads.dB), w_dC = to_host(whole.grads.dC);
    const auto w_dh0 = to_host(whole.grads.dinitial_state);
    std::vector<double> dA(static_cast<std::size_t>(c.dim) * c.dstate, 0.0), dD(c.dim, 0.0), dbias(c.dim, 0.0);
    const std::vector<std::int64_t> ids = packed_ids(c.batch, c.seqlen);
    for (int b = 0; b < c.batch; ++b) {
      const auto docs = documents(ids, c.seqlen, b);
      for (std::size_t i = 0; i < docs.size(); ++i) {
        const int t0 = docs[i].first, len = docs[i].second - docs[i].first;
        const bool first = i == 0, last = i + 1 == docs.size();
        SCOPED_TRACE("row " + std::to_string(b) + " document from " + std::to_string(t0));
        ScanProblem<Exec> doc = p;
        doc.cfg.batch = 1;
        doc.cfg.seqlen = len;
        doc.cfg.packed = false;
        doc.seq = kmamba::Tensor2<std::int64_t, Mem>();
        doc.u = row_slice3(p.u, b, t0, len);
        doc.delta = row_slice3(p.delta, b, t0, len);
        doc.z = row_slice3(p.z, b, t0, len);
        doc.dout = row_slice3(p.dout, b, t0, len);
        doc.B = row_slice4(p.B, b, t0, len);
        doc.C = row_slice4(p.C, b, t0, len);
        doc.cfg.initial_state = first;
        doc.h0 = first ? row_slice3(p.h0, b, 0, c.dstate) : kmamba::Tensor3<float, Mem>();
        doc.cfg.dlast = last;
        doc.dlast = last ? row_slice3(p.dlast, b, 0, c.dstate) : kmamba::Tensor3<float, Mem>();
        const auto o = run_kernel(doc);
        auto row3 = [&](const auto& host) { return Kokkos::subview(host, b, Kokkos::ALL, Kokkos::ALL); };
        auto row4 = [&](const auto& host) { return Kokkos::subview(host, b, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL); };
        auto one3 = [&](const kmamba::Tensor3<float, Mem>& v) {
          return Kokkos::subview(to_host(v), 0, Kokkos::ALL, Kokkos::ALL);
        };
        auto one4 = [&](const kmamba::Tensor4<float, Mem>& v) {
          return Kokkos::subview(to_host(v), 0, Kokkos::ALL, Kokkos::ALL, Kokkos::ALL);
        };
        expect_segment("out", row3(w_out), one3(o.out), t0, 1e-6);
        if (last) expect_segment("last_state", row3(w_last), one3(o.last), 0, 1e-6);
        expect_segment("du", row3(w_du), one3(o.grads.du), t0, 1e-6);
        expect_segment("ddelta", row3(w_dd), one3(o.grads.ddelta), t0, 1e-6);
        expect_segment("dz", row3(w_dz), one3(o.grads.dz), t0, 1e-6);
        expect_segment("dB", row4(w_dB), one4(o.grads.dB), t0, 1e-6);
        expect_segment("dC", row4(w_dC), one4(o.grads.dC), t0, 1e-6);
        if (first) expect_segment("dinitial_state", row3(w_dh0), one3(o.grads.dinitial_state), 0, 1e-6);
        const std::vector<double> a = host_doubles(o.grads.dA), d = host_doubles(o.grads.dD),
                                  db = host_doubles(o.grads.ddelta_bias);
        for (std::size_t k = 0; k < dA.size(); ++k) dA[k] += a[k];
        for (std::size_t k = 0; k < dD.size(); ++k) {
          dD[k] += d[k];
          dbias[k] += db[k];
        }
      }
    }
    expect_close("dA", whole.grads.dA, dA, 1e-5, c.describe());
    expect_close("dD", whole.grads.dD, dD, 1e-5, c.describe());
    expect_close("ddelta_bias", whole.grads.ddelta_bias, dbias, 1e-5, c.describe());
  }
}

TYPED_TEST(SelectiveScan, RejectsWrongShapes) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using kmamba::allocate;
  Config c;
  c.batch = 2;
  c.dim = 4;
  c.seqlen = 7;
  c.dstate = 3;
  c.ngroups = 2;
  c.z = c.D = true;
  const ScanProblem<Exec> p(c);
  auto out = allocate<kmamba::Tensor3<float, Mem>>("kmamba::test::out", 2, 4, 7);
  auto last = allocate<kmamba::Tensor3<float, Mem>>("kmamba::test::last", 2, 4, 3);
  const Exec exec;

  auto bad_delta = allocate<kmamba::Tensor3<float, Mem>>("kmamba::test::bad", 2, 4, 8);
  auto args = p.args();
  args.delta = bad_delta;
  expect_user_error([&] { kmamba::selective_scan_forward(exec, args, out, last); },
                    {"kmamba::selective_scan_forward", "delta", "(2, 4, 8)", "(2, 4, 7)", "(batch, dim, seqlen)"});

  auto bad_B = allocate<kmamba::Tensor4<float, Mem>>("kmamba::test::bad", 2, 2, 4, 7);
  args = p.args();
  args.B = bad_B;
  expect_user_error([&] { kmamba::selective_scan_forward(exec, args, out, last); },
                    {"B", "(2, 2, 4, 7)", "(2, 2, 3, 7)", "(batch, ngroups, dstate, seqlen)"});

  auto three_groups = allocate<kmamba::Tensor4<float, Mem>>("kmamba::test::bad", 2, 3, 3, 7);
  args = p.args();
  args.B = three_groups;
  args.C = three_groups;
  expect_user_error([&] { kmamba::selective_scan_forward(exec, args, out, last); }, {"(2, 3, 3, 7)", "ngroups = 3"});

  auto bad_D = allocate<kmamba::Tensor1<float, Mem>>("kmamba::test::bad", 5);
  args = p.args();
  args.D = bad_D;
  expect_user_error([&] { kmamba::selective_scan_forward(exec, args, out, last); }, {"D", "(5,)", "(4,)"});

  args = p.args();
  args.seq_idx = allocate<kmamba::Tensor2<std::int64_t, Mem>>("kmamba::test::bad", 2, 6);
  expect_user_error([&] { kmamba::selective_scan_forward(exec, args, out, last); },
                    {"seq_idx", "(2, 6)", "(2, 7)", "(batch, seqlen)"});

  auto bad_last = allocate<kmamba::Tensor3<float, Mem>>("kmamba::test::bad", 2, 4, 4);
  expect_user_error([&] { kmamba::selective_scan_forward(exec, p.args(), out, bad_last); },
                    {"last_state", "(2, 4, 4)", "(2, 4, 3)", "(batch, dim, dstate)"});

  // Backward: a wrong gradient shape, and dz without z.
  const auto o = run_kernel(p);
  auto grads = o.grads;
  grads.dA = allocate<kmamba::Tensor2<float, Mem>>("kmamba::test::bad", 4, 5);
  expect_user_error([&] { kmamba::selective_scan_backward(exec, p.args(), p.dout, p.dlast, grads); },
                    {"kmamba::selective_scan_backward", "dA", "(4, 5)", "(4, 3)", "(dim, dstate)"});
  grads = o.grads;
  args = p.args();
  args.z = kmamba::ConstTensor3<float, Mem>();
  expect_user_error([&] { kmamba::selective_scan_backward(exec, args, p.dout, p.dlast, grads); }, {"dz"});

  // Step: state of the wrong dstate.
  kmamba::SelectiveScanStepArgs<Mem> step;
  auto u_t = allocate<kmamba::Tensor2<float, Mem>>("kmamba::test::u_t", 2, 4);
  auto bc_t = allocate<kmamba::Tensor3<float, Mem>>("kmamba::test::bc_t", 2, 2, 3);
  step.u = u_t;
  step.delta = u_t;
  step.A = p.A;
  step.B = bc_t;
  step.C = bc_t;
  auto y_t = allocate<kmamba::Tensor2<float, Mem>>("kmamba::test::y_t", 2, 4);
  auto bad_state = allocate<kmamba::Tensor3<float, Mem>>("kmamba::test::bad", 2, 4, 5);
  expect_user_error([&] { kmamba::selective_scan_step(exec, step, bad_state, y_t); },
                    {"kmamba::selective_scan_step", "state", "(2, 4, 5)", "(2, 4, 3)"});

  // A chunk the team scratch memory cannot hold.
  args = p.args();
  args.chunk_size = 1 << 20;
  expect_user_error([&] { kmamba::selective_scan_forward(exec, args, out, last); }, {"chunk_size", "scratch"});
}

// ‖kernel − ref‖₂ ≤ tol·‖ref‖₂ for a golden tensor.
template <class View>
void expect_golden(const std::string& what, const View& kernel, const std::vector<float>& ref, double tol,
                   const std::string& context) {
  const std::vector<double> k = host_doubles(kernel);
  ASSERT_EQ(k.size(), ref.size()) << what;
  double err = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < k.size(); ++i) {
    ASSERT_TRUE(std::isfinite(k[i])) << what << "[" << i << "] " << context;
    err += (k[i] - ref[i]) * (k[i] - ref[i]);
    norm += double(ref[i]) * ref[i];
  }
  EXPECT_LE(std::sqrt(err), tol * std::sqrt(norm))
      << what << ": ‖Δ‖ = " << std::sqrt(err) << ", ‖ref‖ = " << std::sqrt(norm) << " " << context;
}

TYPED_TEST(SelectiveScan, MatchesGoldenSelectiveScanSmall) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using kmamba::allocate_uninitialized;
  const kmamba::test::SafeTensorsFile file(kmamba::test::golden_dir() + "/selective_scan_small.safetensors");
  ASSERT_NE(file.metadata("config").find("\"delta_softplus\": true"), std::string::npos) << file.metadata("config");
  kmamba::SelectiveScanArgs<Mem> args;
  args.u = file.to_device<kmamba::Tensor3<float, Mem>>("u");
  args.delta = file.to_device<kmamba::Tensor3<float, Mem>>("delta");
  args.A = file.to_device<kmamba::Tensor2<float, Mem>>("A");
  args.B = file.to_device<kmamba::Tensor4<float, Mem>>("B");
  args.C = file.to_device<kmamba::Tensor4<float, Mem>>("C");
  args.D = file.to_device<kmamba::Tensor1<float, Mem>>("D");
  args.z = file.to_device<kmamba::Tensor3<float, Mem>>("z");
  args.delta_bias = file.to_device<kmamba::Tensor1<float, Mem>>("delta_bias");
  args.delta_softplus = true;
  const auto dout = file.to_device<kmamba::Tensor3<float, Mem>>("dout");
  const int batch = static_cast<int>(args.u.extent(0)), dim = static_cast<int>(args.u.extent(1));
  const int seqlen = static_cast<int>(args.u.extent(2)), dstate = static_cast<int>(args.A.extent(1));
  const int ngroups = static_cast<int>(args.B.extent(1));
  for (int chunk : {0, 8}) {  // 0: kmamba chooses; 8: four chunks + 5 tokens
    args.chunk_size = chunk;
    const std::string ctx = "chunk_size " + std::to_string(chunk);
    auto out = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::out", batch, dim, seqlen);
    auto last = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::last", batch, dim, dstate);
    kmamba::SelectiveScanGrads<Mem> g;
    g.du = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::du", batch, dim, seqlen);
    g.ddelta = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::ddelta", batch, dim, seqlen);
    g.dz = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::dz", batch, dim, seqlen);
    g.dA = allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::dA", dim, dstate);
    g.dB = allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::test::dB", batch, ngroups, dstate, seqlen);
    g.dC = allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::test::dC", batch, ngroups, dstate, seqlen);
    g.dD = allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::dD", dim);
    g.ddelta_bias = allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::ddelta_bias", dim);
    for (auto* v : {&out, &last, &g.du, &g.ddelta, &g.dz}) poison(*v);
    for (auto* v : {&g.dB, &g.dC}) poison(*v);
    for (auto* v : {&g.dD, &g.ddelta_bias}) poison(*v);
    poison(g.dA);
    const Exec exec;
    kmamba::selective_scan_forward(exec, args, out, last);
    kmamba::selective_scan_backward(exec, args, dout, kmamba::ConstTensor3<float, Mem>(), g);
    exec.fence();
    const double tol = 1e-3;
    expect_golden("out", out, file.floats("out"), tol, ctx);
    expect_golden("last_state", last, file.floats("last_state"), tol, ctx);
    expect_golden("grad.u", g.du, file.floats("grad.u"), tol, ctx);
    expect_golden("grad.delta", g.ddelta, file.floats("grad.delta"), tol, ctx);
    expect_golden("grad.A", g.dA, file.floats("grad.A"), tol, ctx);
    expect_golden("grad.B", g.dB, file.floats("grad.B"), tol, ctx);
    expect_golden("grad.C", g.dC, file.floats("grad.C"), tol, ctx);
    expect_golden("grad.D", g.dD, file.floats("grad.D"), tol, ctx);
    expect_golden("grad.z", g.dz, file.floats("grad.z"), tol, ctx);
    expect_golden("grad.delta_bias", g.ddelta_bias, file.floats("grad.delta_bias"), tol, ctx);
  }
}

}  // namespace
