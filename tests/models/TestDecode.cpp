// Recurrent inference (docs/algorithms.md §1.6, §2.10, §5) against the chunked forward:
// - mixer level, Mamba-1, Mamba-2 and Mamba-3 (SISO, SISO with the output norm, MIMO; random
//   reference init, seqlen not a multiple of the chunk):
//   prefill + steps, prefill in two segments, and steps alone from a reset cache ≡ forward;
// - model level: prefill of a prompt + decode steps ≡ one forward over the whole sequence (the
//   golden tiny checkpoints, also against their golden logits, and random models with a padded,
//   tied or untied head; Mamba-3 SISO and MIMO); prefill in two segments ≡ one prefill;
// - generation: prompts of different lengths in one batch ≡ each prompt alone; greedy generation
//   is deterministic, matches the arg-max of a full forward, stops at stop tokens and
//   max_new_tokens, streams every token through the callback and counts its work; device sampling
//   (greedy and every filter, a restricted vocabulary, stop tokens looked at every 1, 3 or 16
//   steps) generates the tokens of the host loop with the host Sampler;
// - errors: another mixer's cache, another model's state, a wrong batch, bad tokens;
// - kernel counts of the Mamba-2 decode step (Kokkos Tools callbacks): per block and per mixer step.
//
// Tolerances, max|Δ| / max|ref| over the compared outputs: 5e-5 between the recurrent and the
// chunked paths of kmamba (they differ only in summation order; ~1e-6 observed on Serial and
// OpenMP), and ‖Δ‖/‖ref‖ ≤ 2e-4 against the golden logits (the golden README's tolerance).
#include <kmamba/models/Generation.hpp>
#include <kmamba/models/LanguageModel.hpp>
#include <kmamba/models/Mixer.hpp>
#include <kmamba/models/ParameterSlab.hpp>
#include <kmamba/models/SafeTensors.hpp>
#include <kmamba/models/Sampling.hpp>
#include <kmamba/models/TensorIO.hpp>
#include "TestData.hpp"

#include "Backends.hpp"
#include "Checks.hpp"
#include "ModelConfigs.hpp"

#include <gtest/gtest.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace kmamba::test;
const std::string golden_dir = kmamba::test::golden_dir();
constexpr double recurrent_tolerance = 5e-5;

template <class View>
std::vector<typename View::non_const_value_type> to_vector(const View& view) {
  const auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), view);
  return std::vector<typename View::non_const_value_type>(host.data(), host.data() + host.span());
}

// A device tensor of the given extents holding `values` (row-major).
template <class ViewType, class T, class... Extents>
ViewType to_device(const std::vector<T>& values, Extents... extents) {
  ViewType view("kmamba::test::decode_input", static_cast<std::size_t>(extents)...);
  EXPECT_EQ(view.span(), values.size());
  const auto host = Kokkos::create_mirror_view(view);
  std::copy(values.begin(), values.end(), host.data());
  Kokkos::deep_copy(view, host);
  return view;
}

// Positions [first, last) of a row-major (batch, seqlen, width) host array.
template <class T>
std::vector<T> positions(const std::vector<T>& v, std::size_t batch, std::size_t seqlen, std::size_t width,
                         std::size_t first, std::size_t last) {
  std::vector<T> out;
  for (std::size_t b = 0; b < batch; ++b) {
    out.insert(out.end(), v.begin() + static_cast<std::ptrdiff_t>((b * seqlen + first) * width),
               v.begin() + static_cast<std::ptrdiff_t>((b * seqlen + last) * width));
  }
  return out;
}

// Writes `part` (batch, count, width) into positions [first, first + count) of `whole`.
void put_positions(std::vector<float>& whole, const std::vector<float>& part, std::size_t batch, std::size_t seqlen,
                   std::size_t width, std::size_t first) {
  const std::size_t count = part.size() / (batch * width);
  for (std::size_t b = 0; b < batch; ++b) {
    std::copy(part.begin() + static_cast<std::ptrdiff_t>(b * count * width),
              part.begin() + static_cast<std::ptrdiff_t>((b + 1) * count * width),
              whole.begin() + static_cast<std::ptrdiff_t>((b * seqlen + first) * width));
  }
}

