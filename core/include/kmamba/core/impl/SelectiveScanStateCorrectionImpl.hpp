// The kernels of the selective scan's incoming-state correction
// (kmamba/core/SelectiveScanStateCorrection.hpp): the cumulative δ of each (batch, channel) over
// the segment, the correction of the outputs, the carry of a state across the segment (the
// segment's decay and the correction of the last state), and the gradient with respect to the
// incoming state. The decay exp(A[d,n]·Δ_t) differs per (channel, state, token), so neither product
// is a matrix product: each output sums its dstate terms, one exp each (as many as the scan's own
// recurrence evaluates), and each gradient element its tokens. With seq_idx the cumulative δ is +∞
// from a row's first document start on, and every decay reads it through
// ScanCorrectionOperands::decay, which gives 0 there (A·∞ is not formed: A may be 0).
#ifndef KMAMBA_CORE_IMPL_SELECTIVESCANSTATECORRECTIONIMPL_HPP
#define KMAMBA_CORE_IMPL_SELECTIVESCANSTATECORRECTIONIMPL_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Math.hpp>
#include <kmamba/core/SelectiveScan.hpp>
#include <kmamba/core/Tensor.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace kmamba {
namespace impl {

/// What the correction reads of the scan's arguments.
template <class MemorySpace>
struct ScanCorrectionOperands {
  ConstTensor3<float, MemorySpace> delta;           // (batch, dim, seqlen), before bias and softplus
  ConstTensor2<float, MemorySpace> A;               // (dim, dstate)
  ConstTensor4<float, MemorySpace> C;               // (batch, ngroups, dstate, seqlen)
  ConstTensor3<float, MemorySpace> z;               // (batch, dim, seqlen), optional
  ConstTensor1<float, MemorySpace> delta_bias;      // (dim), optional
  ConstTensor2<std::int64_t, MemorySpace> seq_idx;  // (batch, seqlen), optional
  int batch, dim, seqlen, dstate, channels_per_group;
  bool has_z, has_delta_bias, has_seq_idx, delta_softplus;
  float infinity;  // the cumulative δ from a row's first document start on

  ScanCorrectionOperands(const SelectiveScanArgs<MemorySpace>& args, const SelectiveScanDims& dims)
      : delta(args.delta),
        A(args.A),
        C(args.C),
        z(args.z),
        delta_bias(args.delta_bias),
        seq_idx(args.seq_idx),
        batch(static_cast<int>(dims.batch)),
        dim(static_cast<int>(dims.dim)),
        seqlen(static_cast<int>(dims.seqlen)),
        dstate(static_cast<int>(dims.dstate)),
        channels_per_group(static_cast<int>(dims.dim / dims.ngroups)),
        has_z(args.z.is_allocated()),
        has_delta_bias(args.delta_bias.is_allocated()),
        has_seq_idx(args.seq_idx.is_allocated()),
        delta_softplus(args.delta_softplus),
        infinity(std::numeric_limits<float>::infinity()) {}

  /// δ of the scan: delta + delta_bias, then softplus when asked.
  KOKKOS_INLINE_FUNCTION float delta_value(int b, int d, int t) const {
    const float pre = delta(b, d, t) + (has_delta_bias ? delta_bias(d) : 0.0f);
    return delta_softplus ? kmamba::softplus(pre) : pre;
  }
  /// The gate on the output of token t: silu(z), 1 without z.
  KOKKOS_INLINE_FUNCTION float gate(int b, int d, int t) const { return has_z ? kmamba::silu(z(b, d, t)) : 1.0f; }
  /// Whether a packed document starts at token t > 0.
  KOKKOS_INLINE_FUNCTION bool starts(int b, int t) const {
    return has_seq_idx && t > 0 && seq_idx(b, t) != seq_idx(b, t - 1);
  }
  /// exp(A[d,n]·Δ) for a cumulative δ, 0 past a document start (Δ = +∞).
  KOKKOS_INLINE_FUNCTION float decay(int d, int n, float cumulative) const {
    return cumulative < infinity ? kmamba::math::exp(A(d, n) * cumulative) : 0.0f;
  }
};

/// cumulative(b, d, t) = Σ_{s ≤ t} δ_s of row b, channel d (+∞ from the row's first document start
/// on): one team per (b, d) scanning the tokens with its vector lanes in a fixed order.
template <class ExecSpace, class MemorySpace>
struct ScanCumulativeDeltaFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  ScanCorrectionOperands<MemorySpace> in;
  Tensor3<float, MemorySpace> cumulative;  // (batch, dim, seqlen)

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int b = team.league_rank() / in.dim, d = team.league_rank() % in.dim;
    Kokkos::parallel_scan(Kokkos::ThreadVectorRange(team, in.seqlen),
                          [&](const int t, float& partial, const bool last) {
                            partial += in.starts(b, t) ? in.infinity : in.delta_value(b, d, t);
                            if (last) cumulative(b, d, t) = partial;
                          });
  }
};

