// Packed rows (seq_idx) split across sequence-parallel ranks (docs/distributed.md §2.4): what of the
// previous segment reaches this one. Each rank knows only its own segment's ids, so the ids of the
// last `halo` tokens before the segment come from the previous rank (a chain of small messages, as
// the conv halo itself). A halo position from which the ids change before the segment's first
// token (ids may recur, so equality with the first token's id is not enough) lies in another
// document: its conv inputs are taken as zero, and when the previous segment's last
// token is such a position, the segment's first token starts a document and no state enters the
// segment (its incoming state and the decay it passes on are 0 on that row). A state that does not
// decay on its own (Mamba-3's angle) passes through a segment with decay 1 unless a document
// starts in it or at its first token (packed_segment_carry).
#ifndef KMAMBA_MODELS_SRC_PACKEDSEGMENTS_HPP
#define KMAMBA_MODELS_SRC_PACKEDSEGMENTS_HPP

#include <kmamba/core/Tensor.hpp>
#include <kmamba/parallel/Communicator.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>

namespace kmamba {
namespace impl {

/// The ids of the last `halo` tokens of the previous segments followed by this segment's (before
/// the first segment: its first token's id), one item per (row, halo position).
template <class MemorySpace>
struct PackedHaloIdsFunctor {
  ConstTensor2<std::int64_t, MemorySpace> received;  // (batch, halo): ids before the segment
  ConstTensor2<std::int64_t, MemorySpace> seq_idx;   // (batch, seqlen)
  Tensor2<std::int64_t, MemorySpace> last;           // (batch, halo): ids of the halo this segment passes on
  Tensor2<float, MemorySpace> mask;                  // (batch, halo): 1 where the halo is in the first document
  int halo, seqlen;
  bool has_previous;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int b = static_cast<int>(item / halo), j = static_cast<int>(item % halo);
    const std::int64_t first = seq_idx(b, 0);
    bool same = true;
    for (int i = j; i < halo && has_previous; ++i) same = same && received(b, i) == first;
    mask(b, j) = same ? 1.0f : 0.0f;
    const int t = seqlen - halo + j;  // position j of the passed-on halo, in this segment's tokens
    last(b, j) = t >= 0 ? seq_idx(b, t) : (has_previous ? received(b, seqlen + j) : first);
  }
};

/// The halo mask of this rank's segment (batch, halo) and the passing on of its own last ids,
/// collectively over `sequence` (the previous rank first: a chain, as the conv halo). `halo` ≥ 1.
template <class ExecutionSpace, class MemorySpace>
Tensor2<float, MemorySpace> packed_halo_mask(const ExecutionSpace& exec, const Communicator& sequence, int previous,
                                             int next, const ConstTensor2<std::int64_t, MemorySpace>& seq_idx,
                                             int halo) {
  using Ids = Tensor2<std::int64_t, MemorySpace>;
  const std::int64_t batch = static_cast<std::int64_t>(seq_idx.extent(0));
  const int seqlen = static_cast<int>(seq_idx.extent(1));
  const Ids received = allocate_uninitialized<Ids>("kmamba::packed_segments::received_ids", batch, halo);
  const Ids last = allocate_uninitialized<Ids>("kmamba::packed_segments::last_ids", batch, halo);
  const auto mask =
      allocate_uninitialized<Tensor2<float, MemorySpace>>("kmamba::packed_segments::halo_mask", batch, halo);
  if (previous != no_peer) sequence.recv(exec, received, previous);
  Kokkos::parallel_for(
      "kmamba::packed_segments::halo_ids",
      Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, batch * halo),
      PackedHaloIdsFunctor<MemorySpace>{received, seq_idx, last, mask, halo, seqlen, previous != no_peer});
  if (next != no_peer) sequence.send(exec, last, next);
  return mask;
}

/// conv(b, c, j) *= mask(b, j) for the conv halo (or its gradient) of (batch, channels, d_conv − 1).
template <class MemorySpace>
struct PackedMaskHaloFunctor {
  ConstTensor2<float, MemorySpace> mask;  // (batch, halo)
  Tensor3<float, MemorySpace> conv;       // (batch, channels, d_conv − 1)

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const std::int64_t taps = static_cast<std::int64_t>(conv.extent(2)), per_row = conv.extent(1) * taps;
    const int b = static_cast<int>(item / per_row), c = static_cast<int>(item % per_row / taps);
    const int j = static_cast<int>(item % taps);
    conv(b, c, j) *= mask(b, j);
  }
};

