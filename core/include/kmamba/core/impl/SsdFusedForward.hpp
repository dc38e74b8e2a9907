// The fused SSD forward (SsdArgs::matmul_precision = BFloat16): one team per (batch, head) walks
// the sequence's chunks in order with the running state on chip, on the warp tiles of
// impl/WarpTile.hpp (tensor cores on Cuda, the portable form elsewhere).
//
// A team has 8 warps. Warp w keeps rows n ∈ [16w, 16w+16) of the transposed state Hᵀ (N × P,
// fp32) in registers (dstate / 16 of the warps hold a block). The chunk's rows arrive in scratch
// as they are (fp32) by asynchronous copies (impl/AsyncCopy.hpp) issued during the chunk before:
// C, B and the per-token values once phase 0 has read them, x and z once phase 2 has. Per chunk of
// Q = 32 tokens (t, s index tokens of the chunk, p the head's channels, n the states):
//   phase 0  δ_t and the inclusive cumsum cum_t of δ·a (warp 0); C and B rows from their copies
//            to bf16 tiles; Hᵀ to scratch as bf16;
//   phase 1  Xd[s][p] = bf16(δ_s·x[s][p]); warps 0, 1 (rows t ∈ [16w, 16w+16)):
//            S[t][s] = exp(cum_t − cum_s)·Σ_n C[t][n]·B[s][n] for s ≤ t, 0 above, to scratch;
//   phase 2  warp w: the output block t ∈ 16·(w/4) + [0, 16), p ∈ 16·(w%4) + [0, 16):
//            Y[t][p] = exp(cum_t)·Σ_n C[t][n]·Hᵀ[n][p] + Σ_s S[t][s]·Xd[s][p], and
//            out = (Y + D·x)·silu(z) to global memory (pairs of channels per store); all threads:
//            B[s][n] *= exp(cum_{Q−1} − cum_s);
//   phase 3  Hᵀ[n][p] = exp(cum_{Q−1})·Hᵀ[n][p] + Σ_s B[s][n]·Xd[s][p].
// The code takes any Q that is a multiple of 32 (a warp's lanes scan 32 tokens at a time). Q is 32:
// the score accumulators hold Q columns, and at two teams per SM a thread has 128 registers, which
// 64 columns exceed.
// Tokens past the sequence end read as zero (δ = 0, so the cumsum and the state stand still).
// Compiled for headdim 64 and dstate 16, 32, 64 or 128 (ssd_fused_forward_supported), whatever
// chunk_size asks for (the result is the same function of the inputs); other shapes, and seq_idx,
// take the staged forward of SsdImpl.hpp.
//
// A caller built on the SSD may hand the forward per-head operands (SsdFusedHeadOperands): B and C
// formed per head from shared rows as they are staged (a bias per head, then a rotation by per-token
// angles given as their cosines and sines: the Mamba-3 SISO scan, impl/Mamba3SisoSsd.hpp, which so
// never writes per-head rows), a skip factor per token D[h] + w_t·(C_t·B_t) formed from the same
// fp32 rows in place of D, and the output before the gate. The kernel takes them as a template
// switch (PerHead), so that the plain SSD's kernel carries none of their work.
//
// Numerics: the operands of the four products are rounded to bf16 (C, B, δ·x, the state, the
// decayed C·Bᵀ and the decayed B); sums, the state, δ and the cumsums are fp32; the decays and
// the gate take the hardware's approximate functions (impl/DeviceMath.hpp), whose errors are far
// below the operands' rounding. The Mamba-3 rotation reads the cosines and sines its angle scan
// took once with the exact functions, as the rotate stage that forms per-head rows does, so that
// both paths round the same fp32 rotations to bf16. Against exact
// arithmetic the output carries a relative error of order 2^-8 of the magnitudes summed (each
// product term has operands within 2^-9 relative of their exact values).
#ifndef KMAMBA_CORE_IMPL_SSDFUSEDFORWARD_HPP
#define KMAMBA_CORE_IMPL_SSDFUSEDFORWARD_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/impl/AsyncCopy.hpp>
#include <kmamba/core/impl/DeviceMath.hpp>
#include <kmamba/core/impl/SsdOperands.hpp>
#include <kmamba/core/impl/WarpTeamLaunch.hpp>
#include <kmamba/core/impl/WarpTile.hpp>
#include <kmamba/core/Math.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kmamba {
namespace impl {

/// The chunk length and headdim the fused forward is compiled for, and its warps per team.
constexpr int ssd_fused_chunk = 32;
constexpr int ssd_fused_headdim = 64;
constexpr int ssd_fused_warps = 8;

/// Scratch layout of the fused forward for N states: the product operands bf16 with rows padded
/// by 8 (C and B as [Q][N + 8], Xd as [Q][P + 8], Hᵀ as [N][P + 8], S as [Q][Q + 8]); the chunk's
/// rows as copied, fp32 (x and z as [Q][P + 8], C and B as [Q][N + 4], with per-head operands the
/// cosines and sines of the angles as [Q][N]); then the per-token vectors: δ, cum,
/// exp(cum_{Q−1} − cum), exp(cum) and the skip factor, and the copied dt, log decay and own-token
/// weight, Q floats each.
template <int N, bool PerHead>
struct SsdFusedLayout {
  static constexpr int Q = ssd_fused_chunk, P = ssd_fused_headdim;
  static constexpr int ldn = N + 8, ldp = P + 8, ldq = Q + 8, ldf = P + 8, ldr = N + 4, lda = N;
  static constexpr int vectors = 8;
  static constexpr std::size_t c_offset = 0, b_offset = c_offset + static_cast<std::size_t>(Q) * ldn;
  static constexpr std::size_t x_offset = b_offset + static_cast<std::size_t>(Q) * ldn;
  static constexpr std::size_t h_offset = x_offset + static_cast<std::size_t>(Q) * ldp;
  static constexpr std::size_t s_offset = h_offset + static_cast<std::size_t>(N) * ldp;
  static constexpr std::size_t xr_offset_bytes = (s_offset + static_cast<std::size_t>(Q) * ldq) * 2;
  static constexpr std::size_t zr_offset_bytes = xr_offset_bytes + static_cast<std::size_t>(Q) * ldf * sizeof(float);
  static constexpr std::size_t cr_offset_bytes = zr_offset_bytes + static_cast<std::size_t>(Q) * ldf * sizeof(float);
  static constexpr std::size_t br_offset_bytes = cr_offset_bytes + static_cast<std::size_t>(Q) * ldr * sizeof(float);
  static constexpr std::size_t rotation_offset_bytes =
      br_offset_bytes + static_cast<std::size_t>(Q) * ldr * sizeof(float);
  static constexpr std::size_t vectors_offset_bytes =
      rotation_offset_bytes + (PerHead ? static_cast<std::size_t>(Q) * lda * sizeof(float) : 0);
  static constexpr std::size_t bytes = vectors_offset_bytes + vectors * Q * sizeof(float);
  static_assert(xr_offset_bytes % 16 == 0 && ldf * sizeof(float) % 16 == 0 && ldr * sizeof(float) % 16 == 0,
                "SsdFusedLayout: copied rows 16-byte aligned");
};

/// Four consecutive floats from global memory (16-byte aligned on Cuda).
KOKKOS_INLINE_FUNCTION void ssd_load4(const float* p, float (&v)[4]) {
#if defined(__CUDA_ARCH__)
  const float4 q = *reinterpret_cast<const float4*>(p);
  v[0] = q.x;
  v[1] = q.y;
  v[2] = q.z;
  v[3] = q.w;
#else
  for (int i = 0; i < 4; ++i) v[i] = p[i];
#endif
}

/// 16 bytes from src to dst (both 16-byte aligned on Cuda).
KOKKOS_INLINE_FUNCTION void ssd_copy16(const void* src, void* dst) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
#else
  std::memcpy(dst, src, 16);
#endif
}

