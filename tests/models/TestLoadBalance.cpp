// Load balancing by real tokens (kmamba/models/LoadBalance.hpp): the dealing of a global batch's
// rows to data-parallel ranks and the balanced sequence-parallel segments, on random counts.
//
// The bounds are exact integer statements, so there is no tolerance:
// - rows: with threshold 0 every rank holds at most mean + the largest row (the longest-first
//   dealing gives its last row to the lightest rank, which held at most the mean; the fixed shares
//   are kept only when they are no busier), never more than the busiest fixed share, and at least
//   one row; a threshold t keeps the fixed shares whenever the busiest holds at most (1 + t)·mean;
// - segments: each holds at most total/size + the largest position count, covers its part of
//   [0, seqlen) contiguously and is never empty.
// Each random sweep draws from a fixed seed and from a fresh one, printed on failure.
#include <kmamba/models/LoadBalance.hpp>

#include "Checks.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

namespace {

using kmamba::RowAssignment;
using kmamba::SequenceSegment;
using kmamba::test::expect_user_error;
using Counts = std::vector<std::int64_t>;

std::int64_t total_of(const Counts& v) { return std::accumulate(v.begin(), v.end(), std::int64_t{0}); }
std::int64_t max_of(const Counts& v) { return *std::max_element(v.begin(), v.end()); }

// Row lengths of three kinds: uniform, mostly padding with a few full rows, and equal.
Counts random_counts(std::mt19937_64& random, std::int64_t n, std::int64_t seqlen) {
  Counts counts(static_cast<std::size_t>(n));
  const int kind = static_cast<int>(random() % 3);
  for (auto& c : counts) {
    const std::int64_t draw = static_cast<std::int64_t>(random() % static_cast<std::uint64_t>(seqlen + 1));
    c = kind == 0 ? draw : kind == 1 ? (random() % 4 == 0 ? seqlen : draw / 8) : seqlen / 2;
  }
  return counts;
}

// Every row exactly once, ascending per rank, at least one per rank, and the token sums.
void expect_partition(const RowAssignment& a, const Counts& rows, int ranks) {
  ASSERT_EQ(a.rows.size(), static_cast<std::size_t>(ranks));
  ASSERT_EQ(a.tokens.size(), static_cast<std::size_t>(ranks));
  std::vector<int> seen(rows.size(), 0);
  for (int r = 0; r < ranks; ++r) {
    const auto& mine = a.rows[static_cast<std::size_t>(r)];
    EXPECT_FALSE(mine.empty()) << "rank " << r;
    EXPECT_TRUE(std::is_sorted(mine.begin(), mine.end())) << "rank " << r;
    std::int64_t sum = 0;
    for (const std::int64_t row : mine) {
      ++seen[static_cast<std::size_t>(row)];
      sum += rows[static_cast<std::size_t>(row)];
    }
    EXPECT_EQ(sum, a.tokens[static_cast<std::size_t>(r)]) << "rank " << r;
  }
  EXPECT_TRUE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
}

void check_random_rows(std::uint64_t seed) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 random(seed);
  for (int trial = 0; trial < 300; ++trial) {
    const int ranks = 1 + static_cast<int>(random() % 9);
    const std::int64_t rows = ranks * (1 + static_cast<std::int64_t>(random() % 12)) + (trial % 2 == 0 ? 0 : trial % 5);
    const Counts counts = random_counts(random, rows, 64);
    const double threshold = trial % 3 == 0 ? 0.0 : static_cast<double>(random() % 50) / 100.0;
    const RowAssignment a = kmamba::balance_rows(counts, ranks, threshold);
    const RowAssignment fixed = kmamba::fixed_row_shares(counts, ranks);
    expect_partition(a, counts, ranks);
    EXPECT_EQ(a.fixed_share_tokens, fixed.tokens);
    EXPECT_EQ(a.moved, a.rows != fixed.rows);
    EXPECT_LE(max_of(a.tokens), max_of(fixed.tokens));
    const std::int64_t total = total_of(counts);
    if (threshold == 0.0) {
      EXPECT_LE(max_of(a.tokens) * ranks, total + ranks * max_of(counts)) << "trial " << trial;
    }
    if (static_cast<double>(max_of(fixed.tokens)) * ranks <= (1.0 + threshold) * static_cast<double>(total)) {
      EXPECT_FALSE(a.moved) << "trial " << trial << ": moved although the fixed shares are within the threshold";
    }
    const RowAssignment again = kmamba::balance_rows(counts, ranks, threshold);
    EXPECT_EQ(again.rows, a.rows);
    EXPECT_EQ(again.tokens, a.tokens);
  }
}

