// The communicators: every collective and point-to-point call, for every element type and
// reduction, on random data equals the serial computation over all ranks' data (which each rank
// regenerates: rank r's data are the counter-based normal stream's elements [r·n, (r+1)·n), times
// 1000 and rounded for the integer types), in and out of place; work issued on an execution space
// instance is ordered with that instance's other work; errors name the collective, the axis and the
// rank. One body per test, instantiated per transport set-up:
//
// - this file as it is (kmamba_communicator_tests, ctest communicator.np1/np2/np4, label mpi): the
//   MPI transport on host memory, on the default instance of each host execution space;
// - compiled with KMAMBA_TEST_NCCL (kmamba_nccl_communicator_tests, ctest nccl_communicator.np1,
//   labels mpi and cuda; one GPU per rank): the NCCL transport on device memory, on the default
//   Kokkos::Cuda instance (in Kokkos 3 its stream is the legacy default stream) and on an instance
//   over a non-blocking stream of the test's own (which does not synchronise with the legacy
//   stream, so NCCL work enqueued on any other stream would be unordered with it), and on host
//   memory (the NCCL communicator's MPI path).
//
// Sums over ranks are compared element by element within the bound of a sum's two evaluation
// orders, 2·γ(P−1)·Σ_r|x_r| (support/RoundingBounds.hpp, 1): a transport may add the P ranks' values
// in any order. An average (the sum times 1/P) gets three more roundings of its value, 3u·|avg|;
// NCCL's average of floating types scales each rank's value by the rounded 1/P before summing (two
// roundings per term, (2u + u²)·|x_r|/P, and the sum's bound grows by that relative 2u + u²), which
// 3u·Σ_r|x_r|/P more covers. Integer sums, maxima, minima, gathers, broadcasts and messages are
// exact.
#include "Backends.hpp"
#include "RoundingBounds.hpp"

#include <kmamba/core/Core.hpp>
#include <kmamba/parallel/CountingCommunicator.hpp>
#include <kmamba/parallel/GradientBuckets.hpp>
#include <kmamba/parallel/MpiCommunicator.hpp>
#if KMAMBA_TEST_NCCL
#include <kmamba/backends/VendorChecks.hpp>
#include <kmamba/parallel/NcclCommunicator.hpp>
#endif

#include <Kokkos_Core.hpp>
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using HostExec = Kokkos::DefaultHostExecutionSpace;
template <class T>
using HostVec = Kokkos::View<T*, Kokkos::HostSpace>;

constexpr std::uint64_t seed = 77;

/// Rank `rank`'s n values.
template <class T>
HostVec<T> rank_data(int rank, std::size_t n) {
  HostVec<float> values("kmamba::test::rank_data", n);
  kmamba::fill_normal(HostExec(), values, seed, 0.0f, 1.0f, static_cast<std::uint64_t>(rank) * n);
  HostExec().fence();
  HostVec<T> out("kmamba::test::rank_data", n);
  for (std::size_t i = 0; i < n; ++i) {
    out(i) =
        std::is_floating_point<T>::value ? static_cast<T>(values(i)) : static_cast<T>(std::lround(1000.0 * values(i)));
  }
  return out;
}

/// |got[i] − ref[i]| ≤ bound[i] for every element (bound 0: equal).
template <class T>
void expect_within(const std::vector<T>& got, const std::vector<T>& ref, const std::vector<double>& bound,
                   const std::string& what) {
  ASSERT_EQ(got.size(), ref.size()) << what;
  std::size_t worst = 0;
  double worst_ratio = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    const double diff = std::abs(static_cast<double>(got[i]) - static_cast<double>(ref[i]));
    const double ratio = diff == 0.0 ? 0.0 : diff / bound[i];
    if (!(ratio <= worst_ratio)) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  EXPECT_LE(worst_ratio, 1.0) << what << ": element " << worst << " " << got[worst] << " vs " << ref[worst]
                              << ", bound " << bound[worst];
}

