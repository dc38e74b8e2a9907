// The block-scan form of the selective scan backward (dstate ≤ selective_scan_block_states,
// Mamba-1's 16): the tokens of a chunk are scanned in parallel, not one after the other (the
// forward walks them: impl/SelectiveScanWalk.hpp).
//
// For each state n the recurrence h_t = ā_t·h_{t−1} + δ_t·u_t·B_t (ā_t = carry_t·exp(δ_t·A_n)) is
// a composition of affine maps h ↦ ā·h + b, which is associative. A team of `Threads` threads
// takes a chunk of Threads × Items tokens of one channel, each thread `Items` consecutive ones,
// and recomputes the chunk's states from its checkpoint:
//   1. each thread composes the maps of its tokens (AffineStep::then);
//   2. the team scans those composites (block_exclusive_scan: warp shuffles, then the warps'
//      totals through scratch, one team barrier), so each thread knows the map from the chunk's
//      entering state to the state before its first token;
//   3. each thread walks its tokens again from that state, adding C_t·h_t to y_t.
// Then a reverse scan of the adjoint μ_t = ā_t·(g_t·C_t + μ_{t+1}) (the maps μ ↦ ā_t·μ + ā_t·g_t·C_t
// composed from the end of the chunk) gives every gradient term.
//
// Sums over channels (dB, dC) stay deterministic: a backward team takes a block of channels one
// after the other, each thread adds its own tokens' terms into its own scratch slots (no two
// threads share a slot), and the blocks' partial sums are added by a second kernel in block order.
// Sums over a channel's tokens (dA, dD, dδ_bias) are reduced per warp and added per warp slot.
//
// Two forms run the same source: on Cuda a team is `Threads` threads of a block (shuffles and
// __syncthreads); elsewhere one thread runs the team's `Threads` threads in turn (each holding its
// registers in a slot of an array) and the scans are sequential, so the host tests check the
// chunk decomposition the GPU uses, with any thread count (SelectiveScanBlockShape).
#ifndef KMAMBA_CORE_IMPL_SELECTIVESCANBLOCKSCAN_HPP
#define KMAMBA_CORE_IMPL_SELECTIVESCANBLOCKSCAN_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Math.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/DeviceMath.hpp>
#include <kmamba/core/impl/WarpTeamLaunch.hpp>

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <cstdint>

