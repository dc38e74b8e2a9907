// AdamW (decoupled weight decay), global-norm gradient clipping and the learning-rate schedule
// (linear warm-up, then cosine decay to a floor), over the contiguous slabs of a ParameterSlab.
//
// The AdamW moments live on the device (OptimizerPlacement::Device: the update is one kernel on
// the caller's execution space) or in host memory (OptimizerPlacement::Host, optimizer offload:
// pinned on CUDA). Offloaded, an update runs in groups of at most group_elements slab elements:
// group g's parameters and gradients are copied to host staging buffers on the caller's execution
// space, host threads (Kokkos::DefaultHostExecutionSpace) apply AdamW to them with the host
// moments, and the updated parameters are copied back. Two staging buffers alternate, so that the
// copy to the host of group g + 1 and the copy back of group g - 1 run while the host updates
// group g; the update returns once the host has updated every group, with the last copy back still
// queued on the execution space (its stream orders the next forward after it). The parameters
// stay on the device, where the model computes with them: offload moves the 8 bytes per parameter
// of the two moments off the device and costs 12 bytes per parameter of copies per step.
#ifndef KMAMBA_MODELS_OPTIMIZER_HPP
#define KMAMBA_MODELS_OPTIMIZER_HPP

#include <kmamba/backends/HostStaging.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/Math.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace kmamba {

struct AdamWConfig {
  double lr = 1e-3;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.1;

  /// Throws kmamba::UserError when a hyper-parameter is out of range.
  void validate() const {
    KMAMBA_REQUIRE(lr >= 0 && beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1 && eps > 0 && weight_decay >= 0,
                   "kmamba::AdamW: invalid hyper-parameters (lr " << lr << ", betas " << beta1 << ", " << beta2
                                                                  << ", eps " << eps << ", weight_decay "
                                                                  << weight_decay << ")");
  }
};

/// Learning rate at `step` (0-based): lr·(step+1)/warmup during warm-up, then cosine from lr down to
/// min_lr at total_steps, and min_lr after.
double learning_rate(std::int64_t step, double lr, double min_lr, std::int64_t warmup_steps, std::int64_t total_steps);

/// Where an AdamW keeps its moments and runs its update (file comment).
enum class OptimizerPlacement {
  Device,  ///< moments in the parameters' memory space, the update a kernel beside them
  Host,    ///< moments in host memory (HostStagingSpace), the update on host threads
};
/// "device" or "host".
const char* to_string(OptimizerPlacement placement);

/// Slab elements per group of an offloaded update: 16 MiB of fp32 values per staging buffer, large
/// enough that a copy runs at the link's rate, small enough that the copies of the neighbouring
/// groups hide behind the host's update of one.
inline constexpr std::size_t default_offload_group_elements = std::size_t(1) << 22;

/// One run of the parameter slab an AdamW update covers: slab elements [slab_begin, slab_begin +
/// size) with the moments [moment_offset, moment_offset + size) (a ZeRO-1 shard keeps its moments
/// packed).
struct SlabRun {
  std::size_t slab_begin = 0, moment_offset = 0, size = 0;
};

namespace impl {
/// `runs` cut into pieces of at most `group_elements` elements, in order.
std::vector<SlabRun> split_runs(const std::vector<SlabRun>& runs, std::size_t group_elements);

template <class MemorySpace>
Tensor1<float, MemorySpace> slab_range(const Tensor1<float, MemorySpace>& data, std::size_t begin, std::size_t size) {
  return Tensor1<float, MemorySpace>(data.data() + begin, size);
}

template <class MemorySpace>
struct AdamWUpdate {
  Tensor1<float, MemorySpace> params, m, v;
  ConstTensor1<float, MemorySpace> grads;
  std::size_t decay_end;
  float lr, beta1, beta2, eps, weight_decay, grad_scale, bias1, bias2;
  KOKKOS_INLINE_FUNCTION void operator()(const std::size_t i) const {
    const float g = grads(i) * grad_scale;
    float p = params(i);
    if (i < decay_end) p -= lr * weight_decay * p;
    const float mi = beta1 * m(i) + (1.0f - beta1) * g;
    const float vi = beta2 * v(i) + (1.0f - beta2) * g * g;
    m(i) = mi;
    v(i) = vi;
    params(i) = p - lr * (mi / bias1) / (kmamba::math::sqrt(vi / bias2) + eps);
  }
};
template <class MemorySpace>
struct SumOfSquares {
  ConstTensor1<float, MemorySpace> x;
  KOKKOS_INLINE_FUNCTION void operator()(const std::size_t i, double& acc) const {
    acc += static_cast<double>(x(i)) * static_cast<double>(x(i));
  }
};
}  // namespace impl

