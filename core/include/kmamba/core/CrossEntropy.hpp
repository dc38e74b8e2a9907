// Softmax cross-entropy over a vocabulary, with an ignore index: the language-model loss.
//
//   loss = (1 / count) · Σ_{rows r with targets[r] != ignore_index} ( lse_r − logits[r, targets[r]] ),
//   lse_r = log Σ_v exp(logits[r, v]),   count = number of such rows,
//   dlogits[r, v] = scale · (softmax(logits[r])_v − [v == targets[r]])   (0 on ignored rows).
//
// One team per row and one pass over it: each thread keeps the running max, the sum of
// exponentials scaled to it and the max's index over its entries, and a team reduction merges them,
// in fp32.
#ifndef KMAMBA_CORE_CROSSENTROPY_HPP
#define KMAMBA_CORE_CROSSENTROPY_HPP

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Profiling.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/CrossEntropyImpl.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>

namespace kmamba {

/// Sum of the per-row losses, the number of rows that count (targets != ignore_index) and, of
/// those, the rows whose largest logit (the first, on ties) is the target.
struct CrossEntropySum {
  double loss_sum = 0.0;
  std::int64_t count = 0;
  std::int64_t correct = 0;
  /// The mean loss (0 when no row counts).
  double mean() const { return count > 0 ? loss_sum / static_cast<double>(count) : 0.0; }
};

/// Forward: writes lse (the log-sum-exp of each row, needed by the backward) and returns the summed
/// loss, the counted rows and the correctly predicted ones. Blocking (it returns host values). Throws kmamba::UserError
/// if a target is neither ignore_index nor in [0, vocab), naming the first offending row and id.
template <class ExecutionSpace, class MemorySpace>
CrossEntropySum cross_entropy_forward(const ExecutionSpace& exec,
                                      const ConstTensor2<float, MemorySpace>& logits,          // (rows, vocab)
                                      const ConstTensor1<std::int64_t, MemorySpace>& targets,  // (rows)
                                      std::int64_t ignore_index, const Tensor1<float, MemorySpace>& lse) {  // (rows)
  const ProfilingRegion region("kmamba::cross_entropy_forward");
  constexpr const char* function = "kmamba::cross_entropy_forward";
  const std::int64_t rows = static_cast<std::int64_t>(logits.extent(0));
  const std::int64_t vocab = static_cast<std::int64_t>(logits.extent(1));
  check_shape(function, "targets", targets, {rows}, "(rows) with rows from logits");
  check_shape(function, "lse", lse, {rows}, "(rows) with rows from logits");
  KMAMBA_REQUIRE(vocab > 0 || rows == 0,
                 function << ": logits has an empty vocabulary axis (shape " << shape_of(logits).to_string() << ")");
  const impl::InvalidIds bad = impl::find_invalid_ids(exec, targets, true, ignore_index, vocab);
  KMAMBA_REQUIRE(bad.count == 0, function << ": " << bad.count << " target id(s) are outside [0, " << vocab
                                          << ") and not the ignore index " << ignore_index << "; the first is "
                                          << bad.first_value << " at row " << bad.first_row);
  const impl::CrossEntropyTotals totals = impl::cross_entropy_forward_impl(exec, logits, targets, ignore_index, lse);
  return CrossEntropySum{totals.loss_sum, totals.count, totals.correct};
}

/// Backward: dlogits = scale · (softmax − one_hot(target)) on counted rows, 0 on ignored rows
/// (scale = dloss / count for a mean loss). Non-blocking on `exec`.
template <class ExecutionSpace, class MemorySpace>
void cross_entropy_backward(const ExecutionSpace& exec,
                            const ConstTensor2<float, MemorySpace>& logits,          // (rows, vocab)
                            const ConstTensor1<std::int64_t, MemorySpace>& targets,  // (rows)
                            std::int64_t ignore_index,
                            const ConstTensor1<float, MemorySpace>& lse,                // (rows), from the forward
                            float scale, const Tensor2<float, MemorySpace>& dlogits) {  // (rows, vocab)
  const ProfilingRegion region("kmamba::cross_entropy_backward");
  constexpr const char* function = "kmamba::cross_entropy_backward";
  const std::int64_t rows = static_cast<std::int64_t>(logits.extent(0));
  check_shape(function, "targets", targets, {rows}, "(rows) with rows from logits");
  check_shape(function, "lse", lse, {rows}, "(rows) with rows from logits");
  check_same_shape(function, "dlogits", dlogits, "logits", logits);
  impl::cross_entropy_backward_impl(exec, logits, targets, ignore_index, lse, scale, dlogits);
}

}  // namespace kmamba

#endif