template <class ExecSpace, class MemorySpace>
Tensor3<float, MemorySpace> selective_scan_cumulative_delta(const ExecSpace& exec,
                                                            const ScanCorrectionOperands<MemorySpace>& in) {
  using Policy = Kokkos::TeamPolicy<ExecSpace>;
  const auto cumulative = allocate_uninitialized<Tensor3<float, MemorySpace>>(
      "kmamba::selective_scan_correction::cumulative_delta", in.batch, in.dim, in.seqlen);
  const int vector_length = std::min(32, static_cast<int>(Policy::vector_length_max()));
  Kokkos::parallel_for("kmamba::selective_scan_correction::cumulative_delta",
                       Policy(exec, in.batch * in.dim, 1, vector_length),
                       ScanCumulativeDeltaFunctor<ExecSpace, MemorySpace>{in, cumulative});
  return cumulative;
}

/// exp(A[d,n]·Δ_{L−1}): the factor by which the segment scales state n of channel d (1 when empty,
/// 0 with a document start).
template <class MemorySpace>
KOKKOS_INLINE_FUNCTION float scan_segment_factor(const ScanCorrectionOperands<MemorySpace>& in,
                                                 const ConstTensor3<float, MemorySpace>& cumulative,  // (b, dim, L)
                                                 int b, int d, int n) {
  return in.seqlen > 0 ? in.decay(d, n, cumulative(b, d, in.seqlen - 1)) : 1.0f;
}

/// state(b, d, n) = factor·incoming(b, d, n) + state(b, d, n) with incoming, factor without (the
/// segment's decay).
template <class MemorySpace>
struct ScanCarryStateFunctor {
  ScanCorrectionOperands<MemorySpace> in;
  ConstTensor3<float, MemorySpace> cumulative;  // (batch, dim, seqlen)
  ConstTensor3<float, MemorySpace> incoming;    // (batch, dim, dstate), optional
  Tensor3<float, MemorySpace> state;            // (batch, dim, dstate)

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int n = static_cast<int>(item % in.dstate);
    const int d = static_cast<int>((item / in.dstate) % in.dim);
    const int b = static_cast<int>(item / (static_cast<std::int64_t>(in.dstate) * in.dim));
    const float factor = scan_segment_factor(in, cumulative, b, d, n);
    if (incoming.data() != nullptr) {
      state(b, d, n) += factor * incoming(b, d, n);
    } else {
      state(b, d, n) = factor;
    }
  }
};

/// Adds factor·incoming to `state` (the last state's correction), or writes the factor itself
/// (the segment's decay) when `incoming` is unallocated.
template <class ExecSpace, class MemorySpace>
void selective_scan_carry_state(
    const ExecSpace& exec, const ScanCorrectionOperands<MemorySpace>& in,
    const ConstTensor3<float, NonDeduced<MemorySpace>>& cumulative,  // (batch, dim, seqlen)
    const ConstTensor3<float, NonDeduced<MemorySpace>>& incoming,    // (batch, dim, dstate), optional
    const Tensor3<float, MemorySpace>& state) {                      // (batch, dim, dstate)
  using Range = Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>;
  Kokkos::parallel_for("kmamba::selective_scan_correction::carry_state",
                       Range(exec, 0, static_cast<std::int64_t>(in.batch) * in.dim * in.dstate),
                       ScanCarryStateFunctor<MemorySpace>{in, cumulative, incoming, state});
}

/// out(b, d, t) += g_t·Σ_n C(b, g, n, t)·exp(A[d,n]·Δ_t)·incoming(b, d, n), one work item per
/// output, the tokens innermost (consecutive items read consecutive C, z and out).
template <class MemorySpace>
struct ScanCorrectOutputsFunctor {
  ScanCorrectionOperands<MemorySpace> in;
  ConstTensor3<float, MemorySpace> cumulative;  // (batch, dim, seqlen)
  ConstTensor3<float, MemorySpace> incoming;    // (batch, dim, dstate)
  Tensor3<float, MemorySpace> out;              // (batch, dim, seqlen)

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int t = static_cast<int>(item % in.seqlen);
    const int d = static_cast<int>((item / in.seqlen) % in.dim);
    const int b = static_cast<int>(item / (static_cast<std::int64_t>(in.seqlen) * in.dim));
    const int g = d / in.channels_per_group;
    const float cum = cumulative(b, d, t);
    float sum = 0.0f;
    for (int n = 0; n < in.dstate; ++n) {
      sum += in.C(b, g, n, t) * in.decay(d, n, cum) * incoming(b, d, n);
    }
    out(b, d, t) += in.gate(b, d, t) * sum;
  }
};