std::vector<float> uniform_values(std::size_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-1.5f, 1.5f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// ----------------------------------------------------------------------------------------------
// Mixer level.

kmamba::ModelConfig small_mamba2_config(bool bias, bool norm_before_gate) {
  kmamba::ModelConfig c = model_config(kmamba::MixerKind::Mamba2, {16, 2, 40, 8, 8, 4, 2});
  c.bias = bias;
  c.norm_before_gate = norm_before_gate;
  c.validate();
  return c;
}

kmamba::ModelConfig small_mamba1_config(bool bias) {
  kmamba::ModelConfig c;
  c.mixer = kmamba::MixerKind::Mamba1;
  std::tie(c.d_model, c.n_layer, c.vocab_size, c.d_state, c.dt_rank, c.bias) = std::make_tuple(16, 2, 40, 8, 3, bias);
  c.validate();
  return c;
}

kmamba::ModelConfig small_mamba3_config(bool mimo, bool outproj_norm) {
  kmamba::ModelConfig c = model_config(kmamba::MixerKind::Mamba3, {16, 2, 40, 8, 8, 4, 2});
  c.is_mimo = mimo;
  c.mimo_rank = 2;
  c.is_outproj_norm = outproj_norm;
  c.rope_fraction = mimo ? 1.0 : 0.5;
  c.validate();
  return c;
}

// prefill(u[:, :split]) then steps, prefill in two segments, and steps alone ≡ forward(u).
template <class Exec>
void check_mixer_recurrence(const kmamba::ModelConfig& config, int batch, int seqlen, int split) {
  using Mem = typename Exec::memory_space;
  using T2 = kmamba::Tensor2<float, Mem>;
  using T3 = kmamba::Tensor3<float, Mem>;
  const Exec exec;
  const std::size_t b = static_cast<std::size_t>(batch), L = static_cast<std::size_t>(seqlen),
                    dm = static_cast<std::size_t>(config.d_model), s = static_cast<std::size_t>(split);
  auto mixer = kmamba::make_mixer<Exec>(config, "backbone.layers.0.mixer.");
  kmamba::ParameterSlab<Mem> slab;
  mixer->declare_parameters(slab);
  slab.finalize("kmamba::test::decode_slab");
  mixer->initialize(exec, slab, 5);
  const std::vector<float> u = uniform_values(b * L * dm, 17);
  T3 reference("kmamba::test::reference", b, L, dm);
  mixer->forward(exec, slab, to_device<T3>(u, b, L, dm), reference, false);
  const std::vector<float> expected = to_vector(reference);

  const auto run_steps = [&](kmamba::MixerCache<Exec>& cache, std::size_t first, std::vector<float>& got) {
    T2 out("kmamba::test::step_out", b, dm);
    for (std::size_t t = first; t < L; ++t) {
      mixer->step(exec, slab, to_device<T2>(positions(u, b, L, dm, t, t + 1), b, dm), out, cache);
      put_positions(got, to_vector(out), b, L, dm, t);
    }
  };
  const auto run_prefill = [&](kmamba::MixerCache<Exec>& cache, std::size_t first, std::size_t last,
                               std::vector<float>& got) {
    T3 out("kmamba::test::prefill_out", b, last - first, dm);
    mixer->prefill(exec, slab, to_device<T3>(positions(u, b, L, dm, first, last), b, last - first, dm), out, cache);
    put_positions(got, to_vector(out), b, L, dm, first);
  };

  auto cache = mixer->make_cache(batch);
  ASSERT_EQ(cache->batch(), batch);
  std::vector<float> got(expected.size(), std::nanf(""));
  run_prefill(*cache, 0, s, got);
  run_steps(*cache, s, got);
  const double prefill_then_steps = max_relative_error(got, expected);
  EXPECT_LE(prefill_then_steps, recurrent_tolerance);

  cache->reset(exec);
  std::fill(got.begin(), got.end(), std::nanf(""));
  run_prefill(*cache, 0, s, got);
  run_prefill(*cache, s, s, got);  // an empty segment changes nothing
  run_prefill(*cache, s, L, got);
  const double two_segments = max_relative_error(got, expected);
  EXPECT_LE(two_segments, recurrent_tolerance);

  cache->reset(exec);
  std::fill(got.begin(), got.end(), std::nanf(""));
  run_steps(*cache, 0, got);
  const double steps_only = max_relative_error(got, expected);
  EXPECT_LE(steps_only, recurrent_tolerance);
  std::printf("[ decode   ] %s mixer, %s: prefill+steps %.2e, two prefills %.2e, steps only %.2e\n",
              kmamba::mixer_name(config.mixer), Exec::name(), prefill_then_steps, two_segments, steps_only);
}

KMAMBA_BACKEND_TEST_SUITE(DecodeTest);

TYPED_TEST(DecodeTest, Mamba2MixerStepsMatchForward) {
  check_mixer_recurrence<TypeParam>(small_mamba2_config(false, false), 2, 11, 5);
  check_mixer_recurrence<TypeParam>(small_mamba2_config(true, true), 3, 10, 7);
}

TYPED_TEST(DecodeTest, Mamba1MixerStepsMatchForward) {
  check_mixer_recurrence<TypeParam>(small_mamba1_config(false), 2, 11, 5);
  check_mixer_recurrence<TypeParam>(small_mamba1_config(true), 3, 10, 1);
}

TYPED_TEST(DecodeTest, Mamba3MixerStepsMatchForward) {
  check_mixer_recurrence<TypeParam>(small_mamba3_config(false, false), 2, 11, 5);
  check_mixer_recurrence<TypeParam>(small_mamba3_config(false, true), 3, 10, 1);
  check_mixer_recurrence<TypeParam>(small_mamba3_config(true, false), 2, 9, 4);
}

TYPED_TEST(DecodeTest, MixersRejectForeignCaches) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const Exec exec;
  auto m1 = kmamba::make_mixer<Exec>(small_mamba1_config(false), "a.");
  auto m2 = kmamba::make_mixer<Exec>(small_mamba2_config(false, false), "b.");
  kmamba::ModelConfig wider = small_mamba2_config(false, false);
  wider.d_state = 16;
  auto m2_wide = kmamba::make_mixer<Exec>(wider, "c.");
  kmamba::ParameterSlab<Mem> slab;
  m1->declare_parameters(slab);
  m2->declare_parameters(slab);
  m2_wide->declare_parameters(slab);
  slab.finalize("kmamba::test::decode_slab");
  kmamba::Tensor2<float, Mem> u("kmamba::test::u", 2, 16), out("kmamba::test::out", 2, 16);
  auto cache1 = m1->make_cache(2);
  auto cache2 = m2->make_cache(2);
  auto cache2_single = m2->make_cache(1);
  EXPECT_THROW(m2->step(exec, slab, u, out, *cache1), kmamba::UserError);
  EXPECT_THROW(m1->step(exec, slab, u, out, *cache2), kmamba::UserError);
  EXPECT_THROW(m2_wide->step(exec, slab, u, out, *cache2), kmamba::UserError);
  EXPECT_THROW(m2->step(exec, slab, u, out, *cache2_single), kmamba::UserError);
  EXPECT_THROW(m1->make_cache(0), kmamba::UserError);
  kmamba::Tensor3<float, Mem> seq("kmamba::test::seq", 2, 3, 16), seq_out("kmamba::test::seq_out", 2, 3, 16);
  EXPECT_THROW(m1->prefill(exec, slab, seq, seq_out, *cache2), kmamba::UserError);
  EXPECT_NO_THROW(m2->step(exec, slab, u, out, *cache2));
  EXPECT_NO_THROW(m1->prefill(exec, slab, seq, seq_out, *cache1));
}

