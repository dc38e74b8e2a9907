// The fused chunk backward of the SSD (SsdArgs::matmul_precision = BFloat16): backward stages
// B4–B9 (docs/algorithms.md §2.6) of one (batch, chunk, head) per team, on the warp tiles of
// impl/WarpTile.hpp (tensor cores on Cuda, the portable form elsewhere), with every operand of
// the chunk on chip. It replaces SsdChunkBackwardFunctor of impl/SsdChunkBackward.hpp; before it,
// the walks of impl/SsdFusedStates.hpp write each chunk's entering state and the gradient of its
// leaving one (bf16), and the sums after it are the staged ones (ssd_fused_backward_stages).
//
// A team has 8 warps; warp w works on the row block rb = w / 2 (16 tokens) and the column half
// cb = w % 2 of each product. Per chunk of Q = 64 tokens (l, s tokens, p channels, n states; Hin
// the entering state, dS the gradient of the leaving one, both P × N):
//   phase 0  x, g (gated dout), B, C rows to scratch as bf16; δ, cum (cumsum of δ·a),
//            exp(cum_l) and exp(cum_last − cum_s); Σ g·x (for dD) from the fp32 rows;
//   phase 1  G = g·xᵀ and CB = C·Bᵀ on the 16 × 32 blocks at or below the diagonal; with the
//            decay w[l][s] = exp(cum_l − cum_s) for s ≤ l (0 above): S = CB·w and M = G·w·δ_s to
//            scratch as bf16, E = M·CB (fp32, s < l) for the gradient of the cumsum;
//   phase 2  the stable sums ddA_intra[j] = Σ_{l≥j} Σ_{s<j} E[l][s] (row prefix sums, then column
//            sums, as the staged stage does);
//   phase 3  Hin and dS (stored as bf16) to scratch (over E), ddA_chunk = exp(cum_last)·Σ Hin·dS (fp32 sums);
//   phase 4  dx = δ_s·(exp(cum_last − cum_s)·B·dSᵀ + Sᵀ·g) + D·g, dC = exp(cum_l)·g·Hin + M·B,
//            dB = exp(cum_last − cum_s)·δ_s·x·dS + Mᵀ·C, with the row dot products the gradient
//            of δ takes (<dx_state, x>, <dx_pre, x>, <dC_state, C>);
//   phase 5  ddA_j = ddA_intra + Σ_{l<j} δ_l<dx_state, x>_l + Σ_{l≥j} <dC_state, C>_l + ddA_chunk,
//            then ddt and the chunk's partial sums of dA, dD and ddt_bias.
// Compiled for headdim 64 and dstate 16, 32, 64 or 128, chunks of 64, no seq_idx
// (ssd_fused_backward_supported); other inputs take the staged backward.
//
// With a caller's per-head operands (SsdFusedHeadOperands, a template switch as in the forward) the
// B and C rows are formed per head as they are staged, dB and dC are the gradients of those rows
// (per head), and each token's C_t·B_t and skip factor are written from the fp32 rows.
//
// Numerics: every term of a gradient is a product of inputs (x, B, C, g), δ and decays, through
// Hin and dS (sums of bf16 products of x and B, g and C: impl/SsdFusedStates.hpp); the products
// round at most five of its factors to bf16 (δ·<B·dSᵀ, x> rounds B, dS and x, and dS's own g and
// C; E rounds C, B, g and x; the dx and dB intra terms round S or M besides their operands), each
// by at most 2^-9 relative, so each term carries a relative error below 2.5·2^-8 (first order) and
// the sums are fp32.
#ifndef KMAMBA_CORE_IMPL_SSDFUSEDBACKWARD_HPP
#define KMAMBA_CORE_IMPL_SSDFUSEDBACKWARD_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Bf16.hpp>
#include <kmamba/core/impl/SsdFusedForward.hpp>
#include <kmamba/core/impl/SsdOperands.hpp>
#include <kmamba/core/impl/WarpTeamLaunch.hpp>
#include <kmamba/core/impl/WarpTile.hpp>
#include <kmamba/core/Math.hpp>

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kmamba {
namespace impl {

/// The chunk length the fused backward is compiled for, and its warps per team.
constexpr int ssd_fused_backward_chunk = 64;
constexpr int ssd_fused_backward_warps = 8;

/// A thread's share of a (Rows × Cols) bf16 tile of contiguous rows in global memory, moved to a
/// scratch tile without conversion: eight values (16 bytes) per item, item i = thread + k·Threads
/// at row i / (Cols/8), column 8·(i % (Cols/8)). All loads are issued before any store.
template <int Rows, int Cols, int Threads>
struct SsdBf16RowShare {
  static constexpr int per_row = Cols / 8, items = Rows * per_row;
  static constexpr int count = (items + Threads - 1) / Threads;
  std::uint32_t v[count][4];  // bf16 pairs, the lower column in the low half

  /// `tile` points at row 0 of Rows rows of Cols values (16-byte aligned).
  KOKKOS_INLINE_FUNCTION void load(int thread, const std::uint16_t* tile) {
    KMAMBA_TILE_UNROLL
    for (int k = 0; k < count; ++k) {
      const int i = thread + k * Threads;
      if (i < items) {
        ssd_copy16(tile + 8 * i, v[k]);
      } else {
        for (int e = 0; e < 4; ++e) v[k][e] = 0;
      }
    }
  }
  KOKKOS_INLINE_FUNCTION void store(int thread, const ScratchTile& tile) const {
    KMAMBA_TILE_UNROLL
    for (int k = 0; k < count; ++k) {
      const int i = thread + k * Threads;
      if (i < items) ssd_copy16(v[k], &tile.at(i / per_row, 8 * (i % per_row)));
    }
  }
  /// Σ of the products of this share's values and `other`'s, in fp32.
  KOKKOS_INLINE_FUNCTION float dot(const SsdBf16RowShare& other) const {
    float sum = 0.0f;
    for (int k = 0; k < count; ++k)
      for (int e = 0; e < 4; ++e) {
        sum += bf16_bits_to_float(static_cast<std::uint16_t>(v[k][e])) *
               bf16_bits_to_float(static_cast<std::uint16_t>(other.v[k][e]));
        sum += bf16_bits_to_float(static_cast<std::uint16_t>(v[k][e] >> 16)) *
               bf16_bits_to_float(static_cast<std::uint16_t>(other.v[k][e] >> 16));
      }
    return sum;
  }
};

/// Scratch of the fused backward for N states: bf16 tiles x, g as [Q][P + 8], B, C as [Q][N + 8],
/// S, M as [Q][Q + 8]; then one region holding E (fp32 [Q][Q + 8]: pairs of a row stored by a
/// warp's accumulator lanes fall in distinct banks) in phases 1–2 and Hin, dS (bf16 [P][N + 8]
/// each) from phase 3; then the per-token vectors and the team sums' slots.
template <int N>
struct SsdFusedBackwardLayout {
  static constexpr int Q = ssd_fused_backward_chunk, P = ssd_fused_headdim;
  static constexpr int ldp = P + 8, ldn = N + 8, ldq = Q + 8, lde = Q + 8;
  static constexpr std::size_t x_offset = 0, g_offset = x_offset + static_cast<std::size_t>(Q) * ldp;
  static constexpr std::size_t b_offset = g_offset + static_cast<std::size_t>(Q) * ldp;
  static constexpr std::size_t c_offset = b_offset + static_cast<std::size_t>(Q) * ldn;
  static constexpr std::size_t s_offset = c_offset + static_cast<std::size_t>(Q) * ldn;
  static constexpr std::size_t m_offset = s_offset + static_cast<std::size_t>(Q) * ldq;
  static constexpr std::size_t region_offset = m_offset + static_cast<std::size_t>(Q) * ldq;
  static constexpr std::size_t state_tile = static_cast<std::size_t>(P) * ldn;
  static constexpr std::size_t region_bytes = 4 * state_tile > 4 * static_cast<std::size_t>(Q) * lde
                                                  ? 4 * state_tile
                                                  : 4 * static_cast<std::size_t>(Q) * lde;
  static constexpr std::size_t vectors_offset_bytes = region_offset * 2 + region_bytes;
  /// Per-token float vectors: δ, cum, exp(cum), exp(cum_last − cum), ddA_intra, two halves each
  /// of three row dot products, the prefix of one and the suffix of another.
  static constexpr int vectors = 13;
  static constexpr int slots = 4 * ssd_fused_backward_warps;
  static constexpr std::size_t bytes = vectors_offset_bytes + (vectors * Q + slots) * sizeof(float);
};

/// Rows read four floats at a time need 16-byte aligned data.
inline bool ssd_fused_backward_aligned(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

template <class ExecSpace, class MemorySpace, int N, bool PerHead>
struct SsdFusedBackwardFunctor {
  static constexpr bool tensor_cores = WarpTileTraits<ExecSpace>::tensor_cores;
  using Layout = SsdFusedBackwardLayout<N>;
  static constexpr int Q = Layout::Q, P = Layout::P, R = warp_tile_rows;
  using Team = WarpTeam<tensor_cores, ssd_fused_backward_warps>;
  /// Columns of dB and dC per warp (warps of the second half idle where N = 16).
  static constexpr int NC = N / 2 < 16 ? 16 : N / 2;
  static_assert(Q == 4 * R && P == 64 && ssd_fused_backward_warps == 8, "SsdFusedBackwardFunctor: 4 × 2 warp blocks");
  using HalfAccum = WarpAccum<32, tensor_cores>;   // a 16 × 32 block of G, CB or dx
  using StateAccum = WarpAccum<NC, tensor_cores>;  // a 16 × NC block of dB or dC

  SsdOperands<MemorySpace> in;
  SsdWorkspace<MemorySpace> ws;
  SsdPlan plan;
  ConstTensor4<float, MemorySpace> g;       // (batch, seqlen, nheads, headdim), gated dout
  ConstTensor5<bf16, MemorySpace> hin;      // (batch, nchunks, nheads, headdim, dstate), Hin
  ConstTensor5<bf16, MemorySpace> dstates;  // (batch, nchunks, nheads, headdim, dstate), dS
  Tensor4<float, MemorySpace> dx;           // (batch, seqlen, nheads, headdim)
  Tensor3<float, MemorySpace> ddt;          // (batch, seqlen, nheads)
  Tensor3<float, MemorySpace> dlog_decay;   // (batch, seqlen, nheads), with in.has_log_decay
  Tensor4<float, MemorySpace> dB_head;      // (batch, seqlen, nheads, dstate)
  Tensor4<float, MemorySpace> dC_head;      // (batch, seqlen, nheads, dstate)
  Tensor4<float, MemorySpace> partial;      // (batch, nchunks, nheads, 3): dA, dD, ddt_bias
  bool paired = false;                      // g, dx, dB_head and dC_head take 8-byte accesses at even columns
  SsdFusedHeadOperands<MemorySpace> head;   // with PerHead

  struct Tiles {
    ScratchTile x, g, b, c, s, m, hin, ds;
    float* e;  // [Q][Layout::lde], phases 1–2
    float *delta, *cum, *se_a, *se_last, *intra, *next, *prev, *ddt_direct, *next_before, *prev_after, *slots;
  };

  KOKKOS_INLINE_FUNCTION static Tiles tiles(char* base) {
    auto* u16 = reinterpret_cast<std::uint16_t*>(base);
    auto* vec = reinterpret_cast<float*>(base + Layout::vectors_offset_bytes);
    std::uint16_t* region = u16 + Layout::region_offset;
    Tiles t{ScratchTile{u16 + Layout::x_offset, Layout::ldp},
            ScratchTile{u16 + Layout::g_offset, Layout::ldp},
            ScratchTile{u16 + Layout::b_offset, Layout::ldn},
            ScratchTile{u16 + Layout::c_offset, Layout::ldn},
            ScratchTile{u16 + Layout::s_offset, Layout::ldq},
            ScratchTile{u16 + Layout::m_offset, Layout::ldq},
            ScratchTile{region, Layout::ldn},
            ScratchTile{region + Layout::state_tile, Layout::ldn},
            reinterpret_cast<float*>(region),
            vec,
            vec + Q,
            vec + 2 * Q,
            vec + 3 * Q,
            vec + 4 * Q,
            vec + 5 * Q,
            vec + 7 * Q,
            vec + 9 * Q,
            vec + 11 * Q,
            vec + 12 * Q,
            vec + 13 * Q};
    return t;
  }

  /// Σ over the team of each thread's `value`, in every thread; `slot` picks the scratch slots
  /// (one use per slot per team). Contains a team barrier.
  KOKKOS_INLINE_FUNCTION float team_sum(const WarpTeamContext& ctx, const Tiles& sm, int slot, float value) const {
    float* slots = sm.slots + slot * ssd_fused_backward_warps;
    value = warp_sum(value);
    if (ctx.thread % warp_tile_lanes == 0) slots[ctx.thread / warp_tile_lanes] = value;
    ctx.barrier();
    constexpr int warps = tensor_cores ? ssd_fused_backward_warps : 1;
    float total = 0.0f;
    for (int w = 0; w < warps; ++w) total += slots[w];
    return total;
  }

  /// Phase 0: the per-token vectors and the rows of x, g, B and C; returns the thread's Σ g·x.
  KOKKOS_INLINE_FUNCTION float stage_rows(const Tiles& sm, int thread, const SsdChunkBlock& blk) const {
    const int b = blk.b, h = blk.h, t0 = blk.t0, len = blk.len;
    const auto one = [](int) { return 1.0f; };
    const float last = ws.dA_cs(b, h, blk.c, len - 1);
    for (int t = thread; t < Q; t += Team::threads) {
      const float cum = ws.dA_cs(b, h, blk.c, t < len ? t : len - 1);
      sm.delta[t] = t < len ? ws.dt_out(b, h, blk.c, t) : 0.0f;
      sm.cum[t] = cum;
      sm.se_a[t] = kmamba::math::exp(cum);
      sm.se_last[t] = ssd_decay(last - cum);
    }
    float gx = 0.0f;
    {
      SsdRowShare<Q, P, Team::threads> xs, gs;
      xs.load(thread, len, [&](int t) { return &in.x(b, t0 + t, h, 0); });
      gs.load(thread, len, [&](int t) { return &g(b, t0 + t, h, 0); });
      for (int k = 0; k < xs.count; ++k)
        for (int e = 0; e < 4; ++e) gx += xs.v[k][e] * gs.v[k][e];
      xs.store(thread, sm.x, one);
      gs.store(thread, sm.g, one);
    }
    SsdRowShare<Q, N, Team::threads> bs, cs;
    bs.load(thread, len, [&](int t) { return &in.B(b, t0 + t, blk.g, 0); });
    cs.load(thread, len, [&](int t) { return &in.C(b, t0 + t, blk.g, 0); });
    if constexpr (PerHead) head_rows(thread, blk, bs, cs);
    bs.store(thread, sm.b, one);
    cs.store(thread, sm.c, one);
    return gx;
  }

  /// The staged shares of B and C biased and rotated for the team's head; each token's C_t·B_t and
  /// skip factor to head.qk and head.skip (where allocated), from the fp32 rows.
  template <class Share>
  KOKKOS_INLINE_FUNCTION void head_rows(int thread, const SsdChunkBlock& blk, Share& bs, Share& cs) const {
    const auto rotation = [&](int t) { return head.token_rotation(blk.b, blk.h, blk.t0 + t); };
    bs.transform(thread, blk.len,
                 [&](int t, int n, float(&v)[4]) { head.rotate(head.bias_B, blk.h, n, rotation(t), v); });
    cs.transform(thread, blk.len,
                 [&](int t, int n, float(&v)[4]) { head.rotate(head.bias_C, blk.h, n, rotation(t), v); });
    if (!head.qk.is_allocated()) return;
    float row = 0.0f;
    KMAMBA_TILE_UNROLL
    for (int k = 0; k < Share::count; ++k) {
      const int i = thread + k * Team::threads, t = i / Share::per_row;
      if (i >= Share::items) continue;
      float dot = 0.0f;
      for (int e = 0; e < 4; ++e) dot += bs.v[k][e] * cs.v[k][e];
      ssd_row_sum<tensor_cores, Share::per_row>(dot, i % Share::per_row, row, [&](float qk) {
        if (t >= blk.len) return;
        head.qk(blk.b, blk.t0 + t, blk.h) = qk;
        head.skip(blk.b, blk.t0 + t, blk.h) = head.skip_factor(blk.h, head.own_weight(blk.b, blk.t0 + t, blk.h), qk);
      });
    }
  }

  /// Phase 1 of warp w: its block of G and CB, then S, M and E.
  KOKKOS_INLINE_FUNCTION void scores(const Tiles& sm, int w, int lane) const {
    const int rb = w / 2, cb = w % 2;
    HalfAccum G, CB;
    warp_fill(G, lane, 0.0f);
    warp_fill(CB, lane, 0.0f);
    if (32 * cb <= R * rb + R - 1) {
      warp_mma<ALayout::MK, BLayout::NK, P, false>(G, lane, sm.g.offset(R * rb, 0), sm.x.offset(32 * cb, 0), 32);
      warp_mma<ALayout::MK, BLayout::NK, N, false>(CB, lane, sm.c.offset(R * rb, 0), sm.b.offset(32 * cb, 0), 32);
      HalfAccum::for_each_slot_pair(lane, [&](int r, int c, int i, int k) {
        const int l = R * rb + r;
        float e[2];
        for (int u = 0; u < 2; ++u) {
          const int s = 32 * cb + c + u;
          const float w_ls = s <= l ? ssd_decay(sm.cum[l] - sm.cum[s]) : 0.0f;
          const float m = G.v[i][k + u] * w_ls * sm.delta[s];
          e[u] = m * CB.v[i][k + u];
          G.v[i][k + u] = m;
          CB.v[i][k + u] *= w_ls;
        }
        ssd_store2(sm.e + l * Layout::lde + 32 * cb + c, e[0], e[1], true);
      });
    }
    warp_store_bf16(CB, lane, sm.s.offset(R * rb, 32 * cb));
    warp_store_bf16(G, lane, sm.m.offset(R * rb, 32 * cb));
  }

  /// Phase 2: ddA_intra. Rows of E become their exclusive prefix sums (for j ≤ l), then the
  /// columns are summed over l ≥ j; `columns` picks the second step. On tensor cores a warp scans a
  /// row (two columns per lane), and four lanes sum a column (every fourth row each).
  KOKKOS_INLINE_FUNCTION void intra_sums(const Tiles& sm, int thread, bool columns) const {
    if constexpr (tensor_cores) {
      static_assert(Q == 2 * warp_tile_lanes && Q == 8 * ssd_fused_backward_warps, "intra_sums: 64-token chunks");
      const int w = thread / warp_tile_lanes, lane = thread % warp_tile_lanes;
      if (!columns) {
        for (int i = w; i < Q; i += ssd_fused_backward_warps) {
          float* row = sm.e + i * Layout::lde;
          const int j = 2 * lane;
          const float a0 = j < i ? row[j] : 0.0f, a1 = j + 1 < i ? row[j + 1] : 0.0f;
          const float before = warp_inclusive_sum(a0 + a1, lane) - (a0 + a1);
          if (j <= i) row[j] = before;
          if (j + 1 <= i) row[j + 1] = before + a0;
        }
      } else {
        const int j = 8 * w + lane / 4;
        float sum = 0.0f;
        for (int l = lane % 4; l < Q; l += 4) {
          if (l >= j) sum += sm.e[l * Layout::lde + j];
        }
        sum = warp_quad_sum(sum);
        if (lane % 4 == 0) sm.intra[j] = sum;
      }
    } else {
      for (int i = thread; i < Q; i += Team::threads) {
        float running = 0.0f;
        if (!columns) {
          for (int j = 0; j <= i; ++j) {
            const float v = sm.e[i * Layout::lde + j];
            sm.e[i * Layout::lde + j] = running;
            if (j < i) running += v;
          }
        } else {
          for (int l = i; l < Q; ++l) running += sm.e[l * Layout::lde + i];
          sm.intra[i] = running;
        }
      }
    }
  }

  /// Phase 3: Hin and dS to scratch; returns the thread's Σ Hin·dS.
  KOKKOS_INLINE_FUNCTION float stage_states(const Tiles& sm, int thread, const SsdChunkBlock& blk) const {
    SsdBf16RowShare<P, N, Team::threads> hs, ds;
    hs.load(thread, &hin(blk.b, blk.c, blk.h, 0, 0).bits);
    ds.load(thread, &dstates(blk.b, blk.c, blk.h, 0, 0).bits);
    hs.store(thread, sm.hin);
    ds.store(thread, sm.ds);
    return hs.dot(ds);
  }

  /// Phase 4 of warp w: its 16 × 32 block of dx and the row dot products of δ's gradient.
  KOKKOS_INLINE_FUNCTION void dx_block(const Tiles& sm, int w, int lane, const SsdChunkBlock& blk) const {
    const int rb = w / 2, cb = w % 2;
    HalfAccum D;
    warp_fill(D, lane, 0.0f);
    warp_mma<ALayout::MK, BLayout::NK, N, false>(D, lane, sm.b.offset(R * rb, 0), sm.ds.offset(32 * cb, 0), 32);
    D.for_each(lane, [&](int r, int, float& v) { v *= sm.se_last[R * rb + r]; });
    const auto x_of = [&](int r, int c) { return sm.x.value(R * rb + r, 32 * cb + c); };
    warp_row_sums(D, lane, x_of, [&](int r, float v) { sm.next[cb * Q + R * rb + r] = v; });
    warp_mma<ALayout::KM, BLayout::KN, Q, false>(D, lane, sm.s.offset(0, R * rb), sm.g.offset(0, 32 * cb), 32);
    warp_row_sums(D, lane, x_of, [&](int r, float v) { sm.ddt_direct[cb * Q + R * rb + r] = v; });
    const float skip = in.skip(blk.h);
    D.for_each_pair(lane, [&](int r, int c, float& v0, float& v1) {
      const int s = R * rb + r, p = 32 * cb + c;
      if (s >= blk.len) return;
      float g0, g1;
      ssd_load2(&g(blk.b, blk.t0 + s, blk.h, p), paired, g0, g1);
      ssd_store2(&dx(blk.b, blk.t0 + s, blk.h, p), sm.delta[s] * v0 + skip * g0, sm.delta[s] * v1 + skip * g1, paired);
    });
  }

  /// Phase 4 of warp w: its 16 × NC blocks of dC (and <dC_state, C>) and of dB.
  KOKKOS_INLINE_FUNCTION void state_blocks(const Tiles& sm, int w, int lane, const SsdChunkBlock& blk) const {
    const int rb = w / 2, n0 = NC * (w % 2);
    if (n0 >= N) {  // N = 16: no second half of the state columns, so its row dots are zero
      for (int r = lane; r < R; r += tensor_cores ? warp_tile_lanes : 1) sm.prev[Q + R * rb + r] = 0.0f;
      return;
    }
    StateAccum A;
    warp_fill(A, lane, 0.0f);
    warp_mma<ALayout::MK, BLayout::KN, P, false>(A, lane, sm.g.offset(R * rb, 0), sm.hin.offset(0, n0), NC);
    A.for_each(lane, [&](int r, int, float& v) { v *= sm.se_a[R * rb + r]; });
    warp_row_sums(
        A, lane, [&](int r, int c) { return sm.c.value(R * rb + r, n0 + c); },
        [&](int r, float v) { sm.prev[(w % 2) * Q + R * rb + r] = v; });
    warp_mma<ALayout::MK, BLayout::KN, Q, false>(A, lane, sm.m.offset(R * rb, 0), sm.b.offset(0, n0), NC);
    A.for_each_pair(lane, [&](int r, int c, float& v0, float& v1) {
      const int l = R * rb + r;
      if (l < blk.len) ssd_store2(&dC_head(blk.b, blk.t0 + l, blk.h, n0 + c), v0, v1, paired);
    });
    warp_fill(A, lane, 0.0f);
    warp_mma<ALayout::MK, BLayout::KN, P, false>(A, lane, sm.x.offset(R * rb, 0), sm.ds.offset(0, n0), NC);
    A.for_each(lane, [&](int r, int, float& v) { v *= sm.se_last[R * rb + r] * sm.delta[R * rb + r]; });
    warp_mma<ALayout::KM, BLayout::KN, Q, false>(A, lane, sm.m.offset(0, R * rb), sm.c.offset(0, n0), NC);
    A.for_each_pair(lane, [&](int r, int c, float& v0, float& v1) {
      const int s = R * rb + r;
      if (s < blk.len) ssd_store2(&dB_head(blk.b, blk.t0 + s, blk.h, n0 + c), v0, v1, paired);
    });
  }

  /// Phase 5, first step: Σ_{l<j} δ_l·<dx_state, x>_l (warp 0) and Σ_{l≥j} <dC_state, C>_l (warp 1),
  /// two tokens per lane on tensor cores (the portable form's one thread walks all).
  KOKKOS_INLINE_FUNCTION void token_scans(const Tiles& sm, int thread) const {
    if constexpr (tensor_cores) {
      const int w = thread / warp_tile_lanes, lane = thread % warp_tile_lanes;
      if (w > 1) return;
      float carry = 0.0f;
      for (int half = 0; half < 2; ++half) {
        // warp 0 walks tokens upwards (exclusive prefix), warp 1 downwards (inclusive suffix).
        const int j = w == 0 ? half * warp_tile_lanes + lane : Q - 1 - (half * warp_tile_lanes + lane);
        const float v = w == 0 ? sm.delta[j] * (sm.next[j] + sm.next[Q + j]) : sm.prev[j] + sm.prev[Q + j];
        const float inclusive = warp_inclusive_sum(v, lane) + carry;
        if (w == 0) {
          sm.next_before[j] = inclusive - v;
        } else {
          sm.prev_after[j] = inclusive;
        }
        carry = warp_broadcast(inclusive, warp_tile_lanes - 1);
      }
    } else {
      float before = 0.0f, after = 0.0f;
      for (int j = 0; j < Q; ++j) {
        sm.next_before[j] = before;
        before += sm.delta[j] * (sm.next[j] + sm.next[Q + j]);
        const int k = Q - 1 - j;
        after += sm.prev[k] + sm.prev[Q + k];
        sm.prev_after[k] = after;
      }
    }
  }

  /// Phase 5, second step: ddt of each token; returns the thread's (Σ ddA·δ, Σ ddt).
  KOKKOS_INLINE_FUNCTION Kokkos::pair<float, float> token_gradients(const Tiles& sm, int thread,
                                                                    const SsdChunkBlock& blk, float dda_chunk) const {
    const float rate = in.decay_rate(blk.h);
    float dA_sum = 0.0f, dbias_sum = 0.0f;
    for (int j = thread; j < blk.len; j += Team::threads) {
      const float dda = sm.intra[j] + sm.next_before[j] + sm.prev_after[j] + dda_chunk;
      if (in.has_log_decay) dlog_decay(blk.b, blk.t0 + j, blk.h) = dda;
      float ddt_j = dda * rate + sm.ddt_direct[j] + sm.ddt_direct[Q + j];
      const float pre = in.dt_pre(blk.b, blk.t0 + j, blk.h);
      const float unclamped = in.dt_unclamped(pre);
      if (unclamped < in.dt_min || unclamped > in.dt_max) ddt_j = 0.0f;
      if (in.dt_softplus) ddt_j *= softplus_derivative(pre);
      ddt(blk.b, blk.t0 + j, blk.h) = ddt_j;
      dA_sum += dda * sm.delta[j];
      dbias_sum += ddt_j;
    }
    return {dA_sum, dbias_sum};
  }

  KOKKOS_INLINE_FUNCTION void operator()(const WarpTeamContext& ctx) const {
    const SsdChunkBlock blk = ssd_chunk_block(plan, ctx.league_rank);
    const Tiles sm = tiles(ctx.scratch);
    const int thread = ctx.thread;
    const float gx = stage_rows(sm, thread, blk);
    ctx.barrier();
    Team::for_each_warp(thread, [&](int, int w, int lane) { scores(sm, w, lane); });
    ctx.barrier();
    intra_sums(sm, thread, false);
    ctx.barrier();
    intra_sums(sm, thread, true);
    ctx.barrier();
    const float hd = stage_states(sm, thread, blk);
    const float dda_chunk = kmamba::math::exp(ws.dA_cs(blk.b, blk.h, blk.c, blk.len - 1)) *
                            team_sum(ctx, sm, 0, hd);  // its barrier also orders phase 3 before 4
    Team::for_each_warp(thread, [&](int, int w, int lane) {
      dx_block(sm, w, lane, blk);
      state_blocks(sm, w, lane, blk);
    });
    ctx.barrier();
    token_scans(sm, thread);
    ctx.barrier();
    const Kokkos::pair<float, float> sums = token_gradients(sm, thread, blk, dda_chunk);
    const float dA_sum = team_sum(ctx, sm, 1, sums.first);
    const float dbias_sum = team_sum(ctx, sm, 2, sums.second);
    const float dD_sum = team_sum(ctx, sm, 3, gx);
    if (thread == 0) {
      partial(blk.b, blk.c, blk.h, 0) = dA_sum;
      partial(blk.b, blk.c, blk.h, 1) = dD_sum;
      partial(blk.b, blk.c, blk.h, 2) = dbias_sum;
    }
  }
};

/// Whether the fused backward takes these inputs: headdim 64, dstate 16/32/64/128, no seq_idx,
/// 16-byte aligned x, B and C (the gated dout must be too: ssd_fused_backward_aligned). `plan` is
/// the fused backward's own (chunk 64).
template <class MemorySpace>
bool ssd_fused_backward_supported(const SsdPlan& plan, const SsdOperands<MemorySpace>& in) {
  const bool dstate = ssd_fused_dstate(plan.dstate);
  return plan.headdim == ssd_fused_headdim && plan.chunk == ssd_fused_backward_chunk && dstate && !in.has_seq_idx &&
         ssd_fused_backward_aligned(in.x.data()) && ssd_fused_backward_aligned(in.B.data()) &&
         ssd_fused_backward_aligned(in.C.data());
}

template <int N, bool PerHead, class ExecSpace, class MemorySpace>
void ssd_fused_backward_launch(const ExecSpace& exec,
                               const SsdFusedBackwardFunctor<ExecSpace, MemorySpace, N, PerHead>& f) {
  using Functor = SsdFusedBackwardFunctor<ExecSpace, MemorySpace, N, PerHead>;
  WarpTeamLauncher<ExecSpace, Functor::Team::threads, 2>::launch(exec, "kmamba::ssd::fused_chunk_backward",
                                                                 f.plan.batch * f.plan.nchunks * f.plan.nheads,
                                                                 Functor::Layout::bytes, f);
}

/// The fused chunk backward for the plan's dstate (ssd_fused_backward_supported must hold), with a
/// caller's per-head operands when given.
template <class ExecSpace, class MemorySpace>
void ssd_fused_chunk_backward(
    const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in, const SsdWorkspace<MemorySpace>& ws,
    const SsdNonDeduced<ConstTensor4<float, MemorySpace>>& g, const SsdNonDeduced<ConstTensor5<bf16, MemorySpace>>& hin,
    const SsdNonDeduced<ConstTensor5<bf16, MemorySpace>>& dstates, const SsdNonDeduced<Tensor4<float, MemorySpace>>& dx,
    const SsdNonDeduced<Tensor3<float, MemorySpace>>& ddt, const SsdNonDeduced<Tensor3<float, MemorySpace>>& dlog_decay,
    const SsdNonDeduced<Tensor4<float, MemorySpace>>& dB_head,
    const SsdNonDeduced<Tensor4<float, MemorySpace>>& dC_head,
    const SsdNonDeduced<Tensor4<float, MemorySpace>>& partial,
    const SsdFusedHeadOperands<MemorySpace>& head = SsdFusedHeadOperands<MemorySpace>()) {
  const bool paired =
      ssd_pairs_aligned(g) && ssd_pairs_aligned(dx) && ssd_pairs_aligned(dB_head) && ssd_pairs_aligned(dC_head);
  const auto run = [&](auto states) {
    constexpr int N = decltype(states)::value;
    const auto launch = [&](auto per_head) {
      constexpr bool PerHead = decltype(per_head)::value;
      ssd_fused_backward_launch<N, PerHead>(
          exec, SsdFusedBackwardFunctor<ExecSpace, MemorySpace, N, PerHead>{
                    in, ws, plan, g, hin, dstates, dx, ddt, dlog_decay, dB_head, dC_head, partial, paired, head});
    };
    if (head.per_head) {
      launch(std::true_type());
    } else {
      launch(std::false_type());
    }
  };
  ssd_with_fused_dstate(plan.dstate, run);
}

}  // namespace impl
}  // namespace kmamba

#endif
