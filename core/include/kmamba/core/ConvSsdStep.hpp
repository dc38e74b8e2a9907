// The Mamba-2 decode step between the in_proj and the out_proj, one kernel (docs/algorithms.md §2.10;
// the reference's `Mamba2.step`: causal_conv1d_update on xBC, selective_state_update without z,
// then the gated RMSNorm): per sequence b, head h (group g = h / (nheads / ngroups)), headdim row
// p, state entry n,
//
//   x, B, C  = silu(causal_conv1d_update(xBC of the token, conv states))   conv states shifted in place
//   δ        = softplus₂₀(dt[b,h] + dt_bias[h])      (softplus when dt_softplus; no dt limit, as the
//                                                    reference's step, docs/algorithms.md §9 flag 1)
//   A        = −exp(A_log[h])
//   H[p,n]   = exp(δ·A)·H[p,n] + δ·x[h,p]·B[g,n]     ssm state advanced in place
//   y[h,p]   = Σ_n H[p,n]·C[g,n] + D[h]·x[h,p]
//   normed   = gated RMSNorm(y, z) per group of nheads·headdim / ngroups channels (optional)
//
// It computes what causal_conv1d_update (Conv1dActivation::silu) on x, B and C, then ssd_step,
// then gated_rms_norm compute, reading the token's inputs straight from the in_proj output row
// and A from A_log, so a decode step launches one kernel here instead of seven (−exp(A_log), the
// split of the in_proj row, three conv updates, the SSD step, the gated norm) — the decode step is
// a few hundred latency-bound kernels of a few µs each (perf/RESULTS.md, 2026-12-03). It lives in
// core beside the ops it fuses because it has their contracts (the conv state layout of
// causal_conv1d, the ssm state of ssd_step, so prefill by causal_conv1d / ssd_forward hands over
// to it); the input row is the reference's `zxbcdt` layout, given by a column offset.
//
// The B/C conv states of a group are shifted, and its gated norm computed, by exactly one team:
// the last of the group's teams to finish (an atomic ticket per (batch, group) in
// ConvSsdStepState::group_arrivals; see impl/ConvSsdStepImpl.hpp). Non-blocking on `exec`, no
// allocation, no host-side wait: the kernel can be recorded into a graph
// (kmamba/backends/StepGraph.hpp).
//
//   kmamba::ConvSsdStepArgs<Mem> args;
//   args.xbcdt = projected; args.xbc_offset = d_inner; args.ngroups = ngroups;
//   args.conv_weight = w; args.A_log = A_log; args.D = D; args.dt_bias = dt_bias; args.dt_softplus = true;
//   args.norm_weight = norm_w; args.norm_eps = 1e-5f;
//   kmamba::ConvSsdStepState<Mem> state{conv_x, conv_B, conv_C, ssm, arrivals};
//   kmamba::conv_ssd_step(exec, args, state, y, normed);
#ifndef KMAMBA_CORE_CONVSSDSTEP_HPP
#define KMAMBA_CORE_CONVSSDSTEP_HPP

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Profiling.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/ConvSsdStepImpl.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>
#include <kmamba/core/impl/SsdImpl.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>

