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
#include "Checks.hpp"
#include "Mamba3DeviceProblem.hpp"
#include "Mamba3ScanReference.hpp"
#include "PackedIds.hpp"
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

using namespace kmamba::test;

using namespace kmamba::reference::mamba3;

// ----------------------------------------------------------------------------------------------
// The reference against itself: its backward against finite differences of its forward.

// Every gradient of ref_loss against central differences (step 1e-6) of the reference forward.
void expect_finite_differences(RefProblem P) {
  const Config& cfg = P.cfg;
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
      ASSERT_NEAR(fd, analytic[i], 1e-6 * (1.0 + std::fabs(analytic[i]))) << name << "[" << i << "] " << cfg.describe();
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
  for (const Config& cfg : configs) expect_finite_differences(make_reference_problem(cfg));
}

// Packed rows, SISO and MIMO: documents of one and two tokens, one starting at the last token (PackedIds.hpp),
// with initial states (the first document's) and final cotangents (the last one's).
TEST(Mamba3Reference, PackedBackwardMatchesFiniteDifferences) {
  Config c;
  c.batch = 3;
  c.seqlen = 9;
  c.nheads = 2;
  c.headdim = 2;
  c.ngroups = 1;
  c.dstate = 6;
  c.nangles = 2;
  c.D = c.z = c.initial = c.dfinal = true;
  c.seed = 21;
  RefProblem P = make_reference_problem(c);
  P.seq_idx = kmamba::test::packed_ids(c.batch, c.seqlen);
  expect_finite_differences(P);
  c.rank = 2;  // MIMO
  c.seed = 22;
  P = make_reference_problem(c);
  P.seq_idx = kmamba::test::packed_ids(c.batch, c.seqlen);
  expect_finite_differences(P);
}

// ----------------------------------------------------------------------------------------------
// Device side.

