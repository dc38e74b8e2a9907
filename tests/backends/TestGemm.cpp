// kmamba::gemm against double references: every transposition and shape class (the few-row
// paths included) in fp32, and the operand-rounding precisions (MatmulPrecision::TensorFloat32,
// BFloat16), whose contract is "fp32 sums of exact products of the operands rounded to TF32 /
// bf16". With mag(i, j) = |alpha|·Σ_p |a(i, p)·b(p, j)| + |beta·C0(i, j)|:
// - against the reference on the rounded operands: |C − ref_rounded| ≤ 1e-5·mag + 1e-30 (fp32
//   accumulation of k ≤ 300 products, whose typical error is ~1e-6·mag); this checks the rounding
//   exactly, since a product of unrounded operands is off by ~2^-9 (bf16) / 2^-12 (tf32) of its
//   size and k of them sum to far more than 1e-5·mag somewhere in C — checked too: some element
//   must be farther than that from the unrounded reference.
//   Host backends, the CUDA few-row kernel and the CUDA bf16 path (which converts the operands
//   itself before cuBLAS multiplies them) round to nearest (kmamba::round_operand). cuBLAS does
//   not document how its FAST_TF32 compute type converts, so on that path only the bound below is
//   checked, and the test reports which arithmetic cuBLAS chose.
// - against the unrounded reference: |C − ref| ≤ (2u + u²)·mag + 1e-5·mag, with u the unit
//   roundoff of the conversion (bf16: 2^-8 to nearest, 2^-7 toward zero; tf32: 2^-11 / 2^-10),
//   the bound on the relative error of one product of rounded operands.
#include <kmamba/backends/Gemm.hpp>
#include <kmamba/core/Core.hpp>

#include "Backends.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace {

KMAMBA_BACKEND_TEST_SUITE(Gemm);

// Reference in double: C = alpha · op(A) · op(B) + beta · C0 (C0 ignored when beta = 0).
std::vector<double> reference(bool ta, bool tb, int m, int n, int k, double alpha, const std::vector<float>& A,
                              const std::vector<float>& B, double beta, const std::vector<float>& C0) {
  std::vector<double> C(static_cast<std::size_t>(m) * n);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < n; ++j) {
      double acc = 0.0;
      for (int p = 0; p < k; ++p) {
        const double a = ta ? A[static_cast<std::size_t>(p) * m + i] : A[static_cast<std::size_t>(i) * k + p];
        const double b = tb ? B[static_cast<std::size_t>(j) * k + p] : B[static_cast<std::size_t>(p) * n + j];
        acc += a * b;
      }
      const std::size_t ij = static_cast<std::size_t>(i) * n + j;
      C[ij] = alpha * acc + (beta == 0.0 ? 0.0 : beta * C0[ij]);
    }
  return C;
}

// A random problem for gemm with op(A) of shape (m, k) and op(B) of shape (k, n), stored transposed
// where asked; C starts as NaN when beta = 0 (gemm must ignore it) and random otherwise. The host
// copies a, b, c0 are the inputs as gemm saw them.
template <class Exec>
struct GemmProblem {
  using Mem = typename Exec::memory_space;
  kmamba::Tensor2<float, Mem> A, B, C;
  std::vector<float> a, b, c0;

