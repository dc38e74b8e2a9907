// The walk form of the selective scan forward (dstate ≤ selective_scan_walk_states, Mamba-1's
// 16): each recurrence h_t,n = ā_t,n·h_{t−1},n + δ_t·u_t·B_t,n (ā_t,n = carry_t·exp(δ_t·A_n)) is
// walked token after token by the one thread that owns state n of its channel; no thread combines
// another's maps. Per token and state: one exp2 (ex2.approx on Cuda), the exponent's and the
// input's multiplies and two fused multiply-adds, which is the exp-bound floor's work plus ~5
// instructions.
//
// A channel's states are split over `lanes` neighbouring threads, selective_scan_lane_states
// each (lanes = the power of two ≥ dstate / 4: 4 for dstate 16; rows of B, C past dstate are
// zeros, so the padding states stay 0). The output's sum over the channel's states is each lane's
// partial sum added across its lanes: warp xor-shuffles on Cuda, the partials in lane order
// elsewhere.
//
// One team per (batch, group, block of Shape::threads / lanes channels of the group). The sequence
// is cut into tiles of Shape::tile tokens. A tile's B and C rows (the group's, shared by all the
// team's channels) and its channels' u, δ and z rows are copied into scratch, the next tile's
// copies running while the current tile is walked (cp.async, two buffers); δ is biased and
// passed through the softplus once per (channel, token) in scratch, then every thread walks its
// states over the tile Shape::items tokens at a time and the channel's outputs are written.
//
// Two forms run the same source: on Cuda a team is Shape::threads threads of a block; elsewhere
// one thread runs the team's threads in turn (their states in slots of an array) and the lanes'
// partial sums meet in scratch before the outputs are written, so the host tests check the tiles,
// lanes, padding and checkpoints the GPU uses (SelectiveScanWalkShape).
#ifndef KMAMBA_CORE_IMPL_SELECTIVESCANWALK_HPP
#define KMAMBA_CORE_IMPL_SELECTIVESCANWALK_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/AsyncCopy.hpp>
#include <kmamba/core/impl/DeviceMath.hpp>
#include <kmamba/core/impl/WarpTeamLaunch.hpp>

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <cstdint>

namespace kmamba {
namespace impl {

template <class MemorySpace>
struct SelectiveScanOperands;

/// Largest dstate of the walk forms (Mamba-1 uses 16); wider states take the lane form.
constexpr int selective_scan_walk_states = 16;
/// States a thread of the walk form owns; with at most 4 lanes a channel it covers
/// selective_scan_walk_states.
constexpr int selective_scan_lane_states = 4;
constexpr int selective_scan_max_lanes = selective_scan_walk_states / selective_scan_lane_states;

/// An exponent whose exp2 is 0 whatever δ·A·log2 e is added to it (finite, so that no product
/// with it is NaN): the carry exponent of a token that starts a packed sequence.
constexpr float selective_scan_reset_exponent = -1.0e30f;

/// Team shape of the walk form: `Threads` threads, tiles of `Steps` steps of `Items` tokens.
/// `Device`: the threads are real (Cuda); otherwise one thread runs them in turn.
template <int Threads, int Items, int Steps, bool Device>
struct SelectiveScanWalkShape {
  static constexpr int threads = Threads, items = Items, steps = Steps, tile = Items * Steps;
  static constexpr bool device = Device;
  static constexpr int slots = Device ? 1 : Threads;  // thread registers a real thread holds
  static_assert(Threads >= selective_scan_max_lanes, "SelectiveScanWalkShape: a channel's lanes in one team");
  static_assert(!Device || (Threads % 32 == 0 && Items % 4 == 0), "SelectiveScanWalkShape: whole warps, float4 items");
};

/// Where a team's arrays lie in its scratch (floats; rows `stride` = tile + 4 apart: on Cuda the
/// rows that the lanes of a warp read at one offset then fall in different banks). Per buffer:
/// B and C rows (lanes·4 each), `channel_rows` rows per channel (u, δ, z, then the backward's
/// dout and derivative rows), the tile's carry exponents. After both buffers come the form's own
/// arrays (extra(s)).
struct SelectiveScanWalkLayout {
  int lanes, channels, tile, stride, channel_rows, buffer;

