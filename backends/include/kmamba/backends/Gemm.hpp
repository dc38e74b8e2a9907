// Dense matrix products for the projections: C = alpha · op(A) · op(B) + beta · C on row-major
// fp32 matrices. CUDA goes through cuBLAS on the caller's stream; host backends through Kokkos
// Kernels (OpenBLAS where the host flavour was built with it, the native Kokkos Kernels code
// otherwise), except A·Bᵀ for an A of few rows (a decode step's tokens against a weight matrix),
// which a kmamba kernel computes reading B once (on CUDA: a warp per column of C, up to 4 rows).
//
// The optional MatmulPrecision (kmamba/core/MatmulPrecision.hpp) selects the arithmetic. The
// matrices stay fp32 in memory and the products and sums are fp32 in every mode; TensorFloat32
// and BFloat16 round each operand element to TF32 / bf16 before it is multiplied, so C is the
// fp32 sum of exact products of rounded operands, except where cuBLAS chooses (below):
// - Cuda: Float32 is cublasSgemm. BFloat16 rounds both operands to bf16 (to nearest even) into a
//   device buffer kept between calls (grown to the largest pair, released at Kokkos::finalize) and
//   multiplies them with cublasGemmEx (bf16 operands, CUBLAS_COMPUTE_32F, fp32 C): the mode's
//   numerics up to the order of the fp32 sums, at half the operand bytes of the product.
//   TensorFloat32 is cublasGemmEx on the fp32 matrices with compute type
//   CUBLAS_COMPUTE_32F_FAST_TF32, which permits cuBLAS to convert the operands and multiply on the
//   tensor cores without prescribing it (on the H200 a single row ran in full fp32), so on that
//   path the mode guarantees only its error bound, |C − exact| ≤ (2u + u²)·Σ|α·a·b| + fp32
//   summation error (u = 2⁻¹¹). The few-row kernel rounds each operand as it loads it
//   (round_operand) and still multiplies on the CUDA cores: it is memory bound (it streams an
//   fp32 weight matrix for a few rows), so the rounding only keeps its numerics those of the mode.
// - Host backends emulate the mode exactly: a kernel ("kmamba::gemm::round_operands") writes
//   rounded copies of A and B into a workspace kept between calls ("kmamba::gemm::rounded_operands",
//   grown as needed, released at Kokkos::finalize) and the fp32 GEMM runs on them. The results are
//   those of the mode's numerics, and no faster than Float32.
#ifndef KMAMBA_BACKENDS_GEMM_HPP
#define KMAMBA_BACKENDS_GEMM_HPP

#include <kmamba/Config.hpp>
#include <kmamba/core/MatmulPrecision.hpp>
#include <kmamba/core/Profiling.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/backends/impl/GemmImpl.hpp>

#include <Kokkos_Core.hpp>

namespace kmamba {

/// Whether gemm uses a matrix as given or transposed.
enum class Transpose { No, Yes };

/// C = alpha · op(A) · op(B) + beta · C, with op(A) of shape (m, k), op(B) of shape (k, n) and
/// C of shape (m, n). With beta = 0, C's previous contents are ignored (NaN in C does not
/// propagate). Ordered on `exec`: on CUDA it runs on exec's stream and returns without waiting;
/// on host backends it returns when C is written. `precision` rounds the operands as the file
/// comment says (Float32, the default, multiplies them exactly). Throws kmamba::UserError naming
/// the shapes if they do not agree.
template <class ExecutionSpace, class MemorySpace>
void gemm(const ExecutionSpace& exec, Transpose trans_a, Transpose trans_b, float alpha,
          const ConstTensor2<float, MemorySpace>& A,         // (m, k), or (k, m) when trans_a
          const ConstTensor2<float, MemorySpace>& B,         // (k, n), or (n, k) when trans_b
          float beta, const Tensor2<float, MemorySpace>& C,  // (m, n)
          MatmulPrecision precision = MatmulPrecision::Float32) {
  const ProfilingRegion region("kmamba::gemm");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::gemm: the execution space cannot access the matrices' memory space");
  constexpr const char* function = "kmamba::gemm";
  const bool ta = trans_a == Transpose::Yes, tb = trans_b == Transpose::Yes;
  const std::int64_t m = static_cast<std::int64_t>(ta ? A.extent(1) : A.extent(0));
  const std::int64_t k = static_cast<std::int64_t>(ta ? A.extent(0) : A.extent(1));
  const std::int64_t n = static_cast<std::int64_t>(tb ? B.extent(0) : B.extent(1));
  check_shape(function, "B", B, tb ? Shape{n, k} : Shape{k, n}, tb ? "(n, k) with k from A" : "(k, n) with k from A");
  check_shape(function, "C", C, {m, n}, "(m, n) with m from A and n from B");
  check_allocated(function, "A", A);
  check_allocated(function, "B", B);
  check_allocated(function, "C", C);
  if (m == 0 || n == 0) return;
  impl::GemmImpl<ExecutionSpace, MemorySpace>::run(exec, ta, tb, alpha, A, B, beta, C, precision);
}

template <class MemorySpace>
void gemm(Transpose trans_a, Transpose trans_b, float alpha, const ConstTensor2<float, MemorySpace>& A,
          const ConstTensor2<float, MemorySpace>& B, float beta, const Tensor2<float, MemorySpace>& C,
          MatmulPrecision precision = MatmulPrecision::Float32) {
  gemm(typename Tensor2<float, MemorySpace>::execution_space(), trans_a, trans_b, alpha, A, B, beta, C, precision);
}

}  // namespace kmamba

#endif
