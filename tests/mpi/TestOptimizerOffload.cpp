// The offloaded optimizer under data parallelism (run at 1, 2 and 4 ranks; fp32): with DDP and
// ZeRO-1 (each rank's shards offloaded, updated on host threads, the parameters all-gathered after
// the copies back) a data-parallel trainer with the offloaded optimizer takes the same steps as one
// with the optimizer on the device — the same losses, gradient norms (clipping at every step),
// parameters and moments, bit for bit: the same reductions, the same float operations per element
// (host memory stands in for device memory here, through the GPU's code path: TestOptimizer.cpp) —
// and its checkpoint, the moments gathered from host memory, is the on-device run's file, from
// which an offloaded data-parallel run resumes and takes the same next step.
#include "Checks.hpp"
#include "ModelConfigs.hpp"

#include <kmamba/models/Data.hpp>
#include <kmamba/models/Distributed.hpp>
#include <kmamba/models/Trainer.hpp>
#include <kmamba/parallel/ProcessMesh.hpp>

#include <Kokkos_Core.hpp>
#include <gtest/gtest.h>
#include <mpi.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

namespace {

using Exec = Kokkos::DefaultHostExecutionSpace;

kmamba::Trainer<Exec> make_trainer(kmamba::OptimizerPlacement placement) {
  kmamba::LanguageModel<Exec> model(kmamba::test::model_config(kmamba::MixerKind::Mamba2, {16, 2, 32, 8, 8, 8}));
  model.initialize(1);
  kmamba::TrainConfig t;
  t.lr = 3e-3;
  t.min_lr = 3e-4;
  t.warmup_steps = 2;
  t.total_steps = 6;
  t.batch_size = 4;
  t.grad_clip = 0.05;
  t.weight_decay = 0.1;
  kmamba::Trainer<Exec> trainer(
      std::move(model), t,
      std::make_shared<kmamba::AssociativeRecallTask>(kmamba::AssociativeRecallConfig{32, 24, 4, 5}));
  trainer.set_optimizer_placement(placement);
  return trainer;
}

std::vector<float> parameters(const kmamba::Trainer<Exec>& trainer) {
  const auto& params = trainer.model().parameters().params();
  return std::vector<float>(params.data(), params.data() + params.extent(0));
}

// This rank's moments (its shards under ZeRO-1), from where they live.
std::vector<std::vector<float>> own_moments(const kmamba::Trainer<Exec>& trainer) {
  return kmamba::test::optimizer_moments<Exec>(trainer.data_parallel()->optimizer());
}

TEST(OptimizerOffload, DataParallelStepsAndCheckpointsEqualTheDeviceOptimizer) {
  const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, kmamba::MeshConfig());
  const int np = mesh.world().size();
  for (const int stage : {0, 1}) {
    SCOPED_TRACE("zero_stage " + std::to_string(stage));
    kmamba::DataParallelConfig options;
    options.zero_stage = stage;
    options.bucket_elements = 512;
    kmamba::Trainer<Exec> on_device = make_trainer(kmamba::OptimizerPlacement::Device);
    kmamba::Trainer<Exec> offloaded = make_trainer(kmamba::OptimizerPlacement::Host);
    on_device.enable_data_parallel(mesh, options);
    offloaded.enable_data_parallel(mesh, options);
    EXPECT_EQ(offloaded.optimizer_placement(), kmamba::OptimizerPlacement::Host);
    EXPECT_EQ(offloaded.data_parallel()->optimizer().placement(), kmamba::OptimizerPlacement::Host);
    EXPECT_EQ(offloaded.optimizer_device_bytes(), 0u);
    EXPECT_EQ(on_device.optimizer_device_bytes(), on_device.data_parallel()->optimizer().size() * 2 * sizeof(float));
    for (int s = 0; s < 3; ++s) {
      const kmamba::StepResult a = on_device.step(), b = offloaded.step();
      EXPECT_GT(a.grad_norm, 0.05) << "step " << s << " must clip";
      EXPECT_EQ(b.loss, a.loss) << "step " << s;
      EXPECT_EQ(b.grad_norm, a.grad_norm) << "step " << s;
    }
    EXPECT_EQ(parameters(offloaded), parameters(on_device));
    EXPECT_EQ(own_moments(offloaded), own_moments(on_device));

    const std::string base =
        ::testing::TempDir() + "kmamba_offload_np" + std::to_string(np) + "_zero" + std::to_string(stage);
    if (mesh.world().rank() == 0) {
      std::filesystem::remove_all(base + "_device");
      std::filesystem::remove_all(base + "_host");
    }
    mesh.world().barrier();
    on_device.save_checkpoint(base + "_device");
    offloaded.save_checkpoint(base + "_host");
    EXPECT_EQ(kmamba::test::file_text(base + "_host/training_state.safetensors"),
              kmamba::test::file_text(base + "_device/training_state.safetensors"));

    kmamba::Trainer<Exec> resumed = make_trainer(kmamba::OptimizerPlacement::Host);
    resumed.enable_data_parallel(mesh, options);
    resumed.resume(base + "_host");
    EXPECT_EQ(resumed.steps_taken(), 3);
    const kmamba::StepResult want = on_device.step(), got = resumed.step();
    EXPECT_EQ(got.loss, want.loss);
    EXPECT_EQ(parameters(resumed), parameters(on_device));
    EXPECT_EQ(own_moments(resumed), own_moments(on_device));
    mesh.world().barrier();
    if (mesh.world().rank() == 0) {
      std::filesystem::remove_all(base + "_device");
      std::filesystem::remove_all(base + "_host");
    }
  }
}

TEST(OptimizerOffload, LocalStepsAreRefused) {
  const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, kmamba::MeshConfig());
  kmamba::Trainer<Exec> offloaded = make_trainer(kmamba::OptimizerPlacement::Host);
  kmamba::DataParallelConfig options;
  options.sync_frequency = 2;
  kmamba::test::expect_user_error([&] { offloaded.enable_data_parallel(mesh, options); },
                                  {"offload_optimizer", "gradient_sync_frequency 2"});
}

}  // namespace
