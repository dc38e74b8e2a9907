// Internals of kmamba/core/Ssd.hpp: the stages of the chunked SSD, staged or fused, run in order
// (docs/algorithms.md §2.5, §2.6, §2.10). The stages of the staged form are in the headers included
// below, one per concern (launch plan, chunk forward, chunk backward, backward sums, decode step).
//
// Work decomposition (same for every backend): the chunk stages are TeamPolicy launches with one
// team per (batch, chunk, head) — (batch, chunk, group, tile of rows) for C·Bᵀ; the passing of
// states between chunks is one work item per state element. A team stages its chunk's per-token
// vectors (δ, cumulative δ·a, run ids) in level-0 scratch and works on the intra-chunk matrices a
// tile of rows at a time: the weights of the forward and of dx are formed inside the product's
// operand, the backward keeps one (tile × chunk) block in level-1 scratch, so level-0 scratch
// grows with the chunk only. Every per-chunk product goes through TeamGemm (impl/TeamGemm.hpp),
// which a backend may specialise (with the team shape and scratch it wants, see ssd_plan). The
// functors that multiply take the MatmulPrecision of their products as a template parameter;
// ssd_forward_impl / ssd_backward_impl instantiate the stages once per precision the backend's
// TeamGemm distinguishes (with_matmul_precision: twice on Cuda, once elsewhere). With BFloat16
// products and a shape they are compiled for, the forward is impl/SsdFusedForward.hpp and the
// backward's chunk stages are impl/SsdFusedStates.hpp and impl/SsdFusedBackward.hpp
// (ssd_fused_backward_stages), on the warp tiles.
//
// seq_idx: a "run" is a maximal stretch of tokens with equal seq_idx. Stage 1 writes, per token,
// the number of run starts from the beginning of its chunk up to the token (the first token of a
// row never starts a run, so initial_states belongs to the row's first sequence). Two tokens of a
// chunk interact iff their counts agree; the state entering a chunk reaches the tokens whose
// count is 0; the state leaving a chunk carries the incoming one iff the chunk's last count is 0.
// This is the token-level rule "the state restarts from zero where seq_idx changes".
#ifndef KMAMBA_CORE_IMPL_SSDIMPL_HPP
#define KMAMBA_CORE_IMPL_SSDIMPL_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/MatmulPrecision.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/SsdBackwardSums.hpp>
#include <kmamba/core/impl/SsdChunkBackward.hpp>
#include <kmamba/core/impl/SsdChunkForward.hpp>
#include <kmamba/core/impl/SsdFusedBackward.hpp>
#include <kmamba/core/impl/SsdFusedForward.hpp>
#include <kmamba/core/impl/SsdFusedStates.hpp>
#include <kmamba/core/impl/SsdLaunchPlan.hpp>
#include <kmamba/core/impl/SsdOperands.hpp>
#include <kmamba/core/impl/SsdStep.hpp>
#include <kmamba/core/impl/TeamGemm.hpp>

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <cstdint>