/// Two floats to p: one 8-byte store where `paired` says p is 8-byte aligned (Cuda).
KOKKOS_INLINE_FUNCTION void ssd_store2(float* p, float a, float b, bool paired) {
#if defined(__CUDA_ARCH__)
  if (paired) {
    *reinterpret_cast<float2*>(p) = make_float2(a, b);
    return;
  }
#else
  (void)paired;
#endif
  p[0] = a;
  p[1] = b;
}

/// Two floats from p: one 8-byte load where `paired` says p is 8-byte aligned (Cuda).
KOKKOS_INLINE_FUNCTION void ssd_load2(const float* p, bool paired, float& a, float& b) {
#if defined(__CUDA_ARCH__)
  if (paired) {
    const float2 v = *reinterpret_cast<const float2*>(p);
    a = v.x;
    b = v.y;
    return;
  }
#else
  (void)paired;
#endif
  a = p[0];
  b = p[1];
}

/// Four floats, each times `scale`, stored as bf16 at dst (8-byte aligned) in one 8-byte store.
KOKKOS_INLINE_FUNCTION void ssd_store4_bf16(std::uint16_t* dst, const float (&v)[4], float scale) {
  const std::uint64_t lo = pack_bf16x2(v[0] * scale, v[1] * scale), hi = pack_bf16x2(v[2] * scale, v[3] * scale);
  *reinterpret_cast<std::uint64_t*>(dst) = lo | (hi << 32);
}

/// A thread's share of a (Rows × Cols) fp32 tile of rows from global memory: float4 k of the thread
/// is element (t, n) = (i / (Cols/4), 4·(i % (Cols/4))) with i = thread + k·Threads (when i is within
/// the tile). Loading all of
/// a share before storing any lets the loads overlap (compile-time trip counts, unrolled on the
/// device).
template <int Rows, int Cols, int Threads>
struct SsdRowShare {
  static constexpr int per_row = Cols / 4, items = Rows * per_row;
  static constexpr int count = (items + Threads - 1) / Threads;
  float v[count][4];

  /// row(t) points at the tile's row t (16-byte aligned); rows t ≥ len read as zero.
  template <class Row>
  KOKKOS_INLINE_FUNCTION void load(int thread, int len, const Row& row) {
    KMAMBA_TILE_UNROLL
    for (int k = 0; k < count; ++k) {
      const int i = thread + k * Threads, t = i / per_row, n = 4 * (i % per_row);
      if (i < items && t < len) {
        ssd_load4(row(t) + n, v[k]);
      } else {
        v[k][0] = v[k][1] = v[k][2] = v[k][3] = 0.0f;
      }
    }
  }
  /// f(t, n, v) on each float4 v of the rows t < len (columns n … n + 3).
  template <class F>
  KOKKOS_INLINE_FUNCTION void transform(int thread, int len, const F& f) {
    KMAMBA_TILE_UNROLL
    for (int k = 0; k < count; ++k) {
      const int i = thread + k * Threads, t = i / per_row, n = 4 * (i % per_row);
      if (i < items && t < len) f(t, n, v[k]);
    }
  }
  /// Row t times scale(t), as bf16 into the tile.
  template <class Scale>
  KOKKOS_INLINE_FUNCTION void store(int thread, const ScratchTile& tile, const Scale& scale) const {
    KMAMBA_TILE_UNROLL
    for (int k = 0; k < count; ++k) {
      const int i = thread + k * Threads, t = i / per_row, n = 4 * (i % per_row);
      if (i < items) ssd_store4_bf16(&tile.at(t, n), v[k], scale(t));
    }
  }
};