template <class T>
void expect_equal(const std::vector<T>& got, const std::vector<T>& ref, const std::string& what) {
  expect_within(got, ref, std::vector<double>(ref.size(), 0.0), what);
}

/// The serial reductions over all ranks' data, and the bounds of the file comment.
template <class T>
struct Reference {
  std::vector<T> sum, average, max, min;
  std::vector<double> sum_bound, average_bound;

  Reference(int ranks, std::size_t n, bool premultiplied_average)
      : sum(n, T(0)), max(n), min(n), sum_bound(n), average_bound(n) {
    std::vector<double> abs_sum(n, 0.0);
    for (int r = 0; r < ranks; ++r) {
      const auto data = rank_data<T>(r, n);
      for (std::size_t i = 0; i < n; ++i) {
        sum[i] += data(i);
        abs_sum[i] += std::abs(static_cast<double>(data(i)));
        max[i] = r == 0 ? data(i) : std::max(max[i], data(i));
        min[i] = r == 0 ? data(i) : std::min(min[i], data(i));
      }
    }
    average = sum;
    for (auto& x : average) x /= static_cast<T>(ranks);
    const double u = kmamba::test::unit_roundoff<T>();
    for (std::size_t i = 0; i < n; ++i) {
      sum_bound[i] = kmamba::test::sum_order_bound<T>(ranks) * abs_sum[i];
      average_bound[i] = sum_bound[i] / ranks + 3 * u * std::abs(static_cast<double>(average[i])) +
                         (premultiplied_average ? 3 * u * abs_sum[i] / ranks : 0.0);
    }
  }

  /// Elements [first, first + n) of a reduction or bound.
  template <class V>
  static V block(const V& all, std::size_t first, std::size_t n) {
    return V(all.begin() + static_cast<std::ptrdiff_t>(first), all.begin() + static_cast<std::ptrdiff_t>(first + n));
  }
};

/// x[i] = rank + 1 + i (exact in every type).
template <class View>
struct FillRankPlusIndex {
  View x;
  int rank;
  KOKKOS_INLINE_FUNCTION void operator()(const std::size_t i) const {
    x(i) = static_cast<typename View::value_type>(rank + 1) + static_cast<typename View::value_type>(i);
  }
};

/// send[i] = −1 and recv[i] *= 2: what a collective still reading send or writing recv would see.
template <class View>
struct OverwriteAfter {
  View send, recv;
  KOKKOS_INLINE_FUNCTION void operator()(const std::size_t i) const {
    send(i) = -1;
    recv(i) *= 2;
  }
};

// ---------------------------------------------------------------------------------------------
// The transport set-ups: Exec and Mem, the world communicator and the instance the calls go on.

/// A set-up on the default instance of `ExecSpace`: a world communicator of type `Comm`, views in
/// `MemSpace`; `Premultiplied`: the transport scales each value by 1/P before an average's sum.
template <class Comm, class ExecSpace, class MemSpace, bool Premultiplied>
struct DefaultInstanceSetup {
  using Exec = ExecSpace;
  using Mem = MemSpace;
  static constexpr bool premultiplied_average = Premultiplied;
  std::unique_ptr<kmamba::Communicator> world() const { return std::make_unique<Comm>(MPI_COMM_WORLD); }
  Exec instance() const { return Exec(); }
};

/// The MPI transport on host memory, on the default instance of `ExecSpace`.
template <class ExecSpace>
struct MpiOn : DefaultInstanceSetup<kmamba::MpiCommunicator, ExecSpace, Kokkos::HostSpace, false> {
  static std::string name() { return std::string("Mpi") + ExecSpace::name(); }
};

#if KMAMBA_TEST_NCCL
/// NCCL on device memory, on the default Kokkos::Cuda instance.
struct NcclDefaultInstance : DefaultInstanceSetup<kmamba::NcclCommunicator, Kokkos::Cuda, Kokkos::CudaSpace, true> {
  static std::string name() { return "NcclDefaultInstance"; }
};

