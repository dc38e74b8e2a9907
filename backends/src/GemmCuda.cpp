#include <kmamba/backends/Gemm.hpp>
#include <kmamba/backends/VendorChecks.hpp>

#include <Kokkos_Core.hpp>

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <type_traits>

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

// The bf16 copies of a BFloat16 GEMM's operands: one device buffer for the process (the handle's
// mutex guards it), grown to the largest pair asked for and released when Kokkos finalizes. A
// GEMM's conversions and product are ordered on its stream, so the next GEMM on that stream may
// overwrite the buffer; a GEMM on another stream first waits for the last user's work.
struct Bf16Operands {
  __nv_bfloat16* data = nullptr;
  std::size_t elements = 0;
  cudaStream_t last_stream = nullptr;
  cudaEvent_t last_use = nullptr;
};
Bf16Operands bf16_operands;

// At least `elements` bf16 values for work on `stream` (handle_mutex held).
__nv_bfloat16* bf16_operand_space(cudaStream_t stream, std::size_t elements) {
  Bf16Operands& buffer = bf16_operands;
  if (buffer.last_use == nullptr) {
    KMAMBA_CUDA_CHECK(cudaEventCreateWithFlags(&buffer.last_use, cudaEventDisableTiming));
    Kokkos::push_finalize_hook([] {
      cudaFree(bf16_operands.data);
      cudaEventDestroy(bf16_operands.last_use);
      bf16_operands = Bf16Operands();
    });
  }
  if (buffer.data != nullptr && buffer.last_stream != stream) {
    KMAMBA_CUDA_CHECK(cudaEventRecord(buffer.last_use, buffer.last_stream));
    KMAMBA_CUDA_CHECK(cudaStreamWaitEvent(stream, buffer.last_use, 0));
  }
  if (buffer.elements < elements) {
    KMAMBA_CUDA_CHECK(cudaStreamSynchronize(stream));
    KMAMBA_CUDA_CHECK(cudaFree(buffer.data));
    buffer.data = nullptr;
    buffer.elements = 0;
    KMAMBA_CUDA_CHECK(cudaMalloc(&buffer.data, elements * sizeof(__nv_bfloat16)));
    buffer.elements = elements;
  }
  buffer.last_stream = stream;
  return buffer.data;
}

constexpr int bf16_convert_threads = 256;

// out[i] = in[i] rounded to bf16 (to nearest even) for i < count; four elements a thread, read as
// one float4 and written as 8 bytes where `vectorised` (in 16-byte and out 8-byte aligned).
__global__ void __launch_bounds__(bf16_convert_threads)
    convert_to_bf16_kernel(const float* __restrict__ in, __nv_bfloat16* __restrict__ out, std::size_t count,
                           bool vectorised) {
  const std::size_t i = (static_cast<std::size_t>(blockIdx.x) * bf16_convert_threads + threadIdx.x) * 4;
  if (vectorised && i + 4 <= count) {
    const float4 v = *reinterpret_cast<const float4*>(in + i);
    const __nv_bfloat162 lo = __floats2bfloat162_rn(v.x, v.y), hi = __floats2bfloat162_rn(v.z, v.w);
    uint2 packed;
    packed.x = *reinterpret_cast<const unsigned int*>(&lo);
    packed.y = *reinterpret_cast<const unsigned int*>(&hi);
    *reinterpret_cast<uint2*>(out + i) = packed;
    return;
  }
  for (std::size_t e = i; e < i + 4 && e < count; ++e) out[e] = __float2bfloat16_rn(in[e]);
}

void convert_to_bf16(cudaStream_t stream, const float* in, __nv_bfloat16* out, std::size_t count) {
  if (count == 0) return;
  const bool vectorised =
      reinterpret_cast<std::uintptr_t>(in) % 16 == 0 && reinterpret_cast<std::uintptr_t>(out) % 8 == 0;
  const std::size_t blocks = (count + 4 * bf16_convert_threads - 1) / (4 * bf16_convert_threads);
  convert_to_bf16_kernel<<<static_cast<unsigned int>(blocks), bf16_convert_threads, 0, stream>>>(in, out, count,
                                                                                                 vectorised);
  KMAMBA_CUDA_CHECK(cudaGetLastError());
}

