// PowerSGD gradient compression (Vogels, Karimireddy and Jaggi, "PowerSGD: Practical Low-Rank
// Gradient Compression for Distributed Optimization", NeurIPS 2019) for the data-parallel gradient
// reduction (docs/distributed.md §3.4). Each compressed gradient matrix M (rows n, cols m) of every
// rank travels as two rank-r factors instead of its n·m values:
//
//   M ← M + E                      error feedback (E: this rank's residual, fp32, zero at first)
//   P ← M Q                        (n, r); Q (m, r) from the previous step (warm start), or at the
//                                  first step drawn from a fixed seed, the same on every rank
//   P ← Σ_ranks P                  all-reduce, r·n values
//   P ← orthonormal columns of P   Gram–Schmidt, twice; a column that is (numerically) in the span
//                                  of the earlier ones becomes zero (and its Q column is redrawn)
//   Q ← Mᵀ P ;  Q ← Σ_ranks Q      all-reduce, r·m values
//   M̂ ← P Qᵀ                       = P Pᵀ Σ_ranks M: the sum projected on span(P)
//   E ← M − M̂ / D                  D ranks: Σ_ranks E carries what Σ M̂ left out of Σ M
//
// and the gradient becomes M̂ on every rank. The matrices whose factors would not be smaller
// (r·(n + m) >= n·m, powersgd_compresses) and every other element of the flat gradient (vectors,
// biases, norm weights) are all-reduced whole, in the same all-reduce as the P factors. The
// gradients are sums over the ranks, as DataParallel reduces them (each rank's loss is weighted by
// its share of the global batch's tokens), so M̂ approximates Σ_ranks M.
//
// Everything after an all-reduce (Gram–Schmidt, M̂ = P Qᵀ) computes the same values on every rank
// from the same inputs, so the reduced gradients are bitwise identical on all ranks. A reduction
// whose factors or whole elements are not finite leaves a non-finite gradient (the Trainer skips
// the step) and restarts the compression: E ← 0, Q ← the seed's.
//
//   kmamba::PowerSgd<Exec> powersgd(comm, slab.size(), {{offset, rows, cols}, ...}, /*rank=*/4);
//   powersgd.reduce(exec, slab.grads());   // every step, after the backward; collective
#ifndef KMAMBA_PARALLEL_POWERSGD_HPP
#define KMAMBA_PARALLEL_POWERSGD_HPP

#include <kmamba/backends/Gemm.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/Math.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/parallel/Communicator.hpp>
#include <kmamba/parallel/GradientBuckets.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

namespace kmamba {

/// A gradient matrix PowerSGD compresses: elements [offset, offset + rows·cols) of the flat
/// gradient, row-major (rows, cols).
struct PowerSgdMatrix {
  std::size_t offset = 0;
  std::int64_t rows = 0, cols = 0;
};

/// Whether rank-`rank` factors of a (rows, cols) matrix hold fewer values than the matrix:
/// rank·(rows + cols) < rows·cols. The others are all-reduced whole.
inline bool powersgd_compresses(std::int64_t rows, std::int64_t cols, int rank) {
  return static_cast<std::int64_t>(rank) * (rows + cols) < rows * cols;
}

/// The seed of the first step's Q (the same on every rank).
constexpr std::uint64_t powersgd_default_seed = 20190531;

namespace impl {

/// Where one compressed matrix lies: in the gradient, and its P in the P buffer, its Q in the Q buffer.
struct PowerSgdPlace {
  std::size_t offset = 0, p_offset = 0, q_offset = 0;
  std::int64_t rows = 0, cols = 0;
};

/// e ← e + factor · g.
template <class MemorySpace>
struct AddScaled {
  Tensor1<float, MemorySpace> e;       // (n)
  ConstTensor1<float, MemorySpace> g;  // (n)
  float factor;
  KOKKOS_INLINE_FUNCTION void operator()(const std::size_t i) const { e(i) += factor * g(i); }
};

/// Orthonormalises the columns of each matrix's P (rows, rank), one team per matrix: modified
/// Gram–Schmidt, run twice over the earlier columns ("twice is enough"), dot products summed in
/// double. A column whose norm after the projections is at most 2⁻¹² of its norm before (in the
/// span of the earlier columns up to rounding), or zero, becomes zero and is marked in `zeroed`.
/// A non-finite column stays non-finite.
template <class ExecutionSpace>
struct Orthonormalize {
  using Mem = typename ExecutionSpace::memory_space;
  using Member = typename Kokkos::TeamPolicy<ExecutionSpace>::member_type;
  static constexpr double relative_floor = 1.0 / (4096.0 * 4096.0);  // (2⁻¹²)², on squared norms

