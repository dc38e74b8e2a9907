// Causal depthwise conv1d (docs/algorithms.md §1.2 step 2, §1.5 "conv bwd", §1.6 and §2.10 conv update):
//
//   pre(b, t, c) = bias(c) + sum_{k=0}^{width-1} weight(c, k) * x(b, t - (width-1) + k, c)
//   y(b, t, c)   = silu(pre) with Conv1dActivation::silu, pre with Conv1dActivation::none
//
// weight(c, width-1) multiplies the current token. Inputs before time 0 come from the initial
// conv state, initial_state(b, c, j) = the input at time j - (width-1) (the last width-1 inputs of
// the previous segment, newest last), or are zero without one. The final conv state holds the
// last width-1 inputs of the segment in the same layout, so feeding it as the initial state of the
// next segment gives the same result as one pass over both.
//
// Packed sequences: with seq_idx (batch, seqlen), a token whose id differs from the previous
// token's starts a new sequence, and no output reads an input of an earlier sequence (those taps
// read zero). The initial state belongs to the row's first sequence whatever its id; the final
// state holds the inputs of the row's last sequence, zero before its start.
//
// Optional tensor arguments (bias, initial_state, final_state, ...) are left out by passing an
// empty View, e.g. `{}`. Everything is fp32; every op is non-blocking on the execution space
// instance it is given; the overloads without one use the default instance of the view's
// execution space.
#ifndef KMAMBA_CORE_CONV1D_HPP
#define KMAMBA_CORE_CONV1D_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Profiling.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/Conv1dImpl.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace kmamba {

/// The activation applied to the conv output.
enum class Conv1dActivation { none, silu };

namespace impl {

// Checks the arguments every conv1d op shares and returns the Conv1dInput the kernels read.
template <class MemorySpace>
Conv1dInput<MemorySpace> make_conv1d_input(const char* function, const ConstTensor3<float, MemorySpace>& x,
                                           const ConstTensor2<float, MemorySpace>& weight,
                                           const ConstTensor1<float, MemorySpace>& bias,
                                           const ConstTensor3<float, MemorySpace>& initial_state,
                                           const ConstTensor2<std::int64_t, MemorySpace>& seq_idx,
                                           Conv1dActivation activation) {
  const auto batch = static_cast<std::int64_t>(x.extent(0));
  const auto seqlen = static_cast<std::int64_t>(x.extent(1));
  const auto channels = static_cast<std::int64_t>(x.extent(2));
  check_allocated(function, "x", x);
  check_shape(function, "weight", weight, Shape({channels, Shape::any}), "(channels, width)");
  check_allocated(function, "weight", weight);
  const auto width = static_cast<std::int64_t>(weight.extent(1));
  KMAMBA_REQUIRE(width >= 1 && width <= conv1d_max_width,
                 function << ": weight has shape " << shape_of(weight).to_string()
                          << "; the conv width (its last extent) must be at least 1 and at most " << conv1d_max_width);
  const bool has_bias = conv1d_given(bias);
  if (has_bias) {
    check_shape(function, "bias", bias, Shape({channels}), "(channels)");
    check_allocated(function, "bias", bias);
  }
  const bool has_initial_state = conv1d_given(initial_state);
  if (has_initial_state) {
    check_shape(function, "initial_state", initial_state, Shape({batch, channels, width - 1}),
                "(batch, channels, width - 1)");
    check_allocated(function, "initial_state", initial_state);
  }
  const bool has_seq_idx = conv1d_given(seq_idx);
  if (has_seq_idx) {
    check_shape(function, "seq_idx", seq_idx, Shape({batch, seqlen}), "(batch, seqlen)");
    check_allocated(function, "seq_idx", seq_idx);
  }
  return Conv1dInput<MemorySpace>{x,
                                  weight,
                                  bias,
                                  initial_state,
                                  seq_idx,
                                  has_bias,
                                  has_initial_state,
                                  has_seq_idx,
                                  activation == Conv1dActivation::silu,
                                  static_cast<int>(seqlen),
                                  static_cast<int>(width)};
}

// Rows per forward or backward segment: conv1d_segment_rows, halved (down to
// conv1d_min_segment_rows) while the batch x segments x channels work items would not fill `exec`
// twice over.
template <class ExecutionSpace>
int conv1d_segment_rows_for(const ExecutionSpace& exec, std::int64_t batch, std::int64_t seqlen,
                            std::int64_t channels) {
  const std::int64_t wanted = 2 * static_cast<std::int64_t>(exec.concurrency());
  int rows = conv1d_segment_rows;
  while (rows > conv1d_min_segment_rows && batch * channels * ((seqlen + rows - 1) / rows) < wanted) rows /= 2;
  return rows;
}

}  // namespace impl

