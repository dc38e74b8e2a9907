#include <kmamba/models/Distributed.hpp>

#include <kmamba/core/Error.hpp>

#include <cmath>

namespace kmamba {

void check_mesh_fits_model(const MeshConfig& mesh, const ModelConfig& model) {
  constexpr const char* function = "kmamba::check_mesh_fits_model";
  const int tp = mesh.tensor_parallel_size;
  KMAMBA_REQUIRE(tp >= 1, function << ": tensor_parallel_size must be >= 1, got " << tp);
  KMAMBA_REQUIRE(mesh.sequence_parallel_size >= 1,
                 function << ": sequence_parallel_size must be >= 1, got " << mesh.sequence_parallel_size);
  if (model.mixer == MixerKind::Mamba1) {
    KMAMBA_REQUIRE(model.d_inner() % tp == 0, function << ": tensor_parallel_size " << tp << " does not divide the "
                                                       << mixer_name(model.mixer) << " model's d_inner "
                                                       << model.d_inner() << " (expand × d_model)");
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
template <class MemorySpace>
Tensor1<float, MemorySpace> range(const Tensor1<float, MemorySpace>& data, std::size_t begin, std::size_t size) {
  return Tensor1<float, MemorySpace>(data.data() + begin, size);
}
}  // namespace

template <class ExecutionSpace>
DataParallel<ExecutionSpace>::DataParallel(const ProcessMesh& mesh, const ModelConfig& model, const Slab& slab,
                                           const AdamWConfig& adamw, const DataParallelConfig& config)
    : mesh_(&mesh),
      config_(config),
      adamw_(adamw),
      reducer_(mesh.data(), slab.size(), config.bucket_elements),
      decay_end_(slab.decay_end()) {
  check_mesh_fits_model(mesh.config(), model);
  KMAMBA_REQUIRE(config.zero_stage == 0 || config.zero_stage == 1,
                 "kmamba::DataParallel: zero_stage must be 0 (replicated optimizer state) or 1 (ZeRO-1), got "
                     << config.zero_stage);
  KMAMBA_REQUIRE(slab.size() > 0, "kmamba::DataParallel: the parameter slab is empty (not finalized?)");
  adamw.validate();
  const std::size_t moments = config.zero_stage == 1 ? reducer_.layout().shard_elements() : slab.size();
  m_ = Tensor1<float, memory_space>("kmamba::data_parallel::m", moments);
  v_ = Tensor1<float, memory_space>("kmamba::data_parallel::v", moments);
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
  return mesh_->data().all_reduce_value(local);
}

template <class ExecutionSpace>
double DataParallel<ExecutionSpace>::sum_over_data(double local) const {
  return mesh_->data().all_reduce_value(local);
}

template <class ExecutionSpace>
void DataParallel<ExecutionSpace>::check_slab(const char* function, const Slab& slab) const {
  KMAMBA_REQUIRE(slab.size() == reducer_.layout().elements() && slab.decay_end() == decay_end_,
                 "kmamba::DataParallel::" << function << ": the slab has " << slab.size()
                                          << " elements; this object was made for a slab of "
                                          << reducer_.layout().elements());
}

template <class ExecutionSpace>
void DataParallel<ExecutionSpace>::reduce_gradients(const ExecutionSpace& exec, const Slab& slab) const {
  check_slab("reduce_gradients", slab);
  if (config_.zero_stage == 1) {
    reducer_.reduce_scatter(exec, slab.grads());
  } else {
    reducer_.all_reduce(exec, slab.grads());
  }
}

template <class ExecutionSpace>
double DataParallel<ExecutionSpace>::grad_norm(const ExecutionSpace& exec, const Slab& slab) const {
  check_slab("grad_norm", slab);
  const MeshCoordinates& at = mesh_->coordinates();
  const double owned = at.tp == 0 && at.sp == 0
                           ? reducer_.owned_sum_of_squares(exec, ConstTensor1<float, memory_space>(slab.grads()))
                           : 0.0;
  return std::sqrt(mesh_->world().all_reduce_value(owned));
}

template <class ExecutionSpace>
void DataParallel<ExecutionSpace>::step(const ExecutionSpace& exec, const Slab& slab, double lr, double grad_scale) {
  check_slab("step", slab);
  ++step_;
  const Tensor1<float, memory_space>& params = slab.params();
  const Tensor1<float, memory_space>& grads = slab.grads();
  if (config_.zero_stage == 0) {
    adamw_update(exec, adamw_, step_, params, m_, v_, ConstTensor1<float, memory_space>(grads), decay_end_, lr,
                 grad_scale);
    return;
  }
  for_each_shard([&](std::size_t begin, std::size_t moment_offset, std::size_t size) {
    adamw_update(exec, adamw_, step_, range(params, begin, size), range(m_, moment_offset, size),
                 range(v_, moment_offset, size), ConstTensor1<float, memory_space>(range(grads, begin, size)),
                 decay_end_ > begin ? decay_end_ - begin : 0, lr, grad_scale);
  });
  reducer_.all_gather(exec, params);
}

template <class ExecutionSpace>
template <class Copy>
void DataParallel<ExecutionSpace>::for_each_shard(const Copy& copy) const {
  const BucketLayout& layout = reducer_.layout();
  const int rank = data_rank();
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
  if (config_.zero_stage == 0) {
    Kokkos::deep_copy(exec, m, m_);
    Kokkos::deep_copy(exec, v, v_);
    return;
  }
  for_each_shard([&](std::size_t begin, std::size_t moment_offset, std::size_t size) {
    Kokkos::deep_copy(exec, range(m, begin, size), range(m_, moment_offset, size));
    Kokkos::deep_copy(exec, range(v, begin, size), range(v_, moment_offset, size));
  });
  reducer_.all_gather(exec, m);
  reducer_.all_gather(exec, v);
}

template <class ExecutionSpace>
void DataParallel<ExecutionSpace>::load_moments(const ExecutionSpace& exec, const ConstTensor1<float, memory_space>& m,
                                                const ConstTensor1<float, memory_space>& v, std::int64_t steps) {
  check_full("load_moments", "m", m.extent(0));
  check_full("load_moments", "v", v.extent(0));
  KMAMBA_REQUIRE(steps >= 0, "kmamba::DataParallel::load_moments: steps must be >= 0, got " << steps);
  if (config_.zero_stage == 0) {
    Kokkos::deep_copy(exec, m_, m);
    Kokkos::deep_copy(exec, v_, v);
  } else {
    for_each_shard([&](std::size_t begin, std::size_t moment_offset, std::size_t size) {
      Kokkos::deep_copy(exec, range(m_, moment_offset, size),
                        ConstTensor1<float, memory_space>(m.data() + begin, size));
      Kokkos::deep_copy(exec, range(v_, moment_offset, size),
                        ConstTensor1<float, memory_space>(v.data() + begin, size));
    });
  }
  step_ = steps;
}

#if KMAMBA_HAS_SERIAL
template class DataParallel<Kokkos::Serial>;
#endif
#if KMAMBA_HAS_OPENMP
template class DataParallel<Kokkos::OpenMP>;
#endif
#if KMAMBA_ENABLE_CUDA
template class DataParallel<Kokkos::Cuda>;
#endif
#endif

}  // namespace kmamba
