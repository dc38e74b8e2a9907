// kmamba-plan's cost model (perf/Planner.hpp on perf/ScalingModel.hpp's terms): the parameter
// blocks of a model equal the language model's, the memory terms and a pipeline step equal their
// formulas evaluated by hand for a small config, the chosen plan fits the memory given and is the
// fastest that does, and impossible requests are errors that say why.
#include "ModelConfigs.hpp"
#include "Planner.hpp"

#include <kmamba/KMamba.hpp>

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace {

using kmamba::perf::ParameterBlock;

// Mamba-2, d_model 64, 4 layers, vocab 100, d_state 16, headdim 16 (8 heads), chunk 16, 2 groups:
// d_inner 128, in_proj rows 2·128 + 2·2·16 + 8 = 328, conv channels 128 + 2·32 = 192 (4 taps).
kmamba::ModelConfig small_model() {
  return kmamba::test::model_config(kmamba::MixerKind::Mamba2, {64, 4, 100, 16, 16, 16, 2});
}

// One node of 8: every collective α 8 µs at 100 GB/s; 50 GB/s and 15 µs between nodes.
kmamba::perf::CommModel uniform_comm() {
  return kmamba::perf::CommModel(kmamba::perf::assumed_fits(8, 8e-6, 100e9), 15e-6, 50e9, 8);
}

TEST(Planner, ParameterBlocksAreTheLanguageModelsParameters) {
  const kmamba::ModelConfig config = small_model();
  const kmamba::perf::ModelCosts c = kmamba::perf::model_costs(config);
  // in_proj 328·64 + conv 192·4 + conv bias 192 + dt_bias, A_log, D 3·8 + gated norm 128 + out_proj
  // 64·128 + the block's norm 64; the embedding 100·64 and the final norm 64.
  EXPECT_EQ(c.layer_parameters(), 20992.0 + 768 + 192 + 24 + 128 + 8192 + 64);
  EXPECT_EQ(c.outer_parameters(), 6400.0 + 64);
  const kmamba::LanguageModel<Kokkos::DefaultHostExecutionSpace> model(config);
  EXPECT_EQ(config.n_layer * c.layer_parameters() + c.outer_parameters(),
            static_cast<double>(model.parameters().size()));
  // The Shape form of the scaling model gives the same costs for the same Mamba-2 model.
  kmamba::perf::Shape shape;
  shape.d_model = 64, shape.n_layer = 4, shape.vocab_size = 100, shape.pad_vocab_size_multiple = 1;
  shape.d_state = 16, shape.headdim = 16, shape.ngroups = 2, shape.chunk_size = 16;
  const kmamba::perf::ModelCosts s = kmamba::perf::model_costs(shape);
  EXPECT_EQ(s.layer_parameters(), c.layer_parameters());
  EXPECT_EQ(s.activation_bytes, c.activation_bytes);
  EXPECT_EQ(s.state_bytes, c.state_bytes);
  EXPECT_EQ(s.halo_bytes, c.halo_bytes);
  // Kept per token: 4·(2·64 + 2·128 + 328 + 192) + 4·8·16·16/16 chunk-state bytes.
  EXPECT_EQ(c.activation_bytes, 4.0 * 904 + 512);
}

TEST(Planner, MemoryTermsByHand) {
  const kmamba::perf::ModelCosts c = kmamba::perf::model_costs(small_model());
  // The first of two stages, 2 layers on tp 2, ZeRO-1 over 2 ranks, 2 micro-batches of 64 tokens in flight.
  kmamba::perf::StageLoad stage;
  stage.layers = 2;
  stage.first = true;
  stage.last = false;
  stage.in_flight = 2;
  stage.tokens = 64;
  stage.tp = 2;
  stage.zero_group = 2;
  // A layer on one of 2 tp ranks: in_proj 164·64, conv 96·4 + 96, 3·4 per-head values, gated norm
  // 64, out_proj 64·64, the replicated block norm 64: 15 212; two of them and the embedding stage's 6 464.
  const double params = 2 * (10496.0 + 384 + 96 + 12 + 64 + 4096 + 64) + 6464;
  kmamba::perf::GradientWire wire;
  wire.zero_stage = 1;
  kmamba::perf::MemoryTerms m = kmamba::perf::memory_per_gpu(c, stage, wire);
  EXPECT_EQ(m.weights, 4 * params);
  EXPECT_EQ(m.gradients, 4 * params);
  EXPECT_EQ(m.optimizer, 8 * params / 2);
  EXPECT_EQ(m.compression, 0.0);
  const double layer_bytes = 4128.0 * 64 / 2;  // a layer's activations of one micro-batch on one tp rank
  EXPECT_EQ(m.activations, 2 * 2 * layer_bytes);
  EXPECT_EQ(m.logits, 0.0);
  // Checkpointing keeps each block's input and norm scale, and one block for its recompute.
  stage.checkpointing = true;
  m = kmamba::perf::memory_per_gpu(c, stage, wire);
  EXPECT_EQ(m.activations, 2 * (2 * 4.0 * 65 * 64 + layer_bytes));
  // PowerSGD rank 4: the error feedback of the matrices it compresses and their factors: in_proj
  // (164, 64), out_proj (64, 64), the embedding (100, 64); not the conv (96, 4): 4·100 ≥ 384.
  wire = {kmamba::GradientCompression::PowerSgd, 4, 0};
  m = kmamba::perf::memory_per_gpu(c, stage, wire);
  const double compressed = 2 * (10496.0 + 4096) + 6400, factors = 2 * (4 * 228.0 + 4 * 128) + 4 * 164;
  EXPECT_EQ(m.compression, 4 * (compressed + factors));
  EXPECT_EQ(m.optimizer, 8 * params);
  // The last stage holds the tied head (the embedding's copy) and the logits of one micro-batch.
  stage.first = false;
  stage.last = true;
  m = kmamba::perf::memory_per_gpu(c, stage, wire);
  EXPECT_EQ(m.logits, 4.0 * 100 * 64);
  EXPECT_EQ(m.weights, 4 * params);
}

TEST(Planner, PipelineTermsByHand) {
  EXPECT_DOUBLE_EQ(kmamba::perf::pipeline_bubble(4, 8), 3.0 / 11);
  EXPECT_EQ(kmamba::perf::pipeline_bubble(1, 8), 0.0);
  EXPECT_EQ(kmamba::perf::stage_layers(10, 4), (std::vector<int>{3, 3, 2, 2}));
  EXPECT_THROW(kmamba::perf::stage_layers(3, 4), kmamba::UserError);
  // PowerSGD rank 4 on the small model: per layer in_proj 4·(328 + 64) and out_proj 4·(64 + 128)
  // instead of their elements, everything else whole; the embedding 4·(100 + 64).
  const kmamba::perf::ModelCosts c = kmamba::perf::model_costs(small_model());
  std::vector<ParameterBlock> blocks;
  for (int l = 0; l < 4; ++l) blocks.insert(blocks.end(), c.layer.begin(), c.layer.end());
  blocks.insert(blocks.end(), c.outer.begin(), c.outer.end());
  const double layer_rest = 768.0 + 192 + 24 + 128 + 64;
  EXPECT_EQ(kmamba::perf::powersgd_values(blocks, 4), 4 * (4 * 392.0 + 4 * 192 + layer_rest) + 4 * 164.0 + 64);
}

TEST(Planner, PipelineStepIsTheSlowestStageOverTheScheduleSlots) {
  kmamba::perf::PlanRequest q;
  q.model = small_model();
  q.gpus = 2;
  q.seqlen = 32;
  q.global_batch = 4;
  const kmamba::perf::ComputeRates rates{1e-12, 1e-11};
  kmamba::perf::Plan layout;
  layout.pp = 2;
  layout.micro_batch = 1;
  layout.grad_accum = 4;
  const kmamba::perf::Plan p = kmamba::perf::evaluate_plan(q, uniform_comm(), rates, layout);
  // The last stage: 2 layers (scan units 128·16, 6·30 360 dense FLOPs a token) and the head
  // (6·6 464), 32 tokens per micro-batch; 4 + 2 − 1 slots, each with a send and a receive of 32·64 fp32.
  const double stage = 32 * (2 * (128.0 * 16 * 1e-11 + 6 * 30360.0 * 1e-12) + 6 * 6464.0 * 1e-12);
  EXPECT_NEAR(p.compute, 5 * stage, 1e-15);
  EXPECT_NEAR(p.pp_comm, 5 * 2 * (8e-6 + 4.0 * 32 * 64 / 100e9), 1e-15);
  EXPECT_EQ(p.dp_comm, 0.0);
  EXPECT_DOUBLE_EQ(p.bubble, 1.0 / 5);
  EXPECT_NEAR(p.step, p.compute + p.pp_comm, 1e-15);
  EXPECT_THROW(kmamba::perf::evaluate_plan(q, uniform_comm(), rates,
                                           [] {
                                             kmamba::perf::Plan bad;
                                             bad.pp = 2;
                                             bad.grad_accum = 3;  // 3 micro-batches of 1 are not the batch of 4
                                             return bad;
                                           }()),
               kmamba::UserError);
}

kmamba::perf::PlanRequest medium_request() {
  kmamba::perf::PlanRequest q;
  q.model = kmamba::test::model_config(kmamba::MixerKind::Mamba2, {256, 8, 50277, 64, 32, 64, 4});
  q.gpus = 8;
  q.gpus_per_node = 8;
  q.seqlen = 1024;
  q.global_batch = 16;
  return q;
}

TEST(Planner, ChosenPlanFitsTheMemoryAndIsTheFastestThatDoes) {
  kmamba::perf::PlanRequest q = medium_request();
  const kmamba::perf::ComputeRates rates =
      kmamba::perf::compute_rates(kmamba::perf::default_measurements(), kmamba::MixerKind::Mamba2);
  const std::vector<kmamba::perf::Plan> unlimited = kmamba::perf::enumerate_plans(q, uniform_comm(), rates);
  ASSERT_GT(unlimited.size(), 1u);
  for (std::size_t i = 1; i < unlimited.size(); ++i) EXPECT_LE(unlimited[0].step, unlimited[i].step);
  // Half the fastest plan's memory: the plans that remain all fit, and the first is the fastest of them.
  q.memory_bytes = unlimited.front().memory.total() / 2;
  const std::vector<kmamba::perf::Plan> fitting = kmamba::perf::enumerate_plans(q, uniform_comm(), rates);
  ASSERT_FALSE(fitting.empty());
  double fastest_fitting = 1e30;
  for (const kmamba::perf::Plan& p : unlimited) {
    if (p.memory.total() <= q.memory_bytes) fastest_fitting = std::min(fastest_fitting, p.step);
  }
  EXPECT_EQ(fitting.front().step, fastest_fitting);
  for (const kmamba::perf::Plan& p : fitting) EXPECT_LE(p.memory.total(), q.memory_bytes) << p.describe();
  // The chosen plan's kmamba-train options name its mesh and batch.
  const std::string config = kmamba::perf::train_config_json(q, fitting.front());
  for (const char* key : {"\"pipeline_parallel_size\"", "\"data_parallel_size\"", "\"tensor_parallel_size\"",
                          "\"sequence_parallel_size\"", "\"batch_size\"", "\"grad_accum\"", "\"zero_stage\"",
                          "\"activation_checkpointing\"", "\"gradient_compression\"", "\"seqlen\""}) {
    EXPECT_NE(config.find(key), std::string::npos) << key << " in " << config;
  }
}

TEST(Planner, ImpossibleRequestsSayWhy) {
  kmamba::perf::PlanRequest q = medium_request();
  const kmamba::perf::ComputeRates rates{1e-12, 1e-11};
  q.memory_bytes = 1e3;
  try {
    kmamba::perf::enumerate_plans(q, uniform_comm(), rates);
    ADD_FAILURE() << "1 kB per GPU fits no plan";
  } catch (const kmamba::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("no plan fits"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("the smallest"), std::string::npos) << e.what();
  }
  q = medium_request();
  q.tp = {8};  // 4 groups: tp 8 cannot split them
  try {
    kmamba::perf::enumerate_plans(q, uniform_comm(), rates);
    ADD_FAILURE() << "tp 8 does not divide 4 groups";
  } catch (const kmamba::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("no pp x dp x tp x sp mesh"), std::string::npos) << e.what();
  }
  q = medium_request();
  q.gpus = 12;  // not whole 8-GPU nodes
  EXPECT_THROW(kmamba::perf::enumerate_plans(q, uniform_comm(), rates), kmamba::UserError);
  kmamba::perf::Measurements m = kmamba::perf::default_measurements();
  m.step_seconds = 1e-6;  // less than its own scans
  try {
    kmamba::perf::compute_rates(m, kmamba::MixerKind::Mamba2);
    ADD_FAILURE() << "a step shorter than its scans";
  } catch (const kmamba::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("take the whole measured step"), std::string::npos) << e.what();
  }
}

}  // namespace
