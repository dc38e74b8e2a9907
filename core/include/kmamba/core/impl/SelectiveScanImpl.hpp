// Internals of kmamba/core/SelectiveScan.hpp: the launch plan and the functors.
//
// Work decomposition (same for every backend): one team per (batch, group, block of channels
// of that group). Two forms share it. Up to selective_scan_register_states states (Mamba-1's 16),
// the register forms: a channel's states are padded to that count and split over a few threads,
// each keeping its share in registers (SelectiveScanForwardRegisterFunctor,
// SelectiveScanBackwardRegisterFunctor). Wider states, the lane forms: the channels are spread
// over the team's threads (one per channel on a GPU, a single thread on a host backend, where
// team barriers and shared cache lines cost more than they save), and the vector lanes of a
// thread own the states n of its channel (lane n % vector_length), so the per-token sum over n
// is a vector reduction and the running state of (channel, n) never leaves the lane that owns
// it. In both, the sequence is walked in chunks: the team
// stages the chunk's u, δ, B and C in level-0 scratch, then each thread scans its channels over
// the chunk, then the team writes the chunk's outputs with coalesced stores. Sums over the
// channels of a team (dB, dC) are read from scratch in channel order and written as the team's
// block of a (batch, ngroups, blocks_per_group, dstate, seqlen) workspace, which a second kernel
// sums over the blocks in block order (with one block a group, the teams write dB and dC
// themselves): no atomics, so every gradient repeats bit for bit from run to run.
#ifndef KMAMBA_CORE_IMPL_SELECTIVESCANIMPL_HPP
#define KMAMBA_CORE_IMPL_SELECTIVESCANIMPL_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/Math.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace kmamba {

template <class MemorySpace>
struct SelectiveScanArgs;
template <class MemorySpace>
struct SelectiveScanGrads;
template <class MemorySpace>
struct SelectiveScanStepArgs;

namespace impl {

/// Two floats carried together: sums reduced over the states of a channel (backward: Σ λ·B and
/// Σ λ·∂h/∂δ), and pairs of values staged at once (forward: u and δ, B and C).
struct SelectiveScanPair {
  float first;
  float second;
  KOKKOS_INLINE_FUNCTION SelectiveScanPair() : first(0.0f), second(0.0f) {}
  KOKKOS_INLINE_FUNCTION SelectiveScanPair& operator+=(const SelectiveScanPair& other) {
    first += other.first;
    second += other.second;
    return *this;
  }
  KOKKOS_INLINE_FUNCTION void operator+=(const volatile SelectiveScanPair& other) volatile {
    first += other.first;
    second += other.second;
  }
};

}  // namespace impl
}  // namespace kmamba

namespace Kokkos {
template <>
struct reduction_identity<kmamba::impl::SelectiveScanPair> {
  KOKKOS_FORCEINLINE_FUNCTION static kmamba::impl::SelectiveScanPair sum() { return kmamba::impl::SelectiveScanPair(); }
};
}  // namespace Kokkos

namespace kmamba {
namespace impl {

// Keeps a parameter out of template argument deduction (so that a Tensor3<float> converts to
// the ConstTensor3<float> a public op takes).
template <class T>
struct SelectiveScanIdentity {
  using type = T;
};
template <class T>
using NonDeduced = typename SelectiveScanIdentity<T>::type;

struct SelectiveScanDims {
  std::int64_t batch = 0, dim = 0, seqlen = 0, dstate = 0, ngroups = 1;
};

/// How a launch cuts the work: teams of `channels_per_team` channels of one group, chunks of
/// `chunk` tokens, `vector_length` lanes over the states.
struct SelectiveScanPlan {
  int batch, dim, seqlen, dstate, ngroups;
  int channels_per_group, channels_per_team, blocks_per_group;
  int chunk, nchunks, vector_length;
};

struct SelectiveScanTeamBlock {
  int b, g, block, d0, channels;
};

KOKKOS_INLINE_FUNCTION SelectiveScanTeamBlock selective_scan_team_block(const SelectiveScanPlan& plan,
                                                                        int league_rank) {
  const int block = league_rank % plan.blocks_per_group;
  const int batch_group = league_rank / plan.blocks_per_group;
  SelectiveScanTeamBlock tb;
  tb.g = batch_group % plan.ngroups;
  tb.b = batch_group / plan.ngroups;
  tb.block = block;
  const int first = block * plan.channels_per_team;
  tb.d0 = tb.g * plan.channels_per_group + first;
  const int left = plan.channels_per_group - first;
  tb.channels = left < plan.channels_per_team ? left : plan.channels_per_team;
  return tb;
}

/// Largest item count of a (rows × cols) team range that selective_scan_item splits exactly.
constexpr int selective_scan_max_items = 1 << 22;

/// Chooses channels per team and the chunk length so that the team scratch (bytes given by
/// `scratch_bytes(channels_per_team, chunk, dstate)`) fits level 0 of `ExecSpace`, starting from
/// `preferred_chunk` tokens. A positive `requested_chunk` is kept as is. With `lanes_over_states`
/// the vector lanes of a thread own the states of its channel; without, a thread keeps them all
/// (vector length 1).
template <class ExecSpace>
SelectiveScanPlan selective_scan_plan(const char* function, const SelectiveScanDims& dims, int requested_chunk,
                                      std::size_t (*scratch_bytes)(int, int, int),
                                      const int preferred_channels_per_team = 8, const bool lanes_over_states = true,
                                      const int preferred_chunk = 64) {
  using Policy = Kokkos::TeamPolicy<ExecSpace>;
  constexpr int max_vector_length = 32;
  SelectiveScanPlan plan;
  plan.batch = static_cast<int>(dims.batch);
  plan.dim = static_cast<int>(dims.dim);
  plan.seqlen = static_cast<int>(dims.seqlen);
  plan.dstate = static_cast<int>(dims.dstate);
  plan.ngroups = static_cast<int>(dims.ngroups);
  plan.channels_per_group = plan.dim / plan.ngroups;
  plan.channels_per_team = std::max(1, std::min(preferred_channels_per_team, plan.channels_per_group));
  const bool fixed_chunk = requested_chunk > 0;
  plan.chunk = fixed_chunk ? requested_chunk : std::max(1, std::min(preferred_chunk, plan.seqlen));
  const std::size_t limit = static_cast<std::size_t>(Policy::scratch_size_max(0));
  auto fits = [&]() { return scratch_bytes(plan.channels_per_team, plan.chunk, plan.dstate) <= limit; };
  while (!fits() && !fixed_chunk && plan.chunk > 16) plan.chunk = (plan.chunk + 1) / 2;
  while (!fits() && plan.channels_per_team > 1) plan.channels_per_team = (plan.channels_per_team + 1) / 2;
  while (!fits() && !fixed_chunk && plan.chunk > 1) plan.chunk = (plan.chunk + 1) / 2;
  KMAMBA_REQUIRE(fits(), function << ": chunk_size " << plan.chunk << " with dstate " << plan.dstate << " needs "
                                  << scratch_bytes(plan.channels_per_team, plan.chunk, plan.dstate)
                                  << " bytes of team scratch memory but " << limit
                                  << " are available; pass a smaller chunk_size (or 0)");
  KMAMBA_ASSERT(
      static_cast<std::int64_t>(plan.chunk) * std::max(plan.channels_per_team, plan.dstate) <= selective_scan_max_items,
      "chunk " << plan.chunk << " × max(" << plan.channels_per_team << " channels, " << plan.dstate
               << " states) exceeds the team item range");
  plan.blocks_per_group = (plan.channels_per_group + plan.channels_per_team - 1) / plan.channels_per_team;
  plan.nchunks = (plan.seqlen + plan.chunk - 1) / plan.chunk;
  int vector_length = 1;
  while (lanes_over_states && vector_length < plan.dstate && vector_length < max_vector_length) vector_length *= 2;
  plan.vector_length = std::min(vector_length, static_cast<int>(Policy::vector_length_max()));
  return plan;
}

/// Launches one team per (batch, group, channel block) with `team_threads` threads where the
/// backend allows (0: one per channel of the block).
template <class ExecSpace, class Functor>
void selective_scan_launch(const ExecSpace& exec, const char* label, const SelectiveScanPlan& plan,
                           const Functor& functor, std::size_t scratch, const int team_threads = 0) {
  using Policy = Kokkos::TeamPolicy<ExecSpace>;
  const int league = plan.batch * plan.ngroups * plan.blocks_per_group;
  if (league == 0) return;
  // Where the execution space runs on the host, a team is one thread (what Kokkos recommends
  // there): its channels then run one after the other with no barrier or shared cache line
  // between threads. Elsewhere a team has a thread per channel, as many as fit.
  constexpr bool host = Kokkos::SpaceAccessibility<ExecSpace, Kokkos::HostSpace>::accessible;
  Policy probe(exec, league, 1, plan.vector_length);
  probe.set_scratch_size(0, Kokkos::PerTeam(scratch));
  const int wanted = team_threads > 0 ? team_threads : plan.channels_per_team;
  const int team_size =
      host ? 1 : std::max(1, std::min(wanted, probe.team_size_max(functor, Kokkos::ParallelForTag())));
  Policy policy(exec, league, team_size, plan.vector_length);
  policy.set_scratch_size(0, Kokkos::PerTeam(scratch));
  Kokkos::parallel_for(label, light_weight(policy), functor);
}

/// The sequence inputs of the scan as the kernels read them.
template <class MemorySpace>
struct SelectiveScanOperands {
  ConstTensor3<float, MemorySpace> u, delta;        // (batch, dim, seqlen)
  ConstTensor2<float, MemorySpace> A;               // (dim, dstate)
  ConstTensor4<float, MemorySpace> B, C;            // (batch, ngroups, dstate, seqlen)
  ConstTensor1<float, MemorySpace> D;               // (dim)
  ConstTensor3<float, MemorySpace> z;               // (batch, dim, seqlen)
  ConstTensor1<float, MemorySpace> delta_bias;      // (dim)
  ConstTensor3<float, MemorySpace> initial_state;   // (batch, dim, dstate)
  ConstTensor2<std::int64_t, MemorySpace> seq_idx;  // (batch, seqlen)
  bool has_D, has_z, has_delta_bias, has_initial_state, has_seq_idx, delta_softplus;

