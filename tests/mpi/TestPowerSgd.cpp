// PowerSGD gradient compression (PowerSgd.hpp; DataParallelConfig::compression PowerSgd;
// docs/distributed.md §3.4), at 1, 2 and 4 ranks. Every rank draws fresh random gradients of its
// own (seeded by rank and step) and can compute every other rank's, so the tests know the exact
// sum S = Σ_ranks M (in double).
//
// Full rank: with r >= min(n, m), span(P) = range(S), so M̂ = P Pᵀ S = S up to rounding. The
// computed P = S Q + ΔP with |ΔP| ≤ (m + D)·u·|S||Q| (m-term products, a D-term sum; u = 2⁻²⁴)
// tilts span(P) by at most ‖ΔP‖/σ_min(S Q) ≤ (m + D)·u·κ(S)·κ(Q) (κ: the Frobenius condition
// number ‖A‖_F·‖A⁺‖_F ≥ ‖A‖₂‖A⁺‖₂, computed here in double); Gram–Schmidt twice leaves P orthonormal
// to a few n·u; Q = Sᵀ P adds (n + D)·u and M̂ = P Qᵀ r·u of ‖S‖. So
// ‖M̂ − S‖_F ≤ 4·(m + n + r + 2D)·u·κ(S)·κ(Q)·‖S‖_F (the factor 4 for the tilt entering M̂ twice and
// the second-order terms); observed 1e-7 to 3e-7 against bounds of 1e-4 to 4e-3 (κ 14 to 450). The whole elements are
// an fp32 all-reduce: |got − S| ≤ D·u·Σ|M|. Error feedback: per rank and element, E_t = E_{t−1} + G_t − M̂_t/D with two
// fp32 roundings (M = E + G, then E − M̂·(1/D)), so |E_t − (E_{t−1} + G_t − M̂_t/D)| ≤ 3u·(|E_{t−1}| + |G_t| + |M̂_t|/D);
// summed over the ranks and steps, Σ_ranks E_T = Σ_t (Σ_ranks G_t − M̂_t) within the sum of those bounds.
// Bitwise: after the two all-reduces every rank computes M̂ from the same values, so the reduced
// gradients of all ranks are equal bit for bit.
// Bytes: the two all-reduces carry Σ r·(n + m) values for the compressed matrices plus the
// whole elements, counted exactly by the counting communicator.
#include "ModelConfigs.hpp"

#include <kmamba/models/Data.hpp>
#include <kmamba/models/Distributed.hpp>
#include <kmamba/models/Trainer.hpp>
#include <kmamba/parallel/CountingCommunicator.hpp>
#include <kmamba/parallel/MpiCommunicator.hpp>
#include <kmamba/parallel/PowerSgd.hpp>
#include <kmamba/parallel/ProcessMesh.hpp>

#include "Checks.hpp"

#include <Kokkos_Core.hpp>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

using Exec = Kokkos::DefaultHostExecutionSpace;
using HostFloats = Kokkos::View<float*, Kokkos::HostSpace>;
constexpr double u = 1.0 / (1 << 24);  // fp32 unit roundoff

// Rank `rank`'s gradient at step `step`: n values, normal, fresh for every rank and step.
HostFloats gradient(int rank, int step, std::size_t n) {
  std::mt19937 gen(3000u + 97u * static_cast<unsigned>(step) + static_cast<unsigned>(rank));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  HostFloats g("kmamba::test::powersgd::gradient", n);
  for (std::size_t i = 0; i < n; ++i) g(i) = normal(gen);
  return g;
}

HostFloats copy(const HostFloats& x) {
  HostFloats y("kmamba::test::powersgd::copy", x.extent(0));
  Kokkos::deep_copy(y, x);
  return y;
}

