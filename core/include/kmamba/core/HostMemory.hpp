// How the C library hands host memory to kmamba's Views.
//
// A training or generation step allocates and releases its temporaries (activations, gradients,
// workspaces) every time. glibc's malloc serves blocks above its mmap threshold (128 KiB, raised
// only as blocks are freed) with mmap and returns them with munmap, and gives the free top of its
// heap back to the system, so each step faults in fresh zeroed pages again: on a 2-core host a
// small training step spent about a fifth of its time in page faults (perf/RESULTS.md). The CUDA
// build's device memory comes from a pool for the same reason.
#ifndef KMAMBA_CORE_HOSTMEMORY_HPP
#define KMAMBA_CORE_HOSTMEMORY_HPP

namespace kmamba {

/// Asks the C library to keep freed host memory for reuse: with glibc, blocks up to 32 MiB come
/// from the heap rather than from mmap, and the heap's free top is kept rather than trimmed, so the
/// process keeps its largest working set until it ends (as a caching allocator does). Affects the
/// whole process, so the apps call it at startup and a program that embeds kmamba decides for
/// itself. Does nothing, and returns false, where the C library is not glibc or where the
/// environment sets KMAMBA_HOST_MALLOC_KEEP=0; returns true once applied.
bool keep_freed_host_memory();

}  // namespace kmamba

#endif
