// The Mamba-2 mixer against a naive double-precision reference written from
// docs/algorithms.md §2.1–§2.4 and §2.7 (in_proj, causal conv + SiLU, the SSD as a token-by-token
// recurrence, the
// group-wise gated RMSNorm, out_proj), its gradients against central finite differences of that
// reference over every input and parameter, gradient accumulation, errors, initialisation, and
// the parameter names and shapes of the golden Hugging Face checkpoint.
//
// Tolerances (per tensor, max|kernel − ref| ≤ tol·max|ref|):
// - forward: 1e-4 (the test prints the largest error; 4e-7 on Serial/OpenMP);
// - gradients against central differences of the double reference (step 1e-5): 1e-4 (2.3e-6
//   observed on Serial/OpenMP);
// - the finite differences themselves: steps 1e-5 and 2.5e-6 agree to 1e-7·(1 + |g|);
// - a second backward adds the same gradients again: 1e-5;
// - a packed batch against its documents run one by one: 1e-5 (the same arithmetic per token but
//   for the grouping of the GEMMs' and the reductions' sums, which moves results by a few fp32
//   roundings of max|ref|).
#include <kmamba/core/Core.hpp>
#include <kmamba/models/Config.hpp>
#include <kmamba/models/Mamba2Mixer.hpp>
#include <kmamba/models/ParameterSlab.hpp>
#include <kmamba/models/SafeTensors.hpp>
#include "TestData.hpp"

#include "Activations.hpp"
#include "Backends.hpp"
#include "Checks.hpp"
#include "Linear.hpp"
#include "MixerChecks.hpp"
#include "ModelConfigs.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace kmamba::test;
using namespace kmamba::reference;

const std::string prefix = "backbone.layers.1.mixer.";

// ----------------------------------------------------------------------------------------------
// Problem description and the double reference.

struct Case {
  int batch = 2, seqlen = 7, d_model = 8, expand = 2, headdim = 4, ngroups = 2, d_state = 4, d_conv = 4, chunk = 4;
  bool conv_bias = true, bias = false, norm_before_gate = false;
  double dt_limit_min = 0.0, dt_limit_max = std::numeric_limits<double>::infinity();
  std::uint64_t seed = 1;

  kmamba::ModelConfig config() const {
    kmamba::ModelConfig c = model_config(kmamba::MixerKind::Mamba2, {d_model, 3, 16, d_state, headdim, chunk, ngroups});
    std::tie(c.expand, c.d_conv, c.conv_bias, c.bias, c.norm_before_gate, c.dt_limit_min, c.dt_limit_max) =
        std::tie(expand, d_conv, conv_bias, bias, norm_before_gate, dt_limit_min, dt_limit_max);
    c.validate();
    return c;
  }

  std::string describe() const {
    std::ostringstream s;
    s << "batch=" << batch << " seqlen=" << seqlen << " d_model=" << d_model << " expand=" << expand
      << " headdim=" << headdim << " ngroups=" << ngroups << " d_state=" << d_state << " d_conv=" << d_conv
      << " chunk=" << chunk << " conv_bias=" << conv_bias << " bias=" << bias
      << " norm_before_gate=" << norm_before_gate << " dt_limit=(" << dt_limit_min << ", " << dt_limit_max
      << ") seed=" << seed;
    return s.str();
  }
};

using Params = NamedTensors;  // HF names without the prefix

struct Problem {
  Case c;
  kmamba::ModelConfig cfg;
  Params params;
  std::vector<double> u, dout;  // (batch, seqlen, d_model)

  int E() const { return cfg.d_inner(); }
  int H() const { return cfg.num_heads(); }
  int GN() const { return cfg.ngroups * cfg.d_state; }
  int conv_dim() const { return E() + 2 * GN(); }
  int F() const { return 2 * E() + 2 * GN() + H(); }
};

