// The Mamba-3 SISO scan as an SSD (kmamba/core/Ssd.hpp), and the choice between it and the chunk
// stages of impl/Mamba3ScanImpl.hpp.
//
// In the chunked form of kmamba/core/Mamba3Scan.hpp (rank 1), Ĥ obeys the SSD recurrence
// Ĥ_t = exp(adt_t)·Ĥ_{t−1} + scale_t·v_t k_tᵀ with the rotated k as B (one group per head), the
// rotated q as C, adt as the log decay of each token and scale as δ (which then only scales the
// input). The SSD's own-token term is scale_t·(q_t·k_t)·v_t where the scan has γ_t·(q_t·k_t)·v_t, so
//
//   y_t = ssd_t + c_t·v_t,   c_t = D + (γ_t − scale_t)·(q_t·k_t),
//
// and out = y·silu(z). The backward is the SSD's backward with dout = g = ∂/∂y, and the chain rule
// through c_t: ∂/∂v_t += c_t·g_t; with dc_t = g_t·v_t, ∂/∂γ_t = dc_t·(q_t·k_t) (the "diagonal"
// part), ∂/∂scale_t = ssd's ∂/∂δ_t − dc_t·(q_t·k_t), and ∂/∂q_t += dc_t·(γ_t − scale_t)·k_t, ∂/∂k_t
// likewise (q_t·k_t is the same for the rotated and unrotated vectors). The rest of the backward
// (initial k and v, rotations, angles, dt and trap, sums) is the chunk stages' own tail.
//
// So the SISO scan runs on whatever the SSD runs on: its fused tensor-core kernels with bf16
// operands (MatmulPrecision::BFloat16) or its fp32/TF32 stages. MIMO (rank > 1: every rank of a
// token sees every other) stays on the chunk stages.
//
// The B and C of the SSD are per head (each head has its bias and its angles) where q and k are per
// group. The bf16 forward hands the fused SSD forward the group rows with the biases, the angles'
// cosines and sines and the weights γ_t − scale_t (SsdFusedHeadOperands), which forms each head's
// rows as it stages them and c_t = D + (γ_t − scale_t)·(q_t·k_t) from them: no per-head rows are
// written (2·dstate floats per token and head, each written once and read once), the rotate stage
// runs only for the final k state, and y and the gate come out of the same kernel. The bf16
// backward hands the fused walks and chunk backward the same operands (the chunk backward forms
// q_t·k_t and c_t, the gradients of each head's rotated rows go to per-head rows, which the token
// backward turns back), so no rotated rows are written there either. Rows the fused kernels cannot
// read four floats at a time, and the other precisions, take the rotate stage's per-head rows and
// the SSD's own paths.
#ifndef KMAMBA_CORE_IMPL_MAMBA3SISOSSD_HPP
#define KMAMBA_CORE_IMPL_MAMBA3SISOSSD_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/Bf16.hpp>
#include <kmamba/core/Ssd.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>
#include <kmamba/core/impl/Mamba3ScanImpl.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace kmamba {
namespace impl {

/// Ĥ_{−1}, one item per (batch, head, p, n).
template <class MemorySpace>
struct Mamba3SisoEnteringStateFunctor {
  Mamba3Operands<MemorySpace> in;
  Mamba3Plan plan;
  Tensor4<float, MemorySpace> state;  // (batch, nheads, headdim, dstate)

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const Mamba3StateItem it = mamba3_state_item(plan, item);
    state(it.b, it.h, it.p, it.n) = mamba3_entering_state(in, plan, it.b, it.h, it.p, it.n);
  }
};

