// Status-code checks for the CUDA runtime, cuBLAS and NCCL (KMAMBA_*_CHECK), on top of
// KMAMBA_VENDOR_CHECK from kmamba/core/Error.hpp. Only compiled in where the library exists.
#ifndef KMAMBA_BACKENDS_VENDORCHECKS_HPP
#define KMAMBA_BACKENDS_VENDORCHECKS_HPP

#include <kmamba/Config.hpp>
#include <kmamba/core/Error.hpp>

#include <string>

#if KMAMBA_ENABLE_CUDA
#include <cublas_v2.h>
#include <cuda_runtime.h>

namespace kmamba {
namespace impl {
inline std::string describe_cuda_status(cudaError_t status) {
  return std::string(cudaGetErrorName(status)) + ": " + cudaGetErrorString(status);
}
std::string describe_cublas_status(cublasStatus_t status);
}  // namespace impl
}  // namespace kmamba

#define KMAMBA_CUDA_CHECK(expr) KMAMBA_VENDOR_CHECK("CUDA", expr, cudaSuccess, ::kmamba::impl::describe_cuda_status)
#define KMAMBA_CUBLAS_CHECK(expr) \
  KMAMBA_VENDOR_CHECK("cuBLAS", expr, CUBLAS_STATUS_SUCCESS, ::kmamba::impl::describe_cublas_status)
#endif

#if KMAMBA_ENABLE_NCCL
#include <nccl.h>

namespace kmamba {
namespace impl {
inline std::string describe_nccl_status(ncclResult_t status) { return ncclGetErrorString(status); }
}  // namespace impl
}  // namespace kmamba

#define KMAMBA_NCCL_CHECK(expr) KMAMBA_VENDOR_CHECK("NCCL", expr, ncclSuccess, ::kmamba::impl::describe_nccl_status)
#endif

#endif
