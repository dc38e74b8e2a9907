// Data parallelism of a small Mamba-2 language model (run at 1, 2 and 4 ranks; fp32; "equal" is
// max|Δ| ≤ τ·max|ref| per parameter, docs/distributed.md §8.1, τ below). Every rank also computes the 1-rank
// reference on the whole batch, so no reference data is communicated. Covered, on every
// dp × tp factorisation of the world with an unsplit model (the tp ranks are replicas here; split
// models and sequence parallelism are TestModelParallel's):
// D1 dp ranks on shards of a batch = 1 rank on the batch (loss and every gradient);
// D4 micro-batches accumulate without communication, one bucketed reduction per step (checked
//    with the communication audit);
// D2 the overlapped reduction (DataParallel::attach + begin_reduction): buckets are reduced during
//    the last micro-batch's backward, as its layers finish (the audit counts reductions issued
//    before backward ends), each once, none during the accumulation micro-steps, and the reduced
//    gradients are bitwise those of the reduction after backward (same bucket layout); with
//    DataParallelConfig::overlap false the backward issues none and reduce_gradients all of them;
// D3 ZeRO-1 and DDP: parameters and AdamW moments after 3 clipped steps; moments gather into the
//    slab layout and load back;
// D5 the mesh-wide gradient norm, each parameter counted exactly once; D6 a non-finite gradient on
//    one rank is seen by every rank.
//
// Tolerances (support/RoundingBounds.hpp): the ranks sum the micro-batches' gradients in another
// order than one rank does, and everything downstream of the reduction inherits the difference.
// Gradients and losses agree within τ = 8·√N·u of each tensor's largest |value|, N (about 1.5e3)
// counted from the model's dimensions (τ ≈ 1.8e-5); norms within ‖δ‖₂ of the per-element bounds
// δ = τ·max|g|; parameters and moments after AdamW steps within AdamWDifferenceBound, element by
// element (Adam divides a gradient element by its own size, so a rounding-level one may move by up
// to lr·δ/ε).
#include "DistributedBatches.hpp"
#include "ModelConfigs.hpp"
#include "RoundingBounds.hpp"

#include <kmamba/models/Distributed.hpp>
#include <kmamba/models/LanguageModel.hpp>
#include <kmamba/models/Optimizer.hpp>
#include <kmamba/parallel/CountingCommunicator.hpp>
#include <kmamba/parallel/GradientBuckets.hpp>
#include <kmamba/parallel/MpiCommunicator.hpp>
#include <kmamba/parallel/ProcessMesh.hpp>

#include <gtest/gtest.h>
#include <mpi.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <vector>

