// Internals of kmamba/core/Ssd.hpp: the launch plan, the workspaces and one functor per stage of
// the chunked SSD (docs/algorithms.md §2.5, §2.6, §2.10).
//
// Work decomposition (same for every backend): the chunk stages are TeamPolicy launches with one
// team per (batch, chunk, head) — (batch, chunk, group, tile of rows) for C·Bᵀ; the passing of
// states between chunks is one work item per state element. A team stages its chunk's per-token
// vectors (δ, cumulative δ·a, run ids) in level-0 scratch and works on the intra-chunk matrices a
// tile of rows at a time: the weights of the forward and of dx are formed inside the product's
// operand, the backward keeps one (tile × chunk) block in level-1 scratch, so level-0 scratch
// grows with the chunk only. Every per-chunk product goes through TeamGemm (impl/TeamGemm.hpp),
// which a backend may specialise (with the team shape and scratch it wants, see ssd_plan). The
// functors that multiply take the MatmulPrecision of their products as a template parameter;
// ssd_forward_impl / ssd_backward_impl instantiate the stages once per precision the backend's
// TeamGemm distinguishes (with_matmul_precision: twice on Cuda, once elsewhere). With BFloat16
// products and a shape they are compiled for, the forward is impl/SsdFusedForward.hpp and the
// backward's chunk stages are impl/SsdFusedStates.hpp and impl/SsdFusedBackward.hpp
// (ssd_fused_backward_stages), on the warp tiles.
//
// seq_idx: a "run" is a maximal stretch of tokens with equal seq_idx. Stage 1 writes, per token,
// the number of run starts from the beginning of its chunk up to the token (the first token of a
// row never starts a run, so initial_states belongs to the row's first sequence). Two tokens of a
// chunk interact iff their counts agree; the state entering a chunk reaches the tokens whose
// count is 0; the state leaving a chunk carries the incoming one iff the chunk's last count is 0.
// This is the token-level rule "the state restarts from zero where seq_idx changes".
#ifndef KMAMBA_CORE_IMPL_SSDIMPL_HPP
#define KMAMBA_CORE_IMPL_SSDIMPL_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/impl/ChunkStateWalk.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>
#include <kmamba/core/impl/SsdFusedBackward.hpp>
#include <kmamba/core/impl/SsdFusedForward.hpp>
#include <kmamba/core/impl/SsdFusedStates.hpp>
#include <kmamba/core/impl/SsdOperands.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/TeamGemm.hpp>
#include <kmamba/core/Math.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace kmamba {

template <class MemorySpace>
struct SsdGrads;
template <class MemorySpace>
struct SsdStepArgs;

namespace impl {

template <class ExecSpace>
struct SsdScratch {
  using Vec = Kokkos::View<float*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  using IntVec = Kokkos::View<int*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  // Row-major on every backend: rows are scanned and columns summed with the lanes along a row.
  using Mat =
      Kokkos::View<float**, Kokkos::LayoutRight, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;

  static constexpr int vectors = 9;

