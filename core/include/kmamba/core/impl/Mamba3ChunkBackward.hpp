// Backward stages B2–B5 of the Mamba-3 scan on the chunks: the chunks' dstates, their passing in
// reverse, the gradients of the initial k and v, and the chunk backward (rows, scales, dD).
#ifndef KMAMBA_CORE_IMPL_MAMBA3CHUNKBACKWARD_HPP
#define KMAMBA_CORE_IMPL_MAMBA3CHUNKBACKWARD_HPP

#include <kmamba/core/MatmulPrecision.hpp>
#include <kmamba/core/Math.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/ChunkStateWalk.hpp>
#include <kmamba/core/impl/Mamba3ScanOperands.hpp>
#include <kmamba/core/impl/Mamba3ScanPlan.hpp>
#include <kmamba/core/impl/TeamGemm.hpp>

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <cstdint>

namespace kmamba {
namespace impl {

/// Backward B2 (dstates): Σ_rows exp(cs_t)·g_row ⊗ q_row (exp(cs_t) masked at document starts:
/// mamba3_entering_decay), the gradient the chunk's outputs send to the state entering it.
template <class ExecSpace, class MemorySpace, MatmulPrecision Precision>
struct Mamba3ChunkDstatesFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using S = Mamba3Scratch<ExecSpace>;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3Plan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const Mamba3ChunkBlock blk = mamba3_chunk_block(plan, team.league_rank());
    typename S::Vec scs(team.team_scratch(0), plan.chunk);
    typename S::Vec sscale(team.team_scratch(0), plan.chunk);
    typename S::Vec sgamma(team.team_scratch(0), plan.chunk);
    typename S::IntVec srun(team.team_scratch(0), plan.chunk);
    typename S::Vec seA(team.team_scratch(0), plan.rows);
    const int b = blk.b, h = blk.h, row0 = blk.row0;
    mamba3_stage_tokens(team, ws, blk, scs, sscale, sgamma, srun);
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, blk.rows),
                         [&](const int j) { seA(j) = mamba3_entering_decay(scs, srun, j / plan.rank); });
    team.team_barrier();
    TeamGemm<ExecSpace, Precision>::apply(
        team, plan.headdim, plan.dstate, blk.rows,
        [&](const int p, const int j) { return bw.g(b, row0 + j, h, p) * seA(j); },
        [&](const int j, const int n) { return ws.q(b, row0 + j, h, n); },
        [&](const int p, const int n, const float v) { bw.dstates(b, blk.c, h, p, n) = v; });
  }
};

/// Backward B3 (state passing reversed, one item per (batch, head, p, n)): replaces each chunk's
/// dstates by the gradient of the state leaving the chunk (the last one's is dfinal ssm) and
/// writes ∂/∂Ĥ_{−1} (= dinitial ssm) (chunk_walk_backward).
template <class MemorySpace>
struct Mamba3StatePassingBackwardFunctor {
  Mamba3Workspace<MemorySpace> ws;
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3Plan plan;
  Mamba3StateViews<const float, MemorySpace> dfinal;
  Mamba3StateViews<float, MemorySpace> dinitial;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const Mamba3StateItem it = mamba3_state_item(plan, item);
    const int b = it.b, h = it.h, p = it.p, n = it.n;
    const float ds = chunk_walk_backward(
        plan.nchunks, dfinal.ssm_or_zero(b, h, p, n), [&](int c) -> float& { return bw.dstates(b, c, h, p, n); },
        [&](int c) { return mamba3_chunk_decay(plan, ws, b, h, c); });
    bw.dH0(b, h, p, n) = ds;
    if (dinitial.has_ssm) dinitial.ssm(b, h, p, n) = ds;
  }
};