namespace {

using namespace kmamba::test;

constexpr std::uint64_t init_seed = 2024;
constexpr int batch = 8, seqlen = 12;

// headdim 17: d_inner 68, 4 heads; 4 groups: 27246 parameters, so that at 4 ranks the slab leaves
// an unsharded tail of 2.
kmamba::ModelConfig tiny_mamba2() {
  return kmamba::test::model_config(kmamba::MixerKind::Mamba2, {34, 2, 64, 16, 17, 8, 4});
}

/// τ of the file comment.
const double tolerance = kmamba::test::model_tolerance(tiny_mamba2(), seqlen, batch* seqlen);

using Batch = kmamba::test::TokenRows;

/// A batch of random tokens (kmamba::test::random_token_rows), one per step.
Batch make_batch(int step) { return random_token_rows(batch, seqlen, 1000 + static_cast<std::uint64_t>(step)); }

Batch rows(const Batch& b, int first, int count) { return slice(b, first, count, 0, seqlen); }

/// A mesh of data parallelism alone over MPI_COMM_WORLD whose communicators record every call in `log`.
kmamba::ProcessMesh counting_mesh(const std::shared_ptr<kmamba::CommunicationLog>& log) {
  return kmamba::ProcessMesh(
      std::make_unique<kmamba::CountingCommunicator>(std::make_unique<kmamba::MpiCommunicator>(MPI_COMM_WORLD), log),
      kmamba::MeshConfig());
}

/// One data-parallel step's forward and backward: this dp rank's rows of `b`, one row per
/// micro-batch, each weighted by its tokens over the global count; one reduction at the end.
/// Returns the global mean loss.
double data_parallel_backward(Model& model, kmamba::DataParallel<Exec>& dp, const Batch& b) {
  const Exec exec;
  const int per_rank = batch / dp.data_size();
  const Batch mine = rows(b, dp.data_rank() * per_rank, per_rank);
  const std::int64_t global = dp.global_tokens(predicted(mine));
  model.zero_grads(exec);
  const double loss_sum = accumulate_rows(model, mine, global).loss;
  dp.reduce_gradients(exec, model.parameters());
  exec.fence();
  return dp.sum_over_data(loss_sum) / static_cast<double>(global);
}

/// The one-rank reference of data_parallel_backward: the whole batch on one model, one row per
/// micro-batch with the same token weights (gradient accumulation), so that reference and data
/// parallel run the same kernels on the same shapes and differ only by the reduction across ranks.
/// (One micro-batch of the whole batch ≡ the accumulated rows is the Trainer's accumulation test.)
kmamba::LossResult one_rank_backward(Model& model, const Batch& b) {
  const Exec exec;
  const std::int64_t global = predicted(b);
  model.zero_grads(exec);
  kmamba::LossResult total = accumulate_rows(model, b, global);
  exec.fence();
  total.loss /= static_cast<double>(global);
  return total;
}

TEST(DataParallel, BucketLayoutShardsEveryBucketAndKeepsATail) {
  const kmamba::BucketLayout layout(10, 4, 5);  // buckets round down to a multiple of 4
  ASSERT_EQ(layout.buckets().size(), 2u);
  EXPECT_EQ(layout.buckets()[0].begin, 0u);
  EXPECT_EQ(layout.buckets()[0].size, 4u);
  EXPECT_EQ(layout.buckets()[1].begin, 4u);
  EXPECT_EQ(layout.buckets()[1].shard_offset, 1u);
  EXPECT_EQ(layout.shard_begin(layout.buckets()[1], 3), 7u);
  EXPECT_EQ(layout.tail_begin(), 8u);
  EXPECT_EQ(layout.shard_elements(), 4u);  // one element of each bucket + the 2-element tail
  EXPECT_EQ(kmamba::BucketLayout(9, 1, 0).buckets().size(), 1u);
  EXPECT_EQ(kmamba::default_bucket_elements(64), kmamba::default_bucket_bytes / sizeof(float));
  EXPECT_EQ(kmamba::default_bucket_elements(64), std::size_t{25} << 18);
}

TEST(DataParallel, LossAndGradientsEqualOneRankOnTheWholeBatch) {
  const kmamba::ModelConfig config = tiny_mamba2();
  const Batch b = make_batch(0);
  Model reference(config);
  reference.initialize(init_seed);
  const kmamba::LossResult ref = one_rank_backward(reference, b);

  for (const auto& mesh_config : mesh_configs(false)) {
    const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, mesh_config);
    SCOPED_TRACE(mesh_name(mesh));
    Model model(config);
    model.initialize(init_seed);
    kmamba::DataParallelConfig options;
    options.bucket_elements = 1000;
    kmamba::DataParallel<Exec> dp(mesh, config, model.parameters(), kmamba::AdamWConfig(), options);
    const double loss = data_parallel_backward(model, dp, b);
    EXPECT_LE(std::abs(loss - ref.loss), tolerance * std::abs(ref.loss));
    expect_slab_equal(model.parameters(), model.parameters().grads(), reference.parameters().grads(), tolerance,
                      every_element, "gradient of");
  }
}