  explicit SelectiveScanOperands(const SelectiveScanArgs<MemorySpace>& args)
      : u(args.u),
        delta(args.delta),
        A(args.A),
        B(args.B),
        C(args.C),
        D(args.D),
        z(args.z),
        delta_bias(args.delta_bias),
        initial_state(args.initial_state),
        seq_idx(args.seq_idx),
        has_D(args.D.is_allocated()),
        has_z(args.z.is_allocated()),
        has_delta_bias(args.delta_bias.is_allocated()),
        has_initial_state(args.initial_state.is_allocated()),
        has_seq_idx(args.seq_idx.is_allocated()),
        delta_softplus(args.delta_softplus) {}

  /// The factor on the state carried into token t: 0 where t starts a packed sequence (its id
  /// differs from token t − 1's), else 1. A product with it, rather than a branch, keeps the
  /// recurrence the same instruction stream with and without seq_idx.
  KOKKOS_INLINE_FUNCTION float carry(int b, int t) const {
    return has_seq_idx && t > 0 && seq_idx(b, t) != seq_idx(b, t - 1) ? 0.0f : 1.0f;
  }

  /// delta + delta_bias, before the softplus.
  KOKKOS_INLINE_FUNCTION float delta_pre(int b, int d, int t) const {
    return delta(b, d, t) + (has_delta_bias ? delta_bias(d) : 0.0f);
  }
  KOKKOS_INLINE_FUNCTION float delta_value(float pre) const { return delta_softplus ? kmamba::softplus(pre) : pre; }
  KOKKOS_INLINE_FUNCTION float skip(int d) const { return has_D ? D(d) : 0.0f; }

  /// Stages tokens [t0, t0 + len) of the team's channels: u, δ (after bias and softplus), B, C.
  template <class Member, class Scratch>
  KOKKOS_INLINE_FUNCTION void stage_chunk(const Member& team, const SelectiveScanTeamBlock& tb, int dstate, int t0,
                                          int len, const Scratch& su, const Scratch& sdelta, const Scratch& sB,
                                          const Scratch& sC) const {
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels), [&](const int c) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, len), [&](const int t) {
        su(c, t) = u(tb.b, tb.d0 + c, t0 + t);
        sdelta(c, t) = delta_value(delta_pre(tb.b, tb.d0 + c, t0 + t));
      });
    });
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, dstate), [&](const int n) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, len), [&](const int t) {
        sB(n, t) = B(tb.b, tb.g, n, t0 + t);
        sC(n, t) = C(tb.b, tb.g, n, t0 + t);
      });
    });
  }
};

/// Forward scan. Optionally writes the gated output, the last state, and the state before
/// each chunk (the checkpoints the backward restarts from).
template <class ExecSpace, class MemorySpace>
struct SelectiveScanForwardFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using Scratch = Kokkos::View<float**, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;

  SelectiveScanOperands<MemorySpace> in;
  SelectiveScanPlan plan;
  Tensor3<float, MemorySpace> out;          // (batch, dim, seqlen)
  Tensor3<float, MemorySpace> last_state;   // (batch, dim, dstate)
  Tensor4<float, MemorySpace> checkpoints;  // (batch, dim, nchunks, dstate)
  bool write_out, write_last_state, write_checkpoints;

  static std::size_t scratch_bytes(int channels, int chunk, int dstate) {
    return 3 * Scratch::shmem_size(channels, chunk) + 2 * Scratch::shmem_size(dstate, chunk) +
           2 * Scratch::shmem_size(channels, dstate);
  }

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const SelectiveScanTeamBlock tb = selective_scan_team_block(plan, team.league_rank());
    const int nstate = plan.dstate;
    Scratch su(team.team_scratch(0), plan.channels_per_team, plan.chunk);
    Scratch sdelta(team.team_scratch(0), plan.channels_per_team, plan.chunk);
    Scratch sy(team.team_scratch(0), plan.channels_per_team, plan.chunk);
    Scratch sB(team.team_scratch(0), nstate, plan.chunk);
    Scratch sC(team.team_scratch(0), nstate, plan.chunk);
    Scratch sA(team.team_scratch(0), plan.channels_per_team, nstate);
    Scratch sh(team.team_scratch(0), plan.channels_per_team, nstate);

    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels), [&](const int c) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, nstate), [&](const int n) {
        sA(c, n) = in.A(tb.d0 + c, n);
        sh(c, n) = in.has_initial_state ? in.initial_state(tb.b, tb.d0 + c, n) : 0.0f;
      });
    });
    for (int k = 0; k < plan.nchunks; ++k) {
      const int t0 = k * plan.chunk;
      const int len = plan.seqlen - t0 < plan.chunk ? plan.seqlen - t0 : plan.chunk;
      team.team_barrier();
      if (write_checkpoints) {
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels), [&](const int c) {
          Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, nstate),
                               [&](const int n) { checkpoints(tb.b, tb.d0 + c, k, n) = sh(c, n); });
        });
      }
      in.stage_chunk(team, tb, nstate, t0, len, su, sdelta, sB, sC);
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels), [&](const int c) {
        for (int t = 0; t < len; ++t) {
          const float dt = sdelta(c, t);
          const float dtu = dt * su(c, t);
          const float carry = in.carry(tb.b, t0 + t);
          float y = 0.0f;
          Kokkos::parallel_reduce(
              Kokkos::ThreadVectorRange(team, nstate),
              [&](const int n, float& acc) {
                const float h = carry * kmamba::math::exp(dt * sA(c, n)) * sh(c, n) + dtu * sB(n, t);
                sh(c, n) = h;
                acc += sC(n, t) * h;
              },
              y);
          Kokkos::single(Kokkos::PerThread(team), [&]() { sy(c, t) = y; });
        }
      });
      team.team_barrier();
      if (write_out) {
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels), [&](const int c) {
          const int d = tb.d0 + c;
          const float skip = in.skip(d);
          Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, len), [&](const int t) {
            float v = sy(c, t) + skip * su(c, t);
            if (in.has_z) v *= kmamba::silu(in.z(tb.b, d, t0 + t));
            out(tb.b, d, t0 + t) = v;
          });
        });
      }
    }
    if (write_last_state) {
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels), [&](const int c) {
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, nstate),
                             [&](const int n) { last_state(tb.b, tb.d0 + c, n) = sh(c, n); });
      });
    }
  }
};

