// The Mamba-3 mixer against the golden file `mamba3_block_small` (output, grad of u and of every
// parameter), against a naive double-precision reference written from docs/algorithms.md §3.1–§3.6
// (in_proj, B/C RMSNorm, heavy-tail A, softplus Δ, data-dependent rotary angles, the
// exponential-trapezoidal recurrence token by token, D skip, z gate or output norm, MIMO
// projections, out_proj), its gradients against central finite differences of that reference,
// prefill + step against the forward, gradient accumulation, errors and initialisation.
//
// Tolerances (largest errors observed on Serial/OpenMP in brackets):
// - golden (fp32 reference): ‖Δ‖/‖ref‖ ≤ 1e-3 per tensor (the golden README) [4.1e-7]; the double
//   reference itself against the golden output: 1e-5;
// - forward against the double reference: max|Δ| ≤ 1e-4·max|ref| [2.9e-7];
// - gradients against central differences of the double reference (step 1e-5): 2e-4·max|ref| [2.9e-6];
// - prefill/step against the forward: 1e-4·max|ref|; a second backward doubles the gradients: 1e-5.
#include <kmamba/core/Core.hpp>
#include <kmamba/models/Config.hpp>
#include <kmamba/models/Mamba3Mixer.hpp>
#include <kmamba/models/Mixer.hpp>
#include <kmamba/models/ParameterSlab.hpp>
#include <kmamba/models/SafeTensors.hpp>
#include "TestData.hpp"

#include "Activations.hpp"
#include "Backends.hpp"
#include "Checks.hpp"
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
constexpr double pi = 3.14159265358979323846;

// ----------------------------------------------------------------------------------------------
// Problem description and the double reference.

struct Case {
  int batch = 2, seqlen = 7, d_model = 8, expand = 2, headdim = 4, ngroups = 2, d_state = 8, chunk = 4;
  double rope_fraction = 0.5;
  bool mimo = false, outproj_norm = false;
  int rank = 2;
  std::uint64_t seed = 1;

  kmamba::ModelConfig config() const {
    kmamba::ModelConfig c = model_config(kmamba::MixerKind::Mamba3, {d_model, 3, 16, d_state, headdim, chunk, ngroups});
    std::tie(c.expand, c.rope_fraction, c.is_mimo, c.mimo_rank, c.is_outproj_norm) =
        std::tie(expand, rope_fraction, mimo, rank, outproj_norm);
    c.validate();
    return c;
  }

  std::string describe() const {
    std::ostringstream s;
    s << "batch=" << batch << " seqlen=" << seqlen << " d_model=" << d_model << " headdim=" << headdim
      << " ngroups=" << ngroups << " d_state=" << d_state << " chunk=" << chunk << " rope_fraction=" << rope_fraction
      << " mimo=" << mimo << " rank=" << rank << " outproj_norm=" << outproj_norm << " seed=" << seed;
    return s.str();
  }
};

using Params = NamedTensors;  // names without the prefix

struct Problem {
  Case c;
  kmamba::ModelConfig cfg;
  Params params;
  std::vector<double> u, dout;  // (batch, seqlen, d_model)

  int E() const { return cfg.d_inner(); }
  int H() const { return cfg.num_heads(); }
  int R() const { return cfg.is_mimo ? cfg.mimo_rank : 1; }
  int S() const {
    const int split = static_cast<int>(std::floor(cfg.d_state * cfg.rope_fraction));
    return (split - split % 2) / 2;
  }
  int RGN() const { return R() * cfg.ngroups * cfg.d_state; }
  int F() const { return 2 * E() + 2 * RGN() + 3 * H() + S(); }
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
  const std::size_t Dm = c.d_model, E = P.E(), H = P.H(), F = P.F(), N = c.d_state, R = P.R(), hd = c.headdim;
  const double in_bound = 1.0 / std::sqrt(double(Dm)), out_bound = 1.0 / std::sqrt(double(E));
  P.params["in_proj.weight"] = uniform(F * Dm, -in_bound, in_bound);
  P.params["dt_bias"] = uniform(H, -2.5, 0.0);
  P.params["B_bias"] = uniform(H * R * N, 0.3, 1.3);
  P.params["C_bias"] = uniform(H * R * N, 0.3, 1.3);
  P.params["B_norm.weight"] = uniform(N, 0.5, 1.5);
  P.params["C_norm.weight"] = uniform(N, 0.5, 1.5);
  P.params["D"] = uniform(H, 0.5, 1.5);
  if (c.mimo) {
    P.params["mimo_x"] = uniform(H * R * hd, 0.2, 1.2);
    P.params["mimo_z"] = uniform(H * R * hd, 0.5, 1.5);
    P.params["mimo_o"] = uniform(H * R * hd, 0.2, 1.2);
  }
  if (c.outproj_norm) P.params["norm.weight"] = uniform(E, 0.5, 1.5);
  P.params["out_proj.weight"] = uniform(Dm * E, -out_bound, out_bound);
  const std::size_t n = std::size_t(c.batch) * c.seqlen * Dm;
  P.u = uniform(n, -1.5, 1.5);
  P.dout = uniform(n, -1.0, 1.0);
  return P;
}

