// kmamba-perf: kernel benchmarks with roofline ratios.
//
//   kmamba-perf [--case NAME] [--space Cuda|OpenMP|Serial] [--small] [--repeats R] [--precision fp32|tf32|bf16|all]
//               [--chunk Q] [--json FILE]
//
// Each case states the bytes it must move and the operations it must do; the floor is the largest of
// bytes / bandwidth, FLOPs / FMA rate and transcendental count / SFU rate (H200 ceilings measured or
// from docs/performance.md §2; on a host the ratio is printed against the same H200 floor only as a
// reference point). Inputs are fresh random data (never zeros); timings are medians of fenced runs.
// The SSD and Mamba-3 SISO run in each MatmulPrecision asked for (--precision, default all) that
// the backend distinguishes: their "tf32" rows (tensor-core chunk products) take the TF32 tensor-core rate as
// their FLOP ceiling, the SSD's "bf16" rows (the fused forward; its backward computes as fp32) the bf16
// rate, at the fused forward's own chunk length. Mamba-3 has no bf16 form.
#include "Timing.hpp"
#include <kmamba/KMamba.hpp>
#include <kmamba/backends/Gemm.hpp>
#include <kmamba/core/Files.hpp>

#include "AppRuntime.hpp"
#include "DeviceOption.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace {

// H200 ceilings: measured device copy bandwidth; fp32 FMA and SFU exp rates from docs/performance.md §2.
constexpr double hbm_bytes_per_s = 4.3e12;
constexpr double fp32_flop_per_s = 60e12;
constexpr double exp_per_s = 3.9e12;
// Dense TF32 tensor-core rate: half the measured bf16 one (docs/performance.md §2: 790 TFLOP/s), the
// datasheet's TF32 : bf16 ratio.
constexpr double tf32_flop_per_s = 395e12;
constexpr double bf16_flop_per_s = 790e12;

struct Measurement {
  std::string name, shape;
  double seconds = 0, bytes = 0, flops = 0, exps = 0;
  double flop_per_s = fp32_flop_per_s;  // the FLOP ceiling of the floor
  // A scan case's tokens × inner channels × state size: kmamba-plan scales its time by this unit.
  double scan_units = 0;
};

struct Options {
  std::string only_case, space, precision = "all", json;
  bool small = false;
  int repeats = 10;
  int chunk = 0;  // chunk length of the SSD and Mamba-3 SISO / MIMO; 0: the reference shapes' (256, 64, 16)
  std::vector<Measurement>* rows = nullptr;  // every reported measurement, for --json
};

// One untimed warm-up call, then the median of `repeats` timed ones.
template <class Exec, class F>
double warm_median_seconds(const Exec& exec, int repeats, const F& run) {
  run();
  exec.fence();
  return kmamba_perf::median_seconds(exec, repeats, run);
}

double floor_seconds(const Measurement& m) {
  return std::max({m.bytes / hbm_bytes_per_s, m.flops / m.flop_per_s, m.exps / exp_per_s});
}

void report(const Options& o, const Measurement& m) {
  if (o.rows != nullptr) o.rows->push_back(m);
  const double floor_s = floor_seconds(m);
  std::printf("%-28s %-34s %10.3f ms %9.1f GB/s %9.1f GFLOP/s   floor %8.3f ms  x%.1f\n", m.name.c_str(),
              m.shape.c_str(), m.seconds * 1e3, m.bytes / m.seconds * 1e-9, m.flops / m.seconds * 1e-9, floor_s * 1e3,
              m.seconds / floor_s);
}

// max|a − b| / max|b| over two host views of the same shape (contiguous).
template <class HostView>
double relative_difference(const HostView& a, const HostView& b) {
  double diff = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < b.span(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(a.data()[i]) - b.data()[i]));
    scale = std::max(scale, std::abs(static_cast<double>(b.data()[i])));
  }
  return diff / std::max(scale, 1e-30);
}

// Mamba-1 selective scan at docs/performance.md §3.2's shape (batch 8, seqlen 4096, d_inner 1536,
// d_state 16),
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
  fwd.seconds = warm_median_seconds(exec, o.repeats, [&] { kmamba::selective_scan_forward(exec, args, out, last); });
  fwd.bytes = 4.0 * (4 * elems + 2.0 * batch * dstate * seqlen);  // u, delta, z, out + B, C
  fwd.flops = 8.0 * elems * dstate;                               // per state update: exp arg, decay, B·u, C·h
  fwd.exps = elems * dstate;
  fwd.scan_units = elems * dstate;
  report(o, fwd);

  kmamba::Tensor3<float, Mem> dout =
      kmamba::allocate_uninitialized<kmamba::Tensor3<float, Mem>>("kmamba::perf::dout", batch, dim, seqlen);
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
  bwd.seconds = warm_median_seconds(exec, o.repeats, [&] {
    kmamba::selective_scan_backward(exec, args, dout, kmamba::ConstTensor3<float, Mem>(), g);
  });
  bwd.bytes =
      4.0 * (9 * elems + 4.0 * batch * dstate * seqlen);  // read u, delta, z, dout (+ recompute); write du, ddelta, dz
  bwd.flops = 20.0 * elems * dstate;
  bwd.exps = 2.0 * elems * dstate;  // recompute + backward
  bwd.scan_units = elems * dstate;
  report(o, bwd);
}

