// The Trainer's data-parallel hook (run at 1, 2 and 4 ranks; fp32): a trainer on dp ranks, each
// with grad_accum micro-batches, equals one trainer with dp · grad_accum micro-batches per step —
// the same batches, step results (global loss, tokens, norm) and parameters after 3 steps, with
// DDP and ZeRO-1 — and its checkpoints (moments gathered, written by rank 0) resume the 1-rank run
// and a data-parallel run alike. With dynamic task allocation (LoadBalancing) on packed rows of
// very unequal real tokens, the rows dealt to the ranks by real tokens give the same steps and
// parameters within the same bounds (the same terms, summed in other groups), and the busiest rank
// is never busier than its fixed share.
//
// "Equal" (support/RoundingBounds.hpp): the ranks sum the micro-batches' gradients in another order
// than one trainer does. Losses agree within τ = 8·√N·u (N from the model's dimensions, 0.8e3 to
// 1.1e3 at 1 to 4 ranks: τ ≈ 1.4e-5 to 1.6e-5), gradient norms within ‖δ‖₂ of the gradients' bounds δ (τ times the
// largest gradient of each tensor at the first step, of the slab after), parameters within AdamWDifferenceBound carried
// along the reference run, element by element. np 1 is bitwise identical.
#include "ModelConfigs.hpp"
#include "RoundingBounds.hpp"

#include <kmamba/models/Data.hpp>
#include <kmamba/models/Distributed.hpp>
#include <kmamba/models/Trainer.hpp>
#include <kmamba/parallel/ProcessMesh.hpp>

#include <Kokkos_Core.hpp>
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

namespace {

using Exec = Kokkos::DefaultHostExecutionSpace;
using Mem = Exec::memory_space;

constexpr std::int64_t seqlen = 24, batch_size = 4;

kmamba::ModelConfig tiny_config() {
  return kmamba::test::model_config(kmamba::MixerKind::Mamba2, {16, 2, 32, 8, 8, 8});
}

int world_size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

kmamba::TrainConfig train_config(std::int64_t grad_accum) {
  kmamba::TrainConfig t;
  t.lr = 3e-3;
  t.min_lr = 3e-4;
  t.warmup_steps = 2;
  t.total_steps = 6;
  t.batch_size = batch_size;
  t.grad_accum = grad_accum;
  t.grad_clip = 0.5;
  t.eps = 1e-5;  // bounds Adam's amplification of rounding differences (see TestDataParallel.cpp)
  return t;
}

std::shared_ptr<const kmamba::Dataset> task() {
  return std::make_shared<kmamba::AssociativeRecallTask>(kmamba::AssociativeRecallConfig{32, seqlen, 4, 5});
}

// Packed documents of very unequal real tokens: runs of 40 text tokens, each a document, between
// runs of 150 end-of-document tokens (31), which are not real tokens (their targets are ignored).
// With seed 9 the fourth batch of 4 rows holds no real token (the others 2 to 63): a fixed share
// without real tokens at 2 and 4 ranks.
std::shared_ptr<const kmamba::Dataset> packed_task() {
  std::vector<std::uint32_t> tokens;
  for (int run = 0; run < 12; ++run) {
    for (int i = 0; i < 40; ++i) tokens.push_back(static_cast<std::uint32_t>(1 + (i * 7 + run * 3) % 30));
    tokens.insert(tokens.end(), 150, 31u);
  }
  kmamba::TokenDatasetConfig config;
  config.seqlen = seqlen;
  config.seed = 9;
  config.document_end = 31;
  return std::make_shared<kmamba::TokenDataset>(std::move(tokens), 32, config);
}

kmamba::Trainer<Exec> make_trainer(std::int64_t grad_accum,
                                   const std::shared_ptr<const kmamba::Dataset>& data = task()) {
  kmamba::LanguageModel<Exec> model(tiny_config());
  model.initialize(1);
  return kmamba::Trainer<Exec>(std::move(model), train_config(grad_accum), data);
}

/// A 1-rank trainer's steps and, along them, the bounds of the file comment for a run whose
/// gradients are summed in another order.
struct Reference {
  std::vector<kmamba::StepResult> steps;
  std::vector<double> norm_bounds;
  kmamba::test::AdamWDifferenceBound bound;
  double tolerance;