// ----------------------------------------------------------------------------------------------
// Model level.

// Mamba-3: SISO, or MIMO of rank 2 when `mimo`.
kmamba::ModelConfig random_model_config(kmamba::MixerKind kind, bool mimo = false) {
  kmamba::ModelConfig c;
  c.mixer = kind;
  c.is_mimo = mimo;
  c.mimo_rank = 2;
  c.d_model = 32;
  c.n_layer = 2;
  c.vocab_size = 50;
  c.pad_vocab_size_multiple = 8;  // 56 rows: the padding rows must not reach the logits
  c.d_state = 8;
  c.headdim = 8;
  c.ngroups = 2;
  c.chunk_size = 4;
  c.dt_rank = 4;
  c.tie_embeddings = kind == kmamba::MixerKind::Mamba2;
  c.validate();
  return c;
}

template <class Exec>
kmamba::LanguageModel<Exec> random_model(kmamba::MixerKind kind, bool mimo = false) {
  kmamba::LanguageModel<Exec> model(random_model_config(kind, mimo));
  model.initialize(23);
  return model;
}

/// Calls body(model) for a random model (random_model) of each mixer kind, under a trace naming it.
template <class Exec, class Body>
void for_each_random_model(const Body& body) {
  for (const auto kind : {kmamba::MixerKind::Mamba1, kmamba::MixerKind::Mamba2, kmamba::MixerKind::Mamba3}) {
    SCOPED_TRACE(kmamba::mixer_name(kind));
    auto model = random_model<Exec>(kind);
    body(model);
  }
}

