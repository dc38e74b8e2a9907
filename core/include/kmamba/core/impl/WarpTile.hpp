// Warp-level tile primitives of the fused chunk kernels: bf16 operand tiles in team scratch,
// fp32 accumulators of 16 rows, and the products between them.
//
// A kernel written on these primitives is a sequence of team phases separated by team barriers;
// inside a phase each *warp* (32 threads on Cuda) owns a 16-row accumulator and multiplies
// operand tiles read from scratch. The same source runs on two forms, chosen at compile time by
// WarpTileTraits<ExecSpace>::tensor_cores:
//
// - tensor cores (Cuda): the accumulator is the fragment layout of `mma.sync.aligned.m16n8k16`
//   (bf16 operands, fp32 sums) spread over the warp's lanes; operands come from scratch through
//   `ldmatrix` (with `.trans` for the transposed layouts) or, for the A operand, from another
//   accumulator converted to bf16 in registers (the accumulator layout of an m16n8 product is the
//   A layout of the next, so a state held in registers multiplies without passing through
//   scratch);
// - portable (every other backend, and the tests' oracle): one team thread runs every warp in
//   turn (warps_per_thread of them), each accumulator is a plain 16 × Cols array, and a product
//   is a loop over bf16 operands converted to fp32 with fp32 sums in increasing k.
//
// Both forms round the operands alike (bf16, round to nearest even); they differ only in the order
// of the fp32 sums. The accumulator's element (r, c) is reached with for_each(lane, f(r, c, v)),
// which visits exactly the elements the calling lane holds.
//
// Operand tiles are row-major bf16 (bit patterns) in scratch: element (r, c) at data[r·ld + c],
// with ld a multiple of 8 (16-byte rows for ldmatrix; a pad of 8 elements past a power-of-two
// width spreads the rows over the shared-memory banks). The A operand of a product is either MK
// (A.at(m, k)) or KM (A.at(k, m)), the B operand NK (B.at(n, k)) or KN (B.at(k, n)).
#ifndef KMAMBA_CORE_IMPL_WARPTILE_HPP
#define KMAMBA_CORE_IMPL_WARPTILE_HPP

#include <kmamba/core/Bf16.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>

// Loops over a warp's fragments are unrolled on the device, so that fragments stay in registers.
#if defined(__CUDA_ARCH__)
#define KMAMBA_TILE_UNROLL _Pragma("unroll")
#else
#define KMAMBA_TILE_UNROLL
#endif

namespace kmamba {
namespace impl {

/// Whether the execution space multiplies tiles on the tensor cores (the mma.sync form).
template <class ExecSpace>
struct WarpTileTraits {
  static constexpr bool tensor_cores = false;
};
#if defined(KOKKOS_ENABLE_CUDA)
template <>
struct WarpTileTraits<Kokkos::Cuda> {
  static constexpr bool tensor_cores = true;
};
#endif

/// Rows of every warp accumulator.
constexpr int warp_tile_rows = 16;
/// Threads of a warp in the tensor-core form.
constexpr int warp_tile_lanes = 32;

/// A row-major bf16 tile: in team scratch, or rows of a tensor in memory.
struct ScratchTile {
  std::uint16_t* data;
  int ld;
  KOKKOS_INLINE_FUNCTION std::uint16_t& at(int r, int c) const { return data[r * ld + c]; }
  KOKKOS_INLINE_FUNCTION float value(int r, int c) const { return bf16_bits_to_float(at(r, c)); }
  /// The tile whose element (0, 0) is this one's (r, c).
  KOKKOS_INLINE_FUNCTION ScratchTile offset(int r, int c) const { return ScratchTile{data + r * ld + c, ld}; }
};

/// Operand layouts (see the file comment).
enum class ALayout { MK, KM };
enum class BLayout { NK, KN };

template <int Cols, bool TensorCores>
struct WarpAccum;

/// Portable accumulator: all 16 × Cols sums.
template <int Cols>
struct WarpAccum<Cols, false> {
  static_assert(Cols % 16 == 0, "WarpAccum: Cols must be a multiple of 16");
  float v[warp_tile_rows][Cols];