namespace kmamba {

template <class MemorySpace>
struct SsdGrads;

namespace impl {

/// Stage 3: each chunk's local state in ws.states becomes the state entering it (and the final
/// state is written when final_states is allocated).
template <class ExecSpace, class MemorySpace>
void ssd_state_passing(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                       const SsdWorkspace<MemorySpace>& ws, const Tensor4<float, MemorySpace>& final_states) {
  Kokkos::parallel_for("kmamba::ssd::state_passing",
                       Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, ssd_state_items(plan)),
                       SsdStatePassingFunctor<MemorySpace>{in, ws, plan, final_states, final_states.is_allocated()});
}

/// Stage 4: C·Bᵀ within each chunk (ws.CB).
template <MatmulPrecision Precision, class ExecSpace, class MemorySpace>
void ssd_bmm_chunk(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                   const SsdWorkspace<MemorySpace>& ws) {
  ssd_launch(exec, "kmamba::ssd::bmm_chunk", plan, plan.batch * plan.nchunks * plan.ngroups * plan.ntiles,
             SsdBmmChunkFunctor<ExecSpace, MemorySpace, Precision>{in, ws, plan}, TeamGemm<ExecSpace>::scratch_bytes);
}

/// Stage 1: δ, the chunk cumsums of δ·a and the run ids.
template <class ExecSpace, class MemorySpace>
void ssd_chunk_cumsum(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                      const SsdWorkspace<MemorySpace>& ws) {
  ssd_launch(exec, "kmamba::ssd::chunk_cumsum", plan, plan.batch * plan.nchunks * plan.nheads,
             SsdChunkCumsumFunctor<ExecSpace, MemorySpace>{in, ws, plan}, 0);
}

/// Stages 1–4: δ, cumsums and run ids; entering states (and the final state); C·Bᵀ.
template <MatmulPrecision Precision, class ExecSpace, class MemorySpace>
void ssd_prepare(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                 const SsdWorkspace<MemorySpace>& ws, const Tensor4<float, MemorySpace>& final_states) {
  ssd_chunk_cumsum(exec, plan, in, ws);
  ssd_launch(exec, "kmamba::ssd::chunk_state", plan, plan.batch * plan.nchunks * plan.nheads,
             SsdChunkStateFunctor<ExecSpace, MemorySpace, Precision>{in, ws, plan},
             SsdScratch<ExecSpace>::bytes(plan.chunk));
  ssd_state_passing(exec, plan, in, ws, final_states);
  ssd_bmm_chunk<Precision>(exec, plan, in, ws);
}

template <MatmulPrecision Precision, class ExecSpace, class MemorySpace>
void ssd_forward_stages(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                        const Tensor4<float, MemorySpace>& out, const Tensor4<float, MemorySpace>& final_states) {
  const SsdWorkspace<MemorySpace> ws(plan);
  ssd_prepare<Precision>(exec, plan, in, ws, final_states);
  ssd_launch(exec, "kmamba::ssd::chunk_scan", plan, plan.batch * plan.nchunks * plan.nheads,
             SsdChunkScanFunctor<ExecSpace, MemorySpace, false, Precision>{in, ws, plan, out, {}, {}},
             SsdScratch<ExecSpace>::bytes(plan.chunk));
}

template <class ExecSpace, class MemorySpace>
void ssd_forward_impl(const ExecSpace& exec, const char* function, const SsdDims& dims,
                      const SsdArgs<MemorySpace>& args, const Tensor4<float, MemorySpace>& out,
                      const Tensor4<float, MemorySpace>& final_states) {
  const SsdPlan plan = ssd_plan<ExecSpace>(function, dims, args.chunk_size);
  const SsdOperands<MemorySpace> in(args);
  if (plan.seqlen == 0) {
    if (final_states.is_allocated()) {
      if (in.has_initial_states) {
        Kokkos::deep_copy(exec, final_states, in.initial_states);
      } else {
        Kokkos::deep_copy(exec, final_states, 0.0f);
      }
    }
    return;
  }
  if (args.matmul_precision == MatmulPrecision::BFloat16) {
    const SsdPlan fused = ssd_plan<ExecSpace>(function, dims, ssd_fused_chunk);
    if (ssd_fused_forward_supported(fused, in)) {
      ssd_fused_forward(exec, fused, in, out, final_states, ssd_fused_segment_count(exec, fused));
      return;
    }
  }
  with_matmul_precision<ExecSpace>(args.matmul_precision, [&](auto precision) {
    ssd_forward_stages<decltype(precision)::value>(exec, plan, in, out, final_states);
  });
}

/// The gated dout g = dout·silu(z) and dz (chunk_scan_gate_backward: the forward's output again,
/// from the entering states in ws.states and ws.CB).
template <MatmulPrecision Precision, class ExecSpace, class MemorySpace>
ConstTensor4<float, MemorySpace> ssd_gate_backward(const ExecSpace& exec, const SsdPlan& plan,
                                                   const SsdOperands<MemorySpace>& in,
                                                   const SsdWorkspace<MemorySpace>& ws,
                                                   const ConstTensor4<float, MemorySpace>& dout,
                                                   const Tensor4<float, MemorySpace>& dz) {
  const auto gated = allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::ssd::gated_dout", plan.batch,
                                                                         plan.seqlen, plan.nheads, plan.headdim);
  ssd_launch(exec, "kmamba::ssd::chunk_scan_gate_backward", plan, plan.batch * plan.nchunks * plan.nheads,
             SsdChunkScanFunctor<ExecSpace, MemorySpace, true, Precision>{in, ws, plan, gated, dout, dz},
             SsdScratch<ExecSpace>::bytes(plan.chunk));
  return gated;
}

