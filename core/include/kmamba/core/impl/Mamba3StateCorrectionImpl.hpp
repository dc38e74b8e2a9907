// The kernels of the Mamba-3 incoming-state correction (kmamba/core/Mamba3StateCorrection.hpp,
// docs/algorithms.md §3.9): a segment's final angle, k and v states and its decay without the scan;
// the correction of the outputs by a state entering the segment, and its gradient, on the SSD's
// correction (kmamba/core/SsdStateCorrection.hpp) with the rotated q rows as C; the gradients of the
// initial k and v (the scan's backward stage B4); the gradient a final-angle cotangent gives the
// angles and dt.
//
// Rows are as in the scan (impl/Mamba3ScanRows.hpp): per (batch, head) the tokens × ranks, row
// t·R + r. The SSD's correction sees them as a sequence of L·R "tokens" with one group per head,
// C = the rotated, biased q rows and the log decay adt_t on a token's first row and 0 on its other
// ranks' rows, so that the cumulative log decay of row (t, r) is cs_t, the one of token t. With
// packed ids, row (t, r) has token t's id, so that the SSD's rule (no incoming state from the
// first start on) stops the rows at the segment's first document start.
#ifndef KMAMBA_CORE_IMPL_MAMBA3STATECORRECTIONIMPL_HPP
#define KMAMBA_CORE_IMPL_MAMBA3STATECORRECTIONIMPL_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Math.hpp>
#include <kmamba/core/Ssd.hpp>
#include <kmamba/core/SsdStateCorrection.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/Mamba3ScanImpl.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace kmamba {
namespace impl {

/// The last packed document start of row b (the last t > 0 where seq_idx(b, t) ≠ seq_idx(b, t − 1);
/// 0 without one or without ids), reduced over the team's threads and known to all of them.
template <class Member, class MemorySpace>
KOKKOS_INLINE_FUNCTION int mamba3_last_start(const Member& team,
                                             const ConstTensor2<std::int64_t, MemorySpace>& seq_idx,  // (batch, seqlen)
                                             int b, int seqlen) {
  if (!seq_idx.is_allocated()) return 0;
  int last = 0;
  Kokkos::parallel_reduce(
      Kokkos::TeamThreadRange(team, 1, seqlen),
      [&](const int t, int& latest) {
        if (seq_idx(b, t) != seq_idx(b, t - 1) && t > latest) latest = t;
      },
      Kokkos::Max<int>(last));
  return last > 0 ? last : 0;  // the reducer starts from the lowest int
}

/// The final angle, k and v states of a segment and, when `decay` is allocated, exp(Σ_t adt_t): a
/// team per (batch, head). Its threads sum each angle's increments over the tokens (vector lanes,
/// a fixed order) into θ_{L−1} = θ_{−1} + Σ_t π·tanh(φ_t)·dt_t (reduced into [0, 2π) for SISO, as
/// the scan's), then rotate the last token's biased k by it and project its v. With packed ids the
/// final states are the last document's: the angles total from its start s > 0 without θ_{−1}, and
/// the decay is 0 (no state entering the segment leaves it).
template <class ExecSpace, class MemorySpace>
struct Mamba3SegmentStatesFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using Vec = Kokkos::View<float*, typename ExecSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  Mamba3Operands<MemorySpace> in;
  Mamba3Plan plan;
  Mamba3StateViews<float, MemorySpace> states;  // angle, k, v (each optional)
  Tensor2<float, MemorySpace> decay;            // (batch, nheads), optional

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int b = team.league_rank() / plan.nheads, h = team.league_rank() % plan.nheads;
    const int last = plan.seqlen - 1, g = h / plan.heads_per_group;
    const int from = mamba3_last_start(team, in.seq_idx, b, plan.seqlen);
    Vec theta(team.team_scratch(0), plan.nangles);
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, plan.nangles), [&](const int i) {
      float total = 0.0f;
      Kokkos::parallel_reduce(
          Kokkos::ThreadVectorRange(team, from, plan.seqlen),
          [&](const int t, float& acc) { acc += mamba3_angle_step(in, b, t, h, i); }, total);
      Kokkos::single(Kokkos::PerThread(team), [&]() {
        float angle = (from == 0 ? in.initial.angle_or_zero(b, h, i) : 0.0f) + total;
        if (in.wrap_angle) angle -= mamba3_two_pi * kmamba::math::floor(angle / mamba3_two_pi);
        theta(i) = angle;
        if (states.has_angle) states.angle(b, h, i) = angle;
      });
    });
    if (decay.is_allocated()) {
      float sum = 0.0f;
      Kokkos::parallel_reduce(
          Kokkos::TeamVectorRange(team, plan.seqlen), [&](const int t, float& acc) { acc += in.adt(b, h, t); }, sum);
      Kokkos::single(Kokkos::PerTeam(team), [&]() { decay(b, h) = from == 0 ? kmamba::math::exp(sum) : 0.0f; });
    }
    team.team_barrier();
    if (states.has_k) {
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, plan.rank), [&](const int r) {
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, plan.dstate - plan.nangles), [&](const int slot) {
          if (slot >= plan.nangles) {
            const int n = slot + plan.nangles;
            states.k(b, h, r, n) = in.k_in(b, last, r, g, n) + in.k_bias(h, r, n);
            return;
          }
          const int n0 = 2 * slot, n1 = n0 + 1;
          const float c = kmamba::math::cos(theta(slot)), s = kmamba::math::sin(theta(slot));
          const float k0 = in.k_in(b, last, r, g, n0) + in.k_bias(h, r, n0);
          const float k1 = in.k_in(b, last, r, g, n1) + in.k_bias(h, r, n1);
          states.k(b, h, r, n0) = k0 * c - k1 * s;
          states.k(b, h, r, n1) = k0 * s + k1 * c;
        });
      });
    }
    if (states.has_v) {
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, plan.rank), [&](const int r) {
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, plan.headdim),
                             [&](const int p) { states.v(b, h, r, p) = in.v(b, last, h, p) * in.v_proj(h, r, p); });
      });
    }
  }
};