/// NCCL on device memory, on an instance over a non-blocking stream that the set-up owns.
class NcclOwnInstance {
 public:
  using Exec = Kokkos::Cuda;
  using Mem = Kokkos::CudaSpace;
  static constexpr bool premultiplied_average = true;
  static std::string name() { return "NcclOwnInstance"; }
  NcclOwnInstance() {
    KMAMBA_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    instance_ = Kokkos::Cuda(stream_);
  }
  ~NcclOwnInstance() {
    instance_.fence();
    instance_ = Kokkos::Cuda();  // drop the instance before its stream
    cudaStreamDestroy(stream_);
  }
  NcclOwnInstance(const NcclOwnInstance&) = delete;
  NcclOwnInstance& operator=(const NcclOwnInstance&) = delete;
  std::unique_ptr<kmamba::Communicator> world() const {
    return std::make_unique<kmamba::NcclCommunicator>(MPI_COMM_WORLD);
  }
  Exec instance() const { return instance_; }

 private:
  cudaStream_t stream_ = nullptr;
  Kokkos::Cuda instance_;
};

/// The NCCL communicator on host memory (its MPI path), on the default host instance.
struct NcclHostMemory : DefaultInstanceSetup<kmamba::NcclCommunicator, HostExec, Kokkos::HostSpace, false> {
  static std::string name() { return "NcclHostMemory"; }
};

using Configs = ::testing::Types<NcclDefaultInstance, NcclOwnInstance, NcclHostMemory>;
#elif KMAMBA_HAS_SERIAL && KMAMBA_HAS_OPENMP
using Configs = ::testing::Types<MpiOn<Kokkos::OpenMP>, MpiOn<Kokkos::Serial>>;
#else
using Configs = ::testing::Types<MpiOn<HostExec>>;
#endif

/// The set-up, its world communicator and its instance, and the checks run on them. (The checks
/// are public members: CUDA kernels may not be launched from private or protected ones.)
template <class Config>
class Collectives : public ::testing::Test {
 public:
  using Exec = typename Config::Exec;
  template <class T>
  using Vec = Kokkos::View<T*, typename Config::Mem>;

  Config config;
  std::unique_ptr<kmamba::Communicator> world = config.world();
  Exec exec = config.instance();

  /// `host` in a new view of the set-up's memory, copied on exec (no fence).
  template <class T>
  Vec<T> upload(const HostVec<T>& host) const {
    Vec<T> out("kmamba::test::upload", host.size());
    Kokkos::deep_copy(exec, out, host);
    return out;
  }
  /// Rank `rank`'s n values, uploaded.
  template <class T>
  Vec<T> data(int rank, std::size_t n) const {
    return upload(rank_data<T>(rank, n));
  }
  /// The values of `view` once the work on exec so far is done.
  template <class View>
  std::vector<typename View::non_const_value_type> values(const View& view) const {
    using T = typename View::non_const_value_type;
    HostVec<T> host("kmamba::test::download", view.size());
    Kokkos::deep_copy(exec, host, view);
    exec.fence();
    return std::vector<T>(host.data(), host.data() + host.size());
  }
  template <class T>
  using Unmanaged = Kokkos::View<T*, typename Config::Mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  /// Elements [first, first + n) of `view`.
  template <class T>
  Unmanaged<T> block(const Vec<T>& view, std::size_t first, std::size_t n) const {
    return Unmanaged<T>(view.data() + first, n);
  }