/// Row and column of item i of a row-major (rows × cols) range.
struct SelectiveScanItem {
  int row, col;
};

/// (i / cols, i mod cols) for 0 <= i < 2^22 and cols >= 1, given inv_cols = 1.0f / cols: a float
/// multiply in place of an integer division (about 20 dependent instructions on a GPU). Exact:
/// (i + 0.5) / cols lies at least 0.5 / cols from every integer, and the two roundings (of
/// 1 / cols and of the product) move it by at most (i + 0.5) / cols · 2^-23 < 0.5 / cols.
KOKKOS_INLINE_FUNCTION SelectiveScanItem selective_scan_item(const int i, const int cols, const float inv_cols) {
  const int row = static_cast<int>((static_cast<float>(i) + 0.5f) * inv_cols);
  return SelectiveScanItem{row, i - row * cols};
}

/// For every r < rows and t < cols: f(r, t), over the team's threads (item r·cols + t).
/// rows·cols <= selective_scan_max_items.
template <class Member, class F>
KOKKOS_INLINE_FUNCTION void selective_scan_team_items(const Member& team, const int rows, const int cols, const F& f) {
  const float inv_cols = 1.0f / static_cast<float>(cols);
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows * cols), [&](const int i) {
    const SelectiveScanItem it = selective_scan_item(i, cols, inv_cols);
    f(it.row, it.col);
  });
}

/// For every r < rows and t < cols: store(r, t, load(r, t)), spread over the team's threads with
/// `Batch` loads per thread issued before their stores. A store waits for its load, and a GPU
/// thread issues in order, so one load per store would leave one memory latency per item in
/// flight per thread; thread g handles items i = g, g + groups, ... (selective_scan_item) so that
/// neighbouring threads read neighbouring t. rows·cols <= selective_scan_max_items.
template <int Batch, class Member, class Load, class Store>
KOKKOS_INLINE_FUNCTION void selective_scan_batched_copy(const Member& team, const int rows, const int cols,
                                                        const Load& load, const Store& store) {
  using Value = decltype(load(0, 0));
  const int count = rows * cols;
  const int groups = (count + Batch - 1) / Batch;
  const float inv_cols = 1.0f / static_cast<float>(cols);
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, groups), [&](const int g) {
    Value v[Batch];
    SelectiveScanItem it[Batch];
    for (int k = 0; k < Batch; ++k) {
      const int i = g + k * groups;
      it[k] = selective_scan_item(i, cols, inv_cols);
      if (i < count) v[k] = load(it[k].row, it[k].col);
    }
    for (int k = 0; k < Batch; ++k) {
      if (g + k * groups < count) store(it[k].row, it[k].col, v[k]);
    }
  });
}

/// 2^x. On a GPU the hardware's approximate exp2 (ex2.approx.ftz: relative error about 2^-22,
/// results below 2^-126 flushed to zero, which as a decay of a state is zero either way) instead
/// of exp2f's sequence, whose denormal handling adds a compare and two predicated multiplies to
/// every state update; elsewhere exp2.
KOKKOS_INLINE_FUNCTION float selective_scan_exp2(const float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return kmamba::math::exp2(x);
#endif
}

/// Largest dstate the register form of the forward scan handles (Mamba-1 uses 16).
constexpr int selective_scan_register_states = 16;

/// Zeroes columns [dstate, selective_scan_register_states) of the staged B and C, which the
/// register forms' padded states read and the staging never writes. `sB` and `sC`: (chunk, max_states).
template <class Member, class Rows>
KOKKOS_INLINE_FUNCTION void selective_scan_zero_padded_states(const Member& team, const int chunk, const int dstate,
                                                              const Rows& sB, const Rows& sC) {
  const int padded = selective_scan_register_states - dstate;
  Kokkos::parallel_for(Kokkos::TeamThreadRange(team, chunk * padded), [&](const int i) {
    const int t = i / padded, n = dstate + i % padded;
    sB(t, n) = 0.0f;
    sC(t, n) = 0.0f;
  });
}

/// A_n·log2 e of states n0 ... n0 + States - 1 of channel d (0 past dstate), so that the register
/// forms' decay exp(δ·A_n) is 2^(δ·a_n).
template <int States, class MemorySpace>
KOKKOS_INLINE_FUNCTION void selective_scan_register_rates(const SelectiveScanOperands<MemorySpace>& in, const int d,
                                                          const int n0, const int dstate, float (&a)[States]) {
  constexpr float log2e = 1.4426950408889634f;
  for (int j = 0; j < States; ++j) a[j] = n0 + j < dstate ? in.A(d, n0 + j) * log2e : 0.0f;
}

/// Advances the States states h (of rates a, from selective_scan_register_rates) of channel row c
/// over tokens [0, len) of the staged chunk, states n0 ... of B and C, the carried state scaled by
/// carry(t) (SelectiveScanOperands::carry); after each token t calls after_token(t, h, y) with
/// y = Σ_j C·h, this thread's share of the output.
template <int States, class Rows, class Carry, class AfterToken>
KOKKOS_INLINE_FUNCTION void selective_scan_register_chunk(const int c, const int n0, const int len, const Rows& su,
                                                          const Rows& sdelta, const Rows& sB, const Rows& sC,
                                                          const float (&a)[States], float (&h)[States],
                                                          const Carry& carry, const AfterToken& after_token) {
  // Unrolled on a GPU so that the loads and exponentials of the next tokens, which do not depend
  // on h, issue while the current token's chains complete.
#ifdef __CUDA_ARCH__
#pragma unroll 4
#endif
  for (int t = 0; t < len; ++t) {
    const float dt = sdelta(c, t);
    const float dtu = dt * su(c, t);
    const float keep = carry(t);
    float y = 0.0f;
    for (int j = 0; j < States; ++j) {
      h[j] = keep * selective_scan_exp2(dt * a[j]) * h[j] + dtu * sB(t, n0 + j);
      y += sC(t, n0 + j) * h[j];
    }
    after_token(t, h, y);
  }
}

