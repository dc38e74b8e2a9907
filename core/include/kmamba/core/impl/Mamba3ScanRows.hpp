// Stages 1–2 of the Mamba-3 scan: the angles, cumsums and scales of every chunk, then the rotated q,
// k and projected v rows (and the SISO scan's per-token values), with the row kernels' launch.
#ifndef KMAMBA_CORE_IMPL_MAMBA3SCANROWS_HPP
#define KMAMBA_CORE_IMPL_MAMBA3SCANROWS_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Math.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>
#include <kmamba/core/impl/Mamba3ScanOperands.hpp>
#include <kmamba/core/impl/Mamba3ScanPlan.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>

namespace kmamba {
namespace impl {

/// The increment of angle i at token t: π·tanh(angles)·dt.
template <class MemorySpace>
KOKKOS_INLINE_FUNCTION float mamba3_angle_step(const Mamba3Operands<MemorySpace>& in, int b, int t, int h, int i) {
  return mamba3_pi * kmamba::math::tanh(in.angles(b, t, h, i)) * in.dt(b, h, t);
}

/// Whether a packed document starts inside chunk c of row b (Mamba3Operands::starts).
template <class MemorySpace>
KOKKOS_INLINE_FUNCTION bool mamba3_chunk_has_start(const Mamba3Operands<MemorySpace>& in, const Mamba3Plan& plan, int b,
                                                   int c) {
  if (!in.has_seq_idx) return false;
  const int t0 = c * plan.chunk, len = mamba3_chunk_length(plan, c);
  for (int l = 0; l < len; ++l) {
    if (in.starts(b, t0 + l)) return true;
  }
  return false;
}

/// The per-token values of the SISO scan as the SSD and its own-token correction read them
/// (impl/Mamba3SisoSsd.hpp); unallocated for MIMO. The stage 1a writes scale, log_decay and
/// qk_weight; the rotate stage qk and diag, where allocated (the fused bf16 forward forms q_t·k_t
/// and c_t itself).
template <class MemorySpace>
struct Mamba3SisoTokens {
  Tensor3<float, MemorySpace> scale;      // (batch, seqlen, nheads): scale_t, the SSD's δ
  Tensor3<float, MemorySpace> log_decay;  // (batch, seqlen, nheads): adt_t
  Tensor3<float, MemorySpace> qk_weight;  // (batch, seqlen, nheads): γ_t − scale_t
  Tensor3<float, MemorySpace> qk;         // (batch, seqlen, nheads): q_t·k_t
  Tensor3<float, MemorySpace> diag;       // (batch, seqlen, nheads): c_t = D + (γ_t − scale_t)·q_t·k_t