/// Causal depthwise conv1d forward: writes y and, if given, final_state. final_state may be
/// initial_state itself (the conv state is then advanced in place); y must not be x. With seq_idx,
/// no output reads across a packed sequence's start.
template <class ExecutionSpace>
void causal_conv1d(
    const ExecutionSpace& exec,
    const ConstTensor3<float, impl::Conv1dMemory<ExecutionSpace>>& x,       // (batch, seqlen, channels)
    const ConstTensor2<float, impl::Conv1dMemory<ExecutionSpace>>& weight,  // (channels, width)
    const ConstTensor1<float, impl::Conv1dMemory<ExecutionSpace>>& bias,    // (channels) or empty
    const ConstTensor3<float, impl::Conv1dMemory<ExecutionSpace>>&
        initial_state,                                                      // (batch, channels, width - 1) or empty
    const Tensor3<float, impl::Conv1dMemory<ExecutionSpace>>& y,            // (batch, seqlen, channels)
    const Tensor3<float, impl::Conv1dMemory<ExecutionSpace>>& final_state,  // (batch, channels, width - 1) or empty
    Conv1dActivation activation,
    const ConstTensor2<std::int64_t, impl::Conv1dMemory<ExecutionSpace>>& seq_idx = {}) {  // (batch, seqlen) or empty
  const ProfilingRegion region("kmamba::causal_conv1d");
  using Mem = impl::Conv1dMemory<ExecutionSpace>;
  constexpr const char* function = "kmamba::causal_conv1d";
  const auto in = impl::make_conv1d_input<Mem>(function, x, weight, bias, initial_state, seq_idx, activation);
  const auto batch = static_cast<std::int64_t>(x.extent(0));
  const auto channels = static_cast<std::int64_t>(x.extent(2));
  const std::int64_t width = in.width;
  check_shape(function, "y", y, Shape({batch, static_cast<std::int64_t>(in.seqlen), channels}),
              "(batch, seqlen, channels)");
  check_allocated(function, "y", y);
  KMAMBA_REQUIRE(y.size() == 0 || y.data() != x.data(),
                 function << ": y must not be x (the conv reads earlier tokens)");
  const bool has_final_state = impl::conv1d_given(final_state);
  if (has_final_state) {
    check_shape(function, "final_state", final_state, Shape({batch, channels, width - 1}),
                "(batch, channels, width - 1)");
    check_allocated(function, "final_state", final_state);
  }
  using Policy = Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::int64_t>>;
  const std::int64_t seqlen = in.seqlen;
  const int segment_rows = impl::conv1d_segment_rows_for(exec, batch, seqlen, channels);
  const std::int64_t segments = std::max<std::int64_t>(1, (seqlen + segment_rows - 1) / segment_rows);
  impl::with_conv1d_window(in.width, [&](auto window) {
    Kokkos::parallel_for("kmamba::conv1d::forward", Policy(exec, 0, batch * segments * channels),
                         impl::Conv1dForwardSegmentFunctor<Mem, decltype(window)::value>{
                             in, y, static_cast<int>(channels), static_cast<int>(segments), segment_rows});
  });
  if (has_final_state) {
    Kokkos::parallel_for("kmamba::conv1d::final_state", Policy(exec, 0, batch * channels),
                         impl::Conv1dFinalStateFunctor<Mem>{in, final_state, static_cast<int>(channels)});
  }
}

template <class XView>
void causal_conv1d(
    const XView& x,                                                          // (batch, seqlen, channels)
    const ConstTensor2<float, typename XView::memory_space>& weight,         // (channels, width)
    const ConstTensor1<float, typename XView::memory_space>& bias,           // (channels) or empty
    const ConstTensor3<float, typename XView::memory_space>& initial_state,  // (batch, channels, width - 1) or empty
    const Tensor3<float, typename XView::memory_space>& y,                   // (batch, seqlen, channels)
    const Tensor3<float, typename XView::memory_space>& final_state,         // (batch, channels, width - 1) or empty
    Conv1dActivation activation,
    const ConstTensor2<std::int64_t, typename XView::memory_space>& seq_idx = {}) {  // (batch, seqlen) or empty
  causal_conv1d(typename XView::execution_space(), x, weight, bias, initial_state, y, final_state, activation, seq_idx);
}

