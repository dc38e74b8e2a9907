// The MPI communicator (run at 1, 2 and 4 ranks): every collective on random data equals the
// serial computation over all ranks' data (which each rank regenerates: rank r's data are the
// counter-based normal stream's elements [r·n, (r+1)·n)), in and out of place; and its errors name
// the collective, the axis and the rank. Sums over ranks are compared element by element within
// the bound of a sum's two evaluation orders, 2·γ(P−1)·Σ_r|x_r| (support/RoundingBounds.hpp, 1):
// MPI may add the P ranks' values in any order. Everything else is exact.
#include "RoundingBounds.hpp"

#include <kmamba/core/Core.hpp>
#include <kmamba/parallel/CountingCommunicator.hpp>
#include <kmamba/parallel/MpiCommunicator.hpp>

#include <Kokkos_Core.hpp>
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <vector>

namespace {

using Exec = Kokkos::DefaultHostExecutionSpace;
using Mem = Exec::memory_space;
template <class T>
using Vec = kmamba::Tensor1<T, Mem>;

constexpr std::uint64_t seed = 77;

/// Rank `rank`'s n values.
template <class T = float>
Vec<T> rank_data(int rank, std::size_t n) {
  Vec<float> values("kmamba::test::rank_data", n);
  kmamba::fill_normal(Exec(), values, seed, 0.0f, 1.0f, static_cast<std::uint64_t>(rank) * n);
  Exec().fence();
  Vec<T> out("kmamba::test::rank_data", n);
  for (std::size_t i = 0; i < n; ++i) out(i) = static_cast<T>(values(i));
  return out;
}

/// max|got − ref| ≤ tolerance · max|ref| (docs/distributed.md §8.1), elements [0, n) (exact
/// comparisons: tolerance 0).
template <class A, class B>
void expect_close(const A& got, const B& ref, std::size_t n, double tolerance, const std::string& what) {
  double diff = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(got(i)) - static_cast<double>(ref[i])));
    scale = std::max(scale, std::abs(static_cast<double>(ref[i])));
  }
  EXPECT_LE(diff, tolerance * scale) << what;
}