/// ‖grads‖₂ over the whole slab (blocking: returns a host value).
template <class ExecutionSpace, class MemorySpace>
double global_norm(const ExecutionSpace& exec, const ConstTensor1<float, MemorySpace>& grads) {
  double sum = 0.0;
  Kokkos::parallel_reduce("kmamba::optimizer::global_norm",
                          Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::size_t>>(exec, 0, grads.extent(0)),
                          impl::SumOfSquares<MemorySpace>{grads}, sum);
  return std::sqrt(sum);
}

/// The AdamW update of one range of parameters with its moments, as the `step`-th (1-based) step:
/// params ← AdamW(params, grad_scale · grads) with learning rate `lr` and weight decay on elements
/// [0, decay_end) only. AdamW::step and the ZeRO-1 optimizer (each rank on its shard) use it.
/// Non-blocking on `exec`.
template <class ExecutionSpace, class MemorySpace>
void adamw_update(const ExecutionSpace& exec, const AdamWConfig& config, std::int64_t step,
                  const Tensor1<float, MemorySpace>& params,      // (n)
                  const Tensor1<float, MemorySpace>& m,           // (n) first moment
                  const Tensor1<float, MemorySpace>& v,           // (n) second moment
                  const ConstTensor1<float, MemorySpace>& grads,  // (n)
                  std::size_t decay_end, double lr, double grad_scale) {
  KMAMBA_ASSERT(
      m.extent(0) == params.extent(0) && v.extent(0) == params.extent(0) && grads.extent(0) == params.extent(0),
      "adamw_update: params " << params.extent(0) << ", m " << m.extent(0) << ", v " << v.extent(0) << ", grads "
                              << grads.extent(0));
  const float bias1 = static_cast<float>(1.0 - std::pow(config.beta1, static_cast<double>(step)));
  const float bias2 = static_cast<float>(1.0 - std::pow(config.beta2, static_cast<double>(step)));
  Kokkos::parallel_for(
      "kmamba::optimizer::adamw",
      Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::size_t>>(exec, 0, params.extent(0)),
      impl::AdamWUpdate<MemorySpace>{params, m, v, grads, std::min(decay_end, params.extent(0)), static_cast<float>(lr),
                                     static_cast<float>(config.beta1), static_cast<float>(config.beta2),
                                     static_cast<float>(config.eps), static_cast<float>(config.weight_decay),
                                     static_cast<float>(grad_scale), bias1, bias2});
}

/// AdamW state: the two moment slabs, where they live, and the step count.
template <class MemorySpace>
class AdamW {
 public:
  using host_space = HostStagingSpace<MemorySpace>;

  /// Moments of `size` elements, zero, on the device or in host memory (`placement`); an offloaded
  /// update stages at most `group_elements` slab elements at a time.
  AdamW(std::size_t size, const AdamWConfig& config, OptimizerPlacement placement = OptimizerPlacement::Device,
        std::size_t group_elements = default_offload_group_elements)
      : config_(config), placement_(placement), size_(size) {
    config.validate();
    KMAMBA_REQUIRE(group_elements > 0, "kmamba::AdamW: group_elements must be positive");
    if (placement == OptimizerPlacement::Device) {
      m_ = Tensor1<float, MemorySpace>("kmamba::adamw::m", size);
      v_ = Tensor1<float, MemorySpace>("kmamba::adamw::v", size);
      return;
    }
    host_m_ = Tensor1<float, host_space>("kmamba::adamw::host_m", size);
    host_v_ = Tensor1<float, host_space>("kmamba::adamw::host_v", size);
    const std::size_t staged = std::max<std::size_t>(1, std::min(group_elements, size));
    for (int b = 0; b < 2; ++b) {
      staged_params_[b] = Tensor1<float, host_space>("kmamba::adamw::staged_params", staged);
      staged_grads_[b] = Tensor1<float, host_space>("kmamba::adamw::staged_grads", staged);
    }
  }

  /// One step: params ← AdamW(params, grad_scale · grads) with learning rate `lr`, weight decay on
  /// elements [0, decay_end) only. `grad_scale` folds clipping (and 1/accumulation) into the update.
  /// Device: non-blocking on `exec`; Host: as update().
  template <class ExecutionSpace>
  void step(const ExecutionSpace& exec, const Tensor1<float, MemorySpace>& params,
            const ConstTensor1<float, MemorySpace>& grads, std::size_t decay_end, double lr, double grad_scale = 1.0) {
    KMAMBA_REQUIRE(params.extent(0) == size_ && grads.extent(0) == size_,
                   "kmamba::AdamW::step: params (" << params.extent(0) << ") and grads (" << grads.extent(0)
                                                   << ") must have the optimizer's size " << size_);
    KMAMBA_REQUIRE(decay_end <= params.extent(0),
                   "kmamba::AdamW::step: decay_end " << decay_end << " exceeds the size");
    ++step_;
    update(exec, step_, params, grads, {SlabRun{0, 0, size_}}, decay_end, lr, grad_scale);
  }

