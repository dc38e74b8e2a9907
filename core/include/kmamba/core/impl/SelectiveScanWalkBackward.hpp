// The walk form of the selective scan backward (dstate ≤ selective_scan_walk_states, kmamba's
// chunk): the forward walk's teams, lanes and tiles (impl/SelectiveScanWalk.hpp), the tiles taken
// last to first, each thread's states and their adjoints in its registers.
//
// With ā_t,n = carry_t·exp(δ_t·A_n), g_t = dout_t·silu(z_t) (dout_t without z), the adjoint
// λ_t,n = g_t·C_t,n + μ_t,n where μ_t,n = ā_{t+1},n·λ_{t+1},n and μ_{L−1} = dlast_state:
//   du_t    = D·g_t + δ_t·Σ_n λ_t,n·B_t,n
//   dδ_t    = (u_t·Σ_n λ_t,n·B_t,n + Σ_n A_n·λ_t,n·ā_t,n·h_{t−1},n) · softplus′(delta_t + bias)
//   dz_t    = dout_t·(y_t + D·u_t)·silu′(z_t),   y_t = Σ_n C_t,n·h_t,n
//   dA_n   += δ_t·λ_t,n·ā_t,n·h_{t−1},n           (per channel, over the sequence)
//   dB_t,n += δ_t·u_t·λ_t,n,  dC_t,n += g_t·h_t,n  (per token, over the group's channels)
//   dD     += g_t·u_t,  dδ_bias += dδ_t,  dinitial_state = μ_{−1} = ā_0·λ_0.
// No exp in the adjoint: μ = ā·λ reuses the decay the recompute took.
//
// Per tile, from the state entering it (a checkpoint the walk-form forward writes every tile):
//   1. the boundary walk: the thread's states advanced step by step (Shape::items tokens a step),
//      the state entering each step kept in registers;
//   2. the steps last to first: per state, the step's tokens recomputed from the state entering
//      the step (their decays, entering states and y terms), then λ walked back through them.
// Exps: one per (token, state) in the checkpoint pass, in the boundary walk and in the recompute.
//
// Fixed-order sums (every gradient repeats bit for bit): a channel's lanes add their partial sums
// over states by a shuffle reduce-scatter on Cuda (in lane order in scratch elsewhere), which
// leaves each lane K / lanes tokens of a step to finish; dB and dC of a step are summed over a warp's channels by a
// shuffle reduce-scatter (each thread keeps one (token, dB or dC) sum), stored per warp in
// scratch and added over the warps in warp order once the tile is done, giving the team's block
// of channels' sums (SelectiveScanBlockPartials adds the blocks in block order); dA stays in the
// registers of the thread that owns the state; dD and dδ_bias are summed per lane over its tokens
// and over the lanes at the end.
//
// Two forms run the same source, as the forward's: on Cuda a team is Shape::threads threads of a
// block; elsewhere one thread runs the team's threads in turn and the channel sums meet in
// scratch, so the host tests check the tiles, lanes, checkpoints and padding the GPU uses.
#ifndef KMAMBA_CORE_IMPL_SELECTIVESCANWALKBACKWARD_HPP
#define KMAMBA_CORE_IMPL_SELECTIVESCANWALKBACKWARD_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/Math.hpp>
#include <kmamba/core/impl/AsyncCopy.hpp>
#include <kmamba/core/impl/DeviceMath.hpp>
#include <kmamba/core/impl/SelectiveScanWalk.hpp>
#include <kmamba/core/impl/WarpTeamLaunch.hpp>
#include <kmamba/core/impl/WarpTile.hpp>

#include <Kokkos_Core.hpp>

#include <cstddef>