TEST(DataParallel, ClippedAdamWStepsEqualOneRankWithAndWithoutZero1) {
  const Exec exec;
  const kmamba::ModelConfig config = tiny_mamba2();
  constexpr int steps = 3;
  constexpr double lr = 3e-3, max_norm = 0.25;
  const kmamba::AdamWConfig adamw = clipped_steps_adamw();
  Model reference(config);
  reference.initialize(init_seed);
  const Model::Slab& slab = reference.parameters();
  ClippedAdamWReference one_rank(slab, adamw, steps, lr, max_norm, tolerance,
                                 [&](int step) { one_rank_backward(reference, make_batch(step)); });
  ASSERT_GT(one_rank.norms[0], max_norm) << "the test must exercise clipping";

  for (const auto& mesh_config : mesh_configs(false)) {
    const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, mesh_config);
    for (const int stage : {0, 1}) {
      SCOPED_TRACE(mesh_name(mesh) + " zero_stage " + std::to_string(stage));
      Model model(config);
      model.initialize(init_seed);
      kmamba::DataParallelConfig options;
      options.zero_stage = stage;
      options.bucket_elements = 1000;
      kmamba::DataParallel<Exec> dp(mesh, config, model.parameters(), adamw, options);
      const std::size_t moments = stage == 1 ? dp.layout().shard_elements() : model.parameters().size();
      EXPECT_EQ(dp.first_moment().extent(0), moments);
      for (int step = 0; step < steps; ++step) {
        data_parallel_backward(model, dp, make_batch(step));
        if (stage == 0) {
          // The premise of the parameter bound: every step's gradients (evaluated at this run's
          // parameters) stay within the bounds δ it assumes. ZeRO-1 leaves only this rank's shards
          // reduced, so the check runs on DDP.
          const auto s = static_cast<std::size_t>(step);
          const kmamba::Tensor1<float, Mem> ref_grad(one_rank.grads[s].data(), slab.size());
          kmamba::test::expect_within(
              slab.entries(), model.parameters().grads(), ref_grad,
              [&](std::size_t i) { return one_rank.grad_bounds[s][i]; },
              "gradient of step " + std::to_string(step) + " of");
        }
        const double norm = dp.grad_norm(exec, model.parameters());
        EXPECT_LE(std::abs(norm - one_rank.norms[static_cast<std::size_t>(step)]),
                  one_rank.norm_bounds[static_cast<std::size_t>(step)])
            << "step " << step;
        // The clip factor is bitwise identical on every rank.
        EXPECT_EQ(mesh.world().all_reduce_value(norm, kmamba::ReduceOp::Max),
                  mesh.world().all_reduce_value(norm, kmamba::ReduceOp::Min));
        dp.step(exec, model.parameters(), lr, kmamba::clip_scale(norm, max_norm));
      }
      exec.fence();
      EXPECT_EQ(dp.steps_taken(), steps);
      kmamba::test::expect_within(
          slab.entries(), model.parameters().params(), slab.params(),
          [&](std::size_t i) { return one_rank.bound.parameter(i); }, "parameter");
      // The moments, gathered into the slab's layout, equal the 1-rank AdamW's; loading them back
      // into a fresh object and gathering again is the identity.
      const std::size_t n = model.parameters().size();
      kmamba::Tensor1<float, Mem> m("kmamba::test::m", n), v("kmamba::test::v", n);
      dp.gather_moments(exec, m, v);
      exec.fence();
      kmamba::test::expect_within(
          slab.entries(), m, one_rank.optimizer.first_moment(),
          [&](std::size_t i) { return one_rank.bound.first_moment(i); }, "first moment");
      kmamba::test::expect_within(
          slab.entries(), v, one_rank.optimizer.second_moment(),
          [&](std::size_t i) { return one_rank.bound.second_moment(i); }, "second moment");
      kmamba::DataParallel<Exec> resumed(mesh, config, model.parameters(), adamw, options);
      resumed.load_moments(exec, m, v, dp.steps_taken());
      EXPECT_EQ(resumed.steps_taken(), steps);
      kmamba::Tensor1<float, Mem> m2("kmamba::test::m2", n), v2("kmamba::test::v2", n);
      resumed.gather_moments(exec, m2, v2);
      exec.fence();
      std::size_t changed = 0;
      for (std::size_t i = 0; i < n; ++i) changed += m2(i) != m(i) || v2(i) != v(i);
      EXPECT_EQ(changed, 0u);
      // Every rank holds the same parameters.
      const auto& params = model.parameters().params();
      kmamba::Tensor1<float, Mem> low("kmamba::test::low", params.extent(0)),
          high("kmamba::test::high", params.extent(0));
      mesh.world().all_reduce(exec, params, low, kmamba::ReduceOp::Min);
      mesh.world().all_reduce(exec, params, high, kmamba::ReduceOp::Max);
      std::size_t differing = 0;
      for (std::size_t i = 0; i < params.extent(0); ++i) differing += low(i) != high(i);
      EXPECT_EQ(differing, 0u);
    }
  }
}

