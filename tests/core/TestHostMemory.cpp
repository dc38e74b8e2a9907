// kmamba::keep_freed_host_memory: with glibc, a block of 16 MiB (above glibc's default mmap
// threshold) comes from the heap instead of its own mapping and stays in the heap once freed;
// KMAMBA_HOST_MALLOC_KEEP=0 turns the setting off. The sanitizers replace malloc, so under them
// only the opt-out is checked.
#include <kmamba/core/HostMemory.hpp>

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KMAMBA_TEST_MALLOC_REPLACED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define KMAMBA_TEST_MALLOC_REPLACED 1
#endif
#endif

namespace {

TEST(HostMemory, OptOutLeavesTheAllocatorAlone) {
  ::setenv("KMAMBA_HOST_MALLOC_KEEP", "0", 1);
  EXPECT_FALSE(kmamba::keep_freed_host_memory());
  ::unsetenv("KMAMBA_HOST_MALLOC_KEEP");
}

#if defined(__GLIBC__) && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 33) && !defined(KMAMBA_TEST_MALLOC_REPLACED)
TEST(HostMemory, LargeBlocksComeFromAndReturnToTheHeap) {
  ASSERT_TRUE(kmamba::keep_freed_host_memory());
  constexpr std::size_t bytes = std::size_t(16) << 20;
  const std::size_t mapped_before = mallinfo2().hblks;
  char* const block = static_cast<char*>(std::malloc(bytes));
  ASSERT_NE(block, nullptr);
  std::memset(block, 1, bytes);
  EXPECT_EQ(mallinfo2().hblks, mapped_before) << "a 16 MiB block got a mapping of its own";
  std::free(block);
  EXPECT_GE(mallinfo2().fordblks, bytes) << "the freed 16 MiB left the heap";
}
#endif

}  // namespace
