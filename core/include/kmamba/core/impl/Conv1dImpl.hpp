// Internals of kmamba/core/Conv1d.hpp: the kernels of the causal depthwise conv1d.
//
// Time runs over s in [-(width-1), seqlen): positions s < 0 are the initial conv state
// (initial_state(b, c, s + width - 1)), or zero without one. Output t reads inputs
// t-(width-1) .. t, tap k multiplying input t-(width-1)+k. With seq_idx, a token whose id differs
// from the previous token's starts a packed sequence, and output t reads input s only if no
// sequence starts in (s, t]; the inputs before time 0 belong to the row's first sequence.
#ifndef KMAMBA_CORE_IMPL_CONV1DIMPL_HPP
#define KMAMBA_CORE_IMPL_CONV1DIMPL_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Conv1dWidth.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kmamba {
namespace impl {

template <class ExecutionSpace>
using Conv1dMemory = typename ExecutionSpace::memory_space;

// An optional tensor argument is absent when it is a default-constructed (empty) View.
template <class ViewType>
bool conv1d_given(const ViewType& view) {
  return view.data() != nullptr || view.size() != 0;
}

// What the forward pass reads; shared by the forward and backward kernels.
template <class MemorySpace>
struct Conv1dInput {
  ConstTensor3<float, MemorySpace> x;               // (batch, seqlen, channels)
  ConstTensor2<float, MemorySpace> weight;          // (channels, width)
  ConstTensor1<float, MemorySpace> bias;            // (channels) if has_bias
  ConstTensor3<float, MemorySpace> initial_state;   // (batch, channels, width - 1) if has_initial_state
  ConstTensor2<std::int64_t, MemorySpace> seq_idx;  // (batch, seqlen) if has_seq_idx
  bool has_bias;
  bool has_initial_state;
  bool has_seq_idx;
  bool apply_silu;
  int seqlen;
  int width;

  // The input at time s in [-(width-1), seqlen).
  KOKKOS_INLINE_FUNCTION float input(int b, int s, int c) const {
    if (s >= 0) return x(b, s, c);
    return has_initial_state ? initial_state(b, c, s + width - 1) : 0.0f;
  }

  // Whether token s in [-(width-1), seqlen] starts a packed sequence (never time 0, whose sequence
  // owns the initial state, nor the token after the segment, which continues its last sequence).
  KOKKOS_INLINE_FUNCTION bool starts_sequence(int b, int s) const {
    return has_seq_idx && s >= 1 && s < seqlen && seq_idx(b, s) != seq_idx(b, s - 1);
  }

  // Whether time t (up to seqlen, the next segment's first token) reads input s <= t: no packed
  // sequence starts in (s, t].
  KOKKOS_INLINE_FUNCTION bool reaches(int b, int s, int t) const {
    for (int r = s + 1; r <= t; ++r) {
      if (starts_sequence(b, r)) return false;
    }
    return true;
  }

  // bias + sum_k weight(c, k) * input(t - (width-1) + k) over the inputs t reads, the value before
  // the activation.
  KOKKOS_INLINE_FUNCTION float pre_activation(int b, int t, int c) const {
    float acc = has_bias ? bias(c) : 0.0f;
    for (int k = 0; k < width; ++k) {
      const int s = t - (width - 1) + k;
      if (reaches(b, s, t)) acc += weight(c, k) * input(b, s, c);
    }
    return acc;
  }