TEST(DataParallel, Zero1ReducesEachRanksShard) {
  const kmamba::ModelConfig config = tiny_mamba2();
  const Batch b = make_batch(0);
  Model reference(config);
  reference.initialize(init_seed);
  one_rank_backward(reference, b);

  const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, kmamba::MeshConfig());
  Model model(config);
  model.initialize(init_seed);
  kmamba::DataParallelConfig options;
  options.zero_stage = 1;
  options.bucket_elements = 1000;
  kmamba::DataParallel<Exec> dp(mesh, config, model.parameters(), kmamba::AdamWConfig(), options);
  data_parallel_backward(model, dp, b);
  const kmamba::BucketLayout& layout = dp.layout();
  std::vector<char> owned(layout.elements(), 0);
  for (const auto& bucket : layout.buckets()) {
    const std::size_t begin = layout.shard_begin(bucket, dp.data_rank());
    std::fill(owned.begin() + static_cast<std::ptrdiff_t>(begin),
              owned.begin() + static_cast<std::ptrdiff_t>(begin + layout.shard_size(bucket)), 1);
  }
  std::fill(owned.begin() + static_cast<std::ptrdiff_t>(layout.tail_begin()), owned.end(), 1);
  expect_slab_equal(
      model.parameters(), model.parameters().grads(), reference.parameters().grads(), tolerance,
      [&](std::size_t i) { return owned[i] != 0; }, "owned gradient of");
}

TEST(DataParallel, MicroStepsDoNotCommunicateAndEachStepReducesOnceInBuckets) {
  const Exec exec;
  const kmamba::ModelConfig config = tiny_mamba2();
  const auto log = std::make_shared<kmamba::CommunicationLog>();
  const kmamba::ProcessMesh mesh = counting_mesh(log);
  const Batch mine = rows(make_batch(0), mesh.data().rank() * (batch / mesh.data().size()), batch / mesh.data().size());
  for (const int stage : {0, 1}) {
    SCOPED_TRACE("zero_stage " + std::to_string(stage));
    Model model(config);
    model.initialize(init_seed);
    kmamba::DataParallelConfig options;
    options.zero_stage = stage;
    options.bucket_elements = 1000;
    kmamba::DataParallel<Exec> dp(mesh, config, model.parameters(), kmamba::AdamWConfig(), options);
    const kmamba::BucketLayout& layout = dp.layout();
    const std::int64_t buckets = static_cast<std::int64_t>(layout.buckets().size());
    const std::int64_t sharded = static_cast<std::int64_t>(layout.tail_begin());
    const std::int64_t tail = static_cast<std::int64_t>(layout.elements()) - sharded;
    ASSERT_GT(buckets, 1);
    if (mesh.data().size() == 4) {
      EXPECT_EQ(tail, 2) << "the 4-rank run must exercise the unsharded tail";
    }

    // The sums and reductions run over the group that shares the parameters, dp × sp ("dp_sp"),
    // which is the dp group on this mesh.
    log->clear();
    const std::int64_t global = dp.global_tokens(predicted(mine));
    EXPECT_EQ(log->tally("dp_sp", "all_reduce").calls, 1);
    EXPECT_EQ(log->total_calls(), 1);

    log->clear();
    model.zero_grads(exec);
    for (int r = 0; r < static_cast<int>(mine.ids.extent(0)); ++r) {
      const Batch micro = rows(mine, r, 1);
      model.loss_and_backward(exec, micro.ids, micro.targets,
                              static_cast<double>(predicted(micro)) / static_cast<double>(global));
    }
    EXPECT_EQ(log->total_calls(), 0) << "an accumulation micro-step communicated";

    dp.reduce_gradients(exec, model.parameters());
    if (stage == 0) {
      EXPECT_EQ(log->tally("dp_sp", "all_reduce").calls, buckets + (tail > 0));
      EXPECT_EQ(log->tally("dp_sp", "all_reduce").elements, static_cast<std::int64_t>(layout.elements()));
    } else {
      EXPECT_EQ(log->tally("dp_sp", "reduce_scatter").calls, buckets);
      EXPECT_EQ(log->tally("dp_sp", "reduce_scatter").elements, sharded);
      EXPECT_EQ(log->tally("dp_sp", "all_reduce").calls, tail > 0 ? 1 : 0);
      EXPECT_EQ(log->tally("dp_sp", "all_reduce").elements, tail);
    }
    const std::int64_t reduction_calls = log->total_calls();

    dp.grad_norm(exec, model.parameters());
    EXPECT_EQ(log->tally("world", "all_reduce").calls, 1);
    EXPECT_EQ(log->total_calls(), reduction_calls + 1);

    log->clear();
    dp.step(exec, model.parameters(), 1e-3);
    EXPECT_EQ(log->tally("dp_sp", "all_gather").calls, stage == 1 ? buckets : 0);
    EXPECT_EQ(log->tally("dp_sp", "all_gather").elements, stage == 1 ? sharded : 0);
    EXPECT_EQ(log->total_calls(), stage == 1 ? buckets : 0);
  }
}

