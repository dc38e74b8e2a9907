// Internals of kmamba/backends/Gemm.hpp: the per-backend GEMM dispatch.
#ifndef KMAMBA_BACKENDS_IMPL_GEMMIMPL_HPP
#define KMAMBA_BACKENDS_IMPL_GEMMIMPL_HPP

#include <kmamba/Config.hpp>
#include <kmamba/core/Bf16.hpp>
#include <kmamba/core/MatmulPrecision.hpp>
#include <kmamba/core/Tensor.hpp>

#include <KokkosBlas1_scal.hpp>
#include <KokkosBlas3_gemm.hpp>
#include <Kokkos_Core.hpp>

#include <cstddef>
#include <mutex>

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

/// out(i) = round_operand(precision, in(i)) over flat views.
template <class MemorySpace>
struct RoundOperands {
  Kokkos::View<float*, MemorySpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> out;
  Kokkos::View<const float*, MemorySpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> in;
  MatmulPrecision precision;
  KOKKOS_INLINE_FUNCTION void operator()(const std::size_t i) const { out(i) = round_operand(precision, in(i)); }
};

/// out(i) = in(i) rounded to bf16 over flat views.
template <class MemorySpace>
struct RoundToBf16 {
  Kokkos::View<bf16*, MemorySpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> out;
  Kokkos::View<const float*, MemorySpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> in;
  KOKKOS_INLINE_FUNCTION void operator()(const std::size_t i) const { out(i) = bf16(in(i)); }
};

/// out(i) = the value of the bf16 in(i) (exact) over flat views.
template <class MemorySpace>
struct WidenBf16 {
  Kokkos::View<float*, MemorySpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> out;
  Kokkos::View<const bf16*, MemorySpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>> in;
  KOKKOS_INLINE_FUNCTION void operator()(const std::size_t i) const { out(i) = static_cast<float>(in(i)); }
};

/// The workspace of the host GEMM's rounded operand copies, one per memory space: grown to the
/// largest A and B asked for and kept between calls (a training step rounds the same shapes again
/// and again), released when Kokkos finalizes. The mutex is held for the whole GEMM that uses it.
template <class MemorySpace>
struct GemmRoundingWorkspace {
  std::mutex mutex;
  Kokkos::View<float*, MemorySpace> values;

  static GemmRoundingWorkspace& instance() {
    static GemmRoundingWorkspace workspace;
    return workspace;
  }

  /// At least `size` floats (the mutex held by the caller).
  float* reserve(std::size_t size) {
    if (values.extent(0) < size) {
      if (!values.is_allocated()) Kokkos::push_finalize_hook([] { instance().values = {}; });
      values = {};
      values = Kokkos::View<float*, MemorySpace>(
          Kokkos::view_alloc(Kokkos::WithoutInitializing, "kmamba::gemm::rounded_operands"), size);
    }
    return values.data();
  }
};

// Host backends (and any space without a vendor path): Kokkos Kernels on the execution space
// type of `exec`, except C = A·Bᵀ with at most gemm_few_rows rows in A (decode steps), which runs
// GemmFewRowsFunctor. Kokkos Kernels 3.4 has no execution-space-instance argument, so the call is
// ordered after the work already submitted to `exec` by fencing it first. TensorFloat32 and
// BFloat16 run the same fp32 paths on rounded copies of A and B (GemmRoundingWorkspace).
template <class ExecSpace, class MemorySpace>
struct GemmImpl {
  using Device = Kokkos::Device<ExecSpace, MemorySpace>;
  using Unmanaged = Kokkos::MemoryTraits<Kokkos::Unmanaged>;