/// Σ of the parts of a row whose PerRow items (item j = 0 … PerRow − 1 of the row) lie in
/// consecutive threads, then done(sum) once per row: on tensor cores the row is a segment of a
/// warp's lanes (every lane calls this) and its first item's lane calls done; the portable form's
/// one thread calls this for the items in order, `row` carrying the running sum, and calls done
/// at the last item.
template <bool TensorCores, int PerRow, class Done>
KOKKOS_INLINE_FUNCTION void ssd_row_sum(float part, int j, float& row, const Done& done) {
  if constexpr (TensorCores) {
    part = warp_segment_sum<PerRow>(part);
    if (j == 0) done(part);
  } else {
    row = j == 0 ? part : row + part;
    if (j == PerRow - 1) done(row);
  }
}

/// Per-head operands of a caller built on the SSD (used where `per_head` is set). B and C of head h
/// at token t are Rot_t·(B[b,t,g] + bias_B[h]) and Rot_t·(C[b,t,g] + bias_C[h]), Rot_t turning the
/// pairs of states (2i, 2i + 1), i < nangles, by the angle whose cosine and sine are rotation[b,h,t]
/// at 2i and 2i + 1 (the Mamba-3 rotation, kmamba/core/Mamba3Scan.hpp); the skip factor of token t
/// is D[h] + own_weight[b,t,h]·(C_t·B_t) of those rows, with this D (the SsdOperands' D unused);
/// the forward writes the output before the gate to `ungated`, the chunk backward C_t·B_t and the
/// skip factor to qk and skip, where allocated.
template <class MemorySpace>
struct SsdFusedHeadOperands {
  bool per_head = false;
  ConstTensor2<float, MemorySpace> bias_B, bias_C;  // (nheads, dstate)
  ConstTensor4<float, MemorySpace> rotation;        // (batch, nheads, seqlen, 2·nangles): cos, sin pairs
  int nangles = 0;
  ConstTensor1<float, MemorySpace> D;           // (nheads), optional
  ConstTensor3<float, MemorySpace> own_weight;  // (batch, seqlen, nheads): w_t of the skip factor
  Tensor4<float, MemorySpace> ungated;          // (batch, seqlen, nheads, headdim), optional
  Tensor3<float, MemorySpace> qk, skip;         // (batch, seqlen, nheads), optional

  /// The skip factor of token t of head h whose C_t·B_t is qk and weight w.
  KOKKOS_INLINE_FUNCTION float skip_factor(int h, float w, float qk) const {
    return (D.is_allocated() ? D(h) : 0.0f) + w * qk;
  }
  /// Token t's cosine, sine pairs for head h in global memory (read only where nangles > 0).
  KOKKOS_INLINE_FUNCTION const float* token_rotation(int b, int h, int t) const {
    return rotation.data() + b * rotation.stride(0) + h * rotation.stride(1) + t * rotation.stride(2);
  }

  /// States n … n + 3 (n a multiple of 4) of a token's row, biased and rotated for head h by the
  /// token's angles (rot: the token's cosine, sine pairs).
  KOKKOS_INLINE_FUNCTION void rotate(const ConstTensor2<float, MemorySpace>& bias, int h, int n, const float* rot,
                                     float (&v)[4]) const {
    for (int e = 0; e < 4; ++e) v[e] += bias(h, n + e);
    for (int j = 0; j < 2 && n / 2 + j < nangles; ++j) {
      const float c = rot[n + 2 * j], s = rot[n + 2 * j + 1];
      const float v0 = v[2 * j], v1 = v[2 * j + 1];
      v[2 * j] = v0 * c - v1 * s;
      v[2 * j + 1] = v0 * s + v1 * c;
    }
  }
};

/// How the fused forward cuts each sequence: `count` segments of `chunks` chunks (the last may be
/// shorter), walked by teams of their own when count > 1 (see ssd_fused_segments).
template <class MemorySpace>
struct SsdSegments {
  int count = 1, chunks = 0;
  Tensor5<float, MemorySpace> states;  // (batch, nheads, count, headdim, dstate), when count > 1
  Tensor3<float, MemorySpace> decay;   // (batch, nheads, count): exp(Σ δ·a) over each segment
};

/// StatesOnly: the first pass of a segmented sequence, which walks each segment from a zero state
/// and writes only its end state and decay; otherwise the forward proper. PerHead: with the
/// caller's per-head operands (`head`).
template <class ExecSpace, class MemorySpace, int N, bool StatesOnly, bool PerHead>
struct SsdFusedForwardFunctor {
  static constexpr bool tensor_cores = WarpTileTraits<ExecSpace>::tensor_cores;
  using Layout = SsdFusedLayout<N, PerHead>;
  static constexpr int Q = Layout::Q, P = Layout::P, state_blocks = N / warp_tile_rows;
  using Team = WarpTeam<tensor_cores, ssd_fused_warps>;
  static constexpr int slots = Team::warps_per_thread;
  static constexpr int token_blocks = Q / warp_tile_rows, channel_blocks = P / warp_tile_rows;
  static_assert(state_blocks <= ssd_fused_warps && token_blocks * (token_blocks + 1) / 2 <= ssd_fused_warps &&
                    channel_blocks * token_blocks % ssd_fused_warps == 0 && ssd_fused_warps % channel_blocks == 0 &&
                    Q % warp_tile_lanes == 0,
                "SsdFusedForwardFunctor: one state block and one score block per warp, output blocks evenly");
  using StateAccum = WarpAccum<P, tensor_cores>;               // 16 rows of Hᵀ
  using ScoreAccum = WarpAccum<warp_tile_rows, tensor_cores>;  // a 16 × 16 block of S
  static constexpr int score_blocks = token_blocks * (token_blocks + 1) / 2;
  using OutAccum = WarpAccum<warp_tile_rows, tensor_cores>;  // a 16 × 16 block of Y

  SsdOperands<MemorySpace> in;
  SsdPlan plan;
  Tensor4<float, MemorySpace> out;           // (batch, seqlen, nheads, headdim)
  Tensor4<float, MemorySpace> final_states;  // (batch, nheads, headdim, dstate), optional
  SsdSegments<MemorySpace> segments;
  SsdFusedHeadOperands<MemorySpace> head;
  bool paired_stores = false;  // out and head.ungated take 8-byte stores at even channels