TEST(DataParallel, OverlappedReductionRunsDuringTheLastBackwardAndEqualsTheReductionAfterIt) {
  const Exec exec;
  const kmamba::ModelConfig config = tiny_mamba2();
  const auto log = std::make_shared<kmamba::CommunicationLog>();
  const kmamba::ProcessMesh mesh = counting_mesh(log);
  const int per_rank = batch / mesh.data().size();
  const Batch mine = rows(make_batch(0), mesh.data().rank() * per_rank, per_rank);
  for (const int stage : {0, 1}) {
    SCOPED_TRACE("zero_stage " + std::to_string(stage));
    kmamba::DataParallelConfig options;
    options.zero_stage = stage;
    options.bucket_elements = 1000;
    const std::int64_t global =
        kmamba::DataParallel<Exec>(mesh, config, Model(config).parameters(), kmamba::AdamWConfig(), options)
            .global_tokens(predicted(mine));
    const auto accumulate = [&](Model& model, kmamba::DataParallel<Exec>* overlapped) {
      model.zero_grads(exec);
      accumulate_rows(model, mine, global, [&](int r) {
        if (overlapped != nullptr && r == per_rank - 1) overlapped->begin_reduction(model.parameters());
      });
    };

    Model after(config);
    after.initialize(init_seed);
    kmamba::DataParallel<Exec> dp_after(mesh, config, after.parameters(), kmamba::AdamWConfig(), options);
    accumulate(after, nullptr);
    dp_after.reduce_gradients(exec, after.parameters());
    exec.fence();

    Model during(config);
    during.initialize(init_seed);
    kmamba::DataParallel<Exec> dp(mesh, config, during.parameters(), kmamba::AdamWConfig(), options);
    dp.attach(during);
    // The reductions issued by the time of each announcement of the backward.
    std::vector<std::int64_t> issued;
    during.set_gradients_ready_hook([&](const Exec& e, std::size_t begin, std::size_t end) {
      dp.gradients_ready(e, begin, end);
      issued.push_back(log->total_calls());
    });
    log->clear();
    accumulate(during, &dp);
    const std::size_t per_backward = issued.size() / static_cast<std::size_t>(per_rank);
    ASSERT_EQ(issued.size(), per_backward * static_cast<std::size_t>(per_rank));
    ASSERT_GT(per_backward, 1u);
    const std::size_t last_backward = issued.size() - per_backward;
    EXPECT_EQ(issued[last_backward == 0 ? 0 : last_backward - 1], 0) << "an accumulation micro-step communicated";
    EXPECT_GT(issued[last_backward], 0) << "no bucket was reduced after the last layer's backward";
    EXPECT_LT(issued[last_backward], issued.back()) << "every bucket was reduced at once";
    dp.reduce_gradients(exec, during.parameters());
    exec.fence();
    const kmamba::BucketLayout& layout = dp.layout();
    const std::int64_t buckets = static_cast<std::int64_t>(layout.buckets().size());
    const bool tail = layout.tail_begin() < layout.elements();
    EXPECT_EQ(log->total_calls(), buckets + (tail ? 1 : 0)) << "each bucket is reduced exactly once";

    // Bitwise the same reduced gradients (ZeRO-1: this rank's shards and the tail).
    std::vector<char> owned(layout.elements(), stage == 0 ? 1 : 0);
    for (const auto& bucket : layout.buckets()) {
      const std::size_t begin = layout.shard_begin(bucket, mesh.data().rank());
      std::fill(owned.begin() + static_cast<std::ptrdiff_t>(begin),
                owned.begin() + static_cast<std::ptrdiff_t>(begin + layout.shard_size(bucket)), 1);
    }
    std::fill(owned.begin() + static_cast<std::ptrdiff_t>(layout.tail_begin()), owned.end(), 1);
    std::size_t differing = 0;
    for (std::size_t i = 0; i < layout.elements(); ++i) {
      differing += owned[i] != 0 && during.parameters().grads()(i) != after.parameters().grads()(i);
    }
    EXPECT_EQ(differing, 0u);
  }
}

