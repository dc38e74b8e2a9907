// kmamba-perf-comm: times the collectives of kmamba::Communicator (all-reduce, reduce-scatter,
// all-gather, broadcast, send/recv) over a message-size sweep, under mpirun, on the communicators
// the apps use: a ProcessMesh over MPI_COMM_WORLD (all ranks on the dp axis) and its world
// communicator — MPI on host memory (--device host), NCCL on device memory with one GPU per rank
// (--device cuda; the GPU is the rank's node-local rank, kmamba::node_local_rank).
//
//   mpirun -np 4 kmamba-perf-comm [--device host|cuda] [--min-bytes B] [--max-bytes B] [--factor 2|4]
//                                 [--reps R] [--warmup W] [--collectives LIST] [--json FILE]
//
// Every size is the logical buffer M of docs/distributed.md §0 in bytes of float32, the "size" of the
// NCCL tests: the buffer of all-reduce and broadcast, the whole (size() · n) buffer of
// reduce-scatter and all-gather, the message each rank sends in the send/recv ring (rank r sends to
// r + 1 and receives from r − 1). Each repetition starts after a barrier and ends when the data are
// in place on the rank (a fence of the execution space instance); its time is the slowest rank's;
// the table shows the median of R repetitions after W warm-up calls. Bandwidths as the NCCL tests
// define them: algorithm bandwidth M / t, bus bandwidth = algorithm bandwidth × 2(n−1)/n (all-reduce),
// × (n−1)/n (reduce-scatter, all-gather), × 1 (broadcast, send/recv). Out-of-place operations on
// fresh uniform [0.5, 1.5) data (never zeros) per size.
#include <kmamba/KMamba.hpp>
#include <kmamba/core/Files.hpp>
#include <kmamba/parallel/Mpi.hpp>
#include <kmamba/parallel/ProcessMesh.hpp>

#include "AppRuntime.hpp"

#include <nlohmann/json.hpp>

#include <mpi.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

const std::vector<std::string>& all_collectives() {
  static const std::vector<std::string> names = {"all_reduce", "reduce_scatter", "all_gather", "broadcast",
                                                 "send_recv"};
  return names;
}

struct Options {
  std::string device = "host";
  std::size_t min_bytes = 1024;
  std::size_t max_bytes = std::size_t(1) << 30;
  int factor = 4;
  int reps = 20;
  int warmup = 5;
  std::vector<std::string> collectives = all_collectives();
  std::string json;
};

const char* const description =
    "Times kmamba::Communicator's collectives over a message-size sweep on N ranks (mpirun -np N) and prints,\n"
    "on rank 0, collective, bytes, median time (us), algorithm and bus bandwidth (GB/s, the NCCL tests'\n"
    "conventions). Byte counts accept K, M, G suffixes (powers of 1024).";

// A positive byte count: digits with an optional K, M or G suffix (powers of 1024); 0 if `text`
// is not one.
std::size_t parse_bytes(const std::string& text) {
  char* end = nullptr;
  errno = 0;
  const unsigned long long value = std::strtoull(text.c_str(), &end, 10);
  if (text.empty() || !std::isdigit(static_cast<unsigned char>(text[0])) || errno != 0 || value == 0) return 0;
  const std::string suffix(end);
  const int shift = suffix.empty()                   ? 0
                    : suffix == "K" || suffix == "k" ? 10
                    : suffix == "M" || suffix == "m" ? 20
                    : suffix == "G" || suffix == "g" ? 30
                                                     : -1;
  if (shift < 0 || value > (~0ull >> shift)) return 0;
  return static_cast<std::size_t>(value << shift);
}

CLI::Option* add_bytes_option(CLI::App& cli, const char* name, std::size_t& bytes, const char* help) {
  const CLI::Validator byte_count(
      [](std::string& text) -> std::string {
        return parse_bytes(text) > 0 ? std::string()
                                     : "got '" + text + "', expected a positive byte count (e.g. 1024, 64K, 1G)";
      },
      "");
  return cli
      .add_option_function<std::string>(
          name, [&bytes](const std::string& text) { bytes = parse_bytes(text); }, help)
      ->type_name("B")
      ->check(byte_count);
}