  template <class T>
  void check_all_reduce(std::size_t n) {
    SCOPED_TRACE(kmamba::data_type_name(kmamba::impl::DataTypeOf<T>::value));
    const kmamba::Communicator& comm = *world;
    const Reference<T> ref(comm.size(), n, Config::premultiplied_average);
    const Vec<T> mine = data<T>(comm.rank(), n);
    const Vec<T> out("kmamba::test::out", n);
    comm.all_reduce(exec, mine, out, kmamba::ReduceOp::Sum);
    expect_within(values(out), ref.sum, ref.sum_bound, "sum");
    if (std::is_floating_point<T>::value) {
      comm.all_reduce(exec, mine, out, kmamba::ReduceOp::Average);
      expect_within(values(out), ref.average, ref.average_bound, "average");
    }
    comm.all_reduce(exec, mine, out, kmamba::ReduceOp::Max);
    expect_equal(values(out), ref.max, "max");
    comm.all_reduce(exec, mine, out, kmamba::ReduceOp::Min);
    expect_equal(values(out), ref.min, "min");
    comm.all_reduce(exec, mine);  // in place
    expect_within(values(mine), ref.sum, ref.sum_bound, "sum in place");
  }

  template <class T>
  void check_all_reduce_value() {
    SCOPED_TRACE(kmamba::data_type_name(kmamba::impl::DataTypeOf<T>::value));
    const kmamba::Communicator& comm = *world;
    const int size = comm.size();
    EXPECT_EQ(comm.all_reduce_value(static_cast<T>(comm.rank() + 1)), static_cast<T>(size * (size + 1) / 2));
    EXPECT_EQ(comm.all_reduce_value(static_cast<T>(comm.rank()), kmamba::ReduceOp::Max), static_cast<T>(size - 1));
    EXPECT_EQ(comm.all_reduce_value(static_cast<T>(comm.rank() + 5), kmamba::ReduceOp::Min), static_cast<T>(5));
    if (std::is_floating_point<T>::value) {  // (size − 1)/2 is exact in binary
      EXPECT_EQ(comm.all_reduce_value(static_cast<T>(comm.rank()), kmamba::ReduceOp::Average),
                static_cast<T>((size - 1) / 2.0));
    }
  }

  template <class T>
  void check_reduce_scatter(std::size_t block_size) {
    SCOPED_TRACE(kmamba::data_type_name(kmamba::impl::DataTypeOf<T>::value));
    const kmamba::Communicator& comm = *world;
    const std::size_t n = block_size * static_cast<std::size_t>(comm.size()),
                      first = block_size * static_cast<std::size_t>(comm.rank());
    const Reference<T> all(comm.size(), n, Config::premultiplied_average);
    auto mine = [&](const auto& v) { return Reference<T>::block(v, first, block_size); };
    const Vec<T> send = data<T>(comm.rank(), n);
    const Vec<T> out("kmamba::test::out", block_size);
    comm.reduce_scatter(exec, send, out);
    expect_within(values(out), mine(all.sum), mine(all.sum_bound), "sum");
    if (std::is_floating_point<T>::value) {
      comm.reduce_scatter(exec, send, out, kmamba::ReduceOp::Average);
      expect_within(values(out), mine(all.average), mine(all.average_bound), "average");
    }
    comm.reduce_scatter(exec, send, out, kmamba::ReduceOp::Max);
    expect_equal(values(out), mine(all.max), "max");
    comm.reduce_scatter(exec, send, out, kmamba::ReduceOp::Min);
    expect_equal(values(out), mine(all.min), "min");
    // In place: the result lands in this rank's block of the send buffer.
    const auto own = block(send, first, block_size);
    comm.reduce_scatter(exec, send, own);
    expect_within(values(own), mine(all.sum), mine(all.sum_bound), "sum in place");
  }

  template <class T>
  void check_all_gather(std::size_t block_size) {
    SCOPED_TRACE(kmamba::data_type_name(kmamba::impl::DataTypeOf<T>::value));
    const kmamba::Communicator& comm = *world;
    const std::size_t n = block_size * static_cast<std::size_t>(comm.size()),
                      first = block_size * static_cast<std::size_t>(comm.rank());
    std::vector<T> ref;
    for (int r = 0; r < comm.size(); ++r) {
      const auto block_r = rank_data<T>(r, block_size);
      ref.insert(ref.end(), block_r.data(), block_r.data() + block_size);
    }
    // Named, so that no view is freed while a collective on exec may still read it.
    const Vec<T> mine = data<T>(comm.rank(), block_size), out("kmamba::test::out", n);
    comm.all_gather(exec, mine, out);
    expect_equal(values(out), ref, "out of place");

    const Vec<T> in_place("kmamba::test::in_place", n);
    const auto own = block(in_place, first, block_size);
    Kokkos::deep_copy(exec, own, rank_data<T>(comm.rank(), block_size));
    comm.all_gather(exec, own, in_place);
    expect_equal(values(in_place), ref, "in place");
  }