// Mamba-2 SSD (mamba_chunk_scan_combined) at one (batch, seqlen) of the CUDA performance issue:
// 32 heads, headdim 64, d_state 128, ngroups 1, chunk 256, with D, z, dt_bias and softplus; fp32
// inputs. FLOPs and exp() counts from docs/algorithms.md §6.1–§6.2 (E = nheads·headdim).
template <class Exec>
void bench_ssd_shape(const Options& o, const int batch, const int seqlen) {
  using Mem = typename Exec::memory_space;
  using T1 = kmamba::Tensor1<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  const Exec exec;
  const int nheads = o.small ? 8 : 32, headdim = 64;
  const int dstate = o.small ? 64 : 128, ngroups = 1, chunk = o.chunk > 0 ? o.chunk : 256;
  const double tokens = double(batch) * seqlen, E = double(nheads) * headdim, N = dstate, G = ngroups;
  auto x = kmamba::allocate_uninitialized<T4>("kmamba::perf::x", batch, seqlen, nheads, headdim);
  auto z = kmamba::allocate_uninitialized<T4>("kmamba::perf::z", batch, seqlen, nheads, headdim);
  auto dt = kmamba::allocate_uninitialized<T3>("kmamba::perf::dt", batch, seqlen, nheads);
  auto A = kmamba::allocate_uninitialized<T1>("kmamba::perf::A", nheads);
  auto B = kmamba::allocate_uninitialized<T4>("kmamba::perf::B", batch, seqlen, ngroups, dstate);
  auto C = kmamba::allocate_uninitialized<T4>("kmamba::perf::C", batch, seqlen, ngroups, dstate);
  auto D = kmamba::allocate_uninitialized<T1>("kmamba::perf::D", nheads);
  auto dt_bias = kmamba::allocate_uninitialized<T1>("kmamba::perf::dt_bias", nheads);
  kmamba::fill_normal(exec, x, 11, 0.0f, 1.0f);
  kmamba::fill_normal(exec, z, 12, 0.0f, 1.0f);
  kmamba::fill_normal(exec, dt, 13, -2.0f, 0.5f);
  kmamba::fill_uniform(exec, A, 14, -8.0f, -1.0f);
  kmamba::fill_normal(exec, B, 15, 0.0f, 1.0f);
  kmamba::fill_normal(exec, C, 16, 0.0f, 1.0f);
  kmamba::fill_normal(exec, D, 17, 1.0f, 0.1f);
  kmamba::fill_normal(exec, dt_bias, 18, 0.0f, 0.1f);
  kmamba::SsdArgs<Mem> args;
  args.x = x;
  args.z = z;
  args.dt = dt;
  args.A = A;
  args.B = B;
  args.C = C;
  args.D = D;
  args.dt_bias = dt_bias;
  args.dt_softplus = true;
  args.chunk_size = chunk;
  auto out = kmamba::allocate_uninitialized<T4>("kmamba::perf::out", batch, seqlen, nheads, headdim);
  auto final_states = kmamba::allocate_uninitialized<T4>("kmamba::perf::final_states", batch, nheads, headdim, dstate);
  auto dout = kmamba::allocate_uninitialized<T4>("kmamba::perf::dout", batch, seqlen, nheads, headdim);
  kmamba::fill_normal(exec, dout, 19, 0.0f, 1.0f);
  kmamba::SsdGrads<Mem> g;
  g.dx = kmamba::allocate_uninitialized<T4>("kmamba::perf::dx", batch, seqlen, nheads, headdim);
  g.dz = kmamba::allocate_uninitialized<T4>("kmamba::perf::dz", batch, seqlen, nheads, headdim);
  g.ddt = kmamba::allocate_uninitialized<T3>("kmamba::perf::ddt", batch, seqlen, nheads);
  g.dA = kmamba::allocate_uninitialized<T1>("kmamba::perf::dA", nheads);
  g.dB = kmamba::allocate_uninitialized<T4>("kmamba::perf::dB", batch, seqlen, ngroups, dstate);
  g.dC = kmamba::allocate_uninitialized<T4>("kmamba::perf::dC", batch, seqlen, ngroups, dstate);
  g.dD = kmamba::allocate_uninitialized<T1>("kmamba::perf::dD", nheads);
  g.ddt_bias = kmamba::allocate_uninitialized<T1>("kmamba::perf::ddt_bias", nheads);
  const double io_bytes = 4.0 * tokens * (3 * E + 2 * G * N + nheads);  // x, z, out, B, C, dt (fp32)

  // out and dx of the last fp32 run, against which the other precisions' are compared.
  auto out_fp32 = Kokkos::create_mirror(Kokkos::HostSpace(), out);
  auto dx_fp32 = Kokkos::create_mirror(Kokkos::HostSpace(), g.dx);
  bool have_fp32 = false;
  using kmamba::MatmulPrecision;
  for (const MatmulPrecision precision :
       {MatmulPrecision::Float32, MatmulPrecision::TensorFloat32, MatmulPrecision::BFloat16}) {
    const bool tf32 = precision == MatmulPrecision::TensorFloat32, bf16 = precision == MatmulPrecision::BFloat16;
    if (o.precision != "all" && o.precision != kmamba::matmul_precision_name(precision)) continue;
    // The fused bf16 forward chunks on its own (the backward keeps the configured chunk).
    const int q = bf16 ? kmamba::impl::ssd_fused_chunk : chunk;
    char shape[96];
    if (bf16) {  // forward chunk / backward chunk
      std::snprintf(shape, sizeof shape, "b%d L%d H%d P%d N%d Q%d/%d (%s)", batch, seqlen, nheads, headdim, dstate, q,
                    chunk, Exec::name());
    } else {
      std::snprintf(shape, sizeof shape, "b%d L%d H%d P%d N%d Q%d (%s)", batch, seqlen, nheads, headdim, dstate, q,
                    Exec::name());
    }
    if (tf32 && !kmamba::impl::TeamGemm<Exec, MatmulPrecision::TensorFloat32>::tensor_cores) {
      std::printf("%-28s %-34s   (no tensor-core form on this backend: the same as fp32)\n", "ssd tf32", shape);
      continue;
    }
    args.matmul_precision = precision;
    const std::string suffix =
        precision == MatmulPrecision::Float32 ? "" : std::string(" ") + kmamba::matmul_precision_name(precision);
    const double flop_per_s = bf16 ? bf16_flop_per_s : tf32 ? tf32_flop_per_s : fp32_flop_per_s;

    Measurement fwd{"ssd fwd" + suffix, shape};
    fwd.scan_units = tokens * E * N;
    fwd.flop_per_s = flop_per_s;
    fwd.seconds = warm_median_seconds(exec, o.repeats, [&] { kmamba::ssd_forward(exec, args, out, final_states); });
    // The staged forward writes and reads the chunk states; the fused one keeps them on chip.
    fwd.bytes = io_bytes + (bf16 ? 0.0 : 4.0 * tokens * E * N / q * 2);
    fwd.flops = tokens * (4 * E * N + q * E + 2 * q * G * N);
    fwd.exps = tokens * nheads * q / 2;
    report(o, fwd);

    Measurement bwd{"ssd bwd" + suffix, shape};
    bwd.scan_units = tokens * E * N;
    bwd.flop_per_s = flop_per_s;
    bwd.seconds = warm_median_seconds(
        exec, o.repeats, [&] { kmamba::ssd_backward(exec, args, dout, kmamba::ConstTensor4<float, Mem>(), g); });
    bwd.bytes = 2.0 * io_bytes + 4.0 * tokens * E * N / chunk * 4;  // inputs + dout, every gradient, states recomputed
    bwd.flops = tokens * (10 * E * N + 3 * chunk * E + 6 * chunk * G * N);
    bwd.exps = 3.0 * tokens * nheads * chunk / 2;
    report(o, bwd);

    Measurement both{"ssd fwd+bwd" + suffix, shape};
    both.scan_units = tokens * E * N;
    both.flop_per_s = flop_per_s;
    both.seconds = fwd.seconds + bwd.seconds;
    both.bytes = fwd.bytes + bwd.bytes;
    both.flops = fwd.flops + bwd.flops;
    both.exps = fwd.exps + bwd.exps;
    report(o, both);

    if (precision == MatmulPrecision::Float32) {
      Kokkos::deep_copy(out_fp32, out);
      Kokkos::deep_copy(dx_fp32, g.dx);
      have_fp32 = true;
    } else if (have_fp32) {
      auto out_other = Kokkos::create_mirror(Kokkos::HostSpace(), out);
      auto dx_other = Kokkos::create_mirror(Kokkos::HostSpace(), g.dx);
      Kokkos::deep_copy(out_other, out);
      Kokkos::deep_copy(dx_other, g.dx);
      std::printf("%-28s %-34s   max|%s - fp32| / max|fp32|: out %.2e, dx %.2e\n",
                  ("ssd" + suffix + " accuracy").c_str(), shape, kmamba::matmul_precision_name(precision),
                  relative_difference(out_other, out_fp32), relative_difference(dx_other, dx_fp32));
    }
  }
}

