// kmamba-bench: a short benchmark of this build's kernels on one execution space (the default, or
// --space): selective scan, SSD, Mamba-3 SISO, causal conv1d and RMSNorm forward at small model
// widths and a batch x sequence length (--shape). Each row gives the median time, the bandwidth
// achieved on the bytes a kernel must move (its inputs read and outputs written once) and the ratio
// of its time to the memory floor: those bytes at the copy bandwidth measured on the same space
// first. Every output is checked to be finite. The full benchmarks, with FLOP and transcendental
// floors at the reference shapes, are perf/'s kmamba-perf (docs/performance.md).
#include <kmamba/KMamba.hpp>

#include "AppRuntime.hpp"
#include "DeviceOption.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

namespace {

struct Options {
  std::string shape = "2x1024", space;
  int repeats = 5;
  int batch = 0, seqlen = 0;  // parsed from shape
};

// One kernel's case, set up: its views are held by the two callables.
struct Case {
  std::string kernel, shape;
  double bytes = 0;             // what the kernel must move: its inputs read and outputs written once
  std::function<void()> run;    // one call of the kernel
  std::function<bool()> check;  // whether every output is finite
};

// dst(i) = src(i): the copy that measures the space's memory bandwidth.
template <class Mem>
struct CopyFunctor {
  kmamba::ConstTensor1<float, Mem> src;  // (n)
  kmamba::Tensor1<float, Mem> dst;       // (n)
  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const { dst(i) = src(i); }
};

// One warm-up call, then the median of `repeats` fenced calls.
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

// True when every element of the contiguous float view `v` is finite.
template <class View>
bool all_finite(const View& v) {
  const auto h = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), v);
  return std::all_of(h.data(), h.data() + h.span(), [](float x) { return std::isfinite(x); });
}

// A view of the given extents filled with normal values of `mean` and standard deviation `spread`.
template <class View, class Exec, class... Extents>
View random_view(const Exec& exec, const std::string& name, std::uint64_t seed, float mean, float spread,
                 Extents... extents) {
  View v = kmamba::allocate_uninitialized<View>("kmamba::bench::" + name, extents...);
  kmamba::fill_normal(exec, v, seed, mean, spread);
  return v;
}

// Bytes per second of a copy of 2 x 32 MiB on `exec`.
template <class Exec>
double copy_bandwidth(const Exec& exec, int repeats) {
  using Mem = typename Exec::memory_space;
  const std::int64_t n = std::int64_t(1) << 23;
  const auto src = random_view<kmamba::Tensor1<float, Mem>>(exec, "copy_src", 1, 0.0f, 1.0f, n);
  const auto dst = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::bench::copy_dst", n);
  const double s = median_seconds(exec, repeats, [&] {
    Kokkos::parallel_for("kmamba::bench::copy", Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(exec, 0, n),
                         CopyFunctor<Mem>{src, dst});
  });
  return 8.0 * n / s;
}

// Mamba-1 selective scan: d_inner 512, d_state 16, with D, z, delta_bias and softplus.
template <class Exec>
Case selective_scan_case(const Exec& exec, const Options& o) {
  using Mem = typename Exec::memory_space;
  using T3 = kmamba::Tensor3<float, Mem>;
  const int b = o.batch, L = o.seqlen, D = 512, N = 16;
  kmamba::SelectiveScanArgs<Mem> args;
  args.u = random_view<T3>(exec, "u", 2, 0.0f, 1.0f, b, D, L);
  args.delta = random_view<T3>(exec, "delta", 3, -1.0f, 0.5f, b, D, L);
  args.z = random_view<T3>(exec, "z", 4, 0.0f, 1.0f, b, D, L);
  auto A = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::bench::A", D, N);
  kmamba::fill_uniform(exec, A, 5, -2.0f, -0.1f);
  args.A = A;
  args.B = random_view<kmamba::Tensor4<float, Mem>>(exec, "B", 6, 0.0f, 1.0f, b, 1, N, L);
  args.C = random_view<kmamba::Tensor4<float, Mem>>(exec, "C", 7, 0.0f, 1.0f, b, 1, N, L);
  args.D = random_view<kmamba::Tensor1<float, Mem>>(exec, "D", 8, 1.0f, 0.1f, D);
  args.delta_bias = random_view<kmamba::Tensor1<float, Mem>>(exec, "delta_bias", 9, 0.0f, 0.1f, D);
  args.delta_softplus = true;
  const auto out = kmamba::allocate_uninitialized<T3>("kmamba::bench::out", b, D, L);
  const auto last = kmamba::allocate_uninitialized<T3>("kmamba::bench::last", b, D, N);
  return {"selective_scan", "b" + std::to_string(b) + " L" + std::to_string(L) + " D512 N16",
          4.0 * (4.0 * b * D * L + 2.0 * b * N * L),  // u, delta, z, out; B, C
          [=] { kmamba::selective_scan_forward(exec, args, out, last); }, [=] { return all_finite(out); }};
}