void declare(CLI::App& cli, Options& o) {
  cli.add_option("--device", o.device,
                 "host: MPI communicator, host memory (default); cuda: NCCL communicator, device memory, one GPU per "
                 "rank (the rank's node-local rank)")
      ->type_name("NAME")
      ->check(kmamba::app::one_of({"host", "cuda"}));
  add_bytes_option(cli, "--min-bytes", o.min_bytes, "smallest message (default 1024)");
  add_bytes_option(cli, "--max-bytes", o.max_bytes, "largest message (default 1073741824 = 1 GiB)");
  cli.add_option("--factor", o.factor, "size ratio between steps, 2 or 4 (default 4)")
      ->type_name("F")
      ->check(kmamba::app::one_of({"2", "4"}));
  kmamba::app::add_integer(cli, "--reps", o.reps, 1, 1000000,
                           "timed repetitions per size; the median is reported (default 20)", "R");
  kmamba::app::add_integer(cli, "--warmup", o.warmup, 0, 1000000, "untimed calls per size first (default 5)", "W");
  cli.add_option("--collectives", o.collectives,
                 "comma-separated subset of all_reduce,reduce_scatter,all_gather,broadcast,send_recv (default: all)")
      ->type_name("LIST")
      ->delimiter(',')
      ->check(kmamba::app::one_of(all_collectives()));
  cli.add_option("--json", o.json, "also write the results as JSON (rank 0)")->type_name("FILE");
}

void validate(const Options& o) {
  KMAMBA_REQUIRE(o.min_bytes <= o.max_bytes,
                 "kmamba-perf-comm: --min-bytes " << o.min_bytes << " exceeds --max-bytes " << o.max_bytes);
}

/// Bus bandwidth / algorithm bandwidth (the NCCL tests' factors).
double bus_factor(const std::string& collective, int n) {
  if (collective == "all_reduce") return 2.0 * (n - 1) / n;
  if (collective == "reduce_scatter" || collective == "all_gather") return static_cast<double>(n - 1) / n;
  return 1.0;
}

struct Result {
  std::string collective;
  std::size_t bytes = 0;
  double median_s = 0.0, min_s = 0.0, max_s = 0.0;
};

template <class Exec>
class Bench {
 public:
  using Mem = typename Exec::memory_space;
  using Buffer = Kokkos::View<float*, Mem>;

  Bench(const kmamba::Communicator& comm, const Options& o) : comm_(comm), o_(o) {}

  /// The median, minimum and maximum over the repetitions of the slowest rank's time.
  Result run(const std::string& collective, std::size_t bytes) {
    const int n = comm_.size(), r = comm_.rank();
    // Elements per block: the buffer is cut into n blocks for reduce-scatter and all-gather.
    const bool blocked = collective == "reduce_scatter" || collective == "all_gather";
    const std::size_t count = std::max<std::size_t>(1, bytes / sizeof(float) / (blocked ? n : 1));
    const std::size_t total = blocked ? count * static_cast<std::size_t>(n) : count;
    Buffer send(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kmamba::perf_comm::send"),
                collective == "all_gather" ? count : total);
    Buffer recv(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kmamba::perf_comm::recv"),
                collective == "reduce_scatter" ? count : total);
    const std::uint64_t seed = 0x5eed0000u + 7919u * static_cast<std::uint64_t>(r) + bytes;
    kmamba::fill_uniform(exec_, send, seed, 0.5f, 1.5f);
    kmamba::fill_uniform(exec_, recv, seed + 1, 0.5f, 1.5f);
    exec_.fence();
    const int next = (r + 1) % n, previous = (r + n - 1) % n;
    auto call = [&]() {
      if (collective == "all_reduce")
        comm_.all_reduce(exec_, send, recv, kmamba::ReduceOp::Sum);
      else if (collective == "reduce_scatter")
        comm_.reduce_scatter(exec_, send, recv, kmamba::ReduceOp::Sum);
      else if (collective == "all_gather")
        comm_.all_gather(exec_, send, recv);
      else if (collective == "broadcast")
        comm_.broadcast(exec_, send, 0);
      else
        comm_.send_recv(exec_, send, next, recv, previous);
    };
    for (int i = 0; i < o_.warmup; ++i) call();
    exec_.fence();
    std::vector<double> times;
    for (int i = 0; i < o_.reps; ++i) {
      comm_.barrier();
      const auto start = std::chrono::steady_clock::now();
      call();
      exec_.fence();
      const double local = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      times.push_back(comm_.all_reduce_value(local, kmamba::ReduceOp::Max));
    }
    std::sort(times.begin(), times.end());
    Result result;
    result.collective = collective;
    result.bytes = total * sizeof(float);
    result.median_s = times[times.size() / 2];
    result.min_s = times.front();
    result.max_s = times.back();
    return result;
  }