  KOKKOS_INLINE_FUNCTION float activate(float pre) const { return apply_silu ? silu(pre) : pre; }
};

// final_state(b, c, j) = input(seqlen - (width-1) + j), or zero where that input lies before the
// start of the row's last packed sequence (the next segment continues that sequence alone); one
// thread per (b, c), j ascending so that final_state may be initial_state itself (each j reads
// the state at j + seqlen >= j).
template <class MemorySpace>
struct Conv1dFinalStateFunctor {
  Conv1dInput<MemorySpace> in;
  Tensor3<float, MemorySpace> final_state;  // (batch, channels, width - 1)
  int channels;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const {
    const int c = static_cast<int>(i % channels);
    const int b = static_cast<int>(i / channels);
    for (int j = 0; j < in.width - 1; ++j) {
      const int s = in.seqlen - (in.width - 1) + j;
      final_state(b, c, j) = in.reaches(b, s, in.seqlen) ? in.input(b, s, c) : 0.0f;
    }
  }
};

// What every backward kernel reads.
template <class MemorySpace>
struct Conv1dGradInput {
  Conv1dInput<MemorySpace> in;
  ConstTensor3<float, MemorySpace> dy;            // (batch, seqlen, channels)
  ConstTensor3<float, MemorySpace> dfinal_state;  // (batch, channels, width - 1) if has_dfinal_state
  bool has_dfinal_state;

  // Gradient w.r.t. the pre-activation at output t (the pre-activation is recomputed for SiLU).
  KOKKOS_INLINE_FUNCTION float dpre(int b, int t, int c) const {
    const float g = dy(b, t, c);
    return in.apply_silu ? g * silu_derivative(in.pre_activation(b, t, c)) : g;
  }

  // Gradient w.r.t. the input at time s in [-(width-1), seqlen): every output t that reads it
  // through tap k = s - t + width - 1, plus the final state's entry j = s - seqlen + width - 1
  // where the final state holds it.
  KOKKOS_INLINE_FUNCTION float dinput(int b, int s, int c) const {
    float acc = 0.0f;
    for (int k = 0; k < in.width; ++k) {
      const int t = s + (in.width - 1) - k;
      if (t >= 0 && t < in.seqlen && in.reaches(b, s, t)) acc += in.weight(c, k) * dpre(b, t, c);
    }
    const int j = s - in.seqlen + in.width - 1;
    if (has_dfinal_state && j >= 0 && in.reaches(b, s, in.seqlen)) acc += dfinal_state(b, c, j);
    return acc;
  }
};

// dinitial_state(b, c, j) = dinput at time j - (width-1); flat index i = (b * channels + c) * (width-1) + j.
template <class MemorySpace>
struct Conv1dBackwardStateFunctor {
  Conv1dGradInput<MemorySpace> grad;
  Tensor3<float, MemorySpace> dinitial_state;  // (batch, channels, width - 1)
  int channels;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const {
    const int state_len = grad.in.width - 1;
    const int j = static_cast<int>(i % state_len);
    const std::int64_t bc = i / state_len;
    const int c = static_cast<int>(bc % channels);
    const int b = static_cast<int>(bc / channels);
    dinitial_state(b, c, j) = grad.dinput(b, j - state_len, c);
  }
};

// Rows of a backward segment: long enough that the width - 1 rows read on either side of it stay
// a small share, and shortened (down to conv1d_min_segment_rows) where batch x channels work items
// per segment would not fill the device.
constexpr int conv1d_segment_rows = 64;
constexpr int conv1d_min_segment_rows = 16;

// The register window of a (batch, segment, channel) work item, right-aligned: slot MaxWidth - 1
// holds time t after each step's shift, so every register index is a compile-time constant; a
// width below MaxWidth leaves the leading slots unused (their taps are zero). After a step, the
// slots before `first_read` hold inputs that time t does not read: before tap 0, or before the
// start of t's packed sequence.
template <class MemorySpace, int MaxWidth>
struct Conv1dWindow {
  float tap[MaxWidth];
  float window[MaxWidth];
  int first_tap;   // the slot of tap 0
  int first_read;  // the first slot time t reads; before the first step, one past time t0's (the shift moves it)