Problem make_problem(const Case& c) {
  Problem P;
  P.c = c;
  P.cfg = c.config();
  std::mt19937_64 rng(c.seed);
  const auto uniform = [&](std::size_t n, double lo, double hi) {
    std::uniform_real_distribution<double> d(lo, hi);
    std::vector<double> v(n);
    for (double& x : v) x = d(rng);
    return v;
  };
  const std::size_t Dm = c.d_model, E = P.E(), H = P.H(), F = P.F(), CD = P.conv_dim(), W = c.d_conv;
  const double in_bound = 1.0 / std::sqrt(double(Dm)), out_bound = 1.0 / std::sqrt(double(E));
  P.params["in_proj.weight"] = uniform(F * Dm, -in_bound, in_bound);
  if (c.bias) P.params["in_proj.bias"] = uniform(F, -0.2, 0.2);
  P.params["conv1d.weight"] = uniform(CD * W, -0.5, 0.5);
  if (c.conv_bias) P.params["conv1d.bias"] = uniform(CD, -0.3, 0.3);
  P.params["dt_bias"] = uniform(H, -2.5, 0.0);
  P.params["A_log"] = uniform(H, -0.5, 1.5);
  P.params["D"] = uniform(H, 0.5, 1.5);
  P.params["norm.weight"] = uniform(E, 0.5, 1.5);
  P.params["out_proj.weight"] = uniform(Dm * E, -out_bound, out_bound);
  if (c.bias) P.params["out_proj.bias"] = uniform(Dm, -0.2, 0.2);
  const std::size_t n = std::size_t(c.batch) * c.seqlen * Dm;
  P.u = uniform(n, -1.5, 1.5);
  P.dout = uniform(n, -1.0, 1.0);
  return P;
}

// out (batch, seqlen, d_model) of the mixer, written from the spec with every loop explicit.
std::vector<double> ref_forward(const Problem& P, const Params& w, const std::vector<double>& u) {
  const Case& c = P.c;
  const int Dm = c.d_model, E = P.E(), H = P.H(), hd = c.headdim, G = c.ngroups, N = c.d_state, W = c.d_conv;
  const int GN = P.GN(), CD = P.conv_dim(), F = P.F();
  const int rows = c.batch * c.seqlen;
  const std::vector<double>& w_in = w.at("in_proj.weight");
  const std::vector<double>& conv_w = w.at("conv1d.weight");
  const std::vector<double>& w_out = w.at("out_proj.weight");
  // in_proj: zxbcdt (rows, F) = [z (E) | xBC (E + 2GN) | dt (H)].
  const std::vector<double> zxbcdt = linear(u, rows, Dm, w_in, F, c.bias ? &w.at("in_proj.bias") : nullptr);
  const auto at = [&](int b, int t, int f) { return zxbcdt[(std::size_t(b) * c.seqlen + t) * F + f]; };
  // Causal depthwise conv over the conv_dim channels of xBC, then SiLU.
  std::vector<double> xbc(std::size_t(rows) * CD);
  for (int b = 0; b < c.batch; ++b)
    for (int t = 0; t < c.seqlen; ++t)
      for (int ch = 0; ch < CD; ++ch) {
        double s = c.conv_bias ? w.at("conv1d.bias")[ch] : 0.0;
        for (int k = 0; k < W; ++k) {
          const int src = t - (W - 1) + k;
          if (src >= 0) s += conv_w[std::size_t(ch) * W + k] * at(b, src, E + ch);
        }
        xbc[(std::size_t(b) * c.seqlen + t) * CD + ch] = silu(s);
      }
  // SSD, token by token: x = xBC[0, E) as (H, hd), B = [E, E + GN), C = [E + GN, E + 2GN) as (G, N).
  std::vector<double> y(std::size_t(rows) * E);
  std::vector<double> state(std::size_t(hd) * N);
  for (int b = 0; b < c.batch; ++b)
    for (int h = 0; h < H; ++h) {
      const int g = h / (H / G);
      const double A = -std::exp(w.at("A_log")[h]);
      std::fill(state.begin(), state.end(), 0.0);
      for (int t = 0; t < c.seqlen; ++t) {
        const double* row = &xbc[(std::size_t(b) * c.seqlen + t) * CD];
        double delta = softplus(at(b, t, 2 * E + 2 * GN + h) + w.at("dt_bias")[h]);
        delta = std::min(std::max(delta, c.dt_limit_min), c.dt_limit_max);
        const double decay = std::exp(delta * A);
        for (int p = 0; p < hd; ++p) {
          const double xv = row[h * hd + p];
          double acc = w.at("D")[h] * xv;
          for (int n = 0; n < N; ++n) {
            double& s = state[std::size_t(p) * N + n];
            s = decay * s + delta * xv * row[E + g * N + n];
            acc += s * row[E + GN + g * N + n];
          }
          y[(std::size_t(b) * c.seqlen + t) * E + h * hd + p] = acc;
        }
      }
    }
  // Gated RMSNorm, one mean per group of E / G channels; z = zxbcdt[0, E).
  const int gs = E / G;
  const double eps = P.cfg.norm_epsilon;
  std::vector<double> normed(std::size_t(rows) * E);
  for (int r = 0; r < rows; ++r)
    for (int g = 0; g < G; ++g) {
      double ss = 0.0;
      for (int i = g * gs; i < (g + 1) * gs; ++i) {
        const double v = y[std::size_t(r) * E + i] * (c.norm_before_gate ? 1.0 : silu(zxbcdt[std::size_t(r) * F + i]));
        ss += v * v;
      }
      const double rstd = 1.0 / std::sqrt(ss / gs + eps);
      for (int i = g * gs; i < (g + 1) * gs; ++i) {
        const double gate = silu(zxbcdt[std::size_t(r) * F + i]);
        const double v = y[std::size_t(r) * E + i] * (c.norm_before_gate ? 1.0 : gate);
        double o = v * rstd * w.at("norm.weight")[i];
        if (c.norm_before_gate) o *= gate;
        normed[std::size_t(r) * E + i] = o;
      }
    }
  // out_proj.
  return linear(normed, rows, E, w_out, Dm, c.bias ? &w.at("out_proj.bias") : nullptr);
}

