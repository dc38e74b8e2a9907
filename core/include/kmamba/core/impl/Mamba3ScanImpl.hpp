// Internals of kmamba/core/Mamba3Scan.hpp: the operands of both variants behind one interface, the
// launch plan, the workspaces and one functor per stage of the chunked scan
// (docs/algorithms.md §3.4, §3.5), its backward and the decode step (docs/algorithms.md §3.7).
//
// SISO is MIMO with rank 1 and unit rank projections; every stage is written once for rank R. The
// SISO scan runs its chunk products on the SSD (impl/Mamba3SisoSsd.hpp) with the stages before
// them (angles, scales, rotated rows) and after them (the tail of the backward) taken from here.
// Per (batch, head) the tokens × ranks form "rows" (row = t·R + r); the rotate stage writes the
// rotated, biased q and k and the projected v as rows of per-head workspaces, so that the chunk
// stages read plain (rows × dstate) and (rows × headdim) blocks.
//
// Work decomposition (as the SSD, kmamba/core/impl/SsdImpl.hpp): the chunk stages are TeamPolicy
// launches with one team per (batch, chunk, head), of TeamGemm's preferred shape (256 threads on
// Cuda) with its launch bounds and staging scratch; a team keeps its chunk's per-token vectors in
// level-0 scratch and its (tile rows × chunk rows) blocks of intra-chunk weights in level-1
// scratch, a tile of tokens at a time. Every per-chunk product goes through TeamGemm
// (impl/TeamGemm.hpp). Everything else is a flat launch of one work item per element (rotations,
// gates, group and bias sums, passing of states: one item per (batch, head, p, n) walking the
// chunks) or per (batch, head, chunk, angle) (the angle scans, split in three: chunk sums, a walk
// over the chunks, the scan within each chunk), so that no thread walks the whole sequence. Sums
// over batch, seqlen or heads are taken in a fixed order (no atomics).
#ifndef KMAMBA_CORE_IMPL_MAMBA3SCANIMPL_HPP
#define KMAMBA_CORE_IMPL_MAMBA3SCANIMPL_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/impl/ChunkStateWalk.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/TeamGemm.hpp>
#include <kmamba/core/Math.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace kmamba {
namespace impl {

// Keeps a parameter out of template argument deduction (so that a Tensor4<float> converts to the
// ConstTensor4<float> a public op takes).
template <class T>
struct Mamba3Identity {
  using type = T;
};
template <class T>
using Mamba3NonDeduced = typename Mamba3Identity<T>::type;

constexpr float mamba3_pi = 3.14159265358979323846f;
constexpr float mamba3_two_pi = 6.28318530717958647692f;

struct Mamba3Dims {
  std::int64_t batch = 0, seqlen = 0, nheads = 0, headdim = 0, ngroups = 1, dstate = 0, nangles = 0, rank = 1;
  bool mimo = false;
};

/// A required input is given when it is allocated or has a zero extent (a sequence of length 0, no
/// angles): only a default-constructed View counts as missing.
template <class View>
bool mamba3_given(const View& view) {
  if (view.is_allocated()) return true;
  for (unsigned i = 0; i < View::rank; ++i) {
    if (view.extent(i) != 0) return true;
  }
  return false;
}

template <class... Views>
bool mamba3_all_given(const Views&... views) {
  return (mamba3_given(views) && ...);
}

/// The MIMO chunk size: `chunk_size`, or the reference's 64 / rank when 0.
inline int mamba3_mimo_chunk_size(int chunk_size, std::int64_t rank) {
  if (chunk_size > 0) return chunk_size;
  return rank >= 64 ? 1 : static_cast<int>(64 / std::max<std::int64_t>(rank, 1));
}

/// A set of states of either variant: SISO k, v have no rank axis (k3, v3), MIMO ones do (k4, v4).
/// T is float (states written) or const float (states read). The has_* flags say which are present.
template <class T, class MemorySpace>
struct Mamba3StateViews {
  Tensor3<T, MemorySpace> angle;  // (batch, nheads, nangles)
  Tensor4<T, MemorySpace> ssm;    // (batch, nheads, headdim, dstate)
  Tensor3<T, MemorySpace> k3;     // SISO: (batch, nheads, dstate)
  Tensor3<T, MemorySpace> v3;     // SISO: (batch, nheads, headdim)
  Tensor4<T, MemorySpace> k4;     // MIMO: (batch, nheads, rank, dstate)
  Tensor4<T, MemorySpace> v4;     // MIMO: (batch, nheads, rank, headdim)
  bool mimo = false, has_angle = false, has_ssm = false, has_k = false, has_v = false;

  void set_flags(bool is_mimo) {
    mimo = is_mimo;
    has_angle = angle.is_allocated();
    has_ssm = ssm.is_allocated();
    has_k = mimo ? k4.is_allocated() : k3.is_allocated();
    has_v = mimo ? v4.is_allocated() : v3.is_allocated();
  }
  KOKKOS_INLINE_FUNCTION T& k(int b, int h, int r, int n) const { return mimo ? k4(b, h, r, n) : k3(b, h, n); }
  KOKKOS_INLINE_FUNCTION T& v(int b, int h, int r, int p) const { return mimo ? v4(b, h, r, p) : v3(b, h, p); }
  KOKKOS_INLINE_FUNCTION float angle_or_zero(int b, int h, int i) const { return has_angle ? angle(b, h, i) : 0.0f; }
  KOKKOS_INLINE_FUNCTION float ssm_or_zero(int b, int h, int p, int n) const {
    return has_ssm ? ssm(b, h, p, n) : 0.0f;
  }
  KOKKOS_INLINE_FUNCTION float k_or_zero(int b, int h, int r, int n) const { return has_k ? k(b, h, r, n) : 0.0f; }
  KOKKOS_INLINE_FUNCTION float v_or_zero(int b, int h, int r, int p) const { return has_v ? v(b, h, r, p) : 0.0f; }
};

/// The inputs of either variant as the kernels read them (SISO: q4, k4, q_bias2, k_bias2 and unit
/// projections; MIMO: q5, k5, q_bias3, k_bias3, mimo_*).
template <class MemorySpace>
struct Mamba3Operands {
  ConstTensor4<float, MemorySpace> q4, k4;                  // SISO: (batch, seqlen, ngroups, dstate)
  ConstTensor5<float, MemorySpace> q5, k5;                  // MIMO: (batch, seqlen, rank, ngroups, dstate)
  ConstTensor4<float, MemorySpace> v;                       // (batch, seqlen, nheads, headdim)
  ConstTensor3<float, MemorySpace> adt, dt, trap;           // (batch, nheads, seqlen)
  ConstTensor2<float, MemorySpace> q_bias2, k_bias2;        // SISO: (nheads, dstate)
  ConstTensor3<float, MemorySpace> q_bias3, k_bias3;        // MIMO: (nheads, rank, dstate)
  ConstTensor4<float, MemorySpace> angles;                  // (batch, seqlen, nheads, nangles)
  ConstTensor3<float, MemorySpace> mimo_v, mimo_z, mimo_o;  // MIMO: (nheads, rank, headdim)
  ConstTensor1<float, MemorySpace> D;                       // (nheads)
  ConstTensor4<float, MemorySpace> z;                       // (batch, seqlen, nheads, headdim)
  /// SISO with z, optional (batch, seqlen, nheads, headdim): the output before the gate, written by
  /// the forward and read by the backward (Mamba3SisoArgs::ungated_out)
  Tensor4<float, MemorySpace> ungated;
  Mamba3StateViews<const float, MemorySpace> initial;
  /// SISO keeps its angles reduced into [0, 2π); MIMO reports the plain sum.
  bool mimo = false, wrap_angle = true, has_D = false, has_z = false;

