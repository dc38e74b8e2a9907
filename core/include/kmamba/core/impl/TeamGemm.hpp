// A small matrix product computed by one Kokkos team, shared by the SSD chunk stages
// (kmamba/core/impl/SsdChunkForward.hpp, SsdChunkBackward.hpp) for their per-chunk products (C·Bᵀ,
// x·(δ·decay·B)ᵀ, W·x, ...).
//
//   TeamGemm<ExecSpace, Precision>::apply(team, m, n, k, a, b, store);
//
// computes, for every i < m and j < n, sum = Σ_{l<k} a(i, l)·b(l, j) with fp32 sums and calls
// store(i, j, sum) exactly once. `a` and `b` are callables returning float: they may read team
// scratch or global memory, apply masks and scales, or concatenate two operands along l, so that a
// stage never materialises its operands just to multiply them. They are only called inside
// 0 ≤ i < m, 0 ≤ l < k, 0 ≤ j < n.
//
// Precision (kmamba/core/MatmulPrecision.hpp, default Float32) selects the form at compile time:
// Float32 multiplies exactly in fp32 and sums l in increasing order on every backend;
// TensorFloat32 has a form of its own only where `tensor_cores` is true (Cuda), and is Float32
// elsewhere.
//
// Per backend:
// - host backends: each team thread stages b, 64 columns at a time, and 4 rows of a at a time in
//   buffers on its stack (every operand element evaluated once per strip, not once per product
//   term), and keeps a 4 × 8 block of sums in registers while l runs up (team_gemm_host); products
//   deeper than team_gemm_host_depth take whole rows and accumulate 64 columns at once;
// - Cuda: the team (team_threads threads) stages (64 × depth) tiles of a and (depth × 64) tiles of
//   b in level-0 team scratch, evaluating each operand element once per (64 × 64) output block;
//   the next tiles are fetched into registers while the current ones are multiplied. Float32:
//   every thread accumulates a 4 × 4 block of outputs in registers (CUDA cores). TensorFloat32:
//   the tiles are staged rounded to TF32 (round to nearest) and each of the 8 warps multiplies a
//   16 × 32 part of the block with m16n16k8 TF32 warp MMAs (nvcuda::wmma) into fp32
//   accumulators, which leave through a 16 × 16 buffer per warp in the staging scratch;
// - otherwise (and on Cuda when the team has another size or no scratch was reserved, in either
//   precision): the m·n outputs spread over the team's threads and each sum over the thread's
//   vector lanes, in fp32.
//
// Launch contract (the same for both precisions): a launch whose functor calls apply reserves
// scratch_bytes of level-0 team scratch beyond what the functor itself allocates, uses the
// launch_bounds policy property, and prefers teams of team_threads threads (0: no preference).
// apply uses that scratch past the functor's own allocations (it allocates from a copy of the
// team's scratch space, so repeated calls reuse the same bytes).
// Synchronisation: the caller places a team barrier between writing data that a or b read and
// the call, and between the call and reading what store wrote (the Cuda version also
// synchronises internally, the others do not).
#ifndef KMAMBA_CORE_IMPL_TEAMGEMM_HPP
#define KMAMBA_CORE_IMPL_TEAMGEMM_HPP

#include <kmamba/core/MatmulPrecision.hpp>

#include <Kokkos_Core.hpp>

#if defined(KOKKOS_ENABLE_CUDA)
#include <mma.h>
#endif

#include <cstddef>
#include <type_traits>