// out (batch, seqlen, d_model) of the mixer, written from the spec with every loop explicit.
std::vector<double> ref_forward(const Problem& P, const Params& w, const std::vector<double>& u) {
  const Case& c = P.c;
  const int Dm = c.d_model, E = P.E(), H = P.H(), hd = c.headdim, G = c.ngroups, N = c.d_state, R = P.R();
  const int S = P.S(), F = P.F(), RGN = P.RGN();
  const double eps = P.cfg.norm_epsilon, A_floor = P.cfg.A_floor;
  const std::vector<double>& w_in = w.at("in_proj.weight");
  const std::vector<double>& w_out = w.at("out_proj.weight");
  const auto param = [&](const char* name, int i) { return w.at(name)[std::size_t(i)]; };
  std::vector<double> out(std::size_t(c.batch) * c.seqlen * Dm);
  for (int b = 0; b < c.batch; ++b) {
    // in_proj: (seqlen, F) = [z | x | B (R, G, N) | C | dd_dt | dd_A | trap | angle].
    std::vector<double> proj(std::size_t(c.seqlen) * F);
    for (int t = 0; t < c.seqlen; ++t)
      for (int f = 0; f < F; ++f) {
        double s = 0.0;
        for (int k = 0; k < Dm; ++k) s += u[(std::size_t(b) * c.seqlen + t) * Dm + k] * w_in[std::size_t(f) * Dm + k];
        proj[std::size_t(t) * F + f] = s;
      }
    std::vector<double> o(std::size_t(c.seqlen) * E, 0.0);
    for (int h = 0; h < H; ++h) {
      const int g = h / (H / G);
      std::vector<double> state(std::size_t(hd) * N, 0.0), theta(S, 0.0);
      std::vector<std::vector<double>> k_prev(R, std::vector<double>(N, 0.0)), v_prev(R, std::vector<double>(hd, 0.0));
      for (int t = 0; t < c.seqlen; ++t) {
        const double* row = &proj[std::size_t(t) * F];
        const double* z = row;
        const double* x = row + E;
        const double* Bp = row + 2 * E;
        const double* Cp = row + 2 * E + RGN;
        const double* tail = row + 2 * E + 2 * RGN;
        const double delta = softplus(tail[h] + param("dt_bias", h));
        const double v = tail[H + h];
        const double f = v >= 0.0 ? 1.0 + v : 1.0 / (1.0 - v);
        const double A = std::min(-f, -A_floor);
        const double alpha = std::exp(A * delta), lambda = sigmoid(tail[2 * H + h]);
        const double beta = (1.0 - lambda) * delta * alpha, gamma = lambda * delta;
        for (int i = 0; i < S; ++i) theta[i] += pi * std::tanh(tail[3 * H + i]) * delta;
        std::vector<std::vector<double>> k(R, std::vector<double>(N)), q(R, std::vector<double>(N)),
            vr(R, std::vector<double>(hd));
        for (int r = 0; r < R; ++r) {
          const auto normed = [&](const double* src, const char* weight, const char* bias, std::vector<double>& dst) {
            double ss = 0.0;
            for (int n = 0; n < N; ++n) ss += src[n] * src[n];
            const double rstd = 1.0 / std::sqrt(ss / N + eps);
            for (int n = 0; n < N; ++n) dst[n] = src[n] * rstd * param(weight, n) + param(bias, (h * R + r) * N + n);
            for (int i = 0; i < S; ++i) {  // adjacent pairs (2i, 2i + 1)
              const double p0 = dst[2 * i], p1 = dst[2 * i + 1];
              dst[2 * i] = p0 * std::cos(theta[i]) - p1 * std::sin(theta[i]);
              dst[2 * i + 1] = p0 * std::sin(theta[i]) + p1 * std::cos(theta[i]);
            }
          };
          normed(Bp + (r * G + g) * N, "B_norm.weight", "B_bias", k[r]);
          normed(Cp + (r * G + g) * N, "C_norm.weight", "C_bias", q[r]);
          for (int p = 0; p < hd; ++p)
            vr[r][p] = x[h * hd + p] * (c.mimo ? param("mimo_x", (h * R + r) * hd + p) : 1.0);
        }
        for (int p = 0; p < hd; ++p)
          for (int n = 0; n < N; ++n) {
            double s = alpha * state[std::size_t(p) * N + n];
            for (int r = 0; r < R; ++r) s += beta * v_prev[r][p] * k_prev[r][n] + gamma * vr[r][p] * k[r][n];
            state[std::size_t(p) * N + n] = s;
          }
        for (int r = 0; r < R; ++r) {
          std::vector<double> y(hd);
          for (int p = 0; p < hd; ++p) {
            double s = param("D", h) * vr[r][p];
            for (int n = 0; n < N; ++n) s += state[std::size_t(p) * N + n] * q[r][n];
            y[p] = s;
          }
          double rstd = 1.0;
          if (c.outproj_norm) {
            double ss = 0.0;
            for (int p = 0; p < hd; ++p) ss += y[p] * y[p];
            rstd = 1.0 / std::sqrt(ss / hd + eps);
          }
          for (int p = 0; p < hd; ++p) {
            const int i = h * hd + p;
            const double yn = c.outproj_norm ? y[p] * rstd * param("norm.weight", i) : y[p];
            const double zz = z[i] * (c.mimo ? param("mimo_z", (h * R + r) * hd + p) : 1.0);
            o[std::size_t(t) * E + i] += yn * silu(zz) * (c.mimo ? param("mimo_o", (h * R + r) * hd + p) : 1.0);
          }
        }
        k_prev = k;
        v_prev = vr;
      }
    }
    for (int t = 0; t < c.seqlen; ++t)
      for (int m = 0; m < Dm; ++m) {
        double s = 0.0;
        for (int i = 0; i < E; ++i) s += o[std::size_t(t) * E + i] * w_out[std::size_t(m) * E + i];
        out[(std::size_t(b) * c.seqlen + t) * Dm + m] = s;
      }
  }
  return out;
}