template <class ExecSpace, class MemorySpace>
void mamba3_segment_states_impl(const ExecSpace& exec, const Mamba3Plan& plan, const Mamba3Operands<MemorySpace>& in,
                                const Mamba3StateViews<float, MemorySpace>& states,
                                const Tensor2<float, MemorySpace>& decay) {
  using Policy = Kokkos::TeamPolicy<ExecSpace>;
  using Functor = Mamba3SegmentStatesFunctor<ExecSpace, MemorySpace>;
  const int league = plan.batch * plan.nheads;
  if (league == 0) return;
  const int lanes = std::min(32, static_cast<int>(Policy::vector_length_max()));
  Policy policy(exec, league, Kokkos::AUTO, lanes);
  policy.set_scratch_size(0, Kokkos::PerTeam(Functor::Vec::shmem_size(plan.nangles)));
  Kokkos::parallel_for("kmamba::mamba3_state_correction::segment_states", policy, Functor{in, plan, states, decay});
}

/// The log decay of each row: adt_t on row t·R, 0 on rows t·R + r, r > 0.
template <class MemorySpace>
struct Mamba3RowLogDecayFunctor {
  Mamba3Operands<MemorySpace> in;
  Mamba3Plan plan;
  Tensor3<float, MemorySpace> log_decay;  // (batch, seqlen·rank, nheads)

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int h = static_cast<int>(item % plan.nheads);
    const std::int64_t rest = item / plan.nheads;
    const int row = static_cast<int>(rest % (static_cast<std::int64_t>(plan.seqlen) * plan.rank));
    const int b = static_cast<int>(rest / (static_cast<std::int64_t>(plan.seqlen) * plan.rank));
    log_decay(b, row, h) = row % plan.rank == 0 ? in.adt(b, h, row / plan.rank) : 0.0f;
  }
};

