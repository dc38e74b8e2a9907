// Mamba-1 mixer: forward and backward against a sequential double-precision reference written
// from docs/algorithms.md §1.2–§1.5 (token by token, every state kept; its backward is the adjoint of
// that recurrence), the reference backward against finite differences, the reference forward
// inside a double-precision LM against the golden Hugging Face logits, gradient accumulation,
// shape errors, the reference initialisation, and the parameter names and shapes of the golden
// checkpoint.
//
// Tolerances:
// - kernel (fp32) against the double reference, per tensor: max|kernel − ref| ≤ tol·max|ref| with
//   tol = 1e-4 for the output and every gradient.
// - reference backward against central finite differences of the reference loss (double, step
//   1e-6): |fd − analytic| ≤ 1e-6·(1 + |analytic|).
// - reference LM logits against the golden logits (HF, fp32): ‖Δ‖₂/‖ref‖₂ ≤ 1e-5.
// - calling backward twice: max|g₂ − 2·g₁| ≤ 1e-5·max|2·g₁| per tensor (the scan's dB and dC sum
//   channels with atomics, so the two calls may round differently on parallel backends).
// - a packed batch against its documents run one by one: 1e-5·max|ref| per tensor (the same
//   arithmetic per token but for the grouping of the GEMMs' and the reductions' sums).
#include "TestData.hpp"
#include <kmamba/core/Core.hpp>
#include <kmamba/models/Config.hpp>
#include <kmamba/models/Mamba1Mixer.hpp>
#include <kmamba/models/ParameterSlab.hpp>
#include <kmamba/models/SafeTensors.hpp>

#include "Activations.hpp"
#include "Backends.hpp"
#include "Checks.hpp"
#include "MixerChecks.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

namespace {

using namespace kmamba::test;
using namespace kmamba::reference;

// ----------------------------------------------------------------------------------------------
// Problem description and the double reference.

struct Problem {
  int batch = 2, seqlen = 7, d_model = 8, expand = 2, d_state = 4, d_conv = 4, dt_rank = 2;
  bool conv_bias = true, bias = false;

  int d_inner() const { return expand * d_model; }
  std::string describe() const {
    std::ostringstream s;
    s << "batch=" << batch << " seqlen=" << seqlen << " d_model=" << d_model << " d_inner=" << d_inner()
      << " d_state=" << d_state << " d_conv=" << d_conv << " dt_rank=" << dt_rank << " conv_bias=" << conv_bias
      << " bias=" << bias;
    return s.str();
  }
  kmamba::ModelConfig config() const {
    kmamba::ModelConfig c;
    c.mixer = kmamba::MixerKind::Mamba1;
    c.n_layer = 2;
    std::tie(c.d_model, c.expand, c.d_state, c.d_conv, c.dt_rank, c.conv_bias, c.bias) =
        std::tie(d_model, expand, d_state, d_conv, dt_rank, conv_bias, bias);
    return c;
  }
};

using Tensors = std::map<std::string, std::vector<double>>;  // name relative to the mixer -> row-major values

// The parameter names and shapes the mixer must declare (docs/algorithms.md §1.1).
std::map<std::string, std::vector<std::int64_t>> expected_parameters(const Problem& p) {
  const std::int64_t e = p.d_inner(), dm = p.d_model, n = p.d_state, r = p.dt_rank, w = p.d_conv;
  std::map<std::string, std::vector<std::int64_t>> s{{"in_proj.weight", {2 * e, dm}},
                                                     {"conv1d.weight", {e, 1, w}},
                                                     {"x_proj.weight", {r + 2 * n, e}},
                                                     {"dt_proj.weight", {e, r}},
                                                     {"dt_proj.bias", {e}},
                                                     {"A_log", {e, n}},
                                                     {"D", {e}},
                                                     {"out_proj.weight", {dm, e}}};
  if (p.conv_bias) s["conv1d.bias"] = {e};
  if (p.bias) {
    s["in_proj.bias"] = {2 * e};
    s["out_proj.bias"] = {dm};
  }
  return s;
}

// Everything the reference forward computes, (b, t, feature) row-major.
struct RefForward {
  std::vector<double> xz, pre, xc, dbl, draw, delta, h, ypre, y, out;
};

struct Reference {
  Problem p;
  Tensors w;  // parameters
  std::vector<double> u, dout;

  double param(const char* name, std::size_t i) const { return w.at(name)[i]; }
  double optional(const char* name, std::size_t i) const {
    const auto it = w.find(name);
    return it == w.end() ? 0.0 : it->second[i];
  }
  std::size_t tok(int b, int t) const { return static_cast<std::size_t>(b) * p.seqlen + t; }

