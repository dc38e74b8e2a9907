// Distributed training of a LanguageModel: checking a process mesh against the model, and data
// parallelism — bucketed gradient reduction, global-norm clipping over the whole mesh, and AdamW
// with its moments either replicated (DDP) or sharded across the data-parallel ranks (ZeRO-1) —
// as one object a training loop calls once per optimizer step (docs/distributed.md §3).
//
//   kmamba::ProcessMesh mesh(MPI_COMM_WORLD, mesh_config);
//   kmamba::DataParallel<Exec> dp(mesh, model.config(), model.parameters(), adamw, {/*zero_stage=*/1});
//   // Each data-parallel rank holds its shard of the global batch, in micro-batches.
//   const std::int64_t total = dp.global_tokens(tokens_of_my_micro_batches);
//   model.zero_grads(exec);
//   for (const auto& mb : my_micro_batches)   // no communication on these micro-steps
//     model.loss_and_backward(exec, mb.ids, mb.targets, double(tokens(mb)) / double(total));
//   dp.reduce_gradients(exec, model.parameters());                 // Σ over dp, bucket by bucket
//   const double norm = dp.grad_norm(exec, model.parameters());     // the same value on every rank
//   dp.step(exec, model.parameters(), lr, kmamba::clip_scale(norm, max_norm));
//
// Overlap with backward (docs/distributed.md §3): attached to the model, the gradients of the last
// micro-batch are reduced bucket by bucket while its backward runs (on CUDA on a communication
// stream; on host transports synchronously, through the same path):
//
//   dp.attach(model);                                  // once: the model's gradients-ready hook
//   for (i ...) {
//     if (i == last) dp.begin_reduction(model.parameters());   // accumulation steps stay silent
//     model.loss_and_backward(...);
//   }
//   dp.reduce_gradients(exec, model.parameters());     // reduces what is left, waits for the rest
//
// Weighting micro-batch i by tokens_i / (tokens over all micro-batches of all dp ranks) and summing
// over dp gives exactly the gradient of the mean loss over the global batch, so dp = N ranks on N
// shards of a batch equal one rank on the whole batch (whatever the ranks' token counts).
//
// Tensor and sequence parallelism (ModelParallel.hpp): a LanguageModel made with
// ModelParallel{&mesh.tensor(), &mesh.sequence()} holds this rank's shards; the ranks of a tp group
// see the same data, the ranks of an sp group the segments of the same sequences. DataParallel sums
// the gradients over dp × sp (the ranks that share each parameter), counts a tensor-parallel shard
// on its own rank and a replicated parameter once per tp group in the norm. scatter_parameters and
// gather_parameters convert between the shards and the unsplit (checkpoint) layout:
//
//   kmamba::LanguageModel<Exec> full(config);  full.initialize(seed);   // or LanguageModel::load
//   kmamba::LanguageModel<Exec> local(config, {&mesh.tensor(), &mesh.sequence()});
//   kmamba::scatter_parameters(exec, full, local);          // split on load
//   ...
//   kmamba::gather_parameters(exec, local, full);           // collective over tp; then full.save(dir)
#ifndef KMAMBA_MODELS_DISTRIBUTED_HPP
#define KMAMBA_MODELS_DISTRIBUTED_HPP

#include <kmamba/Config.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/models/Config.hpp>
#include <kmamba/models/LanguageModel.hpp>
#include <kmamba/models/ModelParallel.hpp>
#include <kmamba/models/Optimizer.hpp>
#include <kmamba/models/ParameterSlab.hpp>
#include <kmamba/parallel/GradientBuckets.hpp>
#include <kmamba/parallel/PowerSgd.hpp>
#include <kmamba/parallel/ProcessMesh.hpp>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

