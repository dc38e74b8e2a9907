// Sampling: greedy, temperature, top-k, top-p, min-p, repetition penalty, seeded reproducibility,
// and stop criteria (docs/algorithms.md §5).
#include <kmamba/core/Error.hpp>
#include <kmamba/models/Sampling.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <string>
#include <utility>
#include <vector>

namespace {

using Ids = std::vector<std::int64_t>;
constexpr float neg_inf = -std::numeric_limits<float>::infinity();

kmamba::Sampler make(float temperature, int top_k = 0, float top_p = 1.0f, float min_p = 0.0f,
                     float repetition_penalty = 1.0f, std::uint64_t seed = 7) {
  kmamba::SamplingConfig config;
  config.temperature = temperature;
  config.top_k = top_k;
  config.top_p = top_p;
  config.min_p = min_p;
  config.repetition_penalty = repetition_penalty;
  config.seed = seed;
  return kmamba::Sampler(config);
}

std::vector<float> random_logits(std::size_t vocab, std::uint32_t seed, float scale = 3.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> logits(vocab);
  for (float& l : logits) l = normal(rng);
  return logits;
}

// Logits whose softmax is `probabilities` placed at `ids` of a vocabulary of `vocab` tokens; the
// other tokens get -inf.
std::vector<float> logits_for(std::size_t vocab, const Ids& ids, const std::vector<double>& probabilities) {
  std::vector<float> logits(vocab, neg_inf);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    logits[static_cast<std::size_t>(ids[i])] = static_cast<float>(std::log(probabilities[i]));
  }
  return logits;
}

std::size_t argmax(const std::vector<float>& logits) {
  return static_cast<std::size_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
}

// Counts of `draws` samples (sequence 0, steps 0..draws-1).
std::vector<std::int64_t> histogram(kmamba::Sampler& sampler, const std::vector<float>& logits, int draws,
                                    const Ids& history = {}) {
  std::vector<std::int64_t> counts(logits.size(), 0);
  for (int step = 0; step < draws; ++step) {
    ++counts[static_cast<std::size_t>(sampler.sample(logits, history, 0, static_cast<std::uint64_t>(step)))];
  }
  return counts;
}

// Every count within 5 standard deviations of draws * p (binomial), tokens with p = 0 never drawn.
void expect_frequencies(const std::vector<std::int64_t>& counts, const std::vector<double>& p, int draws) {
  ASSERT_EQ(counts.size(), p.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    const double expected = draws * p[i];
    const double sigma = std::sqrt(draws * p[i] * (1.0 - p[i]));
    EXPECT_LE(std::fabs(static_cast<double>(counts[i]) - expected), 5.0 * sigma + 1e-9)
        << "token " << i << ": " << counts[i] << " draws, expected " << expected;
  }
}

std::vector<double> softmax(const std::vector<float>& logits, double temperature = 1.0) {
  const double m = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double total = 0.0;
  for (std::size_t i = 0; i < p.size(); ++i) total += p[i] = std::exp((logits[i] - m) / temperature);
  for (double& v : p) v /= total;
  return p;
}

std::set<std::int64_t> support(const std::vector<double>& p) {
  std::set<std::int64_t> out;
  for (std::size_t i = 0; i < p.size(); ++i) {
    if (p[i] > 0.0) out.insert(static_cast<std::int64_t>(i));
  }
  return out;
}

// ---- configuration ----