  Reference(kmamba::Trainer<Exec>& trainer, int count)
      : bound(trainer.config().adamw(), trainer.model().parameters().size(), trainer.model().parameters().decay_end()),
        tolerance(kmamba::test::model_tolerance(trainer.model().config(), seqlen,
                                                trainer.config().grad_accum * batch_size * seqlen)) {
    const auto& slab = trainer.model().parameters();
    for (int s = 0; s < count; ++s) {
      steps.push_back(trainer.step());
      const auto grads = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), slab.grads());
      const auto params = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), slab.params());
      const double norm = steps.back().grad_norm, max_norm = trainer.config().grad_clip;
      const std::vector<double> delta = s == 0 ? kmamba::test::per_tensor_bounds(slab.entries(), grads, tolerance)
                                               : kmamba::test::slab_bounds(grads, tolerance);
      norm_bounds.push_back(kmamba::test::norm_difference_bound(delta, norm));
      bound.step(grads, delta, kmamba::clip_scale(norm, max_norm),
                 kmamba::test::clip_scale_difference(norm, norm_bounds.back(), max_norm), steps.back().lr, params);
    }
  }
};

void expect_same_parameters(const kmamba::Trainer<Exec>& got, const kmamba::Trainer<Exec>& ref, const Reference& bounds,
                            const std::string& what) {
  const auto& slab = ref.model().parameters();
  const auto a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), got.model().parameters().params());
  const auto b = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), slab.params());
  kmamba::test::expect_within(
      slab.entries(), a, b, [&](std::size_t i) { return bounds.bound.parameter(i); }, what);
}

void expect_same_step(const kmamba::StepResult& got, const Reference& ref, std::size_t index) {
  const kmamba::StepResult& want = ref.steps[index];
  EXPECT_EQ(got.step, want.step);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_EQ(got.correct, want.correct);
  EXPECT_EQ(got.input_tokens, want.input_tokens);
  EXPECT_DOUBLE_EQ(got.lr, want.lr);
  EXPECT_LE(std::abs(got.loss - want.loss), ref.tolerance * want.loss);
  EXPECT_LE(std::abs(got.grad_norm - want.grad_norm), ref.norm_bounds[index]);
}

TEST(DistributedTrainer, DataParallelStepsAndCheckpointsEqualOneRank) {
  const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, kmamba::MeshConfig());
  const int dp = mesh.config().data_parallel_size;
  constexpr int steps = 3;

  // One rank, dp micro-batches per step: the same batches as dp ranks with one each.
  kmamba::Trainer<Exec> reference = make_trainer(dp);
  const Reference ref(reference, steps);
  ASSERT_GT(ref.steps[0].grad_norm, 0.5) << "the test must exercise clipping";
  // The same run one step longer, for the resumed runs' next step.
  kmamba::Trainer<Exec> continued = make_trainer(dp);
  const Reference longer(continued, steps + 1);

  for (const int stage : {0, 1}) {
    SCOPED_TRACE("zero_stage " + std::to_string(stage));
    kmamba::Trainer<Exec> trainer = make_trainer(1);
    kmamba::DataParallelConfig options;
    options.zero_stage = stage;
    options.bucket_elements = 512;
    trainer.enable_data_parallel(mesh, options);
    for (int s = 0; s < steps; ++s) expect_same_step(trainer.step(), ref, static_cast<std::size_t>(s));
    EXPECT_EQ(trainer.steps_taken(), steps);
    EXPECT_EQ(trainer.data_position(), reference.data_position());
    expect_same_parameters(trainer, reference, ref, "after 3 steps:");

    // The checkpoint holds the gathered moments: the 1-rank run and a data-parallel run resume
    // from it and take the same next step as the reference.
    const std::string dir =
        ::testing::TempDir() + "kmamba_dp_trainer_np" + std::to_string(world_size()) + "_zero" + std::to_string(stage);
    if (mesh.world().rank() == 0) std::filesystem::remove_all(dir);
    mesh.world().barrier();
    trainer.save_checkpoint(dir);

    kmamba::Trainer<Exec> next_reference = make_trainer(dp);
    next_reference.resume(dir);
    kmamba::Trainer<Exec> resumed_dp = make_trainer(1);
    resumed_dp.enable_data_parallel(mesh, options);
    resumed_dp.resume(dir);
    // From the data-parallel run's state (within `ref`'s bounds of the reference) one more step:
    // within the bounds carried one step further.
    expect_same_step(next_reference.step(), longer, steps);
    expect_same_step(resumed_dp.step(), longer, steps);
    expect_same_parameters(next_reference, continued, longer, "1-rank resume:");
    expect_same_parameters(resumed_dp, continued, longer, "data-parallel resume:");
  }
}