/// Causal depthwise conv1d backward. Given dy (and, if the forward's final state was used, its
/// gradient dfinal_state), writes dx, dweight and, if given, dbias and dinitial_state. The
/// pre-activation is recomputed from x for SiLU. dx must not be dy or x. seq_idx must be the
/// forward's.
template <class ExecutionSpace>
void causal_conv1d_backward(
    const ExecutionSpace& exec,
    const ConstTensor3<float, impl::Conv1dMemory<ExecutionSpace>>& x,       // (batch, seqlen, channels)
    const ConstTensor2<float, impl::Conv1dMemory<ExecutionSpace>>& weight,  // (channels, width)
    const ConstTensor1<float, impl::Conv1dMemory<ExecutionSpace>>& bias,    // (channels) or empty
    const ConstTensor3<float, impl::Conv1dMemory<ExecutionSpace>>&
        initial_state,                                                  // (batch, channels, width - 1) or empty
    const ConstTensor3<float, impl::Conv1dMemory<ExecutionSpace>>& dy,  // (batch, seqlen, channels)
    const ConstTensor3<float, impl::Conv1dMemory<ExecutionSpace>>&
        dfinal_state,                                                          // (batch, channels, width - 1) or empty
    const Tensor3<float, impl::Conv1dMemory<ExecutionSpace>>& dx,              // (batch, seqlen, channels)
    const Tensor2<float, impl::Conv1dMemory<ExecutionSpace>>& dweight,         // (channels, width)
    const Tensor1<float, impl::Conv1dMemory<ExecutionSpace>>& dbias,           // (channels) or empty
    const Tensor3<float, impl::Conv1dMemory<ExecutionSpace>>& dinitial_state,  // (batch, channels, width - 1) or empty
    Conv1dActivation activation,
    const ConstTensor2<std::int64_t, impl::Conv1dMemory<ExecutionSpace>>& seq_idx = {}) {  // (batch, seqlen) or empty
  const ProfilingRegion region("kmamba::causal_conv1d_backward");
  using Mem = impl::Conv1dMemory<ExecutionSpace>;
  constexpr const char* function = "kmamba::causal_conv1d_backward";
  const auto in = impl::make_conv1d_input<Mem>(function, x, weight, bias, initial_state, seq_idx, activation);
  const auto batch = static_cast<std::int64_t>(x.extent(0));
  const auto seqlen = static_cast<std::int64_t>(in.seqlen);
  const auto channels = static_cast<std::int64_t>(x.extent(2));
  const std::int64_t width = in.width;
  const Shape sequence_shape({batch, seqlen, channels});
  const Shape state_shape({batch, channels, width - 1});
  check_shape(function, "dy", dy, sequence_shape, "(batch, seqlen, channels)");
  check_allocated(function, "dy", dy);
  const bool has_dfinal_state = impl::conv1d_given(dfinal_state);
  if (has_dfinal_state) {
    check_shape(function, "dfinal_state", dfinal_state, state_shape, "(batch, channels, width - 1)");
    check_allocated(function, "dfinal_state", dfinal_state);
  }
  check_shape(function, "dx", dx, sequence_shape, "(batch, seqlen, channels)");
  check_allocated(function, "dx", dx);
  KMAMBA_REQUIRE(dx.size() == 0 || (dx.data() != dy.data() && dx.data() != x.data()),
                 function << ": dx must not be dy or x");
  check_shape(function, "dweight", dweight, Shape({channels, width}), "(channels, width)");
  check_allocated(function, "dweight", dweight);
  const bool has_dbias = impl::conv1d_given(dbias);
  if (has_dbias) {
    check_shape(function, "dbias", dbias, Shape({channels}), "(channels)");
    check_allocated(function, "dbias", dbias);
  }
  const bool has_dinitial_state = impl::conv1d_given(dinitial_state);
  if (has_dinitial_state) {
    check_shape(function, "dinitial_state", dinitial_state, state_shape, "(batch, channels, width - 1)");
    check_allocated(function, "dinitial_state", dinitial_state);
  }

  const impl::Conv1dGradInput<Mem> grad{in, dy, dfinal_state, has_dfinal_state};
  using Policy = Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::int64_t>>;
  if (has_dinitial_state) {
    Kokkos::parallel_for("kmamba::conv1d::backward_dinitial_state",
                         Policy(exec, 0, static_cast<std::int64_t>(dinitial_state.size())),
                         impl::Conv1dBackwardStateFunctor<Mem>{grad, dinitial_state, static_cast<int>(channels)});
  }
  const int segment_rows = impl::conv1d_segment_rows_for(exec, batch, seqlen, channels);
  const std::int64_t segments = std::max<std::int64_t>(1, (seqlen + segment_rows - 1) / segment_rows);
  const auto partial = allocate_uninitialized<Tensor3<float, Mem>>("kmamba::conv1d::dweight_partial", batch * segments,
                                                                   width + 1, channels);
  impl::with_conv1d_window(in.width, [&](auto window) {
    Kokkos::parallel_for("kmamba::conv1d::backward", Policy(exec, 0, batch * segments * channels),
                         impl::Conv1dBackwardSegmentFunctor<Mem, decltype(window)::value>{
                             grad, dx, partial, static_cast<int>(channels), static_cast<int>(segments), segment_rows});
  });
  impl::conv1d_weight_partial_sum(exec, ConstTensor3<float, Mem>(partial), dweight, dbias, has_dbias);
}