  RefForward forward() const {
    const int B = p.batch, L = p.seqlen, Dm = p.d_model, E = p.d_inner(), N = p.d_state, W = p.d_conv, R = p.dt_rank,
              X = R + 2 * N;
    RefForward f;
    const std::size_t T = static_cast<std::size_t>(B) * L;
    f.xz.assign(T * 2 * E, 0.0);
    f.pre.assign(T * E, 0.0);
    f.xc.assign(T * E, 0.0);
    f.dbl.assign(T * X, 0.0);
    f.draw.assign(T * E, 0.0);
    f.delta.assign(T * E, 0.0);
    f.h.assign(T * E * N, 0.0);
    f.ypre.assign(T * E, 0.0);
    f.y.assign(T * E, 0.0);
    f.out.assign(T * Dm, 0.0);
    for (std::size_t m = 0; m < T; ++m)
      for (int j = 0; j < 2 * E; ++j) {
        double s = optional("in_proj.bias", j);
        for (int k = 0; k < Dm; ++k) s += param("in_proj.weight", j * Dm + k) * u[m * Dm + k];
        f.xz[m * 2 * E + j] = s;
      }
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < L; ++t)
        for (int c = 0; c < E; ++c) {
          double s = optional("conv1d.bias", c);
          for (int k = 0; k < W; ++k) {
            const int src = t - (W - 1) + k;
            if (src >= 0) s += param("conv1d.weight", c * W + k) * f.xz[tok(b, src) * 2 * E + c];
          }
          f.pre[tok(b, t) * E + c] = s;
          f.xc[tok(b, t) * E + c] = silu(s);
        }
    for (std::size_t m = 0; m < T; ++m) {
      for (int i = 0; i < X; ++i) {
        double s = 0.0;
        for (int c = 0; c < E; ++c) s += param("x_proj.weight", i * E + c) * f.xc[m * E + c];
        f.dbl[m * X + i] = s;
      }
      for (int c = 0; c < E; ++c) {
        double s = 0.0;
        for (int r = 0; r < R; ++r) s += param("dt_proj.weight", c * R + r) * f.dbl[m * X + r];
        f.draw[m * E + c] = s;
        f.delta[m * E + c] = softplus(s + param("dt_proj.bias", c));
      }
    }
    for (int b = 0; b < B; ++b)
      for (int c = 0; c < E; ++c)
        for (int t = 0; t < L; ++t) {
          const std::size_t m = tok(b, t);
          const double d = f.delta[m * E + c], x = f.xc[m * E + c];
          double y = param("D", c) * x;
          for (int n = 0; n < N; ++n) {
            const double A = -std::exp(param("A_log", c * N + n));
            const double prev = t == 0 ? 0.0 : f.h[(tok(b, t - 1) * E + c) * N + n];
            const double h = std::exp(d * A) * prev + d * f.dbl[m * X + R + n] * x;
            f.h[(m * E + c) * N + n] = h;
            y += f.dbl[m * X + R + N + n] * h;
          }
          f.ypre[m * E + c] = y;
          f.y[m * E + c] = y * silu(f.xz[m * 2 * E + E + c]);
        }
    for (std::size_t m = 0; m < T; ++m)
      for (int j = 0; j < Dm; ++j) {
        double s = optional("out_proj.bias", j);
        for (int c = 0; c < E; ++c) s += param("out_proj.weight", j * E + c) * f.y[m * E + c];
        f.out[m * Dm + j] = s;
      }
    return f;
  }

  double loss() const {
    const RefForward f = forward();
    double l = 0.0;
    for (std::size_t i = 0; i < f.out.size(); ++i) l += f.out[i] * dout[i];
    return l;
  }

