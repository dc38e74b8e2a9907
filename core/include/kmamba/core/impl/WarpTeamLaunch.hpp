// Launches of warp-tile kernels (impl/WarpTile.hpp) whose team scratch exceeds what a Kokkos
// TeamPolicy can ask for: one team of Threads threads per league item, `bytes` of team scratch.
//
// Kokkos 3.4 caps a Cuda team's level-0 scratch at 40 KB (and never sets the opt-in attribute for
// more than 48 KB), while a chunk kernel holding all its operand tiles on chip needs ~100 KB
// (an H200 SM has 228 KB). So on Cuda the body runs in a __global__ kernel of this file, launched
// on the execution space instance's stream with cudaFuncAttributeMaxDynamicSharedMemorySize set,
// and announced to Kokkos' tools under its label like any Kokkos kernel. Every other backend runs
// the portable warp-tile form, one thread per team, through a Kokkos TeamPolicy.
//
// The body is called as body(WarpTeamContext): its league item, its thread of the team, the
// team's scratch (16-byte aligned) and a team barrier.
#ifndef KMAMBA_CORE_IMPL_WARPTEAMLAUNCH_HPP
#define KMAMBA_CORE_IMPL_WARPTEAMLAUNCH_HPP

#include <kmamba/core/Error.hpp>

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

namespace kmamba {
namespace impl {

struct WarpTeamContext {
  int league_rank;
  int thread;
  char* scratch;

  /// Every thread of the team reaches it before any goes on (one-thread teams: nothing to wait for).
  KOKKOS_INLINE_FUNCTION void barrier() const {
#if defined(__CUDA_ARCH__)
    __syncthreads();
#endif
  }
};

/// The portable launch: a Kokkos TeamPolicy of one-thread teams.
template <class ExecSpace, int Threads, int MinTeamsPerSM>
struct WarpTeamLauncher {
  static_assert(Threads == 1, "WarpTeamLauncher: the portable form runs teams of one thread");

  template <class Body>
  struct Wrapper {
    Body body;
    std::size_t bytes;
    // The scratch starts as NaN in every team: a value read before the body wrote it reaches the
    // results, so the host tests catch what a GPU would read as another team's stale data (a few
    // microseconds per team against milliseconds of portable warp-tile work).
    KOKKOS_INLINE_FUNCTION void operator()(const typename Kokkos::TeamPolicy<ExecSpace>::member_type& team) const {
      char* scratch = static_cast<char*>(team.team_scratch(0).get_shmem(bytes));
      float* words = reinterpret_cast<float*>(scratch);
      for (std::size_t i = 0; i < bytes / sizeof(float); ++i) words[i] = std::numeric_limits<float>::quiet_NaN();
      body(WarpTeamContext{team.league_rank(), team.team_rank(), scratch});
    }
  };

  template <class Body>
  static void launch(const ExecSpace& exec, const char* label, int league, std::size_t bytes, const Body& body) {
    if (league == 0) return;
    Kokkos::TeamPolicy<ExecSpace> policy(exec, league, 1, 1);
    policy.set_scratch_size(0, Kokkos::PerTeam(bytes));
    Kokkos::parallel_for(label, policy, Wrapper<Body>{body, bytes});
  }
};

#if defined(KOKKOS_ENABLE_CUDA)

template <class Body, int Threads, int MinTeamsPerSM>
__global__ void __launch_bounds__(Threads, MinTeamsPerSM) warp_team_kernel(const Body body) {
  extern __shared__ float4 warp_team_scratch[];
  body(WarpTeamContext{static_cast<int>(blockIdx.x), static_cast<int>(threadIdx.x),
                       reinterpret_cast<char*>(warp_team_scratch)});
}

inline const char* warp_team_cuda_error(cudaError_t status) { return cudaGetErrorString(status); }

template <int Threads, int MinTeamsPerSM>
struct WarpTeamLauncher<Kokkos::Cuda, Threads, MinTeamsPerSM> {
  template <class Body>
  static void launch(const Kokkos::Cuda& exec, const char* label, int league, std::size_t bytes, const Body& body) {
    if (league == 0) return;
    const auto kernel = &warp_team_kernel<Body, Threads, MinTeamsPerSM>;
    KMAMBA_VENDOR_CHECK(
        "CUDA", cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)),
        cudaSuccess, warp_team_cuda_error);
    std::uint64_t kernel_id = 0;
    if (Kokkos::Tools::profileLibraryLoaded()) Kokkos::Tools::beginParallelFor(label, 0, &kernel_id);
    kernel<<<league, Threads, bytes, exec.cuda_stream()>>>(body);
    KMAMBA_VENDOR_CHECK("CUDA", cudaGetLastError(), cudaSuccess, warp_team_cuda_error);
    if (Kokkos::Tools::profileLibraryLoaded()) Kokkos::Tools::endParallelFor(kernel_id);
  }
};

#endif  // KOKKOS_ENABLE_CUDA

}  // namespace impl
}  // namespace kmamba

#endif
