// The chunk states of the fused SSD backward (SsdArgs::matmul_precision = BFloat16), walked along
// the sequence on the warp tiles of impl/WarpTile.hpp (tensor cores on Cuda, the portable form
// elsewhere). For chunk c with tokens l, cum the chunk's cumsum of δ·a and last its last token:
//   Hin_c  the state entering chunk c:   Hin_0 = initial_states (or 0),
//          Hin_{c+1} = exp(cum_last)·Hin_c + Σ_l (x_l·δ_l·exp(cum_last − cum_l))ᵀ B_l
//   dS_c   the gradient of the state leaving chunk c:   dS_{last chunk} = dfinal_states (or 0),
//          dS_{c−1} = exp(cum_last)·dS_c + Σ_l (g_l·exp(cum_l))ᵀ C_l,   dinitial_states = dS_{−1}
// (g the gated dout). Hin and dS go to memory as bf16 for the chunk backward
// (impl/SsdFusedBackward.hpp), which rounds them to bf16 for its products anyway.
//
// One team per (batch, head, direction, block of state columns) keeps its block of the running
// state on chip and walks the chunks in order (Hin) or from the last (dS), so that each state is
// written once and read once by the chunk backward; the chunks' own states and the passes that
// carried them along the sequence through memory are gone. A team has 4 warps; warp w holds rows
// p ∈ [16w, 16w + 16) and the team's Cols columns n in fp32. Per chunk, the weighted rows (x·w or
// g·e) and the columns of B or C are staged in scratch as bf16; rows past the sequence end are zero.
//
// Where those teams alone would not fill the device, each walk is cut into segments of whole chunks,
// as the fused forward cuts its own (impl/SsdFusedForward.hpp): a first pass walks every segment
// from zero for its end value and total decay, the values are passed along the segments, and the
// second pass walks every segment from the value entering it, writing the chunks' states.
//
// With a caller's per-head operands (SsdFusedHeadOperands, a template switch as in the forward) the
// columns of B or C are formed per head (biased, rotated) as they are staged.
//
// Numerics: each term of a chunk's sum rounds two factors to bf16 (the weighted x or g, and B or
// C), each within 2^-9 relative; the sums and the running state are fp32, and each Hin or dS is
// rounded to bf16 (2^-9 relative) where it is stored.
#ifndef KMAMBA_CORE_IMPL_SSDFUSEDSTATES_HPP
#define KMAMBA_CORE_IMPL_SSDFUSEDSTATES_HPP

#include <kmamba/core/Bf16.hpp>
#include <kmamba/core/impl/SsdFusedBackward.hpp>
#include <kmamba/core/impl/SsdFusedForward.hpp>
#include <kmamba/core/impl/SsdOperands.hpp>
#include <kmamba/core/impl/WarpTeamLaunch.hpp>
#include <kmamba/core/impl/WarpTile.hpp>
#include <kmamba/core/Math.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
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

/// How the walks are cut: `count` segments of `chunks` chunks (the last may be shorter). With
/// count > 1, `values` holds each segment's end value from zero after the first pass and the value
/// entering its walk after the segment pass (forward: the state before its first chunk; reverse:
/// the gradient of the state after its last chunk).
template <class MemorySpace>
struct SsdWalkSegments {
  int count = 1, chunks = 0;
  Tensor5<float, MemorySpace> values;  // (2·batch, nheads, count, headdim, dstate): index 2b + reverse
  Tensor3<float, MemorySpace> decay;   // (batch, nheads, count): exp(Σ δ·a) over each segment
};