  /// f(r, c, i, k) for each element the lane holds: (r, c) in the tile, v[i][k] its storage (the
  /// same slots in every accumulator of this shape, so that several can be combined elementwise).
  template <class F>
  KOKKOS_INLINE_FUNCTION static void for_each_slot(int /*lane*/, const F& f) {
    for (int r = 0; r < warp_tile_rows; ++r)
      for (int c = 0; c < Cols; ++c) f(r, c, r, c);
  }
  template <class F>
  KOKKOS_INLINE_FUNCTION void for_each(int lane, const F& f) {
    for_each_slot(lane, [&](int r, int c, int i, int k) { f(r, c, v[i][k]); });
  }
  /// f(r, c, i, k) for each pair of adjacent elements (r, c), (r, c + 1) the lane holds (c even),
  /// v[i][k] and v[i][k + 1] their storage.
  template <class F>
  KOKKOS_INLINE_FUNCTION static void for_each_slot_pair(int /*lane*/, const F& f) {
    for (int r = 0; r < warp_tile_rows; ++r)
      for (int c = 0; c < Cols; c += 2) f(r, c, r, c);
  }
  /// f(r, c, v(r, c), v(r, c + 1)) for each pair the lane holds.
  template <class F>
  KOKKOS_INLINE_FUNCTION void for_each_pair(int lane, const F& f) {
    for_each_slot_pair(lane, [&](int r, int c, int i, int k) { f(r, c, v[i][k], v[i][k + 1]); });
  }
};

/// Tensor-core accumulator: n-tile j (columns 8j … 8j+7) holds, in lane (g = lane/4, q = lane%4),
/// (g, 8j+2q), (g, 8j+2q+1), (g+8, 8j+2q), (g+8, 8j+2q+1).
template <int Cols>
struct WarpAccum<Cols, true> {
  static_assert(Cols % 16 == 0, "WarpAccum: Cols must be a multiple of 16");
  float v[Cols / 8][4];

