// The Mamba-3 scan's dimensions and the views its kernels read and write: the operands and gradients
// of either variant (SISO, MIMO) behind one interface, the states and the decode step's operands.
#ifndef KMAMBA_CORE_IMPL_MAMBA3SCANOPERANDS_HPP
#define KMAMBA_CORE_IMPL_MAMBA3SCANOPERANDS_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Tensor.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>

namespace kmamba {
namespace impl {

// Keeps a parameter out of template argument deduction (so that a Tensor4<float> converts to the
// ConstTensor4<float> a public op takes).
template <class T>
struct Mamba3Identity {
  using type = T;
};
template <class T>
using Mamba3NonDeduced = typename Mamba3Identity<T>::type;

constexpr float mamba3_pi = 3.14159265358979323846f;
constexpr float mamba3_two_pi = 6.28318530717958647692f;

struct Mamba3Dims {
  std::int64_t batch = 0, seqlen = 0, nheads = 0, headdim = 0, ngroups = 1, dstate = 0, nangles = 0, rank = 1;
  bool mimo = false;
  bool packed = false;  // MIMO with packed sequence ids: the chunk stages count document starts
};

/// A required input is given when it is allocated or has a zero extent (a sequence of length 0, no
/// angles): only a default-constructed View counts as missing.
template <class View>
bool mamba3_given(const View& view) {
  if (view.is_allocated()) return true;
  for (unsigned i = 0; i < View::rank; ++i) {
    if (view.extent(i) != 0) return true;
  }
  return false;
}

template <class... Views>
bool mamba3_all_given(const Views&... views) {
  return (mamba3_given(views) && ...);
}

/// The MIMO chunk size: `chunk_size`, or the reference's 64 / rank when 0.
inline int mamba3_mimo_chunk_size(int chunk_size, std::int64_t rank) {
  if (chunk_size > 0) return chunk_size;
  return rank >= 64 ? 1 : static_cast<int>(64 / std::max<std::int64_t>(rank, 1));
}

/// A set of states of either variant: SISO k, v have no rank axis (k3, v3), MIMO ones do (k4, v4).
/// T is float (states written) or const float (states read). The has_* flags say which are present.
template <class T, class MemorySpace>
struct Mamba3StateViews {
  Tensor3<T, MemorySpace> angle;  // (batch, nheads, nangles)
  Tensor4<T, MemorySpace> ssm;    // (batch, nheads, headdim, dstate)
  Tensor3<T, MemorySpace> k3;     // SISO: (batch, nheads, dstate)
  Tensor3<T, MemorySpace> v3;     // SISO: (batch, nheads, headdim)
  Tensor4<T, MemorySpace> k4;     // MIMO: (batch, nheads, rank, dstate)
  Tensor4<T, MemorySpace> v4;     // MIMO: (batch, nheads, rank, headdim)
  bool mimo = false, has_angle = false, has_ssm = false, has_k = false, has_v = false;