/// Backward B4 (initial k and v): Ĥ_{−1} holds β̃_0·Σ_r v_{−1,r} k_{−1,r}ᵀ, so dk_{−1,r} = β̃_0·dĤᵀ v_{−1,r},
/// dv_{−1,r} = β̃_0·dĤ k_{−1,r} and ∂/∂β̃_0 = Σ_r v_{−1,r}ᵀ dĤ k_{−1,r} (written when `dbeta0` is
/// allocated). A team per (batch, head).
template <class ExecSpace, class MemorySpace>
struct Mamba3InitialStateBackwardFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  Mamba3Operands<MemorySpace> in;
  ConstTensor4<float, MemorySpace> dH0;  // (batch, nheads, headdim, dstate): ∂/∂Ĥ_{−1}
  Tensor2<float, MemorySpace> dbeta0;    // (batch, nheads), optional
  Mamba3Plan plan;
  Mamba3StateViews<float, MemorySpace> dinitial;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int h = team.league_rank() % plan.nheads;
    const int b = team.league_rank() / plan.nheads;
    const float beta0 = in.beta_tilde(b, h, 0);
    if (dinitial.has_k) {
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, plan.rank * plan.dstate), [&](const int rn) {
        const int r = rn / plan.dstate, n = rn % plan.dstate;
        float sum = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::ThreadVectorRange(team, plan.headdim),
            [&](const int p, float& acc) { acc += dH0(b, h, p, n) * in.initial.v_or_zero(b, h, r, p); }, sum);
        Kokkos::single(Kokkos::PerThread(team), [&]() { dinitial.k(b, h, r, n) = beta0 * sum; });
      });
    }
    if (dinitial.has_v) {
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, plan.rank * plan.headdim), [&](const int rp) {
        const int r = rp / plan.headdim, p = rp % plan.headdim;
        float sum = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::ThreadVectorRange(team, plan.dstate),
            [&](const int n, float& acc) { acc += dH0(b, h, p, n) * in.initial.k_or_zero(b, h, r, n); }, sum);
        Kokkos::single(Kokkos::PerThread(team), [&]() { dinitial.v(b, h, r, p) = beta0 * sum; });
      });
    }
    if (!dbeta0.is_allocated()) return;
    float dbeta = 0.0f;
    if (in.initial.has_k && in.initial.has_v) {
      Kokkos::parallel_reduce(
          Kokkos::TeamThreadRange(team, plan.rank * plan.headdim),
          [&](const int rp, float& acc) {
            const int r = rp / plan.headdim, p = rp % plan.headdim;
            float row = 0.0f;
            Kokkos::parallel_reduce(
                Kokkos::ThreadVectorRange(team, plan.dstate),
                [&](const int n, float& a) { a += dH0(b, h, p, n) * in.initial.k(b, h, r, n); }, row);
            acc += in.initial.v(b, h, r, p) * row;
          },
          dbeta);
    }
    Kokkos::single(Kokkos::PerTeam(team), [&]() { dbeta0(b, h) = dbeta; });
  }
};

