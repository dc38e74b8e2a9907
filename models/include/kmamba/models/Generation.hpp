// Host-side generation loop over LanguageModel's recurrent inference (docs/algorithms.md §5): prompts
// of token ids in, generated tokens out, streamed through a callback as they are chosen, with
// prefill and decode throughput.
//
// Prompts of different lengths share one batch: the shortest prompt's length L0 is prefilled for
// every sequence at once (the chunked forward), then each decode step feeds every sequence one
// token — the next prompt token of a sequence whose prompt is longer than L0 (its logits are not
// sampled), else the token it generated last — so short prompts already generate while longer
// ones finish their prompts. Each sequence therefore sees exactly its own prompt and its own
// tokens, as if it were alone; the cost is that prompt tokens past L0 go through decode steps
// (one token per step) rather than the chunked forward, which is slower for very unequal lengths
// (group prompts of similar length into a batch when that matters). A sequence that is done
// (stop token or max_new_tokens) keeps stepping with its last token, its results ignored, until
// the whole batch is done.
//
// Sampling is a caller-supplied function of the logits row (see TokenSampler), so any sampler
// (greedy, temperature, top-k/top-p, ...) plugs in. No tensor is allocated per step: the
// DecodeState, the device logits and ids and their host mirrors are allocated once per call.
//
//   kmamba::GenerationOptions options;
//   options.max_new_tokens = 64;
//   options.stop_tokens = {model.config().eos_token_id};
//   auto result = kmamba::generate(exec, model, prompts, greedy, options,
//                                  [](int sequence, std::int64_t token) { stream(sequence, token); });
//   std::printf("%.1f tokens/s\n", result.stats.decode_tokens_per_second());
#ifndef KMAMBA_MODELS_GENERATION_HPP
#define KMAMBA_MODELS_GENERATION_HPP

#include <kmamba/models/LanguageModel.hpp>

#include <cstdint>
#include <functional>
#include <vector>

namespace kmamba {

/// Chooses the next token of sequence `sequence` (its index among the prompts) from `logits`,
/// `vocab` floats in host memory over the real vocabulary. `history` is the sequence so far,
/// prompt then generated tokens (for a repetition penalty); history.size() − prompt length is the
/// number of tokens generated so far. Must return an id in [0, vocab).
using TokenSampler =
    std::function<std::int64_t(const float* logits, int vocab, int sequence, const std::vector<std::int64_t>& history)>;

/// Receives each generated token as soon as it is chosen (for streaming). The tokens of one
/// sequence arrive in order; a stop token is reported too, as that sequence's last.
using TokenCallback = std::function<void(int sequence, std::int64_t token)>;

/// When a sequence is done.
struct GenerationOptions {
  int max_new_tokens = 256;               ///< >= 0: tokens generated per sequence at most
  std::vector<std::int64_t> stop_tokens;  ///< generating one of these ends the sequence (it is kept)
};

/// Work and time of one generate call. Times are wall-clock on the host, fenced.
struct GenerationStats {
  std::int64_t prefill_tokens = 0;    ///< batch × the shortest prompt's length (the chunked forward)
  double prefill_seconds = 0.0;       ///< the prefill, its logits copied to the host
  std::int64_t decode_steps = 0;      ///< decode steps run
  std::int64_t decode_tokens = 0;     ///< tokens fed by those steps to sequences not yet done
  std::int64_t generated_tokens = 0;  ///< tokens generated over all sequences
  double decode_seconds = 0.0;        ///< the decode steps, logits copies and sampling

  /// prefill_tokens / prefill_seconds (0 without prefill time).
  double prefill_tokens_per_second() const;
  /// decode_tokens / decode_seconds (0 without decode time).
  double decode_tokens_per_second() const;
};

/// What generate returns.
struct GenerationResult {
  std::vector<std::vector<std::int64_t>> tokens;  ///< per prompt, the generated tokens in order
  GenerationStats stats;
};

/// Generates up to options.max_new_tokens tokens after each prompt (see the file comment) into a
/// DecodeState made for the call. Throws kmamba::UserError for no prompts, an empty prompt, a
/// token outside the vocabulary (prompts or sampler), or a negative max_new_tokens.
template <class ExecutionSpace>
GenerationResult generate(const ExecutionSpace& exec, LanguageModel<ExecutionSpace>& model,
                          const std::vector<std::vector<std::int64_t>>& prompts, const TokenSampler& sampler,
                          const GenerationOptions& options = GenerationOptions(),
                          const TokenCallback& on_token = TokenCallback());

/// The same into `state` (reset first), whose batch must equal the number of prompts: repeated
/// calls reuse its allocations.
template <class ExecutionSpace>
GenerationResult generate(const ExecutionSpace& exec, LanguageModel<ExecutionSpace>& model,
                          DecodeState<ExecutionSpace>& state, const std::vector<std::vector<std::int64_t>>& prompts,
                          const TokenSampler& sampler, const GenerationOptions& options = GenerationOptions(),
                          const TokenCallback& on_token = TokenCallback());

}  // namespace kmamba

#endif
