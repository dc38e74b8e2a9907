// TeamGemm (kmamba/core/impl/TeamGemm.hpp), the team-level product under the SSD stages, on its
// own, in both precisions: every output stored exactly once with Σ_l a(i,l)·b(l,j), for shapes
// that do and do not fill the backend's blocks (k = 0 included), with the team shape the SSD plan
// asks for and with a smaller one (the generic path on backends that specialise), leaving the
// caller's own team scratch untouched.
//
// Tolerances against double references, with mag = Σ_l |a(i,l)·b(l,j)|:
// - exact fp32 forms (Float32 everywhere; TensorFloat32 where the backend has no tensor-core form
//   or the team is not the one it specialises for): |C − ref| ≤ 1e-6·mag + 1e-30 (fp32
//   accumulation of k ≤ 300 products);
// - the tensor-core form (TensorFloat32 on Cuda with the plan's team): the reference sums the
//   products of the operands rounded to TF32 as the hardware conversion does (cvt.rna: nearest,
//   ties away from zero, 10-bit mantissa), which the tensor cores multiply exactly; what remains is
//   their fp32 accumulation, which truncates: |C − ref_tf32| ≤ (k + 16)·2^-22·mag + 1e-30 (about 8×
//   the bound of one truncation per MMA of 8 products). The distance to the exact reference,
//   ≤ (2^-10 + (k + 16)·2^-22)·mag, is checked too and reported.
#include <kmamba/core/impl/TeamGemm.hpp>

#include "Backends.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace {

using kmamba::MatmulPrecision;

// v rounded to TF32 as cvt.rna.tf32.f32 does: the 13 low mantissa bits rounded off, to nearest
// with ties away from zero (the sign is a separate bit, so rounding the magnitude's bits up at
// half rounds away from zero).
float round_to_tf32(float v) {
  std::uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  if ((u & 0x7f800000u) != 0x7f800000u) u = (u + 0x1000u) & 0xffffe000u;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

template <class Exec, MatmulPrecision Precision>
struct GemmProbe {
  using member_type = typename Kokkos::TeamPolicy<Exec>::member_type;
  using Mem = typename Exec::memory_space;
  using Vec = Kokkos::View<float*, typename Exec::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  Kokkos::View<const float**, Kokkos::LayoutRight, Mem> A;   // (m, k): a(i, l) = A(i, l)·(mine(0) + 0.5) = A(i, l)
  Kokkos::View<const float**, Kokkos::LayoutRight, Mem> Bt;  // (n, k): b(l, j) = Bt(j, l)
  Kokkos::View<float**, Kokkos::LayoutRight, Mem> C;         // (m, n)
  Kokkos::View<int**, Kokkos::LayoutRight, Mem> calls;       // (m, n)
  Kokkos::View<int*, Mem> caller_scratch_intact;             // (1)
  int m, n, k, own;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    Vec mine(team.team_scratch(0), own);
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, own), [&](const int q) { mine(q) = 0.5f + q; });
    team.team_barrier();
    kmamba::impl::TeamGemm<Exec, Precision>::apply(
        team, m, n, k, [&](const int i, const int l) { return A(i, l) * (mine(0) + 0.5f); },
        [&](const int l, const int j) { return Bt(j, l); },
        [&](const int i, const int j, const float v) {
          C(i, j) = v;
          calls(i, j) += 1;
        });
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, own), [&](const int q) {
      if (mine(q) != 0.5f + q) caller_scratch_intact(0) = 0;
    });
  }
};