std::vector<std::int64_t> random_ids(std::size_t n, int vocab, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<std::int64_t> d(0, vocab - 1);
  std::vector<std::int64_t> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// Prefill of ids[:, :prefix], then one decode step per remaining token (teacher forcing); returns
// the logits after every position from prefix − 1 on, (batch, seqlen − prefix + 1, vocab).
// `graph_status`, when given, receives the state's step_graph_status() after the last step.
// incremental_logits_in runs them in a given state (reset first).
template <class Exec>
std::vector<float> incremental_logits_in(kmamba::LanguageModel<Exec>& model, kmamba::DecodeState<Exec>& state,
                                         const std::vector<std::int64_t>& ids, std::size_t batch, std::size_t seqlen,
                                         std::size_t prefix, std::string* graph_status = nullptr) {
  using Mem = typename Exec::memory_space;
  const Exec exec;
  const std::size_t V = static_cast<std::size_t>(model.config().vocab_size), n = seqlen - prefix + 1;
  state.reset(exec);
  kmamba::Tensor2<float, Mem> logits("kmamba::test::logits", batch, V);
  std::vector<float> all(batch * n * V);
  model.prefill(
      exec, to_device<kmamba::Tensor2<std::int64_t, Mem>>(positions(ids, batch, seqlen, 1, 0, prefix), batch, prefix),
      state, logits);
  put_positions(all, to_vector(logits), batch, n, V, 0);
  for (std::size_t t = prefix; t < seqlen; ++t) {
    model.decode_step(exec,
                      to_device<kmamba::Tensor1<std::int64_t, Mem>>(positions(ids, batch, seqlen, 1, t, t + 1), batch),
                      state, logits);
    put_positions(all, to_vector(logits), batch, n, V, t - prefix + 1);
  }
  EXPECT_EQ(state.position(), static_cast<std::int64_t>(seqlen));
  if (graph_status != nullptr) *graph_status = state.step_graph_status();
  return all;
}

template <class Exec>
std::vector<float> incremental_logits(kmamba::LanguageModel<Exec>& model, const std::vector<std::int64_t>& ids,
                                      std::size_t batch, std::size_t seqlen, std::size_t prefix, bool step_graph = true,
                                      std::string* graph_status = nullptr) {
  auto state = model.make_decode_state(static_cast<int>(batch));
  state.set_step_graph(step_graph);
  return incremental_logits_in(model, state, ids, batch, seqlen, prefix, graph_status);
}

template <class Exec>
std::vector<float> forward_logits(kmamba::LanguageModel<Exec>& model, const std::vector<std::int64_t>& ids,
                                  std::size_t batch, std::size_t seqlen) {
  using Mem = typename Exec::memory_space;
  kmamba::Tensor3<float, Mem> logits("kmamba::test::forward_logits", batch, seqlen,
                                     static_cast<std::size_t>(model.config().vocab_size));
  model.forward(Exec(), to_device<kmamba::Tensor2<std::int64_t, Mem>>(ids, batch, seqlen), logits);
  return to_vector(logits);
}

template <class Exec>
void check_golden_incremental(const std::string& name) {
  SCOPED_TRACE(name);
  auto model = kmamba::LanguageModel<Exec>::load(golden_dir + "/" + name);
  const kmamba::SafeTensorsReader io(golden_dir + "/" + name + "_io.safetensors");
  const auto ids_view = kmamba::read_view<kmamba::Tensor2<std::int64_t, Kokkos::HostSpace>>(io, "input_ids");
  const std::vector<std::int64_t> ids(ids_view.data(), ids_view.data() + ids_view.span());
  const std::size_t batch = ids_view.extent(0), seqlen = ids_view.extent(1), V = 96, prefix = 13;
  const std::vector<float> got = incremental_logits(model, ids, batch, seqlen, prefix);
  const double vs_forward = max_relative_error(
      got, positions(forward_logits(model, ids, batch, seqlen), batch, seqlen, V, prefix - 1, seqlen));
  const double vs_golden =
      l2_relative_error(got, positions(io.read_f32("logits"), batch, seqlen, V, prefix - 1, seqlen));
  EXPECT_LE(vs_forward, recurrent_tolerance);
  EXPECT_LE(vs_golden, 2e-4);
  std::printf("[ decode   ] %s, %s: prefill %zu + %zu steps vs forward %.2e, vs golden %.2e\n", name.c_str(),
              Exec::name(), prefix, seqlen - prefix, vs_forward, vs_golden);
}

TYPED_TEST(DecodeTest, GoldenPrefillThenStepsMatchForward) {
  check_golden_incremental<TypeParam>("tiny_mamba1");
  check_golden_incremental<TypeParam>("tiny_mamba2");
}

TYPED_TEST(DecodeTest, RandomModelPrefillThenStepsMatchForward) {
  using Exec = TypeParam;
  const std::vector<std::pair<kmamba::MixerKind, bool>> models = {{kmamba::MixerKind::Mamba1, false},
                                                                  {kmamba::MixerKind::Mamba2, false},
                                                                  {kmamba::MixerKind::Mamba3, false},
                                                                  {kmamba::MixerKind::Mamba3, true}};
  for (const auto& entry : models) {
    const kmamba::MixerKind kind = entry.first;
    const bool mimo = entry.second;
    SCOPED_TRACE(std::string(kmamba::mixer_name(kind)) + (mimo ? " MIMO" : ""));
    auto model = random_model<Exec>(kind, mimo);
    const std::size_t batch = 3, seqlen = 17, V = 50;
    const std::vector<std::int64_t> ids = random_ids(batch * seqlen, 50, 3);
    for (const std::size_t prefix : {std::size_t(1), std::size_t(6), std::size_t(17)}) {
      const std::vector<float> got = incremental_logits(model, ids, batch, seqlen, prefix);
      EXPECT_LE(max_relative_error(
                    got, positions(forward_logits(model, ids, batch, seqlen), batch, seqlen, V, prefix - 1, seqlen)),
                recurrent_tolerance)
          << "prefix " << prefix;
    }
  }
}

// The recorded decode step (a CUDA graph; host backends run steps normally) computes exactly what
// the steps launched one by one compute, across many replays with changing tokens.
TYPED_TEST(DecodeTest, RecordedStepGraphMatchesPlainSteps) {
  using Exec = TypeParam;
  for_each_random_model<Exec>([&](kmamba::LanguageModel<Exec>& model) {
    const std::size_t batch = 2, seqlen = 24, prefix = 3;
    const std::vector<std::int64_t> ids = random_ids(batch * seqlen, 50, 11);
    std::string with_status, without_status;
    const std::vector<float> with_graph = incremental_logits(model, ids, batch, seqlen, prefix, true, &with_status);
    const std::vector<float> without_graph =
        incremental_logits(model, ids, batch, seqlen, prefix, false, &without_status);
    EXPECT_EQ(max_relative_error(with_graph, without_graph), 0.0);
    if (std::is_same<typename Exec::memory_space, Kokkos::HostSpace>::value) {
      EXPECT_EQ(with_status, "not recorded: kernel graphs are a CUDA feature");
    } else {
      EXPECT_EQ(with_status, "recorded");
      EXPECT_EQ(without_status, "not recorded: disabled by the caller");
    }
  });
}

TYPED_TEST(DecodeTest, PrefillInTwoSegmentsEqualsOnePrefill) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using Ids = kmamba::Tensor2<std::int64_t, Mem>;
  const Exec exec;
  for_each_random_model<Exec>([&](kmamba::LanguageModel<Exec>& model) {
    const std::size_t batch = 2, seqlen = 13, cut = 5;
    const std::vector<std::int64_t> ids = random_ids(batch * seqlen, 50, 9);
    kmamba::Tensor2<float, Mem> one("kmamba::test::one", batch, 50), two("kmamba::test::two", batch, 50);
    auto whole = model.make_decode_state(2);
    model.prefill(exec, to_device<Ids>(ids, batch, seqlen), whole, one);
    auto split = model.make_decode_state(2);
    model.prefill(exec, to_device<Ids>(positions(ids, batch, seqlen, 1, 0, cut), batch, cut), split, {});
    model.prefill(exec, to_device<Ids>(positions(ids, batch, seqlen, 1, cut, seqlen), batch, seqlen - cut), split, two);
    EXPECT_EQ(split.position(), whole.position());
    EXPECT_LE(max_relative_error(to_vector(two), to_vector(one)), recurrent_tolerance);
    // The states agree too: the next step gives the same logits.
    const auto next = to_device<kmamba::Tensor1<std::int64_t, Mem>>(std::vector<std::int64_t>{4, 41}, batch);
    model.decode_step(exec, next, whole, one);
    model.decode_step(exec, next, split, two);
    EXPECT_LE(max_relative_error(to_vector(two), to_vector(one)), recurrent_tolerance);
  });
}

// ----------------------------------------------------------------------------------------------
// Generation.

