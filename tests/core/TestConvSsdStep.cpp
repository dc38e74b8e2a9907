// conv_ssd_step (the fused Mamba-2 decode kernel: conv update + SiLU of x, B, C, the SSD step,
// then the gated RMSNorm) against a sequential double-precision reference written from its
// definition (docs/algorithms.md §2.3, §2.10): several consecutive tokens from random nonzero conv and
// ssm states, so that a B/C conv state shifted twice or not at all in one call (the per-group
// ticket) shows in the next token's output.
//
// Tolerance: fp32 kernel against the double reference, per tensor, max|kernel − ref| ≤
// 1e-5·max|ref| (the conv is 4 products, the state update one FMA per token, the output a
// dstate-long dot product, the norm a sum over a group; the largest error observed on Serial and
// OpenMP is 4.5e-7).
#include <kmamba/core/ConvSsdStep.hpp>
#include <kmamba/core/Core.hpp>

#include "Activations.hpp"
#include "Backends.hpp"
#include "Checks.hpp"

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
using namespace kmamba::reference;

struct Config {
  int batch = 2, nheads = 4, headdim = 3, ngroups = 2, dstate = 5, width = 4, xbc_offset = 12, tokens = 3;
  bool conv_bias = true, D = true, dt_bias = true, softplus = true;
  bool norm = true, norm_before_gate = false;  // the gated norm (z: the inner columns before xbc_offset)
  float eps = 1e-5f;
  std::uint64_t seed = 1;

  int inner() const { return nheads * headdim; }
  int group_width() const { return ngroups * dstate; }
  int conv_dim() const { return inner() + 2 * group_width(); }
  int columns() const { return xbc_offset + conv_dim() + nheads; }

  std::string describe() const {
    std::ostringstream s;
    s << "batch=" << batch << " nheads=" << nheads << " headdim=" << headdim << " ngroups=" << ngroups
      << " dstate=" << dstate << " width=" << width << " xbc_offset=" << xbc_offset << " conv_bias=" << conv_bias
      << " D=" << D << " dt_bias=" << dt_bias << " softplus=" << softplus << " norm=" << norm
      << " norm_before_gate=" << norm_before_gate << " eps=" << eps;
    return s.str();
  }
};

std::vector<float> uniform(std::size_t n, double lo, double hi, std::mt19937_64& rng) {
  std::uniform_real_distribution<double> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = static_cast<float>(d(rng));
  return v;
}

std::vector<double> doubles(const std::vector<float>& v) { return std::vector<double>(v.begin(), v.end()); }

// The double reference state, row-major as the kernel's tensors.
struct RefState {
  std::vector<double> conv;  // (batch, conv_dim, width − 1), channels x, B, C
  std::vector<double> ssm;   // (batch, nheads, headdim, dstate)
};

// The gated RMSNorm of y (batch, inner) with z the inner columns of each row before xbc_offset,
// one norm group per B/C group.
std::vector<double> reference_norm(const Config& c, const std::vector<double>& y, const std::vector<double>& row,
                                   const std::vector<double>& w) {
  const int E = c.inner(), size = E / c.ngroups;
  std::vector<double> out(y.size());
  for (int b = 0; b < c.batch; ++b) {
    for (int g = 0; g < c.ngroups; ++g) {
      const auto at = [&](int ch) { return static_cast<std::size_t>(b * E + g * size + ch); };
      const auto gate = [&](int ch) {
        return silu(row[static_cast<std::size_t>(b * c.columns() + c.xbc_offset - E + g * size + ch)]);
      };
      const auto input = [&](int ch) { return c.norm_before_gate ? y[at(ch)] : y[at(ch)] * gate(ch); };
      double sumsq = 0.0;
      for (int ch = 0; ch < size; ++ch) sumsq += input(ch) * input(ch);
      const double r = 1.0 / std::sqrt(sumsq / size + static_cast<double>(c.eps));
      for (int ch = 0; ch < size; ++ch) {
        out[at(ch)] =
            input(ch) * r * w[static_cast<std::size_t>(g * size + ch)] * (c.norm_before_gate ? gate(ch) : 1.0);
      }
    }
  }
  return out;
}