TEST(Sampling, ConfigValidationNamesTheField) {
  const auto expect_error = [](kmamba::SamplingConfig config, const std::string& field) {
    try {
      kmamba::Sampler sampler(config);
      FAIL() << "no error for " << field;
    } catch (const kmamba::UserError& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  };
  // Each case sets one field of the defaults out of its range.
  const std::vector<std::pair<std::function<void(kmamba::SamplingConfig&)>, std::string>> cases = {
      {[](kmamba::SamplingConfig& c) { c.temperature = -0.5f; }, "temperature"},
      {[](kmamba::SamplingConfig& c) { c.temperature = std::numeric_limits<float>::quiet_NaN(); }, "temperature"},
      {[](kmamba::SamplingConfig& c) { c.top_k = -1; }, "top_k"},
      {[](kmamba::SamplingConfig& c) { c.top_p = 1.5f; }, "top_p"},
      {[](kmamba::SamplingConfig& c) { c.min_p = -0.1f; }, "min_p"},
      {[](kmamba::SamplingConfig& c) { c.repetition_penalty = 0.0f; }, "repetition_penalty"},
  };
  for (const auto& [set, field] : cases) {
    kmamba::SamplingConfig c;
    set(c);
    expect_error(c, field);
  }
  EXPECT_NO_THROW(kmamba::Sampler(kmamba::SamplingConfig{}));
}

TEST(Sampling, BadLogitsAndHistoryAreErrors) {
  kmamba::Sampler sampler = make(1.0f);
  std::vector<float> logits = {0.0f, 1.0f, std::numeric_limits<float>::quiet_NaN()};
  EXPECT_THROW(sampler.sample(logits, {}, 0, 0), kmamba::UserError);
  logits[2] = std::numeric_limits<float>::infinity();
  EXPECT_THROW(sampler.sample(logits, {}, 0, 0), kmamba::UserError);
  EXPECT_THROW(sampler.sample(std::vector<float>(4, neg_inf), {}, 0, 0), kmamba::UserError);
  EXPECT_THROW(sampler.sample(std::vector<float>{}, {}, 0, 0), kmamba::UserError);
  kmamba::Sampler penalised = make(1.0f, 0, 1.0f, 0.0f, 1.3f);
  EXPECT_THROW(penalised.sample({0.0f, 1.0f}, {0, 2}, 0, 0), kmamba::UserError);
}

// ---- greedy and determinism ----

TEST(Sampling, GreedyIsTheArgmaxWhateverTheSeed) {
  for (std::uint32_t row = 0; row < 50; ++row) {
    const std::vector<float> logits = random_logits(1000, row);
    const auto best = static_cast<std::int64_t>(argmax(logits));
    for (std::uint64_t seed : {0u, 1u, 99u}) {
      kmamba::Sampler zero_temperature = make(0.0f, 0, 0.9f, 0.05f, 1.0f, seed);
      kmamba::Sampler top1 = make(0.7f, 1, 1.0f, 0.0f, 1.0f, seed);
      for (std::uint64_t step = 0; step < 5; ++step) {
        EXPECT_EQ(zero_temperature.sample(logits, {}, row, step), best);
        EXPECT_EQ(top1.sample(logits, {}, row, step), best);
      }
    }
  }
  // Ties go to the lowest id; the distribution is one-hot.
  kmamba::Sampler greedy = make(0.0f);
  const std::vector<float> tied = {1.0f, 3.0f, -2.0f, 3.0f, 3.0f};
  EXPECT_EQ(greedy.sample(tied, {}, 0, 0), 1);
  std::vector<double> p;
  greedy.distribution(tied.data(), 5, nullptr, 0, p);
  EXPECT_EQ(p, std::vector<double>({0.0, 1.0, 0.0, 0.0, 0.0}));
}

TEST(Sampling, SeededSamplingIsReproducibleAndIndependentOfBatchOrder) {
  const int sequences = 8, steps = 64;
  std::vector<std::vector<float>> rows;
  for (int s = 0; s < sequences; ++s) rows.push_back(random_logits(300, 100 + static_cast<std::uint32_t>(s), 1.0f));
  const auto run = [&](std::uint64_t seed, bool reversed) {
    kmamba::Sampler sampler = make(1.0f, 0, 0.95f, 0.0f, 1.0f, seed);
    std::vector<Ids> out(sequences, Ids(steps));
    for (int step = 0; step < steps; ++step) {
      for (int k = 0; k < sequences; ++k) {
        const int s = reversed ? sequences - 1 - k : k;
        out[static_cast<std::size_t>(s)][static_cast<std::size_t>(step)] = sampler.sample(
            rows[static_cast<std::size_t>(s)], {}, static_cast<std::uint64_t>(s), static_cast<std::uint64_t>(step));
      }
    }
    return out;
  };
  const std::vector<Ids> a = run(42, false);
  EXPECT_EQ(run(42, false), a);
  EXPECT_EQ(run(42, true), a);  // batch order does not matter
  const std::vector<Ids> b = run(43, false);
  for (int s = 0; s < sequences; ++s) {
    EXPECT_NE(a[static_cast<std::size_t>(s)], b[static_cast<std::size_t>(s)]) << "sequence " << s;
  }
  // Two sequences with the same logits draw different streams.
  kmamba::Sampler sampler = make(1.0f, 0, 1.0f, 0.0f, 1.0f, 42);
  Ids first, second;
  for (std::uint64_t step = 0; step < steps; ++step) {
    first.push_back(sampler.sample(rows[0], {}, 0, step));
    second.push_back(sampler.sample(rows[0], {}, 1, step));
  }
  EXPECT_NE(first, second);
}

TEST(Sampling, UniformStreamIsInTheUnitIntervalAndUnbiased) {
  double sum = 0.0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    const double u = kmamba::sampling_uniform(5, static_cast<std::uint64_t>(i % 7), static_cast<std::uint64_t>(i));
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
  }
  EXPECT_NEAR(sum / n, 0.5, 5.0 * std::sqrt(1.0 / 12.0 / n));
  EXPECT_NE(kmamba::sampling_uniform(1, 0, 0), kmamba::sampling_uniform(2, 0, 0));
  EXPECT_NE(kmamba::sampling_uniform(1, 0, 0), kmamba::sampling_uniform(1, 1, 0));
  EXPECT_NE(kmamba::sampling_uniform(1, 0, 0), kmamba::sampling_uniform(1, 0, 1));
}

