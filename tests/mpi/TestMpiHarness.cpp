// The MPI harness: these run at 1, 2 and 4 ranks. A tensor filled in rank-sized pieces with
// counter-based random numbers must equal the 1-rank fill, which is what makes sharded
// initialisation reproduce the single-process run.
#include "RoundingBounds.hpp"

#include <kmamba/core/Core.hpp>
#include <kmamba/parallel/Mpi.hpp>

#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <utility>
#include <vector>

namespace {

template <class Mem>
struct SumFunctor {
  Kokkos::View<float*, Kokkos::LayoutRight, Mem> x;
  KOKKOS_INLINE_FUNCTION void operator()(const int i, double& acc) const { acc += x(i); }
};

TEST(MpiHarness, DuplicatesTheCallersCommunicator) {
  kmamba::MpiComm comm(MPI_COMM_WORLD);
  int world_rank = 0, world_size = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  EXPECT_EQ(comm.rank(), world_rank);
  EXPECT_EQ(comm.size(), world_size);
  int result = MPI_UNEQUAL;
  MPI_Comm_compare(comm.get(), MPI_COMM_WORLD, &result);
  EXPECT_EQ(result, MPI_CONGRUENT);  // same group, different context
  kmamba::MpiComm moved = std::move(comm);
  EXPECT_EQ(comm.get(), MPI_COMM_NULL);
  EXPECT_NE(moved.get(), MPI_COMM_NULL);
  EXPECT_THROW(kmamba::MpiComm{MPI_COMM_NULL}, kmamba::UserError);
}

// The ranks of each node (same processor name) hold the local ranks 0, 1, ..., count − 1 once each.
TEST(MpiHarness, NodeLocalRanksNumberEachNodesRanks) {
  int world_size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  const int local = kmamba::node_local_rank(MPI_COMM_WORLD);
  char name[MPI_MAX_PROCESSOR_NAME] = {};
  int length = 0;
  MPI_Get_processor_name(name, &length);
  std::vector<char> names(static_cast<std::size_t>(world_size) * MPI_MAX_PROCESSOR_NAME);
  std::vector<int> locals(static_cast<std::size_t>(world_size));
  MPI_Allgather(name, MPI_MAX_PROCESSOR_NAME, MPI_CHAR, names.data(), MPI_MAX_PROCESSOR_NAME, MPI_CHAR, MPI_COMM_WORLD);
  MPI_Allgather(&local, 1, MPI_INT, locals.data(), 1, MPI_INT, MPI_COMM_WORLD);
  for (int r = 0; r < world_size; ++r) {
    const std::string node(&names[static_cast<std::size_t>(r) * MPI_MAX_PROCESSOR_NAME]);
    std::vector<int> seen;
    for (int q = 0; q < world_size; ++q) {
      if (std::string(&names[static_cast<std::size_t>(q) * MPI_MAX_PROCESSOR_NAME]) == node) seen.push_back(locals[q]);
    }
    std::sort(seen.begin(), seen.end());
    for (std::size_t i = 0; i < seen.size(); ++i) EXPECT_EQ(seen[i], static_cast<int>(i)) << "node " << node;
  }
  EXPECT_THROW(kmamba::node_local_rank(MPI_COMM_NULL), kmamba::UserError);
}

TEST(MpiHarness, ShardedRandomFillEqualsOneRankFill) {
  using Exec = Kokkos::DefaultExecutionSpace;
  using Mem = Exec::memory_space;
  kmamba::MpiComm comm(MPI_COMM_WORLD);
  const int per_rank = 1000 + 37;
  const int total = per_rank * comm.size();

  auto shard = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::shard", per_rank);
  kmamba::fill_normal(Exec(), shard, 2026, 0.0f, 1.0f, static_cast<std::uint64_t>(comm.rank()) * per_rank);
  auto shard_h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), shard);

  std::vector<float> gathered(static_cast<std::size_t>(total));
  KMAMBA_MPI_CHECK(
      MPI_Allgather(shard_h.data(), per_rank, MPI_FLOAT, gathered.data(), per_rank, MPI_FLOAT, comm.get()));

  auto whole = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::whole", total);
  kmamba::fill_normal(Exec(), whole, 2026, 0.0f, 1.0f);
  auto whole_h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), whole);
  for (int i = 0; i < total; ++i) ASSERT_EQ(gathered[static_cast<std::size_t>(i)], whole_h(i)) << "element " << i;

  // A reduction of device data across ranks equals the single-process sum (to rounding).
  double local = 0.0;
  Kokkos::parallel_reduce("kmamba::test::sum", Kokkos::RangePolicy<Exec>(0, per_rank), SumFunctor<Mem>{shard}, local);
  double global = 0.0;
  KMAMBA_MPI_CHECK(MPI_Allreduce(&local, &global, 1, MPI_DOUBLE, MPI_SUM, comm.get()));
  // Both are double sums of the same `total` values in two orders: they differ by at most
  // 2·γ(total−1)·Σ|x| (support/RoundingBounds.hpp, 1).
  double reference = 0.0, magnitude = 0.0;
  for (int i = 0; i < total; ++i) {
    reference += whole_h(i);
    magnitude += std::abs(static_cast<double>(whole_h(i)));
  }
  EXPECT_NEAR(global, reference, kmamba::test::sum_order_bound<double>(total) * magnitude);
}

TEST(MpiHarness, FailedCallBecomesVendorError) {
  kmamba::MpiComm comm(MPI_COMM_WORLD);
  KMAMBA_MPI_CHECK(MPI_Comm_set_errhandler(comm.get(), MPI_ERRORS_RETURN));
  float value = 1.0f;
  try {
    KMAMBA_MPI_CHECK(MPI_Send(&value, 1, MPI_FLOAT, comm.size() + 5, 0, comm.get()));
    FAIL() << "no exception";
  } catch (const kmamba::VendorError& e) {
    EXPECT_EQ(e.library(), "MPI");
    EXPECT_NE(e.status(), MPI_SUCCESS);
    EXPECT_NE(std::string(e.what()).find("MPI_Send"), std::string::npos) << e.what();
  }
}

}  // namespace
