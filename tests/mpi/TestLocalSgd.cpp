// Local SGD (DataParallelConfig::sync_frequency, docs/distributed.md §3.2; run at 1, 2 and 4
// ranks, fp32, DDP). Every rank also runs D one-rank trainers, one per dp replica, each stepping on
// that replica's micro-batches (the data set's micro-batch s·D + r at step s); after every N-th
// step it averages their parameters and AdamW moments itself. The data-parallel trainer of dp rank
// r must follow replica r's reference: between averagings the replicas differ (by O(lr) per
// step), after steps 4 and 8 (N = 4) they hold the same parameters, the references' average. The
// moments are checked through the steps after an averaging, which start from them. A checkpoint
// between averagings is refused; one after an averaging resumes bitwise.
//
// Tolerance: a replica's gradients are computed as its reference's, bitwise (the same batches,
// weights and kernels, one thread per rank); the gradient norm is the same sum of squares in
// another order (its double sum differs by ~1e-16 relative), so the clip scale and with it AdamW's
// update may differ in their last fp32 bits: ≤ 1 ulp of the update (lr · ≤ 1e-2 here) per step,
// amplified through m/√v by at most 1/eps_rel of the moments, and the average adds one rounding of a
// sum of D ≤ 4 values (≤ 2·D·u·max|p|, u = 2⁻²⁴). Over 8 steps that stays below 1e-6 absolute on
// parameters of magnitude ≤ 1 (observed: at most a few 1e-8), while two replicas after one local
// step already differ by more than 1e-4 (lr = 3e-3): the bound separates "equal" from "local".
// The replica's gradient norm equals its reference's within 1e-6 relative: the same gradients
// until the first averaging, then gradients of parameters that differ by the average's rounding
// (MPI sums D = 4 values in its own order), observed up to 1.3e-7 relative.
#include "ModelConfigs.hpp"

#include <kmamba/models/Data.hpp>
#include <kmamba/models/Distributed.hpp>
#include <kmamba/models/Trainer.hpp>
#include <kmamba/parallel/ProcessMesh.hpp>

#include "Checks.hpp"

