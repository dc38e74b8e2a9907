// What the distributed language-model tests share: the MPI world, token batches that the ranks
// split by rows and positions, the comparison of a parameter slab against a reference slab, and the
// one-rank run of clipped AdamW steps that a distributed run follows within derived bounds.
#ifndef KMAMBA_TESTS_SUPPORT_DISTRIBUTED_BATCHES_HPP
#define KMAMBA_TESTS_SUPPORT_DISTRIBUTED_BATCHES_HPP

#include <kmamba/core/Core.hpp>
#include "RoundingBounds.hpp"

#include <kmamba/models/Distributed.hpp>
#include <kmamba/models/LanguageModel.hpp>
#include <kmamba/models/Optimizer.hpp>
#include <kmamba/models/ParameterSlab.hpp>
#include <kmamba/parallel/ProcessMesh.hpp>

#include <gtest/gtest.h>
#include <mpi.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

namespace kmamba {
namespace test {

inline int world_size() {
  int size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

inline int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

/// The distributed tests run on the host backend.
using Exec = Kokkos::DefaultHostExecutionSpace;
using Mem = Exec::memory_space;
using Model = LanguageModel<Exec>;

/// Every mesh of powers of two with tp · sp dividing the world (sp = 1 unless `split_sequences`);
/// dp is the rest.
inline std::vector<MeshConfig> mesh_configs(bool split_sequences) {
  std::vector<MeshConfig> all;
  const int world = world_size();
  for (int tp = 1; tp <= world; tp *= 2) {
    for (int sp = 1; tp * sp <= world && (split_sequences || sp == 1); sp *= 2) {
      MeshConfig c;
      c.tensor_parallel_size = tp;
      c.sequence_parallel_size = sp;
      all.push_back(c);
    }
  }
  return all;
}

/// "mesh dp D tp T sp S".
inline std::string mesh_name(const ProcessMesh& mesh) {
  return "mesh dp " + std::to_string(mesh.config().data_parallel_size) + " tp " +
         std::to_string(mesh.config().tensor_parallel_size) + " sp " +
         std::to_string(mesh.config().sequence_parallel_size);
}

/// Token ids and next-token targets on the host.
struct TokenRows {
  using Ids = Tensor2<std::int64_t, Kokkos::HostSpace>;
  Ids ids, targets;  // (rows, length)
  Ids seq_idx;       // (rows, length): packed documents' ids (LanguageModel::set_sequence_ids), or empty
};

/// `rows` rows of `length` tokens drawn uniformly from [0, 64) with `seed`; targets are the next
/// tokens, with the first r % 3 positions of row r also ignored, so that the rows (and so the
/// ranks) predict different numbers of tokens.
inline TokenRows random_token_rows(int rows, std::int64_t length, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::int64_t> token(0, 63);
  TokenRows b{TokenRows::Ids("kmamba::test::ids", rows, length), TokenRows::Ids("kmamba::test::targets", rows, length),
              TokenRows::Ids()};
  for (int r = 0; r < rows; ++r) {
    for (std::int64_t t = 0; t < length; ++t) b.ids(r, t) = token(rng);
  }
  for (int r = 0; r < rows; ++r) {
    for (std::int64_t t = 0; t < length; ++t) {
      b.targets(r, t) = t + 1 < length && t >= r % 3 ? b.ids(r, t + 1) : ignore_index;
    }
  }
  return b;
}

/// random_token_rows packed into documents: row r's documents start at starts[r % starts.size()]
/// (positions below length; every id differs from the previous one), and no target crosses a
/// document's end.
inline TokenRows packed_token_rows(int rows, std::int64_t length, std::uint64_t seed,
                                   const std::vector<std::vector<std::int64_t>>& starts) {
  TokenRows b = random_token_rows(rows, length, seed);
  b.seq_idx = TokenRows::Ids("kmamba::test::seq_idx", rows, length);
  for (int r = 0; r < rows; ++r) {
    const std::vector<std::int64_t>& row_starts = starts[static_cast<std::size_t>(r) % starts.size()];
    std::int64_t id = 0;
    for (std::int64_t t = 0; t < length; ++t) {
      if (std::find(row_starts.begin(), row_starts.end(), t) != row_starts.end()) ++id;
      b.seq_idx(r, t) = id;
      if (t > 0 && b.seq_idx(r, t) != b.seq_idx(r, t - 1)) b.targets(r, t - 1) = ignore_index;
    }
  }
  return b;
}

/// Rows [first, first + count) and positions [begin, begin + length) of b.
inline TokenRows slice(const TokenRows& b, int first, int count, std::int64_t begin, std::int64_t length) {
  TokenRows out{TokenRows::Ids("kmamba::test::ids", count, length),
                TokenRows::Ids("kmamba::test::targets", count, length), TokenRows::Ids()};
  if (b.seq_idx.is_allocated()) out.seq_idx = TokenRows::Ids("kmamba::test::seq_idx", count, length);
  for (int r = 0; r < count; ++r) {
    for (std::int64_t t = 0; t < length; ++t) {
      out.ids(r, t) = b.ids(first + r, begin + t);
      out.targets(r, t) = b.targets(first + r, begin + t);
      if (b.seq_idx.is_allocated()) out.seq_idx(r, t) = b.seq_idx(first + r, begin + t);
    }
  }
  return out;
}

/// The number of targets of b that are not ignored.
inline std::int64_t predicted(const TokenRows& b) {
  std::int64_t n = 0;
  for (std::size_t i = 0; i < b.targets.span(); ++i) n += b.targets.data()[i] != ignore_index;
  return n;
}

/// Forward and backward of each row of `b` as a micro-batch of its own, weighted by its predicted
/// tokens over `global` (gradient accumulation into the model's gradients, which the caller zeroes);
/// `before_row(r)`, when given, runs before row r. Returns the rows' results summed, with loss the
/// sum over rows of loss·tokens.
inline LossResult accumulate_rows(Model& model, const TokenRows& b, std::int64_t global,
                                  const std::function<void(int)>& before_row = {}) {
  const Exec exec;
  const int rows = static_cast<int>(b.ids.extent(0));
  LossResult total;
  for (int r = 0; r < rows; ++r) {
    if (before_row) before_row(r);
    const TokenRows micro = slice(b, r, 1, 0, static_cast<std::int64_t>(b.ids.extent(1)));
    model.set_sequence_ids(micro.seq_idx);
    const LossResult result = model.loss_and_backward(
        exec, micro.ids, micro.targets, static_cast<double>(predicted(micro)) / static_cast<double>(global));
    model.set_sequence_ids({});
    total.loss += result.loss * static_cast<double>(result.tokens);
    total.tokens += result.tokens;
    total.correct += result.correct;
  }
  return total;
}

/// The 1-rank reference of the split-model tests: the whole batch, one row per micro-batch,
/// weighted by tokens, into the model's zeroed gradients. Returns the mean loss.
inline double one_rank_reference_backward(Model& model, const TokenRows& b) {
  const Exec exec;
  const std::int64_t global = predicted(b);
  model.zero_grads(exec);
  const double loss_sum = accumulate_rows(model, b, global).loss;
  exec.fence();
  return loss_sum / static_cast<double>(global);
}

/// Every parameter's slice of `got` (slab storage) equals `ref`'s within tolerance·max|ref|, only
/// the elements i for which `owned(i)` holds compared; returns the largest max|got − ref| / max|ref|.
template <class Owned>
double expect_slab_equal(const ParameterSlab<Mem>& slab, const Tensor1<float, Mem>& got, const Tensor1<float, Mem>& ref,
                         double tolerance, const Owned& owned, const std::string& what) {
  double worst = 0.0;
  for (const auto& entry : slab.entries()) {
    double diff = 0.0, scale = 0.0;
    for (std::size_t i = entry.offset; i < entry.offset + entry.size; ++i) {
      scale = std::max(scale, std::abs(static_cast<double>(ref(i))));
      if (owned(i)) diff = std::max(diff, std::abs(static_cast<double>(got(i)) - static_cast<double>(ref(i))));
    }
    EXPECT_LE(diff, tolerance * scale) << what << " " << entry.name;
    if (scale > 0) worst = std::max(worst, diff / scale);
  }
  return worst;
}

/// Every element owned (expect_slab_equal).
inline bool every_element(std::size_t) { return true; }

/// The AdamW of the clipped-step comparisons: weight decay 0.1, and ε = 1e-5. Adam divides each
/// gradient element by its own magnitude: an element whose gradient is at the level of fp32 rounding
/// moves by about ±lr whatever its sign, so two summation orders of the same gradient (one rank vs a
/// reduction over ranks) can differ there by up to 2·lr; ε limits that amplification to lr/ε
/// (d update / d g ≤ 1/ε), which AdamWDifferenceBound carries.
inline AdamWConfig clipped_steps_adamw() {
  AdamWConfig adamw;
  adamw.weight_decay = 0.1;
  adamw.eps = 1e-5;
  return adamw;
}

/// The one-rank run of `steps` AdamW steps with learning rate `lr` and the gradient clipped to
/// `max_norm`, and along it the bounds a distributed run must keep (RoundingBounds.hpp): per step,
/// each gradient element within δ = tolerance·max|g| of its tensor (per tensor on the first step,
/// whose parameters every run shares; slab-wide after), the norm within ‖δ‖₂, hence the clip factor
/// within clip_scale_difference, and the parameters and moments within AdamWDifferenceBound.
struct ClippedAdamWReference {
  AdamW<Mem> optimizer;
  AdamWDifferenceBound bound;
  std::vector<double> norms, norm_bounds;        // per step
  std::vector<std::vector<double>> grad_bounds;  // per step, per element of the slab
  std::vector<std::vector<float>> grads;         // per step, per element of the slab

  /// `backward(step)` leaves the gradient of `step` in the grads of `slab`, the reference model's.
  template <class Backward>
  ClippedAdamWReference(const ParameterSlab<Mem>& slab, const AdamWConfig& adamw, int steps, double lr, double max_norm,
                        double tolerance, const Backward& backward)
      : optimizer(slab.size(), adamw), bound(adamw, slab.size(), slab.decay_end()) {
    const Exec exec;
    for (int step = 0; step < steps; ++step) {
      backward(step);
      grads.emplace_back(slab.grads().data(), slab.grads().data() + slab.size());
      const double norm = global_norm(exec, ConstTensor1<float, Mem>(slab.grads()));
      const std::vector<double> delta =
          step == 0 ? per_tensor_bounds(slab.entries(), slab.grads(), tolerance) : slab_bounds(slab.grads(), tolerance);
      norms.push_back(norm);
      norm_bounds.push_back(norm_difference_bound(delta, norm));
      grad_bounds.push_back(delta);
      optimizer.step(exec, slab.params(), slab.grads(), slab.decay_end(), lr, clip_scale(norm, max_norm));
      exec.fence();
      bound.step(slab.grads(), delta, clip_scale(norm, max_norm),
                 clip_scale_difference(norm, norm_bounds.back(), max_norm), lr, slab.params());
    }
  }
};

/// The parameters of `model` (split over `mesh`), gathered into the unsplit layout, within the bounds
/// that `one_rank` carried along its run of the unsplit `slab`. Returns the largest |d|/bound over
/// the world's ranks. Collective over the mesh.
inline double expect_parameters_follow(const ClippedAdamWReference& one_rank, const ParameterSlab<Mem>& slab,
                                       const Model& model, const ProcessMesh& mesh) {
  const Exec exec;
  Model full(model.config());
  gather_parameters(exec, model, full);
  const double worst = expect_within(
      slab.entries(), full.parameters().params(), slab.params(),
      [&](std::size_t i) { return one_rank.bound.parameter(i); }, "parameter");
  return mesh.world().all_reduce_value(worst, ReduceOp::Max);
}

}  // namespace test
}  // namespace kmamba

#endif