 private:
  const kmamba::Communicator& comm_;
  const Options& o_;
  Exec exec_;
};

template <class Exec>
int sweep(const Options& o, kmamba::Transport transport) {
  kmamba::MeshConfig config;  // every rank on the dp axis, as kmamba-train's default mesh
  int world_size = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &world_size);
  kmamba::ProcessMesh mesh(MPI_COMM_WORLD, config.resolve(world_size), transport);
  const kmamba::Communicator& comm = mesh.world();
  const bool root = comm.rank() == 0;
  const int n = comm.size();
  if (root) {
    std::printf("kmamba-perf-comm: %d ranks, %s transport, %s memory (%s), float32; median of %d after %d warm-up\n", n,
                comm.transport(), o.device == "cuda" ? "device" : "host", Exec::name(), o.reps, o.warmup);
    std::printf("%-15s %14s %12s %12s %12s %10s %10s\n", "collective", "bytes", "time_us", "min_us", "max_us",
                "algbw_GB/s", "busbw_GB/s");
  }
  Bench<Exec> bench(comm, o);
  std::vector<Result> results;
  for (const std::string& collective : o.collectives) {
    for (std::size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= static_cast<std::size_t>(o.factor)) {
      const Result r = bench.run(collective, bytes);
      results.push_back(r);
      const double algbw = static_cast<double>(r.bytes) / r.median_s * 1e-9;
      if (root) {
        std::printf("%-15s %14zu %12.1f %12.1f %12.1f %10.3f %10.3f\n", r.collective.c_str(), r.bytes, r.median_s * 1e6,
                    r.min_s * 1e6, r.max_s * 1e6, algbw, algbw * bus_factor(collective, n));
        std::fflush(stdout);
      }
    }
  }
  if (root && !o.json.empty()) {
    nlohmann::json points = nlohmann::json::array();
    for (const Result& r : results) {
      const double algbw = static_cast<double>(r.bytes) / r.median_s * 1e-9;
      points.push_back({{"collective", r.collective},
                        {"bytes", r.bytes},
                        {"time_us", r.median_s * 1e6},
                        {"min_us", r.min_s * 1e6},
                        {"max_us", r.max_s * 1e6},
                        {"algbw_GBps", algbw},
                        {"busbw_GBps", algbw * bus_factor(r.collective, n)}});
    }
    const nlohmann::json doc = {{"tool", "kmamba-perf-comm"},
                                {"ranks", n},
                                {"transport", comm.transport()},
                                {"device", o.device},
                                {"execution_space", Exec::name()},
                                {"dtype", "float32"},
                                {"reps", o.reps},
                                {"warmup", o.warmup},
                                {"results", points}};
    kmamba::write_output_file(o.json, doc.dump(1) + "\n", "kmamba-perf-comm: --json");
    std::printf("kmamba-perf-comm: wrote %s\n", o.json.c_str());
  }
  return 0;
}

// The sweep on the --device transport: MPI on the host, NCCL on CUDA.
int run(const Options& o, kmamba::app::Runtime& runtime) {
  runtime.errors_may_be_local();  // the other ranks may wait in a collective
  if (o.device == "host") return sweep<Kokkos::DefaultHostExecutionSpace>(o, kmamba::Transport::Mpi);
#if KMAMBA_ENABLE_NCCL
  return sweep<Kokkos::Cuda>(o, kmamba::Transport::Nccl);
#else
  KMAMBA_USER_ERROR("kmamba-perf-comm: --device cuda needs a CUDA build with NCCL (KMAMBA_ENABLE_NCCL)");
#endif
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  kmamba::app::Tool tool{"kmamba-perf-comm", description, [&](CLI::App& cli) { declare(cli, o); },
                         [&](const CLI::App&) { validate(o); }, [&](auto& runtime) { return run(o, runtime); }};
  tool.mpi = true;
  tool.keep_freed_host_memory = false;
  return kmamba::app::run_tool(argc, argv, tool);
}
