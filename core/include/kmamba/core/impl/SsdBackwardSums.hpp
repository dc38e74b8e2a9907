// The end of the SSD backward (staged or fused): the chunk backward's per-head outputs summed into
// dB, dC (over the heads of each group) and dA, dD, ddt_bias (over batch and chunks).
#ifndef KMAMBA_CORE_IMPL_SSDBACKWARDSUMS_HPP
#define KMAMBA_CORE_IMPL_SSDBACKWARDSUMS_HPP

#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/SsdOperands.hpp>

#include <Kokkos_Core.hpp>

namespace kmamba {

template <class MemorySpace>
struct SsdGrads;

namespace impl {

/// dB and dC: the heads of each group summed in a fixed order, one work item per element.
template <class MemorySpace>
struct SsdGroupSumFunctor {
  ConstTensor4<float, MemorySpace> dB_head, dC_head;  // (batch, seqlen, nheads, dstate)
  Tensor4<float, MemorySpace> dB, dC;                 // (batch, seqlen, ngroups, dstate)

  KOKKOS_INLINE_FUNCTION void operator()(const int item) const {
    const int dstate = static_cast<int>(dB.extent(3)), ngroups = static_cast<int>(dB.extent(2));
    const int seqlen = static_cast<int>(dB.extent(1));
    const int n = item % dstate, g = (item / dstate) % ngroups, t = (item / (dstate * ngroups)) % seqlen;
    const int b = item / (dstate * ngroups * seqlen);
    const int heads_per_group = static_cast<int>(dB_head.extent(2)) / ngroups;
    float sb = 0.0f, sc = 0.0f;
    for (int k = 0; k < heads_per_group; ++k) {
      sb += dB_head(b, t, g * heads_per_group + k, n);
      sc += dC_head(b, t, g * heads_per_group + k, n);
    }
    dB(b, t, g, n) = sb;
    dC(b, t, g, n) = sc;
  }
};
/// dA, dD and ddt_bias: the per-(batch, chunk) partial sums added in a fixed order.
template <class MemorySpace>
struct SsdParameterSumFunctor {
  ConstTensor4<float, MemorySpace> partial;      // (batch, nchunks, nheads, 3)
  Tensor1<float, MemorySpace> dA, dD, ddt_bias;  // (nheads)
  bool write_dA, write_dD, write_ddt_bias;

  KOKKOS_INLINE_FUNCTION void operator()(const int h) const {
    float sums[3] = {0.0f, 0.0f, 0.0f};
    for (int b = 0; b < static_cast<int>(partial.extent(0)); ++b) {
      for (int c = 0; c < static_cast<int>(partial.extent(1)); ++c) {
        for (int k = 0; k < 3; ++k) sums[k] += partial(b, c, h, k);
      }
    }
    if (write_dA) dA(h) = sums[0];
    if (write_dD) dD(h) = sums[1];
    if (write_ddt_bias) ddt_bias(h) = sums[2];
  }
};

/// The per-head outputs of the chunk backward, summed into the gradients by ssd_backward_sums. With
/// one head per group they are the gradients themselves (nothing to sum).
template <class MemorySpace>
struct SsdChunkGrads {
  Tensor4<float, MemorySpace> dB_head;  // (batch, seqlen, nheads, dstate)
  Tensor4<float, MemorySpace> dC_head;  // (batch, seqlen, nheads, dstate)
  Tensor4<float, MemorySpace> partial;  // (batch, nchunks, nheads, 3): dA, dD, ddt_bias

  SsdChunkGrads(const SsdPlan& plan, const SsdGrads<MemorySpace>& grads)
      : partial(allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::ssd::partial_dA_dD_ddt_bias", plan.batch,
                                                                    plan.nchunks, plan.nheads, 3)) {
    if (plan.heads_per_group == 1) {
      dB_head = grads.dB;
      dC_head = grads.dC;
    } else {
      dB_head = allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::ssd::dB_per_head", plan.batch, plan.seqlen,
                                                                    plan.nheads, plan.dstate);
      dC_head = allocate_uninitialized<Tensor4<float, MemorySpace>>("kmamba::ssd::dC_per_head", plan.batch, plan.seqlen,
                                                                    plan.nheads, plan.dstate);
    }
  }
};

/// dB, dC (over the heads of each group) and dA, dD, ddt_bias (over batch and chunks), in a fixed order.
template <class ExecSpace, class MemorySpace>
void ssd_backward_sums(const ExecSpace& exec, const SsdPlan& plan, const SsdChunkGrads<MemorySpace>& chunk,
                       const SsdGrads<MemorySpace>& grads) {
  if (plan.heads_per_group > 1) {
    Kokkos::parallel_for("kmamba::ssd::group_sum",
                         Kokkos::RangePolicy<ExecSpace>(exec, 0, plan.batch * plan.seqlen * plan.ngroups * plan.dstate),
                         SsdGroupSumFunctor<MemorySpace>{chunk.dB_head, chunk.dC_head, grads.dB, grads.dC});
  }
  Kokkos::parallel_for(
      "kmamba::ssd::parameter_sum", Kokkos::RangePolicy<ExecSpace>(exec, 0, plan.nheads),
      SsdParameterSumFunctor<MemorySpace>{chunk.partial, grads.dA, grads.dD, grads.ddt_bias, grads.dA.is_allocated(),
                                          grads.dD.is_allocated(), grads.ddt_bias.is_allocated()});
}

}  // namespace impl
}  // namespace kmamba

#endif
