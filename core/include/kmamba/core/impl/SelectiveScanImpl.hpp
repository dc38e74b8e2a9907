// Internals of kmamba/core/SelectiveScan.hpp: the launch plans and the functors.
//
// Two forms. Up to selective_scan_walk_states states (Mamba-1's 16) with kmamba's chunk, the
// walk form (impl/SelectiveScanWalk.hpp, impl/SelectiveScanWalkBackward.hpp: each thread walks
// its states of a channel token after token, the backward tiles last to first from checkpoints
// the forward walk writes). Wider states, or a chunk_size of the caller's, the lane form of this
// file: one team per (batch, group, block of
// channels of that group); the channels are spread over the team's threads (one per channel on a GPU, a single thread
// on a host backend, where team barriers and shared cache lines cost more than they save), and the vector lanes of a
// thread own the states n of its channel (lane n % vector_length), so the per-token sum over n is a vector reduction
// and the running state of (channel, n) never leaves the lane that owns it. The sequence is walked in chunks: the team
// stages the chunk's u, δ, B and C in level-0 scratch, then each thread scans its channels over the chunk, then the
// team writes the chunk's outputs with coalesced stores.
#ifndef KMAMBA_CORE_IMPL_SELECTIVESCANIMPL_HPP
#define KMAMBA_CORE_IMPL_SELECTIVESCANIMPL_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>
#include <kmamba/core/impl/SelectiveScanWalk.hpp>
#include <kmamba/core/impl/SelectiveScanWalkBackward.hpp>
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

/// The team shapes each backend runs: the walk forms' forward and backward.
/// Cuda: 128 threads (32 channels of 4 lanes at dstate 16) walking 4 tokens a step; the forward
/// tiles of 16 steps (two buffers of a tile's rows take 70 KB of scratch, so that three teams fit
/// a multiprocessor), the backward tiles of 8 steps (two buffers of its five rows a channel and
/// the warps' dB, dC sums take 72 KB: three teams a multiprocessor; the states entering its 8
/// steps stay in registers). Host backends: 16 threads in turn, the same tiles of 64 and 32
/// tokens. The forward writes the backward's checkpoints at its tiles, a multiple of the
/// forward's items.
template <class ExecSpace>
struct SelectiveScanDefaultShapes {
  using forward = SelectiveScanWalkShape<16, 4, 16, false>;
  using backward = SelectiveScanWalkShape<16, 4, 8, false>;
};
#if defined(KOKKOS_ENABLE_CUDA)
template <>
struct SelectiveScanDefaultShapes<Kokkos::Cuda> {
  using forward = SelectiveScanWalkShape<128, 4, 16, true>;
  using backward = SelectiveScanWalkShape<128, 4, 8, true>;
};
#endif

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

/// Backward scan, chunks last to first. Per chunk: restart the forward from the chunk's
/// checkpoint keeping every state of the chunk in scratch, then walk the chunk backwards with the
/// adjoint state μ_t = ā_{t+1}·λ_{t+1} carried from the later chunk. Per-(batch, channel) sums
/// over seqlen (dA, dD, ddelta_bias) go to `partial_*`. dB and dC are summed over the channels
/// of the team in channel order from the state tile (dC from the recomputed states before the
/// backward walk, dB from the λ·δ·u terms the walk leaves in their place) and written as the
/// team's block of `partial_dB`, `partial_dC`, which SelectiveScanBlockSumFunctor sums over the
/// blocks in order: no atomics, so the gradients repeat bit for bit.
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
  ConstTensor3<float, MemorySpace> dout;               // (batch, dim, seqlen)
  ConstTensor3<float, MemorySpace> dlast_state;        // (batch, dim, dstate)
  ConstTensor4<float, MemorySpace> checkpoints;        // (batch, dim, nchunks, dstate)
  Tensor3<float, MemorySpace> du, ddelta, dz;          // (batch, dim, seqlen)
  Tensor5<float, MemorySpace> partial_dB, partial_dC;  // (blocks_per_group, batch, ngroups, dstate, seqlen)
  Tensor3<float, MemorySpace> dinitial_state;          // (batch, dim, dstate)
  Tensor3<float, MemorySpace> partial_dA;              // (batch, dim, dstate)
  Tensor3<float, MemorySpace> partial_vectors;         // (batch, dim, 2): dD, ddelta_bias
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
          partial_dC(tb.block, tb.b, tb.g, n, t0 + t) = sum;
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
          partial_dB(tb.block, tb.b, tb.g, n, t0 + t) = sum;
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