  /// The `step`-th (1-based) AdamW update of the slab runs `runs` with their moments, weight decay
  /// on slab elements [0, decay_end); counts no step (steps_taken() is step()'s). Device:
  /// non-blocking on `exec`. Host: returns when the host has updated every run, the last copy back
  /// of parameters still queued on `exec` (file comment).
  template <class ExecutionSpace>
  void update(const ExecutionSpace& exec, std::int64_t step, const Tensor1<float, MemorySpace>& params,  // (slab)
              const ConstTensor1<float, MemorySpace>& grads,                                             // (slab)
              const std::vector<SlabRun>& runs, std::size_t decay_end, double lr, double grad_scale) {
    for (const SlabRun& r : runs) {
      KMAMBA_REQUIRE(r.slab_begin + r.size <= params.extent(0) && r.slab_begin + r.size <= grads.extent(0) &&
                         r.moment_offset + r.size <= size_,
                     "kmamba::AdamW::update: the run of " << r.size << " elements at slab element " << r.slab_begin
                                                          << " and moment " << r.moment_offset << " exceeds params ("
                                                          << params.extent(0) << "), grads (" << grads.extent(0)
                                                          << ") or the moments (" << size_ << ")");
    }
    if (placement_ == OptimizerPlacement::Host) {
      host_update(exec, step, params, grads, runs, decay_end, lr, grad_scale);
      return;
    }
    for (const SlabRun& r : runs) {
      adamw_update(exec, config_, step, impl::slab_range(params, r.slab_begin, r.size),
                   impl::slab_range(m_, r.moment_offset, r.size), impl::slab_range(v_, r.moment_offset, r.size),
                   ConstTensor1<float, MemorySpace>(grads.data() + r.slab_begin, r.size),
                   decay_end > r.slab_begin ? decay_end - r.slab_begin : 0, lr, grad_scale);
    }
  }

  /// moments[offset, offset + m.extent(0)) ← m, v: float views of equal extent in any memory
  /// space. Non-blocking on `exec`.
  template <class ExecutionSpace, class View>
  void load_moments(const ExecutionSpace& exec, std::size_t offset, const View& m, const View& v) {
    check_range("load_moments", offset, m.extent(0), v.extent(0));
    if (placement_ == OptimizerPlacement::Host) {
      Kokkos::deep_copy(exec, impl::slab_range(host_m_, offset, m.extent(0)), m);
      Kokkos::deep_copy(exec, impl::slab_range(host_v_, offset, v.extent(0)), v);
    } else {
      Kokkos::deep_copy(exec, impl::slab_range(m_, offset, m.extent(0)), m);
      Kokkos::deep_copy(exec, impl::slab_range(v_, offset, v.extent(0)), v);
    }
  }
  /// moments[offset, offset + size) ← the moments [from_offset, from_offset + size) of `from`
  /// (either placement). Non-blocking on `exec`.
  template <class ExecutionSpace>
  void load_moments(const ExecutionSpace& exec, std::size_t offset, const AdamW& from, std::size_t from_offset,
                    std::size_t size) {
    check_range("load_moments", offset, size, size);
    if (placement_ == OptimizerPlacement::Host) {
      from.store_moments(exec, from_offset, impl::slab_range(host_m_, offset, size),
                         impl::slab_range(host_v_, offset, size));
    } else {
      from.store_moments(exec, from_offset, impl::slab_range(m_, offset, size), impl::slab_range(v_, offset, size));
    }
  }
  /// m, v ← moments[offset, offset + m.extent(0)), into float views of equal extent in any memory
  /// space. Non-blocking on `exec`.
  template <class ExecutionSpace, class View>
  void store_moments(const ExecutionSpace& exec, std::size_t offset, const View& m, const View& v) const {
    check_range("store_moments", offset, m.extent(0), v.extent(0));
    if (placement_ == OptimizerPlacement::Host) {
      Kokkos::deep_copy(exec, m, impl::slab_range(host_m_, offset, m.extent(0)));
      Kokkos::deep_copy(exec, v, impl::slab_range(host_v_, offset, v.extent(0)));
    } else {
      Kokkos::deep_copy(exec, m, impl::slab_range(m_, offset, m.extent(0)));
      Kokkos::deep_copy(exec, v, impl::slab_range(v_, offset, v.extent(0)));
    }
  }

