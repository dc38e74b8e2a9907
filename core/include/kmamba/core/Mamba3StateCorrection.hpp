// The Mamba-3 incoming-state correction (docs/algorithms.md §3.9): what sequence parallelism needs
// to scan the segments of a sequence at the same time (docs/distributed.md §2.3). A Mamba-3 scan
// carries four states; the angle and the previous token's k and v are known before any scan (the
// angle from the ranks' angle totals, k and v from the previous segment's last token), the SSM state
// is not. The scan is linear in its initial SSM state h_in, which enters every output only through
// the state Ĥ_{−1} = h_in + β̃_0·Σ_r v_{−1,r} k_{−1,r}ᵀ entering the first chunk, so
//
//   y_t,r(h_in)  = y_t,r(0) + exp(cs_t)·h_in·q_t,r          cs_t = Σ_{s ≤ t} adt_s inside the segment
//   out_t(h_in)  = out_t(0) + Σ_r exp(cs_t)·(h_in·q_t,r) ⊙ silu(z_t ⊙ mimo_z_r) ⊙ mimo_o_r
//   ssm(h_in)    = ssm(0) + exp(cs_{L−1})·h_in
//
// per (batch, head), q_t,r the rotated, biased query (rotated by the angles from the initial angle
// state); SISO is rank 1 with unit projections (no silu factor without z). The ops:
//
//   kmamba::mamba3_segment_states(exec, args, {angle, {}, k, v}, decay);  // without the scan
//   kmamba::mamba3_siso_forward(exec, args, out, final_states);           // h_in = 0
//   ... h_in from the segments' (decay, final ssm) pairs ...
//   kmamba::mamba3_state_correction_forward(exec, args, h_in, out, {});
//
// and in the backward mamba3_state_correction_backward (the outputs' gradient with respect to h_in),
// mamba3_initial_kv_backward (the initial k and v's gradients through Ĥ_{−1}, before the scan's
// backward computes them) and mamba3_final_angle_backward (what a final-angle cotangent adds to the
// gradients of the angles and dt, after it). The products run on the SSD's correction
// (kmamba/core/SsdStateCorrection.hpp) with the rotated q rows as its C, in fp32. Every op is
// non-blocking on the execution space instance it is given, except that temporary buffers are
// released on return.
//
// Packed rows (args.seq_idx, as the scan's): the states entering the segment belong to its first
// document and the final states are its last one's, so h_in reaches the outputs only before the
// first document start s > 0 and the final state only without one (the segment's decay is then 0),
// the final angle totals the increments from the last start on (without θ_{−1}), and a final-angle
// cotangent reaches only the tokens from that start on. A start at the segment's first token (a
// document beginning where the previous segment ends) is the caller's to apply: it zeroes the states
// entering the segment and the decay the segment passes on (docs/distributed.md §2.4).
#ifndef KMAMBA_CORE_MAMBA3STATECORRECTION_HPP
#define KMAMBA_CORE_MAMBA3STATECORRECTION_HPP

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Mamba3Scan.hpp>
#include <kmamba/core/Profiling.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/Mamba3StateCorrectionImpl.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>

