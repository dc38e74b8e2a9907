// The SSD's dimensions, launch plan, inputs and forward workspace as the kernels read them, shared
// by the staged stages (impl/SsdImpl.hpp) and the fused kernels (impl/SsdFused*.hpp).
#ifndef KMAMBA_CORE_IMPL_SSDOPERANDS_HPP
#define KMAMBA_CORE_IMPL_SSDOPERANDS_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/Math.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <type_traits>

namespace kmamba {

template <class MemorySpace>
struct SsdArgs;

namespace impl {

// Keeps a parameter out of template argument deduction (so that a Tensor4<float> converts to the
// ConstTensor4<float> a public op takes).
template <class T>
struct SsdIdentity {
  using type = T;
};
template <class T>
using SsdNonDeduced = typename SsdIdentity<T>::type;

struct SsdDims {
  std::int64_t batch = 0, seqlen = 0, nheads = 0, headdim = 0, ngroups = 1, dstate = 0;
};

/// How the chunk stages cut the work: `chunk` tokens per chunk, `tile` rows of the intra-chunk
/// matrices per product, teams of `team_size` threads × `vector_length` lanes.
struct SsdPlan {
  int batch, seqlen, nheads, headdim, ngroups, dstate, heads_per_group;
  int chunk, nchunks, tile, ntiles, team_size, vector_length;
};

/// The inputs of the scan as the kernels read them.
template <class MemorySpace>
struct SsdOperands {
  ConstTensor4<float, MemorySpace> x;               // (batch, seqlen, nheads, headdim)
  ConstTensor3<float, MemorySpace> dt;              // (batch, seqlen, nheads)
  ConstTensor1<float, MemorySpace> A;               // (nheads)
  ConstTensor4<float, MemorySpace> B, C;            // (batch, seqlen, ngroups, dstate)
  ConstTensor1<float, MemorySpace> D;               // (nheads)
  ConstTensor4<float, MemorySpace> z;               // (batch, seqlen, nheads, headdim)
  ConstTensor1<float, MemorySpace> dt_bias;         // (nheads)
  ConstTensor4<float, MemorySpace> initial_states;  // (batch, nheads, headdim, dstate)
  ConstTensor2<std::int64_t, MemorySpace> seq_idx;  // (batch, seqlen)
  ConstTensor3<float, MemorySpace> log_decay;       // (batch, seqlen, nheads)
  bool has_D, has_z, has_dt_bias, has_initial_states, has_seq_idx, has_log_decay, dt_softplus;
  float dt_min, dt_max;

  explicit SsdOperands(const SsdArgs<MemorySpace>& args)
      : x(args.x),
        dt(args.dt),
        A(args.A),
        B(args.B),
        C(args.C),
        D(args.D),
        z(args.z),
        dt_bias(args.dt_bias),
        initial_states(args.initial_states),
        seq_idx(args.seq_idx),
        log_decay(args.log_decay),
        has_D(args.D.is_allocated()),
        has_z(args.z.is_allocated()),
        has_dt_bias(args.dt_bias.is_allocated()),
        has_initial_states(args.initial_states.is_allocated()),
        has_seq_idx(args.seq_idx.is_allocated()),
        has_log_decay(args.log_decay.is_allocated()),
        dt_softplus(args.dt_softplus),
        dt_min(args.dt_min),
        dt_max(args.dt_max) {}

