#include <kmamba/backends/Gemm.hpp>
#include <kmamba/core/Core.hpp>

#include "Backends.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

namespace {

template <class ExecSpace>
class Gemm : public ::testing::Test {};
TYPED_TEST_SUITE(Gemm, kmamba::test::Backends, kmamba::test::BackendNames);

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

TYPED_TEST(Gemm, MatchesDoubleReferenceForEveryTransposeAndShape) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  struct Case { int m, n, k; float alpha, beta; };
  const Case cases[] = {{1, 1, 1, 1.0f, 0.0f}, {7, 5, 3, 1.0f, 0.0f}, {64, 33, 17, 0.5f, 2.0f},
                        {3, 130, 65, -1.0f, 1.0f}, {4, 6, 0, 1.0f, 0.5f}, {4, 6, 0, 1.0f, 0.0f},
                        {1, 300, 771, 1.0f, 0.5f}, {16, 40, 100, 2.0f, 0.0f}, {17, 40, 100, 1.0f, 1.0f},
                        // Few rows with k a multiple of 4 (the CUDA path's 16-byte loads), each row bucket.
                        {1, 70, 256, 1.0f, 0.0f}, {2, 9, 64, 0.5f, 1.0f}, {3, 33, 768, 1.0f, 0.0f},
                        {8, 17, 128, -1.0f, 0.5f}, {13, 50, 1536, 1.0f, 0.0f}};
  std::uint64_t seed = 100;
  for (const Case& c : cases) {
    for (int t = 0; t < 4; ++t) {
      const bool ta = t & 1, tb = t & 2;
      SCOPED_TRACE("m=" + std::to_string(c.m) + " n=" + std::to_string(c.n) + " k=" + std::to_string(c.k) +
                   " ta=" + std::to_string(ta) + " tb=" + std::to_string(tb));
      auto A = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::A", ta ? c.k : c.m, ta ? c.m : c.k);
      auto B = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::B", tb ? c.n : c.k, tb ? c.k : c.n);
      auto C = kmamba::allocate_uninitialized<kmamba::Tensor2<float, Mem>>("kmamba::test::C", c.m, c.n);
      kmamba::fill_normal(Exec(), A, seed++, 0.0f, 1.0f);
      kmamba::fill_normal(Exec(), B, seed++, 0.0f, 1.0f);
      if (c.beta == 0.0f) {
        Kokkos::deep_copy(C, std::numeric_limits<float>::quiet_NaN());  // must be ignored
      } else {
        kmamba::fill_normal(Exec(), C, seed++, 0.0f, 1.0f);
      }
      auto Ah = kmamba::test::to_host(A);
      auto Bh = kmamba::test::to_host(B);
      auto C0h = kmamba::test::to_host(C);
      const std::vector<float> a(Ah.data(), Ah.data() + Ah.size()), b(Bh.data(), Bh.data() + Bh.size()),
          c0(C0h.data(), C0h.data() + C0h.size());
      kmamba::gemm(Exec(), ta ? kmamba::Transpose::Yes : kmamba::Transpose::No,
                   tb ? kmamba::Transpose::Yes : kmamba::Transpose::No, c.alpha, kmamba::ConstTensor2<float, Mem>(A),
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
    }
  }
}

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
}

}  // namespace