  Kokkos::View<const PowerSgdPlace*, Mem> places;  // (matrices)
  Tensor1<float, Mem> p;                           // (P buffer)
  Tensor1<int, Mem> zeroed;                        // (matrices · rank)
  int rank;

  KOKKOS_INLINE_FUNCTION double dot(const Member& team, const float* x, int a, int b, std::int64_t rows) const {
    double sum = 0.0;
    Kokkos::parallel_reduce(
        Kokkos::TeamThreadRange(team, rows),
        [&](const std::int64_t i, double& acc) {
          acc += static_cast<double>(x[i * rank + a]) * static_cast<double>(x[i * rank + b]);
        },
        sum);
    return sum;
  }

  KOKKOS_INLINE_FUNCTION void scale(const Member& team, float* x, int c, std::int64_t rows, float factor) const {
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows), [&](const std::int64_t i) { x[i * rank + c] *= factor; });
    team.team_barrier();
  }

  KOKKOS_INLINE_FUNCTION void operator()(const Member& team) const {
    const PowerSgdPlace place = places(team.league_rank());
    float* const x = p.data() + place.p_offset;
    for (int c = 0; c < rank; ++c) {
      const double before = dot(team, x, c, c, place.rows);
      for (int pass = 0; pass < 2; ++pass) {
        for (int j = 0; j < c; ++j) {
          const float projection = static_cast<float>(dot(team, x, j, c, place.rows));
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, place.rows),
                               [&](const std::int64_t i) { x[i * rank + c] -= projection * x[i * rank + j]; });
          team.team_barrier();
        }
      }
      const double after = dot(team, x, c, c, place.rows);
      const bool zero = after <= relative_floor * before;  // false for NaN: a non-finite column stays so
      scale(team, x, c, place.rows, zero ? 0.0f : static_cast<float>(1.0 / kmamba::math::sqrt(after)));
      Kokkos::single(Kokkos::PerTeam(team), [&]() { zeroed(team.league_rank() * rank + c) = zero ? 1 : 0; });
    }
  }
};

/// Q's columns whose P column Orthonormalize zeroed ← the seed's (team per matrix).
template <class ExecutionSpace>
struct RedrawZeroed {
  using Mem = typename ExecutionSpace::memory_space;
  using Member = typename Kokkos::TeamPolicy<ExecutionSpace>::member_type;

  Kokkos::View<const PowerSgdPlace*, Mem> places;  // (matrices)
  ConstTensor1<int, Mem> zeroed;                   // (matrices · rank)
  ConstTensor1<float, Mem> seed_q;                 // (Q buffer)
  Tensor1<float, Mem> q;                           // (Q buffer)
  int rank;

  KOKKOS_INLINE_FUNCTION void operator()(const Member& team) const {
    const int matrix = team.league_rank();
    const PowerSgdPlace place = places(matrix);
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, place.cols * rank), [&](const std::int64_t k) {
      const std::size_t at = place.q_offset + static_cast<std::size_t>(k);
      if (zeroed(matrix * rank + static_cast<int>(k % rank))) q(at) = seed_q(at);
    });
  }
};

}  // namespace impl

/// PowerSGD over one communicator (the ranks that sum the gradients). Keeps a reference to the
/// communicator, which must outlive it. Not thread-safe; one reduction at a time.
template <class ExecutionSpace>
class PowerSgd {
 public:
  using execution_space = ExecutionSpace;
  using memory_space = typename ExecutionSpace::memory_space;