namespace kmamba {

/// Throws a UserError, the same on every rank, when `mesh` cannot shard `model`: the
/// tensor-parallel size must divide the heads and the B/C groups of Mamba-2/3 (each rank keeps
/// whole heads with their group), and be 1 for Mamba-1 (which splits sequences only); the
/// pipeline-parallel size must not exceed the layers (each stage holds at least one).
void check_mesh_fits_model(const MeshConfig& mesh, const ModelConfig& model);

/// local_values ← this rank's part of full_values: the runs of every sharded parameter, every
/// other parameter whole. Both are slab-layout vectors (parameters, gradients or moments), of
/// `full`'s and `local`'s slabs; the models have the same config. No communication. Blocking.
template <class ExecutionSpace>
void scatter_values(const ExecutionSpace& exec, const LanguageModel<ExecutionSpace>& full,
                    const ConstTensor1<float, typename ExecutionSpace::memory_space>& full_values,  // (full slab)
                    const LanguageModel<ExecutionSpace>& local,
                    const Tensor1<float, typename ExecutionSpace::memory_space>& local_values);  // (local slab)

/// full_values ← the unsplit vector assembled from local_values of every rank of
/// local.parallel().tensor (the replicated parameters from its rank 0), on every one of them.
/// Collective over the tensor ranks. Blocking.
template <class ExecutionSpace>
void gather_values(const ExecutionSpace& exec, const LanguageModel<ExecutionSpace>& local,
                   const ConstTensor1<float, typename ExecutionSpace::memory_space>& local_values,  // (local slab)
                   const LanguageModel<ExecutionSpace>& full,
                   const Tensor1<float, typename ExecutionSpace::memory_space>& full_values);  // (full slab)

/// local's parameters ← its part of full's (split on load). No communication. Blocking.
template <class ExecutionSpace>
void scatter_parameters(const ExecutionSpace& exec, const LanguageModel<ExecutionSpace>& full,
                        LanguageModel<ExecutionSpace>& local);
/// full's parameters ← the unsplit parameters (gathered for a save). Collective over tp. Blocking.
template <class ExecutionSpace>
void gather_parameters(const ExecutionSpace& exec, const LanguageModel<ExecutionSpace>& local,
                       LanguageModel<ExecutionSpace>& full);

/// Options of DataParallel.
struct DataParallelConfig {
  int zero_stage = 0;  ///< 0: every rank keeps all AdamW moments; 1: ZeRO-1 (moments sharded)
  /// fp32 elements per reduction bucket (0: default_bucket_elements(dp), 25 MiB of them).
  std::size_t bucket_elements = 0;
  /// true: begin_reduction arms the reduction of the coming backward; false: it does nothing, and
  /// reduce_gradients reduces every bucket after the backward.
  bool overlap = true;
  /// Optimizer steps per synchronisation of the dp replicas (docs/distributed.md §3.2). 1: the
  /// gradients are summed over dp × sp at every step (DDP, ZeRO-1). N > 1, local SGD: the gradients
  /// are summed over sp only, every dp replica steps on its own data, and after every step whose
  /// count is a multiple of N the parameters and AdamW moments are averaged over dp. N > 1 needs
  /// zero_stage 0 (each replica keeps its own moments between averagings).
  std::int64_t sync_frequency = 1;
  /// How the dp × sp gradients travel (GradientBuckets.hpp): fp32, bf16 summed in fp32, or PowerSGD
  /// (PowerSgd.hpp; docs/distributed.md §3.4). PowerSGD needs sync_frequency 1.
  GradientCompression compression = GradientCompression::None;
  /// PowerSGD's rank r (compression PowerSgd only): every parameter of rank >= 2, as a matrix
  /// (first extent, product of the rest), travels as rank-r factors where they are smaller
  /// (powersgd_compresses); the rest is all-reduced whole.
  int powersgd_rank = 4;
  /// Where the AdamW moments (this rank's shards under ZeRO-1) live and are updated
  /// (OptimizerPlacement, Optimizer.hpp): on the device, or offloaded to host memory and host
  /// threads. Host needs sync_frequency 1 (the averaging of local steps runs on the device).
  OptimizerPlacement optimizer_placement = OptimizerPlacement::Device;
};

/// The gradient matrices PowerSGD at rank `rank` compresses in `slab`: each parameter of rank >= 2
/// as (first extent, product of the other extents), where powersgd_compresses; in slab order
/// (entries() is in offset order).
template <class MemorySpace>
std::vector<PowerSgdMatrix> powersgd_matrices(const ParameterSlab<MemorySpace>& slab, int rank) {
  std::vector<PowerSgdMatrix> matrices;
  for (const auto& e : slab.entries()) {
    if (e.shape.size() < 2) continue;
    const std::int64_t rows = e.shape[0], cols = static_cast<std::int64_t>(e.size) / rows;
    if (powersgd_compresses(rows, cols, rank)) matrices.push_back({e.offset, rows, cols});
  }
  return matrices;
}

#if KMAMBA_ENABLE_MPI
template <class ExecutionSpace>
class DataParallel {
 public:
  using execution_space = ExecutionSpace;
  using memory_space = typename ExecutionSpace::memory_space;
  using Slab = ParameterSlab<memory_space>;

