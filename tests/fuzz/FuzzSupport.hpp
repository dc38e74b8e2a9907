// Helpers shared by the fuzz targets.
#ifndef KMAMBA_TESTS_FUZZ_SUPPORT_HPP
#define KMAMBA_TESTS_FUZZ_SUPPORT_HPP

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <unistd.h>

namespace kmamba {
namespace fuzz {

// A file name of this process's own under $TMPDIR (or /tmp), for readers that take a path.
inline std::string scratch_path(const char* what) {
  const char* dir = std::getenv("TMPDIR");
  return std::string(dir && *dir ? dir : "/tmp") + "/kmamba-fuzz-" + what + "-" + std::to_string(::getpid());
}

inline void write_file(const std::string& path, const std::uint8_t* data, std::size_t size) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || (size != 0 && std::fwrite(data, 1, size, f) != size) || std::fclose(f) != 0) {
    std::perror(path.c_str());
    std::abort();
  }
}

}  // namespace fuzz
}  // namespace kmamba

#endif