// The SSD at the issue's two shapes, batch 8 × seqlen 4096 and batch 1 × seqlen 32768 (the same
// tokens in one long sequence: 128 chunks whose states pass through one sequential chain); --small
// runs batch 1 × seqlen 1024 only.
template <class Exec>
void bench_ssd(const Options& o) {
  if (o.small) {
    bench_ssd_shape<Exec>(o, 1, 1024);
    return;
  }
  bench_ssd_shape<Exec>(o, 8, 4096);
  bench_ssd_shape<Exec>(o, 1, 32768);
}

// Mamba-3 SISO (mamba3_siso_combined) at the shape of the CUDA performance issue: batch 8, seqlen
// 4096, 32 heads, headdim 64, d_state 128 (a quarter of it rotated: 16 angles), ngroups 1, chunk 64,
// with D and z; fp32 inputs. FLOPs as docs/algorithms.md §6.4 counts them: the SSD's (§6.1–§6.2) at
// Q = 64, which counts the products that dominate (the rotations and per-token scalars are O(N)).
template <class Exec>
void bench_mamba3_siso(const Options& o) {
  using Mem = typename Exec::memory_space;
  using T1 = kmamba::Tensor1<float, Mem>;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  using T4 = kmamba::Tensor4<float, Mem>;
  const Exec exec;
  const int batch = o.small ? 1 : 8, seqlen = o.small ? 1024 : 4096, nheads = o.small ? 8 : 32, headdim = 64;
  const int dstate = o.small ? 64 : 128, nangles = dstate / 8, ngroups = 1, chunk = o.chunk > 0 ? o.chunk : 64;
  const double tokens = double(batch) * seqlen, E = double(nheads) * headdim, N = dstate, Q = chunk, G = ngroups;
  auto q = kmamba::allocate_uninitialized<T4>("kmamba::perf::q", batch, seqlen, ngroups, dstate);
  auto k = kmamba::allocate_uninitialized<T4>("kmamba::perf::k", batch, seqlen, ngroups, dstate);
  auto v = kmamba::allocate_uninitialized<T4>("kmamba::perf::v", batch, seqlen, nheads, headdim);
  auto z = kmamba::allocate_uninitialized<T4>("kmamba::perf::z", batch, seqlen, nheads, headdim);
  auto adt = kmamba::allocate_uninitialized<T3>("kmamba::perf::adt", batch, nheads, seqlen);
  auto dt = kmamba::allocate_uninitialized<T3>("kmamba::perf::dt", batch, nheads, seqlen);
  auto trap = kmamba::allocate_uninitialized<T3>("kmamba::perf::trap", batch, nheads, seqlen);
  auto q_bias = kmamba::allocate_uninitialized<T2>("kmamba::perf::q_bias", nheads, dstate);
  auto k_bias = kmamba::allocate_uninitialized<T2>("kmamba::perf::k_bias", nheads, dstate);
  auto angles = kmamba::allocate_uninitialized<T4>("kmamba::perf::angles", batch, seqlen, nheads, nangles);
  auto D = kmamba::allocate_uninitialized<T1>("kmamba::perf::D", nheads);
  kmamba::fill_normal(exec, q, 21, 0.0f, 0.1f);
  kmamba::fill_normal(exec, k, 22, 0.0f, 0.1f);
  kmamba::fill_normal(exec, v, 23, 0.0f, 1.0f);
  kmamba::fill_normal(exec, z, 24, 0.0f, 1.0f);
  kmamba::fill_uniform(exec, adt, 25, -0.2f, -0.001f);
  kmamba::fill_uniform(exec, dt, 26, 0.001f, 0.1f);
  kmamba::fill_normal(exec, trap, 27, 0.0f, 1.0f);
  kmamba::fill_normal(exec, q_bias, 28, 0.0f, 0.1f);
  kmamba::fill_normal(exec, k_bias, 29, 0.0f, 0.1f);
  kmamba::fill_normal(exec, angles, 30, 0.0f, 1.0f);
  kmamba::fill_normal(exec, D, 31, 1.0f, 0.1f);
  kmamba::Mamba3SisoArgs<Mem> args;
  args.q = q;
  args.k = k;
  args.v = v;
  args.adt = adt;
  args.dt = dt;
  args.trap = trap;
  args.q_bias = q_bias;
  args.k_bias = k_bias;
  args.angles = angles;
  args.D = D;
  args.z = z;
  args.chunk_size = chunk;
  auto out = kmamba::allocate_uninitialized<T4>("kmamba::perf::out", batch, seqlen, nheads, headdim);
  const kmamba::Mamba3SisoStates<Mem> final_states{
      kmamba::allocate_uninitialized<T3>("kmamba::perf::final_angle", batch, nheads, nangles),
      kmamba::allocate_uninitialized<T4>("kmamba::perf::final_ssm", batch, nheads, headdim, dstate),
      kmamba::allocate_uninitialized<T3>("kmamba::perf::final_k", batch, nheads, dstate),
      kmamba::allocate_uninitialized<T3>("kmamba::perf::final_v", batch, nheads, headdim)};
  auto dout = kmamba::allocate_uninitialized<T4>("kmamba::perf::dout", batch, seqlen, nheads, headdim);
  kmamba::fill_normal(exec, dout, 32, 0.0f, 1.0f);
  kmamba::Mamba3SisoGrads<Mem> g;
  g.dq = kmamba::allocate_uninitialized<T4>("kmamba::perf::dq", batch, seqlen, ngroups, dstate);
  g.dk = kmamba::allocate_uninitialized<T4>("kmamba::perf::dk", batch, seqlen, ngroups, dstate);
  g.dv = kmamba::allocate_uninitialized<T4>("kmamba::perf::dv", batch, seqlen, nheads, headdim);
  g.dadt = kmamba::allocate_uninitialized<T3>("kmamba::perf::dadt", batch, nheads, seqlen);
  g.ddt = kmamba::allocate_uninitialized<T3>("kmamba::perf::ddt", batch, nheads, seqlen);
  g.dtrap = kmamba::allocate_uninitialized<T3>("kmamba::perf::dtrap", batch, nheads, seqlen);
  g.dq_bias = kmamba::allocate_uninitialized<T2>("kmamba::perf::dq_bias", nheads, dstate);
  g.dk_bias = kmamba::allocate_uninitialized<T2>("kmamba::perf::dk_bias", nheads, dstate);
  g.dangles = kmamba::allocate_uninitialized<T4>("kmamba::perf::dangles", batch, seqlen, nheads, nangles);
  g.dD = kmamba::allocate_uninitialized<T1>("kmamba::perf::dD", nheads);
  g.dz = kmamba::allocate_uninitialized<T4>("kmamba::perf::dz", batch, seqlen, nheads, headdim);
  char shape[96];
  std::snprintf(shape, sizeof shape, "b%d L%d H%d P%d N%d Q%d (%s)", batch, seqlen, nheads, headdim, dstate, chunk,
                Exec::name());
  // q, k, v, z, out, adt, dt, trap, angles (fp32)
  const double io_bytes = 4.0 * tokens * (3 * E + 2 * G * N + 3 * nheads + nheads * nangles);

  // The SISO scan runs on the SSD: bf16 is its fused tensor-core path (emulated on host backends).
  for (const kmamba::MatmulPrecision precision :
       {kmamba::MatmulPrecision::Float32, kmamba::MatmulPrecision::TensorFloat32, kmamba::MatmulPrecision::BFloat16}) {
    const bool tf32 = precision == kmamba::MatmulPrecision::TensorFloat32;
    const bool bf16 = precision == kmamba::MatmulPrecision::BFloat16;
    if (o.precision != "all" && o.precision != kmamba::matmul_precision_name(precision)) continue;
    if (tf32 && !kmamba::impl::TeamGemm<Exec, kmamba::MatmulPrecision::TensorFloat32>::tensor_cores) {
      std::printf("%-28s %-34s   (no tensor-core form on this backend: the same as fp32)\n", "mamba3 siso tf32", shape);
      continue;
    }
    args.matmul_precision = precision;
    const std::string suffix = bf16 ? " bf16" : tf32 ? " tf32" : "";
    const double flop_per_s = bf16 ? bf16_flop_per_s : tf32 ? tf32_flop_per_s : fp32_flop_per_s;

    Measurement fwd{"mamba3 siso fwd" + suffix, shape};
    fwd.scan_units = tokens * E * N;
    fwd.flop_per_s = flop_per_s;
    fwd.seconds =
        warm_median_seconds(exec, o.repeats, [&] { kmamba::mamba3_siso_forward(exec, args, out, final_states); });
    fwd.bytes = io_bytes + 4.0 * tokens * E * N / Q * 2;  // + chunk states written and read
    fwd.flops = tokens * (4 * E * N + Q * E + 2 * Q * G * N);
    fwd.exps = tokens * nheads * Q / 2;
    report(o, fwd);

    Measurement bwd{"mamba3 siso bwd" + suffix, shape};
    bwd.scan_units = tokens * E * N;
    bwd.flop_per_s = flop_per_s;
    bwd.seconds = warm_median_seconds(exec, o.repeats, [&] {
      kmamba::mamba3_siso_backward(exec, args, dout, kmamba::Mamba3SisoConstStates<Mem>(), g);
    });
    bwd.bytes = 2.0 * io_bytes + 4.0 * tokens * E * N / Q * 4;  // inputs + dout, every gradient, states recomputed
    bwd.flops = tokens * (10 * E * N + 3 * Q * E + 6 * Q * G * N);
    bwd.exps = 3.0 * tokens * nheads * Q / 2;
    report(o, bwd);

    Measurement both{"mamba3 siso fwd+bwd" + suffix, shape};
    both.scan_units = tokens * E * N;
    both.flop_per_s = flop_per_s;
    both.seconds = fwd.seconds + bwd.seconds;
    both.bytes = fwd.bytes + bwd.bytes;
    both.flops = fwd.flops + bwd.flops;
    both.exps = fwd.exps + bwd.exps;
    report(o, both);
  }
}