  /// Bytes of level-0 scratch every chunk stage fits in: `vectors` float vectors and one int
  /// vector of the chunk, and TeamGemm's staging.
  static std::size_t bytes(int chunk) {
    return vectors * Vec::shmem_size(chunk) + IntVec::shmem_size(chunk) + TeamGemm<ExecSpace>::scratch_bytes;
  }
  /// Bytes of level-1 scratch of the backward's (tile × chunk) block of intra-chunk weights.
  static std::size_t block_bytes(int tile, int chunk) { return Mat::shmem_size(tile, chunk); }
};

template <class ExecSpace>
SsdPlan ssd_plan(const char* function, const SsdDims& dims, int chunk_size) {
  using Policy = Kokkos::TeamPolicy<ExecSpace>;
  using S = SsdScratch<ExecSpace>;
  constexpr int preferred_tile = 64;
  constexpr int preferred_team_size = 8;
  constexpr int max_vector_length = 32;
  SsdPlan plan;
  plan.batch = static_cast<int>(dims.batch);
  plan.seqlen = static_cast<int>(dims.seqlen);
  plan.nheads = static_cast<int>(dims.nheads);
  plan.headdim = static_cast<int>(dims.headdim);
  plan.ngroups = static_cast<int>(dims.ngroups);
  plan.dstate = static_cast<int>(dims.dstate);
  plan.heads_per_group = plan.nheads / plan.ngroups;
  plan.chunk = chunk_size;
  plan.nchunks = (plan.seqlen + plan.chunk - 1) / plan.chunk;
  const std::size_t limit = static_cast<std::size_t>(Policy::scratch_size_max(0));
  const std::size_t need = S::bytes(plan.chunk);
  KMAMBA_REQUIRE(need <= limit, function << ": chunk_size " << plan.chunk << " needs " << need
                                         << " bytes of team scratch memory but " << limit
                                         << " are available; pass a smaller chunk_size");
  const std::size_t block_limit = static_cast<std::size_t>(Policy::scratch_size_max(1));
  plan.tile = std::min(preferred_tile, plan.chunk);
  while (plan.tile > 1 && S::block_bytes(plan.tile, plan.chunk) > block_limit) plan.tile = (plan.tile + 1) / 2;
  const std::size_t block_need = S::block_bytes(plan.tile, plan.chunk);
  KMAMBA_REQUIRE(block_need <= block_limit, function << ": chunk_size " << plan.chunk << " needs " << block_need
                                                     << " bytes of level-1 team scratch memory but " << block_limit
                                                     << " are available; pass a smaller chunk_size");
  plan.ntiles = (plan.chunk + plan.tile - 1) / plan.tile;
  if (TeamGemm<ExecSpace>::team_threads > 0) {
    plan.vector_length = std::min(max_vector_length, static_cast<int>(Policy::vector_length_max()));
    plan.team_size = std::max(1, TeamGemm<ExecSpace>::team_threads / plan.vector_length);
  } else {
    int vector_length = 1;
    const int widest = std::max(plan.chunk, std::max(plan.headdim, plan.dstate));
    while (vector_length < widest && vector_length < max_vector_length) vector_length *= 2;
    plan.vector_length = std::min(vector_length, static_cast<int>(Policy::vector_length_max()));
    plan.team_size = preferred_team_size;
  }
  return plan;
}

/// A TeamPolicy launch of the plan's team shape (fewer threads where the functor cannot have
/// that many) with `scratch` bytes of level-0 and `block_scratch` bytes of level-1 team scratch.
template <class ExecSpace, class Functor>
void ssd_launch(const ExecSpace& exec, const char* label, const SsdPlan& plan, int league, const Functor& functor,
                std::size_t scratch, std::size_t block_scratch = 0) {
  using Policy = Kokkos::TeamPolicy<ExecSpace, typename TeamGemm<ExecSpace>::launch_bounds>;
  if (league == 0) return;
  Policy probe(exec, league, 1, plan.vector_length);
  probe.set_scratch_size(0, Kokkos::PerTeam(scratch));
  const int team_size = std::max(1, std::min(plan.team_size, probe.team_size_max(functor, Kokkos::ParallelForTag())));
  Policy policy(exec, league, team_size, plan.vector_length);
  policy.set_scratch_size(0, Kokkos::PerTeam(scratch));
  if (block_scratch > 0) policy.set_scratch_size(1, Kokkos::PerTeam(block_scratch));
  Kokkos::parallel_for(label, light_weight(policy), functor);
}
/// Stages the chunk's δ, cumulative δ·a and run ids in scratch.
template <class Member, class MemorySpace, class Vec, class IntVec>
KOKKOS_INLINE_FUNCTION void ssd_stage_vectors(const Member& team, const SsdWorkspace<MemorySpace>& ws,
                                              const SsdChunkBlock& blk, const Vec& sdt, const Vec& sA,
                                              const IntVec& srun) {
  Kokkos::parallel_for(Kokkos::TeamVectorRange(team, blk.len), [&](const int l) {
    sdt(l) = ws.dt_out(blk.b, blk.h, blk.c, l);
    sA(l) = ws.dA_cs(blk.b, blk.h, blk.c, l);
    srun(l) = ws.run(blk.b, blk.c, l);
  });
}

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

/// The decay of the state across chunk c of row b, head h: exp(dA_cs[last]), or 0 where a run
/// starts inside the chunk.
template <class MemorySpace>
KOKKOS_INLINE_FUNCTION float ssd_chunk_decay(const SsdPlan& plan, const SsdWorkspace<MemorySpace>& ws, int b, int h,
                                             int c) {
  const int last = (plan.seqlen - c * plan.chunk < plan.chunk ? plan.seqlen - c * plan.chunk : plan.chunk) - 1;
  return ws.run(b, c, last) == 0 ? kmamba::math::exp(ws.dA_cs(b, h, c, last)) : 0.0f;
}

/// Where a (batch, head, p, n) work item of the state passing works.
struct SsdStateItem {
  int b, h, p, n;
};

/// The number of (batch, head, p, n) work items.
inline std::int64_t ssd_state_items(const SsdPlan& plan) {
  return static_cast<std::int64_t>(plan.batch) * plan.nheads * plan.headdim * plan.dstate;
}

KOKKOS_INLINE_FUNCTION SsdStateItem ssd_state_item(const SsdPlan& plan, std::int64_t item) {
  const std::int64_t per_head = static_cast<std::int64_t>(plan.headdim) * plan.dstate;
  const int pn = static_cast<int>(item % per_head);
  const int bh = static_cast<int>(item / per_head);
  return SsdStateItem{bh / plan.nheads, bh % plan.nheads, pn / plan.dstate, pn % plan.dstate};
}

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

/// dB and dC: the heads of each group summed in a fixed order, one work item per element.
template <class MemorySpace>
struct SsdGroupSumFunctor {
  ConstTensor4<float, MemorySpace> dB_head, dC_head;  // (batch, seqlen, nheads, dstate)
  Tensor4<float, MemorySpace> dB, dC;                 // (batch, seqlen, ngroups, dstate)

