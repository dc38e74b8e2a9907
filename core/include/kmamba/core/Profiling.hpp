// ProfilingRegion names the scope of one public op in Kokkos profiling tools (kernel timers,
// Nsight Systems through the nvtx connector): a region pushed on construction and popped on
// destruction. Without a loaded tool it costs one check. Kokkos 3.4 has no ScopedRegion, hence
// this class over pushRegion/popRegion.
//
//   template <class ExecutionSpace> void ssd_forward(const ExecutionSpace& exec, ...) {
//     const ProfilingRegion region("kmamba::ssd_forward");
//     ...
#ifndef KMAMBA_CORE_PROFILING_HPP
#define KMAMBA_CORE_PROFILING_HPP

#include <Kokkos_Core.hpp>

namespace kmamba {

class ProfilingRegion {
 public:
  explicit ProfilingRegion(const char* name) : active_(Kokkos::Profiling::profileLibraryLoaded()) {
    if (active_) Kokkos::Profiling::pushRegion(name);
  }
  ~ProfilingRegion() {
    if (active_) Kokkos::Profiling::popRegion();
  }
  ProfilingRegion(const ProfilingRegion&) = delete;
  ProfilingRegion& operator=(const ProfilingRegion&) = delete;

 private:
  bool active_;
};

}  // namespace kmamba

#endif