std::int64_t argmax(const float* logits, int vocab) {
  return static_cast<std::int64_t>(std::max_element(logits, logits + vocab) - logits);
}

// A greedy sampler that also records every logits row it is given, per sequence.
struct RecordingGreedy {
  std::vector<std::vector<float>>* rows;
  std::int64_t operator()(const float* logits, int vocab, int sequence, const std::vector<std::int64_t>&) const {
    auto& row = (*rows)[static_cast<std::size_t>(sequence)];
    row.insert(row.end(), logits, logits + vocab);
    return argmax(logits, vocab);
  }
};

TYPED_TEST(DecodeTest, PromptsOfDifferentLengthsMatchEachPromptAlone) {
  using Exec = TypeParam;
  const Exec exec;
  for_each_random_model<Exec>([&](kmamba::LanguageModel<Exec>& model) {
    const std::vector<std::vector<std::int64_t>> prompts = {random_ids(9, 50, 1), random_ids(3, 50, 2),
                                                            random_ids(14, 50, 3), random_ids(3, 50, 4)};
    kmamba::GenerationOptions options;
    options.max_new_tokens = 7;
    std::vector<std::vector<float>> batched_rows(prompts.size());
    const kmamba::GenerationResult batched =
        kmamba::generate(exec, model, prompts, RecordingGreedy{&batched_rows}, options);
    EXPECT_EQ(batched.stats.prefill_tokens, 4 * 3);
    EXPECT_EQ(batched.stats.generated_tokens, 4 * 7);
    EXPECT_EQ(batched.stats.decode_steps, 14 - 3 + 7 - 1);
    for (std::size_t s = 0; s < prompts.size(); ++s) {
      std::vector<std::vector<float>> alone_rows(1);
      const kmamba::GenerationResult alone =
          kmamba::generate(exec, model, {prompts[s]}, RecordingGreedy{&alone_rows}, options);
      EXPECT_EQ(batched.tokens[s], alone.tokens[0]) << "sequence " << s;
      EXPECT_LE(max_relative_error(batched_rows[s], alone_rows[0]), recurrent_tolerance) << "sequence " << s;
    }
  });
}

TYPED_TEST(DecodeTest, GreedyGenerationIsDeterministicAndMatchesForward) {
  using Exec = TypeParam;
  const Exec exec;
  for_each_random_model<Exec>([&](kmamba::LanguageModel<Exec>& model) {
    const std::vector<std::vector<std::int64_t>> prompts = {random_ids(6, 50, 11), random_ids(10, 50, 12)};
    const kmamba::TokenSampler greedy = [](const float* logits, int vocab, int, const std::vector<std::int64_t>&) {
      return argmax(logits, vocab);
    };
    kmamba::GenerationOptions options;
    options.max_new_tokens = 9;
    std::vector<std::vector<std::int64_t>> streamed(prompts.size());
    const auto stream = [&](int s, std::int64_t token) { streamed[static_cast<std::size_t>(s)].push_back(token); };
    const auto first = kmamba::generate(exec, model, prompts, greedy, options, stream);
    auto state = model.make_decode_state(2);
    const auto second = kmamba::generate(exec, model, state, prompts, greedy, options);
    const auto third = kmamba::generate(exec, model, state, prompts, greedy, options);  // the state is reset
    EXPECT_EQ(first.tokens, second.tokens);
    EXPECT_EQ(first.tokens, third.tokens);
    EXPECT_EQ(first.tokens, streamed);
    for (std::size_t s = 0; s < prompts.size(); ++s) {
      ASSERT_EQ(first.tokens[s].size(), 9u);
      // Each generated token is the arg-max of a full forward over the prompt and the tokens before it.
      std::vector<std::int64_t> sequence = prompts[s];
      sequence.insert(sequence.end(), first.tokens[s].begin(), first.tokens[s].end() - 1);
      const std::vector<float> logits = forward_logits(model, sequence, 1, sequence.size());
      for (std::size_t k = 0; k < first.tokens[s].size(); ++k) {
        const std::size_t position = prompts[s].size() - 1 + k;
        EXPECT_EQ(first.tokens[s][k], argmax(logits.data() + position * 50, 50)) << "sequence " << s << " token " << k;
      }
    }

    // A stop token ends its sequence (and is kept); the others run to max_new_tokens.
    kmamba::GenerationOptions stopping = options;
    stopping.stop_tokens = {first.tokens[0][3]};
    const auto stopped = kmamba::generate(exec, model, state, prompts, greedy, stopping);
    const auto stop_at = std::find(first.tokens[0].begin(), first.tokens[0].end(), first.tokens[0][3]);
    EXPECT_EQ(stopped.tokens[0], std::vector<std::int64_t>(first.tokens[0].begin(), stop_at + 1));
    for (std::size_t s = 1; s < prompts.size(); ++s) {
      const auto own_stop = std::find(first.tokens[s].begin(), first.tokens[s].end(), first.tokens[0][3]);
      EXPECT_EQ(stopped.tokens[s],
                std::vector<std::int64_t>(first.tokens[s].begin(),
                                          own_stop == first.tokens[s].end() ? own_stop : own_stop + 1));
    }
    kmamba::GenerationOptions none = options;
    none.max_new_tokens = 0;
    const auto empty = kmamba::generate(exec, model, state, prompts, greedy, none);
    EXPECT_TRUE(empty.tokens[0].empty() && empty.tokens[1].empty());
    EXPECT_GT(first.stats.prefill_tokens_per_second(), 0.0);
    EXPECT_GT(first.stats.decode_tokens_per_second(), 0.0);
    EXPECT_EQ(first.stats.decode_tokens,
              2 * 8 + 4);  // 8 steps after the prefill for both, + 4 prompt tokens of the longer
  });
}

