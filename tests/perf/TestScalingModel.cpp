// kmamba-perf-model's alpha-beta fit and scaling prediction (perf/ScalingModel.hpp): the fit must
// recover known α and β from synthetic sweeps with noise, and the predictions must equal the
// formulas evaluated by hand.
#include "ModelConfigs.hpp"
#include "ScalingModel.hpp"

#include <kmamba/KMamba.hpp>

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

namespace {

using kmamba::perf::AlphaBeta;
using kmamba::perf::Sample;

const std::vector<std::string> collectives = {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "send_recv"};

// A 1 KiB ... 1 GiB sweep (factor 4) of time α + bytes·factor(n)·β, each time scaled by a random
// factor in [1 − noise, 1 + noise].
std::vector<Sample> sweep(const std::string& collective, int n, double alpha, double beta, double noise,
                          std::mt19937_64& rng) {
  std::uniform_real_distribution<double> jitter(-noise, noise);
  std::vector<Sample> samples;
  for (double bytes = 1024; bytes <= 1024.0 * 1024 * 1024; bytes *= 4) {
    const double t = alpha + bytes * kmamba::perf::ring_factor(collective, n) * beta;
    samples.push_back({collective, n, bytes, t * (1.0 + jitter(rng))});
  }
  return samples;
}

TEST(ScalingModel, RingFactorsAreTheNcclTestsConventions) {
  EXPECT_DOUBLE_EQ(kmamba::perf::ring_factor("all_reduce", 8), 2.0 * 7 / 8);
  EXPECT_DOUBLE_EQ(kmamba::perf::ring_factor("reduce_scatter", 4), 3.0 / 4);
  EXPECT_DOUBLE_EQ(kmamba::perf::ring_factor("all_gather", 2), 0.5);
  EXPECT_DOUBLE_EQ(kmamba::perf::ring_factor("broadcast", 8), 1.0);
  EXPECT_DOUBLE_EQ(kmamba::perf::ring_factor("send_recv", 2), 1.0);
  EXPECT_THROW(kmamba::perf::ring_factor("all_to_all", 2), kmamba::UserError);
}

TEST(ScalingModel, FitRecoversAlphaAndBetaWithinOnePercent) {
  std::mt19937_64 rng(20261203);
  std::uniform_real_distribution<double> alphas(3e-6, 40e-6), bandwidths(20e9, 400e9);
  std::vector<Sample> all;
  std::vector<AlphaBeta> truth;
  for (const std::string& c : collectives) {
    for (int n : {2, 4, 8}) {
      AlphaBeta t;
      t.collective = c;
      t.ranks = n;
      t.alpha = alphas(rng);
      t.beta = 1.0 / bandwidths(rng);
      truth.push_back(t);
      const std::vector<Sample> s = sweep(c, n, t.alpha, t.beta, 0.002, rng);
      all.insert(all.end(), s.begin(), s.end());
      const AlphaBeta fit = kmamba::perf::fit_alpha_beta(s);
      EXPECT_NEAR(fit.alpha, t.alpha, 0.01 * t.alpha) << c << " n=" << n;
      EXPECT_NEAR(fit.beta, t.beta, 0.01 * t.beta) << c << " n=" << n;
      EXPECT_FALSE(fit.alpha_clamped);
      ASSERT_EQ(fit.relative_error.size(), s.size());
      for (double e : fit.relative_error) EXPECT_LT(std::abs(e), 0.005) << c << " n=" << n;
    }
  }
  // The same through fit_all on the mixed samples: one fit per (collective, ranks).
  const std::vector<AlphaBeta> fits = kmamba::perf::fit_all(all);
  ASSERT_EQ(fits.size(), truth.size());
  for (const AlphaBeta& t : truth) {
    int found = 0;
    for (const AlphaBeta& f : fits) {
      if (f.collective != t.collective || f.ranks != t.ranks) continue;
      ++found;
      EXPECT_NEAR(f.alpha, t.alpha, 0.01 * t.alpha);
      EXPECT_NEAR(f.beta, t.beta, 0.01 * t.beta);
    }
    EXPECT_EQ(found, 1) << t.collective << " n=" << t.ranks;
  }
}

TEST(ScalingModel, NegativeLatencyIsRefittedThroughTheOrigin) {
  // Times that fall below the bandwidth line at the small sizes give a negative free intercept.
  std::vector<Sample> s;
  for (double bytes : {1e3, 1e4, 1e6, 1e8}) s.push_back({"send_recv", 2, bytes, bytes / 10e9});
  s[0].seconds *= 0.5;
  const AlphaBeta fit = kmamba::perf::fit_alpha_beta(s);
  EXPECT_TRUE(fit.alpha_clamped);
  EXPECT_EQ(fit.alpha, 0.0);
  // Through the origin, minimising Σ ((β·x − t)/t)²: β = Σ (x/t) / Σ (x/t)²; x/t is 10e9 at three
  // points and 20e9 at the halved one: β = 5·10e9 / (7·10e18) = (5/7) / 10e9.
  EXPECT_NEAR(fit.beta, 5.0 / 7.0 / 10e9, 1e-9 / 10e9);
  EXPECT_THROW(kmamba::perf::fit_alpha_beta({s[0]}), kmamba::UserError);
  EXPECT_THROW(kmamba::perf::fit_alpha_beta({s[0], {"all_reduce", 2, 1e4, 1e-5}}), kmamba::UserError);
}

// One node of 8 GPUs: reduce-scatter α 10 µs at 100 GB/s bus bandwidth, all-gather 12 µs at
// 200 GB/s, all-reduce 20 µs at 150 GB/s, send/recv 8 µs at 100 GB/s; 50 GB/s and 15 µs between nodes.
kmamba::perf::CommModel hand_model() {
  auto fit = [](const char* c, double alpha, double bandwidth) {
    AlphaBeta f;
    f.collective = c;
    f.ranks = 8;
    f.alpha = alpha;
    f.beta = 1.0 / bandwidth;
    return f;
  };
  return kmamba::perf::CommModel({fit("reduce_scatter", 10e-6, 100e9), fit("all_gather", 12e-6, 200e9),
                                  fit("all_reduce", 20e-6, 150e9), fit("send_recv", 8e-6, 100e9)},
                                 15e-6, 50e9, 8);
}

TEST(ScalingModel, HierarchicalAllReduceByHand) {
  const kmamba::perf::CommModel comm = hand_model();
  const double M = 8e8;
  // RS_intra = 10 µs + 8e8·7/8 / 100e9 = 0.00701 s; AR_inter over 2 nodes of M/8 = 1e8 bytes:
  // 2·15 µs + 2·(1/2)·1e8 / 50e9 = 0.00203 s; AG_intra = 12 µs + 8e8·7/8 / 200e9 = 0.003512 s.
  EXPECT_NEAR(comm.all_reduce(16, 8, M), 0.00701 + 0.00203 + 0.003512, 1e-12);
  // Inside one node: the fitted all-reduce (4 ranks: the 8-rank α and β with 4 ranks' factor 3/2).
  EXPECT_NEAR(comm.all_reduce(4, 4, M), 20e-6 + M * 1.5 / 150e9, 1e-12);
  // One rank per node (tp 8): only the inter-node ring, 4 nodes: 6·15 µs + 2·(3/4)·M / 50e9.
  EXPECT_NEAR(comm.all_reduce(4, 1, M), 6 * 15e-6 + 1.5 * M / 50e9, 1e-12);
  EXPECT_EQ(comm.intra("all_reduce", 1, M), 0.0);
  EXPECT_THROW(comm.intra("broadcast", 8, M), kmamba::UserError);  // not in the table
}

TEST(ScalingModel, ParameterCountMatchesTheLanguageModel) {
  kmamba::ModelConfig config = kmamba::test::model_config(kmamba::MixerKind::Mamba2, {64, 3, 101, 16, 16, 16, 2});
  config.pad_vocab_size_multiple = 8;
  config.validate();
  const kmamba::LanguageModel<Kokkos::DefaultHostExecutionSpace> model(config);
  kmamba::perf::Shape shape;
  shape.d_model = 64;
  shape.n_layer = 3;
  shape.vocab_size = 101;
  shape.pad_vocab_size_multiple = 8;
  shape.d_state = 16;
  shape.headdim = 16;
  shape.ngroups = 2;
  shape.chunk_size = 16;
  EXPECT_EQ(kmamba::perf::parameter_count(shape), static_cast<double>(model.parameters().size()));
  // mamba2-370m: 48 · 6 601 056 per layer + 50280 · 1024 + 1024.
  EXPECT_EQ(kmamba::perf::parameter_count(kmamba::perf::Shape()), 48.0 * 6601056 + 50280.0 * 1024 + 1024);
}

TEST(ScalingModel, DataParallelPredictionByHand) {
  const kmamba::perf::CommModel comm = hand_model();
  kmamba::perf::Workload work;
  work.compute_s = 0.5;
  work.tokens_per_gpu = 16384;
  const double P = kmamba::perf::parameter_count(work.shape), M = 4 * P;
  // 16 GPUs: default buckets of 25 MiB (6 553 600 fp32 elements) → ceil(368.3M / 6.55M) = 57
  // all-reduces of M/57 over 2 nodes: 57·(10 µs + 12 µs + 2·15 µs) + M·7/8·(1/100e9 + 1/200e9) + (M/8)/50e9.
  ASSERT_EQ(std::ceil(P / 6553600), 57.0);
  const double dp_comm = 57 * (10e-6 + 12e-6 + 30e-6) + M * 7.0 / 8 * (1 / 100e9 + 1 / 200e9) + M / 8 / 50e9;
  const kmamba::perf::Prediction p = kmamba::perf::predict_dp(comm, work, 16);
  EXPECT_EQ(p.dp, 16);
  EXPECT_NEAR(p.dp_comm, dp_comm, 1e-12);
  EXPECT_NEAR(p.step, 0.5 + dp_comm, 1e-12);
  EXPECT_NEAR(p.step_overlap, 0.5 + std::max(0.0, dp_comm - 0.5 * 2 / 3), 1e-12);
  EXPECT_NEAR(p.tokens_per_s, 16 * 16384 / (0.5 + dp_comm), 1e-6);
  EXPECT_NEAR(p.mfu, kmamba::perf::flops_per_token(work.shape) * 16 * 16384 / (0.5 + dp_comm) / (16 * 989e12), 1e-12);
  EXPECT_NEAR(p.comm_share(), dp_comm / (0.5 + dp_comm), 1e-12);
  EXPECT_THROW(kmamba::perf::predict_dp(comm, work, 12), kmamba::UserError);  // not whole nodes
}

TEST(ScalingModel, TensorAndSequenceParallelPredictionsByHand) {
  const kmamba::perf::CommModel comm = hand_model();
  kmamba::perf::Workload work;
  work.compute_s = 0.6;
  work.tokens_per_gpu = 8192;
  const kmamba::perf::Shape& s = work.shape;
  const double P = kmamba::perf::parameter_count(s), R = kmamba::perf::replicated_parameter_count(s);
  const double head = 6 * R / kmamba::perf::flops_per_token(s);

  // tp 4 on 16 GPUs: dp 4 with 2 dp ranks per node; 2·48 all-reduces of 8192·1024·4 bytes over 4 ranks.
  const kmamba::perf::Prediction t = kmamba::perf::predict_tp(comm, work, 16, 4);
  EXPECT_EQ(t.dp, 4);
  EXPECT_NEAR(t.compute, 0.6 * (head + (1 - head) / 4), 1e-12);
  EXPECT_NEAR(t.tp_comm, 96 * (20e-6 + 8192.0 * 1024 * 4 * 1.5 / 150e9), 1e-12);
  // The layers split, the block norms (48 · 1024), the embedding and the final norm replicated:
  // 130.7M elements, 20 buckets of 6 553 600.
  const double block_norms = 48.0 * 1024, local = (P - R - block_norms) / 4 + R + block_norms;
  ASSERT_EQ(std::ceil(local / 6553600), 20.0);
  const double Mt = 4 * local;
  // Per bucket RS over 2 ranks (factor 1/2) + AR over 2 nodes of a half bucket + AG over 2 ranks.
  EXPECT_NEAR(t.dp_comm, 20 * (10e-6 + 30e-6 + 12e-6) + Mt / 2 / 100e9 + Mt / 2 / 50e9 + Mt / 2 / 200e9, 1e-12);
  EXPECT_NEAR(t.tokens_per_step, 4 * 8192.0, 0);

  // sp 8 at 65536 tokens on 16 GPUs: each GPU 8192 tokens (the measured step's) and the state
  // correction, 0.25 of the scans' share 0.1; per layer and direction ⌈log₂ 8⌉ = 3 state messages of
  // 32·(1 + 64·128) fp32 values and 7 conv-halo hops of 3·(2048 + 2·128), inside a node.
  const kmamba::perf::Prediction q = kmamba::perf::predict_sp(comm, work, 16, 8, 65536);
  EXPECT_EQ(q.dp, 2);
  EXPECT_NEAR(q.compute, 0.6 * (1 + 0.25 * 0.1), 1e-12);
  const double state = 8e-6 + 4.0 * 32 * (1 + 64 * 128) / 100e9, halo = 8e-6 + 4.0 * 3 * (2048 + 2 * 128) / 100e9;
  EXPECT_NEAR(q.sp_comm, 48 * 2 * (3 * state + 7 * halo), 1e-12);
  EXPECT_NEAR(q.tokens_per_step, 2 * 65536.0, 0);
  EXPECT_THROW(kmamba::perf::predict_tp(comm, work, 16, 16), kmamba::UserError);  // tp beyond a node
}

TEST(ScalingModel, CompressedGradientsByHand) {
  const kmamba::perf::CommModel comm = hand_model();
  kmamba::perf::Workload work;
  work.compute_s = 0.5;
  work.tokens_per_gpu = 16384;
  const double P = kmamba::perf::parameter_count(work.shape);
  // bf16 on the wire: the 57 buckets of 8 ranks (one node) at 2 bytes a value.
  work.compression = kmamba::GradientCompression::Bf16;
  kmamba::perf::Prediction p = kmamba::perf::predict_dp(comm, work, 8);
  EXPECT_NEAR(p.dp_comm, 57 * 20e-6 + 2 * P * 1.75 / 150e9, 1e-12);
  EXPECT_EQ(p.dp_fixed, 0.0);  // bucket reductions run during the backward
  // PowerSGD rank 4 on mamba2-370m: per layer in_proj (4384, 1024) and out_proj (1024, 2048)
  // compressed, the conv (2304, 4) not (4·2308 > 9216), nor the vectors (conv bias 2304, 3·32
  // per head, gated norm 2048, block norm 1024); the embedding (50280, 1024) compressed.
  work.compression = kmamba::GradientCompression::PowerSgd;
  p = kmamba::perf::predict_dp(comm, work, 8);
  const double rest = 9216.0 + 2304 + 96 + 2048 + 1024;
  const double p_values = 48 * (4 * 4384.0 + 4 * 1024 + rest) + 4 * 50280.0 + 1024;
  const double q_values = 48 * (4 * 1024.0 + 4 * 2048) + 4 * 1024.0;
  const double compressed = 48 * (4384.0 * 1024 + 1024.0 * 2048) + 50280.0 * 1024;
  const double expected = 2 * 20e-6 + 4 * (p_values + q_values) * 1.75 / 150e9 + 9 * 4 * compressed / 2.9e12;
  EXPECT_NEAR(p.dp_comm, expected, 1e-12);
  EXPECT_EQ(p.dp_fixed, p.dp_comm);  // after the backward, never hidden
  EXPECT_NEAR(p.step_overlap, 0.5 + expected, 1e-12);
}

TEST(ScalingModel, PipelinePredictionByHand) {
  const kmamba::perf::CommModel comm = hand_model();
  kmamba::perf::Workload work;
  work.compute_s = 0.5;
  work.tokens_per_gpu = 16384;
  const kmamba::perf::Shape& s = work.shape;
  const double head = 6 * kmamba::perf::replicated_parameter_count(s) / kmamba::perf::flops_per_token(s);
  // pp 2 × dp 8 on 16 GPUs, 8 micro-batches of 2·16384/8 = 4096 tokens: 9 slots of the last
  // stage (24 of 48 layers and the head); stage neighbours are 8 ranks apart, on the other node.
  const kmamba::perf::Prediction p = kmamba::perf::predict_pp(comm, work, 16, 2, 8);
  EXPECT_EQ(p.dp, 8);
  EXPECT_EQ(p.pp, 2);
  EXPECT_DOUBLE_EQ(p.bubble, 1.0 / 9);
  EXPECT_NEAR(p.tokens_per_step, 16 * 16384.0, 0);
  EXPECT_NEAR(p.compute, 9 * ((1 - head) / 2 + head) * 4096 * 0.5 / 16384, 1e-12);
  EXPECT_NEAR(p.pp_comm, 9 * 2 * (15e-6 + 4.0 * 4096 * 1024 / 50e9), 1e-12);
  EXPECT_THROW(kmamba::perf::predict_pp(comm, work, 16, 64, 8), kmamba::UserError);  // not a divisor
}

}  // namespace
