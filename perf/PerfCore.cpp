// Core-layer benchmarks: counter-based random fills (compute-bound on host, write-bound on GPU).
// Reports bytes written per second; the floor on a GPU is the device write bandwidth.
#include <kmamba/KMamba.hpp>

#include <benchmark/benchmark.h>

namespace {

template <class Exec, class T>
void BM_FillNormal(benchmark::State& state) {
  using Mem = typename Exec::memory_space;
  const auto n = static_cast<std::size_t>(state.range(0));
  auto x = kmamba::allocate_uninitialized<kmamba::Tensor1<T, Mem>>("kmamba::perf::x", n);
  const Exec exec;
  std::uint64_t seed = 1;
  for (auto _ : state) {
    kmamba::fill_normal(exec, x, seed++, 0.0f, 1.0f);
    exec.fence();
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * n * sizeof(T)));
  state.SetItemsProcessed(static_cast<std::int64_t>(state.iterations() * n));
}

#if KMAMBA_ENABLE_CUDA
BENCHMARK_TEMPLATE(BM_FillNormal, Kokkos::Cuda, float)->Arg(1 << 26)->UseRealTime();
BENCHMARK_TEMPLATE(BM_FillNormal, Kokkos::Cuda, kmamba::bf16)->Arg(1 << 26)->UseRealTime();
#endif
#if KMAMBA_HAS_OPENMP
BENCHMARK_TEMPLATE(BM_FillNormal, Kokkos::OpenMP, float)->Arg(1 << 22)->UseRealTime();
#endif
#if KMAMBA_HAS_SERIAL
BENCHMARK_TEMPLATE(BM_FillNormal, Kokkos::Serial, float)->Arg(1 << 20)->UseRealTime();
#endif

}  // namespace

int main(int argc, char** argv) {
  Kokkos::ScopeGuard kokkos(argc, argv);
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
