// Stages 1–5 of the staged SSD forward (docs/algorithms.md §2.5): chunk_cumsum, chunk_state,
// state_passing, bmm_chunk and chunk_scan (with GateBackward, backward B1).
#ifndef KMAMBA_CORE_IMPL_SSDCHUNKFORWARD_HPP
#define KMAMBA_CORE_IMPL_SSDCHUNKFORWARD_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/MatmulPrecision.hpp>
#include <kmamba/core/Math.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/ChunkStateWalk.hpp>
#include <kmamba/core/impl/SsdLaunchPlan.hpp>
#include <kmamba/core/impl/SsdOperands.hpp>
#include <kmamba/core/impl/TeamGemm.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>

namespace kmamba {
namespace impl {

/// Stage 1 (chunk_cumsum): δ and the inclusive cumsum of δ·a per chunk; the run ids. Each is a
/// vector-level scan of one team thread (thread 0: δ·a; thread 1, in the head-0 teams: run ids).
template <class ExecSpace, class MemorySpace>
struct SsdChunkCumsumFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  SsdOperands<MemorySpace> in;
  SsdWorkspace<MemorySpace> ws;
  SsdPlan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const SsdChunkBlock blk = ssd_chunk_block(plan, team.league_rank());
    const float rate = in.decay_rate(blk.h);
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, blk.h == 0 ? 2 : 1), [&](const int which) {
      if (which == 0) {
        Kokkos::parallel_scan(Kokkos::ThreadVectorRange(team, plan.chunk),
                              [&](const int l, float& partial, const bool last) {
                                const float d = l < blk.len ? in.dt_value(in.dt_pre(blk.b, blk.t0 + l, blk.h)) : 0.0f;
                                if (l < blk.len) partial += in.token_log_decay(blk.b, blk.t0 + l, blk.h, d, rate);
                                if (last) {
                                  ws.dt_out(blk.b, blk.h, blk.c, l) = d;
                                  ws.dA_cs(blk.b, blk.h, blk.c, l) = partial;
                                }
                              });
      } else {
        Kokkos::parallel_scan(
            Kokkos::ThreadVectorRange(team, plan.chunk), [&](const int l, int& partial, const bool last) {
              const int t = blk.t0 + l;
              if (in.has_seq_idx && l < blk.len && t > 0 && in.seq_idx(blk.b, t) != in.seq_idx(blk.b, t - 1))
                partial += 1;
              if (last) ws.run(blk.b, blk.c, l) = partial;
            });
      }
    });
  }
};

/// Stage 2 (chunk_state): the chunk's own end state Σ_l x_l ⊗ B_l·δ_l·exp(dA_cs[last] − dA_cs[l])
/// over the tokens of the chunk's last run.
template <class ExecSpace, class MemorySpace, MatmulPrecision Precision>
struct SsdChunkStateFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using S = SsdScratch<ExecSpace>;
  SsdOperands<MemorySpace> in;
  SsdWorkspace<MemorySpace> ws;
  SsdPlan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const SsdChunkBlock blk = ssd_chunk_block(plan, team.league_rank());
    typename S::Vec sdt(team.team_scratch(0), plan.chunk);
    typename S::Vec sA(team.team_scratch(0), plan.chunk);
    typename S::Vec sw(team.team_scratch(0), plan.chunk);
    typename S::IntVec srun(team.team_scratch(0), plan.chunk);
    ssd_stage_vectors(team, ws, blk, sdt, sA, srun);
    team.team_barrier();
    const int last = blk.len - 1;
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, blk.len), [&](const int l) {
      sw(l) = srun(l) == srun(last) ? sdt(l) * ssd_decay(sA(last) - sA(l)) : 0.0f;
    });
    team.team_barrier();
    TeamGemm<ExecSpace, Precision>::apply(
        team, plan.headdim, plan.dstate, blk.len,
        [&](const int p, const int l) { return in.x(blk.b, blk.t0 + l, blk.h, p) * sw(l); },
        [&](const int l, const int n) { return in.B(blk.b, blk.t0 + l, blk.g, n); },
        [&](const int p, const int n, const float v) { ws.states(blk.b, blk.c, blk.h, p, n) = v; });
  }
};

/// Stage 3 (state_passing): replaces each chunk's local state by the state entering the chunk
/// (H_{c+1} = decay_c·H_c + Sloc_c, H_0 = initial_states or 0) and writes the final state. One
/// work item per (batch, head, p, n) walks the chunks (chunk_walk_forward).
template <class MemorySpace>
struct SsdStatePassingFunctor {
  SsdOperands<MemorySpace> in;
  SsdWorkspace<MemorySpace> ws;
  SsdPlan plan;
  Tensor4<float, MemorySpace> final_states;  // (batch, nheads, headdim, dstate)
  bool write_final;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const SsdStateItem it = ssd_state_item(plan, item);
    const float s0 = in.has_initial_states ? in.initial_states(it.b, it.h, it.p, it.n) : 0.0f;
    const float s = chunk_walk_forward(
        plan.nchunks, s0, [&](int c) -> float& { return ws.states(it.b, c, it.h, it.p, it.n); },
        [&](int c) { return ssd_chunk_decay(plan, ws, it.b, it.h, c); });
    if (write_final) final_states(it.b, it.h, it.p, it.n) = s;
  }
};