// Rows of very unequal real tokens: the fixed shares (some rank may hold none and run no
// backward) and the rows dealt by real tokens both give the one-rank steps.
TEST(DistributedTrainer, PackedRowsOfUnequalRealTokensEqualOneRank) {
  const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, kmamba::MeshConfig());
  const int dp = mesh.config().data_parallel_size;
  constexpr int steps = 3;
  kmamba::Trainer<Exec> reference = make_trainer(dp, packed_task());
  const Reference ref(reference, steps);
  const auto sum = [](const std::vector<std::int64_t>& v) {
    return std::accumulate(v.begin(), v.end(), std::int64_t{0});
  };
  const auto busiest = [](const std::vector<std::int64_t>& v) { return *std::max_element(v.begin(), v.end()); };

  for (const bool dynamic : {false, true}) {
    SCOPED_TRACE(dynamic ? "dynamic task allocation" : "fixed shares");
    kmamba::Trainer<Exec> trainer = make_trainer(1, packed_task());
    kmamba::LoadBalancing balancing;
    balancing.dynamic_task_allocation = dynamic;
    balancing.data_redistribution_threshold = 0.0;
    trainer.set_load_balancing(balancing);
    trainer.enable_data_parallel(mesh);
    bool moved = false, idle_share = false;
    for (int s = 0; s < steps; ++s) {
      const kmamba::StepResult r = trainer.step();
      expect_same_step(r, ref, static_cast<std::size_t>(s));
      if (!dynamic) {
        EXPECT_TRUE(r.rank_tokens.empty());
        continue;
      }
      ASSERT_EQ(r.rank_tokens.size(), static_cast<std::size_t>(dp));
      ASSERT_EQ(r.fixed_share_tokens.size(), static_cast<std::size_t>(dp));
      EXPECT_EQ(sum(r.rank_tokens), r.tokens);
      EXPECT_EQ(sum(r.fixed_share_tokens), r.tokens);
      EXPECT_LE(busiest(r.rank_tokens), busiest(r.fixed_share_tokens));
      moved = moved || r.rows_moved;
      idle_share = idle_share || *std::min_element(r.fixed_share_tokens.begin(), r.fixed_share_tokens.end()) == 0;
    }
    if (dynamic) {
      EXPECT_EQ(moved, dp > 1) << "the packed rows are out of balance on several ranks, never on one";
      EXPECT_EQ(idle_share, dp > 1) << "some fixed share without real tokens (no backward on its rank)";
    }
    EXPECT_EQ(trainer.data_position(), reference.data_position());
    expect_same_parameters(trainer, reference, ref, "after 3 steps:");
  }
}

TEST(DistributedTrainer, AFailedCheckpointWriteFailsOnEveryRank) {
  const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, kmamba::MeshConfig());
  kmamba::Trainer<Exec> trainer = make_trainer(1);
  trainer.enable_data_parallel(mesh);
  std::string error = "no error";
  try {
    trainer.save_checkpoint("/proc/kmamba-not-writable/checkpoint");
  } catch (const kmamba::UserError& e) {
    error = e.what();
  }
  if (mesh.world().rank() == 0) {
    EXPECT_NE(error.find("kmamba-not-writable"), std::string::npos) << error;
  } else {
    EXPECT_NE(error.find("world rank 0 failed to write"), std::string::npos) << error;
  }
}

}  // namespace