/// out = y·silu(z) with y = ssd + c·v, in place (no gate without z; y also to in.ungated when
/// allocated), a row per (batch, token, head).
template <class ExecSpace, class MemorySpace>
struct Mamba3SisoOutputFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  Mamba3Operands<MemorySpace> in;
  Mamba3Plan plan;
  Mamba3SisoTokens<MemorySpace> tok;
  Tensor4<float, MemorySpace> out;  // (batch, seqlen, nheads, headdim): the SSD's output on entry

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    Mamba3Row it;
    if (!mamba3_row(team, plan, plan.seqlen, it)) return;
    const int b = it.b, t = it.row, h = it.h;
    const float c = tok.diag(b, t, h);
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, plan.headdim), [&](const int p) {
      const float y = out(b, t, h, p) + c * in.v(b, t, h, p);
      if (in.ungated.is_allocated()) in.ungated(b, t, h, p) = y;
      out(b, t, h, p) = in.has_z ? y * silu(in.z(b, t, h, p)) : y;
    });
  }
};

/// g = ∂/∂y, dz and dc_t = g_t·v_t, a row per (batch, token, head). With z, y is read from `y`
/// (the kept or recomputed output before the gate) where `complete`, else formed as y + c·v from
/// the SSD's output in `y`.
template <class ExecSpace, class MemorySpace>
struct Mamba3SisoGateBackwardFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  Mamba3Operands<MemorySpace> in;
  Mamba3Plan plan;
  Mamba3SisoTokens<MemorySpace> tok;
  ConstTensor4<float, MemorySpace> y;  // (batch, seqlen, nheads, headdim), with z
  bool complete;
  ConstTensor4<float, MemorySpace> dout;  // (batch, seqlen, nheads, headdim)
  Tensor4<float, MemorySpace> g;          // (batch, seqlen, nheads, headdim)
  Tensor4<float, MemorySpace> dz;         // (batch, seqlen, nheads, headdim), with z
  Tensor3<float, MemorySpace> dc;         // (batch, seqlen, nheads)

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    Mamba3Row it;
    if (!mamba3_row(team, plan, plan.seqlen, it)) return;
    const int b = it.b, t = it.row, h = it.h;
    const float c = in.has_z && !complete ? tok.diag(b, t, h) : 0.0f;
    float sum = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::ThreadVectorRange(team, plan.headdim),
        [&](const int p, float& acc) {
          const float v = in.v(b, t, h, p), d = dout(b, t, h, p);
          float gp = d;
          if (in.has_z) {
            const float zv = in.z(b, t, h, p);
            gp = d * silu(zv);
            dz(b, t, h, p) = d * (y(b, t, h, p) + c * v) * silu_derivative(zv);
          }
          g(b, t, h, p) = gp;
          acc += gp * v;
        },
        sum);
    Kokkos::single(Kokkos::PerThread(team), [&]() { dc(b, t, h) = sum; });
  }
};

/// Each chunk's share of dD (Σ dc_t over its tokens), one item per (batch, chunk, head).
template <class MemorySpace>
struct Mamba3SisoSkipPartialFunctor {
  Mamba3BackwardWorkspace<MemorySpace> bw;
  Mamba3Plan plan;
  ConstTensor3<float, MemorySpace> dc;  // (batch, seqlen, nheads)

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t item) const {
    const int h = static_cast<int>(item % plan.nheads);
    const std::int64_t bc = item / plan.nheads;
    const int c = static_cast<int>(bc % plan.nchunks), b = static_cast<int>(bc / plan.nchunks);
    const int t0 = c * plan.chunk, len = mamba3_chunk_length(plan, c);
    float sum = 0.0f;
    for (int l = 0; l < len; ++l) sum += dc(b, t0 + l, h);
    bw.partial(b, c, h) = sum;
  }
};