// Mamba-3 MIMO of rank 4 at the SISO case's shape (batch 8, seqlen 4096, 32 heads, headdim 64,
// d_state 128, 16 angles, ngroups 1) with chunks of 16 tokens (64 rows of tokens × ranks, the
// reference's 64 / rank), with D and z; fp32 inputs. FLOPs from docs/algorithms.md §6.6.
template <class Exec>
void bench_mamba3_mimo(const Options& o) {
  using Mem = typename Exec::memory_space;
  const Exec exec;
  const int batch = o.small ? 1 : 8, seqlen = o.small ? 1024 : 4096, nheads = o.small ? 8 : 32, headdim = 64;
  const int dstate = o.small ? 64 : 128, nangles = dstate / 8, ngroups = 1, rank = 4;
  const int chunk = o.chunk > 0 ? o.chunk : 16;
  std::uint64_t seed = 50;
  const auto normal = [&](auto view, float mean, float stddev) {
    kmamba::fill_normal(exec, view, seed++, mean, stddev);
    return view;
  };
  const auto uniform = [&](auto view, float lo, float hi) {
    kmamba::fill_uniform(exec, view, seed++, lo, hi);
    return view;
  };
  const auto t1 = [](const char* label, int n0) {
    return kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>(label, n0);
  };
  const auto t3 = [](const char* label, int n0, int n1, int n2) {
    return kmamba::allocate_uninitialized<kmamba::Tensor3<float, Mem>>(label, n0, n1, n2);
  };
  const auto t4 = [](const char* label, int n0, int n1, int n2, int n3) {
    return kmamba::allocate_uninitialized<kmamba::Tensor4<float, Mem>>(label, n0, n1, n2, n3);
  };
  const auto t5 = [](const char* label, int n0, int n1, int n2, int n3, int n4) {
    return kmamba::allocate_uninitialized<kmamba::Tensor5<float, Mem>>(label, n0, n1, n2, n3, n4);
  };
  kmamba::Mamba3MimoArgs<Mem> args;
  args.q = normal(t5("kmamba::perf::q", batch, seqlen, rank, ngroups, dstate), 0.0f, 0.1f);
  args.k = normal(t5("kmamba::perf::k", batch, seqlen, rank, ngroups, dstate), 0.0f, 0.1f);
  args.v = normal(t4("kmamba::perf::v", batch, seqlen, nheads, headdim), 0.0f, 1.0f);
  args.z = normal(t4("kmamba::perf::z", batch, seqlen, nheads, headdim), 0.0f, 1.0f);
  args.adt = uniform(t3("kmamba::perf::adt", batch, nheads, seqlen), -0.2f, -0.001f);
  args.dt = uniform(t3("kmamba::perf::dt", batch, nheads, seqlen), 0.001f, 0.1f);
  args.trap = normal(t3("kmamba::perf::trap", batch, nheads, seqlen), 0.0f, 1.0f);
  args.q_bias = normal(t3("kmamba::perf::q_bias", nheads, rank, dstate), 0.0f, 0.1f);
  args.k_bias = normal(t3("kmamba::perf::k_bias", nheads, rank, dstate), 0.0f, 0.1f);
  args.angles = normal(t4("kmamba::perf::angles", batch, seqlen, nheads, nangles), 0.0f, 1.0f);
  args.mimo_v = normal(t3("kmamba::perf::mimo_v", nheads, rank, headdim), 0.25f, 0.05f);
  args.mimo_z = normal(t3("kmamba::perf::mimo_z", nheads, rank, headdim), 1.0f, 0.1f);
  args.mimo_o = normal(t3("kmamba::perf::mimo_o", nheads, rank, headdim), 0.25f, 0.05f);
  args.D = normal(t1("kmamba::perf::D", nheads), 1.0f, 0.1f);
  args.chunk_size = chunk;
  auto out = t4("kmamba::perf::out", batch, seqlen, nheads, headdim);
  const kmamba::Mamba3MimoStates<Mem> final_states{t3("kmamba::perf::final_angle", batch, nheads, nangles),
                                                   t4("kmamba::perf::final_ssm", batch, nheads, headdim, dstate),
                                                   t4("kmamba::perf::final_k", batch, nheads, rank, dstate),
                                                   t4("kmamba::perf::final_v", batch, nheads, rank, headdim)};
  auto dout = normal(t4("kmamba::perf::dout", batch, seqlen, nheads, headdim), 0.0f, 1.0f);
  kmamba::Mamba3MimoGrads<Mem> g;
  g.dq = t5("kmamba::perf::dq", batch, seqlen, rank, ngroups, dstate);
  g.dk = t5("kmamba::perf::dk", batch, seqlen, rank, ngroups, dstate);
  g.dv = t4("kmamba::perf::dv", batch, seqlen, nheads, headdim);
  g.dz = t4("kmamba::perf::dz", batch, seqlen, nheads, headdim);
  g.dadt = t3("kmamba::perf::dadt", batch, nheads, seqlen);
  g.ddt = t3("kmamba::perf::ddt", batch, nheads, seqlen);
  g.dtrap = t3("kmamba::perf::dtrap", batch, nheads, seqlen);
  g.dq_bias = t3("kmamba::perf::dq_bias", nheads, rank, dstate);
  g.dk_bias = t3("kmamba::perf::dk_bias", nheads, rank, dstate);
  g.dangles = t4("kmamba::perf::dangles", batch, seqlen, nheads, nangles);
  g.dmimo_v = t3("kmamba::perf::dmimo_v", nheads, rank, headdim);
  g.dmimo_z = t3("kmamba::perf::dmimo_z", nheads, rank, headdim);
  g.dmimo_o = t3("kmamba::perf::dmimo_o", nheads, rank, headdim);
  g.dD = t1("kmamba::perf::dD", nheads);
  char shape[96];
  std::snprintf(shape, sizeof shape, "b%d L%d H%d P%d N%d R%d Q%d (%s)", batch, seqlen, nheads, headdim, dstate, rank,
                chunk, Exec::name());
  const double tokens = double(batch) * seqlen, H = nheads, P = headdim, N = dstate, R = rank, Q = chunk;
  // q, k (R·G·N each), v, z, out (H·P each), adt, dt, trap (H each), angles (H·S); fp32
  const double io_bytes = 4.0 * tokens * (2 * R * ngroups * N + 3 * H * P + 3 * H + H * nangles);
  const double state_bytes = 4.0 * tokens * H * P * N / Q;  // one chunk state per chunk and head
  for (const kmamba::MatmulPrecision precision :
       {kmamba::MatmulPrecision::Float32, kmamba::MatmulPrecision::TensorFloat32}) {
    if (o.precision != "all" && o.precision != kmamba::matmul_precision_name(precision)) continue;
    const bool tf32 = precision == kmamba::MatmulPrecision::TensorFloat32;
    if (tf32 && !kmamba::impl::TeamGemm<Exec, kmamba::MatmulPrecision::TensorFloat32>::tensor_cores) {
      std::printf("%-28s %-34s   (no tensor-core form on this backend: the same as fp32)\n", "mamba3 mimo tf32", shape);
      continue;
    }
    args.matmul_precision = precision;
    const std::string suffix = tf32 ? " tf32" : "";
    Measurement fwd{"mamba3 mimo fwd" + suffix, shape};
    fwd.scan_units = tokens * H * P * N;
    fwd.flop_per_s = tf32 ? tf32_flop_per_s : fp32_flop_per_s;
    fwd.seconds =
        warm_median_seconds(exec, o.repeats, [&] { kmamba::mamba3_mimo_forward(exec, args, out, final_states); });
    fwd.bytes = io_bytes + 2 * state_bytes;
    fwd.flops = tokens * H * (4 * P * N * R + Q * R * R * (N + P));
    fwd.exps = tokens * H * Q * R / 2;
    report(o, fwd);
    Measurement bwd{"mamba3 mimo bwd" + suffix, shape};
    bwd.scan_units = tokens * H * P * N;
    bwd.flop_per_s = fwd.flop_per_s;
    bwd.seconds = warm_median_seconds(exec, o.repeats, [&] {
      kmamba::mamba3_mimo_backward(exec, args, dout, kmamba::Mamba3MimoConstStates<Mem>(), g);
    });
    bwd.bytes = 2 * io_bytes + 4 * state_bytes;
    bwd.flops = tokens * H * (10 * P * N * R + 3 * Q * R * R * (N + P));
    bwd.exps = 3 * fwd.exps;
    report(o, bwd);
    Measurement both{"mamba3 mimo fwd+bwd" + suffix, shape};
    both.scan_units = tokens * H * P * N;
    both.flop_per_s = fwd.flop_per_s;
    both.seconds = fwd.seconds + bwd.seconds;
    both.bytes = fwd.bytes + bwd.bytes;
    both.flops = fwd.flops + bwd.flops;
    both.exps = fwd.exps + bwd.exps;
    report(o, both);
  }
}

