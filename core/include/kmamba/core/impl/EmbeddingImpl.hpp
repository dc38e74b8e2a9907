// Internals of kmamba/core/Embedding.hpp: the gather and the deterministic scatter-add.
//
// The backward sums the rows of dout that share an id without atomics, so that dtable is the same
// bit for bit from run to run whatever the thread count or timing:
//   sort       the positions, stably by id, with a least-significant-digit radix sort
//              (embedding_radix_bits per pass, one parallel_scan a pass; the digit counts of every
//              pass come from one histogram of integer atomics, whose sums do not depend on order);
//              equal ids then lie in runs, in position order;
//   tiles      the sorted positions are cut into tiles of embedding_tile positions, whatever the
//              runs; one thread per (tile, column) sums each run's rows of the tile in position
//              order and adds the sum of a run that lies inside the tile to dtable; a run that
//              crosses a tile boundary leaves its share as the tile's head (the run began before
//              the tile) or tail (it goes on after it);
//   crossings  one thread per (tile where a crossing run begins, column) adds the run's tail and
//              then the heads of the tiles it covers, in tile order, to dtable.
// Every sum therefore has a fixed shape set by the ids alone, and a run of any length is spread
// over the columns and over its tiles (the tiny vocabularies of synthetic tasks make long runs).
#ifndef KMAMBA_CORE_IMPL_EMBEDDINGIMPL_HPP
#define KMAMBA_CORE_IMPL_EMBEDDINGIMPL_HPP

#include <kmamba/core/Tensor.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>

namespace kmamba {
namespace impl {

template <class MemorySpace>
struct EmbeddingGather {
  ConstTensor1<std::int64_t, MemorySpace> ids;
  ConstTensor2<float, MemorySpace> table;
  Tensor2<float, MemorySpace> out;
  KOKKOS_INLINE_FUNCTION void operator()(const int t, const int d) const { out(t, d) = table(ids(t), d); }
};

/// Bits of the id a radix pass sorts by, and the digits they make.
constexpr int embedding_radix_bits = 4;
constexpr int embedding_radix = 1 << embedding_radix_bits;

/// Sorted positions a tile of the backward's sums covers.
constexpr int embedding_tile = 64;

/// Radix passes that sort ids below `vocab` (at least one, which also writes the positions).
inline int embedding_radix_passes(const std::int64_t vocab) {
  int passes = 1;
  while (passes * embedding_radix_bits < 63 && (vocab - 1) >> (passes * embedding_radix_bits) > 0) ++passes;
  return passes;
}

template <class MemorySpace>
struct EmbeddingZeroCounts {
  Tensor2<int, MemorySpace> counts;  // (passes, embedding_radix)
  KOKKOS_INLINE_FUNCTION void operator()(const int i) const { counts(i / embedding_radix, i % embedding_radix) = 0; }
};

/// counts(p, e): how many ids have digit e in pass p.
template <class MemorySpace>
struct EmbeddingCountDigits {
  ConstTensor1<std::int64_t, MemorySpace> ids;
  Tensor2<int, MemorySpace> counts;  // (passes, embedding_radix)
  KOKKOS_INLINE_FUNCTION void operator()(const int t) const {
    const std::int64_t id = ids(t);
    for (int p = 0; p < static_cast<int>(counts.extent(0)); ++p) {
      const int digit = static_cast<int>((id >> (p * embedding_radix_bits)) & (embedding_radix - 1));
      Kokkos::atomic_add(&counts(p, digit), 1);
    }
  }
};

/// The scan value of a radix pass: how many positions before this one hold each digit.
struct EmbeddingDigitCounts {
  int count[embedding_radix];
  KOKKOS_INLINE_FUNCTION EmbeddingDigitCounts() {
    for (int e = 0; e < embedding_radix; ++e) count[e] = 0;
  }
  KOKKOS_INLINE_FUNCTION EmbeddingDigitCounts& operator+=(const EmbeddingDigitCounts& other) {
    for (int e = 0; e < embedding_radix; ++e) count[e] += other.count[e];
    return *this;
  }
  KOKKOS_INLINE_FUNCTION void operator+=(const volatile EmbeddingDigitCounts& other) volatile {
    for (int e = 0; e < embedding_radix; ++e) count[e] += other.count[e];
  }
};

/// One stable radix pass: the position at sorted index i of the previous pass (i itself in the
/// first) moves to the slot after every position with a smaller digit and every earlier one with
/// the same digit.
template <class MemorySpace>
struct EmbeddingRadixPass {
  using value_type = EmbeddingDigitCounts;
  ConstTensor1<std::int64_t, MemorySpace> ids;
  ConstTensor2<int, MemorySpace> counts;  // (passes, embedding_radix)
  ConstTensor1<int, MemorySpace> from;    // (tokens), unread in the first pass
  Tensor1<int, MemorySpace> to;           // (tokens)
  int pass;

