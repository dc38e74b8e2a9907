// A small matrix product computed by one Kokkos team, shared by the SSD chunk stages
// (kmamba/core/impl/SsdImpl.hpp) for their per-chunk products (C·Bᵀ, x·(δ·decay·B)ᵀ, W·x, ...).
//
//   TeamGemm<ExecSpace>::apply(team, m, n, k, a, b, store);
//
// computes, for every i < m and j < n, sum = Σ_{l<k} a(i, l)·b(l, j) in fp32 (l in increasing
// order) and calls store(i, j, sum) exactly once. `a` and `b` are callables returning float: they
// may read team scratch or global memory, apply masks and scales, or concatenate two operands
// along l, so that a stage never materialises its operands just to multiply them. They are only
// called inside 0 ≤ i < m, 0 ≤ l < k, 0 ≤ j < n.
//
// Per backend:
// - host backends: each team thread takes whole rows and accumulates a block of columns at once,
//   so that the innermost loop runs over j (contiguous in the stages' operands, vectorisable);
// - Cuda: the team (team_threads threads) stages (64 × depth) tiles of a and (depth × 64) tiles of
//   b in level-0 team scratch, evaluating each operand element once per (64 × 64) output block,
//   and every thread accumulates a 4 × 4 block of outputs in registers; the next tiles are
//   fetched into registers while the current ones are multiplied;
// - otherwise (and on Cuda when the team has another size or no scratch was reserved): the m·n
//   outputs spread over the team's threads and each sum over the thread's vector lanes.
//
// Launch contract: a launch whose functor calls apply reserves scratch_bytes of level-0 team
// scratch beyond what the functor itself allocates, uses the launch_bounds policy property, and
// prefers teams of team_threads threads (0: no preference). apply uses that scratch past the
// functor's own allocations (it allocates from a copy of the team's scratch space, so repeated
// calls reuse the same bytes).
// Synchronisation: the caller places a team barrier between writing data that a or b read and
// the call, and between the call and reading what store wrote (the Cuda version also
// synchronises internally, the others do not).
#ifndef KMAMBA_CORE_IMPL_TEAMGEMM_HPP
#define KMAMBA_CORE_IMPL_TEAMGEMM_HPP

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <type_traits>

namespace kmamba {
namespace impl {

/// Host form: each team thread owns rows and accumulates `block` columns at once.
template <class Member, class AOperand, class BOperand, class Store>
KOKKOS_INLINE_FUNCTION void team_gemm_rows(const Member& team, const int m, const int n, const int k,
                                           const AOperand& a, const BOperand& b, const Store& store) {
  constexpr int block = 64;
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, m), [&](const int i) {
    for (int j0 = 0; j0 < n; j0 += block) {
      const int width = n - j0 < block ? n - j0 : block;
      float acc[block] = {};
      for (int l = 0; l < k; ++l) {
        const float ail = a(i, l);
        for (int j = 0; j < width; ++j) acc[j] += ail * b(l, j0 + j);
      }
      for (int j = 0; j < width; ++j) store(i, j0 + j, acc[j]);
    }
  });
}

/// Generic form: outputs over the team's threads, each sum over the thread's vector lanes.
template <class Member, class AOperand, class BOperand, class Store>
KOKKOS_INLINE_FUNCTION void team_gemm_lanes(const Member& team, const int m, const int n, const int k,
                                            const AOperand& a, const BOperand& b, const Store& store) {
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, m * n), [&](const int ij) {
    const int i = ij / n;
    const int j = ij % n;
    float sum = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(team, k), [&](const int l, float& acc) { acc += a(i, l) * b(l, j); }, sum);
    Kokkos::single(Kokkos::PerThread(team), [&]() { store(i, j, sum); });
  });
}

template <class ExecSpace>
struct TeamGemm {
  static constexpr int team_threads = 0;
  static constexpr std::size_t scratch_bytes = 0;
  using launch_bounds = Kokkos::LaunchBounds<>;

  template <class Member, class AOperand, class BOperand, class Store>
  KOKKOS_INLINE_FUNCTION static void apply(const Member& team, const int m, const int n, const int k,
                                           const AOperand& a, const BOperand& b, const Store& store) {
    if constexpr (std::is_same<typename ExecSpace::memory_space, Kokkos::HostSpace>::value) {
      team_gemm_rows(team, m, n, k, a, b, store);
    } else {
      team_gemm_lanes(team, m, n, k, a, b, store);
    }
  }
};

#if defined(KOKKOS_ENABLE_CUDA)
template <>
struct TeamGemm<Kokkos::Cuda> {
  static constexpr int team_threads = 256;  // a 16 × 16 grid of threads over each output block
  static constexpr int block = 64;          // output rows and columns per block: 4 × 4 per thread
  static constexpr int depth = 16;          // reduced index per staged tile
  static constexpr int lda = block + 4;     // padded rows of the staged tiles: no bank conflicts on
  static constexpr int ldb = block + 8;     // the stores into them, 16-byte aligned rows
  static constexpr int loads = block * depth / team_threads;  // operand elements a thread stages
  static constexpr std::size_t scratch_bytes = sizeof(float) * depth * (lda + ldb) + 16;
  /// Two teams per multiprocessor: at most 128 registers a thread.
  using launch_bounds = Kokkos::LaunchBounds<team_threads, 2>;

