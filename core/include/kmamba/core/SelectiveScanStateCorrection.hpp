// The selective scan's incoming-state correction (docs/algorithms.md §1.7): what a state entering a
// segment adds to the outputs and the last state of a selective scan run from a zero state. The
// scan is linear in its initial state and its decay is diagonal, per (channel d, state n), so for a
// segment scanned with initial state h_in
//
//   Δ_t             = Σ_{s ≤ t} δ_s                         inside the segment, per (batch, channel)
//   out_t(h_in)     = out_t(0) + g_t·Σ_n C_{t,n}·exp(A[d,n]·Δ_t)·h_in[d,n]
//   last(h_in)[d,n] = last(0)[d,n] + exp(A[d,n]·Δ_{L−1})·h_in[d,n]
//
// with δ the scan's (delta + delta_bias, softplus when asked), C_t the channel's group's and
// g_t = silu(z_t) (1 without z): the gate multiplies the state's part of the output as it does the
// rest, so the correction adds to the gated output. Sequence parallelism scans every segment from
// zero at the same time, combines the segments' (decay, last state) pairs across the ranks, and
// adds each rank's incoming state with selective_scan_state_correction_forward
// (docs/distributed.md §2.2). The gradient with respect to the incoming state,
// Σ_t exp(A[d,n]·Δ_t)·C_{t,n}·g_t·dout_t, is what the same ranks combine in reverse order in the
// backward. Every op is non-blocking on the execution space instance it is given, except that its
// temporary buffer is released on return.
//
// Packed rows (args.seq_idx): the incoming state belongs to the segment's first document. From
// the first token t > 0 whose id differs from the previous one's on, exp(A[d,n]·Δ_t) is taken as 0
// (Δ_t = +∞ there): the incoming state reaches neither those outputs nor the last state, takes no
// gradient from them, and a segment holding a start has decay 0. Whether the segment's first token
// itself starts a document is for the caller to say (it needs the previous segment's last id):
// there the incoming state is 0.
//
//   kmamba::selective_scan_forward(exec, args, out, last_state);       // from a zero state
//   kmamba::selective_scan_segment_decay(exec, args, decay);           // exp(A·Δ_{L−1})
//   ... h_in from the previous segments' (decay, last_state) ...
//   kmamba::selective_scan_state_correction_forward(exec, args, h_in, out, last_state);
#ifndef KMAMBA_CORE_SELECTIVESCANSTATECORRECTION_HPP
#define KMAMBA_CORE_SELECTIVESCANSTATECORRECTION_HPP

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Profiling.hpp>
#include <kmamba/core/SelectiveScan.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/SelectiveScanStateCorrectionImpl.hpp>

#include <Kokkos_Core.hpp>

