// The kernels of the SSD's incoming-state correction (kmamba/core/SsdStateCorrection.hpp): the
// cumulative log decay of each (batch, head) over the segment, the correction of the outputs and
// the final states, and the gradient with respect to the incoming state. The two products (outputs:
// C·h_inᵀ per chunk of tokens; gradient: (decay·dout)ᵀ·C over the tokens) go through TeamGemm
// (impl/TeamGemm.hpp) on the SSD's launch plan (ssd_plan, ssd_launch), in fp32 whatever
// SsdArgs::matmul_precision asks: they are a small part of the scan, and exact products keep the
// sequence split as close as the scan's own rounding to the one-rank result.
#ifndef KMAMBA_CORE_IMPL_SSDSTATECORRECTIONIMPL_HPP
#define KMAMBA_CORE_IMPL_SSDSTATECORRECTIONIMPL_HPP

#include <kmamba/core/Math.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/SsdImpl.hpp>
#include <kmamba/core/impl/SsdOperands.hpp>
#include <kmamba/core/impl/TeamGemm.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace kmamba {
namespace impl {

/// decay(b, h, t) = exp(Σ_{s ≤ t} a_s) of row b, head h (a_s = δ_s·A[h] or the given log decay),
/// one team per (b, h) scanning the tokens with its vector lanes in a fixed order; one exp per
/// token, which the kernels below read instead of evaluating it per output element. With seq_idx,
/// a_s = −∞ where a document starts (s > 0), so decay is 0 from the row's first start on: the
/// incoming state reaches neither those tokens nor the final state, and takes no gradient there.
template <class ExecSpace, class MemorySpace>
struct SsdCumulativeDecayFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  SsdOperands<MemorySpace> in;
  Tensor3<float, MemorySpace> decay;  // (batch, nheads, seqlen)
  int nheads, seqlen;
  float minus_infinity;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int b = team.league_rank() / nheads, h = team.league_rank() % nheads;
    const float rate = in.decay_rate(h);
    Kokkos::parallel_scan(Kokkos::ThreadVectorRange(team, seqlen), [&](const int t, float& partial, const bool last) {
      const bool starts = in.has_seq_idx && t > 0 && in.seq_idx(b, t) != in.seq_idx(b, t - 1);
      partial += starts ? minus_infinity : in.token_log_decay(b, t, h, in.dt_value(in.dt_pre(b, t, h)), rate);
      if (last) decay(b, h, t) = kmamba::math::exp(partial);
    });
  }
};

template <class ExecSpace, class MemorySpace>
Tensor3<float, MemorySpace> ssd_cumulative_decay(const ExecSpace& exec, const SsdPlan& plan,
                                                 const SsdOperands<MemorySpace>& in) {
  using Policy = Kokkos::TeamPolicy<ExecSpace>;
  const auto decay = allocate_uninitialized<Tensor3<float, MemorySpace>>("kmamba::ssd_state_correction::decay",
                                                                         plan.batch, plan.nheads, plan.seqlen);
  const int vector_length = std::min(32, static_cast<int>(Policy::vector_length_max()));
  Kokkos::parallel_for("kmamba::ssd_state_correction::decay", Policy(exec, plan.batch * plan.nheads, 1, vector_length),
                       SsdCumulativeDecayFunctor<ExecSpace, MemorySpace>{in, decay, plan.nheads, plan.seqlen,
                                                                         -std::numeric_limits<float>::infinity()});
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

/// out(b, t, h, p) += decay(b, h, t)·Σ_n C(b, t, g, n)·incoming(b, h, p, n), g the group of h: per
/// (batch, chunk of the plan, head) the (tokens × dstate)·(dstate × headdim) product of the chunk's
/// C rows and the head's incoming state, each row scaled by its token's decay as it is stored.
template <class ExecSpace, class MemorySpace>
struct SsdCorrectOutputsFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  ConstTensor4<float, MemorySpace> C;         // (batch, seqlen, ngroups, dstate)
  ConstTensor3<float, MemorySpace> decay;     // (batch, nheads, seqlen)
  ConstTensor4<float, MemorySpace> incoming;  // (batch, nheads, headdim, dstate)
  Tensor4<float, MemorySpace> out;            // (batch, seqlen, nheads, headdim)
  SsdPlan plan;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const SsdChunkBlock blk = ssd_chunk_block(plan, team.league_rank());
    TeamGemm<ExecSpace>::apply(
        team, blk.len, plan.headdim, plan.dstate,
        [&](const int l, const int n) { return C(blk.b, blk.t0 + l, blk.g, n); },
        [&](const int n, const int p) { return incoming(blk.b, blk.h, p, n); },
        [&](const int l, const int p, const float v) {
          out(blk.b, blk.t0 + l, blk.h, p) += decay(blk.b, blk.h, blk.t0 + l) * v;
        });
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

/// State columns per team of the incoming-state gradient: the width of TeamGemm's output blocks on
/// every backend, so that a team's product is whole blocks.
constexpr int ssd_correction_columns = 64;

/// dincoming(b, h, p, n) = Σ_t decay(b, h, t)·dout(b, t, h, p)·C(b, t, g, n): per (batch, head, block
/// of ssd_correction_columns state columns) the (headdim × tokens)·(tokens × columns) product of the
/// decayed dout and the C rows, over the tokens one chunk of the plan at a time (a product's depth
/// stays within what the host form stages), each chunk's sums added to the previous ones' in order.
template <class ExecSpace, class MemorySpace>
struct SsdIncomingStateGradFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  ConstTensor4<float, MemorySpace> C;      // (batch, seqlen, ngroups, dstate)
  ConstTensor3<float, MemorySpace> decay;  // (batch, nheads, seqlen)
  ConstTensor4<float, MemorySpace> dout;   // (batch, seqlen, nheads, headdim)
  Tensor4<float, MemorySpace> dincoming;   // (batch, nheads, headdim, dstate)
  SsdPlan plan;
  int column_blocks;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int n0 = (team.league_rank() % column_blocks) * ssd_correction_columns;
    const int h = (team.league_rank() / column_blocks) % plan.nheads;
    const int b = team.league_rank() / (column_blocks * plan.nheads);
    const int g = h / plan.heads_per_group;
    const int width = plan.dstate - n0 < ssd_correction_columns ? plan.dstate - n0 : ssd_correction_columns;
    for (int t0 = 0; t0 < plan.seqlen; t0 += plan.chunk) {
      const int len = plan.seqlen - t0 < plan.chunk ? plan.seqlen - t0 : plan.chunk;
      // The previous chunk's stores are read back by whichever thread stores the same element now.
      team.team_barrier();
      TeamGemm<ExecSpace>::apply(
          team, plan.headdim, width, len,
          [&](const int p, const int l) { return decay(b, h, t0 + l) * dout(b, t0 + l, h, p); },
          [&](const int l, const int j) { return C(b, t0 + l, g, n0 + j); },
          [&](const int p, const int j, const float v) {
            float& sum = dincoming(b, h, p, n0 + j);
            sum = t0 == 0 ? v : sum + v;
          });
    }
  }
};