  KOKKOS_INLINE_FUNCTION float q_in(int b, int t, int r, int g, int n) const {
    return mimo ? q5(b, t, r, g, n) : q4(b, t, g, n);
  }
  KOKKOS_INLINE_FUNCTION float k_in(int b, int t, int r, int g, int n) const {
    return mimo ? k5(b, t, r, g, n) : k4(b, t, g, n);
  }
  KOKKOS_INLINE_FUNCTION float q_bias(int h, int r, int n) const { return mimo ? q_bias3(h, r, n) : q_bias2(h, n); }
  KOKKOS_INLINE_FUNCTION float k_bias(int h, int r, int n) const { return mimo ? k_bias3(h, r, n) : k_bias2(h, n); }
  KOKKOS_INLINE_FUNCTION float v_proj(int h, int r, int p) const { return mimo ? mimo_v(h, r, p) : 1.0f; }
  KOKKOS_INLINE_FUNCTION float z_proj(int h, int r, int p) const { return mimo ? mimo_z(h, r, p) : 1.0f; }
  KOKKOS_INLINE_FUNCTION float o_proj(int h, int r, int p) const { return mimo ? mimo_o(h, r, p) : 1.0f; }
  KOKKOS_INLINE_FUNCTION float skip(int h) const { return has_D ? D(h) : 0.0f; }
  /// β̃_t = (1 − σ(trap_t))·dt_t, written σ(−trap_t)·dt_t.
  KOKKOS_INLINE_FUNCTION float beta_tilde(int b, int h, int t) const { return sigmoid(-trap(b, h, t)) * dt(b, h, t); }
};

/// The gradients of either variant (SISO: dq4, dk4, dq_bias2, dk_bias2; MIMO: dq5, dk5, dq_bias3,
/// dk_bias3, dmimo_*). Optional ones are unallocated when not wanted.
template <class MemorySpace>
struct Mamba3GradViews {
  Tensor4<float, MemorySpace> dq4, dk4;                   // SISO: (batch, seqlen, ngroups, dstate)
  Tensor5<float, MemorySpace> dq5, dk5;                   // MIMO: (batch, seqlen, rank, ngroups, dstate)
  Tensor2<float, MemorySpace> dq_bias2, dk_bias2;         // SISO: (nheads, dstate)
  Tensor3<float, MemorySpace> dq_bias3, dk_bias3;         // MIMO: (nheads, rank, dstate)
  Tensor4<float, MemorySpace> dv;                         // (batch, seqlen, nheads, headdim)
  Tensor3<float, MemorySpace> dadt, ddt, dtrap;           // (batch, nheads, seqlen)
  Tensor4<float, MemorySpace> dangles;                    // (batch, seqlen, nheads, nangles)
  Tensor3<float, MemorySpace> dmimo_v, dmimo_z, dmimo_o;  // MIMO: (nheads, rank, headdim)
  Tensor1<float, MemorySpace> dD;                         // (nheads)
  Tensor4<float, MemorySpace> dz;                         // (batch, seqlen, nheads, headdim)
  Mamba3StateViews<float, MemorySpace> dinitial;
  bool mimo = false;

  KOKKOS_INLINE_FUNCTION float& dq(int b, int t, int r, int g, int n) const {
    return mimo ? dq5(b, t, r, g, n) : dq4(b, t, g, n);
  }
  KOKKOS_INLINE_FUNCTION float& dk(int b, int t, int r, int g, int n) const {
    return mimo ? dk5(b, t, r, g, n) : dk4(b, t, g, n);
  }
  KOKKOS_INLINE_FUNCTION float& dq_bias(int h, int r, int n) const { return mimo ? dq_bias3(h, r, n) : dq_bias2(h, n); }
  KOKKOS_INLINE_FUNCTION float& dk_bias(int h, int r, int n) const { return mimo ? dk_bias3(h, r, n) : dk_bias2(h, n); }
};

/// The inputs of a decode step of either variant.
template <class MemorySpace>
struct Mamba3StepOperands {
  ConstTensor3<float, MemorySpace> q3, k3;                  // SISO: (batch, ngroups, dstate)
  ConstTensor4<float, MemorySpace> q4, k4;                  // MIMO: (batch, rank, ngroups, dstate)
  ConstTensor3<float, MemorySpace> v;                       // (batch, nheads, headdim)
  ConstTensor2<float, MemorySpace> adt, dt, trap;           // (batch, nheads)
  ConstTensor2<float, MemorySpace> q_bias2, k_bias2;        // SISO: (nheads, dstate)
  ConstTensor3<float, MemorySpace> q_bias3, k_bias3;        // MIMO: (nheads, rank, dstate)
  ConstTensor3<float, MemorySpace> angles;                  // (batch, nheads, nangles)
  ConstTensor3<float, MemorySpace> mimo_v, mimo_z, mimo_o;  // MIMO: (nheads, rank, headdim)
  ConstTensor1<float, MemorySpace> D;                       // (nheads)
  ConstTensor3<float, MemorySpace> z;                       // (batch, nheads, headdim)
  bool mimo = false, wrap_angle = true, has_D = false, has_z = false;

  template <class StepArgs>
  void set_common(const StepArgs& args) {
    v = args.v;
    adt = args.adt;
    dt = args.dt;
    trap = args.trap;
    angles = args.angles;
    D = args.D;
    z = args.z;
    has_D = args.D.is_allocated();
    has_z = args.z.is_allocated();
  }
  KOKKOS_INLINE_FUNCTION float q_in(int b, int r, int g, int n) const { return mimo ? q4(b, r, g, n) : q3(b, g, n); }
  KOKKOS_INLINE_FUNCTION float k_in(int b, int r, int g, int n) const { return mimo ? k4(b, r, g, n) : k3(b, g, n); }
  KOKKOS_INLINE_FUNCTION float q_bias(int h, int r, int n) const { return mimo ? q_bias3(h, r, n) : q_bias2(h, n); }
  KOKKOS_INLINE_FUNCTION float k_bias(int h, int r, int n) const { return mimo ? k_bias3(h, r, n) : k_bias2(h, n); }
  KOKKOS_INLINE_FUNCTION float v_proj(int h, int r, int p) const { return mimo ? mimo_v(h, r, p) : 1.0f; }
  KOKKOS_INLINE_FUNCTION float z_proj(int h, int r, int p) const { return mimo ? mimo_z(h, r, p) : 1.0f; }
  KOKKOS_INLINE_FUNCTION float o_proj(int h, int r, int p) const { return mimo ? mimo_o(h, r, p) : 1.0f; }
};

/// How the chunk stages cut the work: `chunk` tokens (`rows` = chunk·rank rows) per chunk, `tile`
/// tokens (`tile_rows` rows) per scratch block, teams of `team_size` threads × `vector_length` lanes.
struct Mamba3Plan {
  int batch, seqlen, nheads, headdim, ngroups, dstate, nangles, rank, heads_per_group;
  int chunk, nchunks, rows, tile, tile_rows, team_size, vector_length;
};

template <class ExecSpace>
struct Mamba3Scratch {
  using Vec = Kokkos::View<float*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  // Row-major on every backend: rows are scanned and columns summed with the lanes along a row.
  using Mat =
      Kokkos::View<float**, Kokkos::LayoutRight, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;

  static constexpr int token_vectors = 8;

  /// Bytes of level-0 scratch every chunk stage fits in: `token_vectors` vectors of the chunk's
  /// tokens, one of its rows, one of a tile's rows, and TeamGemm's staging.
  static std::size_t bytes(int chunk, int rank, int tile) {
    return token_vectors * Vec::shmem_size(chunk) + Vec::shmem_size(chunk * rank) + Vec::shmem_size(tile * rank) +
           TeamGemm<ExecSpace>::scratch_bytes;
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
  Tensor4<float, MemorySpace> theta;  // (batch, nheads, seqlen, nangles): θ_t reduced into [0, 2π)
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

  Mamba3Workspace(const Mamba3Plan& plan, bool chunk_stages, bool rows = true)
      : theta(allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::mamba3::theta", plan.batch, plan.nheads,
                                                                  plan.seqlen, plan.nangles)),
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
    }
  }
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

/// The weight of source token s in the output of token t ≥ s within a chunk: γ_s on the token
/// itself, scale_s·exp(cs_t − cs_s) before it, 0 after it.
template <class Vec>
KOKKOS_INLINE_FUNCTION float mamba3_pair_weight(const Vec& scs, const Vec& sscale, const Vec& sgamma, int t, int s) {
  if (s > t) return 0.0f;
  if (s == t) return sgamma(s);
  return sscale(s) * kmamba::math::exp(scs(t) - scs(s));
}

/// Stages the chunk's cumulative adt, scales and γ in scratch.
template <class Member, class MemorySpace, class Vec>
KOKKOS_INLINE_FUNCTION void mamba3_stage_tokens(const Member& team, const Mamba3Workspace<MemorySpace>& ws,
                                                const Mamba3ChunkBlock& blk, const Vec& scs, const Vec& sscale,
                                                const Vec& sgamma) {
  Kokkos::parallel_for(Kokkos::TeamVectorRange(team, blk.len), [&](const int l) {
    scs(l) = ws.cs(blk.b, blk.h, blk.t0 + l);
    sscale(l) = ws.scale(blk.b, blk.h, blk.t0 + l);
    sgamma(l) = ws.gamma(blk.b, blk.h, blk.t0 + l);
  });
}