  KOKKOS_INLINE_FUNCTION void operator()(const int i, value_type& before, const bool final) const {
    const int t = pass == 0 ? i : from(i);
    const int digit = static_cast<int>((ids(t) >> (pass * embedding_radix_bits)) & (embedding_radix - 1));
    if (final) {
      int slot = before.count[digit];
      for (int e = 0; e < digit; ++e) slot += counts(pass, e);
      to(slot) = t;
    }
    before.count[digit] += 1;
  }
};

/// The sorted positions, and the run structure of their ids, as the sums read them.
template <class MemorySpace>
struct EmbeddingSortedIds {
  ConstTensor1<std::int64_t, MemorySpace> ids;
  ConstTensor1<int, MemorySpace> order;  // (tokens): positions sorted by (id, position)
  int tokens;

  KOKKOS_INLINE_FUNCTION std::int64_t id(const int i) const { return ids(order(i)); }
  /// Whether the run holding sorted index `last` goes on past it.
  KOKKOS_INLINE_FUNCTION bool continues(const int last) const { return last + 1 < tokens && id(last + 1) == id(last); }
  /// Whether the run holding sorted index `i` began before `begin` (the first of a tile).
  KOKKOS_INLINE_FUNCTION bool began_before(const int begin, const int i) const {
    return begin > 0 && id(begin) == id(i) && id(begin - 1) == id(i);
  }
};

/// Thread (tile, column): sums each run's rows of the tile in position order; a run inside the
/// tile goes to dtable, the share of a crossing run to head (began before) or tail (goes on).
template <class MemorySpace>
struct EmbeddingTileSums {
  EmbeddingSortedIds<MemorySpace> sorted;
  ConstTensor2<float, MemorySpace> dout;   // (tokens, dim)
  Tensor2<float, MemorySpace> dtable;      // (vocab, dim)
  Tensor2<float, MemorySpace> head, tail;  // (tiles, dim)
  int dim;

  KOKKOS_INLINE_FUNCTION void close_run(const int tile, const int d, const int begin, const int first, const int last,
                                        const float sum) const {
    if (sorted.began_before(begin, first)) {
      head(tile, d) = sum;
    } else if (sorted.continues(last)) {
      tail(tile, d) = sum;
    } else {
      dtable(sorted.id(first), d) += sum;
    }
  }

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t index) const {
    const int tile = static_cast<int>(index / dim);
    const int d = static_cast<int>(index % dim);
    const int begin = tile * embedding_tile;
    const int end = begin + embedding_tile < sorted.tokens ? begin + embedding_tile : sorted.tokens;
    int first = begin;
    float sum = 0.0f;
    for (int i = begin; i < end; ++i) {
      if (i > first && sorted.id(i) != sorted.id(first)) {
        close_run(tile, d, begin, first, i - 1, sum);
        first = i;
        sum = 0.0f;
      }
      sum += dout(sorted.order(i), d);
    }
    close_run(tile, d, begin, first, end - 1, sum);
  }
};

/// Thread (tile, column) for a run that begins in the tile and goes on past it: its tail, then the
/// heads of the next tiles up to the one where it ends, added to dtable.
template <class MemorySpace>
struct EmbeddingCrossingSums {
  EmbeddingSortedIds<MemorySpace> sorted;
  ConstTensor2<float, MemorySpace> head, tail;  // (tiles, dim)
  Tensor2<float, MemorySpace> dtable;           // (vocab, dim)
  int dim;

  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t index) const {
    const int tile = static_cast<int>(index / dim);
    const int d = static_cast<int>(index % dim);
    const int begin = tile * embedding_tile;
    const int last = begin + embedding_tile - 1;
    if (last + 1 >= sorted.tokens || !sorted.continues(last) || sorted.began_before(begin, last)) return;
    const std::int64_t run = sorted.id(last);
    float sum = tail(tile, d);
    for (int next = tile + 1;; ++next) {
      sum += head(next, d);
      // The run covers tile `next` and goes on only if the first position after it holds the run.
      const int after = (next + 1) * embedding_tile;
      if (after >= sorted.tokens || sorted.id(after) != run) break;
    }
    dtable(run, d) += sum;
  }
};

