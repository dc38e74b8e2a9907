// Where the tests find their data files: the repository's tests/data (goldens under golden/).
//
// The build records the source tree's path; the environment variable KMAMBA_TEST_DATA_DIR, when set,
// takes its place, so that test binaries built on one machine run on another whose copy of the
// repository lies elsewhere (scripts/gpu-carried.sh sets it on the GPU machine).
#pragma once

#include <cstdlib>
#include <string>

namespace kmamba::test {

/// The tests/data directory of the repository.
inline std::string test_data_dir() {
  const char* env = std::getenv("KMAMBA_TEST_DATA_DIR");
  return (env != nullptr && *env != '\0') ? std::string(env) : std::string(KMAMBA_TEST_DATA_DIR);
}

/// The golden files of the reference implementation (tests/data/golden; README.md there).
inline std::string golden_dir() { return test_data_dir() + "/golden"; }

}  // namespace kmamba::test