namespace kmamba {
namespace impl {

template <class MemorySpace>
struct SelectiveScanOperands;

/// Largest dstate of the block-scan form (Mamba-1 uses 16); wider states take the lane form.
constexpr int selective_scan_block_states = 16;

/// Team shape of the block-scan form: `threads` threads of `items` consecutive tokens each.
/// `device`: the threads are real (Cuda); otherwise one thread runs them in turn.
template <int Threads, int Items, bool Device>
struct SelectiveScanBlockShape {
  static constexpr int threads = Threads, items = Items, chunk = Threads * Items;
  static constexpr bool device = Device;
  static constexpr int slots = Device ? 1 : Threads;  // thread registers a real thread holds
  static constexpr int warps = Device ? Threads / 32 : 1;
  static_assert(!Device || Threads % 32 == 0, "SelectiveScanBlockShape: whole warps on the device");
};

/// The map h ↦ decay·h + value.
struct AffineStep {
  float decay, value;
  KOKKOS_INLINE_FUNCTION static AffineStep identity() { return AffineStep{1.0f, 0.0f}; }
  /// This map, then `next`.
  KOKKOS_INLINE_FUNCTION AffineStep then(const AffineStep& next) const {
    return AffineStep{next.decay * decay, next.decay * value + next.value};
  }
  KOKKOS_INLINE_FUNCTION float apply(float h) const { return decay * h + value; }
};

/// Replaces each thread's composite steps[s] by the composite of the threads before it in scan
/// order (after it in time when Reverse) and returns the composite of all. `totals`: scratch of
/// 2 × Shape::warps steps; `parity` alternates between calls, so that one barrier per call
/// suffices (a slot is rewritten two calls later, after every thread passed the barrier between).
template <class Shape, bool Reverse>
KOKKOS_INLINE_FUNCTION AffineStep block_exclusive_scan(const WarpTeamContext& ctx, AffineStep (&steps)[Shape::slots],
                                                       AffineStep* totals, int parity) {
#if defined(__CUDA_ARCH__)
  if constexpr (Shape::device) {
    constexpr unsigned all = 0xffffffffu;
    const int lane = ctx.thread & 31, warp = ctx.thread >> 5;
    AffineStep inclusive = steps[0];
    for (int offset = 1; offset < 32; offset *= 2) {
      const float d =
          Reverse ? __shfl_down_sync(all, inclusive.decay, offset) : __shfl_up_sync(all, inclusive.decay, offset);
      const float v =
          Reverse ? __shfl_down_sync(all, inclusive.value, offset) : __shfl_up_sync(all, inclusive.value, offset);
      if (Reverse ? lane + offset < 32 : lane >= offset) inclusive = AffineStep{d, v}.then(inclusive);
    }
    const float d = Reverse ? __shfl_down_sync(all, inclusive.decay, 1) : __shfl_up_sync(all, inclusive.decay, 1);
    const float v = Reverse ? __shfl_down_sync(all, inclusive.value, 1) : __shfl_up_sync(all, inclusive.value, 1);
    const AffineStep in_warp = (Reverse ? lane == 31 : lane == 0) ? AffineStep::identity() : AffineStep{d, v};
    AffineStep* slot = totals + parity * Shape::warps;
    if (Reverse ? lane == 0 : lane == 31) slot[warp] = inclusive;
    ctx.barrier();
    AffineStep before = AffineStep::identity(), total = AffineStep::identity();
    for (int w = 0; w < Shape::warps; ++w) {
      const int ww = Reverse ? Shape::warps - 1 - w : w;
      if (Reverse ? ww > warp : ww < warp) before = before.then(slot[ww]);
      total = total.then(slot[ww]);
    }
    steps[0] = before.then(in_warp);
    return total;
  }
#endif
  (void)ctx;
  (void)totals;
  (void)parity;
  AffineStep running = AffineStep::identity();
  for (int i = 0; i < Shape::slots; ++i) {
    const int s = Reverse ? Shape::slots - 1 - i : i;
    const AffineStep own = steps[s];
    steps[s] = running;
    running = running.then(own);
  }
  return running;
}

/// Σ over the team's threads of value[s], added to *target by one thread per warp (slot `warp`
/// of `target`'s row: target[warp]); portable: the slots summed in order into target[0].
template <class Shape>
KOKKOS_INLINE_FUNCTION void block_add_per_warp(const WarpTeamContext& ctx, const float (&value)[Shape::slots],
                                               float* target) {
#if defined(__CUDA_ARCH__)
  if constexpr (Shape::device) {
    float sum = value[0];
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_xor_sync(0xffffffffu, sum, offset);
    if ((ctx.thread & 31) == 0) target[ctx.thread >> 5] += sum;
    return;
  }
#endif
  (void)ctx;
  float sum = 0.0f;
  for (int s = 0; s < Shape::slots; ++s) sum += value[s];
  target[0] += sum;
}

/// f(slot, thread) for each thread register slot the calling thread holds.
template <class Shape, class F>
KOKKOS_INLINE_FUNCTION void for_each_slot(const WarpTeamContext& ctx, const F& f) {
  for (int s = 0; s < Shape::slots; ++s) f(s, Shape::device ? ctx.thread : s);
}

/// v[i] = p[i] for i < K, K a multiple of 4 and p 16-byte aligned: on Cuda four floats a load.
template <int K>
KOKKOS_INLINE_FUNCTION void load_aligned_items(const float* p, float (&v)[K]) {
#if defined(__CUDA_ARCH__)
  for (int i = 0; i + 3 < K; i += 4) {
    const float4 q = *reinterpret_cast<const float4*>(p + i);
    v[i] = q.x;
    v[i + 1] = q.y;
    v[i + 2] = q.z;
    v[i + 3] = q.w;
  }
#else
  for (int i = 0; i < K; ++i) v[i] = p[i];
#endif
}

/// v[i] = row[first + i] where first + i < end, 0 past it; on Cuda four floats a load where the
/// thread's run is whole and 16-byte aligned.
template <int K>
KOKKOS_INLINE_FUNCTION void load_items(const float* row, int first, int end, float (&v)[K]) {
  const float* p = row + first;
#if defined(__CUDA_ARCH__)
  if (K % 4 == 0 && first + K <= end && reinterpret_cast<std::uintptr_t>(p) % 16 == 0) {
    load_aligned_items(p, v);
    return;
  }
#endif
  for (int i = 0; i < K; ++i) v[i] = first + i < end ? p[i] : 0.0f;
}

/// row[first + i] = v[i] where first + i < end (as load_items).
template <int K>
KOKKOS_INLINE_FUNCTION void store_items(float* row, int first, int end, const float (&v)[K]) {
  float* p = row + first;
#if defined(__CUDA_ARCH__)
  if (K % 4 == 0 && first + K <= end && reinterpret_cast<std::uintptr_t>(p) % 16 == 0) {
    for (int i = 0; i < K; i += 4) *reinterpret_cast<float4*>(p + i) = make_float4(v[i], v[i + 1], v[i + 2], v[i + 3]);
    return;
  }
#endif
  for (int i = 0; i < K; ++i) {
    if (first + i < end) p[i] = v[i];
  }
}

/// An exponent whose exp2 is 0 whatever δ·A·log2 e is added to it (finite, so that no product
/// with it is NaN).
constexpr float selective_scan_reset_exponent = -1.0e30f;

/// The per-token inputs of one thread's tokens of a chunk (t = t0 + thread·Items + i; past the
/// sequence: the identity map, u = δ = 0): u, δ, δ·u, and the carry as an exponent, added to
/// δ·A·log2 e before the exp2 (0, or selective_scan_reset_exponent where a packed sequence
/// starts: a decay of 0), which costs the recurrence no multiply.
template <int Items>
struct SelectiveScanTokens {
  float u[Items], delta[Items], du[Items], carry_exponent[Items];
  /// The decay of token i for a state of rate a = A·log2 e.
  KOKKOS_INLINE_FUNCTION float decay(int i, float a) const { return exp2_approx(delta[i] * a + carry_exponent[i]); }
};

template <class MemorySpace, int Items>
KOKKOS_INLINE_FUNCTION void selective_scan_load_tokens(const SelectiveScanOperands<MemorySpace>& in, int b, int d,
                                                       int first, int seqlen, SelectiveScanTokens<Items>& tk) {
  load_items(&in.u(b, d, 0), first, seqlen, tk.u);
  load_items(&in.delta(b, d, 0), first, seqlen, tk.delta);
  for (int i = 0; i < Items; ++i) {
    const bool inside = first + i < seqlen;
    const float bias = in.has_delta_bias ? in.delta_bias(d) : 0.0f;
    tk.delta[i] = inside ? in.delta_value(tk.delta[i] + bias) : 0.0f;
    tk.du[i] = tk.delta[i] * tk.u[i];
    tk.carry_exponent[i] = inside && in.carry(b, first + i) == 0.0f ? selective_scan_reset_exponent : 0.0f;
  }
}

/// Backward: one team per (batch, group, block of `block_channels` channels of the group), chunks
/// last to first, the block's channels one after the other within a chunk. dB and dC of the
/// chunk's tokens are summed over the block's channels in scratch and written to
/// partial_dB/partial_dC (block, batch, group, dstate, seqlen); dA, dD and dδ_bias per (batch,
/// channel) to partial_dA and partial_vectors, as the lane form does.
template <class Shape, class MemorySpace>
struct SelectiveScanBlockBackward {
  static constexpr int K = Shape::items, T = Shape::threads, W = Shape::warps;
  static constexpr int N = selective_scan_block_states;
  static constexpr int block_channels = 16;
  SelectiveScanOperands<MemorySpace> in;
  int batch, dim, seqlen, dstate, ngroups, channels_per_group, blocks_per_group, nchunks;
  ConstTensor3<float, MemorySpace> dout;               // (batch, dim, seqlen)
  ConstTensor3<float, MemorySpace> dlast_state;        // (batch, dim, dstate), optional
  ConstTensor4<float, MemorySpace> checkpoints;        // (batch, dim, nchunks, dstate)
  Tensor3<float, MemorySpace> du, ddelta, dz;          // (batch, dim, seqlen)
  Tensor5<float, MemorySpace> partial_dB, partial_dC;  // (blocks_per_group, batch, ngroups, dstate, seqlen)
  Tensor3<float, MemorySpace> dinitial_state;          // (batch, dim, dstate), optional
  Tensor3<float, MemorySpace> partial_dA;              // (batch, dim, dstate)
  Tensor3<float, MemorySpace> partial_vectors;         // (batch, dim, 2): dD, dδ_bias

