// Internals of kmamba/core/CrossEntropy.hpp.
#ifndef KMAMBA_CORE_IMPL_CROSSENTROPYIMPL_HPP
#define KMAMBA_CORE_IMPL_CROSSENTROPYIMPL_HPP

#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/CheckIds.hpp>
#include <kmamba/core/Math.hpp>

#include <Kokkos_Core.hpp>

#include <cfloat>
#include <climits>
#include <cstdint>

namespace kmamba {
namespace impl {

/// A row's softmax statistics over the entries seen so far: the largest logit, the sum of
/// exp(logit − max), and the first index holding the largest logit.
struct SoftmaxStats {
  float max;
  float sum;
  int arg;

  /// Adds logit x at index v, for indices seen in increasing order (ties keep the first).
  KOKKOS_INLINE_FUNCTION void add(float x, int v) {
    if (x > max || arg == INT_MAX) {
      sum = sum * kmamba::math::exp(max - x) + 1.0f;
      max = x;
      arg = v;
    } else {
      sum += kmamba::math::exp(x - max);
    }
  }

  /// Merges the statistics of another set of entries (any order: ties take the smaller index).
  KOKKOS_INLINE_FUNCTION void merge(float other_max, float other_sum, int other_arg) {
    const float m = other_max > max ? other_max : max;
    sum = sum * kmamba::math::exp(max - m) + other_sum * kmamba::math::exp(other_max - m);
    if (other_max > max || (other_max == max && other_arg < arg)) arg = other_arg;
    max = m;
  }
};

/// Kokkos reducer over SoftmaxStats (a team's threads each walk part of a row).
struct SoftmaxStatsReducer {
  using reducer = SoftmaxStatsReducer;
  using value_type = SoftmaxStats;
  using result_view_type = Kokkos::View<value_type, Kokkos::AnonymousSpace, Kokkos::MemoryUnmanaged>;
  value_type* result;

  KOKKOS_INLINE_FUNCTION explicit SoftmaxStatsReducer(value_type& value) : result(&value) {}
  KOKKOS_INLINE_FUNCTION void join(value_type& dest, const value_type& src) const {
    dest.merge(src.max, src.sum, src.arg);
  }
#if KOKKOS_VERSION < 40000
  KOKKOS_INLINE_FUNCTION void join(volatile value_type& dest, const volatile value_type& src) const {
    SoftmaxStats merged{dest.max, dest.sum, dest.arg};
    merged.merge(src.max, src.sum, src.arg);
    dest.max = merged.max;
    dest.sum = merged.sum;
    dest.arg = merged.arg;
  }
#endif
  KOKKOS_INLINE_FUNCTION void init(value_type& value) const { value = SoftmaxStats{-FLT_MAX, 0.0f, INT_MAX}; }
  KOKKOS_INLINE_FUNCTION value_type& reference() const { return *result; }
  KOKKOS_INLINE_FUNCTION result_view_type view() const { return result_view_type(result); }
  KOKKOS_INLINE_FUNCTION bool references_scalar() const { return true; }
};

/// One pass over each row: its log-sum-exp (kept for the backward), the row's loss and whether its
/// first largest logit is the target.
template <class ExecSpace, class MemorySpace>
struct CrossEntropyForward {
  using member_type = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  ConstTensor2<float, MemorySpace> logits;
  ConstTensor1<std::int64_t, MemorySpace> targets;
  std::int64_t ignore_index;
  Tensor1<float, MemorySpace> lse;
  /// Entries of a row per host block.
  static constexpr int host_block = 1024;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team, double& loss_sum, std::int64_t& count,
                                         std::int64_t& correct) const {
    const int r = team.league_rank();
    const int vocab = static_cast<int>(logits.extent(1));
    SoftmaxStats stats{-FLT_MAX, 0.0f, INT_MAX};
    if constexpr (Kokkos::SpaceAccessibility<ExecSpace, Kokkos::HostSpace>::accessible) {
      // Host: blocks of the row over the team's threads, each block in four independent
      // statistics (one running statistic would chain every element on the previous one).
      const int blocks = (vocab + host_block - 1) / host_block;
      Kokkos::parallel_reduce(
          Kokkos::TeamThreadRange(team, blocks),
          [&](const int b, SoftmaxStats& acc) {
            SoftmaxStats part[4];
            for (int q = 0; q < 4; ++q) part[q] = SoftmaxStats{-FLT_MAX, 0.0f, INT_MAX};
            const int v0 = b * host_block, v1 = vocab - v0 < host_block ? vocab : v0 + host_block;
            for (int v = v0; v < v1; ++v) part[v % 4].add(logits(r, v), v);
            for (int q = 0; q < 4; ++q) acc.merge(part[q].max, part[q].sum, part[q].arg);
          },
          SoftmaxStatsReducer(stats));
    } else {
      Kokkos::parallel_reduce(
          Kokkos::TeamThreadRange(team, vocab), [&](const int v, SoftmaxStats& acc) { acc.add(logits(r, v), v); },
          SoftmaxStatsReducer(stats));
    }
    const float row_lse = stats.max + kmamba::math::log(stats.sum);
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      lse(r) = row_lse;
      const std::int64_t t = targets(r);
      if (t != ignore_index) {
        loss_sum += static_cast<double>(row_lse - logits(r, t));
        count += 1;
        if (stats.arg == t) correct += 1;
      }
    });
  }
};

/// The summed loss, the counted rows and, of those, the rows whose first largest logit is the target.
struct CrossEntropyTotals {
  double loss_sum = 0.0;
  std::int64_t count = 0;
  std::int64_t correct = 0;
};

template <class ExecSpace, class MemorySpace>
CrossEntropyTotals cross_entropy_forward_impl(const ExecSpace& exec, const ConstTensor2<float, MemorySpace>& logits,
                                              const ConstTensor1<std::int64_t, MemorySpace>& targets,
                                              std::int64_t ignore_index, const Tensor1<float, MemorySpace>& lse) {
  CrossEntropyTotals totals;
  const int rows = static_cast<int>(logits.extent(0));
  if (rows == 0) return totals;
  Kokkos::parallel_reduce("kmamba::cross_entropy::forward", Kokkos::TeamPolicy<ExecSpace>(exec, rows, Kokkos::AUTO),
                          CrossEntropyForward<ExecSpace, MemorySpace>{logits, targets, ignore_index, lse},
                          totals.loss_sum, totals.count, totals.correct);
  return totals;
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
      const float p = kmamba::math::exp(logits(r, v) - row_lse);
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
