// Backward stages B6–B7 of the Mamba-3 scan, token by token: the rotations and values turned back,
// the angles, dt and trap, and the sums over groups, tokens and chunks into the gradients.
#ifndef KMAMBA_CORE_IMPL_MAMBA3TOKENBACKWARD_HPP
#define KMAMBA_CORE_IMPL_MAMBA3TOKENBACKWARD_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Math.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/Mamba3ScanOperands.hpp>
#include <kmamba/core/impl/Mamba3ScanPlan.hpp>
#include <kmamba/core/impl/Mamba3ScanRows.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>

namespace kmamba {
namespace impl {

/// The chain rule through the SISO scan's own-token correction c_t (impl/Mamba3SisoSsd.hpp), as the
/// token and value backward apply it: with dc_t = g_t·v_t, ∂/∂v_t += c_t·g_t, the rotated ∂/∂q_t
/// += dc_t·(γ_t − scale_t)·k_t and ∂/∂k_t likewise with q_t, ∂/∂scale_t = the SSD's ∂/∂δ_t −
/// dc_t·(q_t·k_t), the diagonal ∂/∂γ_t = dc_t·(q_t·k_t). Inactive (MIMO) unless `tok` is allocated.
template <class MemorySpace>
struct Mamba3SisoDiagonal {
  Mamba3SisoTokens<MemorySpace> tok;
  ConstTensor3<float, MemorySpace> dc;          // (batch, seqlen, nheads): g_t·v_t
  ConstTensor3<float, MemorySpace> dscale;      // (batch, seqlen, nheads): the SSD's ∂/∂δ
  ConstTensor3<float, MemorySpace> dlog_decay;  // (batch, seqlen, nheads): the SSD's ∂/∂ log decay
  Tensor3<float, MemorySpace> dadt;             // (batch, nheads, seqlen)

  KOKKOS_INLINE_FUNCTION bool active() const { return tok.qk.is_allocated(); }
  /// dc_t·(γ_t − scale_t), the factor of the rotated q·k (0 when inactive).
  KOKKOS_INLINE_FUNCTION float dqk(int b, int t, int h, float gamma) const {
    return active() ? dc(b, t, h) * (gamma - tok.scale(b, t, h)) : 0.0f;
  }
};

/// Backward B6a (a row kernel over (batch, token, head), its lanes over the slots of the rotate
/// stage): adds the final k cotangent at the last token and SISO's own-token correction, and turns
/// the rotated gradients of q and k back (into ∂/∂ the biased q, k, in place), pair by pair over
/// every rank, writing ∂/∂θ_t. A rotation R keeps the cross product of a pair, (Ra) × (Rb) = a × b,
/// and turns k̃ (biased) into the rotated k, so the gradients are turned back first and ∂/∂θ_t =
/// Σ dq̃ × q̃ + dk̃ × k̃ is taken with the biased rows themselves: the rotated rows are not read.
template <class ExecSpace, class MemorySpace>
struct Mamba3TokenBackwardFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  Mamba3Operands<MemorySpace> in;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3Plan plan;
  Mamba3StateViews<const float, MemorySpace> dfinal;
  Mamba3SisoDiagonal<MemorySpace> siso;

  /// The final k cotangent of state n where token t is the last (0 elsewhere).
  KOKKOS_INLINE_FUNCTION float final_k(bool add_final, int b, int h, int r, int n) const {
    return add_final ? dfinal.k(b, h, r, n) : 0.0f;
  }