  /// Compresses `matrices` (disjoint ranges of a flat gradient of `elements` values) to factors of
  /// rank `rank`; the rest of the gradient is all-reduced whole. Q starts from `seed` (the same on
  /// every rank). Throws a UserError for a rank below 1 or a matrix outside the gradient or
  /// overlapping another.
  PowerSgd(const Communicator& comm, std::size_t elements, std::vector<PowerSgdMatrix> matrices, int rank,
           std::uint64_t seed = powersgd_default_seed);

  /// grads ← the sum over the ranks of grads, each compressed matrix as its rank-r PowerSGD
  /// approximation M̂ (the file comment), the other elements exactly as an all-reduce sums them;
  /// updates this rank's error() and the warm-start Q. Identical on every rank. Collective: two
  /// all-reduces. Blocking (a finiteness check reads a host value).
  void reduce(const ExecutionSpace& exec, const Tensor1<float, memory_space>& grads);  // (elements)

  /// Restarts the compression: error() ← 0 and Q ← the seed's, as after construction.
  void reset(const ExecutionSpace& exec);

  int rank() const { return rank_; }
  std::size_t elements() const { return elements_; }
  /// The compressed matrices, in the order given.
  const std::vector<PowerSgdMatrix>& matrices() const { return matrices_; }
  /// Values one reduction all-reduces: Σ rank·(rows + cols) over the matrices plus every element
  /// outside them.
  std::size_t wire_elements() const { return p_.extent(0) + q_.extent(0); }
  /// This rank's error-feedback residual E in the gradient's layout (zero outside the matrices).
  const Tensor1<float, memory_space>& error() const { return error_; }  // (elements)

 private:
  using Matrix = Tensor2<float, memory_space>;
  // The (rows, cols) row-major matrix at `offset` of `buffer`.
  Matrix matrix(const Tensor1<float, memory_space>& buffer,  // (>= offset + rows · cols)
                std::size_t offset, std::int64_t rows, std::int64_t cols) const {
    return Matrix(buffer.data() + offset, static_cast<std::size_t>(rows), static_cast<std::size_t>(cols));
  }
  // Checks the matrices and places their factors and the whole elements in the buffers.
  void lay_out();
  // E_i ← E_i + factor · grads_i over every matrix (kernel `label`): the error feedback's two updates.
  void accumulate(const ExecutionSpace& exec, const char* label,
                  const Tensor1<float, memory_space>& grads,  // (elements)
                  float factor) const;
  // to_wire: the whole elements of grads → the P buffer's tail; otherwise back.
  void move_whole(const ExecutionSpace& exec, const Tensor1<float, memory_space>& grads,  // (elements)
                  bool to_wire) const;
  // Whether the all-reduced buffers (P factors, whole elements, Q factors) are finite. Blocking.
  bool finite(const ExecutionSpace& exec) const;

  const Communicator* comm_;
  std::size_t elements_;
  std::vector<PowerSgdMatrix> matrices_;
  int rank_;
  std::vector<impl::PowerSgdPlace> places_;
  std::vector<std::pair<std::size_t, std::size_t>> whole_;            // [begin, end) of the uncompressed elements
  std::size_t p_elements_ = 0, q_elements_ = 0, whole_elements_ = 0;  // Σ rank·rows, Σ rank·cols, the rest
  Kokkos::View<impl::PowerSgdPlace*, memory_space> device_places_;    // (matrices)
  Tensor1<float, memory_space> error_;                                // (elements)
  Tensor1<float, memory_space> p_;       // (Σ rank·rows + whole elements): P factors, then the whole elements
  Tensor1<float, memory_space> q_;       // (Σ rank·cols): the Q factors, warm start and wire
  Tensor1<float, memory_space> seed_q_;  // (Σ rank·cols): the first step's Q
  Tensor1<int, memory_space> zeroed_;    // (matrices · rank): P columns Gram–Schmidt zeroed
};

