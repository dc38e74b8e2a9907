// kmamba-bench: measures kmamba's kernels on every execution space of this build and checks
// their results. With no arguments it is the quick end-to-end check that a build works.
#include <kmamba/KMamba.hpp>

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

void print_help() {
  std::printf(
      "usage: kmamba-bench [--elements N] [--repeats R] [--space NAME]\n"
      "\n"
      "Runs kmamba's kernels on each execution space of this build (Cuda, OpenMP, Serial), checks\n"
      "their results against the host and prints time, bandwidth and the check.\n"
      "\n"
      "  --elements N   tensor size in elements (default 16777216)\n"
      "  --repeats R    timed repetitions; the median is reported (default 5)\n"
      "  --space NAME   only this execution space (Serial, OpenMP or Cuda)\n"
      "  -h, --help     this text\n"
      "\n"
      "Kokkos options (--kokkos-threads=N, ...) are accepted too.\n");
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name) -> std::string {
      if (i + 1 >= argc) throw kmamba::UserError(std::string("kmamba-bench: ") + name + " needs a value");
      return argv[++i];
    };
    if (a == "-h" || a == "--help") {
      print_help();
      std::exit(0);
    } else if (a == "--elements") {
      o.elements = std::stoll(value("--elements"));
      KMAMBA_REQUIRE(o.elements > 0, "kmamba-bench: --elements must be positive, got " << o.elements);
    } else if (a == "--repeats") {
      o.repeats = std::stoi(value("--repeats"));
      KMAMBA_REQUIRE(o.repeats > 0, "kmamba-bench: --repeats must be positive, got " << o.repeats);
    } else if (a == "--space") {
      o.only_space = value("--space");
    } else if (a.rfind("--kokkos-", 0) != 0) {
      throw kmamba::UserError("kmamba-bench: unknown argument '" + a + "' (see --help)");
    }
  }
  return o;
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

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      print_help();
      return 0;
    }
  }
  Kokkos::ScopeGuard kokkos(argc, argv);
  try {
    const Options o = parse(argc, argv);
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
    return ok ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