  /// The slot's states (see Mamba3RotateFunctor) of every rank; returns the slot's ∂/∂θ_t.
  KOKKOS_INLINE_FUNCTION float turn_back(int b, int t, int h, int g, int slot, float dqk, bool add_final) const {
    if (slot >= plan.nangles) {
      const int n = slot + plan.nangles;
      for (int r = 0; r < plan.rank; ++r) {
        const int row = t * plan.rank + r;
        const float q = in.q_in(b, t, r, g, n) + in.q_bias(h, r, n), k = in.k_in(b, t, r, g, n) + in.k_bias(h, r, n);
        bw.dq(b, row, h, n) += dqk * k;
        bw.dk(b, row, h, n) += dqk * q + final_k(add_final, b, h, r, n);
      }
      return 0.0f;
    }
    const int n0 = 2 * slot, n1 = n0 + 1;
    const float c = ws.rotation(b, h, t, 2 * slot), s = ws.rotation(b, h, t, 2 * slot + 1);
    float dtheta = 0.0f;
    for (int r = 0; r < plan.rank; ++r) {
      const int row = t * plan.rank + r;
      const float q0 = in.q_in(b, t, r, g, n0) + in.q_bias(h, r, n0),
                  q1 = in.q_in(b, t, r, g, n1) + in.q_bias(h, r, n1);
      const float k0 = in.k_in(b, t, r, g, n0) + in.k_bias(h, r, n0),
                  k1 = in.k_in(b, t, r, g, n1) + in.k_bias(h, r, n1);
      const float dq0 = bw.dq(b, row, h, n0), dq1 = bw.dq(b, row, h, n1);
      const float dk0 = bw.dk(b, row, h, n0) + final_k(add_final, b, h, r, n0);
      const float dk1 = bw.dk(b, row, h, n1) + final_k(add_final, b, h, r, n1);
      const float uq0 = dq0 * c + dq1 * s + dqk * k0, uq1 = dq1 * c - dq0 * s + dqk * k1;
      const float uk0 = dk0 * c + dk1 * s + dqk * q0, uk1 = dk1 * c - dk0 * s + dqk * q1;
      dtheta += uq1 * q0 - uq0 * q1 + uk1 * k0 - uk0 * k1;
      bw.dq(b, row, h, n0) = uq0;
      bw.dq(b, row, h, n1) = uq1;
      bw.dk(b, row, h, n0) = uk0;
      bw.dk(b, row, h, n1) = uk1;
    }
    return dtheta;
  }

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    Mamba3Row it;
    if (!mamba3_row(team, plan, plan.seqlen, it)) return;
    const int b = it.b, t = it.row, h = it.h, g = h / plan.heads_per_group;
    const bool add_final = t == plan.seqlen - 1 && dfinal.has_k;
    const float dqk = siso.dqk(b, t, h, ws.gamma(b, h, t));
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, plan.dstate - plan.nangles), [&](const int i) {
      const float dtheta = turn_back(b, t, h, g, i, dqk, add_final);
      if (i < plan.nangles) bw.dtheta(b, h, t, i) = dtheta;
    });
    if (!siso.active()) return;
    Kokkos::single(Kokkos::PerThread(team), [&]() {
      const float diagonal = siso.dc(b, t, h) * siso.tok.qk(b, t, h);
      bw.off(b, h, t) = siso.dscale(b, t, h) - diagonal;
      bw.diag(b, h, t) = diagonal;
      siso.dadt(b, h, t) = siso.dlog_decay(b, t, h);
    });
  }
};

/// Backward B6b (a row kernel over (batch, token, head), lanes over the channels): adds the final v
/// cotangent at the last token (in place, for the projection sums) and SISO's c_t·g_t, and writes
/// dv = Σ_r ∂/∂v_t,r·mimo_v_r.
template <class ExecSpace, class MemorySpace>
struct Mamba3ValueBackwardFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  Mamba3Operands<MemorySpace> in;
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3Plan plan;
  Mamba3StateViews<const float, MemorySpace> dfinal;
  Tensor4<float, MemorySpace> dv;  // (batch, seqlen, nheads, headdim)
  Mamba3SisoDiagonal<MemorySpace> siso;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    Mamba3Row it;
    if (!mamba3_row(team, plan, plan.seqlen, it)) return;
    const int b = it.b, t = it.row, h = it.h;
    const bool add_final = t == plan.seqlen - 1 && dfinal.has_v;
    const float c = siso.active() ? siso.tok.diag(b, t, h) : 0.0f;
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, plan.headdim), [&](const int p) {
      float sum = 0.0f;
      for (int r = 0; r < plan.rank; ++r) {
        const int row = t * plan.rank + r;
        float d = bw.dv(b, row, h, p);
        if (siso.active()) d += c * bw.g(b, row, h, p);
        if (add_final) {
          d += dfinal.v(b, h, r, p);
          bw.dv(b, row, h, p) = d;
        }
        sum += d * in.v_proj(h, r, p);
      }
      dv(b, t, h, p) = sum;
    });
  }
};

/// Backward B7a (one item per (batch, head, chunk, angle)): the chunk's sum of ∂/∂θ_t, last token
/// first, over the tokens before its first document start (the ones the angle entering it reaches).
template <class MemorySpace>
struct Mamba3DthetaChunkSumFunctor {
  Mamba3Operands<MemorySpace> in;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3Plan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const Mamba3ChunkItem it = mamba3_chunk_item(plan, item, plan.nangles);
    const int t0 = it.c * plan.chunk, len = mamba3_chunk_length(plan, it.c);
    float sum = 0.0f;
    for (int l = len - 1; l >= 0; --l) {
      sum += bw.dtheta(it.b, it.h, t0 + l, it.job);
      if (in.starts(it.b, t0 + l)) sum = 0.0f;
    }
    ws.angle_sum(it.b, it.h, it.c, it.job) = sum;
  }
};

