// The apps' choice of execution space: --device (serial, openmp, cuda) in the apps, --space
// (Serial, OpenMP, Cuda: Kokkos's names) in the perf drivers, both dispatched by on_space().
#ifndef KMAMBA_APPS_DEVICEOPTION_HPP
#define KMAMBA_APPS_DEVICEOPTION_HPP

#include <kmamba/Config.hpp>
#include <kmamba/core/Error.hpp>

#include <CLI/CLI.hpp>
#include <Kokkos_Core.hpp>

#include <string>
#include <vector>

namespace kmamba {
namespace app {

/// "Serial", "OpenMP", "Cuda": the execution spaces this build has, by Kokkos's names.
std::vector<std::string> spaces_of_this_build();

/// "serial", "openmp", "cuda": the --device names of this build's spaces.
std::vector<std::string> devices_of_this_build();

/// Declares `--device NAME` (serial, openmp or cuda, those of this build; empty: the build's
/// default execution space) into `device`.
CLI::Option* add_device_option(CLI::App& cli, std::string& device);

/// Declares `--space NAME` (Kokkos's names of this build's spaces) into `space`.
CLI::Option* add_space_option(CLI::App& cli, std::string& space, const std::string& help);

/// True when `name` is `space` in any letter case ("openmp" and "OpenMP").
bool names_space(const std::string& name, const char* space);

/// Returns f(Exec()) for the execution space `name` names (a --device or --space value; empty:
/// Kokkos::DefaultExecutionSpace).
template <class F>
decltype(auto) on_space(const std::string& name, F&& f) {
#if KMAMBA_HAS_SERIAL
  if (names_space(name, "Serial")) return f(Kokkos::Serial());
#endif
#if KMAMBA_HAS_OPENMP
  if (names_space(name, "OpenMP")) return f(Kokkos::OpenMP());
#endif
#if KMAMBA_ENABLE_CUDA
  if (names_space(name, "Cuda")) return f(Kokkos::Cuda());
#endif
  KMAMBA_REQUIRE(name.empty(), "'" << name << "' is not an execution space of this build");
  return f(Kokkos::DefaultExecutionSpace());
}

}  // namespace app
}  // namespace kmamba

#endif
