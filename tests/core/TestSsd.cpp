// Mamba-2 SSD (chunked scan): forward, backward and decode step against a sequential
// double-precision reference written from docs/algorithms.md §2.4, §2.9, §2.10 (token by token, every
// state kept; its backward is the adjoint of that recurrence).
//
// Tolerances:
// - kernel (fp32) against the double reference, per tensor: max|kernel − ref| ≤ tol·max|ref| with
//   tol = 5e-6 for outputs and final states, 2e-5 for gradients (the gradients w.r.t. dt, A,
//   dt_bias and D are sums over many tokens of fp32 products; the largest errors observed on
//   Serial/OpenMP are 5e-7 for outputs and 1.2e-6 for gradients).
// - the same with matmul_precision = TensorFloat32: where the backend has the tensor-core form
//   (Cuda), every per-chunk product takes TF32 operands (relative rounding ≤ 2^-11 each, and the
//   stages chain products: C·Bᵀ, states), so tol = 1e-2 for outputs, final states and gradients.
//   With the host's TeamGemm temporarily rounding its operands as cvt.rna.tf32 does, this sweep
//   gave at most 2.1e-3 (out), 6.8e-4 (final_states), 1.7e-3 (ddt_bias, ddt, dx), 1.2e-3 (dA),
//   ≤ 6.8e-4 (dB, dC, dinitial_states, dz): the tolerance is about 5× that. Elsewhere the
//   TensorFloat32 request computes in fp32 and the fp32 tolerances apply.
// - reference backward against central finite differences of the reference forward (double,
//   step 1e-6): |fd − analytic| ≤ 1e-6·(1 + |analytic|).
// - chunked forward against decode steps, and segment chaining (both fp32, different summation
//   orders): max|Δ| ≤ 1e-5·max|ref|.
// - golden data (ssd_small, ssd_small_noinit; float64 autograd stored as float32):
//   ‖Δ‖₂/‖ref‖₂ ≤ 1e-3 per tensor, as tests/data/golden/README.md suggests.
#include "TestData.hpp"
#include <kmamba/core/Core.hpp>
#include <kmamba/core/Ssd.hpp>

#include "Backends.hpp"
#include "Checks.hpp"
#include "SafeTensorsReader.hpp"
#include "SsdReference.hpp"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace {

using namespace kmamba::reference::ssd;
using namespace kmamba::test;

// ----------------------------------------------------------------------------------------------
// Device side.

template <class Mem>
struct DeviceProblem {
  using T1 = kmamba::Tensor1<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  Config cfg;
  T4 x, B, C, z, h0, dout, dfinal;
  T3 dt, log_decay;
  T1 A, D, bias;
  kmamba::Tensor2<std::int64_t, Mem> seq;

  kmamba::SsdArgs<Mem> args() const {
    kmamba::SsdArgs<Mem> a;
    a.x = x;
    a.dt = dt;
    a.A = A;
    a.B = B;
    a.C = C;
    a.D = D;
    a.z = z;
    a.dt_bias = bias;
    a.initial_states = h0;
    a.seq_idx = seq;
    a.log_decay = log_decay;
    a.dt_softplus = cfg.softplus;
    a.dt_min = cfg.dt_min;
    a.dt_max = cfg.dt_max;
    a.chunk_size = cfg.chunk;
    return a;
  }
};

template <class Exec>
DeviceProblem<typename Exec::memory_space> make_problem(const Config& cfg, RefProblem& ref) {
  using Mem = typename Exec::memory_space;
  using DP = DeviceProblem<Mem>;
  using kmamba::allocate_uninitialized;
  const Exec exec;
  DP p;
  p.cfg = cfg;
  const std::uint64_t s = cfg.seed * 1000;
  p.x = allocate_uninitialized<typename DP::T4>("kmamba::test::x", cfg.batch, cfg.seqlen, cfg.nheads, cfg.headdim);
  p.dt = allocate_uninitialized<typename DP::T3>("kmamba::test::dt", cfg.batch, cfg.seqlen, cfg.nheads);
  if (cfg.log_decay) {
    p.log_decay = allocate_uninitialized<typename DP::T3>("kmamba::test::log_decay", cfg.batch, cfg.seqlen, cfg.nheads);
  } else {
    p.A = allocate_uninitialized<typename DP::T1>("kmamba::test::A", cfg.nheads);
  }
  p.B = allocate_uninitialized<typename DP::T4>("kmamba::test::B", cfg.batch, cfg.seqlen, cfg.ngroups, cfg.dstate);
  p.C = allocate_uninitialized<typename DP::T4>("kmamba::test::C", cfg.batch, cfg.seqlen, cfg.ngroups, cfg.dstate);
  p.dout =
      allocate_uninitialized<typename DP::T4>("kmamba::test::dout", cfg.batch, cfg.seqlen, cfg.nheads, cfg.headdim);
  kmamba::fill_normal(exec, p.x, s + 1, 0.0f, 1.0f);
  if (cfg.softplus) {
    kmamba::fill_uniform(exec, p.dt, s + 2, -2.0f, 0.5f);
  } else {
    kmamba::fill_uniform(exec, p.dt, s + 2, 0.05f, 0.8f);
  }
  if (cfg.log_decay) {
    kmamba::fill_uniform(exec, p.log_decay, s + 3, -1.0f, -0.02f);
  } else {
    kmamba::fill_uniform(exec, p.A, s + 3, -1.5f, -0.2f);
  }
  kmamba::fill_normal(exec, p.B, s + 4, 0.0f, 0.6f);
  kmamba::fill_normal(exec, p.C, s + 5, 0.0f, 0.6f);
  kmamba::fill_normal(exec, p.dout, s + 6, 0.0f, 1.0f);
  if (cfg.D) {
    p.D = allocate_uninitialized<typename DP::T1>("kmamba::test::D", cfg.nheads);
    kmamba::fill_uniform(exec, p.D, s + 7, 0.5f, 1.5f);
  }
  if (cfg.z) {
    p.z = allocate_uninitialized<typename DP::T4>("kmamba::test::z", cfg.batch, cfg.seqlen, cfg.nheads, cfg.headdim);
    kmamba::fill_normal(exec, p.z, s + 8, 0.0f, 1.0f);
  }
  if (cfg.bias) {
    p.bias = allocate_uninitialized<typename DP::T1>("kmamba::test::dt_bias", cfg.nheads);
    kmamba::fill_uniform(exec, p.bias, s + 9, -0.5f, 0.5f);
  }
  if (cfg.initial_states) {
    p.h0 = allocate_uninitialized<typename DP::T4>("kmamba::test::h0", cfg.batch, cfg.nheads, cfg.headdim, cfg.dstate);
    kmamba::fill_normal(exec, p.h0, s + 10, 0.0f, 0.7f);
  }
  if (cfg.dfinal) {
    p.dfinal =
        allocate_uninitialized<typename DP::T4>("kmamba::test::dfinal", cfg.batch, cfg.nheads, cfg.headdim, cfg.dstate);
    kmamba::fill_normal(exec, p.dfinal, s + 11, 0.0f, 1.0f);
  }
  ref = RefProblem();
  ref.cfg = cfg;
  if (cfg.seq_idx) {
    p.seq = kmamba::allocate_uninitialized<kmamba::Tensor2<std::int64_t, Mem>>("kmamba::test::seq_idx", cfg.batch,
                                                                               cfg.seqlen);
    auto h = Kokkos::create_mirror_view(p.seq);
    for (int b = 0; b < cfg.batch; ++b) {
      std::int64_t id = b == 0 ? 0 : 5;
      for (int t = 0; t < cfg.seqlen; ++t) {
        const bool start = b == 0 ? std::find(cfg.boundaries.begin(), cfg.boundaries.end(), t) != cfg.boundaries.end()
                                  : (t == cfg.seqlen / 2 && t > 0);
        if (start) ++id;
        h(b, t) = id;
        ref.seq.push_back(id);
      }
    }
    Kokkos::deep_copy(p.seq, h);
  }
  exec.fence();
  ref.x = host_doubles(p.x);
  ref.dt = host_doubles(p.dt);
  if (cfg.log_decay) {
    ref.log_decay = host_doubles(p.log_decay);
  } else {
    ref.A = host_doubles(p.A);
  }
  ref.B = host_doubles(p.B);
  ref.C = host_doubles(p.C);
  ref.dout = host_doubles(p.dout);
  if (cfg.D) ref.D = host_doubles(p.D);
  if (cfg.z) ref.z = host_doubles(p.z);
  if (cfg.bias) ref.bias = host_doubles(p.bias);
  if (cfg.initial_states) ref.h0 = host_doubles(p.h0);
  if (cfg.dfinal) ref.dfinal = host_doubles(p.dfinal);
  return p;
}