// d(Σ out·dout)/d(every parameter, and "u") by central differences of the reference.
Params ref_gradients(const Problem& P, double step) {
  return central_differences([&](const Params& w, const std::vector<double>& u) { return ref_forward(P, w, u); },
                             P.params, P.u, P.dout, step);
}

// ----------------------------------------------------------------------------------------------
// Running the kernel mixer.

template <class Exec>
struct Harness : MixerHarness<Exec, kmamba::Mamba2Mixer<Exec>> {
  explicit Harness(const Problem& P)
      : MixerHarness<Exec, kmamba::Mamba2Mixer<Exec>>(P.cfg, prefix, P.params, P.c.batch, P.c.seqlen, P.u, P.dout) {}
};

std::vector<Case> forward_cases() {
  Case a;  // one group, seqlen not a multiple of the chunk
  std::tie(a.ngroups, a.seqlen, a.chunk, a.seed) = std::make_tuple(1, 13, 4, 11);
  Case b;  // two groups, norm before gate, no conv bias, linear biases
  std::tie(b.seqlen, b.chunk, b.conv_bias, b.bias, b.norm_before_gate, b.seed) =
      std::make_tuple(9, 8, false, true, true, 12);
  Case c;  // dt limits that clamp some tokens, a single short chunk
  std::tie(c.batch, c.seqlen, c.chunk, c.dt_limit_min, c.dt_limit_max, c.seed) =
      std::make_tuple(3, 5, 16, 0.1, 0.4, 13);
  Case d;  // the golden model's mixer shape: 8 heads × 16, d_state 16, 2 groups, 37 tokens in chunks of 8
  std::tie(d.d_model, d.headdim, d.d_state, d.seqlen, d.chunk, d.seed) = std::make_tuple(64, 16, 16, 37, 8, 14);
  Case e;  // one group, norm before gate, a width-2 conv, batch 1
  std::tie(e.ngroups, e.d_conv, e.norm_before_gate, e.batch, e.seqlen, e.chunk, e.seed) =
      std::make_tuple(1, 2, true, 1, 6, 4, 15);
  // The configuration's chunk (Mamba-2's 256) above ssd_preferred_chunk_size: computed in chunks of
  // 64, three of them, the last partial.
  Case f;
  std::tie(f.batch, f.seqlen, f.chunk, f.seed) = std::make_tuple(1, 150, 256, 16);
  return {a, b, c, d, e, f};
}

