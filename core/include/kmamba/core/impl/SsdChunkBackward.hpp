// Backward stages B2–B9 of the staged SSD (docs/algorithms.md §2.6): the chunks' dstates, their
// passing in reverse and the chunk backward (dx, ddt, per-head dB and dC, partial parameter sums).
#ifndef KMAMBA_CORE_IMPL_SSDCHUNKBACKWARD_HPP
#define KMAMBA_CORE_IMPL_SSDCHUNKBACKWARD_HPP

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

/// Backward B2 (dstates): dH_c = Σ_l exp(dA_cs[l])·g_l ⊗ C_l over the tokens the entering state
/// reaches.
template <class ExecSpace, class MemorySpace, MatmulPrecision Precision>
struct SsdChunkDstatesFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using S = SsdScratch<ExecSpace>;
  SsdOperands<MemorySpace> in;
  SsdWorkspace<MemorySpace> ws;
  SsdPlan plan;
  ConstTensor4<float, MemorySpace> g;   // (batch, seqlen, nheads, headdim)
  Tensor5<float, MemorySpace> dstates;  // (batch, nchunks, nheads, headdim, dstate)

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
    TeamGemm<ExecSpace, Precision>::apply(
        team, plan.headdim, plan.dstate, blk.len,
        [&](const int p, const int l) { return g(blk.b, blk.t0 + l, blk.h, p) * seA(l); },
        [&](const int l, const int n) { return in.C(blk.b, blk.t0 + l, blk.g, n); },
        [&](const int p, const int n, const float v) { dstates(blk.b, blk.c, blk.h, p, n) = v; });
  }
};

/// Backward B3 (state passing, reversed): replaces dH_c by dSloc_c, the gradient of the state
/// leaving chunk c, and writes dinitial_states. One work item per (batch, head, p, n) walks the
/// chunks from the last (chunk_walk_backward).
template <class MemorySpace>
struct SsdStatePassingBackwardFunctor {
  SsdWorkspace<MemorySpace> ws;
  SsdPlan plan;
  ConstTensor4<float, MemorySpace> dfinal_states;  // (batch, nheads, headdim, dstate)
  Tensor5<float, MemorySpace> dstates;             // (batch, nchunks, nheads, headdim, dstate)
  Tensor4<float, MemorySpace> dinitial_states;     // (batch, nheads, headdim, dstate)
  bool has_dfinal, write_dinitial;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const SsdStateItem it = ssd_state_item(plan, item);
    const float ds0 = has_dfinal ? dfinal_states(it.b, it.h, it.p, it.n) : 0.0f;
    const float ds = chunk_walk_backward(
        plan.nchunks, ds0, [&](int c) -> float& { return dstates(it.b, c, it.h, it.p, it.n); },
        [&](int c) { return ssd_chunk_decay(plan, ws, it.b, it.h, c); });
    if (write_dinitial) dinitial_states(it.b, it.h, it.p, it.n) = ds;
  }
};