/// EndOnly: the first pass of segmented walks (each segment from zero, only its end value and decay
/// written); otherwise the walks proper. PerHead: with the caller's per-head operands (`head`).
template <class ExecSpace, class MemorySpace, int N, bool EndOnly, bool PerHead>
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
  SsdWorkspace<MemorySpace> ws;  // dt_out, dA_cs read
  SsdPlan plan;
  ConstTensor4<float, MemorySpace> g;              // (batch, seqlen, nheads, headdim), gated dout
  ConstTensor4<float, MemorySpace> dfinal_states;  // (batch, nheads, headdim, dstate), optional
  Tensor5<bf16, MemorySpace> hin;                  // (batch, nchunks, nheads, headdim, dstate), Hin out
  Tensor5<bf16, MemorySpace> dstates;              // (batch, nchunks, nheads, headdim, dstate), dS out
  Tensor4<float, MemorySpace> dinitial_states;     // (batch, nheads, headdim, dstate), optional
  SsdWalkSegments<MemorySpace> segments;
  SsdFusedHeadOperands<MemorySpace> head;  // with PerHead

  struct Walk {
    int b, h, grp, n0, seg, first, end;  // chunks [first, end) of segment seg
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
    const int seg = league_rank % segments.count, rest = league_rank / segments.count;
    const int block = rest % col_blocks, direction = (rest / col_blocks) % 2, bh = rest / col_blocks / 2;
    const int h = bh % plan.nheads, first = seg * segments.chunks;
    const int end = first + segments.chunks < plan.nchunks ? first + segments.chunks : plan.nchunks;
    return Walk{bh / plan.nheads, h, h / plan.heads_per_group, block * Cols, seg, first, end, direction == 1};
  }

  /// The value where the walk starts: 0 in the first pass; the segment pass's value for a segmented
  /// walk; else initial_states (forward) or dfinal_states (reverse), or 0 where not given.
  KOKKOS_INLINE_FUNCTION float start_value(const Walk& wk, int p, int n) const {
    if (EndOnly) return 0.0f;
    if (segments.count > 1) return segments.values(2 * wk.b + wk.reverse, wk.h, wk.seg, p, n);
    if (wk.reverse) return dfinal_states.is_allocated() ? dfinal_states(wk.b, wk.h, p, n) : 0.0f;
    return in.has_initial_states ? in.initial_states(wk.b, wk.h, p, n) : 0.0f;
  }

  /// Where the walk ends: the segment's end value (first pass), or dinitial_states after the
  /// reverse walk through chunk 0.
  KOKKOS_INLINE_FUNCTION void finish(const Walk& wk, int w, int lane, StateAccum& S) const {
    S.for_each(lane, [&](int r, int n, float& v) {
      const int p = R * w + r;
      if (EndOnly) {
        segments.values(2 * wk.b + wk.reverse, wk.h, wk.seg, p, wk.n0 + n) = v;
      } else if (wk.reverse && wk.first == 0 && dinitial_states.is_allocated()) {
        dinitial_states(wk.b, wk.h, p, wk.n0 + n) = v;
      }
    });
  }

  /// Chunk c's token weights (δ·exp(cum_last − cum) forward, exp(cum) reverse; 0 past the end)
  /// into scratch; returns exp(cum_last), the decay of the state across the chunk.
  KOKKOS_INLINE_FUNCTION float stage_weights(const Tiles& sm, int thread, const Walk& wk, int c, int len,
                                             float& log_decay) const {
    const float last = ws.dA_cs(wk.b, wk.h, c, len - 1);
    for (int t = thread; t < Q; t += Team::threads) {
      const float cum = t < len ? ws.dA_cs(wk.b, wk.h, c, t) : last;
      const float forward = t < len ? ws.dt_out(wk.b, wk.h, c, t) * ssd_decay(last - cum) : 0.0f;
      sm.weights[t] = wk.reverse ? (t < len ? kmamba::math::exp(cum) : 0.0f) : forward;
    }
    log_decay = last;
    return kmamba::math::exp(last);
  }

  /// Chunk c's rows (x or g) times their weights and its columns of B or C, to scratch as bf16.
  KOKKOS_INLINE_FUNCTION float stage_chunk(const WarpTeamContext& ctx, const Tiles& sm, const Walk& wk, int c,
                                           float& log_decay) const {
    const int t0 = c * Q, len = plan.seqlen - t0 < Q ? plan.seqlen - t0 : Q, thread = ctx.thread;
    SsdRowShare<Q, P, Team::threads> rows;
    SsdRowShare<Q, Cols, Team::threads> cols;
    const ConstTensor4<float, MemorySpace>& token_rows = wk.reverse ? g : in.x;
    const ConstTensor4<float, MemorySpace>& state_cols = wk.reverse ? in.C : in.B;
    rows.load(thread, len, [&](int t) { return &token_rows(wk.b, t0 + t, wk.h, 0); });
    cols.load(thread, len, [&](int t) { return &state_cols(wk.b, t0 + t, wk.grp, wk.n0); });
    const float decay = stage_weights(sm, thread, wk, c, len, log_decay);
    ctx.barrier();
    rows.store(thread, sm.rows, [&](int t) { return sm.weights[t]; });
    if constexpr (PerHead) {  // once the rows are stored, for the registers
      const ConstTensor2<float, MemorySpace>& bias = wk.reverse ? head.bias_C : head.bias_B;
      cols.transform(thread, len, [&](int t, int n, float(&v)[4]) {
        head.rotate(bias, wk.h, wk.n0 + n, head.token_rotation(wk.b, wk.h, t0 + t), v);
      });
    }
    cols.store(thread, sm.cols, [](int) { return 1.0f; });
    return decay;
  }

  /// Warp w's block of the state before chunk c's term (Hin_c or dS_c), to global memory as bf16.
  KOKKOS_INLINE_FUNCTION void store(const Walk& wk, int w, int lane, int c, const StateAccum& S) const {
    const Tensor5<bf16, MemorySpace>& out = wk.reverse ? dstates : hin;
    warp_store_bf16(S, lane, ScratchTile{&out(wk.b, c, wk.h, R * w, wk.n0).bits, N});
  }

  KOKKOS_INLINE_FUNCTION void operator()(const WarpTeamContext& ctx) const {
    const Walk wk = walk(ctx.league_rank);
    const Tiles sm = tiles(ctx.scratch);
    StateAccum S[slots];
    Team::for_each_warp(ctx.thread, [&](int slot, int w, int lane) {
      S[slot].for_each(lane, [&](int r, int n, float& v) { v = start_value(wk, R * w + r, wk.n0 + n); });
    });
    float log_decay = 0.0f;
    for (int step = wk.first; step < wk.end; ++step) {
      const int c = wk.reverse ? wk.end - 1 - (step - wk.first) : step;
      float chunk_log_decay;
      const float decay = stage_chunk(ctx, sm, wk, c, chunk_log_decay);
      log_decay += chunk_log_decay;
      ctx.barrier();
      Team::for_each_warp(ctx.thread, [&](int slot, int w, int lane) {
        if (!EndOnly) store(wk, w, lane, c, S[slot]);
        S[slot].for_each(lane, [&](int, int, float& v) { v *= decay; });
        warp_mma<ALayout::KM, BLayout::KN, Q, false>(S[slot], lane, sm.rows.offset(0, R * w), sm.cols, Cols);
      });
      ctx.barrier();
    }
    Team::for_each_warp(ctx.thread, [&](int slot, int w, int lane) { finish(wk, w, lane, S[slot]); });
    if (EndOnly && ctx.thread == 0 && !wk.reverse && wk.n0 == 0) {
      segments.decay(wk.b, wk.h, wk.seg) = kmamba::math::exp(log_decay);
    }
  }
};

