// Pipeline parallelism (run at 1, 2 and 4 ranks; fp32): small Mamba-1, Mamba-2 (tied and untied
// head) and Mamba-3 (SISO, MIMO) language models of 4 layers split into stages of consecutive layers,
// on every pipeline mesh of the world — pp 1 (np 1: the Pipeline path with one stage), pp 2 (np 2),
// pp 4, pp 2 × dp 2, pp 2 × tp 2 (not Mamba-1, which does not split tensors) and pp 2 × sp 2 (np 4).
// Every rank also runs the unsplit 1-rank reference on the whole batch.
// P1 the loss and every gradient (gathered over tp and pp into the unsplit layout) of one step of
//    micro-batches of 1, 2 and 1 rows (at dp 1: the stages' slots hold micro-batches of different
//    shapes) equal the 1-rank run's, with and without activation checkpointing;
// P2 the parameters after 3 clipped AdamW steps (DDP and ZeRO-1) equal the 1-rank run's within the
//    AdamW propagation of τ, and the norm over the whole mesh (all stages, the tied embedding once)
//    equals the 1-rank norm within ‖δ‖₂, identical on every rank;
// P3 the measured bubble of the 1F1B schedule (idle share of each stage's span, from the
//    schedule's own timing) agrees with (p − 1)/(m + p − 1) for stage work of fixed durations;
// P4 a Trainer on the pipeline takes the 1-rank trainer's first step (loss, norm), its checkpoint is
//    the unsplit model (LanguageModel::load on one rank gives the gathered parameters exactly), and
//    resuming it on the pipeline continues bit for bit;
// P5 errors name the bad input: more stages than layers, a mesh that does not divide the world,
//    whole-model calls on a stage, virtual stages the model or the micro-batches do not fit;
// P6 interleaved 1F1B (2 virtual stages per rank; np 2 and 4): Mamba-1, Mamba-2 and Mamba-3 (SISO)
//    models of 8 layers at pp 2, pp 4 and pp 2 × dp 2 — the loss and every gradient of one step of
//    micro-batches of unequal shapes equal the 1-rank run's (τ as P1) and the plain 1F1B pipeline's
//    over the same micro-batches on the same mesh (the same sums in the same order), with and without
//    activation checkpointing; 3 clipped AdamW steps (DDP and ZeRO-1) follow the 1-rank run as in P2;
//    P4 through the interleaved pipeline (8 layers, 4 micro-batches per step).
//    (The interleaved schedule's measured bubble: TestInterleavedSchedule.cpp.)
//
// Tolerances (support/RoundingBounds.hpp, as TestModelParallel.cpp): the pipeline evaluates the same
// sums as one rank, grouped otherwise (the micro-batches' gradients accumulated in another grouping of
// rows, the tied embedding's two partial gradients added across the first and last stage, plus the
// tp/sp/dp regroupings of the meshes), so values agree to the rounding of the chain of sums behind
// them: τ = 8·√N·u relative to each tensor's largest |value|.
#include "Checks.hpp"
#include "DistributedBatches.hpp"
#include "ModelConfigs.hpp"
#include "RoundingBounds.hpp"

#include <kmamba/models/Data.hpp>
#include <kmamba/models/Distributed.hpp>
#include <kmamba/models/LanguageModel.hpp>
#include <kmamba/models/Pipeline.hpp>
#include <kmamba/models/Trainer.hpp>
#include <kmamba/parallel/PipelineSchedule.hpp>
#include <kmamba/parallel/ProcessMesh.hpp>

#include <gtest/gtest.h>
#include <mpi.h>
#include <Kokkos_Core.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