// The decode step's projections, C = A·Bᵀ with few rows (A: tokens, B: a weight matrix), at the
// mamba2-130m shapes: in_proj (3352 × 768), out_proj (768 × 1536), the tied head (50288 × 768).
// The floor streams the weight once. On CUDA the same products also run through cuBLAS SGEMM, the
// path the library takes above impl::gemm_few_rows_cuda_max rows, for comparison.
template <class Exec>
void bench_gemm_few_rows(const Options& o) {
  using Mem = typename Exec::memory_space;
  const Exec exec;
  struct Shape {
    const char* name;
    int n, k;
  };
  const Shape shapes[] = {{"in_proj", 3352, 768}, {"out_proj", 768, 1536}, {"head", 50288, 768}};
  std::uint64_t seed = 40;
  for (const int m : {1, 4, 16}) {
    for (const Shape& sh : shapes) {
      auto A = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::perf::A", m, sh.k);
      auto B = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::perf::B", sh.n, sh.k);
      auto C = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::perf::C", m, sh.n);
      kmamba::fill_normal(exec, A, seed++, 0.0f, 1.0f);
      kmamba::fill_normal(exec, B, seed++, 0.0f, 0.05f);
      char shape[96];
      std::snprintf(shape, sizeof shape, "%s m%d n%d k%d (%s)", sh.name, m, sh.n, sh.k, Exec::name());
      Measurement g{"gemm A*B^T", shape};
      g.seconds = warm_median_seconds(exec, o.repeats, [&] {
        kmamba::gemm(exec, kmamba::Transpose::No, kmamba::Transpose::Yes, 1.0f, kmamba::ConstTensor2<float, Mem>(A),
                     kmamba::ConstTensor2<float, Mem>(B), 0.0f, C);
      });
      g.bytes = 4.0 * (double(sh.n) * sh.k + double(m) * sh.k + double(m) * sh.n);
      g.flops = 2.0 * m * double(sh.n) * sh.k;
      report(o, g);
#if KMAMBA_ENABLE_CUDA
      if constexpr (std::is_same_v<Exec, Kokkos::Cuda>) {
        Measurement c = g;
        c.name = "gemm A*B^T cublas";
        c.seconds = warm_median_seconds(exec, o.repeats, [&] {
          kmamba::impl::cublas_gemm_row_major(exec.cuda_stream(), false, true, m, sh.n, sh.k, 1.0f, A.data(), sh.k,
                                              B.data(), sh.k, 0.0f, C.data(), sh.n);
        });
        report(o, c);
      }
#endif
    }
  }
}

