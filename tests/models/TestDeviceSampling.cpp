// DeviceSampler (docs/algorithms.md §5) against the host Sampler, the reference of every rule:
// - every combination of temperature (greedy included), top-k, top-p, min-p and repetition penalty
//   on random rows, rows with -inf and rows full of ties: the same kept set (exactly) and the same
//   probabilities (to 1e-9), and the same token for 40 draws per row, the rows' seen tokens growing
//   with each draw as the host history does;
// - a 50257-token vocabulary with k from 1 to the whole vocabulary;
// - crafted masks: top-k and top-p cutting through ties keep the lowest ids, min-p at its bound;
// - frequencies of 20000 draws within 5 sigma of the distribution; a seed reproduces every row
//   whatever its place in the batch, another seed does not;
// - errors: NaN, +inf, a row of -inf, bad sizes and shapes.
#include <kmamba/core/Error.hpp>
#include <kmamba/models/DeviceSampler.hpp>
#include <kmamba/models/Sampling.hpp>

#include "Backends.hpp"

#include <gtest/gtest.h>
#include <Kokkos_Core.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <set>
#include <vector>

namespace {

using Ids = std::vector<std::int64_t>;
using Rows = std::vector<std::vector<float>>;
constexpr float neg_inf = -std::numeric_limits<float>::infinity();

kmamba::SamplingConfig config_of(float temperature, int top_k = 0, float top_p = 1.0f, float min_p = 0.0f,
                                 float repetition_penalty = 1.0f, std::uint64_t seed = 7) {
  kmamba::SamplingConfig c;
  c.temperature = temperature;
  c.top_k = top_k;
  c.top_p = top_p;
  c.min_p = min_p;
  c.repetition_penalty = repetition_penalty;
  c.seed = seed;
  return c;
}

std::vector<float> random_row(std::size_t vocab, std::uint32_t seed, float scale) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> row(vocab);
  for (float& l : row) l = normal(rng);
  return row;
}

// The rows of the combination test (vocab 300): random; random with a third at -inf; values from
// {-1, 0, 0.5, 1, 2} (ties everywhere, negative ones for the penalty).
Rows test_rows() {
  Rows rows = {random_row(300, 1, 3.0f), random_row(300, 2, 1.0f), std::vector<float>(300)};
  for (std::size_t i = 0; i < 300; i += 3) rows[1][i] = neg_inf;
  const float levels[] = {-1.0f, 0.0f, 0.5f, 1.0f, 2.0f};
  for (std::size_t i = 0; i < 300; ++i) rows[2][i] = levels[(i * 7) % 5];
  return rows;
}

template <class Mem>
kmamba::Tensor2<float, Mem> device_rows(const Rows& rows) {
  const auto view = kmamba::allocate<kmamba::Tensor2<float, Mem>>("kmamba::test::logits", rows.size(), rows[0].size());
  const auto host = Kokkos::create_mirror_view(view);
  for (std::size_t r = 0; r < rows.size(); ++r) {
    for (std::size_t i = 0; i < rows[r].size(); ++i) host(r, i) = rows[r][i];
  }
  Kokkos::deep_copy(view, host);
  return view;
}

template <class Mem>
kmamba::Tensor1<std::int64_t, Mem> device_ids(const Ids& values) {
  const auto view = kmamba::allocate<kmamba::Tensor1<std::int64_t, Mem>>("kmamba::test::ids", values.size());
  const auto host = Kokkos::create_mirror_view(view);
  for (std::size_t i = 0; i < values.size(); ++i) host(i) = values[i];
  Kokkos::deep_copy(view, host);
  return view;
}

// The device distribution of every row.
template <class Exec>
std::vector<std::vector<double>> device_distribution(
    const kmamba::DeviceSampler<Exec>& sampler, const kmamba::Tensor2<float, typename Exec::memory_space>& logits) {
  using Mem = typename Exec::memory_space;
  const auto p = kmamba::allocate<kmamba::Tensor2<double, Mem>>("kmamba::test::p", logits.extent(0), sampler.vocab());
  sampler.distribution(Exec(), logits, p);
  const auto host = kmamba::test::to_host(p);
  std::vector<std::vector<double>> out(logits.extent(0), std::vector<double>(host.extent(1)));
  for (std::size_t r = 0; r < out.size(); ++r) {
    for (std::size_t i = 0; i < out[r].size(); ++i) out[r][i] = host(r, i);
  }
  return out;
}

std::set<std::int64_t> support(const std::vector<double>& p) {
  std::set<std::int64_t> out;
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (p[i] > 0.0) out.insert(static_cast<std::int64_t>(i));
  }
  return out;
}