/// The increment of angle i at token t: π·tanh(angles)·dt.
template <class MemorySpace>
KOKKOS_INLINE_FUNCTION float mamba3_angle_step(const Mamba3Operands<MemorySpace>& in, int b, int t, int h, int i) {
  return mamba3_pi * kmamba::math::tanh(in.angles(b, t, h, i)) * in.dt(b, h, t);
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

/// Stage 1a (per chunk, one item per (batch, head, chunk, job)): job i < nangles sums the chunk's
/// increments of angle i; job nangles writes the chunk cumsum of adt, γ and scale of its tokens.
template <class MemorySpace>
struct Mamba3ChunkTokensFunctor {
  Mamba3Operands<MemorySpace> in;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3Plan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const Mamba3ChunkItem it = mamba3_chunk_item(plan, item, plan.nangles + 1);
    const int b = it.b, h = it.h, t0 = it.c * plan.chunk, len = mamba3_chunk_length(plan, it.c);
    if (it.job < plan.nangles) {
      float sum = 0.0f;
      for (int l = 0; l < len; ++l) sum += mamba3_angle_step(in, b, t0 + l, h, it.job);
      ws.angle_sum(b, h, it.c, it.job) = sum;
    } else {
      float cs = 0.0f;
      for (int l = 0; l < len; ++l) {
        const int t = t0 + l;
        const float gamma = sigmoid(in.trap(b, h, t)) * in.dt(b, h, t);
        const float next = t + 1 < plan.seqlen ? in.beta_tilde(b, h, t + 1) : 0.0f;
        cs += in.adt(b, h, t);
        ws.cs(b, h, t) = cs;
        ws.gamma(b, h, t) = gamma;
        ws.scale(b, h, t) = gamma + next;
      }
    }
  }
};

/// Stage 1b (one item per (batch, head, angle)): walks the chunks, replacing each chunk's sum of
/// increments by the angle entering it (reduced into [0, 2π) after every chunk; the turns taken
/// out before the chunk are kept for the MIMO final angle).
template <class MemorySpace>
struct Mamba3AnglePassingFunctor {
  Mamba3Operands<MemorySpace> in;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3Plan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int i = static_cast<int>(item % plan.nangles);
    const int bh = static_cast<int>(item / plan.nangles);
    const int h = bh % plan.nheads, b = bh / plan.nheads;
    float theta = in.initial.angle_or_zero(b, h, i);
    float turns = 0.0f;
    for (int c = 0; c < plan.nchunks; ++c) {
      const float total = ws.angle_sum(b, h, c, i);
      ws.angle_sum(b, h, c, i) = theta;
      ws.angle_turns(b, h, c, i) = turns;
      theta += total;
      const float wraps = kmamba::math::floor(theta / mamba3_two_pi);
      theta -= mamba3_two_pi * wraps;
      turns += wraps;
    }
  }
};

/// Stage 1c (one item per (batch, head, chunk, angle)): θ_t from the angle entering the chunk,
/// reduced into [0, 2π) at every token; the final angle at the last token.
template <class MemorySpace>
struct Mamba3AngleScanFunctor {
  Mamba3Operands<MemorySpace> in;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3Plan plan;
  Tensor3<float, MemorySpace> final_angle;  // (batch, nheads, nangles)
  bool write_final_angle;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const Mamba3ChunkItem it = mamba3_chunk_item(plan, item, plan.nangles);
    const int b = it.b, h = it.h, i = it.job, t0 = it.c * plan.chunk, len = mamba3_chunk_length(plan, it.c);
    float theta = ws.angle_sum(b, h, it.c, i);
    float turns = ws.angle_turns(b, h, it.c, i);
    for (int l = 0; l < len; ++l) {
      theta += mamba3_angle_step(in, b, t0 + l, h, i);
      const float wraps = kmamba::math::floor(theta / mamba3_two_pi);
      theta -= mamba3_two_pi * wraps;
      turns += wraps;
      ws.theta(b, h, t0 + l, i) = theta;
    }
    if (write_final_angle && it.c == plan.nchunks - 1) {
      final_angle(b, h, i) = in.wrap_angle ? theta : theta + mamba3_two_pi * turns;
    }
  }
};

/// Row kernels: a team thread per (batch, row, head) row (head fastest), its vector lanes over the
/// row's channels or states (contiguous, so that a warp's accesses coalesce on GPUs), its sums
/// lane reductions; the row's indices are worked out once per row, not per element.
constexpr int mamba3_rows_per_team = 8;

struct Mamba3Row {
  int b, row, h;
};

template <class ExecSpace, class Functor>
void mamba3_row_launch(const ExecSpace& exec, const char* label, std::int64_t rows, const Functor& functor) {
  using Policy = Kokkos::TeamPolicy<ExecSpace>;
  const int lanes = std::min(32, static_cast<int>(Policy::vector_length_max()));
  const int team = vector_lanes_are_threads<ExecSpace> ? mamba3_rows_per_team : 1;
  const std::int64_t league = (rows + team - 1) / team;
  if (league == 0) return;
  Kokkos::parallel_for(label, Policy(exec, static_cast<int>(league), team, lanes), functor);
}

/// The row of the calling team thread among `rows_per_batch`·nheads rows per batch; false past the
/// last row.
template <class Member>
KOKKOS_INLINE_FUNCTION bool mamba3_row(const Member& team, const Mamba3Plan& plan, int rows_per_batch, Mamba3Row& row) {
  const std::int64_t item = static_cast<std::int64_t>(team.league_rank()) * team.team_size() + team.team_rank();
  const std::int64_t per_batch = static_cast<std::int64_t>(rows_per_batch) * plan.nheads;
  if (item >= per_batch * plan.batch) return false;
  const std::int64_t rest = item % per_batch;
  row = Mamba3Row{static_cast<int>(item / per_batch), static_cast<int>(rest / plan.nheads),
                  static_cast<int>(rest % plan.nheads)};
  return true;
}

/// The per-token values of the SISO scan as the SSD and its own-token correction read them
/// (impl/Mamba3SisoSsd.hpp); unallocated for MIMO.
template <class MemorySpace>
struct Mamba3SisoTokens {
  Tensor3<float, MemorySpace> scale;      // (batch, seqlen, nheads): scale_t, the SSD's δ
  Tensor3<float, MemorySpace> log_decay;  // (batch, seqlen, nheads): adt_t
  Tensor3<float, MemorySpace> qk;         // (batch, seqlen, nheads): q_t·k_t
  Tensor3<float, MemorySpace> diag;       // (batch, seqlen, nheads): c_t = D + (γ_t − scale_t)·q_t·k_t

  Mamba3SisoTokens() = default;
  explicit Mamba3SisoTokens(const Mamba3Plan& plan) {
    using T3 = Tensor3<float, MemorySpace>;
    scale = allocate_uninitialized<T3>("kmamba::mamba3::siso_scale", plan.batch, plan.seqlen, plan.nheads);
    log_decay = allocate_uninitialized<T3>("kmamba::mamba3::siso_log_decay", plan.batch, plan.seqlen, plan.nheads);
    qk = allocate_uninitialized<T3>("kmamba::mamba3::siso_qk", plan.batch, plan.seqlen, plan.nheads);
    diag = allocate_uninitialized<T3>("kmamba::mamba3::siso_diagonal", plan.batch, plan.seqlen, plan.nheads);
  }
};

/// Stage 2a (rotate): the rotated, biased q and k rows (where ws has them); the final k state at the last token; with
/// `tok` allocated (SISO), the token's values in the SSD's layout, q_t·k_t from the rotated rows (a
/// rotation keeps dot products). A row kernel over (batch, row = t·R + r, head), its lanes over
/// slots: the first nangles slots are the rotated pairs of states (2j, 2j + 1), one angle's cosine
/// and sine for both, the remaining slots the states from 2·nangles on, one each.
template <class ExecSpace, class MemorySpace>
struct Mamba3RotateFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  Mamba3Operands<MemorySpace> in;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3Plan plan;
  Mamba3StateViews<float, MemorySpace> final_states;
  Mamba3SisoTokens<MemorySpace> tok;

  /// Stores the rotated q, k of state n (where ws has rows); returns their product.
  KOKKOS_INLINE_FUNCTION float store(int b, int h, int row, int t, int r, int n, float qv, float kv) const {
    if (ws.q.is_allocated()) {
      ws.q(b, row, h, n) = qv;
      ws.k(b, row, h, n) = kv;
    }
    if (t == plan.seqlen - 1 && final_states.has_k) final_states.k(b, h, r, n) = kv;
    return qv * kv;
  }

  KOKKOS_INLINE_FUNCTION float rotate_slot(int b, int h, int row, int t, int r, int g, int slot) const {
    if (slot >= plan.nangles) {
      const int n = slot + plan.nangles;
      return store(b, h, row, t, r, n, in.q_in(b, t, r, g, n) + in.q_bias(h, r, n),
                   in.k_in(b, t, r, g, n) + in.k_bias(h, r, n));
    }
    const int n0 = 2 * slot, n1 = n0 + 1;
    const float theta = ws.theta(b, h, t, slot);
    const float c = kmamba::math::cos(theta);
    const float s = kmamba::math::sin(theta);
    const float q0 = in.q_in(b, t, r, g, n0) + in.q_bias(h, r, n0);
    const float q1 = in.q_in(b, t, r, g, n1) + in.q_bias(h, r, n1);
    const float k0 = in.k_in(b, t, r, g, n0) + in.k_bias(h, r, n0);
    const float k1 = in.k_in(b, t, r, g, n1) + in.k_bias(h, r, n1);
    return store(b, h, row, t, r, n0, q0 * c - q1 * s, k0 * c - k1 * s) +
           store(b, h, row, t, r, n1, q0 * s + q1 * c, k0 * s + k1 * c);
  }

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    Mamba3Row it;
    if (!mamba3_row(team, plan, plan.seqlen * plan.rank, it)) return;
    const int b = it.b, row = it.row, h = it.h;
    const int t = row / plan.rank, r = row % plan.rank;
    const int g = h / plan.heads_per_group;
    float qk = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(team, plan.dstate - plan.nangles),
        [&](const int slot, float& acc) { acc += rotate_slot(b, h, row, t, r, g, slot); }, qk);
    if (!tok.qk.is_allocated()) return;
    Kokkos::single(Kokkos::PerThread(team), [&]() {
      const float scale = ws.scale(b, h, t);
      tok.scale(b, t, h) = scale;
      tok.log_decay(b, t, h) = in.adt(b, h, t);
      tok.qk(b, t, h) = qk;
      tok.diag(b, t, h) = in.skip(h) + (ws.gamma(b, h, t) - scale) * qk;
    });
  }
};