  Mamba3SisoTokens() = default;
  /// With `own_token_terms`, q_t·k_t and c_t too.
  Mamba3SisoTokens(const Mamba3Plan& plan, bool own_token_terms) {
    using T3 = Tensor3<float, MemorySpace>;
    scale = allocate_uninitialized<T3>("kmamba::mamba3::siso_scale", plan.batch, plan.seqlen, plan.nheads);
    log_decay = allocate_uninitialized<T3>("kmamba::mamba3::siso_log_decay", plan.batch, plan.seqlen, plan.nheads);
    qk_weight = allocate_uninitialized<T3>("kmamba::mamba3::siso_qk_weight", plan.batch, plan.seqlen, plan.nheads);
    if (own_token_terms) allocate_own_token_terms(plan);
  }
  /// q_t·k_t and c_t, for a stage after the rotate stage's to fill.
  void allocate_own_token_terms(const Mamba3Plan& plan) {
    using T3 = Tensor3<float, MemorySpace>;
    qk = allocate_uninitialized<T3>("kmamba::mamba3::siso_qk", plan.batch, plan.seqlen, plan.nheads);
    diag = allocate_uninitialized<T3>("kmamba::mamba3::siso_diagonal", plan.batch, plan.seqlen, plan.nheads);
  }
};

/// Stage 1a (per chunk, one item per (batch, head, chunk, job)): job i < nangles sums the chunk's
/// increments of angle i from its last document start (from its first token without one); job nangles writes the chunk
/// cumsum of adt, γ and scale of its tokens (and, with `tok` allocated, the SISO scan's per-token values in the SSD's
/// layout; with ws.run allocated, for the first head, the document counts).
template <class MemorySpace>
struct Mamba3ChunkTokensFunctor {
  Mamba3Operands<MemorySpace> in;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3Plan plan;
  Mamba3SisoTokens<MemorySpace> tok;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const Mamba3ChunkItem it = mamba3_chunk_item(plan, item, plan.nangles + 1);
    const int b = it.b, h = it.h, t0 = it.c * plan.chunk, len = mamba3_chunk_length(plan, it.c);
    if (it.job < plan.nangles) {
      float sum = 0.0f;
      for (int l = 0; l < len; ++l) {
        if (in.starts(b, t0 + l)) sum = 0.0f;
        sum += mamba3_angle_step(in, b, t0 + l, h, it.job);
      }
      ws.angle_sum(b, h, it.c, it.job) = sum;
    } else {
      float cs = 0.0f;
      int run = 0;
      for (int l = 0; l < len; ++l) {
        const int t = t0 + l;
        // The counts are the same for every head: the first head's item writes them.
        if (in.starts(b, t)) ++run;
        if (h == 0 && ws.run.is_allocated()) ws.run(b, t) = run;
        const float gamma = sigmoid(in.trap(b, h, t)) * in.dt(b, h, t);
        const float next = t + 1 < plan.seqlen ? in.beta_tilde(b, h, t + 1) : 0.0f;
        const float adt = in.adt(b, h, t), scale = gamma + next;
        cs += adt;
        ws.cs(b, h, t) = cs;
        ws.gamma(b, h, t) = gamma;
        ws.scale(b, h, t) = scale;
        if (!tok.scale.is_allocated()) continue;
        tok.scale(b, t, h) = scale;
        tok.log_decay(b, t, h) = adt;
        tok.qk_weight(b, t, h) = gamma - scale;
      }
    }
  }
};

/// Stage 1b (one item per (batch, head, angle)): walks the chunks, replacing each chunk's sum of
/// increments by the angle entering it (reduced into [0, 2π) after every chunk; the turns taken
/// out before the chunk are kept for the MIMO final angle). A chunk where a document starts passes
/// on the angle of its last document alone.
template <class MemorySpace>
struct Mamba3AnglePassingFunctor {
  Mamba3Operands<MemorySpace> in;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3Plan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int i = static_cast<int>(item % plan.nangles);
    const int bh = static_cast<int>(item / plan.nangles);
    const int h = bh % plan.nheads, b = bh / plan.nheads;
    float theta = in.initial.angle_or_zero(b, h, i);
    float turns = 0.0f;
    for (int c = 0; c < plan.nchunks; ++c) {
      const float total = ws.angle_sum(b, h, c, i);
      ws.angle_sum(b, h, c, i) = theta;
      ws.angle_turns(b, h, c, i) = turns;
      if (mamba3_chunk_has_start(in, plan, b, c)) theta = turns = 0.0f;
      theta += total;
      const float wraps = kmamba::math::floor(theta / mamba3_two_pi);
      theta -= mamba3_two_pi * wraps;
      turns += wraps;
    }
  }
};