namespace {

using namespace kmamba::test;
using kmamba::test::user_error;

using Batch = kmamba::test::TokenRows;

constexpr std::uint64_t init_seed = 91;
constexpr int batch = 4, seqlen = 13, layers = 4;
// P6: 8 layers for 2 chunks on each of up to 4 stages; 6 rows for micro-batches of unequal shapes.
constexpr int interleaved_layers = 8, interleaved_batch = 6, virtual_stages = 2;

kmamba::ModelConfig config_named(const std::string& name, int n_layer = layers) {
  // headdim 8: d_inner 64, 8 heads; 4 groups of 2 heads; 4 layers for up to 4 stages.
  if (name == "mamba1") {
    kmamba::ModelConfig c = model_config(kmamba::MixerKind::Mamba1, {32, n_layer, 64, 8, 8, 4});
    c.bias = true;
    c.validate();
    return c;
  }
  kmamba::ModelConfig c = model_config(kmamba::MixerKind::Mamba2, {32, n_layer, 64, 8, 8, 4, 4});
  if (name == "mamba2_untied") c.tie_embeddings = false;
  if (name.rfind("mamba3", 0) == 0) {
    c.mixer = kmamba::MixerKind::Mamba3;
    c.is_mimo = name == "mamba3_mimo";
    c.mimo_rank = 2;
    c.is_outproj_norm = !c.is_mimo;
  }
  c.validate();
  return c;
}

/// The pipeline meshes of the world: pp = world; at 4 ranks also pp 2 with dp, tp (not for
/// Mamba-1) or sp 2.
std::vector<kmamba::MeshConfig> pipeline_meshes(const kmamba::ModelConfig& config) {
  std::vector<kmamba::MeshConfig> meshes;
  kmamba::MeshConfig all;
  all.pipeline_parallel_size = world_size();
  meshes.push_back(all);
  if (world_size() != 4) return meshes;
  for (const int axis : {0, 1, 2}) {
    if (axis == 1 && config.mixer == kmamba::MixerKind::Mamba1) continue;
    kmamba::MeshConfig m;
    m.pipeline_parallel_size = 2;
    m.data_parallel_size = axis == 0 ? 2 : 1;
    m.tensor_parallel_size = axis == 1 ? 2 : 1;
    m.sequence_parallel_size = axis == 2 ? 2 : 1;
    meshes.push_back(m);
  }
  return meshes;
}

std::string pipeline_mesh_name(const kmamba::ProcessMesh& mesh) {
  return mesh_name(mesh) + " pp " + std::to_string(mesh.config().pipeline_parallel_size);
}

/// This rank's stage of the model (its `chunks` chunks), split over the mesh's tp, sp and pp axes.
Model stage_model(const kmamba::ModelConfig& config, const kmamba::ProcessMesh& mesh, int chunks = 1) {
  Model model(config, {&mesh.tensor(), &mesh.sequence()}, {&mesh.pipeline(), chunks});
  model.initialize(init_seed);
  return model;
}

class PipelineModel : public ::testing::TestWithParam<std::string> {
 protected:
  kmamba::ModelConfig model_config() const { return config_named(GetParam()); }
  double tolerance() const {
    return kmamba::test::model_tolerance(model_config(), seqlen, static_cast<std::int64_t>(batch) * seqlen);
  }
};

Batch make_batch(int step, int rows = batch) {
  return random_token_rows(rows, seqlen, 900 + static_cast<std::uint64_t>(step));
}

/// Micro-batches of 1, 2 and 1 rows of a rank's 4 (1 and 1 of 2), or with `micro_batches` m > 0,
/// m micro-batches of the rank's rows as even as possible, the middle ones the larger.
std::vector<int> micro_batch_rows(int per_rank, int micro_batches) {
  std::vector<int> rows;
  if (micro_batches == 0) {
    for (int first = 0; first < per_rank; first += rows.back())
      rows.push_back(first == 1 && per_rank - first >= 3 ? 2 : 1);
    return rows;
  }
  const int base = per_rank / micro_batches, extra = per_rank % micro_batches;
  for (int i = 0; i < micro_batches; ++i) rows.push_back(base + (i >= 1 && i <= extra ? 1 : 0));
  return rows;
}

/// This rank's rows (dp) and segment (sp) of b through the pipeline, in the micro-batches of
/// micro_batch_rows(rows per rank, count), then the reduction over dp × sp. Returns the
/// global mean loss.
double pipeline_backward(Model& model, kmamba::Pipeline<Exec>& pipeline, kmamba::DataParallel<Exec>& dp,
                         const kmamba::ProcessMesh& mesh, const Batch& b, int count = 0) {
  const Exec exec;
  const int per_rank = static_cast<int>(b.ids.extent(0)) / dp.data_size();
  const kmamba::SequenceSegment segment =
      kmamba::sequence_segment(seqlen, mesh.coordinates().sp, mesh.config().sequence_parallel_size);
  const Batch mine = slice(b, dp.data_rank() * per_rank, per_rank, segment.begin, segment.length);
  const std::int64_t global = dp.global_tokens(predicted(mine));
  std::vector<Batch> parts;
  int first = 0;
  for (const int rows : micro_batch_rows(per_rank, count)) {
    parts.push_back(slice(mine, first, rows, 0, segment.length));
    first += rows;
  }
  std::vector<kmamba::PipelineMicroBatch<Mem>> micro_batches;
  for (const Batch& part : parts) {
    kmamba::PipelineMicroBatch<Mem> mb;
    mb.ids = part.ids;
    mb.targets = part.targets;
    mb.weight = static_cast<double>(predicted(part)) / static_cast<double>(global);
    micro_batches.push_back(mb);
  }
  model.zero_grads(exec);
  const kmamba::LossResult r = pipeline.loss_and_backward(exec, micro_batches);
  EXPECT_EQ(r.tokens, predicted(mine));
  dp.reduce_gradients(exec, model.parameters());
  exec.fence();
  return dp.sum_over_data(r.loss * static_cast<double>(r.tokens)) / static_cast<double>(global);
}

/// One step's loss of b through the pipeline of `chunks` chunks per stage on `mesh` (micro-batches as
/// pipeline_backward), its gradients gathered into `full`, the unsplit model.
double pipeline_gradients(const kmamba::ModelConfig& config, const kmamba::ProcessMesh& mesh, int chunks,
                          bool checkpointing, int micro_batches, const Batch& b, Model& full) {
  const Exec exec;
  Model model = stage_model(config, mesh, chunks);
  model.set_activation_checkpointing(checkpointing);
  kmamba::DataParallel<Exec> dp(mesh, config, model.parameters(), kmamba::AdamWConfig(), kmamba::DataParallelConfig(),
                                model.sharded_parameters());
  kmamba::Pipeline<Exec> pipeline(model);
  const double loss = pipeline_backward(model, pipeline, dp, mesh, b, micro_batches);
  kmamba::gather_values(exec, model, kmamba::ConstTensor1<float, Mem>(model.parameters().grads()), full,
                        full.parameters().grads());
  return loss;
}

TEST_P(PipelineModel, LossAndGradientsEqualOneRank) {
  const kmamba::ModelConfig config = model_config();
  const Batch b = make_batch(0);
  Model reference(config);
  reference.initialize(init_seed);
  const double ref_loss = one_rank_reference_backward(reference, b);
  for (const auto& mesh_config : pipeline_meshes(config)) {
    const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, mesh_config);
    for (const bool checkpointing : {false, true}) {
      SCOPED_TRACE(pipeline_mesh_name(mesh) + (checkpointing ? " with activation checkpointing" : ""));
      Model full(config);
      const double loss = pipeline_gradients(config, mesh, 1, checkpointing, 0, b, full);
      EXPECT_LE(std::abs(loss - ref_loss), tolerance() * ref_loss);
      const double worst = expect_slab_equal(reference.parameters(), full.parameters().grads(),
                                             reference.parameters().grads(), tolerance(), every_element, "gradient");
      const double worst_all = mesh.world().all_reduce_value(worst, kmamba::ReduceOp::Max);
      if (world_rank() == 0) {
        std::printf("[ measured ] %s %s%s: loss %.9f vs %.9f (1 rank), gradients max|d|/max|ref| %.2e\n",
                    GetParam().c_str(), pipeline_mesh_name(mesh).c_str(), checkpointing ? " checkpointing" : "", loss,
                    ref_loss, worst_all);
      }
    }
  }
}