/// Stage 2b (one item per (batch, head, row, channel), or with `last_only` per (batch, head, rank,
/// channel) of the last token): the projected v rows, when ws has them; the final v state at the
/// last token.
template <class MemorySpace>
struct Mamba3ProjectFunctor {
  Mamba3Operands<MemorySpace> in;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3Plan plan;
  Mamba3StateViews<float, MemorySpace> final_states;
  bool last_only;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int p = static_cast<int>(item % plan.headdim);
    const std::int64_t rest = item / plan.headdim;
    const int nrows = last_only ? plan.rank : plan.seqlen * plan.rank;
    const int row = static_cast<int>(rest % nrows) + (last_only ? (plan.seqlen - 1) * plan.rank : 0);
    const int bh = static_cast<int>(rest / nrows);
    const int h = bh % plan.nheads, b = bh / plan.nheads;
    const int t = row / plan.rank, r = row % plan.rank;
    const float v = in.v(b, t, h, p) * in.v_proj(h, r, p);
    if (!last_only) ws.v(b, row, h, p) = v;
    if (t == plan.seqlen - 1 && final_states.has_v) final_states.v(b, h, r, p) = v;
  }
};

/// Stage 3 (chunk_state): the chunk's own end state Σ_rows scale_s·exp(cs_last − cs_s)·v_row ⊗ k_row.
template <class ExecSpace, class MemorySpace, MatmulPrecision Precision>
struct Mamba3ChunkStateFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using S = Mamba3Scratch<ExecSpace>;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3Plan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const Mamba3ChunkBlock blk = mamba3_chunk_block(plan, team.league_rank());
    typename S::Vec sw(team.team_scratch(0), plan.rows);
    const int b = blk.b, h = blk.h, t0 = blk.t0, row0 = blk.row0, last = blk.len - 1;
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, blk.rows), [&](const int j) {
      const int s = j / plan.rank;
      sw(j) = ws.scale(b, h, t0 + s) * kmamba::math::exp(ws.cs(b, h, t0 + last) - ws.cs(b, h, t0 + s));
    });
    team.team_barrier();
    TeamGemm<ExecSpace, Precision>::apply(
        team, plan.headdim, plan.dstate, blk.rows,
        [&](const int p, const int j) { return ws.v(b, row0 + j, h, p) * sw(j); },
        [&](const int j, const int n) { return ws.k(b, row0 + j, h, n); },
        [&](const int p, const int n, const float v) { ws.states(b, blk.c, h, p, n) = v; });
  }
};

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

/// The decay of the state across chunk c: exp(cs at the chunk's last token).
template <class MemorySpace>
KOKKOS_INLINE_FUNCTION float mamba3_chunk_decay(const Mamba3Plan& plan, const Mamba3Workspace<MemorySpace>& ws, int b,
                                                int h, int c) {
  return kmamba::math::exp(ws.cs(b, h, c * plan.chunk + mamba3_chunk_length(plan, c) - 1));
}

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