// d(Σ out·dout)/d(every parameter, and "u") by central differences of the reference.
Params ref_gradients(const Problem& P, double step) {
  return central_differences([&](const Params& w, const std::vector<double>& u) { return ref_forward(P, w, u); },
                             P.params, P.u, P.dout, step);
}

// ----------------------------------------------------------------------------------------------
// Device side.

template <class Exec>
struct Harness : MixerHarness<Exec, kmamba::Mamba3Mixer<Exec>> {
  Harness(const kmamba::ModelConfig& cfg, const Params& params, int batch, int seqlen, const std::vector<double>& u,
          const std::vector<double>& dout)
      : MixerHarness<Exec, kmamba::Mamba3Mixer<Exec>>(cfg, prefix, params, batch, seqlen, u, dout) {}
  explicit Harness(const Problem& P) : Harness(P.cfg, P.params, P.c.batch, P.c.seqlen, P.u, P.dout) {}
};

// ‖kernel − ref‖ / ‖ref‖ ≤ tol (the golden README's measure).
double expect_close_norm(const std::string& what, const std::vector<double>& kernel, const std::vector<double>& ref,
                         double tol) {
  EXPECT_EQ(kernel.size(), ref.size()) << what;
  double diff = 0.0, norm = 0.0;
  for (std::size_t i = 0; i < std::min(kernel.size(), ref.size()); ++i) {
    diff += (kernel[i] - ref[i]) * (kernel[i] - ref[i]);
    norm += ref[i] * ref[i];
  }
  EXPECT_GT(norm, 0.0) << what;
  const double rel = std::sqrt(diff / norm);
  EXPECT_LE(rel, tol) << what << ": ‖Δ‖/‖ref‖ = " << rel;
  return rel;
}