TEST(LoadBalance, RealTokensAreThePositionsWithATarget) {
  kmamba::TokenBatch b;
  b.ids = kmamba::Tensor2<std::int64_t, Kokkos::HostSpace>("ids", 2, 4);
  b.targets = kmamba::Tensor2<std::int64_t, Kokkos::HostSpace>("targets", 2, 4);
  const std::int64_t targets[2][4] = {{5, kmamba::ignore_index, 7, 1},
                                      {kmamba::ignore_index, kmamba::ignore_index, 3, 0}};
  for (int r = 0; r < 2; ++r) {
    for (int t = 0; t < 4; ++t) b.targets(r, t) = targets[r][t];
  }
  EXPECT_EQ(kmamba::real_tokens_per_row(b), (Counts{3, 2}));
  EXPECT_EQ(kmamba::real_tokens_per_position(b), (Counts{1, 0, 2, 2}));
  EXPECT_EQ(total_of(kmamba::real_tokens_per_row(b)), b.predicted_tokens());
}

TEST(LoadBalance, FixedSharesAreContiguousBlocks) {
  const Counts counts = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
  const RowAssignment a = kmamba::fixed_row_shares(counts, 4);
  EXPECT_EQ(a.rows, (std::vector<Counts>{{0, 1, 2}, {3, 4, 5}, {6, 7, 8}, {9, 10, 11}}));
  EXPECT_EQ(a.tokens, (Counts{6, 15, 24, 33}));
  EXPECT_EQ(a.fixed_share_tokens, a.tokens);
  EXPECT_FALSE(a.moved);
}

TEST(LoadBalance, VeryUnequalRowsAreDealtEvenly) {
  // Two ranks whose fixed shares are the full rows and the padding rows.
  const Counts counts = {24, 24, 24, 24, 0, 0, 0, 0};
  const RowAssignment a = kmamba::balance_rows(counts, 2, 0.1);
  EXPECT_TRUE(a.moved);
  EXPECT_EQ(a.fixed_share_tokens, (Counts{96, 0}));
  EXPECT_EQ(a.tokens, (Counts{48, 48}));
  EXPECT_EQ(a.rows[0].size() + a.rows[1].size(), 8u);
  EXPECT_EQ(a.rows[0].size(), 4u);  // ties by rows: the zero rows alternate as well
}

TEST(LoadBalance, ThresholdKeepsTheFixedShares) {
  // Fixed shares 12 and 8: the busiest is 20% above the mean of 10.
  const Counts counts = {6, 6, 4, 4};
  EXPECT_FALSE(kmamba::balance_rows(counts, 2, 0.25).moved);
  const RowAssignment moved = kmamba::balance_rows(counts, 2, 0.19);
  EXPECT_TRUE(moved.moved);
  EXPECT_EQ(moved.tokens, (Counts{10, 10}));
  // Already balanced shares are never moved, even at threshold 0.
  EXPECT_FALSE(kmamba::balance_rows({5, 5, 5, 5}, 2, 0.0).moved);
  EXPECT_FALSE(kmamba::balance_rows({0, 0, 0, 0}, 2, 0.0).moved);
}

TEST(LoadBalance, RandomRowsWithinTheBounds) {
  check_random_rows(20261207);
  check_random_rows(std::random_device()());
}

TEST(LoadBalance, RowErrors) {
  expect_user_error([] { kmamba::balance_rows({1, 2}, 0, 0.1); }, {"kmamba::balance_rows", "ranks must be >= 1", "0"});
  expect_user_error([] { kmamba::balance_rows({1, 2}, 3, 0.1); }, {"2 rows cannot be shared by 3 ranks"});
  expect_user_error([] { kmamba::balance_rows({1, -2}, 2, 0.1); }, {"row 1 has -2 real tokens", ">= 0"});
  expect_user_error([] { kmamba::balance_rows({1, 2}, 2, -0.5); }, {"data_redistribution_threshold", ">= 0", "-0.5"});
  expect_user_error(
      [] {
        kmamba::balance_rows({1, 2}, 2, std::numeric_limits<double>::quiet_NaN());
      },
      {"data_redistribution_threshold", "finite"});
  kmamba::LoadBalancing balancing;
  balancing.data_redistribution_threshold = -1.0;
  expect_user_error([&] { balancing.validate(); }, {"kmamba::LoadBalancing", "data_redistribution_threshold", "-1"});
}

