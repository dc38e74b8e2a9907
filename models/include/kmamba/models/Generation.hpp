// The generation loop over LanguageModel's recurrent inference (docs/algorithms.md §5): prompts
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
// Two ways to choose tokens:
// - a SamplingConfig: sampling on the device (DeviceSampler.hpp). The whole loop stays on the
//   model's execution space — the next token of every sequence (prompt token or sampled), the
//   generated tokens, the stop tokens and max_new_tokens — and the host only launches: no logits
//   are copied and a step does not wait for the device. Every options.sync_interval steps the
//   host reads which sequences are done (a (batch) copy) to end the loop early and hands the new
//   tokens to on_token, so tokens stream in groups of sync_interval, and a batch whose sequences
//   all stop early runs at most sync_interval − 1 steps too many (their results ignored).
//   Without stop tokens or on_token the host reads nothing before the end.
// - a TokenSampler: a caller-supplied host function of each logits row, so any sampler plugs in;
//   the logits go to the host every step and the step waits for them.
// No tensor is allocated per step: the DecodeState, the logits, ids and tokens (and their host
// mirrors) are allocated once per call.
//
//   kmamba::GenerationOptions options;
//   options.max_new_tokens = 64;
//   options.stop_tokens = {model.config().eos_token_id};
//   kmamba::SamplingConfig sampling;  // temperature, top_k, top_p, min_p, repetition_penalty, seed
//   auto result = kmamba::generate(exec, model, prompts, sampling, options,
//                                  [](int sequence, std::int64_t token) { stream(sequence, token); });
//   std::printf("%.1f tokens/s\n", result.stats.decode_tokens_per_second());
#ifndef KMAMBA_MODELS_GENERATION_HPP
#define KMAMBA_MODELS_GENERATION_HPP

#include <kmamba/models/LanguageModel.hpp>
#include <kmamba/models/Sampling.hpp>

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

/// When a sequence is done, and how device sampling runs.
struct GenerationOptions {
  int max_new_tokens = 256;               ///< >= 0: tokens generated per sequence at most
  std::vector<std::int64_t> stop_tokens;  ///< generating one of these ends the sequence (it is kept)
  /// Device sampling only: tokens are chosen among ids [0, sample_vocab) (e.g. the tokenizer's
  /// vocabulary when the model's is padded beyond it); 0 = the model's vocabulary.
  int sample_vocab = 0;
  /// Device sampling only: prompt s draws as sequence first_sequence + s (its random numbers are
  /// those of (seed, first_sequence + s, step)), so a prompt gets the same tokens in any batch.
  std::uint64_t first_sequence = 0;
  /// Device sampling only (>= 1): decode steps between looks at which sequences are done, which
  /// are also the deliveries to on_token (see the file comment).
  int sync_interval = 16;
};

/// Work and time of one generate call. Times are wall-clock on the host, fenced.
struct GenerationStats {
  std::int64_t prefill_tokens = 0;    ///< batch × the shortest prompt's length (the chunked forward)
  double prefill_seconds = 0.0;       ///< the prefill (with a TokenSampler, its logits copied to the host)
  std::int64_t decode_steps = 0;      ///< decode steps run (device sampling: also those after all were done)
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

/// The same with sampling on the device by `sampling` (see the file comment and DeviceSampler.hpp:
/// the tokens of the host Sampler under the same seed, sequence numbers and steps). Also throws
/// kmamba::UserError for a bad `sampling`, sample_vocab or sync_interval, and for logits with NaN
/// or +inf (found at the next look at the device, so the tokens after them are lost).
template <class ExecutionSpace>
GenerationResult generate(const ExecutionSpace& exec, LanguageModel<ExecutionSpace>& model,
                          const std::vector<std::vector<std::int64_t>>& prompts, const SamplingConfig& sampling,
                          const GenerationOptions& options = GenerationOptions(),
                          const TokenCallback& on_token = TokenCallback());

/// The same into `state` (reset first), whose batch must equal the number of prompts.
template <class ExecutionSpace>
GenerationResult generate(const ExecutionSpace& exec, LanguageModel<ExecutionSpace>& model,
                          DecodeState<ExecutionSpace>& state, const std::vector<std::vector<std::int64_t>>& prompts,
                          const SamplingConfig& sampling, const GenerationOptions& options = GenerationOptions(),
                          const TokenCallback& on_token = TokenCallback());

}  // namespace kmamba

#endif