constexpr int adamw_steps = 3;
constexpr double adamw_lr = 3e-3, adamw_max_norm = 0.25;

/// The 1-rank run of P2: `adamw_steps` clipped AdamW steps of `reference` on batches of `rows` rows.
ClippedAdamWReference clipped_one_rank_steps(Model& reference, int rows, double tolerance) {
  ClippedAdamWReference one_rank(reference.parameters(), clipped_steps_adamw(), adamw_steps, adamw_lr, adamw_max_norm,
                                 tolerance,
                                 [&](int step) { one_rank_reference_backward(reference, make_batch(step, rows)); });
  EXPECT_GT(one_rank.norms[0], adamw_max_norm) << "the test must exercise clipping";
  return one_rank;
}

/// P2 on one mesh: the steps of `one_rank` through the pipeline of `chunks` chunks per stage (DDP,
/// then ZeRO-1), on batches of `rows` rows in micro-batches as pipeline_backward's `micro_batches`.
void expect_clipped_steps_follow(const std::string& name, const ClippedAdamWReference& one_rank, const Model& reference,
                                 const kmamba::ProcessMesh& mesh, int chunks, int rows, int micro_batches) {
  const Exec exec;
  const kmamba::ModelConfig& config = reference.config();
  for (const int stage : {0, 1}) {
    SCOPED_TRACE(pipeline_mesh_name(mesh) + " zero_stage " + std::to_string(stage));
    Model model = stage_model(config, mesh, chunks);
    kmamba::DataParallelConfig options;
    options.zero_stage = stage;
    options.bucket_elements = 1000;
    kmamba::DataParallel<Exec> dp(mesh, config, model.parameters(), clipped_steps_adamw(), options,
                                  model.sharded_parameters());
    kmamba::Pipeline<Exec> pipeline(model);
    for (int step = 0; step < adamw_steps; ++step) {
      const auto s = static_cast<std::size_t>(step);
      pipeline_backward(model, pipeline, dp, mesh, make_batch(step, rows), micro_batches);
      const double norm = dp.grad_norm(exec, model.parameters());
      EXPECT_LE(std::abs(norm - one_rank.norms[s]), one_rank.norm_bounds[s]) << "step " << step;
      EXPECT_EQ(mesh.world().all_reduce_value(norm, kmamba::ReduceOp::Max),
                mesh.world().all_reduce_value(norm, kmamba::ReduceOp::Min));
      dp.step(exec, model.parameters(), adamw_lr, kmamba::clip_scale(norm, adamw_max_norm));
    }
    exec.fence();
    const double worst_all = expect_parameters_follow(one_rank, reference.parameters(), model, mesh);
    if (world_rank() == 0) {
      std::printf("[ measured ] %s %s%s zero_stage %d: parameters after %d steps max |d|/bound %.2e\n", name.c_str(),
                  pipeline_mesh_name(mesh).c_str(), chunks > 1 ? (" v " + std::to_string(chunks)).c_str() : "", stage,
                  adamw_steps, worst_all);
    }
  }
}

