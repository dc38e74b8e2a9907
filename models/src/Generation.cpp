// The host-side generation loop: a prefill of the shortest prompt's length, then decode steps
// that finish longer prompts and generate.
#include <kmamba/models/Generation.hpp>

#include <kmamba/Config.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/ForEachBackend.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <utility>

namespace kmamba {

double GenerationStats::prefill_tokens_per_second() const {
  return prefill_seconds > 0.0 ? static_cast<double>(prefill_tokens) / prefill_seconds : 0.0;
}

double GenerationStats::decode_tokens_per_second() const {
  return decode_seconds > 0.0 ? static_cast<double>(decode_tokens) / decode_seconds : 0.0;
}

namespace {

double seconds_since(const std::chrono::steady_clock::time_point& start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

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
  std::size_t shortest = prompts[0].size();
  for (int s = 0; s < batch; ++s) {
    KMAMBA_REQUIRE(!prompts[s].empty(), function << ": prompt " << s << " is empty (every prompt needs a token)");
    shortest = std::min(shortest, prompts[s].size());
  }

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
  state.reset(exec);
  {
    const auto prompt_ids =
        allocate_uninitialized<Tensor2<std::int64_t, Mem>>("kmamba::decode::prompt_ids", batch, shortest);
    const auto host_prompt_ids = Kokkos::create_mirror_view(prompt_ids);
    for (int s = 0; s < batch; ++s) {
      for (std::size_t t = 0; t < shortest; ++t) host_prompt_ids(s, t) = prompts[s][t];
    }
    Kokkos::deep_copy(exec, prompt_ids, host_prompt_ids);
    model.prefill(exec, prompt_ids, state, logits);
    Kokkos::deep_copy(exec, host_logits, logits);
    exec.fence();
  }
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

#define KMAMBA_INSTANTIATE_GENERATE(Space)                                                                      \
  template GenerationResult generate<Space>(const Space&, LanguageModel<Space>&,                                \
                                            const std::vector<std::vector<std::int64_t>>&, const TokenSampler&, \
                                            const GenerationOptions&, const TokenCallback&);                    \
  template GenerationResult generate<Space>(const Space&, LanguageModel<Space>&, DecodeState<Space>&,           \
                                            const std::vector<std::vector<std::int64_t>>&, const TokenSampler&, \
                                            const GenerationOptions&, const TokenCallback&);

KMAMBA_FOR_EACH_BACKEND(KMAMBA_INSTANTIATE_GENERATE)

}  // namespace kmamba