/// Passes the segments' end values along each walk: forward, the value entering segment k + 1 is
/// decay_k·(the value entering k) + end_k from initial_states (or 0); reverse, the value entering
/// segment k − 1's walk is decay_k·(the value entering k's) + end_k from dfinal_states (or 0). One
/// work item per (batch, direction, head, p, n).
template <class MemorySpace>
struct SsdWalkSegmentPassingFunctor {
  SsdOperands<MemorySpace> in;
  SsdPlan plan;
  ConstTensor4<float, MemorySpace> dfinal_states;  // (batch, nheads, headdim, dstate), optional
  SsdWalkSegments<MemorySpace> segments;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int n = static_cast<int>(item % plan.dstate), p = static_cast<int>((item / plan.dstate) % plan.headdim);
    const std::int64_t rest = item / (static_cast<std::int64_t>(plan.dstate) * plan.headdim);
    const int h = static_cast<int>(rest % plan.nheads), walk = static_cast<int>(rest / plan.nheads);
    const int b = walk / 2;
    const bool reverse = walk % 2 == 1;
    float run = 0.0f;
    if (reverse && dfinal_states.is_allocated()) run = dfinal_states(b, h, p, n);
    if (!reverse && in.has_initial_states) run = in.initial_states(b, h, p, n);
    for (int j = 0; j < segments.count; ++j) {
      const int k = reverse ? segments.count - 1 - j : j;
      const float end = segments.values(walk, h, k, p, n);
      segments.values(walk, h, k, p, n) = run;
      run = segments.decay(b, h, k) * run + end;
    }
  }
};

/// The teams of unsegmented walks.
inline int ssd_state_walk_teams(const SsdPlan& plan) {
  return plan.batch * plan.nheads * 2 * (plan.dstate / ssd_state_walk_cols(plan.dstate));
}

/// Segments per walk: as many as keep the teams within one wave of the device (a team of 128
/// threads per 512 of the backend's concurrency: four per SM), each at least
/// ssd_fused_min_segment_chunks long; 1 where the unsegmented teams already fill that wave, since
/// segmenting doubles each team's chunk steps.
template <class ExecSpace>
int ssd_walk_segment_count(const ExecSpace& exec, const SsdPlan& plan) {
  const std::int64_t wanted = std::max<std::int64_t>(1, static_cast<std::int64_t>(exec.concurrency()) / 512);
  const std::int64_t by_length = std::max<std::int64_t>(1, plan.nchunks / ssd_fused_min_segment_chunks);
  const std::int64_t per_wave = wanted / ssd_state_walk_teams(plan);
  return static_cast<int>(per_wave >= 2 ? std::min<std::int64_t>(per_wave, by_length) : 1);
}