template <class XView>
void causal_conv1d_backward(
    const XView& x,                                                          // (batch, seqlen, channels)
    const ConstTensor2<float, typename XView::memory_space>& weight,         // (channels, width)
    const ConstTensor1<float, typename XView::memory_space>& bias,           // (channels) or empty
    const ConstTensor3<float, typename XView::memory_space>& initial_state,  // (batch, channels, width - 1) or empty
    const ConstTensor3<float, typename XView::memory_space>& dy,             // (batch, seqlen, channels)
    const ConstTensor3<float, typename XView::memory_space>& dfinal_state,   // (batch, channels, width - 1) or empty
    const Tensor3<float, typename XView::memory_space>& dx,                  // (batch, seqlen, channels)
    const Tensor2<float, typename XView::memory_space>& dweight,             // (channels, width)
    const Tensor1<float, typename XView::memory_space>& dbias,               // (channels) or empty
    const Tensor3<float, typename XView::memory_space>& dinitial_state,      // (batch, channels, width - 1) or empty
    Conv1dActivation activation,
    const ConstTensor2<std::int64_t, typename XView::memory_space>& seq_idx = {}) {  // (batch, seqlen) or empty
  causal_conv1d_backward(typename XView::execution_space(), x, weight, bias, initial_state, dy, dfinal_state, dx,
                         dweight, dbias, dinitial_state, activation, seq_idx);
}

/// One decode step: shifts conv_state left by one, appends x as its newest entry and writes
/// y = activation(bias + sum_k weight(c, k) * window(k)) over the window (old state, x). Equals
/// causal_conv1d over the same tokens. y may be x itself.
template <class ExecutionSpace>
void causal_conv1d_update(
    const ExecutionSpace& exec, const ConstTensor2<float, impl::Conv1dMemory<ExecutionSpace>>& x,  // (batch, channels)
    const ConstTensor2<float, impl::Conv1dMemory<ExecutionSpace>>& weight,                         // (channels, width)
    const ConstTensor1<float, impl::Conv1dMemory<ExecutionSpace>>& bias,   // (channels) or empty
    const Tensor3<float, impl::Conv1dMemory<ExecutionSpace>>& conv_state,  // (batch, channels, width - 1)
    const Tensor2<float, impl::Conv1dMemory<ExecutionSpace>>& y,           // (batch, channels)
    Conv1dActivation activation) {
  const ProfilingRegion region("kmamba::causal_conv1d_update");
  using Mem = impl::Conv1dMemory<ExecutionSpace>;
  constexpr const char* function = "kmamba::causal_conv1d_update";
  const auto batch = static_cast<std::int64_t>(x.extent(0));
  const auto channels = static_cast<std::int64_t>(x.extent(1));
  check_allocated(function, "x", x);
  check_shape(function, "weight", weight, Shape({channels, Shape::any}), "(channels, width)");
  check_allocated(function, "weight", weight);
  const auto width = static_cast<std::int64_t>(weight.extent(1));
  KMAMBA_REQUIRE(width >= 1, function << ": weight has shape " << shape_of(weight).to_string()
                                      << "; the conv width (its last extent) must be at least 1");
  const bool has_bias = impl::conv1d_given(bias);
  if (has_bias) {
    check_shape(function, "bias", bias, Shape({channels}), "(channels)");
    check_allocated(function, "bias", bias);
  }
  check_shape(function, "conv_state", conv_state, Shape({batch, channels, width - 1}), "(batch, channels, width - 1)");
  check_allocated(function, "conv_state", conv_state);
  check_shape(function, "y", y, Shape({batch, channels}), "(batch, channels)");
  check_allocated(function, "y", y);
  Kokkos::parallel_for(
      "kmamba::conv1d::update",
      impl::light_weight(
          Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, batch * channels)),
      impl::Conv1dUpdateFunctor<Mem>{x, weight, bias, conv_state, y, has_bias, activation == Conv1dActivation::silu,
                                     static_cast<int>(width), static_cast<int>(channels)});
}

template <class XView>
void causal_conv1d_update(
    const XView& x,                                                   // (batch, channels)
    const ConstTensor2<float, typename XView::memory_space>& weight,  // (channels, width)
    const ConstTensor1<float, typename XView::memory_space>& bias,    // (channels) or empty
    const Tensor3<float, typename XView::memory_space>& conv_state,   // (batch, channels, width - 1)
    const Tensor2<float, typename XView::memory_space>& y,            // (batch, channels)
    Conv1dActivation activation) {
  causal_conv1d_update(typename XView::execution_space(), x, weight, bias, conv_state, y, activation);
}

}  // namespace kmamba

#endif
