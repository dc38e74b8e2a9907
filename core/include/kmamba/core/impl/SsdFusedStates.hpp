// The chunk states of the fused SSD backward (SsdArgs::matmul_precision = BFloat16), walked along
// the sequence on the warp tiles of impl/WarpTile.hpp (tensor cores on Cuda, the portable form
// elsewhere). For chunk c with tokens l, cum the chunk's cumsum of δ·a and last its last token:
//   Hin_c  the state entering chunk c:   Hin_0 = initial_states (or 0),
//          Hin_{c+1} = exp(cum_last)·Hin_c + Σ_l (x_l·δ_l·exp(cum_last − cum_l))ᵀ B_l
//   dS_c   the gradient of the state leaving chunk c:   dS_{last chunk} = dfinal_states (or 0),
//          dS_{c−1} = exp(cum_last)·dS_c + Σ_l (g_l·exp(cum_l))ᵀ C_l,   dinitial_states = dS_{−1}
// (g the gated dout). Hin goes to ws.states and dS to dstates for the chunk backward
// (impl/SsdFusedBackward.hpp).
//
// One team per (batch, head, direction, block of state columns) keeps its block of the running
// state on chip and walks the chunks in order (Hin) or from the last (dS), so that each state is
// written once and read once by the chunk backward; the chunks' own states and the passes that
// carried them along the sequence through memory are gone. A team has 4 warps; warp w holds rows
// p ∈ [16w, 16w + 16) and the team's Cols columns n in fp32. Per chunk, the weighted rows (x·w or
// g·e) and the columns of B or C are staged in scratch as bf16; rows past the sequence end are zero.
//
// Numerics: each term of a chunk's sum rounds two factors to bf16 (the weighted x or g, and B or
// C), each within 2^-9 relative; the sums and the running state are fp32.
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

namespace kmamba {
namespace impl {

constexpr int ssd_state_walk_warps = 4;

/// Columns of the state one walking team holds: all N up to 64, else blocks of 64 (two teams'
/// worth of parallelism for N = 128, and 32 accumulator registers a thread).
constexpr int ssd_state_walk_cols(int n) { return n < 64 ? n : 64; }

/// Scratch of a walking team: bf16 tiles of the weighted rows [Q][P + 8] and of the state's
/// columns of B or C [Q][Cols + 8]; then the Q token weights.
template <int Cols>
struct SsdStateWalkLayout {
  static constexpr int Q = ssd_fused_backward_chunk, P = ssd_fused_headdim;
  static constexpr int ldp = P + 8, ldn = Cols + 8;
  static constexpr std::size_t rows_offset = 0, cols_offset = static_cast<std::size_t>(Q) * ldp;
  static constexpr std::size_t weights_offset_bytes = (cols_offset + static_cast<std::size_t>(Q) * ldn) * 2;
  static constexpr std::size_t bytes = weights_offset_bytes + Q * sizeof(float);
};

template <class ExecSpace, class MemorySpace, int N>
struct SsdStateWalkFunctor {
  static constexpr bool tensor_cores = WarpTileTraits<ExecSpace>::tensor_cores;
  static constexpr int Cols = ssd_state_walk_cols(N), col_blocks = N / Cols;
  using Layout = SsdStateWalkLayout<Cols>;
  static constexpr int Q = Layout::Q, P = Layout::P, R = warp_tile_rows;
  using Team = WarpTeam<tensor_cores, ssd_state_walk_warps>;
  using StateAccum = WarpAccum<Cols, tensor_cores>;  // 16 rows p, Cols columns n
  static constexpr int slots = Team::warps_per_thread;
  static_assert(P == ssd_state_walk_warps * R && N % Cols == 0, "SsdStateWalkFunctor: one row block per warp");

  SsdOperands<MemorySpace> in;
  SsdWorkspace<MemorySpace> ws;  // dt_out, dA_cs read; states written (Hin)
  SsdPlan plan;
  ConstTensor4<float, MemorySpace> g;              // (batch, seqlen, nheads, headdim), gated dout
  ConstTensor4<float, MemorySpace> dfinal_states;  // (batch, nheads, headdim, dstate), optional
  Tensor5<float, MemorySpace> dstates;             // (batch, nchunks, nheads, headdim, dstate), dS out
  Tensor4<float, MemorySpace> dinitial_states;     // (batch, nheads, headdim, dstate), optional

  struct Walk {
    int b, h, grp, n0;
    bool reverse;
  };

  struct Tiles {
    ScratchTile rows, cols;
    float* weights;
  };

  KOKKOS_INLINE_FUNCTION static Tiles tiles(char* base) {
    auto* u16 = reinterpret_cast<std::uint16_t*>(base);
    return Tiles{ScratchTile{u16 + Layout::rows_offset, Layout::ldp},
                 ScratchTile{u16 + Layout::cols_offset, Layout::ldn},
                 reinterpret_cast<float*>(base + Layout::weights_offset_bytes)};
  }

  KOKKOS_INLINE_FUNCTION Walk walk(int league_rank) const {
    const int block = league_rank % col_blocks, rest = league_rank / col_blocks;
    const int direction = rest % 2, bh = rest / 2;
    const int h = bh % plan.nheads;
    return Walk{bh / plan.nheads, h, h / plan.heads_per_group, block * Cols, direction == 1};
  }

  /// The state where the walk starts: initial_states (forward) or dfinal_states (reverse), else 0.
  KOKKOS_INLINE_FUNCTION void start(const Walk& wk, int w, int lane, StateAccum& S) const {
    const bool given = wk.reverse ? dfinal_states.is_allocated() : in.has_initial_states;
    S.for_each(lane, [&](int r, int n, float& v) {
      const int p = R * w + r;
      if (!given) {
        v = 0.0f;
      } else {
        v = wk.reverse ? dfinal_states(wk.b, wk.h, p, wk.n0 + n) : in.initial_states(wk.b, wk.h, p, wk.n0 + n);
      }
    });
  }