  KOKKOS_INLINE_FUNCTION SelectiveScanWalkLayout(int lanes_, int channels_, int tile_, int channel_rows_)
      : lanes(lanes_),
        channels(channels_),
        tile(tile_),
        stride(tile_ + 4),
        channel_rows(channel_rows_),
        buffer(((2 * lanes_ * selective_scan_lane_states + channel_rows_ * channels_) * (tile_ + 4) + tile_ + 3) / 4 *
               4) {}

  KOKKOS_INLINE_FUNCTION int state_rows() const { return lanes * selective_scan_lane_states; }
  KOKKOS_INLINE_FUNCTION float* row(float* s, int p, int r) const { return s + p * buffer + r * stride; }
  /// State n's row: n = lane·4 + j lies at j·lanes + lane, so that the lanes of a channel, which
  /// read their j-th states at once, read neighbouring rows (distinct banks on Cuda).
  KOKKOS_INLINE_FUNCTION float* B(float* s, int p, int n) const {
    return row(s, p, (n % selective_scan_lane_states) * lanes + n / selective_scan_lane_states);
  }
  KOKKOS_INLINE_FUNCTION float* C(float* s, int p, int n) const { return B(s, p, n) + state_rows() * stride; }
  KOKKOS_INLINE_FUNCTION float* u(float* s, int p, int c) const { return row(s, p, 2 * state_rows() + c); }
  KOKKOS_INLINE_FUNCTION float* delta(float* s, int p, int c) const { return u(s, p, channels + c); }
  KOKKOS_INLINE_FUNCTION float* z(float* s, int p, int c) const { return u(s, p, 2 * channels + c); }
  KOKKOS_INLINE_FUNCTION float* dout(float* s, int p, int c) const { return u(s, p, 3 * channels + c); }
  KOKKOS_INLINE_FUNCTION float* derivative(float* s, int p, int c) const { return u(s, p, 4 * channels + c); }
  KOKKOS_INLINE_FUNCTION float* carry(float* s, int p) const { return u(s, p, channel_rows * channels); }
  KOKKOS_INLINE_FUNCTION float* extra(float* s) const { return s + 2 * buffer; }
  /// Scratch bytes of a team whose own arrays take `extra_floats`.
  std::size_t bytes(std::size_t extra_floats) const {
    return sizeof(float) * (2 * static_cast<std::size_t>(buffer) + extra_floats);
  }
};

/// v[i] = p[i], i < K, from 16-byte aligned scratch (four floats a load on Cuda when K % 4 == 0).
template <int K>
KOKKOS_INLINE_FUNCTION void scratch_items(const float* p, float (&v)[K]) {
#if defined(__CUDA_ARCH__)
  if constexpr (K % 4 == 0) {
    for (int i = 0; i < K; i += 4) {
      const float4 q = *reinterpret_cast<const float4*>(p + i);
      v[i] = q.x;
      v[i + 1] = q.y;
      v[i + 2] = q.z;
      v[i + 3] = q.w;
    }
  } else {
    for (int i = 0; i < K; ++i) v[i] = p[i];
  }
#else
  for (int i = 0; i < K; ++i) v[i] = p[i];
#endif
}

/// v[i] summed over the `lanes` (1, 2 or 4) neighbouring threads of a warp that share a channel,
/// by xor-shuffles (every lane gets the sums; the same order in every lane). Cuda only.
template <int K>
KOKKOS_INLINE_FUNCTION void selective_scan_lane_sum(int lanes, float (&v)[K]) {
#if defined(__CUDA_ARCH__)
  for (int offset = 1; offset < lanes; offset *= 2) {
    for (int i = 0; i < K; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], offset);
  }
#else
  (void)lanes;
  (void)v;
#endif
}

/// One level of a warp reduce-scatter over v[0..M): the calling thread keeps the lower half where
/// its `offset` bit is 0, the upper half (moved down to v[0..M/2)) where it is 1, each added to
/// the partner's (the thread `offset` away) same half. Cuda only.
template <int M, int N>
KOKKOS_INLINE_FUNCTION void selective_scan_reduce_half(float (&v)[N], int thread, int offset) {
  static_assert(M % 2 == 0 && M <= N, "selective_scan_reduce_half: an even count within the array");
#if defined(__CUDA_ARCH__)
  const bool upper = (thread & offset) != 0;
  for (int k = 0; k < M / 2; ++k) {
    const float send = upper ? v[k] : v[k + M / 2];
    const float keep = upper ? v[k + M / 2] : v[k];
    v[k] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
  }
#else
  (void)v;
  (void)thread;
  (void)offset;
#endif
}

/// A channel's partial sums of K tokens, V sums a token (v[i·V + q]), summed over its `lanes`
/// (1, 2 or 4) neighbouring threads of a warp by a reduce-scatter (Cuda): returns the number of
/// tokens the calling lane then holds, count = K / lanes, tokens lane·count + r at v[r·V + q].
template <int V, int K>
KOKKOS_INLINE_FUNCTION int selective_scan_lane_scatter(int lanes, int lane, float (&v)[V * K]) {
  static_assert(K % 4 == 0, "selective_scan_lane_scatter: tokens in quarters");
  if (lanes == 4) {
    selective_scan_reduce_half<V * K>(v, lane, 2);
    selective_scan_reduce_half<V * K / 2>(v, lane, 1);
  } else if (lanes == 2) {
    selective_scan_reduce_half<V * K>(v, lane, 1);
  }
  return K / lanes;
}

/// A team's channels: d0 + c for c < active, in group g of batch row b, channel block `block` of
/// the group.
struct SelectiveScanWalkTeam {
  int b, g, block, d0, active;
};

/// What the walk forms share: the teams, the states a thread owns, and the tiles' copies into
/// scratch (B, C and per channel u, δ, z and, for the backward, dout).
template <class Shape, class MemorySpace>
struct SelectiveScanWalkTiles {
  static constexpr int S = selective_scan_lane_states;
  SelectiveScanOperands<MemorySpace> in;
  int seqlen, dstate, ngroups, channels_per_group, blocks_per_group;
  SelectiveScanWalkLayout layout;
  bool vector_copies;                     // every copied row 16-byte aligned, seqlen % 4 == 0
  ConstTensor3<float, MemorySpace> dout;  // (batch, dim, seqlen), copied when allocated