// Mamba-2 SSD: 8 heads of 64 channels, d_state 64, one group, chunk 64, with D, z, dt_bias, softplus.
template <class Exec>
Case ssd_case(const Exec& exec, const Options& o) {
  using Mem = typename Exec::memory_space;
  using T1 = kmamba::Tensor1<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  const int b = o.batch, L = o.seqlen, H = 8, P = 64, N = 64;
  kmamba::SsdArgs<Mem> args;
  args.x = random_view<T4>(exec, "x", 11, 0.0f, 1.0f, b, L, H, P);
  args.z = random_view<T4>(exec, "z", 12, 0.0f, 1.0f, b, L, H, P);
  args.dt = random_view<kmamba::Tensor3<float, Mem>>(exec, "dt", 13, -2.0f, 0.5f, b, L, H);
  auto A = kmamba::allocate_uninitialized<T1>("kmamba::bench::A", H);
  kmamba::fill_uniform(exec, A, 14, -8.0f, -1.0f);
  args.A = A;
  args.B = random_view<T4>(exec, "B", 15, 0.0f, 1.0f, b, L, 1, N);
  args.C = random_view<T4>(exec, "C", 16, 0.0f, 1.0f, b, L, 1, N);
  args.D = random_view<T1>(exec, "D", 17, 1.0f, 0.1f, H);
  args.dt_bias = random_view<T1>(exec, "dt_bias", 18, 0.0f, 0.1f, H);
  args.dt_softplus = true;
  args.chunk_size = 64;
  const auto out = kmamba::allocate_uninitialized<T4>("kmamba::bench::out", b, L, H, P);
  const auto final_states = kmamba::allocate_uninitialized<T4>("kmamba::bench::final_states", b, H, P, N);
  return {"ssd", "b" + std::to_string(b) + " L" + std::to_string(L) + " H8 P64 N64 Q64",
          4.0 * b * L * (3.0 * H * P + 2.0 * N + H),  // x, z, out, B, C, dt
          [=] { kmamba::ssd_forward(exec, args, out, final_states); }, [=] { return all_finite(out); }};
}

