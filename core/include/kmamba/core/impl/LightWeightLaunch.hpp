// Kernel launches that may run inside a recorded step graph (kmamba/backends/StepGraph.hpp): the
// decode-step kernels. light_weight(policy) adds Kokkos' light-weight hint, with which CUDA
// passes the functor as a kernel parameter (up to 4 KB) instead of staging it in constant memory
// through host-side waits and copies that stream capture cannot record. No effect on host
// backends.
#ifndef KMAMBA_CORE_IMPL_LIGHTWEIGHTLAUNCH_HPP
#define KMAMBA_CORE_IMPL_LIGHTWEIGHTLAUNCH_HPP

#include <Kokkos_Core.hpp>

namespace kmamba {
namespace impl {

template <class Policy>
auto light_weight(const Policy& policy) {
  return Kokkos::Experimental::require(policy, Kokkos::Experimental::WorkItemProperty::HintLightWeight);
}

}  // namespace impl
}  // namespace kmamba

#endif