/// Stage 5 (chunk_scan): y_t,r = Σ_rows (q_t,r·k_s,r′)·w(t, s)·v_s,r′ + exp(cs_t)·Ĥ q_t,r + D·v_t,r for a tile
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
    typename S::Vec seA(team.team_scratch(0), plan.rows);
    typename S::Mat sW(team.team_scratch(1), plan.tile_rows, plan.rows);
    typename S::Mat sy(team.team_scratch(1), plan.tile_rows, plan.headdim);
    const int b = blk.b, c = blk.c, h = blk.h, t0 = blk.t0, row0 = blk.row0, rows = blk.rows, R = plan.rank;
    mamba3_stage_tokens(team, ws, blk, scs, sscale, sgamma);
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, rows),
                         [&](const int j) { seA(j) = kmamba::math::exp(ws.cs(b, h, t0 + j / R)); });
    const float skip = in.skip(h);
    for (int l0 = 0; l0 < blk.len; l0 += plan.tile) {
      const int tokens = blk.len - l0 < plan.tile ? blk.len - l0 : plan.tile;
      const int nr = tokens * R, i0 = l0 * R;
      team.team_barrier();
      TeamGemm<ExecSpace, Precision>::apply(
          team, nr, rows, plan.dstate, [&](const int i, const int n) { return ws.q(b, row0 + i0 + i, h, n); },
          [&](const int n, const int j) { return ws.k(b, row0 + j, h, n); },
          [&](const int i, const int j, const float v) {
            sW(i, j) = v * mamba3_pair_weight(scs, sscale, sgamma, l0 + i / R, j / R);
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

/// Backward B2 (dstates): Σ_rows exp(cs_t)·g_row ⊗ q_row, the gradient the chunk's outputs send to
/// the state entering it.
template <class ExecSpace, class MemorySpace, MatmulPrecision Precision>
struct Mamba3ChunkDstatesFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using S = Mamba3Scratch<ExecSpace>;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3Plan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const Mamba3ChunkBlock blk = mamba3_chunk_block(plan, team.league_rank());
    typename S::Vec seA(team.team_scratch(0), plan.rows);
    const int b = blk.b, h = blk.h, row0 = blk.row0;
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, blk.rows),
                         [&](const int j) { seA(j) = kmamba::math::exp(ws.cs(b, h, blk.t0 + j / plan.rank)); });
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
/// dq_i = Σ_j w·(g_i·v_j)·k_j + exp(cs_t)·Ĥᵀ g_i (and the part of ∂/∂adt through exp(cs_t)).
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
    typename S::Vec srow(team.team_scratch(0), plan.tile_rows);
    typename S::Mat sA(team.team_scratch(1), plan.tile_rows, plan.rows);
    typename S::Mat sB(team.team_scratch(1), plan.tile_rows, plan.rows);
    typename S::Mat sX(team.team_scratch(1), plan.tile, plan.chunk);
    typename S::Mat sacc(team.team_scratch(1), plan.tile_rows, plan.headdim > plan.dstate ? plan.headdim : plan.dstate);

    const int b = blk.b, c = blk.c, h = blk.h, t0 = blk.t0, len = blk.len, row0 = blk.row0, rows = blk.rows;
    const int R = plan.rank, last = len - 1;
    mamba3_stage_tokens(team, ws, blk, scs, sscale, sgamma);
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, len), [&](const int l) { sintra(l) = 0.0f; });
    team.team_barrier();
    const float cs_last = scs(last);
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
    chunk_term *= kmamba::math::exp(cs_last);
    const float skip = in.skip(h);

    // Pass 1: tiles of source tokens s.
    for (int s0 = 0; s0 < len; s0 += plan.tile) {
      const int tokens = len - s0 < plan.tile ? len - s0 : plan.tile;
      const int nr = tokens * R, j0 = row0 + s0 * R;
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamVectorRange(team, nr), [&](const int jj) {
        const int s = s0 + jj / R;
        srow(jj) = sscale(s) * kmamba::math::exp(cs_last - scs(s));
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
        Kokkos::single(Kokkos::PerThread(team), [&]() { snext(s) = kmamba::math::exp(cs_last - scs(s)) * dot; });
        // X(s, t) from the raw products, then the products weighted in place.
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, len), [&](const int t) {
          float x = 0.0f;
          if (t >= s) {
            const float e = kmamba::math::exp(scs(t) - scs(s));
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
                           [&](const int ii) { srow(ii) = kmamba::math::exp(scs(l0 + ii / R)); });
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
              sB(ii, j) = v * mamba3_pair_weight(scs, sscale, sgamma, l0 + ii / R, j / R);
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

/// The chain rule through the SISO scan's own-token correction c_t (impl/Mamba3SisoSsd.hpp), as the
/// token and value backward apply it: with dc_t = g_t·v_t, ∂/∂v_t += c_t·g_t, the rotated ∂/∂q_t
/// += dc_t·(γ_t − scale_t)·k_t and ∂/∂k_t likewise with q_t, ∂/∂scale_t = the SSD's ∂/∂δ_t −
/// dc_t·(q_t·k_t), the diagonal ∂/∂γ_t = dc_t·(q_t·k_t). Inactive (MIMO) unless `tok` is allocated.
template <class MemorySpace>
struct Mamba3SisoDiagonal {
  Mamba3SisoTokens<MemorySpace> tok;
  ConstTensor3<float, MemorySpace> dc;          // (batch, seqlen, nheads): g_t·v_t
  ConstTensor3<float, MemorySpace> dscale;      // (batch, seqlen, nheads): the SSD's ∂/∂δ
  ConstTensor3<float, MemorySpace> dlog_decay;  // (batch, seqlen, nheads): the SSD's ∂/∂ log decay
  Tensor3<float, MemorySpace> dadt;             // (batch, nheads, seqlen)

  KOKKOS_INLINE_FUNCTION bool active() const { return tok.qk.is_allocated(); }
  /// dc_t·(γ_t − scale_t), the factor of the rotated q·k (0 when inactive).
  KOKKOS_INLINE_FUNCTION float dqk(int b, int t, int h, float gamma) const {
    return active() ? dc(b, t, h) * (gamma - tok.scale(b, t, h)) : 0.0f;
  }
};

/// Backward B6a (a row kernel over (batch, token, head), lanes over the angles): adds the final k
/// cotangent at the last token (and SISO's own-token correction) and turns the rotated gradients of
/// q and k back (into ∂/∂ the biased q, k, in place), pair by pair over every rank, writing ∂/∂θ_t.
template <class ExecSpace, class MemorySpace>
struct Mamba3TokenBackwardFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3Plan plan;
  Mamba3StateViews<const float, MemorySpace> dfinal;
  Mamba3SisoDiagonal<MemorySpace> siso;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    Mamba3Row it;
    if (!mamba3_row(team, plan, plan.seqlen, it)) return;
    const int b = it.b, t = it.row, h = it.h;
    const bool add_final = t == plan.seqlen - 1 && dfinal.has_k;
    const float dqk = siso.dqk(b, t, h, ws.gamma(b, h, t));
    if (add_final || siso.active()) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, 2 * plan.nangles, plan.dstate), [&](const int n) {
        for (int r = 0; r < plan.rank; ++r) {
          const int row = t * plan.rank + r;
          bw.dq(b, row, h, n) += dqk * ws.k(b, row, h, n);
          bw.dk(b, row, h, n) += dqk * ws.q(b, row, h, n) + (add_final ? dfinal.k(b, h, r, n) : 0.0f);
        }
      });
    }
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, plan.nangles), [&](const int i) {
      const int n0 = 2 * i, n1 = n0 + 1;
      const float theta = ws.theta(b, h, t, i);
      const float c = kmamba::math::cos(theta);
      const float s = kmamba::math::sin(theta);
      float dtheta = 0.0f;
      for (int r = 0; r < plan.rank; ++r) {
        const int row = t * plan.rank + r;
        const float q0 = ws.q(b, row, h, n0), q1 = ws.q(b, row, h, n1);
        const float k0 = ws.k(b, row, h, n0), k1 = ws.k(b, row, h, n1);
        const float dq0 = bw.dq(b, row, h, n0) + dqk * k0, dq1 = bw.dq(b, row, h, n1) + dqk * k1;
        float dk0 = bw.dk(b, row, h, n0) + dqk * q0, dk1 = bw.dk(b, row, h, n1) + dqk * q1;
        if (add_final) {
          dk0 += dfinal.k(b, h, r, n0);
          dk1 += dfinal.k(b, h, r, n1);
        }
        dtheta += dq1 * q0 - dq0 * q1 + dk1 * k0 - dk0 * k1;
        bw.dq(b, row, h, n0) = dq0 * c + dq1 * s;
        bw.dq(b, row, h, n1) = dq1 * c - dq0 * s;
        bw.dk(b, row, h, n0) = dk0 * c + dk1 * s;
        bw.dk(b, row, h, n1) = dk1 * c - dk0 * s;
      }
      bw.dtheta(b, h, t, i) = dtheta;
    });
    if (!siso.active()) return;
    Kokkos::single(Kokkos::PerThread(team), [&]() {
      const float diagonal = siso.dc(b, t, h) * siso.tok.qk(b, t, h);
      bw.off(b, h, t) = siso.dscale(b, t, h) - diagonal;
      bw.diag(b, h, t) = diagonal;
      siso.dadt(b, h, t) = siso.dlog_decay(b, t, h);
    });
  }
};

/// Backward B6b (a row kernel over (batch, token, head), lanes over the channels): adds the final v
/// cotangent at the last token (in place, for the projection sums) and SISO's c_t·g_t, and writes
/// dv = Σ_r ∂/∂v_t,r·mimo_v_r.
template <class ExecSpace, class MemorySpace>
struct Mamba3ValueBackwardFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  Mamba3Operands<MemorySpace> in;
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3Plan plan;
  Mamba3StateViews<const float, MemorySpace> dfinal;
  Tensor4<float, MemorySpace> dv;  // (batch, seqlen, nheads, headdim)
  Mamba3SisoDiagonal<MemorySpace> siso;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    Mamba3Row it;
    if (!mamba3_row(team, plan, plan.seqlen, it)) return;
    const int b = it.b, t = it.row, h = it.h;
    const bool add_final = t == plan.seqlen - 1 && dfinal.has_v;
    const float c = siso.active() ? siso.tok.diag(b, t, h) : 0.0f;
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, plan.headdim), [&](const int p) {
      float sum = 0.0f;
      for (int r = 0; r < plan.rank; ++r) {
        const int row = t * plan.rank + r;
        float d = bw.dv(b, row, h, p);
        if (siso.active()) d += c * bw.g(b, row, h, p);
        if (add_final) {
          d += dfinal.v(b, h, r, p);
          bw.dv(b, row, h, p) = d;
        }
        sum += d * in.v_proj(h, r, p);
      }
      dv(b, t, h, p) = sum;
    });
  }
};

/// Backward B7a (one item per (batch, head, chunk, angle)): the chunk's sum of ∂/∂θ_t, last token first.
template <class MemorySpace>
struct Mamba3DthetaChunkSumFunctor {
  Mamba3Workspace<MemorySpace> ws;
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3Plan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const Mamba3ChunkItem it = mamba3_chunk_item(plan, item, plan.nangles);
    const int t0 = it.c * plan.chunk, len = mamba3_chunk_length(plan, it.c);
    float sum = 0.0f;
    for (int l = len - 1; l >= 0; --l) sum += bw.dtheta(it.b, it.h, t0 + l, it.job);
    ws.angle_sum(it.b, it.h, it.c, it.job) = sum;
  }
};

/// Backward B7b (one item per (batch, head, angle)): walks the chunks backwards, replacing each
/// chunk's sum by G entering it from the right (dfinal angle + the sums of the chunks after it);
/// writes dinitial angle.
template <class MemorySpace>
struct Mamba3DthetaPassingFunctor {
  Mamba3Workspace<MemorySpace> ws;
  Mamba3Plan plan;
  Mamba3StateViews<const float, MemorySpace> dfinal;
  Mamba3StateViews<float, MemorySpace> dinitial;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int i = static_cast<int>(item % plan.nangles);
    const int bh = static_cast<int>(item / plan.nangles);
    const int h = bh % plan.nheads, b = bh / plan.nheads;
    float G = dfinal.angle_or_zero(b, h, i);
    for (int c = plan.nchunks - 1; c >= 0; --c) {
      const float sum = ws.angle_sum(b, h, c, i);
      ws.angle_sum(b, h, c, i) = G;
      G += sum;
    }
    if (dinitial.has_angle) dinitial.angle(b, h, i) = G;
  }
};

/// Backward B7c (one item per (batch, head, chunk, angle)): G_i = dfinal angle + Σ_{t′≥t} ∂/∂θ_t′
/// backwards through the chunk from the G entering it; writes dangles and leaves G·π·tanh(φ) (the
/// part of ∂/∂dt through the angles) in dtheta.
template <class MemorySpace>
struct Mamba3AngleBackwardFunctor {
  Mamba3Operands<MemorySpace> in;
  Mamba3Workspace<MemorySpace> ws;
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3Plan plan;
  Tensor4<float, MemorySpace> dangles;  // (batch, seqlen, nheads, nangles)

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const Mamba3ChunkItem it = mamba3_chunk_item(plan, item, plan.nangles);
    const int b = it.b, h = it.h, i = it.job, t0 = it.c * plan.chunk, len = mamba3_chunk_length(plan, it.c);
    float G = ws.angle_sum(b, h, it.c, i);
    for (int l = len - 1; l >= 0; --l) {
      const int t = t0 + l;
      G += bw.dtheta(b, h, t, i);
      const float th = kmamba::math::tanh(in.angles(b, t, h, i));
      dangles(b, t, h, i) = G * in.dt(b, h, t) * mamba3_pi * (1.0f - th * th);
      bw.dtheta(b, h, t, i) = G * mamba3_pi * th;
    }
  }
};