std::vector<Case> forward_cases() {
  Case a;  // SISO, one group, seqlen not a multiple of the chunk
  std::tie(a.ngroups, a.seqlen, a.seed) = std::make_tuple(1, 13, 11);
  Case b;  // SISO, two groups, rope_fraction 1, output norm, one partial chunk
  std::tie(b.rope_fraction, b.outproj_norm, b.seqlen, b.chunk, b.seed) = std::make_tuple(1.0, true, 9, 16, 12);
  Case c;  // MIMO rank 2, two groups, chunk 8 / 2
  std::tie(c.mimo, c.seqlen, c.chunk, c.seed) = std::make_tuple(true, 11, 8, 13);
  Case d;  // MIMO rank 4, rope_fraction 1, seqlen 1
  std::tie(d.mimo, d.rank, d.rope_fraction, d.seqlen, d.batch, d.seed) = std::make_tuple(true, 4, 1.0, 1, 3, 14);
  Case e;  // MIMO rank 1, one group, batch 1
  std::tie(e.mimo, e.rank, e.ngroups, e.batch, e.seqlen, e.seed) = std::make_tuple(true, 1, 1, 1, 10, 15);
  Case f;  // SISO seqlen 1, wider state
  std::tie(f.seqlen, f.d_state, f.seed) = std::make_tuple(1, 16, 16);
  return {a, b, c, d, e, f};
}

std::vector<Case> gradient_cases() {
  Case a;  // SISO, two groups, output norm, three chunks (the last partial)
  std::tie(a.seqlen, a.outproj_norm, a.seed) = std::make_tuple(10, true, 21);
  Case b;  // SISO, one group, rope_fraction 1, z gate
  std::tie(b.ngroups, b.rope_fraction, b.seqlen, b.seed) = std::make_tuple(1, 1.0, 6, 22);
  Case c;  // MIMO rank 2, two groups
  std::tie(c.mimo, c.seqlen, c.seed) = std::make_tuple(true, 7, 23);
  return {a, b, c};
}

KMAMBA_BACKEND_TEST_SUITE(Mamba3Mixer);

// ----------------------------------------------------------------------------------------------
// The golden file.

struct Golden {
  kmamba::ModelConfig cfg;
  Params params;
  std::vector<double> u, out, dout;
  Params grads;  // "u" and every parameter
  int batch = 0, seqlen = 0;
};

Golden load_golden() {
  const kmamba::SafeTensorsReader file(kmamba::test::golden_dir() + "/mamba3_block_small.safetensors");
  Golden g;
  kmamba::ModelConfig& c = g.cfg;
  c.mixer = kmamba::MixerKind::Mamba3;
  c.d_model = static_cast<int>(file.config_number("d_model", 0));
  c.d_state = static_cast<int>(file.config_number("d_state", 0));
  c.expand = static_cast<int>(file.config_number("expand", 0));
  c.headdim = static_cast<int>(file.config_number("headdim", 0));
  c.ngroups = static_cast<int>(file.config_number("ngroups", 0));
  c.rope_fraction = file.config_number("rope_fraction", 0);
  c.is_mimo = file.config_bool("is_mimo", true);
  c.A_floor = file.config_number("A_floor", 0);
  c.norm_epsilon = file.config_number("rmsnorm_eps", 0);
  c.chunk_size = 8;  // 24 tokens: three chunks
  c.n_layer = 1;
  c.vocab_size = 16;
  c.validate();
  EXPECT_EQ(c.num_heads(), static_cast<int>(file.config_number("nheads", 0)));
  const auto values = [&](const std::string& name) {
    const std::vector<float> f = file.read_f32(name);
    return std::vector<double>(f.begin(), f.end());
  };
  for (const std::string& name : file.names()) {
    if (name.compare(0, 6, "param.") == 0) g.params[name.substr(6)] = values(name);
    if (name.compare(0, 5, "grad.") == 0) g.grads[name.substr(5)] = values(name);
  }
  g.u = values("u");
  g.out = values("out");
  g.dout = values("dout");
  g.batch = static_cast<int>(file.info("u").shape[0]);
  g.seqlen = static_cast<int>(file.info("u").shape[1]);
  return g;
}