  struct Tiles {
    ScratchTile c, b, x, h, s;
    float *xr, *zr;   // the chunk's x and z rows as copied (Layout::ldf)
    float *cr, *br;   // its C and B rows as copied (Layout::ldr)
    float* rotation;  // its per-head angles' cosines and sines as copied (Layout::lda)
    float *delta, *cum, *decay_to_end, *exp_cum, *skip;
    float *dt_raw, *log_decay_raw, *own_weight_raw;  // as copied
  };

  KOKKOS_INLINE_FUNCTION static Tiles tiles(char* base) {
    auto* u16 = reinterpret_cast<std::uint16_t*>(base);
    auto* vec = reinterpret_cast<float*>(base + Layout::vectors_offset_bytes);
    return Tiles{ScratchTile{u16 + Layout::c_offset, Layout::ldn},
                 ScratchTile{u16 + Layout::b_offset, Layout::ldn},
                 ScratchTile{u16 + Layout::x_offset, Layout::ldp},
                 ScratchTile{u16 + Layout::h_offset, Layout::ldp},
                 ScratchTile{u16 + Layout::s_offset, Layout::ldq},
                 reinterpret_cast<float*>(base + Layout::xr_offset_bytes),
                 reinterpret_cast<float*>(base + Layout::zr_offset_bytes),
                 reinterpret_cast<float*>(base + Layout::cr_offset_bytes),
                 reinterpret_cast<float*>(base + Layout::br_offset_bytes),
                 reinterpret_cast<float*>(base + Layout::rotation_offset_bytes),
                 vec,
                 vec + Q,
                 vec + 2 * Q,
                 vec + 3 * Q,
                 vec + 4 * Q,
                 vec + 5 * Q,
                 vec + 6 * Q,
                 vec + 7 * Q};
  }

  /// δ, cum, exp(cum_{Q−1} − cum), exp(cum) and the skip factor from the copied per-token values:
  /// one token per lane of warp 0 on tensor cores, thread 0 otherwise (`rate` = in.decay_rate(h)).
  KOKKOS_INLINE_FUNCTION void stage_decays(const Tiles& sm, int thread, int h, int len, float rate) const {
    const float dt_bias = in.dt_bias_of(h);
    const auto delta_of = [&](int t) { return t < len ? in.dt_value(sm.dt_raw[t] + dt_bias) : 0.0f; };
    const auto log_decay_of = [&](int t, float d) {
      return t < len ? (in.has_log_decay ? sm.log_decay_raw[t] : d * rate) : 0.0f;
    };
    // With per-head operands the skip factors come with the rows (convert_head_rows).
    constexpr bool skips = !StatesOnly && !PerHead;
    const auto skip_of = [&](int t) { return t < len ? in.skip(h) : 0.0f; };
    if constexpr (tensor_cores) {
      if (thread >= warp_tile_lanes) return;
      constexpr int parts = Q / warp_tile_lanes;
      float d[parts], cum[parts], carry = 0.0f;
      KMAMBA_TILE_UNROLL
      for (int k = 0; k < parts; ++k) {
        const int t = thread + k * warp_tile_lanes;
        d[k] = delta_of(t);
        cum[k] = carry + warp_inclusive_sum(log_decay_of(t, d[k]), thread);
        carry = warp_broadcast(cum[k], warp_tile_lanes - 1);
      }
      KMAMBA_TILE_UNROLL
      for (int k = 0; k < parts; ++k) {
        const int t = thread + k * warp_tile_lanes;
        sm.delta[t] = d[k];
        sm.cum[t] = cum[k];
        sm.decay_to_end[t] = exp_approx(carry - cum[k]);
        sm.exp_cum[t] = exp_approx(cum[k]);
        if (skips) sm.skip[t] = skip_of(t);
      }
    } else {
      float cum = 0.0f;
      for (int t = 0; t < Q; ++t) {
        const float d = delta_of(t);
        cum += log_decay_of(t, d);
        sm.delta[t] = d;
        sm.cum[t] = cum;
        sm.exp_cum[t] = exp_approx(cum);
        if (skips) sm.skip[t] = skip_of(t);
      }
      for (int t = 0; t < Q; ++t) sm.decay_to_end[t] = exp_approx(cum - sm.cum[t]);
    }
  }

  /// A copied fp32 tile of rows (Q × N, Layout::ldr floats a row) to a bf16 tile.
  KOKKOS_INLINE_FUNCTION static void convert_tile(int thread, const float* raw, const ScratchTile& tile) {
    constexpr int per_row = N / 4, items = Q * per_row;
    KMAMBA_TILE_UNROLL
    for (int k = 0; k < (items + Team::threads - 1) / Team::threads; ++k) {
      const int i = thread + k * Team::threads, t = i / per_row, n = 4 * (i % per_row);
      if (i >= items) continue;
      float v[4];
      ssd_load4(raw + t * Layout::ldr + n, v);
      ssd_store4_bf16(&tile.at(t, n), v, 1.0f);
    }
  }

  /// The copied fp32 C and B rows to their bf16 tiles together (float4 item i of the chunk: row
  /// t = i / (N/4), states n … n + 3), each pair through f(t, n, c, b) first.
  template <class F>
  KOKKOS_INLINE_FUNCTION static void convert_rows(const Tiles& sm, int thread, const F& f) {
    constexpr int per_row = N / 4, items = Q * per_row;
    KMAMBA_TILE_UNROLL
    for (int k = 0; k < (items + Team::threads - 1) / Team::threads; ++k) {
      const int i = thread + k * Team::threads, t = i / per_row, n = 4 * (i % per_row);
      if (i >= items) continue;
      float c[4], b[4];
      ssd_load4(sm.cr + t * Layout::ldr + n, c);
      ssd_load4(sm.br + t * Layout::ldr + n, b);
      f(t, n, c, b);
      ssd_store4_bf16(&sm.c.at(t, n), c, 1.0f);
      ssd_store4_bf16(&sm.b.at(t, n), b, 1.0f);
    }
  }