/// Backward B7d (one item per (batch, head, token)): ∂/∂dt and ∂/∂trap from ∂/∂γ_t = diag_t + off_t,
/// ∂/∂β̃_t = off_{t−1} (∂/∂β̃_0 through the initial k, v) and the angles' part.
template <class MemorySpace>
struct Mamba3ScalarBackwardFunctor {
  Mamba3Operands<MemorySpace> in;
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3Plan plan;
  Tensor3<float, MemorySpace> ddt;    // (batch, nheads, seqlen)
  Tensor3<float, MemorySpace> dtrap;  // (batch, nheads, seqlen)

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int t = static_cast<int>(item % plan.seqlen);
    const int bh = static_cast<int>(item / plan.seqlen);
    const int h = bh % plan.nheads, b = bh / plan.nheads;
    float from_angles = 0.0f;
    for (int i = 0; i < plan.nangles; ++i) from_angles += bw.dtheta(b, h, t, i);
    const float d = in.dt(b, h, t);
    const float lambda = sigmoid(in.trap(b, h, t));
    const float one_minus = sigmoid(-in.trap(b, h, t));
    const float dgamma = bw.diag(b, h, t) + bw.off(b, h, t);
    const float dbeta = t > 0 ? bw.off(b, h, t - 1) : bw.dbeta0(b, h);
    ddt(b, h, t) = from_angles + dgamma * lambda + dbeta * one_minus;
    dtrap(b, h, t) = (dgamma - dbeta) * d * lambda * one_minus;
  }
};

/// dq, dk: the heads of each group summed in a fixed order, one item per (batch, token, rank,
/// group, state).
template <class MemorySpace>
struct Mamba3GroupSumFunctor {
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3GradViews<MemorySpace> grads;
  Mamba3Plan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int n = static_cast<int>(item % plan.dstate);
    std::int64_t rest = item / plan.dstate;
    const int g = static_cast<int>(rest % plan.ngroups);
    rest /= plan.ngroups;
    const int row = static_cast<int>(rest % (plan.seqlen * plan.rank));
    const int b = static_cast<int>(rest / (plan.seqlen * plan.rank));
    const int t = row / plan.rank, r = row % plan.rank;
    float sq = 0.0f, sk = 0.0f;
    for (int k = 0; k < plan.heads_per_group; ++k) {
      const int h = g * plan.heads_per_group + k;
      sq += bw.dq(b, row, h, n);
      sk += bw.dk(b, row, h, n);
    }
    grads.dq(b, t, r, g, n) = sq;
    grads.dk(b, t, r, g, n) = sk;
  }
};

/// dq_bias, dk_bias, first step: each chunk's sums over its tokens, one item per (batch, chunk,
/// head, rank, state).
template <class MemorySpace>
struct Mamba3BiasPartialFunctor {
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3Plan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int rn = static_cast<int>(item % (plan.rank * plan.dstate));
    const std::int64_t rest = item / (plan.rank * plan.dstate);
    const int h = static_cast<int>(rest % plan.nheads);
    const int bc = static_cast<int>(rest / plan.nheads);
    const int c = bc % plan.nchunks, b = bc / plan.nchunks;
    const int r = rn / plan.dstate, n = rn % plan.dstate;
    const int t0 = c * plan.chunk, len = mamba3_chunk_length(plan, c);
    float sq = 0.0f, sk = 0.0f;
    for (int l = 0; l < len; ++l) {
      const int row = (t0 + l) * plan.rank + r;
      sq += bw.dq(b, row, h, n);
      sk += bw.dk(b, row, h, n);
    }
    bw.dq_bias_partial(b, c, h, rn) = sq;
    bw.dk_bias_partial(b, c, h, rn) = sk;
  }
};

/// dq_bias, dk_bias: the per-(batch, chunk) partial sums added in a fixed order, one thread per
/// (head, rank, state).
template <class MemorySpace>
struct Mamba3BiasSumFunctor {
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3GradViews<MemorySpace> grads;
  Mamba3Plan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const int idx) const {
    const int rn = idx % (plan.rank * plan.dstate);
    const int h = idx / (plan.rank * plan.dstate);
    float sq = 0.0f, sk = 0.0f;
    for (int b = 0; b < plan.batch; ++b) {
      for (int c = 0; c < plan.nchunks; ++c) {
        sq += bw.dq_bias_partial(b, c, h, rn);
        sk += bw.dk_bias_partial(b, c, h, rn);
      }
    }
    grads.dq_bias(h, rn / plan.dstate, rn % plan.dstate) = sq;
    grads.dk_bias(h, rn / plan.dstate, rn % plan.dstate) = sk;
  }
};

/// dmimo_v, dmimo_z, dmimo_o: sums over batch and tokens, one thread per (head, rank, channel).
template <class MemorySpace>
struct Mamba3ProjectionSumFunctor {
  Mamba3Operands<MemorySpace> in;
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3GradViews<MemorySpace> grads;
  Mamba3Plan plan;
  ConstTensor4<float, MemorySpace> dout;  // (batch, seqlen, nheads, headdim)

  KOKKOS_INLINE_FUNCTION void operator()(const int idx) const {
    const int p = idx % plan.headdim;
    const int r = (idx / plan.headdim) % plan.rank;
    const int h = idx / (plan.headdim * plan.rank);
    float sv = 0.0f, sz = 0.0f, so = 0.0f;
    for (int b = 0; b < plan.batch; ++b) {
      for (int t = 0; t < plan.seqlen; ++t) {
        const int row = t * plan.rank + r;
        const float go = dout(b, t, h, p);
        const float y = bw.y(b, row, h, p);
        sv += bw.dv(b, row, h, p) * in.v(b, t, h, p);
        if (in.has_z) {
          const float zz = in.z(b, t, h, p);
          const float zr = zz * in.mimo_z(h, r, p);
          so += go * y * silu(zr);
          sz += go * in.mimo_o(h, r, p) * y * silu_derivative(zr) * zz;
        } else {
          so += go * y;
        }
      }
    }
    grads.dmimo_v(h, r, p) = sv;
    grads.dmimo_o(h, r, p) = so;
    if (in.has_z) grads.dmimo_z(h, r, p) = sz;
  }
};

/// dD: the per-(batch, chunk) partial sums added in a fixed order.
template <class MemorySpace>
struct Mamba3SkipSumFunctor {
  ConstTensor3<float, MemorySpace> partial;  // (batch, nchunks, nheads)
  Tensor1<float, MemorySpace> dD;            // (nheads)

  KOKKOS_INLINE_FUNCTION void operator()(const int h) const {
    float sum = 0.0f;
    for (int b = 0; b < static_cast<int>(partial.extent(0)); ++b) {
      for (int c = 0; c < static_cast<int>(partial.extent(1)); ++c) sum += partial(b, c, h);
    }
    dD(h) = sum;
  }
};

