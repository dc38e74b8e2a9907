// bf16 on the wire for the data-parallel gradient reduction (Communicator::all_reduce_bf16 and
// reduce_scatter_bf16, DataParallelConfig::compression; docs/distributed.md §3.3), at 1, 2 and 4
// ranks.
//
// Exactness: each rank can compute every rank's data, so the result is checked bitwise against its
// definition — every rank's fp32 values rounded to bf16 once, summed in fp32 in rank order (the
// reduce-scatter), that sum rounded to bf16 once more (the all-reduce's all-gather); on one rank
// nothing travels and the values stay as they are.
// Tolerance against the fp32 sum S = Σ_r x_r: bf16 keeps 8 significant bits (7 stored), so rounding
// to nearest moves a value by at most half a unit of its last place, u = 2⁻⁸ of its magnitude (not
// 2⁻⁹: a value just above a power of two, 1 + 2⁻⁸, rounds to 1 or 1 + 2⁻⁷, 2⁻⁸ away). The p addends
// contribute ≤ u·Σ_r |x_r|; their fp32 sum ≤ (p − 1)·2⁻²⁴·(1 + u)·Σ_r |x_r|; the final rounding
// ≤ u·|S'| ≤ u·(1 + u + p·2⁻²⁴)·Σ_r |x_r|. Together |got − S| ≤ (2⁻⁷ + 2⁻¹⁶ + p·2⁻²³)·Σ_r |x_r|, element
// by element (observed up to about 1.4·2⁻⁸).
// Bytes: the counting communicator's sent_bytes (ring costs of docs/distributed.md §0) of the
// compressed reduction are half those of the fp32 all-reduce, exactly.
// Training: two dp runs, fp32 and bf16 wire, from the same start: the first step's loss is the
// same (the same parameters); each later step's parameters move by AdamW updates computed from
// gradients within 2⁻⁷ relative (above), so the updates differ by at most about 2⁻⁷ of their size
// (≤ lr per element), and the loss, first order in the parameters, by about 2⁻⁷·Σ_steps |ΔL of a
// step|. The test allows 2⁻⁷ of the loss's total change over the run plus 1e-5 of its value (the
// fp32 rounding of the runs, as in TestDistributedTrainer.cpp); observed at most 1.3e-4 at 2 ranks
// and 3e-5 at 4.
#include "ModelConfigs.hpp"

#include <kmamba/models/Data.hpp>
#include <kmamba/models/Distributed.hpp>
#include <kmamba/models/Trainer.hpp>
#include <kmamba/parallel/CountingCommunicator.hpp>
#include <kmamba/parallel/MpiCommunicator.hpp>
#include <kmamba/parallel/ProcessMesh.hpp>

#include "Checks.hpp"

#include <Kokkos_Core.hpp>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