// The host loop with kmamba::Sampler (as kmamba-generate used it): the reference of device sampling,
// whose repetition penalty skips the prompt tokens outside [0, sample_vocab).
kmamba::TokenSampler host_sampler(kmamba::Sampler& sampler, const std::vector<std::vector<std::int64_t>>& prompts,
                                  int sample_vocab, std::uint64_t first_sequence) {
  return [&sampler, &prompts, sample_vocab, first_sequence](const float* logits, int, int s,
                                                            const std::vector<std::int64_t>& history) {
    const std::size_t prompt_length = prompts[static_cast<std::size_t>(s)].size();
    std::vector<std::int64_t> seen;
    for (const std::int64_t t : history) {
      if (t < sample_vocab) seen.push_back(t);
    }
    return sampler.sample(logits, sample_vocab, seen.data(), seen.size(),
                          first_sequence + static_cast<std::uint64_t>(s),
                          static_cast<std::uint64_t>(history.size() - prompt_length));
  };
}

TYPED_TEST(DecodeTest, DeviceSamplingGeneratesTheHostLoopsTokens) {
  using Exec = TypeParam;
  const Exec exec;
  for_each_random_model<Exec>([&](kmamba::LanguageModel<Exec>& model) {
    const std::vector<std::vector<std::int64_t>> prompts = {random_ids(9, 50, 1), random_ids(3, 50, 2),
                                                            random_ids(14, 50, 3), random_ids(3, 50, 4)};
    kmamba::SamplingConfig greedy;
    greedy.temperature = 0.0f;
    kmamba::SamplingConfig sampled;
    sampled.temperature = 0.8f;
    sampled.top_k = 20;
    sampled.top_p = 0.9f;
    sampled.min_p = 0.02f;
    sampled.repetition_penalty = 1.3f;
    sampled.seed = 5;
    auto state = model.make_decode_state(4);
    for (const kmamba::SamplingConfig& config : {greedy, sampled}) {
      for (const int sample_vocab : {0, 20}) {
        kmamba::GenerationOptions options;
        options.max_new_tokens = 7;
        options.sample_vocab = sample_vocab;
        options.first_sequence = 10;
        SCOPED_TRACE(::testing::Message() << "temperature " << config.temperature << " sample_vocab " << sample_vocab);
        kmamba::Sampler sampler(config);
        const int vocab = sample_vocab == 0 ? 50 : sample_vocab;
        const auto host =
            kmamba::generate(exec, model, state, prompts, host_sampler(sampler, prompts, vocab, 10), options);
        const auto device = kmamba::generate(exec, model, state, prompts, config, options);
        EXPECT_EQ(device.tokens, host.tokens);
        EXPECT_EQ(device.stats.prefill_tokens, host.stats.prefill_tokens);
        EXPECT_EQ(device.stats.decode_steps, host.stats.decode_steps);
        EXPECT_EQ(device.stats.decode_tokens, host.stats.decode_tokens);
        EXPECT_EQ(device.stats.generated_tokens, host.stats.generated_tokens);

        // Stop tokens, looked at every 1, 3 or 16 steps: the same tokens, streamed in order; at most
        // sync_interval − 1 steps more than the host loop.
        options.stop_tokens = {host.tokens[0][2], host.tokens[3][4]};
        const auto host_stopped =
            kmamba::generate(exec, model, state, prompts, host_sampler(sampler, prompts, vocab, 10), options);
        for (const int interval : {1, 3, 16}) {
          options.sync_interval = interval;
          std::vector<std::vector<std::int64_t>> streamed(prompts.size());
          const auto stream = [&](int s, std::int64_t t) { streamed[static_cast<std::size_t>(s)].push_back(t); };
          const auto stopped = kmamba::generate(exec, model, state, prompts, config, options, stream);
          EXPECT_EQ(stopped.tokens, host_stopped.tokens) << "sync_interval " << interval;
          EXPECT_EQ(streamed, host_stopped.tokens) << "sync_interval " << interval;
          EXPECT_EQ(stopped.stats.decode_tokens, host_stopped.stats.decode_tokens);
          EXPECT_GE(stopped.stats.decode_steps, host_stopped.stats.decode_steps);
          EXPECT_LT(stopped.stats.decode_steps, host_stopped.stats.decode_steps + interval);
        }
      }
    }
    kmamba::GenerationOptions bad;
    bad.sync_interval = 0;
    EXPECT_THROW(kmamba::generate(exec, model, state, prompts, greedy, bad), kmamba::UserError);
    bad = kmamba::GenerationOptions();
    bad.sample_vocab = 51;
    EXPECT_THROW(kmamba::generate(exec, model, state, prompts, greedy, bad), kmamba::UserError);
    EXPECT_THROW(kmamba::generate(exec, model, state, {{1, 2}, {3}, {4, 50}, {5}}, greedy), kmamba::UserError);
  });
}

// ----------------------------------------------------------------------------------------------
// Kernel counts. The decode step is latency bound (a few µs per kernel on the H200,
// perf/RESULTS.md 2026-12-03), so each block must stay a handful of kernels.

// Records the labels of the Kokkos kernels (parallel_for, _reduce, _scan) launched while it lives,
// through the Kokkos Tools callbacks.
class KernelLabels {
 public:
  KernelLabels() : saved_(Kokkos::Tools::Experimental::get_callbacks()) {
    active_ = this;
    Kokkos::Tools::Experimental::set_begin_parallel_for_callback(&begin);
    Kokkos::Tools::Experimental::set_begin_parallel_reduce_callback(&begin);
    Kokkos::Tools::Experimental::set_begin_parallel_scan_callback(&begin);
  }
  ~KernelLabels() {
    Kokkos::Tools::Experimental::set_callbacks(saved_);
    active_ = nullptr;
  }
  KernelLabels(const KernelLabels&) = delete;
  KernelLabels& operator=(const KernelLabels&) = delete;

