// Mamba-2 SSD, the chunked state-space scan (reference: state-spaces/mamba
// `mamba_chunk_scan_combined`, docs/algorithms.md §2.4–§2.6, §2.9, §2.10): forward, backward and the
// one-token decode step.
//
// Per batch b, head h (group g = h / (nheads / ngroups)), token t:
//
//   δ_t   = clamp(softplus₂₀(dt[b,t,h] + dt_bias[h]), dt_min, dt_max)     (softplus when dt_softplus)
//   H_t   = exp(a_t)·H_{t−1} + δ_t·x[b,t,h,:] ⊗ B[b,t,g,:]                 H ∈ R^{headdim×dstate}
//           a_t = δ_t·A[h], or log_decay[b,t,h] where given (a decay of its own per token, as
//           Mamba-3's data-dependent one; δ then only scales the input)
//           H_{−1} = initial_states[b,h] (or 0); H_{t−1} is taken as 0 where seq_idx[b,t] ≠ seq_idx[b,t−1]
//   out   = (H_t·C[b,t,g,:] + D[h]·x[b,t,h,:]) · silu(z[b,t,h,:])
//   final_states[b,h] = H_{seqlen−1}
//
// The sequence is cut into chunks of `chunk_size` tokens (the last may be partial) and computed
// in the reference's stages: δ and the chunk cumsum of δ·A; each chunk's own end state; the
// passing of states across chunks; C·Bᵀ within each chunk; the chunk scan with the incoming
// state, D and the gate. All arithmetic, states and cumsums are fp32 (the per-chunk products
// optionally with TF32 operands on the tensor cores: SsdArgs::matmul_precision). Every op is non-blocking
// on the execution space instance it is given, except that temporary buffers are released on
// return (which waits for the device where freeing memory does, as cudaFree).
//
//   kmamba::SsdArgs<Mem> args;
//   args.x = x; args.dt = dt; args.A = A; args.B = B; args.C = C;        // required
//   args.D = D; args.z = z; args.dt_bias = dt_bias; args.dt_softplus = true;  // optional
//   args.chunk_size = 64;
//   kmamba::ssd_forward(exec, args, out, final_states);
#ifndef KMAMBA_CORE_SSD_HPP
#define KMAMBA_CORE_SSD_HPP

#include <kmamba/core/Error.hpp>
#include <kmamba/core/MatmulPrecision.hpp>
#include <kmamba/core/Profiling.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/SsdImpl.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <limits>

