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
//
// An operand that several BFloat16 products share (an activation against the row blocks of a
// weight, a gradient in its two products) is rounded to bf16 once (round_to_bf16, gemm_operand) and
// multiplied by the bf16 overload, which skips the per-call rounding; the products are the same.
// A weight kept in bf16 (a decode step's weights, LanguageModel under BFloat16) multiplies an fp32
// activation through the mixed overload, which rounds only the activation: the same products again,
// with the weight read at half the bytes (on CUDA by the few-row kernel up to 4 rows).
#ifndef KMAMBA_BACKENDS_GEMM_HPP
#define KMAMBA_BACKENDS_GEMM_HPP

#include <kmamba/Config.hpp>
#include <kmamba/core/Bf16.hpp>
#include <kmamba/core/MatmulPrecision.hpp>
#include <kmamba/core/Profiling.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/backends/impl/GemmImpl.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <type_traits>

namespace kmamba {

/// Whether gemm uses a matrix as given or transposed.
enum class Transpose { No, Yes };

namespace impl {

/// Checks the shapes and allocation of a product's operands; returns whether C is empty (m or n 0).
template <class AView, class BView, class CView>
bool gemm_check(bool ta, bool tb, const AView& A, const BView& B, const CView& C) {
  constexpr const char* function = "kmamba::gemm";
  const std::int64_t m = static_cast<std::int64_t>(ta ? A.extent(1) : A.extent(0));
  const std::int64_t k = static_cast<std::int64_t>(ta ? A.extent(0) : A.extent(1));
  const std::int64_t n = static_cast<std::int64_t>(tb ? B.extent(0) : B.extent(1));
  check_shape(function, "B", B, tb ? Shape{n, k} : Shape{k, n}, tb ? "(n, k) with k from A" : "(k, n) with k from A");
  check_shape(function, "C", C, {m, n}, "(m, n) with m from A and n from B");
  check_allocated(function, "A", A);
  check_allocated(function, "B", B);
  check_allocated(function, "C", C);
  return m == 0 || n == 0;
}

}  // namespace impl

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
  const bool ta = trans_a == Transpose::Yes, tb = trans_b == Transpose::Yes;
  if (impl::gemm_check(ta, tb, A, B, C)) return;
  impl::GemmImpl<ExecutionSpace, MemorySpace>::run(exec, ta, tb, alpha, A, B, beta, C, precision);
}

/// The BFloat16 product of operands already in bf16 (round_to_bf16): C = alpha · op(A) · op(B) +
/// beta · C with fp32 sums into the fp32 C — the fp32 overload's BFloat16 mode without its
/// rounding of both operands on every call, for an operand that several products share (an
/// activation against a weight's row blocks, a gradient in both of its products). Shapes,
/// ordering and errors as the fp32 overload.
template <class ExecutionSpace, class MemorySpace>
void gemm(const ExecutionSpace& exec, Transpose trans_a, Transpose trans_b, float alpha,
          const ConstTensor2<bf16, MemorySpace>& A,            // (m, k), or (k, m) when trans_a
          const ConstTensor2<bf16, MemorySpace>& B,            // (k, n), or (n, k) when trans_b
          float beta, const Tensor2<float, MemorySpace>& C) {  // (m, n)
  const ProfilingRegion region("kmamba::gemm");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::gemm: the execution space cannot access the matrices' memory space");
  const bool ta = trans_a == Transpose::Yes, tb = trans_b == Transpose::Yes;
  if (impl::gemm_check(ta, tb, A, B, C)) return;
  impl::GemmImpl<ExecutionSpace, MemorySpace>::run_bf16(exec, ta, tb, alpha, A, B, beta, C);
}

/// The BFloat16 product of an fp32 A and a B already in bf16 (a weight kept in bf16): A is rounded
/// to bf16 as the fp32 overload's BFloat16 mode rounds it, the sums are fp32, so C is that mode's
/// product of the same matrices, with B read at half the bytes. Shapes, ordering and errors as the
/// fp32 overload.
template <class ExecutionSpace, class MemorySpace>
void gemm(const ExecutionSpace& exec, Transpose trans_a, Transpose trans_b, float alpha,
          const ConstTensor2<float, MemorySpace>& A,           // (m, k), or (k, m) when trans_a
          const ConstTensor2<bf16, MemorySpace>& B,            // (k, n), or (n, k) when trans_b
          float beta, const Tensor2<float, MemorySpace>& C) {  // (m, n)
  const ProfilingRegion region("kmamba::gemm");
  static_assert(Kokkos::SpaceAccessibility<ExecutionSpace, MemorySpace>::accessible,
                "kmamba::gemm: the execution space cannot access the matrices' memory space");
  const bool ta = trans_a == Transpose::Yes, tb = trans_b == Transpose::Yes;
  if (impl::gemm_check(ta, tb, A, B, C)) return;
  impl::GemmImpl<ExecutionSpace, MemorySpace>::run_mixed(exec, ta, tb, alpha, A, B, beta, C);
}