  // The taps of channel c and the inputs before t0 (initial state included).
  KOKKOS_INLINE_FUNCTION Conv1dWindow(const Conv1dInput<MemorySpace>& in, int b, int t0, int c)
      : first_tap(MaxWidth - in.width), first_read(MaxWidth - in.width + 1) {
    for (int j = 0; j < MaxWidth; ++j) {
      tap[j] = j >= first_tap ? in.weight(c, j - first_tap) : 0.0f;
      // window[j] = the input at time t0 - MaxWidth + j, the one before each step's shift.
      window[j] = j > first_tap ? in.input(b, t0 - MaxWidth + j, c) : 0.0f;
      if (j > first_tap && in.starts_sequence(b, t0 - MaxWidth + j)) first_read = j;
    }
  }

  // Shifts in the input at time t and returns the pre-activation there.
  KOKKOS_INLINE_FUNCTION float step(const Conv1dInput<MemorySpace>& in, float newest, int b, int t, int c) {
    for (int j = 0; j + 1 < MaxWidth; ++j) window[j] = window[j + 1];
    window[MaxWidth - 1] = newest;
    first_read = in.starts_sequence(b, t) ? MaxWidth - 1 : (first_read > first_tap ? first_read - 1 : first_tap);
    float pre = in.has_bias ? in.bias(c) : 0.0f;
    for (int j = 0; j < MaxWidth; ++j) {
      if (j >= first_read) pre += tap[j] * window[j];
    }
    return pre;
  }
};

// Work item i of the segmented kernels: channel c of batch b over the segment's rows [t0, t1);
// consecutive items are consecutive channels. `item` = b * segments + segment.
struct Conv1dSegmentItem {
  int c, b, t0, t1;
  std::int64_t item;