  // Gradients of loss() = Σ out·dout: every parameter (same names) and "u".
  Tensors backward() const {
    const int B = p.batch, L = p.seqlen, Dm = p.d_model, E = p.d_inner(), N = p.d_state, W = p.d_conv, R = p.dt_rank,
              X = R + 2 * N;
    const RefForward f = forward();
    const std::size_t T = static_cast<std::size_t>(B) * L;
    Tensors g;
    for (const auto& kv : w) g[kv.first].assign(kv.second.size(), 0.0);
    g["u"].assign(u.size(), 0.0);
    std::vector<double> dy(T * E, 0.0), dypre(T * E, 0.0), dxc(T * E, 0.0), ddelta(T * E, 0.0), ddbl(T * X, 0.0),
        dxz(T * 2 * E, 0.0);
    // out = y·out_projᵀ + bias
    for (std::size_t m = 0; m < T; ++m)
      for (int j = 0; j < Dm; ++j) {
        const double go = dout[m * Dm + j];
        if (p.bias) g["out_proj.bias"][j] += go;
        for (int c = 0; c < E; ++c) {
          g["out_proj.weight"][j * E + c] += go * f.y[m * E + c];
          dy[m * E + c] += go * param("out_proj.weight", j * E + c);
        }
      }
    // gate, skip
    for (std::size_t m = 0; m < T; ++m)
      for (int c = 0; c < E; ++c) {
        const double z = f.xz[m * 2 * E + E + c];
        dypre[m * E + c] = dy[m * E + c] * silu(z);
        dxz[m * 2 * E + E + c] = dy[m * E + c] * f.ypre[m * E + c] * silu_derivative(z);
        g["D"][c] += dypre[m * E + c] * f.xc[m * E + c];
        dxc[m * E + c] += dypre[m * E + c] * param("D", c);
      }
    // the recurrence, in reverse; lambda = d loss / d h_t
    std::vector<double> lambda(N);
    for (int b = 0; b < B; ++b)
      for (int c = 0; c < E; ++c) {
        std::fill(lambda.begin(), lambda.end(), 0.0);
        for (int t = L - 1; t >= 0; --t) {
          const std::size_t m = tok(b, t);
          const double d = f.delta[m * E + c], x = f.xc[m * E + c];
          for (int n = 0; n < N; ++n) {
            const double A = -std::exp(param("A_log", c * N + n));
            const double a = std::exp(d * A);
            const double prev = t == 0 ? 0.0 : f.h[(tok(b, t - 1) * E + c) * N + n];
            const double Bn = f.dbl[m * X + R + n];
            ddbl[m * X + R + N + n] += dypre[m * E + c] * f.h[(m * E + c) * N + n];
            lambda[n] += dypre[m * E + c] * f.dbl[m * X + R + N + n];
            ddelta[m * E + c] += lambda[n] * (A * a * prev + Bn * x);
            g["A_log"][c * N + n] += lambda[n] * d * a * prev * A;  // dA · dA/dA_log, dA/dA_log = A
            ddbl[m * X + R + n] += lambda[n] * d * x;
            dxc[m * E + c] += lambda[n] * d * Bn;
            lambda[n] *= a;
          }
        }
      }
    // delta = softplus(dt·dt_projᵀ + dt_bias)
    for (std::size_t m = 0; m < T; ++m)
      for (int c = 0; c < E; ++c) {
        const double dr = ddelta[m * E + c] * softplus_derivative(f.draw[m * E + c] + param("dt_proj.bias", c));
        g["dt_proj.bias"][c] += dr;
        for (int r = 0; r < R; ++r) {
          g["dt_proj.weight"][c * R + r] += dr * f.dbl[m * X + r];
          ddbl[m * X + r] += dr * param("dt_proj.weight", c * R + r);
        }
      }
    // dbl = xc·x_projᵀ
    for (std::size_t m = 0; m < T; ++m)
      for (int i = 0; i < X; ++i)
        for (int c = 0; c < E; ++c) {
          g["x_proj.weight"][i * E + c] += ddbl[m * X + i] * f.xc[m * E + c];
          dxc[m * E + c] += ddbl[m * X + i] * param("x_proj.weight", i * E + c);
        }
    // xc = silu(conv(x) + bias)
    for (int b = 0; b < B; ++b)
      for (int t = 0; t < L; ++t)
        for (int c = 0; c < E; ++c) {
          const std::size_t m = tok(b, t);
          const double dpre = dxc[m * E + c] * silu_derivative(f.pre[m * E + c]);
          if (p.conv_bias) g["conv1d.bias"][c] += dpre;
          for (int k = 0; k < W; ++k) {
            const int src = t - (W - 1) + k;
            if (src < 0) continue;
            g["conv1d.weight"][c * W + k] += dpre * f.xz[tok(b, src) * 2 * E + c];
            dxz[tok(b, src) * 2 * E + c] += dpre * param("conv1d.weight", c * W + k);
          }
        }
    // xz = u·in_projᵀ + bias
    for (std::size_t m = 0; m < T; ++m)
      for (int j = 0; j < 2 * E; ++j) {
        const double gj = dxz[m * 2 * E + j];
        if (p.bias) g["in_proj.bias"][j] += gj;
        for (int k = 0; k < Dm; ++k) {
          g["in_proj.weight"][j * Dm + k] += gj * u[m * Dm + k];
          g["u"][m * Dm + k] += gj * param("in_proj.weight", j * Dm + k);
        }
      }
    return g;
  }
};

// Random parameters in the ranges a trained model has (so that every term matters), input and
// output cotangent.
Reference make_reference(const Problem& p, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  const auto uniform = [&](std::vector<double>& v, std::size_t n, double lo, double hi) {
    std::uniform_real_distribution<double> dist(lo, hi);
    v.resize(n);
    for (double& x : v) x = dist(rng);
  };
  Reference r;
  r.p = p;
  const std::size_t e = static_cast<std::size_t>(p.d_inner()), dm = static_cast<std::size_t>(p.d_model),
                    n = static_cast<std::size_t>(p.d_state), rk = static_cast<std::size_t>(p.dt_rank),
                    w = static_cast<std::size_t>(p.d_conv);
  uniform(r.w["in_proj.weight"], 2 * e * dm, -1.5 / std::sqrt(double(dm)), 1.5 / std::sqrt(double(dm)));
  uniform(r.w["conv1d.weight"], e * w, -0.5, 0.5);
  if (p.conv_bias) uniform(r.w["conv1d.bias"], e, -0.5, 0.5);
  uniform(r.w["x_proj.weight"], (rk + 2 * n) * e, -1.0 / std::sqrt(double(e)), 1.0 / std::sqrt(double(e)));
  uniform(r.w["dt_proj.weight"], e * rk, -1.0 / std::sqrt(double(rk)), 1.0 / std::sqrt(double(rk)));
  uniform(r.w["dt_proj.bias"], e, -4.0, -0.5);
  uniform(r.w["A_log"], e * n, -0.5, 2.5);
  uniform(r.w["D"], e, 0.5, 1.5);
  uniform(r.w["out_proj.weight"], dm * e, -1.0 / std::sqrt(double(e)), 1.0 / std::sqrt(double(e)));
  if (p.bias) {
    uniform(r.w["in_proj.bias"], 2 * e, -0.3, 0.3);
    uniform(r.w["out_proj.bias"], dm, -0.3, 0.3);
  }
  const std::size_t tokens = static_cast<std::size_t>(p.batch) * p.seqlen;
  std::normal_distribution<double> normal(0.0, 1.0);
  r.u.resize(tokens * dm);
  for (double& x : r.u) x = normal(rng);
  r.dout.resize(tokens * dm);
  for (double& x : r.dout) x = normal(rng);
  // The kernels see float values: round everything once so both sides start from the same numbers.
  for (auto& kv : r.w)
    for (double& x : kv.second) x = static_cast<float>(x);
  for (double& x : r.u) x = static_cast<float>(x);
  for (double& x : r.dout) x = static_cast<float>(x);
  return r;
}