void check_random_segments(std::uint64_t seed) {
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937_64 random(seed);
  for (int trial = 0; trial < 300; ++trial) {
    const int size = 1 + static_cast<int>(random() % 8);
    const std::int64_t seqlen = size + static_cast<std::int64_t>(random() % 90);
    Counts counts = random_counts(random, seqlen, 16);
    if (trial % 7 == 0) std::fill(counts.begin(), counts.begin() + seqlen / 2, 0);  // recall-like: context first
    const std::vector<SequenceSegment> s = kmamba::balanced_sequence_segments(counts, size);
    ASSERT_EQ(s.size(), static_cast<std::size_t>(size));
    std::int64_t next = 0;
    for (int k = 0; k < size; ++k) {
      const SequenceSegment& seg = s[static_cast<std::size_t>(k)];
      EXPECT_EQ(seg.begin, next) << "trial " << trial << " segment " << k;
      EXPECT_GE(seg.length, 1) << "trial " << trial << " segment " << k;
      const std::int64_t held =
          std::accumulate(counts.begin() + seg.begin, counts.begin() + seg.begin + seg.length, std::int64_t{0});
      EXPECT_LE(held * size, total_of(counts) + size * max_of(counts)) << "trial " << trial << " segment " << k;
      next = seg.begin + seg.length;
    }
    EXPECT_EQ(next, seqlen);
    const std::vector<SequenceSegment> again = kmamba::balanced_sequence_segments(counts, size);
    for (int k = 0; k < size; ++k)
      EXPECT_EQ(again[static_cast<std::size_t>(k)].begin, s[static_cast<std::size_t>(k)].begin);
  }
}

TEST(BalancedSegments, RandomPositionsWithinTheBound) {
  check_random_segments(7);
  check_random_segments(std::random_device()());
}

TEST(BalancedSegments, FollowTheRealTokens) {
  // Real tokens only in the second half (a recall row's queries): two ranks split at 3/4.
  Counts counts(16, 0);
  std::fill(counts.begin() + 8, counts.end(), 2);
  const std::vector<SequenceSegment> two = kmamba::balanced_sequence_segments(counts, 2);
  EXPECT_EQ(two[0].begin, 0);
  EXPECT_EQ(two[0].length, 12);
  EXPECT_EQ(two[1].begin, 12);
  EXPECT_EQ(two[1].length, 4);
  // Every real token at the last position: the earlier ranks take the context, one token each after the first.
  Counts last(10, 0);
  last.back() = 5;
  const std::vector<SequenceSegment> three = kmamba::balanced_sequence_segments(last, 3);
  EXPECT_EQ(three[0].length, 8);
  EXPECT_EQ(three[1].begin, 8);
  EXPECT_EQ(three[1].length, 1);
  EXPECT_EQ(three[2].begin, 9);
}

TEST(BalancedSegments, WithoutRealTokensTheEvenSplit) {
  const std::vector<SequenceSegment> s = kmamba::balanced_sequence_segments(Counts(11, 0), 4);
  for (int k = 0; k < 4; ++k) {
    const SequenceSegment even = kmamba::sequence_segment(11, k, 4);
    EXPECT_EQ(s[static_cast<std::size_t>(k)].begin, even.begin);
    EXPECT_EQ(s[static_cast<std::size_t>(k)].length, even.length);
  }
}

TEST(BalancedSegments, Errors) {
  expect_user_error(
      [] {
        kmamba::balanced_sequence_segments({1, 2}, 3);
      },
      {"kmamba::balanced_sequence_segments", "2 positions cannot be shared by 3 sequence-parallel ranks"});
  expect_user_error([] { kmamba::balanced_sequence_segments({1, -1}, 1); }, {"position 1 has -1 real tokens"});
}

}  // namespace
