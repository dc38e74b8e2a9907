// The views and elementwise kernels that the models, the backbone and the mixers share: a tensor
// as its flat values or as (batch·seqlen, features) rows over the same memory, out = a + b,
// grad += value, and column sums added into a gradient. Every kernel is non-blocking on `exec`.
#ifndef KMAMBA_MODELS_SRC_ELEMENTWISE_HPP
#define KMAMBA_MODELS_SRC_ELEMENTWISE_HPP

#include <kmamba/core/Tensor.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>

namespace kmamba {
namespace impl {

/// Every value of a contiguous view as one flat vector over the same memory.
template <class View>
Tensor1<typename View::value_type, typename View::memory_space> as_flat(const View& v) {
  return Tensor1<typename View::value_type, typename View::memory_space>(v.data(), v.span());
}

/// A (batch, seqlen, features) tensor as the (batch·seqlen, features) matrix over the same memory.
template <class T, class Mem>
Tensor2<T, Mem> token_rows(const Tensor3<T, Mem>& t) {  // (batch, seqlen, features)
  return Tensor2<T, Mem>(t.data(), t.extent(0) * t.extent(1), t.extent(2));
}

/// Runs f(i) for every i in [0, n) on `exec` with 64-bit indices, as kernel `label`.
template <class Exec, class Functor>
void for_each_index(const Exec& exec, const char* label, std::int64_t n, const Functor& f) {
  Kokkos::parallel_for(label, Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(exec, 0, n), f);
}

/// out(i) = a(i) + b(i).
template <class Mem>
struct AddFunctor {
  Tensor1<float, Mem> out;        // (n)
  ConstTensor1<float, Mem> a, b;  // (n)
  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const { out(i) = a(i) + b(i); }
};

/// grad(i) += value(i).
template <class Mem>
struct AccumulateFunctor {
  ConstTensor1<float, Mem> value;  // (n)
  Tensor1<float, Mem> grad;        // (n)
  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const { grad(i) += value(i); }
};

/// Rows a work item of the column sums adds (the first of their two stages).
constexpr int column_sum_chunk_rows = 64;

/// partial(k, c) = Σ g(r, c) over the rows r of chunk k, in order; flat index i = k · width + c.
template <class Mem>
struct ColumnChunkSumsFunctor {
  ConstTensor2<float, Mem> g;   // (rows, width)
  Tensor2<float, Mem> partial;  // (chunks, width)
  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const {
    const std::int64_t width = static_cast<std::int64_t>(g.extent(1));
    const std::int64_t c = i % width;
    const std::int64_t r0 = i / width * column_sum_chunk_rows;
    const std::int64_t r1 = r0 + column_sum_chunk_rows < static_cast<std::int64_t>(g.extent(0))
                                ? r0 + column_sum_chunk_rows
                                : static_cast<std::int64_t>(g.extent(0));
    float sum = 0.0f;
    for (std::int64_t r = r0; r < r1; ++r) sum += g(r, c);
    partial(i / width, c) = sum;
  }
};

/// grad(offset + c) += Σ_k partial(k, c), the chunks added in order.
template <class Mem>
struct AddChunkSumsFunctor {
  ConstTensor2<float, Mem> partial;  // (chunks, width)
  Tensor1<float, Mem> grad;          // (≥ offset + width)
  int offset;
  KOKKOS_INLINE_FUNCTION void operator()(const int c) const {
    float sum = 0.0f;
    for (std::size_t k = 0; k < partial.extent(0); ++k) sum += partial(k, c);
    grad(offset + c) += sum;
  }
};

/// out = a + b; `out` may be `a` or `b`.
template <class Exec>
void add(const Exec& exec, const char* label, const ConstTensor1<float, typename Exec::memory_space>& a,  // (n)
         const ConstTensor1<float, typename Exec::memory_space>& b,                                       // (n)
         const Tensor1<float, typename Exec::memory_space>& out) {                                        // (n)
  for_each_index(exec, label, static_cast<std::int64_t>(out.extent(0)),
                 AddFunctor<typename Exec::memory_space>{out, a, b});
}

/// grad += value.
template <class Exec>
void accumulate(const Exec& exec, const char* label,
                const ConstTensor1<float, typename Exec::memory_space>& value,  // (n)
                const Tensor1<float, typename Exec::memory_space>& grad) {      // (n)
  for_each_index(exec, label, static_cast<std::int64_t>(value.extent(0)),
                 AccumulateFunctor<typename Exec::memory_space>{value, grad});
}

/// grad(offset : offset + width) += the column sums of g (a bias's gradient), in two stages so that
/// few columns over many rows still fill the device: sums over chunks of column_sum_chunk_rows
/// rows, then the chunks' sums in order (deterministic).
template <class Exec>
void add_column_sums(const Exec& exec, const char* label,
                     const ConstTensor2<float, typename Exec::memory_space>& g,  // (rows, width)
                     const Tensor1<float, typename Exec::memory_space>& grad,    // (≥ offset + width)
                     int offset) {
  using Mem = typename Exec::memory_space;
  const std::int64_t rows = static_cast<std::int64_t>(g.extent(0));
  const std::int64_t width = static_cast<std::int64_t>(g.extent(1));
  const std::int64_t chunks = (rows + column_sum_chunk_rows - 1) / column_sum_chunk_rows;
  if (width == 0) return;
  const auto partial = allocate_uninitialized<Tensor2<float, Mem>>("kmamba::column_sums::partial", chunks, width);
  for_each_index(exec, label, chunks * width, ColumnChunkSumsFunctor<Mem>{g, partial});
  Kokkos::parallel_for(label, Kokkos::RangePolicy<Exec>(exec, 0, static_cast<int>(width)),
                       AddChunkSumsFunctor<Mem>{partial, grad, offset});
}

}  // namespace impl
}  // namespace kmamba

#endif
