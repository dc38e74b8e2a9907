#include <kmamba/core/Error.hpp>
#include <kmamba/models/LoadBalance.hpp>

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>
#include <queue>
#include <tuple>

namespace kmamba {
namespace {

// counts[i]: the real tokens of item i (a row, a position), to be shared by `parts` parts.
void check_counts(const char* function, const char* item, const std::vector<std::int64_t>& counts, int parts,
                  const char* part_name) {
  KMAMBA_REQUIRE(parts >= 1, function << ": the number of " << part_name << " must be >= 1, got " << parts);
  KMAMBA_REQUIRE(counts.size() >= static_cast<std::size_t>(parts),
                 function << ": " << counts.size() << " " << item << "s cannot be shared by " << parts << " "
                          << part_name << " (each needs at least one)");
  for (std::size_t i = 0; i < counts.size(); ++i) {
    KMAMBA_REQUIRE(counts[i] >= 0,
                   function << ": " << item << " " << i << " has " << counts[i] << " real tokens (expected >= 0)");
  }
}

std::int64_t sum_of(const std::vector<std::int64_t>& counts, std::int64_t begin, std::int64_t end) {
  return std::accumulate(counts.begin() + begin, counts.begin() + end, std::int64_t{0});
}

// Longest processing time first: rows by decreasing real tokens (ties by index), each to the rank
// with the fewest real tokens so far, then the fewest rows, then the lowest index.
RowAssignment deal_longest_first(const std::vector<std::int64_t>& row_tokens, int ranks) {
  std::vector<std::int64_t> order(row_tokens.size());
  std::iota(order.begin(), order.end(), std::int64_t{0});
  std::stable_sort(order.begin(), order.end(), [&](std::int64_t a, std::int64_t b) {
    return row_tokens[static_cast<std::size_t>(a)] > row_tokens[static_cast<std::size_t>(b)];
  });
  using Load = std::tuple<std::int64_t, std::int64_t, int>;  // (real tokens, rows, rank)
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> lightest;
  for (int r = 0; r < ranks; ++r) lightest.emplace(0, 0, r);
  RowAssignment a;
  a.rows.resize(static_cast<std::size_t>(ranks));
  a.tokens.assign(static_cast<std::size_t>(ranks), 0);
  for (const std::int64_t row : order) {
    auto [tokens, rows, rank] = lightest.top();
    lightest.pop();
    a.rows[static_cast<std::size_t>(rank)].push_back(row);
    a.tokens[static_cast<std::size_t>(rank)] = tokens + row_tokens[static_cast<std::size_t>(row)];
    lightest.emplace(a.tokens[static_cast<std::size_t>(rank)], rows + 1, rank);
  }
  for (auto& rows : a.rows) std::sort(rows.begin(), rows.end());
  return a;
}

std::int64_t busiest(const std::vector<std::int64_t>& tokens) {
  return *std::max_element(tokens.begin(), tokens.end());
}

}  // namespace

std::vector<std::int64_t> real_tokens_per_row(const TokenBatch& batch) {
  std::vector<std::int64_t> counts(batch.targets.extent(0), 0);
  for (std::size_t b = 0; b < batch.targets.extent(0); ++b) {
    for (std::size_t t = 0; t < batch.targets.extent(1); ++t) counts[b] += batch.targets(b, t) != ignore_index ? 1 : 0;
  }
  return counts;
}

std::vector<std::int64_t> real_tokens_per_position(const TokenBatch& batch) {
  std::vector<std::int64_t> counts(batch.targets.extent(1), 0);
  for (std::size_t b = 0; b < batch.targets.extent(0); ++b) {
    for (std::size_t t = 0; t < batch.targets.extent(1); ++t) counts[t] += batch.targets(b, t) != ignore_index ? 1 : 0;
  }
  return counts;
}

const char* sequence_split_name(SequenceSplit split) { return split == SequenceSplit::Even ? "even" : "balanced"; }

void LoadBalancing::validate() const {
  KMAMBA_REQUIRE(std::isfinite(data_redistribution_threshold) && data_redistribution_threshold >= 0.0,
                 "kmamba::LoadBalancing: data_redistribution_threshold must be a finite fraction >= 0, got "
                     << data_redistribution_threshold);
}

RowAssignment fixed_row_shares(const std::vector<std::int64_t>& row_tokens, int ranks) {
  check_counts("kmamba::fixed_row_shares", "row", row_tokens, ranks, "ranks");
  const auto n = static_cast<std::int64_t>(row_tokens.size());
  RowAssignment a;
  for (int r = 0; r < ranks; ++r) {
    const SequenceSegment block = sequence_segment(n, r, ranks);
    std::vector<std::int64_t> rows(static_cast<std::size_t>(block.length));
    std::iota(rows.begin(), rows.end(), block.begin);
    a.rows.push_back(std::move(rows));
    a.tokens.push_back(sum_of(row_tokens, block.begin, block.begin + block.length));
  }
  a.fixed_share_tokens = a.tokens;
  return a;
}

RowAssignment balance_rows(const std::vector<std::int64_t>& row_tokens, int ranks, double threshold) {
  check_counts("kmamba::balance_rows", "row", row_tokens, ranks, "ranks");
  LoadBalancing{true, threshold}.validate();
  RowAssignment fixed = fixed_row_shares(row_tokens, ranks);
  const std::int64_t total = sum_of(row_tokens, 0, static_cast<std::int64_t>(row_tokens.size()));
  const std::int64_t fixed_max = busiest(fixed.tokens);
  if (static_cast<double>(fixed_max) * ranks <= (1.0 + threshold) * static_cast<double>(total)) return fixed;
  RowAssignment dealt = deal_longest_first(row_tokens, ranks);
  if (busiest(dealt.tokens) >= fixed_max) return fixed;
  dealt.fixed_share_tokens = fixed.tokens;
  dealt.moved = dealt.rows != fixed.rows;
  return dealt;
}

std::vector<SequenceSegment> balanced_sequence_segments(const std::vector<std::int64_t>& position_tokens, int size) {
  check_counts("kmamba::balanced_sequence_segments", "position", position_tokens, size, "sequence-parallel ranks");
  const auto n = static_cast<std::int64_t>(position_tokens.size());
  const std::int64_t total = sum_of(position_tokens, 0, n);
  std::vector<std::int64_t> begin(static_cast<std::size_t>(size) + 1, n);
  begin[0] = 0;
  std::int64_t prefix = 0, p = 0;  // prefix = Σ of position_tokens over [0, p)
  for (int k = 1; k < size; ++k) {
    if (total == 0) {
      begin[static_cast<std::size_t>(k)] = sequence_segment(n, k, size).begin;
      continue;
    }
    // The first p with size · prefix(p) >= k · total, then within [previous + 1, n − (size − k)].
    while (prefix * size < static_cast<std::int64_t>(k) * total)
      prefix += position_tokens[static_cast<std::size_t>(p++)];
    const std::int64_t latest = n - (size - k), earliest = begin[static_cast<std::size_t>(k) - 1] + 1;
    begin[static_cast<std::size_t>(k)] = std::max(earliest, std::min(p, latest));
  }
  std::vector<SequenceSegment> segments(static_cast<std::size_t>(size));
  for (int k = 0; k < size; ++k) {
    segments[static_cast<std::size_t>(k)].begin = begin[static_cast<std::size_t>(k)];
    segments[static_cast<std::size_t>(k)].length =
        begin[static_cast<std::size_t>(k) + 1] - begin[static_cast<std::size_t>(k)];
  }
  return segments;
}

}  // namespace kmamba