  KOKKOS_INLINE_FUNCTION Conv1dSegmentItem(std::int64_t i, int channels, int segments, int segment_rows, int seqlen)
      : c(static_cast<int>(i % channels)), b(0), t0(0), t1(0), item(i / channels) {
    b = static_cast<int>(item / segments);
    t0 = static_cast<int>(item % segments) * segment_rows;
    t1 = t0 + segment_rows < seqlen ? t0 + segment_rows : seqlen;
  }
};

// The forward of one (batch, segment of rows [t0, t1), channel) work item: each step loads x(t)
// once into the register window and writes y(t). Consecutive work items are consecutive channels,
// so every load and store of a warp is contiguous.
template <class MemorySpace, int MaxWidth>
struct Conv1dForwardSegmentFunctor {
  Conv1dInput<MemorySpace> in;
  Tensor3<float, MemorySpace> y;  // (batch, seqlen, channels)
  int channels;
  int segments;
  int segment_rows;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const {
    const Conv1dSegmentItem seg(i, channels, segments, segment_rows, in.seqlen);
    Conv1dWindow<MemorySpace, MaxWidth> w(in, seg.b, seg.t0, seg.c);
    for (int t = seg.t0; t < seg.t1; ++t) {
      y(seg.b, t, seg.c) = in.activate(w.step(in, in.x(seg.b, t, seg.c), seg.b, t, seg.c));
    }
  }
};

// The backward of one (batch, segment of rows [t0, t1), channel) work item in one pass over time:
// each step loads x(t) and dy(t) once, recomputes the pre-activation from a window of the last
// MaxWidth inputs held in registers, adds dpre(t) * weight(c, k) to the pending gradients of the
// inputs it read, writes the input gradient that no later output reaches, and (for t < t1) adds
// dpre(t) * input to the item's partial sums of dweight and dbias. The window and the pending
// gradients are right-aligned (index MaxWidth - 1 is time t) so that every register index is a
// compile-time constant; a width below MaxWidth leaves the leading slots unused. The walk reads
// width - 1 rows before t0 (through Conv1dInput::input, initial state included) and width - 1
// rows after t1 (for the gradients of the segment's last inputs); the partial sums go to
// partial(b * segments + segment, k, c) and Conv1dWeightPartialSumFunctor adds them in order.
template <class MemorySpace, int MaxWidth>
struct Conv1dBackwardSegmentFunctor {
  Conv1dGradInput<MemorySpace> grad;
  Tensor3<float, MemorySpace> dx;       // (batch, seqlen, channels)
  Tensor3<float, MemorySpace> partial;  // (batch * segments, width + 1, channels)
  int channels;
  int segments;
  int segment_rows;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const {
    const int width = grad.in.width;
    const int seqlen = grad.in.seqlen;
    const Conv1dSegmentItem seg(i, channels, segments, segment_rows, seqlen);
    const int c = seg.c, b = seg.b, t0 = seg.t0, t1 = seg.t1;
    const std::int64_t item = seg.item;
    const int t_end = t1 + width - 1 < seqlen ? t1 + width - 1 : seqlen;
    Conv1dWindow<MemorySpace, MaxWidth> w(grad.in, b, t0, c);
    float pending[MaxWidth], sums[MaxWidth];
    float bias_sum = 0.0f;
    for (int j = 0; j < MaxWidth; ++j) {
      pending[j] = 0.0f;
      sums[j] = 0.0f;
    }
    for (int t = t0; t < t1 + MaxWidth - 1; ++t) {
      if (t < t_end) {
        const float pre = w.step(grad.in, grad.in.x(b, t, c), b, t, c);
        const float g = grad.dy(b, t, c);
        const float dpre = grad.in.apply_silu ? g * silu_derivative(pre) : g;
        for (int j = 0; j < MaxWidth; ++j) {
          if (j >= w.first_read) pending[j] += w.tap[j] * dpre;
        }
        if (t < t1) {
          for (int j = 0; j < MaxWidth; ++j) {
            if (j >= w.first_read) sums[j] += dpre * w.window[j];
          }
          bias_sum += dpre;
        }
      }
      // pending[0] is the gradient of the input at time s = t - (MaxWidth - 1), which no later
      // output reads.
      const int s = t - (MaxWidth - 1);
      if (s >= t0) {
        const int j = s - seqlen + width - 1;
        const bool in_final_state = grad.has_dfinal_state && j >= 0 && grad.in.reaches(b, s, seqlen);
        dx(b, s, c) = pending[0] + (in_final_state ? grad.dfinal_state(b, c, j) : 0.0f);
      }
      for (int j = 0; j + 1 < MaxWidth; ++j) pending[j] = pending[j + 1];
      pending[MaxWidth - 1] = 0.0f;
    }
    for (int j = 0; j < MaxWidth; ++j) {
      if (j >= w.first_tap) partial(item, j - w.first_tap, c) = sums[j];
    }
    partial(item, width, c) = bias_sum;
  }
};

// Calls f with the smallest of the register window sizes 4, 8, 16 that holds `width` taps.
template <class F>
void with_conv1d_window(int width, F&& f) {
  if (width <= 4) {
    f(std::integral_constant<int, 4>());
  } else if (width <= 8) {
    f(std::integral_constant<int, 8>());
  } else {
    static_assert(conv1d_max_width == 16, "with_conv1d_window: a window for every width up to conv1d_max_width");
    f(std::integral_constant<int, 16>());
  }
}

// dweight(c, k) (k < width) or dbias(c) (k = width) as the sum of the segments' partial sums, in
// a fixed order (deterministic, no atomics): a team per (k, block of `lanes` channels), whose thread
// q adds partial blocks q, q + team_size, ... in order, and whose first thread then adds the
// threads' sums in order. Flat league index = k * channel_blocks + channel block.
template <class ExecutionSpace>
struct Conv1dWeightPartialSumFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecutionSpace>::member_type;
  using MemorySpace = typename ExecutionSpace::memory_space;
  using scratch_view = Kokkos::View<float**, Kokkos::LayoutRight, typename ExecutionSpace::scratch_memory_space,
                                    Kokkos::MemoryUnmanaged>;
  ConstTensor3<float, MemorySpace> partial;  // (batch * segments, width + 1, channels)
  Tensor2<float, MemorySpace> dweight;       // (channels, width)
  Tensor1<float, MemorySpace> dbias;         // (channels) if has_dbias
  bool has_dbias;
  int channels;
  int width;
  int lanes;

