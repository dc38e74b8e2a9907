// Internals of kmamba/core/RmsNorm.hpp: the forward and backward kernels shared by the plain and
// the gated RMSNorm. Everything is computed in fp32 whatever the storage type of the views.
//
// Work decomposition:
//   forward    one team per (row, group): a team reduction of the sum of squares, then the team
//              writes the group's outputs (and its rstd). add_rms_norm: one team per row, which
//              writes residual + delta back while reducing its squares, then normalises it.
//   backward   one team per (row block, group) whose threads take the block's rows in turn (on
//              GPUs a thread is a warp whose lanes cover the channels): a row's reductions (sum
//              of squares unless rstd was saved, and mean(x̂ ⊙ w ⊙ go)) are lane reductions with no
//              team barrier, the thread writes dx (dz) and accumulates go ⊙ x̂ into its own scratch
//              row; at the end of the block the team adds its threads' rows in thread order and
//              writes the sum as the block's row of a (blocks, dim) workspace. A second kernel sums
//              that workspace over the blocks in block order into dweight: no atomics, so dweight
//              is the same bit for bit from run to run (the blocks follow the rows and the
//              device's concurrency, so it may differ between thread counts). The workspace is
//              allocated per call and released on return, as the other ops' workspaces are: no
//              fence (docs/design.md, "Memory").
#ifndef KMAMBA_CORE_IMPL_RMSNORMIMPL_HPP
#define KMAMBA_CORE_IMPL_RMSNORMIMPL_HPP

#include <kmamba/core/Activations.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>
#include <kmamba/core/Bf16.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/Math.hpp>
#include <kmamba/core/Tensor.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace kmamba {
namespace impl {

/// Enables an overload only for a Kokkos::View argument (saved rstd versus eps).
template <class ViewType>
using rms_norm_if_view = std::enable_if_t<Kokkos::is_view<ViewType>::value, int>;

/// True if `ExecutionSpace` can access the memory of every view type.
template <class ExecutionSpace, class... Views>
constexpr bool rms_norm_accessible =
    (Kokkos::SpaceAccessibility<ExecutionSpace, typename Views::memory_space>::accessible && ...);

/// Checks the scalar arguments shared by every entry point and returns the number of groups.
inline int rms_norm_groups(const char* function, std::int64_t rows, std::int64_t dim, std::int64_t group_size,
                           float eps) {
  KMAMBA_REQUIRE(dim >= 1, function << ": x has shape (" << rows << ", " << dim << ") but (rows, dim) needs dim >= 1");
  KMAMBA_REQUIRE(group_size >= 1 && dim % group_size == 0,
                 function << ": group_size " << group_size << " does not divide dim " << dim);
  KMAMBA_REQUIRE(eps >= 0.0f, function << ": eps must be >= 0, got " << eps);
  KMAMBA_REQUIRE(rows * (dim / group_size) <= INT_MAX,
                 function << ": rows * (dim / group_size) = " << rows * (dim / group_size)
                          << " exceeds the largest team count " << INT_MAX);
  return static_cast<int>(dim / group_size);
}

/// Where the gate silu(z) enters the normalisation.
enum class RmsNormGate {
  none,       ///< plain RMSNorm
  pre_norm,   ///< norm_before_gate = false: y = rmsnorm(x ⊙ silu(z)) ⊙ w (Mamba-2)
  post_norm,  ///< norm_before_gate = true:  y = rmsnorm(x) ⊙ w ⊙ silu(z) (Mamba-3 output norm)
};

/// rstd is (rows,) for the plain norm and (rows, ngroups) for the gated one.
template <class RstdView>
KOKKOS_INLINE_FUNCTION typename RstdView::reference_type rms_norm_rstd_at(const RstdView& rstd, int row, int group) {
  if constexpr (RstdView::rank == 1) {
    (void)group;
    return rstd(row);
  } else {
    return rstd(row, group);
  }
}

/// Rows a backward team works on at once (one per team thread).
constexpr int rms_norm_backward_threads = 4;

/// Threads of a device forward team when there are more rows than the device holds teams at once.
constexpr int rms_norm_forward_rows_team = 128;

/// Rows each backward team handles: at least `min_rows`, and at most `max_blocks` blocks in all
/// (which bounds the partial rows of dweight, and the second kernel's sums, to max_blocks).
inline int rms_norm_rows_per_block(int rows, std::int64_t max_blocks) {
  constexpr std::int64_t min_rows = 4;
  return static_cast<int>(std::max(min_rows, (static_cast<std::int64_t>(rows) + max_blocks - 1) / max_blocks));
}

/// The normalised input of element (row, c): x, or x ⊙ silu(z) for the pre-norm gate.
template <class XView, class ZView>
struct RmsNormInput {
  XView x;
  ZView z;
  RmsNormGate gate;

