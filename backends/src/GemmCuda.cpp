#include <kmamba/backends/Gemm.hpp>
#include <kmamba/backends/VendorChecks.hpp>

#include <Kokkos_Core.hpp>

#include <mutex>

namespace kmamba {
namespace impl {
namespace {

// One cuBLAS handle for the process, created on first use and destroyed when Kokkos finalizes
// (before the CUDA context goes away). Calls set the caller's stream; the mutex keeps two host
// threads from racing on the handle's stream setting.
std::mutex handle_mutex;
cublasHandle_t handle = nullptr;

cublasHandle_t cublas_handle() {
  if (handle == nullptr) {
    KMAMBA_CUBLAS_CHECK(cublasCreate(&handle));
    Kokkos::push_finalize_hook([] {
      cublasDestroy(handle);
      handle = nullptr;
    });
  }
  return handle;
}

}  // namespace

void cublas_sgemm_row_major(cudaStream_t stream, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                            const float* A, int lda, const float* B, int ldb, float beta, float* C, int ldc) {
  const std::lock_guard<std::mutex> lock(handle_mutex);
  cublasHandle_t h = cublas_handle();
  KMAMBA_CUBLAS_CHECK(cublasSetStream(h, stream));
  KMAMBA_CUBLAS_CHECK(cublasSgemm(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, n, m,
                                  k, &alpha, B, ldb, A, lda, &beta, C, ldc));
}

}  // namespace impl
}  // namespace kmamba
