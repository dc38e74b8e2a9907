// The kernels of the SSD's incoming-state correction (kmamba/core/SsdStateCorrection.hpp): the
// cumulative log decay of each (batch, head) over the segment, the correction of the outputs and
// the final states, and the gradient with respect to the incoming state.
#ifndef KMAMBA_CORE_IMPL_SSDSTATECORRECTIONIMPL_HPP
#define KMAMBA_CORE_IMPL_SSDSTATECORRECTIONIMPL_HPP

#include <kmamba/core/Math.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/SsdOperands.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>

namespace kmamba {
namespace impl {

/// decay(b, h, t) = exp(Σ_{s ≤ t} a_s) of row b, head h (a_s = δ_s·A[h] or the given log decay),
/// one team per (b, h) scanning the tokens with its vector lanes in a fixed order; one exp per
/// token, which the kernels below read instead of evaluating it per output element.
template <class ExecSpace, class MemorySpace>
struct SsdCumulativeDecayFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  SsdOperands<MemorySpace> in;
  Tensor3<float, MemorySpace> decay;  // (batch, nheads, seqlen)
  int nheads, seqlen;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int b = team.league_rank() / nheads, h = team.league_rank() % nheads;
    const float rate = in.decay_rate(h);
    Kokkos::parallel_scan(Kokkos::ThreadVectorRange(team, seqlen), [&](const int t, float& partial, const bool last) {
      partial += in.token_log_decay(b, t, h, in.dt_value(in.dt_pre(b, t, h)), rate);
      if (last) decay(b, h, t) = kmamba::math::exp(partial);
    });
  }
};

template <class ExecSpace, class MemorySpace>
Tensor3<float, MemorySpace> ssd_cumulative_decay(const ExecSpace& exec, const SsdDims& dims,
                                                 const SsdOperands<MemorySpace>& in) {
  using Policy = Kokkos::TeamPolicy<ExecSpace>;
  const auto decay = allocate_uninitialized<Tensor3<float, MemorySpace>>("kmamba::ssd_state_correction::decay",
                                                                         dims.batch, dims.nheads, dims.seqlen);
  const int vector_length = std::min(32, static_cast<int>(Policy::vector_length_max()));
  Kokkos::parallel_for("kmamba::ssd_state_correction::decay",
                       Policy(exec, static_cast<int>(dims.batch * dims.nheads), 1, vector_length),
                       SsdCumulativeDecayFunctor<ExecSpace, MemorySpace>{in, decay, static_cast<int>(dims.nheads),
                                                                         static_cast<int>(dims.seqlen)});
  return decay;
}

/// segment(b, h) = decay(b, h, seqlen − 1), 1 for an empty segment.
template <class MemorySpace>
struct SsdSegmentDecayFunctor {
  ConstTensor3<float, MemorySpace> decay;  // (batch, nheads, seqlen)
  Tensor2<float, MemorySpace> segment;     // (batch, nheads)
  int nheads, seqlen;

  KOKKOS_INLINE_FUNCTION void operator()(const int item) const {
    const int b = item / nheads, h = item % nheads;
    segment(b, h) = seqlen > 0 ? decay(b, h, seqlen - 1) : 1.0f;
  }
};

/// out(b, t, h, p) += decay(b, h, t)·Σ_n incoming(b, h, p, n)·C(b, t, g, n), g the group of h.
template <class MemorySpace>
struct SsdCorrectOutputsFunctor {
  ConstTensor4<float, MemorySpace> C;         // (batch, seqlen, ngroups, dstate)
  ConstTensor3<float, MemorySpace> decay;     // (batch, nheads, seqlen)
  ConstTensor4<float, MemorySpace> incoming;  // (batch, nheads, headdim, dstate)
  Tensor4<float, MemorySpace> out;            // (batch, seqlen, nheads, headdim)
  int seqlen, nheads, headdim, dstate, heads_per_group;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int p = static_cast<int>(item % headdim);
    const int h = static_cast<int>((item / headdim) % nheads);
    const int t = static_cast<int>((item / (headdim * nheads)) % seqlen);
    const int b = static_cast<int>(item / (static_cast<std::int64_t>(headdim) * nheads * seqlen));
    const int g = h / heads_per_group;
    float sum = 0.0f;
    for (int n = 0; n < dstate; ++n) sum += incoming(b, h, p, n) * C(b, t, g, n);
    out(b, t, h, p) += decay(b, h, t) * sum;
  }
};

/// final_states(b, h, p, n) += decay(b, h, seqlen − 1)·incoming(b, h, p, n).
template <class MemorySpace>
struct SsdCorrectFinalStatesFunctor {
  ConstTensor3<float, MemorySpace> decay;     // (batch, nheads, seqlen)
  ConstTensor4<float, MemorySpace> incoming;  // (batch, nheads, headdim, dstate)
  Tensor4<float, MemorySpace> final_states;   // (batch, nheads, headdim, dstate)
  int seqlen, nheads, headdim, dstate;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int n = static_cast<int>(item % dstate);
    const int p = static_cast<int>((item / dstate) % headdim);
    const int h = static_cast<int>((item / (static_cast<std::int64_t>(dstate) * headdim)) % nheads);
    const int b = static_cast<int>(item / (static_cast<std::int64_t>(dstate) * headdim * nheads));
    const float across = seqlen > 0 ? decay(b, h, seqlen - 1) : 1.0f;
    final_states(b, h, p, n) += across * incoming(b, h, p, n);
  }
};

