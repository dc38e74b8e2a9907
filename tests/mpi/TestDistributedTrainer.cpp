// The Trainer's data-parallel hook (run at 1, 2 and 4 ranks; fp32): a trainer on dp ranks, each
// with grad_accum micro-batches, equals one trainer with dp · grad_accum micro-batches per step —
// the same batches, step results (global loss, tokens, norm) and parameters after 3 steps, with
// DDP and ZeRO-1 — and its checkpoints (moments gathered, written by rank 0) resume the 1-rank run
// and a data-parallel run alike. "Equal" is max|Δ| ≤ 1e-5·max|ref| per parameter (measured at np
// 2 and 4: parameters within 4.1e-7, losses 1.7e-8; np 1 is bitwise identical).
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
#include <string>
#include <vector>

namespace {

using Exec = Kokkos::DefaultHostExecutionSpace;
using Mem = Exec::memory_space;

constexpr double tolerance = 1e-5;

kmamba::ModelConfig tiny_config() {
  kmamba::ModelConfig c;
  c.mixer = kmamba::MixerKind::Mamba2;
  c.d_model = 16;
  c.n_layer = 2;
  c.vocab_size = 32;
  c.d_state = 8;
  c.headdim = 8;
  c.chunk_size = 8;
  c.validate();
  return c;
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
  t.batch_size = 4;
  t.grad_accum = grad_accum;
  t.grad_clip = 0.5;
  t.eps = 1e-5;  // bounds Adam's amplification of rounding differences (see TestDataParallel.cpp)
  return t;
}

std::shared_ptr<const kmamba::Dataset> task() {
  return std::make_shared<kmamba::AssociativeRecallTask>(kmamba::AssociativeRecallConfig{32, 24, 4, 5});
}

kmamba::Trainer<Exec> make_trainer(std::int64_t grad_accum) {
  kmamba::LanguageModel<Exec> model(tiny_config());
  model.initialize(1);
  return kmamba::Trainer<Exec>(std::move(model), train_config(grad_accum), task());
}

void expect_same_parameters(const kmamba::Trainer<Exec>& got, const kmamba::Trainer<Exec>& ref,
                            const std::string& what) {
  const auto& slab = ref.model().parameters();
  const auto a = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), got.model().parameters().params());
  const auto b = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), slab.params());
  for (const auto& entry : slab.entries()) {
    double diff = 0.0, scale = 0.0;
    for (std::size_t i = entry.offset; i < entry.offset + entry.size; ++i) {
      diff = std::max(diff, std::abs(static_cast<double>(a(i)) - static_cast<double>(b(i))));
      scale = std::max(scale, std::abs(static_cast<double>(b(i))));
    }
    EXPECT_LE(diff, tolerance * scale) << what << " " << entry.name;
  }
}

void expect_same_step(const kmamba::StepResult& got, const kmamba::StepResult& ref) {
  EXPECT_EQ(got.step, ref.step);
  EXPECT_EQ(got.tokens, ref.tokens);
  EXPECT_EQ(got.correct, ref.correct);
  EXPECT_EQ(got.input_tokens, ref.input_tokens);
  EXPECT_DOUBLE_EQ(got.lr, ref.lr);
  EXPECT_LE(std::abs(got.loss - ref.loss), tolerance * ref.loss);
  // The norm of gradients summed in another order (ranks vs micro-batches): measured ≤ 6.2e-7.
  EXPECT_LE(std::abs(got.grad_norm - ref.grad_norm), tolerance * ref.grad_norm);
}

TEST(DistributedTrainer, DataParallelStepsAndCheckpointsEqualOneRank) {
  const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, kmamba::MeshConfig());
  const int dp = mesh.config().data_parallel_size;
  constexpr int steps = 3;

  // One rank, dp micro-batches per step: the same batches as dp ranks with one each.
  kmamba::Trainer<Exec> reference = make_trainer(dp);
  std::vector<kmamba::StepResult> ref_steps;
  for (int s = 0; s < steps; ++s) ref_steps.push_back(reference.step());
  ASSERT_GT(ref_steps[0].grad_norm, 0.5) << "the test must exercise clipping";

  for (const int stage : {0, 1}) {
    SCOPED_TRACE("zero_stage " + std::to_string(stage));
    kmamba::Trainer<Exec> trainer = make_trainer(1);
    kmamba::DataParallelConfig options;
    options.zero_stage = stage;
    options.bucket_elements = 512;
    trainer.enable_data_parallel(mesh, options);
    for (int s = 0; s < steps; ++s) expect_same_step(trainer.step(), ref_steps[static_cast<std::size_t>(s)]);
    EXPECT_EQ(trainer.steps_taken(), steps);
    EXPECT_EQ(trainer.data_position(), reference.data_position());
    expect_same_parameters(trainer, reference, "after 3 steps:");

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
    kmamba::Trainer<Exec> continued = make_trainer(dp);
    for (int s = 0; s < steps; ++s) continued.step();
    const kmamba::StepResult ref_next = continued.step();
    expect_same_step(next_reference.step(), ref_next);
    expect_same_step(resumed_dp.step(), ref_next);
    expect_same_parameters(next_reference, continued, "1-rank resume:");
    expect_same_parameters(resumed_dp, continued, "data-parallel resume:");
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