namespace kmamba {
namespace impl {

/// Deepest product (k) the staged host form takes; deeper ones use team_gemm_rows.
constexpr int team_gemm_host_depth = 512;

/// Host form for products of depth k <= team_gemm_host_depth. Each team thread takes blocks of
/// `rows` rows (block r goes to thread r mod team size); for every 64 columns it stages b's
/// (k × 64) strip once in a buffer of its own, and for each of its row blocks the block's rows of
/// a, so that each operand element is evaluated once per strip and thread rather than once per
/// product term (the operands may form masks and decays). The sums of a rows × `vec` block of
/// outputs stay in registers while l runs up, and the innermost loop (over those `vec` columns)
/// vectorises. Host only: the buffers live on the thread's stack.
template <class Member, class AOperand, class BOperand, class Store>
inline void team_gemm_host(const Member& team, const int m, const int n, const int k, const AOperand& a,
                           const BOperand& b, const Store& store) {
  constexpr int depth = team_gemm_host_depth, cols = 64, rows = 4, vec = 8;
  const int row_blocks = (m + rows - 1) / rows;
  if (team.team_rank() >= row_blocks) return;
  alignas(64) float bs[depth * cols];  // bs[l·cols + j] = b(l, j0 + j), zero past n
  alignas(64) float as[rows * depth];  // as[r·depth + l] = a(i0 + r, l), zero past m
  for (int j0 = 0; j0 < n; j0 += cols) {
    const int width = n - j0 < cols ? n - j0 : cols;
    const int padded = (width + vec - 1) / vec * vec;
    for (int l = 0; l < k; ++l) {
      for (int j = 0; j < width; ++j) bs[l * cols + j] = b(l, j0 + j);
      for (int j = width; j < padded; ++j) bs[l * cols + j] = 0.0f;
    }
    for (int block = team.team_rank(); block < row_blocks; block += team.team_size()) {
      const int i0 = block * rows;
      const int height = m - i0 < rows ? m - i0 : rows;
      for (int r = 0; r < rows; ++r) {
        for (int l = 0; l < k; ++l) as[r * depth + l] = r < height ? a(i0 + r, l) : 0.0f;
      }
      for (int jb = 0; jb < padded; jb += vec) {
        float acc[rows][vec] = {};
        for (int l = 0; l < k; ++l) {
          const float* const bl = bs + l * cols + jb;
          for (int r = 0; r < rows; ++r) {
            const float ar = as[r * depth + l];
            for (int c = 0; c < vec; ++c) acc[r][c] += ar * bl[c];
          }
        }
        for (int r = 0; r < height; ++r) {
          for (int c = 0; c < vec && jb + c < width; ++c) store(i0 + r, j0 + jb + c, acc[r][c]);
        }
      }
    }
  }
}

/// Host form for deeper products: each team thread owns rows and accumulates `block` columns at
/// once.
template <class Member, class AOperand, class BOperand, class Store>
KOKKOS_INLINE_FUNCTION void team_gemm_rows(const Member& team, const int m, const int n, const int k, const AOperand& a,
                                           const BOperand& b, const Store& store) {
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

template <class ExecSpace, MatmulPrecision Precision = MatmulPrecision::Float32>
struct TeamGemm {
  static constexpr int team_threads = 0;
  static constexpr std::size_t scratch_bytes = 0;
  /// Whether Precision has a form of its own here (false: TensorFloat32 computes as Float32).
  static constexpr bool tensor_cores = false;
  using launch_bounds = Kokkos::LaunchBounds<>;

  template <class Member, class AOperand, class BOperand, class Store>
  KOKKOS_INLINE_FUNCTION static void apply(const Member& team, const int m, const int n, const int k, const AOperand& a,
                                           const BOperand& b, const Store& store) {
    if constexpr (std::is_same<typename ExecSpace::memory_space, Kokkos::HostSpace>::value) {
#ifdef __CUDA_ARCH__
      // A host space's functors never run on a GPU; the device pass of a CUDA build compiles this.
      team_gemm_lanes(team, m, n, k, a, b, store);
#else
      if (k <= team_gemm_host_depth) {
        team_gemm_host(team, m, n, k, a, b, store);
      } else {
        team_gemm_rows(team, m, n, k, a, b, store);
      }
#endif
    } else {
      team_gemm_lanes(team, m, n, k, a, b, store);
    }
  }
};

#if defined(KOKKOS_ENABLE_CUDA)
template <MatmulPrecision Precision>
struct TeamGemm<Kokkos::Cuda, Precision> {
  static constexpr bool tensor_cores = Precision == MatmulPrecision::TensorFloat32;
  static constexpr int team_threads = 256;  // Float32: a 16 × 16 grid of threads; TensorFloat32: 8 warps
  static constexpr int block = 64;          // output rows and columns per block
  static constexpr int depth = 16;          // reduced index per staged tile (two MMA steps of 8)
  static constexpr int wide = block + 8;    // the widest staged row, of both forms' layouts
  // Padded rows of the staged tiles, 16-byte aligned. Float32: no bank conflicts on the stores
  // into them. TensorFloat32: a row length of 8 mod 32 words keeps the fragment loads (lanes over
  // 8 rows × 4 columns of a tile) free of bank conflicts, and every fragment's first element
  // 32-byte aligned (rows and fragment offsets are multiples of 8 floats).
  static constexpr int lda = tensor_cores ? block + 8 : block + 4;
  static constexpr int ldb = block + 8;
  static constexpr int loads = block * depth / team_threads;  // operand elements a thread stages
  static constexpr int warps = team_threads / 32;
  static constexpr int mma = 16;  // rows and columns of one accumulator fragment
  /// Both forms fit in the same bytes (the TensorFloat32 output buffers, warps × mma × mma floats,
  /// reuse the tiles), with room to align the staging to 32 bytes.
  static constexpr std::size_t scratch_bytes = sizeof(float) * depth * 2 * wide + 32;
  static_assert(warps * mma * mma <= depth * (lda + ldb), "TeamGemm<Cuda>: the output buffers must fit the tiles");
  static_assert(lda % 8 == 0 || !tensor_cores, "TeamGemm<Cuda>: fragment rows must start 32-byte aligned");
  static_assert(ldb % 8 == 0 && (depth * lda) % 8 == 0, "TeamGemm<Cuda>: fragment rows must start 32-byte aligned");
  /// Two teams per multiprocessor: at most 128 registers a thread.
  using launch_bounds = Kokkos::LaunchBounds<team_threads, 2>;

  template <class Member, class AOperand, class BOperand, class Store>
  KOKKOS_INLINE_FUNCTION static void apply(const Member& team, const int m, const int n, const int k, const AOperand& a,
                                           const BOperand& b, const Store& store) {
#ifdef __CUDA_ARCH__
    typename Kokkos::Cuda::scratch_memory_space space = team.team_scratch(0);
    float* const stage = static_cast<float*>(space.get_shmem_aligned(scratch_bytes - 32, 32, 0));
    if (stage == nullptr || static_cast<int>(blockDim.x * blockDim.y * blockDim.z) != team_threads) {
      team_gemm_lanes(team, m, n, k, a, b, store);
    } else {
#if __CUDA_ARCH__ >= 800
      if constexpr (tensor_cores) {
        tensor_core_blocks(team, stage, m, n, k, a, b, store);
      } else {
        cuda_core_blocks(team, stage, m, n, k, a, b, store);
      }
#else
      cuda_core_blocks(team, stage, m, n, k, a, b, store);
#endif
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
                                                const int k, const int i0, const int j0, const int l0, const int warp,
                                                const int lane, float (&ra)[loads], float (&rb)[loads]) {
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

  // Writes what fetch read into the staged tiles As[l][i] = a(i0 + i, l0 + l) (ld lda) and
  // Bs[l][j] = b(l0 + l, j0 + j) (ld ldb), rounded to TF32 in the tensor-core form.
  KOKKOS_FORCEINLINE_FUNCTION static void put(float* const As, float* const Bs, const int warp, const int lane,
                                              const float (&ra)[loads], const float (&rb)[loads]) {
#pragma unroll
    for (int r = 0; r < loads; ++r) {
      float av = ra[r], bv = rb[r];
#if __CUDA_ARCH__ >= 800
      if constexpr (tensor_cores) {
        av = nvcuda::wmma::__float_to_tf32(av);
        bv = nvcuda::wmma::__float_to_tf32(bv);
      }
#endif
      As[((r / 2) * 8 + (lane & 7)) * lda + (warp + 8 * (r % 2)) * 4 + ((lane >> 3) & 3)] = av;
      Bs[(r * 4 + ((lane >> 3) & 3)) * ldb + warp * 8 + (lane & 7)] = bv;
    }
  }

  // Output blocks of block × block; thread (ty, tx) of the 16 × 16 grid owns rows 4·ty..4·ty+3 and
  // columns 4·tx..4·tx+3. A warp covers 4 × 8 grid cells, so that its float4 reads of the staged
  // tiles touch 64 and 128 consecutive bytes.
  template <class Member, class AOperand, class BOperand, class Store>
  KOKKOS_FORCEINLINE_FUNCTION static void cuda_core_blocks(const Member& team, float* const stage, const int m,
                                                           const int n, const int k, const AOperand& a,
                                                           const BOperand& b, const Store& store) {
    float* const As = stage;                // [depth][lda]
    float* const Bs = stage + depth * lda;  // [depth][ldb]
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
          put(As, Bs, warp, lane, ra, rb);
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

#if __CUDA_ARCH__ >= 800
  // Output blocks of block × block; warp w owns rows 16·(w / 2)..+15 and columns 32·(w % 2)..+31 of
  // a block as two 16 × 16 fp32 accumulator fragments. Per staged tile and step of 8 in l it loads
  // one fragment of a (column-major in As) and two of b (row-major in Bs) and issues two MMAs.
  // After the last tile (and a barrier, as the tiles are still being read) each warp stores its
  // fragments one at a time into its own 16 × 16 row-major buffer at stage + 256·w, and its lanes
  // call store for the buffer's elements (row e / 16, column e % 16 for e = lane + 32·r).
  template <class Member, class AOperand, class BOperand, class Store>
  KOKKOS_FORCEINLINE_FUNCTION static void tensor_core_blocks(const Member& team, float* const stage, const int m,
                                                             const int n, const int k, const AOperand& a,
                                                             const BOperand& b, const Store& store) {
    namespace wmma = nvcuda::wmma;
    float* const As = stage;                // [depth][lda]
    float* const Bs = stage + depth * lda;  // [depth][ldb]
    const int tid = static_cast<int>(threadIdx.y * blockDim.x + threadIdx.x);
    const int warp = tid >> 5, lane = tid & 31;
    const int wi = (warp >> 1) * mma, wj = (warp & 1) * 2 * mma;
    float* const out = stage + warp * mma * mma;
    for (int i0 = 0; i0 < m; i0 += block) {
      for (int j0 = 0; j0 < n; j0 += block) {
        float ra[loads], rb[loads];
        wmma::fragment<wmma::accumulator, mma, mma, 8, float> acc[2];
        wmma::fill_fragment(acc[0], 0.0f);
        wmma::fill_fragment(acc[1], 0.0f);
        fetch(a, b, m, n, k, i0, j0, 0, warp, lane, ra, rb);
        for (int l0 = 0; l0 < k; l0 += depth) {
          team.team_barrier();
          put(As, Bs, warp, lane, ra, rb);
          team.team_barrier();
          if (l0 + depth < k) fetch(a, b, m, n, k, i0, j0, l0 + depth, warp, lane, ra, rb);
#pragma unroll
          for (int l = 0; l < depth; l += 8) {
            wmma::fragment<wmma::matrix_a, mma, mma, 8, wmma::precision::tf32, wmma::col_major> fa;
            wmma::fragment<wmma::matrix_b, mma, mma, 8, wmma::precision::tf32, wmma::row_major> fb[2];
            wmma::load_matrix_sync(fa, As + l * lda + wi, lda);
            wmma::load_matrix_sync(fb[0], Bs + l * ldb + wj, ldb);
            wmma::load_matrix_sync(fb[1], Bs + l * ldb + wj + mma, ldb);
            wmma::mma_sync(acc[0], fa, fb[0], acc[0]);
            wmma::mma_sync(acc[1], fa, fb[1], acc[1]);
          }
        }
        team.team_barrier();
#pragma unroll
        for (int f = 0; f < 2; ++f) {
          wmma::store_matrix_sync(out, acc[f], mma, wmma::mem_row_major);
          __syncwarp();
#pragma unroll
          for (int r = 0; r < mma * mma / 32; ++r) {
            const int e = lane + 32 * r;
            const int i = i0 + wi + e / mma, j = j0 + wj + f * mma + e % mma;
            if (i < m && j < n) store(i, j, out[e]);
          }
          __syncwarp();
        }
      }
    }
  }
#endif
#endif
};
#endif

/// Calls run(std::integral_constant<MatmulPrecision, P>()) once, with P = `requested` where
/// TeamGemm<ExecSpace, P> has a form of its own and P = Float32 otherwise, so that a backend without
/// tensor cores instantiates a stage once.
template <class ExecSpace, class Run>
void with_matmul_precision(const MatmulPrecision requested, const Run& run) {
  using TF32 = std::integral_constant<MatmulPrecision, MatmulPrecision::TensorFloat32>;
  using F32 = std::integral_constant<MatmulPrecision, MatmulPrecision::Float32>;
  if constexpr (TeamGemm<ExecSpace, MatmulPrecision::TensorFloat32>::tensor_cores) {
    if (requested == MatmulPrecision::TensorFloat32) {
      run(TF32());
      return;
    }
  }
  run(F32());
}

}  // namespace impl
}  // namespace kmamba

#endif