  struct Scratch {
    AffineStep totals[2 * W];
    float adjoint[2][block_channels][N];   // μ entering the chunk from the later one, by chunk parity
    float sums[block_channels][N + 2][W];  // per warp: dA (N), dD, dδ_bias
    float dB[N][K][T], dC[N][K][T];        // the chunk's sums over the block's channels, per owner thread
  };
  static constexpr std::size_t bytes = sizeof(Scratch);

  /// Per-thread values of one channel's tokens of the chunk.
  struct Tokens {
    SelectiveScanTokens<K> tk;
    float dpre_grad[K], g[K], y[K], du[K], ddelta[K];
  };

  KOKKOS_INLINE_FUNCTION void operator()(const WarpTeamContext& ctx) const {
    Scratch& sh = *reinterpret_cast<Scratch*>(ctx.scratch);
    const int block = ctx.league_rank % blocks_per_group, bg = ctx.league_rank / blocks_per_group;
    const int g = bg % ngroups, b = bg / ngroups;
    const int first = block * block_channels;
    const int channels = channels_per_group - first < block_channels ? channels_per_group - first : block_channels;
    const int d0 = g * channels_per_group + first;
    if (ctx.thread == 0) {
      for (int c = 0; c < channels; ++c) {
        for (int n = 0; n < dstate; ++n) {
          sh.adjoint[0][c][n] = dlast_state.is_allocated() ? dlast_state(b, d0 + c, n) : 0.0f;
        }
        for (int n = 0; n < N + 2; ++n) {
          for (int w = 0; w < W; ++w) sh.sums[c][n][w] = 0.0f;
        }
      }
    }
    ctx.barrier();
    int parity = 0;
    for (int k = nchunks - 1; k >= 0; --k) {
      const int p = (nchunks - 1 - k) & 1, t0 = k * Shape::chunk;
      for_each_slot<Shape>(ctx, [&](int, int th) {
        for (int n = 0; n < dstate; ++n) {
          for (int i = 0; i < K; ++i) sh.dB[n][i][th] = sh.dC[n][i][th] = 0.0f;
        }
      });
      for (int c = 0; c < channels; ++c) channel(ctx, sh, b, g, d0 + c, c, k, p, parity);
      for_each_slot<Shape>(ctx, [&](int, int th) {
        for (int n = 0; n < dstate; ++n) {
          float vb[K], vc[K];
          for (int i = 0; i < K; ++i) {
            vb[i] = sh.dB[n][i][th];
            vc[i] = sh.dC[n][i][th];
          }
          store_items(&partial_dB(block, b, g, n, 0), t0 + th * K, seqlen, vb);
          store_items(&partial_dC(block, b, g, n, 0), t0 + th * K, seqlen, vc);
        }
      });
    }
    ctx.barrier();
    if (ctx.thread == 0) finish(sh, b, d0, channels, nchunks & 1);
  }

