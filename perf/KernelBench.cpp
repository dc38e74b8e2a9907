// kmamba-perf: kernel benchmarks with roofline ratios.
//
//   kmamba-perf [--case NAME] [--space Cuda|OpenMP|Serial] [--small] [--repeats R]
//
// Each case states the bytes it must move and the operations it must do; the floor is the largest of
// bytes / bandwidth, FLOPs / FMA rate and transcendental count / SFU rate (H200 ceilings measured or
// from perf-anchors.md §6; on a host the ratio is printed against the same H200 floor only as a
// reference point). Inputs are fresh random data (never zeros); timings are medians of fenced runs.
#include <kmamba/KMamba.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

namespace {

// H200 ceilings: measured device copy bandwidth; fp32 FMA and SFU exp rates from perf-anchors.md §6.
constexpr double hbm_bytes_per_s = 4.3e12;
constexpr double fp32_flop_per_s = 60e12;
constexpr double exp_per_s = 3.9e12;

struct Options {
  std::string only_case, space;
  bool small = false;
  int repeats = 10;
};

struct Measurement {
  std::string name, shape;
  double seconds = 0, bytes = 0, flops = 0, exps = 0;
};

template <class Exec, class F>
double median_seconds(const Exec& exec, int repeats, const F& run) {
  run();
  exec.fence();
  std::vector<double> t;
  for (int r = 0; r < repeats; ++r) {
    const auto start = std::chrono::steady_clock::now();
    run();
    exec.fence();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

void report(const Measurement& m) {
  const double floor_s = std::max({m.bytes / hbm_bytes_per_s, m.flops / fp32_flop_per_s, m.exps / exp_per_s});
  std::printf("%-28s %-34s %10.3f ms %9.1f GB/s %9.1f GFLOP/s   floor %8.3f ms  x%.1f\n", m.name.c_str(),
              m.shape.c_str(), m.seconds * 1e3, m.bytes / m.seconds * 1e-9, m.flops / m.seconds * 1e-9, floor_s * 1e3,
              m.seconds / floor_s);
}

// Mamba-1 selective scan at perf-anchors §6.2's shape (batch 8, seqlen 4096, d_inner 1536, d_state 16),
// fp32 inputs, with D, z, delta_bias and softplus.
template <class Exec>
void bench_selective_scan(const Options& o) {
  using Mem = typename Exec::memory_space;
  const Exec exec;
  const int batch = o.small ? 1 : 8, dim = o.small ? 256 : 1536, seqlen = o.small ? 1024 : 4096, dstate = 16;
  const double elems = double(batch) * dim * seqlen;
  auto u = kmamba::allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::perf::u", batch, dim, seqlen);
  auto delta = kmamba::allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::perf::delta", batch, dim, seqlen);
  auto z = kmamba::allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::perf::z", batch, dim, seqlen);
  auto A = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::perf::A", dim, dstate);
  auto B = kmamba::allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::perf::B", batch, 1, dstate, seqlen);
  auto C = kmamba::allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::perf::C", batch, 1, dstate, seqlen);
  auto D = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::perf::D", dim);
  auto bias = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::perf::delta_bias", dim);
  kmamba::fill_normal(exec, u, 1, 0.0f, 1.0f);
  kmamba::fill_normal(exec, delta, 2, -1.0f, 0.5f);
  kmamba::fill_normal(exec, z, 3, 0.0f, 1.0f);
  kmamba::fill_uniform(exec, A, 4, -2.0f, -0.1f);
  kmamba::fill_normal(exec, B, 5, 0.0f, 1.0f);
  kmamba::fill_normal(exec, C, 6, 0.0f, 1.0f);
  kmamba::fill_normal(exec, D, 7, 1.0f, 0.1f);
  kmamba::fill_normal(exec, bias, 8, 0.0f, 0.1f);
  kmamba::SelectiveScanArgs<Mem> args;
  args.u = u;
  args.delta = delta;
  args.z = z;
  args.A = A;
  args.B = B;
  args.C = C;
  args.D = D;
  args.delta_bias = bias;
  args.delta_softplus = true;
  auto out = kmamba::allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::perf::out", batch, dim, seqlen);
  auto last = kmamba::allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::perf::last", batch, dim, dstate);
  char shape[96];
  std::snprintf(shape, sizeof shape, "b%d L%d D%d N%d (%s)", batch, seqlen, dim, dstate, Exec::name());

  Measurement fwd{"selective_scan fwd", shape};
  fwd.seconds = median_seconds(exec, o.repeats, [&] { kmamba::selective_scan_forward(exec, args, out, last); });
  fwd.bytes = 4.0 * (4 * elems + 2.0 * batch * dstate * seqlen);  // u, delta, z, out + B, C
  fwd.flops = 8.0 * elems * dstate;                                  // per state update: exp arg, decay, B·u, C·h
  fwd.exps = elems * dstate;
  report(fwd);

  kmamba::Tensor3<float, Mem> dout = kmamba::allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::perf::dout", batch, dim, seqlen);
  kmamba::fill_normal(exec, dout, 9, 0.0f, 1.0f);
  kmamba::SelectiveScanGrads<Mem> g;
  g.du = kmamba::allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::perf::du", batch, dim, seqlen);
  g.ddelta = kmamba::allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::perf::ddelta", batch, dim, seqlen);
  g.dz = kmamba::allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::perf::dz", batch, dim, seqlen);
  g.dA = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::perf::dA", dim, dstate);
  g.dB = kmamba::allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::perf::dB", batch, 1, dstate, seqlen);
  g.dC = kmamba::allocate_uninitialized<kmamba::Tensor4<float, Mem>>("kmamba::perf::dC", batch, 1, dstate, seqlen);
  g.dD = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::perf::dD", dim);
  g.ddelta_bias = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::perf::ddelta_bias", dim);
  Measurement bwd{"selective_scan bwd", shape};
  bwd.seconds = median_seconds(exec, o.repeats, [&] {
    kmamba::selective_scan_backward(exec, args, dout, kmamba::ConstTensor3<float, Mem>(), g);
  });
  bwd.bytes = 4.0 * (9 * elems + 4.0 * batch * dstate * seqlen);  // read u, delta, z, dout (+ recompute); write du, ddelta, dz
  bwd.flops = 20.0 * elems * dstate;
  bwd.exps = 2.0 * elems * dstate;                                   // recompute + backward
  report(bwd);
}

template <class Exec>
void run_space(const Options& o) {
  const std::vector<std::pair<std::string, std::function<void(const Options&)>>> cases = {
      {"selective_scan", bench_selective_scan<Exec>}};
  bool ran = false;
  for (const auto& c : cases) {
    if (!o.only_case.empty() && o.only_case != c.first) continue;
    c.second(o);
    ran = true;
  }
  KMAMBA_REQUIRE(ran, "kmamba-perf: unknown --case '" << o.only_case << "' (cases: selective_scan)");
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      std::printf("usage: kmamba-perf [--case selective_scan] [--space Cuda|OpenMP|Serial] [--small] [--repeats R]\n"
                  "  --small   shapes that run in seconds on a 2-core CPU (default: the H200 shapes of perf-anchors.md §6)\n");
      return 0;
    }
  }
  Kokkos::ScopeGuard kokkos(argc, argv);
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto value = [&]() -> std::string {
        KMAMBA_REQUIRE(i + 1 < argc, "kmamba-perf: " << a << " needs a value");
        return argv[++i];
      };
      if (a == "--case") o.only_case = value();
      else if (a == "--space") o.space = value();
      else if (a == "--small") o.small = true;
      else if (a == "--repeats") o.repeats = std::max(1, std::atoi(value().c_str()));
      else if (a.rfind("--kokkos-", 0) != 0) KMAMBA_USER_ERROR("kmamba-perf: unknown argument '" << a << "'");
    }
    kmamba::print_configuration(std::cout);
    std::printf("%-28s %-34s %13s %14s %17s   %s\n", "case", "shape", "median", "bandwidth", "arithmetic",
                "H200 floor and ratio");
    const std::string space = o.space.empty() ? Kokkos::DefaultExecutionSpace::name() : o.space;
    bool ran = false;
#if KMAMBA_ENABLE_CUDA
    if (space == "Cuda") run_space<Kokkos::Cuda>(o), ran = true;
#endif
#if KMAMBA_HAS_OPENMP
    if (space == "OpenMP") run_space<Kokkos::OpenMP>(o), ran = true;
#endif
#if KMAMBA_HAS_SERIAL
    if (space == "Serial") run_space<Kokkos::Serial>(o), ran = true;
#endif
    KMAMBA_REQUIRE(ran, "kmamba-perf: --space " << space << " is not an execution space of this build");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 2;
  }
}
