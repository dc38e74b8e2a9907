// TeamGemm (kmamba/core/impl/TeamGemm.hpp), the team-level product under the SSD stages, on its
// own: every output stored exactly once with Σ_l a(i,l)·b(l,j), for shapes that do and do not fill
// the backend's blocks (k = 0 included), with the team shape the SSD plan asks for and with a
// smaller one (the generic path on backends that specialise), leaving the caller's own team
// scratch untouched.
//
// Tolerance: |C − ref| ≤ 1e-6·Σ_l |a(i,l)·b(l,j)| + 1e-30 against a double reference (fp32
// accumulation of k ≤ 300 products).
#include <kmamba/core/impl/TeamGemm.hpp>

#include "Backends.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <random>
#include <string>
#include <vector>

namespace {

template <class Exec>
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
    kmamba::impl::TeamGemm<Exec>::apply(
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

template <class Exec>
void check_product(int m, int n, int k, bool plan_shape) {
  using Mem = typename Exec::memory_space;
  using Policy = Kokkos::TeamPolicy<Exec>;
  using Gemm = kmamba::impl::TeamGemm<Exec>;
  const std::string ctx = "m=" + std::to_string(m) + " n=" + std::to_string(n) + " k=" + std::to_string(k) +
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
  const GemmProbe<Exec> probe{A, Bt, C, calls, intact, m, n, k, own};
  Policy sizing(exec, 1, 1, vector_length);
  const std::size_t scratch = GemmProbe<Exec>::Vec::shmem_size(own) + Gemm::scratch_bytes;
  sizing.set_scratch_size(0, Kokkos::PerTeam(scratch));
  team_size = std::min(team_size, sizing.team_size_max(probe, Kokkos::ParallelForTag()));
  Policy policy(exec, 1, team_size, vector_length);
  policy.set_scratch_size(0, Kokkos::PerTeam(scratch));
  Kokkos::parallel_for("kmamba::test::team_gemm", policy, probe);
  exec.fence();

  auto hC = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), C);
  auto hcalls = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), calls);
  auto hintact = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), intact);
  EXPECT_EQ(hintact(0), 1) << ctx << ": the caller's scratch was overwritten";
  int wrong_calls = 0, wrong_values = 0;
  for (int i = 0; i < m; ++i) {
    for (int j = 0; j < n; ++j) {
      double ref = 0.0, mag = 0.0;
      for (int l = 0; l < k; ++l) {
        const double t = static_cast<double>(hA(i, l)) * hB(j, l);
        ref += t;
        mag += std::abs(t);
      }
      if (hcalls(i, j) != 1) ++wrong_calls;
      if (!(std::abs(hC(i, j) - ref) <= 1e-6 * mag + 1e-30)) {
        if (wrong_values == 0) {
          ADD_FAILURE() << ctx << ": C(" << i << "," << j << ") = " << hC(i, j) << ", reference " << ref;
        }
        ++wrong_values;
      }
    }
  }
  EXPECT_EQ(wrong_calls, 0) << ctx << ": outputs not stored exactly once";
  EXPECT_EQ(wrong_values, 0) << ctx << ": outputs off the reference";
}

template <class ExecSpace>
class TeamGemmTest : public ::testing::Test {};
TYPED_TEST_SUITE(TeamGemmTest, kmamba::test::Backends, kmamba::test::BackendNames);

TYPED_TEST(TeamGemmTest, StoresEveryProductOnceForAnyShape) {
  const int shapes[][3] = {{1, 1, 1},   {3, 5, 7},     {64, 64, 16},  {64, 128, 256}, {65, 129, 17},
                           {130, 257, 33}, {17, 64, 300}, {64, 65, 1}, {5, 3, 0},     {200, 40, 48}};
  for (const auto& s : shapes) {
    check_product<TypeParam>(s[0], s[1], s[2], true);
    check_product<TypeParam>(s[0], s[1], s[2], false);
  }
}

}  // namespace
