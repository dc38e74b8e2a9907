// Internals of kmamba/core/Conv1d.hpp: the kernels of the causal depthwise conv1d.
//
// Time runs over s in [-(width-1), seqlen): positions s < 0 are the initial conv state
// (initial_state(b, c, s + width - 1)), or zero without one. Output t reads inputs
// t-(width-1) .. t, tap k multiplying input t-(width-1)+k.
#ifndef KMAMBA_CORE_IMPL_CONV1DIMPL_HPP
#define KMAMBA_CORE_IMPL_CONV1DIMPL_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Tensor.hpp>

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <cstdint>

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
  ConstTensor3<float, MemorySpace> x;              // (batch, seqlen, channels)
  ConstTensor2<float, MemorySpace> weight;         // (channels, width)
  ConstTensor1<float, MemorySpace> bias;           // (channels) if has_bias
  ConstTensor3<float, MemorySpace> initial_state;  // (batch, channels, width - 1) if has_initial_state
  bool has_bias;
  bool has_initial_state;
  bool apply_silu;
  int seqlen;
  int width;

  // The input at time s in [-(width-1), seqlen).
  KOKKOS_INLINE_FUNCTION float input(int b, int s, int c) const {
    if (s >= 0) return x(b, s, c);
    return has_initial_state ? initial_state(b, c, s + width - 1) : 0.0f;
  }

  // bias + sum_k weight(c, k) * input(t - (width-1) + k), the value before the activation.
  KOKKOS_INLINE_FUNCTION float pre_activation(int b, int t, int c) const {
    float acc = has_bias ? bias(c) : 0.0f;
    for (int k = 0; k < width; ++k) acc += weight(c, k) * input(b, t - (width - 1) + k, c);
    return acc;
  }

  KOKKOS_INLINE_FUNCTION float activate(float pre) const { return apply_silu ? silu(pre) : pre; }
};

// y(b, t, c) for every (b, t, c); flat index i = (b * seqlen + t) * channels + c.
template <class MemorySpace>
struct Conv1dForwardFunctor {
  Conv1dInput<MemorySpace> in;
  Tensor3<float, MemorySpace> y;  // (batch, seqlen, channels)
  int channels;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const {
    const int c = static_cast<int>(i % channels);
    const std::int64_t row = i / channels;
    const int t = static_cast<int>(row % in.seqlen);
    const int b = static_cast<int>(row / in.seqlen);
    y(b, t, c) = in.activate(in.pre_activation(b, t, c));
  }
};