  KOKKOS_INLINE_FUNCTION void operator()(const int item) const {
    const int dstate = static_cast<int>(dB.extent(3)), ngroups = static_cast<int>(dB.extent(2));
    const int seqlen = static_cast<int>(dB.extent(1));
    const int n = item % dstate, g = (item / dstate) % ngroups, t = (item / (dstate * ngroups)) % seqlen;
    const int b = item / (dstate * ngroups * seqlen);
    const int heads_per_group = static_cast<int>(dB_head.extent(2)) / ngroups;
    float sb = 0.0f, sc = 0.0f;
    for (int k = 0; k < heads_per_group; ++k) {
      sb += dB_head(b, t, g * heads_per_group + k, n);
      sc += dC_head(b, t, g * heads_per_group + k, n);
    }
    dB(b, t, g, n) = sb;
    dC(b, t, g, n) = sc;
  }
};
/// dA, dD and ddt_bias: the per-(batch, chunk) partial sums added in a fixed order.
template <class MemorySpace>
struct SsdParameterSumFunctor {
  ConstTensor4<float, MemorySpace> partial;      // (batch, nchunks, nheads, 3)
  Tensor1<float, MemorySpace> dA, dD, ddt_bias;  // (nheads)
  bool write_dA, write_dD, write_ddt_bias;

  KOKKOS_INLINE_FUNCTION void operator()(const int h) const {
    float sums[3] = {0.0f, 0.0f, 0.0f};
    for (int b = 0; b < static_cast<int>(partial.extent(0)); ++b) {
      for (int c = 0; c < static_cast<int>(partial.extent(1)); ++c) {
        for (int k = 0; k < 3; ++k) sums[k] += partial(b, c, h, k);
      }
    }
    if (write_dA) dA(h) = sums[0];
    if (write_dD) dD(h) = sums[1];
    if (write_ddt_bias) ddt_bias(h) = sums[2];
  }
};

/// One decode step (docs/algorithms.md §2.10): a team per (batch, head), threads over headdim,
/// lanes over dstate.
template <class ExecSpace, class MemorySpace>
struct SsdStepFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  ConstTensor3<float, MemorySpace> x;        // (batch, nheads, headdim)
  ConstTensor2<float, MemorySpace> dt;       // (batch, nheads)
  ConstTensor1<float, MemorySpace> A;        // (nheads)
  ConstTensor3<float, MemorySpace> B, C;     // (batch, ngroups, dstate)
  ConstTensor1<float, MemorySpace> D;        // (nheads)
  ConstTensor3<float, MemorySpace> z;        // (batch, nheads, headdim)
  ConstTensor1<float, MemorySpace> dt_bias;  // (nheads)
  Tensor4<float, MemorySpace> state;         // (batch, nheads, headdim, dstate)
  Tensor3<float, MemorySpace> out;           // (batch, nheads, headdim)
  bool has_D, has_z, has_dt_bias, dt_softplus;
  SsdPlan plan;
  int rows_per_team;  // headdim rows of one head per team: a decode step at batch 1 still fills the GPU