/// Backward B3 (state passing, reversed): dstates becomes the gradient of each chunk's leaving
/// state; dinitial_states is written when allocated.
template <class ExecSpace, class MemorySpace>
void ssd_state_passing_backward(const ExecSpace& exec, const SsdPlan& plan, const SsdWorkspace<MemorySpace>& ws,
                                const ConstTensor4<float, MemorySpace>& dfinal_states,
                                const Tensor5<float, MemorySpace>& dstates, const SsdGrads<MemorySpace>& grads) {
  Kokkos::parallel_for(
      "kmamba::ssd::state_passing_backward",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, ssd_state_items(plan)),
      SsdStatePassingBackwardFunctor<MemorySpace>{ws, plan, dfinal_states, dstates, grads.dinitial_states,
                                                  dfinal_states.is_allocated(), grads.dinitial_states.is_allocated()});
}

/// The staged backward: every stage a TeamGemm kernel at the plan's chunk length.
template <MatmulPrecision Precision, class ExecSpace, class MemorySpace>
void ssd_backward_stages(const ExecSpace& exec, const SsdPlan& plan, const SsdOperands<MemorySpace>& in,
                         const ConstTensor4<float, MemorySpace>& dout,
                         const ConstTensor4<float, MemorySpace>& dfinal_states, const SsdGrads<MemorySpace>& grads) {
  const std::size_t scratch = SsdScratch<ExecSpace>::bytes(plan.chunk);
  const int chunk_league = plan.batch * plan.nchunks * plan.nheads;
  const SsdWorkspace<MemorySpace> ws(plan);
  ssd_prepare<Precision>(exec, plan, in, ws, Tensor4<float, MemorySpace>());
  const ConstTensor4<float, MemorySpace> g =
      in.has_z ? ssd_gate_backward<Precision>(exec, plan, in, ws, dout, grads.dz) : dout;
  const auto dstates = allocate_uninitialized<Tensor5<float, MemorySpace>>(
      "kmamba::ssd::dstates", plan.batch, plan.nchunks, plan.nheads, plan.headdim, plan.dstate);
  ssd_launch(exec, "kmamba::ssd::chunk_dstates", plan, chunk_league,
             SsdChunkDstatesFunctor<ExecSpace, MemorySpace, Precision>{in, ws, plan, g, dstates}, scratch);
  ssd_state_passing_backward(exec, plan, ws, dfinal_states, dstates, grads);
  const SsdChunkGrads<MemorySpace> chunk(plan, grads);
  ssd_launch(
      exec, "kmamba::ssd::chunk_backward", plan, chunk_league,
      SsdChunkBackwardFunctor<ExecSpace, MemorySpace, Precision>{
          in, ws, plan, g, dstates, grads.dx, grads.ddt, grads.dlog_decay, chunk.dB_head, chunk.dC_head, chunk.partial},
      scratch, SsdScratch<ExecSpace>::block_bytes(plan.tile, plan.chunk));
  ssd_backward_sums(exec, plan, chunk, grads);
}

/// g = dout·silu(z) and dz = dout·out_x·silu′(z), with out_x the forward's output before the gate;
/// one item per element.
template <class MemorySpace>
struct SsdGateBackwardFunctor {
  SsdPlan plan;
  ConstTensor4<float, MemorySpace> out_x, dout, z;  // (batch, seqlen, nheads, headdim)
  Tensor4<float, MemorySpace> g, dz;                // (batch, seqlen, nheads, headdim)

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const {
    const int p = static_cast<int>(i % plan.headdim);
    const std::int64_t bth = i / plan.headdim;
    const int h = static_cast<int>(bth % plan.nheads);
    const std::int64_t bt = bth / plan.nheads;
    const int t = static_cast<int>(bt % plan.seqlen), b = static_cast<int>(bt / plan.seqlen);
    const float d = dout(b, t, h, p), zv = z(b, t, h, p);
    g(b, t, h, p) = d * silu(zv);
    dz(b, t, h, p) = d * out_x(b, t, h, p) * silu_derivative(zv);
  }
};