// max|got − ref| ≤ tol·max|ref|, every value finite.
void expect_close(const std::string& what, const std::vector<double>& ref, const std::vector<double>& got, double tol) {
  ASSERT_EQ(ref.size(), got.size()) << what;
  double max_ref = 0.0, max_err = 0.0;
  std::size_t worst = 0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    ASSERT_TRUE(std::isfinite(got[i])) << what << ": element " << i << " is " << got[i];
    max_ref = std::max(max_ref, std::abs(ref[i]));
    const double err = std::abs(got[i] - ref[i]);
    if (err > max_err) {
      max_err = err;
      worst = i;
    }
  }
  EXPECT_LE(max_err, tol * max_ref) << what << ": worst element " << worst << " got " << got[worst] << " expected "
                                    << ref[worst] << " (max |ref| " << max_ref << ")";
}

TEST(Mamba1Reference, BackwardMatchesFiniteDifferences) {
  // batch, seqlen, d_model, expand, d_state, d_conv, dt_rank, conv_bias, bias
  const Problem p{2, 5, 4, 2, 3, 3, 2, true, true};
  Reference r = make_reference(p, 7);
  const Tensors analytic = r.backward();
  const double step = 1e-6;
  const auto check = [&](const std::string& name, std::vector<double>& values) {
    const std::vector<double>& a = analytic.at(name);
    for (std::size_t i = 0; i < values.size(); ++i) {
      const double keep = values[i];
      values[i] = keep + step;
      const double up = r.loss();
      values[i] = keep - step;
      const double down = r.loss();
      values[i] = keep;
      const double fd = (up - down) / (2.0 * step);
      EXPECT_NEAR(fd, a[i], 1e-6 * (1.0 + std::abs(a[i]))) << name << "[" << i << "]";
    }
  };
  for (auto& kv : r.w) check(kv.first, kv.second);
  check("u", r.u);
}

// The reference mixer inside a double-precision language model (embedding, pre-norm residual
// blocks with RMSNorm, final norm, tied head; docs/algorithms.md §4.2) reproduces the logits that
// Hugging Face's MambaForCausalLM computed for the golden checkpoint: the reference reads the
// spec the way the golden model does.
TEST(Mamba1Reference, LanguageModelReproducesGoldenLogits) {
  const std::string dir = kmamba::test::golden_dir() + "/";
  const kmamba::ModelConfig config = kmamba::ModelConfig::load(dir + "tiny_mamba1/config.json");
  const kmamba::SafeTensorsReader model(dir + "tiny_mamba1/model.safetensors");
  const kmamba::SafeTensorsReader io(dir + "tiny_mamba1_io.safetensors");
  const std::vector<std::int64_t> ids = io.read_i64("input_ids");
  const std::vector<float> golden = io.read_f32("logits");
  const auto read = [&](const std::string& name) {
    const std::vector<float> v = model.read_f32(name);
    return std::vector<double>(v.begin(), v.end());
  };
  const Problem p{static_cast<int>(io.info("input_ids").shape[0]),
                  static_cast<int>(io.info("input_ids").shape[1]),
                  config.d_model,
                  config.expand,
                  config.d_state,
                  config.d_conv,
                  config.resolved_dt_rank(),
                  config.conv_bias,
                  config.bias};
  const int dm = p.d_model, vocab = config.vocab_size;
  const std::size_t tokens = static_cast<std::size_t>(p.batch) * p.seqlen;
  const auto rms_norm = [&](const std::vector<double>& x, const std::vector<double>& w) {
    std::vector<double> y(x.size());
    for (std::size_t m = 0; m < tokens; ++m) {
      double ss = 0.0;
      for (int j = 0; j < dm; ++j) ss += x[m * dm + j] * x[m * dm + j];
      const double scale = 1.0 / std::sqrt(ss / dm + config.norm_epsilon);
      for (int j = 0; j < dm; ++j) y[m * dm + j] = x[m * dm + j] * scale * w[j];
    }
    return y;
  };
  const std::vector<double> embedding = read("backbone.embeddings.weight");
  std::vector<double> hidden(tokens * dm), residual(tokens * dm, 0.0);
  for (std::size_t m = 0; m < tokens; ++m)
    for (int j = 0; j < dm; ++j) hidden[m * dm + j] = embedding[static_cast<std::size_t>(ids[m]) * dm + j];
  for (int layer = 0; layer < config.n_layer; ++layer) {
    const std::string prefix = "backbone.layers." + std::to_string(layer) + ".";
    for (std::size_t i = 0; i < hidden.size(); ++i) residual[i] += hidden[i];
    Reference r;
    r.p = p;
    for (const auto& kv : expected_parameters(p)) r.w[kv.first] = read(prefix + "mixer." + kv.first);
    r.u = rms_norm(residual, read(prefix + "norm.weight"));
    hidden = r.forward().out;
  }
  for (std::size_t i = 0; i < hidden.size(); ++i) residual[i] += hidden[i];
  const std::vector<double> final_hidden = rms_norm(residual, read("backbone.norm_f.weight"));
  ASSERT_EQ(golden.size(), tokens * vocab);
  double diff2 = 0.0, ref2 = 0.0;
  for (std::size_t m = 0; m < tokens; ++m)
    for (int v = 0; v < vocab; ++v) {
      double logit = 0.0;
      for (int j = 0; j < dm; ++j) logit += final_hidden[m * dm + j] * embedding[static_cast<std::size_t>(v) * dm + j];
      const double g = golden[m * vocab + v];
      diff2 += (logit - g) * (logit - g);
      ref2 += g * g;
    }
  EXPECT_LE(std::sqrt(diff2 / ref2), 1e-5);
}