namespace kmamba {
namespace impl {

/// Backward: one team per (batch, group, block of channels), as the forward walk. Writes du,
/// ddelta, dz (with z), dinitial_state (when allocated), the block's dB and dC sums
/// (partial_dB, partial_dC: (blocks_per_group, batch, ngroups, dstate, seqlen)), and per (batch,
/// channel) dA (partial_dA) and dD, dδ_bias (partial_vectors), which the batch sum adds.
template <class Shape, class MemorySpace>
struct SelectiveScanWalkBackward {
  static constexpr int K = Shape::items, S = selective_scan_lane_states;
  static constexpr int warps = Shape::device ? Shape::threads / 32 : 1;
  /// Channel rows of a buffer: u, δ, z (then dout·silu′(z)), dout (then g), softplus′.
  static constexpr int channel_rows = 5;
  static_assert(!Shape::device || K == 4, "SelectiveScanWalkBackward: the reduce-scatter takes 4 tokens a step");
  using Team = SelectiveScanWalkTeam;
  SelectiveScanWalkTiles<Shape, MemorySpace> tiles;    // tiles.dout: (batch, dim, seqlen)
  ConstTensor3<float, MemorySpace> dlast_state;        // (batch, dim, dstate), optional
  ConstTensor4<float, MemorySpace> checkpoints;        // (batch, dim, ntiles, dstate)
  Tensor3<float, MemorySpace> du, ddelta, dz;          // (batch, dim, seqlen)
  Tensor5<float, MemorySpace> partial_dB, partial_dC;  // (blocks_per_group, batch, ngroups, dstate, seqlen)
  Tensor3<float, MemorySpace> dinitial_state;          // (batch, dim, dstate), optional
  Tensor3<float, MemorySpace> partial_dA;              // (batch, dim, dstate)
  Tensor3<float, MemorySpace> partial_vectors;         // (batch, dim, 2): dD, dδ_bias

  /// A thread's sums over its tokens: dA of its states, dD and dδ_bias of its channel's tokens it
  /// finishes; and the adjoint μ of its states entering the tile walked next.
  struct Sums {
    float mu[S], dA[S], dD, dbias;
  };

  /// Scratch floats past the buffers: per warp a tile's dB and dC sums (2 × state rows × tile);
  /// on host backends also per channel the lanes' sums of y, Σλ·B and Σλ·A·ā·h (3 × tile).
  static std::size_t extra_floats(const SelectiveScanWalkLayout& layout) {
    const std::size_t tile = Shape::tile;
    return warps * 2 * layout.state_rows() * tile + (Shape::device ? 0 : 3 * layout.channels * tile);
  }
  /// Warp w's sum row of dB (which 0) or dC (which 1) for state n.
  KOKKOS_INLINE_FUNCTION float* channel_sum(float* s, int w, int which, int n) const {
    return tiles.layout.extra(s) + ((w * 2 + which) * tiles.layout.state_rows() + n) * Shape::tile;
  }
  /// Host backends: channel c's row of the lanes' sums (0: y, 1: Σλ·B, 2: Σλ·A·ā·h).
  KOKKOS_INLINE_FUNCTION float* lane_sum(float* s, int c, int which) const {
    return channel_sum(s, warps, 0, 0) + (c * 3 + which) * Shape::tile;
  }

  KOKKOS_INLINE_FUNCTION void operator()(const WarpTeamContext& ctx) const {
    float* s = reinterpret_cast<float*>(ctx.scratch);
    const Team tm = tiles.team_of(ctx.league_rank);
    const int first = Shape::device ? ctx.thread : 0, step = Shape::device ? Shape::threads : 1;
    const int ntiles = tiles.ntiles();
    tiles.zero_padding(s, first, step);
    Sums sums[Shape::slots];
    for (int q = 0; q < Shape::slots; ++q) start(tm, Shape::device ? ctx.thread : q, sums[q]);
    if (ntiles > 0) {
      tiles.issue_tile(s, 0, tm, (ntiles - 1) * Shape::tile, first, step);
      async_commit();
      async_wait<0>();
      ctx.barrier();
      prepare_tile(s, 0, tm, (ntiles - 1) * Shape::tile, first, step);
      ctx.barrier();
    }
    for (int k = ntiles - 1; k >= 0; --k) {
      const int p = (ntiles - 1 - k) & 1, t0 = k * Shape::tile;
      if (k > 0) tiles.issue_tile(s, p ^ 1, tm, t0 - Shape::tile, first, step);
      async_commit();
      for (int q = 0; q < Shape::slots; ++q) walk_tile(s, p, tm, k, Shape::device ? ctx.thread : q, sums[q]);
      if constexpr (!Shape::device) finish_summed(s, p, tm, t0, sums);
      ctx.barrier();
      write_channel_sums(s, tm, t0, first, step);
      async_wait<0>();
      ctx.barrier();
      if (k > 0) prepare_tile(s, p ^ 1, tm, t0 - Shape::tile, first, step);
      ctx.barrier();
    }
    for (int q = 0; q < Shape::slots; ++q) finish(tm, Shape::device ? ctx.thread : q, sums[q]);
    write_vectors(tm, Shape::device ? ctx.thread : 0, sums);
  }