/// Backward B7b (one item per (batch, head, angle)): walks the chunks backwards, replacing each
/// chunk's sum by G entering it from the right (dfinal angle + the sums of the chunks after it, up
/// to the nearest document start); writes dinitial angle.
template <class MemorySpace>
struct Mamba3DthetaPassingFunctor {
  Mamba3Operands<MemorySpace> in;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3Plan plan;
  Mamba3StateViews<const float, MemorySpace> dfinal;
  Mamba3StateViews<float, MemorySpace> dinitial;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int i = static_cast<int>(item % plan.nangles);
    const int bh = static_cast<int>(item / plan.nangles);
    const int h = bh % plan.nheads, b = bh / plan.nheads;
    float G = dfinal.angle_or_zero(b, h, i);
    for (int c = plan.nchunks - 1; c >= 0; --c) {
      const float sum = ws.angle_sum(b, h, c, i);
      ws.angle_sum(b, h, c, i) = G;
      G = mamba3_chunk_has_start(in, plan, b, c) ? sum : G + sum;
    }
    if (dinitial.has_angle) dinitial.angle(b, h, i) = G;
  }
};

/// Backward B7c (one item per (batch, head, chunk, angle)): G_i = dfinal angle + Σ_{t′≥t} ∂/∂θ_t′
/// (over t′ of t's document) backwards through the chunk from the G entering it; writes dangles
/// and leaves G·π·tanh(φ) (the part of ∂/∂dt through the angles) in dtheta.
template <class MemorySpace>
struct Mamba3AngleBackwardFunctor {
  Mamba3Operands<MemorySpace> in;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3Plan plan;
  Tensor4<float, MemorySpace> dangles;  // (batch, seqlen, nheads, nangles)

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const Mamba3ChunkItem it = mamba3_chunk_item(plan, item, plan.nangles);
    const int b = it.b, h = it.h, i = it.job, t0 = it.c * plan.chunk, len = mamba3_chunk_length(plan, it.c);
    float G = ws.angle_sum(b, h, it.c, i);
    for (int l = len - 1; l >= 0; --l) {
      const int t = t0 + l;
      G += bw.dtheta(b, h, t, i);
      const float th = kmamba::math::tanh(in.angles(b, t, h, i));
      dangles(b, t, h, i) = G * in.dt(b, h, t) * mamba3_pi * (1.0f - th * th);
      bw.dtheta(b, h, t, i) = G * mamba3_pi * th;
      if (in.starts(b, t)) G = 0.0f;
    }
  }
};

/// Backward B7d (one item per (batch, head, token)): ∂/∂dt and ∂/∂trap from ∂/∂γ_t = diag_t + off_t,
/// ∂/∂β̃_t = off_{t−1} (∂/∂β̃_0 through the initial k, v; 0 where a document starts, β̃_t being 0
/// there) and the angles' part.
template <class MemorySpace>
struct Mamba3ScalarBackwardFunctor {
  Mamba3Operands<MemorySpace> in;
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3Plan plan;
  Tensor3<float, MemorySpace> ddt;    // (batch, nheads, seqlen)
  Tensor3<float, MemorySpace> dtrap;  // (batch, nheads, seqlen)

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int t = static_cast<int>(item % plan.seqlen);
    const int bh = static_cast<int>(item / plan.seqlen);
    const int h = bh % plan.nheads, b = bh / plan.nheads;
    float from_angles = 0.0f;
    for (int i = 0; i < plan.nangles; ++i) from_angles += bw.dtheta(b, h, t, i);
    const float d = in.dt(b, h, t);
    const float lambda = sigmoid(in.trap(b, h, t));
    const float one_minus = sigmoid(-in.trap(b, h, t));
    const float dgamma = bw.diag(b, h, t) + bw.off(b, h, t);
    const float dbeta = in.starts(b, t) ? 0.0f : t > 0 ? bw.off(b, h, t - 1) : bw.dbeta0(b, h);
    ddt(b, h, t) = from_angles + dgamma * lambda + dbeta * one_minus;
    dtrap(b, h, t) = (dgamma - dbeta) * d * lambda * one_minus;
  }
};

/// dq, dk: the heads of each group summed in a fixed order, one item per (batch, token, rank,
/// group, state).
template <class MemorySpace>
struct Mamba3GroupSumFunctor {
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3GradViews<MemorySpace> grads;
  Mamba3Plan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int n = static_cast<int>(item % plan.dstate);
    std::int64_t rest = item / plan.dstate;
    const int g = static_cast<int>(rest % plan.ngroups);
    rest /= plan.ngroups;
    const int row = static_cast<int>(rest % (plan.seqlen * plan.rank));
    const int b = static_cast<int>(rest / (plan.seqlen * plan.rank));
    const int t = row / plan.rank, r = row % plan.rank;
    float sq = 0.0f, sk = 0.0f;
    for (int k = 0; k < plan.heads_per_group; ++k) {
      const int h = g * plan.heads_per_group + k;
      sq += bw.dq(b, row, h, n);
      sk += bw.dk(b, row, h, n);
    }
    grads.dq(b, t, r, g, n) = sq;
    grads.dk(b, t, r, g, n) = sk;
  }
};