  /// Channel d (row c of the block) over chunk k: its tokens' gradients, and its dB, dC terms
  /// added to the chunk's sums.
  KOKKOS_INLINE_FUNCTION void channel(const WarpTeamContext& ctx, Scratch& sh, int b, int g, int d, int c, int k, int p,
                                      int& parity) const {
    const int t0 = k * Shape::chunk;
    Tokens tok[Shape::slots];
    for_each_slot<Shape>(ctx, [&](int s, int th) { load(b, d, t0 + th * K, tok[s]); });
    for (int n = 0; n < dstate; ++n) state(ctx, sh, b, g, d, c, k, n, p, parity, tok);
    float dD[Shape::slots], dbias[Shape::slots];
    const float skip = in.skip(d);
    for_each_slot<Shape>(ctx, [&](int s, int th) {
      const int first = t0 + th * K;
      float dpre[K];
      dD[s] = dbias[s] = 0.0f;
      for (int i = 0; i < K; ++i) {
        // Past the sequence g = u = 0, but λ carries μ through the identity maps there, so the
        // decay term of dδ is not 0: those tokens are left out of the sums.
        dpre[i] = first + i < seqlen ? tok[s].ddelta[i] * tok[s].dpre_grad[i] : 0.0f;
        dD[s] += tok[s].g[i] * tok[s].tk.u[i];
        dbias[s] += dpre[i];
      }
      store_items(&du(b, d, 0), first, seqlen, tok[s].du);
      store_items(&ddelta(b, d, 0), first, seqlen, dpre);
      if (in.has_z) {
        float dy[K], zv[K];
        load_items(&dout(b, d, 0), first, seqlen, dy);
        load_items(&in.z(b, d, 0), first, seqlen, zv);
        for (int i = 0; i < K; ++i) dy[i] *= (tok[s].y[i] + skip * tok[s].tk.u[i]) * kmamba::silu_derivative(zv[i]);
        store_items(&dz(b, d, 0), first, seqlen, dy);
      }
    });
    block_add_per_warp<Shape>(ctx, dD, sh.sums[c][N]);
    block_add_per_warp<Shape>(ctx, dbias, sh.sums[c][N + 1]);
  }

