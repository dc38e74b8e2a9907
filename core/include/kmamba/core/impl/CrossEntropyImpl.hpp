// Internals of kmamba/core/CrossEntropy.hpp.
#ifndef KMAMBA_CORE_IMPL_CROSSENTROPYIMPL_HPP
#define KMAMBA_CORE_IMPL_CROSSENTROPYIMPL_HPP

#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/CheckIds.hpp>

#include <Kokkos_Core.hpp>

#include <cfloat>
#include <cstdint>
#include <utility>

namespace kmamba {
namespace impl {

template <class ExecSpace, class MemorySpace>
struct CrossEntropyForward {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  ConstTensor2<float, MemorySpace> logits;
  ConstTensor1<std::int64_t, MemorySpace> targets;
  std::int64_t ignore_index;
  Tensor1<float, MemorySpace> lse;
  /// Entries of a row per host block.
  static constexpr int host_block = 1024;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team, double& loss_sum, std::int64_t& count) const {
    const int r = team.league_rank();
    const int vocab = static_cast<int>(logits.extent(1));
    float row_max = -FLT_MAX;
    float sum = 0.0f;
    if constexpr (Kokkos::SpaceAccessibility<ExecSpace, Kokkos::HostSpace>::accessible) {
      // Host: blocks of the row over the team's threads, each block's max and sum in four
      // independent registers (a per-element reducer stays in memory, and its chain of dependent
      // max / add costs a store-to-load latency per element).
      const int blocks = (vocab + host_block - 1) / host_block;
      Kokkos::parallel_reduce(
          Kokkos::TeamThreadRange(team, blocks),
          [&](const int b, float& m) {
            float part[4] = {-FLT_MAX, -FLT_MAX, -FLT_MAX, -FLT_MAX};
            const int v0 = b * host_block, v1 = vocab - v0 < host_block ? vocab : v0 + host_block;
            for (int v = v0; v < v1; ++v) part[v % 4] = logits(r, v) > part[v % 4] ? logits(r, v) : part[v % 4];
            for (int q = 0; q < 4; ++q) m = part[q] > m ? part[q] : m;
          },
          Kokkos::Max<float>(row_max));
      Kokkos::parallel_reduce(
          Kokkos::TeamThreadRange(team, blocks),
          [&](const int b, float& total) {
            float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            const int v0 = b * host_block, v1 = vocab - v0 < host_block ? vocab : v0 + host_block;
            for (int v = v0; v < v1; ++v) part[v % 4] += Kokkos::Experimental::exp(logits(r, v) - row_max);
            total += (part[0] + part[1]) + (part[2] + part[3]);
          },
          sum);
    } else {
      Kokkos::parallel_reduce(
          Kokkos::TeamThreadRange(team, vocab),
          [&](const int v, float& m) {
            if (logits(r, v) > m) m = logits(r, v);
          },
          Kokkos::Max<float>(row_max));
      Kokkos::parallel_reduce(
          Kokkos::TeamThreadRange(team, vocab),
          [&](const int v, float& total) { total += Kokkos::Experimental::exp(logits(r, v) - row_max); }, sum);
    }
    const float row_lse = row_max + Kokkos::Experimental::log(sum);
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      lse(r) = row_lse;
      const std::int64_t t = targets(r);
      if (t != ignore_index) {
        loss_sum += static_cast<double>(row_lse - logits(r, t));
        count += 1;
      }
    });
  }
};

// Returns (sum of the counted rows' losses, number of counted rows).
template <class ExecSpace, class MemorySpace>
std::pair<double, std::int64_t> cross_entropy_forward_impl(const ExecSpace& exec,
                                                           const ConstTensor2<float, MemorySpace>& logits,
                                                           const ConstTensor1<std::int64_t, MemorySpace>& targets,
                                                           std::int64_t ignore_index,
                                                           const Tensor1<float, MemorySpace>& lse) {
  double loss_sum = 0.0;
  std::int64_t count = 0;
  const int rows = static_cast<int>(logits.extent(0));
  if (rows == 0) return {0.0, 0};
  Kokkos::parallel_reduce("kmamba::cross_entropy::forward", Kokkos::TeamPolicy<ExecSpace>(exec, rows, Kokkos::AUTO),
                          CrossEntropyForward<ExecSpace, MemorySpace>{logits, targets, ignore_index, lse}, loss_sum,
                          count);
  return {loss_sum, count};
}

template <class ExecSpace, class MemorySpace>
struct CrossEntropyBackward {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  ConstTensor2<float, MemorySpace> logits;
  ConstTensor1<std::int64_t, MemorySpace> targets;
  std::int64_t ignore_index;
  ConstTensor1<float, MemorySpace> lse;
  float scale;
  Tensor2<float, MemorySpace> dlogits;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int r = team.league_rank();
    const int vocab = static_cast<int>(logits.extent(1));
    const std::int64_t t = targets(r);
    const bool counted = t != ignore_index;
    const float row_lse = lse(r);
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, vocab), [&](const int v) {
      const float p = Kokkos::Experimental::exp(logits(r, v) - row_lse);
      dlogits(r, v) = counted ? scale * (p - (v == t ? 1.0f : 0.0f)) : 0.0f;
    });
  }
};

template <class ExecSpace, class MemorySpace>
void cross_entropy_backward_impl(const ExecSpace& exec, const ConstTensor2<float, MemorySpace>& logits,
                                 const ConstTensor1<std::int64_t, MemorySpace>& targets, std::int64_t ignore_index,
                                 const ConstTensor1<float, MemorySpace>& lse, float scale,
                                 const Tensor2<float, MemorySpace>& dlogits) {
  const int rows = static_cast<int>(logits.extent(0));
  if (rows == 0) return;
  Kokkos::parallel_for(
      "kmamba::cross_entropy::backward", Kokkos::TeamPolicy<ExecSpace>(exec, rows, Kokkos::AUTO),
      CrossEntropyBackward<ExecSpace, MemorySpace>{logits, targets, ignore_index, lse, scale, dlogits});
}

}  // namespace impl
}  // namespace kmamba

#endif
