// The process mesh (run at 1, 2 and 4 ranks): rank order tp fastest, then sp, then dp, then pp; for
// every factorisation of the world into pp × dp × tp × sp, each axis communicator holds exactly the ranks the
// closed-form layout names, in order; configurations that do not fit the world or the model give
// the same clear error on every rank, without hanging.
#include <kmamba/models/Config.hpp>
#include <kmamba/models/Distributed.hpp>
#include <kmamba/parallel/ProcessMesh.hpp>

#include "Checks.hpp"

#include <Kokkos_Core.hpp>
#include <gtest/gtest.h>
#include <mpi.h>

#include <string>
#include <vector>

namespace {

using kmamba::test::user_error;

using Exec = Kokkos::DefaultHostExecutionSpace;

void expect_contains(const std::string& text, const std::string& part) {
  EXPECT_NE(text.find(part), std::string::npos) << text;
}

int world_size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

std::vector<kmamba::MeshConfig> factorisations(int world) {
  std::vector<kmamba::MeshConfig> all;
  for (int tp = 1; tp <= world; ++tp) {
    for (int sp = 1; tp * sp <= world; ++sp) {
      for (int pp = 1; tp * sp * pp <= world; ++pp) {
        if (world % (tp * sp * pp) != 0) continue;
        kmamba::MeshConfig c;
        c.data_parallel_size = world / (tp * sp * pp);
        c.tensor_parallel_size = tp;
        c.sequence_parallel_size = sp;
        c.pipeline_parallel_size = pp;
        all.push_back(c);
      }
    }
  }
  return all;
}

TEST(ProcessMesh, ConfigFromJson) {
  const auto c = kmamba::MeshConfig::from_json(
      R"({"tensor_parallel_size": 2, "sequence_parallel_size": 4, "pipeline_parallel_size": 3})", "mesh.json");
  EXPECT_EQ(c.data_parallel_size, 0);
  EXPECT_EQ(c.tensor_parallel_size, 2);
  EXPECT_EQ(c.sequence_parallel_size, 4);
  EXPECT_EQ(c.pipeline_parallel_size, 3);
  const auto back = kmamba::MeshConfig::from_json(c.to_json(), "round trip");
  EXPECT_EQ(back.tensor_parallel_size, 2);
  EXPECT_EQ(back.sequence_parallel_size, 4);
  EXPECT_EQ(back.pipeline_parallel_size, 3);
  expect_contains(user_error([] { kmamba::MeshConfig::from_json(R"({"virtual_stages": 2})", "mesh.json"); }),
                  "mesh.json: unknown key 'virtual_stages'");
  expect_contains(user_error([] {
                    kmamba::MeshConfig pp;
                    pp.pipeline_parallel_size = 3;
                    pp.resolve(4);
                  }),
                  "the world has 4 ranks, which is not a multiple of tensor_parallel_size 1 × sequence_parallel_size 1 "
                  "× pipeline_parallel_size 3 = 3");
  expect_contains(user_error([] { kmamba::MeshConfig::from_json(R"({"data_parallel_size": -1})", "mesh.json"); }),
                  "'data_parallel_size' must be a non-negative integer, got -1");
  expect_contains(user_error([] { kmamba::MeshConfig::from_json(R"({"tensor_parallel_size": 1.5})", "m"); }),
                  "'tensor_parallel_size' must be a non-negative integer");
  expect_contains(user_error([] { kmamba::MeshConfig::from_json("[1, 2]", "m"); }), "must hold a JSON object");
  expect_contains(user_error([] { kmamba::MeshConfig::from_json("{", "broken.json"); }),
                  "broken.json is not valid JSON");
}

TEST(ProcessMesh, ResolveAgainstTheWorldSize) {
  kmamba::MeshConfig c;
  c.tensor_parallel_size = 2;
  EXPECT_EQ(c.resolve(8).data_parallel_size, 4);
  expect_contains(
      user_error([&] { c.resolve(3); }),
      "the world has 3 ranks, which is not a multiple of tensor_parallel_size 2 × sequence_parallel_size 1 = 2");
  c.data_parallel_size = 3;
  expect_contains(
      user_error([&] { c.resolve(8); }),
      "data_parallel_size 3 × tensor_parallel_size 2 × sequence_parallel_size 1 = 6 ranks, but the world has 8");
  c.tensor_parallel_size = 0;
  expect_contains(user_error([&] { c.resolve(8); }), "tensor_parallel_size must be >= 1, got 0");
}

TEST(ProcessMesh, LayoutOrdersTensorFastestThenSequenceThenDataThenPipeline) {
  for (int world = 1; world <= 8; ++world) {
    for (const auto& config : factorisations(world)) {
      const kmamba::MeshLayout layout(config);
      const int t = config.tensor_parallel_size, c = config.sequence_parallel_size, d = config.data_parallel_size;
      for (int rank = 0; rank < world; ++rank) {
        const kmamba::MeshCoordinates at = layout.coordinates_of(rank);
        EXPECT_EQ(rank, at.tp + t * (at.sp + c * (at.dp + d * at.pp)));  // docs/distributed.md §6
        EXPECT_EQ(layout.rank_of(at), rank);
        // Group members differ from `rank` only along their axis.
        for (const int member : layout.group(kmamba::MeshAxis::Tensor, rank)) {
          EXPECT_EQ(layout.coordinates_of(member).dp, at.dp);
          EXPECT_EQ(layout.coordinates_of(member).sp, at.sp);
          EXPECT_EQ(layout.coordinates_of(member).pp, at.pp);
        }
        for (const int member : layout.group(kmamba::MeshAxis::Data, rank)) {
          EXPECT_EQ(layout.coordinates_of(member).tp, at.tp);
          EXPECT_EQ(layout.coordinates_of(member).sp, at.sp);
          EXPECT_EQ(layout.coordinates_of(member).pp, at.pp);
        }
        for (const int member : layout.group(kmamba::MeshAxis::DataSequence, rank)) {
          EXPECT_EQ(layout.coordinates_of(member).tp, at.tp);
          EXPECT_EQ(layout.coordinates_of(member).pp, at.pp);
        }
        const std::vector<int> stages = layout.group(kmamba::MeshAxis::Pipeline, rank);
        EXPECT_EQ(static_cast<int>(stages.size()), config.pipeline_parallel_size);
        for (std::size_t s = 0; s < stages.size(); ++s) {
          const kmamba::MeshCoordinates m = layout.coordinates_of(stages[s]);
          EXPECT_EQ(m.pp, static_cast<int>(s));
          EXPECT_EQ(m.dp, at.dp);
          EXPECT_EQ(m.tp, at.tp);
          EXPECT_EQ(m.sp, at.sp);
        }
      }
    }
  }
  kmamba::MeshConfig c;
  c.data_parallel_size = 2;
  c.tensor_parallel_size = 2;
  c.sequence_parallel_size = 2;
  const kmamba::MeshLayout layout(c);
  EXPECT_EQ(layout.group(kmamba::MeshAxis::Tensor, 5), (std::vector<int>{4, 5}));
  EXPECT_EQ(layout.group(kmamba::MeshAxis::Sequence, 5), (std::vector<int>{5, 7}));
  EXPECT_EQ(layout.group(kmamba::MeshAxis::Data, 5), (std::vector<int>{1, 5}));
  EXPECT_EQ(layout.group(kmamba::MeshAxis::DataSequence, 5), (std::vector<int>{1, 3, 5, 7}));
  c.data_parallel_size = 1;
  c.pipeline_parallel_size = 2;
  const kmamba::MeshLayout stages(c);
  EXPECT_EQ(stages.group(kmamba::MeshAxis::Pipeline, 5), (std::vector<int>{1, 5}));
  EXPECT_EQ(stages.group(kmamba::MeshAxis::DataSequence, 5), (std::vector<int>{5, 7}));
}

TEST(ProcessMesh, AxisCommunicatorsHoldTheLayoutGroups) {
  const Exec exec;
  for (const auto& config : factorisations(world_size())) {
    SCOPED_TRACE("dp " + std::to_string(config.data_parallel_size) + " tp " +
                 std::to_string(config.tensor_parallel_size) + " sp " + std::to_string(config.sequence_parallel_size) +
                 " pp " + std::to_string(config.pipeline_parallel_size));
    kmamba::MeshConfig derived = config;
    derived.data_parallel_size = 0;  // derived from the world size
    const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, derived);
    EXPECT_EQ(mesh.config().data_parallel_size, config.data_parallel_size);
    const int rank = mesh.world().rank();
    const kmamba::MeshCoordinates at = mesh.coordinates();
    EXPECT_EQ(mesh.layout().rank_of(at), rank);
    EXPECT_EQ(mesh.data().rank(), at.dp);
    EXPECT_EQ(mesh.tensor().rank(), at.tp);
    EXPECT_EQ(mesh.sequence().rank(), at.sp);
    EXPECT_EQ(mesh.pipeline().rank(), at.pp);
    for (const auto axis : {kmamba::MeshAxis::Data, kmamba::MeshAxis::Tensor, kmamba::MeshAxis::Sequence,
                            kmamba::MeshAxis::DataSequence, kmamba::MeshAxis::Pipeline}) {
      const kmamba::Communicator& comm = mesh.axis(axis);
      EXPECT_EQ(comm.axis(), kmamba::mesh_axis_name(axis));
      kmamba::Tensor1<std::int32_t, Exec::memory_space> me("kmamba::test::me", 1);
      me(0) = rank;
      kmamba::Tensor1<std::int32_t, Exec::memory_space> members("kmamba::test::members",
                                                                static_cast<std::size_t>(comm.size()));
      comm.all_gather(exec, me, members);
      const std::vector<int> got(members.data(), members.data() + comm.size());
      EXPECT_EQ(got, mesh.layout().group(axis, rank)) << kmamba::mesh_axis_name(axis);
    }
  }
}