/// Forward scan with the states of a channel in registers while the team walks a chunk
/// (dstate <= selective_scan_register_states; no vector lanes). The states are padded to
/// selective_scan_register_states: the padded ones have A = 0 and B = C = 0 (staged once as zeros),
/// so they stay 0 and add nothing, and the loop over a thread's states has no branch, which lets
/// the compiler interleave its independent chains h_n ← 2^(δ·A_n·log2 e)·h_n + δ·u·B_n. On a GPU
/// a channel's states are spread over `state_threads` threads (each writes its share of y to its
/// own row of scratch, summed at write-back): one thread per channel left 12 288 scanning threads
/// at batch 8 × 1536 channels, too few to hide the latency of 16 chains (ncu: 0.21 instructions
/// issued per scheduler cycle), and with it six of eight warps of a block waiting at a barrier.
/// Host backends use the same split (a team is one thread there, which takes the (channel, share)
/// pairs in turn), so the host tests check the GPU's arithmetic. The team stages each chunk's u, δ,
/// B and C in scratch (channel rows padded by one float, so that the staging stores along t and
/// the scan's loads across channels both avoid bank conflicts), with copy_batch loads in flight per
/// thread; the states wait in scratch between chunks, and the outputs leave along t.
/// Same outputs as SelectiveScanForwardFunctor.
template <class ExecSpace, class MemorySpace>
struct SelectiveScanForwardRegisterFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using Rows =
      Kokkos::View<float**, Kokkos::LayoutRight, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  static constexpr int max_states = selective_scan_register_states;
  /// Threads over the states of one channel, and the states each of them keeps.
  static constexpr int state_threads = 4;
  static constexpr int thread_states = max_states / state_threads;
  /// Channels of a team (the channels_per_team the plan starts from; a GPU team has
  /// state_threads threads per channel). Small enough that a multiprocessor holds several teams
  /// at Mamba-1's shapes (1536 channels, batch 8: about 6 per H200 multiprocessor), so that the
  /// other teams scan while one stages its chunk or waits at a barrier.
  static constexpr int team_channels = 16;
  /// Loads in flight per thread while a chunk is staged or its outputs leave.
  static constexpr int copy_batch = 8;

  SelectiveScanOperands<MemorySpace> in;
  SelectiveScanPlan plan;
  Tensor3<float, MemorySpace> out;          // (batch, dim, seqlen)
  Tensor3<float, MemorySpace> last_state;   // (batch, dim, dstate)
  Tensor4<float, MemorySpace> checkpoints;  // (batch, dim, nchunks, dstate)
  bool write_out, write_last_state, write_checkpoints;

  static std::size_t scratch_bytes(int channels, int chunk, int) {
    return (2 + state_threads) * Rows::shmem_size(channels, chunk + 1) + 2 * Rows::shmem_size(chunk, max_states) +
           Rows::shmem_size(channels, max_states + 1);
  }

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const SelectiveScanTeamBlock tb = selective_scan_team_block(plan, team.league_rank());
    const int nstate = plan.dstate;
    const int cpt = plan.channels_per_team;
    Rows su(team.team_scratch(0), cpt, plan.chunk + 1);
    Rows sdelta(team.team_scratch(0), cpt, plan.chunk + 1);
    Rows sy(team.team_scratch(0), state_threads * cpt, plan.chunk + 1);  // row q·cpt + c: threads q's share
    Rows sB(team.team_scratch(0), plan.chunk, max_states);
    Rows sC(team.team_scratch(0), plan.chunk, max_states);
    Rows sh(team.team_scratch(0), cpt, max_states + 1);

    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels * max_states), [&](const int i) {
      const int c = i / max_states, n = i % max_states;
      sh(c, n) = n < nstate && in.has_initial_state ? in.initial_state(tb.b, tb.d0 + c, n) : 0.0f;
    });
    selective_scan_zero_padded_states(team, plan.chunk, nstate, sB, sC);
    for (int k = 0; k < plan.nchunks; ++k) {
      const int t0 = k * plan.chunk;
      const int len = plan.seqlen - t0 < plan.chunk ? plan.seqlen - t0 : plan.chunk;
      team.team_barrier();
      if (write_checkpoints) {
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels * nstate), [&](const int i) {
          const int c = i / nstate, n = i % nstate;
          checkpoints(tb.b, tb.d0 + c, k, n) = sh(c, n);
        });
      }
      selective_scan_batched_copy<copy_batch>(
          team, tb.channels, len,
          [&](const int c, const int t) {
            SelectiveScanPair v;
            v.first = in.u(tb.b, tb.d0 + c, t0 + t);
            v.second = in.delta_pre(tb.b, tb.d0 + c, t0 + t);
            return v;
          },
          [&](const int c, const int t, const SelectiveScanPair& v) {
            su(c, t) = v.first;
            sdelta(c, t) = in.delta_value(v.second);
          });
      selective_scan_batched_copy<copy_batch>(
          team, nstate, len,
          [&](const int n, const int t) {
            SelectiveScanPair v;
            v.first = in.B(tb.b, tb.g, n, t0 + t);
            v.second = in.C(tb.b, tb.g, n, t0 + t);
            return v;
          },
          [&](const int n, const int t, const SelectiveScanPair& v) {
            sB(t, n) = v.first;
            sC(t, n) = v.second;
          });
      team.team_barrier();
      // Thread i scans states q·thread_states ... of channel c; the threads of a warp share q, so
      // their reads of B and C are broadcasts.
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, state_threads * tb.channels), [&](const int i) {
        const int c = i % tb.channels, q = i / tb.channels;
        const int n0 = q * thread_states;
        float a[thread_states], h[thread_states];
        selective_scan_register_rates(in, tb.d0 + c, n0, nstate, a);
        for (int j = 0; j < thread_states; ++j) h[j] = sh(c, n0 + j);
        selective_scan_register_chunk(
            c, n0, len, su, sdelta, sB, sC, a, h, [&](const int t) { return in.carry(tb.b, t0 + t); },
            [&](const int t, const float(&)[thread_states], const float y) { sy(q * cpt + c, t) = y; });
        for (int j = 0; j < thread_states; ++j) sh(c, n0 + j) = h[j];
      });
      team.team_barrier();
      if (write_out) {
        selective_scan_batched_copy<copy_batch>(
            team, tb.channels, len,
            [&](const int c, const int t) { return in.has_z ? in.z(tb.b, tb.d0 + c, t0 + t) : 0.0f; },
            [&](const int c, const int t, const float zv) {
              const int d = tb.d0 + c;
              float v = in.skip(d) * su(c, t);
              for (int q = 0; q < state_threads; ++q) v += sy(q * cpt + c, t);
              if (in.has_z) v *= kmamba::silu(zv);
              out(tb.b, d, t0 + t) = v;
            });
      }
    }
    if (write_last_state) {
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels * nstate), [&](const int i) {
        const int c = i / nstate, n = i % nstate;
        last_state(tb.b, tb.d0 + c, n) = sh(c, n);
      });
    }
  }
};