/// The SSD's arguments for B and C of (batch, seqlen, groups, dstate) (per-head rows, groups =
/// nheads, or the shared rows that SsdFusedHeadOperands turn into them), with stage 2's per-token
/// values `tok` and Ĥ_{−1} (formed here when an initial state is given).
template <class ExecSpace, class MemorySpace>
SsdArgs<MemorySpace> mamba3_siso_ssd_args(const ExecSpace& exec, const Mamba3Plan& plan,
                                          const Mamba3Operands<MemorySpace>& in, MatmulPrecision precision,
                                          const Mamba3SisoTokens<MemorySpace>& tok,
                                          const SsdNonDeduced<ConstTensor4<float, MemorySpace>>& B,
                                          const SsdNonDeduced<ConstTensor4<float, MemorySpace>>& C) {
  SsdArgs<MemorySpace> args;
  if (in.initial.has_ssm || (in.initial.has_k && in.initial.has_v)) {
    const auto state = allocate_uninitialized<Tensor4<float, MemorySpace>>(
        "kmamba::mamba3::siso_entering_state", plan.batch, plan.nheads, plan.headdim, plan.dstate);
    mamba3_for(exec, "kmamba::mamba3::siso_entering_state", mamba3_state_items(plan),
               Mamba3SisoEnteringStateFunctor<MemorySpace>{in, plan, state});
    args.initial_states = state;
  }
  // The SSD's fused kernels read x four floats at a time: an unaligned v is copied first.
  args.x = in.v;
  if (!ssd_rows_aligned(in.v)) {
    const auto copy = allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::mamba3::siso_v", plan.batch,
                                                                          plan.seqlen, plan.nheads, plan.headdim);
    Kokkos::deep_copy(exec, copy, in.v);
    args.x = copy;
  }
  args.dt = tok.scale;
  args.log_decay = tok.log_decay;
  args.seq_idx = in.seq_idx;
  args.B = B;
  args.C = C;
  args.dt_min = -std::numeric_limits<float>::infinity();
  args.chunk_size = plan.chunk;
  args.matmul_precision = precision;
  return args;
}

/// Stages 1–2 with the rotated rows, and the SSD's arguments on them.
template <class ExecSpace, class MemorySpace>
SsdArgs<MemorySpace> mamba3_siso_ssd_prepare(const ExecSpace& exec, const Mamba3Plan& plan,
                                             const Mamba3Operands<MemorySpace>& in, MatmulPrecision precision,
                                             const Mamba3Workspace<MemorySpace>& ws,
                                             const Mamba3SisoTokens<MemorySpace>& tok,
                                             const Mamba3StateViews<float, MemorySpace>& final_states) {
  mamba3_prepare_rows(exec, plan, in, ws, final_states, tok);
  return mamba3_siso_ssd_args(exec, plan, in, precision, tok, ws.k, ws.q);
}

/// The per-head operands of the fused SSD kernels on the shared q and k rows (B = k, C = q).
template <class MemorySpace>
SsdFusedHeadOperands<MemorySpace> mamba3_siso_head_operands(const Mamba3Plan& plan,
                                                            const Mamba3Operands<MemorySpace>& in,
                                                            const Mamba3Workspace<MemorySpace>& ws,
                                                            const Mamba3SisoTokens<MemorySpace>& tok) {
  SsdFusedHeadOperands<MemorySpace> head;
  head.per_head = true;
  head.bias_B = in.k_bias2;
  head.bias_C = in.q_bias2;
  head.rotation = ws.rotation;
  head.nangles = plan.nangles;
  if (in.has_D) head.D = in.D;
  head.own_weight = tok.qk_weight;
  return head;
}