std::vector<Case> gradient_cases() {
  Case a;  // two groups, biases everywhere, three chunks (the last partial)
  std::tie(a.seqlen, a.chunk, a.bias, a.seed) = std::make_tuple(11, 4, true, 21);
  Case b;  // one group, norm before gate, no conv bias, dt limits
  std::tie(b.ngroups, b.seqlen, b.chunk, b.conv_bias, b.norm_before_gate, b.dt_limit_min, b.dt_limit_max, b.seed) =
      std::make_tuple(1, 9, 4, false, true, 0.1, 0.5, 22);
  Case c;  // a configured chunk of 256 computed in chunks of 64 (ssd_preferred_chunk_size)
  std::tie(c.batch, c.seqlen, c.chunk, c.seed) = std::make_tuple(1, 70, 256, 23);
  return {a, b, c};
}

KMAMBA_BACKEND_TEST_SUITE(Mamba2Mixer);

// ----------------------------------------------------------------------------------------------
// The reference itself.

TEST(Mamba2MixerReference, FiniteDifferencesAreConverged) {
  for_each_problem(gradient_cases(), make_problem,
                   [&](const Problem& P) { expect_converged(ref_gradients(P, 1e-5), ref_gradients(P, 2.5e-6)); });
}

// ----------------------------------------------------------------------------------------------
// Kernel against the reference.

TYPED_TEST(Mamba2Mixer, ForwardMatchesReference) {
  expect_forward_matches_reference<Harness<TypeParam>>(forward_cases(), make_problem, ref_forward, 1e-4);
}

TYPED_TEST(Mamba2Mixer, BackwardMatchesReferenceGradients) {
  expect_backward_matches_reference<Harness<TypeParam>>(gradient_cases(), make_problem, ref_gradients, 1e-4);
}

// With bf16 matmul precision the mixer's SSD forward is the fused tensor-core one when its shape
// allows (headdim 64, chunk 64): the in_proj/out_proj GEMMs and the SSD's products then take bf16
// operands. Each output is a sum of products whose factors carry relative rounding ≤ 2^-9 each,
// through two projections and the SSD's chains (≤ 3 rounded factors per term, tests/core/TestSsd),
// so against the double reference max|Δ| ≤ 2^-4·max|ref| holds with room (the fp32 bound is 1e-4);
// the result must also differ from the fp32 mixer's, or the bf16 path did not run.
TYPED_TEST(Mamba2Mixer, Bf16ForwardFollowsTheReference) {
  using Exec = TypeParam;
  Case c;
  c.batch = 1;
  c.seqlen = 70;  // one full chunk of 64 and a partial one
  c.d_model = 64;
  c.headdim = 64;  // 2 heads
  c.ngroups = 1;
  c.d_state = 16;
  c.chunk = 64;
  c.seed = 31;
  const Problem P = make_problem(c);
  const std::vector<double> ref = ref_forward(P, P.params, P.u);
  Harness<Exec> h32(P);
  const std::vector<double> out32 = h32.forward(false);
  expect_close("out (fp32)", out32, ref, 1e-4);
  Harness<Exec> h16(P);
  h16.mixer.set_matmul_precision(kmamba::MatmulPrecision::BFloat16);
  const std::vector<double> out16 = h16.forward(false);
  expect_close("out (bf16)", out16, ref, 1.0 / 16);
  double diff = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    diff = std::max(diff, std::abs(out16[i] - out32[i]));
    scale = std::max(scale, std::abs(ref[i]));
  }
  EXPECT_GT(diff, 1e-4 * scale) << "the bf16 mixer computed as fp32";
}