namespace kmamba {
namespace impl {

// The scan's argument checks and chunk size, per variant.
template <class MemorySpace>
Mamba3Dims mamba3_correction_check(const char* function, const Mamba3SisoArgs<MemorySpace>& args) {
  return mamba3_check_siso_args(function, args);
}
template <class MemorySpace>
Mamba3Dims mamba3_correction_check(const char* function, const Mamba3MimoArgs<MemorySpace>& args) {
  return mamba3_check_mimo_args(function, args);
}
template <class MemorySpace>
int mamba3_correction_chunk(const Mamba3SisoArgs<MemorySpace>& args, const Mamba3Dims&) {
  return args.chunk_size;
}
template <class MemorySpace>
int mamba3_correction_chunk(const Mamba3MimoArgs<MemorySpace>& args, const Mamba3Dims& dims) {
  return mamba3_mimo_chunk_size(args.chunk_size, dims.rank);
}
template <class MemorySpace>
void mamba3_correction_check_states(const char* function, const char* what, const Mamba3SisoStates<MemorySpace>& s,
                                    const Mamba3Dims& dims) {
  mamba3_check_siso_states(function, what, s, dims);
}
template <class MemorySpace>
void mamba3_correction_check_states(const char* function, const char* what, const Mamba3MimoStates<MemorySpace>& s,
                                    const Mamba3Dims& dims) {
  mamba3_check_mimo_states(function, what, s, dims);
}

template <class ExecutionSpace, class Args, class States, class MemorySpace>
void mamba3_segment_states_op(const ExecutionSpace& exec, const Args& args, const States& states,
                              const Tensor2<float, MemorySpace>& decay) {
  constexpr const char* function = "kmamba::mamba3_segment_states";
  const Mamba3Dims dims = mamba3_correction_check(function, args);
  KMAMBA_REQUIRE(!states.ssm.is_allocated(), function << ": states.ssm must be absent (it needs the scan)");
  mamba3_correction_check_states(function, "states", states, dims);
  if (decay.is_allocated()) check_shape(function, "decay", decay, {dims.batch, dims.nheads}, "(batch, nheads)");
  KMAMBA_REQUIRE(dims.seqlen >= 1, function << ": the segment must hold at least one token");
  mamba3_segment_states_impl(exec, mamba3_plan<ExecutionSpace>(function, dims, mamba3_correction_chunk(args, dims)),
                             mamba3_operands(args), mamba3_state_views(states), decay);
}

template <class ExecutionSpace, class Args, class MemorySpace>
void mamba3_state_correction_forward_op(const ExecutionSpace& exec, const Args& args,
                                        const ConstTensor4<float, MemorySpace>& incoming,
                                        const Tensor4<float, MemorySpace>& out,
                                        const Tensor4<float, MemorySpace>& final_ssm) {
  constexpr const char* function = "kmamba::mamba3_state_correction_forward";
  const Mamba3Dims dims = mamba3_correction_check(function, args);
  const Shape state{dims.batch, dims.nheads, dims.headdim, dims.dstate};
  check_shape(function, "incoming", incoming, state, "(batch, nheads, headdim, dstate)");
  check_allocated(function, "incoming", incoming);
  check_shape(function, "out", out, {dims.batch, dims.seqlen, dims.nheads, dims.headdim},
              "(batch, seqlen, nheads, headdim)");
  check_allocated(function, "out", out);
  if (final_ssm.is_allocated())
    check_shape(function, "final_ssm", final_ssm, state, "(batch, nheads, headdim, dstate)");
  mamba3_state_correction_forward_impl(exec,
                                       mamba3_plan<ExecutionSpace>(function, dims, mamba3_correction_chunk(args, dims)),
                                       mamba3_operands(args), incoming, out, final_ssm);
}

template <class ExecutionSpace, class Args, class MemorySpace>
void mamba3_state_correction_backward_op(const ExecutionSpace& exec, const Args& args,
                                         const ConstTensor4<float, MemorySpace>& dout,
                                         const Tensor4<float, MemorySpace>& dincoming) {
  constexpr const char* function = "kmamba::mamba3_state_correction_backward";
  const Mamba3Dims dims = mamba3_correction_check(function, args);
  check_shape(function, "dout", dout, {dims.batch, dims.seqlen, dims.nheads, dims.headdim},
              "(batch, seqlen, nheads, headdim)");
  check_allocated(function, "dout", dout);
  check_shape(function, "dincoming", dincoming, {dims.batch, dims.nheads, dims.headdim, dims.dstate},
              "(batch, nheads, headdim, dstate)");
  check_allocated(function, "dincoming", dincoming);
  mamba3_state_correction_backward_impl(
      exec, mamba3_plan<ExecutionSpace>(function, dims, mamba3_correction_chunk(args, dims)), mamba3_operands(args),
      dout, dincoming);
}

template <class ExecutionSpace, class Args, class States, class MemorySpace>
void mamba3_initial_kv_backward_op(const ExecutionSpace& exec, const Args& args,
                                   const ConstTensor4<float, MemorySpace>& dentering, const States& dinitial) {
  constexpr const char* function = "kmamba::mamba3_initial_kv_backward";
  const Mamba3Dims dims = mamba3_correction_check(function, args);
  check_shape(function, "dentering", dentering, {dims.batch, dims.nheads, dims.headdim, dims.dstate},
              "(batch, nheads, headdim, dstate)");
  check_allocated(function, "dentering", dentering);
  KMAMBA_REQUIRE(!dinitial.angle.is_allocated() && !dinitial.ssm.is_allocated(),
                 function << ": dinitial.angle and dinitial.ssm must be absent (only k and v are written)");
  mamba3_correction_check_states(function, "dinitial", dinitial, dims);
  KMAMBA_REQUIRE(dims.seqlen >= 1, function << ": the segment must hold at least one token");
  const Mamba3Plan plan = mamba3_plan<ExecutionSpace>(function, dims, mamba3_correction_chunk(args, dims));
  mamba3_launch(
      exec, "kmamba::mamba3_state_correction::initial_kv_backward", plan, plan.batch * plan.nheads,
      Mamba3InitialStateBackwardFunctor<ExecutionSpace, MemorySpace>{
          mamba3_operands(args), dentering, Tensor2<float, MemorySpace>(), plan, mamba3_state_views(dinitial)},
      0);
}

}  // namespace impl

/// Writes, for each allocated view of `states` (angle, k, v; ssm must be absent), the final state
/// the scan of `args` ends in, and when allocated decay(b, h) = exp(Σ_t adt[b, h, t]), the factor by
/// which the segment scales an SSM state entering it (0 where a packed document starts inside the
/// segment); without running the scan. Reads the angles, dt, the last token's k, v, the initial
/// angle (zero when absent) and args.seq_idx.
template <class ExecutionSpace, class MemorySpace>
void mamba3_segment_states(const ExecutionSpace& exec, const Mamba3SisoArgs<MemorySpace>& args,
                           const Mamba3SisoStates<MemorySpace>& states,
                           const Tensor2<float, MemorySpace>& decay) {  // (batch, nheads), optional
  const ProfilingRegion region("kmamba::mamba3_segment_states");
  impl::mamba3_segment_states_op(exec, args, states, decay);
}

template <class ExecutionSpace, class MemorySpace>
void mamba3_segment_states(const ExecutionSpace& exec, const Mamba3MimoArgs<MemorySpace>& args,
                           const Mamba3MimoStates<MemorySpace>& states,
                           const Tensor2<float, MemorySpace>& decay) {  // (batch, nheads), optional
  const ProfilingRegion region("kmamba::mamba3_segment_states");
  impl::mamba3_segment_states_op(exec, args, states, decay);
}

template <class Args, class States, class MemorySpace>
void mamba3_segment_states(const Args& args, const States& states,
                           const Tensor2<float, MemorySpace>& decay) {  // (batch, nheads), optional
  mamba3_segment_states(typename Tensor2<float, MemorySpace>::execution_space(), args, states, decay);
}

/// Adds the contribution of the SSM state `incoming` entering the segment (file comment) to `out`
/// (and to args.ungated_out, SISO, when allocated) and, when allocated, exp(cs_{L−1})·incoming to
/// `final_ssm`. `out` and `final_ssm` hold the scan's results from a zero initial SSM state and the
/// initial angle, k and v of `args` (args.initial.ssm is not read); afterwards they equal the scan's
/// results from `incoming`, up to fp32 rounding.
template <class ExecutionSpace, class MemorySpace>
void mamba3_state_correction_forward(
    const ExecutionSpace& exec, const Mamba3SisoArgs<MemorySpace>& args,
    const ConstTensor4<float, impl::Mamba3NonDeduced<MemorySpace>>& incoming,  // (batch, nheads, headdim, dstate)
    const Tensor4<float, MemorySpace>& out,                                    // (batch, seqlen, nheads, headdim)
    const Tensor4<float, MemorySpace>& final_ssm) {  // (batch, nheads, headdim, dstate), optional
  const ProfilingRegion region("kmamba::mamba3_state_correction_forward");
  impl::mamba3_state_correction_forward_op(exec, args, incoming, out, final_ssm);
}

template <class ExecutionSpace, class MemorySpace>
void mamba3_state_correction_forward(
    const ExecutionSpace& exec, const Mamba3MimoArgs<MemorySpace>& args,
    const ConstTensor4<float, impl::Mamba3NonDeduced<MemorySpace>>& incoming,  // (batch, nheads, headdim, dstate)
    const Tensor4<float, MemorySpace>& out,                                    // (batch, seqlen, nheads, headdim)
    const Tensor4<float, MemorySpace>& final_ssm) {  // (batch, nheads, headdim, dstate), optional
  const ProfilingRegion region("kmamba::mamba3_state_correction_forward");
  impl::mamba3_state_correction_forward_op(exec, args, incoming, out, final_ssm);
}

template <class Args, class MemorySpace>
void mamba3_state_correction_forward(
    const Args& args, const ConstTensor4<float, impl::Mamba3NonDeduced<MemorySpace>>& incoming,  // (b, H, P, N)
    const Tensor4<float, MemorySpace>& out,                                                      // (b, L, H, P)
    const Tensor4<float, MemorySpace>& final_ssm) {  // (batch, nheads, headdim, dstate), optional
  mamba3_state_correction_forward(typename Tensor4<float, MemorySpace>::execution_space(), args, incoming, out,
                                  final_ssm);
}

/// Writes dincoming = Σ_t,r exp(cs_t)·g_t,r ⊗ q_t,r per (batch, head), g_t,r = dout_t ⊙ silu(z_t ⊙
/// mimo_z_r) ⊙ mimo_o_r: the gradient of Σ out·dout with respect to the incoming SSM state (the
/// part through the final state, decay·dfinal, is the caller's). The other gradients of the
/// corrected segment are those of the scan's backward from args.initial.ssm = incoming.
template <class ExecutionSpace, class MemorySpace>
void mamba3_state_correction_backward(
    const ExecutionSpace& exec, const Mamba3SisoArgs<MemorySpace>& args,
    const ConstTensor4<float, impl::Mamba3NonDeduced<MemorySpace>>& dout,  // (batch, seqlen, nheads, headdim)
    const Tensor4<float, MemorySpace>& dincoming) {                        // (batch, nheads, headdim, dstate)
  const ProfilingRegion region("kmamba::mamba3_state_correction_backward");
  impl::mamba3_state_correction_backward_op(exec, args, dout, dincoming);
}

template <class ExecutionSpace, class MemorySpace>
void mamba3_state_correction_backward(
    const ExecutionSpace& exec, const Mamba3MimoArgs<MemorySpace>& args,
    const ConstTensor4<float, impl::Mamba3NonDeduced<MemorySpace>>& dout,  // (batch, seqlen, nheads, headdim)
    const Tensor4<float, MemorySpace>& dincoming) {                        // (batch, nheads, headdim, dstate)
  const ProfilingRegion region("kmamba::mamba3_state_correction_backward");
  impl::mamba3_state_correction_backward_op(exec, args, dout, dincoming);
}

template <class Args, class MemorySpace>
void mamba3_state_correction_backward(
    const Args& args,
    const ConstTensor4<float, impl::Mamba3NonDeduced<MemorySpace>>& dout,  // (batch, seqlen, nheads, headdim)
    const Tensor4<float, MemorySpace>& dincoming) {                        // (batch, nheads, headdim, dstate)
  mamba3_state_correction_backward(typename Tensor4<float, MemorySpace>::execution_space(), args, dout, dincoming);
}

/// Writes the gradients of the initial k and v states of `args` (each when allocated in
/// `dinitial`; angle and ssm must be absent) given dentering, the gradient with respect to the state
/// Ĥ_{−1} entering the scan: dk_r = β̃_0·dĤᵀ·v_{−1,r}, dv_r = β̃_0·dĤ·k_{−1,r}, β̃_0 = (1 − σ(trap_0))·dt_0.
/// They are what the scan's backward writes in its dinitial k and v, available before it runs.
template <class ExecutionSpace, class MemorySpace>
void mamba3_initial_kv_backward(
    const ExecutionSpace& exec, const Mamba3SisoArgs<MemorySpace>& args,
    const ConstTensor4<float, impl::Mamba3NonDeduced<MemorySpace>>& dentering,  // (batch, nheads, headdim, dstate)
    const Mamba3SisoStates<MemorySpace>& dinitial) {
  const ProfilingRegion region("kmamba::mamba3_initial_kv_backward");
  impl::mamba3_initial_kv_backward_op(exec, args, dentering, dinitial);
}

template <class ExecutionSpace, class MemorySpace>
void mamba3_initial_kv_backward(
    const ExecutionSpace& exec, const Mamba3MimoArgs<MemorySpace>& args,
    const ConstTensor4<float, impl::Mamba3NonDeduced<MemorySpace>>& dentering,  // (batch, nheads, headdim, dstate)
    const Mamba3MimoStates<MemorySpace>& dinitial) {
  const ProfilingRegion region("kmamba::mamba3_initial_kv_backward");
  impl::mamba3_initial_kv_backward_op(exec, args, dentering, dinitial);
}

template <class MemorySpace>
void mamba3_initial_kv_backward(
    const Mamba3SisoArgs<MemorySpace>& args,
    const ConstTensor4<float, impl::Mamba3NonDeduced<MemorySpace>>& dentering,  // (batch, nheads, headdim, dstate)
    const Mamba3SisoStates<MemorySpace>& dinitial) {
  mamba3_initial_kv_backward(typename Tensor4<float, MemorySpace>::execution_space(), args, dentering, dinitial);
}

template <class MemorySpace>
void mamba3_initial_kv_backward(
    const Mamba3MimoArgs<MemorySpace>& args,
    const ConstTensor4<float, impl::Mamba3NonDeduced<MemorySpace>>& dentering,  // (batch, nheads, headdim, dstate)
    const Mamba3MimoStates<MemorySpace>& dinitial) {
  mamba3_initial_kv_backward(typename Tensor4<float, MemorySpace>::execution_space(), args, dentering, dinitial);
}

/// Adds to `dangles` and `ddt` (the scan's gradients, SISO or MIMO) what a cotangent dfinal_angle
/// of the final angle state gives them: θ_{L−1} = θ_{−1} + Σ_t π·tanh(φ_t)·dt_t, so dφ_t,i +=
/// G_i·π·dt_t·(1 − tanh²φ_t,i) and ddt_t += Σ_i G_i·π·tanh φ_t,i with G = dfinal_angle (the reduction
/// mod 2π counts as the identity, as in the scan's backward). With packed ids (the scan's
/// seq_idx) the sum runs from the row's last document start on, and only those tokens take G.
template <class ExecutionSpace, class MemorySpace>
void mamba3_final_angle_backward(
    const ExecutionSpace& exec,
    const ConstTensor4<float, impl::Mamba3NonDeduced<MemorySpace>>& angles,        // (batch, seqlen, nheads, nangles)
    const ConstTensor3<float, impl::Mamba3NonDeduced<MemorySpace>>& dt,            // (batch, nheads, seqlen)
    const ConstTensor3<float, impl::Mamba3NonDeduced<MemorySpace>>& dfinal_angle,  // (batch, nheads, nangles)
    const Tensor4<float, MemorySpace>& dangles,                                    // (batch, seqlen, nheads, nangles)
    const Tensor3<float, MemorySpace>& ddt,                                        // (batch, nheads, seqlen)
    const ConstTensor2<std::int64_t, impl::Mamba3NonDeduced<MemorySpace>>& seq_idx = {}) {  // (batch, seqlen)
  const ProfilingRegion region("kmamba::mamba3_final_angle_backward");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::mamba3_final_angle_backward: the execution space cannot access the tensors' memory space");
  constexpr const char* function = "kmamba::mamba3_final_angle_backward";
  check_allocated(function, "angles", angles);
  const std::int64_t batch = static_cast<std::int64_t>(angles.extent(0)), seqlen = angles.extent(1);
  const std::int64_t nheads = static_cast<std::int64_t>(angles.extent(2)), nangles = angles.extent(3);
  const Shape per_token{batch, nheads, seqlen}, per_angle{batch, seqlen, nheads, nangles};
  check_shape(function, "dt", dt, per_token, "(batch, nheads, seqlen)");
  check_shape(function, "dfinal_angle", dfinal_angle, {batch, nheads, nangles}, "(batch, nheads, nangles)");
  check_shape(function, "dangles", dangles, per_angle, "(batch, seqlen, nheads, nangles)");
  check_shape(function, "ddt", ddt, per_token, "(batch, nheads, seqlen)");
  check_allocated(function, "dt", dt);
  check_allocated(function, "dfinal_angle", dfinal_angle);
  check_allocated(function, "dangles", dangles);
  check_allocated(function, "ddt", ddt);
  if (seq_idx.is_allocated()) check_shape(function, "seq_idx", seq_idx, {batch, seqlen}, "(batch, seqlen)");
  impl::mamba3_final_angle_backward_impl(exec,
                                         impl::Mamba3FinalAngleBackwardFunctor<ExecutionSpace, MemorySpace>{
                                             angles, dt, dfinal_angle, seq_idx, dangles, ddt, static_cast<int>(seqlen),
                                             static_cast<int>(nheads), static_cast<int>(nangles)},
                                         static_cast<int>(batch));
}

template <class MemorySpace>
void mamba3_final_angle_backward(
    const ConstTensor4<float, impl::Mamba3NonDeduced<MemorySpace>>& angles,        // (batch, seqlen, nheads, nangles)
    const ConstTensor3<float, impl::Mamba3NonDeduced<MemorySpace>>& dt,            // (batch, nheads, seqlen)
    const ConstTensor3<float, impl::Mamba3NonDeduced<MemorySpace>>& dfinal_angle,  // (batch, nheads, nangles)
    const Tensor4<float, MemorySpace>& dangles,                                    // (batch, seqlen, nheads, nangles)
    const Tensor3<float, MemorySpace>& ddt,                                        // (batch, nheads, seqlen)
    const ConstTensor2<std::int64_t, impl::Mamba3NonDeduced<MemorySpace>>& seq_idx = {}) {  // (batch, seqlen)
  mamba3_final_angle_backward(typename Tensor4<float, MemorySpace>::execution_space(), angles, dt, dfinal_angle,
                              dangles, ddt, seq_idx);
}

}  // namespace kmamba

#endif