/// dincoming(b, h, p, n) = Σ_t decay(b, h, t)·dout(b, t, h, p)·C(b, t, g, n), the tokens
/// summed in order.
template <class MemorySpace>
struct SsdIncomingStateGradFunctor {
  ConstTensor4<float, MemorySpace> C;      // (batch, seqlen, ngroups, dstate)
  ConstTensor3<float, MemorySpace> decay;  // (batch, nheads, seqlen)
  ConstTensor4<float, MemorySpace> dout;   // (batch, seqlen, nheads, headdim)
  Tensor4<float, MemorySpace> dincoming;   // (batch, nheads, headdim, dstate)
  int seqlen, nheads, headdim, dstate, heads_per_group;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int n = static_cast<int>(item % dstate);
    const int p = static_cast<int>((item / dstate) % headdim);
    const int h = static_cast<int>((item / (static_cast<std::int64_t>(dstate) * headdim)) % nheads);
    const int b = static_cast<int>(item / (static_cast<std::int64_t>(dstate) * headdim * nheads));
    const int g = h / heads_per_group;
    float sum = 0.0f;
    for (int t = 0; t < seqlen; ++t) sum += decay(b, h, t) * dout(b, t, h, p) * C(b, t, g, n);
    dincoming(b, h, p, n) = sum;
  }
};

template <class ExecSpace, class MemorySpace>
void ssd_segment_decay_impl(const ExecSpace& exec, const SsdDims& dims, const SsdOperands<MemorySpace>& in,
                            const Tensor2<float, MemorySpace>& decay) {  // (batch, nheads)
  const auto cumulative = ssd_cumulative_decay(exec, dims, in);
  Kokkos::parallel_for("kmamba::ssd_state_correction::segment_decay",
                       Kokkos::RangePolicy<ExecSpace>(exec, 0, static_cast<int>(dims.batch * dims.nheads)),
                       SsdSegmentDecayFunctor<MemorySpace>{cumulative, decay, static_cast<int>(dims.nheads),
                                                           static_cast<int>(dims.seqlen)});
}

template <class ExecSpace, class MemorySpace>
void ssd_state_correction_forward_impl(
    const ExecSpace& exec, const SsdDims& dims, const SsdOperands<MemorySpace>& in,
    const ConstTensor4<float, MemorySpace>& incoming,   // (batch, nheads, headdim, dstate)
    const Tensor4<float, MemorySpace>& out,             // (batch, seqlen, nheads, headdim)
    const Tensor4<float, MemorySpace>& final_states) {  // (batch, nheads, headdim, dstate)
  using Range = Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>;
  const auto cumulative = ssd_cumulative_decay(exec, dims, in);
  const int L = static_cast<int>(dims.seqlen), H = static_cast<int>(dims.nheads);
  const int P = static_cast<int>(dims.headdim), N = static_cast<int>(dims.dstate);
  Kokkos::parallel_for("kmamba::ssd_state_correction::outputs", Range(exec, 0, dims.batch * L * H * P),
                       SsdCorrectOutputsFunctor<MemorySpace>{in.C, cumulative, incoming, out, L, H, P, N,
                                                             static_cast<int>(dims.nheads / dims.ngroups)});
  if (!final_states.is_allocated()) return;
  Kokkos::parallel_for("kmamba::ssd_state_correction::final_states", Range(exec, 0, dims.batch * H * P * N),
                       SsdCorrectFinalStatesFunctor<MemorySpace>{cumulative, incoming, final_states, L, H, P, N});
}

template <class ExecSpace, class MemorySpace>
void ssd_state_correction_backward_impl(
    const ExecSpace& exec, const SsdDims& dims, const SsdOperands<MemorySpace>& in,
    const ConstTensor4<float, MemorySpace>& dout,    // (batch, seqlen, nheads, headdim)
    const Tensor4<float, MemorySpace>& dincoming) {  // (batch, nheads, headdim, dstate)
  using Range = Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>;
  const auto cumulative = ssd_cumulative_decay(exec, dims, in);
  const int L = static_cast<int>(dims.seqlen), H = static_cast<int>(dims.nheads);
  const int P = static_cast<int>(dims.headdim), N = static_cast<int>(dims.dstate);
  Kokkos::parallel_for("kmamba::ssd_state_correction::incoming_grad", Range(exec, 0, dims.batch * H * P * N),
                       SsdIncomingStateGradFunctor<MemorySpace>{in.C, cumulative, dout, dincoming, L, H, P, N,
                                                                static_cast<int>(dims.nheads / dims.ngroups)});
}

}  // namespace impl
}  // namespace kmamba

#endif