TEST(Mamba3MixerReference, MatchesTheGoldenOutput) {
  const Golden g = load_golden();
  Problem P;
  P.cfg = g.cfg;
  P.c.batch = g.batch;
  P.c.seqlen = g.seqlen;
  P.c.d_model = g.cfg.d_model;
  P.c.headdim = g.cfg.headdim;
  P.c.ngroups = g.cfg.ngroups;
  P.c.d_state = g.cfg.d_state;
  P.c.rope_fraction = g.cfg.rope_fraction;
  P.params = g.params;
  expect_close_norm("reference out", ref_forward(P, g.params, g.u), g.out, 1e-5);
}

TYPED_TEST(Mamba3Mixer, MatchesTheGoldenBlock) {
  using Exec = TypeParam;
  const Golden g = load_golden();
  Harness<Exec> h(g.cfg, g.params, g.batch, g.seqlen, g.u, g.dout);
  for (const auto& e : h.slab.entries()) {
    EXPECT_EQ(g.params.count(e.name.substr(prefix.size())), 1u) << e.name << " is declared but not in the golden file";
  }
  double worst = expect_close_norm("out", h.forward(true), g.out, 1e-3);
  worst = std::max(worst, expect_close_norm("grad.u", h.backward(), g.grads.at("u"), 1e-3));
  for (const auto& entry : g.params) {
    worst =
        std::max(worst, expect_close_norm("grad." + entry.first, h.grad(entry.first), g.grads.at(entry.first), 1e-3));
  }
  std::printf("largest golden error ‖Δ‖/‖ref‖: %.3g\n", worst);
}

// ----------------------------------------------------------------------------------------------
// The double reference.

TEST(Mamba3MixerReference, FiniteDifferencesAreConverged) {
  Case c = gradient_cases().front();
  c.seqlen = 5;
  const Problem P = make_problem(c);
  expect_converged(ref_gradients(P, 1e-5), ref_gradients(P, 2.5e-6));
}

TYPED_TEST(Mamba3Mixer, ForwardMatchesReference) {
  expect_forward_matches_reference<Harness<TypeParam>>(forward_cases(), make_problem, ref_forward, 1e-4);
}

TYPED_TEST(Mamba3Mixer, BackwardMatchesReferenceGradients) {
  expect_backward_matches_reference<Harness<TypeParam>>(gradient_cases(), make_problem, ref_gradients, 2e-4);
}

TYPED_TEST(Mamba3Mixer, BackwardAddsIntoTheGradients) {
  using Exec = TypeParam;
  Case c;
  c.mimo = true;
  c.seqlen = 6;
  c.seed = 41;
  const Problem P = make_problem(c);
  Harness<Exec> h(P);
  expect_backward_adds_into_gradients(h, P.params);
}