namespace kmamba {

/// The chunk length at which this library's SSD does the least work for Mamba-2's shapes on every
/// backend measured, and the longest chunk a model computes with when its configuration asks for
/// more (the result is the same function of the inputs). The intra-chunk products grow with the
/// chunk, the state products do not, and the chunk kernels are not bound by their products: 64
/// was fastest or tied on the H200 (SSD forward and backward, bf16 training step) and on the CPU.
/// The timings are in perf/RESULTS.md (2026-12-03, "chunk length measured").
constexpr int ssd_preferred_chunk_size = 64;

/// Inputs of ssd_forward / ssd_backward. A View left unallocated (default constructed) means
/// "absent" for the optional ones.
template <class MemorySpace>
struct SsdArgs {
  ConstTensor4<float, MemorySpace> x;               // (batch, seqlen, nheads, headdim)
  ConstTensor3<float, MemorySpace> dt;              // (batch, seqlen, nheads), raw (before bias, softplus, clamp)
  ConstTensor1<float, MemorySpace> A;               // (nheads), negative; required unless log_decay is given
  ConstTensor4<float, MemorySpace> B;               // (batch, seqlen, ngroups, dstate)
  ConstTensor4<float, MemorySpace> C;               // (batch, seqlen, ngroups, dstate)
  ConstTensor1<float, MemorySpace> D;               // (nheads), optional skip connection
  ConstTensor4<float, MemorySpace> z;               // (batch, seqlen, nheads, headdim), optional gate
  ConstTensor1<float, MemorySpace> dt_bias;         // (nheads), optional, added to dt
  ConstTensor4<float, MemorySpace> initial_states;  // (batch, nheads, headdim, dstate), optional (zero if absent)
  /// (batch, seqlen), optional ids of packed sequences: the state restarts from zero wherever the
  /// id changes (padding, e.g. −1, is one more sequence). initial_states belongs to the row's first
  /// sequence whatever its id (the reference kernel applies it only when that id is 0).
  ConstTensor2<std::int64_t, MemorySpace> seq_idx;
  /// (batch, seqlen, nheads), optional: each token's log decay a_t (≤ 0), in place of δ_t·A[h];
  /// A is then not read.
  ConstTensor3<float, MemorySpace> log_decay;
  /// Apply softplus (threshold 20) to dt + dt_bias.
  bool dt_softplus = false;
  /// δ is clamped to [dt_min, dt_max] (the reference's dt_limit).
  float dt_min = 0.0f;
  float dt_max = std::numeric_limits<float>::infinity();
  /// Tokens per chunk (the reference's chunk_size; Mamba-2 uses 256). A value whose team scratch
  /// memory the backend cannot provide is a UserError. The outputs are the same function of the
  /// inputs for every chunk_size (up to fp32 rounding); the work is not (ssd_preferred_chunk_size).
  int chunk_size = 256;
  /// The per-chunk products of the forward and backward (kmamba/core/MatmulPrecision.hpp).
  /// Float32 (default): exact fp32 products, the accuracy the rest of the library is tested at.
  /// TensorFloat32: on Cuda the products run on the tensor cores with operands rounded to TF32
  /// (fp32 sums; out and the gradients then carry relative errors of order 1e-3 of their
  /// magnitude instead of 1e-6); on host backends the same as Float32.
  /// BFloat16: the forward runs fused (one kernel walking each (batch, head)'s chunks with the
  /// state on chip, impl/SsdFusedForward.hpp) and the backward on fused chunk kernels
  /// (impl/SsdFusedStates.hpp, impl/SsdFusedBackward.hpp; with a gate, the ungated output
  /// recomputed by the fused forward), with the operands of their products rounded to bf16, on the
  /// tensor cores on Cuda and emulated exactly on host backends (results then carry relative errors
  /// of order 2^-8 of the magnitudes summed), for headdim 64 (in chunks of their own), dstate
  /// 16/32/64/128, no seq_idx and 16-byte aligned x, B and C (and dout without a gate); other
  /// shapes compute as Float32.
  MatmulPrecision matmul_precision = MatmulPrecision::Float32;
};

/// Gradients written by ssd_backward. dx, ddt, dB, dC are required, dA without log_decay and
/// dlog_decay with it; dD, ddt_bias and dinitial_states are written when allocated (the gradient
/// at the value given, or at zero for an absent D / dt_bias / initial state); dz is required
/// exactly when z is given.
template <class MemorySpace>
struct SsdGrads {
  Tensor4<float, MemorySpace> dx;               // (batch, seqlen, nheads, headdim)
  Tensor3<float, MemorySpace> ddt;              // (batch, seqlen, nheads), w.r.t. the raw dt
  Tensor1<float, MemorySpace> dA;               // (nheads), without log_decay
  Tensor3<float, MemorySpace> dlog_decay;       // (batch, seqlen, nheads), with log_decay
  Tensor4<float, MemorySpace> dB;               // (batch, seqlen, ngroups, dstate)
  Tensor4<float, MemorySpace> dC;               // (batch, seqlen, ngroups, dstate)
  Tensor1<float, MemorySpace> dD;               // (nheads), optional
  Tensor4<float, MemorySpace> dz;               // (batch, seqlen, nheads, headdim), with z
  Tensor1<float, MemorySpace> ddt_bias;         // (nheads), optional
  Tensor4<float, MemorySpace> dinitial_states;  // (batch, nheads, headdim, dstate), optional
};

/// Inputs of ssd_step (one token per sequence; same meaning as SsdArgs). As the reference's
/// `selective_state_update` (docs/algorithms.md §2.10, §9 flag 1), the step applies no dt limit.
template <class MemorySpace>
struct SsdStepArgs {
  ConstTensor3<float, MemorySpace> x;        // (batch, nheads, headdim)
  ConstTensor2<float, MemorySpace> dt;       // (batch, nheads), raw
  ConstTensor1<float, MemorySpace> A;        // (nheads)
  ConstTensor3<float, MemorySpace> B;        // (batch, ngroups, dstate)
  ConstTensor3<float, MemorySpace> C;        // (batch, ngroups, dstate)
  ConstTensor1<float, MemorySpace> D;        // (nheads), optional
  ConstTensor3<float, MemorySpace> z;        // (batch, nheads, headdim), optional
  ConstTensor1<float, MemorySpace> dt_bias;  // (nheads), optional
  bool dt_softplus = false;
};

namespace impl {

inline void ssd_check_group_dims(const char* function, const char* name, const Shape& shape, const SsdDims& dims) {
  KMAMBA_REQUIRE(dims.ngroups >= 1 && dims.nheads % dims.ngroups == 0,
                 function << ": " << name << " has shape " << shape.to_string() << ": ngroups = " << dims.ngroups
                          << " must be positive and divide nheads = " << dims.nheads);
  KMAMBA_REQUIRE(dims.dstate >= 1,
                 function << ": " << name << " has shape " << shape.to_string() << ": dstate must be positive");
}

template <class MemorySpace>
SsdDims ssd_check_args(const char* function, const SsdArgs<MemorySpace>& args) {
  KMAMBA_REQUIRE(args.x.is_allocated() && args.dt.is_allocated() && args.B.is_allocated() && args.C.is_allocated(),
                 function << ": x, dt, B and C are required");
  KMAMBA_REQUIRE(args.A.is_allocated() || args.log_decay.is_allocated(),
                 function << ": A is required unless log_decay is given");
  SsdDims dims;
  dims.batch = static_cast<std::int64_t>(args.x.extent(0));
  dims.seqlen = static_cast<std::int64_t>(args.x.extent(1));
  dims.nheads = static_cast<std::int64_t>(args.x.extent(2));
  dims.headdim = static_cast<std::int64_t>(args.x.extent(3));
  dims.ngroups = static_cast<std::int64_t>(args.B.extent(2));
  dims.dstate = static_cast<std::int64_t>(args.B.extent(3));
  KMAMBA_REQUIRE(dims.nheads >= 1 && dims.headdim >= 1, function << ": x has shape " << shape_of(args.x).to_string()
                                                                 << ": nheads and headdim must be positive");
  ssd_check_group_dims(function, "B", shape_of(args.B), dims);
  check_shape(function, "dt", args.dt, {dims.batch, dims.seqlen, dims.nheads}, "(batch, seqlen, nheads)");
  if (args.log_decay.is_allocated()) {
    check_shape(function, "log_decay", args.log_decay, {dims.batch, dims.seqlen, dims.nheads},
                "(batch, seqlen, nheads)");
  } else {
    check_shape(function, "A", args.A, {dims.nheads}, "(nheads)");
  }
  const Shape bc{dims.batch, dims.seqlen, dims.ngroups, dims.dstate};
  check_shape(function, "B", args.B, bc, "(batch, seqlen, ngroups, dstate)");
  check_shape(function, "C", args.C, bc, "(batch, seqlen, ngroups, dstate)");
  if (args.D.is_allocated()) check_shape(function, "D", args.D, {dims.nheads}, "(nheads)");
  if (args.z.is_allocated()) {
    check_shape(function, "z", args.z, {dims.batch, dims.seqlen, dims.nheads, dims.headdim},
                "(batch, seqlen, nheads, headdim)");
  }
  if (args.dt_bias.is_allocated()) check_shape(function, "dt_bias", args.dt_bias, {dims.nheads}, "(nheads)");
  if (args.initial_states.is_allocated()) {
    check_shape(function, "initial_states", args.initial_states, {dims.batch, dims.nheads, dims.headdim, dims.dstate},
                "(batch, nheads, headdim, dstate)");
  }
  if (args.seq_idx.is_allocated()) {
    check_shape(function, "seq_idx", args.seq_idx, {dims.batch, dims.seqlen}, "(batch, seqlen)");
  }
  KMAMBA_REQUIRE(args.chunk_size >= 1, function << ": chunk_size must be positive, got " << args.chunk_size);
  KMAMBA_REQUIRE(args.dt_min <= args.dt_max, function << ": dt_min must not exceed dt_max, got dt_min=" << args.dt_min
                                                      << " dt_max=" << args.dt_max);
  KMAMBA_REQUIRE(
      dims.batch * dims.seqlen * dims.nheads * dims.headdim < std::numeric_limits<int>::max() &&
          dims.batch * dims.seqlen * dims.nheads * dims.dstate < std::numeric_limits<int>::max(),
      function << ": x has shape " << shape_of(args.x).to_string() << ": too many elements for 32-bit indexing");
  return dims;
}

}  // namespace impl

/// SSD forward. Writes `out` = (y + D·x)·silu(z) and, when allocated, `final_states` = the state
/// after the last token (the initial state for seqlen 0). `final_states` may be
/// `args.initial_states` itself: the state is then advanced in place (recurrent prefill; each
/// element of the initial state is read before the same element of the final state is written).
/// Non-blocking on `exec` (see the file comment). Throws kmamba::UserError for a wrong shape (the message names both
/// shapes) or a chunk_size the team scratch memory cannot hold.
template <class ExecutionSpace, class MemorySpace>
void ssd_forward(const ExecutionSpace& exec, const SsdArgs<MemorySpace>& args,
                 const Tensor4<float, MemorySpace>& out,             // (batch, seqlen, nheads, headdim)
                 const Tensor4<float, MemorySpace>& final_states) {  // (batch, nheads, headdim, dstate), optional
  const ProfilingRegion region("kmamba::ssd_forward");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::ssd_forward: the execution space cannot access the tensors' memory space");
  constexpr const char* function = "kmamba::ssd_forward";
  const impl::SsdDims dims = impl::ssd_check_args(function, args);
  check_shape(function, "out", out, {dims.batch, dims.seqlen, dims.nheads, dims.headdim},
              "(batch, seqlen, nheads, headdim)");
  check_allocated(function, "out", out);
  if (final_states.is_allocated()) {
    check_shape(function, "final_states", final_states, {dims.batch, dims.nheads, dims.headdim, dims.dstate},
                "(batch, nheads, headdim, dstate)");
  }
  impl::ssd_forward_impl(exec, function, dims, args, out, final_states);
}

template <class MemorySpace>
void ssd_forward(const SsdArgs<MemorySpace>& args,
                 const Tensor4<float, MemorySpace>& out,             // (batch, seqlen, nheads, headdim)
                 const Tensor4<float, MemorySpace>& final_states) {  // (batch, nheads, headdim, dstate), optional
  ssd_forward(typename Tensor4<float, MemorySpace>::execution_space(), args, out, final_states);
}

/// SSD backward: the gradients of sum(out·dout) + sum(final_states·dfinal_states) with respect
/// to every input (see SsdGrads for which are written). `dfinal_states` is optional (absent =
/// zero). Stages 1–4 of the forward are recomputed, then the backward runs stage by stage as
/// docs/algorithms.md §2.6 (the gradient w.r.t. δ·A in its stable form). Every sum over batch,
/// seqlen or the heads of a group (dA, dD, ddt_bias, dB, dC) is taken from per-chunk or per-head
/// partials in a fixed order: no atomics, identical results from run to run. Non-blocking on
/// `exec` (see the file comment).
template <class ExecutionSpace, class MemorySpace>
void ssd_backward(
    const ExecutionSpace& exec, const SsdArgs<MemorySpace>& args,
    const ConstTensor4<float, impl::SsdNonDeduced<MemorySpace>>& dout,  // (batch, seqlen, nheads, headdim)
    const ConstTensor4<float, impl::SsdNonDeduced<MemorySpace>>&
        dfinal_states,  // (batch, nheads, headdim, dstate), optional
    const SsdGrads<MemorySpace>& grads) {
  const ProfilingRegion region("kmamba::ssd_backward");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::ssd_backward: the execution space cannot access the tensors' memory space");
  constexpr const char* function = "kmamba::ssd_backward";
  const impl::SsdDims dims = impl::ssd_check_args(function, args);
  const Shape seq{dims.batch, dims.seqlen, dims.nheads, dims.headdim};
  const Shape state{dims.batch, dims.nheads, dims.headdim, dims.dstate};
  const Shape bc{dims.batch, dims.seqlen, dims.ngroups, dims.dstate};
  check_shape(function, "dout", dout, seq, "(batch, seqlen, nheads, headdim)");
  check_allocated(function, "dout", dout);
  if (dfinal_states.is_allocated()) {
    check_shape(function, "dfinal_states", dfinal_states, state, "(batch, nheads, headdim, dstate)");
  }
  check_shape(function, "dx", grads.dx, seq, "(batch, seqlen, nheads, headdim)");
  check_shape(function, "ddt", grads.ddt, {dims.batch, dims.seqlen, dims.nheads}, "(batch, seqlen, nheads)");
  if (args.log_decay.is_allocated()) {
    check_shape(function, "dlog_decay", grads.dlog_decay, {dims.batch, dims.seqlen, dims.nheads},
                "(batch, seqlen, nheads)");
    check_allocated(function, "dlog_decay", grads.dlog_decay);
  } else {
    check_shape(function, "dA", grads.dA, {dims.nheads}, "(nheads)");
    check_allocated(function, "dA", grads.dA);
  }
  check_shape(function, "dB", grads.dB, bc, "(batch, seqlen, ngroups, dstate)");
  check_shape(function, "dC", grads.dC, bc, "(batch, seqlen, ngroups, dstate)");
  check_allocated(function, "dx", grads.dx);
  check_allocated(function, "ddt", grads.ddt);
  check_allocated(function, "dB", grads.dB);
  check_allocated(function, "dC", grads.dC);
  if (grads.dD.is_allocated()) check_shape(function, "dD", grads.dD, {dims.nheads}, "(nheads)");
  if (grads.ddt_bias.is_allocated()) check_shape(function, "ddt_bias", grads.ddt_bias, {dims.nheads}, "(nheads)");
  if (grads.dinitial_states.is_allocated()) {
    check_shape(function, "dinitial_states", grads.dinitial_states, state, "(batch, nheads, headdim, dstate)");
  }
  KMAMBA_REQUIRE(args.z.is_allocated() == grads.dz.is_allocated(),
                 function << ": dz must be allocated exactly when z is given (z "
                          << (args.z.is_allocated() ? "given" : "absent") << ", dz "
                          << (grads.dz.is_allocated() ? "allocated" : "absent") << ")");
  if (grads.dz.is_allocated()) check_shape(function, "dz", grads.dz, seq, "(batch, seqlen, nheads, headdim)");
  impl::ssd_backward_impl(exec, function, dims, args, dout, dfinal_states, grads);
}

template <class MemorySpace>
void ssd_backward(
    const SsdArgs<MemorySpace>& args,
    const ConstTensor4<float, impl::SsdNonDeduced<MemorySpace>>& dout,  // (batch, seqlen, nheads, headdim)
    const ConstTensor4<float, impl::SsdNonDeduced<MemorySpace>>&
        dfinal_states,  // (batch, nheads, headdim, dstate), optional
    const SsdGrads<MemorySpace>& grads) {
  ssd_backward(typename Tensor4<float, MemorySpace>::execution_space(), args, dout, dfinal_states, grads);
}

/// Decode step: advances `state` in place by one token and writes `out` = (state·C + D·x)·silu(z),
/// what ssd_forward computes for that token (when δ lies within the forward's dt limits).
/// Non-blocking on `exec`.
template <class ExecutionSpace, class MemorySpace>
void ssd_step(const ExecutionSpace& exec, const SsdStepArgs<MemorySpace>& args,
              const Tensor4<float, MemorySpace>& state,  // (batch, nheads, headdim, dstate), updated in place
              const Tensor3<float, MemorySpace>& out) {  // (batch, nheads, headdim)
  const ProfilingRegion region("kmamba::ssd_step");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::ssd_step: the execution space cannot access the tensors' memory space");
  constexpr const char* function = "kmamba::ssd_step";
  KMAMBA_REQUIRE(args.x.is_allocated() && args.dt.is_allocated() && args.A.is_allocated() && args.B.is_allocated() &&
                     args.C.is_allocated(),
                 function << ": x, dt, A, B and C are required");
  impl::SsdDims dims;
  dims.batch = static_cast<std::int64_t>(args.x.extent(0));
  dims.seqlen = 1;
  dims.nheads = static_cast<std::int64_t>(args.x.extent(1));
  dims.headdim = static_cast<std::int64_t>(args.x.extent(2));
  dims.ngroups = static_cast<std::int64_t>(args.B.extent(1));
  dims.dstate = static_cast<std::int64_t>(args.B.extent(2));
  KMAMBA_REQUIRE(dims.nheads >= 1 && dims.headdim >= 1, function << ": x has shape " << shape_of(args.x).to_string()
                                                                 << ": nheads and headdim must be positive");
  impl::ssd_check_group_dims(function, "B", shape_of(args.B), dims);
  check_shape(function, "dt", args.dt, {dims.batch, dims.nheads}, "(batch, nheads)");
  check_shape(function, "A", args.A, {dims.nheads}, "(nheads)");
  check_shape(function, "B", args.B, {dims.batch, dims.ngroups, dims.dstate}, "(batch, ngroups, dstate)");
  check_shape(function, "C", args.C, {dims.batch, dims.ngroups, dims.dstate}, "(batch, ngroups, dstate)");
  if (args.D.is_allocated()) check_shape(function, "D", args.D, {dims.nheads}, "(nheads)");
  if (args.z.is_allocated())
    check_shape(function, "z", args.z, {dims.batch, dims.nheads, dims.headdim}, "(batch, nheads, headdim)");
  if (args.dt_bias.is_allocated()) check_shape(function, "dt_bias", args.dt_bias, {dims.nheads}, "(nheads)");
  check_shape(function, "state", state, {dims.batch, dims.nheads, dims.headdim, dims.dstate},
              "(batch, nheads, headdim, dstate)");
  check_shape(function, "out", out, {dims.batch, dims.nheads, dims.headdim}, "(batch, nheads, headdim)");
  check_allocated(function, "state", state);
  check_allocated(function, "out", out);
  impl::ssd_step_impl(exec, dims, args, state, out);
}

template <class MemorySpace>
void ssd_step(const SsdStepArgs<MemorySpace>& args,
              const Tensor4<float, MemorySpace>& state,  // (batch, nheads, headdim, dstate), updated in place
              const Tensor3<float, MemorySpace>& out) {  // (batch, nheads, headdim)
  ssd_step(typename Tensor4<float, MemorySpace>::execution_space(), args, state, out);
}

}  // namespace kmamba

#endif