template <class Exec>
void run_space(const Options& o) {
  const std::vector<std::pair<std::string, std::function<void(const Options&)>>> cases = {
      {"ssd", bench_ssd<Exec>},
      {"mamba3_siso", bench_mamba3_siso<Exec>},
      {"mamba3_mimo", bench_mamba3_mimo<Exec>},
      {"selective_scan", bench_selective_scan<Exec>},
      {"gemm_few_rows", bench_gemm_few_rows<Exec>}};
  bool ran = false;
  for (const auto& c : cases) {
    if (!o.only_case.empty() && o.only_case != c.first) continue;
    c.second(o);
    ran = true;
  }
  KMAMBA_REQUIRE(ran, "kmamba-perf: unknown --case '" << o.only_case
                                                      << "' (cases: ssd, mamba3_siso, selective_scan, gemm_few_rows)");
}

// The rows as JSON into `file`, committed: what was run (space, options, the ceilings of the floor)
// and per row the measured median with its derived rates, the floor and the ratio to it.
void write_json(kmamba::OutputFile& file, const Options& o, const std::string& space,
                const std::vector<Measurement>& rows) {
  nlohmann::json list = nlohmann::json::array();
  for (const Measurement& m : rows) {
    const double floor_s = floor_seconds(m);
    list.push_back({{"case", m.name},
                    {"shape", m.shape},
                    {"seconds", m.seconds},
                    {"bytes", m.bytes},
                    {"flops", m.flops},
                    {"exps", m.exps},
                    {"gb_per_s", m.bytes / m.seconds * 1e-9},
                    {"tflop_per_s", m.flops / m.seconds * 1e-12},
                    {"floor_seconds", floor_s},
                    {"ratio_to_floor", m.seconds / floor_s}});
    if (m.scan_units > 0) list.back()["scan_units"] = m.scan_units;
  }
  const nlohmann::json doc = {{"tool", "kmamba-perf"},
                              {"version", KMAMBA_VERSION_STRING},
                              {"space", space},
                              {"small", o.small},
                              {"repeats", o.repeats},
                              {"chunk", o.chunk},
                              {"precision", o.precision},
                              {"ceilings",
                               {{"bytes_per_s", hbm_bytes_per_s},
                                {"fp32_flop_per_s", fp32_flop_per_s},
                                {"tf32_flop_per_s", tf32_flop_per_s},
                                {"exp_per_s", exp_per_s}}},
                              {"rows", list}};
  file.write(doc.dump(2) + "\n");
  file.commit();
}