  int league() const { return plan.batch * plan.nheads * row_blocks(); }
  KOKKOS_INLINE_FUNCTION int row_blocks() const { return (plan.headdim + rows_per_team - 1) / rows_per_team; }

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int block = team.league_rank() % row_blocks();
    const int h = (team.league_rank() / row_blocks()) % plan.nheads;
    const int b = team.league_rank() / row_blocks() / plan.nheads;
    const int g = h / plan.heads_per_group;
    const float pre = dt(b, h) + (has_dt_bias ? dt_bias(h) : 0.0f);
    const float d = dt_softplus ? softplus(pre) : pre;
    const float decay = kmamba::math::exp(d * A(h));
    const int p_begin = block * rows_per_team;
    const int p_end = p_begin + rows_per_team < plan.headdim ? p_begin + rows_per_team : plan.headdim;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, p_begin, p_end), [&](const int p) {
      const float xv = x(b, h, p);
      float y = 0.0f;
      Kokkos::parallel_reduce(
          Kokkos::ThreadVectorRange(team, plan.dstate),
          [&](const int n, float& acc) {
            const float s = decay * state(b, h, p, n) + d * xv * B(b, g, n);
            state(b, h, p, n) = s;
            acc += s * C(b, g, n);
          },
          y);
      Kokkos::single(Kokkos::PerThread(team), [&]() {
        float o = y + (has_D ? D(h) * xv : 0.0f);
        if (has_z) o *= silu(z(b, h, p));
        out(b, h, p) = o;
      });
    });
  }
};

/// Stage 3: each chunk's local state in ws.states becomes the state entering it (and the final
/// state is written when final_states is allocated).
template <class ExecSpace, class MemorySpace>
void ssd_state_passing(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                       const SsdWorkspace<MemorySpace>& ws, const Tensor4<float, MemorySpace>& final_states) {
  Kokkos::parallel_for("kmamba::ssd::state_passing",
                       Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, ssd_state_items(plan)),
                       SsdStatePassingFunctor<MemorySpace>{in, ws, plan, final_states, final_states.is_allocated()});
}

/// Stage 4: C·Bᵀ within each chunk (ws.CB).
template <MatmulPrecision Precision, class ExecSpace, class MemorySpace>
void ssd_bmm_chunk(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                   const SsdWorkspace<MemorySpace>& ws) {
  ssd_launch(exec, "kmamba::ssd::bmm_chunk", plan, plan.batch * plan.nchunks * plan.ngroups * plan.ntiles,
             SsdBmmChunkFunctor<ExecSpace, MemorySpace, Precision>{in, ws, plan}, TeamGemm<ExecSpace>::scratch_bytes);
}

/// Stage 1: δ, the chunk cumsums of δ·a and the run ids.
template <class ExecSpace, class MemorySpace>
void ssd_chunk_cumsum(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                      const SsdWorkspace<MemorySpace>& ws) {
  ssd_launch(exec, "kmamba::ssd::chunk_cumsum", plan, plan.batch * plan.nchunks * plan.nheads,
             SsdChunkCumsumFunctor<ExecSpace, MemorySpace>{in, ws, plan}, 0);
}