template <class Exec, MatmulPrecision Precision>
void check_product(int m, int n, int k, bool plan_shape) {
  using Mem = typename Exec::memory_space;
  using Policy = Kokkos::TeamPolicy<Exec>;
  using Gemm = kmamba::impl::TeamGemm<Exec, Precision>;
  const std::string ctx = std::string(kmamba::matmul_precision_name(Precision)) + " m=" + std::to_string(m) +
                          " n=" + std::to_string(n) + " k=" + std::to_string(k) +
                          (plan_shape ? " (plan's team shape)" : " (small team)");
  std::mt19937 rng(static_cast<unsigned>(m * 7919 + n * 131 + k));
  std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
  Kokkos::View<float**, Kokkos::LayoutRight, Mem> A("kmamba::test::A", m, std::max(k, 1));
  Kokkos::View<float**, Kokkos::LayoutRight, Mem> Bt("kmamba::test::Bt", n, std::max(k, 1));
  auto hA = Kokkos::create_mirror_view(A);
  auto hB = Kokkos::create_mirror_view(Bt);
  for (int i = 0; i < m; ++i)
    for (int l = 0; l < k; ++l) hA(i, l) = dist(rng);
  for (int j = 0; j < n; ++j)
    for (int l = 0; l < k; ++l) hB(j, l) = dist(rng);
  Kokkos::deep_copy(A, hA);
  Kokkos::deep_copy(Bt, hB);
  Kokkos::View<float**, Kokkos::LayoutRight, Mem> C("kmamba::test::C", m, n);
  Kokkos::deep_copy(C, std::nanf(""));
  Kokkos::View<int**, Kokkos::LayoutRight, Mem> calls("kmamba::test::calls", m, n);
  Kokkos::View<int*, Mem> intact("kmamba::test::intact", 1);
  Kokkos::deep_copy(intact, 1);

  const int own = 37;  // the caller's scratch, an odd size so that TeamGemm must realign
  const int vector_length = std::min(32, static_cast<int>(Policy::vector_length_max()));
  int team_size = Gemm::team_threads > 0 ? Gemm::team_threads / vector_length : 8;
  if (!plan_shape) team_size = std::max(1, team_size / 4);
  const Exec exec;
  const GemmProbe<Exec, Precision> probe{A, Bt, C, calls, intact, m, n, k, own};
  Policy sizing(exec, 1, 1, vector_length);
  const std::size_t scratch = GemmProbe<Exec, Precision>::Vec::shmem_size(own) + Gemm::scratch_bytes;
  sizing.set_scratch_size(0, Kokkos::PerTeam(scratch));
  team_size = std::min(team_size, sizing.team_size_max(probe, Kokkos::ParallelForTag()));
  Policy policy(exec, 1, team_size, vector_length);
  policy.set_scratch_size(0, Kokkos::PerTeam(scratch));
  if (plan_shape && Gemm::team_threads > 0) {
    EXPECT_EQ(team_size * vector_length, Gemm::team_threads) << ctx << ": the specialised form is not exercised";
  }
  const bool tensor_cores = Gemm::tensor_cores && team_size * vector_length == Gemm::team_threads;
  Kokkos::parallel_for("kmamba::test::team_gemm", policy, probe);
  exec.fence();

  auto hC = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), C);
  auto hcalls = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), calls);
  auto hintact = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), intact);
  EXPECT_EQ(hintact(0), 1) << ctx << ": the caller's scratch was overwritten";
  int wrong_calls = 0, wrong_values = 0;
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double ref = 0.0, ref_tf32 = 0.0, mag = 0.0;
      for (int l = 0; l < k; ++l) {
        const double t = static_cast<double>(hA(i, l)) * hB(j, l);
        ref += t;
        ref_tf32 += static_cast<double>(round_to_tf32(hA(i, l))) * round_to_tf32(hB(j, l));
        mag += std::abs(t);
      }
      if (hcalls(i, j) != 1) ++wrong_calls;
      const double accumulation = (k + 16) * std::ldexp(1.0, -22) * mag + 1e-30;
      const bool ok = tensor_cores ? std::abs(hC(i, j) - ref_tf32) <= accumulation &&
                                         std::abs(hC(i, j) - ref) <= std::ldexp(1.0, -10) * mag + accumulation
                                   : std::abs(hC(i, j) - ref) <= 1e-6 * mag + 1e-30;
      if (!ok) {
        if (wrong_values == 0) {
          ADD_FAILURE() << ctx << ": C(" << i << "," << j << ") = " << hC(i, j) << ", reference " << ref
                        << ", TF32-operand reference " << ref_tf32 << ", sum of |products| " << mag
                        << (tensor_cores ? " (tensor-core form)" : " (exact fp32 form)");
        }
        ++wrong_values;
      }
    }
  }
  EXPECT_EQ(wrong_calls, 0) << ctx << ": outputs not stored exactly once";
  EXPECT_EQ(wrong_values, 0) << ctx << ": outputs off the reference";
}

KMAMBA_BACKEND_TEST_SUITE(TeamGemmTest);

constexpr int shapes[][3] = {{1, 1, 1},      {3, 5, 7},     {64, 64, 16}, {64, 128, 256}, {65, 129, 17},
                             {130, 257, 33}, {17, 64, 300}, {64, 65, 1},  {5, 3, 0},      {200, 40, 48}};

TYPED_TEST(TeamGemmTest, StoresEveryProductOnceForAnyShape) {
  for (const auto& s : shapes) {
    check_product<TypeParam, MatmulPrecision::Float32>(s[0], s[1], s[2], true);
    check_product<TypeParam, MatmulPrecision::Float32>(s[0], s[1], s[2], false);
  }
}

TYPED_TEST(TeamGemmTest, TensorFloat32StoresEveryProductOnceForAnyShape) {
  for (const auto& s : shapes) {
    check_product<TypeParam, MatmulPrecision::TensorFloat32>(s[0], s[1], s[2], true);
    check_product<TypeParam, MatmulPrecision::TensorFloat32>(s[0], s[1], s[2], false);
  }
}

}  // namespace