/// One decode step (docs/algorithms.md §3.7): a team per (batch, head); threads over headdim,
/// lanes over dstate.
template <class ExecSpace, class MemorySpace>
struct Mamba3StepFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using S = Mamba3Scratch<ExecSpace>;
  Mamba3StepOperands<MemorySpace> in;
  Mamba3StateViews<float, MemorySpace> states;
  Tensor3<float, MemorySpace> out;  // (batch, nheads, headdim)
  Mamba3Plan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int h = team.league_rank() % plan.nheads;
    const int b = team.league_rank() / plan.nheads;
    const int g = h / plan.heads_per_group;
    const int R = plan.rank, N = plan.dstate, P = plan.headdim;
    typename S::Vec sq(team.team_scratch(0), R * N);
    typename S::Vec sk(team.team_scratch(0), R * N);
    typename S::Vec sv(team.team_scratch(0), R * P);
    typename S::Vec stheta(team.team_scratch(0), plan.nangles);
    const float d = in.dt(b, h);
    const float lambda = sigmoid(in.trap(b, h));
    const float alpha = kmamba::math::exp(in.adt(b, h));
    const float beta = sigmoid(-in.trap(b, h)) * d * alpha;
    const float gamma = lambda * d;
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, plan.nangles), [&](const int i) {
      float theta = states.angle(b, h, i) + mamba3_pi * kmamba::math::tanh(in.angles(b, h, i)) * d;
      if (in.wrap_angle) theta -= mamba3_two_pi * kmamba::math::floor(theta / mamba3_two_pi);
      stheta(i) = theta;
    });
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, R * N), [&](const int rn) {
      const int r = rn / N, n = rn % N;
      if (n < 2 * plan.nangles) {
        const int i = n / 2, n0 = 2 * i, n1 = 2 * i + 1;
        const float c = kmamba::math::cos(stheta(i));
        const float s = kmamba::math::sin(stheta(i));
        const float q0 = in.q_in(b, r, g, n0) + in.q_bias(h, r, n0), q1 = in.q_in(b, r, g, n1) + in.q_bias(h, r, n1);
        const float k0 = in.k_in(b, r, g, n0) + in.k_bias(h, r, n0), k1 = in.k_in(b, r, g, n1) + in.k_bias(h, r, n1);
        sq(rn) = n == n0 ? q0 * c - q1 * s : q0 * s + q1 * c;
        sk(rn) = n == n0 ? k0 * c - k1 * s : k0 * s + k1 * c;
      } else {
        sq(rn) = in.q_in(b, r, g, n) + in.q_bias(h, r, n);
        sk(rn) = in.k_in(b, r, g, n) + in.k_bias(h, r, n);
      }
    });
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, R * P),
                         [&](const int rp) { sv(rp) = in.v(b, h, rp % P) * in.v_proj(h, rp / P, rp % P); });
    team.team_barrier();
    const float skip = in.has_D ? in.D(h) : 0.0f;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, P), [&](const int p) {
      // Rank 0's reduction updates the state; the others read back what the same lanes wrote.
      float o = 0.0f;
      for (int r = 0; r < R; ++r) {
        float y = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::ThreadVectorRange(team, N),
            [&](const int n, float& acc) {
              if (r == 0) {
                float prev = 0.0f, cur = 0.0f;
                for (int rr = 0; rr < R; ++rr) {
                  prev += states.v(b, h, rr, p) * states.k(b, h, rr, n);
                  cur += sv(rr * P + p) * sk(rr * N + n);
                }
                states.ssm(b, h, p, n) = alpha * states.ssm(b, h, p, n) + beta * prev + gamma * cur;
              }
              acc += states.ssm(b, h, p, n) * sq(r * N + n);
            },
            y);
        const float gate = in.has_z ? silu(in.z(b, h, p) * in.z_proj(h, r, p)) : 1.0f;
        o += (y + skip * sv(r * P + p)) * gate * in.o_proj(h, r, p);
      }
      Kokkos::single(Kokkos::PerThread(team), [&]() { out(b, h, p) = o; });
    });
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, R * N),
                         [&](const int rn) { states.k(b, h, rn / N, rn % N) = sk(rn); });
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, R * P),
                         [&](const int rp) { states.v(b, h, rp / P, rp % P) = sv(rp); });
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, plan.nangles),
                         [&](const int i) { states.angle(b, h, i) = stheta(i); });
  }
};

template <class ExecSpace, class Dst, class Src>
void mamba3_copy_or_zero(const ExecSpace& exec, const Dst& dst, bool has_dst, const Src& src, bool has_src) {
  if (!has_dst) return;
  if (has_src) {
    Kokkos::deep_copy(exec, dst, src);
  } else {
    Kokkos::deep_copy(exec, dst, 0.0f);
  }
}

/// dst = src state by state (zero where src lacks one): what a sequence of length 0 does.
template <class ExecSpace, class MemorySpace>
void mamba3_pass_states(const ExecSpace& exec, const Mamba3StateViews<const float, MemorySpace>& src,
                        const Mamba3StateViews<float, MemorySpace>& dst) {
  mamba3_copy_or_zero(exec, dst.angle, dst.has_angle, src.angle, src.has_angle);
  mamba3_copy_or_zero(exec, dst.ssm, dst.has_ssm, src.ssm, src.has_ssm);
  if (dst.mimo) {
    mamba3_copy_or_zero(exec, dst.k4, dst.has_k, src.k4, src.has_k);
    mamba3_copy_or_zero(exec, dst.v4, dst.has_v, src.v4, src.has_v);
  } else {
    mamba3_copy_or_zero(exec, dst.k3, dst.has_k, src.k3, src.has_k);
    mamba3_copy_or_zero(exec, dst.v3, dst.has_v, src.v3, src.has_v);
  }
}

/// Stages 1–2: angles, cumsums and scales; rotated rows (and the final k, v and angle); with `tok`
/// allocated (SISO), the per-token values of the SSD.
template <class ExecSpace, class MemorySpace>
void mamba3_prepare_rows(const ExecSpace& exec, const Mamba3Plan& plan, const Mamba3Operands<MemorySpace>& in,
                         const Mamba3Workspace<MemorySpace>& ws,
                         const Mamba3StateViews<float, MemorySpace>& final_states,
                         const Mamba3SisoTokens<MemorySpace>& tok = Mamba3SisoTokens<MemorySpace>()) {
  const std::int64_t head_chunks = static_cast<std::int64_t>(plan.batch) * plan.nheads * plan.nchunks;
  const std::int64_t rows = static_cast<std::int64_t>(plan.batch) * plan.nheads * plan.seqlen * plan.rank;
  mamba3_for(exec, "kmamba::mamba3::chunk_tokens", head_chunks * (plan.nangles + 1),
             Mamba3ChunkTokensFunctor<MemorySpace>{in, ws, plan});
  mamba3_for(exec, "kmamba::mamba3::angle_passing", static_cast<std::int64_t>(plan.batch) * plan.nheads * plan.nangles,
             Mamba3AnglePassingFunctor<MemorySpace>{in, ws, plan});
  mamba3_for(exec, "kmamba::mamba3::angle_scan", head_chunks * plan.nangles,
             Mamba3AngleScanFunctor<MemorySpace>{in, ws, plan, final_states.angle, final_states.has_angle});
  mamba3_row_launch(exec, "kmamba::mamba3::rotate", rows,
                    Mamba3RotateFunctor<ExecSpace, MemorySpace>{in, ws, plan, final_states, tok});
  const bool last_only = !ws.v.is_allocated();
  if (!last_only || final_states.has_v) {
    const std::int64_t items = last_only
                                   ? static_cast<std::int64_t>(plan.batch) * plan.nheads * plan.rank * plan.headdim
                                   : rows * plan.headdim;
    mamba3_for(exec, "kmamba::mamba3::project", items,
               Mamba3ProjectFunctor<MemorySpace>{in, ws, plan, final_states, last_only});
  }
}

/// Stages 1–4: stages 1–2; the entering states (and the final ssm state).
template <MatmulPrecision Precision, class ExecSpace, class MemorySpace>
void mamba3_prepare(const ExecSpace& exec, const Mamba3Plan& plan, const Mamba3Operands<MemorySpace>& in,
                    const Mamba3Workspace<MemorySpace>& ws, const Mamba3StateViews<float, MemorySpace>& final_states) {
  mamba3_prepare_rows(exec, plan, in, ws, final_states);
  mamba3_launch(exec, "kmamba::mamba3::chunk_state", plan, plan.batch * plan.nchunks * plan.nheads,
                Mamba3ChunkStateFunctor<ExecSpace, MemorySpace, Precision>{ws, plan},
                Mamba3Scratch<ExecSpace>::bytes(plan.chunk, plan.rank, plan.tile));
  mamba3_for(exec, "kmamba::mamba3::state_passing", mamba3_state_items(plan),
             Mamba3StatePassingFunctor<MemorySpace>{in, ws, plan, final_states});
}

template <MatmulPrecision Precision, class ExecSpace, class MemorySpace>
void mamba3_forward_stages(const ExecSpace& exec, const Mamba3Plan& plan, const Mamba3Operands<MemorySpace>& in,
                           const Tensor4<float, MemorySpace>& out,
                           const Mamba3StateViews<float, MemorySpace>& final_states) {
  using S = Mamba3Scratch<ExecSpace>;
  const Mamba3Workspace<MemorySpace> ws(plan, true);
  mamba3_prepare<Precision>(exec, plan, in, ws, final_states);
  mamba3_launch(exec, "kmamba::mamba3::chunk_scan", plan, plan.batch * plan.nchunks * plan.nheads,
                Mamba3ChunkScanFunctor<ExecSpace, MemorySpace, false, Precision>{in, ws, plan, out, {}, {}, {}, {}},
                S::bytes(plan.chunk, plan.rank, plan.tile),
                S::block_bytes(plan.chunk, plan.rank, plan.tile, plan.headdim, plan.dstate));
}