/// The bf16 forward on the shared q and k rows (see the top of this file); false, having done
/// nothing, where the fused SSD forward does not take them.
template <class ExecSpace, class MemorySpace>
bool mamba3_siso_fused_forward(const ExecSpace& exec, const Mamba3Plan& plan, const Mamba3Operands<MemorySpace>& in,
                               MatmulPrecision precision, const Tensor4<float, MemorySpace>& out,
                               const Mamba3StateViews<float, MemorySpace>& final_states) {
  if (precision != MatmulPrecision::BFloat16) return false;
  const SsdDims dims{plan.batch, plan.seqlen, plan.nheads, plan.headdim, plan.ngroups, plan.dstate};
  const SsdPlan fused = ssd_plan<ExecSpace>("kmamba::mamba3_siso_forward", dims, ssd_fused_chunk);
  SsdArgs<MemorySpace> probe;
  probe.x = in.v;
  probe.B = in.k4;
  probe.C = in.q4;
  probe.seq_idx = in.seq_idx;
  if (!ssd_fused_forward_supported(fused, SsdOperands<MemorySpace>(probe))) return false;
  const Mamba3SisoTokens<MemorySpace> tok(plan, false);
  const Mamba3Workspace<MemorySpace> ws(plan, false, false);
  mamba3_prepare_rows(exec, plan, in, ws, final_states, tok);
  SsdArgs<MemorySpace> args = mamba3_siso_ssd_args(exec, plan, in, precision, tok, in.k4, in.q4);
  args.z = in.z;
  SsdFusedHeadOperands<MemorySpace> head = mamba3_siso_head_operands(plan, in, ws, tok);
  head.ungated = in.ungated;
  ssd_fused_forward(exec, fused, SsdOperands<MemorySpace>(args), out,
                    final_states.has_ssm ? final_states.ssm : Tensor4<float, MemorySpace>(),
                    ssd_fused_segment_count(exec, fused), head);
  return true;
}

template <class ExecSpace, class MemorySpace>
void mamba3_siso_ssd_forward(const ExecSpace& exec, const Mamba3Plan& plan, const Mamba3Operands<MemorySpace>& in,
                             MatmulPrecision precision, const Tensor4<float, MemorySpace>& out,
                             const Mamba3StateViews<float, MemorySpace>& final_states) {
  if (mamba3_siso_fused_forward(exec, plan, in, precision, out, final_states)) return;
  const Mamba3Workspace<MemorySpace> ws(plan, false);
  const Mamba3SisoTokens<MemorySpace> tok(plan, true);
  const SsdArgs<MemorySpace> args = mamba3_siso_ssd_prepare(exec, plan, in, precision, ws, tok, final_states);
  ssd_forward(exec, args, out, final_states.has_ssm ? final_states.ssm : Tensor4<float, MemorySpace>());
  mamba3_row_launch(exec, "kmamba::mamba3::siso_output",
                    static_cast<std::int64_t>(plan.batch) * plan.seqlen * plan.nheads,
                    Mamba3SisoOutputFunctor<ExecSpace, MemorySpace>{in, plan, tok, out});
}

/// The gate backward (Mamba3SisoGateBackwardFunctor with y, complete): g into bw.g, dz; returns
/// dc_t = g_t·v_t.
template <class ExecSpace, class MemorySpace>
Tensor3<float, MemorySpace> mamba3_siso_gate_backward(const ExecSpace& exec, const Mamba3Plan& plan,
                                                      const Mamba3Operands<MemorySpace>& in,
                                                      const Mamba3SisoTokens<MemorySpace>& tok,
                                                      const Mamba3NonDeduced<ConstTensor4<float, MemorySpace>>& y,
                                                      bool complete, const ConstTensor4<float, MemorySpace>& dout,
                                                      const Mamba3BackwardWorkspace<MemorySpace>& bw,
                                                      const Mamba3GradViews<MemorySpace>& grads) {
  const auto dc = allocate_uninitialized<Tensor3<float, MemorySpace>>("kmamba::mamba3::siso_ddiagonal", plan.batch,
                                                                      plan.seqlen, plan.nheads);
  mamba3_row_launch(
      exec, "kmamba::mamba3::siso_gate_backward", static_cast<std::int64_t>(plan.batch) * plan.seqlen * plan.nheads,
      Mamba3SisoGateBackwardFunctor<ExecSpace, MemorySpace>{in, plan, tok, y, complete, dout, bw.g, grads.dz, dc});
  return dc;
}