/// The packed id of each row: row_ids(b, t·R + r) = seq_idx(b, t).
template <class MemorySpace>
struct Mamba3RowIdsFunctor {
  ConstTensor2<std::int64_t, MemorySpace> seq_idx;  // (batch, seqlen)
  Tensor2<std::int64_t, MemorySpace> row_ids;       // (batch, seqlen·rank)
  int rank;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const std::int64_t per_batch = static_cast<std::int64_t>(row_ids.extent(1));
    const int b = static_cast<int>(item / per_batch), row = static_cast<int>(item % per_batch);
    row_ids(b, row) = seq_idx(b, row / rank);
  }
};

/// The rows as the SSD's correction reads them: the rotated q rows (rotated by the angles from
/// in.initial.angle), the rows' log decay and, with packed ids, the rows' ids in `ws`, `log_decay`,
/// `row_ids`; `rows` (batch, seqlen·rank, nheads, headdim) gives the SSD its x shape (the
/// correction does not read x).
template <class ExecSpace, class MemorySpace>
SsdArgs<MemorySpace> mamba3_correction_ssd_args(const ExecSpace& exec, const Mamba3Plan& plan,
                                                const Mamba3Operands<MemorySpace>& in,
                                                const Mamba3Workspace<MemorySpace>& ws,
                                                const Tensor3<float, MemorySpace>& log_decay,
                                                const Tensor2<std::int64_t, MemorySpace>& row_ids,
                                                const Tensor4<float, MemorySpace>& rows) {
  mamba3_prepare_rows(exec, plan, in, ws, Mamba3StateViews<float, MemorySpace>());
  mamba3_for(exec, "kmamba::mamba3_state_correction::row_log_decay",
             static_cast<std::int64_t>(plan.batch) * plan.seqlen * plan.rank * plan.nheads,
             Mamba3RowLogDecayFunctor<MemorySpace>{in, plan, log_decay});
  SsdArgs<MemorySpace> args;
  if (in.has_seq_idx) {
    mamba3_for(exec, "kmamba::mamba3_state_correction::row_ids", static_cast<std::int64_t>(row_ids.size()),
               Mamba3RowIdsFunctor<MemorySpace>{in.seq_idx, row_ids, plan.rank});
    args.seq_idx = row_ids;
  }
  args.x = rows;
  args.dt = log_decay;
  args.log_decay = log_decay;
  args.B = ws.q;
  args.C = ws.q;
  args.dt_min = -std::numeric_limits<float>::infinity();
  args.chunk_size = plan.rows;
  return args;
}

/// The gate of row (t, r) at channel p: silu(z_t ⊙ mimo_z_r)·mimo_o_r (without z: mimo_o_r).
template <class MemorySpace>
KOKKOS_INLINE_FUNCTION float mamba3_row_gate(const Mamba3Operands<MemorySpace>& in, int b, int t, int h, int r, int p) {
  const float gate = in.has_z ? silu(in.z(b, t, h, p) * in.z_proj(h, r, p)) : 1.0f;
  return gate * in.o_proj(h, r, p);
}