  template <class T>
  void check_broadcast(std::size_t n) {
    SCOPED_TRACE(kmamba::data_type_name(kmamba::impl::DataTypeOf<T>::value));
    const kmamba::Communicator& comm = *world;
    for (int root = 0; root < comm.size(); ++root) {
      const Vec<T> x = data<T>(comm.rank(), n);
      comm.broadcast(exec, x, root);
      const auto ref = rank_data<T>(root, n);
      expect_equal(values(x), std::vector<T>(ref.data(), ref.data() + n), "root " + std::to_string(root));
    }
  }

  template <class T>
  void check_send_recv(std::size_t n) {
    SCOPED_TRACE(kmamba::data_type_name(kmamba::impl::DataTypeOf<T>::value));
    const kmamba::Communicator& comm = *world;
    const int rank = comm.rank(), size = comm.size();
    auto expected = [&](int r) {
      const auto d = rank_data<T>(r, n);
      return std::vector<T>(d.data(), d.data() + n);
    };
    // Ring: send to the next rank, receive from the previous one (at one rank: itself).
    const Vec<T> mine = data<T>(rank, n), received("kmamba::test::received", n);
    comm.send_recv(exec, mine, (rank + 1) % size, received, (rank + size - 1) % size);
    expect_equal(values(received), expected((rank + size - 1) % size), "ring");

    // Chain (state passing): rank 0 receives nothing, the last rank sends nothing.
    Kokkos::deep_copy(exec, received, T(-1));
    comm.send_recv(exec, mine, rank + 1 < size ? rank + 1 : kmamba::no_peer, received,
                   rank > 0 ? rank - 1 : kmamba::no_peer);
    expect_equal(values(received), rank > 0 ? expected(rank - 1) : std::vector<T>(n, T(-1)), "chain");

    // Plain send and recv between pairs (0 → 1, 2 → 3).
    if (rank % 2 == 0 && rank + 1 < size) {
      comm.send(exec, mine, rank + 1);
      exec.fence();  // before mine is freed
    } else if (rank % 2 == 1) {
      comm.recv(exec, received, rank - 1);
      expect_equal(values(received), expected(rank - 1), "send/recv");
    }
  }

  /// Kernels and collectives queued on exec without a fence between them: each collective reads
  /// what the kernel before it wrote and is done before the kernel after it runs.
  void check_ordering(std::size_t n) {
    const kmamba::Communicator& comm = *world;
    const Vec<double> send("kmamba::test::send", n), recv("kmamba::test::recv", n),
        gathered("kmamba::test::gathered", n * static_cast<std::size_t>(comm.size()));
    const Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::size_t>> range(exec, 0, n);
    Kokkos::parallel_for("kmamba::test::fill", range, FillRankPlusIndex<Vec<double>>{send, comm.rank()});
    comm.all_reduce(exec, send, recv);
    Kokkos::parallel_for("kmamba::test::overwrite", range, OverwriteAfter<Vec<double>>{send, recv});
    comm.all_gather(exec, recv, gathered);
    const double size = comm.size(), rank_sum = size * (size + 1) / 2;
    std::vector<double> ref;
    for (int r = 0; r < comm.size(); ++r) {
      for (std::size_t i = 0; i < n; ++i) ref.push_back(2 * (rank_sum + size * static_cast<double>(i)));
    }
    expect_equal(values(gathered), ref, "all_reduce, kernel, all_gather");
    expect_equal(values(send), std::vector<double>(n, -1.0), "send after the kernel");
  }
};