/// The gradients of a sequence of length 0: the states pass through; every parameter gets zero.
template <class ExecSpace, class MemorySpace>
void mamba3_backward_empty(const ExecSpace& exec, const Mamba3Operands<MemorySpace>& in,
                           const Mamba3StateViews<const float, MemorySpace>& dfinal,
                           const Mamba3GradViews<MemorySpace>& grads) {
  mamba3_pass_states(exec, dfinal, grads.dinitial);
  if (grads.mimo) {
    Kokkos::deep_copy(exec, grads.dq_bias3, 0.0f);
    Kokkos::deep_copy(exec, grads.dk_bias3, 0.0f);
    Kokkos::deep_copy(exec, grads.dmimo_v, 0.0f);
    Kokkos::deep_copy(exec, grads.dmimo_o, 0.0f);
    if (in.has_z) Kokkos::deep_copy(exec, grads.dmimo_z, 0.0f);
  } else {
    Kokkos::deep_copy(exec, grads.dq_bias2, 0.0f);
    Kokkos::deep_copy(exec, grads.dk_bias2, 0.0f);
  }
  if (grads.dD.is_allocated()) Kokkos::deep_copy(exec, grads.dD, 0.0f);
}

/// The backward stages after the chunks' (ws and bw hold the rows, ∂/∂Ĥ_{−1} in bw.dH0, the rows'
/// gradients and the chunks' shares of dD; ∂/∂scale and the diagonal ∂/∂γ, or for SISO `siso`, from
/// which the token backward forms them and ∂/∂adt): the initial k and v, the rotations and angles,
/// dt and trap, and the sums over groups, tokens and chunks.
template <class ExecSpace, class MemorySpace>
void mamba3_backward_tail(const ExecSpace& exec, const Mamba3Plan& plan, const Mamba3Operands<MemorySpace>& in,
                          const Mamba3Workspace<MemorySpace>& ws, const Mamba3BackwardWorkspace<MemorySpace>& bw,
                          const ConstTensor4<float, MemorySpace>& dout,
                          const Mamba3StateViews<const float, MemorySpace>& dfinal,
                          const Mamba3GradViews<MemorySpace>& grads,
                          const Mamba3SisoDiagonal<MemorySpace>& siso = Mamba3SisoDiagonal<MemorySpace>()) {
  const int head_league = plan.batch * plan.nheads;
  const std::int64_t head_chunks = static_cast<std::int64_t>(plan.batch) * plan.nheads * plan.nchunks;
  const std::int64_t tokens = static_cast<std::int64_t>(plan.batch) * plan.seqlen * plan.nheads;
  mamba3_launch(exec, "kmamba::mamba3::initial_state_backward", plan, head_league,
                Mamba3InitialStateBackwardFunctor<ExecSpace, MemorySpace>{in, bw.dH0, bw.dbeta0, plan, grads.dinitial},
                0);
  mamba3_row_launch(exec, "kmamba::mamba3::token_backward", tokens,
                    Mamba3TokenBackwardFunctor<ExecSpace, MemorySpace>{ws, bw, plan, dfinal, siso});
  mamba3_row_launch(exec, "kmamba::mamba3::value_backward", tokens,
                    Mamba3ValueBackwardFunctor<ExecSpace, MemorySpace>{in, bw, plan, dfinal, grads.dv, siso});
  mamba3_for(exec, "kmamba::mamba3::dtheta_chunk_sum", head_chunks * plan.nangles,
             Mamba3DthetaChunkSumFunctor<MemorySpace>{ws, bw, plan});
  mamba3_for(exec, "kmamba::mamba3::dtheta_passing", static_cast<std::int64_t>(head_league) * plan.nangles,
             Mamba3DthetaPassingFunctor<MemorySpace>{ws, plan, dfinal, grads.dinitial});
  mamba3_for(exec, "kmamba::mamba3::angle_backward", head_chunks * plan.nangles,
             Mamba3AngleBackwardFunctor<MemorySpace>{in, ws, bw, plan, grads.dangles});
  mamba3_for(exec, "kmamba::mamba3::scalar_backward", tokens,
             Mamba3ScalarBackwardFunctor<MemorySpace>{in, bw, plan, grads.ddt, grads.dtrap});
  mamba3_for(exec, "kmamba::mamba3::group_sum",
             static_cast<std::int64_t>(plan.batch) * plan.seqlen * plan.rank * plan.ngroups * plan.dstate,
             Mamba3GroupSumFunctor<MemorySpace>{bw, grads, plan});
  mamba3_for(exec, "kmamba::mamba3::bias_partial", head_chunks * plan.rank * plan.dstate,
             Mamba3BiasPartialFunctor<MemorySpace>{bw, plan});
  Kokkos::parallel_for("kmamba::mamba3::bias_sum",
                       Kokkos::RangePolicy<ExecSpace>(exec, 0, plan.nheads * plan.rank * plan.dstate),
                       Mamba3BiasSumFunctor<MemorySpace>{bw, grads, plan});
  if (in.mimo) {
    Kokkos::parallel_for("kmamba::mamba3::projection_sum",
                         Kokkos::RangePolicy<ExecSpace>(exec, 0, plan.nheads * plan.rank * plan.headdim),
                         Mamba3ProjectionSumFunctor<MemorySpace>{in, bw, grads, plan, dout});
  }
  if (grads.dD.is_allocated()) {
    Kokkos::parallel_for("kmamba::mamba3::skip_sum", Kokkos::RangePolicy<ExecSpace>(exec, 0, plan.nheads),
                         Mamba3SkipSumFunctor<MemorySpace>{bw.partial, grads.dD});
  }
}

/// The backward on the chunk stages (MIMO; the SISO scan runs on the SSD: impl/Mamba3SisoSsd.hpp).
template <MatmulPrecision Precision, class ExecSpace, class MemorySpace>
void mamba3_backward_stages(const ExecSpace& exec, const Mamba3Plan& plan, const Mamba3Operands<MemorySpace>& in,
                            const ConstTensor4<float, MemorySpace>& dout,
                            const Mamba3StateViews<const float, MemorySpace>& dfinal,
                            const Mamba3GradViews<MemorySpace>& grads) {
  using S = Mamba3Scratch<ExecSpace>;
  const std::size_t scratch = S::bytes(plan.chunk, plan.rank, plan.tile);
  const std::size_t block_scratch = S::block_bytes(plan.chunk, plan.rank, plan.tile, plan.headdim, plan.dstate);
  const int chunk_league = plan.batch * plan.nchunks * plan.nheads;
  const Mamba3Workspace<MemorySpace> ws(plan, true);
  mamba3_prepare<Precision>(exec, plan, in, ws, Mamba3StateViews<float, MemorySpace>());
  // The rows y_t,r are kept for the projection sums; the gate backward (rank projections, and z
  // when given) runs inside the recomputed chunk scan.
  const Mamba3BackwardWorkspace<MemorySpace> bw(plan, true, true);
  mamba3_launch(
      exec, "kmamba::mamba3::chunk_scan_gate_backward", plan, chunk_league,
      Mamba3ChunkScanFunctor<ExecSpace, MemorySpace, true, Precision>{in, ws, plan, {}, dout, bw.g, grads.dz, bw.y},
      scratch, block_scratch);
  mamba3_launch(exec, "kmamba::mamba3::chunk_dstates", plan, chunk_league,
                Mamba3ChunkDstatesFunctor<ExecSpace, MemorySpace, Precision>{ws, bw, plan}, scratch);
  mamba3_for(exec, "kmamba::mamba3::state_passing_backward", mamba3_state_items(plan),
             Mamba3StatePassingBackwardFunctor<MemorySpace>{ws, bw, plan, dfinal, grads.dinitial});
  mamba3_launch(exec, "kmamba::mamba3::chunk_backward", plan, chunk_league,
                Mamba3ChunkBackwardFunctor<ExecSpace, MemorySpace, Precision>{in, ws, bw, plan, grads.dadt}, scratch,
                block_scratch);
  mamba3_backward_tail(exec, plan, in, ws, bw, dout, dfinal, grads);
}

template <class ExecSpace, class MemorySpace>
void mamba3_step_impl(const ExecSpace& exec, const char* function, const Mamba3Dims& dims,
                      const Mamba3StepOperands<MemorySpace>& in, const Mamba3StateViews<float, MemorySpace>& states,
                      const Tensor3<float, MemorySpace>& out) {
  using Vec = typename Mamba3Scratch<ExecSpace>::Vec;
  const Mamba3Plan plan = mamba3_plan<ExecSpace>(function, dims, 1);
  const int R = plan.rank;
  const std::size_t scratch =
      2 * Vec::shmem_size(R * plan.dstate) + Vec::shmem_size(R * plan.headdim) + Vec::shmem_size(plan.nangles);
  mamba3_launch(exec, "kmamba::mamba3::step", plan, plan.batch * plan.nheads,
                Mamba3StepFunctor<ExecSpace, MemorySpace>{in, states, out, plan}, scratch);
}

}  // namespace impl
}  // namespace kmamba

#endif