// ----------------------------------------------------------------------------------------------
// The kernels.

KMAMBA_BACKEND_TEST_SUITE(Mamba1Mixer);

const std::string test_prefix = "backbone.layers.3.mixer.";

// A slab holding the mixer's parameters after an unrelated one (so that nothing starts at offset 0).
template <class Exec>
kmamba::ParameterSlab<typename Exec::memory_space> declare(const kmamba::Mixer<Exec>& mixer) {
  kmamba::ParameterSlab<typename Exec::memory_space> slab;
  slab.add("backbone.norm_f.weight", {5}, kmamba::WeightDecay::No);
  mixer.declare_parameters(slab);
  slab.finalize("kmamba::test::slab");
  return slab;
}

template <class Mem>
void upload_parameters(const kmamba::ParameterSlab<Mem>& slab, const Tensors& w) {
  auto host = kmamba::test::to_host(slab.params());
  for (const auto& kv : w) {
    const auto& entry = slab.entry(test_prefix + kv.first);
    ASSERT_EQ(entry.size, kv.second.size()) << kv.first;
    for (std::size_t i = 0; i < entry.size; ++i) host(entry.offset + i) = static_cast<float>(kv.second[i]);
  }
  Kokkos::deep_copy(slab.params(), host);
}

template <class Mem>
Tensors download_gradients(const kmamba::ParameterSlab<Mem>& slab, const Tensors& w) {
  const auto host = kmamba::test::to_host(slab.grads());
  Tensors g;
  for (const auto& kv : w) {
    const auto& entry = slab.entry(test_prefix + kv.first);
    g[kv.first].assign(host.data() + entry.offset, host.data() + entry.offset + entry.size);
  }
  return g;
}

template <class Mem>
kmamba::Tensor3<float, Mem> device_tensor(const char* label, const Problem& p, const std::vector<double>& values) {
  auto t = kmamba::allocate_uninitialized<kmamba::Tensor3<float, Mem>>(label, p.batch, p.seqlen, p.d_model);
  kmamba::test::upload(t, values);
  return t;
}

template <class Mem>
kmamba::Tensor3<float, Mem> poisoned(const char* label, const Problem& p) {
  return kmamba::test::poisoned<kmamba::Tensor3<float, Mem>>(label, p.batch, p.seqlen, p.d_model);
}

/// A mixer of `p` in a slab of its own (declare()) holding the parameters of make_reference(p,
/// seed), with the reference's u and dout uploaded and NaN-poisoned outputs.
template <class Exec>
struct Fixture {
  using Mem = typename Exec::memory_space;
  Reference r;
  kmamba::Mamba1Mixer<Exec> mixer;
  kmamba::ParameterSlab<Mem> slab;
  kmamba::Tensor3<float, Mem> u, dout, out, du;  // (batch, seqlen, d_model)

  Fixture(const Problem& p, std::uint64_t seed)
      : r(make_reference(p, seed)),
        mixer(p.config(), test_prefix),
        slab(declare(mixer)),
        u(device_tensor<Mem>("kmamba::test::u", p, r.u)),
        dout(device_tensor<Mem>("kmamba::test::dout", p, r.dout)),
        out(poisoned<Mem>("kmamba::test::out", p)),
        du(poisoned<Mem>("kmamba::test::du", p)) {
    upload_parameters(slab, r.w);
  }

  /// A forward keeping its activations, then a backward of the cotangent `d_out`.
  void forward_backward(const kmamba::Tensor3<float, Mem>& d_out) {
    const Exec exec;
    mixer.forward(exec, slab, u, out, true);
    mixer.backward(exec, slab, d_out, du);
    exec.fence();
  }
};