template <class Mem>
kmamba::SsdGrads<Mem> allocate_grads(const Config& c, bool with_z, bool with_optional) {
  using kmamba::allocate_uninitialized;
  kmamba::SsdGrads<Mem> g;
  g.dx =
      allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::test::dx", c.batch, c.seqlen, c.nheads, c.headdim);
  g.ddt = allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::ddt", c.batch, c.seqlen, c.nheads);
  if (c.log_decay) {
    g.dlog_decay =
        allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::dlog_decay", c.batch, c.seqlen, c.nheads);
    poison(g.dlog_decay);
  } else {
    g.dA = allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::dA", c.nheads);
    poison(g.dA);
  }
  g.dB =
      allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::test::dB", c.batch, c.seqlen, c.ngroups, c.dstate);
  g.dC =
      allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::test::dC", c.batch, c.seqlen, c.ngroups, c.dstate);
  poison(g.dx);
  poison(g.ddt);
  poison(g.dB);
  poison(g.dC);
  if (with_z) {
    g.dz =
        allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::test::dz", c.batch, c.seqlen, c.nheads, c.headdim);
    poison(g.dz);
  }
  if (with_optional) {
    g.dD = allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::dD", c.nheads);
    g.ddt_bias = allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::ddt_bias", c.nheads);
    g.dinitial_states = allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::test::dh0", c.batch, c.nheads,
                                                                            c.headdim, c.dstate);
    poison(g.dD);
    poison(g.ddt_bias);
    poison(g.dinitial_states);
  }
  return g;
}

constexpr double forward_tol = 5e-6;
constexpr double gradient_tol = 2e-5;
constexpr double tf32_forward_tol = 1e-2;
constexpr double tf32_gradient_tol = 1e-2;

template <class Exec>
void check_against_reference(const Config& cfg, kmamba::MatmulPrecision precision = kmamba::MatmulPrecision::Float32) {
  using Mem = typename Exec::memory_space;
  const bool tf32 = precision == kmamba::MatmulPrecision::TensorFloat32 &&
                    kmamba::impl::TeamGemm<Exec, kmamba::MatmulPrecision::TensorFloat32>::tensor_cores;
  const double out_tol = tf32 ? tf32_forward_tol : forward_tol;
  const double grad_tol = tf32 ? tf32_gradient_tol : gradient_tol;
  const std::string ctx = cfg.describe() + " matmul_precision=" + kmamba::matmul_precision_name(precision);
  RefProblem ref;
  const DeviceProblem<Mem> p = make_problem<Exec>(cfg, ref);
  kmamba::SsdArgs<Mem> args = p.args();
  args.matmul_precision = precision;
  const Exec exec;
  auto out = kmamba::allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::test::out", cfg.batch, cfg.seqlen,
                                                                         cfg.nheads, cfg.headdim);
  auto fin = kmamba::allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::test::final", cfg.batch, cfg.nheads,
                                                                         cfg.headdim, cfg.dstate);
  poison(out);
  poison(fin);
  kmamba::ssd_forward(exec, args, out, fin);
  const kmamba::SsdGrads<Mem> g = allocate_grads<Mem>(cfg, cfg.z, true);
  kmamba::ssd_backward(exec, args, p.dout, p.dfinal, g);
  exec.fence();

  const RefForward rf = ref_forward(ref);
  expect_near_rel("out", host_doubles(out), rf.out, out_tol, ctx);
  expect_near_rel("final_states", host_doubles(fin), rf.final_states, out_tol, ctx);
  const RefGrads rg = ref_backward(ref);
  expect_near_rel("dx", host_doubles(g.dx), rg.dx, grad_tol, ctx);
  expect_near_rel("ddt", host_doubles(g.ddt), rg.ddt, grad_tol, ctx);
  if (cfg.log_decay) {
    expect_near_rel("dlog_decay", host_doubles(g.dlog_decay), rg.dlog_decay, grad_tol, ctx);
  } else {
    expect_near_rel("dA", host_doubles(g.dA), rg.dA, grad_tol, ctx);
  }
  expect_near_rel("dB", host_doubles(g.dB), rg.dB, grad_tol, ctx);
  expect_near_rel("dC", host_doubles(g.dC), rg.dC, grad_tol, ctx);
  expect_near_rel("dD", host_doubles(g.dD), rg.dD, grad_tol, ctx);
  expect_near_rel("ddt_bias", host_doubles(g.ddt_bias), rg.dbias, grad_tol, ctx);
  expect_near_rel("dinitial_states", host_doubles(g.dinitial_states), rg.dh0, grad_tol, ctx);
  if (cfg.z) expect_near_rel("dz", host_doubles(g.dz), rg.dz, grad_tol, ctx);
}

