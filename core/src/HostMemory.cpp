#include <kmamba/core/HostMemory.hpp>

#include <climits>
#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace kmamba {

bool keep_freed_host_memory() {
  const char* const setting = std::getenv("KMAMBA_HOST_MALLOC_KEEP");
  if (setting != nullptr && std::strcmp(setting, "0") == 0) return false;
#if defined(__GLIBC__)
  // 32 MiB is the largest mmap threshold glibc accepts on 64-bit targets; a fixed threshold also
  // turns off its dynamic adjustment. mallopt returns 1 on success.
  constexpr int mmap_threshold = 32 * 1024 * 1024;
  return mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1 && mallopt(M_TRIM_THRESHOLD, INT_MAX) == 1;
#else
  return false;
#endif
}

}  // namespace kmamba
