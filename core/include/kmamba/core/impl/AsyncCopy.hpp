// Copies from global memory into team scratch that do not pass through registers: on Cuda
// (sm_80 and later) `cp.async`, whose copies run while the team computes and are waited for by
// group; elsewhere plain copies, complete on return (so the waits are no-ops and a kernel written
// on these calls behaves the same, only without the overlap).
//
// A thread issues copies, closes them into a group with async_commit(), and before reading their
// destinations waits with async_wait<Pending>() until at most `Pending` of its groups are still in
// flight; a team barrier after the wait makes every thread's copies visible to the whole team.
#ifndef KMAMBA_CORE_IMPL_ASYNCCOPY_HPP
#define KMAMBA_CORE_IMPL_ASYNCCOPY_HPP

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <cstring>

namespace kmamba {
namespace impl {

/// 16 bytes from src (global, 16-byte aligned) to dst (scratch, 16-byte aligned); zeros instead
/// where `valid` is false (src is then not read, but must be a mapped address).
KOKKOS_INLINE_FUNCTION void async_copy16(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const auto shared = static_cast<std::uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared), "l"(src), "r"(valid ? 16 : 0));
#else
  if (valid) {
    std::memcpy(dst, src, 16);
  } else {
    std::memset(dst, 0, 16);
  }
#endif
}

/// 4 bytes from src (global, 4-byte aligned) to dst (scratch); zeros where `valid` is false.
KOKKOS_INLINE_FUNCTION void async_copy4(void* dst, const void* src, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const auto shared = static_cast<std::uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared), "l"(src), "r"(valid ? 4 : 0));
#else
  if (valid) {
    std::memcpy(dst, src, 4);
  } else {
    std::memset(dst, 0, 4);
  }
#endif
}

/// Closes the calling thread's copies issued since the last commit into one group.
KOKKOS_INLINE_FUNCTION void async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::);
#endif
}

/// Waits until at most `Pending` of the calling thread's committed groups are in flight.
template <int Pending>
KOKKOS_INLINE_FUNCTION void async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
#endif
}

}  // namespace impl
}  // namespace kmamba

#endif
