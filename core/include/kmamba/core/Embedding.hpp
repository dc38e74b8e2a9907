// Token embedding: out[t, :] = table[ids[t], :], and its backward (scatter-add of the output
// gradient into the rows of the table that were used).
#ifndef KMAMBA_CORE_EMBEDDING_HPP
#define KMAMBA_CORE_EMBEDDING_HPP

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Profiling.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/CheckIds.hpp>
#include <kmamba/core/impl/EmbeddingImpl.hpp>

#include <Kokkos_Core.hpp>

#include <climits>
#include <cstdint>

namespace kmamba {

/// Throws kmamba::UserError (from `function`) naming the first id outside [0, vocab) — the rows of
/// the embedding table — and its position. Blocking.
template <class ExecutionSpace, class MemorySpace>
void check_embedding_ids(const ExecutionSpace& exec, const ConstTensor1<std::int64_t, MemorySpace>& ids,  // (tokens)
                         const std::int64_t vocab, const char* function = "kmamba::embedding_forward") {
  const ProfilingRegion region("kmamba::check_embedding_ids");
  const impl::InvalidIds bad = impl::find_invalid_ids(exec, ids, false, 0, vocab);
  KMAMBA_REQUIRE(bad.count == 0, function << ": " << bad.count << " token id(s) are outside [0, " << vocab
                                          << "), the rows of the embedding table; the first is " << bad.first_value
                                          << " at position " << bad.first_row);
}

/// out[t, :] = table[ids[t], :]. Blocking only for the id check (check_embedding_ids). With
/// `check_ids` false the caller guarantees the ids are valid (checked before, e.g. outside a
/// recorded step graph) and the call is non-blocking.
template <class ExecutionSpace, class MemorySpace>
void embedding_forward(const ExecutionSpace& exec, const ConstTensor1<std::int64_t, MemorySpace>& ids,  // (tokens)
                       const ConstTensor2<float, MemorySpace>& table,                                   // (vocab, dim)
                       const Tensor2<float, MemorySpace>& out,                                          // (tokens, dim)
                       const bool check_ids = true) {
  const ProfilingRegion region("kmamba::embedding_forward");
  constexpr const char* function = "kmamba::embedding_forward";
  const std::int64_t tokens = static_cast<std::int64_t>(ids.extent(0));
  const std::int64_t vocab = static_cast<std::int64_t>(table.extent(0));
  const std::int64_t dim = static_cast<std::int64_t>(table.extent(1));
  check_shape(function, "out", out, {tokens, dim}, "(tokens, dim) with dim from table");
  if (check_ids) check_embedding_ids(exec, ids, vocab, function);
  if (tokens == 0 || dim == 0) return;
  Kokkos::parallel_for(
      "kmamba::embedding::forward",
      impl::light_weight(Kokkos::MDRangePolicy<ExecutionSpace, Kokkos::Rank<2>>(exec, {0, 0}, {tokens, dim})),
      impl::EmbeddingGather<MemorySpace>{ids, table, out});
}

/// dtable[ids[t], :] += dout[t, :] (accumulates: zero dtable first for a plain gradient). The rows
/// of an id are summed in a fixed order set by the ids alone (impl/EmbeddingImpl.hpp), without
/// atomics: dtable is the same bit for bit from run to run, at any thread count. Non-blocking on
/// `exec`; ids must already have passed embedding_forward's check. On a GPU allocates two int
/// arrays of `tokens` and two float arrays of (tokens / 64, dim) for the sort and the partial sums;
/// host backends sum each column's tokens in position order without allocating.
template <class ExecutionSpace, class MemorySpace>
void embedding_backward(const ExecutionSpace& exec, const ConstTensor1<std::int64_t, MemorySpace>& ids,  // (tokens)
                        const ConstTensor2<float, MemorySpace>& dout,  // (tokens, dim)
                        const Tensor2<float, MemorySpace>& dtable) {   // (vocab, dim)
  const ProfilingRegion region("kmamba::embedding_backward");
  constexpr const char* function = "kmamba::embedding_backward";
  const std::int64_t tokens = static_cast<std::int64_t>(ids.extent(0));
  const std::int64_t dim = static_cast<std::int64_t>(dtable.extent(1));
  check_shape(function, "dout", dout, {tokens, dim}, "(tokens, dim) with dim from dtable");
  KMAMBA_REQUIRE(tokens <= INT_MAX - impl::embedding_tile && dim <= INT_MAX,
                 function << ": " << tokens << " tokens of dim " << dim << " exceed the supported "
                          << INT_MAX - impl::embedding_tile << " tokens and " << INT_MAX << " columns");
  if (tokens == 0 || dim == 0) return;
  impl::embedding_scatter_add(exec, ids, dout, dtable);
}

}  // namespace kmamba

#endif
