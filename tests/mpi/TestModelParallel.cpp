// Tensor and sequence parallelism of small Mamba-2 and Mamba-3 (SISO with the output norm or the gate
// in the scan, and MIMO of rank 2) language models, and sequence parallelism of a Mamba-1 one (which does not split
// tensors: its meshes are the dp × sp ones) (run at 1, 2 and 4 ranks; fp32). Every rank also runs the unsplit 1-rank
// reference on the whole batch, so no reference data is communicated. On every dp × tp × sp factorisation of the world
// (tp splits the 8 heads and 4 groups; sp splits the 13 positions unevenly — 7/6 and 4/3/3/3 — into segments no shorter
// than the Mamba-1/2 conv halo of d_conv − 1 = 3, and the chunk size 4 does not divide them; Mamba-3 has no conv, its
// angle and previous-token halo come from the previous segments):
// M1 the loss and every gradient (gathered into the unsplit layout) after one step equal the
//    1-rank run's, max|Δ| ≤ τ·max|ref| per parameter (docs/distributed.md §8.1);
// M2 the parameters after 3 clipped AdamW steps (DDP and ZeRO-1) equal the 1-rank run's within the
//    AdamW propagation of τ, and the mesh-wide gradient norm equals the 1-rank norm within ‖δ‖₂;
// M3 initialize() gives each tensor rank the slices of the unsplit initialisation; scatter then
//    gather is the identity;
// M1 also holds with activation checkpointing (the recompute repeats the sequence state passing);
// M4 a tensor-parallel size that does not divide the heads/groups is one clear error on every rank (any
//    tensor split of Mamba-1);
//    sequence_segment splits unevenly and rejects a segment of no tokens;
// M5 prefill and decode steps of a tensor-parallel model give the unsplit model's logits;
// M6 Mamba-2, Mamba-1 and Mamba-3 (SISO and MIMO) packed rows (documents starting at a segment's
//    first token, inside a segment and inside the conv halo of the next segment) give the 1-rank
//    loss and gradients on every mesh, as M1.
//
// Tolerances (support/RoundingBounds.hpp): the mesh evaluates the 1-rank model's sums in other
// orders (the tensor ranks' partial projections added by an all-reduce, the sequence segments'
// states composed across the ranks and added to scans from zero, the Mamba-3 angle offsets summed —
// the dp × sp gradient reduction), the same terms in other groupings, so values agree to the
// rounding of the chain of sums behind them: τ = 8·√N·u relative to each tensor's largest |value|,
// N counted from the model's dimensions (1.2e3 to 1.4e3 here: τ ≈ 1.7e-5). The parameters after AdamW steps may differ
// by more where a gradient element is at rounding level (Adam divides it by its own size, up to
// 1/ε); their bound is AdamWDifferenceBound's, element by element.
#include "Checks.hpp"
#include "DistributedBatches.hpp"
#include "ModelConfigs.hpp"
#include "RoundingBounds.hpp"

#include <kmamba/models/Distributed.hpp>
#include <kmamba/models/LanguageModel.hpp>
#include <kmamba/models/ModelParallel.hpp>
#include <kmamba/models/Optimizer.hpp>
#include <kmamba/parallel/ProcessMesh.hpp>

#include <gtest/gtest.h>
#include <mpi.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