// prefill of the first tokens, a decode step per token, prefill of the rest: the forward's outputs.
TYPED_TEST(Mamba3Mixer, PrefillAndStepMatchTheForward) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  std::vector<Case> cases(3);
  cases[0].seqlen = 12;
  cases[0].seed = 71;
  cases[1].seqlen = 11;
  cases[1].outproj_norm = true;
  cases[1].ngroups = 1;
  cases[1].rope_fraction = 1.0;
  cases[1].seed = 72;
  cases[2].seqlen = 10;
  cases[2].mimo = true;
  cases[2].chunk = 8;
  cases[2].seed = 73;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.describe());
    const Problem P = make_problem(c);
    Harness<Exec> h(P);
    const std::vector<double> full = h.forward(false);
    const int Dm = c.d_model, first = 5, steps = 3;
    const auto u_host = kmamba::test::to_host(h.u);
    std::vector<double> pieced(full.size(), std::numeric_limits<double>::quiet_NaN());
    auto cache = h.mixer.make_cache(c.batch);
    const auto run_prefill = [&](int begin, int end) {
      const T3 u("kmamba::test::u_part", c.batch, end - begin, Dm),
          out("kmamba::test::out_part", c.batch, end - begin, Dm);
      auto uh = Kokkos::create_mirror_view(u);
      for (int b = 0; b < c.batch; ++b)
        for (int t = begin; t < end; ++t)
          for (int m = 0; m < Dm; ++m) uh(b, t - begin, m) = u_host(b, t, m);
      Kokkos::deep_copy(u, uh);
      h.mixer.prefill(Exec(), h.slab, u, out, *cache);
      Kokkos::fence();
      const auto oh = kmamba::test::to_host(out);
      for (int b = 0; b < c.batch; ++b)
        for (int t = begin; t < end; ++t)
          for (int m = 0; m < Dm; ++m) pieced[(std::size_t(b) * c.seqlen + t) * Dm + m] = oh(b, t - begin, m);
    };
    run_prefill(0, first);
    const T2 tok("kmamba::test::token", c.batch, Dm), tok_out("kmamba::test::token_out", c.batch, Dm);
    for (int t = first; t < first + steps; ++t) {
      auto th = Kokkos::create_mirror_view(tok);
      for (int b = 0; b < c.batch; ++b)
        for (int m = 0; m < Dm; ++m) th(b, m) = u_host(b, t, m);
      Kokkos::deep_copy(tok, th);
      h.mixer.step(Exec(), h.slab, tok, tok_out, *cache);
      Kokkos::fence();
      const auto oh = kmamba::test::to_host(tok_out);
      for (int b = 0; b < c.batch; ++b)
        for (int m = 0; m < Dm; ++m) pieced[(std::size_t(b) * c.seqlen + t) * Dm + m] = oh(b, m);
    }
    run_prefill(first + steps, c.seqlen);
    expect_close("prefill + step + prefill", pieced, full, 1e-4);
    cache->reset(Exec());
    run_prefill(0, c.seqlen);
    expect_close("prefill after reset", pieced, full, 1e-4);
  }
}

// Packed rows: documents across chunk boundaries, of one token, at a row's end; SISO with the z
// gate and with the output norm, MIMO of rank 2 (chunks of 4 tokens) and of rank 4 (chunks of one
// token, so that every start is at a chunk's first token). Tolerance 1e-5 as Mamba-1/2 (the same
// arithmetic per token but for the grouping of the GEMMs' and the reductions' sums).
TYPED_TEST(Mamba3Mixer, PackedRowsEqualDocumentsAlone) {
  std::vector<Case> cases(4);
  cases[1].outproj_norm = true;
  cases[2].mimo = true;
  cases[2].chunk = 8;
  cases[3].mimo = true;
  cases[3].rank = 4;
  for (Case c : cases) {
    c.batch = 3;
    c.seqlen = 41;
    SCOPED_TRACE(c.describe());
    expect_packed_rows_equal_documents_alone<TypeParam, kmamba::Mamba3Mixer<TypeParam>>(c.config(), c.batch, c.seqlen,
                                                                                        91, 1e-5);
  }
}