// final_state(b, c, j) = input(seqlen - (width-1) + j), one thread per (b, c), j ascending so
// that final_state may be initial_state itself (each j reads the state at j + seqlen >= j).
template <class MemorySpace>
struct Conv1dFinalStateFunctor {
  Conv1dInput<MemorySpace> in;
  Tensor3<float, MemorySpace> final_state;  // (batch, channels, width - 1)
  int channels;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const {
    const int c = static_cast<int>(i % channels);
    const int b = static_cast<int>(i / channels);
    for (int j = 0; j < in.width - 1; ++j) {
      final_state(b, c, j) = in.input(b, in.seqlen - (in.width - 1) + j, c);
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
  // through tap k = s - t + width - 1, plus the final state's entry j = s - seqlen + width - 1.
  KOKKOS_INLINE_FUNCTION float dinput(int b, int s, int c) const {
    float acc = 0.0f;
    for (int k = 0; k < in.width; ++k) {
      const int t = s + (in.width - 1) - k;
      if (t >= 0 && t < in.seqlen) acc += in.weight(c, k) * dpre(b, t, c);
    }
    const int j = s - in.seqlen + in.width - 1;
    if (has_dfinal_state && j >= 0) acc += dfinal_state(b, c, j);
    return acc;
  }
};

// dx(b, s, c); flat index i = (b * seqlen + s) * channels + c.
template <class MemorySpace>
struct Conv1dBackwardInputFunctor {
  Conv1dGradInput<MemorySpace> grad;
  Tensor3<float, MemorySpace> dx;  // (batch, seqlen, channels)
  int channels;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const {
    const int c = static_cast<int>(i % channels);
    const std::int64_t row = i / channels;
    const int s = static_cast<int>(row % grad.in.seqlen);
    const int b = static_cast<int>(row / grad.in.seqlen);
    dx(b, s, c) = grad.dinput(b, s, c);
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

// dweight(c, k) = sum over (b, t) of dpre(b, t, c) * input(b, t-(width-1)+k, c) and
// dbias(c) = sum over (b, t) of dpre(b, t, c), as a deterministic multi-level reduction without
// atomics. One team per (tile of `channel_tile` channels, block of rows): the channels on vector
// lanes (coalesced loads), team thread q sums rows q, q + team_size, ... of its block into its own
// slice of team scratch, then the slices are added in a fixed order. With one row block the team
// writes dweight / dbias; with several (so that a long sequence of few channels, such as the B and
// C segments of a Mamba-2 conv, still fills a GPU) it writes its block's partial sums and
// Conv1dWeightPartialSumFunctor adds them in block order.
template <class ExecutionSpace>
struct Conv1dBackwardWeightFunctor {
  using MemorySpace = Conv1dMemory<ExecutionSpace>;
  using Policy = Kokkos::TeamPolicy<ExecutionSpace>;
  using member_type = typename Policy::member_type;
  // (team_size, width + 1, channel_tile): per team thread, per tap (the last one is the bias), per lane.
  using ScratchSums = Kokkos::View<float***,
                                   Kokkos::LayoutRight,
                                   typename ExecutionSpace::scratch_memory_space,
                                   Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  static constexpr int channel_tile = 32;
  static constexpr int preferred_team_size = 16;

  Conv1dGradInput<MemorySpace> grad;
  Tensor2<float, MemorySpace> dweight;  // (channels, width)
  Tensor1<float, MemorySpace> dbias;    // (channels) if has_dbias
  Tensor3<float, MemorySpace> partial;  // (row_blocks, width + 1, channels) if row_blocks > 1
  bool has_dbias;
  int batch;
  int channels;
  int scratch_level;
  int row_blocks;

  static std::size_t scratch_bytes(int team_size, int width) {
    return ScratchSums::shmem_size(static_cast<std::size_t>(team_size), static_cast<std::size_t>(width) + 1,
                                   static_cast<std::size_t>(channel_tile));
  }

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int tiles = (channels + channel_tile - 1) / channel_tile;
    const int tile_index = team.league_rank() % tiles;
    const int block = team.league_rank() / tiles;
    const int c0 = tile_index * channel_tile;
    const int tile = channels - c0 < channel_tile ? channels - c0 : channel_tile;
    const int width = grad.in.width;
    const int seqlen = grad.in.seqlen;
    const int rows = batch * seqlen;
    const int rows_per_block = (rows + row_blocks - 1) / row_blocks;
    const int row_begin = block * rows_per_block;
    const int row_end = row_begin + rows_per_block < rows ? row_begin + rows_per_block : rows;
    const int q = team.team_rank();
    const int team_size = team.team_size();
    const ScratchSums sums(team.team_scratch(scratch_level), team_size, width + 1, channel_tile);
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, tile), [&](const int lane) {
      const int c = c0 + lane;
      for (int k = 0; k <= width; ++k) sums(q, k, lane) = 0.0f;
      for (int r = row_begin + q; r < row_end; r += team_size) {
        const int b = r / seqlen;
        const int t = r % seqlen;
        const float g = grad.dpre(b, t, c);
        for (int k = 0; k < width; ++k) sums(q, k, lane) += g * grad.in.input(b, t - (width - 1) + k, c);
        sums(q, width, lane) += g;
      }
    });
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, width + 1), [&](const int k) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, tile), [&](const int lane) {
        float total = 0.0f;
        for (int p = 0; p < team_size; ++p) total += sums(p, k, lane);
        if (row_blocks > 1) {
          partial(block, k, c0 + lane) = total;
        } else if (k < width) {
          dweight(c0 + lane, k) = total;
        } else if (has_dbias) {
          dbias(c0 + lane) = total;
        }
      });
    });
  }
};

// dweight(c, k) (k < width) or dbias(c) (k = width) as the sum of the row blocks' partial sums in
// block order; flat index i = k * channels + c.
template <class MemorySpace>
struct Conv1dWeightPartialSumFunctor {
  ConstTensor3<float, MemorySpace> partial;  // (row_blocks, width + 1, channels)
  Tensor2<float, MemorySpace> dweight;       // (channels, width)
  Tensor1<float, MemorySpace> dbias;         // (channels) if has_dbias
  bool has_dbias;
  int channels;
  int width;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const {
    const int c = static_cast<int>(i % channels);
    const int k = static_cast<int>(i / channels);
    float total = 0.0f;
    for (std::size_t block = 0; block < partial.extent(0); ++block) total += partial(block, k, c);
    if (k < width) {
      dweight(c, k) = total;
    } else if (has_dbias) {
      dbias(c) = total;
    }
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

}  // namespace impl
}  // namespace kmamba

#endif