  GemmProblem(int m, int n, int k, bool ta, bool tb, float beta, std::uint64_t& seed)
      : A(kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::A", ta ? k : m, ta ? m : k)),
        B(kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::B", tb ? n : k, tb ? k : n)),
        C(kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::C", m, n)) {
    kmamba::fill_normal(Exec(), A, seed++, 0.0f, 1.0f);
    kmamba::fill_normal(Exec(), B, seed++, 0.0f, 1.0f);
    if (beta == 0.0f) {
      Kokkos::deep_copy(C, std::numeric_limits<float>::quiet_NaN());
    } else {
      kmamba::fill_normal(Exec(), C, seed++, 0.0f, 1.0f);
    }
    a = host_vector(A);
    b = host_vector(B);
    c0 = host_vector(C);
  }

  static std::vector<float> host_vector(const kmamba::Tensor2<float, Mem>& v) {
    const auto h = kmamba::test::to_host(v);
    return std::vector<float>(h.data(), h.data() + h.size());
  }
};

/// C (m × n) = alpha·op(A)·op(B) + beta·C with an inner dimension k.
struct GemmCase {
  int m, n, k;
  float alpha, beta;
};

kmamba::Transpose transpose(bool t) { return t ? kmamba::Transpose::Yes : kmamba::Transpose::No; }

// Runs check(c, ta, tb, problem, trace) for every case c and every transposition of A and B on a
// GemmProblem drawn from `seed` on, under the trace `trace` (`what`, then the case and the
// transpositions); stops at the first fatal failure.
template <class Exec, std::size_t N, class Check>
void for_each_problem(const GemmCase (&cases)[N], std::uint64_t& seed, const std::string& what, const Check& check) {
  for (const GemmCase& c : cases) {
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      const std::string trace = what + "m=" + std::to_string(c.m) + " n=" + std::to_string(c.n) +
                                " k=" + std::to_string(c.k) + " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb);
      SCOPED_TRACE(trace);
      check(c, ta, tb, GemmProblem<Exec>(c.m, c.n, c.k, ta, tb, c.beta, seed), trace);
      if (::testing::Test::HasFatalFailure()) return;
    }
  }
}

TYPED_TEST(Gemm, MatchesDoubleReferenceForEveryTransposeAndShape) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const GemmCase cases[] = {{1, 1, 1, 1.0f, 0.0f},
                            {7, 5, 3, 1.0f, 0.0f},
                            {64, 33, 17, 0.5f, 2.0f},
                            {3, 130, 65, -1.0f, 1.0f},
                            {4, 6, 0, 1.0f, 0.5f},
                            {4, 6, 0, 1.0f, 0.0f},
                            {1, 300, 771, 1.0f, 0.5f},
                            {16, 40, 100, 2.0f, 0.0f},
                            {17, 40, 100, 1.0f, 1.0f},
                            // Few rows with k a multiple of 4 (the CUDA path's 16-byte loads), each row bucket.
                            {1, 70, 256, 1.0f, 0.0f},
                            {2, 9, 64, 0.5f, 1.0f},
                            {3, 33, 768, 1.0f, 0.0f},
                            {8, 17, 128, -1.0f, 0.5f},
                            {13, 50, 1536, 1.0f, 0.0f}};
  std::uint64_t seed = 100;
  for_each_problem<Exec>(
      cases, seed, "", [](const GemmCase& c, bool ta, bool tb, const GemmProblem<Exec>& problem, const std::string&) {
        const auto& [A, B, C, a, b, c0] = problem;
        kmamba::gemm(Exec(), transpose(ta), transpose(tb), c.alpha, kmamba::ConstTensor2<float, Mem>(A),
                     kmamba::ConstTensor2<float, Mem>(B), c.beta, C);
        Exec().fence();
        const std::vector<double> ref = reference(ta, tb, c.m, c.n, c.k, c.alpha, a, b, c.beta, c0);
        auto Ch = kmamba::test::to_host(C);
        for (int i = 0; i < c.m; ++i)
          for (int j = 0; j < c.n; ++j) {
            const double r = ref[static_cast<std::size_t>(i) * c.n + j];
            // fp32 accumulation of k products of unit normals: error ~ k·eps·sqrt(k) at worst.
            ASSERT_NEAR(Ch(i, j), r, 1e-5 * (1.0 + std::fabs(r)) * (1 + c.k)) << "(" << i << ", " << j << ")";
          }
      });
}

using kmamba::MatmulPrecision;