/// The backward's dB and dC per block of a group's channels, which each team writes for its own
/// block and sum_into adds in block order (no atomics: the sums repeat bitwise).
template <class MemorySpace>
struct SelectiveScanBlockPartials {
  Tensor5<float, MemorySpace> dB, dC;  // (blocks, batch, ngroups, dstate, seqlen)

  SelectiveScanBlockPartials(const SelectiveScanDims& dims, std::int64_t blocks)
      : dB(allocate_uninitialized<Tensor5<float, MemorySpace>>("kmamba::selective_scan::partial_dB", blocks, dims.batch,
                                                               dims.ngroups, dims.dstate, dims.seqlen)),
        dC(allocate_uninitialized<Tensor5<float, MemorySpace>>("kmamba::selective_scan::partial_dC", blocks, dims.batch,
                                                               dims.ngroups, dims.dstate, dims.seqlen)) {}

  /// grads.dB, grads.dC = the blocks' partial sums.
  template <class ExecSpace>
  void sum_into(const ExecSpace& exec, const SelectiveScanGrads<MemorySpace>& grads) const {
    const int batch = static_cast<int>(grads.dB.extent(0)), ngroups = static_cast<int>(grads.dB.extent(1));
    const int dstate = static_cast<int>(grads.dB.extent(2)), seqlen = static_cast<int>(grads.dB.extent(3));
    Kokkos::parallel_for(
        "kmamba::selective_scan::block_sum",
        Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<4>>(exec, {0, 0, 0, 0}, {batch, ngroups, dstate, seqlen}),
        SelectiveScanBlockSumFunctor<MemorySpace>{dB, dC, grads.dB, grads.dC});
  }
};

/// Runs the lane form of the forward scan in chunks of `requested_chunk` tokens (0: chosen here),
/// writing what is allocated of out, last_state and checkpoints. Returns the chunk length used.
template <class ExecSpace, class MemorySpace>
int selective_scan_lane_forward(const ExecSpace& exec, const char* function, const char* label,
                                const SelectiveScanDims& dims, int requested_chunk,
                                const SelectiveScanOperands<MemorySpace>& operands,
                                const Tensor3<float, MemorySpace>& out,          // (batch, dim, seqlen)
                                const Tensor3<float, MemorySpace>& last_state,   // (batch, dim, dstate)
                                const Tensor4<float, MemorySpace>& checkpoints)  // (batch, dim, nchunks, dstate)
{
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

/// The walk forms' shared part for the team shape `Shape` and `channel_rows` rows per channel
/// (copying `dout` when allocated); the number of teams in `league`.
template <class Shape, class MemorySpace>
SelectiveScanWalkTiles<Shape, MemorySpace> selective_scan_walk_tiles(const SelectiveScanDims& dims,
                                                                     const SelectiveScanOperands<MemorySpace>& operands,
                                                                     const ConstTensor3<float, MemorySpace>& dout,
                                                                     int channel_rows, int& league) {
  const int dstate = static_cast<int>(dims.dstate), seqlen = static_cast<int>(dims.seqlen);
  int lanes = 1;
  while (lanes * selective_scan_lane_states < dstate) lanes *= 2;
  KMAMBA_ASSERT(lanes <= selective_scan_max_lanes, "walk form with dstate " << dstate);
  const int channels = Shape::threads / lanes;
  const int channels_per_group = static_cast<int>(dims.dim / dims.ngroups);
  const int blocks_per_group = (channels_per_group + channels - 1) / channels;
  auto aligned = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; };
  const bool vector_copies = Shape::tile % 4 == 0 && seqlen % 4 == 0 && aligned(operands.u.data()) &&
                             aligned(operands.delta.data()) && aligned(operands.B.data()) &&
                             aligned(operands.C.data()) && (!operands.has_z || aligned(operands.z.data())) &&
                             (!dout.is_allocated() || aligned(dout.data()));
  league = static_cast<int>(dims.batch * dims.ngroups) * blocks_per_group;
  return SelectiveScanWalkTiles<Shape, MemorySpace>{operands,
                                                    seqlen,
                                                    dstate,
                                                    static_cast<int>(dims.ngroups),
                                                    channels_per_group,
                                                    blocks_per_group,
                                                    SelectiveScanWalkLayout(lanes, channels, Shape::tile, channel_rows),
                                                    vector_copies,
                                                    dout};
}