  KOKKOS_INLINE_FUNCTION SelectiveScanWalkTeam team_of(int league_rank) const {
    const int block = league_rank % blocks_per_group, bg = league_rank / blocks_per_group;
    const int first = block * layout.channels, left = channels_per_group - first;
    SelectiveScanWalkTeam tm;
    tm.block = block;
    tm.g = bg % ngroups;
    tm.b = bg / ngroups;
    tm.d0 = tm.g * channels_per_group + first;
    tm.active = left < layout.channels ? left : layout.channels;
    return tm;
  }

  KOKKOS_INLINE_FUNCTION int ntiles() const { return (seqlen + Shape::tile - 1) / Shape::tile; }

  /// The state n = lane·S + j of channel c, thread th = c·lanes + lane; valid: an active channel's
  /// state below dstate.
  KOKKOS_INLINE_FUNCTION bool owns(const SelectiveScanWalkTeam& tm, int th, int j, int& d, int& n) const {
    const int c = th / layout.lanes;
    d = tm.d0 + c;
    n = (th % layout.lanes) * S + j;
    return c < tm.active && n < dstate;
  }

  /// Rows of B and C past dstate are set to zero in both buffers (the padding states' inputs).
  KOKKOS_INLINE_FUNCTION void zero_padding(float* s, int first, int step) const {
    const int pad = (layout.state_rows() - dstate) * Shape::tile;
    for (int i = first; i < 4 * pad; i += step) {
      const int p = i / (2 * pad), n = dstate + (i % pad) / Shape::tile, t = i % Shape::tile;
      (i % (2 * pad) < pad ? layout.B(s, p, n) : layout.C(s, p, n))[t] = 0.0f;
    }
  }

