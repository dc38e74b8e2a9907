// Mamba-1 selective scan (reference: state-spaces/mamba `selective_scan_fn`,
// docs/algorithms.md §1.3, §1.4, §1.6): forward, backward and the one-token decode step.
//
// Per batch b, channel d (group g = d / (dim / ngroups)) and state n:
//
//   δ_t    = delta[b,d,t] + delta_bias[d]          then softplus₂₀ when delta_softplus
//   h_t,n  = exp(δ_t·A[d,n])·h_{t−1},n + δ_t·B[b,g,n,t]·u[b,d,t]     h_{−1} = initial_state (or 0)
//   out_t  = (Σ_n C[b,g,n,t]·h_t,n + D[d]·u[b,d,t]) · silu(z[b,d,t])
//   last_state[b,d,n] = h_{L−1},n
//
// Packed sequences: with seq_idx (batch, seqlen), h_{t−1} is taken as 0 where seq_idx[b,t] differs
// from seq_idx[b,t−1] (t ≥ 1), so no state crosses from one packed sequence into the next; the
// initial state belongs to the row's first sequence whatever its id, the last state to its last.
//
// All arithmetic and the running state are fp32. The sequence is walked in chunks, the state
// carried from chunk to chunk, so no (seqlen × dstate) tensor is ever materialised: up to 16
// states the forward and the backward walk each state token after token in a thread's registers
// (the walk form; the backward's tiles last to first from checkpoints); wider states are
// staged a chunk of `chunk_size` tokens at a time in team scratch memory (docs/algorithms.md §1.3).
// Every op is non-blocking on the execution space instance it is given.
//
//   kmamba::SelectiveScanArgs<Mem> args;
//   args.u = u; args.delta = delta; args.A = A; args.B = B; args.C = C;   // required
//   args.D = D; args.z = z; args.delta_bias = delta_bias;                  // optional
//   args.delta_softplus = true;
//   kmamba::selective_scan_forward(exec, args, out, last_state);
#ifndef KMAMBA_CORE_SELECTIVESCAN_HPP
#define KMAMBA_CORE_SELECTIVESCAN_HPP

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Profiling.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/SelectiveScanImpl.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>

