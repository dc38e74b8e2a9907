#include <kmamba/models/Distributed.hpp>

#include <kmamba/core/Error.hpp>
#include <kmamba/core/ForEachBackend.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

namespace kmamba {

SequenceSegment sequence_segment(std::int64_t seqlen, int rank, int size) {
  KMAMBA_REQUIRE(size >= 1 && rank >= 0 && rank < size,
                 "kmamba::sequence_segment: rank " << rank << " is not in [0, " << size << ")");
  KMAMBA_REQUIRE(seqlen >= size, "kmamba::sequence_segment: a sequence of " << seqlen << " tokens cannot be split over "
                                                                            << size
                                                                            << " sequence-parallel ranks (each needs "
                                                                               "at least one token)");
  const std::int64_t base = seqlen / size, extra = seqlen % size;
  SequenceSegment segment;
  segment.length = base + (rank < extra ? 1 : 0);
  segment.begin = rank * base + std::min<std::int64_t>(rank, extra);
  return segment;
}

StageLayers stage_layers(int n_layer, int stage, int stages) {
  KMAMBA_REQUIRE(stages >= 1 && stage >= 0 && stage < stages,
                 "kmamba::stage_layers: stage " << stage << " is not in [0, " << stages << ")");
  KMAMBA_REQUIRE(stages <= n_layer, "kmamba::stage_layers: pipeline_parallel_size "
                                        << stages << " exceeds the model's " << n_layer
                                        << " layers (n_layer); each pipeline stage needs at least one layer");
  const int base = n_layer / stages, extra = n_layer % stages;
  StageLayers layers;
  layers.begin = stage * base + std::min(stage, extra);
  layers.end = layers.begin + base + (stage < extra ? 1 : 0);
  return layers;
}

StageLayers chunk_layers(int n_layer, const PipelineParallel& stages, int chunk) {
  const int v = stages.virtual_stages, p = stages.stages();
  KMAMBA_REQUIRE(v >= 1, "kmamba::chunk_layers: virtual_pipeline_stages must be >= 1, got " << v);
  KMAMBA_REQUIRE(chunk >= 0 && chunk < v, "kmamba::chunk_layers: chunk " << chunk << " is not in [0, " << v << ")");
  KMAMBA_REQUIRE(v == 1 || v * p <= n_layer, "kmamba::chunk_layers: virtual_pipeline_stages "
                                                 << v << " x pipeline_parallel_size " << p << " exceeds the model's "
                                                 << n_layer
                                                 << " layers (n_layer); each chunk needs at least one layer");
  return stage_layers(n_layer, chunk * p + stages.stage(), v * p);
}

namespace {

// dst[dst_offset, dst_offset + count) ← src[src_offset, src_offset + count).
template <class ExecutionSpace>
void copy_range(const ExecutionSpace& exec, float* dst, std::int64_t dst_offset, const float* src,
                std::int64_t src_offset, std::int64_t count) {
  using Mem = typename ExecutionSpace::memory_space;
  const auto n = static_cast<std::size_t>(count);
  Kokkos::deep_copy(exec, Tensor1<float, Mem>(dst + dst_offset, n), ConstTensor1<float, Mem>(src + src_offset, n));
}

// Checks that the two models and vectors fit together and calls copy(full offset, local offset,
// count, replicated) for every run of every parameter of `local` (ShardedParameter::Run; a
// parameter that the split leaves whole is one replicated run).
template <class ExecutionSpace, class Copy>
void for_each_parameter(const char* function, const LanguageModel<ExecutionSpace>& full,
                        const LanguageModel<ExecutionSpace>& local, std::size_t full_size, std::size_t local_size,
                        const Copy& copy) {
  KMAMBA_REQUIRE(full.config().to_hf_json() == local.config().to_hf_json(),
                 function << ": the two models have different configs");
  KMAMBA_REQUIRE(
      full.parallel().tensor_size() == 1 && full.parallel().sequence_size() == 1 && full.pipeline().stages() == 1,
      function << ": the unsplit model must not be split itself");
  KMAMBA_REQUIRE(full_size == full.parameters().size() && local_size == local.parameters().size(),
                 function << ": the vectors have " << full_size << " and " << local_size
                          << " elements; the slabs of the unsplit and the local model have " << full.parameters().size()
                          << " and " << local.parameters().size());
  std::map<std::string, ShardedParameter> shards;
  for (ShardedParameter& p : local.sharded_parameters()) shards[p.name] = std::move(p);
  for (const auto& entry : local.parameters().entries()) {
    const auto full_offset = static_cast<std::int64_t>(full.parameters().entry(entry.name).offset);
    const auto local_offset = static_cast<std::int64_t>(entry.offset);
    const auto it = shards.find(entry.name);
    if (it == shards.end()) {
      copy(full_offset, local_offset, static_cast<std::int64_t>(entry.size), true);
      continue;
    }
    for (const ShardedParameter::Run& run : it->second.runs) {
      copy(full_offset + run.full_offset, local_offset + run.local_offset, run.count, run.replicated);
    }
  }
}

}  // namespace

template <class ExecutionSpace>
void scatter_values(const ExecutionSpace& exec, const LanguageModel<ExecutionSpace>& full,
                    const ConstTensor1<float, typename ExecutionSpace::memory_space>& full_values,
                    const LanguageModel<ExecutionSpace>& local,
                    const Tensor1<float, typename ExecutionSpace::memory_space>& local_values) {
  float* const to = local_values.data();
  const float* const from = full_values.data();
  for_each_parameter("kmamba::scatter_values", full, local, full_values.extent(0), local_values.extent(0),
                     [&](std::int64_t full_offset, std::int64_t local_offset, std::int64_t count, bool) {
                       copy_range(exec, to, local_offset, from, full_offset, count);
                     });
  exec.fence();
}

template <class ExecutionSpace>
void gather_values(const ExecutionSpace& exec, const LanguageModel<ExecutionSpace>& local,
                   const ConstTensor1<float, typename ExecutionSpace::memory_space>& local_values,
                   const LanguageModel<ExecutionSpace>& full,
                   const Tensor1<float, typename ExecutionSpace::memory_space>& full_values) {
  // Each rank writes its shards into zeros (the replicated parameters and runs on tp rank 0 only, the
  // tied embedding from the first pipeline stage only); the sums over the tensor ranks and over the
  // stages are then exact.
  Kokkos::deep_copy(exec, full_values, 0.0f);
  const bool first = local.parallel().tensor_rank() == 0;
  const PipelineParallel& stages = local.pipeline();
  std::pair<std::int64_t, std::int64_t> second_copy{0, 0};  // the local slab range of the last stage's tied embedding
  if (stages.stages() > 1 && stages.last_stage() && local.config().tie_embeddings) {
    const auto& e = local.parameters().entry(embedding_parameter_name);
    second_copy = {static_cast<std::int64_t>(e.offset), static_cast<std::int64_t>(e.offset + e.size)};
  }
  float* const to = full_values.data();
  const float* const from = local_values.data();
  for_each_parameter("kmamba::gather_values", full, local, full_values.extent(0), local_values.extent(0),
                     [&](std::int64_t full_offset, std::int64_t local_offset, std::int64_t count, bool replicated) {
                       if (local_offset >= second_copy.first && local_offset < second_copy.second) return;
                       if (first || !replicated) copy_range(exec, to, full_offset, from, local_offset, count);
                     });
  if (local.parallel().tensor_size() > 1) local.parallel().tensor->all_reduce(exec, full_values);
  if (stages.stages() > 1) stages.pipeline->all_reduce(exec, full_values);
  exec.fence();
}

template <class ExecutionSpace>
void scatter_parameters(const ExecutionSpace& exec, const LanguageModel<ExecutionSpace>& full,
                        LanguageModel<ExecutionSpace>& local) {
  scatter_values(exec, full, ConstTensor1<float, typename ExecutionSpace::memory_space>(full.parameters().params()),
                 local, local.parameters().params());
}

template <class ExecutionSpace>
void gather_parameters(const ExecutionSpace& exec, const LanguageModel<ExecutionSpace>& local,
                       LanguageModel<ExecutionSpace>& full) {
  gather_values(exec, local, ConstTensor1<float, typename ExecutionSpace::memory_space>(local.parameters().params()),
                full, full.parameters().params());
}

#define KMAMBA_INSTANTIATE_TENSOR_PARALLEL(Exec)                                                                 \
  template void scatter_values<Exec>(const Exec&, const LanguageModel<Exec>&,                                    \
                                     const ConstTensor1<float, Exec::memory_space>&, const LanguageModel<Exec>&, \
                                     const Tensor1<float, Exec::memory_space>&);                                 \
  template void gather_values<Exec>(const Exec&, const LanguageModel<Exec>&,                                     \
                                    const ConstTensor1<float, Exec::memory_space>&, const LanguageModel<Exec>&,  \
                                    const Tensor1<float, Exec::memory_space>&);                                  \
  template void scatter_parameters<Exec>(const Exec&, const LanguageModel<Exec>&, LanguageModel<Exec>&);         \
  template void gather_parameters<Exec>(const Exec&, const LanguageModel<Exec>&, LanguageModel<Exec>&);
KMAMBA_FOR_EACH_BACKEND(KMAMBA_INSTANTIATE_TENSOR_PARALLEL)
#undef KMAMBA_INSTANTIATE_TENSOR_PARALLEL

void check_mesh_fits_model(const MeshConfig& mesh, const ModelConfig& model) {
  constexpr const char* function = "kmamba::check_mesh_fits_model";
  const int tp = mesh.tensor_parallel_size;
  KMAMBA_REQUIRE(tp >= 1, function << ": tensor_parallel_size must be >= 1, got " << tp);
  KMAMBA_REQUIRE(mesh.sequence_parallel_size >= 1,
                 function << ": sequence_parallel_size must be >= 1, got " << mesh.sequence_parallel_size);
  KMAMBA_REQUIRE(mesh.pipeline_parallel_size >= 1 && mesh.pipeline_parallel_size <= model.n_layer,
                 function << ": pipeline_parallel_size " << mesh.pipeline_parallel_size << " must lie in [1, "
                          << model.n_layer << "]: the model has " << model.n_layer
                          << " layers (n_layer) and each pipeline stage needs at least one");
  if (model.mixer == MixerKind::Mamba1) {
    KMAMBA_REQUIRE(tp == 1, function << ": tensor_parallel_size " << tp << ": the " << mixer_name(model.mixer)
                                     << " mixer is not split across tensor ranks (it splits sequences: use "
                                        "sequence_parallel_size)");
    return;
  }
  KMAMBA_REQUIRE(model.num_heads() % tp == 0, function << ": tensor_parallel_size " << tp << " does not divide the "
                                                       << mixer_name(model.mixer) << " model's " << model.num_heads()
                                                       << " heads; each tensor-parallel rank must hold whole heads");
  KMAMBA_REQUIRE(model.ngroups % tp == 0,
                 function << ": tensor_parallel_size " << tp << " does not divide the " << mixer_name(model.mixer)
                          << " model's ngroups " << model.ngroups
                          << "; each tensor-parallel rank must hold whole B/C groups (use ngroups a multiple of "
                             "tensor_parallel_size, or a smaller tensor_parallel_size)");
}

#if KMAMBA_ENABLE_MPI
namespace {
// ranges ← ranges without [begin, end) (sorted, disjoint ranges stay so).
void remove_range(std::vector<std::pair<std::size_t, std::size_t>>& ranges, std::size_t begin, std::size_t end) {
  std::vector<std::pair<std::size_t, std::size_t>> kept;
  for (const auto& r : ranges) {
    if (r.first < begin) kept.emplace_back(r.first, std::min(r.second, begin));
    if (r.second > end) kept.emplace_back(std::max(r.first, end), r.second);
  }
  ranges = std::move(kept);
}
}  // namespace

template <class ExecutionSpace>
DataParallel<ExecutionSpace>::DataParallel(const ProcessMesh& mesh, const ModelConfig& model, const Slab& slab,
                                           const AdamWConfig& adamw, const DataParallelConfig& config,
                                           const std::vector<ShardedParameter>& tensor_sharded)
    : mesh_(&mesh),
      config_(config),
      reducer_(mesh.data_sequence(), slab.size(), config.bucket_elements, config.compression),
      sequence_reducer_(mesh.sequence(), slab.size(), config.bucket_elements),
      decay_end_(slab.decay_end()),
      optimizer_(config.zero_stage == 1 ? reducer_.layout().shard_elements() : slab.size(), adamw,
                 config.optimizer_placement) {
  check_mesh_fits_model(mesh.config(), model);
  if (mesh.coordinates().tp == 0) {
    counted_.emplace_back(0, slab.size());
  } else {
    for (const ShardedParameter& p : tensor_sharded) {
      const auto& e = slab.entry(p.name);
      const bool has_replicated_run =
          std::any_of(p.runs.begin(), p.runs.end(), [](const ShardedParameter::Run& run) { return run.replicated; });
      if (!has_replicated_run) {
        counted_.emplace_back(e.offset, e.offset + e.size);
        continue;
      }
      for (const ShardedParameter::Run& run : p.runs) {
        const auto begin = e.offset + static_cast<std::size_t>(run.local_offset);
        if (!run.replicated) counted_.emplace_back(begin, begin + static_cast<std::size_t>(run.count));
      }
    }
    std::sort(counted_.begin(), counted_.end());
  }
  // The tied embedding of the last pipeline stage is a copy of the first stage's (their gradients
  // were summed), counted there.
  const int stages = mesh.config().pipeline_parallel_size;
  if (stages > 1 && mesh.coordinates().pp == stages - 1 && model.tie_embeddings) {
    const auto& e = slab.entry(embedding_parameter_name);
    remove_range(counted_, e.offset, e.offset + e.size);
  }
  KMAMBA_REQUIRE(config.zero_stage == 0 || config.zero_stage == 1,
                 "kmamba::DataParallel: zero_stage must be 0 (replicated optimizer state) or 1 (ZeRO-1), got "
                     << config.zero_stage);
  KMAMBA_REQUIRE(config.sync_frequency >= 1,
                 "kmamba::DataParallel: gradient_sync_frequency must be >= 1, got " << config.sync_frequency);
  KMAMBA_REQUIRE(config.zero_stage == 0 || config.sync_frequency == 1,
                 "kmamba::DataParallel: zero_stage 1 with gradient_sync_frequency "
                     << config.sync_frequency
                     << ": ZeRO-1 shards the AdamW moments over the dp ranks, but local steps need every replica's "
                        "own moments; use zero_stage 0 or gradient_sync_frequency 1");
  KMAMBA_REQUIRE(config.optimizer_placement == OptimizerPlacement::Device || config.sync_frequency == 1,
                 "kmamba::DataParallel: offload_optimizer with gradient_sync_frequency "
                     << config.sync_frequency
                     << ": local steps average the AdamW moments over dp on the device, where an offloaded "
                        "optimizer keeps none; use gradient_sync_frequency 1 or no optimizer offload");
  KMAMBA_REQUIRE(slab.size() > 0, "kmamba::DataParallel: the parameter slab is empty (not finalized?)");
  if (config.compression == GradientCompression::PowerSgd) make_powersgd(slab);
}

template <class ExecutionSpace>
void DataParallel<ExecutionSpace>::make_powersgd(const Slab& slab) {
  KMAMBA_REQUIRE(config_.sync_frequency == 1,
                 "kmamba::DataParallel: gradient_compression powersgd with gradient_sync_frequency "
                     << config_.sync_frequency
                     << ": local steps reduce no gradients over dp between averagings, so there is nothing to "
                        "compress; use gradient_compression none or gradient_sync_frequency 1");
  KMAMBA_REQUIRE(config_.powersgd_rank >= 1,
                 "kmamba::DataParallel: powersgd_rank must be >= 1, got " << config_.powersgd_rank);
  powersgd_ = std::make_unique<PowerSgd<ExecutionSpace>>(
      mesh_->data_sequence(), slab.size(), powersgd_matrices(slab, config_.powersgd_rank), config_.powersgd_rank);
}

template <class ExecutionSpace>
int DataParallel<ExecutionSpace>::data_rank() const {
  return mesh_->data().rank();
}

template <class ExecutionSpace>
int DataParallel<ExecutionSpace>::data_size() const {
  return mesh_->data().size();
}

template <class ExecutionSpace>
std::int64_t DataParallel<ExecutionSpace>::sum_over_data(std::int64_t local) const {
  return mesh_->data_sequence().all_reduce_value(local);
}

template <class ExecutionSpace>
double DataParallel<ExecutionSpace>::sum_over_data(double local) const {
  return mesh_->data_sequence().all_reduce_value(local);
}

template <class ExecutionSpace>
std::int64_t DataParallel<ExecutionSpace>::replica_tokens(std::int64_t local_tokens) const {
  const std::int64_t replica = mesh_->sequence().all_reduce_value(local_tokens);
  KMAMBA_REQUIRE(mesh_->data().all_reduce_value(replica, ReduceOp::Min) > 0,
                 "kmamba::DataParallel: a data-parallel replica's micro-batches hold no predicted tokens; with "
                 "gradient_sync_frequency "
                     << config_.sync_frequency << " every replica steps on its own tokens, so each needs some");
  return replica;
}

template <class ExecutionSpace>
void DataParallel<ExecutionSpace>::check_slab(const char* function, const Slab& slab) const {
  KMAMBA_REQUIRE(slab.size() == reducer_.layout().elements() && slab.decay_end() == decay_end_,
                 "kmamba::DataParallel::" << function << ": the slab has " << slab.size()
                                          << " elements; this object was made for a slab of "
                                          << reducer_.layout().elements());
}

template <class ExecutionSpace>
typename GradientReducer<ExecutionSpace>::Reduction DataParallel<ExecutionSpace>::reduction() const {
  using Reduction = typename GradientReducer<ExecutionSpace>::Reduction;
  return config_.zero_stage == 1 ? Reduction::ReduceScatter : Reduction::AllReduce;
}

template <class ExecutionSpace>
void DataParallel<ExecutionSpace>::attach(LanguageModel<ExecutionSpace>& model) {
  check_slab("attach", model.parameters());
  reducer_.set_ready_sequence(model.gradients_ready_sequence());
  model.set_gradients_ready_hook(
      [this](const ExecutionSpace& exec, std::size_t begin, std::size_t end) { gradients_ready(exec, begin, end); });
}

template <class ExecutionSpace>
void DataParallel<ExecutionSpace>::begin_reduction(const Slab& slab) {
  check_slab("begin_reduction", slab);
  if (config_.overlap && !local_steps() && !powersgd_) reducer_.begin(slab.grads(), reduction());
}

template <class ExecutionSpace>
void DataParallel<ExecutionSpace>::gradients_ready(const ExecutionSpace& exec, std::size_t begin, std::size_t end) {
  reducer_.ready(exec, begin, end);
}

template <class ExecutionSpace>
void DataParallel<ExecutionSpace>::reduce_gradients(const ExecutionSpace& exec, const Slab& slab) {
  check_slab("reduce_gradients", slab);
  if (powersgd_) {
    powersgd_->reduce(exec, slab.grads());
  } else if (!local_steps()) {
    reducer_.finish(exec, slab.grads(), reduction());
  } else if (mesh_->sequence().size() > 1) {
    sequence_reducer_.all_reduce(exec, slab.grads());
  }
}

template <class ExecutionSpace>
double DataParallel<ExecutionSpace>::grad_norm(const ExecutionSpace& exec, const Slab& slab) const {
  check_slab("grad_norm", slab);
  if (local_steps()) return replica_grad_norm(exec, slab);
  const double owned = reducer_.owned_sum_of_squares(exec, ConstTensor1<float, memory_space>(slab.grads()), counted_);
  return std::sqrt(mesh_->world().all_reduce_value(owned));
}

template <class ExecutionSpace>
double DataParallel<ExecutionSpace>::replica_grad_norm(const ExecutionSpace& exec, const Slab& slab) const {
  // Every rank of the replica holds its whole summed gradient; counted_ leaves the replicated
  // parameters to tp rank 0 and the tied embedding to the first stage, so the sum over tp and pp
  // counts each parameter once.
  double squares = 0.0;
  for (const auto& range : counted_) {
    squares += GradientReducer<ExecutionSpace>::sum_of_squares(exec, ConstTensor1<float, memory_space>(slab.grads()),
                                                               range.first, range.second - range.first);
  }
  const double norm = std::sqrt(mesh_->pipeline().all_reduce_value(mesh_->tensor().all_reduce_value(squares)));
  const int non_finite = mesh_->world().all_reduce_value(std::isfinite(norm) ? 0 : 1);
  return non_finite == 0 ? norm : std::numeric_limits<double>::quiet_NaN();
}

template <class ExecutionSpace>
void DataParallel<ExecutionSpace>::average_replicas(const ExecutionSpace& exec, const Slab& slab) const {
  // Moments too, so that the replicas leave as one state: a checkpoint in the unsplit layout (one
  // model, one set of moments) then holds the whole run, and resumes it exactly at any mesh.
  const Communicator& data = mesh_->data();
  for (const Tensor1<float, memory_space>& x : {slab.params(), first_moment(), second_moment()}) {
    data.all_reduce(exec, x, ReduceOp::Average);
  }
}

template <class ExecutionSpace>
void DataParallel<ExecutionSpace>::step(const ExecutionSpace& exec, const Slab& slab, double lr, double grad_scale) {
  check_slab("step", slab);
  ++step_;
  optimizer_.update(exec, step_, slab.params(), ConstTensor1<float, memory_space>(slab.grads()), owned_runs(),
                    decay_end_, lr, grad_scale);
  if (config_.zero_stage == 1) {
    reducer_.all_gather(exec, slab.params());
  } else if (local_steps() && data_size() > 1 && step_ % config_.sync_frequency == 0) {
    average_replicas(exec, slab);
  }
}

template <class ExecutionSpace>
std::vector<SlabRun> DataParallel<ExecutionSpace>::owned_runs() const {
  if (config_.zero_stage == 0) return {SlabRun{0, 0, reducer_.layout().elements()}};
  std::vector<SlabRun> runs;
  for_each_shard([&](std::size_t begin, std::size_t moment_offset, std::size_t size) {
    runs.push_back({begin, moment_offset, size});
  });
  return runs;
}

template <class ExecutionSpace>
template <class Copy>
void DataParallel<ExecutionSpace>::for_each_shard(const Copy& copy) const {
  const BucketLayout& layout = reducer_.layout();
  const int rank = reducer_.communicator().rank();  // on the dp × sp group the shards are laid over
  for (const auto& bucket : layout.buckets()) {
    copy(layout.shard_begin(bucket, rank), bucket.shard_offset, layout.shard_size(bucket));
  }
  const std::size_t tail = layout.elements() - layout.tail_begin();
  if (tail > 0) copy(layout.tail_begin(), layout.shard_elements() - tail, tail);
}

template <class ExecutionSpace>
void DataParallel<ExecutionSpace>::check_full(const char* function, const char* name, std::size_t size) const {
  KMAMBA_REQUIRE(size == reducer_.layout().elements(), "kmamba::DataParallel::" << function << ": " << name << " has "
                                                                                << size << " elements, the slab "
                                                                                << reducer_.layout().elements());
}

template <class ExecutionSpace>
void DataParallel<ExecutionSpace>::gather_moments(const ExecutionSpace& exec, const Tensor1<float, memory_space>& m,
                                                  const Tensor1<float, memory_space>& v) const {
  check_full("gather_moments", "m", m.extent(0));
  check_full("gather_moments", "v", v.extent(0));
  for (const SlabRun& r : owned_runs()) {
    optimizer_.store_moments(exec, r.moment_offset, impl::slab_range(m, r.slab_begin, r.size),
                             impl::slab_range(v, r.slab_begin, r.size));
  }
  if (config_.zero_stage == 0) return;
  reducer_.all_gather(exec, m);
  reducer_.all_gather(exec, v);
}

template <class ExecutionSpace>
void DataParallel<ExecutionSpace>::load_moments(const ExecutionSpace& exec, const ConstTensor1<float, memory_space>& m,
                                                const ConstTensor1<float, memory_space>& v, std::int64_t steps) {
  check_full("load_moments", "m", m.extent(0));
  check_full("load_moments", "v", v.extent(0));
  for (const SlabRun& r : owned_runs()) {
    optimizer_.load_moments(exec, r.moment_offset, ConstTensor1<float, memory_space>(m.data() + r.slab_begin, r.size),
                            ConstTensor1<float, memory_space>(v.data() + r.slab_begin, r.size));
  }
  restart_at(exec, steps);
}

template <class ExecutionSpace>
void DataParallel<ExecutionSpace>::load_moments(const ExecutionSpace& exec, const AdamW<memory_space>& from,
                                                std::int64_t steps) {
  check_full("load_moments", "the AdamW's moments", from.size());
  for (const SlabRun& r : owned_runs()) optimizer_.load_moments(exec, r.moment_offset, from, r.slab_begin, r.size);
  restart_at(exec, steps);
}

template <class ExecutionSpace>
void DataParallel<ExecutionSpace>::restart_at(const ExecutionSpace& exec, std::int64_t steps) {
  KMAMBA_REQUIRE(steps >= 0, "kmamba::DataParallel::load_moments: steps must be >= 0, got " << steps);
  step_ = steps;
  if (powersgd_) powersgd_->reset(exec);
}

#define KMAMBA_INSTANTIATE(Exec) template class DataParallel<Exec>;
KMAMBA_FOR_EACH_BACKEND(KMAMBA_INSTANTIATE)
#undef KMAMBA_INSTANTIATE
#endif

}  // namespace kmamba