std::vector<Config> sweep() {
  std::vector<Config> list;
  Config c;
  c.seqlen = 1;
  c.ngroups = 1;
  list.push_back(c);  // one token, no options
  c = Config();
  c.seqlen = 7;  // chunk − 1
  c.D = c.z = true;
  c.seed = 2;
  list.push_back(c);
  c = Config();
  c.seqlen = 8;  // exactly one chunk
  c.ngroups = 1;
  c.bias = c.initial_states = c.dfinal = true;
  c.seed = 3;
  list.push_back(c);
  c = Config();
  c.seqlen = 29;  // three chunks + 5
  c.D = c.z = c.bias = c.initial_states = c.dfinal = true;
  c.seed = 4;
  list.push_back(c);
  c.ngroups = 1;
  c.D = c.z = false;
  c.seed = 5;
  list.push_back(c);
  c = Config();
  c.seqlen = 29;
  c.D = c.z = c.bias = c.initial_states = c.dfinal = true;
  c.seq_idx = true;
  c.boundaries = {8};  // exactly on a chunk boundary
  c.seed = 6;
  list.push_back(c);
  c.boundaries = {3, 5, 19, 24};  // two in the first chunk, a chunk with a restart mid-way
  c.ngroups = 1;
  c.seed = 7;
  list.push_back(c);
  c.boundaries = {1, 16, 17, 28};  // first and last token of chunks
  c.ngroups = 2;
  c.initial_states = false;
  c.seed = 8;
  list.push_back(c);
  c = Config();
  c.seqlen = 21;  // no softplus, δ clamped on both sides
  c.softplus = false;
  c.D = c.bias = c.initial_states = c.dfinal = true;
  c.dt_min = 0.2f;
  c.dt_max = 0.6f;
  c.seed = 9;
  list.push_back(c);
  c.softplus = true;
  c.z = true;
  c.dt_min = 0.3f;
  c.dt_max = 0.7f;
  c.seed = 10;
  list.push_back(c);
  c = Config();
  c.batch = 1;  // chunks longer than a scratch tile of rows (64)
  c.seqlen = 170;
  c.chunk = 80;
  c.nheads = 2;
  c.headdim = 8;
  c.ngroups = 1;
  c.dstate = 16;
  c.D = c.z = c.bias = c.initial_states = c.dfinal = true;
  c.seq_idx = true;
  c.boundaries = {100};
  c.seed = 11;
  list.push_back(c);
  c.seqlen = 300;  // the Mamba-2 chunk size: one full chunk of 256 and a partial one
  c.chunk = 256;
  c.ngroups = 2;
  c.boundaries = {256, 270};
  c.seed = 12;
  list.push_back(c);
  c = Config();  // a log decay per token in place of δ·A, with every option
  c.seqlen = 29;
  c.D = c.z = c.bias = c.initial_states = c.dfinal = c.log_decay = true;
  c.seq_idx = true;
  c.boundaries = {3, 16};
  c.seed = 13;
  list.push_back(c);
  c.softplus = false;  // δ only scales the input: no softplus, clamped
  c.seq_idx = false;
  c.dt_min = 0.2f;
  c.dt_max = 0.6f;
  c.seed = 14;
  list.push_back(c);
  return list;
}

// ----------------------------------------------------------------------------------------------
// The reference against itself: its backward against finite differences of its forward.

TEST(SsdReference, BackwardMatchesFiniteDifferences) {
  std::vector<Config> configs;
  Config c;
  c.batch = 2;
  c.seqlen = 11;
  c.nheads = 2;
  c.headdim = 2;
  c.ngroups = 2;
  c.dstate = 3;
  c.D = c.z = c.bias = c.initial_states = c.dfinal = true;
  c.seq_idx = true;
  c.boundaries = {4};
  configs.push_back(c);
  c.ngroups = 1;
  c.softplus = false;
  c.seq_idx = false;
  c.z = false;
  c.dt_min = 0.2f;
  c.dt_max = 0.6f;
  c.seed = 2;
  configs.push_back(c);
  c.log_decay = true;
  c.seed = 3;
  configs.push_back(c);
  for (const Config& cfg : configs) {
    RefProblem P;
    make_problem<Kokkos::DefaultHostExecutionSpace>(cfg, P);
    const RefGrads g = ref_backward(P);
    const double eps = 1e-6;
    int clamped = 0;
    for (int b = 0; b < cfg.batch; ++b)
      for (int t = 0; t < cfg.seqlen; ++t)
        for (int h = 0; h < cfg.nheads; ++h) {
          const double u = P.unclamped(P.pre(b, t, h));
          clamped += (u < cfg.dt_min || u > cfg.dt_max);
          // Finite differences need δ away from the clamp's kinks.
          ASSERT_GT(std::min(std::fabs(u - cfg.dt_min), std::fabs(u - cfg.dt_max)), 1e-4) << cfg.describe();
        }
    if (std::isfinite(cfg.dt_max)) {
      EXPECT_GT(clamped, 0) << "the clamp should be exercised: " << cfg.describe();
    }
    auto check = [&](const char* name, std::vector<double>& input, const std::vector<double>& analytic) {
      ASSERT_EQ(input.size(), analytic.size()) << name;
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
    check("x", P.x, g.dx);
    check("dt", P.dt, g.ddt);
    if (cfg.log_decay) {
      check("log_decay", P.log_decay, g.dlog_decay);
    } else {
      check("A", P.A, g.dA);
    }
    check("B", P.B, g.dB);
    check("C", P.C, g.dC);
    check("D", P.D, g.dD);
    check("dt_bias", P.bias, g.dbias);
    check("initial_states", P.h0, g.dh0);
    if (cfg.z) check("z", P.z, g.dz);
  }
}

// ----------------------------------------------------------------------------------------------
// Kernels.

KMAMBA_BACKEND_TEST_SUITE(Ssd);

TYPED_TEST(Ssd, ForwardAndBackwardMatchReference) {
  for (const Config& cfg : sweep()) check_against_reference<TypeParam>(cfg);
}

TYPED_TEST(Ssd, TensorFloat32ForwardAndBackwardMatchReference) {
  for (const Config& cfg : sweep()) check_against_reference<TypeParam>(cfg, kmamba::MatmulPrecision::TensorFloat32);
}

TYPED_TEST(Ssd, BackwardIsDeterministicAndOptionalGradientsMayBeOmitted) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  Config cfg;
  cfg.seqlen = 29;
  cfg.D = cfg.bias = cfg.initial_states = true;
  RefProblem ref;
  const DeviceProblem<Mem> p = make_problem<Exec>(cfg, ref);
  const Exec exec;
  const kmamba::SsdGrads<Mem> first = allocate_grads<Mem>(cfg, false, true);
  const kmamba::SsdGrads<Mem> second = allocate_grads<Mem>(cfg, false, false);
  kmamba::ssd_backward(exec, p.args(), p.dout, kmamba::ConstTensor4<float, Mem>(), first);
  kmamba::ssd_backward(exec, p.args(), p.dout, kmamba::ConstTensor4<float, Mem>(), second);
  exec.fence();
  EXPECT_EQ(host_doubles(first.dx), host_doubles(second.dx));
  EXPECT_EQ(host_doubles(first.ddt), host_doubles(second.ddt));
  EXPECT_EQ(host_doubles(first.dA), host_doubles(second.dA));
  EXPECT_EQ(host_doubles(first.dB), host_doubles(second.dB));
  EXPECT_EQ(host_doubles(first.dC), host_doubles(second.dC));
}

// Copies token t of a (batch, seqlen, X, Y) host tensor into a (batch, X, Y) view.
// ----------------------------------------------------------------------------------------------
// The fused forward (matmul_precision = BFloat16) against the double reference.
//
// Its four products take bf16 operands (relative rounding ≤ 2^-9 each, round to nearest even) and
// sum in fp32. Every term of an output is a product of at most three rounded factors before the
// fp32 sum: the state's share exp(cum_t)·Σ_n H·C rounds H (itself a sum of terms δ·x·B·decay with
// δ·x, B and the decayed B rounded: 1.5·2^-8) and C, ≤ 2.5·2^-8; the chunk's own share rounds C
// and B (into C·Bᵀ), the decayed C·Bᵀ and δ·x, ≤ 2·2^-8. So per element
//   |out − ref| ≤ 3·2^-8·|out|_abs + 1e-6·max|ref|,
// where |out|_abs is the reference on absolute values (ref_forward(·, true): every term counted
// with its magnitude, so cancellation cannot hide an error) and the second term covers the fp32
// sums; and
//   |final_states − ref| ≤ 2·2^-8·|H|_abs + 1e-6·max|ref|.
// Shapes the fused form does not take compute in fp32 and keep the fp32 tolerance.

