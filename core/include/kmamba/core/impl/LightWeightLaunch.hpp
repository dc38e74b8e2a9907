// Kernel launches that may run inside a recorded step graph (kmamba/backends/StepGraph.hpp): the
// decode-step kernels. light_weight(policy) adds Kokkos' light-weight hint, with which CUDA
// passes the functor as a kernel parameter (up to 4 KB) instead of staging it in constant memory
// through host-side waits and copies that stream capture cannot record. No effect on host
// backends. vector_lanes_are_threads<ExecSpace> says how a team occupies the device, for sizing
// work blocks to what runs at once.
#ifndef KMAMBA_CORE_IMPL_LIGHTWEIGHTLAUNCH_HPP
#define KMAMBA_CORE_IMPL_LIGHTWEIGHTLAUNCH_HPP

#include <Kokkos_Core.hpp>

namespace kmamba {
namespace impl {

template <class Policy>
auto light_weight(const Policy& policy) {
  return Kokkos::Experimental::require(policy, Kokkos::Experimental::WorkItemProperty::HintLightWeight);
}

/// Whether a team's vector lanes are hardware threads of their own (GPU backends: a team of
/// team_size × vector_length threads) or a loop inside one thread (host backends).
template <class ExecSpace>
constexpr bool vector_lanes_are_threads =
    !Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename ExecSpace::memory_space>::accessible;

}  // namespace impl
}  // namespace kmamba

#endif