template <int N, bool EndOnly, bool PerHead, class ExecSpace, class MemorySpace>
void ssd_state_walk_launch(const ExecSpace& exec,
                           const SsdStateWalkFunctor<ExecSpace, MemorySpace, N, EndOnly, PerHead>& f) {
  using Functor = SsdStateWalkFunctor<ExecSpace, MemorySpace, N, EndOnly, PerHead>;
  WarpTeamLauncher<ExecSpace, Functor::Team::threads, 4>::launch(
      exec, EndOnly ? "kmamba::ssd::fused_state_walk_segments" : "kmamba::ssd::fused_state_walks",
      f.plan.batch * f.plan.nheads * 2 * Functor::col_blocks * f.segments.count, Functor::Layout::bytes, f);
}

/// The walks for N states in `segment_count` segments (see ssd_fused_state_walks).
template <int N, bool PerHead, class ExecSpace, class MemorySpace>
void ssd_fused_state_walks_of(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                              const SsdWorkspace<MemorySpace>& ws, const ConstTensor4<float, MemorySpace>& g,
                              const ConstTensor4<float, MemorySpace>& dfinal_states,
                              const Tensor5<bf16, MemorySpace>& hin, const Tensor5<bf16, MemorySpace>& dstates,
                              const Tensor4<float, MemorySpace>& dinitial_states, int segment_count,
                              const SsdFusedHeadOperands<MemorySpace>& head) {
  SsdWalkSegments<MemorySpace> segments;
  segments.count = std::max(1, std::min(segment_count, plan.nchunks));
  segments.chunks = (plan.nchunks + segments.count - 1) / segments.count;
  segments.count = (plan.nchunks + segments.chunks - 1) / segments.chunks;
  if (segments.count > 1) {
    segments.values = allocate_uninitialized<Tensor5<float, MemorySpace>>(
        "kmamba::ssd::walk_segment_values", 2 * plan.batch, plan.nheads, segments.count, plan.headdim, plan.dstate);
    segments.decay = allocate_uninitialized<Tensor3<float, MemorySpace>>("kmamba::ssd::walk_segment_decay", plan.batch,
                                                                         plan.nheads, segments.count);
    ssd_state_walk_launch<N, true, PerHead>(
        exec, SsdStateWalkFunctor<ExecSpace, MemorySpace, N, true, PerHead>{in, ws, plan, g, dfinal_states, hin,
                                                                            dstates, dinitial_states, segments, head});
    Kokkos::parallel_for(
        "kmamba::ssd::walk_segment_passing",
        Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(
            exec, 0, static_cast<std::int64_t>(2 * plan.batch) * plan.nheads * plan.headdim * plan.dstate),
        SsdWalkSegmentPassingFunctor<MemorySpace>{in, plan, dfinal_states, segments});
  }
  ssd_state_walk_launch<N, false, PerHead>(
      exec, SsdStateWalkFunctor<ExecSpace, MemorySpace, N, false, PerHead>{in, ws, plan, g, dfinal_states, hin, dstates,
                                                                           dinitial_states, segments, head});
}

/// Hin into hin and dS into dstates for every (batch, chunk, head), and dinitial_states
/// when allocated; the plan and inputs are the fused backward's (ssd_fused_backward_supported, g
/// 16-byte aligned), and ws.dt_out and ws.dA_cs hold the chunk cumsum. Each walk is cut into
/// `segment_count` segments (at most one per chunk; ssd_walk_segment_count chooses it); with a
/// caller's per-head operands when given.
template <class ExecSpace, class MemorySpace>
void ssd_fused_state_walks(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                           const SsdWorkspace<MemorySpace>& ws,
                           const SsdNonDeduced<ConstTensor4<float, MemorySpace>>& g,
                           const SsdNonDeduced<ConstTensor4<float, MemorySpace>>& dfinal_states,
                           const SsdNonDeduced<Tensor5<bf16, MemorySpace>>& hin,
                           const SsdNonDeduced<Tensor5<bf16, MemorySpace>>& dstates,
                           const SsdNonDeduced<Tensor4<float, MemorySpace>>& dinitial_states, int segment_count,
                           const SsdFusedHeadOperands<MemorySpace>& head = SsdFusedHeadOperands<MemorySpace>()) {
  ssd_with_fused_dstate(plan.dstate, [&](auto states) {
    constexpr int N = decltype(states)::value;
    if (head.per_head) {
      ssd_fused_state_walks_of<N, true>(exec, plan, in, ws, g, dfinal_states, hin, dstates, dinitial_states,
                                        segment_count, head);
    } else {
      ssd_fused_state_walks_of<N, false>(exec, plan, in, ws, g, dfinal_states, hin, dstates, dinitial_states,
                                         segment_count, head);
    }
  });
}

}  // namespace impl
}  // namespace kmamba

#endif