  KOKKOS_INLINE_FUNCTION void start(const Team& tm, int th, Sums& sums) const {
    for (int j = 0; j < S; ++j) {
      int d, n;
      const bool own = tiles.owns(tm, th, j, d, n);
      sums.mu[j] = own && dlast_state.is_allocated() ? dlast_state(tm.b, d, n) : 0.0f;
      sums.dA[j] = 0.0f;
    }
    sums.dD = sums.dbias = 0.0f;
  }

  KOKKOS_INLINE_FUNCTION void finish(const Team& tm, int th, const Sums& sums) const {
    for (int j = 0; j < S; ++j) {
      int d, n;
      if (!tiles.owns(tm, th, j, d, n)) continue;
      partial_dA(tm.b, d, n) = sums.dA[j];
      if (dinitial_state.is_allocated()) dinitial_state(tm.b, d, n) = sums.mu[j];
    }
  }

  /// partial_vectors of the team's channels: each channel's lanes' dD and dδ_bias added (Cuda:
  /// xor-shuffles; elsewhere the lanes' slots in order).
  KOKKOS_INLINE_FUNCTION void write_vectors(const Team& tm, int thread, const Sums (&sums)[Shape::slots]) const {
    const int lanes = tiles.layout.lanes;
    if constexpr (Shape::device) {
      float v[2] = {sums[0].dD, sums[0].dbias};
      selective_scan_lane_sum(lanes, v);
      const int c = thread / lanes;
      if (thread % lanes == 0 && c < tm.active) {
        partial_vectors(tm.b, tm.d0 + c, 0) = v[0];
        partial_vectors(tm.b, tm.d0 + c, 1) = v[1];
      }
    } else {
      (void)thread;
      for (int c = 0; c < tm.active; ++c) {
        float dD = 0.0f, dbias = 0.0f;
        for (int l = 0; l < lanes; ++l) {
          dD += sums[c * lanes + l].dD;
          dbias += sums[c * lanes + l].dbias;
        }
        partial_vectors(tm.b, tm.d0 + c, 0) = dD;
        partial_vectors(tm.b, tm.d0 + c, 1) = dbias;
      }
    }
  }