// ---- plain sampling and temperature ----

TEST(Sampling, FrequenciesMatchTheSoftmax) {
  const std::vector<float> logits = {1.0f, 0.5f, -0.3f, 2.0f, 0.0f, -1.5f, 1.2f, 0.8f, -0.7f, 0.3f};
  const int draws = 200000;
  for (const float temperature : {1.0f, 0.5f, 2.0f}) {
    kmamba::Sampler sampler = make(temperature, 0, 1.0f, 0.0f, 1.0f, 11);
    const std::vector<double> p = softmax(logits, temperature);
    std::vector<double> q;
    sampler.distribution(logits.data(), 10, nullptr, 0, q);
    for (std::size_t i = 0; i < p.size(); ++i) EXPECT_NEAR(q[i], p[i], 1e-6);
    expect_frequencies(histogram(sampler, logits, draws), p, draws);
  }
}

TEST(Sampling, NegativeInfinityLogitsAreNeverSampled) {
  const std::vector<float> logits = {neg_inf, 0.0f, neg_inf, 0.0f, neg_inf};
  kmamba::Sampler sampler = make(1.0f);
  const std::vector<std::int64_t> counts = histogram(sampler, logits, 20000);
  EXPECT_EQ(counts[0] + counts[2] + counts[4], 0);
  expect_frequencies(counts, {0.0, 0.5, 0.0, 0.5, 0.0}, 20000);
}

TEST(Sampling, TemperatureTowardsZeroIsGreedyAndLargeIsUniform) {
  std::vector<float> logits = random_logits(500, 3);
  const auto best = static_cast<std::int64_t>(argmax(logits));
  logits[static_cast<std::size_t>(best)] += 0.5f;  // a margin of 0.5 over the runner-up at least
  for (const float temperature : {1e-2f, 1e-4f, 1e-20f}) {
    kmamba::Sampler cold = make(temperature);
    std::vector<double> p;
    cold.distribution(logits.data(), 500, nullptr, 0, p);
    EXPECT_GT(p[static_cast<std::size_t>(best)], 1.0 - 1e-12) << "temperature " << temperature;
    for (std::uint64_t step = 0; step < 200; ++step) EXPECT_EQ(cold.sample(logits, {}, 0, step), best);
  }
  // A temperature so small that the scaled logits overflow still gives the arg-max.
  kmamba::Sampler denormal = make(std::numeric_limits<float>::denorm_min());
  EXPECT_EQ(denormal.sample({1e38f, 3e38f, -3e38f}, {}, 0, 0), 1);
  kmamba::Sampler hot = make(1e4f);
  std::vector<double> p;
  hot.distribution(logits.data(), 500, nullptr, 0, p);
  const auto range = std::minmax_element(p.begin(), p.end());
  EXPECT_LT(*range.second / *range.first, 1.01);
}

// ---- filters: never outside the allowed set ----