// Mamba-3 SISO: 8 heads of 64 channels, d_state 64 with half of it rotated (16 angles), chunk 64,
// with D and z.
template <class Exec>
Case mamba3_siso_case(const Exec& exec, const Options& o) {
  using Mem = typename Exec::memory_space;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  const int b = o.batch, L = o.seqlen, H = 8, P = 64, N = 64, angles = 16;
  kmamba::Mamba3SisoArgs<Mem> args;
  args.q = random_view<T4>(exec, "q", 21, 0.0f, 0.1f, b, L, 1, N);
  args.k = random_view<T4>(exec, "k", 22, 0.0f, 0.1f, b, L, 1, N);
  args.v = random_view<T4>(exec, "v", 23, 0.0f, 1.0f, b, L, H, P);
  args.z = random_view<T4>(exec, "z", 24, 0.0f, 1.0f, b, L, H, P);
  auto adt = kmamba::allocate_uninitialized<T3>("kmamba::bench::adt", b, H, L);
  auto dt = kmamba::allocate_uninitialized<T3>("kmamba::bench::dt", b, H, L);
  kmamba::fill_uniform(exec, adt, 25, -0.2f, -0.001f);
  kmamba::fill_uniform(exec, dt, 26, 0.001f, 0.1f);
  args.adt = adt;
  args.dt = dt;
  args.trap = random_view<T3>(exec, "trap", 27, 0.0f, 1.0f, b, H, L);
  args.q_bias = random_view<T2>(exec, "q_bias", 28, 0.0f, 0.1f, H, N);
  args.k_bias = random_view<T2>(exec, "k_bias", 29, 0.0f, 0.1f, H, N);
  args.angles = random_view<T4>(exec, "angles", 30, 0.0f, 1.0f, b, L, H, angles);
  args.D = random_view<kmamba::Tensor1<float, Mem>>(exec, "D", 31, 1.0f, 0.1f, H);
  args.chunk_size = 64;
  const auto out = kmamba::allocate_uninitialized<T4>("kmamba::bench::out", b, L, H, P);
  const kmamba::Mamba3SisoStates<Mem> final_states{
      kmamba::allocate_uninitialized<T3>("kmamba::bench::final_angle", b, H, angles),
      kmamba::allocate_uninitialized<T4>("kmamba::bench::final_ssm", b, H, P, N),
      kmamba::allocate_uninitialized<T3>("kmamba::bench::final_k", b, H, N),
      kmamba::allocate_uninitialized<T3>("kmamba::bench::final_v", b, H, P)};
  return {"mamba3_siso", "b" + std::to_string(b) + " L" + std::to_string(L) + " H8 P64 N64 Q64",
          4.0 * b * L * (3.0 * H * P + 2.0 * N + 3.0 * H + H * angles),  // q, k, v, z, out, adt, dt, trap, angles
          [=] { kmamba::mamba3_siso_forward(exec, args, out, final_states); }, [=] { return all_finite(out); }};
}

// Causal depthwise conv1d with SiLU: the 640 channels of the SSD case's x, B and C, width 4.
template <class Exec>
Case conv1d_case(const Exec& exec, const Options& o) {
  using Mem = typename Exec::memory_space;
  using T3 = kmamba::Tensor3<float, Mem>;
  const int b = o.batch, L = o.seqlen, C = 640, W = 4;
  const auto x = random_view<T3>(exec, "x", 41, 0.0f, 1.0f, b, L, C);
  const auto weight = random_view<kmamba::Tensor2<float, Mem>>(exec, "weight", 42, 0.0f, 0.5f, C, W);
  const auto bias = random_view<kmamba::Tensor1<float, Mem>>(exec, "bias", 43, 0.0f, 0.1f, C);
  const auto y = kmamba::allocate_uninitialized<T3>("kmamba::bench::y", b, L, C);
  return {"conv1d", "b" + std::to_string(b) + " L" + std::to_string(L) + " C640 W4",
          4.0 * (2.0 * b * L * C + C * (W + 1.0)),  // x, y; weight, bias
          [=] {
            kmamba::causal_conv1d(exec, kmamba::ConstTensor3<float, Mem>(x), kmamba::ConstTensor2<float, Mem>(weight),
                                  kmamba::ConstTensor1<float, Mem>(bias), kmamba::ConstTensor3<float, Mem>(), y, T3(),
                                  kmamba::Conv1dActivation::silu);
          },
          [=] { return all_finite(y); }};
}

// RMSNorm over d_model 256, one row per token.
template <class Exec>
Case rms_norm_case(const Exec& exec, const Options& o) {
  using Mem = typename Exec::memory_space;
  using T2 = kmamba::Tensor2<float, Mem>;
  const std::int64_t rows = std::int64_t(o.batch) * o.seqlen;
  const int dim = 256;
  const auto x = random_view<T2>(exec, "x", 51, 0.0f, 1.0f, rows, dim);
  const auto weight = random_view<kmamba::Tensor1<float, Mem>>(exec, "weight", 52, 1.0f, 0.1f, dim);
  const auto y = kmamba::allocate_uninitialized<T2>("kmamba::bench::y", rows, dim);
  return {"rms_norm", "rows" + std::to_string(rows) + " D256", 4.0 * (2.0 * rows * dim + dim),  // x, y; weight
          [=] { kmamba::rms_norm(exec, x, weight, 1e-5f, y); }, [=] { return all_finite(y); }};
}

