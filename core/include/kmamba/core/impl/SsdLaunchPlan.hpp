// How the staged SSD cuts its work: team scratch, the launch plan (ssd_plan) and team launch, the
// staging of a chunk's per-token vectors, and the decay and work items of the passing of states.
#ifndef KMAMBA_CORE_IMPL_SSDLAUNCHPLAN_HPP
#define KMAMBA_CORE_IMPL_SSDLAUNCHPLAN_HPP

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Math.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>
#include <kmamba/core/impl/SsdOperands.hpp>
#include <kmamba/core/impl/TeamGemm.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace kmamba {
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

}  // namespace impl
}  // namespace kmamba

#endif