template <class ExecutionSpace, class MemorySpace>
void mask_packed_halo(const ExecutionSpace& exec, const ConstTensor2<float, MemorySpace>& mask,
                      const Tensor3<float, MemorySpace>& conv) {  // (batch, channels, d_conv − 1)
  Kokkos::parallel_for("kmamba::packed_segments::mask_halo",
                       Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, conv.size()),
                       PackedMaskHaloFunctor<MemorySpace>{mask, conv});
}

/// rows(b, i) *= mask(b, halo − 1): zero on the rows whose segment starts a document.
template <class MemorySpace>
struct PackedMaskRowsFunctor {
  ConstTensor2<float, MemorySpace> mask;  // (batch, halo)
  Tensor2<float, MemorySpace> rows;       // (batch, width)

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const std::int64_t width = static_cast<std::int64_t>(rows.extent(1));
    const int b = static_cast<int>(item / width);
    rows(b, static_cast<int>(item % width)) *= mask(b, static_cast<int>(mask.extent(1)) - 1);
  }
};

/// Zeroes the rows of `state` (batch first, any shape after) whose segment starts a document.
template <class ExecutionSpace, class View>
void mask_packed_rows(const ExecutionSpace& exec, const ConstTensor2<float, typename View::memory_space>& mask,
                      const View& state) {
  using Mem = typename View::memory_space;
  const std::size_t batch = state.extent(0);
  const Tensor2<float, Mem> rows(state.data(), batch, batch == 0 ? 0 : state.size() / batch);
  Kokkos::parallel_for("kmamba::packed_segments::mask_rows",
                       Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, rows.size()),
                       PackedMaskRowsFunctor<Mem>{mask, rows});
}

/// carry(b, j) = 1 where the state entering row b's segment reaches its end: the segment does not
/// start a document (mask(b, halo − 1) = 1) and none starts inside it; else 0. One item per row.
template <class MemorySpace>
struct PackedSegmentCarryFunctor {
  ConstTensor2<float, MemorySpace> mask;            // (batch, halo)
  ConstTensor2<std::int64_t, MemorySpace> seq_idx;  // (batch, seqlen)
  Tensor2<float, MemorySpace> carry;                // (batch, width)

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int b = static_cast<int>(item);
    bool through = mask(b, static_cast<int>(mask.extent(1)) - 1) != 0.0f;
    for (int t = 1; t < static_cast<int>(seq_idx.extent(1)) && through; ++t)
      through = seq_idx(b, t) == seq_idx(b, t - 1);
    for (int j = 0; j < static_cast<int>(carry.extent(1)); ++j) carry(b, j) = through ? 1.0f : 0.0f;
  }
};

/// The decays (batch, width) of a segment's pairs for a state that does not decay on its own (as
/// Mamba-3's angle): 1 where what enters the segment leaves it, 0 where a document starts at or
/// after its first token (PackedSegmentCarryFunctor), from packed_halo_mask's mask.
template <class ExecutionSpace, class MemorySpace>
Tensor2<float, MemorySpace> packed_segment_carry(const ExecutionSpace& exec,
                                                 const ConstTensor2<float, MemorySpace>& mask,  // (batch, halo)
                                                 const ConstTensor2<std::int64_t, MemorySpace>& seq_idx,  // (batch, L)
                                                 int width) {
  const std::int64_t batch = static_cast<std::int64_t>(seq_idx.extent(0));
  const auto carry =
      allocate_uninitialized<Tensor2<float, MemorySpace>>("kmamba::packed_segments::carry", batch, width);
  Kokkos::parallel_for("kmamba::packed_segments::carry",
                       Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, batch),
                       PackedSegmentCarryFunctor<MemorySpace>{mask, seq_idx, carry});
  return carry;
}

}  // namespace impl
}  // namespace kmamba

#endif
