// How the Mamba-3 scan cuts its work: the launch plan, team scratch and launchers, the forward and
// backward workspaces, and the helpers that place a team or work item in a chunk.
#ifndef KMAMBA_CORE_IMPL_MAMBA3SCANPLAN_HPP
#define KMAMBA_CORE_IMPL_MAMBA3SCANPLAN_HPP

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Math.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>
#include <kmamba/core/impl/Mamba3ScanOperands.hpp>
#include <kmamba/core/impl/TeamGemm.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace kmamba {
namespace impl {

/// How the chunk stages cut the work: `chunk` tokens (`rows` = chunk·rank rows) per chunk, `tile`
/// tokens (`tile_rows` rows) per scratch block, teams of `team_size` threads × `vector_length` lanes;
/// `packed`: the chunk stages count document starts (Mamba3Dims::packed).
struct Mamba3Plan {
  int batch, seqlen, nheads, headdim, ngroups, dstate, nangles, rank, heads_per_group;
  int chunk, nchunks, rows, tile, tile_rows, team_size, vector_length;
  bool packed;
};

template <class ExecSpace>
struct Mamba3Scratch {
  using Vec = Kokkos::View<float*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  using IntVec = Kokkos::View<int*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  // Row-major on every backend: rows are scanned and columns summed with the lanes along a row.
  using Mat =
      Kokkos::View<float**, Kokkos::LayoutRight, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;

  static constexpr int token_vectors = 8;