/// Runs the walk-form forward with the team shape `Shape`, writing what is allocated of out,
/// last_state and checkpoints (the state entering every `checkpoint_interval` tokens).
template <class Shape, class ExecSpace, class MemorySpace>
void selective_scan_walk_forward(const ExecSpace& exec, const char* label, const SelectiveScanDims& dims,
                                 const SelectiveScanOperands<MemorySpace>& operands,
                                 const Tensor3<float, MemorySpace>& out,          // (batch, dim, seqlen)
                                 const Tensor3<float, MemorySpace>& last_state,   // (batch, dim, dstate)
                                 const Tensor4<float, MemorySpace>& checkpoints,  // (batch, dim, nchunks, dstate)
                                 int checkpoint_interval) {
  using Functor = SelectiveScanWalkForward<Shape, MemorySpace>;
  KMAMBA_ASSERT(checkpoint_interval > 0 && checkpoint_interval % Shape::items == 0,
                "checkpoint interval " << checkpoint_interval << " is not a multiple of " << Shape::items);
  // z only gates the output: a pass without one (the checkpoint pass) does not copy it.
  SelectiveScanOperands<MemorySpace> used = operands;
  used.has_z = operands.has_z && out.is_allocated();
  int league = 0;
  const Functor functor{
      selective_scan_walk_tiles<Shape>(dims, used, ConstTensor3<float, MemorySpace>(), Functor::channel_rows, league),
      checkpoint_interval, out, last_state, checkpoints};
  WarpTeamLauncher<ExecSpace, Shape::threads / Shape::slots, 3>::launch(
      exec, label, league, functor.tiles.layout.bytes(Functor::extra_floats(functor.tiles.layout)), functor);
}

/// The walk-form backward with the team shape `Shape`: the checkpoint pass (the walk-form forward
/// with the shape `ForwardShape`, a checkpoint every Shape::tile tokens), the backward, and dB,
/// dC summed over the channel blocks. Writes partial_dA and partial_vectors for the batch sum.
template <class ForwardShape, class Shape, class ExecSpace, class MemorySpace>
void selective_scan_walk_backward(const ExecSpace& exec, const SelectiveScanDims& dims,
                                  const SelectiveScanOperands<MemorySpace>& operands,
                                  const ConstTensor3<float, MemorySpace>& dout,         // (batch, dim, seqlen)
                                  const ConstTensor3<float, MemorySpace>& dlast_state,  // (batch, dim, dstate)
                                  const SelectiveScanGrads<MemorySpace>& grads,
                                  const Tensor3<float, MemorySpace>& partial_dA,       // (batch, dim, dstate)
                                  const Tensor3<float, MemorySpace>& partial_vectors)  // (batch, dim, 2)
{
  using Functor = SelectiveScanWalkBackward<Shape, MemorySpace>;
  const int ntiles = static_cast<int>((dims.seqlen + Shape::tile - 1) / Shape::tile);
  const auto checkpoints = allocate_uninitialized<Tensor4<float, MemorySpace>>(
      "kmamba::selective_scan::checkpoints", dims.batch, dims.dim, ntiles, dims.dstate);
  selective_scan_walk_forward<ForwardShape>(exec, "kmamba::selective_scan::checkpoints", dims, operands,
                                            Tensor3<float, MemorySpace>(), Tensor3<float, MemorySpace>(), checkpoints,
                                            Shape::tile);
  int league = 0;
  const auto tiles = selective_scan_walk_tiles<Shape>(dims, operands, dout, Functor::channel_rows, league);
  const SelectiveScanBlockPartials<MemorySpace> partial(dims, tiles.blocks_per_group);
  const Functor functor{tiles,      dlast_state, checkpoints,          grads.du,   grads.ddelta,   grads.dz,
                        partial.dB, partial.dC,  grads.dinitial_state, partial_dA, partial_vectors};
  WarpTeamLauncher<ExecSpace, Shape::threads / Shape::slots, 3>::launch(
      exec, "kmamba::selective_scan::backward", league, tiles.layout.bytes(Functor::extra_floats(tiles.layout)),
      functor);
  partial.sum_into(exec, grads);
}

/// Whether the walk forms take a call: dstate within their bound and chunk_size 0
/// (kmamba's choice); a chunk_size of the caller's runs the lane form with it.
inline bool selective_scan_takes_walk_form(const SelectiveScanDims& dims, int requested_chunk) {
  return dims.dstate <= selective_scan_walk_states && requested_chunk == 0;
}

