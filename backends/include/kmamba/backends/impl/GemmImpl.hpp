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

// Host backends (and any space without a vendor path): Kokkos Kernels on the execution space
// type of `exec`. Kokkos Kernels 3.4 has no execution-space-instance argument, so the call is
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
    KokkosBlas::gemm(trans_a ? "T" : "N", trans_b ? "T" : "N", alpha, a, b, beta, c);
  }
};

#if KMAMBA_ENABLE_CUDA
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
    const auto ld = [](std::size_t columns) { return columns > 0 ? static_cast<int>(columns) : 1; };
    cublas_sgemm_row_major(exec.cuda_stream(), trans_a, trans_b, m, n, k, alpha, A.data(), ld(A.extent(1)), B.data(),
                           ld(B.extent(1)), beta, C.data(), ld(C.extent(1)));
  }
};
#endif

}  // namespace impl
}  // namespace kmamba

#endif