template <class ExecutionSpace>
PowerSgd<ExecutionSpace>::PowerSgd(const Communicator& comm, std::size_t elements, std::vector<PowerSgdMatrix> matrices,
                                   int rank, std::uint64_t seed)
    : comm_(&comm), elements_(elements), matrices_(std::move(matrices)), rank_(rank) {
  KMAMBA_REQUIRE(rank >= 1, "kmamba::PowerSgd: powersgd_rank must be >= 1, got " << rank);
  lay_out();
  error_ = Tensor1<float, memory_space>("kmamba::powersgd::error", elements);
  p_ = Tensor1<float, memory_space>("kmamba::powersgd::p", p_elements_ + whole_elements_);
  q_ = Tensor1<float, memory_space>("kmamba::powersgd::q", q_elements_);
  seed_q_ = Tensor1<float, memory_space>("kmamba::powersgd::seed_q", q_elements_);
  zeroed_ = Tensor1<int, memory_space>("kmamba::powersgd::zeroed", matrices_.size() * static_cast<std::size_t>(rank));
  // std::mt19937_64 and the normal distribution of one build give every rank the same values.
  const auto host = Kokkos::create_mirror_view(seed_q_);
  std::mt19937_64 generator(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (std::size_t i = 0; i < q_elements_; ++i) host(i) = normal(generator);
  Kokkos::deep_copy(seed_q_, host);
  Kokkos::deep_copy(q_, seed_q_);
  device_places_ = Kokkos::View<impl::PowerSgdPlace*, memory_space>("kmamba::powersgd::places", places_.size());
  const auto host_places = Kokkos::create_mirror_view(device_places_);
  for (std::size_t i = 0; i < places_.size(); ++i) host_places(i) = places_[i];
  Kokkos::deep_copy(device_places_, host_places);
}

template <class ExecutionSpace>
void PowerSgd<ExecutionSpace>::lay_out() {
  constexpr const char* function = "kmamba::PowerSgd";
  std::vector<std::size_t> order(matrices_.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return matrices_[a].offset < matrices_[b].offset; });
  std::size_t covered = 0;  // the gradient's elements before `covered` are placed
  for (const std::size_t i : order) {
    const PowerSgdMatrix& m = matrices_[i];
    KMAMBA_REQUIRE(m.rows >= 1 && m.cols >= 1,
                   function << ": matrix " << i << " has shape (" << m.rows << ", " << m.cols << ")");
    const std::size_t size = static_cast<std::size_t>(m.rows * m.cols);
    KMAMBA_REQUIRE(m.offset >= covered && m.offset + size <= elements_,
                   function << ": matrix " << i << " (elements " << m.offset << " to " << m.offset + size
                            << ") overlaps another or lies outside the gradient of " << elements_ << " elements");
    if (m.offset > covered) whole_.emplace_back(covered, m.offset);
    covered = m.offset + size;
  }
  if (covered < elements_) whole_.emplace_back(covered, elements_);
  for (const PowerSgdMatrix& m : matrices_) {
    places_.push_back({m.offset, p_elements_, q_elements_, m.rows, m.cols});
    p_elements_ += static_cast<std::size_t>(rank_ * m.rows);
    q_elements_ += static_cast<std::size_t>(rank_ * m.cols);
  }
  for (const auto& range : whole_) whole_elements_ += range.second - range.first;
}

template <class ExecutionSpace>
void PowerSgd<ExecutionSpace>::accumulate(const ExecutionSpace& exec, const char* label,
                                          const Tensor1<float, memory_space>& grads, float factor) const {
  for (const PowerSgdMatrix& m : matrices_) {
    const Tensor1<float, memory_space> e(error_.data() + m.offset, static_cast<std::size_t>(m.rows * m.cols));
    const ConstTensor1<float, memory_space> g(grads.data() + m.offset, e.extent(0));
    Kokkos::parallel_for(label,
                         Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::size_t>>(exec, 0, e.extent(0)),
                         impl::AddScaled<memory_space>{e, g, factor});
  }
}

template <class ExecutionSpace>
void PowerSgd<ExecutionSpace>::move_whole(const ExecutionSpace& exec, const Tensor1<float, memory_space>& grads,
                                          bool to_wire) const {
  std::size_t at = p_elements_;
  for (const auto& range : whole_) {
    const std::size_t size = range.second - range.first;
    const Tensor1<float, memory_space> wire(p_.data() + at, size), grad(grads.data() + range.first, size);
    if (to_wire) {
      Kokkos::deep_copy(exec, wire, grad);
    } else {
      Kokkos::deep_copy(exec, grad, wire);
    }
    at += size;
  }
}