namespace kmamba {

/// Inputs of selective_scan_forward / selective_scan_backward. A View left unallocated (default
/// constructed) means "absent" for the optional ones.
template <class MemorySpace>
struct SelectiveScanArgs {
  ConstTensor3<float, MemorySpace> u;               // (batch, dim, seqlen)
  ConstTensor3<float, MemorySpace> delta;           // (batch, dim, seqlen), before bias and softplus
  ConstTensor2<float, MemorySpace> A;               // (dim, dstate), real (negative for a stable scan)
  ConstTensor4<float, MemorySpace> B;               // (batch, ngroups, dstate, seqlen)
  ConstTensor4<float, MemorySpace> C;               // (batch, ngroups, dstate, seqlen)
  ConstTensor1<float, MemorySpace> D;               // (dim), optional skip connection
  ConstTensor3<float, MemorySpace> z;               // (batch, dim, seqlen), optional gate
  ConstTensor1<float, MemorySpace> delta_bias;      // (dim), optional, added to delta
  ConstTensor3<float, MemorySpace> initial_state;   // (batch, dim, dstate), optional (zero if absent)
  ConstTensor2<std::int64_t, MemorySpace> seq_idx;  // (batch, seqlen), optional packed sequence ids
  /// Apply softplus (threshold 20) to delta + delta_bias.
  bool delta_softplus = false;
  /// Tokens per chunk; 0 lets kmamba choose (for dstate ≤ 16 the walk forms, whose tiles are
  /// fixed per backend). Any other value runs the lane form with chunks of that length; one the
  /// team scratch memory cannot hold is a UserError.
  int chunk_size = 0;
};

/// Gradients written by selective_scan_backward. du, ddelta, dA, dB, dC are required; dD,
/// ddelta_bias and dinitial_state are written when allocated (the gradient at the value given, or
/// at zero for an absent D / delta_bias / initial state); dz is required exactly when z is given.
template <class MemorySpace>
struct SelectiveScanGrads {
  Tensor3<float, MemorySpace> du;              // (batch, dim, seqlen)
  Tensor3<float, MemorySpace> ddelta;          // (batch, dim, seqlen), w.r.t. delta before bias/softplus
  Tensor2<float, MemorySpace> dA;              // (dim, dstate)
  Tensor4<float, MemorySpace> dB;              // (batch, ngroups, dstate, seqlen)
  Tensor4<float, MemorySpace> dC;              // (batch, ngroups, dstate, seqlen)
  Tensor1<float, MemorySpace> dD;              // (dim), optional
  Tensor3<float, MemorySpace> dz;              // (batch, dim, seqlen), with z
  Tensor1<float, MemorySpace> ddelta_bias;     // (dim), optional
  Tensor3<float, MemorySpace> dinitial_state;  // (batch, dim, dstate), optional
};

/// Inputs of selective_scan_step (one token per sequence; same meaning as SelectiveScanArgs).
template <class MemorySpace>
struct SelectiveScanStepArgs {
  ConstTensor2<float, MemorySpace> u;           // (batch, dim)
  ConstTensor2<float, MemorySpace> delta;       // (batch, dim)
  ConstTensor2<float, MemorySpace> A;           // (dim, dstate)
  ConstTensor3<float, MemorySpace> B;           // (batch, ngroups, dstate)
  ConstTensor3<float, MemorySpace> C;           // (batch, ngroups, dstate)
  ConstTensor1<float, MemorySpace> D;           // (dim), optional
  ConstTensor2<float, MemorySpace> z;           // (batch, dim), optional
  ConstTensor1<float, MemorySpace> delta_bias;  // (dim), optional
  bool delta_softplus = false;
};

namespace impl {

template <class MemorySpace>
SelectiveScanDims selective_scan_check_args(const char* function, const SelectiveScanArgs<MemorySpace>& args) {
  KMAMBA_REQUIRE(args.A.is_allocated() && args.B.is_allocated() && args.C.is_allocated(),
                 function << ": A, B and C are required");
  SelectiveScanDims dims;
  dims.batch = static_cast<std::int64_t>(args.u.extent(0));
  dims.dim = static_cast<std::int64_t>(args.u.extent(1));
  dims.seqlen = static_cast<std::int64_t>(args.u.extent(2));
  dims.dstate = static_cast<std::int64_t>(args.A.extent(1));
  dims.ngroups = static_cast<std::int64_t>(args.B.extent(1));
  check_allocated(function, "u", args.u);
  check_shape(function, "delta", args.delta, {dims.batch, dims.dim, dims.seqlen}, "(batch, dim, seqlen)");
  check_shape(function, "A", args.A, {dims.dim, dims.dstate}, "(dim, dstate)");
  KMAMBA_REQUIRE(dims.ngroups >= 1 && dims.dim % dims.ngroups == 0,
                 function << ": B has shape " << shape_of(args.B).to_string() << ": ngroups = " << dims.ngroups
                          << " must be positive and divide dim = " << dims.dim);
  KMAMBA_REQUIRE(dims.dstate >= 1,
                 function << ": A has shape " << shape_of(args.A).to_string() << ": dstate must be positive");
  const Shape bc{dims.batch, dims.ngroups, dims.dstate, dims.seqlen};
  check_shape(function, "B", args.B, bc, "(batch, ngroups, dstate, seqlen)");
  check_shape(function, "C", args.C, bc, "(batch, ngroups, dstate, seqlen)");
  if (args.D.is_allocated()) check_shape(function, "D", args.D, {dims.dim}, "(dim)");
  if (args.z.is_allocated())
    check_shape(function, "z", args.z, {dims.batch, dims.dim, dims.seqlen}, "(batch, dim, seqlen)");
  if (args.delta_bias.is_allocated()) check_shape(function, "delta_bias", args.delta_bias, {dims.dim}, "(dim)");
  if (args.initial_state.is_allocated()) {
    check_shape(function, "initial_state", args.initial_state, {dims.batch, dims.dim, dims.dstate},
                "(batch, dim, dstate)");
  }
  if (args.seq_idx.is_allocated())
    check_shape(function, "seq_idx", args.seq_idx, {dims.batch, dims.seqlen}, "(batch, seqlen)");
  KMAMBA_REQUIRE(args.chunk_size >= 0, function << ": chunk_size must be >= 0, got " << args.chunk_size);
  return dims;
}

}  // namespace impl

/// Selective scan forward. Writes `out` = (y + D·u)·silu(z) and, when allocated, `last_state` =
/// the state after the last token (the initial state for seqlen 0). `last_state` may be
/// `args.initial_state` itself: the state is then advanced in place (recurrent prefill; each team
/// reads its channels' initial state before writing their last state). Non-blocking on `exec`.
/// Throws kmamba::UserError for a wrong shape (the message names both shapes) or a chunk_size
/// the team scratch memory cannot hold.
template <class ExecutionSpace, class MemorySpace>
void selective_scan_forward(const ExecutionSpace& exec, const SelectiveScanArgs<MemorySpace>& args,
                            const Tensor3<float, MemorySpace>& out,           // (batch, dim, seqlen)
                            const Tensor3<float, MemorySpace>& last_state) {  // (batch, dim, dstate), optional
  const ProfilingRegion region("kmamba::selective_scan_forward");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::selective_scan_forward: the execution space cannot access the tensors' memory space");
  constexpr const char* function = "kmamba::selective_scan_forward";
  const impl::SelectiveScanDims dims = impl::selective_scan_check_args(function, args);
  check_shape(function, "out", out, {dims.batch, dims.dim, dims.seqlen}, "(batch, dim, seqlen)");
  check_allocated(function, "out", out);
  if (last_state.is_allocated()) {
    check_shape(function, "last_state", last_state, {dims.batch, dims.dim, dims.dstate}, "(batch, dim, dstate)");
  }
  impl::selective_scan_forward_impl<typename impl::SelectiveScanDefaultShapes<ExecutionSpace>::forward>(
      exec, function, dims, args, out, last_state);
}

template <class MemorySpace>
void selective_scan_forward(const SelectiveScanArgs<MemorySpace>& args,
                            const Tensor3<float, MemorySpace>& out,           // (batch, dim, seqlen)
                            const Tensor3<float, MemorySpace>& last_state) {  // (batch, dim, dstate), optional
  selective_scan_forward(typename Tensor3<float, MemorySpace>::execution_space(), args, out, last_state);
}

/// Selective scan backward: the gradients of sum(out·dout) + sum(last_state·dlast_state) with
/// respect to every input (see SelectiveScanGrads for which are written). `dlast_state` is
/// optional (absent = zero). The states are recomputed chunk by chunk from per-chunk checkpoints
/// and the adjoint state is carried backwards through the chunks. dA, dD and ddelta_bias are
/// reduced over batch and seqlen, and dB and dC over the channels of a group, from partial sums
/// in a fixed order (no atomics: every gradient repeats bit for bit from run to run). Non-blocking
/// on `exec`, except that its temporary buffers (per-chunk checkpoints of the state, per-batch
/// partial sums, and partial dB and dC per team's block of channels) are released on return, which waits for the device
/// where freeing memory does (cudaFree).
template <class ExecutionSpace, class MemorySpace>
void selective_scan_backward(
    const ExecutionSpace& exec, const SelectiveScanArgs<MemorySpace>& args,
    const ConstTensor3<float, impl::NonDeduced<MemorySpace>>& dout,         // (batch, dim, seqlen)
    const ConstTensor3<float, impl::NonDeduced<MemorySpace>>& dlast_state,  // (batch, dim, dstate), optional
    const SelectiveScanGrads<MemorySpace>& grads) {
  const ProfilingRegion region("kmamba::selective_scan_backward");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::selective_scan_backward: the execution space cannot access the tensors' memory space");
  constexpr const char* function = "kmamba::selective_scan_backward";
  const impl::SelectiveScanDims dims = impl::selective_scan_check_args(function, args);
  const Shape seq{dims.batch, dims.dim, dims.seqlen};
  const Shape state{dims.batch, dims.dim, dims.dstate};
  const Shape bc{dims.batch, dims.ngroups, dims.dstate, dims.seqlen};
  check_shape(function, "dout", dout, seq, "(batch, dim, seqlen)");
  check_allocated(function, "dout", dout);
  if (dlast_state.is_allocated()) check_shape(function, "dlast_state", dlast_state, state, "(batch, dim, dstate)");
  check_shape(function, "du", grads.du, seq, "(batch, dim, seqlen)");
  check_shape(function, "ddelta", grads.ddelta, seq, "(batch, dim, seqlen)");
  check_shape(function, "dA", grads.dA, {dims.dim, dims.dstate}, "(dim, dstate)");
  check_shape(function, "dB", grads.dB, bc, "(batch, ngroups, dstate, seqlen)");
  check_shape(function, "dC", grads.dC, bc, "(batch, ngroups, dstate, seqlen)");
  check_allocated(function, "du", grads.du);
  check_allocated(function, "ddelta", grads.ddelta);
  check_allocated(function, "dA", grads.dA);
  check_allocated(function, "dB", grads.dB);
  check_allocated(function, "dC", grads.dC);
  if (grads.dD.is_allocated()) check_shape(function, "dD", grads.dD, {dims.dim}, "(dim)");
  if (grads.ddelta_bias.is_allocated()) check_shape(function, "ddelta_bias", grads.ddelta_bias, {dims.dim}, "(dim)");
  if (grads.dinitial_state.is_allocated()) {
    check_shape(function, "dinitial_state", grads.dinitial_state, state, "(batch, dim, dstate)");
  }
  KMAMBA_REQUIRE(args.z.is_allocated() == grads.dz.is_allocated(),
                 function << ": dz must be allocated exactly when z is given (z "
                          << (args.z.is_allocated() ? "given" : "absent") << ", dz "
                          << (grads.dz.is_allocated() ? "allocated" : "absent") << ")");
  if (grads.dz.is_allocated()) check_shape(function, "dz", grads.dz, seq, "(batch, dim, seqlen)");
  using Shapes = impl::SelectiveScanDefaultShapes<ExecutionSpace>;
  impl::selective_scan_backward_impl<typename Shapes::forward, typename Shapes::backward>(exec, function, dims, args,
                                                                                          dout, dlast_state, grads);
}

template <class MemorySpace>
void selective_scan_backward(
    const SelectiveScanArgs<MemorySpace>& args,
    const ConstTensor3<float, impl::NonDeduced<MemorySpace>>& dout,         // (batch, dim, seqlen)
    const ConstTensor3<float, impl::NonDeduced<MemorySpace>>& dlast_state,  // (batch, dim, dstate), optional
    const SelectiveScanGrads<MemorySpace>& grads) {
  selective_scan_backward(typename Tensor3<float, MemorySpace>::execution_space(), args, dout, dlast_state, grads);
}

/// Decode step: advances `state` in place by one token and writes `out` = (C·state + D·u)·silu(z),
/// exactly what selective_scan_forward computes for that token. Non-blocking on `exec`.
template <class ExecutionSpace, class MemorySpace>
void selective_scan_step(const ExecutionSpace& exec, const SelectiveScanStepArgs<MemorySpace>& args,
                         const Tensor3<float, MemorySpace>& state,  // (batch, dim, dstate), updated in place
                         const Tensor2<float, MemorySpace>& out) {  // (batch, dim)
  const ProfilingRegion region("kmamba::selective_scan_step");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::selective_scan_step: the execution space cannot access the tensors' memory space");
  constexpr const char* function = "kmamba::selective_scan_step";
  KMAMBA_REQUIRE(args.A.is_allocated() && args.B.is_allocated() && args.C.is_allocated(),
                 function << ": A, B and C are required");
  impl::SelectiveScanDims dims;
  dims.batch = static_cast<std::int64_t>(args.u.extent(0));
  dims.dim = static_cast<std::int64_t>(args.u.extent(1));
  dims.seqlen = 1;
  dims.dstate = static_cast<std::int64_t>(args.A.extent(1));
  dims.ngroups = static_cast<std::int64_t>(args.B.extent(1));
  check_allocated(function, "u", args.u);
  check_shape(function, "delta", args.delta, {dims.batch, dims.dim}, "(batch, dim)");
  check_shape(function, "A", args.A, {dims.dim, dims.dstate}, "(dim, dstate)");
  KMAMBA_REQUIRE(dims.ngroups >= 1 && dims.dim % dims.ngroups == 0,
                 function << ": B has shape " << shape_of(args.B).to_string() << ": ngroups = " << dims.ngroups
                          << " must be positive and divide dim = " << dims.dim);
  KMAMBA_REQUIRE(dims.dstate >= 1,
                 function << ": A has shape " << shape_of(args.A).to_string() << ": dstate must be positive");
  check_shape(function, "B", args.B, {dims.batch, dims.ngroups, dims.dstate}, "(batch, ngroups, dstate)");
  check_shape(function, "C", args.C, {dims.batch, dims.ngroups, dims.dstate}, "(batch, ngroups, dstate)");
  if (args.D.is_allocated()) check_shape(function, "D", args.D, {dims.dim}, "(dim)");
  if (args.z.is_allocated()) check_shape(function, "z", args.z, {dims.batch, dims.dim}, "(batch, dim)");
  if (args.delta_bias.is_allocated()) check_shape(function, "delta_bias", args.delta_bias, {dims.dim}, "(dim)");
  check_shape(function, "state", state, {dims.batch, dims.dim, dims.dstate}, "(batch, dim, dstate)");
  check_shape(function, "out", out, {dims.batch, dims.dim}, "(batch, dim)");
  check_allocated(function, "state", state);
  check_allocated(function, "out", out);
  impl::selective_scan_step_impl(exec, dims, args, state, out);
}

template <class MemorySpace>
void selective_scan_step(const SelectiveScanStepArgs<MemorySpace>& args,
                         const Tensor3<float, MemorySpace>& state,  // (batch, dim, dstate), updated in place
                         const Tensor2<float, MemorySpace>& out) {  // (batch, dim)
  selective_scan_step(typename Tensor3<float, MemorySpace>::execution_space(), args, state, out);
}

}  // namespace kmamba

#endif