// The Frobenius condition number ‖A‖_F·‖A⁺‖_F of a full-rank (rows, cols) row-major matrix, in
// double: G = the smaller Gram matrix, ‖A⁺‖_F² = trace(G⁻¹) = ‖L⁻¹‖_F² for G = L Lᵀ.
double condition(const std::vector<double>& a, int rows, int cols) {  // a: (rows, cols)
  const bool by_rows = rows < cols;
  const int k = by_rows ? rows : cols, other = by_rows ? cols : rows;
  const auto at = [&](int i, int l) {  // row i of the k-row factor
    return by_rows ? a[static_cast<std::size_t>(i * cols + l)] : a[static_cast<std::size_t>(l * cols + i)];
  };
  std::vector<double> g(static_cast<std::size_t>(k * k), 0.0), inv(static_cast<std::size_t>(k * k), 0.0);
  double trace = 0.0;
  for (int i = 0; i < k; ++i) {
    for (int j = 0; j < k; ++j) {
      for (int l = 0; l < other; ++l) g[static_cast<std::size_t>(i * k + j)] += at(i, l) * at(j, l);
    }
    trace += g[static_cast<std::size_t>(i * k + i)];
  }
  for (int j = 0; j < k; ++j) {  // Cholesky, in place (lower triangle)
    for (int i = j; i < k; ++i) {
      double s = g[static_cast<std::size_t>(i * k + j)];
      for (int l = 0; l < j; ++l) s -= g[static_cast<std::size_t>(i * k + l)] * g[static_cast<std::size_t>(j * k + l)];
      g[static_cast<std::size_t>(i * k + j)] = i == j ? std::sqrt(s) : s / g[static_cast<std::size_t>(j * k + j)];
    }
  }
  double inverse_trace = 0.0;
  for (int c = 0; c < k; ++c) {  // column c of L⁻¹ by forward substitution
    for (int i = c; i < k; ++i) {
      double s = i == c ? 1.0 : 0.0;
      for (int l = c; l < i; ++l)
        s -= g[static_cast<std::size_t>(i * k + l)] * inv[static_cast<std::size_t>(l * k + c)];
      inv[static_cast<std::size_t>(i * k + c)] = s / g[static_cast<std::size_t>(i * k + i)];
      inverse_trace += inv[static_cast<std::size_t>(i * k + c)] * inv[static_cast<std::size_t>(i * k + c)];
    }
  }
  return std::sqrt(trace * inverse_trace);
}