TEST_P(PipelineModel, ClippedAdamWStepsEqualOneRankWithAndWithoutZero1) {
  Model reference(model_config());
  reference.initialize(init_seed);
  const ClippedAdamWReference one_rank = clipped_one_rank_steps(reference, batch, tolerance());
  for (const auto& mesh_config : pipeline_meshes(model_config())) {
    const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, mesh_config);
    expect_clipped_steps_follow(GetParam(), one_rank, reference, mesh, 1, batch, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Mixers, PipelineModel,
                         ::testing::Values("mamba1", "mamba2", "mamba2_untied", "mamba3_siso", "mamba3_mimo"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

/// P6's meshes of the world, each with its micro-batches per step (a multiple of pp): pp = world
/// with 4 (np 2, 4), and pp 2 × dp 2 with 2 (np 4).
struct InterleavedMesh {
  kmamba::MeshConfig mesh;
  int micro_batches;
};

std::vector<InterleavedMesh> interleaved_meshes() {
  kmamba::MeshConfig all;
  all.pipeline_parallel_size = world_size();
  std::vector<InterleavedMesh> meshes{{all, 4}};
  if (world_size() != 4) return meshes;
  kmamba::MeshConfig pp_dp;
  pp_dp.pipeline_parallel_size = 2;
  pp_dp.data_parallel_size = 2;
  meshes.push_back({pp_dp, 2});
  return meshes;
}

class InterleavedPipelineModel : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (world_size() < 2) GTEST_SKIP() << "virtual stages need at least 2 pipeline stages";
  }
  kmamba::ModelConfig model_config() const { return config_named(GetParam(), interleaved_layers); }
  double tolerance() const {
    return kmamba::test::model_tolerance(model_config(), seqlen, static_cast<std::int64_t>(interleaved_batch) * seqlen);
  }
};

// P6. The same micro-batches through the plain and the interleaved pipeline: each block's gradient is
// summed over the micro-batches in the same order, so the two agree to τ at worst (printed: exactly,
// where the recomputed forwards repeat the first bit for bit).
TEST_P(InterleavedPipelineModel, LossAndGradientsEqualOneRankAndThePlainPipeline) {
  const kmamba::ModelConfig config = model_config();
  const Batch b = make_batch(0, interleaved_batch);
  Model reference(config);
  reference.initialize(init_seed);
  const double ref_loss = one_rank_reference_backward(reference, b);
  for (const InterleavedMesh& m : interleaved_meshes()) {
    const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, m.mesh);
    for (const bool checkpointing : {false, true}) {
      const std::string name = pipeline_mesh_name(mesh) + " v " + std::to_string(virtual_stages) + " m " +
                               std::to_string(m.micro_batches) + (checkpointing ? " checkpointing" : "");
      SCOPED_TRACE(name);
      Model plain(config), interleaved(config);
      const double plain_loss = pipeline_gradients(config, mesh, 1, checkpointing, m.micro_batches, b, plain);
      const double loss =
          pipeline_gradients(config, mesh, virtual_stages, checkpointing, m.micro_batches, b, interleaved);
      EXPECT_LE(std::abs(loss - ref_loss), tolerance() * ref_loss);
      EXPECT_LE(std::abs(loss - plain_loss), tolerance() * ref_loss);
      const auto grads = interleaved.parameters().grads();
      const double worst = expect_slab_equal(reference.parameters(), grads, reference.parameters().grads(), tolerance(),
                                             every_element, "gradient");
      const double worst_plain = expect_slab_equal(reference.parameters(), grads, plain.parameters().grads(),
                                                   tolerance(), every_element, "gradient against the plain pipeline");
      const double worst_all = mesh.world().all_reduce_value(worst, kmamba::ReduceOp::Max);
      const double worst_plain_all = mesh.world().all_reduce_value(worst_plain, kmamba::ReduceOp::Max);
      if (world_rank() == 0) {
        std::printf(
            "[ measured ] %s %s: loss %.9f vs %.9f (1 rank) %.9f (plain pp), gradients max|d|/max|ref| "
            "%.2e (1 rank) %.2e (plain pp)\n",
            GetParam().c_str(), name.c_str(), loss, ref_loss, plain_loss, worst_all, worst_plain_all);
      }
    }
  }
}