const char* const description =
    "Prints one row per case: shape, median time, achieved GB/s and GFLOP/s, the H200 floor and the ratio to it.";

void declare(CLI::App& cli, Options& o) {
  cli.add_option("--case", o.only_case, "only this case (default: all)")
      ->type_name("NAME")
      ->check(kmamba::app::one_of({"ssd", "mamba3_siso", "mamba3_mimo", "selective_scan", "gemm_few_rows"}));
  kmamba::app::add_space_option(cli, o.space, "the execution space (default: the build's default)");
  cli.add_flag("--small", o.small,
               "shapes that run in seconds on a 2-core CPU (default: the H200 shapes of docs/performance.md §3)");
  cli.add_option("--repeats", o.repeats, "timed runs per case; the median is reported (default 10)")
      ->type_name("R")
      ->check(kmamba::app::integer_in(1, 1000000));
  cli.add_option("--precision", o.precision,
                 "the SSD / Mamba-3 chunk products: exact fp32, TF32 on the tensor cores, bf16 (the SSD's fused "
                 "forward), or all (default)")
      ->type_name("P")
      ->check(kmamba::app::one_of({"fp32", "tf32", "bf16", "all"}));
  cli.add_option("--chunk", o.chunk,
                 "chunk length of the SSD, Mamba-3 SISO and MIMO (default: the reference shapes', 256, 64 and 16); the "
                 "result is the same function of the inputs, the work is not")
      ->type_name("Q")
      ->check(kmamba::app::integer_in(1, kmamba::app::int_max));
  cli.add_option("--json", o.json,
                 "also write the rows to FILE as JSON (an object with the configuration and a "
                 "\"rows\" array)")
      ->type_name("FILE");
}