  KOKKOS_INLINE_FUNCTION float operator()(int row, int c) const {
    const float xv = to_float(x(row, c));
    return gate == RmsNormGate::pre_norm ? xv * kmamba::silu(to_float(z(row, c))) : xv;
  }
};

template <class ExecutionSpace, class XView, class ZView, class WView, class YView, class RstdView>
struct RmsNormForwardFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecutionSpace>::member_type;
  using y_type = typename YView::non_const_value_type;

  RmsNormInput<XView, ZView> input;
  WView weight;
  YView y;
  RstdView rstd;
  float eps;
  int group_size;
  int ngroups;
  bool write_rstd;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int row = team.league_rank() / ngroups;
    const int group = team.league_rank() % ngroups;
    const int begin = group * group_size;
    const int end = begin + group_size;

    float sumsq = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::TeamThreadRange(team, begin, end),
        [&](const int c, float& acc) {
          const float v = input(row, c);
          acc += v * v;
        },
        sumsq);
    const float r = 1.0f / kmamba::math::sqrt(sumsq / static_cast<float>(group_size) + eps);

    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, begin, end), [&](const int c) {
      float out = input(row, c) * r * to_float(weight(c));
      if (input.gate == RmsNormGate::post_norm) {
        out *= kmamba::silu(to_float(input.z(row, c)));
      }
      y(row, c) = from_float<y_type>(out);
    });
    if (write_rstd) {
      Kokkos::single(Kokkos::PerTeam(team), [&]() { rms_norm_rstd_at(rstd, row, group) = r; });
    }
  }
};

/// add_rms_norm: one team per row; the team first adds delta into the residual row (summing the
/// squares of the sums), then, after a barrier, normalises the updated row.
template <class ExecutionSpace, class ResidualView, class DeltaView, class WView, class YView>
struct RmsNormAddForwardFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecutionSpace>::member_type;
  using residual_type = typename ResidualView::non_const_value_type;
  using y_type = typename YView::non_const_value_type;

  ResidualView residual;
  DeltaView delta;
  WView weight;
  YView y;
  float eps;
  int dim;

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int row = team.league_rank();
    float sumsq = 0.0f;
    Kokkos::parallel_reduce(
        Kokkos::TeamThreadRange(team, dim),
        [&](const int c, float& acc) {
          const residual_type v = from_float<residual_type>(to_float(residual(row, c)) + to_float(delta(row, c)));
          residual(row, c) = v;
          const float f = to_float(v);
          acc += f * f;
        },
        sumsq);
    team.team_barrier();
    const float r = 1.0f / kmamba::math::sqrt(sumsq / static_cast<float>(dim) + eps);
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, dim), [&](const int c) {
      y(row, c) = from_float<y_type>(to_float(residual(row, c)) * r * to_float(weight(c)));
    });
  }
};

template <class ExecutionSpace, class DyView, class XView, class ZView, class WView, class RstdView, class DxView,
          class DzView, class DweightView>
struct RmsNormBackwardFunctor {
  using member_type = typename Kokkos::TeamPolicy<ExecutionSpace>::member_type;
  using scratch_view = Kokkos::View<float**, Kokkos::LayoutRight, typename ExecutionSpace::scratch_memory_space,
                                    Kokkos::MemoryUnmanaged>;
  using dx_type = typename DxView::non_const_value_type;
  using dz_type = typename DzView::non_const_value_type;

