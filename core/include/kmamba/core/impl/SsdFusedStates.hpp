// The chunk states of the fused SSD backward (SsdArgs::matmul_precision = BFloat16) on the warp
// tiles of impl/WarpTile.hpp (tensor cores on Cuda, the portable form elsewhere). For one
// (batch, chunk, head) per team, with l the chunk's tokens, cum the chunk's cumsum of δ·a:
//   Sloc[p][n]  = Σ_l x[l][p]·δ_l·exp(cum_last − cum_l)·B[l][n]   the state the chunk leaves from a
//                                                                  zero entering state (stage 2)
//   dSloc[p][n] = Σ_l g[l][p]·exp(cum_l)·C[l][n]                    the gradient its outputs send to
//                                                                  the entering state (backward B2)
// They replace the staged chunk_state and chunk_dstates stages (SsdChunkStateFunctor,
// SsdChunkDstatesFunctor of impl/SsdImpl.hpp) where the fused chunk backward runs; either product
// may be asked alone (a gated backward forms g only after the entering states are known).
//
// A team has 8 warps: warp w < 4 holds rows p ∈ [16w, 16w+16) of Sloc, warp w ≥ 4 the same rows
// of dSloc, all N columns in fp32. The chunk's rows are staged in scratch as bf16 with their token
// weights applied (x·δ·exp(cum_last − cum), g·exp(cum)), B and C as they are; rows past the
// sequence end are zero.
//
// Numerics: each term of a sum rounds two factors to bf16 (the weighted x or g, and B or C), each
// within 2^-9 relative; the sums over the chunk's tokens are fp32.
#ifndef KMAMBA_CORE_IMPL_SSDFUSEDSTATES_HPP
#define KMAMBA_CORE_IMPL_SSDFUSEDSTATES_HPP