namespace {

using Exec = Kokkos::DefaultHostExecutionSpace;
using HostFloats = Kokkos::View<float*, Kokkos::HostSpace>;

// Rank r's values: signed, spread over six decades, so that rounding and cancellation both occur.
HostFloats rank_values(int rank, std::size_t n) {
  std::mt19937 gen(1000u + static_cast<unsigned>(rank));
  std::uniform_real_distribution<float> mantissa(-1.0f, 1.0f), decade(-3.0f, 3.0f);
  HostFloats x("kmamba::test::bf16_wire::values", n);
  for (std::size_t i = 0; i < n; ++i) x(i) = mantissa(gen) * std::pow(10.0f, decade(gen));
  return x;
}

float round_bf16(float x) { return static_cast<float>(kmamba::bf16(x)); }

double sent(const kmamba::CommunicationLog& log, const std::string& axis, const std::string& operation) {
  return log.tally(axis, operation).sent_bytes;
}

TEST(Bf16Wire, SumsRoundedValuesInFp32WithHalfTheBytes) {
  const auto log = std::make_shared<kmamba::CommunicationLog>();
  const kmamba::CountingCommunicator world(std::make_unique<kmamba::MpiCommunicator>(MPI_COMM_WORLD), log);
  const int p = world.size();
  const std::size_t n = 96 * static_cast<std::size_t>(p);
  std::vector<HostFloats> all;
  for (int r = 0; r < p; ++r) all.push_back(rank_values(r, n));

  HostFloats fp32("kmamba::test::bf16_wire::fp32", n), wire("kmamba::test::bf16_wire::wire", n);
  Kokkos::deep_copy(fp32, all[static_cast<std::size_t>(world.rank())]);
  Kokkos::deep_copy(wire, fp32);
  world.all_reduce(Exec(), fp32);
  const double fp32_bytes = sent(*log, "world", "all_reduce");
  log->clear();
  world.all_reduce_bf16(Exec(), wire);
  EXPECT_DOUBLE_EQ(sent(*log, "world", "send_recv") + sent(*log, "world", "all_gather"), 0.5 * fp32_bytes);
  EXPECT_EQ(log->tally("world", "all_reduce").calls, 0);

  const double bound = std::ldexp(1.0, -7) + std::ldexp(1.0, -16) + p * std::ldexp(1.0, -23);
  for (std::size_t i = 0; i < n; ++i) {
    float sum = 0.0f;
    double exact = 0.0, magnitude = 0.0;
    for (const HostFloats& x : all) {
      sum += round_bf16(x(i));
      exact += x(i);
      magnitude += std::abs(x(i));
    }
    ASSERT_EQ(wire(i), p == 1 ? all[0](i) : round_bf16(sum)) << "element " << i << " (one rank: nothing travels)";
    ASSERT_LE(std::abs(wire(i) - exact), bound * magnitude) << "element " << i;
  }

  // The reduce-scatter keeps its fp32 sum of the rounded values.
  HostFloats send("kmamba::test::bf16_wire::send", n), shard("kmamba::test::bf16_wire::shard", n / p);
  Kokkos::deep_copy(send, all[static_cast<std::size_t>(world.rank())]);
  world.reduce_scatter_bf16(Exec(), send, shard);
  for (std::size_t j = 0; j < n / p; ++j) {
    float sum = 0.0f;
    const std::size_t i = static_cast<std::size_t>(world.rank()) * (n / p) + j;
    for (const HostFloats& x : all) sum += round_bf16(x(i));
    ASSERT_EQ(shard(j), p == 1 ? all[0](i) : sum) << "element " << j;
  }

  if (p > 1) {
    kmamba::test::expect_user_error([&] { world.all_reduce_bf16(Exec(), HostFloats("odd", n + 1)); },
                                    {"all_reduce_bf16", "not a multiple"});
  }
}

std::shared_ptr<const kmamba::Dataset> task() {
  return std::make_shared<kmamba::AssociativeRecallTask>(kmamba::AssociativeRecallConfig{32, 24, 4, 5});
}

kmamba::Trainer<Exec> make_trainer() {
  kmamba::LanguageModel<Exec> model(kmamba::test::model_config(kmamba::MixerKind::Mamba2, {16, 2, 32, 8, 8, 8}));
  model.initialize(1);
  kmamba::TrainConfig t;
  t.lr = 3e-3;
  t.min_lr = 3e-4;
  t.warmup_steps = 2;
  t.total_steps = 6;
  t.batch_size = 4;
  t.grad_clip = 0.5;
  t.eps = 1e-5;
  return kmamba::Trainer<Exec>(std::move(model), t, task());
}

// A trainer over a counting mesh: the steps' losses and the bytes its dp × sp axis sent.
struct CountedRun {
  std::vector<double> losses;
  std::shared_ptr<kmamba::CommunicationLog> log = std::make_shared<kmamba::CommunicationLog>();

  CountedRun(kmamba::GradientCompression compression, int steps) {
    const kmamba::ProcessMesh mesh(
        std::make_unique<kmamba::CountingCommunicator>(std::make_unique<kmamba::MpiCommunicator>(MPI_COMM_WORLD), log),
        kmamba::MeshConfig());
    kmamba::Trainer<Exec> trainer = make_trainer();
    kmamba::DataParallelConfig options;
    options.bucket_elements = 512;
    options.compression = compression;
    trainer.enable_data_parallel(mesh, options);
    for (int s = 0; s < steps; ++s) losses.push_back(trainer.step().loss);
  }
};

TEST(Bf16Wire, TrainingFollowsTheFp32RunWithHalfTheGradientBytes) {
  constexpr int steps = 6;
  const CountedRun fp32(kmamba::GradientCompression::None, steps), bf16(kmamba::GradientCompression::Bf16, steps);
  // Scalars (token counts, losses) and the tail (fewer elements than ranks) are all-reduced in fp32
  // by both runs; the buckets are what bf16 halves.
  const double buckets_fp32 = sent(*fp32.log, "dp_sp", "all_reduce") - sent(*bf16.log, "dp_sp", "all_reduce");
  EXPECT_DOUBLE_EQ(sent(*bf16.log, "dp_sp", "send_recv") + sent(*bf16.log, "dp_sp", "all_gather"), 0.5 * buckets_fp32);

  EXPECT_EQ(bf16.losses[0], fp32.losses[0]) << "the first step starts from the same parameters";
  const double change = std::abs(fp32.losses.back() - fp32.losses.front());
  for (int s = 1; s < steps; ++s) {
    EXPECT_LE(std::abs(bf16.losses[s] - fp32.losses[s]), std::ldexp(change, -7) + 1e-5 * fp32.losses[s])
        << "step " << s + 1;
  }
}

}  // namespace
