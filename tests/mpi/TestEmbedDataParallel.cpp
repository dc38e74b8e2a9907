// The embedding API's data parallelism (run at 1, 2 and 4 ranks; fp32): Model::train_step on each
// rank's shard of a global batch after enable_data_parallel(MPI_COMM_WORLD) equals one Model on
// the whole batch — losses, gradient norms and parameters after 3 steps, with replicated (stage
// 0) and sharded (ZeRO-1) AdamW moments — starting from rank 0's parameters whatever each rank
// initialised; save writes once (rank 0) and every rank loads the same model. Compiled as it is
// (kmamba_embed_data_parallel_tests), on host memory through MPI; with KMAMBA_TEST_NCCL
// (kmamba_embed_data_parallel_nccl_tests, labels mpi and cuda; one GPU per rank), the same on
// device memory through NCCL, on the default Kokkos::Cuda instance.
//
// "Equal" (support/RoundingBounds.hpp): the ranks sum the shards' gradients in another order than
// one model does on the whole batch. Losses agree within τ = 8·√N·u (N from the model's
// dimensions, about 750: τ ≈ 1.3e-5), gradient norms within ‖δ‖₂ of the gradients' bounds δ (τ
// times the largest gradient of each tensor at the first step, of the slab after), parameters
// within AdamWDifferenceBound carried along the reference run, element by element.
#include "RoundingBounds.hpp"

#include <kmamba/KMamba.hpp>

#include <Kokkos_Core.hpp>
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

namespace {

#if KMAMBA_TEST_NCCL
using Exec = Kokkos::Cuda;
#else
using Exec = Kokkos::DefaultHostExecutionSpace;
#endif
using Mem = Exec::memory_space;

kmamba::SequenceModelConfig tiny_config() {
  kmamba::SequenceModelConfig c;
  c.input_size = 3;
  c.output_size = 2;
  c.backbone.mixer = kmamba::MixerKind::Mamba2;
  c.backbone.d_model = 16;
  c.backbone.n_layer = 2;
  c.backbone.d_state = 8;
  c.backbone.headdim = 8;
  c.backbone.chunk_size = 8;
  return c;
}

std::vector<float> parameters_of(const kmamba::Model<Exec>& model) {
  const auto host =
      Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), model.sequence_model().parameters().params());
  return std::vector<float>(host.data(), host.data() + host.span());
}

/// τ of the file comment: the backbone's reductions, with the input and output projections of
/// the SequenceModel in place of the LM head's.
double tolerance(std::int64_t seqlen, std::int64_t tokens) {
  const kmamba::SequenceModelConfig c = tiny_config();
  kmamba::ModelConfig backbone = c.backbone;
  backbone.vocab_size = c.input_size + c.output_size;
  return kmamba::test::model_tolerance(backbone, seqlen, tokens);
}

}  // namespace

TEST(EmbedDataParallel, ShardsOfABatchEqualOneModelOnTheWholeBatch) {
  int rank = 0, size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  const int batch = 4, seqlen = 20, shard = batch / size;
  ASSERT_EQ(batch % size, 0);
  const Exec exec;
  // The same global batch on every rank (fresh random values), and this rank's shard of it.
  kmamba::Tensor3<float, Mem> x("kmamba::test::x", batch, seqlen, 3), t("kmamba::test::t", batch, seqlen, 2);
  kmamba::fill_normal(exec, x, 91, 0.0f, 1.0f);
  kmamba::fill_normal(exec, t, 92, 0.0f, 1.0f);
  kmamba::Tensor3<float, Mem> xs("kmamba::test::xs", shard, seqlen, 3), ts("kmamba::test::ts", shard, seqlen, 2);
  const auto mine = std::make_pair(rank * shard, (rank + 1) * shard);
  Kokkos::deep_copy(exec, xs, Kokkos::subview(x, mine, Kokkos::ALL, Kokkos::ALL));
  Kokkos::deep_copy(exec, ts, Kokkos::subview(t, mine, Kokkos::ALL, Kokkos::ALL));
  exec.fence();
  for (const int zero_stage : {0, 1}) {
    SCOPED_TRACE("zero_stage " + std::to_string(zero_stage));
    kmamba::TrainOptions options;
    options.lr = 3e-3;
    options.warmup_steps = 1;
    options.total_steps = 5;
    options.grad_clip = 0.5;
    options.eps = 1e-5;  // bounds Adam's amplification of rounding differences
    options.zero_stage = zero_stage;
    kmamba::Model<Exec> reference(tiny_config(), 5, options);
    const auto& slab = reference.sequence_model().parameters();
    kmamba::AdamWConfig adamw;
    adamw.beta1 = options.beta1;
    adamw.beta2 = options.beta2;
    adamw.eps = options.eps;
    adamw.weight_decay = options.weight_decay;
    kmamba::test::AdamWDifferenceBound bound(adamw, slab.size(), slab.decay_end());
    const double tau = tolerance(seqlen, static_cast<std::int64_t>(batch) * seqlen);
    kmamba::Model<Exec> parallel(tiny_config(), 5 + static_cast<std::uint64_t>(rank), options);  // rank 0's wins
    parallel.enable_data_parallel(MPI_COMM_WORLD);
    EXPECT_EQ(parallel.data_size(), size);
    EXPECT_EQ(parallel.data_rank(), rank);
    EXPECT_EQ(parameters_of(parallel), parameters_of(reference));
    for (int step = 0; step < 3; ++step) {
      const kmamba::TrainStepResult r = reference.train_step(exec, x, t);
      const kmamba::TrainStepResult p = parallel.train_step(exec, xs, ts);
      exec.fence();
      const auto grads = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), slab.grads());
      const auto params = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), slab.params());
      const std::vector<double> delta = step == 0 ? kmamba::test::per_tensor_bounds(slab.entries(), grads, tau)
                                                  : kmamba::test::slab_bounds(grads, tau);
      const double norm_bound = kmamba::test::norm_difference_bound(delta, r.grad_norm);
      bound.step(grads, delta, kmamba::clip_scale(r.grad_norm, options.grad_clip),
                 kmamba::test::clip_scale_difference(r.grad_norm, norm_bound, options.grad_clip), r.lr, params);
      EXPECT_EQ(p.step, r.step);
      EXPECT_NEAR(p.loss, r.loss, tau * r.loss);
      EXPECT_NEAR(p.grad_norm, r.grad_norm, norm_bound);
      EXPECT_EQ(p.lr, r.lr);
    }
    const std::vector<float> got = parameters_of(parallel), want = parameters_of(reference);
    kmamba::test::expect_within(
        slab.entries(), [&](std::size_t i) { return got[i]; }, [&](std::size_t i) { return want[i]; },
        [&](std::size_t i) { return bound.parameter(i); }, "parameter");
    // Rank 0 writes; every rank returns once the files exist and loads the same parameters.
    const std::string dir =
        std::string(::testing::TempDir()) + "kmamba_embed_dp_" + Exec::name() + "_np" + std::to_string(size);
    parallel.save(dir);
    EXPECT_EQ(parameters_of(kmamba::Model<Exec>::load(dir)), parameters_of(parallel));
    MPI_Barrier(MPI_COMM_WORLD);  // nobody saves the next stage's model while another rank still loads
  }
}
