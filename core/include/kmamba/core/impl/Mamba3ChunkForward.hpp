// Stages 3–5 of the Mamba-3 scan: each chunk's own end state, the passing of states between the
// chunks and the chunk scan (the outputs, or with GateBackward the recompute of backward B1).
#ifndef KMAMBA_CORE_IMPL_MAMBA3CHUNKFORWARD_HPP
#define KMAMBA_CORE_IMPL_MAMBA3CHUNKFORWARD_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/MatmulPrecision.hpp>
#include <kmamba/core/Math.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/ChunkStateWalk.hpp>
#include <kmamba/core/impl/Mamba3ScanOperands.hpp>
#include <kmamba/core/impl/Mamba3ScanPlan.hpp>
#include <kmamba/core/impl/TeamGemm.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>

namespace kmamba {
namespace impl {

/// Stage 3 (chunk_state): the chunk's own end state Σ_rows scale_s·exp(cs_last − cs_s)·v_row ⊗ k_row
/// (over the rows of the chunk's last document).
template <class ExecSpace, class MemorySpace, MatmulPrecision Precision>
struct Mamba3ChunkStateFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using S = Mamba3Scratch<ExecSpace>;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3Plan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const Mamba3ChunkBlock blk = mamba3_chunk_block(plan, team.league_rank());
    typename S::Vec scs(team.team_scratch(0), plan.chunk);
    typename S::Vec sscale(team.team_scratch(0), plan.chunk);
    typename S::Vec sgamma(team.team_scratch(0), plan.chunk);
    typename S::IntVec srun(team.team_scratch(0), plan.chunk);
    typename S::Vec sw(team.team_scratch(0), plan.rows);
    const int b = blk.b, h = blk.h, row0 = blk.row0, last = blk.len - 1;
    mamba3_stage_tokens(team, ws, blk, scs, sscale, sgamma, srun);
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, blk.rows), [&](const int j) {
      const int s = j / plan.rank;
      sw(j) = sscale(s) * mamba3_decay(scs, srun, s, last);
    });
    team.team_barrier();
    TeamGemm<ExecSpace, Precision>::apply(
        team, plan.headdim, plan.dstate, blk.rows,
        [&](const int p, const int j) { return ws.v(b, row0 + j, h, p) * sw(j); },
        [&](const int j, const int n) { return ws.k(b, row0 + j, h, n); },
        [&](const int p, const int n, const float v) { ws.states(b, blk.c, h, p, n) = v; });
  }
};

/// Ĥ_{−1}(p, n) = initial ssm + β̃_0·Σ_r v_{−1,r}(p)·k_{−1,r}(n) (zero where no initial state is given).
template <class MemorySpace>
KOKKOS_INLINE_FUNCTION float mamba3_entering_state(const Mamba3Operands<MemorySpace>& in, const Mamba3Plan& plan, int b,
                                                   int h, int p, int n) {
  float s = in.initial.ssm_or_zero(b, h, p, n);
  if (in.initial.has_k && in.initial.has_v) {
    float kv = 0.0f;
    for (int r = 0; r < plan.rank; ++r) kv += in.initial.v(b, h, r, p) * in.initial.k(b, h, r, n);
    s += in.beta_tilde(b, h, 0) * kv;
  }
  return s;
}

/// Stage 4 (state_passing, one item per (batch, head, p, n)): replaces each chunk's local state by
/// the state Ĥ entering the chunk (Ĥ_{−1} = initial ssm + β̃_0·Σ_r v_{−1,r} k_{−1,r}ᵀ) and writes the
/// final ssm state (chunk_walk_forward).
template <class MemorySpace>
struct Mamba3StatePassingFunctor {
  Mamba3Operands<MemorySpace> in;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3Plan plan;
  Mamba3StateViews<float, MemorySpace> final_states;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const Mamba3StateItem it = mamba3_state_item(plan, item);
    const int b = it.b, h = it.h, p = it.p, n = it.n;
    float s = mamba3_entering_state(in, plan, b, h, p, n);
    s = chunk_walk_forward(
        plan.nchunks, s, [&](int c) -> float& { return ws.states(b, c, h, p, n); },
        [&](int c) { return mamba3_chunk_decay(plan, ws, b, h, c); });
    if (final_states.has_ssm) final_states.ssm(b, h, p, n) = s;
  }
};