/// Stage 1c (one item per (batch, head, chunk, angle)): θ_t from the angle entering the chunk,
/// reduced into [0, 2π) at every token, stored as its cosine and sine (the exact functions: every
/// stage that rotates reads these, so that the fused forward's rotations and the rotate stage's
/// round the same values), from 0 again where a document starts; the final angle at the last token.
template <class MemorySpace>
struct Mamba3AngleScanFunctor {
  Mamba3Operands<MemorySpace> in;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3Plan plan;
  Tensor3<float, MemorySpace> final_angle;  // (batch, nheads, nangles)
  bool write_final_angle;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const Mamba3ChunkItem it = mamba3_chunk_item(plan, item, plan.nangles);
    const int b = it.b, h = it.h, i = it.job, t0 = it.c * plan.chunk, len = mamba3_chunk_length(plan, it.c);
    float theta = ws.angle_sum(b, h, it.c, i);
    float turns = ws.angle_turns(b, h, it.c, i);
    for (int l = 0; l < len; ++l) {
      if (in.starts(b, t0 + l)) theta = turns = 0.0f;
      theta += mamba3_angle_step(in, b, t0 + l, h, i);
      const float wraps = kmamba::math::floor(theta / mamba3_two_pi);
      theta -= mamba3_two_pi * wraps;
      turns += wraps;
      ws.rotation(b, h, t0 + l, 2 * i) = kmamba::math::cos(theta);
      ws.rotation(b, h, t0 + l, 2 * i + 1) = kmamba::math::sin(theta);
    }
    if (write_final_angle && it.c == plan.nchunks - 1) {
      final_angle(b, h, i) = in.wrap_angle ? theta : theta + mamba3_two_pi * turns;
    }
  }
};

/// Row kernels: a team thread per (batch, row, head) row (head fastest), its vector lanes over the
/// row's channels or states (contiguous, so that a warp's accesses coalesce on GPUs), its sums
/// lane reductions; the row's indices are worked out once per row, not per element.
constexpr int mamba3_rows_per_team = 8;

struct Mamba3Row {
  int b, row, h;
};

template <class ExecSpace, class Functor>
void mamba3_row_launch(const ExecSpace& exec, const char* label, std::int64_t rows, const Functor& functor) {
  using Policy = Kokkos::TeamPolicy<ExecSpace>;
  const int lanes = std::min(32, static_cast<int>(Policy::vector_length_max()));
  const int team = vector_lanes_are_threads<ExecSpace> ? mamba3_rows_per_team : 1;
  const std::int64_t league = (rows + team - 1) / team;
  if (league == 0) return;
  Kokkos::parallel_for(label, Policy(exec, static_cast<int>(league), team, lanes), functor);
}

/// The row of the calling team thread among `rows_per_batch`·nheads rows per batch; false past the
/// last row.
template <class Member>
KOKKOS_INLINE_FUNCTION bool mamba3_row(const Member& team, const Mamba3Plan& plan, int rows_per_batch, Mamba3Row& row) {
  const std::int64_t item = static_cast<std::int64_t>(team.league_rank()) * team.team_size() + team.team_rank();
  const std::int64_t per_batch = static_cast<std::int64_t>(rows_per_batch) * plan.nheads;
  if (item >= per_batch * plan.batch) return false;
  const std::int64_t rest = item % per_batch;
  row = Mamba3Row{static_cast<int>(item / per_batch), static_cast<int>(rest / plan.nheads),
                  static_cast<int>(rest % plan.nheads)};
  return true;
}

