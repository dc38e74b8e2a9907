// Helper of the rank-failure tests (RunRankFailure.cmake): every rank joins all-reduces in a loop;
// rank argv[1] throws in round 3 while the others wait for it in that round's all-reduce.
// kmamba::run_or_abort must end every rank, with a message naming the failed rank.
#include <kmamba/core/Error.hpp>
#include <kmamba/parallel/Mpi.hpp>
#include <kmamba/parallel/MpiCommunicator.hpp>

#include <Kokkos_Core.hpp>
#include <mpi.h>

#include <cstdio>
#include <cstdlib>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s FAILING_RANK\n", argv[0]);
    MPI_Finalize();
    return 2;
  }
  const int failing = std::atoi(argv[1]);
  const int rc = kmamba::run_or_abort(MPI_COMM_WORLD, [&] {
    Kokkos::ScopeGuard kokkos(argc, argv);
    const kmamba::MpiCommunicator world(MPI_COMM_WORLD);
    for (int round = 0; round < 1000000; ++round) {
      if (world.rank() == failing && round == 3) KMAMBA_USER_ERROR("injected failure in round " << round);
      world.all_reduce_value(round, kmamba::ReduceOp::Sum);
    }
    return 0;
  });
  MPI_Finalize();
  return rc;
}