/// The SSD's gradients of the SISO backward: ∂/∂v and ∂/∂ the rotated k, q rows into bw, ∂/∂δ and
/// ∂/∂ log decay.
template <class MemorySpace>
SsdGrads<MemorySpace> mamba3_siso_ssd_grads(const Mamba3Plan& plan, const Mamba3BackwardWorkspace<MemorySpace>& bw) {
  using T3 = Tensor3<float, MemorySpace>;
  SsdGrads<MemorySpace> sg;
  sg.dx = bw.dv;
  sg.ddt = allocate_uninitialized<T3>("kmamba::mamba3::siso_dscale", plan.batch, plan.seqlen, plan.nheads);
  sg.dlog_decay = allocate_uninitialized<T3>("kmamba::mamba3::siso_dadt", plan.batch, plan.seqlen, plan.nheads);
  sg.dB = bw.dk;
  sg.dC = bw.dq;
  return sg;
}

/// The SISO backward after the SSD's (bw holds its gradients, dc the own-token g_t·v_t): ∂/∂ the
/// initial ssm state, the chunks' shares of dD and the chunk stages' tail with the own-token terms.
template <class ExecSpace, class MemorySpace>
void mamba3_siso_backward_after_ssd(const ExecSpace& exec, const Mamba3Plan& plan,
                                    const Mamba3Operands<MemorySpace>& in, const Mamba3Workspace<MemorySpace>& ws,
                                    const Mamba3BackwardWorkspace<MemorySpace>& bw,
                                    const Mamba3SisoTokens<MemorySpace>& tok, const Tensor3<float, MemorySpace>& dc,
                                    const SsdGrads<MemorySpace>& sg, const ConstTensor4<float, MemorySpace>& dout,
                                    const Mamba3StateViews<const float, MemorySpace>& dfinal,
                                    const Mamba3GradViews<MemorySpace>& grads) {
  if (grads.dinitial.has_ssm) Kokkos::deep_copy(exec, grads.dinitial.ssm, bw.dH0);
  mamba3_for(exec, "kmamba::mamba3::siso_skip_partial",
             static_cast<std::int64_t>(plan.batch) * plan.nchunks * plan.nheads,
             Mamba3SisoSkipPartialFunctor<MemorySpace>{bw, plan, dc});
  mamba3_backward_tail(exec, plan, in, ws, bw, dout, dfinal, grads,
                       Mamba3SisoDiagonal<MemorySpace>{tok, dc, sg.ddt, sg.dlog_decay, grads.dadt});
}

/// The SSD part of the bf16 backward on the shared q and k rows (see mamba3_siso_fused_backward):
/// the chunk cumsum, the state walks and the chunk backward of the fused SSD with the head operands,
/// ∂/∂ each head's rotated rows to bw.dk, bw.dq, ∂/∂v to bw.dv, and q_t·k_t and c_t to `tok`.
template <class ExecSpace, class MemorySpace>
void mamba3_siso_fused_ssd_backward(const ExecSpace& exec, const SsdPlan& fused,
                                    const SsdOperands<MemorySpace>& operands, SsdFusedHeadOperands<MemorySpace> head,
                                    const Mamba3StateViews<const float, MemorySpace>& dfinal,
                                    const Mamba3BackwardWorkspace<MemorySpace>& bw, const SsdGrads<MemorySpace>& sg,
                                    const Mamba3SisoTokens<MemorySpace>& tok) {
  using States = Tensor5<bf16, MemorySpace>;
  const SsdWorkspace<MemorySpace> ws(fused, false);
  const auto hin = allocate_uninitialized<States>("kmamba::mamba3::siso_entering_states", fused.batch, fused.nchunks,
                                                  fused.nheads, fused.headdim, fused.dstate);
  const auto dstates = allocate_uninitialized<States>("kmamba::mamba3::siso_dstates", fused.batch, fused.nchunks,
                                                      fused.nheads, fused.headdim, fused.dstate);
  const auto partial = allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::mamba3::siso_ssd_partial",
                                                                           fused.batch, fused.nchunks, fused.nheads, 3);
  ssd_chunk_cumsum(exec, fused, operands, ws);
  ssd_fused_state_walks(exec, fused, operands, ws, bw.g,
                        dfinal.has_ssm ? dfinal.ssm : ConstTensor4<float, MemorySpace>(), hin, dstates, bw.dH0,
                        ssd_walk_segment_count(exec, fused), head);
  head.qk = tok.qk;
  head.skip = tok.diag;
  ssd_fused_chunk_backward(exec, fused, operands, ws, bw.g, hin, dstates, sg.dx, sg.ddt, sg.dlog_decay, sg.dB, sg.dC,
                           partial, head);
}