  DyView dy;
  RmsNormInput<XView, ZView> input;
  WView weight;
  RstdView rstd;
  DxView dx;
  DzView dz;
  Kokkos::View<float**, Kokkos::LayoutRight, typename DweightView::memory_space> dweight_blocks;  // (blocks, dim)
  float eps;
  int rows;
  int group_size;
  int ngroups;
  int rows_per_block;
  int scratch_level;
  int lanes;  ///< the policy's vector length: a row's channels are spread over this many lanes
  bool have_rstd;

  /// The gradient reaching x̂ ⊙ w: dy, or dy ⊙ silu(z) when the gate follows the norm.
  KOKKOS_INLINE_FUNCTION float grad_out(int row, int c) const {
    const float g = to_float(dy(row, c));
    return input.gate == RmsNormGate::post_norm ? g * kmamba::silu(to_float(input.z(row, c))) : g;
  }

  /// Σ f(c) over the lane's channels c = begin + lane + k·lanes, four at a time in independent
  /// sums so that their loads are in flight together.
  template <class F>
  KOKKOS_INLINE_FUNCTION float lane_sum(int lane, int begin, int end, const F& f) const {
    float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
    int c = begin + lane;
    for (; c + 3 * lanes < end; c += 4 * lanes) {
      s0 += f(c);
      s1 += f(c + lanes);
      s2 += f(c + 2 * lanes);
      s3 += f(c + 3 * lanes);
    }
    for (; c < end; c += lanes) s0 += f(c);
    return (s0 + s1) + (s2 + s3);
  }

  /// f(c) over the lane's channels, four at a time.
  template <class F>
  KOKKOS_INLINE_FUNCTION void lane_for(int lane, int begin, int end, const F& f) const {
    int c = begin + lane;
    for (; c + 3 * lanes < end; c += 4 * lanes) {
      f(c);
      f(c + lanes);
      f(c + 2 * lanes);
      f(c + 3 * lanes);
    }
    for (; c < end; c += lanes) f(c);
  }

  /// Writes dx (and dz) of element (row, c) and adds its share of dweight to `dweight_sum`.
  KOKKOS_INLINE_FUNCTION void write_gradients(int row, int c, float r, float mean_term, float& dweight_sum) const {
    const float xhat = input(row, c) * r;
    const float w = to_float(weight(c));
    const float go = grad_out(row, c);
    const float dv = (w * go - xhat * mean_term) * r;
    switch (input.gate) {
      case RmsNormGate::none:
        dx(row, c) = from_float<dx_type>(dv);
        break;
      case RmsNormGate::pre_norm: {
        const float zv = to_float(input.z(row, c));
        dx(row, c) = from_float<dx_type>(dv * kmamba::silu(zv));
        dz(row, c) = from_float<dz_type>(dv * to_float(input.x(row, c)) * kmamba::silu_derivative(zv));
        break;
      }
      case RmsNormGate::post_norm: {
        const float zv = to_float(input.z(row, c));
        dx(row, c) = from_float<dx_type>(dv);
        dz(row, c) = from_float<dz_type>(to_float(dy(row, c)) * xhat * w * kmamba::silu_derivative(zv));
        break;
      }
    }
    dweight_sum += go * xhat;
  }

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    const int block = team.league_rank() / ngroups;
    const int group = team.league_rank() % ngroups;
    const int begin = group * group_size;
    const int end = begin + group_size;
    const int row_begin = block * rows_per_block;
    const int row_end = row_begin + rows_per_block < rows ? row_begin + rows_per_block : rows;
    const float inv_n = 1.0f / static_cast<float>(group_size);
    const int q = team.team_rank();
    const int team_size = team.team_size();
    // (team_size, group_size): each team thread's share of dweight for the group's channels.
    const scratch_view dweight_rows(team.team_scratch(scratch_level), team_size, group_size);
    Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, group_size), [&](const int i) { dweight_rows(q, i) = 0.0f; });

    // A row per thread (on GPUs a warp, its lanes over the channels): the row's reductions are
    // lane reductions, with no team barrier between rows.
    for (int row = row_begin + q; row < row_end; row += team_size) {
      float r;
      if (have_rstd) {
        r = rms_norm_rstd_at(rstd, row, group);
      } else {
        float sumsq = 0.0f;
        Kokkos::parallel_reduce(
            Kokkos::ThreadVectorRange(team, lanes),
            [&](const int lane, float& acc) {
              acc += lane_sum(lane, begin, end, [&](const int c) {
                const float v = input(row, c);
                return v * v;
              });
            },
            sumsq);
        r = 1.0f / kmamba::math::sqrt(sumsq * inv_n + eps);
      }

      // mean over the group of x̂ ⊙ w ⊙ go, with x̂ = v·r.
      float projection = 0.0f;
      Kokkos::parallel_reduce(
          Kokkos::ThreadVectorRange(team, lanes),
          [&](const int lane, float& acc) {
            acc += lane_sum(lane, begin, end,
                            [&](const int c) { return input(row, c) * to_float(weight(c)) * grad_out(row, c); });
          },
          projection);
      const float mean_term = projection * r * inv_n;

      Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, lanes), [&](const int lane) {
        lane_for(lane, begin, end,
                 [&](const int c) { write_gradients(row, c, r, mean_term, dweight_rows(q, c - begin)); });
      });
    }
    team.team_barrier();
    Kokkos::parallel_for(Kokkos::TeamVectorRange(team, begin, end), [&](const int c) {
      float total = 0.0f;
      for (int p = 0; p < team_size; ++p) total += dweight_rows(p, c - begin);
      dweight_blocks(block, c) = total;
    });
  }
};

