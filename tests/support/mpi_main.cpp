// GoogleTest main for MPI suites: owns MPI and Kokkos start-up; only rank 0 prints results, and a
// failure on any rank fails the run on every rank. An exception escaping a test on one rank aborts
// every rank (kmamba::run_or_abort) instead of leaving the others blocked in a collective. A run
// whose filter selects no test fails (NoTestSelected.hpp).
#include "NoTestSelected.hpp"

#include <kmamba/parallel/Mpi.hpp>

#include <Kokkos_Core.hpp>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::GTEST_FLAG(catch_exceptions) = false;
  if (rank != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
  }
  const int failed = kmamba::run_or_abort(MPI_COMM_WORLD, [&] {
    Kokkos::ScopeGuard kokkos(argc, argv);
    const int result = RUN_ALL_TESTS();
    return result != 0 || kmamba::test::no_test_selected() ? 1 : 0;
  });
  int any_failed = 0;
  MPI_Allreduce(&failed, &any_failed, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (rank == 0 && any_failed && !failed) {
    std::fprintf(stderr, "a test failed on another rank\n");
  }
  MPI_Finalize();
  return any_failed;
}