/// The bf16 backward on the shared q and k rows, as the forward (see the top of this file): the
/// SSD's walks and chunk backward form each head's rows as they stage them, and the chunk backward
/// writes q_t·k_t and c_t, so that the rotate stage does not run; y (with z, where not kept) comes
/// from the fused forward on the same operands. False, having done nothing, where the fused
/// kernels do not take the shared rows.
template <class ExecSpace, class MemorySpace>
bool mamba3_siso_fused_backward(const ExecSpace& exec, const Mamba3Plan& plan, const Mamba3Operands<MemorySpace>& in,
                                MatmulPrecision precision, const ConstTensor4<float, MemorySpace>& dout,
                                const Mamba3StateViews<const float, MemorySpace>& dfinal,
                                const Mamba3GradViews<MemorySpace>& grads) {
  if (precision != MatmulPrecision::BFloat16) return false;
  const SsdDims dims{plan.batch, plan.seqlen, plan.nheads, plan.headdim, plan.ngroups, plan.dstate};
  const SsdPlan fused = ssd_plan<ExecSpace>("kmamba::mamba3_siso_backward", dims, ssd_fused_backward_chunk);
  const SsdPlan forward = ssd_plan<ExecSpace>("kmamba::mamba3_siso_backward", dims, ssd_fused_chunk);
  const bool recompute = in.has_z && !in.ungated.is_allocated();
  SsdArgs<MemorySpace> probe;
  probe.x = in.v;
  probe.B = in.k4;
  probe.C = in.q4;
  probe.seq_idx = in.seq_idx;
  const SsdOperands<MemorySpace> probe_in(probe);
  if (!ssd_fused_backward_supported(fused, probe_in) ||
      (recompute && !ssd_fused_forward_supported(forward, probe_in))) {
    return false;
  }
  const Mamba3Workspace<MemorySpace> ws(plan, false, false);
  Mamba3SisoTokens<MemorySpace> tok(plan, false);
  mamba3_prepare_rows(exec, plan, in, ws, Mamba3StateViews<float, MemorySpace>(), tok);
  tok.allocate_own_token_terms(plan);  // filled by the chunk backward
  const SsdOperands<MemorySpace> operands(mamba3_siso_ssd_args(exec, plan, in, precision, tok, in.k4, in.q4));
  const SsdFusedHeadOperands<MemorySpace> head = mamba3_siso_head_operands(plan, in, ws, tok);
  const Mamba3BackwardWorkspace<MemorySpace> bw(plan, recompute, false);
  if (recompute) {
    ssd_fused_forward(exec, forward, operands, bw.y, Tensor4<float, MemorySpace>(),
                      ssd_fused_segment_count(exec, forward), head);
  }
  const auto dc = mamba3_siso_gate_backward(exec, plan, in, tok, recompute ? bw.y : in.ungated, true, dout, bw, grads);
  const SsdGrads<MemorySpace> sg = mamba3_siso_ssd_grads(plan, bw);
  mamba3_siso_fused_ssd_backward(exec, fused, operands, head, dfinal, bw, sg, tok);
  mamba3_siso_backward_after_ssd(exec, plan, in, ws, bw, tok, dc, sg, dout, dfinal, grads);
  return true;
}