/// Backward scan, chunks last to first. Per chunk: restart the forward from the chunk's
/// checkpoint keeping every state of the chunk in scratch, then walk the chunk backwards with the
/// adjoint state μ_t = ā_{t+1}·λ_{t+1} carried from the later chunk. Per-(batch, channel) sums
/// over seqlen (dA, dD, ddelta_bias) go to `partial_*`. dB and dC are summed over the channels
/// of the team in channel order from the state tile (dC from the recomputed states before the
/// backward walk, dB from the λ·δ·u terms the walk leaves in their place) and written as the
/// team's block of `dB_blocks`, `dC_blocks`.
template <class ExecSpace, class MemorySpace>
struct SelectiveScanBackwardFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using Scratch = Kokkos::View<float**, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  // Tokens innermost on every backend (a GPU's default scratch layout is LayoutLeft): the lanes of
  // the channel sums read consecutive tokens, those of the scans states chunk + 1 floats apart.
  using Scratch3 =
      Kokkos::View<float***, Kokkos::LayoutRight, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;

  SelectiveScanOperands<MemorySpace> in;
  SelectiveScanPlan plan;
  ConstTensor3<float, MemorySpace> dout;             // (batch, dim, seqlen)
  ConstTensor3<float, MemorySpace> dlast_state;      // (batch, dim, dstate)
  ConstTensor4<float, MemorySpace> checkpoints;      // (batch, dim, nchunks, dstate)
  Tensor3<float, MemorySpace> du, ddelta, dz;        // (batch, dim, seqlen)
  Tensor5<float, MemorySpace> dB_blocks, dC_blocks;  // (batch, ngroups, blocks_per_group, dstate, seqlen)
  Tensor3<float, MemorySpace> dinitial_state;        // (batch, dim, dstate)
  Tensor3<float, MemorySpace> partial_dA;            // (batch, dim, dstate)
  Tensor3<float, MemorySpace> partial_vectors;       // (batch, dim, 2): dD, ddelta_bias
  bool has_dlast_state, write_dinitial_state;

  static std::size_t scratch_bytes(int channels, int chunk, int dstate) {
    return 7 * Scratch::shmem_size(channels, chunk) + 2 * Scratch::shmem_size(dstate, chunk) +
           3 * Scratch::shmem_size(channels, dstate) + Scratch::shmem_size(channels, 2) +
           Scratch3::shmem_size(channels, dstate, chunk + 1);
  }

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const SelectiveScanTeamBlock tb = selective_scan_team_block(plan, team.league_rank());
    const int nstate = plan.dstate;
    const int cpt = plan.channels_per_team;
    Scratch su(team.team_scratch(0), cpt, plan.chunk);
    Scratch sdelta(team.team_scratch(0), cpt, plan.chunk);
    Scratch sdelta_grad(team.team_scratch(0), cpt, plan.chunk);  // dδ/d(delta)
    Scratch sg(team.team_scratch(0), cpt, plan.chunk);           // dL/dy
    Scratch sy(team.team_scratch(0), cpt, plan.chunk);           // Σ_n C·h
    Scratch sdu(team.team_scratch(0), cpt, plan.chunk);
    Scratch sddelta(team.team_scratch(0), cpt, plan.chunk);
    Scratch sB(team.team_scratch(0), nstate, plan.chunk);
    Scratch sC(team.team_scratch(0), nstate, plan.chunk);
    Scratch sA(team.team_scratch(0), cpt, nstate);
    Scratch smu(team.team_scratch(0), cpt, nstate);
    Scratch sdA(team.team_scratch(0), cpt, nstate);
    Scratch sacc(team.team_scratch(0), cpt, 2);
    // h before the chunk, then after each token; the backward walk replaces h_{t-1} (index t),
    // once read, by λ_t·δ_t·u_t.
    Scratch3 hs(team.team_scratch(0), cpt, nstate, plan.chunk + 1);

    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels), [&](const int c) {
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, nstate), [&](const int n) {
        sA(c, n) = in.A(tb.d0 + c, n);
        smu(c, n) = has_dlast_state ? dlast_state(tb.b, tb.d0 + c, n) : 0.0f;
        sdA(c, n) = 0.0f;
      });
      Kokkos::single(Kokkos::PerThread(team), [&]() {
        sacc(c, 0) = 0.0f;
        sacc(c, 1) = 0.0f;
      });
    });
    for (int k = plan.nchunks - 1; k >= 0; --k) {
      const int t0 = k * plan.chunk;
      const int len = plan.seqlen - t0 < plan.chunk ? plan.seqlen - t0 : plan.chunk;
      team.team_barrier();
      in.stage_chunk(team, tb, nstate, t0, len, su, sdelta, sB, sC);
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels), [&](const int c) {
        const int d = tb.d0 + c;
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, len), [&](const int t) {
          sdelta_grad(c, t) = in.delta_softplus ? kmamba::softplus_derivative(in.delta_pre(tb.b, d, t0 + t)) : 1.0f;
          const float g = dout(tb.b, d, t0 + t);
          sg(c, t) = in.has_z ? g * kmamba::silu(in.z(tb.b, d, t0 + t)) : g;
        });
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, nstate),
                             [&](const int n) { hs(c, n, 0) = checkpoints(tb.b, d, k, n); });
      });
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels), [&](const int c) {
        for (int t = 0; t < len; ++t) {
          const float dt = sdelta(c, t);
          const float dtu = dt * su(c, t);
          const float carry = in.carry(tb.b, t0 + t);
          float y = 0.0f;
          Kokkos::parallel_reduce(
              Kokkos::ThreadVectorRange(team, nstate),
              [&](const int n, float& acc) {
                const float h = carry * kmamba::math::exp(dt * sA(c, n)) * hs(c, n, t) + dtu * sB(n, t);
                hs(c, n, t + 1) = h;
                acc += sC(n, t) * h;
              },
              y);
          Kokkos::single(Kokkos::PerThread(team), [&]() { sy(c, t) = y; });
        }
      });
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nstate), [&](const int n) {
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, len), [&](const int t) {
          float sum = 0.0f;
          for (int c = 0; c < tb.channels; ++c) sum += sg(c, t) * hs(c, n, t + 1);
          dC_blocks(tb.b, tb.g, tb.block, n, t0 + t) = sum;
        });
      });
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels), [&](const int c) {
        const float skip = in.skip(tb.d0 + c);
        for (int t = len - 1; t >= 0; --t) {
          const float dt = sdelta(c, t);
          const float uu = su(c, t);
          const float g = sg(c, t);
          const float carry = in.carry(tb.b, t0 + t);
          SelectiveScanPair sums;
          Kokkos::parallel_reduce(
              Kokkos::ThreadVectorRange(team, nstate),
              [&](const int n, SelectiveScanPair& acc) {
                const float a = carry * kmamba::math::exp(dt * sA(c, n));
                const float a_hprev = a * hs(c, n, t);
                const float lambda = g * sC(n, t) + smu(c, n);
                hs(c, n, t) = lambda * dt * uu;
                acc.first += lambda * sB(n, t);
                acc.second += lambda * (sB(n, t) * uu + sA(c, n) * a_hprev);
                sdA(c, n) += lambda * dt * a_hprev;
                smu(c, n) = a * lambda;
              },
              sums);
          Kokkos::single(Kokkos::PerThread(team), [&]() {
            sdu(c, t) = skip * g + dt * sums.first;
            const float dpre = sums.second * sdelta_grad(c, t);
            sddelta(c, t) = dpre;
            sacc(c, 0) += g * uu;
            sacc(c, 1) += dpre;
          });
        }
      });
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels), [&](const int c) {
        const int d = tb.d0 + c;
        const float skip = in.skip(d);
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, len), [&](const int t) {
          du(tb.b, d, t0 + t) = sdu(c, t);
          ddelta(tb.b, d, t0 + t) = sddelta(c, t);
          if (in.has_z) {
            const float zz = in.z(tb.b, d, t0 + t);
            dz(tb.b, d, t0 + t) = dout(tb.b, d, t0 + t) * (sy(c, t) + skip * su(c, t)) * kmamba::silu_derivative(zz);
          }
        });
      });
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nstate), [&](const int n) {
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, len), [&](const int t) {
          float sum = 0.0f;
          for (int c = 0; c < tb.channels; ++c) sum += hs(c, n, t);
          dB_blocks(tb.b, tb.g, tb.block, n, t0 + t) = sum;
        });
      });
    }
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels), [&](const int c) {
      const int d = tb.d0 + c;
      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, nstate), [&](const int n) {
        partial_dA(tb.b, d, n) = sdA(c, n);
        if (write_dinitial_state) dinitial_state(tb.b, d, n) = smu(c, n);
      });
      Kokkos::single(Kokkos::PerThread(team), [&]() {
        partial_vectors(tb.b, d, 0) = sacc(c, 0);
        partial_vectors(tb.b, d, 1) = sacc(c, 1);
      });
    });
  }
};