/// Stages 1–4: δ, cumsums and run ids; entering states (and the final state); C·Bᵀ.
template <MatmulPrecision Precision, class ExecSpace, class MemorySpace>
void ssd_prepare(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                 const SsdWorkspace<MemorySpace>& ws, const Tensor4<float, MemorySpace>& final_states) {
  ssd_chunk_cumsum(exec, plan, in, ws);
  ssd_launch(exec, "kmamba::ssd::chunk_state", plan, plan.batch * plan.nchunks * plan.nheads,
             SsdChunkStateFunctor<ExecSpace, MemorySpace, Precision>{in, ws, plan},
             SsdScratch<ExecSpace>::bytes(plan.chunk));
  ssd_state_passing(exec, plan, in, ws, final_states);
  ssd_bmm_chunk<Precision>(exec, plan, in, ws);
}

template <MatmulPrecision Precision, class ExecSpace, class MemorySpace>
void ssd_forward_stages(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                        const Tensor4<float, MemorySpace>& out, const Tensor4<float, MemorySpace>& final_states) {
  const SsdWorkspace<MemorySpace> ws(plan);
  ssd_prepare<Precision>(exec, plan, in, ws, final_states);
  ssd_launch(exec, "kmamba::ssd::chunk_scan", plan, plan.batch * plan.nchunks * plan.nheads,
             SsdChunkScanFunctor<ExecSpace, MemorySpace, false, Precision>{in, ws, plan, out, {}, {}},
             SsdScratch<ExecSpace>::bytes(plan.chunk));
}

template <class ExecSpace, class MemorySpace>
void ssd_forward_impl(const ExecSpace& exec, const char* function, const SsdDims& dims,
                      const SsdArgs<MemorySpace>& args, const Tensor4<float, MemorySpace>& out,
                      const Tensor4<float, MemorySpace>& final_states) {
  const SsdPlan plan = ssd_plan<ExecSpace>(function, dims, args.chunk_size);
  const SsdOperands<MemorySpace> in(args);
  if (plan.seqlen == 0) {
    if (final_states.is_allocated()) {
      if (in.has_initial_states) {
        Kokkos::deep_copy(exec, final_states, in.initial_states);
      } else {
        Kokkos::deep_copy(exec, final_states, 0.0f);
      }
    }
    return;
  }
  if (args.matmul_precision == MatmulPrecision::BFloat16) {
    const SsdPlan fused = ssd_plan<ExecSpace>(function, dims, ssd_fused_chunk);
    if (ssd_fused_forward_supported(fused, in)) {
      ssd_fused_forward(exec, fused, in, out, final_states, ssd_fused_segment_count(exec, fused));
      return;
    }
  }
  with_matmul_precision<ExecSpace>(args.matmul_precision, [&](auto precision) {
    ssd_forward_stages<decltype(precision)::value>(exec, plan, in, out, final_states);
  });
}

/// The gated dout g = dout·silu(z) and dz (chunk_scan_gate_backward: the forward's output again,
/// from the entering states in ws.states and ws.CB).
template <MatmulPrecision Precision, class ExecSpace, class MemorySpace>
ConstTensor4<float, MemorySpace> ssd_gate_backward(const ExecSpace& exec, const SsdPlan& plan,
                                                   const SsdOperands<MemorySpace>& in,
                                                   const SsdWorkspace<MemorySpace>& ws,
                                                   const ConstTensor4<float, MemorySpace>& dout,
                                                   const Tensor4<float, MemorySpace>& dz) {
  const auto gated = allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::ssd::gated_dout", plan.batch,
                                                                         plan.seqlen, plan.nheads, plan.headdim);
  ssd_launch(exec, "kmamba::ssd::chunk_scan_gate_backward", plan, plan.batch * plan.nchunks * plan.nheads,
             SsdChunkScanFunctor<ExecSpace, MemorySpace, true, Precision>{in, ws, plan, gated, dout, dz},
             SsdScratch<ExecSpace>::bytes(plan.chunk));
  return gated;
}

