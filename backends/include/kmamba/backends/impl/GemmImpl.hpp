// Internals of kmamba/backends/Gemm.hpp: the per-backend GEMM dispatch.
#ifndef KMAMBA_BACKENDS_IMPL_GEMMIMPL_HPP
#define KMAMBA_BACKENDS_IMPL_GEMMIMPL_HPP

#include <kmamba/Config.hpp>
#include <kmamba/core/Tensor.hpp>

#include <KokkosBlas1_scal.hpp>
#include <KokkosBlas3_gemm.hpp>
#include <Kokkos_Core.hpp>

namespace kmamba {
namespace impl {

/// C(i, j) = alpha · Σ_p A(i, p)·B(j, p) + beta · C(i, j) (C ignored when beta = 0) for a matrix A
/// of few rows: one work item per column j reads row j of B once for every row of A, so B streams
/// from memory once. Eight partial sums per dot product (combined pairwise) let the compiler
/// vectorise the inner loop.
template <class MemorySpace>
struct GemmFewRowsFunctor {
  ConstTensor2<float, MemorySpace> A;  // (m, k)
  ConstTensor2<float, MemorySpace> B;  // (n, k)
  Tensor2<float, MemorySpace> C;       // (m, n)
  float alpha, beta;

  KOKKOS_INLINE_FUNCTION void operator()(const int j) const {
    const int m = static_cast<int>(A.extent(0)), k = static_cast<int>(A.extent(1));
    const float* b = &B(j, 0);
    for (int i = 0; i < m; ++i) {
      const float* a = &A(i, 0);
      float s[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
      int p = 0;
      for (; p + 8 <= k; p += 8) {
        for (int u = 0; u < 8; ++u) s[u] += a[p + u] * b[p + u];
      }
      for (; p < k; ++p) s[0] += a[p] * b[p];
      const float dot = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
      C(i, j) = alpha * dot + (beta == 0.0f ? 0.0f : beta * C(i, j));
    }
  }
};

/// The most rows of A for which C = A·Bᵀ runs a few-rows kernel (GemmFewRowsFunctor on hosts,
/// gemm_few_rows_cuda on CUDA): the BLAS packs all of B on every call, a copy of the whole
/// weight matrix for a decode step's few tokens, and cuBLAS spreads it over few blocks.
constexpr std::size_t gemm_few_rows = 16;

// Host backends (and any space without a vendor path): Kokkos Kernels on the execution space
// type of `exec`, except C = A·Bᵀ with at most gemm_few_rows rows in A (decode steps), which runs
// GemmFewRowsFunctor. Kokkos Kernels 3.4 has no execution-space-instance argument, so the call is
// ordered after the work already submitted to `exec` by fencing it first.
template <class ExecSpace, class MemorySpace>
struct GemmImpl {
  static void run(const ExecSpace& exec, bool trans_a, bool trans_b, float alpha,
                  const ConstTensor2<float, MemorySpace>& A, const ConstTensor2<float, MemorySpace>& B, float beta,
                  const Tensor2<float, MemorySpace>& C) {
    using Device = Kokkos::Device<ExecSpace, MemorySpace>;
    using Unmanaged = Kokkos::MemoryTraits<Kokkos::Unmanaged>;
    const Kokkos::View<const float**, Kokkos::LayoutRight, Device, Unmanaged> a(A.data(), A.extent(0), A.extent(1));
    const Kokkos::View<const float**, Kokkos::LayoutRight, Device, Unmanaged> b(B.data(), B.extent(0), B.extent(1));
    const Kokkos::View<float**, Kokkos::LayoutRight, Device, Unmanaged> c(C.data(), C.extent(0), C.extent(1));
    exec.fence();
    if (a.extent(0) * a.extent(1) == 0) {  // k == 0: C = beta · C
      if (beta == 0.0f) {
        Kokkos::deep_copy(c, 0.0f);
      } else {
        KokkosBlas::scal(c, beta, c);
      }
      return;
    }
    if (!trans_a && trans_b && a.extent(0) <= gemm_few_rows) {
      Kokkos::parallel_for("kmamba::gemm::few_rows", Kokkos::RangePolicy<ExecSpace>(exec, 0, static_cast<int>(c.extent(1))),
                           GemmFewRowsFunctor<MemorySpace>{A, B, C, alpha, beta});
      exec.fence();
      return;
    }
    KokkosBlas::gemm(trans_a ? "T" : "N", trans_b ? "T" : "N", alpha, a, b, beta, c);
  }
};

#if KMAMBA_ENABLE_CUDA
/// C = alpha · A·Bᵀ + beta · C (C ignored when beta = 0) on `stream` for 1 ≤ m ≤ 16, all
/// row-major and contiguous: A (m, k), B (n, k), C (m, n). A warp per column j streams row j of B
/// once (16-byte loads when rows are 16-byte aligned, several loads in flight per lane) against
/// all m rows of A (read through the cache), and reduces m dot products with shuffles. It is the
/// decode step's projection at small batch, which cuBLAS SGEMM spreads over few blocks.
void gemm_few_rows_cuda(cudaStream_t stream, int m, int n, int k, float alpha, const float* A, const float* B,
                        float beta, float* C);

/// The most rows for which the CUDA GEMM takes gemm_few_rows_cuda rather than cuBLAS. Measured on
/// the H200 (perf/RESULTS.md, 2026-12-03): at m = 1 it beats cuBLAS SGEMM on every decode shape
/// (in_proj 13 vs 17 µs, head 50 vs 55 µs); at m = 16 cuBLAS wins (head 122 vs 309 µs). The cut
/// at 4 lies between the two measured points (`kmamba-perf --case gemm_few_rows` times m = 4 too).
constexpr int gemm_few_rows_cuda_max = 4;

// C = alpha op(A) op(B) + beta C in row-major is Cᵀ = alpha op(B)ᵀ op(A)ᵀ + beta Cᵀ in cuBLAS's
// column-major view of the same memory.
void cublas_sgemm_row_major(cudaStream_t stream, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                            const float* A, int lda, const float* B, int ldb, float beta, float* C, int ldc);

template <class MemorySpace>
struct GemmImpl<Kokkos::Cuda, MemorySpace> {
  static void run(const Kokkos::Cuda& exec, bool trans_a, bool trans_b, float alpha,
                  const ConstTensor2<float, MemorySpace>& A, const ConstTensor2<float, MemorySpace>& B, float beta,
                  const Tensor2<float, MemorySpace>& C) {
    const int m = static_cast<int>(C.extent(0)), n = static_cast<int>(C.extent(1));
    const int k = static_cast<int>(trans_a ? A.extent(0) : A.extent(1));
    if (!trans_a && trans_b && k > 0 && m <= gemm_few_rows_cuda_max) {
      gemm_few_rows_cuda(exec.cuda_stream(), m, n, k, alpha, A.data(), B.data(), beta, C.data());
      return;
    }
    const auto ld = [](std::size_t columns) { return columns > 0 ? static_cast<int>(columns) : 1; };
    cublas_sgemm_row_major(exec.cuda_stream(), trans_a, trans_b, m, n, k, alpha, A.data(), ld(A.extent(1)), B.data(),
                           ld(B.extent(1)), beta, C.data(), ld(C.extent(1)));
  }
};
#endif

}  // namespace impl
}  // namespace kmamba

#endif
