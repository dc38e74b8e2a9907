// Sampling on the model's execution space (docs/algorithms.md §5): the rules of Sampling.hpp —
// repetition penalty, greedy, top-k, temperature, top-p, min-p, one seeded draw — applied to a
// (batch, vocab) tensor of logits in device memory, one team per row, so that a decode loop
// copies no logits to the host. The chosen ids stay on the device.
//
// The same choices as the host Sampler: greedy picks the same token; a draw uses the same
// counter-based number per (seed, sequence, step) and the same inverse CDF in ascending id order,
// so it picks the host Sampler's token unless the number falls within ~1e-12 (relative) of a
// boundary of the cumulative distribution. The difference: the kept weights are fixed point
// (2^-43 of the best token's), so sums are exact and a draw is the same on every backend up to
// the last-place differences of exp; a token 2^44 times less likely than the best is never drawn.
// The repetition penalty applies to the tokens each row has seen — given by observe() (a prompt)
// and every token sample() chooses — which are kept on the device.
//
//   kmamba::DeviceSampler<Exec> sampler(config, batch, vocab);
//   sampler.observe(exec, prompt_ids);          // (batch, length), -1 = padding
//   sampler.sample(exec, logits, steps, ids);   // per row: the token of step steps(r)
//   sampler.check_errors("my_loop");            // blocking: throws on a NaN logit met since reset
#ifndef KMAMBA_MODELS_DEVICESAMPLER_HPP
#define KMAMBA_MODELS_DEVICESAMPLER_HPP

#include <kmamba/core/Tensor.hpp>
#include <kmamba/models/Sampling.hpp>

#include <cstdint>

namespace kmamba {

/// A SamplingConfig applied on `ExecutionSpace` to the rows of a batch (see the file comment).
/// Holds the seen-token flags of every row (batch × vocab bytes, allocated only with a repetition
/// penalty) and an error flag. Every call is non-blocking on `exec` except check_errors.
template <class ExecutionSpace>
class DeviceSampler {
 public:
  using memory_space = typename ExecutionSpace::memory_space;

  /// Validates `config` and the sizes (batch >= 1, 1 <= vocab <= 2^21; kmamba::UserError
  /// otherwise). Tokens are chosen among ids [0, vocab); the rows start with nothing seen.
  DeviceSampler(const SamplingConfig& config, int batch, int vocab);

  const SamplingConfig& config() const { return config_; }
  int batch() const { return batch_; }
  int vocab() const { return vocab_; }

  /// Forgets the tokens every row has seen and clears the error flag.
  void reset(const ExecutionSpace& exec);

  /// Adds tokens(r, :) to the tokens row r has seen (for the repetition penalty; nothing to do
  /// without one). Entries outside [0, vocab) are skipped: -1 pads rows of different lengths, and
  /// a token that cannot be chosen needs no penalty.
  void observe(const ExecutionSpace& exec, const ConstTensor2<std::int64_t, memory_space>& tokens);  // (batch, length)

  /// For every row r with steps(r) >= 0: ids(r) = the token chosen from logits(r, 0:vocab) for
  /// sequence first_sequence + r at step steps(r) (the random number's counter), which row r has
  /// then seen. Rows with steps(r) < 0 are left alone. A row whose logits hold NaN or +inf, or only
  /// -inf, gets id 0 and sets the error flag (see check_errors).
  void sample(const ExecutionSpace& exec, const ConstTensor2<float, memory_space>& logits,  // (batch, >= vocab)
              const ConstTensor1<std::int64_t, memory_space>& steps,                        // (batch)
              const Tensor1<std::int64_t, memory_space>& ids,                               // (batch)
              std::uint64_t first_sequence = 0) const;

  /// The distribution sample() draws from for every row: probabilities(r, i) is 0 for every token
  /// the filters remove, one-hot for greedy decoding. Marks nothing as seen.
  void distribution(const ExecutionSpace& exec, const ConstTensor2<float, memory_space>& logits,  // (batch, >= vocab)
                    const Tensor2<double, memory_space>& probabilities) const;                    // (batch, vocab)

  /// Throws kmamba::UserError, from `function`, naming the row and token if a sample() or
  /// distribution() since construction or reset() met bad logits. Blocking.
  void check_errors(const char* function) const;

 private:
  void run(const ExecutionSpace& exec, const ConstTensor2<float, memory_space>& logits,
           const ConstTensor1<std::int64_t, memory_space>& steps, const Tensor1<std::int64_t, memory_space>& ids,
           const Tensor2<double, memory_space>& probabilities, std::uint64_t first_sequence) const;

  SamplingConfig config_;
  int batch_, vocab_;
  Tensor2<std::uint8_t, memory_space> seen_;   // (batch, vocab) with a repetition penalty, else empty
  Tensor1<std::int64_t, memory_space> error_;  // (3): code, row, token of the first error
};

}  // namespace kmamba

#endif