// prefill over packed rows gives the packed forward's outputs, and leaves the states of each row's
// last document: a decode step after it equals the step after a prefill of that document alone.
template <class Exec>
void expect_prefill_of_packed_rows_continues_the_last_document(const Case& c) {
  using Mem = typename Exec::memory_space;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  const Problem P = make_problem(c);
  Harness<Exec> h(P);
  const Exec exec;
  const int Dm = c.d_model;
  h.mixer.set_sequence_ids(device_packed_ids<Mem>(c.batch, c.seqlen));
  const std::vector<double> packed = h.forward(false);
  auto cache = h.mixer.make_cache(c.batch);
  const T3 out = poisoned<T3>("kmamba::test::prefill_out", c.batch, c.seqlen, Dm);
  h.mixer.prefill(exec, h.slab, h.u, out, *cache);
  expect_close("prefill of packed rows", host_doubles(out), packed, 1e-5);
  const T2 tok("kmamba::test::token", c.batch, Dm);
  kmamba::fill_normal(exec, tok, 94, 0.0f, 1.0f);
  const T2 step_out = poisoned<T2>("kmamba::test::step_out", c.batch, Dm);
  h.mixer.step(exec, h.slab, tok, step_out, *cache);
  const auto step_h = to_host(step_out);
  h.mixer.set_sequence_ids({});
  const std::vector<std::int64_t> ids = packed_ids(c.batch, c.seqlen);
  for (int b = 0; b < c.batch; ++b) {
    const int t0 = documents(ids, c.seqlen, b).back().first, len = c.seqlen - t0;
    SCOPED_TRACE("row " + std::to_string(b) + ", last document from " + std::to_string(t0));
    const T3 doc("kmamba::test::last_document", 1, len, Dm), doc_out("kmamba::test::last_document_out", 1, len, Dm);
    Kokkos::deep_copy(doc, Kokkos::subview(h.u, std::make_pair(b, b + 1), std::make_pair(t0, c.seqlen), Kokkos::ALL));
    auto alone = h.mixer.make_cache(1);
    h.mixer.prefill(exec, h.slab, doc, doc_out, *alone);
    const T2 tok1("kmamba::test::token_alone", 1, Dm), out1("kmamba::test::step_alone", 1, Dm);
    Kokkos::deep_copy(tok1, Kokkos::subview(tok, std::make_pair(b, b + 1), Kokkos::ALL));
    h.mixer.step(exec, h.slab, tok1, out1, *alone);
    std::vector<double> packed_step;
    for (int m = 0; m < Dm; ++m) packed_step.push_back(step_h(b, m));
    expect_close("step after the packed prefill", host_doubles(out1), packed_step, 1e-5);
  }
}

// The packed prefill's check above, SISO and MIMO (chunks of 4 tokens).
TYPED_TEST(Mamba3Mixer, PrefillOfPackedRowsContinuesTheLastDocument) {
  for (const bool mimo : {false, true}) {
    Case c;
    c.batch = 3;
    c.seqlen = 23;
    c.mimo = mimo;
    if (mimo) c.chunk = 8;
    c.seed = 93;
    SCOPED_TRACE(c.describe());
    expect_prefill_of_packed_rows_continues_the_last_document<TypeParam>(c);
  }
}

TYPED_TEST(Mamba3Mixer, RejectsBadShapesAndMissingActivations) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using T2 = kmamba::Tensor2<float, Mem>;
  Case c;
  c.seed = 51;
  const Problem P = make_problem(c);
  Harness<Exec> h(P);
  expect_mixer_shape_errors<Exec>(h, "Mamba3Mixer");

  // Caches: another batch, another mixer's dimensions, a step of the wrong width.
  auto cache = h.mixer.make_cache(c.batch + 1);
  expect_user_error([&] { h.mixer.prefill(Exec(), h.slab, h.u, h.out, *cache); },
                    {"Mamba3Mixer::prefill", "3 sequences"});
  Case mimo = c;
  mimo.mimo = true;
  const Problem Q = make_problem(mimo);
  kmamba::Mamba3Mixer<Exec> other(Q.cfg, prefix);
  auto other_cache = other.make_cache(c.batch);
  expect_user_error([&] { h.mixer.prefill(Exec(), h.slab, h.u, h.out, *other_cache); },
                    {"not made by a Mamba-3 mixer"});
  auto good_cache = h.mixer.make_cache(c.batch);
  const T2 tok_wide("kmamba::test::tok_wide", c.batch, c.d_model + 1),
      tok_out("kmamba::test::tok_out", c.batch, c.d_model);
  expect_user_error([&] { h.mixer.step(Exec(), h.slab, tok_wide, tok_out, *good_cache); },
                    {"Mamba3Mixer::step", "(batch, d_model)"});
  expect_user_error([&] { h.mixer.make_cache(0); }, {"batch must be at least 1"});

  // Configs.
  kmamba::ModelConfig mamba2 = P.cfg;
  mamba2.mixer = kmamba::MixerKind::Mamba2;
  expect_user_error([&] { kmamba::Mamba3Mixer<Exec> m(mamba2, prefix); }, {"Mamba2"});
  kmamba::ModelConfig mimo_norm = Q.cfg;
  mimo_norm.is_outproj_norm = true;
  expect_user_error([&] { kmamba::Mamba3Mixer<Exec> m(mimo_norm, prefix); }, {"is_outproj_norm", "is_mimo"});
  kmamba::ModelConfig biased = P.cfg;
  biased.bias = true;
  expect_user_error([&] { kmamba::Mamba3Mixer<Exec> m(biased, prefix); }, {"bias"});
  EXPECT_NE(dynamic_cast<kmamba::Mamba3Mixer<Exec>*>(kmamba::make_mixer<Exec>(P.cfg, prefix).get()), nullptr);
}