template <class ExecSpace, class MemorySpace>
void selective_scan_correct_outputs(
    const ExecSpace& exec, const ScanCorrectionOperands<MemorySpace>& in,
    const ConstTensor3<float, NonDeduced<MemorySpace>>& cumulative,  // (batch, dim, seqlen)
    const ConstTensor3<float, NonDeduced<MemorySpace>>& incoming,    // (batch, dim, dstate)
    const Tensor3<float, MemorySpace>& out) {                        // (batch, dim, seqlen)
  using Range = Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>;
  Kokkos::parallel_for("kmamba::selective_scan_correction::outputs",
                       Range(exec, 0, static_cast<std::int64_t>(in.batch) * in.dim * in.seqlen),
                       ScanCorrectOutputsFunctor<MemorySpace>{in, cumulative, incoming, out});
}

/// gated(b, d, t) = g_t·dout(b, d, t), so that the gradient's terms do not evaluate the gate once
/// per state.
template <class MemorySpace>
struct ScanGateDoutFunctor {
  ScanCorrectionOperands<MemorySpace> in;
  ConstTensor3<float, MemorySpace> dout;  // (batch, dim, seqlen)
  Tensor3<float, MemorySpace> gated;      // (batch, dim, seqlen)

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int t = static_cast<int>(item % in.seqlen);
    const int d = static_cast<int>((item / in.seqlen) % in.dim);
    const int b = static_cast<int>(item / (static_cast<std::int64_t>(in.seqlen) * in.dim));
    gated(b, d, t) = in.gate(b, d, t) * dout(b, d, t);
  }
};

/// dincoming(b, d, n) = Σ_t exp(A[d,n]·Δ_t)·C(b, g, n, t)·gated(b, d, t): one team per (b, d), its
/// threads over the states and each sum over the thread's vector lanes along the tokens.
template <class ExecSpace, class MemorySpace>
struct ScanIncomingStateGradFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  ScanCorrectionOperands<MemorySpace> in;
  ConstTensor3<float, MemorySpace> cumulative;  // (batch, dim, seqlen)
  ConstTensor3<float, MemorySpace> gated;       // (batch, dim, seqlen), g_t·dout_t
  Tensor3<float, MemorySpace> dincoming;        // (batch, dim, dstate)

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int b = team.league_rank() / in.dim, d = team.league_rank() % in.dim;
    const int g = d / in.channels_per_group;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, in.dstate), [&](const int n) {
      float sum = 0.0f;
      Kokkos::parallel_reduce(
          Kokkos::ThreadVectorRange(team, in.seqlen),
          [&](const int t, float& acc) {
            acc += in.decay(d, n, cumulative(b, d, t)) * in.C(b, g, n, t) * gated(b, d, t);
          },
          sum);
      Kokkos::single(Kokkos::PerThread(team), [&]() { dincoming(b, d, n) = sum; });
    });
  }
};

template <class ExecSpace, class MemorySpace>
void selective_scan_incoming_state_grad(
    const ExecSpace& exec, const ScanCorrectionOperands<MemorySpace>& in,
    const ConstTensor3<float, NonDeduced<MemorySpace>>& cumulative,  // (batch, dim, seqlen)
    const ConstTensor3<float, NonDeduced<MemorySpace>>& dout,        // (batch, dim, seqlen)
    const Tensor3<float, MemorySpace>& dincoming) {                  // (batch, dim, dstate)
  using Range = Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>;
  using Policy = Kokkos::TeamPolicy<ExecSpace>;
  ConstTensor3<float, MemorySpace> gated = dout;
  if (in.has_z) {
    const auto buffer = allocate_uninitialized<Tensor3<float, MemorySpace>>(
        "kmamba::selective_scan_correction::gated_dout", in.batch, in.dim, in.seqlen);
    Kokkos::parallel_for("kmamba::selective_scan_correction::gated_dout",
                         Range(exec, 0, static_cast<std::int64_t>(in.batch) * in.dim * in.seqlen),
                         ScanGateDoutFunctor<MemorySpace>{in, dout, buffer});
    gated = buffer;
  }
  const int vector_length = std::min(32, static_cast<int>(Policy::vector_length_max()));
  Kokkos::parallel_for("kmamba::selective_scan_correction::incoming_grad",
                       Policy(exec, in.batch * in.dim, Kokkos::AUTO, vector_length),
                       ScanIncomingStateGradFunctor<ExecSpace, MemorySpace>{in, cumulative, gated, dincoming});
}

}  // namespace impl
}  // namespace kmamba

#endif