// One token of the reference: advances `s` and returns y (batch, nheads, headdim).
std::vector<double> reference_step(const Config& c, const std::vector<double>& row, const std::vector<double>& weight,
                                   const std::vector<double>& bias, const std::vector<double>& A_log,
                                   const std::vector<double>& D, const std::vector<double>& dt_bias, RefState& s) {
  const int K = c.width - 1, CD = c.conv_dim(), E = c.inner(), GN = c.group_width();
  std::vector<double> y(static_cast<std::size_t>(c.batch * E));
  for (int b = 0; b < c.batch; ++b) {
    std::vector<double> act(static_cast<std::size_t>(CD));
    for (int ch = 0; ch < CD; ++ch) {
      const double newest = row[static_cast<std::size_t>(b * c.columns() + c.xbc_offset + ch)];
      double* window = &s.conv[static_cast<std::size_t>((b * CD + ch) * K)];
      double pre = c.conv_bias ? bias[static_cast<std::size_t>(ch)] : 0.0;
      for (int k = 0; k < K; ++k) pre += weight[static_cast<std::size_t>(ch * c.width + k)] * window[k];
      pre += weight[static_cast<std::size_t>(ch * c.width + K)] * newest;
      act[static_cast<std::size_t>(ch)] = silu(pre);
      for (int k = 0; k + 1 < K; ++k) window[k] = window[k + 1];
      if (K > 0) window[K - 1] = newest;
    }
    for (int h = 0; h < c.nheads; ++h) {
      const int g = h / (c.nheads / c.ngroups);
      double dt = row[static_cast<std::size_t>(b * c.columns() + c.xbc_offset + CD + h)];
      if (c.dt_bias) dt += dt_bias[static_cast<std::size_t>(h)];
      const double delta = c.softplus ? softplus(dt) : dt;
      const double decay = std::exp(delta * -std::exp(A_log[static_cast<std::size_t>(h)]));
      for (int p = 0; p < c.headdim; ++p) {
        const double x = act[static_cast<std::size_t>(h * c.headdim + p)];
        double out = c.D ? D[static_cast<std::size_t>(h)] * x : 0.0;
        for (int n = 0; n < c.dstate; ++n) {
          double& H = s.ssm[static_cast<std::size_t>(((b * c.nheads + h) * c.headdim + p) * c.dstate + n)];
          H = decay * H + delta * x * act[static_cast<std::size_t>(E + g * c.dstate + n)];
          out += H * act[static_cast<std::size_t>(E + GN + g * c.dstate + n)];
        }
        y[static_cast<std::size_t>(b * E + h * c.headdim + p)] = out;
      }
    }
  }
  return y;
}

template <class View, class... Extents>
View device(const std::string& label, const std::vector<float>& values, Extents... extents) {
  View v(label, extents...);
  auto h = Kokkos::create_mirror_view(v);
  std::copy(values.begin(), values.end(), h.data());
  Kokkos::deep_copy(v, h);
  return v;
}

// kmamba::test::expect_near_rel against a reference that is not all zero (which would make the
// comparison vacuous).
double expect_near_rel(const char* what, const std::vector<double>& got, const std::vector<double>& want, double tol,
                       const std::string& ctx) {
  double scale = 0.0;
  for (const double w : want) scale = std::max(scale, std::abs(w));
  EXPECT_GT(scale, 0.0) << what << " " << ctx;
  return kmamba::test::expect_near_rel(what, got, want, tol, ctx);
}

// The slice of conv channels [first, first + count) of a (batch, conv_dim, K) row-major vector.
std::vector<double> channels(const std::vector<double>& conv, int batch, int conv_dim, int K, int first, int count) {
  std::vector<double> out;
  for (int b = 0; b < batch; ++b)
    for (int ch = first; ch < first + count; ++ch)
      for (int k = 0; k < K; ++k) out.push_back(conv[static_cast<std::size_t>((b * conv_dim + ch) * K + k)]);
  return out;
}

