// RMSNorm over the last axis: the plain norm of the language model's blocks
// (docs/algorithms.md §0, §4.2; add_rms_norm fuses the residual add before it, for inference) and
// the gated, group-wise norm of the Mamba-2/3 mixers (`RMSNormGated`,
// docs/algorithms.md §2.3, §3.1), forward and backward.
//
//   plain                          rstd = 1/sqrt(mean(x²) + eps)        y = x·rstd ⊙ w
//   gated, norm_before_gate=false  v = x ⊙ silu(z); rstd = 1/sqrt(mean(v²) + eps); y = v·rstd ⊙ w
//   gated, norm_before_gate=true   rstd = 1/sqrt(mean(x²) + eps)        y = (x·rstd ⊙ w) ⊙ silu(z)
//
// The gated norm takes the mean over each group of group_size consecutive channels separately
// (one rstd per row and group); group_size = dim is the ordinary norm over the whole row.
// Rows are batch·seqlen flattened: pass rank-2 views (rows, dim). x, z, weight, y, dy, dx and dz
// may store float, double or bf16; everything is computed in fp32, and rstd and dweight are fp32.
// Every op is non-blocking on `exec`: no fences. The forward allocates nothing; the backward
// allocates a (row blocks, dim) workspace of partial dweight rows, which a second kernel sums in
// block order (no atomics, so dweight repeats bit for bit from run to run), and releases it on
// return, which waits for the device only where freeing memory does (cudaFree).
//
//   kmamba::gated_rms_norm(exec, y_ssd, z, norm_weight, 1e-5f, d_ssm / ngroups,
//                          /*norm_before_gate=*/false, out, rstd);   // Mamba-2 output norm
#ifndef KMAMBA_CORE_RMSNORM_HPP
#define KMAMBA_CORE_RMSNORM_HPP

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Profiling.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/RmsNormImpl.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <type_traits>