/// Backward B3 (state passing, reversed): dstates becomes the gradient of each chunk's leaving
/// state; dinitial_states is written when allocated.
template <class ExecSpace, class MemorySpace>
void ssd_state_passing_backward(const ExecSpace& exec, const SsdPlan& plan, const SsdWorkspace<MemorySpace>& ws,
                                const ConstTensor4<float, MemorySpace>& dfinal_states,
                                const Tensor5<float, MemorySpace>& dstates, const SsdGrads<MemorySpace>& grads) {
  Kokkos::parallel_for(
      "kmamba::ssd::state_passing_backward",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, ssd_state_items(plan)),
      SsdStatePassingBackwardFunctor<MemorySpace>{ws, plan, dfinal_states, dstates, grads.dinitial_states,
                                                  dfinal_states.is_allocated(), grads.dinitial_states.is_allocated()});
}

/// The per-head outputs of the chunk backward, summed into the gradients by ssd_backward_sums. With
/// one head per group they are the gradients themselves (nothing to sum).
template <class MemorySpace>
struct SsdChunkGrads {
  Tensor4<float, MemorySpace> dB_head;  // (batch, seqlen, nheads, dstate)
  Tensor4<float, MemorySpace> dC_head;  // (batch, seqlen, nheads, dstate)
  Tensor4<float, MemorySpace> partial;  // (batch, nchunks, nheads, 3): dA, dD, ddt_bias

  SsdChunkGrads(const SsdPlan& plan, const SsdGrads<MemorySpace>& grads)
      : partial(allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::ssd::partial_dA_dD_ddt_bias", plan.batch,
                                                                    plan.nchunks, plan.nheads, 3)) {
    if (plan.heads_per_group == 1) {
      dB_head = grads.dB;
      dC_head = grads.dC;
    } else {
      dB_head = allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::ssd::dB_per_head", plan.batch, plan.seqlen,
                                                                    plan.nheads, plan.dstate);
      dC_head = allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::ssd::dC_per_head", plan.batch, plan.seqlen,
                                                                    plan.nheads, plan.dstate);
    }
  }
};

/// dB, dC (over the heads of each group) and dA, dD, ddt_bias (over batch and chunks), in a fixed order.
template <class ExecSpace, class MemorySpace>
void ssd_backward_sums(const ExecSpace& exec, const SsdPlan& plan, const SsdChunkGrads<MemorySpace>& chunk,
                       const SsdGrads<MemorySpace>& grads) {
  if (plan.heads_per_group > 1) {
    Kokkos::parallel_for("kmamba::ssd::group_sum",
                         Kokkos::RangePolicy<ExecSpace>(exec, 0, plan.batch * plan.seqlen * plan.ngroups * plan.dstate),
                         SsdGroupSumFunctor<MemorySpace>{chunk.dB_head, chunk.dC_head, grads.dB, grads.dC});
  }
  Kokkos::parallel_for(
      "kmamba::ssd::parameter_sum", Kokkos::RangePolicy<ExecSpace>(exec, 0, plan.nheads),
      SsdParameterSumFunctor<MemorySpace>{chunk.partial, grads.dA, grads.dD, grads.ddt_bias, grads.dA.is_allocated(),
                                          grads.dD.is_allocated(), grads.ddt_bias.is_allocated()});
}

/// The staged backward: every stage a TeamGemm kernel at the plan's chunk length.
template <MatmulPrecision Precision, class ExecSpace, class MemorySpace>
void ssd_backward_stages(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                         const ConstTensor4<float, MemorySpace>& dout,
                         const ConstTensor4<float, MemorySpace>& dfinal_states, const SsdGrads<MemorySpace>& grads) {
  const std::size_t scratch = SsdScratch<ExecSpace>::bytes(plan.chunk);
  const int chunk_league = plan.batch * plan.nchunks * plan.nheads;
  const SsdWorkspace<MemorySpace> ws(plan);
  ssd_prepare<Precision>(exec, plan, in, ws, Tensor4<float, MemorySpace>());
  const ConstTensor4<float, MemorySpace> g =
      in.has_z ? ssd_gate_backward<Precision>(exec, plan, in, ws, dout, grads.dz) : dout;
  const auto dstates = allocate_uninitialized<Tensor5<float, MemorySpace>>(
      "kmamba::ssd::dstates", plan.batch, plan.nchunks, plan.nheads, plan.headdim, plan.dstate);
  ssd_launch(exec, "kmamba::ssd::chunk_dstates", plan, chunk_league,
             SsdChunkDstatesFunctor<ExecSpace, MemorySpace, Precision>{in, ws, plan, g, dstates}, scratch);
  ssd_state_passing_backward(exec, plan, ws, dfinal_states, dstates, grads);
  const SsdChunkGrads<MemorySpace> chunk(plan, grads);
  ssd_launch(
      exec, "kmamba::ssd::chunk_backward", plan, chunk_league,
      SsdChunkBackwardFunctor<ExecSpace, MemorySpace, Precision>{
          in, ws, plan, g, dstates, grads.dx, grads.ddt, grads.dlog_decay, chunk.dB_head, chunk.dC_head, chunk.partial},
      scratch, SsdScratch<ExecSpace>::block_bytes(plan.tile, plan.chunk));
  ssd_backward_sums(exec, plan, chunk, grads);
}