  const std::vector<std::string>& labels() const { return labels_; }

  // The labels but the GEMMs' (a Kokkos kernel on host backends, a vendor kernel on CUDA).
  std::vector<std::string> without_gemms() const {
    std::vector<std::string> out;
    for (const std::string& l : labels_)
      if (l.rfind("kmamba::gemm::", 0) != 0) out.push_back(l);
    return out;
  }

 private:
  static void begin(const char* name, std::uint32_t, std::uint64_t* id) {
    active_->labels_.emplace_back(name);
    *id = 0;
  }
  static inline KernelLabels* active_ = nullptr;
  Kokkos::Tools::Experimental::EventSet saved_;
  std::vector<std::string> labels_;
};

std::string joined(const std::vector<std::string>& labels) {
  std::string s;
  for (const std::string& l : labels) s += "\n  " + l;
  return s;
}

// One Mamba-2 block of the decode step, beyond its two projections: the fused residual add +
// norm and conv_ssd_step (with the gated norm; at tensor_parallel_size 1 the out_proj sum
// launches nothing). Measured as the kernels of a step of a 2-layer model minus those of a
// 1-layer one, and on the mixer's step alone.
TYPED_TEST(DecodeTest, Mamba2DecodeStepLaunchesTwoKernelsPerBlockBesidesTheProjections) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const Exec exec;
  const std::size_t batch = 2, prefix = 3;
  std::vector<std::vector<std::string>> steps;
  for (const int layers : {1, 2}) {
    kmamba::ModelConfig config = random_model_config(kmamba::MixerKind::Mamba2);
    config.n_layer = layers;
    config.validate();
    kmamba::LanguageModel<Exec> model(config);
    model.initialize(23);
    auto state = model.make_decode_state(static_cast<int>(batch));
    state.set_step_graph(false);  // a recording would not launch the kernels one by one
    kmamba::Tensor2<float, Mem> logits("kmamba::test::logits", batch, static_cast<std::size_t>(config.vocab_size));
    model.prefill(exec, to_device<kmamba::Tensor2<std::int64_t, Mem>>(random_ids(batch * prefix, 50, 5), batch, prefix),
                  state, logits);
    const auto ids = to_device<kmamba::Tensor1<std::int64_t, Mem>>(random_ids(batch, 50, 6), batch);
    exec.fence();
    std::vector<std::string> labels;
    {
      const KernelLabels counter;
      model.decode_step(exec, ids, state, logits);
      exec.fence();
      labels = counter.without_gemms();
    }
    steps.push_back(labels);
  }
  ASSERT_GE(steps[1].size(), steps[0].size()) << joined(steps[1]);
  const std::size_t per_block = steps[1].size() - steps[0].size();
  EXPECT_LE(per_block, 2u) << "kernels of a 2-layer step:" << joined(steps[1]);
  std::printf("[ decode   ] Mamba2 step, %s: %zu kernels per block besides the projections; 2-layer step:%s\n",
              Exec::name(), per_block, joined(steps[1]).c_str());

  const kmamba::ModelConfig config = small_mamba2_config(false, false);
  auto mixer = kmamba::make_mixer<Exec>(config, "backbone.layers.0.mixer.");
  kmamba::ParameterSlab<Mem> slab;
  mixer->declare_parameters(slab);
  slab.finalize("kmamba::test::decode_slab");
  mixer->initialize(exec, slab, 5);
  auto cache = mixer->make_cache(static_cast<int>(batch));
  const std::size_t dm = static_cast<std::size_t>(config.d_model);
  const auto u = to_device<kmamba::Tensor2<float, Mem>>(uniform_values(batch * dm, 19), batch, dm);
  kmamba::Tensor2<float, Mem> out("kmamba::test::step_out", batch, dm);
  exec.fence();
  std::vector<std::string> labels;
  {
    const KernelLabels counter;
    mixer->step(exec, slab, u, out, *cache);
    exec.fence();
    labels = counter.without_gemms();
  }
  EXPECT_EQ(labels, std::vector<std::string>{"kmamba::ssd::conv_step"}) << joined(labels);
}

// The logits of `steps` decode steps (no prefill) from a new state made under `made_under`, the
// model switched to BFloat16 before the steps; the labels of the last step's kernels into `labels`.
template <class Exec>
std::vector<float> bf16_step_logits(kmamba::LanguageModel<Exec>& model, kmamba::MatmulPrecision made_under,
                                    const std::vector<std::int64_t>& ids, std::size_t batch, std::size_t steps,
                                    std::vector<std::string>& labels) {
  using Mem = typename Exec::memory_space;
  const Exec exec;
  const std::size_t V = static_cast<std::size_t>(model.config().vocab_size);
  model.set_matmul_precision(made_under);
  auto state = model.make_decode_state(static_cast<int>(batch));
  state.set_step_graph(false);  // a recording would not launch the kernels one by one
  model.set_matmul_precision(kmamba::MatmulPrecision::BFloat16);
  kmamba::Tensor2<float, Mem> logits("kmamba::test::logits", batch, V);
  std::vector<float> all;
  for (std::size_t t = 0; t < steps; ++t) {
    const auto step_ids =
        to_device<kmamba::Tensor1<std::int64_t, Mem>>(positions(ids, batch, steps, 1, t, t + 1), batch);
    exec.fence();
    const KernelLabels counter;
    model.decode_step(exec, step_ids, state, logits);
    exec.fence();
    labels = counter.labels();
    const std::vector<float> step = to_vector(logits);
    all.insert(all.end(), step.begin(), step.end());
  }
  return all;
}