TEST(ProcessMesh, MismatchedMeshFailsOnEveryRankWithoutHanging) {
  const int world = world_size();
  kmamba::MeshConfig too_many;
  too_many.data_parallel_size = world + 1;
  const std::string error = user_error([&] { kmamba::ProcessMesh mesh(MPI_COMM_WORLD, too_many); });
  expect_contains(error, "kmamba::MeshConfig::resolve: data_parallel_size " + std::to_string(world + 1));
  expect_contains(error, "but the world has " + std::to_string(world));
  kmamba::MeshConfig odd;
  odd.tensor_parallel_size = world + 1;
  expect_contains(user_error([&] { kmamba::ProcessMesh mesh(MPI_COMM_WORLD, odd); }), "is not a multiple of");
#if !KMAMBA_ENABLE_NCCL
  expect_contains(
      user_error([] { kmamba::ProcessMesh mesh(MPI_COMM_WORLD, kmamba::MeshConfig(), kmamba::Transport::Nccl); }),
      "Transport::Nccl needs a build with KMAMBA_ENABLE_NCCL");
#endif
  // Every rank threw before communicating: they all reach this barrier.
  EXPECT_EQ(MPI_Barrier(MPI_COMM_WORLD), MPI_SUCCESS);
}

TEST(ProcessMesh, MeshMustFitTheModel) {
  kmamba::ModelConfig model;  // Mamba-2
  model.d_model = 64;
  model.headdim = 16;  // d_inner 128: 8 heads
  model.ngroups = 2;
  kmamba::MeshConfig mesh;
  mesh.tensor_parallel_size = 2;
  kmamba::check_mesh_fits_model(mesh, model);
  mesh.tensor_parallel_size = 3;
  expect_contains(user_error([&] { kmamba::check_mesh_fits_model(mesh, model); }),
                  "tensor_parallel_size 3 does not divide the Mamba2 model's 8 heads");
  mesh.tensor_parallel_size = 4;
  expect_contains(user_error([&] { kmamba::check_mesh_fits_model(mesh, model); }),
                  "tensor_parallel_size 4 does not divide the Mamba2 model's ngroups 2");
  model.mixer = kmamba::MixerKind::Mamba1;
  mesh.tensor_parallel_size = 2;
  expect_contains(user_error([&] { kmamba::check_mesh_fits_model(mesh, model); }),
                  "tensor_parallel_size 2: the Mamba1 mixer is not split across tensor ranks");
  mesh.tensor_parallel_size = 1;
  mesh.sequence_parallel_size = 2;
  kmamba::check_mesh_fits_model(mesh, model);
}

}  // namespace