// v with its low mantissa bits cut off (rounding toward zero) to the format of `p`.
float truncated(MatmulPrecision p, float v) {
  std::uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  u &= p == MatmulPrecision::BFloat16 ? 0xffff0000u : 0xffffe000u;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

std::vector<float> rounded(const std::vector<float>& v, MatmulPrecision p) {
  std::vector<float> out(v.size());
  for (std::size_t i = 0; i < v.size(); ++i) out[i] = kmamba::round_operand(p, v[i]);
  return out;
}

// |alpha|·Σ_p |a·b| + |beta·C0| per element: the scale of C's rounding errors.
std::vector<double> magnitudes(bool ta, bool tb, int m, int n, int k, double alpha, const std::vector<float>& A,
                               const std::vector<float>& B, double beta, const std::vector<float>& C0) {
  std::vector<float> absA(A.size()), absB(B.size()), absC(C0.size());
  for (std::size_t i = 0; i < A.size(); ++i) absA[i] = std::fabs(A[i]);
  for (std::size_t i = 0; i < B.size(); ++i) absB[i] = std::fabs(B[i]);
  for (std::size_t i = 0; i < C0.size(); ++i) absC[i] = std::fabs(C0[i]);
  return reference(ta, tb, m, n, k, std::fabs(alpha), absA, absB, std::fabs(beta), absC);
}

// out(i) = round_operand(precision, in(i)) on the device.
template <class Mem>
struct RoundEach {
  kmamba::Tensor1<float, Mem> out;
  kmamba::Tensor1<float, Mem> in;
  MatmulPrecision precision;
  KOKKOS_INLINE_FUNCTION void operator()(const int i) const { out(i) = kmamba::round_operand(precision, in(i)); }
};

TYPED_TEST(Gemm, RoundOperandRoundsToTheFormatsAsDocumented) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const float one = 1.0f;
  // Ties: bf16 to even (1 + 2^-8 lies between 1 and 1 + 2^-7), tf32 away from zero.
  EXPECT_EQ(kmamba::round_operand(MatmulPrecision::BFloat16, one + std::ldexp(1.0f, -8)), one);
  EXPECT_EQ(kmamba::round_operand(MatmulPrecision::BFloat16, one + 3 * std::ldexp(1.0f, -8)),
            one + std::ldexp(1.0f, -6));
  EXPECT_EQ(kmamba::round_operand(MatmulPrecision::TensorFloat32, one + std::ldexp(1.0f, -11)),
            one + std::ldexp(1.0f, -10));
  EXPECT_EQ(kmamba::round_operand(MatmulPrecision::TensorFloat32, -(one + std::ldexp(1.0f, -11))),
            -(one + std::ldexp(1.0f, -10)));
  EXPECT_TRUE(
      std::isinf(kmamba::round_operand(MatmulPrecision::TensorFloat32, std::numeric_limits<float>::infinity())));
  EXPECT_TRUE(std::isnan(kmamba::round_operand(MatmulPrecision::BFloat16, std::numeric_limits<float>::quiet_NaN())));
  EXPECT_TRUE(
      std::isnan(kmamba::round_operand(MatmulPrecision::TensorFloat32, std::numeric_limits<float>::quiet_NaN())));
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int t = 0; t < 1000; ++t) {
    const float v = normal(rng);
    EXPECT_EQ(kmamba::round_operand(MatmulPrecision::Float32, v), v);
    const float b = kmamba::round_operand(MatmulPrecision::BFloat16, v);
    const float f = kmamba::round_operand(MatmulPrecision::TensorFloat32, v);
    EXPECT_EQ(truncated(MatmulPrecision::BFloat16, b), b) << v;  // a bf16 value
    EXPECT_EQ(truncated(MatmulPrecision::TensorFloat32, f), f) << v;
    EXPECT_LE(std::fabs(b - v), std::ldexp(std::fabs(v), -8)) << v;
    EXPECT_LE(std::fabs(f - v), std::ldexp(std::fabs(v), -11)) << v;
  }
  // The same on the device: random values, ties and the special values.
  auto values = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::values", 1024);
  kmamba::fill_normal(Exec(), values, 11, 0.0f, 3.0f);
  auto hv = kmamba::test::to_host(values);
  hv(0) = one + std::ldexp(1.0f, -8);
  hv(1) = one + std::ldexp(1.0f, -11);
  hv(2) = -std::numeric_limits<float>::infinity();
  hv(3) = std::numeric_limits<float>::quiet_NaN();
  Kokkos::deep_copy(values, hv);
  for (const MatmulPrecision p :
       {MatmulPrecision::Float32, MatmulPrecision::TensorFloat32, MatmulPrecision::BFloat16}) {
    auto out = kmamba::allocate_uninitialized<kmamba::Tensor1<float, Mem>>("kmamba::test::rounded", 1024);
    Kokkos::parallel_for("kmamba::test::round_operand", Kokkos::RangePolicy<Exec>(0, 1024),
                         RoundEach<Mem>{out, values, p});
    auto ho = kmamba::test::to_host(out);
    for (int i = 0; i < 1024; ++i) {
      const float want = kmamba::round_operand(p, hv(i));
      std::uint32_t got_bits, want_bits;
      std::memcpy(&got_bits, &ho(i), sizeof got_bits);
      std::memcpy(&want_bits, &want, sizeof want_bits);
      ASSERT_EQ(got_bits, want_bits) << kmamba::matmul_precision_name(p) << " device vs host at " << i << ": " << hv(i);
    }
  }
  EXPECT_EQ(kmamba::parse_matmul_precision("bf16"), MatmulPrecision::BFloat16);
  EXPECT_EQ(kmamba::parse_matmul_precision("tf32"), MatmulPrecision::TensorFloat32);
  EXPECT_EQ(kmamba::parse_matmul_precision("fp32"), MatmulPrecision::Float32);
  for (const MatmulPrecision p :
       {MatmulPrecision::Float32, MatmulPrecision::TensorFloat32, MatmulPrecision::BFloat16}) {
    EXPECT_EQ(kmamba::parse_matmul_precision(kmamba::matmul_precision_name(p)), p);
  }
  try {
    kmamba::parse_matmul_precision("fp16", "--precision");
    FAIL() << "no exception";
  } catch (const kmamba::UserError& e) {
    EXPECT_EQ(std::string(e.what()), "--precision must be fp32, tf32 or bf16, got 'fp16'");
  }
}