  template <class Member, class AOperand, class BOperand, class Store>
  KOKKOS_INLINE_FUNCTION static void apply(const Member& team, const int m, const int n, const int k,
                                           const AOperand& a, const BOperand& b, const Store& store) {
#ifdef __CUDA_ARCH__
    typename Kokkos::Cuda::scratch_memory_space space = team.team_scratch(0);
    float* const stage = static_cast<float*>(space.get_shmem_aligned(scratch_bytes - 16, 16, 0));
    if (stage == nullptr || static_cast<int>(blockDim.x * blockDim.y * blockDim.z) != team_threads) {
      team_gemm_lanes(team, m, n, k, a, b, store);
    } else {
      blocks(team, stage, m, n, k, a, b, store);
    }
#else
    team_gemm_lanes(team, m, n, k, a, b, store);
#endif
  }

#ifdef __CUDA_ARCH__
 private:
  // Reads this thread's share of the (block × depth) tile of a at (i0, l0) and of the
  // (depth × block) tile of b at (l0, j0), zero outside the product. A warp reads a 4 (i) × 8 (l)
  // patch of a and a 4 (l) × 8 (j) patch of b, which keeps its global reads within a few cache
  // lines whichever index the operand has contiguous.
  template <class AOperand, class BOperand>
  KOKKOS_FORCEINLINE_FUNCTION static void fetch(const AOperand& a, const BOperand& b, const int m, const int n,
                                                const int k, const int i0, const int j0, const int l0,
                                                const int warp, const int lane, float (&ra)[loads],
                                                float (&rb)[loads]) {
#pragma unroll
    for (int r = 0; r < loads; ++r) {
      const int i = i0 + (warp + 8 * (r % 2)) * 4 + ((lane >> 3) & 3), l = l0 + (r / 2) * 8 + (lane & 7);
      ra[r] = i < m && l < k ? a(i, l) : 0.0f;
    }
#pragma unroll
    for (int r = 0; r < loads; ++r) {
      const int l = l0 + r * 4 + ((lane >> 3) & 3), j = j0 + warp * 8 + (lane & 7);
      rb[r] = l < k && j < n ? b(l, j) : 0.0f;
    }
  }

  // Output blocks of block × block; thread (ty, tx) of the 16 × 16 grid owns rows 4·ty..4·ty+3 and
  // columns 4·tx..4·tx+3. A warp covers 4 × 8 grid cells, so that its float4 reads of the staged
  // tiles touch 64 and 128 consecutive bytes. The next tiles are fetched into registers while the
  // current ones are multiplied.
  template <class Member, class AOperand, class BOperand, class Store>
  KOKKOS_FORCEINLINE_FUNCTION static void blocks(const Member& team, float* const stage, const int m, const int n,
                                                 const int k, const AOperand& a, const BOperand& b,
                                                 const Store& store) {
    float* const As = stage;                // [depth][lda], As[l][i] = a(i0 + i, l0 + l)
    float* const Bs = stage + depth * lda;  // [depth][ldb], Bs[l][j] = b(l0 + l, j0 + j)
    const int tid = static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x);
    const int warp = tid >> 5, lane = tid & 31;
    const int ty = (warp >> 1) * 4 + (lane >> 3);
    const int tx = (warp & 1) * 8 + (lane & 7);
    for (int i0 = 0; i0 < m; i0 += block) {
      for (int j0 = 0; j0 < n; j0 += block) {
        float ra[loads], rb[loads];
        float acc[4][4];
#pragma unroll
        for (int r = 0; r < 4; ++r) {
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[r][c] = 0.0f;
        }
        fetch(a, b, m, n, k, i0, j0, 0, warp, lane, ra, rb);
        for (int l0 = 0; l0 < k; l0 += depth) {
          team.team_barrier();
#pragma unroll
          for (int r = 0; r < loads; ++r) {
            As[((r / 2) * 8 + (lane & 7)) * lda + (warp + 8 * (r % 2)) * 4 + ((lane >> 3) & 3)] = ra[r];
            Bs[(r * 4 + ((lane >> 3) & 3)) * ldb + warp * 8 + (lane & 7)] = rb[r];
          }
          team.team_barrier();
          if (l0 + depth < k) fetch(a, b, m, n, k, i0, j0, l0 + depth, warp, lane, ra, rb);
#pragma unroll
          for (int l = 0; l < depth; ++l) {
            const float4 av = *reinterpret_cast<const float4*>(As + l * lda + 4 * ty);
            const float4 bv = *reinterpret_cast<const float4*>(Bs + l * ldb + 4 * tx);
            const float ar[4] = {av.x, av.y, av.z, av.w};
            const float br[4] = {bv.x, bv.y, bv.z, bv.w};
#pragma unroll
            for (int r = 0; r < 4; ++r) {
#pragma unroll
              for (int c = 0; c < 4; ++c) acc[r][c] += ar[r] * br[c];
            }
          }
        }
#pragma unroll
        for (int r = 0; r < 4; ++r) {
#pragma unroll
          for (int c = 0; c < 4; ++c) {
            const int i = i0 + 4 * ty + r, j = j0 + 4 * tx + c;
            if (i < m && j < n) store(i, j, acc[r][c]);
          }
        }
      }
    }
  }
#endif
};
#endif

}  // namespace impl
}  // namespace kmamba

#endif
