// Mamba-3 scans (reference: state-spaces/mamba `mamba3_siso_combined` and the TileLang MIMO op, their
// sequential references `mamba3_siso_step_ref` / `mamba3_MIMO_step_ref`; docs/algorithms.md §3.2–§3.7):
// the SISO scan and the MIMO scan of rank R, forward (chunked), backward and the one-token decode step.
//
// Per batch b, head h (group g = h / (nheads / ngroups)), token t and rank r (SISO: R = 1 and every
// mimo_* factor is 1):
//
//   θ_t      = θ_{t−1} + π·tanh(angles[b,t,h,:])·dt[b,h,t]                      θ ∈ R^nangles
//   q_t,r    = Rot(θ_t)·(q[b,t,r,g,:] + q_bias[h,r,:])    k_t,r = Rot(θ_t)·(k[b,t,r,g,:] + k_bias[h,r,:])
//              Rot turns each pair of coordinates (2i, 2i+1), i < nangles, by θ_i and leaves the other
//              dstate − 2·nangles coordinates unchanged (the references' adjacent-pair convention)
//   v_t,r    = v[b,t,h,:] ⊙ mimo_v[h,r,:]
//   λ_t = σ(trap[b,h,t]),  α_t = exp(adt[b,h,t]),  β_t = (1 − λ_t)·dt[b,h,t]·α_t,  γ_t = λ_t·dt[b,h,t]
//   H_t      = α_t·H_{t−1} + β_t·Σ_r v_{t−1,r} k_{t−1,r}ᵀ + γ_t·Σ_r v_t,r k_t,rᵀ   (headdim × dstate)
//   y_t,r    = H_t·q_t,r + D[h]·v_t,r
//   out[b,t,h,:] = Σ_r y_t,r ⊙ silu(z[b,t,h,:] ⊙ mimo_z[h,r,:]) ⊙ mimo_o[h,r,:]   (no silu factor without z)
//
// Packed rows (seq_idx): where seq_idx[b,t] ≠ seq_idx[b,t−1] (t > 0) a document starts, and token t
// sees nothing before it: θ_{t−1} and H_{t−1} are taken as 0 and the previous-token term is dropped
// (β_t = 0), so each document gives what it gives alone. The initial states belong to the row's
// first document, the final states are those of its last one. With Ĥ below, the SSD's rule
// "H_{t−1} is 0 where the id changes" and β̃_t = 0 there give exactly this (Ĥ_{t−1} = H_{t−1} at
// a start), so the SISO scan hands the ids to its SSD; the angle scans restart at every start. The
// MIMO chunk stages apply the same rule as the SSD's (impl/SsdImpl.hpp): within a chunk two rows
// interact only when no document starts between their tokens, the state entering a chunk reaches
// its tokens before its first start, and leaves it only when the chunk has none.
//
// The initial states (θ_{−1}, H_{−1}, k_{−1,r}, v_{−1,r}) are zero unless given; the final states are
// θ_{L−1}, H_{L−1}, k_{L−1,r} (rotated, biased) and v_{L−1,r} (for SISO the raw v of the last token).
// The SISO angle state is kept reduced into [0, 2π) (as the reference's SISO kernels); the MIMO
// angle state is the plain sum (as the reference's MIMO step); both rotate by the same angles.
//
// Chunked form. With β̃_t = (1 − λ_t)·dt_t (0 past the last token) and scale_t = γ_t + β̃_{t+1},
// Ĥ_t = H_t + β̃_{t+1}·Σ_r v_t,r k_t,rᵀ obeys Ĥ_t = α_t·Ĥ_{t−1} + scale_t·Σ_r v_t,r k_t,rᵀ (the SSD
// recurrence, Ĥ_{−1} = H_{−1} + β̃_0·Σ_r v_{−1,r} k_{−1,r}ᵀ, Ĥ_{L−1} = H_{L−1}), and
//   y_t,r = Σ_{s<t} e^{cs_t − cs_s}·scale_s·Σ_r′ (q_t,r·k_s,r′)·v_s,r′
//           + γ_t·Σ_r′ (q_t,r·k_t,r′)·v_t,r′ + e^{cs_t}·Ĥ_{chunk start − 1}·q_t,r + D·v_t,r
// with cs the cumulative sum of adt within the chunk. The sequence is cut into chunks of
// `chunk_size` tokens (the last may be partial; rows of a chunk are its tokens × ranks) and computed
// in the stages of the SSD (kmamba/core/Ssd.hpp): per-token angles, decays and scales; rotated q
// and k; each chunk's own end state; the passing of states across chunks; the chunk scan. The
// backward runs the same decomposition in reverse (docs/algorithms.md §3.5, rank sums inside the inner
// products for MIMO); the reduction of angles mod 2π is treated as the identity, as the reference
// does. The SISO scan is computed as an SSD (kmamba/core/Ssd.hpp, with a log decay per token and a
// correction of each token's own term: impl/Mamba3SisoSsd.hpp), so it takes the SSD's precisions;
// MIMO runs the chunk stages above. All arithmetic and states are fp32 (the per-chunk products
// optionally with TF32 or, SISO only, bf16 operands on the tensor cores: matmul_precision). Every op is non-blocking on
// the execution space instance it is given, except that temporary buffers are released on return (which waits for the
// device where freeing memory does, as cudaFree).
//
//   kmamba::Mamba3SisoArgs<Mem> args;
//   args.q = C; args.k = B; args.v = x; args.adt = adt; args.dt = dt; args.trap = trap;   // required
//   args.q_bias = C_bias; args.k_bias = B_bias; args.angles = angles;                    // required
//   args.D = D; args.z = z;                                                               // optional
//   kmamba::Mamba3SisoStates<Mem> final_states;        // allocate the states you want back
//   kmamba::mamba3_siso_forward(exec, args, out, final_states);
#ifndef KMAMBA_CORE_MAMBA3SCAN_HPP
#define KMAMBA_CORE_MAMBA3SCAN_HPP

#include <kmamba/core/Error.hpp>
#include <kmamba/core/MatmulPrecision.hpp>
#include <kmamba/core/Profiling.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/Mamba3SisoSsd.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <limits>
#include <string>

namespace kmamba {

/// SISO states (final states written by the forward, gradients of the initial states written by
/// the backward, the decode step's carried states). An unallocated View means "not wanted".
template <class MemorySpace>
struct Mamba3SisoStates {
  Tensor3<float, MemorySpace> angle;  // (batch, nheads, nangles)
  Tensor4<float, MemorySpace> ssm;    // (batch, nheads, headdim, dstate)
  Tensor3<float, MemorySpace> k;      // (batch, nheads, dstate): rotated, biased k of the last token
  Tensor3<float, MemorySpace> v;      // (batch, nheads, headdim): v of the last token
};

/// Read-only SISO states (initial states, cotangents of the final states). An unallocated View
/// means zero. Converts from Mamba3SisoStates, so the final states of one call continue the next.
template <class MemorySpace>
struct Mamba3SisoConstStates {
  ConstTensor3<float, MemorySpace> angle;  // (batch, nheads, nangles)
  ConstTensor4<float, MemorySpace> ssm;    // (batch, nheads, headdim, dstate)
  ConstTensor3<float, MemorySpace> k;      // (batch, nheads, dstate)
  ConstTensor3<float, MemorySpace> v;      // (batch, nheads, headdim)