  static void run(const ExecSpace& exec, bool trans_a, bool trans_b, float alpha,
                  const ConstTensor2<float, MemorySpace>& A, const ConstTensor2<float, MemorySpace>& B, float beta,
                  const Tensor2<float, MemorySpace>& C, MatmulPrecision precision) {
    if (precision == MatmulPrecision::Float32 || A.span() == 0) {
      run_fp32(exec, trans_a, trans_b, alpha, A, B, beta, C);
      return;
    }
    const auto round = [precision](const auto& out, const auto& in) {
      return RoundOperands<MemorySpace>{out, in, precision};
    };
    run_on_copies(exec, "kmamba::gemm::round_operands", trans_a, trans_b, alpha, A, B, beta, C, round, round);
  }

  /// The product of operands already in bf16: their exact fp32 values into the workspace, then the
  /// fp32 GEMM (the BFloat16 mode's numerics).
  static void run_bf16(const ExecSpace& exec, bool trans_a, bool trans_b, float alpha,
                       const ConstTensor2<bf16, MemorySpace>& A, const ConstTensor2<bf16, MemorySpace>& B, float beta,
                       const Tensor2<float, MemorySpace>& C) {
    const auto widen = [](const auto& out, const auto& in) { return WidenBf16<MemorySpace>{out, in}; };
    run_on_copies(exec, "kmamba::gemm::widen_bf16", trans_a, trans_b, alpha, A, B, beta, C, widen, widen);
  }

  /// The BFloat16 product of an fp32 A, rounded to bf16 as the fp32 overload's BFloat16 mode
  /// rounds it, and a B already in bf16: the rounded A and the widened B into the workspace, then
  /// the fp32 GEMM.
  static void run_mixed(const ExecSpace& exec, bool trans_a, bool trans_b, float alpha,
                        const ConstTensor2<float, MemorySpace>& A, const ConstTensor2<bf16, MemorySpace>& B, float beta,
                        const Tensor2<float, MemorySpace>& C) {
    run_on_copies(
        exec, "kmamba::gemm::round_and_widen", trans_a, trans_b, alpha, A, B, beta, C,
        [](const auto& out, const auto& in) {
          return RoundOperands<MemorySpace>{out, in, MatmulPrecision::BFloat16};
        },
        [](const auto& out, const auto& in) {
          return WidenBf16<MemorySpace>{out, in};
        });
  }

  /// run_fp32 on fp32 copies of A and B in the workspace (GemmRoundingWorkspace), each written by
  /// one launch labelled `label` of the functor that `copy_a(out, in)` / `copy_b(out, in)` returns
  /// for flat views of the copy and of the operand (RoundOperands, WidenBf16).
  template <class TA, class TB, class CopyA, class CopyB>
  static void run_on_copies(const ExecSpace& exec, const char* label, bool trans_a, bool trans_b, float alpha,
                            const ConstTensor2<TA, MemorySpace>& A, const ConstTensor2<TB, MemorySpace>& B, float beta,
                            const Tensor2<float, MemorySpace>& C, const CopyA& copy_a, const CopyB& copy_b) {
    GemmRoundingWorkspace<MemorySpace>& workspace = GemmRoundingWorkspace<MemorySpace>::instance();
    const std::lock_guard<std::mutex> lock(workspace.mutex);
    const std::size_t a_size = A.span(), b_size = B.span();
    float* const copies = workspace.reserve(a_size + b_size);
    using Out = Kokkos::View<float*, MemorySpace, Unmanaged>;
    using InA = Kokkos::View<const TA*, MemorySpace, Unmanaged>;
    using InB = Kokkos::View<const TB*, MemorySpace, Unmanaged>;
    using Policy = Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::size_t>>;
    Kokkos::parallel_for(label, Policy(exec, 0, a_size), copy_a(Out(copies, a_size), InA(A.data(), a_size)));
    Kokkos::parallel_for(label, Policy(exec, 0, b_size), copy_b(Out(copies + a_size, b_size), InB(B.data(), b_size)));
    run_fp32(exec, trans_a, trans_b, alpha, ConstTensor2<float, MemorySpace>(copies, A.extent(0), A.extent(1)),
             ConstTensor2<float, MemorySpace>(copies + a_size, B.extent(0), B.extent(1)), beta, C);
  }