TYPED_TEST(Mamba3Mixer, InitializesAsTheReference) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  Case c;
  c.d_model = 32;
  c.headdim = 8;
  c.d_state = 16;
  c.mimo = true;
  c.rank = 4;
  kmamba::ModelConfig cfg = c.config();
  cfg.n_layer = 4;
  // Weight decay on the two projections alone.
  const auto init = [&](const std::string& p, std::uint64_t seed) {
    kmamba::Mamba3Mixer<Exec> mixer(cfg, p);
    kmamba::ParameterSlab<Mem> slab;
    mixer.declare_parameters(slab);
    for (const auto& e : slab.entries()) {
      const bool decayed = e.name == p + "in_proj.weight" || e.name == p + "out_proj.weight";
      EXPECT_EQ(e.decay, decayed ? kmamba::WeightDecay::Yes : kmamba::WeightDecay::No) << e.name;
    }
    return initialized_parameters<Exec, kmamba::Mamba3Mixer<Exec>>(cfg, p, seed);
  };
  const Params w = init(prefix, 7);
  EXPECT_EQ(w.size(), 11u);
  const double E = cfg.d_inner();
  expect_uniform("in_proj.weight", w.at("in_proj.weight"), 1.0 / std::sqrt(double(cfg.d_model)));
  expect_uniform("out_proj.weight", w.at("out_proj.weight"), 1.0 / std::sqrt(E) / std::sqrt(double(cfg.n_layer)));
  for (const char* one : {"B_bias", "C_bias", "B_norm.weight", "C_norm.weight", "D", "mimo_z"}) {
    for (double v : w.at(one)) EXPECT_EQ(v, 1.0) << one;
  }
  for (const char* quarter : {"mimo_x", "mimo_o"}) {
    for (double v : w.at(quarter)) EXPECT_EQ(v, 0.25) << quarter;
  }
  for (double v : w.at("dt_bias")) {
    const double dt = softplus(v);
    EXPECT_GE(dt, cfg.dt_min * (1.0 - 1e-4));
    EXPECT_LE(dt, cfg.dt_max * (1.0 + 1e-4));
  }
  const Params again = init(prefix, 7);
  const Params reseeded = init(prefix, 8);
  const Params other_layer = init("backbone.layers.2.mixer.", 7);
  for (const char* random : {"in_proj.weight", "out_proj.weight", "dt_bias"}) {
    EXPECT_EQ(again.at(random), w.at(random)) << random;
    EXPECT_NE(reseeded.at(random), w.at(random)) << random;
    EXPECT_NE(other_layer.at(random), w.at(random)) << random;
  }
  cfg.is_mimo = false;
  cfg.is_outproj_norm = true;
  const Params siso = init(prefix, 7);
  EXPECT_EQ(siso.size(), 9u);
  EXPECT_EQ(siso.count("mimo_x"), 0u);
  for (double v : siso.at("norm.weight")) EXPECT_EQ(v, 1.0);
  // bc_bias_init sets the B and C biases alone (kmamba-train's recall default is 0.1).
  cfg.bc_bias_init = 0.1;
  const Params small_bias = init(prefix, 7);
  for (const char* bias : {"B_bias", "C_bias"}) {
    for (double v : small_bias.at(bias)) EXPECT_EQ(v, 0.1f) << bias;
  }
  for (const char* one : {"B_norm.weight", "C_norm.weight", "D", "norm.weight"}) {
    for (double v : small_bias.at(one)) EXPECT_EQ(v, 1.0) << one;
  }
  EXPECT_EQ(small_bias.at("in_proj.weight"), siso.at("in_proj.weight"));
  EXPECT_EQ(small_bias.at("dt_bias"), siso.at("dt_bias"));
}

}  // namespace