/// Stage 5 (chunk_scan): y_t,r = Σ_rows (q_t,r·k_s,r′)·w(t, s)·v_s,r′ + exp(cs_t)·Ĥ q_t,r + D·v_t,r (the
/// weights and exp(cs_t) masked at document starts: mamba3_pair_weight, mamba3_entering_decay) for a tile
/// of rows at a time (the intra-chunk weights and the scaled q concatenated along the reduced
/// index); then the gated, rank-contracted output (forward) or, with GateBackward (backward B1 fused
/// into the recompute), g_t,r = dout·mimo_o_r·silu(z ⊙ mimo_z_r), dz = Σ_r dout·mimo_o_r·y_t,r·silu′(z ⊙
/// mimo_z_r)·mimo_z_r (with z) and the rows y_t,r themselves (when `y` is allocated).
template <class ExecSpace, class MemorySpace, bool GateBackward, MatmulPrecision Precision>
struct Mamba3ChunkScanFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using S = Mamba3Scratch<ExecSpace>;
  Mamba3Operands<MemorySpace> in;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3Plan plan;
  Tensor4<float, MemorySpace> out;        // forward: (batch, seqlen, nheads, headdim)
  ConstTensor4<float, MemorySpace> dout;  // GateBackward: (batch, seqlen, nheads, headdim)
  Tensor4<float, MemorySpace> g;          // GateBackward: (batch, seqlen·rank, nheads, headdim)
  Tensor4<float, MemorySpace> dz;         // GateBackward with z: (batch, seqlen, nheads, headdim)
  Tensor4<float, MemorySpace> y;          // GateBackward, optional: (batch, seqlen·rank, nheads, headdim)

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const Mamba3ChunkBlock blk = mamba3_chunk_block(plan, team.league_rank());
    typename S::Vec scs(team.team_scratch(0), plan.chunk);
    typename S::Vec sscale(team.team_scratch(0), plan.chunk);
    typename S::Vec sgamma(team.team_scratch(0), plan.chunk);
    typename S::IntVec srun(team.team_scratch(0), plan.chunk);
    typename S::Vec seA(team.team_scratch(0), plan.rows);
    typename S::Mat sW(team.team_scratch(1), plan.tile_rows, plan.rows);
    typename S::Mat sy(team.team_scratch(1), plan.tile_rows, plan.headdim);
    const int b = blk.b, c = blk.c, h = blk.h, t0 = blk.t0, row0 = blk.row0, rows = blk.rows, R = plan.rank;
    mamba3_stage_tokens(team, ws, blk, scs, sscale, sgamma, srun);
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, rows),
                         [&](const int j) { seA(j) = mamba3_entering_decay(scs, srun, j / R); });
    const float skip = in.skip(h);
    for (int l0 = 0; l0 < blk.len; l0 += plan.tile) {
      const int tokens = blk.len - l0 < plan.tile ? blk.len - l0 : plan.tile;
      const int nr = tokens * R, i0 = l0 * R;
      team.team_barrier();
      TeamGemm<ExecSpace, Precision>::apply(
          team, nr, rows, plan.dstate, [&](const int i, const int n) { return ws.q(b, row0 + i0 + i, h, n); },
          [&](const int n, const int j) { return ws.k(b, row0 + j, h, n); },
          [&](const int i, const int j, const float v) {
            sW(i, j) = v * mamba3_pair_weight(scs, sscale, sgamma, srun, l0 + i / R, j / R);
          });
      team.team_barrier();
      TeamGemm<ExecSpace, Precision>::apply(
          team, nr, plan.headdim, rows + plan.dstate,
          [&](const int i, const int k) {
            return k < rows ? sW(i, k) : seA(i0 + i) * ws.q(b, row0 + i0 + i, h, k - rows);
          },
          [&](const int k, const int p) {
            return k < rows ? ws.v(b, row0 + k, h, p) : ws.states(b, c, h, p, k - rows);
          },
          [&](const int i, const int p, const float v) { sy(i, p) = v + skip * ws.v(b, row0 + i0 + i, h, p); });
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tokens), [&](const int l) {
        const int t = t0 + l0 + l;
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, plan.headdim), [&](const int p) {
          if constexpr (GateBackward) {
            const float go = dout(b, t, h, p);
            float dzp = 0.0f;
            for (int r = 0; r < R; ++r) {
              const int row = row0 + i0 + l * R + r;
              const float yr = sy(l * R + r, p);
              const float scaled = go * in.o_proj(h, r, p);
              if (y.is_allocated()) y(b, row, h, p) = yr;
              if (in.has_z) {
                const float zr = in.z(b, t, h, p) * in.z_proj(h, r, p);
                g(b, row, h, p) = scaled * silu(zr);
                dzp += scaled * yr * silu_derivative(zr) * in.z_proj(h, r, p);
              } else {
                g(b, row, h, p) = scaled;
              }
            }
            if (in.has_z) dz(b, t, h, p) = dzp;
          } else {
            float o = 0.0f;
            for (int r = 0; r < R; ++r) {
              const float gate = in.has_z ? silu(in.z(b, t, h, p) * in.z_proj(h, r, p)) : 1.0f;
              o += sy(l * R + r, p) * gate * in.o_proj(h, r, p);
            }
            out(b, t, h, p) = o;
          }
        });
      });
    }
  }
};

}  // namespace impl
}  // namespace kmamba

#endif
