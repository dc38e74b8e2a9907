// Internals of kmamba/core/ConvSsdStep.hpp: the one kernel of a Mamba-2 decode step between the
// in_proj and the out_proj.
//
// Work decomposition: one team per (batch, group, block of the group's x channels); a channel is
// a (head, headdim row) pair, c = h·headdim + p. Blocks are as many as occupy the execution space
// and no more (each team recomputes its group's B and C, see conv_ssd_step_block): on CUDA at
// batch 1 a team's thread count of channels (8, so 24 heads of 64 rows give 192 teams, as
// ssd_step), at batch 64 about 96 channels per team (16 teams per sequence); on a host with T
// threads about T blocks in all. A team of group g
//   1. computes B and C of group g after conv + SiLU (2·dstate channels over all its threads and
//      lanes, into team scratch) from the conv states as they were before the step; every team of
//      the group computes the same values, cheaper than a second launch;
//   2. per channel of its block (a thread, lanes over dstate): the x channel's conv + SiLU and
//      conv-state shift (the channel's own: no other team touches it), then the SSM update
//      state = exp(δ·A)·state + δ·x·B and y = state·C + D·x;
//   3. takes a ticket: every thread fences its writes, a team barrier, then one thread atomically
//      increments group_arrivals(b, g). The team that draws the last ticket of (b, g) — every
//      other team of the group has then read the group's B/C conv states and written its y —
//      resets the counter to zero, shifts the conv states of group g's B and C channels (exactly
//      once) and, with the gated norm, normalises the group's y (one norm group per B/C group),
//      reading the other teams' y through volatile loads (after their fences and tickets, never
//      from a stale cache line). No team waits for another, so the kernel cannot deadlock whatever
//      order the teams run in, and the norm sums in the same order whichever team is last.
#ifndef KMAMBA_CORE_IMPL_CONVSSDSTEPIMPL_HPP
#define KMAMBA_CORE_IMPL_CONVSSDSTEPIMPL_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/SsdImpl.hpp>
#include <kmamba/core/Math.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace kmamba {
namespace impl {

/// The x channels per team: one per thread (`team_size`), or more where that would give more
/// teams than `exec` runs at once, since every team recomputes its group's B and C and the last
/// team of a group normalises it: about concurrency / (groups · threads_per_team) blocks per
/// group of `group_channels` channels, `groups` counting every (sequence, group). On CUDA a team
/// is team_size · vector_length threads, so a batch-1 step still gets one channel per thread and
/// a batch-64 step about as many teams as the device holds at once; a host's teams are counted as
/// one thread each (threads_per_team 1: its vector lanes are a loop), about T blocks in all with
/// T threads.
template <class ExecSpace>
int conv_ssd_step_block(const ExecSpace& exec, std::int64_t groups, std::int64_t group_channels, int team_size,
                        int threads_per_team) {
  const std::int64_t resident = static_cast<std::int64_t>(exec.concurrency()) / std::max(1, threads_per_team);
  const std::int64_t blocks = std::max<std::int64_t>(1, resident / groups);
  return static_cast<int>(std::max<std::int64_t>(team_size, (group_channels + blocks - 1) / blocks));
}

template <class ExecSpace, class MemorySpace>
struct ConvSsdStepFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using ScratchVec = Kokkos::View<float*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;

  ConstTensor2<float, MemorySpace> xbcdt;        // (batch, columns)
  ConstTensor2<float, MemorySpace> weight;       // (conv_dim, width), channels x, B, C
  ConstTensor1<float, MemorySpace> bias;         // (conv_dim) when has_bias
  ConstTensor1<float, MemorySpace> A_log;        // (nheads)
  ConstTensor1<float, MemorySpace> D;            // (nheads) when has_D
  ConstTensor1<float, MemorySpace> dt_bias;      // (nheads) when has_dt_bias
  ConstTensor1<float, MemorySpace> norm_weight;  // (nheads·headdim) when has_norm
  Tensor3<float, MemorySpace> conv_x;            // (batch, nheads·headdim, width − 1)
  Tensor3<float, MemorySpace> conv_B;            // (batch, ngroups·dstate, width − 1)
  Tensor3<float, MemorySpace> conv_C;            // (batch, ngroups·dstate, width − 1)
  Tensor4<float, MemorySpace> ssm;               // (batch, nheads, headdim, dstate)
  Tensor2<int, MemorySpace> arrivals;            // (batch, ngroups)
  Tensor3<float, MemorySpace> y;                 // (batch, nheads, headdim)
  Tensor2<float, MemorySpace> normed;            // (batch, nheads·headdim) when has_norm
  bool has_bias, has_D, has_dt_bias, dt_softplus, has_norm, norm_before_gate;
  float norm_eps;
  int nheads, headdim, dstate, width, ngroups, heads_per_group;
  int z_column, x_column, dt_column;  // xbcdt columns of z(0) (with the norm), x(0) and dt(0); B and C follow x
  int B_channel, C_channel;           // conv channels (weight rows) of B(0) and C(0)
  int channels_per_team;              // x channels (head, row) per block

  KOKKOS_INLINE_FUNCTION int group_channels() const { return heads_per_group * headdim; }
  KOKKOS_INLINE_FUNCTION int teams_per_group() const {
    return (group_channels() + channels_per_team - 1) / channels_per_team;
  }
  int league(int batch) const { return batch * ngroups * teams_per_group(); }
  static std::size_t scratch_bytes(int dstate) { return 2 * ScratchVec::shmem_size(static_cast<std::size_t>(dstate)); }

