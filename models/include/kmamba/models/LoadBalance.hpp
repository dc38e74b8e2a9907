// Load balancing by real tokens (docs/distributed.md §3.1, §2): which rows of a global batch each
// data-parallel rank trains on, and where each sequence-parallel rank's segment begins.
//
// A real token is a position whose target is not ignore_index (TokenBatch::predicted_tokens): the
// positions the loss scores and the gradient weights. An end-of-document token of packed rows, a
// recall sequence's key-value context and padding a program marks with ignore_index targets are
// not real tokens. balance_rows and balanced_sequence_segments are pure functions of the counts, so
// every rank that holds the same counts computes the same answer without communicating.
//
//   const kmamba::RowAssignment a = kmamba::balance_rows(real_tokens_of_every_row, dp_size, 0.1);
//   for (std::int64_t row : a.rows[dp_rank]) ...                          // this rank's rows
//   const auto segments = kmamba::balanced_sequence_segments(real_tokens_per_position, sp_size);
#ifndef KMAMBA_MODELS_LOADBALANCE_HPP
#define KMAMBA_MODELS_LOADBALANCE_HPP

#include <kmamba/models/Data.hpp>
#include <kmamba/models/ModelParallel.hpp>

#include <cstdint>
#include <string>
#include <vector>

namespace kmamba {

/// The real tokens of each row of `batch`.
std::vector<std::int64_t> real_tokens_per_row(const TokenBatch& batch);
/// The real tokens at each position of `batch`, summed over its rows.
std::vector<std::int64_t> real_tokens_per_position(const TokenBatch& batch);

/// How sequences are cut into sequence-parallel segments.
enum class SequenceSplit {
  Even,      ///< equal lengths, the first seqlen % size segments one token longer (sequence_segment)
  Balanced,  ///< about equal real tokens summed over the rows (balanced_sequence_segments)
};

/// "even", "balanced".
const char* sequence_split_name(SequenceSplit split);

/// How a Trainer hands out work (kmamba-train's load_balancing keys and sequence_split_strategy).
struct LoadBalancing {
  /// Hand each data-parallel rank rows of the step's global batch by their real tokens
  /// (balance_rows) instead of its fixed share.
  bool dynamic_task_allocation = false;
  /// Rows are moved only when the busiest rank's fixed share exceeds the mean by more than this
  /// fraction of the mean (>= 0).
  double data_redistribution_threshold = 0.1;
  SequenceSplit sequence_split = SequenceSplit::Even;

  /// Throws kmamba::UserError naming a threshold that is negative or not finite.
  void validate() const;
};

/// Which rows each of `ranks` ranks trains on.
struct RowAssignment {
  std::vector<std::vector<std::int64_t>> rows;   ///< rows[r]: the row indices of rank r, ascending
  std::vector<std::int64_t> tokens;              ///< real tokens of rows[r]
  std::vector<std::int64_t> fixed_share_tokens;  ///< real tokens of rank r's fixed share
  bool moved = false;                            ///< some rank's rows are not its fixed share
};

/// The fixed shares of `row_tokens.size()` rows (each entry a row's real tokens, >= 0) over
/// `ranks` ranks: rank r takes the contiguous block sequence_segment(rows, r, ranks), which is
/// what each data-parallel rank loads without balancing. Needs rows >= ranks >= 1.
RowAssignment fixed_row_shares(const std::vector<std::int64_t>& row_tokens, int ranks);

/// The fixed shares, unless the busiest share holds more than (1 + threshold) times the mean real
/// tokens per rank: then the rows are dealt longest first (ties by row index) each to the rank
/// with the fewest real tokens so far (ties: fewer rows, then the lower rank), and that dealing is
/// taken when its busiest rank holds fewer real tokens than the busiest fixed share. Every rank
/// then holds at most mean + the largest row's real tokens, and at least one row. Deterministic.
RowAssignment balance_rows(const std::vector<std::int64_t>& row_tokens, int ranks, double threshold);

/// Contiguous, non-empty segments of a sequence of `position_tokens.size()` positions (entry t:
/// the real tokens at position t summed over the rows, >= 0) for `size` sequence-parallel ranks:
/// segment k begins at the first position p whose prefix Σ_{t<p} holds k/size of the real
/// tokens, moved as little as keeps every segment at least one token long. Each segment holds at
/// most total/size + the largest entry (a segment that the move changed is one token long or
/// shorter than before). Without real tokens: the even split. Needs positions >= size >= 1.
std::vector<SequenceSegment> balanced_sequence_segments(const std::vector<std::int64_t>& position_tokens, int size);

}  // namespace kmamba

#endif