  /// As the portable form's: f(r, c, i, k) with v[i][k] the element (r, c).
  template <class F>
  KOKKOS_INLINE_FUNCTION static void for_each_slot(int lane, const F& f) {
    const int g = lane >> 2, q = lane & 3;
    KMAMBA_TILE_UNROLL
    for (int j = 0; j < Cols / 8; ++j) {
      KMAMBA_TILE_UNROLL
      for (int e = 0; e < 4; ++e) f(g + (e >> 1) * 8, 8 * j + 2 * q + (e & 1), j, e);
    }
  }
  template <class F>
  KOKKOS_INLINE_FUNCTION void for_each(int lane, const F& f) {
    for_each_slot(lane, [&](int r, int c, int i, int k) { f(r, c, v[i][k]); });
  }
  /// As the portable form's: the lane's pairs (g, 8j + 2q) and (g + 8, 8j + 2q).
  template <class F>
  KOKKOS_INLINE_FUNCTION static void for_each_slot_pair(int lane, const F& f) {
    const int g = lane >> 2, q = lane & 3;
    KMAMBA_TILE_UNROLL
    for (int j = 0; j < Cols / 8; ++j) {
      f(g, 8 * j + 2 * q, j, 0);
      f(g + 8, 8 * j + 2 * q, j, 2);
    }
  }
  template <class F>
  KOKKOS_INLINE_FUNCTION void for_each_pair(int lane, const F& f) {
    for_each_slot_pair(lane, [&](int r, int c, int i, int k) { f(r, c, v[i][k], v[i][k + 1]); });
  }
};

/// Two floats as bf16x2 (round to nearest even), `lo` in the low half.
KOKKOS_INLINE_FUNCTION std::uint32_t pack_bf16x2(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  std::uint32_t packed;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;\n" : "=r"(packed) : "f"(hi), "f"(lo));
  return packed;
#else
  return static_cast<std::uint32_t>(float_to_bf16_bits(lo)) |
         (static_cast<std::uint32_t>(float_to_bf16_bits(hi)) << 16);
#endif
}

/// Rows 0 … 15 of `tile` = the accumulator rounded to bf16; pairs of adjacent columns in one
/// 4-byte store on the tensor-core form.
template <int Cols>
KOKKOS_INLINE_FUNCTION void warp_store_bf16(const WarpAccum<Cols, false>& acc, int /*lane*/, const ScratchTile& tile) {
  for (int r = 0; r < warp_tile_rows; ++r)
    for (int c = 0; c < Cols; ++c) tile.at(r, c) = float_to_bf16_bits(acc.v[r][c]);
}
template <int Cols>
KOKKOS_INLINE_FUNCTION void warp_store_bf16(const WarpAccum<Cols, true>& acc, int lane, const ScratchTile& tile) {
  const int g = lane >> 2, q = lane & 3;
  KMAMBA_TILE_UNROLL
  for (int j = 0; j < Cols / 8; ++j) {
    *reinterpret_cast<std::uint32_t*>(&tile.at(g, 8 * j + 2 * q)) = pack_bf16x2(acc.v[j][0], acc.v[j][1]);
    *reinterpret_cast<std::uint32_t*>(&tile.at(g + 8, 8 * j + 2 * q)) = pack_bf16x2(acc.v[j][2], acc.v[j][3]);
  }
}

template <int Cols, bool TensorCores>
KOKKOS_INLINE_FUNCTION void warp_fill(WarpAccum<Cols, TensorCores>& acc, int lane, float value) {
  acc.for_each(lane, [&](int, int, float& v) { v = value; });
}

// ---------------------------------------------------------------------------------------------
// Portable products.

/// acc(r, c) += Σ_{k<Depth} A(r, k)·B(k, c) for c < ncols (a multiple of 16). Causal: only the
/// 16-blocks of k at or below the 16-block of c (k/16 ≤ c/16) are summed, for operands that are
/// zero above that diagonal.
template <ALayout AL, BLayout BL, int Depth, bool Causal, int Cols>
KOKKOS_INLINE_FUNCTION void warp_mma(WarpAccum<Cols, false>& acc, int /*lane*/, const ScratchTile& a,
                                     const ScratchTile& b, int ncols) {
  for (int r = 0; r < warp_tile_rows; ++r) {
    for (int c = 0; c < ncols; ++c) {
      const int depth = Causal ? ((c / 16 + 1) * 16 < Depth ? (c / 16 + 1) * 16 : Depth) : Depth;
      float sum = acc.v[r][c];
      for (int k = 0; k < depth; ++k) {
        const float av = AL == ALayout::MK ? a.value(r, k) : a.value(k, r);
        const float bv = BL == BLayout::NK ? b.value(c, k) : b.value(k, c);
        sum += av * bv;
      }
      acc.v[r][c] = sum;
    }
  }
}

/// acc(r, c) += Σ_{k<Depth} round_bf16(a_acc(r, k))·B(k, c): the A operand is another warp
/// accumulator (Depth columns), rounded to bf16 as the tensor-core form converts it.
template <BLayout BL, int Depth, int Cols>
KOKKOS_INLINE_FUNCTION void warp_mma_registers(WarpAccum<Cols, false>& acc, int /*lane*/,
                                               const WarpAccum<Depth, false>& a_acc, const ScratchTile& b, int ncols) {
  for (int r = 0; r < warp_tile_rows; ++r) {
    for (int c = 0; c < ncols; ++c) {
      float sum = acc.v[r][c];
      for (int k = 0; k < Depth; ++k) {
        const float av = bf16_bits_to_float(float_to_bf16_bits(a_acc.v[r][k]));
        const float bv = BL == BLayout::NK ? b.value(c, k) : b.value(k, c);
        sum += av * bv;
      }
      acc.v[r][c] = sum;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Tensor-core products (Cuda, sm_80 and later).

#if defined(KOKKOS_ENABLE_CUDA)

namespace warp_tile_cuda {

KOKKOS_INLINE_FUNCTION std::uint32_t shared_address(const void* p) {
#if defined(__CUDA_ARCH__)
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
#else
  (void)p;
  return 0u;
#endif
}

/// Four 8 × 8 b16 matrices; `Trans` loads each transposed. Lane l gives the address of row l % 8
/// of matrix l / 8.
template <bool Trans>
KOKKOS_INLINE_FUNCTION void ldmatrix_x4(std::uint32_t (&r)[4], const std::uint16_t* row) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const std::uint32_t addr = shared_address(row);
  if constexpr (Trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
  }
#else
  (void)row;
  r[0] = r[1] = r[2] = r[3] = 0u;
  Kokkos::abort("kmamba: ldmatrix needs a device of compute capability 8.0 or later");
#endif
}

/// d += a·b for one m16n8k16 tile (bf16 operands, fp32 sums).
KOKKOS_INLINE_FUNCTION void mma_bf16(float (&d)[4], const std::uint32_t (&a)[4], std::uint32_t b0, std::uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
  (void)d;
  (void)a;
  (void)b0;
  (void)b1;
  Kokkos::abort("kmamba: mma.sync needs a device of compute capability 8.0 or later");
#endif
}

/// The A fragment (16 × 16, k-block kk) from scratch.
template <ALayout AL>
KOKKOS_INLINE_FUNCTION void load_a(std::uint32_t (&a)[4], const ScratchTile& t, int kk, int lane) {
  const int i = lane >> 3, r = lane & 7;
  if constexpr (AL == ALayout::MK) {
    ldmatrix_x4<false>(a, &t.at(r + (i & 1) * 8, 16 * kk + (i >> 1) * 8));
  } else {
    ldmatrix_x4<true>(a, &t.at(16 * kk + r + (i >> 1) * 8, (i & 1) * 8));
  }
}

/// The B fragments of n-tiles 2jj and 2jj+1 (columns 16jj … 16jj+15) of k-block kk: b[0], b[1]
/// for the first, b[2], b[3] for the second.
template <BLayout BL>
KOKKOS_INLINE_FUNCTION void load_b(std::uint32_t (&b)[4], const ScratchTile& t, int kk, int jj, int lane) {
  const int i = lane >> 3, r = lane & 7;
  if constexpr (BL == BLayout::NK) {
    ldmatrix_x4<false>(b, &t.at(16 * jj + r + (i >> 1) * 8, 16 * kk + (i & 1) * 8));
  } else {
    ldmatrix_x4<true>(b, &t.at(16 * kk + r + (i & 1) * 8, 16 * jj + (i >> 1) * 8));
  }
}

}  // namespace warp_tile_cuda

template <ALayout AL, BLayout BL, int Depth, bool Causal, int Cols>
KOKKOS_INLINE_FUNCTION void warp_mma(WarpAccum<Cols, true>& acc, int lane, const ScratchTile& a, const ScratchTile& b,
                                     int ncols) {
  static_assert(Depth % 16 == 0, "warp_mma: Depth must be a multiple of 16");
  KMAMBA_TILE_UNROLL
  for (int kk = 0; kk < Depth / 16; ++kk) {
    std::uint32_t af[4];
    warp_tile_cuda::load_a<AL>(af, a, kk, lane);
    KMAMBA_TILE_UNROLL
    for (int jj = 0; jj < Cols / 16; ++jj) {
      if (16 * jj >= ncols || (Causal && kk > jj)) continue;
      std::uint32_t bf[4];
      warp_tile_cuda::load_b<BL>(bf, b, kk, jj, lane);
      warp_tile_cuda::mma_bf16(acc.v[2 * jj], af, bf[0], bf[1]);
      warp_tile_cuda::mma_bf16(acc.v[2 * jj + 1], af, bf[2], bf[3]);
    }
  }
}

template <BLayout BL, int Depth, int Cols>
KOKKOS_INLINE_FUNCTION void warp_mma_registers(WarpAccum<Cols, true>& acc, int lane,
                                               const WarpAccum<Depth, true>& a_acc, const ScratchTile& b, int ncols) {
  KMAMBA_TILE_UNROLL
  for (int kk = 0; kk < Depth / 16; ++kk) {
    const float(&lo)[4] = a_acc.v[2 * kk];
    const float(&hi)[4] = a_acc.v[2 * kk + 1];
    const std::uint32_t af[4] = {pack_bf16x2(lo[0], lo[1]), pack_bf16x2(lo[2], lo[3]), pack_bf16x2(hi[0], hi[1]),
                                 pack_bf16x2(hi[2], hi[3])};
    KMAMBA_TILE_UNROLL
    for (int jj = 0; jj < Cols / 16; ++jj) {
      if (16 * jj >= ncols) continue;
      std::uint32_t bf[4];
      warp_tile_cuda::load_b<BL>(bf, b, kk, jj, lane);
      warp_tile_cuda::mma_bf16(acc.v[2 * jj], af, bf[0], bf[1]);
      warp_tile_cuda::mma_bf16(acc.v[2 * jj + 1], af, bf[2], bf[3]);
    }
  }
}

#endif  // KOKKOS_ENABLE_CUDA

/// Inclusive prefix sum of `value` over the lanes of a warp (tensor-core form only: every lane of
/// the warp calls it).
KOKKOS_INLINE_FUNCTION float warp_inclusive_sum(float value, int lane) {
#if defined(__CUDA_ARCH__)
  KMAMBA_TILE_UNROLL
  for (int offset = 1; offset < warp_tile_lanes; offset *= 2) {
    const float other = __shfl_up_sync(0xffffffffu, value, offset);
    if (lane >= offset) value += other;
  }
  return value;
#else
  (void)lane;
  return value;
#endif
}

/// `value` of lane `source` in every lane of the warp (tensor-core form only).
KOKKOS_INLINE_FUNCTION float warp_broadcast(float value, int source) {
#if defined(__CUDA_ARCH__)
  return __shfl_sync(0xffffffffu, value, source);
#else
  (void)source;
  return value;
#endif
}

/// Σ of `value` over the lanes of a warp, in every lane (tensor-core form: every lane of the warp
/// calls it; the portable form's one thread is its own sum).
KOKKOS_INLINE_FUNCTION float warp_sum(float value) {
#if defined(__CUDA_ARCH__)
  KMAMBA_TILE_UNROLL
  for (int offset = warp_tile_lanes / 2; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
#endif
  return value;
}

/// Σ of `value` over each group of Lanes consecutive lanes (lanes Lanes·i … Lanes·i + Lanes − 1, a
/// power of two up to a warp), in each of them (tensor-core form: every lane of the warp calls it;
/// the portable form's one thread is its own sum).
template <int Lanes>
KOKKOS_INLINE_FUNCTION float warp_segment_sum(float value) {
  static_assert(Lanes > 0 && Lanes <= warp_tile_lanes && (Lanes & (Lanes - 1)) == 0,
                "warp_segment_sum: a power-of-two segment of a warp");
#if defined(__CUDA_ARCH__)
  KMAMBA_TILE_UNROLL
  for (int offset = 1; offset < Lanes; offset *= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
#endif
  return value;
}

/// Σ of `value` over each group of four consecutive lanes (lanes 4i … 4i + 3), in each of them.
KOKKOS_INLINE_FUNCTION float warp_quad_sum(float value) { return warp_segment_sum<4>(value); }

/// store(r, Σ_c acc(r, c)·weight(r, c)) for each of the accumulator's 16 rows, once per row (on
/// tensor cores by the lane q = 0 of the four that hold the row, after summing over them).
template <int Cols, class Weight, class Store>
KOKKOS_INLINE_FUNCTION void warp_row_sums(const WarpAccum<Cols, false>& acc, int /*lane*/, const Weight& weight,
                                          const Store& store) {
  for (int r = 0; r < warp_tile_rows; ++r) {
    float sum = 0.0f;
    for (int c = 0; c < Cols; ++c) sum += acc.v[r][c] * weight(r, c);
    store(r, sum);
  }
}
template <int Cols, class Weight, class Store>
KOKKOS_INLINE_FUNCTION void warp_row_sums(const WarpAccum<Cols, true>& acc, int lane, const Weight& weight,
                                          const Store& store) {
  const int g = lane >> 2, q = lane & 3;
  float lo = 0.0f, hi = 0.0f;
  KMAMBA_TILE_UNROLL
  for (int j = 0; j < Cols / 8; ++j) {
    const int c = 8 * j + 2 * q;
    lo += acc.v[j][0] * weight(g, c) + acc.v[j][1] * weight(g, c + 1);
    hi += acc.v[j][2] * weight(g + 8, c) + acc.v[j][3] * weight(g + 8, c + 1);
  }
  lo = warp_quad_sum(lo);
  hi = warp_quad_sum(hi);
  if (q == 0) {
    store(g, lo);
    store(g + 8, hi);
  }
}

/// The warps of a team in the form's order: calls f(slot, warp, lane) for each warp the calling
/// thread takes part in (slot indexes the thread's own accumulators: 0 … warps_per_thread − 1).
template <bool TensorCores, int Warps>
struct WarpTeam {
  /// Team threads per team: a warp of lanes per warp on tensor cores, one thread otherwise.
  static constexpr int threads = TensorCores ? Warps * warp_tile_lanes : 1;
  /// Warp accumulators each thread keeps of one kind.
  static constexpr int warps_per_thread = TensorCores ? 1 : Warps;

  template <class F>
  KOKKOS_INLINE_FUNCTION static void for_each_warp(int thread, const F& f) {
    if constexpr (TensorCores) {
      f(0, thread / warp_tile_lanes, thread % warp_tile_lanes);
    } else {
      for (int w = 0; w < Warps; ++w) f(w, w, 0);
    }
  }
};

}  // namespace impl
}  // namespace kmamba

#endif