template <class Exec>
void check_against_reference(const Problem& p, std::uint64_t seed) {
  using Mem = typename Exec::memory_space;
  SCOPED_TRACE(p.describe());
  Fixture<Exec> f(p, seed);
  const RefForward ref = f.r.forward();
  const Tensors ref_grads = f.r.backward();
  const Exec exec;
  {
    // A forward of another shape first, so that the one checked below reallocates its buffers.
    Problem other = p;
    other.batch = p.batch + 1;
    other.seqlen = p.seqlen + 3;
    const auto u = device_tensor<Mem>(
        "kmamba::test::u_other", other,
        std::vector<double>(static_cast<std::size_t>(other.batch) * other.seqlen * other.d_model, 0.25));
    const auto out = poisoned<Mem>("kmamba::test::out_other", other);
    f.mixer.forward(exec, f.slab, u, out, true);
  }
  f.forward_backward(f.dout);

  const double tol = 1e-4;
  expect_close("out", ref.out, host_doubles(f.out), tol);
  expect_close("du", ref_grads.at("u"), host_doubles(f.du), tol);
  const Tensors grads = download_gradients(f.slab, f.r.w);
  for (const auto& kv : grads) expect_close("grad " + kv.first, ref_grads.at(kv.first), kv.second, tol);
  // The unrelated parameter's gradient is untouched.
  const auto all = kmamba::test::to_host(f.slab.grads());
  const auto& norm = f.slab.entry("backbone.norm_f.weight");
  for (std::size_t i = 0; i < norm.size; ++i) EXPECT_EQ(all(norm.offset + i), 0.0f);
}

TYPED_TEST(Mamba1Mixer, MatchesReferenceSmall) {
  // batch, seqlen, d_model, expand, d_state, d_conv, dt_rank
  const Problem p{2, 37, 16, 2, 8, 4, 3};
  check_against_reference<TypeParam>(p, 11);
}

TYPED_TEST(Mamba1Mixer, MatchesReferenceOneTokenWithoutConvBias) {
  // batch, seqlen, d_model, expand, d_state, d_conv, dt_rank, conv_bias
  const Problem p{1, 1, 8, 2, 4, 4, 1, false};
  check_against_reference<TypeParam>(p, 12);
}

TYPED_TEST(Mamba1Mixer, MatchesReferenceLongWithBiases) {
  // batch, seqlen, d_model, expand, d_state, d_conv, dt_rank, conv_bias, bias
  const Problem p{2, 300, 16, 2, 16, 4, 2, true, true};
  check_against_reference<TypeParam>(p, 13);
}

TYPED_TEST(Mamba1Mixer, MatchesReferencePartialTiles) {
  // batch, seqlen, d_model, expand, d_state, d_conv, dt_rank, conv_bias, bias
  const Problem p{3, 45, 24, 2, 5, 2, 4, false, true};
  check_against_reference<TypeParam>(p, 14);
}

// Documents across scan chunk boundaries, of one token, and shorter than the conv window.
TYPED_TEST(Mamba1Mixer, PackedRowsEqualDocumentsAlone) {
  // batch, seqlen, d_model, expand, d_state, d_conv, dt_rank
  const Problem p{3, 41, 16, 2, 8, 4, 3};
  kmamba::test::expect_packed_rows_equal_documents_alone<TypeParam, kmamba::Mamba1Mixer<TypeParam>>(p.config(), p.batch,
                                                                                                    p.seqlen, 81, 1e-5);
}

TYPED_TEST(Mamba1Mixer, BackwardAccumulatesGradients) {
  using Exec = TypeParam;
  Problem p;
  p.seqlen = 19;
  p.bias = true;
  Fixture<Exec> f(p, 21);
  f.forward_backward(f.dout);
  const Tensors once = download_gradients(f.slab, f.r.w);
  const std::vector<double> du_once = host_doubles(f.du);
  const Exec exec;
  f.mixer.backward(exec, f.slab, f.dout, f.du);
  exec.fence();
  const Tensors twice = download_gradients(f.slab, f.r.w);
  for (const auto& kv : once) {
    std::vector<double> doubled = kv.second;
    for (double& v : doubled) v *= 2.0;
    expect_close("twice " + kv.first, doubled, twice.at(kv.first), 1e-5);
  }
  expect_close("du", du_once, host_doubles(f.du), 1e-5);
}

TYPED_TEST(Mamba1Mixer, EmptySequencesLeaveGradientsUnchanged) {
  using Exec = TypeParam;
  // batch, seqlen, d_model, expand, d_state, d_conv, dt_rank, conv_bias, bias
  const Problem p{2, 0, 8, 2, 4, 4, 2, true, true};
  Fixture<Exec> f(p, 5);
  f.forward_backward(f.u);
  for (const auto& kv : download_gradients(f.slab, f.r.w))
    for (const double g : kv.second) EXPECT_EQ(g, 0.0) << kv.first;
}

