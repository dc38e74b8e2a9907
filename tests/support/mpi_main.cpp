// GoogleTest main for MPI suites: owns MPI and Kokkos start-up; only rank 0 prints results, and a
// failure on any rank fails the run on every rank. An exception escaping a test on one rank aborts
// every rank (kmamba::run_or_abort) instead of leaving the others blocked in a collective. A run
// whose filter selects no test fails (NoTestSelected.hpp). In CUDA builds each rank takes the GPU
// of its node-local rank (modulo the GPUs present; --kokkos-device-id overrides), as kmamba-train
// does: NCCL wants one GPU per rank.
#include "NoTestSelected.hpp"

#include <kmamba/Config.hpp>
#include <kmamba/parallel/Mpi.hpp>

#include <Kokkos_Core.hpp>
#include <gtest/gtest.h>
#include <mpi.h>

#include <cstdio>
#include <string>
#include <vector>

namespace {

/// argv with --kokkos-device-id=<node-local rank mod GPUs> appended in CUDA builds, unless given.
std::vector<char*> kokkos_arguments(int argc, char** argv, std::string& device_argument) {
  std::vector<char*> args(argv, argv + argc);
#if KMAMBA_ENABLE_CUDA
  bool given = false;
  for (int i = 1; i < argc; ++i) given = given || std::string(argv[i]).rfind("--kokkos-device-id", 0) == 0;
  const int devices = Kokkos::Cuda::detect_device_count();
  if (!given && devices > 0) {
    device_argument = "--kokkos-device-id=" + std::to_string(kmamba::node_local_rank(MPI_COMM_WORLD) % devices);
    args.push_back(&device_argument[0]);
  }
#else
  (void)device_argument;
#endif
  return args;
}

}  // namespace

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
  std::string device_argument;
  std::vector<char*> kokkos_args = kokkos_arguments(argc, argv, device_argument);
  int kokkos_argc = static_cast<int>(kokkos_args.size());
  const int failed = kmamba::run_or_abort(MPI_COMM_WORLD, [&] {
    Kokkos::ScopeGuard kokkos(kokkos_argc, kokkos_args.data());
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