// C = alpha·op(A)·op(B) + beta·C for row-major bf16 A, B and fp32 C on the handle's stream: the
// column-major product Cᵀ = op(B)ᵀ·op(A)ᵀ with fp32 sums.
void bf16_product(cublasHandle_t h, cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k, float alpha,
                  const void* A, int lda, const void* B, int ldb, float beta, float* C, int ldc) {
  KMAMBA_CUBLAS_CHECK(cublasGemmEx(h, op_b, op_a, n, m, k, &alpha, B, CUDA_R_16BF, ldb, A, CUDA_R_16BF, lda, &beta, C,
                                   CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

constexpr int few_rows_warps_per_block = 8;

// v with each element rounded to the operand precision P (round_operand).
template <MatmulPrecision P>
__device__ float rounded(float v) {
  return round_operand(P, v);
}
template <MatmulPrecision P>
__device__ float4 rounded(float4 v) {
  return make_float4(round_operand(P, v.x), round_operand(P, v.y), round_operand(P, v.z), round_operand(P, v.w));
}

// Row i of A against row j of B for every i < m (M ≥ m, a compile-time bound so that the partial
// sums live in registers), Vec = float4 or float: each lane walks k in Vec-wide strides 32 apart.
// Every operand element is rounded to P as it is loaded.
template <int M, MatmulPrecision P, class Vec>
__device__ void few_rows_dots(int m, int k_vec, const Vec* __restrict__ a, const Vec* __restrict__ b, int lane,
                              float (&acc)[M]) {
#pragma unroll 4
  for (int p = lane; p < k_vec; p += 32) {
    const Vec bv = rounded<P>(__ldg(&b[p]));
#pragma unroll
    for (int i = 0; i < M; ++i) {
      if (i < m) {
        const Vec av = rounded<P>(__ldg(&a[static_cast<std::size_t>(i) * k_vec + p]));
        if constexpr (sizeof(Vec) == sizeof(float4)) {
          acc[i] += av.x * bv.x + av.y * bv.y + av.z * bv.z + av.w * bv.w;
        } else {
          acc[i] += av * bv;
        }
      }
    }
  }
}

// Row i of A (fp32, rounded to bf16 as loaded) against the bf16 row j of B for every i < m. With
// `vectorised` (k a multiple of 8, both rows 16-byte aligned) each lane takes eight elements at a
// time, B's as one 16-byte load; otherwise one at a time.
template <int M>
__device__ void few_rows_mixed_dots(int m, int k, bool vectorised, const float* __restrict__ a,
                                    const __nv_bfloat16* __restrict__ b, int lane, float (&acc)[M]) {
  constexpr MatmulPrecision P = MatmulPrecision::BFloat16;
  if (!vectorised) {
    for (int p = lane; p < k; p += 32) {
      const float bv = __bfloat162float(b[p]);
#pragma unroll
      for (int i = 0; i < M; ++i) {
        if (i < m) acc[i] += rounded<P>(__ldg(&a[static_cast<std::size_t>(i) * k + p])) * bv;
      }
    }
    return;
  }
#pragma unroll 4
  for (int p = lane; p < k / 8; p += 32) {
    const uint4 packed = __ldg(reinterpret_cast<const uint4*>(b) + p);
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
    float bv[8];
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 f = __bfloat1622float2(pairs[q]);
      bv[2 * q] = f.x;
      bv[2 * q + 1] = f.y;
    }
#pragma unroll
    for (int i = 0; i < M; ++i) {
      if (i < m) {
        const float4* row = reinterpret_cast<const float4*>(a + static_cast<std::size_t>(i) * k) + 2 * p;
        const float4 lo = rounded<P>(__ldg(row)), hi = rounded<P>(__ldg(row + 1));
        acc[i] += lo.x * bv[0] + lo.y * bv[1] + lo.z * bv[2] + lo.w * bv[3] + hi.x * bv[4] + hi.y * bv[5] +
                  hi.z * bv[6] + hi.w * bv[7];
      }
    }
  }
}

// The warp's m dot products of column j summed over its lanes; lane 0 writes C(i, j).
template <int M>
__device__ void few_rows_store(int m, int n, int j, int lane, float alpha, float beta, float* __restrict__ C,
                               float (&acc)[M]) {
#pragma unroll
  for (int i = 0; i < M; ++i) {
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], offset);
  }
  if (lane == 0) {
#pragma unroll
    for (int i = 0; i < M; ++i) {
      if (i < m) {
        float* c = C + static_cast<std::size_t>(i) * n + j;
        *c = alpha * acc[i] + (beta == 0.0f ? 0.0f : beta * *c);
      }
    }
  }
}