  /// dt_bias[h], or 0 without one.
  KOKKOS_INLINE_FUNCTION float dt_bias_of(int h) const { return has_dt_bias ? dt_bias(h) : 0.0f; }
  /// dt + dt_bias, before the softplus.
  KOKKOS_INLINE_FUNCTION float dt_pre(int b, int t, int h) const { return dt(b, t, h) + dt_bias_of(h); }
  /// softplus (when asked for), before the clamp.
  KOKKOS_INLINE_FUNCTION float dt_unclamped(float pre) const { return dt_softplus ? softplus(pre) : pre; }
  /// δ = clamp(softplus(dt + dt_bias), dt_min, dt_max).
  KOKKOS_INLINE_FUNCTION float dt_value(float pre) const {
    const float v = dt_unclamped(pre);
    return v < dt_min ? dt_min : (v > dt_max ? dt_max : v);
  }
  /// The rate a_t = rate·δ_t of head h: A[h], or 0 where log_decay gives a_t itself.
  KOKKOS_INLINE_FUNCTION float decay_rate(int h) const { return has_log_decay ? 0.0f : A(h); }
  /// a_t of a token inside the sequence, with δ = `delta` and rate = decay_rate(h).
  KOKKOS_INLINE_FUNCTION float token_log_decay(int b, int t, int h, float delta, float rate) const {
    return has_log_decay ? log_decay(b, t, h) : delta * rate;
  }
  KOKKOS_INLINE_FUNCTION float skip(int h) const { return has_D ? D(h) : 0.0f; }
};

/// Buffers the forward stages hand to each other (recomputed by the backward).
template <class MemorySpace>
struct SsdWorkspace {
  Tensor4<float, MemorySpace> dt_out;  // (batch, nheads, nchunks, chunk): δ, 0 past the sequence end
  Tensor4<float, MemorySpace> dA_cs;   // (batch, nheads, nchunks, chunk): inclusive cumsum of δ·a
  Tensor3<int, MemorySpace> run;       // (batch, nchunks, chunk): run starts since the chunk start
  Tensor5<float, MemorySpace> states;  // (batch, nchunks, nheads, headdim, dstate): local, then entering
  Tensor5<float, MemorySpace> CB;      // (batch, nchunks, ngroups, chunk, chunk): C_l·B_s for s ≤ l

  /// `staged`: with the states and CB of the staged stages (the fused backward keeps its own).
  explicit SsdWorkspace(const SsdPlan& plan, bool staged = true)
      : dt_out(allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::ssd::dt", plan.batch, plan.nheads,
                                                                   plan.nchunks, plan.chunk)),
        dA_cs(allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::ssd::dA_cumsum", plan.batch, plan.nheads,
                                                                  plan.nchunks, plan.chunk)),
        run(allocate_uninitialized<Tensor3<int, MemorySpace>>("kmamba::ssd::run", plan.batch, plan.nchunks,
                                                              plan.chunk)),
        states(staged ? allocate_uninitialized<Tensor5<float, MemorySpace>>(
                            "kmamba::ssd::states", plan.batch, plan.nchunks, plan.nheads, plan.headdim, plan.dstate)
                      : Tensor5<float, MemorySpace>()),
        CB(staged ? allocate_uninitialized<Tensor5<float, MemorySpace>>("kmamba::ssd::CB", plan.batch, plan.nchunks,
                                                                        plan.ngroups, plan.chunk, plan.chunk)
                  : Tensor5<float, MemorySpace>()) {}
};

/// Where a (batch, chunk, head) team works.
struct SsdChunkBlock {
  int b, c, h, g, t0, len;
};

KOKKOS_INLINE_FUNCTION SsdChunkBlock ssd_chunk_block(const SsdPlan& plan, int league_rank) {
  SsdChunkBlock blk;
  blk.h = league_rank % plan.nheads;
  blk.c = (league_rank / plan.nheads) % plan.nchunks;
  blk.b = league_rank / (plan.nheads * plan.nchunks);
  blk.g = blk.h / plan.heads_per_group;
  blk.t0 = blk.c * plan.chunk;
  blk.len = plan.seqlen - blk.t0 < plan.chunk ? plan.seqlen - blk.t0 : plan.chunk;
  return blk;
}

/// Whether the fused kernels (impl/SsdFused*.hpp) are compiled for this dstate.
inline bool ssd_fused_dstate(int dstate) { return dstate == 16 || dstate == 32 || dstate == 64 || dstate == 128; }

/// f(std::integral_constant<int, dstate>()) for a dstate ssd_fused_dstate accepts (128 for any other).
template <class F>
void ssd_with_fused_dstate(int dstate, const F& f) {
  switch (dstate) {
    case 16:
      f(std::integral_constant<int, 16>());
      break;
    case 32:
      f(std::integral_constant<int, 32>());
      break;
    case 64:
      f(std::integral_constant<int, 64>());
      break;
    default:
      f(std::integral_constant<int, 128>());
      break;
  }
}

/// exp(min(v, 0)): the decay between two tokens of a chunk (the clamp only guards masked pairs).
KOKKOS_INLINE_FUNCTION float ssd_decay(float v) { return kmamba::math::exp(v < 0.0f ? v : 0.0f); }

}  // namespace impl
}  // namespace kmamba

#endif