/// dweight(c): the blocks' partial rows summed in block order.
template <class DweightView>
struct RmsNormDweightSumFunctor {
  Kokkos::View<const float**, Kokkos::LayoutRight, typename DweightView::memory_space> dweight_blocks;  // (blocks, dim)
  DweightView dweight;
  KOKKOS_INLINE_FUNCTION void operator()(const int c) const {
    float sum = 0.0f;
    for (int block = 0; block < static_cast<int>(dweight_blocks.extent(0)); ++block) sum += dweight_blocks(block, c);
    dweight(c) = sum;
  }
};

/// Launches a forward functor with one team per (row, group) of group_size channels.
template <class ExecutionSpace, class Functor>
void rms_norm_launch_forward(const ExecutionSpace& exec, const char* label, int league, int group_size,
                             const Functor& functor) {
  using Policy = Kokkos::TeamPolicy<ExecutionSpace>;
  if constexpr (Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename ExecutionSpace::memory_space>::accessible) {
    Kokkos::parallel_for(label, light_weight(Policy(exec, league, Kokkos::AUTO)), functor);
  } else {
    // Few rows (a decode step's): a team of about one thread per two channels, since the
    // automatic team (64 threads) would walk a 1536-channel row in 24 dependent loads per thread,
    // which the single row waits for in full. More rows than the device holds teams of
    // rms_norm_forward_rows_team threads: teams of that size, whose reduction over a few warps
    // costs little beside the row's loads (a team of hundreds of threads spends most of its
    // instructions in the reduction's barriers, and the device runs out of work to overlap).
    const int max_team = Policy(exec, league, 1).team_size_max(functor, Kokkos::ParallelForTag());
    const bool many_rows = league >= exec.concurrency() / rms_norm_forward_rows_team;
    const int wanted = many_rows ? rms_norm_forward_rows_team : std::max(32, (group_size / 2 + 31) / 32 * 32);
    Kokkos::parallel_for(label, light_weight(Policy(exec, league, std::max(1, std::min(max_team, wanted)))), functor);
  }
}