TYPED_TEST(Mamba1Mixer, ReportsBadInputAsUserErrors) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using kmamba::UserError;
  Problem p;
  const Exec exec;
  {
    kmamba::ModelConfig wrong = p.config();
    wrong.mixer = kmamba::MixerKind::Mamba2;
    EXPECT_THROW(kmamba::Mamba1Mixer<Exec>(wrong, test_prefix), UserError);
    wrong = p.config();
    wrong.d_state = 0;
    EXPECT_THROW(kmamba::Mamba1Mixer<Exec>(wrong, test_prefix), UserError);
  }
  kmamba::Mamba1Mixer<Exec> mixer(p.config(), test_prefix);
  EXPECT_EQ(mixer.prefix(), test_prefix);
  auto slab = declare(mixer);
  const Reference r = make_reference(p, 3);
  upload_parameters(slab, r.w);
  const auto u = device_tensor<Mem>("kmamba::test::u", p, r.u);
  const auto out = poisoned<Mem>("kmamba::test::out", p);
  const auto du = poisoned<Mem>("kmamba::test::du", p);
  using T3 = kmamba::Tensor3<float, Mem>;
  const T3 narrow("kmamba::test::narrow", p.batch, p.seqlen, p.d_model - 1);
  const T3 shorter("kmamba::test::shorter", p.batch, p.seqlen - 1, p.d_model);

  EXPECT_THROW(mixer.backward(exec, slab, u, du), UserError);  // nothing kept yet
  EXPECT_THROW(mixer.forward(exec, slab, narrow, narrow, true), UserError);
  EXPECT_THROW(mixer.forward(exec, slab, u, shorter, true), UserError);
  EXPECT_THROW(mixer.forward(exec, slab, u, T3(), true), UserError);
  mixer.forward(exec, slab, u, out, false);
  EXPECT_THROW(mixer.backward(exec, slab, u, du), UserError);  // forward kept nothing
  mixer.forward(exec, slab, u, out, true);
  EXPECT_THROW(mixer.backward(exec, slab, shorter, du), UserError);
  EXPECT_THROW(mixer.backward(exec, slab, u, shorter), UserError);
  mixer.backward(exec, slab, u, du);
  mixer.release_activations();
  EXPECT_THROW(mixer.backward(exec, slab, u, du), UserError);

  // A slab without this mixer's parameters, or with them in other shapes.
  kmamba::ParameterSlab<Mem> empty;
  empty.add("backbone.norm_f.weight", {5}, kmamba::WeightDecay::No);
  empty.finalize("kmamba::test::empty");
  EXPECT_THROW(mixer.forward(exec, empty, u, out, true), UserError);
  EXPECT_THROW(mixer.initialize(exec, empty, 1), UserError);
  Problem other = p;
  other.d_state = p.d_state + 1;
  kmamba::Mamba1Mixer<Exec> other_mixer(other.config(), test_prefix);
  auto other_slab = declare(other_mixer);
  EXPECT_THROW(mixer.forward(exec, other_slab, u, out, true), UserError);
  exec.fence();
}

TYPED_TEST(Mamba1Mixer, DeclaresHuggingFaceNamesWithWeightDecayOnWeights) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  for (const bool bias : {false, true}) {
    for (const bool conv_bias : {false, true}) {
      Problem p;
      p.bias = bias;
      p.conv_bias = conv_bias;
      kmamba::Mamba1Mixer<Exec> mixer(p.config(), test_prefix);
      kmamba::ParameterSlab<Mem> slab;
      mixer.declare_parameters(slab);
      const auto expected = expected_parameters(p);
      ASSERT_EQ(slab.entries().size(), expected.size());
      for (const auto& kv : expected) {
        const std::string name = test_prefix + kv.first;
        ASSERT_TRUE(slab.contains(name)) << name;
        EXPECT_EQ(slab.entry(name).shape, kv.second) << name;
        const bool decayed = kv.first.find(".weight") != std::string::npos;
        EXPECT_EQ(slab.entry(name).decay, decayed ? kmamba::WeightDecay::Yes : kmamba::WeightDecay::No) << name;
      }
    }
  }
}