  /// Bytes of level-0 scratch every chunk stage fits in: `token_vectors` vectors of the chunk's
  /// tokens and one of their document counts, one of its rows, one of a tile's rows, and TeamGemm's staging.
  static std::size_t bytes(int chunk, int rank, int tile) {
    return token_vectors * Vec::shmem_size(chunk) + IntVec::shmem_size(chunk) + Vec::shmem_size(chunk * rank) +
           Vec::shmem_size(tile * rank) + TeamGemm<ExecSpace>::scratch_bytes;
  }
  /// Bytes of level-1 scratch of the blocks: two (tile rows × chunk rows) blocks, a (tile × chunk)
  /// block of token pairs and a (tile rows × max(headdim, dstate)) block.
  static std::size_t block_bytes(int chunk, int rank, int tile, int headdim, int dstate) {
    const int rows = chunk * rank, tile_rows = tile * rank;
    return 2 * Mat::shmem_size(tile_rows, rows) + Mat::shmem_size(tile, chunk) +
           Mat::shmem_size(tile_rows, std::max(headdim, dstate));
  }
};

template <class ExecSpace>
Mamba3Plan mamba3_plan(const char* function, const Mamba3Dims& dims, int chunk_size) {
  using Policy = Kokkos::TeamPolicy<ExecSpace>;
  using S = Mamba3Scratch<ExecSpace>;
  constexpr int preferred_tile_rows = 64;
  constexpr int preferred_team_size = 8;
  constexpr int max_vector_length = 32;
  Mamba3Plan plan;
  plan.batch = static_cast<int>(dims.batch);
  plan.seqlen = static_cast<int>(dims.seqlen);
  plan.nheads = static_cast<int>(dims.nheads);
  plan.headdim = static_cast<int>(dims.headdim);
  plan.ngroups = static_cast<int>(dims.ngroups);
  plan.dstate = static_cast<int>(dims.dstate);
  plan.nangles = static_cast<int>(dims.nangles);
  plan.rank = static_cast<int>(dims.rank);
  plan.heads_per_group = plan.nheads / plan.ngroups;
  plan.chunk = chunk_size;
  plan.nchunks = (plan.seqlen + plan.chunk - 1) / plan.chunk;
  plan.rows = plan.chunk * plan.rank;
  plan.packed = dims.packed;
  const std::size_t block_limit = static_cast<std::size_t>(Policy::scratch_size_max(1));
  plan.tile = std::min(std::max(1, preferred_tile_rows / plan.rank), plan.chunk);
  auto block_need = [&]() { return S::block_bytes(plan.chunk, plan.rank, plan.tile, plan.headdim, plan.dstate); };
  while (plan.tile > 1 && block_need() > block_limit) plan.tile = (plan.tile + 1) / 2;
  const std::size_t limit = static_cast<std::size_t>(Policy::scratch_size_max(0));
  const std::size_t need = S::bytes(plan.chunk, plan.rank, plan.tile);
  KMAMBA_REQUIRE(need <= limit && block_need() <= block_limit,
                 function << ": chunk_size " << plan.chunk << " with rank " << plan.rank << ", headdim " << plan.headdim
                          << " and dstate " << plan.dstate << " needs " << need << " bytes of team scratch memory and "
                          << block_need() << " of level-1 team scratch memory but " << limit << " and " << block_limit
                          << " are available; pass a smaller chunk_size");
  plan.tile_rows = plan.tile * plan.rank;
  if (TeamGemm<ExecSpace>::team_threads > 0) {
    plan.vector_length = std::min(max_vector_length, static_cast<int>(Policy::vector_length_max()));
    plan.team_size = std::max(1, TeamGemm<ExecSpace>::team_threads / plan.vector_length);
  } else {
    int vector_length = 1;
    const int widest = std::max(plan.rows, std::max(plan.headdim, plan.dstate));
    while (vector_length < widest && vector_length < max_vector_length) vector_length *= 2;
    plan.vector_length = std::min(vector_length, static_cast<int>(Policy::vector_length_max()));
    plan.team_size = preferred_team_size;
  }
  return plan;
}

/// A TeamPolicy launch of the plan's team shape (fewer threads where the functor cannot have that
/// many) with TeamGemm's launch bounds, `scratch` bytes of level-0 and `block_scratch` bytes of
/// level-1 team scratch.
template <class ExecSpace, class Functor>
void mamba3_launch(const ExecSpace& exec, const char* label, const Mamba3Plan& plan, int league, const Functor& functor,
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

/// A flat launch of `items` work items.
template <class ExecSpace, class Functor>
void mamba3_for(const ExecSpace& exec, const char* label, std::int64_t items, const Functor& functor) {
  if (items == 0) return;
  Kokkos::parallel_for(
      label, light_weight(Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, items)), functor);
}

/// Buffers the forward stages hand to each other (recomputed by the backward).
template <class MemorySpace>
struct Mamba3Workspace {
  /// (batch, nheads, seqlen, 2·nangles): cos θ_t,i at 2i and sin θ_t,i at 2i + 1 (θ_t reduced into
  /// [0, 2π)), taken once per token, head and angle for every stage that rotates
  Tensor4<float, MemorySpace> rotation;
  Tensor3<float, MemorySpace> cs;     // (batch, nheads, seqlen): inclusive cumsum of adt within the chunk
  Tensor3<float, MemorySpace> scale;  // (batch, nheads, seqlen): γ_t + β̃_{t+1}
  Tensor3<float, MemorySpace> gamma;  // (batch, nheads, seqlen): γ_t
  /// (batch, seqlen·rank, nheads, dstate): rotated, biased; unallocated where the SSD's fused
  /// forward forms them itself (impl/Mamba3SisoSsd.hpp)
  Tensor4<float, MemorySpace> q, k;
  /// With the chunk stages (the SISO scan on the SSD reads v itself and has no chunk states):
  Tensor4<float, MemorySpace> v;       // (batch, seqlen·rank, nheads, headdim): projected
  Tensor5<float, MemorySpace> states;  // (batch, nchunks, nheads, headdim, dstate): local, then entering Ĥ
  /// (batch, nheads, nchunks, nangles): the chunk's sum of angle increments, then θ entering the
  /// chunk (the backward reuses it for the sums of ∂/∂θ and the gradient entering from the right)
  Tensor4<float, MemorySpace> angle_sum;
  Tensor4<float, MemorySpace> angle_turns;  // (batch, nheads, nchunks, nangles): turns taken out before the chunk
  /// (batch, seqlen), with the chunk stages of packed rows: the document starts from the first token
  /// of the token's chunk up to the token (the SSD's run counts, impl/SsdImpl.hpp)
  Tensor2<int, MemorySpace> run;