TEST(DataParallel, WithoutOverlapTheBackwardIssuesNoReduction) {
  const Exec exec;
  const kmamba::ModelConfig config = tiny_mamba2();
  const auto log = std::make_shared<kmamba::CommunicationLog>();
  const kmamba::ProcessMesh mesh = counting_mesh(log);
  const int per_rank = batch / mesh.data().size();
  const Batch mine = rows(make_batch(0), mesh.data().rank() * per_rank, per_rank);
  kmamba::DataParallelConfig options;
  options.bucket_elements = 1000;
  options.overlap = false;
  Model model(config);
  model.initialize(init_seed);
  kmamba::DataParallel<Exec> dp(mesh, config, model.parameters(), kmamba::AdamWConfig(), options);
  dp.attach(model);
  const std::int64_t global = dp.global_tokens(predicted(mine));
  log->clear();
  model.zero_grads(exec);
  accumulate_rows(model, mine, global, [&](int r) {
    if (r == per_rank - 1) dp.begin_reduction(model.parameters());
  });
  EXPECT_EQ(log->total_calls(), 0) << "a reduction ran during the backward";
  dp.reduce_gradients(exec, model.parameters());
  const kmamba::BucketLayout& layout = dp.layout();
  const std::int64_t buckets = static_cast<std::int64_t>(layout.buckets().size());
  EXPECT_EQ(log->tally("dp_sp", "all_reduce").calls, buckets + (layout.tail_begin() < layout.elements() ? 1 : 0));
  EXPECT_EQ(log->total_calls(), log->tally("dp_sp", "all_reduce").calls);
}

TEST(DataParallel, GradNormCountsEveryParameterOnceOverTheMesh) {
  const Exec exec;
  const kmamba::ModelConfig config = tiny_mamba2();
  for (const auto& mesh_config : mesh_configs(false)) {
    const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, mesh_config);
    for (const int stage : {0, 1}) {
      SCOPED_TRACE(mesh_name(mesh) + " zero_stage " + std::to_string(stage));
      Model model(config);
      kmamba::DataParallelConfig options;
      options.zero_stage = stage;
      options.bucket_elements = 1000;
      const kmamba::DataParallel<Exec> dp(mesh, config, model.parameters(), kmamba::AdamWConfig(), options);
      Kokkos::deep_copy(model.parameters().grads(), 1.0f);
      const double norm = dp.grad_norm(exec, model.parameters());
      EXPECT_EQ(norm * norm, static_cast<double>(model.parameters().size()));
      // An infinite gradient on one rank makes the norm infinite on every rank (all skip together).
      if (mesh.world().rank() == 0) model.parameters().grads()(0) = std::numeric_limits<float>::infinity();
      EXPECT_TRUE(std::isinf(dp.grad_norm(exec, model.parameters())));
    }
  }
}

TEST(DataParallel, RejectsAMeshThatDoesNotFitTheModel) {
  kmamba::ModelConfig config = tiny_mamba2();
  config.ngroups = 1;
  const kmamba::ProcessMesh mesh(MPI_COMM_WORLD, kmamba::MeshConfig());
  Model model(config);
  kmamba::DataParallelConfig options;
  options.zero_stage = 2;
  try {
    kmamba::DataParallel<Exec> dp(mesh, config, model.parameters(), kmamba::AdamWConfig(), options);
    ADD_FAILURE() << "no exception";
  } catch (const kmamba::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("zero_stage must be 0"), std::string::npos) << e.what();
  }
}

}  // namespace