// A warp per column j of C: its m dot products (B fp32 with operands rounded to P, or B bf16 with A
// rounded to bf16), summed over the lanes.
template <int M, MatmulPrecision P, class BType>
__global__ void __launch_bounds__(32 * few_rows_warps_per_block)
    gemm_few_rows_kernel(int m, int n, int k, float alpha, const float* __restrict__ A, const BType* __restrict__ B,
                         float beta, float* __restrict__ C, bool vectorised) {
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int j = static_cast<int>(blockIdx.x) * few_rows_warps_per_block + static_cast<int>(threadIdx.x) / 32;
  if (j >= n) return;
  float acc[M];
#pragma unroll
  for (int i = 0; i < M; ++i) acc[i] = 0.0f;
  const BType* b = B + static_cast<std::size_t>(j) * k;
  if constexpr (std::is_same_v<BType, __nv_bfloat16>) {
    few_rows_mixed_dots<M>(m, k, vectorised, A, b, lane, acc);
  } else if (vectorised) {
    few_rows_dots<M, P>(m, k / 4, reinterpret_cast<const float4*>(A), reinterpret_cast<const float4*>(b), lane, acc);
  } else {
    few_rows_dots<M, P>(m, k, A, b, lane, acc);
  }
  few_rows_store<M>(m, n, j, lane, alpha, beta, C, acc);
}

// Rows of both operands 16-byte aligned and k a multiple of the elements of a 16-byte load of B.
template <class BType>
bool few_rows_vectorised(int k, const float* A, const BType* B) {
  constexpr int per_load = 16 / static_cast<int>(sizeof(BType));
  return k % per_load == 0 && reinterpret_cast<std::uintptr_t>(A) % 16 == 0 &&
         reinterpret_cast<std::uintptr_t>(B) % 16 == 0;
}

template <int M, MatmulPrecision P, class BType>
void launch_few_rows(cudaStream_t stream, int m, int n, int k, float alpha, const float* A, const BType* B, float beta,
                     float* C) {
  const int blocks = (n + few_rows_warps_per_block - 1) / few_rows_warps_per_block;
  gemm_few_rows_kernel<M, P, BType><<<blocks, 32 * few_rows_warps_per_block, 0, stream>>>(m, n, k, alpha, A, B, beta, C,
                                                                                          few_rows_vectorised(k, A, B));
  KMAMBA_CUDA_CHECK(cudaGetLastError());
}

template <MatmulPrecision P, class BType>
void few_rows_in(cudaStream_t stream, int m, int n, int k, float alpha, const float* A, const BType* B, float beta,
                 float* C) {
  if (m == 1) {
    launch_few_rows<1, P>(stream, m, n, k, alpha, A, B, beta, C);
  } else if (m <= 2) {
    launch_few_rows<2, P>(stream, m, n, k, alpha, A, B, beta, C);
  } else if (m <= 4) {
    launch_few_rows<4, P>(stream, m, n, k, alpha, A, B, beta, C);
  } else if (m <= 8) {
    launch_few_rows<8, P>(stream, m, n, k, alpha, A, B, beta, C);
  } else {
    launch_few_rows<16, P>(stream, m, n, k, alpha, A, B, beta, C);
  }
}

}  // namespace

void gemm_few_rows_cuda(cudaStream_t stream, int m, int n, int k, float alpha, const float* A, const float* B,
                        float beta, float* C, MatmulPrecision precision) {
  KMAMBA_ASSERT(m >= 1 && m <= static_cast<int>(gemm_few_rows) && n >= 1 && k >= 1,
                "gemm_few_rows_cuda: m = " << m << ", n = " << n << ", k = " << k);
  switch (precision) {
    case MatmulPrecision::Float32:
      few_rows_in<MatmulPrecision::Float32>(stream, m, n, k, alpha, A, B, beta, C);
      return;
    case MatmulPrecision::TensorFloat32:
      few_rows_in<MatmulPrecision::TensorFloat32>(stream, m, n, k, alpha, A, B, beta, C);
      return;
    case MatmulPrecision::BFloat16:
      few_rows_in<MatmulPrecision::BFloat16>(stream, m, n, k, alpha, A, B, beta, C);
      return;
  }
  KMAMBA_ASSERT(false, "gemm_few_rows_cuda: unknown MatmulPrecision " << static_cast<int>(precision));
}