template <class ExecSpace, class MemorySpace>
void mamba3_siso_ssd_backward(const ExecSpace& exec, const Mamba3Plan& plan, const Mamba3Operands<MemorySpace>& in,
                              MatmulPrecision precision, const ConstTensor4<float, MemorySpace>& dout,
                              const Mamba3StateViews<const float, MemorySpace>& dfinal,
                              const Mamba3GradViews<MemorySpace>& grads) {
  if (mamba3_siso_fused_backward(exec, plan, in, precision, dout, dfinal, grads)) return;
  const Mamba3Workspace<MemorySpace> ws(plan, false);
  const Mamba3SisoTokens<MemorySpace> tok(plan, true);
  const SsdArgs<MemorySpace> args =
      mamba3_siso_ssd_prepare(exec, plan, in, precision, ws, tok, Mamba3StateViews<float, MemorySpace>());
  const bool recompute = in.has_z && !in.ungated.is_allocated();
  const Mamba3BackwardWorkspace<MemorySpace> bw(plan, recompute, false);
  if (recompute) ssd_forward(exec, args, bw.y, Tensor4<float, MemorySpace>());
  const auto dc =
      mamba3_siso_gate_backward(exec, plan, in, tok, recompute ? bw.y : in.ungated, !recompute, dout, bw, grads);
  SsdGrads<MemorySpace> sg = mamba3_siso_ssd_grads(plan, bw);
  sg.dinitial_states = bw.dH0;
  ssd_backward(exec, args, bw.g, dfinal.has_ssm ? dfinal.ssm : ConstTensor4<float, MemorySpace>(), sg);
  mamba3_siso_backward_after_ssd(exec, plan, in, ws, bw, tok, dc, sg, dout, dfinal, grads);
}

/// Forward of either variant: SISO on the SSD (any precision the SSD takes), MIMO on the chunk
/// stages (fp32 or TF32).
template <class ExecSpace, class MemorySpace>
void mamba3_forward_impl(const ExecSpace& exec, const char* function, const Mamba3Dims& dims, int chunk_size,
                         MatmulPrecision precision, const Mamba3Operands<MemorySpace>& in,
                         const Tensor4<float, MemorySpace>& out,
                         const Mamba3StateViews<float, MemorySpace>& final_states) {
  if (in.mimo) check_scan_matmul_precision(function, precision);
  const Mamba3Plan plan = mamba3_plan<ExecSpace>(function, dims, chunk_size);
  if (plan.seqlen == 0) {
    mamba3_pass_states(exec, in.initial, final_states);
  } else if (!in.mimo) {
    mamba3_siso_ssd_forward(exec, plan, in, precision, out, final_states);
  } else {
    with_matmul_precision<ExecSpace>(
        precision, [&](auto p) { mamba3_forward_stages<decltype(p)::value>(exec, plan, in, out, final_states); });
  }
}

/// Backward of either variant (as mamba3_forward_impl chooses).
template <class ExecSpace, class MemorySpace>
void mamba3_backward_impl(const ExecSpace& exec, const char* function, const Mamba3Dims& dims, int chunk_size,
                          MatmulPrecision precision, const Mamba3Operands<MemorySpace>& in,
                          const ConstTensor4<float, MemorySpace>& dout,
                          const Mamba3StateViews<const float, MemorySpace>& dfinal,
                          const Mamba3GradViews<MemorySpace>& grads) {
  if (in.mimo) check_scan_matmul_precision(function, precision);
  const Mamba3Plan plan = mamba3_plan<ExecSpace>(function, dims, chunk_size);
  if (plan.seqlen == 0) {
    mamba3_backward_empty(exec, in, dfinal, grads);
  } else if (!in.mimo) {
    mamba3_siso_ssd_backward(exec, plan, in, precision, dout, dfinal, grads);
  } else {
    with_matmul_precision<ExecSpace>(
        precision, [&](auto p) { mamba3_backward_stages<decltype(p)::value>(exec, plan, in, dout, dfinal, grads); });
  }
}

}  // namespace impl
}  // namespace kmamba

#endif