// The first step's Q of every matrix, as PowerSgd draws it (the same generator of this build).
std::vector<std::vector<double>> seed_q(const std::vector<kmamba::PowerSgdMatrix>& matrices, int rank) {
  std::mt19937_64 generator(kmamba::powersgd_default_seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<double>> q;
  for (const kmamba::PowerSgdMatrix& m : matrices) {
    q.emplace_back(static_cast<std::size_t>(m.cols * rank));
    for (double& x : q.back()) x = normal(generator);
  }
  return q;
}

bool equal_on_every_rank(const HostFloats& x) {
  HostFloats first = copy(x);
  MPI_Bcast(first.data(), static_cast<int>(first.extent(0)), MPI_FLOAT, 0, MPI_COMM_WORLD);
  int differs = std::memcmp(first.data(), x.data(), x.extent(0) * sizeof(float)) != 0 ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &differs, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  return differs == 0;
}

bool in_matrix(const std::vector<kmamba::PowerSgdMatrix>& matrices, std::size_t i) {
  for (const auto& m : matrices) {
    if (i >= m.offset && i < m.offset + static_cast<std::size_t>(m.rows * m.cols)) return true;
  }
  return false;
}

TEST(PowerSgd, FullRankReproducesTheSumOfTheGradients) {
  const kmamba::MpiCommunicator world(MPI_COMM_WORLD);
  const int p = world.size(), rank = 9;  // >= min(n, m) of every matrix below
  const std::vector<kmamba::PowerSgdMatrix> matrices{{3, 12, 5}, {67, 7, 9}, {132, 16, 3}};
  const std::size_t n = 185;  // whole elements [0, 3), [63, 67), [130, 132), [180, 185)
  std::vector<HostFloats> all;
  for (int r = 0; r < p; ++r) all.push_back(gradient(r, 0, n));
  kmamba::PowerSgd<Exec> powersgd(world, n, matrices, rank);
  HostFloats g = copy(all[static_cast<std::size_t>(world.rank())]);
  powersgd.reduce(Exec(), g);
  EXPECT_TRUE(equal_on_every_rank(g));

  std::vector<double> sum(n, 0.0), magnitude(n, 0.0);
  for (const HostFloats& x : all) {
    for (std::size_t i = 0; i < n; ++i) {
      sum[i] += x(i);
      magnitude[i] += std::abs(x(i));
    }
  }
  for (std::size_t i = 0; i < n; ++i) {
    if (!in_matrix(matrices, i)) {
      ASSERT_LE(std::abs(g(i) - sum[i]), p * u * magnitude[i]) << "whole element " << i;
    }
  }
  const auto q = seed_q(matrices, rank);
  for (std::size_t k = 0; k < matrices.size(); ++k) {
    const auto& m = matrices[k];
    const std::vector<double> s(
        sum.begin() + static_cast<std::ptrdiff_t>(m.offset),
        sum.begin() + static_cast<std::ptrdiff_t>(m.offset + static_cast<std::size_t>(m.rows * m.cols)));
    double error = 0.0, norm = 0.0;
    for (std::size_t i = 0; i < s.size(); ++i) {
      error += (g(m.offset + i) - s[i]) * (g(m.offset + i) - s[i]);
      norm += s[i] * s[i];
    }
    const double kappa = condition(s, static_cast<int>(m.rows), static_cast<int>(m.cols)) *
                         condition(q[k], static_cast<int>(m.cols), rank);
    const double bound = 4.0 * static_cast<double>(m.rows + m.cols + rank + 2 * p) * u * kappa;
    EXPECT_LE(std::sqrt(error / norm), bound) << "matrix " << k << " (" << m.rows << ", " << m.cols << "), κ " << kappa;
  }
}

TEST(PowerSgd, ErrorFeedbackKeepsWhatTheCompressionLeftOut) {
  const kmamba::MpiCommunicator world(MPI_COMM_WORLD);
  const int p = world.size(), rank = 2, steps = 5;
  const std::vector<kmamba::PowerSgdMatrix> matrices{{5, 24, 16}, {396, 10, 30}};
  const std::size_t n = 700;
  kmamba::PowerSgd<Exec> powersgd(world, n, matrices, rank);
  std::vector<double> left_out(n, 0.0), bound(n, 0.0);  // Σ_t (Σ_ranks G − M̂); the rounding allowed
  for (int t = 0; t < steps; ++t) {
    std::vector<HostFloats> all;
    for (int r = 0; r < p; ++r) all.push_back(gradient(r, t, n));
    const HostFloats before = copy(powersgd.error()), mine = all[static_cast<std::size_t>(world.rank())];
    HostFloats g = copy(mine);
    powersgd.reduce(Exec(), g);
    ASSERT_TRUE(equal_on_every_rank(g)) << "step " << t;
    std::vector<double> step_bound(n, 0.0);
    for (std::size_t i = 0; i < n; ++i) {
      const double expected = in_matrix(matrices, i) ? double(before(i)) + mine(i) - double(g(i)) / p : 0.0;
      step_bound[i] = 3.0 * u * (std::abs(before(i)) + std::abs(mine(i)) + std::abs(g(i)) / p);
      ASSERT_LE(std::abs(powersgd.error()(i) - expected), step_bound[i]) << "step " << t << ", element " << i;
    }
    MPI_Allreduce(MPI_IN_PLACE, step_bound.data(), static_cast<int>(n), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
    for (std::size_t i = 0; i < n; ++i) {
      double sum = 0.0, magnitude = 0.0;
      for (const HostFloats& x : all) {
        sum += x(i);
        magnitude += std::abs(x(i));
      }
      if (!in_matrix(matrices, i)) {
        ASSERT_LE(std::abs(g(i) - sum), p * u * magnitude) << "whole element " << i;
      }
      left_out[i] += in_matrix(matrices, i) ? sum - g(i) : 0.0;
      bound[i] += step_bound[i];
    }
  }
  std::vector<double> errors(n);
  for (std::size_t i = 0; i < n; ++i) errors[i] = powersgd.error()(i);
  MPI_Allreduce(MPI_IN_PLACE, errors.data(), static_cast<int>(n), MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  double kept = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_LE(std::abs(errors[i] - left_out[i]), bound[i] + 1e-12) << "element " << i;
    kept += std::abs(errors[i]);
  }
  EXPECT_GT(kept, 1.0) << "rank 2 of these matrices leaves something out";
}

TEST(PowerSgd, SendsTheFactorsAndTheWholeElements) {
  const auto log = std::make_shared<kmamba::CommunicationLog>();
  const kmamba::CountingCommunicator world(std::make_unique<kmamba::MpiCommunicator>(MPI_COMM_WORLD), log);
  const int p = world.size(), rank = 2;
  const std::vector<kmamba::PowerSgdMatrix> matrices{{5, 24, 16}, {396, 10, 30}};
  const std::size_t n = 700;
  kmamba::PowerSgd<Exec> powersgd(world, n, matrices, rank);
  HostFloats g = gradient(world.rank(), 0, n);
  powersgd.reduce(Exec(), g);
  // 2·(24 + 16) + 2·(10 + 30) = 160 factor values instead of 384 + 300; 700 − 684 = 16 whole.
  const std::int64_t values = 160 + 16;
  EXPECT_EQ(powersgd.wire_elements(), static_cast<std::size_t>(values));
  const auto& tally = log->tally("world", "all_reduce");
  EXPECT_EQ(tally.calls, 2);
  EXPECT_EQ(tally.elements, values);
  EXPECT_EQ(tally.bytes, 4 * values);
  EXPECT_DOUBLE_EQ(tally.sent_bytes, 2.0 * (p - 1) / p * 4.0 * static_cast<double>(values));
}

std::shared_ptr<const kmamba::Dataset> task() {
  return std::make_shared<kmamba::AssociativeRecallTask>(kmamba::AssociativeRecallConfig{32, 24, 4, 5});
}

kmamba::Trainer<Exec> make_trainer(int ngroups = 1) {
  kmamba::LanguageModel<Exec> model(
      kmamba::test::model_config(kmamba::MixerKind::Mamba2, {16, 2, 32, 8, 8, 8, ngroups}));
  model.initialize(1);
  kmamba::TrainConfig t;
  t.lr = 3e-3;
  t.min_lr = 3e-4;
  t.warmup_steps = 2;
  t.total_steps = 8;
  t.batch_size = 4;
  t.grad_clip = 0.5;
  t.eps = 1e-5;
  return kmamba::Trainer<Exec>(std::move(model), t, task());
}

kmamba::DataParallelConfig powersgd(int zero_stage = 0) {
  kmamba::DataParallelConfig options;
  options.zero_stage = zero_stage;
  options.compression = kmamba::GradientCompression::PowerSgd;
  options.powersgd_rank = 4;
  return options;
}

// A model's gradient reduction sends r·(n + m) values for each weight matrix the rule compresses
// and every other value whole; the expected count is computed here from the slab's shapes.
TEST(PowerSgd, DataParallelSendsFactorsOfTheModelsMatrices) {
  const auto log = std::make_shared<kmamba::CommunicationLog>();
  const kmamba::ProcessMesh mesh(
      std::make_unique<kmamba::CountingCommunicator>(std::make_unique<kmamba::MpiCommunicator>(MPI_COMM_WORLD), log),
      kmamba::MeshConfig());
  kmamba::Trainer<Exec> trainer = make_trainer();
  const auto& slab = trainer.model().parameters();
  std::int64_t expected = 0, compressed = 0;
  for (const auto& e : slab.entries()) {
    const std::int64_t rows = e.shape[0], cols = static_cast<std::int64_t>(e.size) / rows;
    const bool matrix = e.shape.size() >= 2 && 4 * (rows + cols) < rows * cols;
    expected += matrix ? 4 * (rows + cols) : static_cast<std::int64_t>(e.size);
    compressed += matrix ? 1 : 0;
  }
  EXPECT_GE(compressed, 3) << "the embedding and each layer's projections";
  kmamba::DataParallel<Exec> dp(mesh, trainer.model().config(), slab, kmamba::AdamWConfig(), powersgd());
  EXPECT_EQ(dp.powersgd()->matrices().size(), static_cast<std::size_t>(compressed));
  Kokkos::deep_copy(slab.grads(), gradient(mesh.world().rank(), 0, slab.size()));
  log->clear();
  dp.reduce_gradients(Exec(), slab);
  const auto& tally = log->tally("dp_sp", "all_reduce");
  const int p = mesh.data_sequence().size();
  EXPECT_EQ(tally.elements, expected) << "of " << slab.size() << " gradient values, " << expected << " travel";
  EXPECT_DOUBLE_EQ(tally.sent_bytes, 2.0 * (p - 1) / p * 4.0 * static_cast<double>(expected));
  EXPECT_LT(expected, static_cast<std::int64_t>(slab.size()) / 2);
  EXPECT_TRUE(equal_on_every_rank(slab.grads()));
  // A checkpoint holds no PowerSGD state: loading moments restarts it.
  dp.load_moments(Exec(), kmamba::ConstTensor1<float, Kokkos::HostSpace>(trainer.optimizer().first_moment()),
                  kmamba::ConstTensor1<float, Kokkos::HostSpace>(trainer.optimizer().second_moment()), 0);
  for (std::size_t i = 0; i < slab.size(); ++i) ASSERT_EQ(dp.powersgd()->error()(i), 0.0f);
}

// Training: PowerSGD at rank 4 keeps the replicas bitwise equal; with ZeRO-1 (the same reduced
// gradient, AdamW on shards, the norm summed in another order) it follows DDP within fp32
// rounding; its losses follow the uncompressed run's, the first equal (the same parameters), the
// later within 2% (a compressed gradient is another descent direction; observed at most 0.9% over
// these 8 steps, whose batches move the loss by up to 7%). That the loss falls over a longer run is
// train.mpi_dp2_powersgd's check.
TEST(PowerSgd, TrainsWithTheReplicasEqualAndZeroOneAgrees) {
  const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, kmamba::MeshConfig());
  kmamba::Trainer<Exec> ddp = make_trainer(), zero1 = make_trainer(), plain = make_trainer();
  ddp.enable_data_parallel(mesh, powersgd(0));
  zero1.enable_data_parallel(mesh, powersgd(1));
  plain.enable_data_parallel(mesh);
  for (int s = 0; s < 8; ++s) {
    const kmamba::StepResult a = ddp.step(), b = zero1.step(), c = plain.step();
    EXPECT_NEAR(b.loss, a.loss, 1e-5 * a.loss) << "step " << s + 1;
    if (s == 0) {
      EXPECT_EQ(a.loss, c.loss);
    }
    EXPECT_NEAR(a.loss, c.loss, 0.02 * c.loss) << "step " << s + 1;
    ASSERT_TRUE(equal_on_every_rank(ddp.model().parameters().params())) << "step " << s + 1;
    ASSERT_TRUE(equal_on_every_rank(zero1.model().parameters().params())) << "step " << s + 1;
  }
}

// A trainer on `mesh` holding this rank's shards of make_trainer(2)'s model (ngroups 2 splits over tp 2).
kmamba::Trainer<Exec> split_trainer(const kmamba::ProcessMesh& mesh, const kmamba::DataParallelConfig& options) {
  kmamba::Trainer<Exec> full = make_trainer(2);
  kmamba::LanguageModel<Exec> local(full.model().config(), {&mesh.tensor(), &mesh.sequence()});
  kmamba::scatter_parameters(Exec(), full.model(), local);
  kmamba::Trainer<Exec> trainer(std::move(local), full.config(), task());
  trainer.enable_data_parallel(mesh, options);
  return trainer;
}

// dp 2 × sp 2 and dp 2 × tp 2: the ranks that share the parameters (dp × sp) reduce them with
// PowerSGD and stay bitwise equal at every step (each tp rank compresses its own shards); the
// losses follow the uncompressed run on the same mesh within 2% (as above).
TEST(PowerSgd, SequenceAndTensorParallelMeshes) {
  int world = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world);
  if (world != 4) GTEST_SKIP() << "needs 4 ranks (dp 2 x sp 2, dp 2 x tp 2)";
  for (const bool tensor : {false, true}) {
    SCOPED_TRACE(tensor ? "dp 2 x tp 2" : "dp 2 x sp 2");
    kmamba::MeshConfig config;
    config.data_parallel_size = 2;
    (tensor ? config.tensor_parallel_size : config.sequence_parallel_size) = 2;
    const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, config);
    kmamba::Trainer<Exec> compressed = split_trainer(mesh, powersgd()),
                          plain = split_trainer(mesh, kmamba::DataParallelConfig());
    for (int s = 0; s < 6; ++s) {
      const kmamba::StepResult a = compressed.step(), c = plain.step();
      EXPECT_NEAR(a.loss, c.loss, 0.02 * c.loss) << "step " << s + 1;
      const auto params = compressed.model().parameters().params();
      HostFloats first = copy(params);
      mesh.data_sequence().broadcast(Exec(), first, 0);
      int differs = std::memcmp(first.data(), params.data(), params.extent(0) * sizeof(float)) != 0 ? 1 : 0;
      ASSERT_EQ(mesh.world().all_reduce_value(differs, kmamba::ReduceOp::Max), 0) << "step " << s + 1;
    }
  }
}

TEST(PowerSgd, LocalStepsAndABadRankAreRefused) {
  const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, kmamba::MeshConfig());
  kmamba::DataParallelConfig local = powersgd();
  local.sync_frequency = 4;
  kmamba::Trainer<Exec> refused = make_trainer();
  kmamba::test::expect_user_error([&] { refused.enable_data_parallel(mesh, local); },
                                  {"gradient_compression powersgd", "gradient_sync_frequency 4"});
  kmamba::DataParallelConfig zero_rank = powersgd();
  zero_rank.powersgd_rank = 0;
  kmamba::test::expect_user_error([&] { refused.enable_data_parallel(mesh, zero_rank); }, {"powersgd_rank", "got 0"});
  const kmamba::MpiCommunicator world(MPI_COMM_WORLD);
  kmamba::test::expect_user_error(
      [&] {
        kmamba::PowerSgd<Exec>(world, 50, {{0, 5, 5}, {20, 5, 5}}, 1);
      },
      {"overlaps another or lies outside"});
}

}  // namespace
