// The SSD's incoming-state correction (docs/algorithms.md §2.11): what a state entering a segment
// adds to the outputs and the final state of an SSD scanned from a zero state. The SSD is linear in
// its initial state, so for a segment scanned with initial state h_in
//
//   out_t(h_in)   = out_t(0) + exp(cs_t)·h_in·C_t          cs_t = Σ_{s ≤ t} a_s inside the segment
//   final(h_in)   = final(0) + exp(cs_{L−1})·h_in          (a_s = δ_s·A[h] or SsdArgs::log_decay)
//
// per (batch, head), C_t the head's group's. With packed sequence ids (SsdArgs::seq_idx) the incoming
// state belongs to the segment's first document: exp(cs_t) is taken as 0 from the first document
// start (t > 0) on, so the decay of a segment with a start inside is 0. Sequence parallelism scans every segment from
// zero at the same time, combines the segments' (decay, final state) pairs across the ranks, and adds each rank's
// incoming state with ssd_state_correction_forward (docs/distributed.md §2.1). The gradient with respect to the
// incoming state, Σ_t exp(cs_t)·C_t·dout_tᵀ, is what the same ranks combine in reverse order in the backward. δ is the
// SSD's: dt + dt_bias, softplus when asked, clamped to [dt_min, dt_max]. Every op is non-blocking on the execution
// space instance it is given, except that its temporary buffer is released on return.
//
//   kmamba::ssd_forward(exec, args, out, final_states);              // from a zero state
//   kmamba::ssd_segment_decay(exec, args, decay);                    // exp(cs_{L−1}) per (b, h)
//   ... h_in from the previous segments' (decay, final_states) ...
//   kmamba::ssd_state_correction_forward(exec, args, h_in, out, final_states);
#ifndef KMAMBA_CORE_SSDSTATECORRECTION_HPP
#define KMAMBA_CORE_SSDSTATECORRECTION_HPP

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Profiling.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Ssd.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/SsdOperands.hpp>
#include <kmamba/core/impl/SsdStateCorrectionImpl.hpp>

#include <Kokkos_Core.hpp>

namespace kmamba {
namespace impl {

// The SSD's argument checks, and the two inputs the correction does not take: a gate (the
// correction adds to the ungated output, so a gated SSD must leave the gate to its caller).
template <class MemorySpace>
SsdDims ssd_state_correction_check_args(const char* function, const SsdArgs<MemorySpace>& args) {
  const SsdDims dims = ssd_check_args(function, args);
  KMAMBA_REQUIRE(!args.z.is_allocated(), function << ": z must be absent (the correction adds to the ungated output; "
                                                     "apply the gate after it)");
  return dims;
}

}  // namespace impl

/// decay(b, h) = exp(Σ_t a_t) over the segment of `args` (1 for an empty segment): the factor by
/// which the segment scales a state entering it. Reads dt, dt_bias, A (or log_decay) and the dt
/// options of `args`; x, B and C only for their shapes.
template <class ExecutionSpace, class MemorySpace>
void ssd_segment_decay(const ExecutionSpace& exec, const SsdArgs<MemorySpace>& args,
                       const Tensor2<float, MemorySpace>& decay) {  // (batch, nheads)
  const ProfilingRegion region("kmamba::ssd_segment_decay");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::ssd_segment_decay: the execution space cannot access the tensors' memory space");
  constexpr const char* function = "kmamba::ssd_segment_decay";
  const impl::SsdDims dims = impl::ssd_state_correction_check_args(function, args);
  check_shape(function, "decay", decay, {dims.batch, dims.nheads}, "(batch, nheads)");
  check_allocated(function, "decay", decay);
  impl::ssd_segment_decay_impl(exec, impl::ssd_plan<ExecutionSpace>(function, dims, args.chunk_size),
                               impl::SsdOperands<MemorySpace>(args), decay);
}

/// Adds the contribution of the state `incoming` entering the segment: out_t += exp(cs_t)·incoming·C_t
/// and, when allocated, final_states += exp(cs_{L−1})·incoming (file comment). `out` and
/// `final_states` hold the SSD's results from a zero initial state (args.initial_states is not
/// read); afterwards they equal the SSD's results from `incoming`, up to fp32 rounding.
template <class ExecutionSpace, class MemorySpace>
void ssd_state_correction_forward(
    const ExecutionSpace& exec, const SsdArgs<MemorySpace>& args,
    const ConstTensor4<float, impl::SsdNonDeduced<MemorySpace>>& incoming,  // (batch, nheads, headdim, dstate)
    const Tensor4<float, MemorySpace>& out,                                 // (batch, seqlen, nheads, headdim)
    const Tensor4<float, MemorySpace>& final_states) {  // (batch, nheads, headdim, dstate), optional
  const ProfilingRegion region("kmamba::ssd_state_correction_forward");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::ssd_state_correction_forward: the execution space cannot access the tensors' memory space");
  constexpr const char* function = "kmamba::ssd_state_correction_forward";
  const impl::SsdDims dims = impl::ssd_state_correction_check_args(function, args);
  const Shape state{dims.batch, dims.nheads, dims.headdim, dims.dstate};
  check_shape(function, "incoming", incoming, state, "(batch, nheads, headdim, dstate)");
  check_allocated(function, "incoming", incoming);
  check_shape(function, "out", out, {dims.batch, dims.seqlen, dims.nheads, dims.headdim},
              "(batch, seqlen, nheads, headdim)");
  check_allocated(function, "out", out);
  if (final_states.is_allocated()) {
    check_shape(function, "final_states", final_states, state, "(batch, nheads, headdim, dstate)");
  }
  impl::ssd_state_correction_forward_impl(exec, impl::ssd_plan<ExecutionSpace>(function, dims, args.chunk_size),
                                          impl::SsdOperands<MemorySpace>(args), incoming, out, final_states);
}

/// Writes dincoming = Σ_t exp(cs_t)·C_t·dout_tᵀ per (batch, head): the gradient of Σ out·dout with
/// respect to the incoming state (the part through the outputs; the part through the final state
/// is decay·dfinal_states, which the caller adds where it combines the segments). The gradients
/// with respect to x, dt, A, B and C of the corrected segment are those of ssd_backward with
/// args.initial_states = incoming.
template <class ExecutionSpace, class MemorySpace>
void ssd_state_correction_backward(
    const ExecutionSpace& exec, const SsdArgs<MemorySpace>& args,
    const ConstTensor4<float, impl::SsdNonDeduced<MemorySpace>>& dout,  // (batch, seqlen, nheads, headdim)
    const Tensor4<float, MemorySpace>& dincoming) {                     // (batch, nheads, headdim, dstate)
  const ProfilingRegion region("kmamba::ssd_state_correction_backward");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::ssd_state_correction_backward: the execution space cannot access the tensors' memory space");
  constexpr const char* function = "kmamba::ssd_state_correction_backward";
  const impl::SsdDims dims = impl::ssd_state_correction_check_args(function, args);
  check_shape(function, "dout", dout, {dims.batch, dims.seqlen, dims.nheads, dims.headdim},
              "(batch, seqlen, nheads, headdim)");
  check_allocated(function, "dout", dout);
  check_shape(function, "dincoming", dincoming, {dims.batch, dims.nheads, dims.headdim, dims.dstate},
              "(batch, nheads, headdim, dstate)");
  check_allocated(function, "dincoming", dincoming);
  impl::ssd_state_correction_backward_impl(exec, impl::ssd_plan<ExecutionSpace>(function, dims, args.chunk_size),
                                           impl::SsdOperands<MemorySpace>(args), dout, dincoming);
}

}  // namespace kmamba

#endif