  Mamba3Workspace(const Mamba3Plan& plan, bool chunk_stages, bool rows = true)
      : rotation(allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::mamba3::rotation", plan.batch,
                                                                     plan.nheads, plan.seqlen, 2 * plan.nangles)),
        cs(allocate_uninitialized<Tensor3<float, MemorySpace>>("kmamba::mamba3::adt_cumsum", plan.batch, plan.nheads,
                                                               plan.seqlen)),
        scale(allocate_uninitialized<Tensor3<float, MemorySpace>>("kmamba::mamba3::scale", plan.batch, plan.nheads,
                                                                  plan.seqlen)),
        gamma(allocate_uninitialized<Tensor3<float, MemorySpace>>("kmamba::mamba3::gamma", plan.batch, plan.nheads,
                                                                  plan.seqlen)),
        angle_sum(allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::mamba3::angle_chunk_sum", plan.batch,
                                                                      plan.nheads, plan.nchunks, plan.nangles)),
        angle_turns(allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::mamba3::angle_turns", plan.batch,
                                                                        plan.nheads, plan.nchunks, plan.nangles)) {
    if (rows) {
      q = allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::mamba3::q_rotated", plan.batch,
                                                              plan.seqlen * plan.rank, plan.nheads, plan.dstate);
      k = allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::mamba3::k_rotated", plan.batch,
                                                              plan.seqlen * plan.rank, plan.nheads, plan.dstate);
    }
    if (chunk_stages) {
      v = allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::mamba3::v_projected", plan.batch,
                                                              plan.seqlen * plan.rank, plan.nheads, plan.headdim);
      states = allocate_uninitialized<Tensor5<float, MemorySpace>>("kmamba::mamba3::states", plan.batch, plan.nchunks,
                                                                   plan.nheads, plan.headdim, plan.dstate);
      if (plan.packed) {
        run = allocate_uninitialized<Tensor2<int, MemorySpace>>("kmamba::mamba3::run", plan.batch, plan.seqlen);
      }
    }
  }

  /// The document starts counted in `run`; 0 without packed rows.
  KOKKOS_INLINE_FUNCTION int runs(int b, int t) const { return run.is_allocated() ? run(b, t) : 0; }
};

/// Buffers of the backward stages.
template <class MemorySpace>
struct Mamba3BackwardWorkspace {
  Tensor4<float, MemorySpace> y;       // (batch, seqlen·rank, nheads, headdim): y_t,r before the gate (keep_rows)
  Tensor4<float, MemorySpace> g;       // (batch, seqlen·rank, nheads, headdim): ∂/∂y_t,r
  Tensor4<float, MemorySpace> dv;      // (batch, seqlen·rank, nheads, headdim): ∂/∂v_t,r
  Tensor4<float, MemorySpace> dq, dk;  // (batch, seqlen·rank, nheads, dstate): ∂/∂ rotated, then biased q, k
  /// (batch, nchunks, nheads, headdim, dstate), with chunk_states: ∂/∂ the state entering, then
  /// leaving, each chunk
  Tensor5<float, MemorySpace> dstates;
  Tensor4<float, MemorySpace> dH0;      // (batch, nheads, headdim, dstate): ∂/∂Ĥ_{−1}
  Tensor3<float, MemorySpace> off;      // (batch, nheads, seqlen): ∂/∂scale_t
  Tensor3<float, MemorySpace> diag;     // (batch, nheads, seqlen): ∂/∂γ_t through the token's own term
  Tensor2<float, MemorySpace> dbeta0;   // (batch, nheads): ∂/∂β̃_0 through the initial k, v
  Tensor4<float, MemorySpace> dtheta;   // (batch, nheads, seqlen, nangles): ∂/∂θ_t, then G·π·tanh(φ)
  Tensor3<float, MemorySpace> partial;  // (batch, nchunks, nheads): the chunk's share of dD
  Tensor4<float, MemorySpace> dq_bias_partial, dk_bias_partial;  // (batch, nchunks, nheads, rank·dstate)