template <class ExecSpace, class MemorySpace>
void ssd_segment_decay_impl(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                            const Tensor2<float, MemorySpace>& decay) {  // (batch, nheads)
  const auto cumulative = ssd_cumulative_decay(exec, plan, in);
  Kokkos::parallel_for("kmamba::ssd_state_correction::segment_decay",
                       Kokkos::RangePolicy<ExecSpace>(exec, 0, plan.batch * plan.nheads),
                       SsdSegmentDecayFunctor<MemorySpace>{cumulative, decay, plan.nheads, plan.seqlen});
}

template <class ExecSpace, class MemorySpace>
void ssd_state_correction_forward_impl(
    const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
    const ConstTensor4<float, MemorySpace>& incoming,   // (batch, nheads, headdim, dstate)
    const Tensor4<float, MemorySpace>& out,             // (batch, seqlen, nheads, headdim)
    const Tensor4<float, MemorySpace>& final_states) {  // (batch, nheads, headdim, dstate)
  using Range = Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>;
  const auto cumulative = ssd_cumulative_decay(exec, plan, in);
  ssd_launch(exec, "kmamba::ssd_state_correction::outputs", plan, plan.batch * plan.nchunks * plan.nheads,
             SsdCorrectOutputsFunctor<ExecSpace, MemorySpace>{in.C, cumulative, incoming, out, plan},
             TeamGemm<ExecSpace>::scratch_bytes);
  if (!final_states.is_allocated()) return;
  Kokkos::parallel_for("kmamba::ssd_state_correction::final_states", Range(exec, 0, ssd_state_items(plan)),
                       SsdCorrectFinalStatesFunctor<MemorySpace>{cumulative, incoming, final_states, plan.seqlen,
                                                                 plan.nheads, plan.headdim, plan.dstate});
}

template <class ExecSpace, class MemorySpace>
void ssd_state_correction_backward_impl(
    const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
    const ConstTensor4<float, MemorySpace>& dout,    // (batch, seqlen, nheads, headdim)
    const Tensor4<float, MemorySpace>& dincoming) {  // (batch, nheads, headdim, dstate)
  if (plan.seqlen == 0) {                            // no tokens: the outputs do not depend on the state
    Kokkos::deep_copy(exec, dincoming, 0.0f);
    return;
  }
  const auto cumulative = ssd_cumulative_decay(exec, plan, in);
  const int column_blocks = (plan.dstate + ssd_correction_columns - 1) / ssd_correction_columns;
  ssd_launch(
      exec, "kmamba::ssd_state_correction::incoming_grad", plan, plan.batch * plan.nheads * column_blocks,
      SsdIncomingStateGradFunctor<ExecSpace, MemorySpace>{in.C, cumulative, dout, dincoming, plan, column_blocks},
      TeamGemm<ExecSpace>::scratch_bytes);
}

}  // namespace impl
}  // namespace kmamba

#endif