TEST(Sampling, TopKNeverSamplesOutsideTheKLargest) {
  const std::vector<float> logits = random_logits(200, 5, 1.0f);
  std::vector<std::int64_t> order(200);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    return logits[static_cast<std::size_t>(a)] > logits[static_cast<std::size_t>(b)];
  });
  for (const int k : {2, 5, 17}) {
    const std::set<std::int64_t> allowed(order.begin(), order.begin() + k);
    kmamba::Sampler sampler = make(1.3f, k);
    std::vector<double> p;
    sampler.distribution(logits.data(), 200, nullptr, 0, p);
    EXPECT_EQ(support(p), allowed);
    const int draws = 20000;
    const std::vector<std::int64_t> counts = histogram(sampler, logits, draws);
    for (std::size_t i = 0; i < counts.size(); ++i) {
      if (allowed.count(static_cast<std::int64_t>(i)) == 0) {
        EXPECT_EQ(counts[i], 0) << "token " << i << " is not among the top " << k;
      } else {
        EXPECT_GT(counts[i], 0);
      }
    }
    // Within the k kept: the softmax of their logits over the temperature.
    std::vector<float> kept(200, neg_inf);
    for (const std::int64_t id : allowed) kept[static_cast<std::size_t>(id)] = logits[static_cast<std::size_t>(id)];
    expect_frequencies(counts, softmax(kept, 1.3), draws);
  }
}

TEST(Sampling, TopKIsExactForTiedAndWidelySpreadLogits) {
  // Ties at the boundary go to the lower ids.
  kmamba::Sampler two = make(1.0f, 2);
  std::vector<double> p;
  const std::vector<float> tied = {1.0f, 2.0f, 2.0f, 2.0f, 0.0f};
  two.distribution(tied.data(), 5, nullptr, 0, p);
  EXPECT_EQ(support(p), std::set<std::int64_t>({1, 2}));
  // k beyond the finite logits keeps them all.
  kmamba::Sampler many = make(1.0f, 10);
  const std::vector<float> few = {neg_inf, 0.5f, neg_inf, 0.0f};
  many.distribution(few.data(), 4, nullptr, 0, p);
  EXPECT_EQ(support(p), std::set<std::int64_t>({1, 3}));
  // Logits spread over hundreds of units (far beyond the sampler's binning range).
  const std::vector<float> wide = random_logits(5000, 29, 100.0f);
  std::vector<std::int64_t> order(wide.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    return wide[static_cast<std::size_t>(a)] > wide[static_cast<std::size_t>(b)];
  });
  for (const int k : {2, 50, 4000}) {
    kmamba::Sampler sampler = make(50.0f, k);
    sampler.distribution(wide.data(), 5000, nullptr, 0, p);
    EXPECT_EQ(support(p), std::set<std::int64_t>(order.begin(), order.begin() + k)) << "k " << k;
  }
}

TEST(Sampling, TopPKeepsTheSmallestSetReachingTheMass) {
  // Probabilities 0.4, 0.3, 0.15, 0.1, 0.05 at scattered ids of a 16-token vocabulary.
  const Ids ids = {7, 3, 11, 0, 5};
  const std::vector<double> probabilities = {0.4, 0.3, 0.15, 0.1, 0.05};
  const std::vector<float> logits = logits_for(16, ids, probabilities);
  struct Case {
    float top_p;
    std::size_t keep;
  };
  // Mass before each token in decreasing order: 0, 0.4, 0.7, 0.85, 0.95.
  for (const Case c : {Case{0.3f, 1}, Case{0.65f, 2}, Case{0.75f, 3}, Case{0.9f, 4}, Case{0.99f, 5}}) {
    kmamba::Sampler sampler = make(1.0f, 0, c.top_p);
    const std::set<std::int64_t> allowed(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(c.keep));
    std::vector<double> p;
    sampler.distribution(logits.data(), 16, nullptr, 0, p);
    EXPECT_EQ(support(p), allowed) << "top_p " << c.top_p;
    const int draws = 20000;
    const std::vector<std::int64_t> counts = histogram(sampler, logits, draws);
    double kept_mass = 0.0;
    for (std::size_t i = 0; i < c.keep; ++i) kept_mass += probabilities[i];
    std::vector<double> expected(16, 0.0);
    for (std::size_t i = 0; i < c.keep; ++i) expected[static_cast<std::size_t>(ids[i])] = probabilities[i] / kept_mass;
    expect_frequencies(counts, expected, draws);
  }
  // 0 and 1 switch top-p off (the reference's convention).
  for (const float off : {0.0f, 1.0f}) {
    kmamba::Sampler sampler = make(1.0f, 0, off);
    std::vector<double> p;
    sampler.distribution(logits.data(), 16, nullptr, 0, p);
    EXPECT_EQ(support(p).size(), 5u);
  }
}

