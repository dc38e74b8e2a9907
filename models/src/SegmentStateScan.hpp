// Sequence parallelism's combination of per-segment (decay, state) pairs across the sequence ranks
// (docs/distributed.md §2.1): an exclusive scan in ⌈log₂ c⌉ rounds of point-to-point exchanges.
//
// A segment scanned from a zero state ends in `local`; a state s entering it leaves as
// decay ⊙ s + local (decay per row, or per group of consecutive state elements). Rank k needs the
// state entering its segment, the composition of the pairs of ranks 0 … k − 1:
//
//   incoming(k) = decay(k − 1) ⊙ incoming(k − 1) + local(k − 1),   incoming(0) = 0.
//
// Round r (d = 2^r): rank k sends the composite W of ranks [k − d + 1, k] (its own pair at r = 0)
// to rank k + d and receives that of rank k − d, which it composes in front of its exclusive
// composite E (ranks [k − d, k − 1] after the round) and of W. Every rank exchanges at most one
// message of rows·(decay width + state width) floats per round, whatever c: against the serial
// chain this adds ⌈log₂ c⌉ − 1 exchanges to the critical path and removes c − 1 scans from it; an
// all-gather of the pairs would move (c − 1) pairs to every rank and keep c of them in memory.
// Backward, the gradients with respect to the incoming states compose the same way in the other
// direction (Direction::Backward: rank k receives from k + d, incoming(c − 1) = 0).
#ifndef KMAMBA_MODELS_SRC_SEGMENTSTATESCAN_HPP
#define KMAMBA_MODELS_SRC_SEGMENTSTATESCAN_HPP

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/parallel/Communicator.hpp>

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <cstdint>