#include <Kokkos_Core.hpp>
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace {

using Exec = Kokkos::DefaultHostExecutionSpace;
using HostFloats = Kokkos::View<float*, Kokkos::HostSpace>;

constexpr std::int64_t seqlen = 24, batch_size = 4, sync_frequency = 4;
constexpr double tolerance = 1e-6;     // parameters, absolute (file comment)
constexpr double local_spread = 1e-4;  // two replicas after a local step differ by more

std::shared_ptr<const kmamba::Dataset> task() {
  return std::make_shared<kmamba::AssociativeRecallTask>(kmamba::AssociativeRecallConfig{32, seqlen, 4, 5});
}

kmamba::Trainer<Exec> make_trainer(const std::shared_ptr<const kmamba::Dataset>& data) {
  kmamba::LanguageModel<Exec> model(kmamba::test::model_config(kmamba::MixerKind::Mamba2, {16, 2, 32, 8, 8, 8}));
  model.initialize(1);
  kmamba::TrainConfig t;
  t.lr = 3e-3;
  t.min_lr = 3e-4;
  t.warmup_steps = 2;
  t.total_steps = 8;
  t.batch_size = batch_size;
  t.grad_clip = 0.5;
  t.eps = 1e-5;
  return kmamba::Trainer<Exec>(std::move(model), t, data);
}

int world_size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

kmamba::DataParallelConfig local_sgd() {
  kmamba::DataParallelConfig options;
  options.bucket_elements = 512;
  options.sync_frequency = sync_frequency;
  return options;
}

template <class View>
HostFloats host(const View& x) {
  HostFloats out("kmamba::test::local_sgd::host", x.extent(0));
  Kokkos::deep_copy(out, x);
  return out;
}

double max_difference(const HostFloats& a, const HostFloats& b) {
  double d = 0.0;
  for (std::size_t i = 0; i < a.extent(0); ++i) d = std::max(d, std::abs(double(a(i)) - double(b(i))));
  return d;
}

// The references' parameters and both moments ← their mean, summed in rank order in fp32.
void average(std::vector<kmamba::Trainer<Exec>>& replicas) {
  const auto mean = [&](const auto& of) {
    std::vector<HostFloats> values;
    for (auto& r : replicas) values.push_back(host(of(r)));
    HostFloats avg("kmamba::test::local_sgd::average", values[0].extent(0));
    for (std::size_t i = 0; i < avg.extent(0); ++i) {
      float sum = 0.0f;
      for (const HostFloats& v : values) sum += v(i);
      avg(i) = sum * (1.0f / static_cast<float>(values.size()));
    }
    for (auto& r : replicas) Kokkos::deep_copy(of(r), avg);
  };
  mean([](kmamba::Trainer<Exec>& t) { return t.model().parameters().params(); });
  mean([](kmamba::Trainer<Exec>& t) { return t.optimizer().first_moment(); });
  mean([](kmamba::Trainer<Exec>& t) { return t.optimizer().second_moment(); });
}

// The largest difference between the parameters of rank 0 of `axis` and this rank's, over the world.
double spread(const kmamba::ProcessMesh& mesh, const kmamba::Communicator& axis, const kmamba::Trainer<Exec>& trainer) {
  const HostFloats mine = host(trainer.model().parameters().params());
  HostFloats first("kmamba::test::local_sgd::first", mine.extent(0));
  Kokkos::deep_copy(first, mine);
  axis.broadcast(Exec(), first, 0);
  return mesh.world().all_reduce_value(max_difference(first, mine), kmamba::ReduceOp::Max);
}

TEST(LocalSgd, ReplicasStepAloneAndAverageEveryNSteps) {
  const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, kmamba::MeshConfig());
  const int dp = mesh.config().data_parallel_size, rank = mesh.data().rank();
  const auto data = task();
  std::vector<kmamba::Trainer<Exec>> replicas;
  for (int r = 0; r < dp; ++r) replicas.push_back(make_trainer(data));
  kmamba::Trainer<Exec> trainer = make_trainer(data);
  trainer.enable_data_parallel(mesh, local_sgd());

  for (std::int64_t step = 1; step <= 2 * sync_frequency; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    const kmamba::StepResult got = trainer.step();
    double loss_sum = 0.0;
    std::int64_t tokens = 0;
    for (int r = 0; r < dp; ++r) {
      const kmamba::StepResult want = replicas[static_cast<std::size_t>(r)].step(
          {data->batch(kmamba::Split::Train, (step - 1) * dp + r, batch_size)});
      loss_sum += want.loss * static_cast<double>(want.tokens);
      tokens += want.tokens;
      if (r == rank) {
        EXPECT_NEAR(got.grad_norm, want.grad_norm, 1e-6 * want.grad_norm) << "the replica's norm";
      }
    }
    EXPECT_EQ(got.step, step);
    EXPECT_EQ(got.tokens, tokens) << "the loss and counts are global";
    EXPECT_NEAR(got.loss, loss_sum / static_cast<double>(tokens), 1e-6 * got.loss);
    const bool averaged = step % sync_frequency == 0;
    if (averaged) average(replicas);
    EXPECT_EQ(trainer.replicas_identical(), averaged || dp == 1);
    const HostFloats want = host(replicas[static_cast<std::size_t>(rank)].model().parameters().params());
    EXPECT_LE(max_difference(host(trainer.model().parameters().params()), want), tolerance);
    const double over_data = spread(mesh, mesh.data(), trainer);
    if (averaged || dp == 1) {
      EXPECT_EQ(over_data, 0.0) << "after an averaging every replica holds the same parameters";
    } else {
      EXPECT_GT(over_data, local_spread) << "between averagings the replicas step on their own data";
    }
  }
}