template <class ExecutionSpace, class XView, class ZView, class WView, class YView, class RstdView>
void rms_norm_forward(const ExecutionSpace& exec, const XView& x, const ZView& z, const WView& weight, float eps,
                      int group_size, RmsNormGate gate, const YView& y, const RstdView& rstd, bool write_rstd) {
  const int rows = static_cast<int>(x.extent(0));
  const int ngroups = static_cast<int>(x.extent(1)) / group_size;
  if (rows == 0) return;
  using Functor = RmsNormForwardFunctor<ExecutionSpace, XView, ZView, WView, YView, RstdView>;
  rms_norm_launch_forward(exec, "kmamba::rms_norm::forward", rows * ngroups, group_size,
                          Functor{{x, z, gate}, weight, y, rstd, eps, group_size, ngroups, write_rstd});
}

template <class ExecutionSpace, class DyView, class XView, class ZView, class WView, class RstdView, class DxView,
          class DzView, class DweightView>
void rms_norm_backward(const char* function, const ExecutionSpace& exec, const DyView& dy, const XView& x,
                       const ZView& z, const WView& weight, const RstdView& rstd, bool have_rstd, float eps,
                       int group_size, RmsNormGate gate, const DxView& dx, const DzView& dz,
                       const DweightView& dweight) {
  using Policy = Kokkos::TeamPolicy<ExecutionSpace>;
  using Functor =
      RmsNormBackwardFunctor<ExecutionSpace, DyView, XView, ZView, WView, RstdView, DxView, DzView, DweightView>;
  const int rows = static_cast<int>(x.extent(0));
  const int dim = static_cast<int>(x.extent(1));
  const int ngroups = dim / group_size;
  // Teams of rms_norm_backward_threads rows at once (fewer where the backend allows fewer), each a
  // vector of up to 32 lanes over the channels.
  const int vector_length = std::min(32, static_cast<int>(Policy::vector_length_max()));
  Functor functor{dy, {x, z, gate},  weight,   rstd, dx, dz, {}, eps, rows, group_size, ngroups, 0,
                  0,  vector_length, have_rstd};
  const int team_size =
      std::max(1, std::min(rms_norm_backward_threads,
                           Policy(exec, 1, 1, vector_length).team_size_max(functor, Kokkos::ParallelForTag())));
  // As many row blocks as teams the device holds at once (at least 64): enough rows in flight to
  // cover the loads' latency, few enough that the partial rows of dweight stay small.
  const std::int64_t threads_per_team =
      static_cast<std::int64_t>(team_size) * (vector_lanes_are_threads<ExecutionSpace> ? vector_length : 1);
  const int rows_per_block = rms_norm_rows_per_block(
      rows, std::max<std::int64_t>(64, static_cast<std::int64_t>(exec.concurrency()) / threads_per_team));
  functor.rows_per_block = rows_per_block;
  const int blocks = (rows + rows_per_block - 1) / rows_per_block;
  // shmem_size includes the alignment padding of a View placed in scratch.
  const std::size_t scratch_bytes =
      Functor::scratch_view::shmem_size(static_cast<std::size_t>(team_size), static_cast<std::size_t>(group_size));
  KMAMBA_REQUIRE(scratch_bytes <= static_cast<std::size_t>(Policy::scratch_size_max(1)),
                 function << ": group_size " << group_size << " needs " << scratch_bytes
                          << " bytes of team scratch, more than the " << Policy::scratch_size_max(1)
                          << " the backend offers");
  functor.scratch_level = scratch_bytes <= static_cast<std::size_t>(Policy::scratch_size_max(0)) ? 0 : 1;

  functor.dweight_blocks =
      allocate_uninitialized<decltype(functor.dweight_blocks)>("kmamba::rms_norm::dweight_blocks", blocks, dim);
  if (blocks > 0) {
    Kokkos::parallel_for("kmamba::rms_norm::backward",
                         Policy(exec, blocks * ngroups, team_size, vector_length)
                             .set_scratch_size(functor.scratch_level, Kokkos::PerTeam(scratch_bytes)),
                         functor);
  }
  Kokkos::parallel_for("kmamba::rms_norm::sum_dweight", Kokkos::RangePolicy<ExecutionSpace>(exec, 0, dim),
                       RmsNormDweightSumFunctor<DweightView>{functor.dweight_blocks, dweight});
}

}  // namespace impl
}  // namespace kmamba

#endif