// Distribution, then `draws` draws (sequence first_sequence + r, steps 0..draws-1) of the device
// sampler against the host Sampler; row r starts having seen `history[r]`.
template <class Exec>
void expect_same_as_host(const kmamba::SamplingConfig& config, const Rows& rows, std::vector<Ids> history, int draws,
                         std::uint64_t first_sequence = 3) {
  using Mem = typename Exec::memory_space;
  const Exec exec;
  const int batch = static_cast<int>(rows.size()), vocab = static_cast<int>(rows[0].size());
  const auto logits = device_rows<Mem>(rows);
  kmamba::DeviceSampler<Exec> sampler(config, batch, vocab);
  kmamba::Sampler host(config);
  std::size_t longest = 0;
  for (const Ids& h : history) longest = std::max(longest, h.size());
  const auto seen = kmamba::allocate<kmamba::Tensor2<std::int64_t, Mem>>("kmamba::test::seen", batch, longest);
  const auto host_seen = Kokkos::create_mirror_view(seen);
  for (int r = 0; r < batch; ++r) {
    for (std::size_t j = 0; j < longest; ++j) host_seen(r, j) = j < history[r].size() ? history[r][j] : -1;
  }
  Kokkos::deep_copy(seen, host_seen);
  sampler.reset(exec);
  sampler.observe(exec, seen);

  const std::vector<std::vector<double>> p = device_distribution(sampler, logits);
  for (int r = 0; r < batch; ++r) {
    std::vector<double> q;
    host.distribution(rows[r].data(), vocab, history[r].data(), history[r].size(), q);
    ASSERT_EQ(support(p[r]), support(q)) << "row " << r;
    for (int i = 0; i < vocab; ++i) ASSERT_NEAR(p[r][i], q[i], 1e-9) << "row " << r << " token " << i;
  }
  const auto steps = device_ids<Mem>(Ids(batch, 0));
  const auto ids = device_ids<Mem>(Ids(batch, -1));
  for (int step = 0; step < draws; ++step) {
    Kokkos::deep_copy(steps, std::int64_t(step));
    sampler.sample(exec, logits, steps, ids, first_sequence);
    const auto chosen = kmamba::test::to_host(ids);
    for (int r = 0; r < batch; ++r) {
      const std::int64_t expected =
          host.sample(rows[r].data(), vocab, history[r].data(), history[r].size(),
                      first_sequence + static_cast<std::uint64_t>(r), static_cast<std::uint64_t>(step));
      ASSERT_EQ(chosen(r), expected) << "row " << r << " step " << step;
      history[r].push_back(expected);
    }
  }
  sampler.check_errors("test");
}

}  // namespace

KMAMBA_BACKEND_TEST_SUITE(DeviceSamplingTest);

TYPED_TEST(DeviceSamplingTest, EveryCombinationMatchesTheHostSampler) {
  const Rows rows = test_rows();
  const std::vector<Ids> history = {{4, 4, 17, 250}, {}, {0, 1, 2, 3, 5, 8, 13}};
  for (const float temperature : {0.0f, 0.6f, 1.0f, 2.5f}) {
    for (const int top_k : {0, 1, 3, 40}) {
      for (const float top_p : {1.0f, 0.3f, 0.9f}) {
        for (const float min_p : {0.0f, 0.05f}) {
          for (const float penalty : {1.0f, 1.3f}) {
            SCOPED_TRACE(::testing::Message() << "temperature " << temperature << " top_k " << top_k << " top_p "
                                              << top_p << " min_p " << min_p << " penalty " << penalty);
            expect_same_as_host<TypeParam>(config_of(temperature, top_k, top_p, min_p, penalty), rows, history, 40);
            if (::testing::Test::HasFatalFailure()) return;
          }
        }
      }
    }
  }
}

TYPED_TEST(DeviceSamplingTest, LargeVocabularyAnyKMatchesTheHostSampler) {
  const Rows rows = {random_row(50257, 5, 4.0f), random_row(50257, 6, 0.5f)};
  for (const int top_k : {1, 2, 50, 1000, 50256, 50257}) {
    SCOPED_TRACE(::testing::Message() << "top_k " << top_k);
    expect_same_as_host<TypeParam>(config_of(1.0f, top_k, 0.95f, 0.0f, 1.2f), rows, {{7, 9}, {}}, 4);
  }
  expect_same_as_host<TypeParam>(config_of(0.8f, 0, 0.5f, 0.01f), rows, {{}, {}}, 4);
}