namespace {

using namespace kmamba::test;

constexpr std::uint64_t init_seed = 77;
constexpr int batch = 4, seqlen = 13;

kmamba::ModelConfig tiny_mamba2() {
  // headdim 8: d_inner 64, 8 heads; 4 groups of 2 heads.
  kmamba::ModelConfig c = kmamba::test::model_config(kmamba::MixerKind::Mamba2, {32, 2, 64, 8, 8, 4, 4});
  c.bias = true;  // in_proj.bias is split, out_proj.bias replicated
  c.validate();
  return c;
}

/// The same dimensions with Mamba-3 mixers (2 rotary angles, replicated across the tensor ranks):
/// SISO with the per-head output norm or with the gate in the scan (`gated`), or MIMO of rank 2
/// (chunk 2) with the gate in the scan.
kmamba::ModelConfig tiny_mamba3(bool mimo, bool gated = false) {
  kmamba::ModelConfig c = tiny_mamba2();
  c.mixer = kmamba::MixerKind::Mamba3;
  c.bias = false;
  c.is_mimo = mimo;
  c.mimo_rank = 2;
  c.is_outproj_norm = !mimo && !gated;
  c.validate();
  return c;
}

/// Mamba-1 of the same width (d_inner 64, d_state 8), with linear biases.
kmamba::ModelConfig tiny_mamba1() {
  kmamba::ModelConfig c = kmamba::test::model_config(kmamba::MixerKind::Mamba1, {32, 2, 64, 8, 8, 4});
  c.bias = true;
  c.validate();
  return c;
}

kmamba::ModelConfig config_named(const std::string& name) {
  if (name == "mamba1") return tiny_mamba1();
  if (name == "mamba2") return tiny_mamba2();
  return tiny_mamba3(name == "mamba3_mimo", name == "mamba3_siso_gated");
}

/// The tests below run on each of these models.
class SplitModel : public ::testing::TestWithParam<std::string> {
 protected:
  kmamba::ModelConfig model_config() const { return config_named(GetParam()); }
  /// τ of the file comment for batches of `length` tokens per row.
  double tolerance(int length = seqlen) const {
    return kmamba::test::model_tolerance(model_config(), length, static_cast<std::int64_t>(batch) * length);
  }
};

using Batch = kmamba::test::TokenRows;

/// A batch of random tokens (kmamba::test::random_token_rows), one per step.
Batch make_batch(int step, int length = seqlen) {
  return random_token_rows(batch, length, 500 + static_cast<std::uint64_t>(step));
}

kmamba::ModelParallel split_of(const kmamba::ProcessMesh& mesh) { return {&mesh.tensor(), &mesh.sequence()}; }

/// The meshes of mesh_configs(true) that can split `config`: all of them, or for Mamba-1 those
/// without a tensor split.
std::vector<kmamba::MeshConfig> split_meshes(const kmamba::ModelConfig& config) {
  std::vector<kmamba::MeshConfig> meshes;
  for (const auto& m : mesh_configs(true)) {
    if (config.mixer != kmamba::MixerKind::Mamba1 || m.tensor_parallel_size == 1) meshes.push_back(m);
  }
  return meshes;
}

/// Calls check(mesh, local) for every mesh of split_meshes(config), `local` the model of `config` split over the
/// mesh and initialised with init_seed, under a trace naming the mesh.
template <class Check>
void for_each_split(const kmamba::ModelConfig& config, const Check& check) {
  for (const auto& mesh_config : split_meshes(config)) {
    const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, mesh_config);
    SCOPED_TRACE(mesh_name(mesh));
    Model local(config, split_of(mesh));
    local.initialize(init_seed);
    check(mesh, local);
  }
}

/// The same on this rank's rows (dp) and segment (sp) of b; the reduction over dp × sp overlaps the
/// last micro-batch's backward (DataParallel::attach). Returns the global mean loss.
double parallel_backward(Model& model, kmamba::DataParallel<Exec>& dp, const kmamba::ProcessMesh& mesh,
                         const Batch& b) {
  const Exec exec;
  const int per_rank = batch / dp.data_size();
  const kmamba::SequenceSegment segment = kmamba::sequence_segment(
      static_cast<std::int64_t>(b.ids.extent(1)), mesh.coordinates().sp, mesh.config().sequence_parallel_size);
  const Batch mine = slice(b, dp.data_rank() * per_rank, per_rank, segment.begin, segment.length);
  const std::int64_t global = dp.global_tokens(predicted(mine));
  dp.attach(model);
  model.zero_grads(exec);
  const double loss_sum = accumulate_rows(model, mine, global, [&](int r) {
                            if (r == per_rank - 1) dp.begin_reduction(model.parameters());
                          }).loss;
  dp.reduce_gradients(exec, model.parameters());
  exec.fence();
  return dp.sum_over_data(loss_sum) / static_cast<double>(global);
}

TEST(ModelParallel, SequenceSegmentsSplitUnevenlyAndCoverTheSequence) {
  const std::int64_t lengths[] = {4, 3, 3, 3};
  std::int64_t begin = 0;
  for (int r = 0; r < 4; ++r) {
    const kmamba::SequenceSegment s = kmamba::sequence_segment(13, r, 4);
    EXPECT_EQ(s.begin, begin);
    EXPECT_EQ(s.length, lengths[r]);
    begin += s.length;
  }
  EXPECT_THROW(kmamba::sequence_segment(3, 0, 4), kmamba::UserError);
}