// dp 2 × sp 2: the sp ranks of a replica sum their segments' gradients at every step, so they
// hold the same parameters at every step, while the dp replicas differ between averagings. The
// first step's loss (from the same parameters) is the references' mean over both replicas within
// the sequence split's fp32 regrouping (2e-5 relative, as train.mpi_dp2sp2).
TEST(LocalSgd, SequenceRanksReduceEveryStep) {
  if (world_size() != 4) GTEST_SKIP() << "needs 4 ranks (dp 2 x sp 2)";
  kmamba::MeshConfig config;
  config.data_parallel_size = 2;
  config.sequence_parallel_size = 2;
  const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, config);
  const auto data = task();
  kmamba::Trainer<Exec> full = make_trainer(data);
  kmamba::LanguageModel<Exec> local(full.model().config(), {&mesh.tensor(), &mesh.sequence()});
  kmamba::scatter_parameters(Exec(), full.model(), local);
  kmamba::Trainer<Exec> trainer(std::move(local), full.config(), data);
  trainer.enable_data_parallel(mesh, local_sgd());

  double loss_sum = 0.0;
  std::int64_t tokens = 0;
  for (int r = 0; r < 2; ++r) {
    kmamba::Trainer<Exec> reference = make_trainer(data);
    const kmamba::StepResult want = reference.step({data->batch(kmamba::Split::Train, r, batch_size)});
    loss_sum += want.loss * static_cast<double>(want.tokens);
    tokens += want.tokens;
  }
  EXPECT_NEAR(trainer.step().loss, loss_sum / static_cast<double>(tokens), 2e-5 * loss_sum / tokens);
  for (std::int64_t step = 2; step <= 2 * sync_frequency; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    trainer.step();
    EXPECT_EQ(spread(mesh, mesh.sequence(), trainer), 0.0) << "the sp ranks of a replica step together";
    const double over_data = spread(mesh, mesh.data(), trainer);
    if (step % sync_frequency == 0) {
      EXPECT_EQ(over_data, 0.0);
    } else {
      EXPECT_GT(over_data, local_spread);
    }
  }
}

TEST(LocalSgd, CheckpointsOnlyAfterAnAveragingAndResumeExactly) {
  const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, kmamba::MeshConfig());
  const int dp = mesh.config().data_parallel_size;
  const auto data = task();
  const std::string dir = ::testing::TempDir() + "kmamba_local_sgd_np" + std::to_string(mesh.world().size());
  if (mesh.world().rank() == 0) std::filesystem::remove_all(dir);
  mesh.world().barrier();

  kmamba::Trainer<Exec> trainer = make_trainer(data);
  trainer.enable_data_parallel(mesh, local_sgd());
  for (std::int64_t s = 0; s < sync_frequency; ++s) trainer.step();
  trainer.save_checkpoint(dir);
  trainer.step();
  if (dp > 1) {
    kmamba::test::expect_user_error([&] { trainer.save_checkpoint(dir + "_between"); },
                                    {"save_checkpoint", "step 5", "replicas differ", "gradient_sync_frequency"});
  }
  for (std::int64_t s = sync_frequency + 1; s < 2 * sync_frequency; ++s) trainer.step();

  kmamba::Trainer<Exec> resumed = make_trainer(data);
  resumed.enable_data_parallel(mesh, local_sgd());
  resumed.resume(dir);
  EXPECT_EQ(resumed.steps_taken(), sync_frequency);
  for (std::int64_t s = sync_frequency; s < 2 * sync_frequency; ++s) resumed.step();
  EXPECT_EQ(max_difference(host(resumed.model().parameters().params()), host(trainer.model().parameters().params())),
            0.0)
      << "the resumed run continues bitwise";
}

TEST(LocalSgd, FrequencyOneIsDataParallelAndZeroOneIsRefused) {
  const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, kmamba::MeshConfig());
  const auto data = task();
  kmamba::Trainer<Exec> ddp = make_trainer(data), explicit_one = make_trainer(data);
  kmamba::DataParallelConfig one;
  one.sync_frequency = 1;
  ddp.enable_data_parallel(mesh);
  explicit_one.enable_data_parallel(mesh, one);
  for (int s = 0; s < 3; ++s) {
    const kmamba::StepResult a = ddp.step(), b = explicit_one.step();
    EXPECT_EQ(a.loss, b.loss);
    EXPECT_EQ(a.grad_norm, b.grad_norm);
  }
  EXPECT_EQ(max_difference(host(ddp.model().parameters().params()), host(explicit_one.model().parameters().params())),
            0.0);

  kmamba::DataParallelConfig zero = local_sgd();
  zero.zero_stage = 1;
  kmamba::Trainer<Exec> refused = make_trainer(data);
  kmamba::test::expect_user_error([&] { refused.enable_data_parallel(mesh, zero); },
                                  {"zero_stage 1", "gradient_sync_frequency 4"});
}

}  // namespace