/// dq_bias, dk_bias, first step: each chunk's sums over its tokens, one item per (batch, chunk,
/// head, rank, state).
template <class MemorySpace>
struct Mamba3BiasPartialFunctor {
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3Plan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int rn = static_cast<int>(item % (plan.rank * plan.dstate));
    const std::int64_t rest = item / (plan.rank * plan.dstate);
    const int h = static_cast<int>(rest % plan.nheads);
    const int bc = static_cast<int>(rest / plan.nheads);
    const int c = bc % plan.nchunks, b = bc / plan.nchunks;
    const int r = rn / plan.dstate, n = rn % plan.dstate;
    const int t0 = c * plan.chunk, len = mamba3_chunk_length(plan, c);
    float sq = 0.0f, sk = 0.0f;
    for (int l = 0; l < len; ++l) {
      const int row = (t0 + l) * plan.rank + r;
      sq += bw.dq(b, row, h, n);
      sk += bw.dk(b, row, h, n);
    }
    bw.dq_bias_partial(b, c, h, rn) = sq;
    bw.dk_bias_partial(b, c, h, rn) = sk;
  }
};

/// dq_bias, dk_bias: the per-(batch, chunk) partial sums added in a fixed order, one thread per
/// (head, rank, state).
template <class MemorySpace>
struct Mamba3BiasSumFunctor {
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3GradViews<MemorySpace> grads;
  Mamba3Plan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const int idx) const {
    const int rn = idx % (plan.rank * plan.dstate);
    const int h = idx / (plan.rank * plan.dstate);
    float sq = 0.0f, sk = 0.0f;
    for (int b = 0; b < plan.batch; ++b) {
      for (int c = 0; c < plan.nchunks; ++c) {
        sq += bw.dq_bias_partial(b, c, h, rn);
        sk += bw.dk_bias_partial(b, c, h, rn);
      }
    }
    grads.dq_bias(h, rn / plan.dstate, rn % plan.dstate) = sq;
    grads.dk_bias(h, rn / plan.dstate, rn % plan.dstate) = sk;
  }
};

/// dmimo_v, dmimo_z, dmimo_o: sums over batch and tokens, one thread per (head, rank, channel).
template <class MemorySpace>
struct Mamba3ProjectionSumFunctor {
  Mamba3Operands<MemorySpace> in;
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3GradViews<MemorySpace> grads;
  Mamba3Plan plan;
  ConstTensor4<float, MemorySpace> dout;  // (batch, seqlen, nheads, headdim)

  KOKKOS_INLINE_FUNCTION void operator()(const int idx) const {
    const int p = idx % plan.headdim;
    const int r = (idx / plan.headdim) % plan.rank;
    const int h = idx / (plan.headdim * plan.rank);
    float sv = 0.0f, sz = 0.0f, so = 0.0f;
    for (int b = 0; b < plan.batch; ++b) {
      for (int t = 0; t < plan.seqlen; ++t) {
        const int row = t * plan.rank + r;
        const float go = dout(b, t, h, p);
        const float y = bw.y(b, row, h, p);
        sv += bw.dv(b, row, h, p) * in.v(b, t, h, p);
        if (in.has_z) {
          const float zz = in.z(b, t, h, p);
          const float zr = zz * in.mimo_z(h, r, p);
          so += go * y * silu(zr);
          sz += go * in.mimo_o(h, r, p) * y * silu_derivative(zr) * zz;
        } else {
          so += go * y;
        }
      }
    }
    grads.dmimo_v(h, r, p) = sv;
    grads.dmimo_o(h, r, p) = so;
    if (in.has_z) grads.dmimo_z(h, r, p) = sz;
  }
};

/// dD: the per-(batch, chunk) partial sums added in a fixed order.
template <class MemorySpace>
struct Mamba3SkipSumFunctor {
  ConstTensor3<float, MemorySpace> partial;  // (batch, nchunks, nheads)
  Tensor1<float, MemorySpace> dD;            // (nheads)

  KOKKOS_INLINE_FUNCTION void operator()(const int h) const {
    float sum = 0.0f;
    for (int b = 0; b < static_cast<int>(partial.extent(0)); ++b) {
      for (int c = 0; c < static_cast<int>(partial.extent(1)); ++c) sum += partial(b, c, h);
    }
    dD(h) = sum;
  }
};

}  // namespace impl
}  // namespace kmamba

#endif