/// Forward (Backward = false): out_t += Σ_r rows_(t,r) ⊙ gate_(t,r), and in.ungated_t += rows_(t,0) when
/// allocated (SISO). Backward = true: rows_(t,r) = dout_t ⊙ gate_(t,r). A row kernel over
/// (batch, token, head), lanes over the channels.
template <class ExecSpace, class MemorySpace, bool Backward>
struct Mamba3CorrectionGateFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  Mamba3Operands<MemorySpace> in;
  Mamba3Plan plan;
  Tensor4<float, MemorySpace> rows;       // (batch, seqlen·rank, nheads, headdim)
  Tensor4<float, MemorySpace> out;        // forward: (batch, seqlen, nheads, headdim)
  ConstTensor4<float, MemorySpace> dout;  // backward: (batch, seqlen, nheads, headdim)

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    Mamba3Row it;
    if (!mamba3_row(team, plan, plan.seqlen, it)) return;
    const int b = it.b, t = it.row, h = it.h, R = plan.rank;
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, plan.headdim), [&](const int p) {
      if constexpr (Backward) {
        for (int r = 0; r < R; ++r) rows(b, t * R + r, h, p) = dout(b, t, h, p) * mamba3_row_gate(in, b, t, h, r, p);
      } else {
        float sum = 0.0f;
        for (int r = 0; r < R; ++r) sum += rows(b, t * R + r, h, p) * mamba3_row_gate(in, b, t, h, r, p);
        out(b, t, h, p) += sum;
        if (in.ungated.is_allocated()) in.ungated(b, t, h, p) += rows(b, t * R, h, p);
      }
    });
  }
};

/// Buffers of the correction: the rows' workspace, their log decay, their packed ids (with
/// `packed`) and per-row values.
template <class MemorySpace>
struct Mamba3CorrectionBuffers {
  Mamba3Workspace<MemorySpace> ws;
  Tensor3<float, MemorySpace> log_decay;       // (batch, seqlen·rank, nheads)
  Tensor2<std::int64_t, MemorySpace> row_ids;  // (batch, seqlen·rank), with packed ids
  Tensor4<float, MemorySpace> rows;            // (batch, seqlen·rank, nheads, headdim)

  Mamba3CorrectionBuffers(const Mamba3Plan& plan, bool packed)
      : ws(plan, false),
        log_decay(allocate_uninitialized<Tensor3<float, MemorySpace>>(
            "kmamba::mamba3_state_correction::log_decay", plan.batch, plan.seqlen * plan.rank, plan.nheads)),
        row_ids(packed ? allocate_uninitialized<Tensor2<std::int64_t, MemorySpace>>(
                             "kmamba::mamba3_state_correction::row_ids", plan.batch, plan.seqlen * plan.rank)
                       : Tensor2<std::int64_t, MemorySpace>()),
        rows(allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::mamba3_state_correction::rows", plan.batch,
                                                                 plan.seqlen * plan.rank, plan.nheads, plan.headdim)) {}

  /// The SSD's arguments over these buffers (mamba3_correction_ssd_args).
  template <class ExecSpace>
  SsdArgs<MemorySpace> ssd_args(const ExecSpace& exec, const Mamba3Plan& plan,
                                const Mamba3Operands<MemorySpace>& in) const {
    return mamba3_correction_ssd_args(exec, plan, in, ws, log_decay, row_ids, rows);
  }
};

template <class ExecSpace, class MemorySpace>
void mamba3_state_correction_forward_impl(const ExecSpace& exec, const Mamba3Plan& plan,
                                          const Mamba3Operands<MemorySpace>& in,
                                          const ConstTensor4<float, MemorySpace>& incoming,
                                          const Tensor4<float, MemorySpace>& out,
                                          const Tensor4<float, MemorySpace>& final_ssm) {
  if (plan.seqlen == 0) {
    if (final_ssm.is_allocated()) {
      mamba3_for(exec, "kmamba::mamba3_state_correction::pass_state", mamba3_state_items(plan),
                 SsdCorrectFinalStatesFunctor<MemorySpace>{Tensor3<float, MemorySpace>(), incoming, final_ssm, 0,
                                                           plan.nheads, plan.headdim, plan.dstate});
    }
    return;
  }
  const Mamba3CorrectionBuffers<MemorySpace> buf(plan, in.has_seq_idx);
  const SsdArgs<MemorySpace> args = buf.ssd_args(exec, plan, in);
  Kokkos::deep_copy(exec, buf.rows, 0.0f);
  ssd_state_correction_forward(exec, args, incoming, buf.rows, final_ssm);
  mamba3_row_launch(exec, "kmamba::mamba3_state_correction::gate",
                    static_cast<std::int64_t>(plan.batch) * plan.seqlen * plan.nheads,
                    Mamba3CorrectionGateFunctor<ExecSpace, MemorySpace, false>{in, plan, buf.rows, out, {}});
}