  /// Copies the tile at t0 into buffer p: B and C rows below dstate, u, δ, z and dout rows of the
  /// team's channels (zeros past the sequence and for channels past the group's end).
  KOKKOS_INLINE_FUNCTION void issue_tile(float* s, int p, const SelectiveScanWalkTeam& tm, int t0, int first,
                                         int step) const {
    if constexpr (Shape::tile % 4 == 0) {
      if (vector_copies) {
        issue_rows<4>(s, p, tm, t0, first, step);
        return;
      }
    }
    issue_rows<1>(s, p, tm, t0, first, step);
  }

  /// issue_tile in copies of Width floats (the pieces of a row a power of two in the shapes run,
  /// so that a piece's row and offset cost shifts, not divisions).
  template <int Width>
  KOKKOS_INLINE_FUNCTION void issue_rows(float* s, int p, const SelectiveScanWalkTeam& tm, int t0, int first,
                                         int step) const {
    constexpr int pieces = Shape::tile / Width;
    auto copy = [&](float* dst, const float* row, int t, bool valid) {
      const float* src = row + (valid ? t0 + t : 0);
      if constexpr (Width == 4) {
        async_copy16(dst + t, src, valid);
      } else {
        async_copy4(dst + t, src, valid);
      }
    };
    for (int i = first; i < dstate * pieces; i += step) {
      const int n = i / pieces, t = (i % pieces) * Width;
      copy(layout.B(s, p, n), &in.B(tm.b, tm.g, n, 0), t, t0 + t < seqlen);
      copy(layout.C(s, p, n), &in.C(tm.b, tm.g, n, 0), t, t0 + t < seqlen);
    }
    for (int i = first; i < layout.channels * pieces; i += step) {
      const int c = i / pieces, t = (i % pieces) * Width, d = tm.d0 + (c < tm.active ? c : 0);
      const bool valid = c < tm.active && t0 + t < seqlen;
      copy(layout.u(s, p, c), &in.u(tm.b, d, 0), t, valid);
      copy(layout.delta(s, p, c), &in.delta(tm.b, d, 0), t, valid);
      if (in.has_z) copy(layout.z(s, p, c), &in.z(tm.b, d, 0), t, valid);
      if (dout.is_allocated()) copy(layout.dout(s, p, c), &dout(tm.b, d, 0), t, valid);
    }
  }

  /// The carry exponents of the tile at t0 in buffer p (0, or selective_scan_reset_exponent where
  /// a packed sequence starts).
  KOKKOS_INLINE_FUNCTION void prepare_carry(float* s, int p, const SelectiveScanWalkTeam& tm, int t0, int first,
                                            int step) const {
    for (int t = first; t < Shape::tile; t += step) {
      const bool reset = t0 + t < seqlen && in.carry(tm.b, t0 + t) == 0.0f;
      layout.carry(s, p)[t] = reset ? selective_scan_reset_exponent : 0.0f;
    }
  }
};

/// Forward: writes what is allocated of out, last_state and the state entering each chunk of
/// `checkpoint_interval` tokens (the backward's checkpoints; a multiple of Shape::items).
template <class Shape, class MemorySpace>
struct SelectiveScanWalkForward {
  static constexpr int K = Shape::items, S = selective_scan_lane_states;
  /// Channel rows of a buffer: u, δ, z.
  static constexpr int channel_rows = 3;
  using Team = SelectiveScanWalkTeam;
  SelectiveScanWalkTiles<Shape, MemorySpace> tiles;
  int checkpoint_interval;
  Tensor3<float, MemorySpace> out;          // (batch, dim, seqlen)
  Tensor3<float, MemorySpace> last_state;   // (batch, dim, dstate)
  Tensor4<float, MemorySpace> checkpoints;  // (batch, dim, nchunks, dstate)