  Mamba3BackwardWorkspace(const Mamba3Plan& plan, bool keep_rows, bool chunk_states) {
    const int rows = plan.seqlen * plan.rank;
    using T4 = Tensor4<float, MemorySpace>;
    if (keep_rows) y = allocate_uninitialized<T4>("kmamba::mamba3::y", plan.batch, rows, plan.nheads, plan.headdim);
    g = allocate_uninitialized<T4>("kmamba::mamba3::dy", plan.batch, rows, plan.nheads, plan.headdim);
    dv = allocate_uninitialized<T4>("kmamba::mamba3::dv_projected", plan.batch, rows, plan.nheads, plan.headdim);
    dq = allocate_uninitialized<T4>("kmamba::mamba3::dq_rows", plan.batch, rows, plan.nheads, plan.dstate);
    dk = allocate_uninitialized<T4>("kmamba::mamba3::dk_rows", plan.batch, rows, plan.nheads, plan.dstate);
    if (chunk_states) {
      dstates = allocate_uninitialized<Tensor5<float, MemorySpace>>("kmamba::mamba3::dstates", plan.batch, plan.nchunks,
                                                                    plan.nheads, plan.headdim, plan.dstate);
    }
    dH0 = allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::mamba3::dinitial_ssm_effective", plan.batch,
                                                              plan.nheads, plan.headdim, plan.dstate);
    off = allocate_uninitialized<Tensor3<float, MemorySpace>>("kmamba::mamba3::dscale", plan.batch, plan.nheads,
                                                              plan.seqlen);
    diag = allocate_uninitialized<Tensor3<float, MemorySpace>>("kmamba::mamba3::dgamma_diagonal", plan.batch,
                                                               plan.nheads, plan.seqlen);
    dbeta0 = allocate_uninitialized<Tensor2<float, MemorySpace>>("kmamba::mamba3::dbeta0", plan.batch, plan.nheads);
    dtheta = allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::mamba3::dtheta", plan.batch, plan.nheads,
                                                                 plan.seqlen, plan.nangles);
    partial = allocate_uninitialized<Tensor3<float, MemorySpace>>("kmamba::mamba3::partial_dD", plan.batch,
                                                                  plan.nchunks, plan.nheads);
    dq_bias_partial = allocate_uninitialized<Tensor4<float, MemorySpace>>(
        "kmamba::mamba3::partial_dq_bias", plan.batch, plan.nchunks, plan.nheads, plan.rank * plan.dstate);
    dk_bias_partial = allocate_uninitialized<Tensor4<float, MemorySpace>>(
        "kmamba::mamba3::partial_dk_bias", plan.batch, plan.nchunks, plan.nheads, plan.rank * plan.dstate);
  }
};

/// Where a (batch, chunk, head) team works.
struct Mamba3ChunkBlock {
  int b, c, h, t0, len, row0, rows;
};

KOKKOS_INLINE_FUNCTION Mamba3ChunkBlock mamba3_chunk_block(const Mamba3Plan& plan, int league_rank) {
  Mamba3ChunkBlock blk;
  blk.h = league_rank % plan.nheads;
  blk.c = (league_rank / plan.nheads) % plan.nchunks;
  blk.b = league_rank / (plan.nheads * plan.nchunks);
  blk.t0 = blk.c * plan.chunk;
  blk.len = plan.seqlen - blk.t0 < plan.chunk ? plan.seqlen - blk.t0 : plan.chunk;
  blk.row0 = blk.t0 * plan.rank;
  blk.rows = blk.len * plan.rank;
  return blk;
}

/// The number of tokens of chunk c.
KOKKOS_INLINE_FUNCTION int mamba3_chunk_length(const Mamba3Plan& plan, int c) {
  return plan.seqlen - c * plan.chunk < plan.chunk ? plan.seqlen - c * plan.chunk : plan.chunk;
}

/// The decay exp(cs_t − cs_s) from token s to token t ≥ s of a chunk (scratch: the cumulative adt
/// and the document counts); 0 where a document starts in (s, t], as the state does not pass it.
template <class Vec, class IntVec>
KOKKOS_INLINE_FUNCTION float mamba3_decay(const Vec& scs, const IntVec& srun, int s, int t) {
  return srun(s) == srun(t) ? kmamba::math::exp(scs(t) - scs(s)) : 0.0f;
}

