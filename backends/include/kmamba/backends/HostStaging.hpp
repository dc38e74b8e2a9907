// The host memory that copies to and from a memory space go through fastest: page-locked memory
// (Kokkos::CudaHostPinnedSpace) for CUDA device memory, whose copies then run asynchronously on a
// stream at the link's full rate; plain host memory for host memory spaces, where a copy is a
// memcpy either way.
//
//   kmamba::Tensor1<float, kmamba::HostStagingSpace<Kokkos::CudaSpace>> staged("label", n);
//   Kokkos::deep_copy(exec, staged, device_values);   // cudaMemcpyAsync on exec's stream
#ifndef KMAMBA_BACKENDS_HOSTSTAGING_HPP
#define KMAMBA_BACKENDS_HOSTSTAGING_HPP

#include <kmamba/Config.hpp>

#include <Kokkos_Core.hpp>

namespace kmamba {
namespace impl {
template <class MemorySpace>
struct HostStagingSpaceOf {
  using type = Kokkos::HostSpace;
};
#if KMAMBA_ENABLE_CUDA
template <>
struct HostStagingSpaceOf<Kokkos::CudaSpace> {
  using type = Kokkos::CudaHostPinnedSpace;
};
#endif
}  // namespace impl

/// Host memory for the copies of data in `MemorySpace`: CudaHostPinnedSpace for CudaSpace,
/// HostSpace otherwise. Always readable and writable by host threads.
template <class MemorySpace>
using HostStagingSpace = typename impl::HostStagingSpaceOf<MemorySpace>::type;

}  // namespace kmamba

#endif