  KOKKOS_INLINE_FUNCTION void load(int b, int d, int first, Tokens& tok) const {
    selective_scan_load_tokens(in, b, d, first, seqlen, tok.tk);
    load_items(&dout(b, d, 0), first, seqlen, tok.g);
    float zv[K] = {};
    if (in.has_z) load_items(&in.z(b, d, 0), first, seqlen, zv);
    load_items(&in.delta(b, d, 0), first, seqlen, tok.dpre_grad);
    const float skip = in.skip(d);
    const float bias = in.has_delta_bias ? in.delta_bias(d) : 0.0f;
    for (int i = 0; i < K; ++i) {
      tok.dpre_grad[i] = in.delta_softplus ? kmamba::softplus_derivative(tok.dpre_grad[i] + bias) : 1.0f;
      if (in.has_z) tok.g[i] *= kmamba::silu(zv[i]);
      tok.y[i] = 0.0f;
      tok.du[i] = skip * tok.g[i];
      tok.ddelta[i] = 0.0f;
    }
  }

  /// State n of channel d over chunk k: the states recomputed from the checkpoint (forward scan),
  /// the adjoint (reverse scan), and every gradient term of state n.
  KOKKOS_INLINE_FUNCTION void state(const WarpTeamContext& ctx, Scratch& sh, int b, int g, int d, int c, int k, int n,
                                    int p, int& parity, Tokens (&tok)[Shape::slots]) const {
    const int t0 = k * Shape::chunk;
    const float A = in.A(d, n), a = A * device_math_log2e;
    float decay[Shape::slots][K], B[Shape::slots][K], C[Shape::slots][K], hprev[Shape::slots][K];
    AffineStep steps[Shape::slots];
    for_each_slot<Shape>(ctx, [&](int s, int th) {
      load_items(&in.B(b, g, n, 0), t0 + th * K, seqlen, B[s]);
      load_items(&in.C(b, g, n, 0), t0 + th * K, seqlen, C[s]);
      steps[s] = AffineStep::identity();
      for (int i = 0; i < K; ++i) {
        decay[s][i] = tok[s].tk.decay(i, a);
        steps[s] = steps[s].then(AffineStep{decay[s][i], tok[s].tk.du[i] * B[s][i]});
      }
    });
    block_exclusive_scan<Shape, false>(ctx, steps, sh.totals, parity);
    parity ^= 1;
    const float entering = checkpoints(b, d, k, n);
    for_each_slot<Shape>(ctx, [&](int s, int th) {
      float h = steps[s].apply(entering);
      AffineStep back = AffineStep::identity();
      for (int i = 0; i < K; ++i) {
        hprev[s][i] = h;
        h = decay[s][i] * h + tok[s].tk.du[i] * B[s][i];
        tok[s].y[i] += C[s][i] * h;
        sh.dC[n][i][th] += tok[s].g[i] * h;
      }
      for (int i = K - 1; i >= 0; --i) back = back.then(AffineStep{decay[s][i], decay[s][i] * tok[s].g[i] * C[s][i]});
      steps[s] = back;
    });
    const AffineStep total = block_exclusive_scan<Shape, true>(ctx, steps, sh.totals, parity);
    parity ^= 1;
    const float later = sh.adjoint[p][c][n];
    float dA[Shape::slots];
    for_each_slot<Shape>(ctx, [&](int s, int th) {
      float mu = steps[s].apply(later);
      dA[s] = 0.0f;
      for (int i = K - 1; i >= 0; --i) {
        const float dt = tok[s].tk.delta[i], u = tok[s].tk.u[i];
        const float lambda = tok[s].g[i] * C[s][i] + mu;
        tok[s].du[i] += lambda * dt * B[s][i];
        tok[s].ddelta[i] += lambda * (u * B[s][i] + A * decay[s][i] * hprev[s][i]);
        dA[s] += lambda * dt * decay[s][i] * hprev[s][i];
        sh.dB[n][i][th] += lambda * dt * u;
        mu = decay[s][i] * lambda;
      }
    });
    block_add_per_warp<Shape>(ctx, dA, sh.sums[c][n]);
    if (ctx.thread == 0) sh.adjoint[p ^ 1][c][n] = total.apply(later);
  }

