// Internals of kmamba/core/Mamba3Scan.hpp: the stages of the chunked scan and of its backward
// (docs/algorithms.md §3.4, §3.5) run in order. The stages are in the headers included below, one
// per concern (operands, plan and workspaces, rows, chunk forward, chunk and token backward, step).
//
// SISO is MIMO with rank 1 and unit rank projections; every stage is written once for rank R. The
// SISO scan runs its chunk products on the SSD (impl/Mamba3SisoSsd.hpp) with the stages before
// them (angles, scales, rotated rows) and after them (the tail of the backward) taken from here.
// Per (batch, head) the tokens × ranks form "rows" (row = t·R + r); the rotate stage writes the
// rotated, biased q and k and the projected v as rows of per-head workspaces, so that the chunk
// stages read plain (rows × dstate) and (rows × headdim) blocks.
//
// Work decomposition (as the SSD, kmamba/core/impl/SsdImpl.hpp): the chunk stages are TeamPolicy
// launches with one team per (batch, chunk, head), of TeamGemm's preferred shape (256 threads on
// Cuda) with its launch bounds and staging scratch; a team keeps its chunk's per-token vectors in
// level-0 scratch and its (tile rows × chunk rows) blocks of intra-chunk weights in level-1
// scratch, a tile of tokens at a time. Every per-chunk product goes through TeamGemm
// (impl/TeamGemm.hpp). Everything else is a flat launch of one work item per element (rotations,
// gates, group and bias sums, passing of states: one item per (batch, head, p, n) walking the
// chunks) or per (batch, head, chunk, angle) (the angle scans, split in three: chunk sums, a walk
// over the chunks, the scan within each chunk), so that no thread walks the whole sequence. Sums
// over batch, seqlen or heads are taken in a fixed order (no atomics).
#ifndef KMAMBA_CORE_IMPL_MAMBA3SCANIMPL_HPP
#define KMAMBA_CORE_IMPL_MAMBA3SCANIMPL_HPP

#include <kmamba/core/MatmulPrecision.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/Mamba3ChunkBackward.hpp>
#include <kmamba/core/impl/Mamba3ChunkForward.hpp>
#include <kmamba/core/impl/Mamba3ScanOperands.hpp>
#include <kmamba/core/impl/Mamba3ScanPlan.hpp>
#include <kmamba/core/impl/Mamba3ScanRows.hpp>
#include <kmamba/core/impl/Mamba3ScanStep.hpp>
#include <kmamba/core/impl/Mamba3TokenBackward.hpp>

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <cstdint>