TEST(Sampling, TopPOnALargeVocabularyMatchesAFullSort) {
  const std::size_t vocab = 50280;
  const std::vector<float> logits = random_logits(vocab, 17, 2.0f);
  for (const float top_p : {0.1f, 0.5f, 0.9f, 0.999f}) {
    // Reference: sort everything, keep while the mass before a token is below top_p.
    const std::vector<double> p = softmax(logits, static_cast<double>(0.8f));
    std::vector<std::int64_t> order(vocab);
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
      return p[static_cast<std::size_t>(a)] > p[static_cast<std::size_t>(b)];
    });
    std::set<std::int64_t> allowed;
    double mass = 0.0;
    for (const std::int64_t id : order) {
      if (mass >= top_p) break;
      allowed.insert(id);
      mass += p[static_cast<std::size_t>(id)];
    }
    kmamba::Sampler sampler = make(0.8f, 0, top_p);
    std::vector<double> q;
    sampler.distribution(logits.data(), static_cast<std::int64_t>(vocab), nullptr, 0, q);
    EXPECT_EQ(support(q), allowed) << "top_p " << top_p;
    for (std::uint64_t step = 0; step < 200; ++step) {
      ASSERT_EQ(allowed.count(sampler.sample(logits, {}, 3, step)), 1u);
    }
  }
}

TEST(Sampling, MinPKeepsTokensAboveAFractionOfTheBest) {
  const Ids ids = {2, 9, 4, 0, 6, 1};
  const std::vector<double> probabilities = {0.5, 0.2, 0.12, 0.08, 0.06, 0.04};
  const std::vector<float> logits = logits_for(12, ids, probabilities);
  struct Case {
    float min_p;
    std::size_t keep;
  };
  // Ratios to the best: 1, 0.4, 0.24, 0.16, 0.12, 0.08.
  for (const Case c : {Case{0.5f, 1}, Case{0.3f, 2}, Case{0.2f, 3}, Case{0.1f, 5}, Case{0.05f, 6}}) {
    kmamba::Sampler sampler = make(1.0f, 0, 1.0f, c.min_p);
    const std::set<std::int64_t> allowed(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(c.keep));
    std::vector<double> p;
    sampler.distribution(logits.data(), 12, nullptr, 0, p);
    EXPECT_EQ(support(p), allowed) << "min_p " << c.min_p;
    const std::vector<std::int64_t> counts = histogram(sampler, logits, 10000);
    for (std::size_t i = 0; i < counts.size(); ++i) {
      if (allowed.count(static_cast<std::int64_t>(i)) == 0) {
        EXPECT_EQ(counts[i], 0) << "min_p " << c.min_p;
      }
    }
  }
  // min-p is judged after the temperature: at T = 0.5 the ratios square (0.16 for id 9 -> kept at
  // 0.15, 0.0576 for id 4 -> dropped).
  kmamba::Sampler cold = make(0.5f, 0, 1.0f, 0.15f);
  std::vector<double> p;
  cold.distribution(logits.data(), 12, nullptr, 0, p);
  EXPECT_EQ(support(p), std::set<std::int64_t>({2, 9}));
}