  /// Scratch floats past the buffers: on host backends the lanes' summed outputs (channels × tile).
  static std::size_t extra_floats(const SelectiveScanWalkLayout& layout) {
    return Shape::device ? 0 : static_cast<std::size_t>(layout.channels) * Shape::tile;
  }

  KOKKOS_INLINE_FUNCTION float* summed(float* s, int c) const { return tiles.layout.extra(s) + c * Shape::tile; }

  KOKKOS_INLINE_FUNCTION void operator()(const WarpTeamContext& ctx) const {
    float* s = reinterpret_cast<float*>(ctx.scratch);
    const Team tm = tiles.team_of(ctx.league_rank);
    const int first = Shape::device ? ctx.thread : 0, step = Shape::device ? Shape::threads : 1;
    const int ntiles = tiles.ntiles();
    tiles.zero_padding(s, first, step);
    float h[Shape::slots][S], a[Shape::slots][S];
    for (int q = 0; q < Shape::slots; ++q) start(tm, Shape::device ? ctx.thread : q, h[q], a[q]);
    if (ntiles > 0) {
      tiles.issue_tile(s, 0, tm, 0, first, step);
      async_commit();
      async_wait<0>();
      ctx.barrier();
      prepare_tile(s, 0, tm, 0, first, step);
      ctx.barrier();
    }
    int next_checkpoint = 0;
    for (int k = 0; k < ntiles; ++k) {
      const int p = k & 1, t0 = k * Shape::tile;
      if (k + 1 < ntiles) tiles.issue_tile(s, p ^ 1, tm, t0 + Shape::tile, first, step);
      async_commit();
      for (int q = 0; q < Shape::slots; ++q) {
        walk_tile(s, p, tm, t0, Shape::device ? ctx.thread : q, h[q], a[q], next_checkpoint);
      }
      while (next_checkpoint < t0 + Shape::tile) next_checkpoint += checkpoint_interval;
      if (!Shape::device && out.is_allocated()) write_summed(s, p, tm, t0);
      async_wait<0>();
      ctx.barrier();
      if (k + 1 < ntiles) prepare_tile(s, p ^ 1, tm, t0 + Shape::tile, first, step);
      ctx.barrier();
    }
    for (int q = 0; q < Shape::slots; ++q) finish(tm, Shape::device ? ctx.thread : q, h[q]);
  }

  KOKKOS_INLINE_FUNCTION void start(const Team& tm, int th, float (&h)[S], float (&a)[S]) const {
    for (int j = 0; j < S; ++j) {
      int d, n;
      const bool own = tiles.owns(tm, th, j, d, n);
      h[j] = own && tiles.in.has_initial_state ? tiles.in.initial_state(tm.b, d, n) : 0.0f;
      a[j] = own ? tiles.in.A(d, n) * device_math_log2e : 0.0f;
    }
  }

  KOKKOS_INLINE_FUNCTION void finish(const Team& tm, int th, const float (&h)[S]) const {
    for (int j = 0; j < S; ++j) {
      int d, n;
      if (tiles.owns(tm, th, j, d, n) && last_state.is_allocated()) last_state(tm.b, d, n) = h[j];
    }
  }

  /// In buffer p (copies complete): δ = softplus(delta + bias) once per (channel, token), 0 past
  /// the sequence (the identity step); the carry exponents; on host backends the summed outputs
  /// zeroed.
  KOKKOS_INLINE_FUNCTION void prepare_tile(float* s, int p, const Team& tm, int t0, int first, int step) const {
    const SelectiveScanWalkLayout& layout = tiles.layout;
    for (int i = first; i < layout.channels * Shape::tile; i += step) {
      const int c = i / Shape::tile, t = i % Shape::tile;
      float* delta = layout.delta(s, p, c);
      const float bias = tiles.in.has_delta_bias && c < tm.active ? tiles.in.delta_bias(tm.d0 + c) : 0.0f;
      delta[t] = c < tm.active && t0 + t < tiles.seqlen ? tiles.in.delta_value(delta[t] + bias) : 0.0f;
      if (!Shape::device) summed(s, c)[t] = 0.0f;
    }
    tiles.prepare_carry(s, p, tm, t0, first, step);
  }