  /// convert_rows with per-head operands: rows t < len biased and rotated for head h, and the skip
  /// factor of each token, head.D[h] + w_t·(C_t·B_t), from the fp32 rows. A row's N/4 items lie in
  /// consecutive threads (a segment of a warp's lanes on tensor cores, which sum their parts of
  /// C_t·B_t; the portable form's one thread takes them in order).
  KOKKOS_INLINE_FUNCTION void convert_head_rows(const Tiles& sm, int thread, int h, int len) const {
    constexpr int per_row = N / 4;
    static_assert(!tensor_cores || (Team::threads % per_row == 0 && warp_tile_lanes % per_row == 0),
                  "SsdFusedForwardFunctor: a row's items in one segment of a warp");
    float row = 0.0f;
    convert_rows(sm, thread, [&](int t, int n, float(&c)[4], float(&b)[4]) {
      float dot = 0.0f;
      if (t < len) {
        head.rotate(head.bias_C, h, n, sm.rotation + t * Layout::lda, c);
        head.rotate(head.bias_B, h, n, sm.rotation + t * Layout::lda, b);
        for (int e = 0; e < 4; ++e) dot += c[e] * b[e];
      }
      if constexpr (!StatesOnly) {
        ssd_row_sum<tensor_cores, per_row>(dot, n / 4, row, [&](float qk) {
          sm.skip[t] = t < len ? head.skip_factor(h, sm.own_weight_raw[t], qk) : 0.0f;
        });
      }
    });
  }

  /// Phase 0: the decays; C and B from their copies to bf16 tiles (biased and rotated per head
  /// with per-head operands); Hᵀ to scratch.
  KOKKOS_INLINE_FUNCTION void stage_chunk(const Tiles& sm, int thread, int h, int len, float rate,
                                          const StateAccum (&H)[slots]) const {
    stage_decays(sm, thread, h, len, rate);
    if constexpr (PerHead) {
      convert_head_rows(sm, thread, h, len);
    } else {
      convert_tile(thread, sm.cr, sm.c);
      convert_tile(thread, sm.br, sm.b);
    }
    if (!StatesOnly) {
      Team::for_each_warp(thread, [&](int slot, int w, int lane) {
        if (w < state_blocks) warp_store_bf16(H[slot], lane, sm.h.offset(warp_tile_rows * w, 0));
      });
    }
  }

  /// Copies of chunk c's C and B rows, dt, log decays, own-token weights and rotations (as the
  /// operands have them) into scratch; rows past the sequence read as zero.
  KOKKOS_INLINE_FUNCTION void copy_rows(const Tiles& sm, int thread, int b, int h, int g, int c) const {
    const int t0 = c * Q, len = plan.seqlen - t0 < Q ? plan.seqlen - t0 : Q;
    constexpr int per_row = N / 4;
    for (int i = thread; i < Q * per_row; i += Team::threads) {
      const int t = i / per_row, n = 4 * (i % per_row);
      const bool valid = t < len;
      async_copy16(sm.cr + t * Layout::ldr + n, valid ? &in.C(b, t0 + t, g, n) : in.C.data(), valid);
      async_copy16(sm.br + t * Layout::ldr + n, valid ? &in.B(b, t0 + t, g, n) : in.B.data(), valid);
    }
    for (int t = thread; t < Q; t += Team::threads) {
      const bool valid = t < len;
      async_copy4(sm.dt_raw + t, valid ? &in.dt(b, t0 + t, h) : in.dt.data(), valid);
      if (in.has_log_decay) {
        async_copy4(sm.log_decay_raw + t, valid ? &in.log_decay(b, t0 + t, h) : in.log_decay.data(), valid);
      }
      if (PerHead && !StatesOnly) {
        async_copy4(sm.own_weight_raw + t, valid ? &head.own_weight(b, t0 + t, h) : head.own_weight.data(), valid);
      }
    }
    if constexpr (PerHead) copy_rotation(sm, thread, b, h, t0, len);
  }

  /// Copies of the chunk's cosine, sine pairs (2·nangles floats a token) into scratch.
  KOKKOS_INLINE_FUNCTION void copy_rotation(const Tiles& sm, int thread, int b, int h, int t0, int len) const {
    const int width = 2 * head.nangles;
    for (int i = thread; i < Q * width; i += Team::threads) {
      const int t = i / width, a = i % width;
      const bool valid = t < len;
      async_copy4(sm.rotation + t * Layout::lda + a, valid ? &head.rotation(b, h, t0 + t, a) : head.rotation.data(),
                  valid);
    }
  }

  /// Copies of chunk c's x rows (and z rows when gated) into scratch; past the sequence zero.
  KOKKOS_INLINE_FUNCTION void copy_inputs(const Tiles& sm, int thread, int b, int h, int c) const {
    const int t0 = c * Q, len = plan.seqlen - t0 < Q ? plan.seqlen - t0 : Q;
    constexpr int per_row = P / 4;
    for (int i = thread; i < Q * per_row; i += Team::threads) {
      const int t = i / per_row, p = 4 * (i % per_row);
      const bool valid = t < len;
      async_copy16(sm.xr + t * Layout::ldf + p, valid ? &in.x(b, t0 + t, h, p) : in.x.data(), valid);
      if (gated()) async_copy16(sm.zr + t * Layout::ldf + p, valid ? &in.z(b, t0 + t, h, p) : in.z.data(), valid);
    }
  }

  /// Whether the output is gated by z (the forward proper only).
  KOKKOS_INLINE_FUNCTION bool gated() const { return !StatesOnly && in.has_z; }

