// AdamW (decoupled weight decay), global-norm gradient clipping and the learning-rate schedule
// (linear warm-up, then cosine decay to a floor), over the contiguous slabs of a ParameterSlab.
#ifndef KMAMBA_MODELS_OPTIMIZER_HPP
#define KMAMBA_MODELS_OPTIMIZER_HPP

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/Math.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>

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

namespace impl {
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

/// AdamW state: the two moment slabs and the step count.
template <class MemorySpace>
class AdamW {
 public:
  AdamW(std::size_t size, const AdamWConfig& config)
      : config_(config), m_("kmamba::adamw::m", size), v_("kmamba::adamw::v", size) {
    config.validate();
  }

  /// One step: params ← AdamW(params, grad_scale · grads) with learning rate `lr`, weight decay on
  /// elements [0, decay_end) only. `grad_scale` folds clipping (and 1/accumulation) into the update.
  /// Non-blocking on `exec`.
  template <class ExecutionSpace>
  void step(const ExecutionSpace& exec, const Tensor1<float, MemorySpace>& params,
            const ConstTensor1<float, MemorySpace>& grads, std::size_t decay_end, double lr, double grad_scale = 1.0) {
    KMAMBA_REQUIRE(params.extent(0) == m_.extent(0) && grads.extent(0) == m_.extent(0),
                   "kmamba::AdamW::step: params (" << params.extent(0) << ") and grads (" << grads.extent(0)
                                                   << ") must have the optimizer's size " << m_.extent(0));
    KMAMBA_REQUIRE(decay_end <= params.extent(0),
                   "kmamba::AdamW::step: decay_end " << decay_end << " exceeds the size");
    ++step_;
    adamw_update(exec, config_, step_, params, m_, v_, grads, decay_end, lr, grad_scale);
  }

  std::int64_t steps_taken() const { return step_; }
  void set_steps_taken(std::int64_t steps) { step_ = steps; }
  const Tensor1<float, MemorySpace>& first_moment() const { return m_; }
  const Tensor1<float, MemorySpace>& second_moment() const { return v_; }
  const AdamWConfig& config() const { return config_; }

 private:
  AdamWConfig config_;
  Tensor1<float, MemorySpace> m_, v_;
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