// Times one case, set up by `make_case`, and prints its row; returns whether its outputs are finite.
// The case's views are released on return, before the next case is set up.
template <class Exec>
bool time_case(const Exec& exec, const Options& o, double bandwidth, Case (*make_case)(const Exec&, const Options&)) {
  const Case c = make_case(exec, o);
  const double seconds = median_seconds(exec, o.repeats, c.run);
  const bool finite = c.check();
  const double floor_s = c.bytes / bandwidth;
  std::printf("%-15s %-28s %8.3f ms %10.2f %8.3f ms %8.1f  %s\n", c.kernel.c_str(), c.shape.c_str(), seconds * 1e3,
              c.bytes / seconds * 1e-9, floor_s * 1e3, seconds / floor_s, finite ? "finite" : "NOT FINITE");
  return finite;
}

template <class Exec>
int bench_space(const Exec& exec, const Options& o) {
  const double bandwidth = copy_bandwidth(exec, o.repeats);
  std::printf(
      "kmamba-bench: %s, batch %d x seqlen %d, median of %d runs; memory floor: bytes / %.1f GB/s (a "
      "copy on %s)\n",
      Exec::name(), o.batch, o.seqlen, o.repeats, bandwidth * 1e-9, Exec::name());
  std::printf("%-15s %-28s %11s %10s %11s %8s  %s\n", "kernel", "shape", "time", "GB/s", "floor", "x floor", "output");
  using MakeCase = Case (*)(const Exec&, const Options&);
  const MakeCase cases[] = {selective_scan_case<Exec>, ssd_case<Exec>, mamba3_siso_case<Exec>, conv1d_case<Exec>,
                            rms_norm_case<Exec>};
  bool ok = true;
  for (const MakeCase make_case : cases) ok = time_case(exec, o, bandwidth, make_case) && ok;
  std::printf(ok ? "kmamba-bench: every output finite\n" : "kmamba-bench: CHECK FAILED (a non-finite output)\n");
  return ok ? kmamba::app::exit_done : kmamba::app::exit_failed;
}

// "BxL" (batch x sequence length) into o.batch and o.seqlen.
void parse_shape(Options& o) {
  long long b = 0, L = 0;
  char x = 0, extra = 0;
  const bool parsed = std::sscanf(o.shape.c_str(), "%lld%c%lld%c", &b, &x, &L, &extra) == 3 && x == 'x';
  KMAMBA_REQUIRE(parsed && b >= 1 && b <= 4096 && L >= 1 && L <= (1 << 20),
                 "kmamba-bench: --shape: got '" << o.shape
                                                << "', expected BxL, a batch in [1, 4096] and a sequence length in "
                                                   "[1, 1048576] (e.g. 2x1024)");
  o.batch = static_cast<int>(b);
  o.seqlen = static_cast<int>(L);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App cli{
      "Times this build's kernels forward on one execution space: selective scan (Mamba-1), SSD (Mamba-2),\n"
      "Mamba-3 SISO, causal conv1d and RMSNorm, at small model widths (d_inner 512, 8 heads of 64,\n"
      "d_state 16 / 64, d_model 256). For each: the median time, the GB/s achieved on the bytes it must\n"
      "move (inputs read and outputs written once) and its time over the memory floor, those bytes at\n"
      "the copy bandwidth measured first on the same space; every output is checked to be finite.\n"
      "kmamba-perf (perf/) has the full benchmarks. Exit status: 0 every output finite, 1 one was not,\n"
      "2 a bad option.",
      "kmamba-bench"};
  kmamba::app::configure(cli);
  Options o;
  cli.add_option("--shape", o.shape, "batch x sequence length of every kernel (default 2x1024)")->type_name("BxL");
  kmamba::app::add_integer(cli, "--repeats", o.repeats, 1, 1000000,
                           "timed repetitions after a warm-up; the median is reported (default 5)", "R");
  kmamba::app::add_space_option(cli, o.space, "the execution space (default: the build's default)");
  return kmamba::app::run_app(argc, argv, cli, {}, [&](kmamba::app::Runtime&) {
    parse_shape(o);
    kmamba::print_configuration(std::cout);
    return kmamba::app::on_space(o.space, [&](const auto& exec) { return bench_space(exec, o); });
  });
}