  /// In buffer p (copies complete), per (channel, token), 0 past the sequence and for channels
  /// past the group's end: δ = softplus(delta + bias) and softplus′ (or δ = delta + bias and 1),
  /// g = dout·silu(z) in the dout row and dout·silu′(z) in the z row (g = dout without z); the
  /// carry exponents; on host backends the sums of the tile zeroed.
  KOKKOS_INLINE_FUNCTION void prepare_tile(float* s, int p, const Team& tm, int t0, int first, int step) const {
    const SelectiveScanWalkLayout& layout = tiles.layout;
    const SelectiveScanOperands<MemorySpace>& in = tiles.in;
    for (int i = first; i < layout.channels * Shape::tile; i += step) {
      const int c = i / Shape::tile, t = i % Shape::tile;
      const bool valid = c < tm.active && t0 + t < tiles.seqlen;
      const float pre = valid ? layout.delta(s, p, c)[t] + (in.has_delta_bias ? in.delta_bias(tm.d0 + c) : 0.0f) : 0.0f;
      float derivative = 1.0f;
      layout.delta(s, p, c)[t] = valid ? delta_and_derivative(pre, derivative) : 0.0f;
      layout.derivative(s, p, c)[t] = valid ? derivative : 0.0f;
      const float dy = valid ? layout.dout(s, p, c)[t] : 0.0f;
      if (in.has_z) {
        const float z = valid ? layout.z(s, p, c)[t] : 0.0f, sigmoid = sigmoid_approx(z);
        layout.dout(s, p, c)[t] = dy * z * sigmoid;                           // dout·silu(z)
        layout.z(s, p, c)[t] = dy * sigmoid * (1.0f + z * (1.0f - sigmoid));  // dout·silu′(z)
      } else {
        layout.dout(s, p, c)[t] = dy;
      }
      if (!Shape::device) {
        for (int w = 0; w < 3; ++w) lane_sum(s, c, w)[t] = 0.0f;
      }
    }
    if (!Shape::device) {
      for (int i = 0; i < 2 * layout.state_rows() * Shape::tile; ++i) channel_sum(s, 0, 0, 0)[i] = 0.0f;
    }
    tiles.prepare_carry(s, p, tm, t0, first, step);
  }

  /// δ = softplus(pre) (pre without the softplus), `derivative` = its derivative: one exp for
  /// both, the softplus exactly the forward's (kmamba::softplus), so that the recomputed states
  /// are the checkpoint pass's.
  KOKKOS_INLINE_FUNCTION float delta_and_derivative(float pre, float& derivative) const {
    if (!tiles.in.delta_softplus || pre > softplus_threshold) {
      derivative = 1.0f;
      return pre;
    }
    const float e = kmamba::math::exp(pre);
    derivative = e / (1.0f + e);
    return kmamba::math::log1p(e);
  }

  /// Thread th's states over tile k in buffer p: the boundary walk from the tile's checkpoint,
  /// then the steps last to first.
  KOKKOS_INLINE_FUNCTION void walk_tile(float* s, int p, const Team& tm, int k, int th, Sums& sums) const {
    const SelectiveScanWalkLayout& layout = tiles.layout;
    const int c = th / layout.lanes, lane = th % layout.lanes;
    if (c >= layout.channels) return;  // host shapes whose thread count is not a multiple of lanes
    float A[S], a[S], h[S], entering[Shape::steps][S];
    for (int j = 0; j < S; ++j) {
      int d, n;
      const bool own = tiles.owns(tm, th, j, d, n);
      A[j] = own ? tiles.in.A(d, n) : 0.0f;
      a[j] = A[j] * device_math_log2e;
      h[j] = own ? checkpoints(tm.b, d, k, n) : 0.0f;
    }
    // Unrolled, so that `entering` stays in registers (its index is then a constant).
    KMAMBA_TILE_UNROLL
    for (int step = 0; step < Shape::steps; ++step) {
      for (int j = 0; j < S; ++j) entering[step][j] = h[j];
      if (step + 1 < Shape::steps) advance(s, p, c, lane, step * K, a, h);
    }
    KMAMBA_TILE_UNROLL
    for (int step = Shape::steps - 1; step >= 0; --step) {
      reverse_step(s, p, tm, k * Shape::tile, step * K, th, A, a, entering[step], sums);
    }
  }

  /// h advanced over the K tokens from tile offset t (the boundary walk).
  KOKKOS_INLINE_FUNCTION void advance(float* s, int p, int c, int lane, int t, const float (&a)[S],
                                      float (&h)[S]) const {
    const SelectiveScanWalkLayout& layout = tiles.layout;
    float u[K], dt[K], exponent[K];
    scratch_items(layout.u(s, p, c) + t, u);
    scratch_items(layout.delta(s, p, c) + t, dt);
    scratch_items(layout.carry(s, p) + t, exponent);
    for (int i = 0; i < K; ++i) u[i] *= dt[i];  // now δ·u
    for (int j = 0; j < S; ++j) {
      float B[K];
      scratch_items(layout.B(s, p, lane * S + j) + t, B);
      for (int i = 0; i < K; ++i) h[j] = exp2_approx(dt[i] * a[j] + exponent[i]) * h[j] + u[i] * B[i];
    }
  }