void cublas_gemm_row_major(cudaStream_t stream, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                           const float* A, int lda, const float* B, int ldb, float beta, float* C, int ldc,
                           MatmulPrecision precision) {
  const std::lock_guard<std::mutex> lock(handle_mutex);
  cublasHandle_t h = cublas_handle();
  KMAMBA_CUBLAS_CHECK(cublasSetStream(h, stream));
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (precision == MatmulPrecision::Float32) {
    KMAMBA_CUBLAS_CHECK(cublasSgemm(h, op_b, op_a, n, m, k, &alpha, B, ldb, A, lda, &beta, C, ldc));
    return;
  }
  if (precision == MatmulPrecision::TensorFloat32) {
    KMAMBA_CUBLAS_CHECK(cublasGemmEx(h, op_b, op_a, n, m, k, &alpha, B, CUDA_R_32F, ldb, A, CUDA_R_32F, lda, &beta, C,
                                     CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT));
    return;
  }
  // BFloat16: both operands rounded to bf16 into the shared buffer (A first, B from a 16-byte
  // boundary), then a bf16 × bf16 product with fp32 sums and an fp32 C.
  // (k = 0: both operands are empty, and their leading dimensions are placeholders.)
  const std::size_t a_count = k == 0 ? 0 : static_cast<std::size_t>(trans_a ? k : m) * lda;
  const std::size_t b_count = k == 0 ? 0 : static_cast<std::size_t>(trans_b ? n : k) * ldb;
  const std::size_t b_offset = (a_count + 7) / 8 * 8;
  __nv_bfloat16* const operands = bf16_operand_space(stream, b_offset + b_count);
  convert_to_bf16(stream, A, operands, a_count);
  convert_to_bf16(stream, B, operands + b_offset, b_count);
  bf16_product(h, op_a, op_b, m, n, k, alpha, operands, lda, operands + b_offset, ldb, beta, C, ldc);
}

void gemm_few_rows_mixed_cuda(cudaStream_t stream, int m, int n, int k, float alpha, const float* A, const void* B,
                              float beta, float* C) {
  KMAMBA_ASSERT(m >= 1 && m <= static_cast<int>(gemm_few_rows) && n >= 1 && k >= 1,
                "gemm_few_rows_mixed_cuda: m = " << m << ", n = " << n << ", k = " << k);
  few_rows_in<MatmulPrecision::BFloat16>(stream, m, n, k, alpha, A, static_cast<const __nv_bfloat16*>(B), beta, C);
}

void cublas_gemm_mixed_row_major(cudaStream_t stream, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                                 const float* A, int lda, const void* B, int ldb, float beta, float* C, int ldc) {
  const std::lock_guard<std::mutex> lock(handle_mutex);
  cublasHandle_t h = cublas_handle();
  KMAMBA_CUBLAS_CHECK(cublasSetStream(h, stream));
  // A's bf16 copy lives in stream-ordered memory of its own, not in the buffer the BFloat16 products
  // share: a decode step recorded into a graph (StepGraph, on a stream of its own that goes with the
  // graph) then owns its allocation as graph memory nodes instead of a pointer into a buffer that
  // may grow, or serve another stream, before the graph replays.
  const std::size_t a_count = k == 0 ? 0 : static_cast<std::size_t>(trans_a ? k : m) * lda;
  void* a_rounded = nullptr;
  if (a_count > 0) KMAMBA_CUDA_CHECK(cudaMallocAsync(&a_rounded, a_count * sizeof(__nv_bfloat16), stream));
  convert_to_bf16(stream, A, static_cast<__nv_bfloat16*>(a_rounded), a_count);
  bf16_product(h, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, alpha, a_rounded,
               lda, B, ldb, beta, C, ldc);
  if (a_rounded != nullptr) KMAMBA_CUDA_CHECK(cudaFreeAsync(a_rounded, stream));
}

void cublas_gemm_bf16_row_major(cudaStream_t stream, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                                const void* A, int lda, const void* B, int ldb, float beta, float* C, int ldc) {
  const std::lock_guard<std::mutex> lock(handle_mutex);
  cublasHandle_t h = cublas_handle();
  KMAMBA_CUBLAS_CHECK(cublasSetStream(h, stream));
  bf16_product(h, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k, alpha, A, lda, B,
               ldb, beta, C, ldc);
}

void round_to_bf16_cuda(cudaStream_t stream, const float* in, void* out, std::size_t count) {
  convert_to_bf16(stream, in, static_cast<__nv_bfloat16*>(out), count);
}

}  // namespace impl
}  // namespace kmamba