/// Stage 2a (rotate): the rotated, biased q and k rows (where ws has them); the final k state at
/// the last token; with tok.qk allocated (SISO), q_t·k_t and c_t. A rotation keeps dot products
/// and q_t, k_t turn by the same angles, so q_t·k_t is the product of the biased rows as they are,
/// and the angles' cosines and sines are read only for rows that are stored. A row kernel over
/// (batch, row = t·R + r, head) for the rows [first_row, first_row + rows) of each batch, its
/// lanes over slots: the first nangles slots are the rotated pairs of states (2j, 2j + 1), the
/// remaining slots the states from 2·nangles on, one each.
template <class ExecSpace, class MemorySpace>
struct Mamba3RotateFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  Mamba3Operands<MemorySpace> in;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3Plan plan;
  Mamba3StateViews<float, MemorySpace> final_states;
  Mamba3SisoTokens<MemorySpace> tok;
  int first_row, rows;

  /// Whether token t's rotated rows are stored (in ws, or as the final k state).
  KOKKOS_INLINE_FUNCTION bool stores(int t) const {
    return ws.q.is_allocated() || (t == plan.seqlen - 1 && final_states.has_k);
  }

  /// Stores the rotated q, k of state n (where ws has rows, and the final k state).
  KOKKOS_INLINE_FUNCTION void store(int b, int h, int row, int t, int r, int n, float qv, float kv) const {
    if (ws.q.is_allocated()) {
      ws.q(b, row, h, n) = qv;
      ws.k(b, row, h, n) = kv;
    }
    if (t == plan.seqlen - 1 && final_states.has_k) final_states.k(b, h, r, n) = kv;
  }

  /// Stores the slot's rotated rows where they are kept; returns the slot's part of q·k.
  KOKKOS_INLINE_FUNCTION float rotate_slot(int b, int h, int row, int t, int r, int g, int slot) const {
    if (slot >= plan.nangles) {
      const int n = slot + plan.nangles;
      const float qv = in.q_in(b, t, r, g, n) + in.q_bias(h, r, n), kv = in.k_in(b, t, r, g, n) + in.k_bias(h, r, n);
      if (stores(t)) store(b, h, row, t, r, n, qv, kv);
      return qv * kv;
    }
    const int n0 = 2 * slot, n1 = n0 + 1;
    const float q0 = in.q_in(b, t, r, g, n0) + in.q_bias(h, r, n0);
    const float q1 = in.q_in(b, t, r, g, n1) + in.q_bias(h, r, n1);
    const float k0 = in.k_in(b, t, r, g, n0) + in.k_bias(h, r, n0);
    const float k1 = in.k_in(b, t, r, g, n1) + in.k_bias(h, r, n1);
    if (stores(t)) {
      const float c = ws.rotation(b, h, t, 2 * slot), s = ws.rotation(b, h, t, 2 * slot + 1);
      store(b, h, row, t, r, n0, q0 * c - q1 * s, k0 * c - k1 * s);
      store(b, h, row, t, r, n1, q0 * s + q1 * c, k0 * s + k1 * c);
    }
    return q0 * k0 + q1 * k1;
  }

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    Mamba3Row it;
    if (!mamba3_row(team, plan, rows, it)) return;
    const int b = it.b, row = first_row + it.row, h = it.h;
    const int t = row / plan.rank, r = row % plan.rank;
    const int g = h / plan.heads_per_group;
    float qk = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(team, plan.dstate - plan.nangles),
        [&](const int slot, float& acc) { acc += rotate_slot(b, h, row, t, r, g, slot); }, qk);
    if (!tok.qk.is_allocated()) return;
    Kokkos::single(Kokkos::PerThread(team), [&]() {
      tok.qk(b, t, h) = qk;
      tok.diag(b, t, h) = in.skip(h) + tok.qk_weight(b, t, h) * qk;
    });
  }
};

/// Stage 2b (one item per (batch, head, row, channel), or with `last_only` per (batch, head, rank,
/// channel) of the last token): the projected v rows, when ws has them; the final v state at the
/// last token.
template <class MemorySpace>
struct Mamba3ProjectFunctor {
  Mamba3Operands<MemorySpace> in;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3Plan plan;
  Mamba3StateViews<float, MemorySpace> final_states;
  bool last_only;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int p = static_cast<int>(item % plan.headdim);
    const std::int64_t rest = item / plan.headdim;
    const int nrows = last_only ? plan.rank : plan.seqlen * plan.rank;
    const int row = static_cast<int>(rest % nrows) + (last_only ? (plan.seqlen - 1) * plan.rank : 0);
    const int bh = static_cast<int>(rest / nrows);
    const int h = bh % plan.nheads, b = bh / plan.nheads;
    const int t = row / plan.rank, r = row % plan.rank;
    const float v = in.v(b, t, h, p) * in.v_proj(h, r, p);
    if (!last_only) ws.v(b, row, h, p) = v;
    if (t == plan.seqlen - 1 && final_states.has_v) final_states.v(b, h, r, p) = v;
  }
};

}  // namespace impl
}  // namespace kmamba

#endif