namespace kmamba {

/// Plain RMSNorm: y(r, c) = x(r, c) · rstd(r) · weight(c), rstd(r) = 1/sqrt(mean_c x(r, c)² + eps).
/// Also writes rstd for rms_norm_backward.
template <class ExecutionSpace, class XView, class WView, class YView, class RstdView>
void rms_norm(const ExecutionSpace& exec,
              const XView& x,       // (rows, dim)
              const WView& weight,  // (dim,)
              float eps,
              const YView& y,        // (rows, dim)
              const RstdView& rstd)  // (rows,)
{
  const ProfilingRegion region("kmamba::rms_norm");
  static_assert(XView::rank == 2 && WView::rank == 1 && YView::rank == 2 && RstdView::rank == 1,
                "kmamba::rms_norm: x and y are (rows, dim), weight is (dim,), rstd is (rows,)");
  static_assert(std::is_same<typename RstdView::value_type, float>::value, "kmamba::rms_norm: rstd is fp32");
  static_assert(impl::rms_norm_accessible<ExecutionSpace, XView, WView, YView, RstdView>,
                "kmamba::rms_norm: the execution space cannot access every view");
  constexpr const char* fn = "kmamba::rms_norm";
  const std::int64_t rows = static_cast<std::int64_t>(x.extent(0));
  const std::int64_t dim = static_cast<std::int64_t>(x.extent(1));
  impl::rms_norm_groups(fn, rows, dim, dim, eps);
  check_shape(fn, "weight", weight, Shape({dim}), "(dim)");
  check_shape(fn, "y", y, Shape({rows, dim}), "(rows, dim)");
  check_shape(fn, "rstd", rstd, Shape({rows}), "(rows)");
  check_allocated(fn, "x", x);
  check_allocated(fn, "weight", weight);
  check_allocated(fn, "y", y);
  check_allocated(fn, "rstd", rstd);
  impl::rms_norm_forward(exec, x, XView(), weight, eps, static_cast<int>(dim), impl::RmsNormGate::none, y, rstd, true);
}

/// Plain RMSNorm without saving rstd (inference).
template <class ExecutionSpace, class XView, class WView, class YView>
void rms_norm(const ExecutionSpace& exec,
              const XView& x,       // (rows, dim)
              const WView& weight,  // (dim,)
              float eps,
              const YView& y)  // (rows, dim)
{
  const ProfilingRegion region("kmamba::rms_norm");
  static_assert(XView::rank == 2 && WView::rank == 1 && YView::rank == 2,
                "kmamba::rms_norm: x and y are (rows, dim), weight is (dim,)");
  static_assert(impl::rms_norm_accessible<ExecutionSpace, XView, WView, YView>,
                "kmamba::rms_norm: the execution space cannot access every view");
  constexpr const char* fn = "kmamba::rms_norm";
  const std::int64_t rows = static_cast<std::int64_t>(x.extent(0));
  const std::int64_t dim = static_cast<std::int64_t>(x.extent(1));
  impl::rms_norm_groups(fn, rows, dim, dim, eps);
  check_shape(fn, "weight", weight, Shape({dim}), "(dim)");
  check_shape(fn, "y", y, Shape({rows, dim}), "(rows, dim)");
  check_allocated(fn, "x", x);
  check_allocated(fn, "weight", weight);
  check_allocated(fn, "y", y);
  impl::rms_norm_forward(exec, x, XView(), weight, eps, static_cast<int>(dim), impl::RmsNormGate::none, y,
                         Tensor1<float, typename ExecutionSpace::memory_space>(), false);
}

/// Residual add and plain RMSNorm in one kernel (inference; the reference's fused add + norm of a
/// block, `rms_norm_fn(x, w, residual=residual, prenorm=True)`):
///   residual(r, c) += delta(r, c),   y(r, c) = residual(r, c) · rstd(r) · weight(c),
///   rstd(r) = 1/sqrt(mean_c residual(r, c)² + eps) of the updated residual.
/// Equals adding delta into residual and then rms_norm(residual, weight, eps, y). residual is
/// updated in place; y must not alias residual or delta.
template <class ExecutionSpace, class ResidualView, class DeltaView, class WView, class YView>
void add_rms_norm(const ExecutionSpace& exec,
                  const ResidualView& residual,  // (rows, dim), updated in place
                  const DeltaView& delta,        // (rows, dim)
                  const WView& weight,           // (dim,)
                  float eps,
                  const YView& y)  // (rows, dim)
{
  const ProfilingRegion region("kmamba::add_rms_norm");
  static_assert(ResidualView::rank == 2 && DeltaView::rank == 2 && WView::rank == 1 && YView::rank == 2,
                "kmamba::add_rms_norm: residual, delta and y are (rows, dim), weight is (dim,)");
  static_assert(impl::rms_norm_accessible<ExecutionSpace, ResidualView, DeltaView, WView, YView>,
                "kmamba::add_rms_norm: the execution space cannot access every view");
  constexpr const char* fn = "kmamba::add_rms_norm";
  const std::int64_t rows = static_cast<std::int64_t>(residual.extent(0));
  const std::int64_t dim = static_cast<std::int64_t>(residual.extent(1));
  impl::rms_norm_groups(fn, rows, dim, dim, eps);
  check_shape(fn, "delta", delta, Shape({rows, dim}), "(rows, dim) of residual");
  check_shape(fn, "weight", weight, Shape({dim}), "(dim)");
  check_shape(fn, "y", y, Shape({rows, dim}), "(rows, dim) of residual");
  check_allocated(fn, "residual", residual);
  check_allocated(fn, "delta", delta);
  check_allocated(fn, "weight", weight);
  check_allocated(fn, "y", y);
  if (rows == 0) return;
  using Functor = impl::RmsNormAddForwardFunctor<ExecutionSpace, ResidualView, DeltaView, WView, YView>;
  impl::rms_norm_launch_forward(exec, "kmamba::rms_norm::add_forward", static_cast<int>(rows), static_cast<int>(dim),
                                Functor{residual, delta, weight, y, eps, static_cast<int>(dim)});
}

template <class ResidualView, class DeltaView, class WView, class YView>
void add_rms_norm(const ResidualView& residual, const DeltaView& delta, const WView& weight, float eps,
                  const YView& y) {
  add_rms_norm(typename ResidualView::execution_space(), residual, delta, weight, eps, y);
}

template <class XView, class WView, class YView, class RstdView>
void rms_norm(const XView& x, const WView& weight, float eps, const YView& y, const RstdView& rstd) {
  rms_norm(typename XView::execution_space(), x, weight, eps, y, rstd);
}

template <class XView, class WView, class YView>
void rms_norm(const XView& x, const WView& weight, float eps, const YView& y) {
  rms_norm(typename XView::execution_space(), x, weight, eps, y);
}

/// Backward of the plain RMSNorm with the rstd saved by rms_norm. With x̂ = x·rstd and g = dy:
///   dx = (w ⊙ g − x̂ · mean(x̂ ⊙ w ⊙ g)) · rstd,   dweight = Σ_rows g ⊙ x̂.
/// dweight is overwritten (not accumulated into).
template <class ExecutionSpace, class DyView, class XView, class WView, class RstdView, class DxView, class DweightView,
          impl::rms_norm_if_view<RstdView> = 0>
void rms_norm_backward(const ExecutionSpace& exec,
                       const DyView& dy,            // (rows, dim)
                       const XView& x,              // (rows, dim)
                       const WView& weight,         // (dim,)
                       const RstdView& rstd,        // (rows,)
                       const DxView& dx,            // (rows, dim)
                       const DweightView& dweight)  // (dim,)
{
  const ProfilingRegion region("kmamba::rms_norm_backward");
  static_assert(DyView::rank == 2 && XView::rank == 2 && WView::rank == 1 && RstdView::rank == 1 && DxView::rank == 2 &&
                    DweightView::rank == 1,
                "kmamba::rms_norm_backward: dy, x, dx are (rows, dim), weight and dweight (dim,), rstd (rows,)");
  static_assert(std::is_same<typename RstdView::non_const_value_type, float>::value &&
                    std::is_same<typename DweightView::value_type, float>::value,
                "kmamba::rms_norm_backward: rstd and dweight are fp32");
  static_assert(impl::rms_norm_accessible<ExecutionSpace, DyView, XView, WView, RstdView, DxView, DweightView>,
                "kmamba::rms_norm_backward: the execution space cannot access every view");
  constexpr const char* fn = "kmamba::rms_norm_backward";
  const std::int64_t rows = static_cast<std::int64_t>(x.extent(0));
  const std::int64_t dim = static_cast<std::int64_t>(x.extent(1));
  impl::rms_norm_groups(fn, rows, dim, dim, 0.0f);
  check_shape(fn, "dy", dy, Shape({rows, dim}), "(rows, dim)");
  check_shape(fn, "weight", weight, Shape({dim}), "(dim)");
  check_shape(fn, "rstd", rstd, Shape({rows}), "(rows)");
  check_shape(fn, "dx", dx, Shape({rows, dim}), "(rows, dim)");
  check_shape(fn, "dweight", dweight, Shape({dim}), "(dim)");
  check_allocated(fn, "dy", dy);
  check_allocated(fn, "x", x);
  check_allocated(fn, "weight", weight);
  check_allocated(fn, "rstd", rstd);
  check_allocated(fn, "dx", dx);
  check_allocated(fn, "dweight", dweight);
  impl::rms_norm_backward(fn, exec, dy, x, XView(), weight, rstd, true, 0.0f, static_cast<int>(dim),
                          impl::RmsNormGate::none, dx, DxView(), dweight);
}

/// Backward of the plain RMSNorm recomputing rstd from x and eps (same results as with it saved).
template <class ExecutionSpace, class DyView, class XView, class WView, class DxView, class DweightView>
void rms_norm_backward(const ExecutionSpace& exec,
                       const DyView& dy,     // (rows, dim)
                       const XView& x,       // (rows, dim)
                       const WView& weight,  // (dim,)
                       float eps,
                       const DxView& dx,            // (rows, dim)
                       const DweightView& dweight)  // (dim,)
{
  const ProfilingRegion region("kmamba::rms_norm_backward");
  static_assert(
      DyView::rank == 2 && XView::rank == 2 && WView::rank == 1 && DxView::rank == 2 && DweightView::rank == 1,
      "kmamba::rms_norm_backward: dy, x, dx are (rows, dim), weight and dweight (dim,)");
  static_assert(std::is_same<typename DweightView::value_type, float>::value,
                "kmamba::rms_norm_backward: dweight is fp32");
  static_assert(impl::rms_norm_accessible<ExecutionSpace, DyView, XView, WView, DxView, DweightView>,
                "kmamba::rms_norm_backward: the execution space cannot access every view");
  constexpr const char* fn = "kmamba::rms_norm_backward";
  const std::int64_t rows = static_cast<std::int64_t>(x.extent(0));
  const std::int64_t dim = static_cast<std::int64_t>(x.extent(1));
  impl::rms_norm_groups(fn, rows, dim, dim, eps);
  check_shape(fn, "dy", dy, Shape({rows, dim}), "(rows, dim)");
  check_shape(fn, "weight", weight, Shape({dim}), "(dim)");
  check_shape(fn, "dx", dx, Shape({rows, dim}), "(rows, dim)");
  check_shape(fn, "dweight", dweight, Shape({dim}), "(dim)");
  check_allocated(fn, "dy", dy);
  check_allocated(fn, "x", x);
  check_allocated(fn, "weight", weight);
  check_allocated(fn, "dx", dx);
  check_allocated(fn, "dweight", dweight);
  impl::rms_norm_backward(fn, exec, dy, x, XView(), weight,
                          Tensor1<const float, typename ExecutionSpace::memory_space>(), false, eps,
                          static_cast<int>(dim), impl::RmsNormGate::none, dx, DxView(), dweight);
}

template <class DyView, class XView, class WView, class RstdView, class DxView, class DweightView,
          impl::rms_norm_if_view<RstdView> = 0>
void rms_norm_backward(const DyView& dy, const XView& x, const WView& weight, const RstdView& rstd, const DxView& dx,
                       const DweightView& dweight) {
  rms_norm_backward(typename XView::execution_space(), dy, x, weight, rstd, dx, dweight);
}

template <class DyView, class XView, class WView, class DxView, class DweightView>
void rms_norm_backward(const DyView& dy, const XView& x, const WView& weight, float eps, const DxView& dx,
                       const DweightView& dweight) {
  rms_norm_backward(typename XView::execution_space(), dy, x, weight, eps, dx, dweight);
}

/// Gated RMSNorm (`RMSNormGated`), group-wise: for each row and each group of group_size
/// consecutive channels,
///   norm_before_gate = false:  v = x ⊙ silu(z),  rstd = 1/sqrt(mean(v²) + eps),  y = v·rstd ⊙ w
///   norm_before_gate = true:   rstd = 1/sqrt(mean(x²) + eps),  y = (x·rstd ⊙ w) ⊙ silu(z)
/// group_size must divide dim (group_size = dim normalises the whole row). Also writes rstd, one
/// per row and group, for gated_rms_norm_backward.
template <class ExecutionSpace, class XView, class ZView, class WView, class YView, class RstdView>
void gated_rms_norm(const ExecutionSpace& exec,
                    const XView& x,       // (rows, dim)
                    const ZView& z,       // (rows, dim)
                    const WView& weight,  // (dim,)
                    float eps, int group_size, bool norm_before_gate,
                    const YView& y,        // (rows, dim)
                    const RstdView& rstd)  // (rows, dim / group_size)
{
  const ProfilingRegion region("kmamba::gated_rms_norm");
  static_assert(XView::rank == 2 && ZView::rank == 2 && WView::rank == 1 && YView::rank == 2 && RstdView::rank == 2,
                "kmamba::gated_rms_norm: x, z, y are (rows, dim), weight (dim,), rstd (rows, groups)");
  static_assert(std::is_same<typename RstdView::value_type, float>::value, "kmamba::gated_rms_norm: rstd is fp32");
  static_assert(impl::rms_norm_accessible<ExecutionSpace, XView, ZView, WView, YView, RstdView>,
                "kmamba::gated_rms_norm: the execution space cannot access every view");
  constexpr const char* fn = "kmamba::gated_rms_norm";
  const std::int64_t rows = static_cast<std::int64_t>(x.extent(0));
  const std::int64_t dim = static_cast<std::int64_t>(x.extent(1));
  const int ngroups = impl::rms_norm_groups(fn, rows, dim, group_size, eps);
  check_shape(fn, "z", z, Shape({rows, dim}), "(rows, dim)");
  check_shape(fn, "weight", weight, Shape({dim}), "(dim)");
  check_shape(fn, "y", y, Shape({rows, dim}), "(rows, dim)");
  check_shape(fn, "rstd", rstd, Shape({rows, ngroups}), "(rows, dim / group_size)");
  check_allocated(fn, "x", x);
  check_allocated(fn, "z", z);
  check_allocated(fn, "weight", weight);
  check_allocated(fn, "y", y);
  check_allocated(fn, "rstd", rstd);
  impl::rms_norm_forward(exec, x, z, weight, eps, group_size,
                         norm_before_gate ? impl::RmsNormGate::post_norm : impl::RmsNormGate::pre_norm, y, rstd, true);
}

/// Gated RMSNorm without saving rstd (inference).
template <class ExecutionSpace, class XView, class ZView, class WView, class YView>
void gated_rms_norm(const ExecutionSpace& exec,
                    const XView& x,       // (rows, dim)
                    const ZView& z,       // (rows, dim)
                    const WView& weight,  // (dim,)
                    float eps, int group_size, bool norm_before_gate,
                    const YView& y)  // (rows, dim)
{
  const ProfilingRegion region("kmamba::gated_rms_norm");
  static_assert(XView::rank == 2 && ZView::rank == 2 && WView::rank == 1 && YView::rank == 2,
                "kmamba::gated_rms_norm: x, z, y are (rows, dim), weight (dim,)");
  static_assert(impl::rms_norm_accessible<ExecutionSpace, XView, ZView, WView, YView>,
                "kmamba::gated_rms_norm: the execution space cannot access every view");
  constexpr const char* fn = "kmamba::gated_rms_norm";
  const std::int64_t rows = static_cast<std::int64_t>(x.extent(0));
  const std::int64_t dim = static_cast<std::int64_t>(x.extent(1));
  impl::rms_norm_groups(fn, rows, dim, group_size, eps);
  check_shape(fn, "z", z, Shape({rows, dim}), "(rows, dim)");
  check_shape(fn, "weight", weight, Shape({dim}), "(dim)");
  check_shape(fn, "y", y, Shape({rows, dim}), "(rows, dim)");
  check_allocated(fn, "x", x);
  check_allocated(fn, "z", z);
  check_allocated(fn, "weight", weight);
  check_allocated(fn, "y", y);
  impl::rms_norm_forward(exec, x, z, weight, eps, group_size,
                         norm_before_gate ? impl::RmsNormGate::post_norm : impl::RmsNormGate::pre_norm, y,
                         Tensor2<float, typename ExecutionSpace::memory_space>(), false);
}

template <class XView, class ZView, class WView, class YView, class RstdView>
void gated_rms_norm(const XView& x, const ZView& z, const WView& weight, float eps, int group_size,
                    bool norm_before_gate, const YView& y, const RstdView& rstd) {
  gated_rms_norm(typename XView::execution_space(), x, z, weight, eps, group_size, norm_before_gate, y, rstd);
}

template <class XView, class ZView, class WView, class YView>
void gated_rms_norm(const XView& x, const ZView& z, const WView& weight, float eps, int group_size,
                    bool norm_before_gate, const YView& y) {
  gated_rms_norm(typename XView::execution_space(), x, z, weight, eps, group_size, norm_before_gate, y);
}

/// Backward of the gated RMSNorm with the rstd saved by gated_rms_norm (docs/algorithms.md §2.3).
/// Per row and group, with x̂ = v·rstd (v = x ⊙ silu(z) for norm_before_gate = false, v = x for
/// true) and go = dy (false) or dy ⊙ silu(z) (true):
///   dv = (w ⊙ go − x̂ · mean(x̂ ⊙ w ⊙ go)) · rstd,   dweight = Σ_rows go ⊙ x̂
///   norm_before_gate = false:  dx = dv ⊙ silu(z),  dz = dv ⊙ x ⊙ silu′(z)
///   norm_before_gate = true:   dx = dv,            dz = dy ⊙ x̂ ⊙ w ⊙ silu′(z)
/// dweight is overwritten (not accumulated into).
template <class ExecutionSpace, class DyView, class XView, class ZView, class WView, class RstdView, class DxView,
          class DzView, class DweightView, impl::rms_norm_if_view<RstdView> = 0>
void gated_rms_norm_backward(const ExecutionSpace& exec,
                             const DyView& dy,      // (rows, dim)
                             const XView& x,        // (rows, dim)
                             const ZView& z,        // (rows, dim)
                             const WView& weight,   // (dim,)
                             const RstdView& rstd,  // (rows, dim / group_size)
                             int group_size, bool norm_before_gate,
                             const DxView& dx,            // (rows, dim)
                             const DzView& dz,            // (rows, dim)
                             const DweightView& dweight)  // (dim,)
{
  const ProfilingRegion region("kmamba::gated_rms_norm_backward");
  static_assert(DyView::rank == 2 && XView::rank == 2 && ZView::rank == 2 && WView::rank == 1 && RstdView::rank == 2 &&
                    DxView::rank == 2 && DzView::rank == 2 && DweightView::rank == 1,
                "kmamba::gated_rms_norm_backward: dy, x, z, dx, dz are (rows, dim), weight and dweight "
                "(dim,), rstd (rows, groups)");
  static_assert(std::is_same<typename RstdView::non_const_value_type, float>::value &&
                    std::is_same<typename DweightView::value_type, float>::value,
                "kmamba::gated_rms_norm_backward: rstd and dweight are fp32");
  static_assert(
      impl::rms_norm_accessible<ExecutionSpace, DyView, XView, ZView, WView, RstdView, DxView, DzView, DweightView>,
      "kmamba::gated_rms_norm_backward: the execution space cannot access every view");
  constexpr const char* fn = "kmamba::gated_rms_norm_backward";
  const std::int64_t rows = static_cast<std::int64_t>(x.extent(0));
  const std::int64_t dim = static_cast<std::int64_t>(x.extent(1));
  const int ngroups = impl::rms_norm_groups(fn, rows, dim, group_size, 0.0f);
  check_shape(fn, "dy", dy, Shape({rows, dim}), "(rows, dim)");
  check_shape(fn, "z", z, Shape({rows, dim}), "(rows, dim)");
  check_shape(fn, "weight", weight, Shape({dim}), "(dim)");
  check_shape(fn, "rstd", rstd, Shape({rows, ngroups}), "(rows, dim / group_size)");
  check_shape(fn, "dx", dx, Shape({rows, dim}), "(rows, dim)");
  check_shape(fn, "dz", dz, Shape({rows, dim}), "(rows, dim)");
  check_shape(fn, "dweight", dweight, Shape({dim}), "(dim)");
  check_allocated(fn, "dy", dy);
  check_allocated(fn, "x", x);
  check_allocated(fn, "z", z);
  check_allocated(fn, "weight", weight);
  check_allocated(fn, "rstd", rstd);
  check_allocated(fn, "dx", dx);
  check_allocated(fn, "dz", dz);
  check_allocated(fn, "dweight", dweight);
  impl::rms_norm_backward(fn, exec, dy, x, z, weight, rstd, true, 0.0f, group_size,
                          norm_before_gate ? impl::RmsNormGate::post_norm : impl::RmsNormGate::pre_norm, dx, dz,
                          dweight);
}

/// Backward of the gated RMSNorm recomputing rstd from x, z and eps.
template <class ExecutionSpace, class DyView, class XView, class ZView, class WView, class DxView, class DzView,
          class DweightView>
void gated_rms_norm_backward(const ExecutionSpace& exec,
                             const DyView& dy,     // (rows, dim)
                             const XView& x,       // (rows, dim)
                             const ZView& z,       // (rows, dim)
                             const WView& weight,  // (dim,)
                             float eps, int group_size, bool norm_before_gate,
                             const DxView& dx,            // (rows, dim)
                             const DzView& dz,            // (rows, dim)
                             const DweightView& dweight)  // (dim,)
{
  const ProfilingRegion region("kmamba::gated_rms_norm_backward");
  static_assert(DyView::rank == 2 && XView::rank == 2 && ZView::rank == 2 && WView::rank == 1 && DxView::rank == 2 &&
                    DzView::rank == 2 && DweightView::rank == 1,
                "kmamba::gated_rms_norm_backward: dy, x, z, dx, dz are (rows, dim), weight and dweight (dim,)");
  static_assert(std::is_same<typename DweightView::value_type, float>::value,
                "kmamba::gated_rms_norm_backward: dweight is fp32");
  static_assert(impl::rms_norm_accessible<ExecutionSpace, DyView, XView, ZView, WView, DxView, DzView, DweightView>,
                "kmamba::gated_rms_norm_backward: the execution space cannot access every view");
  constexpr const char* fn = "kmamba::gated_rms_norm_backward";
  const std::int64_t rows = static_cast<std::int64_t>(x.extent(0));
  const std::int64_t dim = static_cast<std::int64_t>(x.extent(1));
  impl::rms_norm_groups(fn, rows, dim, group_size, eps);
  check_shape(fn, "dy", dy, Shape({rows, dim}), "(rows, dim)");
  check_shape(fn, "z", z, Shape({rows, dim}), "(rows, dim)");
  check_shape(fn, "weight", weight, Shape({dim}), "(dim)");
  check_shape(fn, "dx", dx, Shape({rows, dim}), "(rows, dim)");
  check_shape(fn, "dz", dz, Shape({rows, dim}), "(rows, dim)");
  check_shape(fn, "dweight", dweight, Shape({dim}), "(dim)");
  check_allocated(fn, "dy", dy);
  check_allocated(fn, "x", x);
  check_allocated(fn, "z", z);
  check_allocated(fn, "weight", weight);
  check_allocated(fn, "dx", dx);
  check_allocated(fn, "dz", dz);
  check_allocated(fn, "dweight", dweight);
  impl::rms_norm_backward(
      fn, exec, dy, x, z, weight, Tensor2<const float, typename ExecutionSpace::memory_space>(), false, eps, group_size,
      norm_before_gate ? impl::RmsNormGate::post_norm : impl::RmsNormGate::pre_norm, dx, dz, dweight);
}

template <class DyView, class XView, class ZView, class WView, class RstdView, class DxView, class DzView,
          class DweightView, impl::rms_norm_if_view<RstdView> = 0>
void gated_rms_norm_backward(const DyView& dy, const XView& x, const ZView& z, const WView& weight,
                             const RstdView& rstd, int group_size, bool norm_before_gate, const DxView& dx,
                             const DzView& dz, const DweightView& dweight) {
  gated_rms_norm_backward(typename XView::execution_space(), dy, x, z, weight, rstd, group_size, norm_before_gate, dx,
                          dz, dweight);
}

template <class DyView, class XView, class ZView, class WView, class DxView, class DzView, class DweightView>
void gated_rms_norm_backward(const DyView& dy, const XView& x, const ZView& z, const WView& weight, float eps,
                             int group_size, bool norm_before_gate, const DxView& dx, const DzView& dz,
                             const DweightView& dweight) {
  gated_rms_norm_backward(typename XView::execution_space(), dy, x, z, weight, eps, group_size, norm_before_gate, dx,
                          dz, dweight);
}

}  // namespace kmamba

#endif