template <class ExecutionSpace>
bool PowerSgd<ExecutionSpace>::finite(const ExecutionSpace& exec) const {
  using Reducer = GradientReducer<ExecutionSpace>;
  const double squares = Reducer::sum_of_squares(exec, ConstTensor1<float, memory_space>(p_), 0, p_.extent(0)) +
                         Reducer::sum_of_squares(exec, ConstTensor1<float, memory_space>(q_), 0, q_.extent(0));
  return std::isfinite(squares);
}

template <class ExecutionSpace>
void PowerSgd<ExecutionSpace>::reduce(const ExecutionSpace& exec, const Tensor1<float, memory_space>& grads) {
  KMAMBA_REQUIRE(grads.extent(0) == elements_, "kmamba::PowerSgd::reduce: the gradient has "
                                                   << grads.extent(0) << " elements, this object was made for "
                                                   << elements_);
  accumulate(exec, "kmamba::powersgd::add_error", grads, 1.0f);  // E ← M = gradient + E
  for (const impl::PowerSgdPlace& m : places_) {                 // P = M Q
    gemm(exec, Transpose::No, Transpose::No, 1.0f,
         ConstTensor2<float, memory_space>(matrix(error_, m.offset, m.rows, m.cols)),
         ConstTensor2<float, memory_space>(matrix(q_, m.q_offset, m.cols, rank_)), 0.0f,
         matrix(p_, m.p_offset, m.rows, rank_));
  }
  move_whole(exec, grads, true);
  comm_->all_reduce(exec, p_);
  move_whole(exec, grads, false);
  const int matrices = static_cast<int>(places_.size());
  if (matrices > 0) {
    Kokkos::parallel_for("kmamba::powersgd::orthonormalize",
                         Kokkos::TeamPolicy<ExecutionSpace>(exec, matrices, Kokkos::AUTO),
                         impl::Orthonormalize<ExecutionSpace>{device_places_, p_, zeroed_, rank_});
  }
  for (const impl::PowerSgdPlace& m : places_) {  // Q = Mᵀ P
    gemm(exec, Transpose::Yes, Transpose::No, 1.0f,
         ConstTensor2<float, memory_space>(matrix(error_, m.offset, m.rows, m.cols)),
         ConstTensor2<float, memory_space>(matrix(p_, m.p_offset, m.rows, rank_)), 0.0f,
         matrix(q_, m.q_offset, m.cols, rank_));
  }
  comm_->all_reduce(exec, q_);
  for (const impl::PowerSgdPlace& m : places_) {  // M̂ = P Qᵀ
    gemm(exec, Transpose::No, Transpose::Yes, 1.0f,
         ConstTensor2<float, memory_space>(matrix(p_, m.p_offset, m.rows, rank_)),
         ConstTensor2<float, memory_space>(matrix(q_, m.q_offset, m.cols, rank_)), 0.0f,
         matrix(grads, m.offset, m.rows, m.cols));
  }
  accumulate(exec, "kmamba::powersgd::keep_error", grads, -1.0f / static_cast<float>(comm_->size()));  // E ← M − M̂/D
  if (!finite(exec)) {
    reset(exec);
  } else if (matrices > 0) {
    Kokkos::parallel_for("kmamba::powersgd::redraw_zeroed",
                         Kokkos::TeamPolicy<ExecutionSpace>(exec, matrices, Kokkos::AUTO),
                         impl::RedrawZeroed<ExecutionSpace>{device_places_, zeroed_, seed_q_, q_, rank_});
  }
}

template <class ExecutionSpace>
void PowerSgd<ExecutionSpace>::reset(const ExecutionSpace& exec) {
  Kokkos::deep_copy(exec, error_, 0.0f);
  Kokkos::deep_copy(exec, q_, seed_q_);
}

}  // namespace kmamba

#endif