/// Backward scan with the states of a channel in registers (dstate <= selective_scan_register_states;
/// no vector lanes), the counterpart of SelectiveScanForwardRegisterFunctor: states padded to
/// selective_scan_register_states with A = B = C = 0 (they stay 0 and add nothing), `state_threads`
/// threads per channel with `thread_states` states each, on every backend. Per chunk, last to first:
/// stage the chunk; restart the forward from the chunk's checkpoint, keeping every state of the
/// chunk in scratch (and each thread's share of y); write the chunk's dC, summed over the team's
/// channels in channel order; walk the chunk backwards carrying the adjoint μ and the dA sums in
/// registers, leaving λ·δ·u in place of each state read and each thread's shares of Σ λ·B and
/// Σ λ·∂h/∂δ in rows of scratch; then write du, dδ, dz and dB. μ, the dA sums and the
/// per-channel sums of dD and ddelta_bias wait in scratch between chunks. Same outputs as
/// SelectiveScanBackwardFunctor.
template <class ExecSpace, class MemorySpace>
struct SelectiveScanBackwardRegisterFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using Rows =
      Kokkos::View<float**, Kokkos::LayoutRight, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  using States =
      Kokkos::View<float***, Kokkos::LayoutRight, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  static constexpr int max_states = selective_scan_register_states;
  static constexpr int state_threads = SelectiveScanForwardRegisterFunctor<ExecSpace, MemorySpace>::state_threads;
  static constexpr int thread_states = max_states / state_threads;
  /// Channels of a team (the channels_per_team the plan starts from).
  static constexpr int team_channels = 8;
  /// Tokens per chunk the plan starts from. The states of every token of a chunk wait in scratch,
  /// so the chunk sets how many one-warp teams a multiprocessor holds: a GPU takes the chunk at
  /// which the teams of Mamba-1's training shape (batch 8 × 1536 channels) fit in one wave of an
  /// H200 (about 16 KB of scratch a team); a host team is one thread with nothing to share the
  /// core with, and takes the longer chunk, which has fewer chunk boundaries.
  static constexpr int preferred_chunk = Kokkos::SpaceAccessibility<ExecSpace, Kokkos::HostSpace>::accessible ? 16 : 12;

  SelectiveScanOperands<MemorySpace> in;
  SelectiveScanPlan plan;
  ConstTensor3<float, MemorySpace> dout;             // (batch, dim, seqlen)
  ConstTensor3<float, MemorySpace> dlast_state;      // (batch, dim, dstate)
  ConstTensor4<float, MemorySpace> checkpoints;      // (batch, dim, nchunks, dstate)
  Tensor3<float, MemorySpace> du, ddelta, dz;        // (batch, dim, seqlen)
  Tensor5<float, MemorySpace> dB_blocks, dC_blocks;  // (batch, ngroups, blocks_per_group, dstate, seqlen)
  Tensor3<float, MemorySpace> dinitial_state;        // (batch, dim, dstate)
  Tensor3<float, MemorySpace> partial_dA;            // (batch, dim, dstate)
  Tensor3<float, MemorySpace> partial_vectors;       // (batch, dim, 2): dD, ddelta_bias
  bool has_dlast_state, write_dinitial_state;

  static std::size_t scratch_bytes(int channels, int chunk, int) {
    return (4 + 3 * state_threads) * Rows::shmem_size(channels, chunk + 1) + 2 * Rows::shmem_size(chunk, max_states) +
           2 * Rows::shmem_size(channels, max_states + 1) + Rows::shmem_size(channels, 2) +
           States::shmem_size(channels, max_states + 1, chunk + 1);
  }

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const SelectiveScanTeamBlock tb = selective_scan_team_block(plan, team.league_rank());
    const int nstate = plan.dstate;
    const int cpt = plan.channels_per_team;
    const int width = plan.chunk + 1;
    Rows su(team.team_scratch(0), cpt, width);
    Rows sdelta(team.team_scratch(0), cpt, width);
    Rows sdelta_grad(team.team_scratch(0), cpt, width);  // dδ/d(delta)
    Rows sg(team.team_scratch(0), cpt, width);           // dL/dy
    // Row q·cpt + c: thread q's share of channel c's Σ_n C·h, Σ_n λ·B and Σ_n λ·∂h/∂δ; the
    // write-back leaves dδ/d(delta)·Σ λ·∂h/∂δ in row c of the last.
    Rows sy(team.team_scratch(0), state_threads * cpt, width);
    Rows sfirst(team.team_scratch(0), state_threads * cpt, width);
    Rows ssecond(team.team_scratch(0), state_threads * cpt, width);
    Rows sB(team.team_scratch(0), plan.chunk, max_states);
    Rows sC(team.team_scratch(0), plan.chunk, max_states);
    Rows smu(team.team_scratch(0), cpt, max_states + 1);
    Rows sdA(team.team_scratch(0), cpt, max_states + 1);
    Rows sacc(team.team_scratch(0), cpt, 2);
    // h before the chunk, then after each token; the backward walk replaces h_{t-1} (index t),
    // once read, by λ_t·δ_t·u_t. One state row more than used, so that channels lie an odd
    // number of floats apart.
    States hs(team.team_scratch(0), cpt, max_states + 1, width);

    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels * max_states), [&](const int i) {
      const int c = i / max_states, n = i % max_states;
      smu(c, n) = n < nstate && has_dlast_state ? dlast_state(tb.b, tb.d0 + c, n) : 0.0f;
      sdA(c, n) = 0.0f;
      if (n < 2) sacc(c, n) = 0.0f;
    });
    selective_scan_zero_padded_states(team, plan.chunk, nstate, sB, sC);
    for (int k = plan.nchunks - 1; k >= 0; --k) {
      const int t0 = k * plan.chunk;
      const int len = plan.seqlen - t0 < plan.chunk ? plan.seqlen - t0 : plan.chunk;
      team.team_barrier();
      selective_scan_team_items(team, tb.channels, len, [&](const int c, const int t) {
        const int d = tb.d0 + c;
        const float pre = in.delta_pre(tb.b, d, t0 + t);
        su(c, t) = in.u(tb.b, d, t0 + t);
        sdelta(c, t) = in.delta_value(pre);
        sdelta_grad(c, t) = in.delta_softplus ? kmamba::softplus_derivative(pre) : 1.0f;
        const float g = dout(tb.b, d, t0 + t);
        sg(c, t) = in.has_z ? g * kmamba::silu(in.z(tb.b, d, t0 + t)) : g;
      });
      selective_scan_team_items(team, nstate, len, [&](const int n, const int t) {
        sB(t, n) = in.B(tb.b, tb.g, n, t0 + t);
        sC(t, n) = in.C(tb.b, tb.g, n, t0 + t);
      });
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels * max_states), [&](const int i) {
        const int c = i / max_states, n = i % max_states;
        hs(c, n, 0) = n < nstate ? checkpoints(tb.b, tb.d0 + c, k, n) : 0.0f;
      });
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, state_threads * tb.channels), [&](const int i) {
        const int c = i % tb.channels, q = i / tb.channels;
        const int n0 = q * thread_states;
        float a[thread_states], h[thread_states];
        selective_scan_register_rates(in, tb.d0 + c, n0, nstate, a);
        for (int j = 0; j < thread_states; ++j) h[j] = hs(c, n0 + j, 0);
        selective_scan_register_chunk(
            c, n0, len, su, sdelta, sB, sC, a, h, [&](const int t) { return in.carry(tb.b, t0 + t); },
            [&](const int t, const float(&state)[thread_states], const float y) {
              for (int j = 0; j < thread_states; ++j) hs(c, n0 + j, t + 1) = state[j];
              sy(q * cpt + c, t) = y;
            });
      });
      team.team_barrier();
      selective_scan_team_items(team, nstate, len, [&](const int n, const int t) {
        float sum = 0.0f;
        for (int c = 0; c < tb.channels; ++c) sum += sg(c, t) * hs(c, n, t + 1);
        dC_blocks(tb.b, tb.g, tb.block, n, t0 + t) = sum;
      });
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, state_threads * tb.channels), [&](const int i) {
        const int c = i % tb.channels, q = i / tb.channels;
        const int n0 = q * thread_states;
        float A[thread_states], a[thread_states], mu[thread_states], dA[thread_states];
        selective_scan_register_rates(in, tb.d0 + c, n0, nstate, a);
        for (int j = 0; j < thread_states; ++j) {
          A[j] = n0 + j < nstate ? in.A(tb.d0 + c, n0 + j) : 0.0f;
          mu[j] = smu(c, n0 + j);
          dA[j] = sdA(c, n0 + j);
        }
        for (int t = len - 1; t >= 0; --t) {
          const float dt = sdelta(c, t);
          const float uu = su(c, t);
          const float g = sg(c, t);
          const float keep = in.carry(tb.b, t0 + t);
          float first = 0.0f, second = 0.0f;
          for (int j = 0; j < thread_states; ++j) {
            const int n = n0 + j;
            const float decay = keep * selective_scan_exp2(dt * a[j]);
            const float decay_hprev = decay * hs(c, n, t);
            const float lambda = g * sC(t, n) + mu[j];
            hs(c, n, t) = lambda * dt * uu;
            first += lambda * sB(t, n);
            second += lambda * (sB(t, n) * uu + A[j] * decay_hprev);
            dA[j] += lambda * dt * decay_hprev;
            mu[j] = decay * lambda;
          }
          sfirst(q * cpt + c, t) = first;
          ssecond(q * cpt + c, t) = second;
        }
        for (int j = 0; j < thread_states; ++j) {
          smu(c, n0 + j) = mu[j];
          sdA(c, n0 + j) = dA[j];
        }
      });
      team.team_barrier();
      selective_scan_team_items(team, tb.channels, len, [&](const int c, const int t) {
        const int d = tb.d0 + c;
        const float skip = in.skip(d);
        float y = 0.0f, first = 0.0f, second = 0.0f;
        for (int q = 0; q < state_threads; ++q) {
          y += sy(q * cpt + c, t);
          first += sfirst(q * cpt + c, t);
          second += ssecond(q * cpt + c, t);
        }
        const float dpre = second * sdelta_grad(c, t);
        ssecond(c, t) = dpre;
        du(tb.b, d, t0 + t) = skip * sg(c, t) + sdelta(c, t) * first;
        ddelta(tb.b, d, t0 + t) = dpre;
        if (in.has_z) {
          const float zz = in.z(tb.b, d, t0 + t);
          dz(tb.b, d, t0 + t) = dout(tb.b, d, t0 + t) * (y + skip * su(c, t)) * kmamba::silu_derivative(zz);
        }
      });
      selective_scan_team_items(team, nstate, len, [&](const int n, const int t) {
        float sum = 0.0f;
        for (int c = 0; c < tb.channels; ++c) sum += hs(c, n, t);
        dB_blocks(tb.b, tb.g, tb.block, n, t0 + t) = sum;
      });
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels), [&](const int c) {
        float dD = sacc(c, 0), dbias = sacc(c, 1);
        for (int t = len - 1; t >= 0; --t) {
          dD += sg(c, t) * su(c, t);
          dbias += ssecond(c, t);
        }
        sacc(c, 0) = dD;
        sacc(c, 1) = dbias;
      });
    }
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels * nstate), [&](const int i) {
      const int c = i / nstate, n = i % nstate;
      const int d = tb.d0 + c;
      partial_dA(tb.b, d, n) = sdA(c, n);
      if (write_dinitial_state) dinitial_state(tb.b, d, n) = smu(c, n);
      if (n == 0) {
        partial_vectors(tb.b, d, 0) = sacc(c, 0);
        partial_vectors(tb.b, d, 1) = sacc(c, 1);
      }
    });
  }
};