/// The decay exp(cs_t) of the state entering a chunk to its token t; 0 from the chunk's first
/// document start on.
template <class Vec, class IntVec>
KOKKOS_INLINE_FUNCTION float mamba3_entering_decay(const Vec& scs, const IntVec& srun, int t) {
  return srun(t) == 0 ? kmamba::math::exp(scs(t)) : 0.0f;
}

/// The weight of source token s in the output of token t ≥ s within a chunk: γ_s on the token
/// itself, scale_s·exp(cs_t − cs_s) before it (0 across a document start), 0 after it.
template <class Vec, class IntVec>
KOKKOS_INLINE_FUNCTION float mamba3_pair_weight(const Vec& scs, const Vec& sscale, const Vec& sgamma,
                                                const IntVec& srun, int t, int s) {
  if (s > t) return 0.0f;
  if (s == t) return sgamma(s);
  return sscale(s) * mamba3_decay(scs, srun, s, t);
}

/// Stages the chunk's cumulative adt, scales, γ and document counts in scratch.
template <class Member, class MemorySpace, class Vec, class IntVec>
KOKKOS_INLINE_FUNCTION void mamba3_stage_tokens(const Member& team, const Mamba3Workspace<MemorySpace>& ws,
                                                const Mamba3ChunkBlock& blk, const Vec& scs, const Vec& sscale,
                                                const Vec& sgamma, const IntVec& srun) {
  Kokkos::parallel_for(Kokkos::TeamVectorRange(team, blk.len), [&](const int l) {
    scs(l) = ws.cs(blk.b, blk.h, blk.t0 + l);
    sscale(l) = ws.scale(blk.b, blk.h, blk.t0 + l);
    sgamma(l) = ws.gamma(blk.b, blk.h, blk.t0 + l);
    srun(l) = ws.runs(blk.b, blk.t0 + l);
  });
}

/// Where a (batch, head, chunk, job) work item works (job fastest).
struct Mamba3ChunkItem {
  int b, h, c, job;
};

KOKKOS_INLINE_FUNCTION Mamba3ChunkItem mamba3_chunk_item(const Mamba3Plan& plan, std::int64_t item, int jobs) {
  Mamba3ChunkItem it;
  it.job = static_cast<int>(item % jobs);
  const std::int64_t rest = item / jobs;
  it.c = static_cast<int>(rest % plan.nchunks);
  const int bh = static_cast<int>(rest / plan.nchunks);
  it.h = bh % plan.nheads;
  it.b = bh / plan.nheads;
  return it;
}

/// Where a (batch, head, p, n) work item of the passing of states works.
struct Mamba3StateItem {
  int b, h, p, n;
};

KOKKOS_INLINE_FUNCTION Mamba3StateItem mamba3_state_item(const Mamba3Plan& plan, std::int64_t item) {
  const std::int64_t per_head = static_cast<std::int64_t>(plan.headdim) * plan.dstate;
  const int pn = static_cast<int>(item % per_head);
  const int bh = static_cast<int>(item / per_head);
  return Mamba3StateItem{bh / plan.nheads, bh % plan.nheads, pn / plan.dstate, pn % plan.dstate};
}

/// The number of (batch, head, p, n) work items.
inline std::int64_t mamba3_state_items(const Mamba3Plan& plan) {
  return static_cast<std::int64_t>(plan.batch) * plan.nheads * plan.headdim * plan.dstate;
}

/// The decay of the state across chunk c: exp(cs at the chunk's last token), 0 where a document
/// starts in the chunk.
template <class MemorySpace>
KOKKOS_INLINE_FUNCTION float mamba3_chunk_decay(const Mamba3Plan& plan, const Mamba3Workspace<MemorySpace>& ws, int b,
                                                int h, int c) {
  const int last = c * plan.chunk + mamba3_chunk_length(plan, c) - 1;
  return ws.runs(b, last) == 0 ? kmamba::math::exp(ws.cs(b, h, last)) : 0.0f;
}

}  // namespace impl
}  // namespace kmamba

#endif