TYPED_TEST(Mamba1Mixer, InitializesAsTheReference) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  // batch, seqlen, d_model, expand, d_state, d_conv, dt_rank, conv_bias, bias
  const Problem p{2, 7, 64, 2, 16, 4, 4, true, true};
  kmamba::ModelConfig config = p.config();
  config.n_layer = 4;
  config.rescale_prenorm_residual = true;
  config.dt_scale = 1.5;
  config.dt_min = 1e-3;
  config.dt_max = 0.1;
  config.dt_init_floor = 2e-3;  // above dt_min, so that the floor shows
  kmamba::Mamba1Mixer<Exec> mixer(config, test_prefix);
  kmamba::Mamba1Mixer<Exec> neighbour(config, "backbone.layers.4.mixer.");
  kmamba::ParameterSlab<Mem> slab;
  mixer.declare_parameters(slab);
  neighbour.declare_parameters(slab);
  slab.finalize("kmamba::test::slab");
  const Exec exec;
  mixer.initialize(exec, slab, 42);
  neighbour.initialize(exec, slab, 42);
  exec.fence();
  // A fresh host copy on every call (on a device backend a mirror is a snapshot).
  const auto values = [&](const std::string& name) {
    const auto host = kmamba::test::to_host(slab.params());
    const auto& e = slab.entry(name);
    return std::vector<double>(host.data() + e.offset, host.data() + e.offset + e.size);
  };
  const auto get = [&](const std::string& name) { return values(test_prefix + name); };
  const int e = p.d_inner(), n = p.d_state;
  // Uniform in (−bound, bound), reaching close to the bound, roughly centred.
  const auto expect_uniform = [&](const std::string& name, double bound) {
    const std::vector<double> v = get(name);
    double max_abs = 0.0, mean = 0.0;
    for (const double x : v) {
      max_abs = std::max(max_abs, std::abs(x));
      mean += x / static_cast<double>(v.size());
    }
    EXPECT_LE(max_abs, bound * (1.0 + 1e-6)) << name;
    EXPECT_GE(max_abs, 0.9 * bound) << name;
    EXPECT_LE(std::abs(mean), 0.15 * bound) << name;
  };
  expect_uniform("in_proj.weight", 1.0 / std::sqrt(64.0));
  expect_uniform("x_proj.weight", 1.0 / std::sqrt(double(e)));
  expect_uniform("conv1d.weight", 0.5);
  expect_uniform("conv1d.bias", 0.5);
  expect_uniform("dt_proj.weight", 1.5 / std::sqrt(4.0));
  expect_uniform("out_proj.weight", 1.0 / std::sqrt(double(e)) / std::sqrt(4.0));
  for (const double x : get("in_proj.bias")) EXPECT_EQ(x, 0.0);
  for (const double x : get("out_proj.bias")) EXPECT_EQ(x, 0.0);
  for (const double x : get("D")) EXPECT_EQ(x, 1.0);
  const std::vector<double> A_log = get("A_log");
  for (int d = 0; d < e; ++d)
    for (int s = 0; s < n; ++s) EXPECT_NEAR(A_log[d * n + s], std::log(s + 1.0), 1e-6) << d << "," << s;
  // softplus(dt_proj.bias) is the sampled dt: log-uniform in [dt_min, dt_max], floored.
  double mean_log = 0.0;
  int floored = 0;
  for (const double b : get("dt_proj.bias")) {
    const double dt = softplus(b);
    EXPECT_GE(dt, 2e-3 * (1.0 - 1e-4));
    EXPECT_LE(dt, 0.1 * (1.0 + 1e-4));
    if (std::abs(dt - 2e-3) < 2e-3 * 1e-4) ++floored;
    mean_log += std::log(std::max(dt, 1e-3)) / e;
  }
  EXPECT_GT(floored, 0);
  EXPECT_NEAR(mean_log, 0.5 * (std::log(1e-3) + std::log(0.1)), 0.5);
  // Deterministic in the seed, different per layer.
  const std::vector<double> first = get("in_proj.weight");
  EXPECT_NE(first, values("backbone.layers.4.mixer.in_proj.weight"));
  mixer.initialize(exec, slab, 42);
  exec.fence();
  EXPECT_EQ(first, values(test_prefix + "in_proj.weight"));
  mixer.initialize(exec, slab, 43);
  exec.fence();
  EXPECT_NE(first, values(test_prefix + "in_proj.weight"));

  // The "constant" dt_proj.weight scheme; no rescale of out_proj.
  config.dt_init_random = false;
  config.rescale_prenorm_residual = false;
  kmamba::Mamba1Mixer<Exec> constant(config, test_prefix);
  kmamba::ParameterSlab<Mem> slab2;
  constant.declare_parameters(slab2);
  slab2.finalize("kmamba::test::slab2");
  constant.initialize(exec, slab2, 42);
  exec.fence();
  const auto host2 = kmamba::test::to_host(slab2.params());
  const auto& dt = slab2.entry(test_prefix + "dt_proj.weight");
  for (std::size_t i = 0; i < dt.size; ++i) EXPECT_FLOAT_EQ(host2(dt.offset + i), 1.5f / 2.0f);
  const auto& out = slab2.entry(test_prefix + "out_proj.weight");
  double max_out = 0.0;
  for (std::size_t i = 0; i < out.size; ++i) max_out = std::max(max_out, std::abs(double(host2(out.offset + i))));
  EXPECT_GT(max_out, 0.9 / std::sqrt(double(e)));
}

// The layer-0 mixer tensors of the golden Hugging Face checkpoint are exactly what the mixer
// declares for its config.json.
TEST(Mamba1MixerGolden, DeclaresTheCheckpointTensors) {
  using Exec = Kokkos::DefaultHostExecutionSpace;
  const std::string dir = kmamba::test::golden_dir() + "/tiny_mamba1/";
  const kmamba::ModelConfig config = kmamba::ModelConfig::load(dir + "config.json");
  ASSERT_EQ(config.mixer, kmamba::MixerKind::Mamba1);
  const std::string prefix = "backbone.layers.0.mixer.";
  kmamba::Mamba1Mixer<Exec> mixer(config, prefix);
  kmamba::ParameterSlab<Exec::memory_space> slab;
  mixer.declare_parameters(slab);
  const kmamba::SafeTensorsReader file(dir + "model.safetensors");
  EXPECT_EQ(expect_declared_as_in_file(slab, file, prefix), slab.entries().size());
  for (const auto& entry : slab.entries()) EXPECT_TRUE(file.contains(entry.name)) << entry.name;
}

}  // namespace