template <class ExecSpace, class MemorySpace>
void mamba3_state_correction_backward_impl(const ExecSpace& exec, const Mamba3Plan& plan,
                                           const Mamba3Operands<MemorySpace>& in,
                                           const ConstTensor4<float, MemorySpace>& dout,
                                           const Tensor4<float, MemorySpace>& dincoming) {
  if (plan.seqlen == 0) {
    Kokkos::deep_copy(exec, dincoming, 0.0f);
    return;
  }
  const Mamba3CorrectionBuffers<MemorySpace> buf(plan, in.has_seq_idx);
  const SsdArgs<MemorySpace> args = buf.ssd_args(exec, plan, in);
  mamba3_row_launch(exec, "kmamba::mamba3_state_correction::gate_backward",
                    static_cast<std::int64_t>(plan.batch) * plan.seqlen * plan.nheads,
                    Mamba3CorrectionGateFunctor<ExecSpace, MemorySpace, true>{in, plan, buf.rows,
                                                                              Tensor4<float, MemorySpace>(), dout});
  ssd_state_correction_backward(exec, args, buf.rows, dincoming);
}

/// dangles(b, t, h, i) += G_i·π·dt_t·(1 − tanh²φ_t,i) and ddt(b, h, t) += Σ_i G_i·π·tanh φ_t,i with
/// G = dfinal_angle(b, h, :), for the tokens from the row's last document start on (all without
/// seq_idx): a team per (batch, head), its threads over those tokens, vector lanes over the angles.
template <class ExecSpace, class MemorySpace>
struct Mamba3FinalAngleBackwardFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  ConstTensor4<float, MemorySpace> angles;          // (batch, seqlen, nheads, nangles)
  ConstTensor3<float, MemorySpace> dt;              // (batch, nheads, seqlen)
  ConstTensor3<float, MemorySpace> dfinal_angle;    // (batch, nheads, nangles)
  ConstTensor2<std::int64_t, MemorySpace> seq_idx;  // (batch, seqlen), optional
  Tensor4<float, MemorySpace> dangles;              // (batch, seqlen, nheads, nangles)
  Tensor3<float, MemorySpace> ddt;                  // (batch, nheads, seqlen)
  int seqlen, nheads, nangles;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int b = team.league_rank() / nheads, h = team.league_rank() % nheads;
    const int from = mamba3_last_start(team, seq_idx, b, seqlen);
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, from, seqlen), [&](const int t) {
      const float step = dt(b, h, t);
      float dstep = 0.0f;
      Kokkos::parallel_reduce(
          Kokkos::ThreadVectorRange(team, nangles),
          [&](const int i, float& acc) {
            const float grad = dfinal_angle(b, h, i) * mamba3_pi;
            const float th = kmamba::math::tanh(angles(b, t, h, i));
            dangles(b, t, h, i) += grad * step * (1.0f - th * th);
            acc += grad * th;
          },
          dstep);
      Kokkos::single(Kokkos::PerThread(team), [&]() { ddt(b, h, t) += dstep; });
    });
  }
};

template <class ExecSpace, class MemorySpace>
void mamba3_final_angle_backward_impl(const ExecSpace& exec,
                                      const Mamba3FinalAngleBackwardFunctor<ExecSpace, MemorySpace>& functor,
                                      int batch) {
  using Policy = Kokkos::TeamPolicy<ExecSpace>;
  const int league = batch * functor.nheads;
  if (league == 0) return;
  const int lanes = std::min(32, static_cast<int>(Policy::vector_length_max()));
  Kokkos::parallel_for("kmamba::mamba3_state_correction::final_angle_backward",
                       Policy(exec, league, Kokkos::AUTO, lanes), functor);
}

}  // namespace impl
}  // namespace kmamba

#endif