TEST_P(SplitModel, InitializeGivesTheSlicesOfTheUnsplitModelAndGatherInvertsScatter) {
  const Exec exec;
  const kmamba::ModelConfig config = model_config();
  Model full(config);
  full.initialize(init_seed);
  for_each_split(config, [&](const kmamba::ProcessMesh& mesh, Model& local) {
    if (mesh.config().tensor_parallel_size > 1) {
      EXPECT_LT(local.parameters().size(), full.parameters().size());
      EXPECT_FALSE(local.sharded_parameters().empty());
    }
    Model scattered(config, split_of(mesh));
    kmamba::scatter_parameters(exec, full, scattered);
    std::size_t differing = 0;
    for (std::size_t i = 0; i < local.parameters().size(); ++i) {
      differing += local.parameters().params()(i) != scattered.parameters().params()(i);
    }
    EXPECT_EQ(differing, 0u);
    Model gathered(config);
    kmamba::gather_parameters(exec, local, gathered);
    differing = 0;
    for (std::size_t i = 0; i < full.parameters().size(); ++i) {
      differing += full.parameters().params()(i) != gathered.parameters().params()(i);
    }
    EXPECT_EQ(differing, 0u);
    if (mesh.config().tensor_parallel_size > 1) {
      EXPECT_THROW(local.save("unused"), kmamba::UserError);
    }
  });
}

TEST_P(SplitModel, LossAndGradientsEqualOneRank) {
  const Exec exec;
  const kmamba::ModelConfig config = model_config();
  const Batch b = make_batch(0);
  Model reference(config);
  reference.initialize(init_seed);
  const double ref_loss = one_rank_reference_backward(reference, b);
  for (const auto& mesh_config : split_meshes(config)) {
    const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, mesh_config);
    for (const bool checkpointing : {false, true}) {
      SCOPED_TRACE(mesh_name(mesh) + (checkpointing ? " with activation checkpointing" : ""));
      Model model(config, split_of(mesh));
      model.initialize(init_seed);
      model.set_activation_checkpointing(checkpointing);
      kmamba::DataParallel<Exec> dp(mesh, config, model.parameters(), kmamba::AdamWConfig(),
                                    kmamba::DataParallelConfig(), model.sharded_parameters());
      const double loss = parallel_backward(model, dp, mesh, b);
      EXPECT_LE(std::abs(loss - ref_loss), tolerance() * ref_loss);
      Model full(config);
      kmamba::gather_values(exec, model, kmamba::ConstTensor1<float, Mem>(model.parameters().grads()), full,
                            full.parameters().grads());
      const double worst = expect_slab_equal(reference.parameters(), full.parameters().grads(),
                                             reference.parameters().grads(), tolerance(), every_element, "gradient");
      const double worst_all = mesh.world().all_reduce_value(worst, kmamba::ReduceOp::Max);
      if (world_rank() == 0) {
        std::printf("[ measured ] %s %s%s: loss %.9f vs %.9f (1 rank), gradients max|d|/max|ref| %.2e\n",
                    GetParam().c_str(), mesh_name(mesh).c_str(), checkpointing ? " checkpointing" : "", loss, ref_loss,
                    worst_all);
      }
    }
  }
}

// Segments of 2, 2, 1, 1 tokens at 4 ranks, shorter than the Mamba-1/2 conv halo of 3: a rank's
// halo then reaches back over several ranks (through the previous rank's conv state, which holds
// part of its own halo), and its gradient flows back the same way. Mamba-3: one-token segments,
// whose final k and v states are their only token's.
TEST_P(SplitModel, SegmentsShorterThanTheHaloEqualOneRank) {
  const kmamba::ModelConfig config = model_config();
  const Batch b = make_batch(7, 6);
  Model reference(config);
  reference.initialize(init_seed);
  const double ref_loss = one_rank_reference_backward(reference, b);
  kmamba::MeshConfig mesh_config;
  mesh_config.sequence_parallel_size = world_size();
  const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, mesh_config);
  Model model(config, split_of(mesh));
  model.initialize(init_seed);
  kmamba::DataParallel<Exec> dp(mesh, config, model.parameters(), kmamba::AdamWConfig());
  const double loss = parallel_backward(model, dp, mesh, b);
  EXPECT_LE(std::abs(loss - ref_loss), tolerance(6) * ref_loss);
  expect_slab_equal(reference.parameters(), model.parameters().grads(), reference.parameters().grads(), tolerance(6),
                    every_element, "gradient");
}

// Document starts of the packed test rows, against the segments of 13 positions (sp 2: [0, 7),
// [7, 13); sp 4: [0, 4), [4, 7), [7, 10), [10, 13)) and the conv halo of 3: a segment that starts a
// document of several tokens (7); a halo partly in the segment's first document (6: tokens 4, 5
// are another's, 6 is the first document's), a start inside a segment (11); one- and two-token
// documents and a start at a segment's first token (1, 3, 4), a halo token in the first document (9);
// one document over every segment.
const std::vector<std::vector<std::int64_t>> packed_starts = {{7}, {6, 11}, {1, 3, 4, 9}, {}};