TEST_P(InterleavedPipelineModel, ClippedAdamWStepsEqualOneRankWithAndWithoutZero1) {
  Model reference(model_config());
  reference.initialize(init_seed);
  const ClippedAdamWReference one_rank = clipped_one_rank_steps(reference, interleaved_batch, tolerance());
  for (const InterleavedMesh& m : interleaved_meshes()) {
    const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, m.mesh);
    expect_clipped_steps_follow(GetParam(), one_rank, reference, mesh, virtual_stages, interleaved_batch,
                                m.micro_batches);
  }
}

INSTANTIATE_TEST_SUITE_P(Mixers, InterleavedPipelineModel, ::testing::Values("mamba1", "mamba2", "mamba3_siso"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

/// Stage work of fixed durations (sleeps: on an oversubscribed host a sleeping rank leaves its core
/// to the others), passing activations of a few elements.
class FixedDurationStage : public kmamba::PipelineStageWork<Exec> {
 public:
  FixedDurationStage(double forward_seconds, double backward_seconds)
      : forward_(forward_seconds), backward_(backward_seconds), buffer_("kmamba::test::activation", 16) {}
  std::size_t activation_elements(int) const override { return buffer_.size(); }
  Activation forward(int, const Activation&) override { return wait(forward_); }
  Activation backward(int, const Activation&) override { return wait(backward_); }

 private:
  Activation wait(double seconds) {
    std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
    return buffer_;
  }
  double forward_, backward_;
  Activation buffer_;
};

// P3. Each stage is busy m·(t_f + t_b) of the span (m + p − 1)·(t_f + t_b), so its idle share is
// (p − 1)/(m + p − 1). The measured busy time includes each sleep's overshoot (timer slack and
// wake-up delay), and so does the span along its critical path of m + p − 1 forward-backward slots;
// what a stage's own busy time does not hold is the other stages' overshoots on the critical path
// and the time the messages take to arrive (microseconds on shared memory, but milliseconds when a
// waking rank waits for a core of a loaded, oversubscribed host: 3 to 14 ms per slot measured on the
// shared 2-core development machine at load 9). A delay d per slot lengthens the span by
// (m + p − 1)·d and so raises the idle share by at most d/(t_f + t_b); with slots of
// t_f + t_b = 450 ms the margin 0.05 allows d = 22 ms per slot.
TEST(PipelineSchedule, MeasuredBubbleAgreesWithTheOneForwardOneBackwardFormula) {
  const Exec exec;
  kmamba::MeshConfig mesh_config;
  mesh_config.pipeline_parallel_size = world_size();
  const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, mesh_config);
  const int p = world_size();
  for (const int m : {4, 8}) {
    constexpr double forward = 0.15, backward = 0.3;
    FixedDurationStage work(forward, backward);
    const kmamba::PipelineTiming t = kmamba::run_one_f_one_b(exec, mesh.pipeline(), m, work);
    const double want = kmamba::one_f_one_b_bubble(p, m);
    EXPECT_NEAR(t.idle_fraction(), want, 0.05) << "stage " << mesh.pipeline().rank() << ", m " << m;
    // The work ran m forwards and m backwards, no more (one more would add at least a forward).
    EXPECT_GE(t.busy_seconds, m * (forward + backward)) << "stage " << mesh.pipeline().rank();
    EXPECT_LT(t.busy_seconds, m * (forward + backward) + forward) << "stage " << mesh.pipeline().rank();
    const double worst = mesh.world().all_reduce_value(std::abs(t.idle_fraction() - want), kmamba::ReduceOp::Max);
    if (world_rank() == 0) {
      std::printf("[ measured ] p %d m %d: stage 0 idle %.4f of %.3f s, formula %.4f, worst |d| over stages %.4f\n", p,
                  m, t.idle_fraction(), t.span_seconds, want, worst);
    }
  }
}

kmamba::TrainConfig trainer_config(int grad_accum = 3) {
  kmamba::TrainConfig t;
  t.lr = 3e-3;
  t.warmup_steps = 1;
  t.total_steps = 4;
  t.batch_size = 2;
  t.grad_accum = grad_accum;
  t.grad_clip = 0.5;
  t.eval_interval = 0;
  return t;
}

// P4. The trainer's first step starts from the 1-rank trainer's parameters, so its loss and norm
// agree within τ and ‖δ‖₂ (the same sums regrouped); later steps are the P2 comparison. On a
// pipeline of pp = world stages of `chunks` chunks each.
void expect_trainer_through_pipeline(const kmamba::ModelConfig& config, int chunks, const kmamba::TrainConfig& train) {
  const Exec exec;
  constexpr std::int64_t recall_seqlen = 24;
  auto data = std::make_shared<kmamba::AssociativeRecallTask>(kmamba::AssociativeRecallConfig{32, recall_seqlen, 4, 5});
  Model whole(config);
  whole.initialize(init_seed);
  kmamba::Trainer<Exec> one_rank(std::move(whole), train, data);
  const kmamba::StepResult want = one_rank.step();
  const double tau =
      kmamba::test::model_tolerance(config, recall_seqlen, train.batch_size * train.grad_accum * recall_seqlen);
  const auto& ref_slab = one_rank.model().parameters();  // its gradients of the first step
  const double norm_bound =
      norm_difference_bound(per_tensor_bounds(ref_slab.entries(), ref_slab.grads(), tau), want.grad_norm);

  kmamba::MeshConfig mesh_config;
  mesh_config.pipeline_parallel_size = world_size();
  const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, mesh_config);
  kmamba::Trainer<Exec> trainer(stage_model(config, mesh, chunks), train, data);
  trainer.enable_data_parallel(mesh, kmamba::DataParallelConfig{1});
  ASSERT_NE(trainer.pipeline(), nullptr);
  const kmamba::StepResult got = trainer.step();
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_LE(std::abs(got.loss - want.loss), tau * want.loss);
  EXPECT_LE(std::abs(got.grad_norm - want.grad_norm), norm_bound);
  trainer.step();

  const std::string dir =
      (std::filesystem::temp_directory_path() / ("kmamba_pipeline_checkpoint_v" + std::to_string(chunks))).string();
  trainer.save_checkpoint(dir);
  Model gathered(config);
  kmamba::gather_parameters(exec, trainer.model(), gathered);
  const Model loaded = Model::load(dir);  // every rank reads the one checkpoint: it is the unsplit model
  std::size_t differing = 0;
  for (std::size_t i = 0; i < gathered.parameters().size(); ++i) {
    differing += gathered.parameters().params()(i) != loaded.parameters().params()(i);
  }
  EXPECT_EQ(differing, 0u);

  kmamba::Trainer<Exec> resumed(stage_model(config, mesh, chunks), train, data);
  resumed.enable_data_parallel(mesh, kmamba::DataParallelConfig{1});
  resumed.resume(dir);
  const kmamba::StepResult next = trainer.step(), again = resumed.step();
  EXPECT_EQ(again.loss, next.loss);
  EXPECT_EQ(again.grad_norm, next.grad_norm);
  differing = 0;
  for (std::size_t i = 0; i < trainer.model().parameters().size(); ++i) {
    differing += trainer.model().parameters().params()(i) != resumed.model().parameters().params()(i);
  }
  EXPECT_EQ(differing, 0u);
  mesh.world().barrier();
  if (world_rank() == 0) std::filesystem::remove_all(dir);
}