  /// Chunk c's token weights (δ·exp(cum_last − cum) forward, exp(cum) reverse; 0 past the end)
  /// into scratch; returns exp(cum_last), the decay of the state across the chunk.
  KOKKOS_INLINE_FUNCTION float stage_weights(const Tiles& sm, int thread, const Walk& wk, int c, int len) const {
    const float last = ws.dA_cs(wk.b, wk.h, c, len - 1);
    for (int t = thread; t < Q; t += Team::threads) {
      const float cum = t < len ? ws.dA_cs(wk.b, wk.h, c, t) : last;
      const float forward = t < len ? ws.dt_out(wk.b, wk.h, c, t) * ssd_decay(last - cum) : 0.0f;
      sm.weights[t] = wk.reverse ? (t < len ? kmamba::math::exp(cum) : 0.0f) : forward;
    }
    return kmamba::math::exp(last);
  }

  /// Chunk c's rows (x or g) times their weights and its columns of B or C, to scratch as bf16.
  KOKKOS_INLINE_FUNCTION float stage_chunk(const WarpTeamContext& ctx, const Tiles& sm, const Walk& wk, int c) const {
    const int t0 = c * Q, len = plan.seqlen - t0 < Q ? plan.seqlen - t0 : Q, thread = ctx.thread;
    SsdRowShare<Q, P, Team::threads> rows;
    SsdRowShare<Q, Cols, Team::threads> cols;
    const ConstTensor4<float, MemorySpace>& token_rows = wk.reverse ? g : in.x;
    const ConstTensor4<float, MemorySpace>& state_cols = wk.reverse ? in.C : in.B;
    rows.load(thread, len, [&](int t) { return &token_rows(wk.b, t0 + t, wk.h, 0); });
    cols.load(thread, len, [&](int t) { return &state_cols(wk.b, t0 + t, wk.grp, wk.n0); });
    const float decay = stage_weights(sm, thread, wk, c, len);
    ctx.barrier();
    rows.store(thread, sm.rows, [&](int t) { return sm.weights[t]; });
    cols.store(thread, sm.cols, [](int) { return 1.0f; });
    return decay;
  }

  /// Warp w's block of the state before chunk c's term (Hin_c or dS_c), to global memory.
  KOKKOS_INLINE_FUNCTION void store(const Walk& wk, int w, int lane, int c, StateAccum& S) const {
    const Tensor5<float, MemorySpace>& out = wk.reverse ? dstates : ws.states;
    S.for_each(lane, [&](int r, int n, float& v) { out(wk.b, c, wk.h, R * w + r, wk.n0 + n) = v; });
  }

  KOKKOS_INLINE_FUNCTION void operator()(const WarpTeamContext& ctx) const {
    const Walk wk = walk(ctx.league_rank);
    const Tiles sm = tiles(ctx.scratch);
    StateAccum S[slots];
    Team::for_each_warp(ctx.thread, [&](int slot, int w, int lane) { start(wk, w, lane, S[slot]); });
    for (int step = 0; step < plan.nchunks; ++step) {
      const int c = wk.reverse ? plan.nchunks - 1 - step : step;
      const float decay = stage_chunk(ctx, sm, wk, c);
      ctx.barrier();
      Team::for_each_warp(ctx.thread, [&](int slot, int w, int lane) {
        store(wk, w, lane, c, S[slot]);
        S[slot].for_each(lane, [&](int, int, float& v) { v *= decay; });
        warp_mma<ALayout::KM, BLayout::KN, Q, false>(S[slot], lane, sm.rows.offset(0, R * w), sm.cols, Cols);
      });
      ctx.barrier();
    }
    if (!wk.reverse || !dinitial_states.is_allocated()) return;
    Team::for_each_warp(ctx.thread, [&](int slot, int w, int lane) {
      S[slot].for_each(lane, [&](int r, int n, float& v) { dinitial_states(wk.b, wk.h, R * w + r, wk.n0 + n) = v; });
    });
  }
};

/// Hin into ws.states and dS into dstates for every (batch, chunk, head), and dinitial_states
/// when allocated; the plan and inputs are the fused backward's (ssd_fused_backward_supported, g
/// 16-byte aligned). ws.dt_out and ws.dA_cs must hold the chunk cumsum.
template <class ExecSpace, class MemorySpace>
void ssd_fused_state_walks(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                           const SsdWorkspace<MemorySpace>& ws,
                           const SsdNonDeduced<ConstTensor4<float, MemorySpace>>& g,
                           const SsdNonDeduced<ConstTensor4<float, MemorySpace>>& dfinal_states,
                           const SsdNonDeduced<Tensor5<float, MemorySpace>>& dstates,
                           const SsdNonDeduced<Tensor4<float, MemorySpace>>& dinitial_states) {
  const auto run = [&](auto states) {
    constexpr int N = decltype(states)::value;
    using Functor = SsdStateWalkFunctor<ExecSpace, MemorySpace, N>;
    WarpTeamLauncher<ExecSpace, Functor::Team::threads, 4>::launch(
        exec, "kmamba::ssd::fused_state_walks", plan.batch * plan.nheads * 2 * Functor::col_blocks,
        Functor::Layout::bytes, Functor{in, ws, plan, g, dfinal_states, dstates, dinitial_states});
  };
  ssd_with_fused_dstate(plan.dstate, run);
}

}  // namespace impl
}  // namespace kmamba

#endif
