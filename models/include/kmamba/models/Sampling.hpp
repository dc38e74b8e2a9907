// Choosing the next token from a row of logits (docs/algorithms.md §5), and when to stop generating.
// DeviceSampler.hpp applies the same rules on the device.
//
// The sampler works on the host: the logits of one sequence are a contiguous row of floats in host
// memory (a host mirror of the model's last-position logits, sliced to the real vocabulary when the
// embedding is padded). Per row, in this order:
//   1. repetition penalty (CTRL): every distinct token already in the sequence (prompt + generated)
//      has its logit l replaced by l / penalty if l > 0, l * penalty if l < 0;
//   2. greedy (temperature == 0 or top_k == 1): the arg-max, lowest id on ties; nothing below applies;
//   3. top-k: keep the k largest logits (lowest ids on ties);
//   4. temperature: divide the kept logits by it;
//   5. top-p and min-p, both judged on the softmax of what steps 3-4 left, a token being kept only
//      if both keep it: top-p keeps the most likely tokens while the probability mass before them
//      (in decreasing order) is below top_p, i.e. the smallest set of mass >= top_p; min-p keeps the
//      tokens with probability >= min_p times the largest probability;
//   6. one draw from the softmax of the kept tokens.
// This is the reference's order (repetition penalty, top-k, temperature, top-p). Deviation, as
// docs/algorithms.md §5 asks: the reference's min-p compares logits against token 0's logit and only
// runs without top-k and top-p; kmamba implements min-p as defined above, combinable with both.
//
// Random numbers are counter-based (Philox4x32-10): the draw for (seed, sequence, step) is the same
// whatever the batch order, the thread or the Sampler object, so a batch reproduces sequence by
// sequence. Logits of -inf are allowed (the token is never chosen); NaN and +inf are errors.
#ifndef KMAMBA_MODELS_SAMPLING_HPP
#define KMAMBA_MODELS_SAMPLING_HPP

#include <cstddef>
#include <cstdint>
#include <vector>

namespace kmamba {

/// How to choose tokens. The defaults sample from the plain softmax at temperature 1.
struct SamplingConfig {
  float temperature = 1.0f;         ///< >= 0; 0 selects greedy decoding
  int top_k = 0;                    ///< >= 0; 0 = off, 1 = greedy
  float top_p = 1.0f;               ///< in [0, 1]; off at 0 and at 1 (the reference's convention)
  float min_p = 0.0f;               ///< in [0, 1]; 0 = off
  float repetition_penalty = 1.0f;  ///< > 0; 1 = off, > 1 discourages repeats
  std::uint64_t seed = 0;

  /// Throws kmamba::UserError naming the first field out of range.
  void validate() const;
  /// Whether decoding is greedy (temperature == 0 or top_k == 1).
  bool greedy() const { return temperature == 0.0f || top_k == 1; }
};

/// The uniform number in [0, 1) (53 random bits) behind the draw of `step` of `sequence` under
/// `seed`.
double sampling_uniform(std::uint64_t seed, std::uint64_t sequence, std::uint64_t step);

/// Applies a SamplingConfig to logits rows. Holds scratch buffers that grow to the vocabulary size
/// once and are reused, so a decode loop does not allocate per step; hence one Sampler per thread.
class Sampler {
 public:
  /// Validates `config` (kmamba::UserError if out of range).
  explicit Sampler(const SamplingConfig& config);

  const SamplingConfig& config() const { return config_; }

  /// The next token of `sequence` at decode step `step`. `logits` holds `vocab` floats and is not
  /// modified; `history` (`history_size` ids, each in [0, vocab)) is the sequence so far, read by
  /// the repetition penalty only. Costs a few passes over the vocabulary (no sort): a decode loop
  /// can sample the sequences of a batch in parallel, one Sampler per thread.
  std::int64_t sample(const float* logits, std::int64_t vocab, const std::int64_t* history, std::size_t history_size,
                      std::uint64_t sequence, std::uint64_t step);

  /// The same with vectors (vocab = logits.size()).
  std::int64_t sample(const std::vector<float>& logits, const std::vector<std::int64_t>& history,
                      std::uint64_t sequence, std::uint64_t step);

  /// The distribution sample() draws from, written to `probabilities` (resized to `vocab`): zero
  /// for every token the filters remove, one-hot for greedy decoding.
  void distribution(const float* logits, std::int64_t vocab, const std::int64_t* history, std::size_t history_size,
                    std::vector<double>& probabilities);

 private:
  // Runs steps 1-5, leaving the kept tokens in kept_ (ascending ids) with their unnormalised
  // weights in weight_; returns the sum of those weights.
  double select(const float* logits, std::int64_t vocab, const std::int64_t* history, std::size_t history_size);
  // Step 1: divides a positive value (multiplies a negative one) by the penalty once per distinct
  // token of the history.
  void penalize_repetitions(std::int64_t vocab, const std::int64_t* history, std::size_t history_size);
  // The order of the filters: larger value first, lower id on ties.
  bool before(std::int64_t a, std::int64_t b) const;
  // Top-k and top-p look at the largest values only. To avoid sorting the vocabulary, the kept
  // tokens are binned by their distance to the largest value `top` (bin b: top - value in [b, b + 1),
  // the last bin also everything further), so every token of a bin comes before every token of a
  // later bin; order_ receives the tokens of the first bins whose count (or weight, when `weighted`)
  // adds up to `limit` (all of them if it is never reached).
  void gather_leading_bins(double top, double limit, bool weighted);
  // Step 3: keeps the top_k tokens in `before` order; `top` is the largest value.
  void keep_top_k(double top);
  // Step 5a: keeps a token while the weight before it (in `before` order) is below `threshold`
  // (top_p times the total weight); `max_value` is the largest scaled value.
  void keep_top_p(double max_value, double threshold);

  SamplingConfig config_;
  std::vector<double> value_;   // per token: logit after the penalty, then scaled by the temperature
  std::vector<double> weight_;  // per token: exp(value - max value)
  std::vector<std::int64_t> kept_;
  std::vector<std::int64_t> order_;
  std::vector<char> mark_;
};

/// Why a sequence stops.
enum class StopReason { None, StopToken, MaxNewTokens };

/// When a sequence is done: once it has generated one of `stop_tokens` (typically the tokenizer's
/// EOS; the stop token is the last generated token), or `max_new_tokens` tokens. The reference's
/// max_length counts the prompt too: max_new_tokens = max_length - prompt length.
struct StopCriteria {
  std::vector<std::int64_t> stop_tokens;
  std::int64_t max_new_tokens = -1;  ///< < 0: no limit

  /// Whether a sequence that has generated `generated` tokens, the latest being `last_token`
  /// (ignored when `generated` is 0), is done. A stop token takes precedence over the limit.
  StopReason check(std::int64_t generated, std::int64_t last_token) const;
};

}  // namespace kmamba

#endif