  /// Phase 1, all threads: Xd = bf16(δ_s·x[s][p]) from the fp32 rows.
  KOKKOS_INLINE_FUNCTION void scale_x(const Tiles& sm, int thread) const {
    constexpr int items = Q * P / 4;
    KMAMBA_TILE_UNROLL
    for (int k = 0; k < (items + Team::threads - 1) / Team::threads; ++k) {
      const int i = thread + k * Team::threads, s = i / (P / 4), p = 4 * (i % (P / 4));
      if (i >= items) continue;
      float v[4];
      ssd_load4(sm.xr + s * Layout::ldf + p, v);
      ssd_store4_bf16(&sm.x.at(s, p), v, sm.delta[s]);
    }
  }

  /// Phase 1 of warp w < score_blocks: the w-th 16 × 16 block (tb, sb), sb ≤ tb, of the decayed
  /// C·Bᵀ in row order, to scratch (one block per warp, so that the phase takes one block's time).
  KOKKOS_INLINE_FUNCTION void scores(const Tiles& sm, int w, int lane) const {
    if (w >= score_blocks) return;
    int tb = 0;
    while ((tb + 1) * (tb + 2) / 2 <= w) ++tb;
    const int sb = w - tb * (tb + 1) / 2;
    ScoreAccum S;
    warp_fill(S, lane, 0.0f);
    warp_mma<ALayout::MK, BLayout::NK, N, false>(S, lane, sm.c.offset(warp_tile_rows * tb, 0),
                                                 sm.b.offset(warp_tile_rows * sb, 0), warp_tile_rows);
    S.for_each(lane, [&](int r, int c, float& v) {
      const int t = warp_tile_rows * tb + r, s = warp_tile_rows * sb + c;
      v = s <= t ? v * exp_approx(sm.cum[t] - sm.cum[s]) : 0.0f;
    });
    warp_store_bf16(S, lane, sm.s.offset(warp_tile_rows * tb, warp_tile_rows * sb));
  }

  /// The blocks of S above the diagonal: zero in every chunk, written once.
  KOKKOS_INLINE_FUNCTION void zero_upper_scores(const Tiles& sm, int thread) const {
    for (int i = thread; i < Q * Q; i += Team::threads) {
      const int t = i / Q, s = i % Q;
      if (s / warp_tile_rows > t / warp_tile_rows) sm.s.at(t, s) = 0;
    }
  }

  /// Phase 2 of warp w: its 16 × 16 blocks of the output, to global memory.
  KOKKOS_INLINE_FUNCTION void output(const Tiles& sm, int w, int lane, int b, int h, int t0, int len) const {
    constexpr int warps_per_row = ssd_fused_warps / channel_blocks;
    for (int tb = w / channel_blocks; tb < token_blocks; tb += warps_per_row) {
      output_block(sm, tb, w % channel_blocks, lane, b, h, t0, len);
    }
  }

  /// The output block of tokens 16·tb + [0, 16) and channels 16·pb + [0, 16).
  KOKKOS_INLINE_FUNCTION void output_block(const Tiles& sm, int tb, int pb, int lane, int b, int h, int t0,
                                           int len) const {
    OutAccum Y;
    warp_fill(Y, lane, 0.0f);
    warp_mma<ALayout::MK, BLayout::KN, N, false>(Y, lane, sm.c.offset(warp_tile_rows * tb, 0),
                                                 sm.h.offset(0, warp_tile_rows * pb), warp_tile_rows);
    Y.for_each(lane, [&](int r, int, float& v) { v *= sm.exp_cum[warp_tile_rows * tb + r]; });
    warp_mma<ALayout::MK, BLayout::KN, Q, false>(Y, lane, sm.s.offset(warp_tile_rows * tb, 0),
                                                 sm.x.offset(0, warp_tile_rows * pb), warp_tile_rows);
    Y.for_each_pair(lane, [&](int r, int c, float& v0, float& v1) {
      const int t = warp_tile_rows * tb + r, p = warp_tile_rows * pb + c;
      if (t >= len) return;
      const float* x = sm.xr + t * Layout::ldf + p;
      const float skip = sm.skip[t];
      float y0 = v0 + skip * x[0], y1 = v1 + skip * x[1];
      if (PerHead && head.ungated.is_allocated()) ssd_store2(&head.ungated(b, t0 + t, h, p), y0, y1, paired_stores);
      if (in.has_z) {
        const float* z = sm.zr + t * Layout::ldf + p;
        y0 *= silu_approx(z[0]);
        y1 *= silu_approx(z[1]);
      }
      ssd_store2(&out(b, t0 + t, h, p), y0, y1, paired_stores);
    });
  }

  /// Phase 2, all threads: B[s][n] *= exp(cum_{Q−1} − cum_s), four elements (8 bytes) at a time.
  KOKKOS_INLINE_FUNCTION void decay_b(const Tiles& sm, int thread) const {
    constexpr int items = Q * N / 4;
    KMAMBA_TILE_UNROLL
    for (int k = 0; k < (items + Team::threads - 1) / Team::threads; ++k) {
      const int i = thread + k * Team::threads, s = i / (N / 4), n = 4 * (i % (N / 4));
      if (i >= items) continue;
      float v[4];
      for (int e = 0; e < 4; ++e) v[e] = sm.b.value(s, n + e);
      ssd_store4_bf16(&sm.b.at(s, n), v, sm.decay_to_end[s]);
    }
  }

  /// Phase 3 of a warp with a state block: Hᵀ = exp(cum_{Q−1})·Hᵀ + (decayed B)ᵀ·Xd.
  KOKKOS_INLINE_FUNCTION void update_state(const Tiles& sm, int w, int lane, StateAccum& H) const {
    if (w >= state_blocks) return;
    const float chunk_decay = sm.exp_cum[Q - 1];
    H.for_each(lane, [&](int, int, float& v) { v *= chunk_decay; });
    warp_mma<ALayout::KM, BLayout::KN, Q, false>(H, lane, sm.b.offset(0, warp_tile_rows * w), sm.x, P);
  }

