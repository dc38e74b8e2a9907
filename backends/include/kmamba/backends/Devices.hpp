// What this build of kmamba can run on, and what the current machine offers.
#ifndef KMAMBA_BACKENDS_DEVICES_HPP
#define KMAMBA_BACKENDS_DEVICES_HPP

#include <kmamba/Config.hpp>

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

namespace kmamba {

/// One execution space of this build (Serial, OpenMP, Cuda) and what it runs on.
struct ExecutionSpaceInfo {
  std::string name;         // Kokkos name: "Serial", "OpenMP", "Cuda"
  std::string device;       // "host CPU, 16 threads" or "NVIDIA H200 (sm_90, 132 SMs, 139.8 GiB)"
  int concurrency = 0;      // threads (host) or resident threads (GPU)
  bool is_default = false;  // Kokkos::DefaultExecutionSpace
};

/// The execution spaces compiled into this build. Call after Kokkos::initialize.
std::vector<ExecutionSpaceInfo> execution_spaces();

/// Human-readable build configuration (version, options, Kokkos version, execution spaces).
/// Call after Kokkos::initialize.
void print_configuration(std::ostream& os);

}  // namespace kmamba

#endif
