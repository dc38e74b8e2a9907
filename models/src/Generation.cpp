// The host-side generation loop: a prefill of the shortest prompt's length, then decode steps
// that finish longer prompts and generate.
#include <kmamba/models/Generation.hpp>

#include <kmamba/Config.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/ForEachBackend.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>
#include <kmamba/models/DeviceSampler.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <utility>
#include <vector>

namespace kmamba {

double GenerationStats::prefill_tokens_per_second() const {
  return prefill_seconds > 0.0 ? static_cast<double>(prefill_tokens) / prefill_seconds : 0.0;
}

double GenerationStats::decode_tokens_per_second() const {
  return decode_seconds > 0.0 ? static_cast<double>(decode_tokens) / decode_seconds : 0.0;
}

namespace impl {

/// Before a sampling round, `fed` tokens having been fed to every sequence: a sequence still in its
/// prompt gets its next prompt token in ids and is not sampled (steps −1), a done one keeps its
/// last id and is not sampled, the others are sampled at step = the tokens they have generated.
template <class Mem>
struct PlanRound {
  ConstTensor2<std::int64_t, Mem> prompts;         // (batch, longest prompt), −1 after each prompt
  ConstTensor1<std::int64_t, Mem> prompt_lengths;  // (batch)
  ConstTensor1<std::int64_t, Mem> generated;       // (batch)
  ConstTensor1<std::int64_t, Mem> done;            // (batch): 1 once a sequence is done
  Tensor1<std::int64_t, Mem> steps;                // (batch)
  Tensor1<std::int64_t, Mem> ids;                  // (batch)
  std::int64_t fed;
  KOKKOS_INLINE_FUNCTION void operator()(const int s) const {
    if (done(s)) {
      steps(s) = -1;
    } else if (fed < prompt_lengths(s)) {
      ids(s) = prompts(s, fed);
      steps(s) = -1;
    } else {
      steps(s) = generated(s);
    }
  }
};

/// After a sampling round: a sampled sequence records its token, which ends it when it is a stop
/// token or the max_new_tokens-th.
template <class Mem>
struct RecordRound {
  ConstTensor1<std::int64_t, Mem> steps;        // (batch)
  ConstTensor1<std::int64_t, Mem> ids;          // (batch)
  ConstTensor1<std::int64_t, Mem> stop_tokens;  // (stops)
  Tensor2<std::int64_t, Mem> tokens;            // (batch, max_new_tokens)
  Tensor1<std::int64_t, Mem> generated;         // (batch)
  Tensor1<std::int64_t, Mem> done;              // (batch)
  KOKKOS_INLINE_FUNCTION void operator()(const int s) const {
    const std::int64_t step = steps(s);
    if (step < 0) return;
    const std::int64_t token = ids(s);
    tokens(s, step) = token;
    generated(s) = step + 1;
    bool stop = step + 1 >= static_cast<std::int64_t>(tokens.extent(1));
    for (std::size_t k = 0; k < stop_tokens.extent(0); ++k) stop = stop || token == stop_tokens(k);
    if (stop) done(s) = 1;
  }
};

}  // namespace impl

namespace {

double seconds_since(const std::chrono::steady_clock::time_point& start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Checks the prompts (none empty) and returns the shortest one's length.
std::size_t shortest_prompt(const char* function, const std::vector<std::vector<std::int64_t>>& prompts) {
  KMAMBA_REQUIRE(!prompts.empty(), function << ": no prompts");
  std::size_t shortest = prompts[0].size();
  for (std::size_t s = 0; s < prompts.size(); ++s) {
    KMAMBA_REQUIRE(!prompts[s].empty(), function << ": prompt " << s << " is empty (every prompt needs a token)");
    shortest = std::min(shortest, prompts[s].size());
  }
  return shortest;
}

// Resets `state` and feeds it the first `shortest` tokens of every prompt through the chunked
// forward; `logits` (batch, vocab_size) receives the logits after them. Blocking (prefill is).
template <class ExecutionSpace>
void prefill_shortest(const ExecutionSpace& exec, LanguageModel<ExecutionSpace>& model,
                      DecodeState<ExecutionSpace>& state, const std::vector<std::vector<std::int64_t>>& prompts,
                      std::size_t shortest, const Tensor2<float, typename ExecutionSpace::memory_space>& logits) {
  using Mem = typename ExecutionSpace::memory_space;
  const int batch = static_cast<int>(prompts.size());
  state.reset(exec);
  const auto prompt_ids =
      allocate_uninitialized<Tensor2<std::int64_t, Mem>>("kmamba::decode::prompt_ids", batch, shortest);
  const auto host_prompt_ids = Kokkos::create_mirror_view(prompt_ids);
  for (int s = 0; s < batch; ++s) {
    for (std::size_t t = 0; t < shortest; ++t) host_prompt_ids(s, t) = prompts[s][t];
  }
  Kokkos::deep_copy(exec, prompt_ids, host_prompt_ids);
  model.prefill(exec, prompt_ids, state, logits);
}

// What a generate call with device sampling keeps on the device, allocated once per call, and the
// host's view of it.
template <class ExecutionSpace>
struct DeviceGeneration {
  using Mem = typename ExecutionSpace::memory_space;
  Tensor2<std::int64_t, Mem> prompts;         // (batch, longest prompt), −1 after each prompt
  Tensor1<std::int64_t, Mem> prompt_lengths;  // (batch)
  Tensor1<std::int64_t, Mem> stop_tokens;     // (stops)
  Tensor2<std::int64_t, Mem> tokens;          // (batch, max_new_tokens): the generated tokens
  Tensor1<std::int64_t, Mem> generated;       // (batch): how many
  Tensor1<std::int64_t, Mem> done;            // (batch)
  Tensor1<std::int64_t, Mem> steps;           // (batch): the sampler's steps of a round
  Tensor1<std::int64_t, Mem> ids;             // (batch): the tokens fed to the next decode step
  typename Tensor2<std::int64_t, Mem>::HostMirror host_tokens;
  typename Tensor1<std::int64_t, Mem>::HostMirror host_generated, host_done;
  std::vector<std::int64_t> reported;  // per sequence: tokens handed to on_token

  DeviceGeneration(const ExecutionSpace& exec, const std::vector<std::vector<std::int64_t>>& prompt_list,
                   const GenerationOptions& options) {
    const int batch = static_cast<int>(prompt_list.size());
    std::size_t longest = 0;
    for (const auto& p : prompt_list) longest = std::max(longest, p.size());
    prompts = allocate_uninitialized<Tensor2<std::int64_t, Mem>>("kmamba::generate::prompts", batch, longest);
    prompt_lengths = allocate_uninitialized<Tensor1<std::int64_t, Mem>>("kmamba::generate::prompt_lengths", batch);
    stop_tokens =
        allocate_uninitialized<Tensor1<std::int64_t, Mem>>("kmamba::generate::stop_tokens", options.stop_tokens.size());
    const auto host_prompts = Kokkos::create_mirror_view(prompts);
    const auto host_lengths = Kokkos::create_mirror_view(prompt_lengths);
    const auto host_stops = Kokkos::create_mirror_view(stop_tokens);
    for (int s = 0; s < batch; ++s) {
      host_lengths(s) = static_cast<std::int64_t>(prompt_list[s].size());
      for (std::size_t t = 0; t < longest; ++t) host_prompts(s, t) = t < prompt_list[s].size() ? prompt_list[s][t] : -1;
    }
    for (std::size_t k = 0; k < options.stop_tokens.size(); ++k) host_stops(k) = options.stop_tokens[k];
    Kokkos::deep_copy(exec, prompts, host_prompts);
    Kokkos::deep_copy(exec, prompt_lengths, host_lengths);
    Kokkos::deep_copy(exec, stop_tokens, host_stops);
    tokens = allocate<Tensor2<std::int64_t, Mem>>("kmamba::generate::tokens", batch, options.max_new_tokens);
    generated = allocate<Tensor1<std::int64_t, Mem>>("kmamba::generate::generated", batch);
    done = allocate<Tensor1<std::int64_t, Mem>>("kmamba::generate::done", batch);
    steps = allocate<Tensor1<std::int64_t, Mem>>("kmamba::generate::steps", batch);
    ids = allocate<Tensor1<std::int64_t, Mem>>("kmamba::generate::ids", batch);
    host_tokens = Kokkos::create_mirror_view(tokens);
    host_generated = Kokkos::create_mirror_view(generated);
    host_done = Kokkos::create_mirror_view(done);
    reported.assign(static_cast<std::size_t>(batch), 0);
  }

  int batch() const { return static_cast<int>(ids.extent(0)); }

  // One round, `fed` tokens having been fed to every sequence: ids for the next step, the sampled
  // tokens recorded, sequences that end marked done. Non-blocking.
  void round(const ExecutionSpace& exec, const DeviceSampler<ExecutionSpace>& sampler,
             const Tensor2<float, Mem>& logits, std::int64_t fed, std::uint64_t first_sequence) {
    // Light-weight launches: the functor goes as a kernel parameter, with no host-side wait.
    const auto rows = impl::light_weight(Kokkos::RangePolicy<ExecutionSpace>(exec, 0, batch()));
    Kokkos::parallel_for("kmamba::generate::plan_round", rows,
                         impl::PlanRound<Mem>{prompts, prompt_lengths, generated, done, steps, ids, fed});
    sampler.sample(exec, logits, steps, ids, first_sequence);
    Kokkos::parallel_for("kmamba::generate::record_round", rows,
                         impl::RecordRound<Mem>{steps, ids, stop_tokens, tokens, generated, done});
  }

  // Blocking: hands the tokens generated since the last call to on_token (when set) and returns
  // whether every sequence is done.
  bool sync(const ExecutionSpace& exec, const TokenCallback& on_token) {
    Kokkos::deep_copy(exec, host_done, done);
    Kokkos::deep_copy(exec, host_generated, generated);
    if (on_token) Kokkos::deep_copy(exec, host_tokens, tokens);
    exec.fence();
    bool all_done = true;
    for (int s = 0; s < batch(); ++s) {
      all_done = all_done && host_done(s) != 0;
      if (!on_token) continue;
      for (; reported[s] < host_generated(s); ++reported[s]) on_token(s, host_tokens(s, reported[s]));
    }
    return all_done;
  }
};

}  // namespace

template <class ExecutionSpace>
GenerationResult generate(const ExecutionSpace& exec, LanguageModel<ExecutionSpace>& model,
                          const std::vector<std::vector<std::int64_t>>& prompts, const TokenSampler& sampler,
                          const GenerationOptions& options, const TokenCallback& on_token) {
  KMAMBA_REQUIRE(!prompts.empty(), "kmamba::generate: no prompts");
  DecodeState<ExecutionSpace> state = model.make_decode_state(static_cast<int>(prompts.size()));
  return generate(exec, model, state, prompts, sampler, options, on_token);
}

template <class ExecutionSpace>
GenerationResult generate(const ExecutionSpace& exec, LanguageModel<ExecutionSpace>& model,
                          DecodeState<ExecutionSpace>& state, const std::vector<std::vector<std::int64_t>>& prompts,
                          const TokenSampler& sampler, const GenerationOptions& options,
                          const TokenCallback& on_token) {
  using Mem = typename ExecutionSpace::memory_space;
  constexpr const char* function = "kmamba::generate";
  const int batch = static_cast<int>(prompts.size());
  const int vocab = model.config().vocab_size;
  KMAMBA_REQUIRE(batch > 0, function << ": no prompts");
  KMAMBA_REQUIRE(state.batch() == batch, function << ": the DecodeState holds " << state.batch() << " sequences but "
                                                  << batch << " prompts were given");
  KMAMBA_REQUIRE(static_cast<bool>(sampler), function << ": no sampler");
  KMAMBA_REQUIRE(options.max_new_tokens >= 0,
                 function << ": max_new_tokens must be >= 0, got " << options.max_new_tokens);
  const std::size_t shortest = shortest_prompt(function, prompts);

  GenerationResult result;
  result.tokens.resize(static_cast<std::size_t>(batch));
  if (options.max_new_tokens == 0) return result;
  const auto is_stop = [&](std::int64_t token) {
    return std::find(options.stop_tokens.begin(), options.stop_tokens.end(), token) != options.stop_tokens.end();
  };

  // Everything the loop touches, allocated once.
  const auto logits = allocate_uninitialized<Tensor2<float, Mem>>("kmamba::decode::logits", batch, vocab);
  const auto host_logits = Kokkos::create_mirror_view(logits);
  const auto ids = allocate_uninitialized<Tensor1<std::int64_t, Mem>>("kmamba::decode::ids", batch);
  const auto host_ids = Kokkos::create_mirror_view(ids);
  std::vector<std::vector<std::int64_t>> history(static_cast<std::size_t>(batch));
  std::vector<std::size_t> fed(static_cast<std::size_t>(batch), shortest);  // tokens each sequence has been fed
  std::vector<char> done(static_cast<std::size_t>(batch), 0);
  for (int s = 0; s < batch; ++s) {
    history[s].reserve(prompts[s].size() + static_cast<std::size_t>(options.max_new_tokens));
    history[s].assign(prompts[s].begin(), prompts[s].end());
    result.tokens[s].reserve(static_cast<std::size_t>(options.max_new_tokens));
    host_ids(s) = prompts[s][shortest - 1];  // a valid id for a sequence done before it is fed anything
  }

  // Prefill: the first `shortest` tokens of every prompt through the chunked forward.
  const auto prefill_start = std::chrono::steady_clock::now();
  prefill_shortest(exec, model, state, prompts, shortest, logits);
  Kokkos::deep_copy(exec, host_logits, logits);
  exec.fence();
  result.stats.prefill_tokens = static_cast<std::int64_t>(batch) * static_cast<std::int64_t>(shortest);
  result.stats.prefill_seconds = seconds_since(prefill_start);

  // Decode: host_logits row s follows the fed[s] first tokens of history[s].
  const auto decode_start = std::chrono::steady_clock::now();
  for (;;) {
    int active = 0;
    for (int s = 0; s < batch; ++s) {
      if (done[s]) continue;  // keeps its last token in host_ids
      std::int64_t next;
      if (fed[s] < prompts[s].size()) {
        next = prompts[s][fed[s]];
      } else {
        next = sampler(&host_logits(s, 0), vocab, s, history[s]);
        KMAMBA_REQUIRE(next >= 0 && next < vocab, function << ": the sampler returned token " << next
                                                           << " for sequence " << s << ", outside [0, " << vocab
                                                           << ")");
        history[s].push_back(next);
        result.tokens[s].push_back(next);
        ++result.stats.generated_tokens;
        if (on_token) on_token(s, next);
        if (is_stop(next) || static_cast<int>(result.tokens[s].size()) >= options.max_new_tokens) {
          done[s] = 1;
          continue;
        }
      }
      host_ids(s) = next;
      ++active;
    }
    if (active == 0) break;
    Kokkos::deep_copy(exec, ids, host_ids);
    model.decode_step(exec, ids, state, logits);
    Kokkos::deep_copy(exec, host_logits, logits);
    exec.fence();
    for (int s = 0; s < batch; ++s) ++fed[s];
    ++result.stats.decode_steps;
    result.stats.decode_tokens += active;
  }
  result.stats.decode_seconds = seconds_since(decode_start);
  return result;
}

template <class ExecutionSpace>
GenerationResult generate(const ExecutionSpace& exec, LanguageModel<ExecutionSpace>& model,
                          const std::vector<std::vector<std::int64_t>>& prompts, const SamplingConfig& sampling,
                          const GenerationOptions& options, const TokenCallback& on_token) {
  KMAMBA_REQUIRE(!prompts.empty(), "kmamba::generate: no prompts");
  DecodeState<ExecutionSpace> state = model.make_decode_state(static_cast<int>(prompts.size()));
  return generate(exec, model, state, prompts, sampling, options, on_token);
}

template <class ExecutionSpace>
GenerationResult generate(const ExecutionSpace& exec, LanguageModel<ExecutionSpace>& model,
                          DecodeState<ExecutionSpace>& state, const std::vector<std::vector<std::int64_t>>& prompts,
                          const SamplingConfig& sampling, const GenerationOptions& options,
                          const TokenCallback& on_token) {
  using Mem = typename ExecutionSpace::memory_space;
  constexpr const char* function = "kmamba::generate";
  const std::size_t shortest = shortest_prompt(function, prompts);
  const int batch = static_cast<int>(prompts.size());
  const int vocab = model.config().vocab_size;
  const int sample_vocab = options.sample_vocab == 0 ? vocab : options.sample_vocab;
  KMAMBA_REQUIRE(state.batch() == batch, function << ": the DecodeState holds " << state.batch() << " sequences but "
                                                  << batch << " prompts were given");
  KMAMBA_REQUIRE(options.max_new_tokens >= 0,
                 function << ": max_new_tokens must be >= 0, got " << options.max_new_tokens);
  KMAMBA_REQUIRE(sample_vocab >= 1 && sample_vocab <= vocab, function << ": sample_vocab must be in [0, vocab_size = "
                                                                      << vocab << "], got " << options.sample_vocab);
  KMAMBA_REQUIRE(options.sync_interval >= 1, function << ": sync_interval must be >= 1, got " << options.sync_interval);
  // Decode steps take the prompt tokens past the shortest unchecked (they never wait for the device).
  std::size_t longest = 0;
  for (int s = 0; s < batch; ++s) {
    longest = std::max(longest, prompts[s].size());
    for (std::size_t t = 0; t < prompts[s].size(); ++t) {
      KMAMBA_REQUIRE(prompts[s][t] >= 0 && prompts[s][t] < vocab, function << ": token " << prompts[s][t]
                                                                           << " at position " << t << " of prompt " << s
                                                                           << " is outside [0, " << vocab << ")");
    }
  }
  DeviceSampler<ExecutionSpace> sampler(sampling, batch, sample_vocab);
  GenerationResult result;
  result.tokens.resize(static_cast<std::size_t>(batch));
  if (options.max_new_tokens == 0) return result;

  DeviceGeneration<ExecutionSpace> loop(exec, prompts, options);
  const auto logits = allocate_uninitialized<Tensor2<float, Mem>>("kmamba::decode::logits", batch, vocab);
  sampler.reset(exec);
  sampler.observe(exec, loop.prompts);  // the repetition penalty sees each whole prompt from the start
  const auto prefill_start = std::chrono::steady_clock::now();
  prefill_shortest(exec, model, state, prompts, shortest, logits);
  exec.fence();
  result.stats.prefill_tokens = static_cast<std::int64_t>(batch) * static_cast<std::int64_t>(shortest);
  result.stats.prefill_seconds = seconds_since(prefill_start);

  // Round r samples after shortest + r tokens; the last sequence needs `rounds` of them. Only stop
  // tokens can end the loop earlier, and only on_token needs the tokens before the end.
  const std::int64_t rounds = static_cast<std::int64_t>(longest - shortest) + options.max_new_tokens;
  const bool look = !options.stop_tokens.empty() || static_cast<bool>(on_token);
  const auto decode_start = std::chrono::steady_clock::now();
  for (std::int64_t r = 0;;) {
    loop.round(exec, sampler, logits, static_cast<std::int64_t>(shortest) + r, options.first_sequence);
    if (++r == rounds) break;
    if (look && r % options.sync_interval == 0) {
      sampler.check_errors(function);
      if (loop.sync(exec, on_token)) break;
    }
    model.decode_step(exec, loop.ids, state, logits, false);
    ++result.stats.decode_steps;
  }
  loop.sync(exec, on_token);
  result.stats.decode_seconds = seconds_since(decode_start);
  sampler.check_errors(function);

  Kokkos::deep_copy(loop.host_tokens, loop.tokens);
  for (int s = 0; s < batch; ++s) {
    const std::int64_t n = loop.host_generated(s);
    for (std::int64_t k = 0; k < n; ++k) result.tokens[s].push_back(loop.host_tokens(s, k));
    result.stats.generated_tokens += n;
    // A sequence is fed its prompt past the shortest, then each token it generates but the last.
    result.stats.decode_tokens += static_cast<std::int64_t>(prompts[s].size() - shortest) + n - 1;
  }
  return result;
}

#define KMAMBA_INSTANTIATE_GENERATE(Space)                                                                        \
  template GenerationResult generate<Space>(const Space&, LanguageModel<Space>&,                                  \
                                            const std::vector<std::vector<std::int64_t>>&, const TokenSampler&,   \
                                            const GenerationOptions&, const TokenCallback&);                      \
  template GenerationResult generate<Space>(const Space&, LanguageModel<Space>&, DecodeState<Space>&,             \
                                            const std::vector<std::vector<std::int64_t>>&, const TokenSampler&,   \
                                            const GenerationOptions&, const TokenCallback&);                      \
  template GenerationResult generate<Space>(const Space&, LanguageModel<Space>&,                                  \
                                            const std::vector<std::vector<std::int64_t>>&, const SamplingConfig&, \
                                            const GenerationOptions&, const TokenCallback&);                      \
  template GenerationResult generate<Space>(const Space&, LanguageModel<Space>&, DecodeState<Space>&,             \
                                            const std::vector<std::vector<std::int64_t>>&, const SamplingConfig&, \
                                            const GenerationOptions&, const TokenCallback&);

KMAMBA_FOR_EACH_BACKEND(KMAMBA_INSTANTIATE_GENERATE)

}  // namespace kmamba