int run(Options& o) {
  // Opened before the benchmarks run, so that an unwritable path costs nothing.
  std::unique_ptr<kmamba::OutputFile> json;
  if (!o.json.empty()) json = std::make_unique<kmamba::OutputFile>(o.json, "kmamba-perf: --json");
  kmamba::print_configuration(std::cout);
  std::printf("%-28s %-34s %13s %14s %17s   %s\n", "case", "shape", "median", "bandwidth", "arithmetic",
              "H200 floor and ratio");
  std::vector<Measurement> rows;
  o.rows = &rows;
  const std::string space = kmamba::app::on_space(o.space, [&](auto exec) {
    run_space<decltype(exec)>(o);
    return std::string(decltype(exec)::name());
  });
  if (json) write_json(*json, o, space, rows);
  return kmamba::app::exit_done;
}

}  // namespace

int main(int argc, char** argv) {
  kmamba::keep_freed_host_memory();  // steps reuse freed host memory (KMAMBA_HOST_MALLOC_KEEP=0: off)
  CLI::App cli{description, "kmamba-perf"};
  kmamba::app::configure(cli);
  Options o;
  declare(cli, o);
  return kmamba::app::run_app(argc, argv, cli, {}, [&](kmamba::app::Runtime&) { return run(o); });
}
