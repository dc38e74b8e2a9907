// The walk of a chunked scan's state across its chunks, shared by the SSD and Mamba-3 state
// passing (docs/algorithms.md §2.5 stage 3) and their reversed backward (§2.6 B3): one work item
// per state element runs the recurrence s ← decay(c)·s + value(c) along the chunks, writing into
// slot c the value s held before chunk c's term was added.
//
// The recurrence is a dependent chain, so a walk that loaded chunk c + 1 while it combined chunk c
// would keep one load in flight per work item, too few to cover the memory latency (the stages ran
// at a fraction of the memory bandwidth). The walk loads chunk_walk_batch chunks' values and
// decays before it combines them.
#ifndef KMAMBA_CORE_IMPL_CHUNKSTATEWALK_HPP
#define KMAMBA_CORE_IMPL_CHUNKSTATEWALK_HPP

#include <Kokkos_Core.hpp>

namespace kmamba {
namespace impl {

/// Chunks whose values a walk loads before it combines them.
constexpr int chunk_walk_batch = 8;

/// Walks chunks 0, 1, …, nchunks − 1 from s: for each chunk c, slot(c) (a reference to the value
/// of chunk c) is read, then overwritten by s, and s becomes decay(c)·s + that value. Returns the
/// final s.
template <class Slot, class Decay>
KOKKOS_INLINE_FUNCTION float chunk_walk_forward(int nchunks, float s, const Slot& slot, const Decay& decay) {
  for (int c0 = 0; c0 < nchunks; c0 += chunk_walk_batch) {
    float value[chunk_walk_batch], factor[chunk_walk_batch];
    for (int j = 0; j < chunk_walk_batch; ++j) {
      const int c = c0 + j < nchunks ? c0 + j : nchunks - 1;
      value[j] = slot(c);
      factor[j] = decay(c);
    }
    for (int j = 0; j < chunk_walk_batch; ++j) {
      if (c0 + j < nchunks) {
        slot(c0 + j) = s;
        s = factor[j] * s + value[j];
      }
    }
  }
  return s;
}

/// The same walk from the last chunk to the first (the backward of chunk_walk_forward: slot(c)
/// holds the gradient reaching chunk c's entering state and leaves holding that of its leaving one).
template <class Slot, class Decay>
KOKKOS_INLINE_FUNCTION float chunk_walk_backward(int nchunks, float s, const Slot& slot, const Decay& decay) {
  return chunk_walk_forward(
      nchunks, s, [&](int c) -> decltype(auto) { return slot(nchunks - 1 - c); },
      [&](int c) { return decay(nchunks - 1 - c); });
}

}  // namespace impl
}  // namespace kmamba

#endif