/// g = dout·silu(z) and dz = dout·out_x·silu′(z), with out_x the forward's output before the gate;
/// one item per element.
template <class MemorySpace>
struct SsdGateBackwardFunctor {
  SsdPlan plan;
  ConstTensor4<float, MemorySpace> out_x, dout, z;  // (batch, seqlen, nheads, headdim)
  Tensor4<float, MemorySpace> g, dz;                // (batch, seqlen, nheads, headdim)

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const {
    const int p = static_cast<int>(i % plan.headdim);
    const std::int64_t bth = i / plan.headdim;
    const int h = static_cast<int>(bth % plan.nheads);
    const std::int64_t bt = bth / plan.nheads;
    const int t = static_cast<int>(bt % plan.seqlen), b = static_cast<int>(bt / plan.seqlen);
    const float d = dout(b, t, h, p), zv = z(b, t, h, p);
    g(b, t, h, p) = d * silu(zv);
    dz(b, t, h, p) = d * out_x(b, t, h, p) * silu_derivative(zv);
  }
};

/// The gated dout g and dz from the forward recomputed without the gate by the fused forward
/// (`forward_plan`: its chunk; ssd_fused_forward_supported must hold).
template <class ExecSpace, class MemorySpace>
ConstTensor4<float, MemorySpace> ssd_fused_gate_backward(const ExecSpace& exec, const SsdPlan& forward_plan,
                                                         const SsdOperands<MemorySpace>& in,
                                                         const ConstTensor4<float, MemorySpace>& dout,
                                                         const Tensor4<float, MemorySpace>& dz) {
  using T4 = Tensor4<float, MemorySpace>;
  const SsdPlan& plan = forward_plan;
  const auto out_x =
      allocate_uninitialized<T4>("kmamba::ssd::ungated_out", plan.batch, plan.seqlen, plan.nheads, plan.headdim);
  SsdOperands<MemorySpace> ungated = in;
  ungated.has_z = false;
  ssd_fused_forward(exec, plan, ungated, out_x, T4(), ssd_fused_segment_count(exec, plan));
  const auto g =
      allocate_uninitialized<T4>("kmamba::ssd::gated_dout", plan.batch, plan.seqlen, plan.nheads, plan.headdim);
  Kokkos::parallel_for("kmamba::ssd::gate_backward",
                       Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(
                           exec, 0, static_cast<std::int64_t>(plan.batch) * plan.seqlen * plan.nheads * plan.headdim),
                       SsdGateBackwardFunctor<MemorySpace>{plan, out_x, dout, in.z, g, dz});
  return g;
}