TYPED_TEST(DeviceSamplingTest, MasksCutThroughTiesAtTheLowestIds) {
  using Exec = TypeParam;
  const auto kept = [](const kmamba::SamplingConfig& config, const std::vector<float>& row) {
    kmamba::DeviceSampler<Exec> sampler(config, 1, static_cast<int>(row.size()));
    return support(device_distribution(sampler, device_rows<typename Exec::memory_space>({row}))[0]);
  };
  // Eight equal logits at ids 2, 4, ..., 16 of 20, one larger at 19, the rest -inf.
  std::vector<float> ties(20, neg_inf);
  for (int i = 2; i <= 16; i += 2) ties[static_cast<std::size_t>(i)] = 1.0f;
  ties[19] = 3.0f;
  EXPECT_EQ(kept(config_of(1.0f, 1), ties), std::set<std::int64_t>({19}));
  EXPECT_EQ(kept(config_of(0.0f), ties), std::set<std::int64_t>({19}));
  EXPECT_EQ(kept(config_of(1.0f, 4), ties), std::set<std::int64_t>({19, 2, 4, 6}));
  EXPECT_EQ(kept(config_of(1.0f, 9), ties), std::set<std::int64_t>({19, 2, 4, 6, 8, 10, 12, 14, 16}));
  EXPECT_EQ(kept(config_of(1.0f, 50), ties), std::set<std::int64_t>({19, 2, 4, 6, 8, 10, 12, 14, 16}));
  // Equal probabilities 1/8 (ids 0..7 of 10): top-p keeps a token while the mass before it is below
  // top_p — 0.3 keeps three, 0.25 two (the mass before the third is exactly 0.25), 1/8 one.
  std::vector<float> flat(10, neg_inf);
  for (std::size_t i = 0; i < 8; ++i) flat[i] = 0.0f;
  EXPECT_EQ(kept(config_of(1.0f, 0, 0.3f), flat), std::set<std::int64_t>({0, 1, 2}));
  EXPECT_EQ(kept(config_of(1.0f, 0, 0.25f), flat), std::set<std::int64_t>({0, 1}));
  EXPECT_EQ(kept(config_of(1.0f, 0, 0.125f), flat), std::set<std::int64_t>({0}));
  EXPECT_EQ(kept(config_of(1.0f, 3, 0.5f), flat), std::set<std::int64_t>({0, 1}));
  // Min-p around the bounds: probabilities relative to the best 1/4, 1, 1/2 (to float rounding).
  const std::vector<float> halves = {std::log(0.125f), std::log(0.5f), std::log(0.25f), neg_inf};
  EXPECT_EQ(kept(config_of(1.0f, 0, 1.0f, 0.249f), halves), std::set<std::int64_t>({0, 1, 2}));
  EXPECT_EQ(kept(config_of(1.0f, 0, 1.0f, 0.251f), halves), std::set<std::int64_t>({1, 2}));
  EXPECT_EQ(kept(config_of(1.0f, 0, 1.0f, 0.499f), halves), std::set<std::int64_t>({1, 2}));
  EXPECT_EQ(kept(config_of(1.0f, 0, 1.0f, 0.6f), halves), std::set<std::int64_t>({1}));
}

TYPED_TEST(DeviceSamplingTest, RepetitionPenaltyAppliesToSeenAndChosenTokens) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const Exec exec;
  // Greedy with penalty 4: the prompt's token 0 (logit 2 → 0.5) loses to token 2 (1.5); once chosen,
  // token 2 (→ 0.375) loses to token 0, which wins its tie with token 3 (0.5) by the lower id and,
  // penalised once only, keeps winning. The prompt's 9 is outside the vocabulary (skipped).
  const std::vector<float> row = {2.0f, -1.0f, 1.5f, 0.5f, 0.0f};
  kmamba::DeviceSampler<Exec> sampler(config_of(0.0f, 0, 1.0f, 0.0f, 4.0f), 1, 5);
  sampler.reset(exec);
  sampler.observe(exec, kmamba::Tensor2<const std::int64_t, Mem>(device_ids<Mem>({0, 0, -1, 9}).data(), 1, 4));
  const auto logits = device_rows<Mem>({row});
  const auto steps = device_ids<Mem>({0});
  const auto ids = device_ids<Mem>({-1});
  Ids chosen;
  for (int step = 0; step < 4; ++step) {
    sampler.sample(exec, logits, steps, ids);
    chosen.push_back(kmamba::test::to_host(ids)(0));
  }
  EXPECT_EQ(chosen, Ids({2, 0, 0, 0}));
  sampler.reset(exec);  // forgets everything seen
  sampler.sample(exec, logits, steps, ids);
  EXPECT_EQ(kmamba::test::to_host(ids)(0), 0);
}