// Returns the largest relative error of y, the ssm state and normed over the tokens.
template <class Exec>
double check_against_reference(const Config& c) {
  using Mem = typename Exec::memory_space;
  using T1 = kmamba::Tensor1<float, Mem>;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  const std::string ctx = c.describe();
  std::mt19937_64 rng(c.seed);
  const std::size_t B = static_cast<std::size_t>(c.batch), H = static_cast<std::size_t>(c.nheads),
                    P = static_cast<std::size_t>(c.headdim), N = static_cast<std::size_t>(c.dstate),
                    E = static_cast<std::size_t>(c.inner()), GN = static_cast<std::size_t>(c.group_width()),
                    CD = static_cast<std::size_t>(c.conv_dim()), W = static_cast<std::size_t>(c.width), K = W - 1,
                    cols = static_cast<std::size_t>(c.columns());
  const std::vector<float> weight = uniform(CD * W, -0.6, 0.6, rng);
  const std::vector<float> bias = uniform(CD, -0.3, 0.3, rng);
  const std::vector<float> A_log = uniform(H, std::log(1.0), std::log(16.0), rng);
  const std::vector<float> D = uniform(H, 0.5, 1.5, rng);
  const std::vector<float> dt_bias = uniform(H, -3.0, -1.0, rng);
  const std::vector<float> norm_weight = uniform(E, 0.5, 1.5, rng);
  const std::vector<float> conv0 = uniform(B * CD * K, -1.0, 1.0, rng);
  const std::vector<float> ssm0 = uniform(B * H * P * N, -1.0, 1.0, rng);

  // The device state: the x, B, C windows as the three tensors of the op.
  const auto part = [&](int first, std::size_t count) {
    std::vector<float> out;
    for (const double v :
         channels(doubles(conv0), c.batch, static_cast<int>(CD), static_cast<int>(K), first, static_cast<int>(count)))
      out.push_back(static_cast<float>(v));
    return out;
  };
  kmamba::ConvSsdStepState<Mem> state;
  state.conv_x = device<T3>("kmamba::test::conv_x", part(0, E), B, E, K);
  state.conv_B = device<T3>("kmamba::test::conv_B", part(static_cast<int>(E), GN), B, GN, K);
  state.conv_C = device<T3>("kmamba::test::conv_C", part(static_cast<int>(E + GN), GN), B, GN, K);
  state.ssm = device<T4>("kmamba::test::ssm", ssm0, B, H, P, N);
  state.group_arrivals = kmamba::allocate<kmamba::Tensor2<int, Mem>>("kmamba::test::arrivals", B, c.ngroups);
  const T2 row("kmamba::test::xbcdt", B, cols);
  kmamba::ConvSsdStepArgs<Mem> args;
  args.xbcdt = row;
  args.xbc_offset = c.xbc_offset;
  args.ngroups = c.ngroups;
  args.conv_weight = device<T2>("kmamba::test::conv_weight", weight, CD, W);
  if (c.conv_bias) args.conv_bias = device<T1>("kmamba::test::conv_bias", bias, CD);
  args.A_log = device<T1>("kmamba::test::A_log", A_log, H);
  if (c.D) args.D = device<T1>("kmamba::test::D", D, H);
  if (c.dt_bias) args.dt_bias = device<T1>("kmamba::test::dt_bias", dt_bias, H);
  args.dt_softplus = c.softplus;
  const T3 y("kmamba::test::y", B, H, P);
  T2 normed;
  if (c.norm) {
    args.norm_weight = device<T1>("kmamba::test::norm_weight", norm_weight, E);
    args.norm_eps = c.eps;
    args.norm_before_gate = c.norm_before_gate;
    normed = T2("kmamba::test::normed", B, E);
  }

  RefState ref{doubles(conv0), doubles(ssm0)};
  const Exec exec;
  double worst = 0.0;
  for (int t = 0; t < c.tokens; ++t) {
    // x, B, C, dt of a fresh token (and random values in the columns before xbc_offset, which the
    // op must not read); a raw dt without softplus is the step δ itself, so positive.
    std::vector<float> values = uniform(B * cols, -1.5, 1.5, rng);
    for (std::size_t b = 0; b < B; ++b)
      for (std::size_t h = 0; h < H; ++h)
        values[b * cols + cols - H + h] = c.softplus ? uniform(1, -2.0, 2.5, rng)[0] : uniform(1, 0.05, 0.8, rng)[0];
    auto hrow = Kokkos::create_mirror_view(row);
    std::copy(values.begin(), values.end(), hrow.data());
    Kokkos::deep_copy(row, hrow);
    Kokkos::deep_copy(y, std::nanf(""));
    if (c.norm) Kokkos::deep_copy(normed, std::nanf(""));
    kmamba::conv_ssd_step(exec, args, state, y, normed);
    exec.fence();
    const std::vector<double> want = reference_step(c, doubles(values), doubles(weight), doubles(bias), doubles(A_log),
                                                    doubles(D), doubles(dt_bias), ref);
    const std::string at = ctx + " token=" + std::to_string(t);
    worst = std::max(worst, expect_near_rel("y", host_doubles(y), want, 1e-5, at));
    worst = std::max(worst, expect_near_rel("ssm", host_doubles(state.ssm), ref.ssm, 1e-5, at));
    if (c.norm) {
      worst =
          std::max(worst, expect_near_rel("normed", host_doubles(normed),
                                          reference_norm(c, want, doubles(values), doubles(norm_weight)), 1e-5, at));
    }
    const int cd = static_cast<int>(CD), k = static_cast<int>(K);
    if (K > 0) {
      expect_near_rel("conv_x", host_doubles(state.conv_x), channels(ref.conv, c.batch, cd, k, 0, static_cast<int>(E)),
                      0.0, at);
      expect_near_rel("conv_B", host_doubles(state.conv_B),
                      channels(ref.conv, c.batch, cd, k, static_cast<int>(E), static_cast<int>(GN)), 0.0, at);
      expect_near_rel("conv_C", host_doubles(state.conv_C),
                      channels(ref.conv, c.batch, cd, k, static_cast<int>(E + GN), static_cast<int>(GN)), 0.0, at);
    }
    const auto arrivals = kmamba::test::to_host(state.group_arrivals);
    for (std::size_t i = 0; i < arrivals.size(); ++i) EXPECT_EQ(arrivals.data()[i], 0) << "group_arrivals " << at;
  }
  return worst;
}