/// Second pass of the backward: dA, dD and ddelta_bias summed over the batch, one thread per
/// (channel, state), in a fixed order.
template <class MemorySpace>
struct SelectiveScanBatchSumFunctor {
  ConstTensor3<float, MemorySpace> partial_dA;       // (batch, dim, dstate)
  ConstTensor3<float, MemorySpace> partial_vectors;  // (batch, dim, 2)
  Tensor2<float, MemorySpace> dA;                    // (dim, dstate)
  Tensor1<float, MemorySpace> dD, ddelta_bias;       // (dim)
  bool write_dD, write_ddelta_bias;

  KOKKOS_INLINE_FUNCTION void operator()(const int index) const {
    const int nstate = static_cast<int>(dA.extent(1));
    const int d = index / nstate;
    const int n = index % nstate;
    const int batch = static_cast<int>(partial_dA.extent(0));
    float sum = 0.0f;
    for (int b = 0; b < batch; ++b) sum += partial_dA(b, d, n);
    dA(d, n) = sum;
    if (n == 0) {
      float sum_d = 0.0f, sum_bias = 0.0f;
      for (int b = 0; b < batch; ++b) {
        sum_d += partial_vectors(b, d, 0);
        sum_bias += partial_vectors(b, d, 1);
      }
      if (write_dD) dD(d) = sum_d;
      if (write_ddelta_bias) ddelta_bias(d) = sum_bias;
    }
  }
};

/// dB and dC from the teams' blocks, summed in block order; one thread per (batch, group, state,
/// token).
template <class MemorySpace>
struct SelectiveScanBlockSumFunctor {
  ConstTensor5<float, MemorySpace> dB_blocks, dC_blocks;  // (batch, ngroups, blocks_per_group, dstate, seqlen)
  Tensor4<float, MemorySpace> dB, dC;                     // (batch, ngroups, dstate, seqlen)

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t index) const {
    const std::int64_t seqlen = static_cast<std::int64_t>(dB.extent(3));
    const std::int64_t nstate = static_cast<std::int64_t>(dB.extent(2));
    const std::int64_t ngroups = static_cast<std::int64_t>(dB.extent(1));
    const int t = static_cast<int>(index % seqlen);
    const int n = static_cast<int>((index / seqlen) % nstate);
    const int g = static_cast<int>((index / (seqlen * nstate)) % ngroups);
    const int b = static_cast<int>(index / (seqlen * nstate * ngroups));
    float sum_b = 0.0f, sum_c = 0.0f;
    for (int block = 0; block < static_cast<int>(dB_blocks.extent(2)); ++block) {
      sum_b += dB_blocks(b, g, block, n, t);
      sum_c += dC_blocks(b, g, block, n, t);
    }
    dB(b, g, n, t) = sum_b;
    dC(b, g, n, t) = sum_c;
  }
};

/// One decode step: every (batch, channel) advances its state by one token in place.
template <class ExecSpace, class MemorySpace>
struct SelectiveScanStepFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;

  ConstTensor2<float, MemorySpace> u, delta;    // (batch, dim)
  ConstTensor2<float, MemorySpace> A;           // (dim, dstate)
  ConstTensor3<float, MemorySpace> B, C;        // (batch, ngroups, dstate)
  ConstTensor1<float, MemorySpace> D;           // (dim)
  ConstTensor2<float, MemorySpace> z;           // (batch, dim)
  ConstTensor1<float, MemorySpace> delta_bias;  // (dim)
  Tensor3<float, MemorySpace> state;            // (batch, dim, dstate)
  Tensor2<float, MemorySpace> out;              // (batch, dim)
  bool has_D, has_z, has_delta_bias, delta_softplus;
  SelectiveScanPlan plan;

  static std::size_t scratch_bytes(int, int, int) { return 0; }

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const SelectiveScanTeamBlock tb = selective_scan_team_block(plan, team.league_rank());
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, tb.channels), [&](const int c) {
      const int d = tb.d0 + c;
      const float pre = delta(tb.b, d) + (has_delta_bias ? delta_bias(d) : 0.0f);
      const float dt = delta_softplus ? kmamba::softplus(pre) : pre;
      const float uu = u(tb.b, d);
      const float dtu = dt * uu;
      float y = 0.0f;
      Kokkos::parallel_reduce(
          Kokkos::ThreadVectorRange(team, plan.dstate),
          [&](const int n, float& acc) {
            const float h = kmamba::math::exp(dt * A(d, n)) * state(tb.b, d, n) + dtu * B(tb.b, tb.g, n);
            state(tb.b, d, n) = h;
            acc += C(tb.b, tb.g, n) * h;
          },
          y);
      Kokkos::single(Kokkos::PerThread(team), [&]() {
        float v = y + (has_D ? D(d) * uu : 0.0f);
        if (has_z) v *= kmamba::silu(z(tb.b, d));
        out(tb.b, d) = v;
      });
    });
  }
};

/// Runs the forward scan in chunks of `requested_chunk` tokens (0: chosen here), writing what is
/// allocated of out, last_state and checkpoints: the register form when dstate fits it, the
/// lane form otherwise. Returns the chunk length used.
template <class ExecSpace, class MemorySpace>
int selective_scan_forward_launch(const ExecSpace& exec, const char* function, const char* label,
                                  const SelectiveScanDims& dims, int requested_chunk,
                                  const SelectiveScanOperands<MemorySpace>& operands,
                                  const Tensor3<float, MemorySpace>& out, const Tensor3<float, MemorySpace>& last_state,
                                  const Tensor4<float, MemorySpace>& checkpoints) {
  if (dims.dstate <= selective_scan_register_states) {
    // Teams of Functor::team_channels channels share the staging of B and C.
    using Functor = SelectiveScanForwardRegisterFunctor<ExecSpace, MemorySpace>;
    const SelectiveScanPlan plan = selective_scan_plan<ExecSpace>(
        function, dims, requested_chunk, &Functor::scratch_bytes, Functor::team_channels, false);
    const Functor functor{operands,
                          plan,
                          out,
                          last_state,
                          checkpoints,
                          out.is_allocated(),
                          last_state.is_allocated(),
                          checkpoints.is_allocated()};
    selective_scan_launch(exec, label, plan, functor,
                          Functor::scratch_bytes(plan.channels_per_team, plan.chunk, plan.dstate),
                          plan.channels_per_team * Functor::state_threads);
    return plan.chunk;
  }
  using Functor = SelectiveScanForwardFunctor<ExecSpace, MemorySpace>;
  const SelectiveScanPlan plan =
      selective_scan_plan<ExecSpace>(function, dims, requested_chunk, &Functor::scratch_bytes);
  const Functor functor{operands,
                        plan,
                        out,
                        last_state,
                        checkpoints,
                        out.is_allocated(),
                        last_state.is_allocated(),
                        checkpoints.is_allocated()};
  selective_scan_launch(exec, label, plan, functor,
                        Functor::scratch_bytes(plan.channels_per_team, plan.chunk, plan.dstate));
  return plan.chunk;
}