  /// The state entering the team's first chunk (Hᵀ rows n of the warp's block).
  KOKKOS_INLINE_FUNCTION void load_state(int thread, int b, int h, int seg, StateAccum (&H)[slots]) const {
    Team::for_each_warp(thread, [&](int slot, int w, int lane) {
      H[slot].for_each(lane, [&](int r, int p, float& v) {
        const int n = warp_tile_rows * w + r;
        if (StatesOnly || w >= state_blocks) {
          v = 0.0f;
        } else if (segments.count > 1) {
          v = segments.states(b, h, seg, p, n);
        } else {
          v = in.has_initial_states ? in.initial_states(b, h, p, n) : 0.0f;
        }
      });
    });
  }

  /// The state after the team's last chunk: the segment's own end state (StatesOnly) or, for an
  /// unsegmented sequence, final_states.
  KOKKOS_INLINE_FUNCTION void store_state(int thread, int b, int h, int seg, StateAccum (&H)[slots]) const {
    if (!StatesOnly && (segments.count > 1 || !final_states.is_allocated())) return;
    Team::for_each_warp(thread, [&](int slot, int w, int lane) {
      if (w >= state_blocks) return;
      H[slot].for_each(lane, [&](int r, int p, float& v) {
        const int n = warp_tile_rows * w + r;
        if (StatesOnly) {
          segments.states(b, h, seg, p, n) = v;
        } else {
          final_states(b, h, p, n) = v;
        }
      });
    });
  }

  KOKKOS_INLINE_FUNCTION void operator()(const WarpTeamContext& ctx) const {
    const int seg = ctx.league_rank % segments.count, bh = ctx.league_rank / segments.count;
    const int b = bh / plan.nheads, h = bh % plan.nheads;
    const int g = h / plan.heads_per_group;
    const int thread = ctx.thread;  // of Team::threads (ssd_fused_launch)
    const Tiles sm = tiles(ctx.scratch);
    const float rate = in.decay_rate(h);
    StateAccum H[slots];
    load_state(thread, b, h, seg, H);
    const int c_begin = seg * segments.chunks;
    const int c_end = (seg + 1) * segments.chunks < plan.nchunks ? (seg + 1) * segments.chunks : plan.nchunks;
    if (!StatesOnly) zero_upper_scores(sm, thread);
    if (c_begin < c_end) {
      copy_rows(sm, thread, b, h, g, c_begin);
      async_commit();
      copy_inputs(sm, thread, b, h, c_begin);
      async_commit();
    }
    float log_decay = 0.0f;
    for (int c = c_begin; c < c_end; ++c) {
      const int t0 = c * Q, len = plan.seqlen - t0 < Q ? plan.seqlen - t0 : Q;
      async_wait<1>();  // chunk c's rows (its x and z may still be in flight)
      ctx.barrier();
      stage_chunk(sm, thread, h, len, rate, H);
      async_wait<0>();
      ctx.barrier();
      if (c + 1 < c_end) {
        copy_rows(sm, thread, b, h, g, c + 1);
        async_commit();
      }
      scale_x(sm, thread);
      log_decay += sm.cum[Q - 1];
      if (!StatesOnly) Team::for_each_warp(thread, [&](int, int w, int lane) { scores(sm, w, lane); });
      ctx.barrier();
      if (!StatesOnly) Team::for_each_warp(thread, [&](int, int w, int lane) { output(sm, w, lane, b, h, t0, len); });
      decay_b(sm, thread);
      ctx.barrier();
      if (c + 1 < c_end) {
        copy_inputs(sm, thread, b, h, c + 1);
        async_commit();
      }
      Team::for_each_warp(thread, [&](int slot, int w, int lane) { update_state(sm, w, lane, H[slot]); });
    }
    store_state(thread, b, h, seg, H);
    if (StatesOnly && thread == 0) segments.decay(b, h, seg) = kmamba::math::exp(log_decay);
  }
};

/// Passes the segments' states along each sequence: segments.states holds each segment's own end
/// state (from zero) on entry and the state entering it on return; final_states (optional) gets
/// the state after the last segment. One work item per (batch, head, channel, state).
template <class MemorySpace>
struct SsdSegmentPassingFunctor {
  SsdOperands<MemorySpace> in;
  SsdPlan plan;
  SsdSegments<MemorySpace> segments;
  Tensor4<float, MemorySpace> final_states;  // (batch, nheads, headdim, dstate), optional

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int n = static_cast<int>(item % plan.dstate), p = static_cast<int>((item / plan.dstate) % plan.headdim);
    const int bh = static_cast<int>(item / (static_cast<std::int64_t>(plan.dstate) * plan.headdim));
    const int b = bh / plan.nheads, h = bh % plan.nheads;
    float run = in.has_initial_states ? in.initial_states(b, h, p, n) : 0.0f;
    for (int k = 0; k < segments.count; ++k) {
      const float local = segments.states(b, h, k, p, n);
      segments.states(b, h, k, p, n) = run;
      run = segments.decay(b, h, k) * run + local;
    }
    if (final_states.is_allocated()) final_states(b, h, p, n) = run;
  }
};

/// Whether the rows of a (batch, seqlen, heads or groups, width) view start 16-byte aligned: its
/// data and its three outer strides (a view cut from a wider one has strides of its parent).
template <class View>
bool ssd_rows_aligned(const View& v) {
  return reinterpret_cast<std::uintptr_t>(v.data()) % 16 == 0 && v.stride(0) % 4 == 0 && v.stride(1) % 4 == 0 &&
         v.stride(2) % 4 == 0;
}