std::vector<Config> sweep() {
  std::vector<Config> configs;
  std::uint64_t seed = 100;
  for (const int batch : {1, 2, 3}) {
    for (const int ngroups : {1, 2}) {
      for (const bool conv_bias : {true, false}) {
        Config c;
        c.batch = batch;
        c.ngroups = ngroups;
        c.conv_bias = conv_bias;
        c.norm_before_gate = !conv_bias;
        c.seed = seed++;
        configs.push_back(c);
      }
    }
  }
  // Several teams per head and per group on CUDA (on host backends, blocks of channels across
  // heads and, at batch 1 with one group on two threads, two teams per group); the mamba2-130m
  // dstate and head layout at a smaller width.
  Config wide;
  wide.batch = 2;
  wide.nheads = 6;
  wide.headdim = 20;
  wide.ngroups = 2;
  wide.dstate = 48;
  wide.xbc_offset = 120;
  wide.seed = seed++;
  configs.push_back(wide);
  Config large;
  large.batch = 1;
  large.nheads = 8;
  large.headdim = 64;
  large.ngroups = 1;
  large.dstate = 128;
  large.xbc_offset = 512;
  large.tokens = 2;
  large.seed = seed++;
  configs.push_back(large);
  // Many sequences: on CUDA several channels per thread (an H200 holds ~1056 teams at once, so
  // 200 sequences of 84 channels get 5 blocks of 17, the last one short); on hosts as the others.
  Config many;
  many.batch = 200;
  many.nheads = 4;
  many.headdim = 21;
  many.ngroups = 1;
  many.dstate = 16;
  many.xbc_offset = 84;
  many.tokens = 2;
  many.seed = seed++;
  configs.push_back(many);
  // Options off and a raw dt (no softplus), conv widths 2 and 1, a large norm eps.
  Config bare;
  bare.D = bare.dt_bias = bare.norm = false;
  bare.softplus = false;
  bare.width = 2;
  bare.xbc_offset = 0;
  bare.seed = seed++;
  configs.push_back(bare);
  Config pointwise;
  pointwise.width = 1;
  pointwise.norm_before_gate = true;
  pointwise.eps = 0.5f;
  pointwise.seed = seed++;
  configs.push_back(pointwise);
  return configs;
}

KMAMBA_BACKEND_TEST_SUITE(ConvSsdStep);

TYPED_TEST(ConvSsdStep, MatchesSequentialReference) {
  double worst = 0.0;
  for (const Config& c : sweep()) worst = std::max(worst, check_against_reference<TypeParam>(c));
  std::printf("[ conv_ssd ] %s: largest relative error of y, ssm and normed %.2e\n", TypeParam::name(), worst);
}