  KOKKOS_INLINE_FUNCTION int channel_blocks() const { return (channels + lanes - 1) / lanes; }

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int k = team.league_rank() / channel_blocks();
    const int c0 = (team.league_rank() % channel_blocks()) * lanes;
    const int q = team.team_rank();
    const int threads = team.team_size();
    const int blocks = static_cast<int>(partial.extent(0));
    const scratch_view sums(team.team_scratch(0), threads, lanes);
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, lanes), [&](const int lane) {
      const int c = c0 + lane;
      float total = 0.0f;
      if (c < channels) {
        for (int block = q; block < blocks; block += threads) total += partial(block, k, c);
      }
      sums(q, lane) = total;
    });
    team.team_barrier();
    if (q != 0) return;
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, lanes), [&](const int lane) {
      const int c = c0 + lane;
      if (c >= channels) return;
      float total = 0.0f;
      for (int p = 0; p < threads; ++p) total += sums(p, lane);
      if (k < width) {
        dweight(c, k) = total;
      } else if (has_dbias) {
        dbias(c) = total;
      }
    });
  }
};

// One decode step per (b, c): y = act(bias + sum_{k < width-1} weight(c, k) * state(k) + weight(c, width-1) * x),
// then the state shifts left by one and x becomes its newest (last) entry.
template <class MemorySpace>
struct Conv1dUpdateFunctor {
  ConstTensor2<float, MemorySpace> x;       // (batch, channels)
  ConstTensor2<float, MemorySpace> weight;  // (channels, width)
  ConstTensor1<float, MemorySpace> bias;    // (channels) if has_bias
  Tensor3<float, MemorySpace> conv_state;   // (batch, channels, width - 1)
  Tensor2<float, MemorySpace> y;            // (batch, channels)
  bool has_bias;
  bool apply_silu;
  int width;
  int channels;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const {
    const int c = static_cast<int>(i % channels);
    const int b = static_cast<int>(i / channels);
    const float newest = x(b, c);
    float acc = has_bias ? bias(c) : 0.0f;
    for (int k = 0; k < width - 1; ++k) acc += weight(c, k) * conv_state(b, c, k);
    acc += weight(c, width - 1) * newest;
    for (int k = 0; k + 1 < width - 1; ++k) conv_state(b, c, k) = conv_state(b, c, k + 1);
    if (width > 1) conv_state(b, c, width - 2) = newest;
    y(b, c) = apply_silu ? silu(acc) : acc;
  }
};

// Launches Conv1dWeightPartialSumFunctor: on devices teams of 8 threads of 32 lanes (a warp each),
// on hosts a thread per team and channel.
template <class ExecutionSpace, class MemorySpace>
void conv1d_weight_partial_sum(const ExecutionSpace& exec,
                               const ConstTensor3<float, MemorySpace>& partial,  // (blocks, width + 1, channels)
                               const Tensor2<float, MemorySpace>& dweight,       // (channels, width)
                               const Tensor1<float, MemorySpace>& dbias,         // (channels) if has_dbias
                               bool has_dbias) {
  using Policy = Kokkos::TeamPolicy<ExecutionSpace>;
  using Functor = Conv1dWeightPartialSumFunctor<ExecutionSpace>;
  const int lanes = std::min(32, static_cast<int>(Policy::vector_length_max()));
  const int threads = vector_lanes_are_threads<ExecutionSpace> ? 8 : 1;
  const Functor functor{
      partial, dweight, dbias, has_dbias, static_cast<int>(partial.extent(2)), static_cast<int>(dweight.extent(1)),
      lanes};
  const int league = (functor.width + 1) * functor.channel_blocks();
  if (league == 0) return;
  Kokkos::parallel_for("kmamba::conv1d::backward_dweight_sum",
                       Policy(exec, league, threads, lanes)
                           .set_scratch_size(0, Kokkos::PerTeam(Functor::scratch_view::shmem_size(threads, lanes))),
                       functor);
}

}  // namespace impl
}  // namespace kmamba

#endif