  /// Checks the mesh against `model` (check_mesh_fits_model) and lays `slab` out in buckets over
  /// the mesh's dp × sp group. `tensor_sharded` lists the slab's tensor-parallel shards
  /// (LanguageModel::sharded_parameters(); empty without tensor parallelism). Keeps a reference to
  /// `mesh`, which must outlive this object. Does not communicate: every rank must start from the
  /// same parameters (same seed or checkpoint).
  DataParallel(const ProcessMesh& mesh, const ModelConfig& model, const Slab& slab, const AdamWConfig& adamw,
               const DataParallelConfig& config = DataParallelConfig(),
               const std::vector<ShardedParameter>& tensor_sharded = {});

  const ProcessMesh& mesh() const { return *mesh_; }
  const DataParallelConfig& config() const { return config_; }
  const BucketLayout& layout() const { return reducer_.layout(); }
  /// This rank's position on the dp axis and its size: rank data_rank() trains on shard
  /// data_rank() of data_size() of every global batch.
  int data_rank() const;
  int data_size() const;

  /// Σ over the dp × sp ranks of `local_tokens` (each rank's predicted tokens of one optimizer step).
  std::int64_t global_tokens(std::int64_t local_tokens) const { return sum_over_data(local_tokens); }
  /// Whether the steps are local (config().sync_frequency > 1): each dp replica's gradient is the
  /// mean over its own tokens (weight micro-batches by replica_tokens), summed over sp only.
  bool local_steps() const { return config_.sync_frequency > 1; }
  /// Σ over this replica's sp ranks of `local_tokens`. Throws a UserError on every rank when a
  /// replica's sum is 0 (a local step needs tokens on every replica). Collective over dp × sp.
  std::int64_t replica_tokens(std::int64_t local_tokens) const;
  /// Whether every dp replica holds the same parameters and moments: always with
  /// sync_frequency 1 or one dp rank, else right after an averaging (steps_taken() a multiple of it).
  bool replicas_identical() const { return data_size() == 1 || step_ % config_.sync_frequency == 0; }
  /// Σ over the dp × sp ranks of `local` (e.g. loss · tokens, to report the global mean loss).
  double sum_over_data(double local) const;
  std::int64_t sum_over_data(std::int64_t local) const;

  /// Makes `model` announce its gradients to this object as its backward produces them (its
  /// gradients-ready hook, LanguageModel::set_gradients_ready_hook) and reduces the buckets in the
  /// order of those announcements. `model` keeps a pointer to this object: detach or outlive it.
  void attach(LanguageModel<ExecutionSpace>& model);
  /// Arms the reduction of the coming backward (the last micro-batch of an optimizer step): each
  /// bucket is reduced as soon as its gradients are announced. Without it (accumulation micro-steps,
  /// or config().overlap false) announcements do nothing.
  void begin_reduction(const Slab& slab);
  /// The announcement of an attached model: the gradients of slab elements [begin, end) are final.
  void gradients_ready(const ExecutionSpace& exec, std::size_t begin, std::size_t end);

  /// Once per optimizer step, after the last micro-batch's backward: slab.grads() ← Σ over dp × sp
  /// (the buckets begin_reduction's backward did not reduce yet, or all of them). ZeRO-1
  /// reduce-scatters, so only this rank's shards (and the unsharded tail) are then valid. Local
  /// steps: Σ over sp only, in fp32. PowerSGD: the whole slab, its matrices compressed
  /// (PowerSgd::reduce), on every rank, after the backward (begin_reduction arms nothing).
  void reduce_gradients(const ExecutionSpace& exec, const Slab& slab);

  /// ‖gradient‖₂ over every unique parameter of the mesh (after reduce_gradients): each rank sums
  /// the squares it owns — its ZeRO shards, the tail on dp × sp rank 0; tensor-parallel shards on
  /// every tp rank, replicated parameters only on tp rank 0; each pipeline stage its own parameters,
  /// the tied embedding on the first stage only — and one all-reduce over the world
  /// adds them. Identical on every rank. Local steps: the norm of this replica's gradient (summed
  /// over its tp ranks), or NaN on every rank when any replica's is not finite, so that every
  /// replica skips the step together. Blocking.
  double grad_norm(const ExecutionSpace& exec, const Slab& slab) const;