/// Whether pairs of adjacent channels of a (batch, seqlen, heads, headdim) view start 8-byte aligned
/// at even channels.
template <class View>
bool ssd_pairs_aligned(const View& v) {
  return reinterpret_cast<std::uintptr_t>(v.data()) % 8 == 0 && v.stride(0) % 2 == 0 && v.stride(1) % 2 == 0 &&
         v.stride(2) % 2 == 0;
}

/// Whether the fused forward takes these inputs: headdim 64, dstate 16/32/64/128, no seq_idx, and
/// rows of x, B, C and z 16-byte aligned (they are read four floats at a time). `plan` is the fused
/// forward's own (chunk ssd_fused_chunk).
template <class MemorySpace>
bool ssd_fused_forward_supported(const SsdPlan& plan, const SsdOperands<MemorySpace>& in) {
  const bool dstate = ssd_fused_dstate(plan.dstate);
  return plan.headdim == ssd_fused_headdim && plan.chunk == ssd_fused_chunk && dstate && !in.has_seq_idx &&
         ssd_rows_aligned(in.x) && ssd_rows_aligned(in.B) && ssd_rows_aligned(in.C) &&
         (!in.has_z || ssd_rows_aligned(in.z));
}

template <int N, bool StatesOnly, bool PerHead, class ExecSpace, class MemorySpace>
void ssd_fused_launch(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                      const Tensor4<float, MemorySpace>& out, const Tensor4<float, MemorySpace>& final_states,
                      const SsdSegments<MemorySpace>& segments, const SsdFusedHeadOperands<MemorySpace>& head) {
  using Functor = SsdFusedForwardFunctor<ExecSpace, MemorySpace, N, StatesOnly, PerHead>;
  WarpTeamLauncher<ExecSpace, Functor::Team::threads, 2>::launch(
      exec, StatesOnly ? "kmamba::ssd::fused_segment_states" : "kmamba::ssd::fused_forward",
      plan.batch * plan.nheads * segments.count, Functor::Layout::bytes,
      Functor{in, plan, out, final_states, segments, head,
              ssd_pairs_aligned(out) && (!head.ungated.is_allocated() || ssd_pairs_aligned(head.ungated))});
}

/// Segments per sequence: as many as keep the teams of (batch, head, segment) within one wave of
/// the device (a team of 256 threads per 1024 of the backend's concurrency: two per SM), each
/// segment at least ssd_fused_min_segment_chunks chunks long; 1 where batch × heads teams already
/// fill that wave. Segmenting doubles each team's chunk steps (the segment pass, then the forward),
/// so it pays only where it at least doubles the teams that run at once.
constexpr int ssd_fused_min_segment_chunks = 4;

template <class ExecSpace>
int ssd_fused_segment_count(const ExecSpace& exec, const SsdPlan& plan) {
  const std::int64_t wanted = std::max<std::int64_t>(1, static_cast<std::int64_t>(exec.concurrency()) / 1024);
  const std::int64_t teams = static_cast<std::int64_t>(plan.batch) * plan.nheads;
  const std::int64_t by_length = std::max<std::int64_t>(1, plan.nchunks / ssd_fused_min_segment_chunks);
  const std::int64_t per_wave = wanted / teams;
  return static_cast<int>(per_wave >= 2 ? std::min<std::int64_t>(per_wave, by_length) : 1);
}

/// The fused forward for N states: one pass when batch × heads fills the device; otherwise the
/// segments' end states (from zero), their passing along the sequence, then the forward of every
/// segment from the state entering it.
template <int N, bool PerHead, class ExecSpace, class MemorySpace>
void ssd_fused_forward_states(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                              const Tensor4<float, MemorySpace>& out, const Tensor4<float, MemorySpace>& final_states,
                              int segment_count, const SsdFusedHeadOperands<MemorySpace>& head) {
  SsdSegments<MemorySpace> segments;
  segments.count = std::max(1, std::min(segment_count, plan.nchunks));
  segments.chunks = (plan.nchunks + segments.count - 1) / segments.count;
  segments.count = (plan.nchunks + segments.chunks - 1) / segments.chunks;
  if (segments.count > 1) {
    segments.states = allocate_uninitialized<Tensor5<float, MemorySpace>>(
        "kmamba::ssd::segment_states", plan.batch, plan.nheads, segments.count, plan.headdim, plan.dstate);
    segments.decay = allocate_uninitialized<Tensor3<float, MemorySpace>>("kmamba::ssd::segment_decay", plan.batch,
                                                                         plan.nheads, segments.count);
    ssd_fused_launch<N, true, PerHead>(exec, plan, in, out, final_states, segments, head);
    Kokkos::parallel_for("kmamba::ssd::fused_segment_passing",
                         Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(
                             exec, 0, static_cast<std::int64_t>(plan.batch) * plan.nheads * plan.headdim * plan.dstate),
                         SsdSegmentPassingFunctor<MemorySpace>{in, plan, segments, final_states});
  }
  ssd_fused_launch<N, false, PerHead>(exec, plan, in, out, final_states, segments, head);
}

/// The fused forward for the plan's dstate (ssd_fused_forward_supported must hold), each sequence
/// cut into `segment_count` segments (at most one per chunk; ssd_fused_segment_count chooses it),
/// with a caller's per-head operands when given.
template <class ExecSpace, class MemorySpace>
void ssd_fused_forward(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                       const Tensor4<float, MemorySpace>& out, const Tensor4<float, MemorySpace>& final_states,
                       int segment_count,
                       const SsdFusedHeadOperands<MemorySpace>& head = SsdFusedHeadOperands<MemorySpace>()) {
  ssd_with_fused_dstate(plan.dstate, [&](auto states) {
    constexpr int N = decltype(states)::value;
    if (head.per_head) {
      ssd_fused_forward_states<N, true>(exec, plan, in, out, final_states, segment_count, head);
    } else {
      ssd_fused_forward_states<N, false>(exec, plan, in, out, final_states, segment_count, head);
    }
  });
}

}  // namespace impl
}  // namespace kmamba

#endif