TYPED_TEST(Mamba2Mixer, OneMixerRunsSeveralShapes) {
  using Exec = TypeParam;
  using T3 = kmamba::Tensor3<float, typename Exec::memory_space>;
  Case c;
  c.seqlen = 10;
  c.seed = 61;
  const Problem first = make_problem(c);
  c.batch = 3;
  c.seqlen = 5;
  const Problem second = make_problem(c);  // the same parameters (drawn before the inputs)
  ASSERT_EQ(first.params, second.params);
  Harness<Exec> h(first);
  h.forward(true);
  const T3 u = kmamba::allocate_uninitialized<T3>("kmamba::test::u2", c.batch, c.seqlen, c.d_model);
  const T3 out("kmamba::test::out2", c.batch, c.seqlen, c.d_model);
  const T3 dout = kmamba::allocate_uninitialized<T3>("kmamba::test::dout2", c.batch, c.seqlen, c.d_model);
  const T3 du("kmamba::test::du2", c.batch, c.seqlen, c.d_model);
  upload(u, second.u);
  upload(dout, second.dout);
  h.mixer.forward(Exec(), h.slab, u, out, true);
  Kokkos::fence();
  expect_close("out of the second shape", host_doubles(out), ref_forward(second, second.params, second.u), 1e-4);
  h.mixer.backward(Exec(), h.slab, dout, du);
  Kokkos::fence();
  expect_close("du of the second shape", host_doubles(du), ref_gradients(second, 1e-5).at("u"), 1e-4);
  expect_close("out of the first shape again", h.forward(false), ref_forward(first, first.params, first.u), 1e-4);
}

TYPED_TEST(Mamba2Mixer, BackwardAddsIntoTheGradients) {
  using Exec = TypeParam;
  Case c;
  c.bias = true;
  c.seqlen = 10;
  c.seed = 41;
  const Problem P = make_problem(c);
  Harness<Exec> h(P);
  expect_backward_adds_into_gradients(h, P.params);
}

TYPED_TEST(Mamba2Mixer, RejectsBadShapesAndMissingActivations) {
  using Exec = TypeParam;
  Case c;
  c.seed = 51;
  const Problem P = make_problem(c);
  Harness<Exec> h(P);
  expect_mixer_shape_errors<Exec>(h, "Mamba2Mixer");
  // A config of another mixer kind.
  kmamba::ModelConfig mamba1 = P.cfg;
  mamba1.mixer = kmamba::MixerKind::Mamba1;
  expect_user_error([&] { kmamba::Mamba2Mixer<Exec> m(mamba1, prefix); }, {"Mamba1"});
}

// Documents across SSD chunk boundaries, of one token, and shorter than the conv window.
TYPED_TEST(Mamba2Mixer, PackedRowsEqualDocumentsAlone) {
  Case c;
  c.batch = 3;
  c.seqlen = 41;
  expect_packed_rows_equal_documents_alone<TypeParam, kmamba::Mamba2Mixer<TypeParam>>(c.config(), c.batch, c.seqlen, 71,
                                                                                      1e-5);
}