// |kernel − ref| ≤ rel·magnitude + abs_tol·max|ref| per element (every kernel value finite).
void expect_within_magnitude(const std::string& what, const std::vector<double>& kernel, const std::vector<double>& ref,
                             const std::vector<double>& magnitude, double rel, const std::string& context) {
  ASSERT_EQ(kernel.size(), ref.size()) << what << " " << context;
  double scale = 0.0;
  for (double v : ref) scale = std::max(scale, std::fabs(v));
  std::size_t failures = 0;
  double worst_ratio = 0.0;
  std::size_t worst = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    ASSERT_TRUE(std::isfinite(kernel[i])) << what << "[" << i << "] = " << kernel[i] << " " << context;
    const double bound = rel * magnitude[i] + 1e-6 * scale;
    const double ratio = std::fabs(kernel[i] - ref[i]) / bound;
    if (ratio > 1.0) ++failures;
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  EXPECT_EQ(failures, 0u) << what << ": " << failures << " elements outside the bound; worst at " << worst
                          << " (kernel " << kernel[worst] << ", ref " << ref[worst] << ", |.|_abs " << magnitude[worst]
                          << ", error/bound " << worst_ratio << ") " << context;
}

// segments = 0: through kmamba::ssd_forward; otherwise the fused forward itself with that many
// segments per sequence (the count the public op chooses depends on the device's size).
template <class Exec>
void check_bf16_forward(const Config& cfg, int segments = 0) {
  using Mem = typename Exec::memory_space;
  const std::string ctx = cfg.describe() + " matmul_precision=bf16 segments=" + std::to_string(segments);
  RefProblem ref;
  const DeviceProblem<Mem> p = make_problem<Exec>(cfg, ref);
  kmamba::SsdArgs<Mem> args = p.args();
  args.matmul_precision = kmamba::MatmulPrecision::BFloat16;
  const Exec exec;
  auto out = kmamba::allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::test::out", cfg.batch, cfg.seqlen,
                                                                         cfg.nheads, cfg.headdim);
  auto fin = kmamba::allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::test::final", cfg.batch, cfg.nheads,
                                                                         cfg.headdim, cfg.dstate);
  poison(out);
  poison(fin);
  if (segments == 0) {
    kmamba::ssd_forward(exec, args, out, fin);
  } else {
    const kmamba::impl::SsdDims dims = kmamba::impl::ssd_check_args("test", args);
    const kmamba::impl::SsdPlan plan = kmamba::impl::ssd_plan<Exec>("test", dims, kmamba::impl::ssd_fused_chunk);
    const kmamba::impl::SsdOperands<Mem> in(args);
    ASSERT_TRUE(kmamba::impl::ssd_fused_forward_supported(plan, in)) << ctx;
    kmamba::impl::ssd_fused_forward(exec, plan, in, out, fin, segments);
  }
  exec.fence();
  const RefForward rf = ref_forward(ref);
  const bool fused = cfg.headdim == 64 && !cfg.seq_idx &&
                     (cfg.dstate == 16 || cfg.dstate == 32 || cfg.dstate == 64 || cfg.dstate == 128);
  if (!fused) {
    expect_near_rel("out", host_doubles(out), rf.out, forward_tol, ctx);
    expect_near_rel("final_states", host_doubles(fin), rf.final_states, forward_tol, ctx);
    return;
  }
  const RefForward mag = ref_forward(ref, true);
  constexpr double u = 1.0 / 256.0;  // 2^-8
  expect_within_magnitude("out", host_doubles(out), rf.out, mag.out, 3 * u, ctx);
  expect_within_magnitude("final_states", host_doubles(fin), rf.final_states, mag.final_states, 2 * u, ctx);
  // Not vacuous: bf16 operands must show (an fp32 forward would agree to ~1e-6 everywhere).
  const std::vector<double> k = host_doubles(out);
  double err = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < k.size(); ++i) {
    err = std::max(err, std::fabs(k[i] - rf.out[i]));
    scale = std::max(scale, std::fabs(rf.out[i]));
  }
  EXPECT_GT(err, 1e-5 * scale) << "the bf16 forward agrees with the double reference as closely as fp32: " << ctx;
}

std::vector<Config> bf16_sweep() {
  std::vector<Config> list;
  Config c;
  c.headdim = 64;
  c.chunk = 64;
  c.nheads = 4;
  c.ngroups = 2;
  c.seqlen = 150;  // two chunks + 22
  c.dstate = 32;
  c.D = c.z = c.bias = c.initial_states = true;
  c.seed = 21;
  list.push_back(c);
  c.batch = 1;
  c.seqlen = 64;  // exactly one chunk, no options
  c.ngroups = 1;
  c.dstate = 16;
  c.D = c.z = c.bias = c.initial_states = false;
  c.seed = 22;
  list.push_back(c);
  c.seqlen = 130;
  c.nheads = 2;
  c.dstate = 128;
  c.D = c.z = true;
  c.initial_states = true;
  c.seed = 23;
  list.push_back(c);
  c.seqlen = 70;  // no softplus, δ clamped; a configured chunk the fused form does not use
  c.chunk = 16;
  c.dstate = 64;
  c.softplus = false;
  c.dt_min = 0.2f;
  c.dt_max = 0.6f;
  c.seed = 24;
  list.push_back(c);
  c.seqlen = 200;  // no gate over several chunks: the chunk states and their gradients in one kernel
  c.chunk = 64;
  c.dstate = 64;
  c.z = false;
  c.softplus = true;
  c.seed = 29;
  list.push_back(c);
  c.log_decay = true;  // Mamba-3's form: a log decay per token, one group per head, no D or gate
  c.nheads = c.ngroups = 3;
  c.softplus = false;
  c.dt_min = -std::numeric_limits<float>::infinity();
  c.dt_max = std::numeric_limits<float>::infinity();
  c.D = c.bias = false;
  c.dfinal = true;
  c.seed = 30;
  list.push_back(c);
  c = Config();  // shapes the fused form does not take: fp32 stages
  c.seqlen = 29;
  c.D = c.z = c.bias = c.initial_states = true;
  c.seed = 25;
  list.push_back(c);
  c.headdim = 64;
  c.chunk = 64;
  c.seqlen = 90;
  c.dstate = 16;
  c.seq_idx = true;
  c.boundaries = {40};
  c.seed = 26;
  list.push_back(c);
  return list;
}

TYPED_TEST(Ssd, Bf16FusedForwardMatchesReference) {
  for (const Config& cfg : bf16_sweep()) check_bf16_forward<TypeParam>(cfg);
}

TYPED_TEST(Ssd, Bf16FusedForwardInSegmentsMatchesReference) {
  Config c;
  c.batch = 1;
  c.headdim = 64;
  c.chunk = 64;
  c.nheads = 2;
  c.ngroups = 1;
  c.dstate = 32;
  c.seqlen = 7 * 64 + 10;  // 8 chunks, the last partial
  c.D = c.z = c.bias = c.initial_states = true;
  c.seed = 27;
  for (int segments : {1, 2, 3, 8}) check_bf16_forward<TypeParam>(c, segments);
  c.initial_states = false;
  c.seed = 28;
  check_bf16_forward<TypeParam>(c, 5);
}