  Mamba3SisoConstStates() = default;
  Mamba3SisoConstStates(const Mamba3SisoStates<MemorySpace>& s)  // NOLINT: implicit on purpose
      : angle(s.angle), ssm(s.ssm), k(s.k), v(s.v) {}
};

/// MIMO states: as the SISO ones with a rank axis on k and v (v holds the projected v_t,r).
template <class MemorySpace>
struct Mamba3MimoStates {
  Tensor3<float, MemorySpace> angle;  // (batch, nheads, nangles)
  Tensor4<float, MemorySpace> ssm;    // (batch, nheads, headdim, dstate)
  Tensor4<float, MemorySpace> k;      // (batch, nheads, rank, dstate)
  Tensor4<float, MemorySpace> v;      // (batch, nheads, rank, headdim)
};

template <class MemorySpace>
struct Mamba3MimoConstStates {
  ConstTensor3<float, MemorySpace> angle;  // (batch, nheads, nangles)
  ConstTensor4<float, MemorySpace> ssm;    // (batch, nheads, headdim, dstate)
  ConstTensor4<float, MemorySpace> k;      // (batch, nheads, rank, dstate)
  ConstTensor4<float, MemorySpace> v;      // (batch, nheads, rank, headdim)

  Mamba3MimoConstStates() = default;
  Mamba3MimoConstStates(const Mamba3MimoStates<MemorySpace>& s)  // NOLINT: implicit on purpose
      : angle(s.angle), ssm(s.ssm), k(s.k), v(s.v) {}
};

/// Inputs of mamba3_siso_forward / mamba3_siso_backward (the reference API's Q, K, V, ADT, DT, Trap,
/// Q_bias, K_bias, Angles, D, Z). A View left unallocated means "absent" for the optional ones.
template <class MemorySpace>
struct Mamba3SisoArgs {
  ConstTensor4<float, MemorySpace> q;          // (batch, seqlen, ngroups, dstate): C after its norm
  ConstTensor4<float, MemorySpace> k;          // (batch, seqlen, ngroups, dstate): B after its norm
  ConstTensor4<float, MemorySpace> v;          // (batch, seqlen, nheads, headdim): x
  ConstTensor3<float, MemorySpace> adt;        // (batch, nheads, seqlen): A·dt, the log-decay (≤ 0)
  ConstTensor3<float, MemorySpace> dt;         // (batch, nheads, seqlen): dt after its softplus
  ConstTensor3<float, MemorySpace> trap;       // (batch, nheads, seqlen): before its sigmoid
  ConstTensor2<float, MemorySpace> q_bias;     // (nheads, dstate)
  ConstTensor2<float, MemorySpace> k_bias;     // (nheads, dstate)
  ConstTensor4<float, MemorySpace> angles;     // (batch, seqlen, nheads, nangles): raw, 2·nangles ≤ dstate
  ConstTensor1<float, MemorySpace> D;          // (nheads), optional skip connection
  ConstTensor4<float, MemorySpace> z;          // (batch, seqlen, nheads, headdim), optional gate
  Mamba3SisoConstStates<MemorySpace> initial;  // optional, each state separately (zero if absent)
  /// (batch, seqlen), optional: packed sequence ids (see the file comment); a document starts where
  /// the id changes. The bf16 fused kernels do not take them (those runs compute on the SSD's
  /// fp32 stages, as SsdArgs::seq_idx).
  ConstTensor2<std::int64_t, MemorySpace> seq_idx;
  /// (batch, seqlen, nheads, headdim), optional, with z only: the output before the gate. When it
  /// is allocated, mamba3_siso_forward writes it and mamba3_siso_backward reads it in place of
  /// recomputing the scan for the gate's gradient, so between the two calls it must hold what the
  /// forward of the same inputs wrote (the reference kernel keeps this tensor the same way).
  Tensor4<float, MemorySpace> ungated_out;
  /// Tokens per chunk (the reference's default 64). A value whose team scratch memory the backend
  /// cannot provide is a UserError.
  int chunk_size = 64;
  /// The per-chunk products, exactly as SsdArgs::matmul_precision (the scan runs on the SSD):
  /// Float32 (default) exact; TensorFloat32 with TF32 operands on Cuda's tensor cores; BFloat16
  /// with bf16 operands in the SSD's fused kernels where they take the shape (headdim 64, dstate
  /// 16/32/64/128), fp32 otherwise.
  MatmulPrecision matmul_precision = MatmulPrecision::Float32;
};

/// Gradients written by mamba3_siso_backward. dq, dk, dv, dadt, ddt, dtrap, dq_bias, dk_bias and
/// dangles are required; dD and the initial states' gradients are written when allocated (the
/// gradient at the value given, or at zero for an absent D or initial state); dz is required
/// exactly when z is given.
template <class MemorySpace>
struct Mamba3SisoGrads {
  Tensor4<float, MemorySpace> dq;          // (batch, seqlen, ngroups, dstate)
  Tensor4<float, MemorySpace> dk;          // (batch, seqlen, ngroups, dstate)
  Tensor4<float, MemorySpace> dv;          // (batch, seqlen, nheads, headdim)
  Tensor3<float, MemorySpace> dadt;        // (batch, nheads, seqlen)
  Tensor3<float, MemorySpace> ddt;         // (batch, nheads, seqlen)
  Tensor3<float, MemorySpace> dtrap;       // (batch, nheads, seqlen)
  Tensor2<float, MemorySpace> dq_bias;     // (nheads, dstate)
  Tensor2<float, MemorySpace> dk_bias;     // (nheads, dstate)
  Tensor4<float, MemorySpace> dangles;     // (batch, seqlen, nheads, nangles)
  Tensor1<float, MemorySpace> dD;          // (nheads), optional
  Tensor4<float, MemorySpace> dz;          // (batch, seqlen, nheads, headdim), with z
  Mamba3SisoStates<MemorySpace> dinitial;  // optional, each state separately
};

/// Inputs of mamba3_mimo_forward / mamba3_mimo_backward: as Mamba3SisoArgs with a rank axis on q,
/// k and their biases, and the per-head rank projections of v, z and the output.
template <class MemorySpace>
struct Mamba3MimoArgs {
  ConstTensor5<float, MemorySpace> q;          // (batch, seqlen, rank, ngroups, dstate)
  ConstTensor5<float, MemorySpace> k;          // (batch, seqlen, rank, ngroups, dstate)
  ConstTensor4<float, MemorySpace> v;          // (batch, seqlen, nheads, headdim)
  ConstTensor3<float, MemorySpace> adt;        // (batch, nheads, seqlen)
  ConstTensor3<float, MemorySpace> dt;         // (batch, nheads, seqlen)
  ConstTensor3<float, MemorySpace> trap;       // (batch, nheads, seqlen)
  ConstTensor3<float, MemorySpace> q_bias;     // (nheads, rank, dstate)
  ConstTensor3<float, MemorySpace> k_bias;     // (nheads, rank, dstate)
  ConstTensor4<float, MemorySpace> angles;     // (batch, seqlen, nheads, nangles); 2·nangles ≤ dstate
  ConstTensor3<float, MemorySpace> mimo_v;     // (nheads, rank, headdim)
  ConstTensor3<float, MemorySpace> mimo_z;     // (nheads, rank, headdim), exactly when z is given
  ConstTensor3<float, MemorySpace> mimo_o;     // (nheads, rank, headdim)
  ConstTensor1<float, MemorySpace> D;          // (nheads), optional
  ConstTensor4<float, MemorySpace> z;          // (batch, seqlen, nheads, headdim), optional
  Mamba3MimoConstStates<MemorySpace> initial;  // optional, each state separately (zero if absent)
  /// (batch, seqlen), optional: packed sequence ids, as Mamba3SisoArgs::seq_idx.
  ConstTensor2<std::int64_t, MemorySpace> seq_idx;
  /// Tokens per chunk; 0 = the reference's default 64 / rank (at least 1).
  int chunk_size = 0;
  /// The per-chunk products: Float32 (default) or TensorFloat32 (as Mamba3SisoArgs); BFloat16 is a
  /// UserError (the MIMO scan runs on its own chunk stages, not the SSD).
  MatmulPrecision matmul_precision = MatmulPrecision::Float32;
};

/// Gradients written by mamba3_mimo_backward (required/optional as Mamba3SisoGrads; dmimo_v and
/// dmimo_o are required, dmimo_z exactly when z is given).
template <class MemorySpace>
struct Mamba3MimoGrads {
  Tensor5<float, MemorySpace> dq;          // (batch, seqlen, rank, ngroups, dstate)
  Tensor5<float, MemorySpace> dk;          // (batch, seqlen, rank, ngroups, dstate)
  Tensor4<float, MemorySpace> dv;          // (batch, seqlen, nheads, headdim)
  Tensor3<float, MemorySpace> dadt;        // (batch, nheads, seqlen)
  Tensor3<float, MemorySpace> ddt;         // (batch, nheads, seqlen)
  Tensor3<float, MemorySpace> dtrap;       // (batch, nheads, seqlen)
  Tensor3<float, MemorySpace> dq_bias;     // (nheads, rank, dstate)
  Tensor3<float, MemorySpace> dk_bias;     // (nheads, rank, dstate)
  Tensor4<float, MemorySpace> dangles;     // (batch, seqlen, nheads, nangles)
  Tensor3<float, MemorySpace> dmimo_v;     // (nheads, rank, headdim)
  Tensor3<float, MemorySpace> dmimo_z;     // (nheads, rank, headdim), with z
  Tensor3<float, MemorySpace> dmimo_o;     // (nheads, rank, headdim)
  Tensor1<float, MemorySpace> dD;          // (nheads), optional
  Tensor4<float, MemorySpace> dz;          // (batch, seqlen, nheads, headdim), with z
  Mamba3MimoStates<MemorySpace> dinitial;  // optional, each state separately
};

/// Inputs of mamba3_siso_step (one token per sequence; same meaning as Mamba3SisoArgs).
template <class MemorySpace>
struct Mamba3SisoStepArgs {
  ConstTensor3<float, MemorySpace> q;       // (batch, ngroups, dstate)
  ConstTensor3<float, MemorySpace> k;       // (batch, ngroups, dstate)
  ConstTensor3<float, MemorySpace> v;       // (batch, nheads, headdim)
  ConstTensor2<float, MemorySpace> adt;     // (batch, nheads)
  ConstTensor2<float, MemorySpace> dt;      // (batch, nheads)
  ConstTensor2<float, MemorySpace> trap;    // (batch, nheads)
  ConstTensor2<float, MemorySpace> q_bias;  // (nheads, dstate)
  ConstTensor2<float, MemorySpace> k_bias;  // (nheads, dstate)
  ConstTensor3<float, MemorySpace> angles;  // (batch, nheads, nangles)
  ConstTensor1<float, MemorySpace> D;       // (nheads), optional
  ConstTensor3<float, MemorySpace> z;       // (batch, nheads, headdim), optional
};

/// Inputs of mamba3_mimo_step.
template <class MemorySpace>
struct Mamba3MimoStepArgs {
  ConstTensor4<float, MemorySpace> q;       // (batch, rank, ngroups, dstate)
  ConstTensor4<float, MemorySpace> k;       // (batch, rank, ngroups, dstate)
  ConstTensor3<float, MemorySpace> v;       // (batch, nheads, headdim)
  ConstTensor2<float, MemorySpace> adt;     // (batch, nheads)
  ConstTensor2<float, MemorySpace> dt;      // (batch, nheads)
  ConstTensor2<float, MemorySpace> trap;    // (batch, nheads)
  ConstTensor3<float, MemorySpace> q_bias;  // (nheads, rank, dstate)
  ConstTensor3<float, MemorySpace> k_bias;  // (nheads, rank, dstate)
  ConstTensor3<float, MemorySpace> angles;  // (batch, nheads, nangles)
  ConstTensor3<float, MemorySpace> mimo_v;  // (nheads, rank, headdim)
  ConstTensor3<float, MemorySpace> mimo_z;  // (nheads, rank, headdim), exactly when z is given
  ConstTensor3<float, MemorySpace> mimo_o;  // (nheads, rank, headdim)
  ConstTensor1<float, MemorySpace> D;       // (nheads), optional
  ConstTensor3<float, MemorySpace> z;       // (batch, nheads, headdim), optional
};

namespace impl {

/// Checks of the dimensions read off the inputs, shared by every op.
inline void mamba3_check_dims(const char* function, const Mamba3Dims& dims, const Shape& v_shape, const Shape& q_shape,
                              const Shape& angles_shape) {
  KMAMBA_REQUIRE(dims.nheads >= 1 && dims.headdim >= 1,
                 function << ": v has shape " << v_shape.to_string() << ": nheads and headdim must be positive");
  KMAMBA_REQUIRE(dims.ngroups >= 1 && dims.nheads % dims.ngroups == 0,
                 function << ": q has shape " << q_shape.to_string() << ": ngroups = " << dims.ngroups
                          << " must be positive and divide nheads = " << dims.nheads);
  KMAMBA_REQUIRE(dims.dstate >= 1, function << ": q has shape " << q_shape.to_string() << ": dstate must be positive");
  KMAMBA_REQUIRE(dims.rank >= 1, function << ": q has shape " << q_shape.to_string() << ": rank must be positive");
  KMAMBA_REQUIRE(2 * dims.nangles <= dims.dstate, function << ": angles has shape " << angles_shape.to_string()
                                                           << ": 2·nangles = " << 2 * dims.nangles
                                                           << " must not exceed dstate = " << dims.dstate);
  KMAMBA_REQUIRE(dims.batch * dims.seqlen * dims.nheads * dims.rank * (dims.headdim + dims.dstate) <
                     std::numeric_limits<int>::max(),
                 function << ": v has shape " << v_shape.to_string() << ": too many elements for 32-bit indexing");
}

template <class MemorySpace>
void mamba3_check_common(const char* function, const Mamba3Dims& dims, const ConstTensor4<float, MemorySpace>& v,
                         const ConstTensor3<float, MemorySpace>& adt, const ConstTensor3<float, MemorySpace>& dt,
                         const ConstTensor3<float, MemorySpace>& trap, const ConstTensor4<float, MemorySpace>& angles,
                         const ConstTensor1<float, MemorySpace>& D, const ConstTensor4<float, MemorySpace>& z,
                         const ConstTensor2<std::int64_t, MemorySpace>& seq_idx, int chunk_size) {
  check_shape(function, "v", v, {dims.batch, dims.seqlen, dims.nheads, dims.headdim},
              "(batch, seqlen, nheads, headdim)");
  const Shape per_token{dims.batch, dims.nheads, dims.seqlen};
  check_shape(function, "adt", adt, per_token, "(batch, nheads, seqlen)");
  check_shape(function, "dt", dt, per_token, "(batch, nheads, seqlen)");
  check_shape(function, "trap", trap, per_token, "(batch, nheads, seqlen)");
  check_shape(function, "angles", angles, {dims.batch, dims.seqlen, dims.nheads, dims.nangles},
              "(batch, seqlen, nheads, nangles)");
  if (D.is_allocated()) check_shape(function, "D", D, {dims.nheads}, "(nheads)");
  if (z.is_allocated()) {
    check_shape(function, "z", z, {dims.batch, dims.seqlen, dims.nheads, dims.headdim},
                "(batch, seqlen, nheads, headdim)");
  }
  if (seq_idx.is_allocated()) check_shape(function, "seq_idx", seq_idx, {dims.batch, dims.seqlen}, "(batch, seqlen)");
  KMAMBA_REQUIRE(chunk_size >= 1, function << ": chunk_size must be positive, got " << chunk_size);
}

/// Checks the shapes of a set of SISO states (`what` names it in messages: "initial", "final_states", ...).
template <class StatesType>
void mamba3_check_siso_states(const char* function, const char* what, const StatesType& s, const Mamba3Dims& dims) {
  const std::string prefix(what);
  if (s.angle.is_allocated()) {
    check_shape(function, (prefix + ".angle").c_str(), s.angle, {dims.batch, dims.nheads, dims.nangles},
                "(batch, nheads, nangles)");
  }
  if (s.ssm.is_allocated()) {
    check_shape(function, (prefix + ".ssm").c_str(), s.ssm, {dims.batch, dims.nheads, dims.headdim, dims.dstate},
                "(batch, nheads, headdim, dstate)");
  }
  if (s.k.is_allocated()) {
    check_shape(function, (prefix + ".k").c_str(), s.k, {dims.batch, dims.nheads, dims.dstate},
                "(batch, nheads, dstate)");
  }
  if (s.v.is_allocated()) {
    check_shape(function, (prefix + ".v").c_str(), s.v, {dims.batch, dims.nheads, dims.headdim},
                "(batch, nheads, headdim)");
  }
}

template <class StatesType>
void mamba3_check_mimo_states(const char* function, const char* what, const StatesType& s, const Mamba3Dims& dims) {
  const std::string prefix(what);
  if (s.angle.is_allocated()) {
    check_shape(function, (prefix + ".angle").c_str(), s.angle, {dims.batch, dims.nheads, dims.nangles},
                "(batch, nheads, nangles)");
  }
  if (s.ssm.is_allocated()) {
    check_shape(function, (prefix + ".ssm").c_str(), s.ssm, {dims.batch, dims.nheads, dims.headdim, dims.dstate},
                "(batch, nheads, headdim, dstate)");
  }
  if (s.k.is_allocated()) {
    check_shape(function, (prefix + ".k").c_str(), s.k, {dims.batch, dims.nheads, dims.rank, dims.dstate},
                "(batch, nheads, rank, dstate)");
  }
  if (s.v.is_allocated()) {
    check_shape(function, (prefix + ".v").c_str(), s.v, {dims.batch, dims.nheads, dims.rank, dims.headdim},
                "(batch, nheads, rank, headdim)");
  }
}

template <class MemorySpace>
Mamba3Dims mamba3_check_siso_args(const char* function, const Mamba3SisoArgs<MemorySpace>& args) {
  KMAMBA_REQUIRE(impl::mamba3_all_given(args.q, args.k, args.v, args.adt, args.dt, args.trap, args.q_bias, args.k_bias,
                                        args.angles),
                 function << ": q, k, v, adt, dt, trap, q_bias, k_bias and angles are required");
  Mamba3Dims dims;
  dims.batch = static_cast<std::int64_t>(args.v.extent(0));
  dims.seqlen = static_cast<std::int64_t>(args.v.extent(1));
  dims.nheads = static_cast<std::int64_t>(args.v.extent(2));
  dims.headdim = static_cast<std::int64_t>(args.v.extent(3));
  dims.ngroups = static_cast<std::int64_t>(args.q.extent(2));
  dims.dstate = static_cast<std::int64_t>(args.q.extent(3));
  dims.nangles = static_cast<std::int64_t>(args.angles.extent(3));
  dims.rank = 1;
  dims.mimo = false;
  mamba3_check_dims(function, dims, shape_of(args.v), shape_of(args.q), shape_of(args.angles));
  const Shape qk{dims.batch, dims.seqlen, dims.ngroups, dims.dstate};
  check_shape(function, "q", args.q, qk, "(batch, seqlen, ngroups, dstate)");
  check_shape(function, "k", args.k, qk, "(batch, seqlen, ngroups, dstate)");
  check_shape(function, "q_bias", args.q_bias, {dims.nheads, dims.dstate}, "(nheads, dstate)");
  check_shape(function, "k_bias", args.k_bias, {dims.nheads, dims.dstate}, "(nheads, dstate)");
  mamba3_check_common(function, dims, args.v, args.adt, args.dt, args.trap, args.angles, args.D, args.z, args.seq_idx,
                      args.chunk_size);
  mamba3_check_siso_states(function, "initial", args.initial, dims);
  if (args.ungated_out.is_allocated()) {
    KMAMBA_REQUIRE(args.z.is_allocated(),
                   function << ": ungated_out is given without z (without a gate the output is ungated)");
    check_shape(function, "ungated_out", args.ungated_out, shape_of(args.v), "(batch, seqlen, nheads, headdim)");
  }
  return dims;
}

template <class MemorySpace>
Mamba3Dims mamba3_check_mimo_args(const char* function, const Mamba3MimoArgs<MemorySpace>& args) {
  KMAMBA_REQUIRE(impl::mamba3_all_given(args.q, args.k, args.v, args.adt, args.dt, args.trap, args.q_bias, args.k_bias,
                                        args.angles, args.mimo_v, args.mimo_o),
                 function << ": q, k, v, adt, dt, trap, q_bias, k_bias, angles, mimo_v and mimo_o are required");
  Mamba3Dims dims;
  dims.batch = static_cast<std::int64_t>(args.v.extent(0));
  dims.seqlen = static_cast<std::int64_t>(args.v.extent(1));
  dims.nheads = static_cast<std::int64_t>(args.v.extent(2));
  dims.headdim = static_cast<std::int64_t>(args.v.extent(3));
  dims.rank = static_cast<std::int64_t>(args.q.extent(2));
  dims.ngroups = static_cast<std::int64_t>(args.q.extent(3));
  dims.dstate = static_cast<std::int64_t>(args.q.extent(4));
  dims.nangles = static_cast<std::int64_t>(args.angles.extent(3));
  dims.mimo = true;
  mamba3_check_dims(function, dims, shape_of(args.v), shape_of(args.q), shape_of(args.angles));
  const Shape qk{dims.batch, dims.seqlen, dims.rank, dims.ngroups, dims.dstate};
  check_shape(function, "q", args.q, qk, "(batch, seqlen, rank, ngroups, dstate)");
  check_shape(function, "k", args.k, qk, "(batch, seqlen, rank, ngroups, dstate)");
  const Shape bias{dims.nheads, dims.rank, dims.dstate};
  check_shape(function, "q_bias", args.q_bias, bias, "(nheads, rank, dstate)");
  check_shape(function, "k_bias", args.k_bias, bias, "(nheads, rank, dstate)");
  const Shape proj{dims.nheads, dims.rank, dims.headdim};
  check_shape(function, "mimo_v", args.mimo_v, proj, "(nheads, rank, headdim)");
  check_shape(function, "mimo_o", args.mimo_o, proj, "(nheads, rank, headdim)");
  KMAMBA_REQUIRE(args.z.is_allocated() == args.mimo_z.is_allocated(),
                 function << ": mimo_z must be given exactly when z is (z "
                          << (args.z.is_allocated() ? "given" : "absent") << ", mimo_z "
                          << (args.mimo_z.is_allocated() ? "given" : "absent") << ")");
  if (args.mimo_z.is_allocated()) check_shape(function, "mimo_z", args.mimo_z, proj, "(nheads, rank, headdim)");
  KMAMBA_REQUIRE(args.chunk_size >= 0,
                 function << ": chunk_size must be positive (or 0 for 64 / rank), got " << args.chunk_size);
  mamba3_check_common(function, dims, args.v, args.adt, args.dt, args.trap, args.angles, args.D, args.z, args.seq_idx,
                      mamba3_mimo_chunk_size(args.chunk_size, dims.rank));
  dims.packed = args.seq_idx.is_allocated();
  mamba3_check_mimo_states(function, "initial", args.initial, dims);
  return dims;
}

/// The required and optional gradient checks shared by both backward ops.
template <class Grads>
void mamba3_check_grads_common(const char* function, const Mamba3Dims& dims, const Grads& grads, bool has_z) {
  check_shape(function, "dv", grads.dv, {dims.batch, dims.seqlen, dims.nheads, dims.headdim},
              "(batch, seqlen, nheads, headdim)");
  const Shape per_token{dims.batch, dims.nheads, dims.seqlen};
  check_shape(function, "dadt", grads.dadt, per_token, "(batch, nheads, seqlen)");
  check_shape(function, "ddt", grads.ddt, per_token, "(batch, nheads, seqlen)");
  check_shape(function, "dtrap", grads.dtrap, per_token, "(batch, nheads, seqlen)");
  check_shape(function, "dangles", grads.dangles, {dims.batch, dims.seqlen, dims.nheads, dims.nangles},
              "(batch, seqlen, nheads, nangles)");
  check_allocated(function, "dq", grads.dq);
  check_allocated(function, "dk", grads.dk);
  check_allocated(function, "dv", grads.dv);
  check_allocated(function, "dadt", grads.dadt);
  check_allocated(function, "ddt", grads.ddt);
  check_allocated(function, "dtrap", grads.dtrap);
  check_allocated(function, "dq_bias", grads.dq_bias);
  check_allocated(function, "dk_bias", grads.dk_bias);
  check_allocated(function, "dangles", grads.dangles);
  if (grads.dD.is_allocated()) check_shape(function, "dD", grads.dD, {dims.nheads}, "(nheads)");
  KMAMBA_REQUIRE(has_z == grads.dz.is_allocated(),
                 function << ": dz must be allocated exactly when z is given (z " << (has_z ? "given" : "absent")
                          << ", dz " << (grads.dz.is_allocated() ? "allocated" : "absent") << ")");
  if (grads.dz.is_allocated()) {
    check_shape(function, "dz", grads.dz, {dims.batch, dims.seqlen, dims.nheads, dims.headdim},
                "(batch, seqlen, nheads, headdim)");
  }
}

template <class MemorySpace>
Mamba3StateViews<float, MemorySpace> mamba3_state_views(const Mamba3SisoStates<MemorySpace>& s) {
  Mamba3StateViews<float, MemorySpace> out;
  out.angle = s.angle;
  out.ssm = s.ssm;
  out.k3 = s.k;
  out.v3 = s.v;
  out.set_flags(false);
  return out;
}

template <class MemorySpace>
Mamba3StateViews<const float, MemorySpace> mamba3_state_views(const Mamba3SisoConstStates<MemorySpace>& s) {
  Mamba3StateViews<const float, MemorySpace> out;
  out.angle = s.angle;
  out.ssm = s.ssm;
  out.k3 = s.k;
  out.v3 = s.v;
  out.set_flags(false);
  return out;
}

template <class MemorySpace>
Mamba3StateViews<float, MemorySpace> mamba3_state_views(const Mamba3MimoStates<MemorySpace>& s) {
  Mamba3StateViews<float, MemorySpace> out;
  out.angle = s.angle;
  out.ssm = s.ssm;
  out.k4 = s.k;
  out.v4 = s.v;
  out.set_flags(true);
  return out;
}

template <class MemorySpace>
Mamba3StateViews<const float, MemorySpace> mamba3_state_views(const Mamba3MimoConstStates<MemorySpace>& s) {
  Mamba3StateViews<const float, MemorySpace> out;
  out.angle = s.angle;
  out.ssm = s.ssm;
  out.k4 = s.k;
  out.v4 = s.v;
  out.set_flags(true);
  return out;
}

template <class MemorySpace>
Mamba3Operands<MemorySpace> mamba3_operands(const Mamba3SisoArgs<MemorySpace>& args) {
  Mamba3Operands<MemorySpace> in;
  in.q4 = args.q;
  in.k4 = args.k;
  in.v = args.v;
  in.adt = args.adt;
  in.dt = args.dt;
  in.trap = args.trap;
  in.q_bias2 = args.q_bias;
  in.k_bias2 = args.k_bias;
  in.angles = args.angles;
  in.D = args.D;
  in.z = args.z;
  in.ungated = args.ungated_out;
  in.initial = mamba3_state_views(args.initial);
  in.mimo = false;
  in.wrap_angle = true;
  in.set_seq_idx(args.seq_idx);
  in.has_D = args.D.is_allocated();
  in.has_z = args.z.is_allocated();
  return in;
}

template <class MemorySpace>
Mamba3Operands<MemorySpace> mamba3_operands(const Mamba3MimoArgs<MemorySpace>& args) {
  Mamba3Operands<MemorySpace> in;
  in.q5 = args.q;
  in.k5 = args.k;
  in.v = args.v;
  in.adt = args.adt;
  in.dt = args.dt;
  in.trap = args.trap;
  in.q_bias3 = args.q_bias;
  in.k_bias3 = args.k_bias;
  in.angles = args.angles;
  in.mimo_v = args.mimo_v;
  in.mimo_z = args.mimo_z;
  in.mimo_o = args.mimo_o;
  in.D = args.D;
  in.z = args.z;
  in.initial = mamba3_state_views(args.initial);
  in.mimo = true;
  in.wrap_angle = false;
  in.set_seq_idx(args.seq_idx);
  in.has_D = args.D.is_allocated();
  in.has_z = args.z.is_allocated();
  return in;
}

}  // namespace impl

/// Mamba-3 SISO forward. Writes `out` and, for each allocated view of `final_states`, that final
/// state (the initial state, or zero, for seqlen 0). Non-blocking on `exec` (see the file comment).
/// Throws kmamba::UserError for a wrong shape (the message names both shapes) or a chunk_size the
/// team scratch memory cannot hold.
template <class ExecutionSpace, class MemorySpace>
void mamba3_siso_forward(const ExecutionSpace& exec, const Mamba3SisoArgs<MemorySpace>& args,
                         const Tensor4<float, MemorySpace>& out,  // (batch, seqlen, nheads, headdim)
                         const Mamba3SisoStates<MemorySpace>& final_states) {
  const ProfilingRegion region("kmamba::mamba3_siso_forward");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::mamba3_siso_forward: the execution space cannot access the tensors' memory space");
  constexpr const char* function = "kmamba::mamba3_siso_forward";
  const impl::Mamba3Dims dims = impl::mamba3_check_siso_args(function, args);
  check_shape(function, "out", out, {dims.batch, dims.seqlen, dims.nheads, dims.headdim},
              "(batch, seqlen, nheads, headdim)");
  check_allocated(function, "out", out);
  impl::mamba3_check_siso_states(function, "final_states", final_states, dims);
  impl::mamba3_forward_impl(exec, function, dims, args.chunk_size, args.matmul_precision, impl::mamba3_operands(args),
                            out, impl::mamba3_state_views(final_states));
}

template <class MemorySpace>
void mamba3_siso_forward(const Mamba3SisoArgs<MemorySpace>& args,
                         const Tensor4<float, MemorySpace>& out,  // (batch, seqlen, nheads, headdim)
                         const Mamba3SisoStates<MemorySpace>& final_states) {
  mamba3_siso_forward(typename Tensor4<float, MemorySpace>::execution_space(), args, out, final_states);
}

/// Mamba-3 SISO backward: the gradients of sum(out·dout) + Σ sum(final state·its cotangent) with
/// respect to every input (see Mamba3SisoGrads for which are written). Each view of
/// `dfinal_states` is optional (absent = zero). The forward stages are recomputed (with z, the output
/// before the gate too, unless args.ungated_out holds it). Every sum over
/// batch, seqlen or the heads of a group is taken in a fixed order: no atomics, identical results
/// from run to run. Non-blocking on `exec` (see the file comment).
template <class ExecutionSpace, class MemorySpace>
void mamba3_siso_backward(
    const ExecutionSpace& exec, const Mamba3SisoArgs<MemorySpace>& args,
    const ConstTensor4<float, impl::Mamba3NonDeduced<MemorySpace>>& dout,  // (batch, seqlen, nheads, headdim)
    const Mamba3SisoConstStates<impl::Mamba3NonDeduced<MemorySpace>>& dfinal_states,
    const Mamba3SisoGrads<MemorySpace>& grads) {
  const ProfilingRegion region("kmamba::mamba3_siso_backward");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::mamba3_siso_backward: the execution space cannot access the tensors' memory space");
  constexpr const char* function = "kmamba::mamba3_siso_backward";
  const impl::Mamba3Dims dims = impl::mamba3_check_siso_args(function, args);
  check_shape(function, "dout", dout, {dims.batch, dims.seqlen, dims.nheads, dims.headdim},
              "(batch, seqlen, nheads, headdim)");
  check_allocated(function, "dout", dout);
  impl::mamba3_check_siso_states(function, "dfinal_states", dfinal_states, dims);
  const Shape qk{dims.batch, dims.seqlen, dims.ngroups, dims.dstate};
  check_shape(function, "dq", grads.dq, qk, "(batch, seqlen, ngroups, dstate)");
  check_shape(function, "dk", grads.dk, qk, "(batch, seqlen, ngroups, dstate)");
  check_shape(function, "dq_bias", grads.dq_bias, {dims.nheads, dims.dstate}, "(nheads, dstate)");
  check_shape(function, "dk_bias", grads.dk_bias, {dims.nheads, dims.dstate}, "(nheads, dstate)");
  impl::mamba3_check_grads_common(function, dims, grads, args.z.is_allocated());
  impl::mamba3_check_siso_states(function, "dinitial", grads.dinitial, dims);
  impl::Mamba3GradViews<MemorySpace> g;
  g.dq4 = grads.dq;
  g.dk4 = grads.dk;
  g.dq_bias2 = grads.dq_bias;
  g.dk_bias2 = grads.dk_bias;
  g.dv = grads.dv;
  g.dadt = grads.dadt;
  g.ddt = grads.ddt;
  g.dtrap = grads.dtrap;
  g.dangles = grads.dangles;
  g.dD = grads.dD;
  g.dz = grads.dz;
  g.dinitial = impl::mamba3_state_views(grads.dinitial);
  g.mimo = false;
  impl::mamba3_backward_impl(exec, function, dims, args.chunk_size, args.matmul_precision, impl::mamba3_operands(args),
                             dout, impl::mamba3_state_views(dfinal_states), g);
}

template <class MemorySpace>
void mamba3_siso_backward(
    const Mamba3SisoArgs<MemorySpace>& args,
    const ConstTensor4<float, impl::Mamba3NonDeduced<MemorySpace>>& dout,  // (batch, seqlen, nheads, headdim)
    const Mamba3SisoConstStates<impl::Mamba3NonDeduced<MemorySpace>>& dfinal_states,
    const Mamba3SisoGrads<MemorySpace>& grads) {
  mamba3_siso_backward(typename Tensor4<float, MemorySpace>::execution_space(), args, dout, dfinal_states, grads);
}

/// Mamba-3 MIMO forward (see mamba3_siso_forward).
template <class ExecutionSpace, class MemorySpace>
void mamba3_mimo_forward(const ExecutionSpace& exec, const Mamba3MimoArgs<MemorySpace>& args,
                         const Tensor4<float, MemorySpace>& out,  // (batch, seqlen, nheads, headdim)
                         const Mamba3MimoStates<MemorySpace>& final_states) {
  const ProfilingRegion region("kmamba::mamba3_mimo_forward");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::mamba3_mimo_forward: the execution space cannot access the tensors' memory space");
  constexpr const char* function = "kmamba::mamba3_mimo_forward";
  const impl::Mamba3Dims dims = impl::mamba3_check_mimo_args(function, args);
  check_shape(function, "out", out, {dims.batch, dims.seqlen, dims.nheads, dims.headdim},
              "(batch, seqlen, nheads, headdim)");
  check_allocated(function, "out", out);
  impl::mamba3_check_mimo_states(function, "final_states", final_states, dims);
  impl::mamba3_forward_impl(exec, function, dims, impl::mamba3_mimo_chunk_size(args.chunk_size, dims.rank),
                            args.matmul_precision, impl::mamba3_operands(args), out,
                            impl::mamba3_state_views(final_states));
}

template <class MemorySpace>
void mamba3_mimo_forward(const Mamba3MimoArgs<MemorySpace>& args,
                         const Tensor4<float, MemorySpace>& out,  // (batch, seqlen, nheads, headdim)
                         const Mamba3MimoStates<MemorySpace>& final_states) {
  mamba3_mimo_forward(typename Tensor4<float, MemorySpace>::execution_space(), args, out, final_states);
}

/// Mamba-3 MIMO backward (see mamba3_siso_backward; also the gradients of the rank projections).
template <class ExecutionSpace, class MemorySpace>
void mamba3_mimo_backward(
    const ExecutionSpace& exec, const Mamba3MimoArgs<MemorySpace>& args,
    const ConstTensor4<float, impl::Mamba3NonDeduced<MemorySpace>>& dout,  // (batch, seqlen, nheads, headdim)
    const Mamba3MimoConstStates<impl::Mamba3NonDeduced<MemorySpace>>& dfinal_states,
    const Mamba3MimoGrads<MemorySpace>& grads) {
  const ProfilingRegion region("kmamba::mamba3_mimo_backward");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::mamba3_mimo_backward: the execution space cannot access the tensors' memory space");
  constexpr const char* function = "kmamba::mamba3_mimo_backward";
  const impl::Mamba3Dims dims = impl::mamba3_check_mimo_args(function, args);
  check_shape(function, "dout", dout, {dims.batch, dims.seqlen, dims.nheads, dims.headdim},
              "(batch, seqlen, nheads, headdim)");
  check_allocated(function, "dout", dout);
  impl::mamba3_check_mimo_states(function, "dfinal_states", dfinal_states, dims);
  const Shape qk{dims.batch, dims.seqlen, dims.rank, dims.ngroups, dims.dstate};
  check_shape(function, "dq", grads.dq, qk, "(batch, seqlen, rank, ngroups, dstate)");
  check_shape(function, "dk", grads.dk, qk, "(batch, seqlen, rank, ngroups, dstate)");
  const Shape bias{dims.nheads, dims.rank, dims.dstate};
  check_shape(function, "dq_bias", grads.dq_bias, bias, "(nheads, rank, dstate)");
  check_shape(function, "dk_bias", grads.dk_bias, bias, "(nheads, rank, dstate)");
  const Shape proj{dims.nheads, dims.rank, dims.headdim};
  check_shape(function, "dmimo_v", grads.dmimo_v, proj, "(nheads, rank, headdim)");
  check_shape(function, "dmimo_o", grads.dmimo_o, proj, "(nheads, rank, headdim)");
  check_allocated(function, "dmimo_v", grads.dmimo_v);
  check_allocated(function, "dmimo_o", grads.dmimo_o);
  KMAMBA_REQUIRE(args.z.is_allocated() == grads.dmimo_z.is_allocated(),
                 function << ": dmimo_z must be allocated exactly when z is given (z "
                          << (args.z.is_allocated() ? "given" : "absent") << ", dmimo_z "
                          << (grads.dmimo_z.is_allocated() ? "allocated" : "absent") << ")");
  if (grads.dmimo_z.is_allocated()) check_shape(function, "dmimo_z", grads.dmimo_z, proj, "(nheads, rank, headdim)");
  impl::mamba3_check_grads_common(function, dims, grads, args.z.is_allocated());
  impl::mamba3_check_mimo_states(function, "dinitial", grads.dinitial, dims);
  impl::Mamba3GradViews<MemorySpace> g;
  g.dq5 = grads.dq;
  g.dk5 = grads.dk;
  g.dq_bias3 = grads.dq_bias;
  g.dk_bias3 = grads.dk_bias;
  g.dv = grads.dv;
  g.dadt = grads.dadt;
  g.ddt = grads.ddt;
  g.dtrap = grads.dtrap;
  g.dangles = grads.dangles;
  g.dmimo_v = grads.dmimo_v;
  g.dmimo_z = grads.dmimo_z;
  g.dmimo_o = grads.dmimo_o;
  g.dD = grads.dD;
  g.dz = grads.dz;
  g.dinitial = impl::mamba3_state_views(grads.dinitial);
  g.mimo = true;
  impl::mamba3_backward_impl(exec, function, dims, impl::mamba3_mimo_chunk_size(args.chunk_size, dims.rank),
                             args.matmul_precision, impl::mamba3_operands(args), dout,
                             impl::mamba3_state_views(dfinal_states), g);
}

template <class MemorySpace>
void mamba3_mimo_backward(
    const Mamba3MimoArgs<MemorySpace>& args,
    const ConstTensor4<float, impl::Mamba3NonDeduced<MemorySpace>>& dout,  // (batch, seqlen, nheads, headdim)
    const Mamba3MimoConstStates<impl::Mamba3NonDeduced<MemorySpace>>& dfinal_states,
    const Mamba3MimoGrads<MemorySpace>& grads) {
  mamba3_mimo_backward(typename Tensor4<float, MemorySpace>::execution_space(), args, dout, dfinal_states, grads);
}

namespace impl {

template <class MemorySpace, class StepArgs>
void mamba3_check_step_common(const char* function, const Mamba3Dims& dims, const StepArgs& args,
                              const Tensor3<float, MemorySpace>& out) {
  check_shape(function, "v", args.v, {dims.batch, dims.nheads, dims.headdim}, "(batch, nheads, headdim)");
  const Shape per_head{dims.batch, dims.nheads};
  check_shape(function, "adt", args.adt, per_head, "(batch, nheads)");
  check_shape(function, "dt", args.dt, per_head, "(batch, nheads)");
  check_shape(function, "trap", args.trap, per_head, "(batch, nheads)");
  check_shape(function, "angles", args.angles, {dims.batch, dims.nheads, dims.nangles}, "(batch, nheads, nangles)");
  if (args.D.is_allocated()) check_shape(function, "D", args.D, {dims.nheads}, "(nheads)");
  if (args.z.is_allocated())
    check_shape(function, "z", args.z, {dims.batch, dims.nheads, dims.headdim}, "(batch, nheads, headdim)");
  check_shape(function, "out", out, {dims.batch, dims.nheads, dims.headdim}, "(batch, nheads, headdim)");
  check_allocated(function, "out", out);
}

template <class StatesType>
void mamba3_require_all_states(const char* function, const StatesType& states) {
  KMAMBA_REQUIRE(
      states.angle.is_allocated() && states.ssm.is_allocated() && states.k.is_allocated() && states.v.is_allocated(),
      function << ": the step needs all four states (angle, ssm, k, v) allocated");
}

}  // namespace impl

/// SISO decode step: advances `states` (all four required) in place by one token and writes `out`,
/// what mamba3_siso_forward computes for that token given those states as its initial states.
/// Non-blocking on `exec`.
template <class ExecutionSpace, class MemorySpace>
void mamba3_siso_step(const ExecutionSpace& exec, const Mamba3SisoStepArgs<MemorySpace>& args,
                      const Mamba3SisoStates<MemorySpace>& states,  // updated in place
                      const Tensor3<float, MemorySpace>& out) {     // (batch, nheads, headdim)
  const ProfilingRegion region("kmamba::mamba3_siso_step");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::mamba3_siso_step: the execution space cannot access the tensors' memory space");
  constexpr const char* function = "kmamba::mamba3_siso_step";
  KMAMBA_REQUIRE(impl::mamba3_all_given(args.q, args.k, args.v, args.adt, args.dt, args.trap, args.q_bias, args.k_bias,
                                        args.angles),
                 function << ": q, k, v, adt, dt, trap, q_bias, k_bias and angles are required");
  impl::Mamba3Dims dims;
  dims.batch = static_cast<std::int64_t>(args.v.extent(0));
  dims.seqlen = 1;
  dims.nheads = static_cast<std::int64_t>(args.v.extent(1));
  dims.headdim = static_cast<std::int64_t>(args.v.extent(2));
  dims.ngroups = static_cast<std::int64_t>(args.q.extent(1));
  dims.dstate = static_cast<std::int64_t>(args.q.extent(2));
  dims.nangles = static_cast<std::int64_t>(args.angles.extent(2));
  impl::mamba3_check_dims(function, dims, shape_of(args.v), shape_of(args.q), shape_of(args.angles));
  check_shape(function, "q", args.q, {dims.batch, dims.ngroups, dims.dstate}, "(batch, ngroups, dstate)");
  check_shape(function, "k", args.k, {dims.batch, dims.ngroups, dims.dstate}, "(batch, ngroups, dstate)");
  check_shape(function, "q_bias", args.q_bias, {dims.nheads, dims.dstate}, "(nheads, dstate)");
  check_shape(function, "k_bias", args.k_bias, {dims.nheads, dims.dstate}, "(nheads, dstate)");
  impl::mamba3_check_step_common(function, dims, args, out);
  impl::mamba3_require_all_states(function, states);
  impl::mamba3_check_siso_states(function, "states", states, dims);
  impl::Mamba3StepOperands<MemorySpace> in;
  in.q3 = args.q;
  in.k3 = args.k;
  in.q_bias2 = args.q_bias;
  in.k_bias2 = args.k_bias;
  in.set_common(args);
  in.mimo = false;
  in.wrap_angle = true;
  impl::mamba3_step_impl(exec, function, dims, in, impl::mamba3_state_views(states), out);
}

template <class MemorySpace>
void mamba3_siso_step(const Mamba3SisoStepArgs<MemorySpace>& args,
                      const Mamba3SisoStates<MemorySpace>& states,  // updated in place
                      const Tensor3<float, MemorySpace>& out) {     // (batch, nheads, headdim)
  mamba3_siso_step(typename Tensor3<float, MemorySpace>::execution_space(), args, states, out);
}

/// MIMO decode step (see mamba3_siso_step; the angle state is not reduced mod 2π, as in the
/// forward).
template <class ExecutionSpace, class MemorySpace>
void mamba3_mimo_step(const ExecutionSpace& exec, const Mamba3MimoStepArgs<MemorySpace>& args,
                      const Mamba3MimoStates<MemorySpace>& states,  // updated in place
                      const Tensor3<float, MemorySpace>& out) {     // (batch, nheads, headdim)
  const ProfilingRegion region("kmamba::mamba3_mimo_step");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::mamba3_mimo_step: the execution space cannot access the tensors' memory space");
  constexpr const char* function = "kmamba::mamba3_mimo_step";
  KMAMBA_REQUIRE(impl::mamba3_all_given(args.q, args.k, args.v, args.adt, args.dt, args.trap, args.q_bias, args.k_bias,
                                        args.angles, args.mimo_v, args.mimo_o),
                 function << ": q, k, v, adt, dt, trap, q_bias, k_bias, angles, mimo_v and mimo_o are required");
  impl::Mamba3Dims dims;
  dims.batch = static_cast<std::int64_t>(args.v.extent(0));
  dims.seqlen = 1;
  dims.nheads = static_cast<std::int64_t>(args.v.extent(1));
  dims.headdim = static_cast<std::int64_t>(args.v.extent(2));
  dims.rank = static_cast<std::int64_t>(args.q.extent(1));
  dims.ngroups = static_cast<std::int64_t>(args.q.extent(2));
  dims.dstate = static_cast<std::int64_t>(args.q.extent(3));
  dims.nangles = static_cast<std::int64_t>(args.angles.extent(2));
  dims.mimo = true;
  impl::mamba3_check_dims(function, dims, shape_of(args.v), shape_of(args.q), shape_of(args.angles));
  const Shape qk{dims.batch, dims.rank, dims.ngroups, dims.dstate};
  check_shape(function, "q", args.q, qk, "(batch, rank, ngroups, dstate)");
  check_shape(function, "k", args.k, qk, "(batch, rank, ngroups, dstate)");
  const Shape bias{dims.nheads, dims.rank, dims.dstate};
  check_shape(function, "q_bias", args.q_bias, bias, "(nheads, rank, dstate)");
  check_shape(function, "k_bias", args.k_bias, bias, "(nheads, rank, dstate)");
  const Shape proj{dims.nheads, dims.rank, dims.headdim};
  check_shape(function, "mimo_v", args.mimo_v, proj, "(nheads, rank, headdim)");
  check_shape(function, "mimo_o", args.mimo_o, proj, "(nheads, rank, headdim)");
  KMAMBA_REQUIRE(args.z.is_allocated() == args.mimo_z.is_allocated(),
                 function << ": mimo_z must be given exactly when z is (z "
                          << (args.z.is_allocated() ? "given" : "absent") << ", mimo_z "
                          << (args.mimo_z.is_allocated() ? "given" : "absent") << ")");
  if (args.mimo_z.is_allocated()) check_shape(function, "mimo_z", args.mimo_z, proj, "(nheads, rank, headdim)");
  impl::mamba3_check_step_common(function, dims, args, out);
  impl::mamba3_require_all_states(function, states);
  impl::mamba3_check_mimo_states(function, "states", states, dims);
  impl::Mamba3StepOperands<MemorySpace> in;
  in.q4 = args.q;
  in.k4 = args.k;
  in.q_bias3 = args.q_bias;
  in.k_bias3 = args.k_bias;
  in.mimo_v = args.mimo_v;
  in.mimo_z = args.mimo_z;
  in.mimo_o = args.mimo_o;
  in.set_common(args);
  in.mimo = true;
  in.wrap_angle = false;
  impl::mamba3_step_impl(exec, function, dims, in, impl::mamba3_state_views(states), out);
}

template <class MemorySpace>
void mamba3_mimo_step(const Mamba3MimoStepArgs<MemorySpace>& args,
                      const Mamba3MimoStates<MemorySpace>& states,  // updated in place
                      const Tensor3<float, MemorySpace>& out) {     // (batch, nheads, headdim)
  mamba3_mimo_step(typename Tensor3<float, MemorySpace>::execution_space(), args, states, out);
}

}  // namespace kmamba

#endif