// Packed rows on every mesh of `config` give the 1-rank loss and gradients (M6).
void expect_packed_rows_equal_one_rank(const kmamba::ModelConfig& config, const char* name) {
  const Batch b = packed_token_rows(batch, seqlen, 900, packed_starts);
  Model reference(config);
  reference.initialize(init_seed);
  const double ref_loss = one_rank_reference_backward(reference, b);
  const double tol = kmamba::test::model_tolerance(config, seqlen, static_cast<std::int64_t>(batch) * seqlen);
  for (const auto& mesh_config : split_meshes(config)) {
    const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, mesh_config);
    SCOPED_TRACE(mesh_name(mesh));
    Model model(config, split_of(mesh));
    model.initialize(init_seed);
    kmamba::DataParallel<Exec> dp(mesh, config, model.parameters(), kmamba::AdamWConfig(), kmamba::DataParallelConfig(),
                                  model.sharded_parameters());
    const double loss = parallel_backward(model, dp, mesh, b);
    EXPECT_LE(std::abs(loss - ref_loss), tol * ref_loss);
    Model full(config);
    kmamba::gather_values(Exec(), model, kmamba::ConstTensor1<float, Mem>(model.parameters().grads()), full,
                          full.parameters().grads());
    const double worst = expect_slab_equal(reference.parameters(), full.parameters().grads(),
                                           reference.parameters().grads(), tol, every_element, "gradient");
    const double worst_all = mesh.world().all_reduce_value(worst, kmamba::ReduceOp::Max);
    if (world_rank() == 0) {
      std::printf("[ measured ] packed %s %s: loss %.9f vs %.9f (1 rank), gradients max|d|/max|ref| %.2e\n", name,
                  mesh_name(mesh).c_str(), loss, ref_loss, worst_all);
    }
  }
}

TEST(ModelParallel, Mamba2PackedRowsEqualOneRank) { expect_packed_rows_equal_one_rank(tiny_mamba2(), "mamba2"); }

// Mamba-1 (dp × sp meshes): the selective scan's correction stops at a start inside a segment, the
// conv halo and the state are masked as Mamba-2's.
TEST(ModelParallel, Mamba1PackedRowsEqualOneRank) { expect_packed_rows_equal_one_rank(tiny_mamba1(), "mamba1"); }

// Mamba-3 SISO (with the output norm, and with the gate in the scan) and MIMO: the angle, the
// previous token's k and v and the SSM state stop at a start inside a segment and at a segment's
// first token; the angle totals of a segment with a start count from its last one.
TEST(ModelParallel, Mamba3SisoPackedRowsEqualOneRank) {
  expect_packed_rows_equal_one_rank(tiny_mamba3(false), "mamba3_siso");
  expect_packed_rows_equal_one_rank(tiny_mamba3(false, true), "mamba3_siso_gated");
}

TEST(ModelParallel, Mamba3MimoPackedRowsEqualOneRank) {
  expect_packed_rows_equal_one_rank(tiny_mamba3(true), "mamba3_mimo");
}

TEST_P(SplitModel, ClippedAdamWStepsEqualOneRankWithAndWithoutZero1) {
  const Exec exec;
  const kmamba::ModelConfig config = model_config();
  constexpr int steps = 3;
  constexpr double lr = 3e-3, max_norm = 0.25;
  const kmamba::AdamWConfig adamw = clipped_steps_adamw();
  Model reference(config);
  reference.initialize(init_seed);
  const Model::Slab& slab = reference.parameters();
  ClippedAdamWReference one_rank(slab, adamw, steps, lr, max_norm, tolerance(),
                                 [&](int step) { one_rank_reference_backward(reference, make_batch(step)); });
  ASSERT_GT(one_rank.norms[0], max_norm) << "the test must exercise clipping";

  for (const auto& mesh_config : split_meshes(config)) {
    const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, mesh_config);
    for (const int stage : {0, 1}) {
      SCOPED_TRACE(mesh_name(mesh) + " zero_stage " + std::to_string(stage));
      Model model(config, split_of(mesh));
      model.initialize(init_seed);
      kmamba::DataParallelConfig options;
      options.zero_stage = stage;
      options.bucket_elements = 1000;
      kmamba::DataParallel<Exec> dp(mesh, config, model.parameters(), adamw, options, model.sharded_parameters());
      for (int step = 0; step < steps; ++step) {
        const auto s = static_cast<std::size_t>(step);
        parallel_backward(model, dp, mesh, make_batch(step));
        if (stage == 0) {
          // The premise of the parameter bound: every step's gradients (evaluated at this run's
          // parameters) stay within the bounds δ it assumes. ZeRO-1 leaves only this rank's shards
          // reduced, so the check runs on DDP.
          Model full(config);
          kmamba::gather_values(exec, model, kmamba::ConstTensor1<float, Mem>(model.parameters().grads()), full,
                                full.parameters().grads());
          const kmamba::Tensor1<float, Mem> ref_grad(one_rank.grads[s].data(), one_rank.grads[s].size());
          kmamba::test::expect_within(
              slab.entries(), full.parameters().grads(), ref_grad,
              [&](std::size_t i) { return one_rank.grad_bounds[s][i]; }, "gradient of step " + std::to_string(step));
        }
        const double norm = dp.grad_norm(exec, model.parameters());
        const double ref = one_rank.norms[s];
        EXPECT_LE(std::abs(norm - ref), one_rank.norm_bounds[s]) << "step " << step;
        EXPECT_EQ(mesh.world().all_reduce_value(norm, kmamba::ReduceOp::Max),
                  mesh.world().all_reduce_value(norm, kmamba::ReduceOp::Min));
        dp.step(exec, model.parameters(), lr, kmamba::clip_scale(norm, max_norm));
      }
      exec.fence();
      const double worst_all = expect_parameters_follow(one_rank, slab, model, mesh);
      if (world_rank() == 0) {
        std::printf("[ measured ] %s %s zero_stage %d: parameters after %d steps max |d|/bound %.2e\n",
                    GetParam().c_str(), mesh_name(mesh).c_str(), stage, steps, worst_all);
      }
    }
  }
}