namespace kmamba {

/// decay(b, d, n) = exp(A[d,n]·Σ_t δ_t) over the segment of `args` (1 for an empty segment, 0 for a
/// row with a document start after its first token): the factor by which the segment scales a state
/// entering it. Reads delta, delta_bias, A, seq_idx and the softplus option of `args`; u, B and C
/// only for their shapes.
template <class ExecutionSpace, class MemorySpace>
void selective_scan_segment_decay(const ExecutionSpace& exec, const SelectiveScanArgs<MemorySpace>& args,
                                  const Tensor3<float, MemorySpace>& decay) {  // (batch, dim, dstate)
  const ProfilingRegion region("kmamba::selective_scan_segment_decay");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::selective_scan_segment_decay: the execution space cannot access the tensors' memory space");
  constexpr const char* function = "kmamba::selective_scan_segment_decay";
  const impl::SelectiveScanDims dims = impl::selective_scan_check_args(function, args);
  check_shape(function, "decay", decay, {dims.batch, dims.dim, dims.dstate}, "(batch, dim, dstate)");
  check_allocated(function, "decay", decay);
  const impl::ScanCorrectionOperands<MemorySpace> in(args, dims);
  impl::selective_scan_carry_state(exec, in, impl::selective_scan_cumulative_delta(exec, in),
                                   ConstTensor3<float, MemorySpace>(), decay);
}

/// Adds the contribution of the state `incoming` entering the segment to `out` and, when
/// allocated, to `last_state` (file comment). `out` and `last_state` hold the scan's results from
/// a zero initial state (args.initial_state is not read); afterwards they equal the scan's results
/// from `incoming`, up to fp32 rounding.
template <class ExecutionSpace, class MemorySpace>
void selective_scan_state_correction_forward(
    const ExecutionSpace& exec, const SelectiveScanArgs<MemorySpace>& args,
    const ConstTensor3<float, impl::NonDeduced<MemorySpace>>& incoming,  // (batch, dim, dstate)
    const Tensor3<float, MemorySpace>& out,                              // (batch, dim, seqlen)
    const Tensor3<float, MemorySpace>& last_state) {                     // (batch, dim, dstate), optional
  const ProfilingRegion region("kmamba::selective_scan_state_correction_forward");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::selective_scan_state_correction_forward: the execution space cannot access the tensors' "
                "memory space");
  constexpr const char* function = "kmamba::selective_scan_state_correction_forward";
  const impl::SelectiveScanDims dims = impl::selective_scan_check_args(function, args);
  const Shape state{dims.batch, dims.dim, dims.dstate};
  check_shape(function, "incoming", incoming, state, "(batch, dim, dstate)");
  check_allocated(function, "incoming", incoming);
  check_shape(function, "out", out, {dims.batch, dims.dim, dims.seqlen}, "(batch, dim, seqlen)");
  check_allocated(function, "out", out);
  if (last_state.is_allocated()) check_shape(function, "last_state", last_state, state, "(batch, dim, dstate)");
  const impl::ScanCorrectionOperands<MemorySpace> in(args, dims);
  const auto cumulative = impl::selective_scan_cumulative_delta(exec, in);
  impl::selective_scan_correct_outputs(exec, in, cumulative, incoming, out);
  if (last_state.is_allocated()) impl::selective_scan_carry_state(exec, in, cumulative, incoming, last_state);
}

/// Writes dincoming = Σ_t exp(A[d,n]·Δ_t)·C_{t,n}·g_t·dout_t per (batch, channel, state): the
/// gradient of Σ out·dout with respect to the incoming state (the part through the outputs; the
/// part through the last state is decay·dlast_state, which the caller adds where it combines the
/// segments). The gradients with respect to u, delta, A, B, C, D, z and delta_bias of the corrected
/// segment are those of selective_scan_backward with args.initial_state = incoming.
template <class ExecutionSpace, class MemorySpace>
void selective_scan_state_correction_backward(
    const ExecutionSpace& exec, const SelectiveScanArgs<MemorySpace>& args,
    const ConstTensor3<float, impl::NonDeduced<MemorySpace>>& dout,  // (batch, dim, seqlen)
    const Tensor3<float, MemorySpace>& dincoming) {                  // (batch, dim, dstate)
  const ProfilingRegion region("kmamba::selective_scan_state_correction_backward");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::selective_scan_state_correction_backward: the execution space cannot access the tensors' "
                "memory space");
  constexpr const char* function = "kmamba::selective_scan_state_correction_backward";
  const impl::SelectiveScanDims dims = impl::selective_scan_check_args(function, args);
  check_shape(function, "dout", dout, {dims.batch, dims.dim, dims.seqlen}, "(batch, dim, seqlen)");
  check_allocated(function, "dout", dout);
  check_shape(function, "dincoming", dincoming, {dims.batch, dims.dim, dims.dstate}, "(batch, dim, dstate)");
  check_allocated(function, "dincoming", dincoming);
  const impl::ScanCorrectionOperands<MemorySpace> in(args, dims);
  impl::selective_scan_incoming_state_grad(exec, in, impl::selective_scan_cumulative_delta(exec, in), dout, dincoming);
}

}  // namespace kmamba

#endif