namespace kmamba {
namespace impl {

template <class ExecSpace, class Dst, class Src>
void mamba3_copy_or_zero(const ExecSpace& exec, const Dst& dst, bool has_dst, const Src& src, bool has_src) {
  if (!has_dst) return;
  if (has_src) {
    Kokkos::deep_copy(exec, dst, src);
  } else {
    Kokkos::deep_copy(exec, dst, 0.0f);
  }
}

/// dst = src state by state (zero where src lacks one): what a sequence of length 0 does.
template <class ExecSpace, class MemorySpace>
void mamba3_pass_states(const ExecSpace& exec, const Mamba3StateViews<const float, MemorySpace>& src,
                        const Mamba3StateViews<float, MemorySpace>& dst) {
  mamba3_copy_or_zero(exec, dst.angle, dst.has_angle, src.angle, src.has_angle);
  mamba3_copy_or_zero(exec, dst.ssm, dst.has_ssm, src.ssm, src.has_ssm);
  if (dst.mimo) {
    mamba3_copy_or_zero(exec, dst.k4, dst.has_k, src.k4, src.has_k);
    mamba3_copy_or_zero(exec, dst.v4, dst.has_v, src.v4, src.has_v);
  } else {
    mamba3_copy_or_zero(exec, dst.k3, dst.has_k, src.k3, src.has_k);
    mamba3_copy_or_zero(exec, dst.v3, dst.has_v, src.v3, src.has_v);
  }
}

/// Stages 1–2: angles (as cosines and sines), cumsums and scales; rotated rows (and the final k, v
/// and angle); with `tok` allocated (SISO), the per-token values of the SSD. The rotate stage runs
/// over every token where ws has rows or tok asks for q_t·k_t, else only for the final k state.
template <class ExecSpace, class MemorySpace>
void mamba3_prepare_rows(const ExecSpace& exec, const Mamba3Plan& plan, const Mamba3Operands<MemorySpace>& in,
                         const Mamba3Workspace<MemorySpace>& ws,
                         const Mamba3StateViews<float, MemorySpace>& final_states,
                         const Mamba3SisoTokens<MemorySpace>& tok = Mamba3SisoTokens<MemorySpace>()) {
  const std::int64_t head_chunks = static_cast<std::int64_t>(plan.batch) * plan.nheads * plan.nchunks;
  const std::int64_t rows = static_cast<std::int64_t>(plan.batch) * plan.nheads * plan.seqlen * plan.rank;
  mamba3_for(exec, "kmamba::mamba3::chunk_tokens", head_chunks * (plan.nangles + 1),
             Mamba3ChunkTokensFunctor<MemorySpace>{in, ws, plan, tok});
  mamba3_for(exec, "kmamba::mamba3::angle_passing", static_cast<std::int64_t>(plan.batch) * plan.nheads * plan.nangles,
             Mamba3AnglePassingFunctor<MemorySpace>{in, ws, plan});
  mamba3_for(exec, "kmamba::mamba3::angle_scan", head_chunks * plan.nangles,
             Mamba3AngleScanFunctor<MemorySpace>{in, ws, plan, final_states.angle, final_states.has_angle});
  if (ws.q.is_allocated() || tok.qk.is_allocated()) {
    mamba3_row_launch(
        exec, "kmamba::mamba3::rotate", rows,
        Mamba3RotateFunctor<ExecSpace, MemorySpace>{in, ws, plan, final_states, tok, 0, plan.seqlen * plan.rank});
  } else if (final_states.has_k) {
    mamba3_row_launch(exec, "kmamba::mamba3::rotate_final", rows / plan.seqlen,
                      Mamba3RotateFunctor<ExecSpace, MemorySpace>{in, ws, plan, final_states, tok,
                                                                  (plan.seqlen - 1) * plan.rank, plan.rank});
  }
  const bool last_only = !ws.v.is_allocated();
  if (!last_only || final_states.has_v) {
    const std::int64_t items = last_only
                                   ? static_cast<std::int64_t>(plan.batch) * plan.nheads * plan.rank * plan.headdim
                                   : rows * plan.headdim;
    mamba3_for(exec, "kmamba::mamba3::project", items,
               Mamba3ProjectFunctor<MemorySpace>{in, ws, plan, final_states, last_only});
  }
}

/// Stages 1–4: stages 1–2; the entering states (and the final ssm state).
template <MatmulPrecision Precision, class ExecSpace, class MemorySpace>
void mamba3_prepare(const ExecSpace& exec, const Mamba3Plan& plan, const Mamba3Operands<MemorySpace>& in,
                    const Mamba3Workspace<MemorySpace>& ws, const Mamba3StateViews<float, MemorySpace>& final_states) {
  mamba3_prepare_rows(exec, plan, in, ws, final_states);
  mamba3_launch(exec, "kmamba::mamba3::chunk_state", plan, plan.batch * plan.nchunks * plan.nheads,
                Mamba3ChunkStateFunctor<ExecSpace, MemorySpace, Precision>{ws, plan},
                Mamba3Scratch<ExecSpace>::bytes(plan.chunk, plan.rank, plan.tile));
  mamba3_for(exec, "kmamba::mamba3::state_passing", mamba3_state_items(plan),
             Mamba3StatePassingFunctor<MemorySpace>{in, ws, plan, final_states});
}

template <MatmulPrecision Precision, class ExecSpace, class MemorySpace>
void mamba3_forward_stages(const ExecSpace& exec, const Mamba3Plan& plan, const Mamba3Operands<MemorySpace>& in,
                           const Tensor4<float, MemorySpace>& out,
                           const Mamba3StateViews<float, MemorySpace>& final_states) {
  using S = Mamba3Scratch<ExecSpace>;
  const Mamba3Workspace<MemorySpace> ws(plan, true);
  mamba3_prepare<Precision>(exec, plan, in, ws, final_states);
  mamba3_launch(exec, "kmamba::mamba3::chunk_scan", plan, plan.batch * plan.nchunks * plan.nheads,
                Mamba3ChunkScanFunctor<ExecSpace, MemorySpace, false, Precision>{in, ws, plan, out, {}, {}, {}, {}},
                S::bytes(plan.chunk, plan.rank, plan.tile),
                S::block_bytes(plan.chunk, plan.rank, plan.tile, plan.headdim, plan.dstate));
}

/// The gradients of a sequence of length 0: the states pass through; every parameter gets zero.
template <class ExecSpace, class MemorySpace>
void mamba3_backward_empty(const ExecSpace& exec, const Mamba3Operands<MemorySpace>& in,
                           const Mamba3StateViews<const float, MemorySpace>& dfinal,
                           const Mamba3GradViews<MemorySpace>& grads) {
  mamba3_pass_states(exec, dfinal, grads.dinitial);
  if (grads.mimo) {
    Kokkos::deep_copy(exec, grads.dq_bias3, 0.0f);
    Kokkos::deep_copy(exec, grads.dk_bias3, 0.0f);
    Kokkos::deep_copy(exec, grads.dmimo_v, 0.0f);
    Kokkos::deep_copy(exec, grads.dmimo_o, 0.0f);
    if (in.has_z) Kokkos::deep_copy(exec, grads.dmimo_z, 0.0f);
  } else {
    Kokkos::deep_copy(exec, grads.dq_bias2, 0.0f);
    Kokkos::deep_copy(exec, grads.dk_bias2, 0.0f);
  }
  if (grads.dD.is_allocated()) Kokkos::deep_copy(exec, grads.dD, 0.0f);
}

/// The backward stages after the chunks' (ws and bw hold the rows, ∂/∂Ĥ_{−1} in bw.dH0, the rows'
/// gradients and the chunks' shares of dD; ∂/∂scale and the diagonal ∂/∂γ, or for SISO `siso`, from
/// which the token backward forms them and ∂/∂adt): the initial k and v, the rotations and angles,
/// dt and trap, and the sums over groups, tokens and chunks.
template <class ExecSpace, class MemorySpace>
void mamba3_backward_tail(const ExecSpace& exec, const Mamba3Plan& plan, const Mamba3Operands<MemorySpace>& in,
                          const Mamba3Workspace<MemorySpace>& ws, const Mamba3BackwardWorkspace<MemorySpace>& bw,
                          const ConstTensor4<float, MemorySpace>& dout,
                          const Mamba3StateViews<const float, MemorySpace>& dfinal,
                          const Mamba3GradViews<MemorySpace>& grads,
                          const Mamba3SisoDiagonal<MemorySpace>& siso = Mamba3SisoDiagonal<MemorySpace>()) {
  const int head_league = plan.batch * plan.nheads;
  const std::int64_t head_chunks = static_cast<std::int64_t>(plan.batch) * plan.nheads * plan.nchunks;
  const std::int64_t tokens = static_cast<std::int64_t>(plan.batch) * plan.seqlen * plan.nheads;
  mamba3_launch(exec, "kmamba::mamba3::initial_state_backward", plan, head_league,
                Mamba3InitialStateBackwardFunctor<ExecSpace, MemorySpace>{in, bw.dH0, bw.dbeta0, plan, grads.dinitial},
                0);
  mamba3_row_launch(exec, "kmamba::mamba3::token_backward", tokens,
                    Mamba3TokenBackwardFunctor<ExecSpace, MemorySpace>{in, ws, bw, plan, dfinal, siso});
  mamba3_row_launch(exec, "kmamba::mamba3::value_backward", tokens,
                    Mamba3ValueBackwardFunctor<ExecSpace, MemorySpace>{in, bw, plan, dfinal, grads.dv, siso});
  mamba3_for(exec, "kmamba::mamba3::dtheta_chunk_sum", head_chunks * plan.nangles,
             Mamba3DthetaChunkSumFunctor<MemorySpace>{in, ws, bw, plan});
  mamba3_for(exec, "kmamba::mamba3::dtheta_passing", static_cast<std::int64_t>(head_league) * plan.nangles,
             Mamba3DthetaPassingFunctor<MemorySpace>{in, ws, plan, dfinal, grads.dinitial});
  mamba3_for(exec, "kmamba::mamba3::angle_backward", head_chunks * plan.nangles,
             Mamba3AngleBackwardFunctor<MemorySpace>{in, ws, bw, plan, grads.dangles});
  mamba3_for(exec, "kmamba::mamba3::scalar_backward", tokens,
             Mamba3ScalarBackwardFunctor<MemorySpace>{in, bw, plan, grads.ddt, grads.dtrap});
  mamba3_for(exec, "kmamba::mamba3::group_sum",
             static_cast<std::int64_t>(plan.batch) * plan.seqlen * plan.rank * plan.ngroups * plan.dstate,
             Mamba3GroupSumFunctor<MemorySpace>{bw, grads, plan});
  mamba3_for(exec, "kmamba::mamba3::bias_partial", head_chunks * plan.rank * plan.dstate,
             Mamba3BiasPartialFunctor<MemorySpace>{bw, plan});
  Kokkos::parallel_for("kmamba::mamba3::bias_sum",
                       Kokkos::RangePolicy<ExecSpace>(exec, 0, plan.nheads * plan.rank * plan.dstate),
                       Mamba3BiasSumFunctor<MemorySpace>{bw, grads, plan});
  if (in.mimo) {
    Kokkos::parallel_for("kmamba::mamba3::projection_sum",
                         Kokkos::RangePolicy<ExecSpace>(exec, 0, plan.nheads * plan.rank * plan.headdim),
                         Mamba3ProjectionSumFunctor<MemorySpace>{in, bw, grads, plan, dout});
  }
  if (grads.dD.is_allocated()) {
    Kokkos::parallel_for("kmamba::mamba3::skip_sum", Kokkos::RangePolicy<ExecSpace>(exec, 0, plan.nheads),
                         Mamba3SkipSumFunctor<MemorySpace>{bw.partial, grads.dD});
  }
}

/// The backward on the chunk stages (MIMO; the SISO scan runs on the SSD: impl/Mamba3SisoSsd.hpp).
template <MatmulPrecision Precision, class ExecSpace, class MemorySpace>
void mamba3_backward_stages(const ExecSpace& exec, const Mamba3Plan& plan, const Mamba3Operands<MemorySpace>& in,
                            const ConstTensor4<float, MemorySpace>& dout,
                            const Mamba3StateViews<const float, MemorySpace>& dfinal,
                            const Mamba3GradViews<MemorySpace>& grads) {
  using S = Mamba3Scratch<ExecSpace>;
  const std::size_t scratch = S::bytes(plan.chunk, plan.rank, plan.tile);
  const std::size_t block_scratch = S::block_bytes(plan.chunk, plan.rank, plan.tile, plan.headdim, plan.dstate);
  const int chunk_league = plan.batch * plan.nchunks * plan.nheads;
  const Mamba3Workspace<MemorySpace> ws(plan, true);
  mamba3_prepare<Precision>(exec, plan, in, ws, Mamba3StateViews<float, MemorySpace>());
  // The rows y_t,r are kept for the projection sums; the gate backward (rank projections, and z
  // when given) runs inside the recomputed chunk scan.
  const Mamba3BackwardWorkspace<MemorySpace> bw(plan, true, true);
  mamba3_launch(
      exec, "kmamba::mamba3::chunk_scan_gate_backward", plan, chunk_league,
      Mamba3ChunkScanFunctor<ExecSpace, MemorySpace, true, Precision>{in, ws, plan, {}, dout, bw.g, grads.dz, bw.y},
      scratch, block_scratch);
  mamba3_launch(exec, "kmamba::mamba3::chunk_dstates", plan, chunk_league,
                Mamba3ChunkDstatesFunctor<ExecSpace, MemorySpace, Precision>{ws, bw, plan}, scratch);
  mamba3_for(exec, "kmamba::mamba3::state_passing_backward", mamba3_state_items(plan),
             Mamba3StatePassingBackwardFunctor<MemorySpace>{ws, bw, plan, dfinal, grads.dinitial});
  mamba3_launch(exec, "kmamba::mamba3::chunk_backward", plan, chunk_league,
                Mamba3ChunkBackwardFunctor<ExecSpace, MemorySpace, Precision>{in, ws, bw, plan, grads.dadt}, scratch,
                block_scratch);
  mamba3_backward_tail(exec, plan, in, ws, bw, dout, dfinal, grads);
}

}  // namespace impl
}  // namespace kmamba

#endif