/// Backward B4–B9 for one (batch, chunk, head): dx, ddt, this head's share of dB and dC, and the
/// chunk's partial sums of dA, dD and ddt_bias. Gradients w.r.t. the per-token dA = δ·a are
/// accumulated in the stable form of docs/algorithms.md §2.6 B8 (every pair s < j ≤ l, no
/// differences). dx and dC
/// (per head) hold their partial sums between the products of a tile; the (tile × chunk) block
/// of intra-chunk weights lives in level-1 scratch. Products skip the columns that the causal
/// mask makes zero.
template <class ExecSpace, class MemorySpace, MatmulPrecision Precision>
struct SsdChunkBackwardFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using S = SsdScratch<ExecSpace>;
  SsdOperands<MemorySpace> in;
  SsdWorkspace<MemorySpace> ws;
  SsdPlan plan;
  ConstTensor4<float, MemorySpace> g;        // (batch, seqlen, nheads, headdim), gated dout
  ConstTensor5<float, MemorySpace> dstates;  // (batch, nchunks, nheads, headdim, dstate), dSloc
  Tensor4<float, MemorySpace> dx;            // (batch, seqlen, nheads, headdim)
  Tensor3<float, MemorySpace> ddt;           // (batch, seqlen, nheads)
  Tensor3<float, MemorySpace> dlog_decay;    // (batch, seqlen, nheads), with in.has_log_decay
  Tensor4<float, MemorySpace> dB_head;       // (batch, seqlen, nheads, dstate)
  Tensor4<float, MemorySpace> dC_head;       // (batch, seqlen, nheads, dstate)
  Tensor4<float, MemorySpace> partial;       // (batch, nchunks, nheads, 3): dA, dD, ddt_bias

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const SsdChunkBlock blk = ssd_chunk_block(plan, team.league_rank());
    typename S::Vec sdt(team.team_scratch(0), plan.chunk);
    typename S::Vec sA(team.team_scratch(0), plan.chunk);
    typename S::Vec seA(team.team_scratch(0), plan.chunk);     // exp(dA_cs[l]) where the entering state reaches
    typename S::Vec seLast(team.team_scratch(0), plan.chunk);  // exp(dA_cs[last] − dA_cs[s]) in the last run
    typename S::Vec sddt(team.team_scratch(0), plan.chunk);    // ∂/∂δ, direct part
    typename S::Vec snext(team.team_scratch(0), plan.chunk);   // w_l of B5
    typename S::Vec sprev(team.team_scratch(0), plan.chunk);   // ddA_prev_raw of B6, then its suffix sums
    typename S::Vec sintra(team.team_scratch(0), plan.chunk);  // ddA_intra of B8 (iii)
    typename S::Vec sddA(team.team_scratch(0), plan.chunk);    // total gradient w.r.t. δ_j·a
    typename S::IntVec srun(team.team_scratch(0), plan.chunk);
    typename S::Mat sW(team.team_scratch(1), plan.tile, plan.chunk);

    const int b = blk.b, c = blk.c, h = blk.h, gr = blk.g, t0 = blk.t0, len = blk.len, last = len - 1;
    ssd_stage_vectors(team, ws, blk, sdt, sA, srun);
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, len), [&](const int l) {
      seA(l) = srun(l) == 0 ? kmamba::math::exp(sA(l)) : 0.0f;
      seLast(l) = srun(l) == srun(last) ? ssd_decay(sA(last) - sA(l)) : 0.0f;
      sintra(l) = 0.0f;
    });
    // B3's ddA_chunk: the decay of the entering state depends on dA_cs[last].
    float ddA_chunk = 0.0f;
    if (srun(last) == 0) {
      Kokkos::parallel_reduce(
          Kokkos::TeamThreadRange(team, plan.headdim),
          [&](const int p, float& acc) {
            float row = 0.0f;
            Kokkos::parallel_reduce(
                Kokkos::ThreadVectorRange(team, plan.dstate),
                [&](const int n, float& r) { r += ws.states(b, c, h, p, n) * dstates(b, c, h, p, n); }, row);
            acc += row;
          },
          ddA_chunk);
      ddA_chunk *= kmamba::math::exp(sA(last));
    }
    const float skip = in.skip(h);

    // B4 (and w_l of B5): acc_s = seLast_s·dSloc B_s + Σ_{k≥s} CB[k,s]·exp(dA_cs[k]−dA_cs[s])·g_k,
    // accumulated in dx, tiles of rows s.
    for (int s0 = 0; s0 < len; s0 += plan.tile) {
      const int rows = len - s0 < plan.tile ? len - s0 : plan.tile;
      team.team_barrier();
      TeamGemm<ExecSpace, Precision>::apply(
          team, rows, plan.headdim, plan.dstate,
          [&](const int i, const int n) { return seLast(s0 + i) * in.B(b, t0 + s0 + i, gr, n); },
          [&](const int n, const int p) { return dstates(b, c, h, p, n); },
          [&](const int i, const int p, const float v) { dx(b, t0 + s0 + i, h, p) = v; });
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows), [&](const int i) {
        const int s = s0 + i;
        float dot = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::ThreadVectorRange(team, plan.headdim),
            [&](const int p, float& acc) { acc += dx(b, t0 + s, h, p) * in.x(b, t0 + s, h, p); }, dot);
        Kokkos::single(Kokkos::PerThread(team), [&]() { snext(s) = sdt(s) * dot; });
      });
      team.team_barrier();
      TeamGemm<ExecSpace, Precision>::apply(
          team, rows, plan.headdim, len - s0,
          [&](const int i, const int kk) {
            const int s = s0 + i, k = s0 + kk;
            return k >= s && srun(k) == srun(s) ? ws.CB(b, c, gr, k, s) * ssd_decay(sA(k) - sA(s)) : 0.0f;
          },
          [&](const int kk, const int p) { return g(b, t0 + s0 + kk, h, p); },
          [&](const int i, const int p, const float v) { dx(b, t0 + s0 + i, h, p) += v; });
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows), [&](const int i) {
        const int s = s0 + i;
        float dot = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::ThreadVectorRange(team, plan.headdim),
            [&](const int p, float& acc) {
              const float v = dx(b, t0 + s, h, p);
              acc += v * in.x(b, t0 + s, h, p);
              dx(b, t0 + s, h, p) = sdt(s) * v + skip * g(b, t0 + s, h, p);
            },
            dot);
        Kokkos::single(Kokkos::PerThread(team), [&]() { sddt(s) = dot; });
      });
    }

    // B6, B7 (dC) and B8 (i), (iii), tiles of rows l: M[l,s] = <g_l, x_s>·δ_s·exp(dA_cs[l]−dA_cs[s])
    // for s ≤ l, formed over the columns s < l0 + rows; dC (per head) accumulated in dC_head.
    for (int l0 = 0; l0 < len; l0 += plan.tile) {
      const int rows = len - l0 < plan.tile ? len - l0 : plan.tile;
      const int cols = l0 + rows;
      team.team_barrier();
      TeamGemm<ExecSpace, Precision>::apply(
          team, rows, cols, plan.headdim, [&](const int i, const int p) { return g(b, t0 + l0 + i, h, p); },
          [&](const int p, const int s) { return in.x(b, t0 + s, h, p); },
          [&](const int i, const int s, const float v) {
            const int l = l0 + i;
            sW(i, s) = s <= l && srun(s) == srun(l) ? v * sdt(s) * ssd_decay(sA(l) - sA(s)) : 0.0f;
          });
      TeamGemm<ExecSpace, Precision>::apply(
          team, rows, plan.dstate, plan.headdim,
          [&](const int i, const int p) { return seA(l0 + i) * g(b, t0 + l0 + i, h, p); },
          [&](const int p, const int n) { return ws.states(b, c, h, p, n); },
          [&](const int i, const int n, const float v) { dC_head(b, t0 + l0 + i, h, n) = v; });
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows), [&](const int i) {
        const int l = l0 + i;
        float dot = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::ThreadVectorRange(team, plan.dstate),
            [&](const int n, float& acc) { acc += dC_head(b, t0 + l, h, n) * in.C(b, t0 + l, gr, n); }, dot);
        Kokkos::single(Kokkos::PerThread(team), [&]() { sprev(l) = dot; });
      });
      team.team_barrier();
      TeamGemm<ExecSpace, Precision>::apply(
          team, rows, plan.dstate, cols, [&](const int i, const int s) { return sW(i, s); },
          [&](const int s, const int n) { return in.B(b, t0 + s, gr, n); },
          [&](const int i, const int n, const float v) { dC_head(b, t0 + l0 + i, h, n) += v; });
      team.team_barrier();
      // Row l of the block becomes the exclusive prefix sums Σ_{s<j} M[l,s]·CB[l,s] for j ≤ l
      // (0 for j > l) ...
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows), [&](const int i) {
        const int l = l0 + i;
        Kokkos::parallel_scan(Kokkos::ThreadVectorRange(team, cols),
                              [&](const int j, float& running, const bool final) {
                                const float term = j < l ? sW(i, j) * ws.CB(b, c, gr, l, j) : 0.0f;
                                if (final) sW(i, j) = j <= l ? running : 0.0f;
                                running += term;
                              });
      });
      team.team_barrier();
      // ... and column j summed over the rows gives this tile's share of ddA_intra[j].
      Kokkos::parallel_for(Kokkos::TeamVectorRange(team, cols), [&](const int j) {
        float col = 0.0f;
        for (int i = 0; i < rows; ++i) col += sW(i, j);
        sintra(j) += col;
      });
    }

    // B5 (dB): dB_s = Σ_{l≥s} M[l,s]·C_l + seLast_s·δ_s·dSlocᵀ x_s, tiles of rows s, over the
    // columns l ≥ s0.
    for (int s0 = 0; s0 < len; s0 += plan.tile) {
      const int rows = len - s0 < plan.tile ? len - s0 : plan.tile;
      const int cols = len - s0;
      team.team_barrier();
      TeamGemm<ExecSpace, Precision>::apply(
          team, rows, cols, plan.headdim, [&](const int i, const int p) { return in.x(b, t0 + s0 + i, h, p); },
          [&](const int p, const int ll) { return g(b, t0 + s0 + ll, h, p); },
          [&](const int i, const int ll, const float v) {
            const int s = s0 + i, l = s0 + ll;
            sW(i, ll) = l >= s && srun(s) == srun(l) ? v * sdt(s) * ssd_decay(sA(l) - sA(s)) : 0.0f;
          });
      team.team_barrier();
      TeamGemm<ExecSpace, Precision>::apply(
          team, rows, plan.dstate, cols + plan.headdim,
          [&](const int i, const int k) {
            const int s = s0 + i;
            return k < cols ? sW(i, k) : seLast(s) * sdt(s) * in.x(b, t0 + s, h, k - cols);
          },
          [&](const int k, const int n) {
            return k < cols ? in.C(b, t0 + s0 + k, gr, n) : dstates(b, c, h, k - cols, n);
          },
          [&](const int i, const int n, const float v) { dB_head(b, t0 + s0 + i, h, n) = v; });
    }
    team.team_barrier();

    // B8 (i), (ii) and B9: ddA_j = ddA_intra[j] + Σ_{l<j} w_l + Σ_{l≥j} prev_l (+ ddA_chunk), then
    // ∂/∂δ_j, ∂/∂(dt_j) and the chunk's sums for dA and ddt_bias. The prefix and suffix sums are
    // vector-level scans of one team thread each.
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, 2), [&](const int which) {
      if (which == 0) {
        Kokkos::parallel_scan(Kokkos::ThreadVectorRange(team, len), [&](const int j, float& next, const bool final) {
          if (final) sddA(j) = sintra(j) + next;
          next += snext(j);
        });
      } else {
        Kokkos::parallel_scan(Kokkos::ThreadVectorRange(team, len), [&](const int r, float& prev, const bool final) {
          const int j = len - 1 - r;
          prev += sprev(j) + (r == 0 ? ddA_chunk : 0.0f);
          if (final) sprev(j) = prev;
        });
      }
    });
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, len), [&](const int j) { sddA(j) += sprev(j); });
    team.team_barrier();
    const float rate = in.decay_rate(h);
    float dA_sum = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::TeamThreadRange(team, len),
        [&](const int j, float& acc) {
          if (in.has_log_decay) Kokkos::single(Kokkos::PerThread(team), [&]() { dlog_decay(b, t0 + j, h) = sddA(j); });
          float ddt_j = sddA(j) * rate + sddt(j);
          const float pre = in.dt_pre(b, t0 + j, h);
          const float unclamped = in.dt_unclamped(pre);
          if (unclamped < in.dt_min || unclamped > in.dt_max) ddt_j = 0.0f;
          if (in.dt_softplus) ddt_j *= softplus_derivative(pre);
          Kokkos::single(Kokkos::PerThread(team), [&]() { ddt(b, t0 + j, h) = ddt_j; });
          acc += sddA(j) * sdt(j);
        },
        dA_sum);
    team.team_barrier();
    float dbias_sum = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::TeamThreadRange(team, len), [&](const int j, float& acc) { acc += ddt(b, t0 + j, h); }, dbias_sum);
    float dD_sum = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::TeamThreadRange(team, len),
        [&](const int l, float& acc) {
          float row = 0.0f;
          Kokkos::parallel_reduce(
              Kokkos::ThreadVectorRange(team, plan.headdim),
              [&](const int p, float& r) { r += g(b, t0 + l, h, p) * in.x(b, t0 + l, h, p); }, row);
          acc += row;
        },
        dD_sum);
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      partial(b, c, h, 0) = dA_sum;
      partial(b, c, h, 1) = dD_sum;
      partial(b, c, h, 2) = dbias_sum;
    });
  }
};

}  // namespace impl
}  // namespace kmamba

#endif