/// The lane-form backward (wider states, or a chunk_size of the caller's).
template <class ExecSpace, class MemorySpace>
void selective_scan_lane_backward(const ExecSpace& exec, const char* function, const SelectiveScanDims& dims,
                                  int requested_chunk, const SelectiveScanOperands<MemorySpace>& operands,
                                  const ConstTensor3<float, MemorySpace>& dout,         // (batch, dim, seqlen)
                                  const ConstTensor3<float, MemorySpace>& dlast_state,  // (batch, dim, dstate)
                                  const SelectiveScanGrads<MemorySpace>& grads,
                                  const Tensor3<float, MemorySpace>& partial_dA,       // (batch, dim, dstate)
                                  const Tensor3<float, MemorySpace>& partial_vectors)  // (batch, dim, 2)
{
  using Functor = SelectiveScanBackwardFunctor<ExecSpace, MemorySpace>;
  const SelectiveScanPlan plan =
      selective_scan_plan<ExecSpace>(function, dims, requested_chunk, &Functor::scratch_bytes);
  const auto checkpoints = allocate_uninitialized<Tensor4<float, MemorySpace>>(
      "kmamba::selective_scan::checkpoints", dims.batch, dims.dim, plan.nchunks, dims.dstate);
  // The checkpoint pass must cut the sequence where the backward does.
  const int forward_chunk =
      selective_scan_lane_forward(exec, function, "kmamba::selective_scan::checkpoints", dims, plan.chunk, operands,
                                  Tensor3<float, MemorySpace>(), Tensor3<float, MemorySpace>(), checkpoints);
  KMAMBA_ASSERT(forward_chunk == plan.chunk,
                "checkpoint pass chunk " << forward_chunk << " differs from the backward's " << plan.chunk);
  const SelectiveScanBlockPartials<MemorySpace> partial(dims, plan.blocks_per_group);
  const Functor backward{operands,
                         plan,
                         dout,
                         dlast_state,
                         checkpoints,
                         grads.du,
                         grads.ddelta,
                         grads.dz,
                         partial.dB,
                         partial.dC,
                         grads.dinitial_state,
                         partial_dA,
                         partial_vectors,
                         dlast_state.is_allocated(),
                         grads.dinitial_state.is_allocated()};
  selective_scan_launch(exec, "kmamba::selective_scan::backward", plan, backward,
                        Functor::scratch_bytes(plan.channels_per_team, plan.chunk, plan.dstate));
  partial.sum_into(exec, grads);
}

/// `Shape`: the walk form's team shape (SelectiveScanDefaultShapes<ExecSpace>::forward for the
/// public op; the tests run other shapes on host backends).
template <class Shape, class ExecSpace, class MemorySpace>
void selective_scan_forward_impl(const ExecSpace& exec, const char* function, const SelectiveScanDims& dims,
                                 const SelectiveScanArgs<MemorySpace>& args, const Tensor3<float, MemorySpace>& out,
                                 const Tensor3<float, MemorySpace>& last_state) {
  const SelectiveScanOperands<MemorySpace> operands(args);
  if (selective_scan_takes_walk_form(dims, args.chunk_size)) {
    selective_scan_walk_forward<Shape>(exec, "kmamba::selective_scan::forward", dims, operands, out, last_state,
                                       Tensor4<float, MemorySpace>(), Shape::items);
  } else {
    selective_scan_lane_forward(exec, function, "kmamba::selective_scan::forward", dims, args.chunk_size, operands, out,
                                last_state, Tensor4<float, MemorySpace>());
  }
}

/// `ForwardShape`, `Shape`: the team shapes of the walk-form checkpoint pass and of the backward
/// walk (SelectiveScanDefaultShapes<ExecSpace> for the public op; the tests run other shapes
/// on host backends).
template <class ForwardShape, class Shape, class ExecSpace, class MemorySpace>
void selective_scan_backward_impl(const ExecSpace& exec, const char* function, const SelectiveScanDims& dims,
                                  const SelectiveScanArgs<MemorySpace>& args,
                                  const ConstTensor3<float, MemorySpace>& dout,
                                  const ConstTensor3<float, MemorySpace>& dlast_state,
                                  const SelectiveScanGrads<MemorySpace>& grads) {
  const auto partial_dA = allocate_uninitialized<Tensor3<float, MemorySpace>>("kmamba::selective_scan::partial_dA",
                                                                              dims.batch, dims.dim, dims.dstate);
  const auto partial_vectors = allocate_uninitialized<Tensor3<float, MemorySpace>>(
      "kmamba::selective_scan::partial_dD_ddelta_bias", dims.batch, dims.dim, 2);
  const SelectiveScanOperands<MemorySpace> operands(args);
  if (selective_scan_takes_walk_form(dims, args.chunk_size)) {
    selective_scan_walk_backward<ForwardShape, Shape>(exec, dims, operands, dout, dlast_state, grads, partial_dA,
                                                      partial_vectors);
  } else {
    selective_scan_lane_backward(exec, function, dims, args.chunk_size, operands, dout, dlast_state, grads, partial_dA,
                                 partial_vectors);
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