namespace kmamba {
namespace impl {

/// Forward: the state entering rank k comes from ranks 0 … k − 1. Backward: the gradient entering
/// rank k's final state comes from ranks k + 1 … c − 1.
enum class SegmentScanDirection { Forward, Backward };

/// state(r, j) = decay_e(r, j / q)·received_state(r, j) + state(r, j) for both composites (E, W),
/// q = state width / decay width; the decays are composed by SegmentScanDecayFunctor after it.
template <class MemorySpace>
struct SegmentScanStateFunctor {
  ConstTensor2<float, MemorySpace> received_state;  // (rows, width)
  ConstTensor2<float, MemorySpace> e_decay;         // (rows, decay width)
  ConstTensor2<float, MemorySpace> w_decay;         // (rows, decay width)
  Tensor2<float, MemorySpace> e_state;              // (rows, width)
  Tensor2<float, MemorySpace> w_state;              // (rows, width), unallocated after the last round
  int width, per_decay;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int r = static_cast<int>(item / width), j = static_cast<int>(item % width);
    const float in = received_state(r, j);
    e_state(r, j) += e_decay(r, j / per_decay) * in;
    if (w_state.data() != nullptr) w_state(r, j) += w_decay(r, j / per_decay) * in;
  }
};

/// e_decay ⊙= received_decay, w_decay ⊙= received_decay.
template <class MemorySpace>
struct SegmentScanDecayFunctor {
  ConstTensor1<float, MemorySpace> received_decay;  // (rows·decay width)
  Tensor1<float, MemorySpace> e_decay;              // (rows·decay width)
  Tensor1<float, MemorySpace> w_decay;              // (rows·decay width), unallocated after the last round

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const {
    e_decay(i) *= received_decay(i);
    if (w_decay.data() != nullptr) w_decay(i) *= received_decay(i);
  }
};

/// Writes `incoming`, the composition of the pairs (decay, local) of the ranks before this one in
/// `direction` (zero on the first), collectively over `sequence` (every rank calls it with the same
/// shapes). Non-blocking on `exec` where the transport is stream-ordered.
template <class ExecutionSpace, class MemorySpace>
void segment_state_scan(const ExecutionSpace& exec, const Communicator& sequence, SegmentScanDirection direction,
                        const ConstTensor2<float, MemorySpace>& decay,  // (rows, decay width)
                        const ConstTensor2<float, MemorySpace>& local,  // (rows, width)
                        const Tensor2<float, MemorySpace>& incoming) {  // (rows, width)
  using Range = Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::int64_t>>;
  using Vector = Tensor1<float, MemorySpace>;
  using Matrix = Tensor2<float, MemorySpace>;
  const std::size_t rows = local.extent(0), width = local.extent(1), decay_width = decay.extent(1);
  KMAMBA_REQUIRE(decay.extent(0) == rows && incoming.extent(0) == rows && incoming.extent(1) == width &&
                     decay_width > 0 && width % decay_width == 0,
                 "kmamba::segment_state_scan: decay (" << decay.extent(0) << ", " << decay_width << "), local (" << rows
                                                       << ", " << width << ") and incoming (" << incoming.extent(0)
                                                       << ", " << incoming.extent(1) << ") do not fit");
  const int k = sequence.rank(), c = sequence.size();
  const int step = direction == SegmentScanDirection::Forward ? 1 : -1;
  const std::size_t pair = rows * (decay_width + width);
  // [decay | state] of a composite in one buffer, so that a round is one message.
  const auto w = allocate_uninitialized<Vector>("kmamba::segment_scan::w", pair);
  const auto received = allocate_uninitialized<Vector>("kmamba::segment_scan::received", pair);
  const auto decay_part = [&](const Vector& v) { return Matrix(v.data(), rows, decay_width); };
  const auto state_part = [&](const Vector& v) { return Matrix(v.data() + rows * decay_width, rows, width); };
  Kokkos::deep_copy(exec, decay_part(w), decay);
  Kokkos::deep_copy(exec, state_part(w), local);
  const auto e_decay = allocate_uninitialized<Matrix>("kmamba::segment_scan::e_decay", rows, decay_width);
  Kokkos::deep_copy(exec, e_decay, 1.0f);
  Kokkos::deep_copy(exec, incoming, 0.0f);
  for (int d = 1; d < c; d *= 2) {
    const int to = k + step * d, from = k - step * d;
    const bool sends = to >= 0 && to < c, receives = from >= 0 && from < c;
    sequence.send_recv(exec, w, sends ? to : no_peer, received, receives ? from : no_peer);
    if (!receives) continue;
    const bool last_round = 2 * d >= c;  // W is sent in a later round only
    const Matrix w_state = last_round ? Matrix() : state_part(w);
    const Matrix w_decay = last_round ? Matrix() : decay_part(w);
    Kokkos::parallel_for(
        "kmamba::segment_scan::compose_states", Range(exec, 0, static_cast<std::int64_t>(rows * width)),
        SegmentScanStateFunctor<MemorySpace>{state_part(received), e_decay, w_decay, incoming, w_state,
                                             static_cast<int>(width), static_cast<int>(width / decay_width)});
    Kokkos::parallel_for("kmamba::segment_scan::compose_decays",
                         Range(exec, 0, static_cast<std::int64_t>(rows * decay_width)),
                         SegmentScanDecayFunctor<MemorySpace>{
                             Vector(received.data(), rows * decay_width), Vector(e_decay.data(), rows * decay_width),
                             last_round ? Vector() : Vector(w.data(), rows * decay_width)});
  }
}

/// inclusive = local + decay ⊙ incoming: the composite that ends at this rank (the state leaving its
/// segment, or backward the gradient of the state entering it), from the exclusive one.
template <class ExecutionSpace, class MemorySpace>
void segment_state_inclusive(const ExecutionSpace& exec,
                             const ConstTensor2<float, MemorySpace>& decay,     // (rows, decay width)
                             const ConstTensor2<float, MemorySpace>& local,     // (rows, width)
                             const ConstTensor2<float, MemorySpace>& incoming,  // (rows, width)
                             const Tensor2<float, MemorySpace>& inclusive) {    // (rows, width)
  const std::size_t rows = local.extent(0), width = local.extent(1), decay_width = decay.extent(1);
  KMAMBA_REQUIRE(decay.extent(0) == rows && incoming.extent(0) == rows && incoming.extent(1) == width &&
                     inclusive.extent(0) == rows && inclusive.extent(1) == width && decay_width > 0 &&
                     width % decay_width == 0,
                 "kmamba::segment_state_inclusive: decay (" << decay.extent(0) << ", " << decay_width << "), local ("
                                                            << rows << ", " << width << ") and incoming, inclusive do "
                                                            << "not fit");
  Kokkos::deep_copy(exec, inclusive, local);
  Kokkos::parallel_for(
      "kmamba::segment_scan::inclusive",
      Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::int64_t>>(exec, 0,
                                                                           static_cast<std::int64_t>(rows * width)),
      SegmentScanStateFunctor<MemorySpace>{incoming, decay, decay, inclusive, Tensor2<float, MemorySpace>(),
                                           static_cast<int>(width), static_cast<int>(width / decay_width)});
}

}  // namespace impl
}  // namespace kmamba

#endif