TYPED_TEST(ConvSsdStep, RejectsBadShapes) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using T1 = kmamba::Tensor1<float, Mem>;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  using kmamba::allocate;
  const Exec exec;
  // batch 2, nheads 4, headdim 3, ngroups 2, dstate 5, width 4: conv_dim 32, 6 + 32 + 4 columns.
  kmamba::ConvSsdStepArgs<Mem> args;
  args.xbcdt = allocate<T2>("kmamba::test::xbcdt", 2, 42);
  args.xbc_offset = 6;
  args.ngroups = 2;
  args.conv_weight = allocate<T2>("kmamba::test::w", 32, 4);
  args.A_log = allocate<T1>("kmamba::test::A_log", 4);
  kmamba::ConvSsdStepState<Mem> state{
      allocate<T3>("kmamba::test::cx", 2, 12, 3), allocate<T3>("kmamba::test::cB", 2, 10, 3),
      allocate<T3>("kmamba::test::cC", 2, 10, 3), allocate<T4>("kmamba::test::s", 2, 4, 3, 5),
      allocate<kmamba::Tensor2<int, Mem>>("kmamba::test::arrivals", 2, 2)};
  const T3 y = allocate<T3>("kmamba::test::y", 2, 4, 3);
  kmamba::conv_ssd_step(exec, args, state, y);  // the shapes above are consistent
  exec.fence();

  auto bad = args;
  bad.xbcdt = allocate<T2>("kmamba::test::xbcdt", 2, 41);
  expect_user_error([&] { kmamba::conv_ssd_step(exec, bad, state, y); },
                    {"kmamba::conv_ssd_step", "xbcdt", "(2, 41)", "(2, 42)"});
  bad = args;
  bad.ngroups = 3;
  expect_user_error([&] { kmamba::conv_ssd_step(exec, bad, state, y); }, {"ngroups = 3", "nheads = 4"});
  bad = args;
  bad.conv_weight = allocate<T2>("kmamba::test::w", 31, 4);
  expect_user_error([&] { kmamba::conv_ssd_step(exec, bad, state, y); }, {"conv_weight", "(31, 4)"});
  bad = args;
  bad.D = allocate<T1>("kmamba::test::D", 3);
  expect_user_error([&] { kmamba::conv_ssd_step(exec, bad, state, y); }, {"D", "(3,)", "(4,)"});
  bad = args;
  bad.xbc_offset = -1;
  expect_user_error([&] { kmamba::conv_ssd_step(exec, bad, state, y); }, {"xbc_offset"});
  auto wrong = state;
  wrong.conv_B = allocate<T3>("kmamba::test::cB", 2, 10, 2);
  expect_user_error([&] { kmamba::conv_ssd_step(exec, args, wrong, y); }, {"conv_B", "(2, 10, 2)", "(2, 10, 3)"});
  wrong = state;
  wrong.group_arrivals = allocate<kmamba::Tensor2<int, Mem>>("kmamba::test::arrivals", 2, 1);
  expect_user_error([&] { kmamba::conv_ssd_step(exec, args, wrong, y); }, {"group_arrivals", "(2, 1)", "(2, 2)"});
  expect_user_error([&] { kmamba::conv_ssd_step(exec, args, state, allocate<T3>("kmamba::test::y", 2, 4, 2)); },
                    {"y", "(2, 4, 2)", "(2, 4, 3)"});
  const T2 normed = allocate<T2>("kmamba::test::normed", 2, 12);
  expect_user_error([&] { kmamba::conv_ssd_step(exec, args, state, y, normed); }, {"normed", "norm_weight"});
  bad = args;
  bad.norm_weight = allocate<T1>("kmamba::test::norm_w", 12);
  expect_user_error([&] { kmamba::conv_ssd_step(exec, bad, state, y, normed); }, {"xbc_offset", "12", "6"});
  bad.xbc_offset = 12;
  bad.xbcdt = allocate<T2>("kmamba::test::xbcdt", 2, 48);
  expect_user_error([&] { kmamba::conv_ssd_step(exec, bad, state, y, allocate<T2>("kmamba::test::n", 2, 11)); },
                    {"normed", "(2, 11)", "(2, 12)"});
}

}  // namespace