/// `in` rounded to bf16 (to nearest, ties to even) into `out`: the operand of several bf16
/// products rounded once. Ordered on `exec`. Throws kmamba::UserError if the shapes differ.
template <class ExecutionSpace, class MemorySpace>
void round_to_bf16(const ExecutionSpace& exec, const ConstTensor2<float, MemorySpace>& in,  // (rows, cols)
                   const Tensor2<bf16, MemorySpace>& out) {                                 // (rows, cols)
  const ProfilingRegion region("kmamba::round_to_bf16");
  check_shape("kmamba::round_to_bf16", "out", out, shape_of(in), "(rows, cols) of in");
  if (in.span() == 0) return;
  check_allocated("kmamba::round_to_bf16", "in", in);
  check_allocated("kmamba::round_to_bf16", "out", out);
  impl::GemmImpl<ExecutionSpace, MemorySpace>::round_to_bf16(exec, in, out);
}

/// A matrix that several products use, in the form they multiply: under MatmulPrecision::BFloat16
/// its bf16 copy, rounded once (gemm_operand), otherwise the fp32 matrix itself. Rows of it are
/// operands too (a weight's row blocks).
template <class MemorySpace>
struct GemmOperand {
  ConstTensor2<float, MemorySpace> values;  // (rows, cols), fp32
  ConstTensor2<bf16, MemorySpace> rounded;  // (rows, cols), the bf16 copy under BFloat16

  /// Rows [first, first + count).
  GemmOperand rows(std::int64_t first, std::int64_t count) const {
    const auto block = [&](const auto& m) {
      using View = std::decay_t<decltype(m)>;
      return m.is_allocated() ? View(m.data() + first * static_cast<std::int64_t>(m.extent(1)),
                                     static_cast<std::size_t>(count), m.extent(1))
                              : View();
    };
    return {block(values), block(rounded)};
  }
};

/// `m` as the operand of several products in `precision` (bf16 rounded once for BFloat16). The bf16
/// copy goes to `storage` from element `offset` on when it is given (several operands in one
/// allocation: a release of device memory may wait for the device), else to an allocation of its
/// own. Throws kmamba::UserError if `storage` is too short.
template <class ExecutionSpace, class MemorySpace>
GemmOperand<MemorySpace> gemm_operand(const ExecutionSpace& exec,
                                      const ConstTensor2<float, MemorySpace>& m,  // (rows, cols)
                                      MatmulPrecision precision,
                                      const Tensor1<bf16, MemorySpace>& storage = {},  // (≥ offset + rows·cols)
                                      std::size_t offset = 0) {
  GemmOperand<MemorySpace> operand{m, {}};
  if (precision != MatmulPrecision::BFloat16) return operand;
  Tensor2<bf16, MemorySpace> copy;
  if (storage.is_allocated()) {
    KMAMBA_REQUIRE(offset + m.span() <= storage.extent(0), "kmamba::gemm_operand: storage holds "
                                                               << storage.extent(0) << " values, a (" << m.extent(0)
                                                               << ", " << m.extent(1) << ") operand from " << offset
                                                               << " needs " << offset + m.span());
    copy = Tensor2<bf16, MemorySpace>(storage.data() + offset, m.extent(0), m.extent(1));
  } else {
    copy = allocate_uninitialized<Tensor2<bf16, MemorySpace>>("kmamba::gemm::bf16_operand", m.extent(0), m.extent(1));
  }
  round_to_bf16(exec, m, copy);
  operand.rounded = copy;
  return operand;
}

/// gemm on shared operands: their bf16 copies when both have one, else the fp32 matrices in
/// `precision`.
template <class ExecutionSpace, class MemorySpace>
void gemm(const ExecutionSpace& exec, Transpose trans_a, Transpose trans_b, float alpha,
          const GemmOperand<MemorySpace>& A,                 // (m, k), or (k, m) when trans_a
          const GemmOperand<MemorySpace>& B,                 // (k, n), or (n, k) when trans_b
          float beta, const Tensor2<float, MemorySpace>& C,  // (m, n)
          MatmulPrecision precision) {
  if (A.rounded.is_allocated() && B.rounded.is_allocated()) {
    gemm(exec, trans_a, trans_b, alpha, A.rounded, B.rounded, beta, C);
  } else {
    gemm(exec, trans_a, trans_b, alpha, A.values, B.values, beta, C, precision);
  }
}

template <class MemorySpace>
void gemm(Transpose trans_a, Transpose trans_b, float alpha, const ConstTensor2<float, MemorySpace>& A,
          const ConstTensor2<float, MemorySpace>& B, float beta, const Tensor2<float, MemorySpace>& C,
          MatmulPrecision precision = MatmulPrecision::Float32) {
  gemm(typename Tensor2<float, MemorySpace>::execution_space(), trans_a, trans_b, alpha, A, B, beta, C, precision);
}

}  // namespace kmamba

#endif