// Recurrent inference on a tensor-parallel model (prefill, then decode steps) gives the unsplit
// model's logits; a sequence-split model refuses it.
TEST_P(SplitModel, TensorParallelDecodeEqualsTheUnsplitModel) {
  const Exec exec;
  const kmamba::ModelConfig config = model_config();
  const Batch b = make_batch(3, 9);
  const int rows = 2, prompt = 6;
  const Batch head = slice(b, 0, rows, 0, prompt);
  Model full(config);
  full.initialize(init_seed);
  for_each_split(config, [&](const kmamba::ProcessMesh& mesh, Model& local) {
    if (mesh.config().sequence_parallel_size > 1) {
      auto state = local.make_decode_state(rows);
      EXPECT_THROW(local.prefill(exec, head.ids, state, kmamba::Tensor2<float, Mem>()), kmamba::UserError);
      return;
    }
    auto full_state = full.make_decode_state(rows);
    auto local_state = local.make_decode_state(rows);
    kmamba::Tensor2<float, Mem> want("kmamba::test::want", rows, config.vocab_size);
    kmamba::Tensor2<float, Mem> got("kmamba::test::got", rows, config.vocab_size);
    full.prefill(exec, head.ids, full_state, want);
    local.prefill(exec, head.ids, local_state, got);
    double worst = 0.0, scale = 0.0;
    const auto compare = [&] {
      exec.fence();
      for (int r = 0; r < rows; ++r) {
        for (int v = 0; v < config.vocab_size; ++v) {
          worst = std::max(worst, std::abs(static_cast<double>(got(r, v)) - want(r, v)));
          scale = std::max(scale, std::abs(static_cast<double>(want(r, v))));
        }
      }
    };
    compare();
    for (int t = prompt; t < 9; ++t) {
      kmamba::Tensor1<std::int64_t, Mem> next("kmamba::test::next", rows);
      for (int r = 0; r < rows; ++r) next(r) = b.ids(r, t);
      full.decode_step(exec, next, full_state, want);
      local.decode_step(exec, next, local_state, got);
      compare();
    }
    EXPECT_GT(scale, 0.0);
    EXPECT_LE(worst, tolerance(9) * scale);
  });
}

TEST_P(SplitModel, RejectsATensorSplitThatDoesNotFitTheHeads) {
  if (world_size() < 2) GTEST_SKIP() << "needs 2 ranks";
  kmamba::ModelConfig config = model_config();
  config.ngroups = 1;
  kmamba::MeshConfig mesh_config;
  mesh_config.tensor_parallel_size = 2;
  const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, mesh_config);
  try {
    Model model(config, split_of(mesh));
    ADD_FAILURE() << "no exception";
  } catch (const kmamba::UserError& e) {
    const char* const want = config.mixer == kmamba::MixerKind::Mamba1 ? "the Mamba1 mixer splits sequences only"
                                                                       : "must divide nheads 8 and ngroups 1";
    EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Mixers, SplitModel,
                         ::testing::Values("mamba1", "mamba2", "mamba3_siso", "mamba3_siso_gated", "mamba3_mimo"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

}  // namespace