/// The sort's scatter-add (the GPU's form; host tests run it too). Allocates the sort's two
/// position arrays and the tiles' heads and tails (2 · tokens / embedding_tile rows).
template <class ExecutionSpace, class MemorySpace>
void embedding_sorted_scatter_add(const ExecutionSpace& exec, const ConstTensor1<std::int64_t, MemorySpace>& ids,
                                  const ConstTensor2<float, MemorySpace>& dout,
                                  const Tensor2<float, MemorySpace>& dtable) {
  const int tokens = static_cast<int>(ids.extent(0));
  const int dim = static_cast<int>(dtable.extent(1));
  const int passes = embedding_radix_passes(static_cast<std::int64_t>(dtable.extent(0)));
  const auto counts =
      allocate_uninitialized<Tensor2<int, MemorySpace>>("kmamba::embedding::digit_counts", passes, embedding_radix);
  Tensor1<int, MemorySpace> order[2] = {
      allocate_uninitialized<Tensor1<int, MemorySpace>>("kmamba::embedding::order", tokens),
      allocate_uninitialized<Tensor1<int, MemorySpace>>("kmamba::embedding::order_swap", tokens)};
  Kokkos::parallel_for("kmamba::embedding::zero_digit_counts",
                       Kokkos::RangePolicy<ExecutionSpace>(exec, 0, passes * embedding_radix),
                       EmbeddingZeroCounts<MemorySpace>{counts});
  Kokkos::parallel_for("kmamba::embedding::count_digits", Kokkos::RangePolicy<ExecutionSpace>(exec, 0, tokens),
                       EmbeddingCountDigits<MemorySpace>{ids, counts});
  for (int p = 0; p < passes; ++p) {
    Kokkos::parallel_scan("kmamba::embedding::radix_pass", Kokkos::RangePolicy<ExecutionSpace>(exec, 0, tokens),
                          EmbeddingRadixPass<MemorySpace>{ids, counts, order[(p + 1) % 2], order[p % 2], p});
  }
  const EmbeddingSortedIds<MemorySpace> sorted{ids, order[(passes - 1) % 2], tokens};

  const int tiles = (tokens + embedding_tile - 1) / embedding_tile;
  const auto head = allocate_uninitialized<Tensor2<float, MemorySpace>>("kmamba::embedding::tile_heads", tiles, dim);
  const auto tail = allocate_uninitialized<Tensor2<float, MemorySpace>>("kmamba::embedding::tile_tails", tiles, dim);
  using Range = Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::int64_t>>;
  const std::int64_t items = static_cast<std::int64_t>(tiles) * dim;
  Kokkos::parallel_for("kmamba::embedding::tile_sums", Range(exec, 0, items),
                       EmbeddingTileSums<MemorySpace>{sorted, dout, dtable, head, tail, dim});
  Kokkos::parallel_for("kmamba::embedding::crossing_sums", Range(exec, 0, items),
                       EmbeddingCrossingSums<MemorySpace>{sorted, head, tail, dtable, dim});
}

/// Host backends: a thread per block of embedding_host_columns columns adds every token's row to
/// dtable in position order. Deterministic as the sort's order is (one sum per element, in a
/// fixed order), in one parallel region where the sort takes a dozen: on a host each region is a
/// fork and join of the threads, which costs more than the sums of a small model and, with the
/// cores shared, a scheduler quantum whenever one thread is not running.
constexpr int embedding_host_columns = 16;

template <class MemorySpace>
struct EmbeddingColumnSums {
  ConstTensor1<std::int64_t, MemorySpace> ids;
  ConstTensor2<float, MemorySpace> dout;
  Tensor2<float, MemorySpace> dtable;
  int tokens, dim;

  KOKKOS_INLINE_FUNCTION void operator()(const int block) const {
    const int first = block * embedding_host_columns;
    const int end = first + embedding_host_columns < dim ? first + embedding_host_columns : dim;
    for (int t = 0; t < tokens; ++t) {
      const std::int64_t id = ids(t);
      for (int d = first; d < end; ++d) dtable(id, d) += dout(t, d);
    }
  }
};

/// dtable[ids[t], :] += dout[t, :] in a fixed order: embedding_sorted_scatter_add on a GPU,
/// EmbeddingColumnSums on host backends. Non-blocking on `exec`.
template <class ExecutionSpace, class MemorySpace>
void embedding_scatter_add(const ExecutionSpace& exec, const ConstTensor1<std::int64_t, MemorySpace>& ids,
                           const ConstTensor2<float, MemorySpace>& dout, const Tensor2<float, MemorySpace>& dtable) {
  const int tokens = static_cast<int>(ids.extent(0));
  if constexpr (Kokkos::SpaceAccessibility<ExecutionSpace, Kokkos::HostSpace>::accessible) {
    const int dim = static_cast<int>(dtable.extent(1));
    Kokkos::parallel_for(
        "kmamba::embedding::column_sums",
        Kokkos::RangePolicy<ExecutionSpace>(exec, 0, (dim + embedding_host_columns - 1) / embedding_host_columns),
        EmbeddingColumnSums<MemorySpace>{ids, dout, dtable, tokens, dim});
  } else {
    embedding_sorted_scatter_add(exec, ids, dout, dtable);
  }
}

}  // namespace impl
}  // namespace kmamba

#endif