/// The fused backward (ssd_fused_backward_supported(plan, in), and with a gate
/// ssd_fused_forward_supported(forward_plan, in); dout 16-byte aligned where there is no gate):
/// the gated dout from a recomputed fused forward (with a gate), the entering states and the
/// leaving states' gradients walked along the sequence in one kernel (impl/SsdFusedStates.hpp), and
/// the chunk stage B4–B9 (impl/SsdFusedBackward.hpp), on the tensor cores.
template <class ExecSpace, class MemorySpace>
void ssd_fused_backward_stages(const ExecSpace& exec, const SsdPlan& plan, const SsdPlan& forward_plan,
                               const SsdOperands<MemorySpace>& in, const ConstTensor4<float, MemorySpace>& dout,
                               const ConstTensor4<float, MemorySpace>& dfinal_states,
                               const SsdGrads<MemorySpace>& grads) {
  const SsdWorkspace<MemorySpace> ws(plan, false);
  using States = Tensor5<bf16, MemorySpace>;
  const auto hin = allocate_uninitialized<States>("kmamba::ssd::entering_states", plan.batch, plan.nchunks, plan.nheads,
                                                  plan.headdim, plan.dstate);
  const auto dstates = allocate_uninitialized<States>("kmamba::ssd::dstates", plan.batch, plan.nchunks, plan.nheads,
                                                      plan.headdim, plan.dstate);
  const ConstTensor4<float, MemorySpace> g =
      in.has_z ? ssd_fused_gate_backward(exec, forward_plan, in, dout, grads.dz) : dout;
  ssd_chunk_cumsum(exec, plan, in, ws);
  ssd_fused_state_walks(exec, plan, in, ws, g, dfinal_states, hin, dstates, grads.dinitial_states,
                        ssd_walk_segment_count(exec, plan));
  const SsdChunkGrads<MemorySpace> chunk(plan, grads);
  ssd_fused_chunk_backward(exec, plan, in, ws, g, hin, dstates, grads.dx, grads.ddt, grads.dlog_decay, chunk.dB_head,
                           chunk.dC_head, chunk.partial);
  ssd_backward_sums(exec, plan, chunk, grads);
}

template <class ExecSpace, class MemorySpace>
void ssd_backward_impl(const ExecSpace& exec, const char* function, const SsdDims& dims,
                       const SsdArgs<MemorySpace>& args, const ConstTensor4<float, MemorySpace>& dout,
                       const ConstTensor4<float, MemorySpace>& dfinal_states, const SsdGrads<MemorySpace>& grads) {
  const SsdOperands<MemorySpace> in(args);
  if (args.matmul_precision == MatmulPrecision::BFloat16 && dims.seqlen > 0) {
    const SsdPlan fused = ssd_plan<ExecSpace>(function, dims, ssd_fused_backward_chunk);
    const SsdPlan forward = ssd_plan<ExecSpace>(function, dims, ssd_fused_chunk);
    const bool gate_ok = in.has_z ? ssd_fused_forward_supported(forward, in) : ssd_fused_backward_aligned(dout.data());
    if (ssd_fused_backward_supported(fused, in) && gate_ok) {
      ssd_fused_backward_stages(exec, fused, forward, in, dout, dfinal_states, grads);
      return;
    }
  }
  const SsdPlan plan = ssd_plan<ExecSpace>(function, dims, args.chunk_size);
  with_matmul_precision<ExecSpace>(args.matmul_precision, [&](auto precision) {
    ssd_backward_stages<decltype(precision)::value>(exec, plan, in, dout, dfinal_states, grads);
  });
}

template <class ExecSpace, class MemorySpace>
void ssd_step_impl(const ExecSpace& exec, const SsdDims& dims, const SsdStepArgs<MemorySpace>& args,
                   const Tensor4<float, MemorySpace>& state, const Tensor3<float, MemorySpace>& out) {
  const SsdPlan plan = ssd_plan<ExecSpace>("kmamba::ssd_step", dims, 1);
  const SsdStepFunctor<ExecSpace, MemorySpace> functor{args.x,
                                                       args.dt,
                                                       args.A,
                                                       args.B,
                                                       args.C,
                                                       args.D,
                                                       args.z,
                                                       args.dt_bias,
                                                       state,
                                                       out,
                                                       args.D.is_allocated(),
                                                       args.z.is_allocated(),
                                                       args.dt_bias.is_allocated(),
                                                       args.dt_softplus,
                                                       plan,
                                                       plan.team_size};
  ssd_launch(exec, "kmamba::ssd::step", plan, functor.league(), functor, 0);
}

}  // namespace impl
}  // namespace kmamba

#endif