  void set_flags(bool is_mimo) {
    mimo = is_mimo;
    has_angle = angle.is_allocated();
    has_ssm = ssm.is_allocated();
    has_k = mimo ? k4.is_allocated() : k3.is_allocated();
    has_v = mimo ? v4.is_allocated() : v3.is_allocated();
  }
  KOKKOS_INLINE_FUNCTION T& k(int b, int h, int r, int n) const { return mimo ? k4(b, h, r, n) : k3(b, h, n); }
  KOKKOS_INLINE_FUNCTION T& v(int b, int h, int r, int p) const { return mimo ? v4(b, h, r, p) : v3(b, h, p); }
  KOKKOS_INLINE_FUNCTION float angle_or_zero(int b, int h, int i) const { return has_angle ? angle(b, h, i) : 0.0f; }
  KOKKOS_INLINE_FUNCTION float ssm_or_zero(int b, int h, int p, int n) const {
    return has_ssm ? ssm(b, h, p, n) : 0.0f;
  }
  KOKKOS_INLINE_FUNCTION float k_or_zero(int b, int h, int r, int n) const { return has_k ? k(b, h, r, n) : 0.0f; }
  KOKKOS_INLINE_FUNCTION float v_or_zero(int b, int h, int r, int p) const { return has_v ? v(b, h, r, p) : 0.0f; }
};

/// The inputs of either variant as the kernels read them (SISO: q4, k4, q_bias2, k_bias2 and unit
/// projections; MIMO: q5, k5, q_bias3, k_bias3, mimo_*).
template <class MemorySpace>
struct Mamba3Operands {
  ConstTensor4<float, MemorySpace> q4, k4;                  // SISO: (batch, seqlen, ngroups, dstate)
  ConstTensor5<float, MemorySpace> q5, k5;                  // MIMO: (batch, seqlen, rank, ngroups, dstate)
  ConstTensor4<float, MemorySpace> v;                       // (batch, seqlen, nheads, headdim)
  ConstTensor3<float, MemorySpace> adt, dt, trap;           // (batch, nheads, seqlen)
  ConstTensor2<float, MemorySpace> q_bias2, k_bias2;        // SISO: (nheads, dstate)
  ConstTensor3<float, MemorySpace> q_bias3, k_bias3;        // MIMO: (nheads, rank, dstate)
  ConstTensor4<float, MemorySpace> angles;                  // (batch, seqlen, nheads, nangles)
  ConstTensor3<float, MemorySpace> mimo_v, mimo_z, mimo_o;  // MIMO: (nheads, rank, headdim)
  ConstTensor1<float, MemorySpace> D;                       // (nheads)
  ConstTensor4<float, MemorySpace> z;                       // (batch, seqlen, nheads, headdim)
  /// SISO with z, optional (batch, seqlen, nheads, headdim): the output before the gate, written by
  /// the forward and read by the backward (Mamba3SisoArgs::ungated_out)
  Tensor4<float, MemorySpace> ungated;
  Mamba3StateViews<const float, MemorySpace> initial;
  ConstTensor2<std::int64_t, MemorySpace> seq_idx;  // (batch, seqlen), with has_seq_idx: packed sequence ids
  /// SISO keeps its angles reduced into [0, 2π); MIMO reports the plain sum.
  bool mimo = false, wrap_angle = true, has_D = false, has_z = false, has_seq_idx = false;

  void set_seq_idx(const ConstTensor2<std::int64_t, MemorySpace>& ids) {
    seq_idx = ids;
    has_seq_idx = ids.is_allocated();
  }
  /// Whether a packed document starts at token t > 0 (the row's first token never starts one: the
  /// initial states belong to its first document).
  KOKKOS_INLINE_FUNCTION bool starts(int b, int t) const {
    return has_seq_idx && t > 0 && seq_idx(b, t) != seq_idx(b, t - 1);
  }

  KOKKOS_INLINE_FUNCTION float q_in(int b, int t, int r, int g, int n) const {
    return mimo ? q5(b, t, r, g, n) : q4(b, t, g, n);
  }
  KOKKOS_INLINE_FUNCTION float k_in(int b, int t, int r, int g, int n) const {
    return mimo ? k5(b, t, r, g, n) : k4(b, t, g, n);
  }
  KOKKOS_INLINE_FUNCTION float q_bias(int h, int r, int n) const { return mimo ? q_bias3(h, r, n) : q_bias2(h, n); }
  KOKKOS_INLINE_FUNCTION float k_bias(int h, int r, int n) const { return mimo ? k_bias3(h, r, n) : k_bias2(h, n); }
  KOKKOS_INLINE_FUNCTION float v_proj(int h, int r, int p) const { return mimo ? mimo_v(h, r, p) : 1.0f; }
  KOKKOS_INLINE_FUNCTION float z_proj(int h, int r, int p) const { return mimo ? mimo_z(h, r, p) : 1.0f; }
  KOKKOS_INLINE_FUNCTION float o_proj(int h, int r, int p) const { return mimo ? mimo_o(h, r, p) : 1.0f; }
  KOKKOS_INLINE_FUNCTION float skip(int h) const { return has_D ? D(h) : 0.0f; }
  /// β̃_t = (1 − σ(trap_t))·dt_t, written σ(−trap_t)·dt_t; 0 where a document starts (no previous
  /// token).
  KOKKOS_INLINE_FUNCTION float beta_tilde(int b, int h, int t) const {
    return starts(b, t) ? 0.0f : sigmoid(-trap(b, h, t)) * dt(b, h, t);
  }
};

/// The gradients of either variant (SISO: dq4, dk4, dq_bias2, dk_bias2; MIMO: dq5, dk5, dq_bias3,
/// dk_bias3, dmimo_*). Optional ones are unallocated when not wanted.
template <class MemorySpace>
struct Mamba3GradViews {
  Tensor4<float, MemorySpace> dq4, dk4;                   // SISO: (batch, seqlen, ngroups, dstate)
  Tensor5<float, MemorySpace> dq5, dk5;                   // MIMO: (batch, seqlen, rank, ngroups, dstate)
  Tensor2<float, MemorySpace> dq_bias2, dk_bias2;         // SISO: (nheads, dstate)
  Tensor3<float, MemorySpace> dq_bias3, dk_bias3;         // MIMO: (nheads, rank, dstate)
  Tensor4<float, MemorySpace> dv;                         // (batch, seqlen, nheads, headdim)
  Tensor3<float, MemorySpace> dadt, ddt, dtrap;           // (batch, nheads, seqlen)
  Tensor4<float, MemorySpace> dangles;                    // (batch, seqlen, nheads, nangles)
  Tensor3<float, MemorySpace> dmimo_v, dmimo_z, dmimo_o;  // MIMO: (nheads, rank, headdim)
  Tensor1<float, MemorySpace> dD;                         // (nheads)
  Tensor4<float, MemorySpace> dz;                         // (batch, seqlen, nheads, headdim)
  Mamba3StateViews<float, MemorySpace> dinitial;
  bool mimo = false;