// The backward with matmul_precision = BFloat16 against the double reference. Its chunk stage is
// the fused one (impl/SsdFusedBackward.hpp) for the shapes the fused forward takes: every term of
// dx, dB, dC and of δ's gradient is a product of inputs, δ and decays of which the products round
// at most five factors to bf16 (2^-9 relative each), so each term is within 2.5·2^-8 of its exact
// value to first order, 3·2^-8 with the second-order terms and the fp32 sums' share, which the
// 1e-6·max|ref| term of expect_within_magnitude also covers:
//   |grad − ref| ≤ 3·2^-8·|grad|_abs + 1e-6·max|ref|,
// with |grad|_abs the reference on absolute values (ref_backward(·, true)). dA, dD and ddt_bias are
// sums of those terms and take the same bound; so do dinitial_states (passed sums of g·C products,
// two factors rounded) and dz (the recomputed output, whose state part rounds x, B and the state).
// The shapes the fused form does not take run the fp32 stages and keep the fp32 tolerance.
template <class Exec>
void check_bf16_backward(const Config& cfg) {
  using Mem = typename Exec::memory_space;
  const std::string ctx = cfg.describe() + " matmul_precision=bf16 (backward)";
  RefProblem ref;
  const DeviceProblem<Mem> p = make_problem<Exec>(cfg, ref);
  kmamba::SsdArgs<Mem> args = p.args();
  args.matmul_precision = kmamba::MatmulPrecision::BFloat16;
  const kmamba::SsdGrads<Mem> g = allocate_grads<Mem>(cfg, cfg.z, true);
  kmamba::ssd_backward(Exec(), args, p.dout, p.dfinal, g);
  Exec().fence();
  const RefGrads rg = ref_backward(ref);
  const bool fused = cfg.headdim == 64 && !cfg.seq_idx &&
                     (cfg.dstate == 16 || cfg.dstate == 32 || cfg.dstate == 64 || cfg.dstate == 128);
  if (!fused) {
    expect_near_rel("dinitial_states", host_doubles(g.dinitial_states), rg.dh0, gradient_tol, ctx);
    if (cfg.z) expect_near_rel("dz", host_doubles(g.dz), rg.dz, gradient_tol, ctx);
    expect_near_rel("dx", host_doubles(g.dx), rg.dx, gradient_tol, ctx);
    expect_near_rel("ddt", host_doubles(g.ddt), rg.ddt, gradient_tol, ctx);
    expect_near_rel("dB", host_doubles(g.dB), rg.dB, gradient_tol, ctx);
    expect_near_rel("dC", host_doubles(g.dC), rg.dC, gradient_tol, ctx);
    return;
  }
  const RefGrads mag = ref_backward(ref, true);
  constexpr double bound = 3.0 / 256.0;
  expect_within_magnitude("dinitial_states", host_doubles(g.dinitial_states), rg.dh0, mag.dh0, bound, ctx);
  if (cfg.z) expect_within_magnitude("dz", host_doubles(g.dz), rg.dz, mag.dz, bound, ctx);
  expect_within_magnitude("dx", host_doubles(g.dx), rg.dx, mag.dx, bound, ctx);
  expect_within_magnitude("ddt", host_doubles(g.ddt), rg.ddt, mag.ddt, bound, ctx);
  expect_within_magnitude("dB", host_doubles(g.dB), rg.dB, mag.dB, bound, ctx);
  expect_within_magnitude("dC", host_doubles(g.dC), rg.dC, mag.dC, bound, ctx);
  if (cfg.log_decay) {
    expect_within_magnitude("dlog_decay", host_doubles(g.dlog_decay), rg.dlog_decay, mag.dlog_decay, bound, ctx);
  } else {
    expect_within_magnitude("dA", host_doubles(g.dA), rg.dA, mag.dA, bound, ctx);
  }
  if (cfg.D) expect_within_magnitude("dD", host_doubles(g.dD), rg.dD, mag.dD, bound, ctx);
  if (cfg.bias) expect_within_magnitude("ddt_bias", host_doubles(g.ddt_bias), rg.dbias, mag.dbias, bound, ctx);
  // Not vacuous: bf16 operands must show (the fp32 stages agree to ~1e-6).
  const std::vector<double> k = host_doubles(g.dx);
  double err = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < k.size(); ++i) {
    err = std::max(err, std::fabs(k[i] - rg.dx[i]));
    scale = std::max(scale, std::fabs(rg.dx[i]));
  }
  EXPECT_GT(err, 1e-5 * scale) << "the bf16 backward agrees with the double reference as closely as fp32: " << ctx;
}

TYPED_TEST(Ssd, Bf16FusedBackwardMatchesReference) {
  for (Config cfg : bf16_sweep()) {
    cfg.dfinal = true;
    check_bf16_backward<TypeParam>(cfg);
  }
}

// The fused backward's state walks cut into segments (the count the public op chooses depends on
// the device's size) against one walk per sequence: the same bf16 products, summed in another
// order. Before the bf16 rounding of the stored states the two agree to fp32 rounding (at most 11
// chunk sums of 64 products per value, each sum and combination within a few 2^-24 of the
// magnitudes: far inside 1e-5 of each tensor's largest value); the rounding then moves a value by
// at most one bf16 step, 2^-7 of it. A lost decay or a wrong segment would miss by order 1.
template <class Exec>
void check_segmented_walks(const Config& cfg, int segments) {
  using Mem = typename Exec::memory_space;
  namespace ki = kmamba::impl;
  const std::string ctx = cfg.describe() + " segments=" + std::to_string(segments);
  RefProblem ref;
  const DeviceProblem<Mem> p = make_problem<Exec>(cfg, ref);
  kmamba::SsdArgs<Mem> args = p.args();
  args.matmul_precision = kmamba::MatmulPrecision::BFloat16;
  const ki::SsdPlan plan = ki::ssd_plan<Exec>("test", ki::ssd_check_args("test", args), ki::ssd_fused_backward_chunk);
  const ki::SsdOperands<Mem> in(args);
  ASSERT_TRUE(ki::ssd_fused_backward_supported(plan, in)) << ctx;
  const Exec exec;
  const auto walk = [&](int count) {
    const ki::SsdWorkspace<Mem> ws(plan, false);
    using States = kmamba::Tensor5<kmamba::bf16, Mem>;
    const auto hin = kmamba::allocate_uninitialized<States>("kmamba::test::hin", plan.batch, plan.nchunks, plan.nheads,
                                                            plan.headdim, plan.dstate);
    const auto dstates = kmamba::allocate_uninitialized<States>("kmamba::test::dstates", plan.batch, plan.nchunks,
                                                                plan.nheads, plan.headdim, plan.dstate);
    const auto dinitial = kmamba::allocate_uninitialized<kmamba::Tensor4<float, Mem>>(
        "kmamba::test::dinitial", plan.batch, plan.nheads, plan.headdim, plan.dstate);
    poison(dinitial);
    ki::ssd_chunk_cumsum(exec, plan, in, ws);
    ki::ssd_fused_state_walks(exec, plan, in, ws, p.dout, p.dfinal, hin, dstates, dinitial, count);
    exec.fence();
    return std::vector<std::vector<double>>{host_doubles(hin), host_doubles(dstates), host_doubles(dinitial)};
  };
  const auto one = walk(1), cut = walk(segments);
  const char* names[] = {"entering states", "leaving states' gradients", "dinitial_states"};
  for (int i = 0; i < 3; ++i) {
    double scale = 0.0;
    for (double v : one[i]) scale = std::max(scale, std::fabs(v));
    const double step = i < 2 ? 1.0 / 128.0 : 0.0;
    std::size_t outside = 0;
    for (std::size_t k = 0; k < one[i].size(); ++k)
      if (!(std::fabs(cut[i][k] - one[i][k]) <= step * std::fabs(one[i][k]) + 1e-5 * scale)) ++outside;
    EXPECT_EQ(outside, 0u) << names[i] << ": values outside 2^-7·|value| + 1e-5·max of one walk's " << ctx;
  }
}