  /// The K tokens from tile offset t, entering state `entering`: per state the tokens recomputed
  /// and λ walked back (mu, dA updated), dB and dC passed to the channel sums; then the lanes'
  /// sums give the tokens' du, ddelta and dz.
  KOKKOS_INLINE_FUNCTION void reverse_step(float* s, int p, const Team& tm, int t0, int t, int th, const float (&A)[S],
                                           const float (&a)[S], const float (&entering)[S], Sums& sums) const {
    const SelectiveScanWalkLayout& layout = tiles.layout;
    const int c = th / layout.lanes, lane = th % layout.lanes;
    // part[3i], part[3i + 1], part[3i + 2]: token i's y, Σλ·B and Σ A·λ·ā·h over the thread's states.
    float u[K], dt[K], exponent[K], g[K], part[3 * K];
    scratch_items(layout.u(s, p, c) + t, u);
    scratch_items(layout.delta(s, p, c) + t, dt);
    scratch_items(layout.carry(s, p) + t, exponent);
    scratch_items(layout.dout(s, p, c) + t, g);
    for (int i = 0; i < K; ++i) {
      u[i] *= dt[i];  // now δ·u
      part[3 * i] = part[3 * i + 1] = part[3 * i + 2] = 0.0f;
    }
    for (int j = 0; j < S; ++j) {
      const int n = lane * S + j;
      float B[K], C[K], decay[K], before[K], terms[2 * K];  // terms: dB of the K tokens, then dC
      scratch_items(layout.B(s, p, n) + t, B);
      scratch_items(layout.C(s, p, n) + t, C);
      float h = entering[j];
      for (int i = 0; i < K; ++i) {
        decay[i] = exp2_approx(dt[i] * a[j] + exponent[i]);
        before[i] = h;
        h = decay[i] * h + u[i] * B[i];
        part[3 * i] += C[i] * h;
        terms[K + i] = g[i] * h;
      }
      float mu = sums.mu[j];
      for (int i = K - 1; i >= 0; --i) {
        const float lambda = g[i] * C[i] + mu;
        const float q = lambda * decay[i] * before[i];
        part[3 * i + 1] += lambda * B[i];
        part[3 * i + 2] += A[j] * q;
        sums.dA[j] += dt[i] * q;
        terms[i] = lambda * u[i];
        mu = decay[i] * lambda;
      }
      sums.mu[j] = mu;
      add_channel_terms(s, th, n, t, terms);
    }
    if constexpr (Shape::device) {
      const int count = selective_scan_lane_scatter<3, K>(layout.lanes, lane, part);
      for (int r = 0; r < K; ++r) {
        if (r < count) {
          finish_token(s, p, tm, t0 + t + lane * count + r, c, part[3 * r], part[3 * r + 1], part[3 * r + 2], sums);
        }
      }
    } else {
      for (int i = 0; i < K; ++i) {
        for (int w = 0; w < 3; ++w) lane_sum(s, c, w)[t + i] += part[3 * i + w];
      }
    }
  }

