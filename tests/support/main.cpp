// GoogleTest main for single-process suites: owns Kokkos start-up and shutdown. A run whose
// filter selects no test fails (NoTestSelected.hpp), so that no ctest entry passes vacuously.
#include "NoTestSelected.hpp"

#include <Kokkos_Core.hpp>
#include <gtest/gtest.h>

int main(int argc, char** argv) {
  ::testing::InitGoogleTest(&argc, argv);
  Kokkos::ScopeGuard kokkos(argc, argv);
  const int result = RUN_ALL_TESTS();
  return kmamba::test::no_test_selected() ? 1 : result;
}