TYPED_TEST(Ssd, Bf16FusedBackwardWalksInSegmentsMatchOneWalk) {
  Config c;
  c.batch = 2;
  c.headdim = 64;
  c.chunk = 64;
  c.nheads = 2;
  c.ngroups = 1;
  c.dstate = 128;
  c.seqlen = 10 * 64 + 17;  // 11 chunks, the last partial
  c.D = c.bias = c.initial_states = c.dfinal = true;
  c.seed = 29;
  for (int segments : {2, 3, 11}) check_segmented_walks<TypeParam>(c, segments);
  c.dstate = 32;
  c.initial_states = c.dfinal = false;
  c.seed = 30;
  check_segmented_walks<TypeParam>(c, 4);
}

template <class HostView, class View>
void copy_token(const HostView& full, int t, const View& step) {
  auto h = Kokkos::create_mirror_view(step);
  for (std::size_t b = 0; b < h.extent(0); ++b)
    for (std::size_t i = 0; i < h.extent(1); ++i)
      for (std::size_t j = 0; j < h.extent(2); ++j) h(b, i, j) = full(b, t, i, j);
  Kokkos::deep_copy(step, h);
}

TYPED_TEST(Ssd, ChunkedForwardEqualsDecodeSteps) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using kmamba::allocate_uninitialized;
  for (int variant = 0; variant < 2; ++variant) {
    Config cfg;
    cfg.seqlen = 13;
    cfg.chunk = 4;
    cfg.initial_states = true;
    cfg.D = cfg.z = cfg.bias = variant == 0;
    cfg.softplus = variant == 0;
    cfg.ngroups = variant == 0 ? 2 : 1;
    cfg.seed = 20 + variant;
    const std::string ctx = cfg.describe();
    RefProblem ref;
    const DeviceProblem<Mem> p = make_problem<Exec>(cfg, ref);
    const Exec exec;
    auto out = allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::test::out", cfg.batch, cfg.seqlen,
                                                                   cfg.nheads, cfg.headdim);
    auto fin = allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::test::final", cfg.batch, cfg.nheads,
                                                                   cfg.headdim, cfg.dstate);
    poison(out);
    poison(fin);
    kmamba::ssd_forward(exec, p.args(), out, fin);

    auto state = allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::test::state", cfg.batch, cfg.nheads,
                                                                     cfg.headdim, cfg.dstate);
    Kokkos::deep_copy(state, p.h0);
    kmamba::SsdStepArgs<Mem> step;
    auto x1 =
        allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::x1", cfg.batch, cfg.nheads, cfg.headdim);
    auto z1 =
        allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::z1", cfg.batch, cfg.nheads, cfg.headdim);
    auto dt1 = allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::dt1", cfg.batch, cfg.nheads);
    auto B1 =
        allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::B1", cfg.batch, cfg.ngroups, cfg.dstate);
    auto C1 =
        allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::C1", cfg.batch, cfg.ngroups, cfg.dstate);
    auto y1 =
        allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::test::y1", cfg.batch, cfg.nheads, cfg.headdim);
    step.x = x1;
    step.dt = dt1;
    step.A = p.A;
    step.B = B1;
    step.C = C1;
    step.D = p.D;
    step.dt_bias = p.bias;
    if (cfg.z) step.z = z1;
    step.dt_softplus = cfg.softplus;
    const auto hx = kmamba::test::to_host(p.x);
    const auto hdt = kmamba::test::to_host(p.dt);
    const auto hB = kmamba::test::to_host(p.B);
    const auto hC = kmamba::test::to_host(p.C);
    const auto hout = kmamba::test::to_host(out);
    std::vector<double> stepped, chunked;
    const auto hzfull = cfg.z ? kmamba::test::to_host(p.z) : decltype(kmamba::test::to_host(p.x))();
    for (int t = 0; t < cfg.seqlen; ++t) {
      copy_token(hx, t, x1);
      copy_token(hB, t, B1);
      copy_token(hC, t, C1);
      if (cfg.z) copy_token(hzfull, t, z1);
      auto hdt1 = Kokkos::create_mirror_view(dt1);
      for (int b = 0; b < cfg.batch; ++b)
        for (int h = 0; h < cfg.nheads; ++h) hdt1(b, h) = hdt(b, t, h);
      Kokkos::deep_copy(dt1, hdt1);
      poison(y1);
      kmamba::ssd_step(exec, step, state, y1);
      const auto hy = kmamba::test::to_host(y1);
      for (int b = 0; b < cfg.batch; ++b)
        for (int h = 0; h < cfg.nheads; ++h)
          for (int q = 0; q < cfg.headdim; ++q) {
            stepped.push_back(hy(b, h, q));
            chunked.push_back(hout(b, t, h, q));
          }
    }
    expect_near_rel("out (steps vs chunked)", stepped, chunked, 1e-5, ctx);
    expect_near_rel("state (steps vs chunked)", host_doubles(state), host_doubles(fin), 1e-5, ctx);
  }
}

// A (batch, [t0, t1), X, Y) slice of a device tensor, as a new tensor.
template <class View>
View slice_tokens(const View& full, int t0, int t1) {
  View part(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kmamba::test::slice"), full.extent(0),
            static_cast<std::size_t>(t1 - t0), full.extent(2), full.extent(3));
  const auto hf = kmamba::test::to_host(full);
  auto hp = Kokkos::create_mirror_view(part);
  for (std::size_t b = 0; b < hp.extent(0); ++b)
    for (int t = t0; t < t1; ++t)
      for (std::size_t i = 0; i < hp.extent(2); ++i)
        for (std::size_t j = 0; j < hp.extent(3); ++j) hp(b, t - t0, i, j) = hf(b, t, i, j);
  Kokkos::deep_copy(part, hp);
  return part;
}