  OptimizerPlacement placement() const { return placement_; }
  /// Moment elements (each of m and v).
  std::size_t size() const { return size_; }
  /// Bytes this optimizer holds in MemorySpace (the moments on the device) and in host memory
  /// (offloaded: the moments and the two staging buffers of parameters and gradients).
  std::size_t device_bytes() const { return (m_.span() + v_.span()) * sizeof(float); }
  std::size_t host_bytes() const {
    std::size_t elements = host_m_.span() + host_v_.span();
    for (int b = 0; b < 2; ++b) elements += staged_params_[b].span() + staged_grads_[b].span();
    return elements * sizeof(float);
  }
  std::int64_t steps_taken() const { return step_; }
  void set_steps_taken(std::int64_t steps) { step_ = steps; }
  /// The device moments (OptimizerPlacement::Device only; store_moments copies either placement).
  const Tensor1<float, MemorySpace>& first_moment() const {
    require_device("first_moment");
    return m_;
  }
  const Tensor1<float, MemorySpace>& second_moment() const {
    require_device("second_moment");
    return v_;
  }
  const AdamWConfig& config() const { return config_; }

 private:
  void require_device(const char* function) const {
    KMAMBA_REQUIRE(
        placement_ == OptimizerPlacement::Device,
        "kmamba::AdamW::" << function << ": the moments are offloaded to host memory; copy them with store_moments");
  }
  void check_range(const char* function, std::size_t offset, std::size_t m, std::size_t v) const {
    KMAMBA_REQUIRE(m == v && offset + m <= size_,
                   "kmamba::AdamW::" << function << ": m (" << m << ") and v (" << v << ") at offset " << offset
                                     << " must be equal and fit the moments (" << size_ << ")");
  }

  // The offloaded update (file comment): staging buffer g % 2 carries group g.
  template <class ExecutionSpace>
  void host_update(const ExecutionSpace& exec, std::int64_t step, const Tensor1<float, MemorySpace>& params,
                   const ConstTensor1<float, MemorySpace>& grads, const std::vector<SlabRun>& runs,
                   std::size_t decay_end, double lr, double grad_scale) {
    const std::vector<SlabRun> groups = impl::split_runs(runs, staged_params_[0].extent(0));
    if (groups.empty()) return;
    const auto stage = [&](std::size_t g) {
      const SlabRun& r = groups[g];
      Kokkos::deep_copy(exec, impl::slab_range(staged_params_[g % 2], 0, r.size),
                        impl::slab_range(params, r.slab_begin, r.size));
      Kokkos::deep_copy(exec, impl::slab_range(staged_grads_[g % 2], 0, r.size),
                        ConstTensor1<float, MemorySpace>(grads.data() + r.slab_begin, r.size));
    };
    const Kokkos::DefaultHostExecutionSpace host;
    stage(0);
    exec.fence();
    for (std::size_t g = 0; g < groups.size(); ++g) {
      // Queued behind the copy back of group g - 1 from the same buffer, so it overwrites nothing
      // still in flight.
      if (g + 1 < groups.size()) stage(g + 1);
      const SlabRun& r = groups[g];
      const auto staged = impl::slab_range(staged_params_[g % 2], 0, r.size);
      adamw_update(host, config_, step, staged, impl::slab_range(host_m_, r.moment_offset, r.size),
                   impl::slab_range(host_v_, r.moment_offset, r.size),
                   ConstTensor1<float, host_space>(staged_grads_[g % 2].data(), r.size),
                   decay_end > r.slab_begin ? decay_end - r.slab_begin : 0, lr, grad_scale);
      host.fence();
      exec.fence();  // group g + 1 staged, before the host updates it
      Kokkos::deep_copy(exec, impl::slab_range(params, r.slab_begin, r.size), staged);
    }
  }

  AdamWConfig config_;
  OptimizerPlacement placement_;
  std::size_t size_;
  Tensor1<float, MemorySpace> m_, v_;                              // Device placement
  Tensor1<float, host_space> host_m_, host_v_;                     // Host placement
  Tensor1<float, host_space> staged_params_[2], staged_grads_[2];  // Host placement: the update's groups
  std::int64_t step_ = 0;
};

/// Scale that clips a gradient of norm `norm` to at most `max_norm` (1 when already within,
/// or when max_norm <= 0 disables clipping).
inline double clip_scale(double norm, double max_norm) {
  if (max_norm <= 0.0 || !(norm > max_norm)) return 1.0;
  return max_norm / (norm + 1e-6);
}

}  // namespace kmamba

#endif