namespace kmamba {

/// Inputs of conv_ssd_step. A View left unallocated means "absent" for the optional ones.
template <class MemorySpace>
struct ConvSsdStepArgs {
  /// (batch, columns): per sequence the token's x (nheads·headdim), B (ngroups·dstate) and C
  /// (ngroups·dstate) before the conv, then the raw dt (nheads), consecutive from column
  /// xbc_offset to the last column. The Mamba-2 in_proj output [z | x | B | C | dt] is this with
  /// xbc_offset = d_inner.
  ConstTensor2<float, MemorySpace> xbcdt;
  int xbc_offset = 0;
  int ngroups = 1;
  ConstTensor2<float, MemorySpace>
      conv_weight;  // (conv_dim, width), channels x, B, C; conv_dim = nheads·headdim + 2·ngroups·dstate
  ConstTensor1<float, MemorySpace> conv_bias;  // (conv_dim), optional
  ConstTensor1<float, MemorySpace> A_log;      // (nheads), A = −exp(A_log)
  ConstTensor1<float, MemorySpace> D;          // (nheads), optional skip connection
  ConstTensor1<float, MemorySpace> dt_bias;    // (nheads), optional, added to dt
  /// Apply softplus (threshold 20) to dt + dt_bias.
  bool dt_softplus = false;
  /// (nheads·headdim), optional: when given, `normed` receives gated_rms_norm(y, z, norm_weight,
  /// norm_eps, group_size = nheads·headdim / ngroups, norm_before_gate), with z the nheads·headdim
  /// columns of xbcdt just before xbc_offset (the Mamba-2 in_proj's z segment).
  ConstTensor1<float, MemorySpace> norm_weight;
  float norm_eps = 1e-5f;
  bool norm_before_gate = false;
};

/// The recurrent state conv_ssd_step advances in place. The conv states have causal_conv1d's
/// layout (the last width − 1 inputs, newest last), the ssm state ssd_step's.
template <class MemorySpace>
struct ConvSsdStepState {
  Tensor3<float, MemorySpace> conv_x;  // (batch, nheads·headdim, width − 1)
  Tensor3<float, MemorySpace> conv_B;  // (batch, ngroups·dstate, width − 1)
  Tensor3<float, MemorySpace> conv_C;  // (batch, ngroups·dstate, width − 1)
  Tensor4<float, MemorySpace> ssm;     // (batch, nheads, headdim, dstate)
  /// (batch, ngroups): the kernel's per-group tickets. Zero before the first call (allocate
  /// zero-filled); every call leaves it zero.
  Tensor2<int, MemorySpace> group_arrivals;
};

namespace impl {

// The argument checks of conv_ssd_step; returns its dimensions (seqlen 1).
template <class MemorySpace>
SsdDims conv_ssd_step_check_args(const char* function, const ConvSsdStepArgs<MemorySpace>& args,
                                 const ConvSsdStepState<MemorySpace>& state,
                                 const Tensor3<float, MemorySpace>& y,         // (batch, nheads, headdim)
                                 const Tensor2<float, MemorySpace>& normed) {  // (batch, nheads·headdim)
  KMAMBA_REQUIRE(args.xbcdt.is_allocated() && args.conv_weight.is_allocated() && args.A_log.is_allocated(),
                 function << ": xbcdt, conv_weight and A_log are required");
  check_allocated(function, "ssm", state.ssm);
  const std::int64_t batch = static_cast<std::int64_t>(state.ssm.extent(0));
  const std::int64_t nheads = static_cast<std::int64_t>(state.ssm.extent(1));
  const std::int64_t headdim = static_cast<std::int64_t>(state.ssm.extent(2));
  const std::int64_t dstate = static_cast<std::int64_t>(state.ssm.extent(3));
  const std::int64_t ngroups = args.ngroups;
  KMAMBA_REQUIRE(nheads >= 1 && headdim >= 1 && dstate >= 1,
                 function << ": ssm has shape " << shape_of(state.ssm).to_string()
                          << ": nheads, headdim and dstate must be positive");
  KMAMBA_REQUIRE(ngroups >= 1 && nheads % ngroups == 0,
                 function << ": ngroups = " << ngroups << " must be positive and divide nheads = " << nheads);
  KMAMBA_REQUIRE(args.xbc_offset >= 0, function << ": xbc_offset must not be negative, got " << args.xbc_offset);
  const std::int64_t inner = nheads * headdim, group_width = ngroups * dstate;
  const std::int64_t conv_dim = inner + 2 * group_width;
  check_shape(function, "conv_weight", args.conv_weight, Shape({conv_dim, Shape::any}),
              "(conv_dim, width) with conv_dim = nheads·headdim + 2·ngroups·dstate");
  const std::int64_t width = static_cast<std::int64_t>(args.conv_weight.extent(1));
  KMAMBA_REQUIRE(width >= 1, function << ": conv_weight has shape " << shape_of(args.conv_weight).to_string()
                                      << "; the conv width (its last extent) must be at least 1");
  check_shape(function, "xbcdt", args.xbcdt, {batch, args.xbc_offset + conv_dim + nheads},
              "(batch, xbc_offset + nheads·headdim + 2·ngroups·dstate + nheads)");
  if (args.conv_bias.is_allocated()) check_shape(function, "conv_bias", args.conv_bias, {conv_dim}, "(conv_dim)");
  check_shape(function, "A_log", args.A_log, {nheads}, "(nheads)");
  if (args.D.is_allocated()) check_shape(function, "D", args.D, {nheads}, "(nheads)");
  if (args.dt_bias.is_allocated()) check_shape(function, "dt_bias", args.dt_bias, {nheads}, "(nheads)");
  check_shape(function, "conv_x", state.conv_x, {batch, inner, width - 1}, "(batch, nheads·headdim, width − 1)");
  check_shape(function, "conv_B", state.conv_B, {batch, group_width, width - 1}, "(batch, ngroups·dstate, width − 1)");
  check_shape(function, "conv_C", state.conv_C, {batch, group_width, width - 1}, "(batch, ngroups·dstate, width − 1)");
  check_shape(function, "group_arrivals", state.group_arrivals, {batch, ngroups}, "(batch, ngroups)");
  check_shape(function, "y", y, {batch, nheads, headdim}, "(batch, nheads, headdim)");
  check_allocated(function, "conv_x", state.conv_x);
  check_allocated(function, "conv_B", state.conv_B);
  check_allocated(function, "conv_C", state.conv_C);
  check_allocated(function, "group_arrivals", state.group_arrivals);
  check_allocated(function, "y", y);
  const bool has_norm = args.norm_weight.is_allocated();
  KMAMBA_REQUIRE(has_norm == normed.is_allocated(),
                 function << ": normed must be given exactly when norm_weight is (norm_weight "
                          << (has_norm ? "given" : "absent") << ", normed "
                          << (normed.is_allocated() ? "given" : "absent") << ")");
  if (has_norm) {
    check_shape(function, "norm_weight", args.norm_weight, {inner}, "(nheads·headdim)");
    check_shape(function, "normed", normed, {batch, inner}, "(batch, nheads·headdim)");
    KMAMBA_REQUIRE(args.xbc_offset >= inner, function << ": with the gated norm, z is the " << inner
                                                      << " columns before xbc_offset, which is " << args.xbc_offset);
    KMAMBA_REQUIRE(args.norm_eps >= 0.0f, function << ": norm_eps must be >= 0, got " << args.norm_eps);
  }
  KMAMBA_REQUIRE(
      batch * nheads * headdim * dstate < std::numeric_limits<int>::max() &&
          batch * (args.xbc_offset + conv_dim + nheads) < std::numeric_limits<int>::max(),
      function << ": ssm has shape " << shape_of(state.ssm).to_string() << ": too many elements for 32-bit indexing");
  SsdDims dims;
  dims.batch = batch;
  dims.seqlen = 1;
  dims.nheads = nheads;
  dims.headdim = headdim;
  dims.ngroups = ngroups;
  dims.dstate = dstate;
  return dims;
}

}  // namespace impl

/// One decode token: advances the conv and ssm states of `state` in place and writes `y` and,
/// with args.norm_weight, `normed` (see the file comment). Equals causal_conv1d_update (silu) on
/// x, B, C, then ssd_step with A = −exp(A_log), then gated_rms_norm. Non-blocking on `exec`.
/// Throws kmamba::UserError for a wrong shape (the message names both shapes), a negative
/// xbc_offset (or one smaller than nheads·headdim with the norm), ngroups that does not divide
/// nheads, or `normed` given without norm_weight or the reverse.
template <class ExecutionSpace, class MemorySpace>
void conv_ssd_step(const ExecutionSpace& exec, const ConvSsdStepArgs<MemorySpace>& args,
                   const ConvSsdStepState<MemorySpace>& state,
                   const Tensor3<float, MemorySpace>& y,        // (batch, nheads, headdim)
                   const Tensor2<float, MemorySpace>& normed =  // (batch, nheads·headdim), with norm_weight
                   Tensor2<float, MemorySpace>()) {
  const ProfilingRegion region("kmamba::conv_ssd_step");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::conv_ssd_step: the execution space cannot access the tensors' memory space");
  constexpr const char* function = "kmamba::conv_ssd_step";
  const impl::SsdDims dims = impl::conv_ssd_step_check_args(function, args, state, y, normed);
  const std::int64_t batch = dims.batch, nheads = dims.nheads, headdim = dims.headdim, dstate = dims.dstate;
  const std::int64_t ngroups = dims.ngroups, inner = nheads * headdim, group_width = ngroups * dstate;
  const std::int64_t conv_dim = inner + 2 * group_width;
  const std::int64_t width = static_cast<std::int64_t>(args.conv_weight.extent(1));
  const bool has_norm = args.norm_weight.is_allocated();
  if (batch == 0) return;

  const impl::SsdPlan plan = impl::ssd_plan<ExecutionSpace>(function, dims, 1);
  const impl::ConvSsdStepFunctor<ExecutionSpace, MemorySpace> functor{
      args.xbcdt,
      args.conv_weight,
      args.conv_bias,
      args.A_log,
      args.D,
      args.dt_bias,
      args.norm_weight,
      state.conv_x,
      state.conv_B,
      state.conv_C,
      state.ssm,
      state.group_arrivals,
      y,
      normed,
      args.conv_bias.is_allocated(),
      args.D.is_allocated(),
      args.dt_bias.is_allocated(),
      args.dt_softplus,
      has_norm,
      args.norm_before_gate,
      args.norm_eps,
      static_cast<int>(nheads),
      static_cast<int>(headdim),
      static_cast<int>(dstate),
      static_cast<int>(width),
      static_cast<int>(ngroups),
      static_cast<int>(nheads / ngroups),
      has_norm ? static_cast<int>(args.xbc_offset - inner) : 0,
      args.xbc_offset,
      static_cast<int>(args.xbc_offset + conv_dim),
      static_cast<int>(inner),
      static_cast<int>(inner + group_width),
      impl::conv_ssd_step_block(
          exec, batch * ngroups, inner / ngroups, plan.team_size,
          impl::vector_lanes_are_threads<ExecutionSpace> ? plan.team_size * plan.vector_length : 1)};
  // Not ssd_launch: its policy carries the chunk products' launch bounds (two 256-thread teams per
  // multiprocessor, for their register blocks), which would cap this latency-bound kernel — a chain
  // of dependent loads per channel — at a quarter of the threads a multiprocessor holds.
  using Policy = Kokkos::TeamPolicy<ExecutionSpace>;
  const std::size_t scratch = functor.scratch_bytes(static_cast<int>(dstate));
  const int league = functor.league(static_cast<int>(batch));
  const int team_size = std::max(1, std::min(plan.team_size, Policy(exec, league, 1, plan.vector_length)
                                                                 .set_scratch_size(0, Kokkos::PerTeam(scratch))
                                                                 .team_size_max(functor, Kokkos::ParallelForTag())));
  Kokkos::parallel_for(
      "kmamba::ssd::conv_step",
      impl::light_weight(
          Policy(exec, league, team_size, plan.vector_length).set_scratch_size(0, Kokkos::PerTeam(scratch))),
      functor);
}

template <class MemorySpace>
void conv_ssd_step(const ConvSsdStepArgs<MemorySpace>& args, const ConvSsdStepState<MemorySpace>& state,
                   const Tensor3<float, MemorySpace>& y,        // (batch, nheads, headdim)
                   const Tensor2<float, MemorySpace>& normed =  // (batch, nheads·headdim), with norm_weight
                   Tensor2<float, MemorySpace>()) {
  conv_ssd_step(typename Tensor3<float, MemorySpace>::execution_space(), args, state, y, normed);
}

}  // namespace kmamba

#endif