TYPED_TEST(Gemm, RoundedPrecisionsMultiplyRoundedOperandsExactly) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  // The few-row paths (m = 1..4, and up to 16 on host backends) and the BLAS / cuBLAS path.
  const GemmCase cases[] = {{1, 70, 256, 1.0f, 0.0f},    {2, 9, 64, 0.5f, 1.0f},     {3, 33, 300, 1.0f, 0.0f},
                            {4, 40, 128, -1.0f, 0.5f},   {13, 50, 200, 1.0f, 0.0f},  {64, 33, 96, 0.5f, 2.0f},
                            {37, 130, 257, -1.0f, 1.0f}, {100, 64, 300, 1.0f, 0.0f}, {5, 7, 3, 1.0f, 0.0f}};
  std::uint64_t seed = 500;
  for (const MatmulPrecision precision : {MatmulPrecision::BFloat16, MatmulPrecision::TensorFloat32}) {
    for_each_problem<Exec>(
        cases, seed, std::string(kmamba::matmul_precision_name(precision)) + " ",
        [precision](const GemmCase& c, bool ta, bool tb, const GemmProblem<Exec>& problem, const std::string& ctx) {
          const auto& [A, B, C, a, b, c0] = problem;
          kmamba::gemm(Exec(), transpose(ta), transpose(tb), c.alpha, kmamba::ConstTensor2<float, Mem>(A),
                       kmamba::ConstTensor2<float, Mem>(B), c.beta, C, precision);
          Exec().fence();
          auto Ch = kmamba::test::to_host(C);
          // The inputs are left as they were.
          auto Ah2 = kmamba::test::to_host(A);
          for (std::size_t i = 0; i < a.size(); ++i) ASSERT_EQ(Ah2.data()[i], a[i]) << "A changed at " << i;

          bool vendor = false;  // cuBLAS's own conversion
#if KMAMBA_ENABLE_CUDA
          vendor = std::is_same<Exec, Kokkos::Cuda>::value && precision == MatmulPrecision::TensorFloat32 &&
                   !(!ta && tb && c.m <= kmamba::impl::gemm_few_rows_cuda_max);
#endif
          const std::vector<double> mag = magnitudes(ta, tb, c.m, c.n, c.k, c.alpha, a, b, c.beta, c0);
          const std::vector<double> exact = reference(ta, tb, c.m, c.n, c.k, c.alpha, a, b, c.beta, c0);
          const auto worst_against = [&](const std::vector<double>& ref) {  // max |C − ref| / (1e-5·mag + 1e-30)
            double worst = 0.0;
            for (int i = 0; i < c.m; ++i)
              for (int j = 0; j < c.n; ++j) {
                const std::size_t ij = static_cast<std::size_t>(i) * c.n + j;
                worst = std::max(worst, std::fabs(Ch(i, j) - ref[ij]) / (1e-5 * mag[ij] + 1e-30));
              }
            return worst;
          };
          const double worst = worst_against(
              reference(ta, tb, c.m, c.n, c.k, c.alpha, rounded(a, precision), rounded(b, precision), c.beta, c0));
          if (vendor) {
            // cuBLAS's fast compute type permits the conversion, it does not prescribe it: on the H200
            // some shapes ran in full fp32 (m = 1), others on the tensor cores with a conversion that
            // is neither rounding to nearest nor toward zero of each operand. Its contract is the
            // bound against the exact products below; which arithmetic it chose is reported.
            std::printf("[ info ] cuBLAS %s: %s\n", ctx.c_str(),
                        worst <= 1.0                  ? "operands rounded to nearest"
                        : worst_against(exact) <= 1.0 ? "fp32 products"
                                                      : "another conversion");
          } else {
            EXPECT_LE(worst, 1.0) << "largest |C − ref on rounded operands| in units of 1e-5·mag";
            // The rounding happened: fp32 products would match the exact reference within 1e-5·mag.
            if (c.k >= 64) {
              EXPECT_GT(worst_against(exact), 1.0) << "C matches unrounded fp32 products: no rounding";
            }
          }
          const double u = std::ldexp(1.0, precision == MatmulPrecision::BFloat16 ? -8 : -11);
          for (int i = 0; i < c.m; ++i)
            for (int j = 0; j < c.n; ++j) {
              const std::size_t ij = static_cast<std::size_t>(i) * c.n + j;
              ASSERT_LE(std::fabs(Ch(i, j) - exact[ij]), (2 * u + u * u + 1e-5) * mag[ij] + 1e-30)
                  << "(" << i << ", " << j << ") against the unrounded reference";
            }
        });
    if (::testing::Test::HasFatalFailure()) return;
  }
}