/// The gated dout g and dz from the forward recomputed without the gate by the fused forward
/// (`forward_plan`: its chunk; ssd_fused_forward_supported must hold).
template <class ExecSpace, class MemorySpace>
ConstTensor4<float, MemorySpace> ssd_fused_gate_backward(const ExecSpace& exec, const SsdPlan& forward_plan,
                                                         const SsdOperands<MemorySpace>& in,
                                                         const ConstTensor4<float, MemorySpace>& dout,
                                                         const Tensor4<float, MemorySpace>& dz) {
  using T4 = Tensor4<float, MemorySpace>;
  const SsdPlan& plan = forward_plan;
  const auto out_x =
      allocate_uninitialized<T4>("kmamba::ssd::ungated_out", plan.batch, plan.seqlen, plan.nheads, plan.headdim);
  SsdOperands<MemorySpace> ungated = in;
  ungated.has_z = false;
  ssd_fused_forward(exec, plan, ungated, out_x, T4(), ssd_fused_segment_count(exec, plan));
  const auto g =
      allocate_uninitialized<T4>("kmamba::ssd::gated_dout", plan.batch, plan.seqlen, plan.nheads, plan.headdim);
  Kokkos::parallel_for("kmamba::ssd::gate_backward",
                       Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(
                           exec, 0, static_cast<std::int64_t>(plan.batch) * plan.seqlen * plan.nheads * plan.headdim),
                       SsdGateBackwardFunctor<MemorySpace>{plan, out_x, dout, in.z, g, dz});
  return g;
}

/// The fused backward (ssd_fused_backward_supported(plan, in), and with a gate
/// ssd_fused_forward_supported(forward_plan, in); dout 16-byte aligned where there is no gate):
/// the gated dout from a recomputed fused forward (with a gate), the entering states and the
/// leaving states' gradients walked along the sequence in one kernel (impl/SsdFusedStates.hpp), and
/// the chunk stage B4–B9 (impl/SsdFusedBackward.hpp), on the tensor cores.
template <class ExecSpace, class MemorySpace>
void ssd_fused_backward_stages(const ExecSpace& exec, const SsdPlan& plan, const SsdPlan& forward_plan,
                               const SsdOperands<MemorySpace>& in, const ConstTensor4<float, MemorySpace>& dout,
                               const ConstTensor4<float, MemorySpace>& dfinal_states,
                               const SsdGrads<MemorySpace>& grads) {
  const SsdWorkspace<MemorySpace> ws(plan, false);
  using States = Tensor5<bf16, MemorySpace>;
  const auto hin = allocate_uninitialized<States>("kmamba::ssd::entering_states", plan.batch, plan.nchunks, plan.nheads,
                                                  plan.headdim, plan.dstate);
  const auto dstates = allocate_uninitialized<States>("kmamba::ssd::dstates", plan.batch, plan.nchunks, plan.nheads,
                                                      plan.headdim, plan.dstate);
  const ConstTensor4<float, MemorySpace> g =
      in.has_z ? ssd_fused_gate_backward(exec, forward_plan, in, dout, grads.dz) : dout;
  ssd_chunk_cumsum(exec, plan, in, ws);
  ssd_fused_state_walks(exec, plan, in, ws, g, dfinal_states, hin, dstates, grads.dinitial_states,
                        ssd_walk_segment_count(exec, plan));
  const SsdChunkGrads<MemorySpace> chunk(plan, grads);
  ssd_fused_chunk_backward(exec, plan, in, ws, g, hin, dstates, grads.dx, grads.ddt, grads.dlog_decay, chunk.dB_head,
                           chunk.dC_head, chunk.partial);
  ssd_backward_sums(exec, plan, chunk, grads);
}

template <class ExecSpace, class MemorySpace>
void ssd_backward_impl(const ExecSpace& exec, const char* function, const SsdDims& dims,
                       const SsdArgs<MemorySpace>& args, const ConstTensor4<float, MemorySpace>& dout,
                       const ConstTensor4<float, MemorySpace>& dfinal_states, const SsdGrads<MemorySpace>& grads) {
  const SsdOperands<MemorySpace> in(args);
  if (args.matmul_precision == MatmulPrecision::BFloat16 && dims.seqlen > 0) {
    const SsdPlan fused = ssd_plan<ExecSpace>(function, dims, ssd_fused_backward_chunk);
    const SsdPlan forward = ssd_plan<ExecSpace>(function, dims, ssd_fused_chunk);
    const bool gate_ok = in.has_z ? ssd_fused_forward_supported(forward, in) : ssd_fused_backward_aligned(dout.data());
    if (ssd_fused_backward_supported(fused, in) && gate_ok) {
      ssd_fused_backward_stages(exec, fused, forward, in, dout, dfinal_states, grads);
      return;
    }
  }
  const SsdPlan plan = ssd_plan<ExecSpace>(function, dims, args.chunk_size);
  with_matmul_precision<ExecSpace>(args.matmul_precision, [&](auto precision) {
    ssd_backward_stages<decltype(precision)::value>(exec, plan, in, dout, dfinal_states, grads);
  });
}

}  // namespace impl
}  // namespace kmamba

#endif
