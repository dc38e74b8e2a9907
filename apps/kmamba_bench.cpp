// kmamba-bench: measures kmamba's kernels on every execution space of this build and checks
// their results. With no arguments it is the quick end-to-end check that a build works.
#include <kmamba/KMamba.hpp>

#include "AppRuntime.hpp"
#include "DeviceOption.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <string>
#include <vector>

namespace {

struct Options {
  long long elements = 1 << 24;
  int repeats = 5;
  std::string only_space;
};

void declare(CLI::App& cli, Options& o) {
  kmamba::app::add_integer(cli, "--elements", o.elements, 1, 1LL << 36, "tensor size in elements (default 16777216)");
  kmamba::app::add_integer(cli, "--repeats", o.repeats, 1, 1000000,
                           "timed repetitions; the median is reported (default 5)", "R");
  kmamba::app::add_space_option(cli, o.only_space, "only this execution space (default: every one of this build)");
}

template <class F>
double median_seconds(int repeats, const F& run) {
  run();  // warm-up
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    run();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

template <class Exec>
bool bench_space(const Options& o) {
  using Mem = typename Exec::memory_space;
  const Exec exec;
  const auto n = static_cast<std::size_t>(o.elements);
  auto x = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::bench::x", n);
  auto h = kmamba::allocate_uninitialized<kmamba::Tensor1<kmamba::bf16, Mem>>("kmamba::bench::h", n);
  const std::uint64_t seed = 20261202;

  const double t_fill = median_seconds(o.repeats, [&] {
    kmamba::fill_normal(exec, x, seed, 0.0f, 1.0f);
    exec.fence();
  });
  const double t_fill_bf16 = median_seconds(o.repeats, [&] {
    kmamba::fill_normal(exec, h, seed, 0.0f, 1.0f);
    exec.fence();
  });

  // Check a spread of elements against the host's own evaluation of the same stream.
  auto xh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), x);
  auto hh = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), h);
  std::size_t bad = 0;
  const std::size_t stride = n > 4096 ? n / 4096 : 1;
  // Host backends reproduce the host's values exactly; a GPU's log and cos may differ from the
  // host's libm by a few units in the last place.
  for (std::size_t i = 0; i < n; i += stride) {
    const float expected = kmamba::normal_at(seed, i);
    const bool value_ok = std::fabs(xh(i) - expected) <= 1e-6f * (std::fabs(expected) + 1.0f);
    if (!value_ok || hh(i).bits != kmamba::bf16(xh(i)).bits) ++bad;
  }
  std::printf("  %-7s fill_normal f32 : %9.3f ms  %8.1f GB/s   fill_normal bf16 : %9.3f ms  %8.1f GB/s   check: %s\n",
              Exec::name(), t_fill * 1e3, 4.0 * n / t_fill * 1e-9, t_fill_bf16 * 1e3, 2.0 * n / t_fill_bf16 * 1e-9,
              bad == 0 ? "ok" : "MISMATCH");
  return bad == 0;
}

int run(const Options& o) {
  kmamba::print_configuration(std::cout);
  std::printf("kmamba-bench: %lld elements, median of %d runs\n", o.elements, o.repeats);
  bool ok = true;
  bool ran = false;
  auto want = [&](const char* name) { return o.only_space.empty() || o.only_space == name; };
#if KMAMBA_ENABLE_CUDA
  if (want("Cuda")) ok = bench_space<Kokkos::Cuda>(o) && ok, ran = true;
#endif
#if KMAMBA_HAS_OPENMP
  if (want("OpenMP")) ok = bench_space<Kokkos::OpenMP>(o) && ok, ran = true;
#endif
#if KMAMBA_HAS_SERIAL
  if (want("Serial")) ok = bench_space<Kokkos::Serial>(o) && ok, ran = true;
#endif
  KMAMBA_REQUIRE(ran, "kmamba-bench: --space " << o.only_space << " is not an execution space of this build");
  std::printf(ok ? "kmamba-bench: all checks passed\n" : "kmamba-bench: CHECK FAILED\n");
  return ok ? kmamba::app::exit_done : kmamba::app::exit_failed;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App cli{
      "Runs kmamba's kernels on each execution space of this build (Cuda, OpenMP, Serial), checks\n"
      "their results against the host and prints time, bandwidth and the check. Exit status: 0 all\n"
      "checks passed, 1 a check failed, 2 a bad option.",
      "kmamba-bench"};
  kmamba::app::configure(cli);
  Options o;
  declare(cli, o);
  return kmamba::app::run_app(argc, argv, cli, {}, [&](kmamba::app::Runtime&) { return run(o); });
}