  /// Thread th's states over the tile in buffer p; `next_checkpoint`: the first token of the tile
  /// or later whose entering state is a checkpoint.
  KOKKOS_INLINE_FUNCTION void walk_tile(float* s, int p, const Team& tm, int t0, int th, float (&h)[S],
                                        const float (&a)[S], int next_checkpoint) const {
    const SelectiveScanWalkLayout& layout = tiles.layout;
    const int c = th / layout.lanes, lane = th % layout.lanes;
    if (c >= layout.channels) return;  // host shapes whose thread count is not a multiple of lanes
    for (int step = 0; step < Shape::steps; ++step) {
      const int t = step * K;
      if (t0 + t == next_checkpoint && t0 + t < tiles.seqlen) {
        if (checkpoints.is_allocated()) write_checkpoint(tm, th, (t0 + t) / checkpoint_interval, h);
        next_checkpoint += checkpoint_interval;
      }
      float u[K], dt[K], exponent[K], y[K];
      scratch_items(layout.u(s, p, c) + t, u);
      scratch_items(layout.delta(s, p, c) + t, dt);
      scratch_items(layout.carry(s, p) + t, exponent);
      for (int i = 0; i < K; ++i) {
        u[i] *= dt[i];  // now δ·u
        y[i] = 0.0f;
      }
      for (int j = 0; j < S; ++j) {
        float B[K], C[K];
        scratch_items(layout.B(s, p, lane * S + j) + t, B);
        scratch_items(layout.C(s, p, lane * S + j) + t, C);
        for (int i = 0; i < K; ++i) {
          h[j] = exp2_approx(dt[i] * a[j] + exponent[i]) * h[j] + u[i] * B[i];
          y[i] += C[i] * h[j];
        }
      }
      if (out.is_allocated()) emit(s, p, tm, t0 + t, c, lane, y);
    }
  }

  /// The lanes' partial outputs y of tokens t..t + K − 1 of channel c: on Cuda summed across the
  /// lanes by a reduce-scatter and written, each lane its K / lanes tokens; elsewhere added
  /// to the summed outputs in scratch (lanes in order), written by write_summed.
  KOKKOS_INLINE_FUNCTION void emit(float* s, int p, const Team& tm, int t, int c, int lane, float (&y)[K]) const {
    if constexpr (Shape::device) {
      const int count = selective_scan_lane_scatter<1, K>(tiles.layout.lanes, lane, y);
      for (int r = 0; r < K; ++r) {
        if (r < count) write_output(s, p, tm, t + lane * count + r, c, y[r]);
      }
    } else {
      (void)lane;
      float* sum = summed(s, c) + t % Shape::tile;
      for (int i = 0; i < K; ++i) sum[i] += y[i];
    }
  }

  KOKKOS_INLINE_FUNCTION void write_summed(float* s, int p, const Team& tm, int t0) const {
    for (int c = 0; c < tiles.layout.channels; ++c) {
      for (int t = 0; t < Shape::tile; ++t) write_output(s, p, tm, t0 + t, c, summed(s, c)[t]);
    }
  }

  /// out at token t of channel c = (y + D·u)·silu(z).
  KOKKOS_INLINE_FUNCTION void write_output(float* s, int p, const Team& tm, int t, int c, float y) const {
    if (c >= tm.active || t >= tiles.seqlen) return;
    const int i = t % Shape::tile, d = tm.d0 + c;
    const float v = y + tiles.in.skip(d) * tiles.layout.u(s, p, c)[i];
    out(tm.b, d, t) = tiles.in.has_z ? v * silu_approx(tiles.layout.z(s, p, c)[i]) : v;
  }

  KOKKOS_INLINE_FUNCTION void write_checkpoint(const Team& tm, int th, int chunk, const float (&h)[S]) const {
    for (int j = 0; j < S; ++j) {
      int d, n;
      if (tiles.owns(tm, th, j, d, n)) checkpoints(tm.b, d, chunk, n) = h[j];
    }
  }
};

}  // namespace impl
}  // namespace kmamba

#endif