TYPED_TEST(Ssd, FinalStateOfOneSegmentContinuesTheNext) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  using kmamba::allocate_uninitialized;
  Config cfg;
  cfg.seqlen = 21;
  cfg.chunk = 8;
  cfg.D = cfg.z = cfg.bias = cfg.initial_states = true;
  cfg.seed = 30;
  RefProblem ref;
  const DeviceProblem<Mem> p = make_problem<Exec>(cfg, ref);
  const Exec exec;
  auto out = allocate_uninitialized<T4>("kmamba::test::out", cfg.batch, cfg.seqlen, cfg.nheads, cfg.headdim);
  auto fin = allocate_uninitialized<T4>("kmamba::test::final", cfg.batch, cfg.nheads, cfg.headdim, cfg.dstate);
  auto out_alone =
      allocate_uninitialized<T4>("kmamba::test::out_alone", cfg.batch, cfg.seqlen, cfg.nheads, cfg.headdim);
  poison(out);
  poison(fin);
  poison(out_alone);
  kmamba::ssd_forward(exec, p.args(), out, fin);
  kmamba::ssd_forward(exec, p.args(), out_alone, T4());  // final_states is optional

  const int split = 11;  // inside the second chunk
  // dt has rank 3: slice it through a rank-4 view of extent 1 in the last dimension.
  const auto hdt = kmamba::test::to_host(p.dt);
  auto segment = [&](int t0, int t1, const kmamba::ConstTensor4<float, Mem>& init, const T4& seg_out,
                     const T4& seg_final) {
    kmamba::SsdArgs<Mem> a = p.args();
    a.x = slice_tokens(p.x, t0, t1);
    a.B = slice_tokens(p.B, t0, t1);
    a.C = slice_tokens(p.C, t0, t1);
    a.z = slice_tokens(p.z, t0, t1);
    T3 dt = allocate_uninitialized<T3>("kmamba::test::dt_part", cfg.batch, t1 - t0, cfg.nheads);
    auto h = Kokkos::create_mirror_view(dt);
    for (int b = 0; b < cfg.batch; ++b)
      for (int t = t0; t < t1; ++t)
        for (int hd = 0; hd < cfg.nheads; ++hd) h(b, t - t0, hd) = hdt(b, t, hd);
    Kokkos::deep_copy(dt, h);
    a.dt = dt;
    a.initial_states = init;
    kmamba::ssd_forward(exec, a, seg_out, seg_final);
  };
  auto out1 = allocate_uninitialized<T4>("kmamba::test::out1", cfg.batch, split, cfg.nheads, cfg.headdim);
  auto fin1 = allocate_uninitialized<T4>("kmamba::test::final1", cfg.batch, cfg.nheads, cfg.headdim, cfg.dstate);
  auto out2 = allocate_uninitialized<T4>("kmamba::test::out2", cfg.batch, cfg.seqlen - split, cfg.nheads, cfg.headdim);
  auto fin2 = allocate_uninitialized<T4>("kmamba::test::final2", cfg.batch, cfg.nheads, cfg.headdim, cfg.dstate);
  poison(out1);
  poison(out2);
  poison(fin1);
  poison(fin2);
  segment(0, split, p.h0, out1, fin1);
  segment(split, cfg.seqlen, fin1, out2, fin2);
  exec.fence();
  const std::string ctx = cfg.describe();
  EXPECT_EQ(host_doubles(out_alone), host_doubles(out));
  expect_near_rel("out, first segment", host_doubles(out1), host_doubles(slice_tokens(out, 0, split)), 1e-5, ctx);
  expect_near_rel("out, second segment", host_doubles(out2), host_doubles(slice_tokens(out, split, cfg.seqlen)), 1e-5,
                  ctx);
  expect_near_rel("final_states", host_doubles(fin2), host_doubles(fin), 1e-5, ctx);
}

TYPED_TEST(Ssd, RejectsBadShapes) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using T1 = kmamba::Tensor1<float, Mem>;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  using kmamba::allocate;
  Config cfg;  // batch 2, seqlen 10, nheads 4, headdim 3, ngroups 2, dstate 5
  cfg.D = cfg.z = cfg.initial_states = true;
  RefProblem ref;
  const DeviceProblem<Mem> p = make_problem<Exec>(cfg, ref);
  const Exec exec;
  auto out = allocate<T4>("kmamba::test::out", 2, 10, 4, 3);
  auto fin = allocate<T4>("kmamba::test::final", 2, 4, 3, 5);

  kmamba::SsdArgs<Mem> args = p.args();
  args.C = allocate<T4>("kmamba::test::C", 2, 9, 2, 5);
  expect_user_error([&] { kmamba::ssd_forward(exec, args, out, fin); },
                    {"kmamba::ssd_forward", "C", "(2, 9, 2, 5)", "(2, 10, 2, 5)", "(batch, seqlen, ngroups, dstate)"});
  args = p.args();
  args.dt = allocate<T3>("kmamba::test::dt", 2, 10, 3);
  expect_user_error([&] { kmamba::ssd_forward(exec, args, out, fin); }, {"dt", "(2, 10, 3)", "(2, 10, 4)"});
  args = p.args();
  args.B = allocate<T4>("kmamba::test::B", 2, 10, 3, 5);
  expect_user_error([&] { kmamba::ssd_forward(exec, args, out, fin); }, {"B", "(2, 10, 3, 5)", "ngroups"});
  args = p.args();
  args.initial_states = allocate<T4>("kmamba::test::h0", 2, 4, 5, 3);
  expect_user_error([&] { kmamba::ssd_forward(exec, args, out, fin); },
                    {"initial_states", "(2, 4, 5, 3)", "(2, 4, 3, 5)"});
  args = p.args();
  args.A = T1();
  expect_user_error([&] { kmamba::ssd_forward(exec, args, out, fin); },
                    {"kmamba::ssd_forward", "A is required unless log_decay is given"});
  args.log_decay = allocate<T3>("kmamba::test::log_decay", 2, 4, 10);
  expect_user_error([&] { kmamba::ssd_forward(exec, args, out, fin); },
                    {"log_decay", "(2, 4, 10)", "(2, 10, 4)", "(batch, seqlen, nheads)"});
  {
    args.log_decay = allocate<T3>("kmamba::test::log_decay", 2, 10, 4);
    kmamba::SsdGrads<Mem> g = allocate_grads<Mem>(cfg, cfg.z, false);  // dA, no dlog_decay
    expect_user_error([&] { kmamba::ssd_backward(exec, args, p.dout, p.dfinal, g); },
                      {"kmamba::ssd_backward", "dlog_decay", "(batch, seqlen, nheads)"});
  }
  args = p.args();
  args.seq_idx = allocate<kmamba::Tensor2<std::int64_t, Mem>>("kmamba::test::seq_idx", 2, 11);
  expect_user_error([&] { kmamba::ssd_forward(exec, args, out, fin); }, {"seq_idx", "(2, 11)", "(2, 10)"});
  args = p.args();
  args.D = allocate<T1>("kmamba::test::D", 3);
  expect_user_error([&] { kmamba::ssd_forward(exec, args, out, fin); }, {"D", "(3,)", "(4,)"});
  args = p.args();
  expect_user_error([&] { kmamba::ssd_forward(exec, args, allocate<T4>("kmamba::test::o", 2, 10, 4, 4), fin); },
                    {"out", "(2, 10, 4, 4)", "(2, 10, 4, 3)"});
  expect_user_error([&] { kmamba::ssd_forward(exec, args, out, allocate<T4>("kmamba::test::f", 2, 4, 3, 6)); },
                    {"final_states", "(2, 4, 3, 6)", "(2, 4, 3, 5)"});
  args.chunk_size = 0;
  expect_user_error([&] { kmamba::ssd_forward(exec, args, out, fin); }, {"chunk_size"});
  args = p.args();
  args.chunk_size = 1 << 22;
  expect_user_error([&] { kmamba::ssd_forward(exec, args, out, fin); }, {"chunk_size", "scratch"});

  args = p.args();
  kmamba::SsdGrads<Mem> g = allocate_grads<Mem>(cfg, true, true);
  g.dB = allocate<T4>("kmamba::test::dB", 2, 10, 1, 5);
  expect_user_error([&] { kmamba::ssd_backward(exec, args, p.dout, kmamba::ConstTensor4<float, Mem>(), g); },
                    {"kmamba::ssd_backward", "dB", "(2, 10, 1, 5)", "(2, 10, 2, 5)"});
  g = allocate_grads<Mem>(cfg, false, true);
  expect_user_error([&] { kmamba::ssd_backward(exec, args, p.dout, kmamba::ConstTensor4<float, Mem>(), g); }, {"dz"});
  g = allocate_grads<Mem>(cfg, true, true);
  expect_user_error(
      [&] {
        kmamba::ssd_backward(exec, args, allocate<T4>("kmamba::test::dout", 2, 10, 4, 2),
                             kmamba::ConstTensor4<float, Mem>(), g);
      },
      {"dout", "(2, 10, 4, 2)", "(2, 10, 4, 3)"});

  kmamba::SsdStepArgs<Mem> step;
  step.x = allocate<T3>("kmamba::test::x1", 2, 4, 3);
  step.dt = allocate<T2>("kmamba::test::dt1", 2, 4);
  step.A = p.A;
  step.B = allocate<T3>("kmamba::test::B1", 2, 2, 5);
  step.C = allocate<T3>("kmamba::test::C1", 2, 2, 5);
  auto y = allocate<T3>("kmamba::test::y1", 2, 4, 3);
  expect_user_error([&] { kmamba::ssd_step(exec, step, allocate<T4>("kmamba::test::s", 2, 4, 5, 3), y); },
                    {"kmamba::ssd_step", "state", "(2, 4, 5, 3)", "(2, 4, 3, 5)"});
  step.C = allocate<T3>("kmamba::test::C2", 2, 1, 5);
  expect_user_error([&] { kmamba::ssd_step(exec, step, allocate<T4>("kmamba::test::s", 2, 4, 3, 5), y); },
                    {"C", "(2, 1, 5)", "(2, 2, 5)"});
}