TEST(Sampling, CombinedFiltersKeepOnlyWhatEveryFilterKeeps) {
  const std::vector<float> logits = random_logits(1000, 23, 1.5f);
  const int top_k = 40;
  const float temperature = 0.9f, top_p = 0.8f, min_p = 0.02f;
  // Independent reference: top-k by logit, then softmax at the temperature over those, then the
  // top-p set and the min-p set of that distribution, intersected.
  std::vector<std::int64_t> order(1000);
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    return logits[static_cast<std::size_t>(a)] > logits[static_cast<std::size_t>(b)];
  });
  std::vector<float> top(1000, neg_inf);
  for (int i = 0; i < top_k; ++i) {
    const auto id = static_cast<std::size_t>(order[static_cast<std::size_t>(i)]);
    top[id] = logits[id];
  }
  const std::vector<double> p = softmax(top, temperature);
  const double p_max = p[static_cast<std::size_t>(order[0])];
  std::set<std::int64_t> allowed;
  double mass = 0.0;
  for (int i = 0; i < top_k; ++i) {
    const std::int64_t id = order[static_cast<std::size_t>(i)];
    if (mass >= top_p) break;
    mass += p[static_cast<std::size_t>(id)];
    if (p[static_cast<std::size_t>(id)] >= min_p * p_max) allowed.insert(id);
  }
  ASSERT_GT(allowed.size(), 3u);
  kmamba::Sampler sampler = make(temperature, top_k, top_p, min_p);
  std::vector<double> q;
  sampler.distribution(logits.data(), 1000, nullptr, 0, q);
  EXPECT_EQ(support(q), allowed);
  for (std::uint64_t step = 0; step < 5000; ++step) ASSERT_EQ(allowed.count(sampler.sample(logits, {}, 9, step)), 1u);
}

// ---- repetition penalty ----

TEST(Sampling, RepetitionPenaltyDividesPositiveAndMultipliesNegativeLogitsOnce) {
  const std::vector<float> logits = {2.0f, -1.0f, 1.5f, 0.5f, 0.0f};
  kmamba::Sampler sampler = make(1.0f, 0, 1.0f, 0.0f, 2.0f);
  std::vector<double> p;
  // Token 0 twice (penalised once), token 1, token 4 (logit 0 stays 0).
  const Ids history = {0, 1, 0, 4};
  sampler.distribution(logits.data(), 5, history.data(), history.size(), p);
  const std::vector<double> expected = softmax({1.0f, -2.0f, 1.5f, 0.5f, 0.0f});
  for (std::size_t i = 0; i < 5; ++i) EXPECT_NEAR(p[i], expected[i], 1e-9) << "token " << i;
  // Greedy sees the penalised logits: 0 was the arg-max, 2 is now.
  kmamba::Sampler greedy = make(0.0f, 0, 1.0f, 0.0f, 2.0f);
  EXPECT_EQ(greedy.sample(logits, {}, 0, 0), 0);
  EXPECT_EQ(greedy.sample(logits, {0}, 0, 0), 2);
  // A penalty below 1 favours repeats; a penalty of 1 changes nothing.
  kmamba::Sampler favour = make(0.0f, 0, 1.0f, 0.0f, 0.5f);
  EXPECT_EQ(favour.sample(logits, {2}, 0, 0), 2);
  kmamba::Sampler neutral = make(1.0f);
  neutral.distribution(logits.data(), 5, history.data(), history.size(), p);
  const std::vector<double> plain = softmax(logits);
  for (std::size_t i = 0; i < 5; ++i) EXPECT_NEAR(p[i], plain[i], 1e-12);
  // The penalised distribution is what is sampled.
  const int draws = 100000;
  std::vector<std::int64_t> counts(5, 0);
  for (int step = 0; step < draws; ++step) {
    ++counts[static_cast<std::size_t>(sampler.sample(logits, history, 0, static_cast<std::uint64_t>(step)))];
  }
  expect_frequencies(counts, expected, draws);
}

// ---- stop criteria ----

TEST(StopCriteria, StopTokensAndMaxNewTokens) {
  kmamba::StopCriteria stop;
  stop.stop_tokens = {0, 50};
  stop.max_new_tokens = 3;
  EXPECT_EQ(stop.check(0, -1), kmamba::StopReason::None);
  EXPECT_EQ(stop.check(0, 0), kmamba::StopReason::None);  // nothing generated yet: no last token
  EXPECT_EQ(stop.check(1, 7), kmamba::StopReason::None);
  EXPECT_EQ(stop.check(2, 50), kmamba::StopReason::StopToken);
  EXPECT_EQ(stop.check(3, 7), kmamba::StopReason::MaxNewTokens);
  EXPECT_EQ(stop.check(3, 0), kmamba::StopReason::StopToken);  // the stop token takes precedence
  kmamba::StopCriteria none;
  EXPECT_EQ(none.check(1000000, 5), kmamba::StopReason::None);
  none.max_new_tokens = 0;
  EXPECT_EQ(none.check(0, -1), kmamba::StopReason::MaxNewTokens);
}

}  // namespace