  KOKKOS_INLINE_FUNCTION float& dq(int b, int t, int r, int g, int n) const {
    return mimo ? dq5(b, t, r, g, n) : dq4(b, t, g, n);
  }
  KOKKOS_INLINE_FUNCTION float& dk(int b, int t, int r, int g, int n) const {
    return mimo ? dk5(b, t, r, g, n) : dk4(b, t, g, n);
  }
  KOKKOS_INLINE_FUNCTION float& dq_bias(int h, int r, int n) const { return mimo ? dq_bias3(h, r, n) : dq_bias2(h, n); }
  KOKKOS_INLINE_FUNCTION float& dk_bias(int h, int r, int n) const { return mimo ? dk_bias3(h, r, n) : dk_bias2(h, n); }
};

/// The inputs of a decode step of either variant.
template <class MemorySpace>
struct Mamba3StepOperands {
  ConstTensor3<float, MemorySpace> q3, k3;                  // SISO: (batch, ngroups, dstate)
  ConstTensor4<float, MemorySpace> q4, k4;                  // MIMO: (batch, rank, ngroups, dstate)
  ConstTensor3<float, MemorySpace> v;                       // (batch, nheads, headdim)
  ConstTensor2<float, MemorySpace> adt, dt, trap;           // (batch, nheads)
  ConstTensor2<float, MemorySpace> q_bias2, k_bias2;        // SISO: (nheads, dstate)
  ConstTensor3<float, MemorySpace> q_bias3, k_bias3;        // MIMO: (nheads, rank, dstate)
  ConstTensor3<float, MemorySpace> angles;                  // (batch, nheads, nangles)
  ConstTensor3<float, MemorySpace> mimo_v, mimo_z, mimo_o;  // MIMO: (nheads, rank, headdim)
  ConstTensor1<float, MemorySpace> D;                       // (nheads)
  ConstTensor3<float, MemorySpace> z;                       // (batch, nheads, headdim)
  bool mimo = false, wrap_angle = true, has_D = false, has_z = false;

  template <class StepArgs>
  void set_common(const StepArgs& args) {
    v = args.v;
    adt = args.adt;
    dt = args.dt;
    trap = args.trap;
    angles = args.angles;
    D = args.D;
    z = args.z;
    has_D = args.D.is_allocated();
    has_z = args.z.is_allocated();
  }
  KOKKOS_INLINE_FUNCTION float q_in(int b, int r, int g, int n) const { return mimo ? q4(b, r, g, n) : q3(b, g, n); }
  KOKKOS_INLINE_FUNCTION float k_in(int b, int r, int g, int n) const { return mimo ? k4(b, r, g, n) : k3(b, g, n); }
  KOKKOS_INLINE_FUNCTION float q_bias(int h, int r, int n) const { return mimo ? q_bias3(h, r, n) : q_bias2(h, n); }
  KOKKOS_INLINE_FUNCTION float k_bias(int h, int r, int n) const { return mimo ? k_bias3(h, r, n) : k_bias2(h, n); }
  KOKKOS_INLINE_FUNCTION float v_proj(int h, int r, int p) const { return mimo ? mimo_v(h, r, p) : 1.0f; }
  KOKKOS_INLINE_FUNCTION float z_proj(int h, int r, int p) const { return mimo ? mimo_z(h, r, p) : 1.0f; }
  KOKKOS_INLINE_FUNCTION float o_proj(int h, int r, int p) const { return mimo ? mimo_o(h, r, p) : 1.0f; }
};

}  // namespace impl
}  // namespace kmamba

#endif