#include <kmamba/core/impl/SsdFusedBackward.hpp>
#include <kmamba/core/impl/SsdFusedForward.hpp>
#include <kmamba/core/impl/SsdOperands.hpp>
#include <kmamba/core/impl/WarpTeamLaunch.hpp>
#include <kmamba/core/impl/WarpTile.hpp>
#include <kmamba/core/Math.hpp>

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kmamba {
namespace impl {

constexpr int ssd_fused_states_warps = 8;

/// Scratch of the chunk-states kernel for N states: bf16 tiles x·w and g·e as [Q][P + 8], B and
/// C as [Q][N + 8]; then the token weights w = δ·exp(cum_last − cum) and e = exp(cum), Q floats each.
template <int N>
struct SsdFusedStatesLayout {
  static constexpr int Q = ssd_fused_backward_chunk, P = ssd_fused_headdim;
  static constexpr int ldp = P + 8, ldn = N + 8;
  static constexpr std::size_t x_offset = 0, g_offset = x_offset + static_cast<std::size_t>(Q) * ldp;
  static constexpr std::size_t b_offset = g_offset + static_cast<std::size_t>(Q) * ldp;
  static constexpr std::size_t c_offset = b_offset + static_cast<std::size_t>(Q) * ldn;
  static constexpr std::size_t vectors_offset_bytes = (c_offset + static_cast<std::size_t>(Q) * ldn) * 2;
  static constexpr std::size_t bytes = vectors_offset_bytes + 2 * Q * sizeof(float);
};

template <class ExecSpace, class MemorySpace, int N>
struct SsdFusedStatesFunctor {
  static constexpr bool tensor_cores = WarpTileTraits<ExecSpace>::tensor_cores;
  using Layout = SsdFusedStatesLayout<N>;
  static constexpr int Q = Layout::Q, P = Layout::P, R = warp_tile_rows;
  using Team = WarpTeam<tensor_cores, ssd_fused_states_warps>;
  using StateAccum = WarpAccum<N, tensor_cores>;  // 16 rows p of Sloc or dSloc
  static_assert(P == 4 * R && ssd_fused_states_warps == 8, "SsdFusedStatesFunctor: 4 row blocks per product");

  SsdOperands<MemorySpace> in;
  SsdWorkspace<MemorySpace> ws;  // dt_out, dA_cs read; states written (Sloc)
  SsdPlan plan;
  ConstTensor4<float, MemorySpace> g;   // (batch, seqlen, nheads, headdim), gated dout (with dstates)
  Tensor5<float, MemorySpace> dstates;  // (batch, nchunks, nheads, headdim, dstate), dSloc out
  bool want_states, want_dstates;

  struct Tiles {
    ScratchTile x, g, b, c;
    float *wx, *wg;
  };

  KOKKOS_INLINE_FUNCTION static Tiles tiles(char* base) {
    auto* u16 = reinterpret_cast<std::uint16_t*>(base);
    auto* vec = reinterpret_cast<float*>(base + Layout::vectors_offset_bytes);
    return Tiles{ScratchTile{u16 + Layout::x_offset, Layout::ldp},
                 ScratchTile{u16 + Layout::g_offset, Layout::ldp},
                 ScratchTile{u16 + Layout::b_offset, Layout::ldn},
                 ScratchTile{u16 + Layout::c_offset, Layout::ldn},
                 vec,
                 vec + Q};
  }

  /// The token weights of x and g (zero past the sequence end).
  KOKKOS_INLINE_FUNCTION void stage_weights(const Tiles& sm, int thread, const SsdChunkBlock& blk) const {
    const float last = ws.dA_cs(blk.b, blk.h, blk.c, blk.len - 1);
    for (int t = thread; t < Q; t += Team::threads) {
      const bool inside = t < blk.len;
      const float cum = inside ? ws.dA_cs(blk.b, blk.h, blk.c, t) : last;
      sm.wx[t] = inside ? ws.dt_out(blk.b, blk.h, blk.c, t) * ssd_decay(last - cum) : 0.0f;
      sm.wg[t] = inside ? kmamba::math::exp(cum) : 0.0f;
    }
  }

  /// Phase 0: the weighted rows and B, C to scratch as bf16 (every load issued before the barrier
  /// that publishes the weights).
  KOKKOS_INLINE_FUNCTION void stage_rows(const WarpTeamContext& ctx, const Tiles& sm, const SsdChunkBlock& blk) const {
    const int b = blk.b, h = blk.h, t0 = blk.t0, len = blk.len, thread = ctx.thread;
    SsdRowShare<Q, P, Team::threads> xs, gs;
    SsdRowShare<Q, N, Team::threads> bs, cs;
    if (want_states) {
      xs.load(thread, len, [&](int t) { return &in.x(b, t0 + t, h, 0); });
      bs.load(thread, len, [&](int t) { return &in.B(b, t0 + t, blk.g, 0); });
    }
    if (want_dstates) {
      gs.load(thread, len, [&](int t) { return &g(b, t0 + t, h, 0); });
      cs.load(thread, len, [&](int t) { return &in.C(b, t0 + t, blk.g, 0); });
    }
    stage_weights(sm, thread, blk);
    ctx.barrier();
    const auto one = [](int) { return 1.0f; };
    if (want_states) {
      xs.store(thread, sm.x, [&](int t) { return sm.wx[t]; });
      bs.store(thread, sm.b, one);
    }
    if (want_dstates) {
      gs.store(thread, sm.g, [&](int t) { return sm.wg[t]; });
      cs.store(thread, sm.c, one);
    }
  }

  /// Phase 1 of warp w: its 16 rows of Sloc (w < 4) or dSloc (w ≥ 4), to global memory.
  KOKKOS_INLINE_FUNCTION void product(const Tiles& sm, int w, int lane, const SsdChunkBlock& blk) const {
    const bool states = w < ssd_fused_states_warps / 2;
    if (states ? !want_states : !want_dstates) return;
    const int p0 = R * (w % (ssd_fused_states_warps / 2));
    StateAccum S;
    warp_fill(S, lane, 0.0f);
    warp_mma<ALayout::KM, BLayout::KN, Q, false>(S, lane, (states ? sm.x : sm.g).offset(0, p0), states ? sm.b : sm.c,
                                                 N);
    const Tensor5<float, MemorySpace>& out = states ? ws.states : dstates;
    S.for_each(lane, [&](int r, int n, float& v) { out(blk.b, blk.c, blk.h, p0 + r, n) = v; });
  }

  KOKKOS_INLINE_FUNCTION void operator()(const WarpTeamContext& ctx) const {
    const SsdChunkBlock blk = ssd_chunk_block(plan, ctx.league_rank);
    const Tiles sm = tiles(ctx.scratch);
    stage_rows(ctx, sm, blk);
    ctx.barrier();
    Team::for_each_warp(ctx.thread, [&](int, int w, int lane) { product(sm, w, lane, blk); });
  }
};

/// Sloc into ws.states (want_states) and dSloc into dstates (want_dstates) for every (batch,
/// chunk, head); the plan and inputs are the fused backward's (ssd_fused_backward_supported, and g
/// 16-byte aligned when dSloc is asked for).
template <class ExecSpace, class MemorySpace>
void ssd_fused_chunk_states(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                            const SsdWorkspace<MemorySpace>& ws,
                            const SsdNonDeduced<ConstTensor4<float, MemorySpace>>& g,
                            const SsdNonDeduced<Tensor5<float, MemorySpace>>& dstates, bool want_states,
                            bool want_dstates) {
  const auto run = [&](auto states) {
    constexpr int N = decltype(states)::value;
    using Functor = SsdFusedStatesFunctor<ExecSpace, MemorySpace, N>;
    WarpTeamLauncher<ExecSpace, Functor::Team::threads, 2>::launch(
        exec, "kmamba::ssd::fused_chunk_states", plan.batch * plan.nchunks * plan.nheads, Functor::Layout::bytes,
        Functor{in, ws, plan, g, dstates, want_states, want_dstates});
  };
  ssd_with_fused_dstate(plan.dstate, run);
}

}  // namespace impl
}  // namespace kmamba

#endif