// ----------------------------------------------------------------------------------------------
// Golden data.

// The int64 tensor `name` of a safetensors file (the test reader returns F32 tensors only).
std::vector<std::int64_t> golden_int64(const std::string& path, const kmamba::test::SafeTensorsFile& file,
                                       const std::string& name) {
  const auto& e = file.entry(name);
  if (e.dtype != "I64") throw std::runtime_error(name + " is " + e.dtype + ", not I64");
  std::ifstream in(path, std::ios::binary);
  unsigned char length_bytes[8];
  in.read(reinterpret_cast<char*>(length_bytes), 8);
  std::uint64_t header = 0;
  for (int i = 7; i >= 0; --i) header = (header << 8) | length_bytes[i];
  std::vector<std::int64_t> values((e.end - e.begin) / sizeof(std::int64_t));
  in.seekg(static_cast<std::streamoff>(8 + header + e.begin));
  in.read(reinterpret_cast<char*>(values.data()), static_cast<std::streamsize>(values.size() * sizeof(std::int64_t)));
  if (!in) throw std::runtime_error("cannot read " + name + " from " + path);
  return values;
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

template <class Exec>
void check_golden(const std::string& name) {
  using Mem = typename Exec::memory_space;
  using T1 = kmamba::Tensor1<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  using kmamba::allocate_uninitialized;
  const std::string path = kmamba::test::golden_dir() + "/" + name + ".safetensors";
  const kmamba::test::SafeTensorsFile file(path);
  const nlohmann::json config = nlohmann::json::parse(file.metadata("config"));
  ASSERT_EQ(config.at("op").get<std::string>(), "ssd");
  kmamba::SsdArgs<Mem> args;
  args.x = file.to_device<T4>("x");
  args.dt = file.to_device<T3>("dt");
  args.A = file.to_device<T1>("A");
  args.B = file.to_device<T4>("B");
  args.C = file.to_device<T4>("C");
  args.D = file.to_device<T1>("D");
  args.z = file.to_device<T4>("z");
  args.dt_bias = file.to_device<T1>("dt_bias");
  args.initial_states = file.to_device<T4>("initial_states");
  args.dt_softplus = config.at("dt_softplus").get<bool>();
  args.chunk_size = config.at("chunk_size").get<int>();
  const auto& limit = config.at("dt_limit");
  args.dt_min = limit.at(0).get<float>();
  args.dt_max = limit.at(1).is_string() ? std::numeric_limits<float>::infinity() : limit.at(1).get<float>();
  const std::vector<std::int64_t> seq = golden_int64(path, file, "seq_idx");
  const int batch = static_cast<int>(args.x.extent(0)), seqlen = static_cast<int>(args.x.extent(1));
  const int nheads = static_cast<int>(args.x.extent(2)), headdim = static_cast<int>(args.x.extent(3));
  const int ngroups = static_cast<int>(args.B.extent(2)), dstate = static_cast<int>(args.B.extent(3));
  auto seq_idx = allocate_uninitialized<kmamba::Tensor2<std::int64_t, Mem>>("kmamba::test::seq_idx", batch, seqlen);
  {
    auto h = Kokkos::create_mirror_view(seq_idx);
    ASSERT_EQ(seq.size(), h.size());
    std::memcpy(h.data(), seq.data(), seq.size() * sizeof(std::int64_t));
    Kokkos::deep_copy(seq_idx, h);
  }
  args.seq_idx = seq_idx;
  const auto dout = file.to_device<T4>("dout");
  const auto dfinal = file.to_device<T4>("dfinal_states");
  const std::string ctx = name + " " + file.metadata("config");

  auto out = allocate_uninitialized<T4>("kmamba::test::out", batch, seqlen, nheads, headdim);
  auto fin = allocate_uninitialized<T4>("kmamba::test::final", batch, nheads, headdim, dstate);
  poison(out);
  poison(fin);
  Config cfg;
  cfg.batch = batch;
  cfg.seqlen = seqlen;
  cfg.nheads = nheads;
  cfg.headdim = headdim;
  cfg.ngroups = ngroups;
  cfg.dstate = dstate;
  const kmamba::SsdGrads<Mem> g = allocate_grads<Mem>(cfg, true, true);
  const Exec exec;
  kmamba::ssd_forward(exec, args, out, fin);
  kmamba::ssd_backward(exec, args, dout, dfinal, g);
  exec.fence();
  const double tol = 1e-3;
  expect_golden("out", out, file.floats("out"), tol, ctx);
  expect_golden("final_states", fin, file.floats("final_states"), tol, ctx);
  expect_golden("grad.x", g.dx, file.floats("grad.x"), tol, ctx);
  expect_golden("grad.dt", g.ddt, file.floats("grad.dt"), tol, ctx);
  expect_golden("grad.A", g.dA, file.floats("grad.A"), tol, ctx);
  expect_golden("grad.B", g.dB, file.floats("grad.B"), tol, ctx);
  expect_golden("grad.C", g.dC, file.floats("grad.C"), tol, ctx);
  expect_golden("grad.D", g.dD, file.floats("grad.D"), tol, ctx);
  expect_golden("grad.z", g.dz, file.floats("grad.z"), tol, ctx);
  expect_golden("grad.dt_bias", g.ddt_bias, file.floats("grad.dt_bias"), tol, ctx);
  expect_golden("grad.initial_states", g.dinitial_states, file.floats("grad.initial_states"), tol, ctx);
}

TYPED_TEST(Ssd, MatchesGoldenSsdSmall) { check_golden<TypeParam>("ssd_small"); }

TYPED_TEST(Ssd, MatchesGoldenSsdSmallNoinit) { check_golden<TypeParam>("ssd_small_noinit"); }

}  // namespace