TEST(PipelineTrainer, StepsCheckpointsAndResumesThroughThePipeline) {
  expect_trainer_through_pipeline(config_named("mamba2"), 1, trainer_config());
}

// P6 through the Trainer: 2 chunks per stage, 4 micro-batches per step (a multiple of pp 2 and 4).
TEST(PipelineTrainer, StepsCheckpointsAndResumesThroughTheInterleavedPipeline) {
  if (world_size() < 2) GTEST_SKIP() << "virtual stages need at least 2 pipeline stages";
  expect_trainer_through_pipeline(config_named("mamba2", interleaved_layers), virtual_stages, trainer_config(4));
}

// P5.
TEST(PipelineErrors, NameTheBadInput) {
  kmamba::ModelConfig config = config_named("mamba2");
  config.n_layer = 1;
  config.validate();
  kmamba::MeshConfig two_stages;
  two_stages.pipeline_parallel_size = 2;
  two_stages.data_parallel_size = 1;
  EXPECT_NE(user_error([&] {
              kmamba::check_mesh_fits_model(two_stages, config);
            }).find("pipeline_parallel_size 2 must lie in [1, 1]: the model has 1 layers"),
            std::string::npos);
  EXPECT_NE(
      user_error([] { kmamba::stage_layers(3, 0, 4); }).find("pipeline_parallel_size 4 exceeds the model's 3 layers"),
      std::string::npos);
  EXPECT_NE(user_error([] {
              kmamba::MeshConfig c;
              c.pipeline_parallel_size = 3;
              c.resolve(4);
            })
                .find("which is not a multiple of tensor_parallel_size 1 × sequence_parallel_size 1 × "
                      "pipeline_parallel_size 3 = 3"),
            std::string::npos);
  EXPECT_NE(user_error([] {
              kmamba::chunk_layers(4, kmamba::PipelineParallel{nullptr, 5}, 0);
            }).find("virtual_pipeline_stages 5 x pipeline_parallel_size 1 exceeds the model's 4 layers"),
            std::string::npos);
  EXPECT_NE(user_error([&] {
              Model(config_named("mamba2"), {}, kmamba::PipelineParallel{nullptr, 2});
            }).find("virtual_pipeline_stages 2 with pipeline_parallel_size 1"),
            std::string::npos);
  if (world_size() < 2) return;
  kmamba::MeshConfig stages;
  stages.pipeline_parallel_size = 2;
  const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, stages);
  Model model = stage_model(config_named("mamba2"), mesh);
  const Batch b = make_batch(0);
  EXPECT_NE(user_error([&] {
              model.loss(Exec(), b.ids, b.targets);
            }).find("this model holds pipeline stage " + std::to_string(mesh.pipeline().rank()) + " of 2"),
            std::string::npos);
  EXPECT_NE(user_error([&] { model.save("unused"); }).find("kmamba::LanguageModel::save"), std::string::npos);
  // The interleaved schedule takes the micro-batches in groups of p: 3 of them on 2 stages do not fit.
  Model chunked = stage_model(config_named("mamba2"), mesh, virtual_stages);
  kmamba::Pipeline<Exec> pipeline(chunked);
  const std::vector<kmamba::PipelineMicroBatch<Mem>> three(3,
                                                           kmamba::PipelineMicroBatch<Mem>{b.ids, b.targets, {}, 1.0});
  EXPECT_NE(user_error([&] {
              pipeline.loss_and_backward(Exec(), three);
            }).find("the micro-batches (3) must be a positive multiple of pipeline_parallel_size 2"),
            std::string::npos);
}

}  // namespace