template <class ExecSpace, class MemorySpace>
void selective_scan_forward_impl(const ExecSpace& exec, const char* function, const SelectiveScanDims& dims,
                                 const SelectiveScanArgs<MemorySpace>& args, const Tensor3<float, MemorySpace>& out,
                                 const Tensor3<float, MemorySpace>& last_state) {
  selective_scan_forward_launch(exec, function, "kmamba::selective_scan::forward", dims, args.chunk_size,
                                SelectiveScanOperands<MemorySpace>(args), out, last_state,
                                Tensor4<float, MemorySpace>());
}

template <class ExecSpace, class MemorySpace>
void selective_scan_backward_impl(const ExecSpace& exec, const char* function, const SelectiveScanDims& dims,
                                  const SelectiveScanArgs<MemorySpace>& args,
                                  const ConstTensor3<float, MemorySpace>& dout,
                                  const ConstTensor3<float, MemorySpace>& dlast_state,
                                  const SelectiveScanGrads<MemorySpace>& grads) {
  using Backward = SelectiveScanBackwardFunctor<ExecSpace, MemorySpace>;
  using RegisterBackward = SelectiveScanBackwardRegisterFunctor<ExecSpace, MemorySpace>;
  // The register form where dstate fits it, as for the forward; the lane form otherwise.
  const bool registers = dims.dstate <= selective_scan_register_states;
  const SelectiveScanPlan plan =
      registers
          ? selective_scan_plan<ExecSpace>(function, dims, args.chunk_size, &RegisterBackward::scratch_bytes,
                                           RegisterBackward::team_channels, false, RegisterBackward::preferred_chunk)
          : selective_scan_plan<ExecSpace>(function, dims, args.chunk_size, &Backward::scratch_bytes);

  const auto checkpoints = allocate_uninitialized<Tensor4<float, MemorySpace>>(
      "kmamba::selective_scan::checkpoints", dims.batch, dims.dim, plan.nchunks, dims.dstate);
  const auto partial_dA = allocate_uninitialized<Tensor3<float, MemorySpace>>("kmamba::selective_scan::partial_dA",
                                                                              dims.batch, dims.dim, dims.dstate);
  const auto partial_vectors = allocate_uninitialized<Tensor3<float, MemorySpace>>(
      "kmamba::selective_scan::partial_dD_ddelta_bias", dims.batch, dims.dim, 2);

  const SelectiveScanOperands<MemorySpace> operands(args);
  // The checkpoint pass must cut the sequence where the backward does.
  const int forward_chunk =
      selective_scan_forward_launch(exec, function, "kmamba::selective_scan::checkpoints", dims, plan.chunk, operands,
                                    Tensor3<float, MemorySpace>(), Tensor3<float, MemorySpace>(), checkpoints);
  KMAMBA_ASSERT(forward_chunk == plan.chunk,
                "checkpoint pass chunk " << forward_chunk << " differs from the backward's " << plan.chunk);

  // One block a group: the teams' blocks are dB and dC themselves (the same layout with an
  // extent of 1). Otherwise a workspace of a block per team, summed by a second kernel.
  const bool one_block = plan.blocks_per_group == 1 && grads.dB.span_is_contiguous() && grads.dC.span_is_contiguous();
  auto blocks_of = [&](const Tensor4<float, MemorySpace>& grad, const char* label) {
    const auto extent = [](const std::int64_t e) { return static_cast<std::size_t>(e); };
    return one_block ? Tensor5<float, MemorySpace>(grad.data(),
                                                   Kokkos::LayoutRight(extent(dims.batch), extent(dims.ngroups), 1,
                                                                       extent(dims.dstate), extent(dims.seqlen)))
                     : allocate_uninitialized<Tensor5<float, MemorySpace>>(
                           label, dims.batch, dims.ngroups, plan.blocks_per_group, dims.dstate, dims.seqlen);
  };
  const Tensor5<float, MemorySpace> dB_blocks = blocks_of(grads.dB, "kmamba::selective_scan::dB_blocks");
  const Tensor5<float, MemorySpace> dC_blocks = blocks_of(grads.dC, "kmamba::selective_scan::dC_blocks");
  // Both forms take the same members; `form` carries the functor type.
  auto launch = [&](auto form, const int team_threads) {
    using Functor = typename decltype(form)::type;
    const Functor backward{operands,
                           plan,
                           dout,
                           dlast_state,
                           checkpoints,
                           grads.du,
                           grads.ddelta,
                           grads.dz,
                           dB_blocks,
                           dC_blocks,
                           grads.dinitial_state,
                           partial_dA,
                           partial_vectors,
                           dlast_state.is_allocated(),
                           grads.dinitial_state.is_allocated()};
    selective_scan_launch(exec, "kmamba::selective_scan::backward", plan, backward,
                          Functor::scratch_bytes(plan.channels_per_team, plan.chunk, plan.dstate), team_threads);
  };
  if (registers) {
    launch(SelectiveScanIdentity<RegisterBackward>(), plan.channels_per_team * RegisterBackward::state_threads);
  } else {
    launch(SelectiveScanIdentity<Backward>(), 0);
  }

  if (!one_block) {
    Kokkos::parallel_for("kmamba::selective_scan::block_sum_dB_dC",
                         Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(
                             exec, 0, dims.batch * dims.ngroups * dims.dstate * dims.seqlen),
                         SelectiveScanBlockSumFunctor<MemorySpace>{dB_blocks, dC_blocks, grads.dB, grads.dC});
  }
  const SelectiveScanBatchSumFunctor<MemorySpace> batch_sum{partial_dA,
                                                            partial_vectors,
                                                            grads.dA,
                                                            grads.dD,
                                                            grads.ddelta_bias,
                                                            grads.dD.is_allocated(),
                                                            grads.ddelta_bias.is_allocated()};
  Kokkos::parallel_for("kmamba::selective_scan::batch_sum",
                       Kokkos::RangePolicy<ExecSpace>(exec, 0, dims.dim * dims.dstate), batch_sum);
}

template <class ExecSpace, class MemorySpace>
void selective_scan_step_impl(const ExecSpace& exec, const SelectiveScanDims& dims,
                              const SelectiveScanStepArgs<MemorySpace>& args, const Tensor3<float, MemorySpace>& state,
                              const Tensor2<float, MemorySpace>& out) {
  using Functor = SelectiveScanStepFunctor<ExecSpace, MemorySpace>;
  const SelectiveScanPlan plan =
      selective_scan_plan<ExecSpace>("kmamba::selective_scan_step", dims, 1, &Functor::scratch_bytes);
  const Functor functor{args.u,
                        args.delta,
                        args.A,
                        args.B,
                        args.C,
                        args.D,
                        args.z,
                        args.delta_bias,
                        state,
                        out,
                        args.D.is_allocated(),
                        args.z.is_allocated(),
                        args.delta_bias.is_allocated(),
                        args.delta_softplus,
                        plan};
  selective_scan_launch(exec, "kmamba::selective_scan::step", plan, functor, 0);
}

}  // namespace impl
}  // namespace kmamba

#endif