  // silu(bias + Σ_{k < width−1} w(k)·state(k) + w(width−1)·newest) of one channel: `s` indexes the
  // state, `c` the weight and bias.
  KOKKOS_INLINE_FUNCTION float convolve(const Tensor3<float, MemorySpace>& state, int b, int s, int c,
                                        float newest) const {
    float acc = has_bias ? bias(c) : 0.0f;
    for (int k = 0; k < width - 1; ++k) acc += weight(c, k) * state(b, s, k);
    acc += weight(c, width - 1) * newest;
    return silu(acc);
  }

  // Shifts one channel's window left and appends `newest`.
  KOKKOS_INLINE_FUNCTION void shift(const Tensor3<float, MemorySpace>& state, int b, int s, float newest) const {
    for (int k = 0; k + 1 < width - 1; ++k) state(b, s, k) = state(b, s, k + 1);
    if (width > 1) state(b, s, width - 2) = newest;
  }

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int block = team.league_rank() % teams_per_group();
    const int g = (team.league_rank() / teams_per_group()) % ngroups;
    const int b = team.league_rank() / teams_per_group() / ngroups;
    const int first = g * dstate;  // the group's first B (and C) channel
    const ScratchVec Bs(team.team_scratch(0), dstate), Cs(team.team_scratch(0), dstate);

    // 1. B and C of group g (identical in every team of the group).
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, 2 * dstate), [&](const int i) {
      const int n = i < dstate ? i : i - dstate;
      const int j = first + n;
      if (i < dstate) {
        Bs(n) = convolve(conv_B, b, j, B_channel + j, xbcdt(b, x_column + B_channel + j));
      } else {
        Cs(n) = convolve(conv_C, b, j, C_channel + j, xbcdt(b, x_column + C_channel + j));
      }
    });
    team.team_barrier();

    // 2. The x channels of this block: conv, then the SSM update.
    const int c_begin = g * group_channels() + block * channels_per_team;
    const int c_end = c_begin + channels_per_team < (g + 1) * group_channels() ? c_begin + channels_per_team
                                                                               : (g + 1) * group_channels();
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, c_begin, c_end), [&](const int c) {
      const int h = c / headdim, p = c % headdim;
      const float pre = xbcdt(b, dt_column + h) + (has_dt_bias ? dt_bias(h) : 0.0f);
      const float d = dt_softplus ? softplus(pre) : pre;
      const float A = -kmamba::math::exp(A_log(h));
      const float decay = kmamba::math::exp(d * A);
      float xv = 0.0f;
      Kokkos::single(
          Kokkos::PerThread(team),
          [&](float& v) {
            const float newest = xbcdt(b, x_column + c);
            v = convolve(conv_x, b, c, c, newest);
            shift(conv_x, b, c, newest);
          },
          xv);
      float acc = 0.0f;
      Kokkos::parallel_reduce(
          Kokkos::ThreadVectorRange(team, dstate),
          [&](const int n, float& sum) {
            const float s = decay * ssm(b, h, p, n) + d * xv * Bs(n);
            ssm(b, h, p, n) = s;
            sum += s * Cs(n);
          },
          acc);
      Kokkos::single(Kokkos::PerThread(team), [&]() { y(b, h, p) = acc + (has_D ? D(h) * xv : 0.0f); });
    });

    // 3. The last team of (b, g) to get here shifts the group's B/C conv states and normalises y.
    Kokkos::memory_fence();
    team.team_barrier();
    int last = 0;
    Kokkos::single(
        Kokkos::PerTeam(team),
        [&](int& is_last) {
          Kokkos::memory_fence();
          is_last = Kokkos::atomic_fetch_add(&arrivals(b, g), 1) == teams_per_group() - 1 ? 1 : 0;
          if (is_last != 0) {
            arrivals(b, g) = 0;
            Kokkos::memory_fence();
          }
        },
        last);
    if (last == 0) return;
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, 2 * dstate), [&](const int i) {
      const int j = first + (i < dstate ? i : i - dstate);
      if (i < dstate) {
        shift(conv_B, b, j, xbcdt(b, x_column + B_channel + j));
      } else {
        shift(conv_C, b, j, xbcdt(b, x_column + C_channel + j));
      }
    });
    if (has_norm) normalize(team, b, g);
  }

  // The y of channel c (= h·headdim + p) of sequence b, as another team wrote it.
  KOKKOS_INLINE_FUNCTION float written_y(int b, int c) const {
    return *static_cast<const volatile float*>(&y(b, c / headdim, c % headdim));
  }

  // The gated RMSNorm of group g's channels of sequence b (as gated_rms_norm's forward).
  KOKKOS_INLINE_FUNCTION void normalize(const member_type& team, int b, int g) const {
    const int size = heads_per_group * headdim, begin = g * size;
    const auto input = [&](int c) {
      const float v = written_y(b, c);
      return norm_before_gate ? v : v * silu(xbcdt(b, z_column + c));
    };
    float sumsq = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::TeamVectorRange(team, begin, begin + size),
        [&](const int c, float& acc) {
          const float v = input(c);
          acc += v * v;
        },
        sumsq);
    const float r = 1.0f / kmamba::math::sqrt(sumsq / static_cast<float>(size) + norm_eps);
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, begin, begin + size), [&](const int c) {
      float out = input(c) * r * norm_weight(c);
      if (norm_before_gate) out *= silu(xbcdt(b, z_column + c));
      normed(b, c) = out;
    });
  }
};

}  // namespace impl
}  // namespace kmamba

#endif