TYPED_TEST_SUITE(Collectives, Configs, kmamba::test::BackendNames);

/// check(T{}, size) for each element type the communicators carry: float, double, int32, int64,
/// with the sizes given in that order.
template <class Check>
void for_each_type(const Check& check, const std::array<int, 4>& sizes) {
  check(float{}, sizes[0]);
  check(double{}, sizes[1]);
  check(std::int32_t{}, sizes[2]);
  check(std::int64_t{}, sizes[3]);
}

TYPED_TEST(Collectives, AllReduceEqualsSerial) {
  for_each_type([&](auto zero, int n) { this->template check_all_reduce<decltype(zero)>(n); }, {1001, 257, 300, 129});
}

TYPED_TEST(Collectives, AllReduceValueEqualsSerial) {
  for_each_type([&](auto zero, int) { this->template check_all_reduce_value<decltype(zero)>(); }, {0, 0, 0, 0});
}

TYPED_TEST(Collectives, ReduceScatterEqualsSerial) {
  for_each_type([&](auto zero, int n) { this->template check_reduce_scatter<decltype(zero)>(n); }, {333, 65, 77, 31});
}

TYPED_TEST(Collectives, AllGatherEqualsSerial) {
  for_each_type([&](auto zero, int n) { this->template check_all_gather<decltype(zero)>(n); }, {100, 129, 57, 33});
}

TYPED_TEST(Collectives, BroadcastFromEveryRoot) {
  for_each_type([&](auto zero, int n) { this->template check_broadcast<decltype(zero)>(n); }, {500, 100, 70, 40});
}

TYPED_TEST(Collectives, SendRecvRingAndChain) {
  for_each_type([&](auto zero, int n) { this->template check_send_recv<decltype(zero)>(n); }, {64, 33, 17, 9});
}

TYPED_TEST(Collectives, OrderedWithTheInstancesOtherWork) { this->check_ordering(1 << 16); }