TYPED_TEST(DeviceSamplingTest, FrequenciesMatchTheDistributionAndSeedsReproduce) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const Exec exec;
  const std::vector<float> row = {std::log(0.5f), std::log(0.2f), neg_inf, std::log(0.25f), std::log(0.05f)};
  const std::vector<double> p = {0.5, 0.2, 0.0, 0.25, 0.05};
  const int batch = 64, rounds = 313;  // 20032 draws
  const auto logits = device_rows<Mem>(Rows(batch, row));
  kmamba::DeviceSampler<Exec> sampler(config_of(1.0f, 0, 1.0f, 0.0f, 1.0f, 99), batch, 5);
  const auto steps = device_ids<Mem>(Ids(batch, 0));
  const auto ids = device_ids<Mem>(Ids(batch, 0));
  std::vector<double> counts(5, 0.0);
  std::vector<Ids> draws(batch);
  for (int step = 0; step < rounds; ++step) {
    Kokkos::deep_copy(steps, std::int64_t(step));
    sampler.sample(exec, logits, steps, ids);
    const auto host = kmamba::test::to_host(ids);
    for (int r = 0; r < batch; ++r) {
      counts[static_cast<std::size_t>(host(r))] += 1.0;
      draws[r].push_back(host(r));
    }
  }
  const double n = batch * rounds;
  for (std::size_t i = 0; i < 5; ++i) {
    EXPECT_LE(std::fabs(counts[i] - n * p[i]), 5.0 * std::sqrt(n * p[i] * (1.0 - p[i])) + 1e-9) << "token " << i;
  }
  // Row 5 alone, as sequence 5, at step 17: the same token; a row skipped (step -1) is untouched.
  kmamba::DeviceSampler<Exec> alone(config_of(1.0f, 0, 1.0f, 0.0f, 1.0f, 99), 2, 5);
  const auto two_steps = device_ids<Mem>({17, -1});
  const auto two_ids = device_ids<Mem>({-1, -5});
  alone.sample(exec, device_rows<Mem>(Rows(2, row)), two_steps, two_ids, 5);
  EXPECT_EQ(kmamba::test::to_host(two_ids)(0), draws[5][17]);
  EXPECT_EQ(kmamba::test::to_host(two_ids)(1), -5);
  // Another seed changes the draws.
  kmamba::DeviceSampler<Exec> other(config_of(1.0f, 0, 1.0f, 0.0f, 1.0f, 100), batch, 5);
  Kokkos::deep_copy(steps, std::int64_t(0));
  other.sample(exec, logits, steps, ids);
  const auto host = kmamba::test::to_host(ids);
  int same = 0;
  for (int r = 0; r < batch; ++r) same += host(r) == draws[r][0] ? 1 : 0;
  EXPECT_LT(same, batch);
}

TYPED_TEST(DeviceSamplingTest, BadLogitsAndShapesAreErrors) {
  using Exec = TypeParam;
  using Mem = typename Exec::memory_space;
  const Exec exec;
  EXPECT_THROW(kmamba::DeviceSampler<Exec>(config_of(-1.0f), 1, 4), kmamba::UserError);
  EXPECT_THROW(kmamba::DeviceSampler<Exec>(config_of(1.0f), 0, 4), kmamba::UserError);
  EXPECT_THROW(kmamba::DeviceSampler<Exec>(config_of(1.0f), 1, (1 << 21) + 1), kmamba::UserError);
  kmamba::DeviceSampler<Exec> sampler(config_of(1.0f), 2, 4);
  const auto steps = device_ids<Mem>({0, 0});
  const auto ids = device_ids<Mem>({0, 0});
  EXPECT_THROW(sampler.sample(exec, device_rows<Mem>({{1, 2, 3}, {1, 2, 3}}), steps, ids), kmamba::UserError);
  EXPECT_THROW(sampler.sample(exec, device_rows<Mem>({{1, 2, 3, 4}}), steps, ids), kmamba::UserError);
  EXPECT_THROW(sampler.sample(exec, device_rows<Mem>({{1, 2, 3, 4}, {1, 2, 3, 4}}), device_ids<Mem>({0}), ids),
               kmamba::UserError);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (const std::vector<float>& bad : {std::vector<float>{1, nan, 0, 0}, std::vector<float>{1, 0, inf, 0},
                                        std::vector<float>{neg_inf, neg_inf, neg_inf, neg_inf}}) {
    sampler.reset(exec);
    sampler.sample(exec, device_rows<Mem>({{1, 2, 3, 4}, bad}), steps, ids);
    EXPECT_THROW(sampler.check_errors("test"), kmamba::UserError);
    EXPECT_EQ(kmamba::test::to_host(ids)(1), 0);
  }
  sampler.reset(exec);  // clears the error
  EXPECT_NO_THROW(sampler.check_errors("test"));
}