// Under BFloat16 a decode state made then multiplies the model's bf16 copy of the weights; one made
// under Float32 (no copy) rounds the fp32 weights in every product. Both form the products of the
// same rounded operands with fp32 sums: on host backends the same fp32 GEMM on the same operand
// values (equal logits), on CUDA two kernels summing in different orders (the recurrent tolerance).
// On hosts the labels show which path ran (on CUDA the GEMMs are vendor kernels, not Kokkos ones).
TYPED_TEST(DecodeTest, Bf16DecodeWeightsGiveThePerStepRoundedProducts) {
  using Exec = TypeParam;
  constexpr bool host = std::is_same<typename Exec::memory_space, Kokkos::HostSpace>::value;
  for_each_random_model<Exec>([&](kmamba::LanguageModel<Exec>& model) {
    const std::size_t batch = 2, steps = 5;
    const std::vector<std::int64_t> ids = random_ids(batch * steps, 50, 31);
    std::vector<std::string> copy_labels, rounding_labels;
    const std::vector<float> with_copy =
        bf16_step_logits(model, kmamba::MatmulPrecision::BFloat16, ids, batch, steps, copy_labels);
    const std::vector<float> rounding =
        bf16_step_logits(model, kmamba::MatmulPrecision::Float32, ids, batch, steps, rounding_labels);
    EXPECT_LE(max_relative_error(with_copy, rounding), host ? 0.0 : recurrent_tolerance);
    if (host) {
      const auto has = [](const std::vector<std::string>& labels, const std::string& label) {
        return std::find(labels.begin(), labels.end(), label) != labels.end();
      };
      EXPECT_TRUE(has(copy_labels, "kmamba::gemm::round_and_widen")) << joined(copy_labels);
      EXPECT_FALSE(has(copy_labels, "kmamba::gemm::round_operands")) << joined(copy_labels);
      EXPECT_TRUE(has(rounding_labels, "kmamba::gemm::round_operands")) << joined(rounding_labels);
    }
  });
}

// The bf16 copy follows the parameters at each prefill: a state made before the parameters changed
// gives, after its next prefill, the logits of a state made after the change.
TYPED_TEST(DecodeTest, Bf16DecodeWeightsFollowTheParametersAtPrefill) {
  using Exec = TypeParam;
  for_each_random_model<Exec>([&](kmamba::LanguageModel<Exec>& model) {
    const std::size_t batch = 2, seqlen = 9, prefix = 4;
    const std::vector<std::int64_t> ids = random_ids(batch * seqlen, 50, 37);
    model.set_matmul_precision(kmamba::MatmulPrecision::BFloat16);
    auto early = model.make_decode_state(static_cast<int>(batch));
    const auto params = model.parameters().params();
    const auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), params);
    for (std::size_t i = 0; i < host.extent(0); ++i) host(i) *= 1.25f;
    Kokkos::deep_copy(params, host);
    const std::vector<float> fresh = incremental_logits(model, ids, batch, seqlen, prefix);
    const std::vector<float> stale_state = incremental_logits_in(model, early, ids, batch, seqlen, prefix);
    EXPECT_EQ(max_relative_error(stale_state, fresh), 0.0);
  });
}

TYPED_TEST(DecodeTest, RejectsForeignStatesAndBadInputs) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  using Ids = kmamba::Tensor2<std::int64_t, Mem>;
  const Exec exec;
  auto a = random_model<Exec>(kmamba::MixerKind::Mamba2);
  auto b = random_model<Exec>(kmamba::MixerKind::Mamba2);
  auto state = a.make_decode_state(2);
  kmamba::Tensor2<float, Mem> logits("kmamba::test::logits", 2, 50);
  const Ids ids = to_device<Ids>(random_ids(8, 50, 1), 2, 4);
  EXPECT_THROW(b.prefill(exec, ids, state, logits), kmamba::UserError);
  EXPECT_THROW(a.prefill(exec, to_device<Ids>(random_ids(12, 50, 1), 3, 4), state, logits), kmamba::UserError);
  kmamba::Tensor2<float, Mem> wrong("kmamba::test::wrong", 2, 56);  // the padded vocabulary
  EXPECT_THROW(a.prefill(exec, ids, state, wrong), kmamba::UserError);
  EXPECT_THROW(a.prefill(exec, to_device<Ids>(std::vector<std::int64_t>{1, 2, 50, 3}, 2, 2), state, logits),
               kmamba::UserError);
  EXPECT_THROW(a.decode_step(exec, to_device<kmamba::Tensor1<std::int64_t, Mem>>(std::vector<std::int64_t>{1, -1}, 2),
                             state, logits),
               kmamba::UserError);
  EXPECT_THROW(a.make_decode_state(0), kmamba::UserError);
  const kmamba::TokenSampler out_of_range = [](const float*, int vocab, int, const std::vector<std::int64_t>&) {
    return static_cast<std::int64_t>(vocab);
  };
  EXPECT_THROW(kmamba::generate(exec, a, {{1, 2}}, out_of_range), kmamba::UserError);
  EXPECT_THROW(kmamba::generate(exec, a, {{1, 2}, {}}, out_of_range), kmamba::UserError);
  EXPECT_THROW(kmamba::generate(exec, a, state, {{1, 2}}, out_of_range), kmamba::UserError);  // batch 2 state
}

}  // namespace