TYPED_TEST(Collectives, SplitGivesAxisCommunicators) {
  const kmamba::Communicator& world = *this->world;
  const auto parity = world.split(world.rank() % 2, world.rank(), "parity");
  EXPECT_EQ(parity->axis(), "parity");
  EXPECT_EQ(std::string(parity->transport()), std::string(world.transport()));
  EXPECT_EQ(parity->rank(), world.rank() / 2);
  EXPECT_EQ(parity->size(), (world.size() + 1 - world.rank() % 2) / 2);
  // The sum of the world ranks of the group, on the host and through the set-up's memory.
  int expected = 0;
  for (int r = world.rank() % 2; r < world.size(); r += 2) expected += r;
  EXPECT_EQ(parity->all_reduce_value(world.rank()), expected);
  const auto x = this->upload(HostVec<std::int32_t>("kmamba::test::x", 3));
  Kokkos::deep_copy(this->exec, x, world.rank());
  parity->all_reduce(this->exec, x);
  EXPECT_EQ(this->values(x), std::vector<std::int32_t>(3, expected));
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

TYPED_TEST(Collectives, ErrorsNameTheCollectiveAxisAndRank) {
  using Exec = typename TestFixture::Exec;
  const auto dp = this->world->split(0, this->world->rank(), "dp");
  const Exec exec = this->exec;
  const std::string where = "rank " + std::to_string(dp->rank()) + " of " + std::to_string(dp->size());
  const std::string transport = this->world->transport();
  const typename TestFixture::template Vec<float> a("kmamba::test::a", 10), b("kmamba::test::b", 11);
  expect_error<kmamba::UserError>([&] { dp->all_reduce(exec, a, b); },
                                  {"kmamba::Communicator::all_reduce", "axis 'dp'", transport, where, "11"});
  expect_error<kmamba::UserError>([&] { dp->reduce_scatter(exec, a, b); },
                                  {"kmamba::Communicator::reduce_scatter", "axis 'dp'", where});
  expect_error<kmamba::UserError>([&] { dp->all_gather(exec, b, a); }, {"all_gather", "axis 'dp'", where});
  expect_error<kmamba::UserError>([&] { dp->broadcast(exec, a, dp->size()); }, {"broadcast", "root", where});
  expect_error<kmamba::UserError>([&] { dp->send(exec, a, -2); }, {"Communicator::send ", "dest -2", where});
  const typename TestFixture::template Vec<std::int64_t> ints("kmamba::test::ints", 4);
  expect_error<kmamba::UserError>([&] { dp->all_reduce(exec, ints, kmamba::ReduceOp::Average); },
                                  {"all_reduce", "Average", "int64", where});
}

#if KMAMBA_TEST_NCCL
// Device memory needs a Kokkos::Cuda instance (whose stream orders the NCCL work): with a host
// instance the call is refused, naming the fix, before any communication.
TEST(NcclCommunicator, DeviceViewsWithAHostInstanceAreAnError) {
  const kmamba::NcclCommunicator world(MPI_COMM_WORLD);
  const Kokkos::View<float*, Kokkos::CudaSpace> x("kmamba::test::x", 8);
  expect_error<kmamba::UserError>(
      [&] { world.all_reduce(HostExec(), x); },
      {"kmamba::Communicator::all_reduce", "axis 'world'", "NCCL", "device memory", "not a Kokkos::Cuda instance"});
}

// Work on the compute stream standing in for a backward: the values [begin, end) rewritten as they are.
void rewrite_on_device(const Kokkos::Cuda& exec, const Kokkos::View<float*, Kokkos::CudaSpace>& x, std::size_t begin,
                       std::size_t end) {
  Kokkos::parallel_for(
      "kmamba::test::rewrite", Kokkos::RangePolicy<Kokkos::Cuda>(exec, begin, end),
      KOKKOS_LAMBDA(const std::size_t i) { x(i) = 0.5f * (2.0f * x(i)); });
}

// The reducer's timeline records one interval per bucket and one for the tail's reduction, in the
// order they ran on the communication stream, and the moment the compute stream joined it; the
// recorded reductions still sum (over one rank: leave the values as they are).
TEST(NcclCommunicator, GradientReducerTimelineRecordsEveryReduction) {
  const kmamba::NcclCommunicator world(MPI_COMM_WORLD);
  const Kokkos::Cuda exec;
  const std::size_t buckets = 3, bucket = 1 << 18, n = buckets * bucket * world.size() + 1;
  const Kokkos::View<float*, Kokkos::CudaSpace> grads("kmamba::test::grads", n);
  kmamba::fill_normal(exec, grads, seed, 0.0f, 1.0f);
  const auto expected = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), grads);
  kmamba::GradientReducer<Kokkos::Cuda> reducer(world, n, bucket * world.size());
  reducer.record_timeline(true);
  using Reduction = kmamba::GradientReducer<Kokkos::Cuda>::Reduction;
  reducer.begin(grads, Reduction::AllReduce);
  for (std::size_t b = 0; b < buckets; ++b) {
    const std::size_t begin = b * bucket * world.size(), end = begin + bucket * world.size();
    rewrite_on_device(exec, grads, begin, end);
    reducer.ready(exec, begin, end);
  }
  reducer.finish(exec, grads, Reduction::AllReduce);
  exec.fence();
  const kmamba::CommunicationTimeline t = reducer.timeline();
  // One interval per bucket of the layout (on one rank the last element is a bucket of its own, on
  // several it is the tail), then the tail's, which finish() opens even when the tail is empty.
  ASSERT_EQ(t.collectives.size(), reducer.layout().buckets().size() + 1);
  ASSERT_EQ(reducer.layout().buckets().size(), world.size() == 1 ? buckets + 1 : buckets);
  ASSERT_EQ(t.joins.size(), 1u);
  EXPECT_EQ(t.collectives.front().first, 0.0);
  for (std::size_t i = 0; i < t.collectives.size(); ++i) {
    EXPECT_LE(t.collectives[i].first, t.collectives[i].second) << "reduction " << i;
    if (i > 0) EXPECT_LE(t.collectives[i - 1].second, t.collectives[i].first) << "reduction " << i;
  }
  EXPECT_GE(t.busy(), 0.0);
  EXPECT_LE(t.busy_before(t.joins[0]), t.busy());
  EXPECT_GE(t.exposed_after(t.joins[0]), 0.0);
  const auto got = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), grads);
  for (std::size_t i = 0; i < n; ++i) {
    ASSERT_NEAR(got(i), world.size() * expected(i), 2e-6f * world.size() * std::fabs(expected(i))) << "element " << i;
  }
}
#else
using Vec = HostVec<float>;