  /// After the last chunk (thread 0, past a barrier): the per-(batch, channel) sums and the
  /// initial state's gradient.
  KOKKOS_INLINE_FUNCTION void finish(const Scratch& sh, int b, int d0, int channels, int p) const {
    for (int c = 0; c < channels; ++c) {
      float sums[N + 2];
      for (int j = 0; j < N + 2; ++j) {
        sums[j] = 0.0f;
        for (int w = 0; w < W; ++w) sums[j] += sh.sums[c][j][w];
      }
      for (int n = 0; n < dstate; ++n) {
        partial_dA(b, d0 + c, n) = sums[n];
        if (dinitial_state.is_allocated()) dinitial_state(b, d0 + c, n) = sh.adjoint[p][c][n];
      }
      partial_vectors(b, d0 + c, 0) = sums[N];
      partial_vectors(b, d0 + c, 1) = sums[N + 1];
    }
  }
};

/// dB, dC = Σ over blocks of the partial sums, in block order; one item per (batch, group, state,
/// token).
template <class MemorySpace>
struct SelectiveScanBlockSumFunctor {
  ConstTensor5<float, MemorySpace> partial_dB, partial_dC;  // (blocks, batch, ngroups, dstate, seqlen)
  Tensor4<float, MemorySpace> dB, dC;                       // (batch, ngroups, dstate, seqlen)

  KOKKOS_INLINE_FUNCTION void operator()(const int b, const int g, const int n, const int t) const {
    float sum_b = 0.0f, sum_c = 0.0f;
    for (int k = 0; k < static_cast<int>(partial_dB.extent(0)); ++k) {
      sum_b += partial_dB(k, b, g, n, t);
      sum_c += partial_dC(k, b, g, n, t);
    }
    dB(b, g, n, t) = sum_b;
    dC(b, g, n, t) = sum_c;
  }
};

}  // namespace impl
}  // namespace kmamba

#endif
