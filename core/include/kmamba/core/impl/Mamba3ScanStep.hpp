// The Mamba-3 decode step (docs/algorithms.md §3.7): its functor and its launch.
#ifndef KMAMBA_CORE_IMPL_MAMBA3SCANSTEP_HPP
#define KMAMBA_CORE_IMPL_MAMBA3SCANSTEP_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Math.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/Mamba3ScanOperands.hpp>
#include <kmamba/core/impl/Mamba3ScanPlan.hpp>

#include <Kokkos_Core.hpp>

#include <cstddef>

namespace kmamba {
namespace impl {

/// One decode step (docs/algorithms.md §3.7): a team per (batch, head); threads over headdim,
/// lanes over dstate.
template <class ExecSpace, class MemorySpace>
struct Mamba3StepFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using S = Mamba3Scratch<ExecSpace>;
  Mamba3StepOperands<MemorySpace> in;
  Mamba3StateViews<float, MemorySpace> states;
  Tensor3<float, MemorySpace> out;  // (batch, nheads, headdim)
  Mamba3Plan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int h = team.league_rank() % plan.nheads;
    const int b = team.league_rank() / plan.nheads;
    const int g = h / plan.heads_per_group;
    const int R = plan.rank, N = plan.dstate, P = plan.headdim;
    typename S::Vec sq(team.team_scratch(0), R * N);
    typename S::Vec sk(team.team_scratch(0), R * N);
    typename S::Vec sv(team.team_scratch(0), R * P);
    typename S::Vec stheta(team.team_scratch(0), plan.nangles);
    const float d = in.dt(b, h);
    const float lambda = sigmoid(in.trap(b, h));
    const float alpha = kmamba::math::exp(in.adt(b, h));
    const float beta = sigmoid(-in.trap(b, h)) * d * alpha;
    const float gamma = lambda * d;
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, plan.nangles), [&](const int i) {
      float theta = states.angle(b, h, i) + mamba3_pi * kmamba::math::tanh(in.angles(b, h, i)) * d;
      if (in.wrap_angle) theta -= mamba3_two_pi * kmamba::math::floor(theta / mamba3_two_pi);
      stheta(i) = theta;
    });
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, R * N), [&](const int rn) {
      const int r = rn / N, n = rn % N;
      if (n < 2 * plan.nangles) {
        const int i = n / 2, n0 = 2 * i, n1 = 2 * i + 1;
        const float c = kmamba::math::cos(stheta(i));
        const float s = kmamba::math::sin(stheta(i));
        const float q0 = in.q_in(b, r, g, n0) + in.q_bias(h, r, n0), q1 = in.q_in(b, r, g, n1) + in.q_bias(h, r, n1);
        const float k0 = in.k_in(b, r, g, n0) + in.k_bias(h, r, n0), k1 = in.k_in(b, r, g, n1) + in.k_bias(h, r, n1);
        sq(rn) = n == n0 ? q0 * c - q1 * s : q0 * s + q1 * c;
        sk(rn) = n == n0 ? k0 * c - k1 * s : k0 * s + k1 * c;
      } else {
        sq(rn) = in.q_in(b, r, g, n) + in.q_bias(h, r, n);
        sk(rn) = in.k_in(b, r, g, n) + in.k_bias(h, r, n);
      }
    });
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, R * P),
                         [&](const int rp) { sv(rp) = in.v(b, h, rp % P) * in.v_proj(h, rp / P, rp % P); });
    team.team_barrier();
    const float skip = in.has_D ? in.D(h) : 0.0f;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, P), [&](const int p) {
      // Rank 0's reduction updates the state; the others read back what the same lanes wrote.
      float o = 0.0f;
      for (int r = 0; r < R; ++r) {
        float y = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::ThreadVectorRange(team, N),
            [&](const int n, float& acc) {
              if (r == 0) {
                float prev = 0.0f, cur = 0.0f;
                for (int rr = 0; rr < R; ++rr) {
                  prev += states.v(b, h, rr, p) * states.k(b, h, rr, n);
                  cur += sv(rr * P + p) * sk(rr * N + n);
                }
                states.ssm(b, h, p, n) = alpha * states.ssm(b, h, p, n) + beta * prev + gamma * cur;
              }
              acc += states.ssm(b, h, p, n) * sq(r * N + n);
            },
            y);
        const float gate = in.has_z ? silu(in.z(b, h, p) * in.z_proj(h, r, p)) : 1.0f;
        o += (y + skip * sv(r * P + p)) * gate * in.o_proj(h, r, p);
      }
      Kokkos::single(Kokkos::PerThread(team), [&]() { out(b, h, p) = o; });
    });
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, R * N),
                         [&](const int rn) { states.k(b, h, rn / N, rn % N) = sk(rn); });
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, R * P),
                         [&](const int rp) { states.v(b, h, rp / P, rp % P) = sv(rp); });
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, plan.nangles),
                         [&](const int i) { states.angle(b, h, i) = stheta(i); });
  }
};

template <class ExecSpace, class MemorySpace>
void mamba3_step_impl(const ExecSpace& exec, const char* function, const Mamba3Dims& dims,
                      const Mamba3StepOperands<MemorySpace>& in, const Mamba3StateViews<float, MemorySpace>& states,
                      const Tensor3<float, MemorySpace>& out) {
  using Vec = typename Mamba3Scratch<ExecSpace>::Vec;
  const Mamba3Plan plan = mamba3_plan<ExecSpace>(function, dims, 1);
  const int R = plan.rank;
  const std::size_t scratch =
      2 * Vec::shmem_size(R * plan.dstate) + Vec::shmem_size(R * plan.headdim) + Vec::shmem_size(plan.nangles);
  mamba3_launch(exec, "kmamba::mamba3::step", plan, plan.batch * plan.nheads,
                Mamba3StepFunctor<ExecSpace, MemorySpace>{in, states, out, plan}, scratch);
}

}  // namespace impl
}  // namespace kmamba

#endif