// MPI's own errors, as VendorError or UserError naming the counts.
TEST(MpiCommunicator, MessageLengthErrors) {
  const kmamba::MpiCommunicator world(MPI_COMM_WORLD);
  if (world.size() < 2 || world.rank() > 1) return;
  // A message longer than the receive buffer: MPI's truncation error, as a VendorError.
  Vec longer("kmamba::test::longer", 8), shorter("kmamba::test::shorter", 4);
  if (world.rank() == 0) {
    world.send(HostExec(), longer, 1);
    world.send(HostExec(), shorter, 1);
  } else {
    expect_error<kmamba::VendorError>([&] { world.recv(HostExec(), shorter, 0); },
                                      {"kmamba::Communicator::recv", "axis 'world'", "rank 1 of", "MPI"});
    // A shorter message than expected is a UserError naming both counts.
    expect_error<kmamba::UserError>([&] { world.recv(HostExec(), longer, 0); },
                                    {"kmamba::Communicator::recv", "received 4 elements from rank 0, expected 8"});
  }
}

/// Sums of 1001 values over the ranks of `comm`, checked.
void check_sum(const kmamba::Communicator& comm) {
  const Reference<float> ref(comm.size(), 1001, false);
  const Vec mine = rank_data<float>(comm.rank(), 1001), out("kmamba::test::out", 1001);
  comm.all_reduce(HostExec(), mine, out);
  expect_within(std::vector<float>(out.data(), out.data() + 1001), ref.sum, ref.sum_bound, "sum");
}

// The audit wrapper forwards every operation (the results are the transport's) and counts it; with
// the log's timing on it also adds each operation's time, on the communicators split from it too.
TEST(CountingCommunicator, CountsAndTimesTheOperationsItForwards) {
  const auto log = std::make_shared<kmamba::CommunicationLog>();
  const kmamba::CountingCommunicator world(std::make_unique<kmamba::MpiCommunicator>(MPI_COMM_WORLD), log);
  check_sum(world);
  const kmamba::CommunicationLog::Tally untimed = log->tally("world", "all_reduce");
  EXPECT_EQ(untimed.calls, 1);
  EXPECT_EQ(untimed.elements, 1001);
  EXPECT_EQ(log->total_seconds(), 0.0);

  log->clear();
  log->set_timing(true);
  const auto half = world.split(world.rank() % 2, world.rank(), "dp");
  check_sum(*half);
  Vec block = rank_data<float>(world.rank(), 64), gathered("kmamba::test::gathered", 64 * world.size());
  world.all_gather(HostExec(), block, gathered);
  for (int r = 0; r < world.size(); ++r) EXPECT_EQ(gathered(64 * r + 5), rank_data<float>(r, 64)(5));
  const kmamba::CommunicationLog::Tally timed = log->tally("dp", "all_reduce");
  EXPECT_EQ(timed.calls, untimed.calls);
  EXPECT_GT(timed.seconds, 0.0);
  EXPECT_GT(log->tally("world", "all_gather").seconds, 0.0);
  EXPECT_EQ(log->tally("world", "all_gather").elements, 64 * world.size());
  EXPECT_DOUBLE_EQ(log->total_seconds(), timed.seconds + log->tally("world", "all_gather").seconds);
  EXPECT_EQ(log->tallies().size(), 2u);
}
#endif

}  // namespace