// |C − the reference on bf16-rounded operands| ≤ 1e-5·mag at every element.
template <class HostC>
void check_against_rounded(const GemmCase& c, bool ta, bool tb, const HostC& Ch, const std::vector<float>& a,
                           const std::vector<float>& b, const std::vector<float>& c0) {
  const std::vector<double> mag = magnitudes(ta, tb, c.m, c.n, c.k, c.alpha, a, b, c.beta, c0);
  const std::vector<double> ref = reference(ta, tb, c.m, c.n, c.k, c.alpha, rounded(a, MatmulPrecision::BFloat16),
                                            rounded(b, MatmulPrecision::BFloat16), c.beta, c0);
  for (int i = 0; i < c.m; ++i)
    for (int j = 0; j < c.n; ++j) {
      const std::size_t ij = static_cast<std::size_t>(i) * c.n + j;
      ASSERT_LE(std::fabs(Ch(i, j) - ref[ij]), 1e-5 * mag[ij] + 1e-30) << "(" << i << ", " << j << ")";
    }
}

// Operands rounded once (round_to_bf16: to nearest even, as kmamba::bf16) and multiplied by the
// bf16 overload (both in bf16) or by the mixed overload (B in bf16, A fp32, rounded by the
// product): the BFloat16 mode's contract, fp32 sums of exact products of the rounded operands,
// within 1e-5·mag of the reference on the rounded operands (as above). The cases cover the few-row
// paths (m ≤ 4 on CUDA: k a multiple of 8 or not, the 16-byte and the element loads) and cuBLAS.
template <class Exec>
void check_bf16_products(bool a_in_bf16, std::uint64_t seed) {
  using Mem = typename Exec::memory_space;
  using B2 = kmamba::Tensor2<kmamba::bf16, Mem>;
  const GemmCase cases[] = {{1, 70, 256, 1.0f, 0.0f}, {2, 9, 60, 0.5f, 1.0f},   {4, 40, 128, -1.0f, 0.5f},
                            {3, 33, 300, 1.0f, 0.0f}, {64, 33, 96, 0.5f, 2.0f}, {37, 130, 257, -1.0f, 1.0f},
                            {5, 7, 3, 1.0f, 0.0f}};
  for_each_problem<Exec>(
      cases, seed, a_in_bf16 ? "bf16 A " : "fp32 A ",
      [a_in_bf16](const GemmCase& c, bool ta, bool tb, const GemmProblem<Exec>& problem, const std::string&) {
        const auto& [A, B, C, a, b, c0] = problem;
        const auto B16 = kmamba::allocate_uninitialized<B2>("kmamba::test::B16", B.extent(0), B.extent(1));
        kmamba::round_to_bf16(Exec(), kmamba::ConstTensor2<float, Mem>(B), B16);
        if (a_in_bf16) {
          const auto A16 = kmamba::allocate_uninitialized<B2>("kmamba::test::A16", A.extent(0), A.extent(1));
          kmamba::round_to_bf16(Exec(), kmamba::ConstTensor2<float, Mem>(A), A16);
          kmamba::gemm(Exec(), transpose(ta), transpose(tb), c.alpha, kmamba::ConstTensor2<kmamba::bf16, Mem>(A16),
                       kmamba::ConstTensor2<kmamba::bf16, Mem>(B16), c.beta, C);
        } else {
          kmamba::gemm(Exec(), transpose(ta), transpose(tb), c.alpha, kmamba::ConstTensor2<float, Mem>(A),
                       kmamba::ConstTensor2<kmamba::bf16, Mem>(B16), c.beta, C);
        }
        Exec().fence();
        const auto b16 = kmamba::test::to_host(B16);
        for (std::size_t i = 0; i < b.size(); ++i) {
          ASSERT_EQ(b16.data()[i].bits, kmamba::float_to_bf16_bits(b[i])) << "round_to_bf16 at " << i;
        }
        check_against_rounded(c, ta, tb, kmamba::test::to_host(C), a, b, c0);
      });
}