  /// AdamW step at learning rate `lr` on the reduced gradients scaled by `grad_scale` (the clip
  /// factor): DDP updates the whole slab on every rank; ZeRO-1 updates this rank's shards with its
  /// sharded moments, then all-gathers the parameters. Leaves the parameters identical on every rank;
  /// local steps only after every sync_frequency-th step, which averages parameters and moments
  /// over dp.
  void step(const ExecutionSpace& exec, const Slab& slab, double lr, double grad_scale = 1.0);

  /// m, v ← the AdamW moments in the slab's layout, as a single-process AdamW holds them (for a
  /// checkpoint), on every rank: ZeRO-1 all-gathers the shards over dp. Collective over dp.
  void gather_moments(const ExecutionSpace& exec, const Tensor1<float, memory_space>& m,  // (slab size)
                      const Tensor1<float, memory_space>& v) const;                       // (slab size)
  /// Sets the moments from slab-layout moments held by every rank (a checkpoint), each rank keeping
  /// its shards, and the step count to `steps`; restarts PowerSGD (PowerSgd::reset: checkpoints do
  /// not hold its per-rank error and Q). No communication.
  void load_moments(const ExecutionSpace& exec, const ConstTensor1<float, memory_space>& m,  // (slab size)
                    const ConstTensor1<float, memory_space>& v,                              // (slab size)
                    std::int64_t steps);
  /// The same from the moments of a single-process AdamW of the slab (either placement).
  void load_moments(const ExecutionSpace& exec, const AdamW<memory_space>& from, std::int64_t steps);

  /// Starts or stops recording when the gradient reductions ran against the compute stream
  /// (GradientReducer::record_timeline; CUDA only), to measure their overlap with the backward.
  void record_communication_timeline(bool on) { reducer_.record_timeline(on); }
  CommunicationTimeline communication_timeline() const { return reducer_.timeline(); }

  std::int64_t steps_taken() const { return step_; }
  /// The PowerSGD state (compression PowerSgd), else null.
  const PowerSgd<ExecutionSpace>* powersgd() const { return powersgd_.get(); }
  /// AdamW moments: the whole slab (stage 0) or this rank's shard storage in layout() order (stage 1);
  /// on the device (optimizer_placement Device only: optimizer().store_moments copies either).
  const Tensor1<float, memory_space>& first_moment() const { return optimizer_.first_moment(); }
  const Tensor1<float, memory_space>& second_moment() const { return optimizer_.second_moment(); }
  /// The AdamW holding those moments (its steps_taken() is not counted: steps_taken() is).
  const AdamW<memory_space>& optimizer() const { return optimizer_; }

 private:
  void check_slab(const char* function, const Slab& slab) const;
  // Checks the PowerSGD options against the others and makes powersgd_ over the dp × sp group.
  void make_powersgd(const Slab& slab);
  double replica_grad_norm(const ExecutionSpace& exec, const Slab& slab) const;
  void average_replicas(const ExecutionSpace& exec, const Slab& slab) const;
  typename GradientReducer<ExecutionSpace>::Reduction reduction() const;
  void check_full(const char* function, const char* name, std::size_t size) const;
  // Calls copy(slab_begin, shard_storage_begin, size) for each of this rank's shards (stage 1).
  template <class Copy>
  void for_each_shard(const Copy& copy) const;
  // The slab runs this rank's AdamW updates: the whole slab (stage 0) or its shards (stage 1).
  std::vector<SlabRun> owned_runs() const;
  // The step count to `steps`, PowerSGD restarted (after the moments were loaded).
  void restart_at(const ExecutionSpace& exec, std::int64_t steps);

  const ProcessMesh* mesh_;
  DataParallelConfig config_;
  GradientReducer<ExecutionSpace> reducer_;
  GradientReducer<ExecutionSpace> sequence_reducer_;    // local steps: the sum over sp
  std::unique_ptr<PowerSgd<ExecutionSpace>> powersgd_;  // compression PowerSgd: the dp × sp reduction
  std::size_t decay_end_;
  std::vector<std::pair<std::size_t, std::size_t>> counted_;  // slab ranges this rank counts in the norm
  AdamW<memory_space> optimizer_;                             // the moments of owned_runs(), packed
  std::int64_t step_ = 0;
};
#endif

}  // namespace kmamba

#endif
