// The SSD decode step (docs/algorithms.md §2.10): its functor and its launch.
#ifndef KMAMBA_CORE_IMPL_SSDSTEP_HPP
#define KMAMBA_CORE_IMPL_SSDSTEP_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Math.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/SsdLaunchPlan.hpp>
#include <kmamba/core/impl/SsdOperands.hpp>

#include <Kokkos_Core.hpp>

namespace kmamba {

template <class MemorySpace>
struct SsdStepArgs;

namespace impl {

/// One decode step (docs/algorithms.md §2.10): a team per (batch, head), threads over headdim,
/// lanes over dstate.
template <class ExecSpace, class MemorySpace>
struct SsdStepFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  ConstTensor3<float, MemorySpace> x;        // (batch, nheads, headdim)
  ConstTensor2<float, MemorySpace> dt;       // (batch, nheads)
  ConstTensor1<float, MemorySpace> A;        // (nheads)
  ConstTensor3<float, MemorySpace> B, C;     // (batch, ngroups, dstate)
  ConstTensor1<float, MemorySpace> D;        // (nheads)
  ConstTensor3<float, MemorySpace> z;        // (batch, nheads, headdim)
  ConstTensor1<float, MemorySpace> dt_bias;  // (nheads)
  Tensor4<float, MemorySpace> state;         // (batch, nheads, headdim, dstate)
  Tensor3<float, MemorySpace> out;           // (batch, nheads, headdim)
  bool has_D, has_z, has_dt_bias, dt_softplus;
  SsdPlan plan;
  int rows_per_team;  // headdim rows of one head per team: a decode step at batch 1 still fills the GPU

  int league() const { return plan.batch * plan.nheads * row_blocks(); }
  KOKKOS_INLINE_FUNCTION int row_blocks() const { return (plan.headdim + rows_per_team - 1) / rows_per_team; }

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int block = team.league_rank() % row_blocks();
    const int h = (team.league_rank() / row_blocks()) % plan.nheads;
    const int b = team.league_rank() / row_blocks() / plan.nheads;
    const int g = h / plan.heads_per_group;
    const float pre = dt(b, h) + (has_dt_bias ? dt_bias(h) : 0.0f);
    const float d = dt_softplus ? softplus(pre) : pre;
    const float decay = kmamba::math::exp(d * A(h));
    const int p_begin = block * rows_per_team;
    const int p_end = p_begin + rows_per_team < plan.headdim ? p_begin + rows_per_team : plan.headdim;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, p_begin, p_end), [&](const int p) {
      const float xv = x(b, h, p);
      float y = 0.0f;
      Kokkos::parallel_reduce(
          Kokkos::ThreadVectorRange(team, plan.dstate),
          [&](const int n, float& acc) {
            const float s = decay * state(b, h, p, n) + d * xv * B(b, g, n);
            state(b, h, p, n) = s;
            acc += s * C(b, g, n);
          },
          y);
      Kokkos::single(Kokkos::PerThread(team), [&]() {
        float o = y + (has_D ? D(h) * xv : 0.0f);
        if (has_z) o *= silu(z(b, h, p));
        out(b, h, p) = o;
      });
    });
  }
};

template <class ExecSpace, class MemorySpace>
void ssd_step_impl(const ExecSpace& exec, const SsdDims& dims, const SsdStepArgs<MemorySpace>& args,
                   const Tensor4<float, MemorySpace>& state, const Tensor3<float, MemorySpace>& out) {
  const SsdPlan plan = ssd_plan<ExecSpace>("kmamba::ssd_step", dims, 1);
  const SsdStepFunctor<ExecSpace, MemorySpace> functor{args.x,
                                                       args.dt,
                                                       args.A,
                                                       args.B,
                                                       args.C,
                                                       args.D,
                                                       args.z,
                                                       args.dt_bias,
                                                       state,
                                                       out,
                                                       args.D.is_allocated(),
                                                       args.z.is_allocated(),
                                                       args.dt_bias.is_allocated(),
                                                       args.dt_softplus,
                                                       plan,
                                                       plan.team_size};
  ssd_launch(exec, "kmamba::ssd::step", plan, functor.league(), functor, 0);
}

}  // namespace impl
}  // namespace kmamba

#endif