/// Stage 4 (bmm_chunk): CB[l, s] = C_l·B_s within each chunk, per group, for s ≤ l (the only
/// entries the later stages read). One team per (batch, chunk, group, tile of rows l).
template <class ExecSpace, class MemorySpace, MatmulPrecision Precision>
struct SsdBmmChunkFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  SsdOperands<MemorySpace> in;
  SsdWorkspace<MemorySpace> ws;
  SsdPlan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int tile = team.league_rank() % plan.ntiles;
    const int rest = team.league_rank() / plan.ntiles;
    const int g = rest % plan.ngroups;
    const int c = (rest / plan.ngroups) % plan.nchunks;
    const int b = rest / (plan.ngroups * plan.nchunks);
    const int t0 = c * plan.chunk;
    const int len = plan.seqlen - t0 < plan.chunk ? plan.seqlen - t0 : plan.chunk;
    const int l0 = tile * plan.tile;
    if (l0 >= len) return;
    const int rows = len - l0 < plan.tile ? len - l0 : plan.tile;
    TeamGemm<ExecSpace, Precision>::apply(
        team, rows, l0 + rows, plan.dstate, [&](const int i, const int n) { return in.C(b, t0 + l0 + i, g, n); },
        [&](const int n, const int s) { return in.B(b, t0 + s, g, n); },
        [&](const int i, const int s, const float v) { ws.CB(b, c, g, l0 + i, s) = v; });
  }
};

/// Stage 5 (chunk_scan): out_x_l = exp(dA_cs[l])·H_c C_l + Σ_{s≤l} CB[l,s]·exp(dA_cs[l]−dA_cs[s])·δ_s·x_s
/// + D·x_l; the forward writes out = out_x·silu(z) (out_x without z). One product per tile of rows,
/// with the intra-chunk weights (formed as the product reads them, over the columns s < l0 + rows
/// that can be nonzero) and the scaled C concatenated along the reduced index.
/// With GateBackward (backward B1, z given) it writes g = dout·silu(z) to `out` and
/// dz = dout·out_x·silu′(z) instead.
template <class ExecSpace, class MemorySpace, bool GateBackward, MatmulPrecision Precision>
struct SsdChunkScanFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using S = SsdScratch<ExecSpace>;
  SsdOperands<MemorySpace> in;
  SsdWorkspace<MemorySpace> ws;
  SsdPlan plan;
  Tensor4<float, MemorySpace> out;        // (batch, seqlen, nheads, headdim)
  ConstTensor4<float, MemorySpace> dout;  // (batch, seqlen, nheads, headdim), with GateBackward
  Tensor4<float, MemorySpace> dz;         // (batch, seqlen, nheads, headdim), with GateBackward

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const SsdChunkBlock blk = ssd_chunk_block(plan, team.league_rank());
    typename S::Vec sdt(team.team_scratch(0), plan.chunk);
    typename S::Vec sA(team.team_scratch(0), plan.chunk);
    typename S::Vec seA(team.team_scratch(0), plan.chunk);
    typename S::IntVec srun(team.team_scratch(0), plan.chunk);
    ssd_stage_vectors(team, ws, blk, sdt, sA, srun);
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, blk.len),
                         [&](const int l) { seA(l) = srun(l) == 0 ? kmamba::math::exp(sA(l)) : 0.0f; });
    team.team_barrier();
    const float skip = in.skip(blk.h);
    for (int l0 = 0; l0 < blk.len; l0 += plan.tile) {
      const int rows = blk.len - l0 < plan.tile ? blk.len - l0 : plan.tile;
      const int cols = l0 + rows;
      TeamGemm<ExecSpace, Precision>::apply(
          team, rows, plan.headdim, cols + plan.dstate,
          [&](const int i, const int k) {
            const int l = l0 + i;
            if (k >= cols) return seA(l) * in.C(blk.b, blk.t0 + l, blk.g, k - cols);
            return k <= l && srun(k) == srun(l) ? ws.CB(blk.b, blk.c, blk.g, l, k) * ssd_decay(sA(l) - sA(k)) * sdt(k)
                                                : 0.0f;
          },
          [&](const int k, const int p) {
            return k < cols ? in.x(blk.b, blk.t0 + k, blk.h, p) : ws.states(blk.b, blk.c, blk.h, p, k - cols);
          },
          [&](const int i, const int p, const float v) {
            const int t = blk.t0 + l0 + i;
            const float o = v + skip * in.x(blk.b, t, blk.h, p);
            if constexpr (GateBackward) {
              const float zz = in.z(blk.b, t, blk.h, p);
              const float go = dout(blk.b, t, blk.h, p);
              out(blk.b, t, blk.h, p) = go * silu(zz);
              dz(blk.b, t, blk.h, p) = go * o * silu_derivative(zz);
            } else {
              out(blk.b, t, blk.h, p) = in.has_z ? o * silu(in.z(blk.b, t, blk.h, p)) : o;
            }
          });
    }
  }
};

}  // namespace impl
}  // namespace kmamba

#endif