  /// State n's dB (terms[i]) and dC (terms[K + i]) of tokens t + i: on Cuda summed over the
  /// warp's channels (reduce-scatter over the channel bits of the thread index: 16, 8, 4, then
  /// all-reduce over the channel bits below the lanes' when lanes < 4) and stored in the warp's
  /// sum rows; elsewhere added to the one set of sum rows.
  KOKKOS_INLINE_FUNCTION void add_channel_terms(float* s, int th, int n, int t, float (&terms)[2 * K]) const {
    if constexpr (Shape::device) {
#if defined(__CUDA_ARCH__)
      const int thread = th & 31;
      selective_scan_reduce_half<8>(terms, thread, 16);
      selective_scan_reduce_half<4>(terms, thread, 8);
      selective_scan_reduce_half<2>(terms, thread, 4);
      for (int offset = 2; offset >= tiles.layout.lanes; offset /= 2) {
        terms[0] += __shfl_xor_sync(0xffffffffu, terms[0], offset);
      }
      // The value kept: index 4·bit16 + 2·bit8 + bit4 of the thread; written by the threads whose
      // channel bits below 4 are 0.
      const int held = ((thread >> 4) & 1) * 4 + ((thread >> 3) & 1) * 2 + ((thread >> 2) & 1);
      if ((thread & 3 & ~(tiles.layout.lanes - 1)) == 0) channel_sum(s, th >> 5, held / K, n)[t + held % K] = terms[0];
#else
      (void)s;
      (void)th;
      (void)n;
      (void)t;
      (void)terms;
#endif
    } else {
      (void)th;
      for (int i = 0; i < K; ++i) {
        channel_sum(s, 0, 0, n)[t + i] += terms[i];
        channel_sum(s, 0, 1, n)[t + i] += terms[K + i];
      }
    }
  }

  /// Host backends: the tile's du, ddelta, dz from the lanes' sums; token t's dD and dδ_bias go
  /// to lane t % lanes of its channel.
  KOKKOS_INLINE_FUNCTION void finish_summed(float* s, int p, const Team& tm, int t0, Sums (&sums)[Shape::slots]) const {
    const int lanes = tiles.layout.lanes;
    for (int c = 0; c < tiles.layout.channels; ++c) {
      for (int t = 0; t < Shape::tile; ++t) {
        finish_token(s, p, tm, t0 + t, c, lane_sum(s, c, 0)[t], lane_sum(s, c, 1)[t], lane_sum(s, c, 2)[t],
                     sums[c * lanes + t % lanes]);
      }
    }
  }

  /// du, ddelta and dz of channel c at token t from y = Σ C·h, sum_B = Σ λ·B, sum_A = Σ A·λ·ā·h;
  /// its dD and dδ_bias terms added to `sums`.
  KOKKOS_INLINE_FUNCTION void finish_token(float* s, int p, const Team& tm, int t, int c, float y, float sum_B,
                                           float sum_A, Sums& sums) const {
    if (c >= tm.active || t >= tiles.seqlen) return;
    const SelectiveScanWalkLayout& layout = tiles.layout;
    const int i = t % Shape::tile, d = tm.d0 + c;
    const float u = layout.u(s, p, c)[i], g = layout.dout(s, p, c)[i], skip = tiles.in.skip(d);
    const float dpre = (u * sum_B + sum_A) * layout.derivative(s, p, c)[i];
    du(tm.b, d, t) = skip * g + layout.delta(s, p, c)[i] * sum_B;
    ddelta(tm.b, d, t) = dpre;
    if (tiles.in.has_z) dz(tm.b, d, t) = layout.z(s, p, c)[i] * (y + skip * u);
    sums.dD += g * u;
    sums.dbias += dpre;
  }

  /// The tile's dB and dC of the team's block: the warps' sum rows added in warp order.
  KOKKOS_INLINE_FUNCTION void write_channel_sums(float* s, const Team& tm, int t0, int first, int step) const {
    const int per = tiles.dstate * Shape::tile;
    for (int idx = first; idx < 2 * per; idx += step) {
      const int which = idx / per, n = (idx % per) / Shape::tile, t = idx % Shape::tile;
      if (t0 + t >= tiles.seqlen) continue;
      float sum = 0.0f;
      for (int w = 0; w < warps; ++w) sum += channel_sum(s, w, which, n)[t];
      (which == 0 ? partial_dB : partial_dC)(tm.block, tm.b, tm.g, n, t0 + t) = sum;
    }
  }
};

}  // namespace impl
}  // namespace kmamba

#endif