  static void round_to_bf16(const ExecSpace& exec, const ConstTensor2<float, MemorySpace>& in,
                            const Tensor2<bf16, MemorySpace>& out) {
    using Policy = Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::size_t>>;
    using Out = Kokkos::View<bf16*, MemorySpace, Unmanaged>;
    using In = Kokkos::View<const float*, MemorySpace, Unmanaged>;
    Kokkos::parallel_for("kmamba::round_to_bf16", Policy(exec, 0, in.span()),
                         RoundToBf16<MemorySpace>{Out(out.data(), out.span()), In(in.data(), in.span())});
  }

  static void run_fp32(const ExecSpace& exec, bool trans_a, bool trans_b, float alpha,
                       const ConstTensor2<float, MemorySpace>& A, const ConstTensor2<float, MemorySpace>& B, float beta,
                       const Tensor2<float, MemorySpace>& C) {
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
      Kokkos::parallel_for("kmamba::gemm::few_rows",
                           Kokkos::RangePolicy<ExecSpace>(exec, 0, static_cast<int>(c.extent(1))),
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
/// decode step's projection at small batch, which cuBLAS SGEMM spreads over few blocks. Every
/// operand element is rounded as it is loaded (round_operand(precision, ·)); the products and sums
/// stay on the CUDA cores in fp32 (the kernel is memory bound).
void gemm_few_rows_cuda(cudaStream_t stream, int m, int n, int k, float alpha, const float* A, const float* B,
                        float beta, float* C, MatmulPrecision precision = MatmulPrecision::Float32);

/// The most rows for which the CUDA GEMM takes gemm_few_rows_cuda rather than cuBLAS. The
/// few-row kernel streams B once at memory bandwidth, which beats cuBLAS SGEMM at one row on every
/// decode shape; with more rows its dependent FMA chains and re-reads of A make it latency bound,
/// and cuBLAS wins by 16 rows. The cut lies between the two (timings: perf/RESULTS.md,
/// 2026-12-03, "few-row GEMM kernel"; `kmamba-perf --case gemm_few_rows` times m = 1, 4 and 16).
constexpr int gemm_few_rows_cuda_max = 4;

// C = alpha op(A) op(B) + beta C in row-major is Cᵀ = alpha op(B)ᵀ op(A)ᵀ + beta Cᵀ in cuBLAS's
// column-major view of the same memory. Float32: cublasSgemm; TensorFloat32: cublasGemmEx on the
// fp32 matrices with compute type CUBLAS_COMPUTE_32F_FAST_TF32; BFloat16: the operands rounded to
// bf16 in a buffer kept between calls, then cublasGemmEx on them (tensor cores, fp32 sums).
void cublas_gemm_row_major(cudaStream_t stream, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                           const float* A, int lda, const float* B, int ldb, float beta, float* C, int ldc,
                           MatmulPrecision precision = MatmulPrecision::Float32);

/// cublas_gemm_row_major's BFloat16 product on operands already in bf16 (A and B point at
/// kmamba::bf16 values, the layout of __nv_bfloat16).
void cublas_gemm_bf16_row_major(cudaStream_t stream, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                                const void* A, int lda, const void* B, int ldb, float beta, float* C, int ldc);

/// gemm_few_rows_cuda's BFloat16 product with B already in bf16 (B points at kmamba::bf16 values):
/// A rounded to bf16 as it is loaded, B read at half the bytes.
void gemm_few_rows_mixed_cuda(cudaStream_t stream, int m, int n, int k, float alpha, const float* A, const void* B,
                              float beta, float* C);

/// cublas_gemm_row_major's BFloat16 product with B already in bf16: only A is rounded into the
/// shared buffer.
void cublas_gemm_mixed_row_major(cudaStream_t stream, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
                                 const float* A, int lda, const void* B, int ldb, float beta, float* C, int ldc);

/// out[i] = in[i] rounded to bf16 (to nearest even) for i < count, on `stream` (out points at
/// kmamba::bf16 values).
void round_to_bf16_cuda(cudaStream_t stream, const float* in, void* out, std::size_t count);

template <class MemorySpace>
struct GemmImpl<Kokkos::Cuda, MemorySpace> {
  static void run_bf16(const Kokkos::Cuda& exec, bool trans_a, bool trans_b, float alpha,
                       const ConstTensor2<bf16, MemorySpace>& A, const ConstTensor2<bf16, MemorySpace>& B, float beta,
                       const Tensor2<float, MemorySpace>& C) {
    const int m = static_cast<int>(C.extent(0)), n = static_cast<int>(C.extent(1));
    const int k = static_cast<int>(trans_a ? A.extent(0) : A.extent(1));
    const auto ld = [](std::size_t columns) { return columns > 0 ? static_cast<int>(columns) : 1; };
    cublas_gemm_bf16_row_major(exec.cuda_stream(), trans_a, trans_b, m, n, k, alpha, A.data(), ld(A.extent(1)),
                               B.data(), ld(B.extent(1)), beta, C.data(), ld(C.extent(1)));
  }

  static void run_mixed(const Kokkos::Cuda& exec, bool trans_a, bool trans_b, float alpha,
                        const ConstTensor2<float, MemorySpace>& A, const ConstTensor2<bf16, MemorySpace>& B, float beta,
                        const Tensor2<float, MemorySpace>& C) {
    const int m = static_cast<int>(C.extent(0)), n = static_cast<int>(C.extent(1));
    const int k = static_cast<int>(trans_a ? A.extent(0) : A.extent(1));
    if (!trans_a && trans_b && k > 0 && m <= gemm_few_rows_cuda_max) {
      gemm_few_rows_mixed_cuda(exec.cuda_stream(), m, n, k, alpha, A.data(), B.data(), beta, C.data());
      return;
    }
    const auto ld = [](std::size_t columns) { return columns > 0 ? static_cast<int>(columns) : 1; };
    cublas_gemm_mixed_row_major(exec.cuda_stream(), trans_a, trans_b, m, n, k, alpha, A.data(), ld(A.extent(1)),
                                B.data(), ld(B.extent(1)), beta, C.data(), ld(C.extent(1)));
  }

  static void round_to_bf16(const Kokkos::Cuda& exec, const ConstTensor2<float, MemorySpace>& in,
                            const Tensor2<bf16, MemorySpace>& out) {
    round_to_bf16_cuda(exec.cuda_stream(), in.data(), out.data(), in.span());
  }

  static void run(const Kokkos::Cuda& exec, bool trans_a, bool trans_b, float alpha,
                  const ConstTensor2<float, MemorySpace>& A, const ConstTensor2<float, MemorySpace>& B, float beta,
                  const Tensor2<float, MemorySpace>& C, MatmulPrecision precision) {
    const int m = static_cast<int>(C.extent(0)), n = static_cast<int>(C.extent(1));
    const int k = static_cast<int>(trans_a ? A.extent(0) : A.extent(1));
    if (!trans_a && trans_b && k > 0 && m <= gemm_few_rows_cuda_max) {
      gemm_few_rows_cuda(exec.cuda_stream(), m, n, k, alpha, A.data(), B.data(), beta, C.data(), precision);
      return;
    }
    const auto ld = [](std::size_t columns) { return columns > 0 ? static_cast<int>(columns) : 1; };
    cublas_gemm_row_major(exec.cuda_stream(), trans_a, trans_b, m, n, k, alpha, A.data(), ld(A.extent(1)), B.data(),
                          ld(B.extent(1)), beta, C.data(), ld(C.extent(1)), precision);
  }
};
#endif

}  // namespace impl
}  // namespace kmamba

#endif