TYPED_TEST(Mamba2Mixer, InitializesAsTheReference) {
  using Exec = TypeParam;
  Case c;
  std::tie(c.d_model, c.headdim, c.d_state, c.bias) = std::make_tuple(32, 8, 8, true);
  kmamba::ModelConfig cfg = c.config();
  cfg.n_layer = 4;
  const auto init = [&](const std::string& p, std::uint64_t seed) {
    return initialized_parameters<Exec, kmamba::Mamba2Mixer<Exec>>(cfg, p, seed);
  };
  const Params w = init(prefix, 7);
  const double E = cfg.d_inner();
  expect_uniform("in_proj.weight", w.at("in_proj.weight"), 1.0 / std::sqrt(double(cfg.d_model)));
  expect_uniform("conv1d.weight", w.at("conv1d.weight"), 1.0 / std::sqrt(double(cfg.d_conv)));
  expect_uniform("conv1d.bias", w.at("conv1d.bias"), 1.0 / std::sqrt(double(cfg.d_conv)));
  expect_uniform("out_proj.weight", w.at("out_proj.weight"), 1.0 / std::sqrt(E) / std::sqrt(double(cfg.n_layer)));
  for (double v : w.at("in_proj.bias")) EXPECT_EQ(v, 0.0);
  for (double v : w.at("out_proj.bias")) EXPECT_EQ(v, 0.0);
  for (double v : w.at("D")) EXPECT_EQ(v, 1.0);
  for (double v : w.at("norm.weight")) EXPECT_EQ(v, 1.0);
  for (double v : w.at("A_log")) {
    EXPECT_GE(std::exp(v), 1.0 - 1e-6);
    EXPECT_LT(std::exp(v), 16.0 + 1e-5);
  }
  for (double v : w.at("dt_bias")) {
    const double dt = softplus(v);  // invsp undone
    EXPECT_GE(dt, cfg.dt_min * (1.0 - 1e-4));
    EXPECT_LE(dt, cfg.dt_max * (1.0 + 1e-4));
  }
  // Deterministic in the seed; another seed or another layer's prefix draws other values.
  const Params again = init(prefix, 7);
  const Params reseeded = init(prefix, 8);
  const Params other_layer = init("backbone.layers.2.mixer.", 7);
  for (const auto& entry : w) {
    EXPECT_EQ(again.at(entry.first), entry.second) << entry.first;
    const bool random = entry.first != "D" && entry.first != "norm.weight" && entry.first != "in_proj.bias" &&
                        entry.first != "out_proj.bias";
    if (random) {
      EXPECT_NE(reseeded.at(entry.first), entry.second) << entry.first;
      EXPECT_NE(other_layer.at(entry.first), entry.second) << entry.first;
    }
  }
  // Without the prenorm-residual rescale, out_proj uses the plain bound.
  cfg.rescale_prenorm_residual = false;
  expect_uniform("out_proj.weight (no rescale)", init(prefix, 7).at("out_proj.weight"), 1.0 / std::sqrt(E));
}

// ----------------------------------------------------------------------------------------------
// The golden checkpoint's names and shapes.

TEST(Mamba2MixerGolden, DeclaresTheCheckpointsParameters) {
  using Exec = Kokkos::DefaultHostExecutionSpace;
  using Mem = Exec::memory_space;
  const std::string dir = kmamba::test::golden_dir() + "/tiny_mamba2";
  const kmamba::ModelConfig cfg = kmamba::ModelConfig::load(dir + "/config.json");
  ASSERT_EQ(cfg.mixer, kmamba::MixerKind::Mamba2);
  const kmamba::SafeTensorsReader file(dir + "/model.safetensors");
  for (int layer = 0; layer < cfg.n_layer; ++layer) {
    const std::string p = "backbone.layers." + std::to_string(layer) + ".mixer.";
    SCOPED_TRACE(p);
    kmamba::Mamba2Mixer<Exec> mixer(cfg, p);
    EXPECT_EQ(mixer.prefix(), p);
    kmamba::ParameterSlab<Mem> slab;
    mixer.declare_parameters(slab);
    const std::size_t in_file = expect_declared_as_in_file(slab, file, p);
    EXPECT_EQ(in_file, slab.entries().size()) << "declared parameters missing from the checkpoint";
    for (const auto& e : slab.entries()) {
      const bool decayed =
          e.name == p + "in_proj.weight" || e.name == p + "out_proj.weight" || e.name == p + "conv1d.weight";
      EXPECT_EQ(e.decay, decayed ? kmamba::WeightDecay::Yes : kmamba::WeightDecay::No) << e.name;
    }
    EXPECT_EQ(in_file, 8u);
  }
}

}  // namespace