/// |got(i) − ref[i]| ≤ bound[i] for every element.
template <class A, class B>
void expect_within(const A& got, const B& ref, const std::vector<double>& bound, const std::string& what) {
  std::size_t worst = 0;
  double worst_ratio = 0.0;
  for (std::size_t i = 0; i < bound.size(); ++i) {
    const double diff = std::abs(static_cast<double>(got(i)) - static_cast<double>(ref[i]));
    const double ratio = diff == 0.0 ? 0.0 : diff / bound[i];
    if (!(ratio <= worst_ratio)) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  EXPECT_LE(worst_ratio, 1.0) << what << ": element " << worst << " " << got(worst) << " vs " << ref[worst]
                              << ", bound " << bound[worst];
}

/// The bounds of a sum over `ranks` ranks (Σ|x| per element given) and of its average (the sum
/// times the rounded 1/P, against the exact sum divided by P: three more roundings).
template <class T>
std::vector<double> sum_bounds(const std::vector<double>& abs_sum, int ranks) {
  std::vector<double> out(abs_sum.size());
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = kmamba::test::sum_order_bound<T>(ranks) * abs_sum[i];
  return out;
}
template <class T>
std::vector<double> average_bounds(const std::vector<double>& abs_sum, const std::vector<T>& average, int ranks) {
  std::vector<double> out = sum_bounds<T>(abs_sum, ranks);
  for (std::size_t i = 0; i < out.size(); ++i) {
    out[i] = out[i] / ranks + 3 * kmamba::test::unit_roundoff<T>() * std::abs(static_cast<double>(average[i]));
  }
  return out;
}

template <class T>
void check_all_reduce(const kmamba::Communicator& comm, std::size_t n) {
  std::vector<T> sum(n, T(0)), max(n), min(n);
  std::vector<double> abs_sum(n, 0.0);
  for (int r = 0; r < comm.size(); ++r) {
    const auto data = rank_data<T>(r, n);
    for (std::size_t i = 0; i < n; ++i) {
      sum[i] += data(i);
      abs_sum[i] += std::abs(static_cast<double>(data(i)));
      max[i] = r == 0 ? data(i) : std::max(max[i], data(i));
      min[i] = r == 0 ? data(i) : std::min(min[i], data(i));
    }
  }
  std::vector<T> average(sum);
  for (auto& x : average) x /= static_cast<T>(comm.size());
  const std::vector<double> sum_bound = sum_bounds<T>(abs_sum, comm.size());
  const std::vector<double> average_bound = average_bounds<T>(abs_sum, average, comm.size());

  const auto mine = rank_data<T>(comm.rank(), n);
  Vec<T> out("kmamba::test::out", n);
  comm.all_reduce(Exec(), mine, out, kmamba::ReduceOp::Sum);
  expect_within(out, sum, sum_bound, "sum");
  comm.all_reduce(Exec(), mine, out, kmamba::ReduceOp::Average);
  expect_within(out, average, average_bound, "average");
  comm.all_reduce(Exec(), mine, out, kmamba::ReduceOp::Max);
  expect_close(out, max, n, 0.0, "max");
  comm.all_reduce(Exec(), mine, out, kmamba::ReduceOp::Min);
  expect_close(out, min, n, 0.0, "min");
  comm.all_reduce(Exec(), mine);  // in place
  expect_within(mine, sum, sum_bound, "sum in place");
}

TEST(MpiCommunicator, AllReduceEqualsSerial) {
  const kmamba::MpiCommunicator world(MPI_COMM_WORLD);
  check_all_reduce<float>(world, 1001);
  check_all_reduce<double>(world, 257);

  Vec<std::int64_t> counts("kmamba::test::counts", 3);
  for (int i = 0; i < 3; ++i) counts(i) = (world.rank() + 1) * (i + 1);
  world.all_reduce(Exec(), counts);
  const std::int64_t ranks_sum = static_cast<std::int64_t>(world.size()) * (world.size() + 1) / 2;
  for (int i = 0; i < 3; ++i) EXPECT_EQ(counts(i), ranks_sum * (i + 1));

  EXPECT_EQ(world.all_reduce_value<std::int64_t>(world.rank() + 1), ranks_sum);
  EXPECT_EQ(world.all_reduce_value<std::int32_t>(world.rank(), kmamba::ReduceOp::Max), world.size() - 1);
  EXPECT_DOUBLE_EQ(world.all_reduce_value(static_cast<double>(world.rank()), kmamba::ReduceOp::Average),
                   (world.size() - 1) / 2.0);
}

TEST(MpiCommunicator, ReduceScatterEqualsSerial) {
  const kmamba::MpiCommunicator world(MPI_COMM_WORLD);
  const std::size_t block = 333, n = block * static_cast<std::size_t>(world.size());
  std::vector<float> sum(n, 0.0f);
  std::vector<double> abs_sum(n, 0.0);
  for (int r = 0; r < world.size(); ++r) {
    const auto data = rank_data(r, n);
    for (std::size_t i = 0; i < n; ++i) {
      sum[i] += data(i);
      abs_sum[i] += std::abs(static_cast<double>(data(i)));
    }
  }
  const auto first = static_cast<std::ptrdiff_t>(block * world.rank()),
             last = first + static_cast<std::ptrdiff_t>(block);
  const std::vector<float> mine_ref(sum.begin() + first, sum.begin() + last);
  const std::vector<double> mine_abs(abs_sum.begin() + first, abs_sum.begin() + last);
  const std::vector<double> sum_bound = sum_bounds<float>(mine_abs, world.size());
  const auto data = rank_data(world.rank(), n);
  Vec<float> out("kmamba::test::out", block);
  world.reduce_scatter(Exec(), data, out);
  expect_within(out, mine_ref, sum_bound, "out of place");
  world.reduce_scatter(Exec(), data, out, kmamba::ReduceOp::Average);
  std::vector<float> average(mine_ref);
  for (auto& x : average) x /= static_cast<float>(world.size());
  expect_within(out, average, average_bounds<float>(mine_abs, average, world.size()), "average");

  // In place: the result lands in this rank's block of the send buffer.
  const Vec<float> own(data.data() + block * static_cast<std::size_t>(world.rank()), block);
  world.reduce_scatter(Exec(), data, own);
  expect_within(own, mine_ref, sum_bound, "in place");
}

TEST(MpiCommunicator, AllGatherEqualsSerial) {
  const kmamba::MpiCommunicator world(MPI_COMM_WORLD);
  const std::size_t block = 129, n = block * static_cast<std::size_t>(world.size());
  std::vector<double> ref;
  for (int r = 0; r < world.size(); ++r) {
    const auto data = rank_data<double>(r, block);
    ref.insert(ref.end(), data.data(), data.data() + block);
  }
  Vec<double> out("kmamba::test::out", n);
  world.all_gather(Exec(), rank_data<double>(world.rank(), block), out);
  expect_close(out, ref, n, 0.0, "out of place");

  Vec<double> in_place("kmamba::test::in_place", n);
  const Vec<double> own(in_place.data() + block * static_cast<std::size_t>(world.rank()), block);
  Kokkos::deep_copy(own, rank_data<double>(world.rank(), block));
  world.all_gather(Exec(), own, in_place);
  expect_close(in_place, ref, n, 0.0, "in place");
}

TEST(MpiCommunicator, BroadcastFromTheLastRank) {
  const kmamba::MpiCommunicator world(MPI_COMM_WORLD);
  const int root = world.size() - 1;
  const auto data = rank_data(world.rank(), 500);
  world.broadcast(Exec(), data, root);
  const auto ref = rank_data(root, 500);
  expect_close(data, ref.data(), 500, 0.0, "broadcast");
}

TEST(MpiCommunicator, SendRecvRingAndChain) {
  const kmamba::MpiCommunicator world(MPI_COMM_WORLD);
  const int rank = world.rank(), size = world.size();
  const std::size_t n = 64;
  // Ring: send to the next rank, receive from the previous one.
  Vec<float> received("kmamba::test::received", n);
  world.send_recv(Exec(), rank_data(rank, n), (rank + 1) % size, received, (rank + size - 1) % size);
  expect_close(received, rank_data((rank + size - 1) % size, n).data(), n, 0.0, "ring");

  // Chain (state passing): rank 0 receives nothing, the last rank sends nothing.
  Kokkos::deep_copy(received, -1.0f);
  world.send_recv(Exec(), rank_data(rank, n), rank + 1 < size ? rank + 1 : kmamba::no_peer, received,
                  rank > 0 ? rank - 1 : kmamba::no_peer);
  if (rank > 0) {
    expect_close(received, rank_data(rank - 1, n).data(), n, 0.0, "chain");
  } else {
    for (std::size_t i = 0; i < n; ++i) ASSERT_EQ(received(i), -1.0f) << "rank 0 received something";
  }

  // Plain send and recv between pairs (0 → 1, 2 → 3).
  if (rank % 2 == 0 && rank + 1 < size) {
    world.send(Exec(), rank_data(rank, n), rank + 1);
  } else if (rank % 2 == 1) {
    world.recv(Exec(), received, rank - 1);
    expect_close(received, rank_data(rank - 1, n).data(), n, 0.0, "send/recv");
  }
}

TEST(MpiCommunicator, SplitGivesAxisCommunicators) {
  const kmamba::MpiCommunicator world(MPI_COMM_WORLD);
  const auto parity = world.split(world.rank() % 2, world.rank(), "parity");
  EXPECT_EQ(parity->axis(), "parity");
  EXPECT_EQ(std::string(parity->transport()), "MPI");
  EXPECT_EQ(parity->rank(), world.rank() / 2);
  EXPECT_EQ(parity->size(), (world.size() + 1 - world.rank() % 2) / 2);
  // The sum of the world ranks of the group.
  int expected = 0;
  for (int r = world.rank() % 2; r < world.size(); r += 2) expected += r;
  EXPECT_EQ(parity->all_reduce_value(world.rank()), expected);
}

/// Runs `body`, expects a kmamba exception of type E whose message holds every piece of `parts`.
template <class E, class Body>
void expect_error(const Body& body, const std::vector<std::string>& parts) {
  try {
    body();
    ADD_FAILURE() << "no exception";
  } catch (const E& e) {
    for (const auto& part : parts) EXPECT_NE(std::string(e.what()).find(part), std::string::npos) << e.what();
  }
}

TEST(MpiCommunicator, ErrorsNameTheCollectiveAxisAndRank) {
  const kmamba::MpiCommunicator world(MPI_COMM_WORLD);
  const auto dp = world.split(0, world.rank(), "dp");
  const std::string where = "rank " + std::to_string(dp->rank()) + " of " + std::to_string(dp->size());
  Vec<float> a("kmamba::test::a", 10), b("kmamba::test::b", 11);
  expect_error<kmamba::UserError>([&] { dp->all_reduce(Exec(), a, b); },
                                  {"kmamba::Communicator::all_reduce", "axis 'dp'", "MPI", where, "11"});
  expect_error<kmamba::UserError>([&] { dp->reduce_scatter(Exec(), a, b); },
                                  {"kmamba::Communicator::reduce_scatter", "axis 'dp'", where});
  expect_error<kmamba::UserError>([&] { dp->all_gather(Exec(), b, a); }, {"all_gather", "axis 'dp'", where});
  expect_error<kmamba::UserError>([&] { dp->broadcast(Exec(), a, dp->size()); }, {"broadcast", "root", where});
  expect_error<kmamba::UserError>([&] { dp->send(Exec(), a, -2); }, {"Communicator::send ", "dest -2", where});
  Vec<std::int64_t> ints("kmamba::test::ints", 4);
  expect_error<kmamba::UserError>([&] { dp->all_reduce(Exec(), ints, kmamba::ReduceOp::Average); },
                                  {"all_reduce", "Average", "int64", where});

  if (world.size() < 2 || world.rank() > 1) return;
  // A message longer than the receive buffer: MPI's truncation error, as a VendorError.
  Vec<float> longer("kmamba::test::longer", 8), shorter("kmamba::test::shorter", 4);
  if (world.rank() == 0) {
    world.send(Exec(), longer, 1);
    world.send(Exec(), shorter, 1);
  } else {
    expect_error<kmamba::VendorError>([&] { world.recv(Exec(), shorter, 0); },
                                      {"kmamba::Communicator::recv", "axis 'world'", "rank 1 of", "MPI"});
    // A shorter message than expected is a UserError naming both counts.
    expect_error<kmamba::UserError>([&] { world.recv(Exec(), longer, 0); },
                                    {"kmamba::Communicator::recv", "received 4 elements from rank 0, expected 8"});
  }
}

// The audit wrapper forwards every operation (the results are the transport's) and counts it; with
// the log's timing on it also adds each operation's time, on the communicators split from it too.
TEST(CountingCommunicator, CountsAndTimesTheOperationsItForwards) {
  const auto log = std::make_shared<kmamba::CommunicationLog>();
  const kmamba::CountingCommunicator world(std::make_unique<kmamba::MpiCommunicator>(MPI_COMM_WORLD), log);
  check_all_reduce<float>(world, 1001);
  const kmamba::CommunicationLog::Tally untimed = log->tally("world", "all_reduce");
  EXPECT_GT(untimed.calls, 0);
  EXPECT_EQ(untimed.elements, untimed.calls * 1001);
  EXPECT_EQ(log->total_seconds(), 0.0);

  log->clear();
  log->set_timing(true);
  const auto half = world.split(world.rank() % 2, world.rank(), "dp");
  check_all_reduce<float>(*half, 1001);
  Vec<float> block = rank_data(world.rank(), 64), gathered("kmamba::test::gathered", 64 * world.size());
  world.all_gather(Exec(), block, gathered);
  for (int r = 0; r < world.size(); ++r) EXPECT_EQ(gathered(64 * r + 5), rank_data(r, 64)(5));
  const kmamba::CommunicationLog::Tally timed = log->tally("dp", "all_reduce");
  EXPECT_EQ(timed.calls, untimed.calls);
  EXPECT_GT(timed.seconds, 0.0);
  EXPECT_GT(log->tally("world", "all_gather").seconds, 0.0);
  EXPECT_EQ(log->tally("world", "all_gather").elements, 64 * world.size());
  EXPECT_DOUBLE_EQ(log->total_seconds(), timed.seconds + log->tally("world", "all_gather").seconds);
  EXPECT_EQ(log->tallies().size(), 2u);
}

}  // namespace
