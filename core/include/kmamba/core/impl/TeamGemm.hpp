// A small matrix product computed by one Kokkos team, shared by the SSD chunk stages
// (kmamba/core/impl/SsdImpl.hpp) for their per-chunk products (C·Bᵀ, x·(δ·decay·B)ᵀ, W·x, ...).
//
//   TeamGemm<ExecSpace>::apply(team, m, n, k, a, b, store);
//
// computes, for every i < m and j < n, sum = Σ_{l<k} a(i, l)·b(l, j) in fp32 and calls
// store(i, j, sum) exactly once. `a` and `b` are callables returning float: they may read team
// scratch or global memory, apply masks and scales, or concatenate two operands along l, so that
// a stage never materialises its operands just to multiply them. The generic version spreads the
// m·n outputs over the team's threads and each sum over the thread's vector lanes; on host
// backends each thread takes whole rows and accumulates a block of columns at once, so that the
// innermost loop runs over j (contiguous in the stages' operands, vectorisable) with the same
// summation order over l. A backend specialises TeamGemm<ItsExecSpace> to use its own matrix
// units without touching the stages.
// The call contains no team barrier: the caller synchronises before reading what `store` wrote.
#ifndef KMAMBA_CORE_IMPL_TEAMGEMM_HPP
#define KMAMBA_CORE_IMPL_TEAMGEMM_HPP

#include <Kokkos_Core.hpp>

#include <type_traits>

namespace kmamba {
namespace impl {

template <class ExecSpace>
struct TeamGemm {
  template <class Member, class AOperand, class BOperand, class Store>
  KOKKOS_INLINE_FUNCTION static void apply(const Member& team, const int m, const int n, const int k,
                                           const AOperand& a, const BOperand& b, const Store& store) {
    if constexpr (std::is_same<typename ExecSpace::memory_space, Kokkos::HostSpace>::value) {
      constexpr int block = 64;
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, m), [&](const int i) {
        for (int j0 = 0; j0 < n; j0 += block) {
          const int width = n - j0 < block ? n - j0 : block;
          float acc[block] = {};
          for (int l = 0; l < k; ++l) {
            const float ail = a(i, l);
            for (int j = 0; j < width; ++j) acc[j] += ail * b(l, j0 + j);
          }
          for (int j = 0; j < width; ++j) store(i, j0 + j, acc[j]);
        }
      });
      return;
    }
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, m * n), [&](const int ij) {
      const int i = ij / n;
      const int j = ij % n;
      float sum = 0.0f;
      Kokkos::parallel_reduce(
          Kokkos::ThreadVectorRange(team, k), [&](const int l, float& acc) { acc += a(i, l) * b(l, j); }, sum);
      Kokkos::single(Kokkos::PerThread(team), [&]() { store(i, j, sum); });
    });
  }
};

}  // namespace impl
}  // namespace kmamba

#endif