// Runs the forward (and, with `backward`, the backward) of the problem's variant and returns every
// result in the reference's layouts. Every output is poisoned before the run.
// A SISO run given `ungated` (allocated) keeps the output before the gate there
// (Mamba3SisoArgs::ungated_out) for its backward.
template <class Exec>
std::pair<RefOutputs, RefGrads> run_kernels(
    const Mamba3DeviceProblem<typename Exec::memory_space>& p, bool backward,
    const kmamba::Tensor4<float, typename Exec::memory_space>& ungated = {}) {  // (batch, seqlen, nheads, headdim)
  using Mem = typename Exec::memory_space;
  using DP = Mamba3DeviceProblem<Mem>;
  const Config& c = p.cfg;
  const int B = c.batch, L = c.seqlen, H = c.nheads, Pd = c.headdim, G = c.ngroups, N = c.dstate, S = c.nangles;
  const int R = c.R();
  const Exec exec;
  RefOutputs o;
  RefGrads g;
  auto out = poisoned<typename DP::T4>("out", B, L, H, Pd);
  if (c.mimo()) {
    kmamba::Mamba3MimoStates<Mem> fin{
        poisoned<typename DP::T3>("final_angle", B, H, S), poisoned<typename DP::T4>("final_ssm", B, H, Pd, N),
        poisoned<typename DP::T4>("final_k", B, H, R, N), poisoned<typename DP::T4>("final_v", B, H, R, Pd)};
    kmamba::mamba3_mimo_forward(exec, p.mimo_args(), out, fin);
    exec.fence();
    o = {host_doubles(out), host_doubles(fin.angle), host_doubles(fin.ssm), host_doubles(fin.k), host_doubles(fin.v)};
    if (!backward) return {o, g};
    kmamba::Mamba3MimoGrads<Mem> d;
    d.dq = poisoned<typename DP::T5>("dq", B, L, R, G, N);
    d.dk = poisoned<typename DP::T5>("dk", B, L, R, G, N);
    d.dq_bias = poisoned<typename DP::T3>("dq_bias", H, R, N);
    d.dk_bias = poisoned<typename DP::T3>("dk_bias", H, R, N);
    d.dmimo_v = poisoned<typename DP::T3>("dmimo_v", H, R, Pd);
    d.dmimo_o = poisoned<typename DP::T3>("dmimo_o", H, R, Pd);
    if (c.z) d.dmimo_z = poisoned<typename DP::T3>("dmimo_z", H, R, Pd);
    d.dv = poisoned<typename DP::T4>("dv", B, L, H, Pd);
    d.dadt = poisoned<typename DP::T3>("dadt", B, H, L);
    d.ddt = poisoned<typename DP::T3>("ddt", B, H, L);
    d.dtrap = poisoned<typename DP::T3>("dtrap", B, H, L);
    d.dangles = poisoned<typename DP::T4>("dangles", B, L, H, S);
    d.dD = poisoned<typename DP::T1>("dD", H);
    if (c.z) d.dz = poisoned<typename DP::T4>("dz", B, L, H, Pd);
    d.dinitial = {poisoned<typename DP::T3>("dangle0", B, H, S), poisoned<typename DP::T4>("dssm0", B, H, Pd, N),
                  poisoned<typename DP::T4>("dk0", B, H, R, N), poisoned<typename DP::T4>("dv0", B, H, R, Pd)};
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
  kmamba::Mamba3SisoStates<Mem> fin{
      poisoned<typename DP::T3>("final_angle", B, H, S), poisoned<typename DP::T4>("final_ssm", B, H, Pd, N),
      poisoned<typename DP::T3>("final_k", B, H, N), poisoned<typename DP::T3>("final_v", B, H, Pd)};
  kmamba::Mamba3SisoArgs<Mem> args = p.siso_args();
  args.ungated_out = ungated;
  kmamba::mamba3_siso_forward(exec, args, out, fin);
  exec.fence();
  o = {host_doubles(out), host_doubles(fin.angle), host_doubles(fin.ssm), host_doubles(fin.k), host_doubles(fin.v)};
  if (!backward) return {o, g};
  kmamba::Mamba3SisoGrads<Mem> d;
  d.dq = poisoned<typename DP::T4>("dq", B, L, G, N);
  d.dk = poisoned<typename DP::T4>("dk", B, L, G, N);
  d.dq_bias = poisoned<typename DP::T2>("dq_bias", H, N);
  d.dk_bias = poisoned<typename DP::T2>("dk_bias", H, N);
  d.dv = poisoned<typename DP::T4>("dv", B, L, H, Pd);
  d.dadt = poisoned<typename DP::T3>("dadt", B, H, L);
  d.ddt = poisoned<typename DP::T3>("ddt", B, H, L);
  d.dtrap = poisoned<typename DP::T3>("dtrap", B, H, L);
  d.dangles = poisoned<typename DP::T4>("dangles", B, L, H, S);
  d.dD = poisoned<typename DP::T1>("dD", H);
  if (c.z) d.dz = poisoned<typename DP::T4>("dz", B, L, H, Pd);
  d.dinitial = {poisoned<typename DP::T3>("dangle0", B, H, S), poisoned<typename DP::T4>("dssm0", B, H, Pd, N),
                poisoned<typename DP::T3>("dk0", B, H, N), poisoned<typename DP::T3>("dv0", B, H, Pd)};
  kmamba::mamba3_siso_backward(exec, args, p.dout, p.siso_dfinal, d);
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
  const Mamba3DeviceProblem<typename Exec::memory_space> p(P);
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

KMAMBA_BACKEND_TEST_SUITE(Mamba3Scan);

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

// The kernels' forward and backward of each problem of `list` on packed rows (PackedIds.hpp)
// against the packed reference.
template <class Exec>
void expect_packed_rows_match_reference(const std::vector<Config>& list) {
  for (const Config& cfg : list) {
    RefProblem P = make_reference_problem(cfg);
    P.seq_idx = kmamba::test::packed_ids(cfg.batch, cfg.seqlen);
    const Mamba3DeviceProblem<typename Exec::memory_space> p(P);
    const auto result = run_kernels<Exec>(p, true);
    compare_outputs(result.first, ref_forward(P), forward_tol, cfg.describe() + " packed");
    compare_grads(result.second, ref_backward(P), gradient_tol, cfg.describe() + " packed");
  }
}

// Packed rows (Mamba3SisoArgs::seq_idx) against the packed reference: documents across chunk
// boundaries, of one token, starting at a row's last token; with every option, the default chunk
// and a bf16 request (which the packed rows compute in fp32: the fused kernels take no ids, so the
// fp32 tolerances apply).
TYPED_TEST(Mamba3Scan, SisoPackedRowsMatchReference) {
  worst() = Worst();
  std::vector<Config> list;
  Config c;
  c.batch = 3;
  c.seqlen = 29;
  c.D = c.z = c.initial = c.dfinal = true;
  c.seed = 31;
  list.push_back(c);
  c.nangles = 4;  // rope_fraction 1.0, one group
  c.ngroups = 1;
  c.chunk = 8;
  c.z = false;
  c.seed = 32;
  list.push_back(c);
  c = Config();
  c.batch = 3;
  c.seqlen = 70;
  c.chunk = 64;
  c.nheads = 2;
  c.headdim = 64;
  c.ngroups = 1;
  c.dstate = 16;
  c.nangles = 4;
  c.D = c.z = c.initial = c.dfinal = true;
  c.precision = kmamba::MatmulPrecision::BFloat16;
  c.seed = 33;
  list.push_back(c);
  expect_packed_rows_match_reference<TypeParam>(list);
  print_worst("SISO kernels vs reference, packed rows");
}

// Packed rows (Mamba3MimoArgs::seq_idx) on the MIMO chunk stages against the packed reference:
// starts at a chunk's first and last token and inside chunks, documents of one token, a start at a
// row's last token, chunks of more rows than a scratch tile (so that the chunk backward's second pass
// recomputes its weights), rank 1 and the default chunk (64 / 4 = 16 tokens).
TYPED_TEST(Mamba3Scan, MimoPackedRowsMatchReference) {
  worst() = Worst();
  std::vector<Config> list;
  Config c;
  c.batch = 3;
  c.rank = 2;
  c.seqlen = 29;
  c.D = c.z = c.initial = c.dfinal = true;
  c.seed = 41;
  list.push_back(c);
  c.rank = 4;  // rope_fraction 1.0, no gate, one group, the default chunk
  c.nangles = 4;
  c.ngroups = 1;
  c.chunk = 0;
  c.z = false;
  c.seed = 42;
  list.push_back(c);
  c.rank = 1;  // rank 1 through the MIMO path
  c.z = true;
  c.nangles = 2;
  c.chunk = 3;
  c.seed = 43;
  list.push_back(c);
  c = Config();
  c.batch = 3;  // chunks of 40 tokens: 80 rows, more than a tile of 32 tokens (64 rows)
  c.rank = 2;
  c.seqlen = 70;
  c.chunk = 40;
  c.nheads = 2;
  c.headdim = 8;
  c.ngroups = 1;
  c.dstate = 16;
  c.D = c.z = c.initial = c.dfinal = true;
  c.seed = 44;
  list.push_back(c);
  expect_packed_rows_match_reference<TypeParam>(list);
  print_worst("MIMO kernels vs reference, packed rows");
}

TYPED_TEST(Mamba3Scan, TensorFloat32SisoMatchesReference) {
  worst() = Worst();
  for (const Config& cfg : in_tensor_float32(siso_sweep())) check_against_reference<TypeParam>(cfg);
  print_worst("SISO kernels (TensorFloat32 chunk products) vs reference");
}

// bf16 (SISO only: the scan runs on the SSD, whose fused kernels take headdim 64 and dstate
// 16/32/64/128): the chunk products round q, k, v, g and the states to bf16, whose unit roundoff
// 2^-8 is 8× TF32's 2^-11, along the same chains of products; so the TF32 bounds scaled by 8:
// 8e-2 of the largest magnitude for outputs and gradients, and the vanishing ∂/∂θ measured against
// 8 × 5e-2 of the largest gradient. The result must also differ from the reference by more than
// fp32 rounding (the bf16 path ran).
constexpr double bf16_tol = 8e-2;
constexpr double bf16_vanishing = 8 * tf32_vanishing;

std::vector<Config> bf16_siso_sweep() {
  std::vector<Config> list;
  Config c;
  c.batch = 2;
  c.seqlen = 150;  // two full chunks and a partial one
  c.chunk = 64;
  c.nheads = 2;
  c.ngroups = 1;
  c.headdim = 64;
  c.dstate = 32;
  c.nangles = 8;
  c.D = c.z = c.initial = c.dfinal = true;
  c.precision = kmamba::MatmulPrecision::BFloat16;
  c.seed = 41;
  list.push_back(c);
  c.batch = 1;  // dstate 128, Mamba-3's shape, no gate nor initial state
  c.seqlen = 64;
  c.dstate = 128;
  c.nangles = 32;
  c.nheads = 2;
  c.ngroups = 2;
  c.z = c.initial = false;
  c.seed = 42;
  list.push_back(c);
  c.seqlen = 100;  // an odd number of angles (a rotated pair and an unrotated one in a float4)
  c.dstate = 64;
  c.nangles = 5;
  c.nheads = 4;
  c.ngroups = 2;
  c.z = true;
  c.seed = 43;
  list.push_back(c);
  return list;
}

TYPED_TEST(Mamba3Scan, Bf16SisoMatchesReference) {
  worst() = Worst();
  for (const Config& cfg : bf16_siso_sweep()) {
    const RefProblem P = make_reference_problem(cfg);
    const Mamba3DeviceProblem<typename TypeParam::memory_space> p(P);
    const auto result = run_kernels<TypeParam>(p, true);
    const RefOutputs ref = ref_forward(P);
    compare_outputs(result.first, ref, bf16_tol, cfg.describe());
    compare_grads(result.second, ref_backward(P), bf16_tol, cfg.describe(), bf16_vanishing);
    double err = 0.0, scale = 0.0;
    for (std::size_t i = 0; i < ref.out.size(); ++i) {
      err = std::max(err, std::fabs(result.first.out[i] - ref.out[i]));
      scale = std::max(scale, std::fabs(ref.out[i]));
    }
    EXPECT_GT(err, 1e-5 * scale) << "the bf16 scan agrees with the reference as closely as fp32: " << cfg.describe();
  }
  print_worst("SISO kernels (bf16 chunk products) vs reference");
}

// With a gate, the output before it kept by the forward (Mamba3SisoArgs::ungated_out) holds y with
// out = y·silu(z), and the backward reading it in place of recomputing the scan gives the
// recomputing backward's gradients: only dz reads y, and the kept and the recomputed y are the
// same fp32 sum up to the contraction of its last addition (one rounding). Fp32 and bf16 products.
TYPED_TEST(Mamba3Scan, KeptUngatedOutputReplacesTheRecompute) {
  using Mem = typename TypeParam::memory_space;
  std::vector<Config> list;
  for (const Config& c : siso_sweep()) {
    if (c.z) list.push_back(c);
  }
  list.push_back(bf16_siso_sweep().front());
  ASSERT_GE(list.size(), 3u);
  for (const Config& cfg : list) {
    ASSERT_TRUE(cfg.z);
    const RefProblem P = make_reference_problem(cfg);
    const Mamba3DeviceProblem<Mem> p(P);
    const std::string ctx = cfg.describe();
    const auto recomputed = run_kernels<TypeParam>(p, true);
    auto ungated = poisoned<kmamba::Tensor4<float, Mem>>("ungated_out", cfg.batch, cfg.seqlen, cfg.nheads, cfg.headdim);
    const auto kept = run_kernels<TypeParam>(p, true, ungated);
    expect_near_rel("out", kept.first.out, recomputed.first.out, 0.0, ctx);
    compare_grads(kept.second, recomputed.second, 1e-6, ctx);
    const std::vector<double> y = host_doubles(ungated), z = host_doubles(p.z);
    std::vector<double> gated(y.size());
    for (std::size_t i = 0; i < y.size(); ++i) gated[i] = y[i] * z[i] / (1.0 + std::exp(-z[i]));
    expect_near_rel("ungated_out·silu(z)", gated, kept.first.out, 1e-6, ctx);
  }
}

// The bf16 forward and backward form each head's rotated q and k inside the fused SSD kernels from
// the shared rows (impl/Mamba3SisoSsd.hpp); where the shared rows cannot be read four floats at a
// time (here: q and k one float past an aligned address) the rotate stage writes per-head rows and
// the SSD reads those. Both paths round the same fp32 rotations to bf16 for the same products and
// differ at most by how the compiler contracts a rotation's two products (an fp32 rounding of an
// operand, 2^-24 relative, carried through bf16 products that keep the error at that order) and by
// q_t·k_t, which the fused kernels sum from the rotated rows and the rotate stage from the biased
// ones (fp32 sums of the same products, 2^-24 relative each): outputs, final states and gradients
// within 1e-5 of the largest.
TYPED_TEST(Mamba3Scan, Bf16SisoSharedRowsMatchPerHeadRows) {
  using Mem = typename TypeParam::memory_space;
  using T4 = kmamba::Tensor4<float, Mem>;
  for (const Config& cfg : bf16_siso_sweep()) {
    const RefProblem P = make_reference_problem(cfg);
    const Mamba3DeviceProblem<Mem> aligned(P);
    Mamba3DeviceProblem<Mem> shifted(P);
    const auto shift = [](const T4& v, const char* label) {
      const Kokkos::View<float*, Mem> buffer(std::string(label), v.size() + 1);
      const T4 view(buffer.data() + 1, v.extent(0), v.extent(1), v.extent(2), v.extent(3));
      Kokkos::deep_copy(view, v);
      return std::make_pair(buffer, view);
    };
    const auto q = shift(aligned.q4, "q_shifted"), k = shift(aligned.k4, "k_shifted");
    shifted.q4 = q.second;
    shifted.k4 = k.second;
    const auto shared = run_kernels<TypeParam>(aligned, true);
    const auto per_head = run_kernels<TypeParam>(shifted, true);
    compare_outputs(shared.first, per_head.first, 1e-5, cfg.describe());
    compare_grads(shared.second, per_head.second, 1e-5, cfg.describe());
  }
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
  const Mamba3DeviceProblem<Mem> p(P);
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
    auto y = poisoned<T3>("y1", B, H, Pd);
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
  const auto whole = run_kernels<Exec>(Mamba3DeviceProblem<Mem>(P), true);

  RefProblem first = slice_problem(P, 0, split), second = slice_problem(P, split, L);
  first.dangle.clear();
  first.dssm.clear();
  first.dk.clear();
  first.dv.clear();
  const auto forward1 = run_kernels<Exec>(Mamba3DeviceProblem<Mem>(first), false).first;
  second.angle0 = forward1.angle;
  second.ssm0 = forward1.ssm;
  second.k0 = forward1.k;
  second.v0 = forward1.v;
  const auto run2 = run_kernels<Exec>(Mamba3DeviceProblem<Mem>(second), true);
  first.dangle = run2.second.dangle0;
  first.dssm = run2.second.dssm0;
  first.dk = run2.second.dk0;
  first.dv = run2.second.dv0;
  const auto run1 = run_kernels<Exec>(Mamba3DeviceProblem<Mem>(first), true);

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
  const Mamba3DeviceProblem<Mem> siso(make_reference_problem(cfg));
  auto out = allocate<T4>("kmamba::test::out", 2, 10, 4, 3);
  const kmamba::Mamba3SisoStates<Mem> no_states;

  kmamba::Mamba3SisoArgs<Mem> a = siso.siso_args();
  a.seq_idx = allocate<kmamba::Tensor2<std::int64_t, Mem>>("kmamba::test::seq_idx", 2, 11);
  expect_user_error([&] { kmamba::mamba3_siso_backward(exec, a, siso.dout, siso.siso_dfinal, {}); },
                    {"kmamba::mamba3_siso_backward", "seq_idx", "(2, 11)", "(2, 10)", "(batch, seqlen)"});
  a = siso.siso_args();
  a.ungated_out = allocate<T4>("kmamba::test::ungated_out", 2, 10, 4, 2);
  expect_user_error([&] { kmamba::mamba3_siso_forward(exec, a, out, no_states); },
                    {"kmamba::mamba3_siso_forward", "ungated_out", "(2, 10, 4, 2)", "(2, 10, 4, 3)",
                     "(batch, seqlen, nheads, headdim)"});
  a = siso.siso_args();
  a.z = T4();
  a.ungated_out = out;
  expect_user_error([&] { kmamba::mamba3_siso_forward(exec, a, out, no_states); },
                    {"kmamba::mamba3_siso_forward", "ungated_out", "without z"});
  a = siso.siso_args();
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
  const Mamba3DeviceProblem<Mem> mimo(make_reference_problem(cfg));
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
  const auto result = run_kernels<Exec>(Mamba3DeviceProblem<typename Exec::memory_space>(P), true);
  expect_golden(file, result.first, result.second, mimo, kernel_golden_tol,
                std::string("kernels vs ") + golden_name(mimo));
}

TYPED_TEST(Mamba3Scan, MatchesGoldenSiso) { check_golden<TypeParam>(false); }

TYPED_TEST(Mamba3Scan, MatchesGoldenMimo) { check_golden<TypeParam>(true); }

}  // namespace