/// Backward B5 for one (batch, chunk, head): the rows of ∂/∂q, ∂/∂k (rotated) and ∂/∂v (projected),
/// ∂/∂scale_t and the token's own ∂/∂γ_t, ∂/∂adt, and the chunk's share of dD.
///
/// Pass 1 runs over tiles of source rows j = (s, r′) (with rows i = (t, r), t ≥ s, of the whole
/// chunk): A = k_j·q_i and B = v_j·g_i give X(s, t) = exp(cs_t − cs_s)·Σ_{r,r′} A·B, whence
/// ∂/∂γ_s ⊃ X(s, s), ∂/∂scale_s = Σ_{t>s} X(s, t) + exp(cs_last − cs_s)·Σ_r′ v_jᵀ dĤ k_j and the intra-chunk
/// part of ∂/∂adt_j, Σ_{s<j≤t} scale_s·X(s, t) (suffix sums along each row, then column sums: every term
/// added, none subtracted); then dv_j = Σ_i w·A·g_i + scale_s·exp(cs_last − cs_s)·dĤ k_j + D·g_j and
/// dk_j = Σ_i w·B·q_i + scale_s·exp(cs_last − cs_s)·dĤᵀ v_j. Pass 2 runs over tiles of target rows i:
/// dq_i = Σ_j w·(g_i·v_j)·k_j + exp(cs_t)·Ĥᵀ g_i (and the part of ∂/∂adt through exp(cs_t)). With packed
/// rows every exp(·) above is the masked decay (zero across a document start), so each term that
/// does not pass a start is the document's own and the others vanish, derivatives included.
template <class ExecSpace, class MemorySpace, MatmulPrecision Precision>
struct Mamba3ChunkBackwardFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using S = Mamba3Scratch<ExecSpace>;
  Mamba3Operands<MemorySpace> in;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3Plan plan;
  Tensor3<float, MemorySpace> dadt;  // (batch, nheads, seqlen)

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const Mamba3ChunkBlock blk = mamba3_chunk_block(plan, team.league_rank());
    typename S::Vec scs(team.team_scratch(0), plan.chunk);
    typename S::Vec sscale(team.team_scratch(0), plan.chunk);
    typename S::Vec sgamma(team.team_scratch(0), plan.chunk);
    typename S::Vec sdiag(team.team_scratch(0), plan.chunk);   // X(s, s)
    typename S::Vec soff(team.team_scratch(0), plan.chunk);    // ∂/∂scale_s
    typename S::Vec sintra(team.team_scratch(0), plan.chunk);  // intra-chunk ∂/∂adt_j, then the total
    typename S::Vec sprev(team.team_scratch(0), plan.chunk);   // Σ_r q_t,r·exp(cs_t)·Ĥᵀ g_t,r
    typename S::Vec snext(team.team_scratch(0), plan.chunk);   // exp(cs_last − cs_s)·Σ_r′ v_jᵀ dĤ k_j
    typename S::IntVec srun(team.team_scratch(0), plan.chunk);
    typename S::Vec srow(team.team_scratch(0), plan.tile_rows);
    typename S::Mat sA(team.team_scratch(1), plan.tile_rows, plan.rows);
    typename S::Mat sB(team.team_scratch(1), plan.tile_rows, plan.rows);
    typename S::Mat sX(team.team_scratch(1), plan.tile, plan.chunk);
    typename S::Mat sacc(team.team_scratch(1), plan.tile_rows, plan.headdim > plan.dstate ? plan.headdim : plan.dstate);

    const int b = blk.b, c = blk.c, h = blk.h, t0 = blk.t0, len = blk.len, row0 = blk.row0, rows = blk.rows;
    const int R = plan.rank, last = len - 1;
    mamba3_stage_tokens(team, ws, blk, scs, sscale, sgamma, srun);
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, len), [&](const int l) { sintra(l) = 0.0f; });
    team.team_barrier();
    // The decay of the entering state across the chunk depends on every adt of the chunk.
    float chunk_term = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::TeamThreadRange(team, plan.headdim),
        [&](const int p, float& acc) {
          float row = 0.0f;
          Kokkos::parallel_reduce(
              Kokkos::ThreadVectorRange(team, plan.dstate),
              [&](const int n, float& r) { r += ws.states(b, c, h, p, n) * bw.dstates(b, c, h, p, n); }, row);
          acc += row;
        },
        chunk_term);
    chunk_term *= mamba3_entering_decay(scs, srun, last);
    const float skip = in.skip(h);

    // Pass 1: tiles of source tokens s.
    for (int s0 = 0; s0 < len; s0 += plan.tile) {
      const int tokens = len - s0 < plan.tile ? len - s0 : plan.tile;
      const int nr = tokens * R, j0 = row0 + s0 * R;
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamVectorRange(team, nr), [&](const int jj) {
        const int s = s0 + jj / R;
        srow(jj) = sscale(s) * mamba3_decay(scs, srun, s, last);
      });
      TeamGemm<ExecSpace, Precision>::apply(
          team, nr, plan.dstate, plan.headdim, [&](const int jj, const int p) { return ws.v(b, j0 + jj, h, p); },
          [&](const int p, const int n) { return bw.dstates(b, c, h, p, n); },
          [&](const int jj, const int n, const float v) { sacc(jj, n) = v; });
      TeamGemm<ExecSpace, Precision>::apply(
          team, nr, rows, plan.dstate, [&](const int jj, const int n) { return ws.k(b, j0 + jj, h, n); },
          [&](const int n, const int i) { return ws.q(b, row0 + i, h, n); },
          [&](const int jj, const int i, const float v) { sA(jj, i) = i / R >= s0 + jj / R ? v : 0.0f; });
      TeamGemm<ExecSpace, Precision>::apply(
          team, nr, rows, plan.headdim, [&](const int jj, const int p) { return ws.v(b, j0 + jj, h, p); },
          [&](const int p, const int i) { return bw.g(b, row0 + i, h, p); },
          [&](const int jj, const int i, const float v) { sB(jj, i) = i / R >= s0 + jj / R ? v : 0.0f; });
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tokens), [&](const int ss) {
        const int s = s0 + ss;
        float dot = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::ThreadVectorRange(team, R * plan.dstate),
            [&](const int rn, float& acc) {
              const int rr = rn / plan.dstate, n = rn % plan.dstate;
              acc += sacc(ss * R + rr, n) * ws.k(b, j0 + ss * R + rr, h, n);
            },
            dot);
        Kokkos::single(Kokkos::PerThread(team), [&]() { snext(s) = mamba3_decay(scs, srun, s, last) * dot; });
        // X(s, t) from the raw products, then the products weighted in place.
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, len), [&](const int t) {
          float x = 0.0f;
          if (t >= s) {
            const float e = mamba3_decay(scs, srun, s, t);
            const float w = t > s ? sscale(s) * e : sgamma(s);
            for (int rs = 0; rs < R; ++rs) {
              for (int rt = 0; rt < R; ++rt) {
                const float a = sA(ss * R + rs, t * R + rt), bb = sB(ss * R + rs, t * R + rt);
                x += a * bb;
                sA(ss * R + rs, t * R + rt) = a * w;
                sB(ss * R + rs, t * R + rt) = bb * w;
              }
            }
            x *= e;
          }
          sX(ss, t) = x;
        });
      });
      team.team_barrier();
      // Row s of X becomes scale_s·Σ_{t≥j} X(s, t) for j > s (0 for j ≤ s), a suffix scan along
      // the row (index r = len − 1 − j) ...
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tokens), [&](const int ss) {
        const int s = s0 + ss;
        Kokkos::parallel_scan(Kokkos::ThreadVectorRange(team, len), [&](const int r, float& running, const bool final) {
          const int j = len - 1 - r;
          const float x = sX(ss, j);
          if (j > s) running += x;
          if (final) {
            if (j == s) sdiag(s) = x;
            if (r == len - 1) soff(s) = running + snext(s);
            sX(ss, j) = j > s ? sscale(s) * running : 0.0f;
          }
        });
      });
      team.team_barrier();
      // ... and column j summed over the rows gives this tile's share of the intra-chunk ∂/∂adt_j.
      Kokkos::parallel_for(Kokkos::TeamVectorRange(team, len), [&](const int j) {
        float col = 0.0f;
        for (int ss = 0; ss < tokens; ++ss) col += sX(ss, j);
        sintra(j) += col;
      });
      TeamGemm<ExecSpace, Precision>::apply(
          team, nr, plan.headdim, rows + plan.dstate,
          [&](const int jj, const int k) { return k < rows ? sA(jj, k) : srow(jj) * ws.k(b, j0 + jj, h, k - rows); },
          [&](const int k, const int p) {
            return k < rows ? bw.g(b, row0 + k, h, p) : bw.dstates(b, c, h, p, k - rows);
          },
          [&](const int jj, const int p, const float v) {
            bw.dv(b, j0 + jj, h, p) = v + skip * bw.g(b, j0 + jj, h, p);
          });
      TeamGemm<ExecSpace, Precision>::apply(
          team, nr, plan.dstate, rows, [&](const int jj, const int i) { return sB(jj, i); },
          [&](const int i, const int n) { return ws.q(b, row0 + i, h, n); },
          [&](const int jj, const int n, const float v) { bw.dk(b, j0 + jj, h, n) = v + srow(jj) * sacc(jj, n); });
    }

    // Pass 2: tiles of target tokens t. Where one tile holds the whole chunk, pass 1 left the
    // weighted products w·(v_j·g_i) of every pair in sB (rows j, columns i): the block pass 2 needs,
    // transposed.
    const bool whole_chunk = len <= plan.tile;
    for (int l0 = 0; l0 < len; l0 += plan.tile) {
      const int tokens = len - l0 < plan.tile ? len - l0 : plan.tile;
      const int nr = tokens * R, i0 = row0 + l0 * R;
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamVectorRange(team, nr),
                           [&](const int ii) { srow(ii) = mamba3_entering_decay(scs, srun, l0 + ii / R); });
      team.team_barrier();
      TeamGemm<ExecSpace, Precision>::apply(
          team, nr, plan.dstate, plan.headdim,
          [&](const int ii, const int p) { return srow(ii) * bw.g(b, i0 + ii, h, p); },
          [&](const int p, const int n) { return ws.states(b, c, h, p, n); },
          [&](const int ii, const int n, const float v) { sacc(ii, n) = v; });
      if (!whole_chunk) {
        TeamGemm<ExecSpace, Precision>::apply(
            team, nr, rows, plan.headdim, [&](const int ii, const int p) { return bw.g(b, i0 + ii, h, p); },
            [&](const int p, const int j) { return ws.v(b, row0 + j, h, p); },
            [&](const int ii, const int j, const float v) {
              sB(ii, j) = v * mamba3_pair_weight(scs, sscale, sgamma, srun, l0 + ii / R, j / R);
            });
      }
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tokens), [&](const int l) {
        float dot = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::ThreadVectorRange(team, R * plan.dstate),
            [&](const int rn, float& acc) {
              const int rr = rn / plan.dstate, n = rn % plan.dstate;
              acc += sacc(l * R + rr, n) * ws.q(b, i0 + l * R + rr, h, n);
            },
            dot);
        Kokkos::single(Kokkos::PerThread(team), [&]() { sprev(l0 + l) = dot; });
      });
      const float* const weighted = sB.data();
      const std::size_t across = whole_chunk ? sB.stride_1() : sB.stride_0();
      const std::size_t along = whole_chunk ? sB.stride_0() : sB.stride_1();
      TeamGemm<ExecSpace, Precision>::apply(
          team, nr, plan.dstate, rows, [&](const int ii, const int j) { return weighted[ii * across + j * along]; },
          [&](const int j, const int n) { return ws.k(b, row0 + j, h, n); },
          [&](const int ii, const int n, const float v) { bw.dq(b, i0 + ii, h, n) = v + sacc(ii, n); });
    }
    team.team_barrier();

    // ∂/∂adt_j = intra + Σ_{s<j} scale_s·snext_s + Σ_{t≥j} sprev_t + the chunk term: snext becomes
    // the prefix sums and sprev the suffix sums (vector-level scans of one team thread each).
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, 2), [&](const int which) {
      if (which == 0) {
        Kokkos::parallel_scan(Kokkos::ThreadVectorRange(team, len), [&](const int j, float& next, const bool final) {
          const float term = sscale(j) * snext(j);
          if (final) snext(j) = next;
          next += term;
        });
      } else {
        Kokkos::parallel_scan(Kokkos::ThreadVectorRange(team, len), [&](const int r, float& prev, const bool final) {
          const int j = len - 1 - r;
          prev += sprev(j) + (r == 0 ? chunk_term : 0.0f);
          if (final) sprev(j) = prev;
        });
      }
    });
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, len), [&](const int j) {
      dadt(b, h, t0 + j) = sintra(j) + snext(j) + sprev(j);
      bw.off(b, h, t0 + j) = soff(j);
      bw.diag(b, h, t0 + j) = sdiag(j);
    });
    float dD = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::TeamThreadRange(team, rows),
        [&](const int j, float& acc) {
          float row = 0.0f;
          Kokkos::parallel_reduce(
              Kokkos::ThreadVectorRange(team, plan.headdim),
              [&](const int p, float& r) { r += bw.g(b, row0 + j, h, p) * ws.v(b, row0 + j, h, p); }, row);
          acc += row;
        },
        dD);
    Kokkos::single(Kokkos::PerTeam(team), [&]() { bw.partial(b, c, h) = dD; });
  }
};

}  // namespace impl
}  // namespace kmamba

#endif