TYPED_TEST(Gemm, Bf16OperandsMultiplyAsTheRoundingMode) { check_bf16_products<TypeParam>(true, 900); }

TYPED_TEST(Gemm, Bf16WeightsAgainstFp32RowsMultiplyAsTheRoundingMode) { check_bf16_products<TypeParam>(false, 1300); }

TYPED_TEST(Gemm, RejectsShapesThatDoNotAgree) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  auto A = kmamba::allocate<kmamba::Tensor2<float, Mem>>("kmamba::test::A", 4, 3);
  auto B = kmamba::allocate<kmamba::Tensor2<float, Mem>>("kmamba::test::B", 5, 2);
  auto C = kmamba::allocate<kmamba::Tensor2<float, Mem>>("kmamba::test::C", 4, 2);
  try {
    kmamba::gemm(Exec(), kmamba::Transpose::No, kmamba::Transpose::No, 1.0f, kmamba::ConstTensor2<float, Mem>(A),
                 kmamba::ConstTensor2<float, Mem>(B), 0.0f, C);
    FAIL() << "no exception";
  } catch (const kmamba::UserError& e) {
    EXPECT_EQ(std::string(e.what()), "kmamba::gemm: B has shape (5, 2) but (k, n) with k from A = (3, 2) was expected");
  }
  auto B2 = kmamba::allocate<kmamba::Tensor2<float, Mem>>("kmamba::test::B2", 3, 2);
  auto C2 = kmamba::allocate<kmamba::Tensor2<float, Mem>>("kmamba::test::C2", 2, 4);
  EXPECT_THROW(kmamba::gemm(Exec(), kmamba::Transpose::No, kmamba::Transpose::No, 1.0f,
                            kmamba::ConstTensor2<float, Mem>(A), kmamba::ConstTensor2<float, Mem>(B2), 0.0f, C2),
               kmamba::UserError);
  using B16 = kmamba::Tensor2<kmamba::bf16, Mem>;
  const auto A16 = kmamba::allocate<B16>("kmamba::test::A16", 4, 3),
             Bad16 = kmamba::allocate<B16>("kmamba::test::B16", 5, 2);
  try {
    kmamba::gemm(Exec(), kmamba::Transpose::No, kmamba::Transpose::No, 1.0f,
                 kmamba::ConstTensor2<kmamba::bf16, Mem>(A16), kmamba::ConstTensor2<kmamba::bf16, Mem>(Bad16), 0.0f, C);
    FAIL() << "no exception";
  } catch (const kmamba::UserError& e) {
    EXPECT_EQ(std::string(e.what()), "kmamba::gemm: B has shape (5, 2) but (k, n) with k from A = (3, 2) was expected");
  }
  try {
    kmamba::round_to_bf16(Exec(), kmamba::ConstTensor2<float, Mem>(B), A16);
    FAIL() << "no exception";
  } catch (const kmamba::UserError& e) {
    EXPECT_EQ(std::string(e.what()),
              "kmamba::round_to_bf16: out has shape (4, 3) but (rows, cols) of in = (5, 2) was expected");
  }
}

}  // namespace
