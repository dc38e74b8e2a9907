// Scalar activation functions shared by every kernel, evaluated in fp32 (docs/algorithms.md §0), and an
// elementwise SiLU forward/backward over row-major tensors of rank 1 to 4.
//
//   sigmoid(v)             = 1 / (1 + e^-v)
//   silu(v)                = v * sigmoid(v)
//   silu_derivative(v)     = sigmoid(v) * (1 + v * (1 - sigmoid(v)))
//   softplus(v)            = v if v > 20, else log(1 + e^v)      (threshold 20, as F.softplus)
//   softplus_derivative(v) = 1 if v > 20, else sigmoid(v)
#ifndef KMAMBA_CORE_ACTIVATIONS_HPP
#define KMAMBA_CORE_ACTIVATIONS_HPP

#include <kmamba/core/Profiling.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Math.hpp>

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <type_traits>

namespace kmamba {

/// Values above this pass through softplus unchanged (and have derivative 1).
constexpr float softplus_threshold = 20.0f;

KOKKOS_INLINE_FUNCTION float sigmoid(float v) { return 1.0f / (1.0f + kmamba::math::exp(-v)); }

KOKKOS_INLINE_FUNCTION float silu(float v) { return v * sigmoid(v); }

/// d silu(v) / dv.
KOKKOS_INLINE_FUNCTION float silu_derivative(float v) {
  const float s = sigmoid(v);
  return s * (1.0f + v * (1.0f - s));
}

KOKKOS_INLINE_FUNCTION float softplus(float v) {
  return v > softplus_threshold ? v : kmamba::math::log1p(kmamba::math::exp(v));
}

/// d softplus(v) / dv, with the same threshold as softplus.
KOKKOS_INLINE_FUNCTION float softplus_derivative(float v) { return v > softplus_threshold ? 1.0f : sigmoid(v); }

namespace impl {

// The element of a rank-1..4 view at row-major flat index `flat`.
template <class ViewType>
KOKKOS_INLINE_FUNCTION typename ViewType::reference_type silu_element(const ViewType& view, std::size_t flat) {
  std::size_t idx[4] = {0, 0, 0, 0};
  for (int d = static_cast<int>(ViewType::rank) - 1; d >= 0; --d) {
    const std::size_t n = view.extent(static_cast<unsigned>(d));
    idx[d] = flat % n;
    flat /= n;
  }
  return view.access(idx[0], idx[1], idx[2], idx[3]);
}

template <class XView, class YView>
struct SiluForwardFunctor {
  XView x;
  YView y;
  KOKKOS_INLINE_FUNCTION void operator()(const std::size_t i) const { silu_element(y, i) = silu(silu_element(x, i)); }
};

template <class XView, class DyView, class DxView>
struct SiluBackwardFunctor {
  XView x;
  DyView dy;
  DxView dx;
  KOKKOS_INLINE_FUNCTION void operator()(const std::size_t i) const {
    silu_element(dx, i) = silu_element(dy, i) * silu_derivative(silu_element(x, i));
  }
};

template <class ExecutionSpace, class ViewType>
constexpr void check_silu_view() {
  static_assert(Kokkos::is_view<ViewType>::value, "kmamba: SiLU ops take Kokkos::Views");
  static_assert(ViewType::rank >= 1 && ViewType::rank <= 4, "kmamba: SiLU ops take tensors of rank 1 to 4");
  static_assert(std::is_same<typename ViewType::non_const_value_type, float>::value,
                "kmamba: SiLU ops take float tensors");
  static_assert(std::is_same<typename ViewType::array_layout, Kokkos::LayoutRight>::value,
                "kmamba: SiLU ops take row-major (LayoutRight) tensors");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, typename ViewType::memory_space>::accessible,
                "kmamba: the execution space cannot access the tensor's memory space");
}

}  // namespace impl

/// y = silu(x) elementwise. y may be x itself. Non-blocking on `exec`.
template <class ExecutionSpace, class XView, class YView>
void silu_forward(const ExecutionSpace& exec,
                  const XView& x,  // any shape of rank 1..4
                  const YView& y   // same shape as x
) {
  const ProfilingRegion region("kmamba::silu_forward");
  impl::check_silu_view<ExecutionSpace, XView>();
  impl::check_silu_view<ExecutionSpace, YView>();
  check_same_shape("kmamba::silu_forward", "y", y, "x", x);
  check_allocated("kmamba::silu_forward", "x", x);
  check_allocated("kmamba::silu_forward", "y", y);
  if (x.size() == 0) return;
  Kokkos::parallel_for("kmamba::activations::silu_forward",
                       Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::size_t>>(exec, 0, x.size()),
                       impl::SiluForwardFunctor<XView, YView>{x, y});
}

template <class XView, class YView>
void silu_forward(const XView& x, const YView& y) {
  silu_forward(typename YView::execution_space(), x, y);
}

/// dx = dy * silu_derivative(x) elementwise. dx may be dy itself. Non-blocking on `exec`.
template <class ExecutionSpace, class XView, class DyView, class DxView>
void silu_backward(const ExecutionSpace& exec,
                   const XView& x,    // any shape of rank 1..4
                   const DyView& dy,  // same shape as x
                   const DxView& dx   // same shape as x
) {
  const ProfilingRegion region("kmamba::silu_backward");
  impl::check_silu_view<ExecutionSpace, XView>();
  impl::check_silu_view<ExecutionSpace, DyView>();
  impl::check_silu_view<ExecutionSpace, DxView>();
  check_same_shape("kmamba::silu_backward", "dy", dy, "x", x);
  check_same_shape("kmamba::silu_backward", "dx", dx, "x", x);
  check_allocated("kmamba::silu_backward", "x", x);
  check_allocated("kmamba::silu_backward", "dy", dy);
  check_allocated("kmamba::silu_backward", "dx", dx);
  if (x.size() == 0) return;
  Kokkos::parallel_for("kmamba::activations::silu_backward",
                       Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::size_t>>(exec, 0, x.size()),
                       impl::SiluBackwardFunctor<XView, DyView, DxView>{x, dy, dx});
}

template <class XView, class DyView, class DxView>
void silu_backward(const XView& x, const DyView& dy, const DxView& dx) {
  silu_backward(typename DxView::execution_space(), x, dy, dx);
}

}  // namespace kmamba

#endif
