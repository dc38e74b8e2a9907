// The kernels of DeviceSampler (kmamba/models/DeviceSampler.hpp): one team per row of logits runs
// the rules of Sampling.hpp without sorting the vocabulary.
//
// Top-k and top-p need the token at a given rank (count, or probability mass) of the order "larger
// value first, lower id on ties". A team finds it by radix select: every value maps to a 64-bit key
// whose unsigned order is the value's order; up to eight passes over the row, one per byte of the
// key from the top, histogram the tokens that share the key's leading bytes found so far (256 bins
// in team scratch) and keep the bin in which the running count or mass reaches the limit, until
// that bin holds a single token or the key is complete. That gives the threshold key T and the
// weight of the tokens above it; the tokens equal to T are then kept in id order up to the limit
// (one team scan finds the last one kept). Nothing is sorted and no per-row buffer is needed
// beyond the logits, whatever the vocabulary and k.
//
// Weights are fixed point: weight = round(exp(value − max) · 2^43), so every sum (the top-p mass,
// the total, the cumulative mass of the draw) is an integer sum, exact and the same whatever the
// order of the additions, the team size or the backend. Tokens whose probability relative to the
// best is below 2^-44 get weight 0 and are never drawn (the host Sampler draws them with that
// probability). A 2^21 vocabulary keeps the total below 2^64.
#ifndef KMAMBA_MODELS_SRC_SAMPLINGKERNELS_HPP
#define KMAMBA_MODELS_SRC_SAMPLINGKERNELS_HPP

#include <kmamba/core/Math.hpp>
#include <kmamba/core/Random.hpp>
#include <kmamba/core/Tensor.hpp>

#include <Kokkos_Core.hpp>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace kmamba {
namespace impl {

/// Largest vocabulary the fixed-point weights allow (the total of 2^21 weights of 2^43 fits 64 bits).
constexpr std::int64_t device_sampler_max_vocab = std::int64_t(1) << 21;
/// The fixed-point scale of the weights.
constexpr double device_sampler_weight_scale = 8796093022208.0;  // 2^43

/// Error codes the sampler leaves in its error view: (code, row, token).
enum DeviceSamplerError : std::int64_t { sampler_ok = 0, sampler_bad_logit = 1, sampler_all_masked = 2 };

/// The uniform number in [0, 1) of draw (seed, sequence, step), on the host (kmamba::sampling_uniform)
/// and the device alike.
KOKKOS_INLINE_FUNCTION double device_sampling_uniform(std::uint64_t seed, std::uint64_t sequence, std::uint64_t step) {
  constexpr std::uint32_t domain = 0x73616d70u;  // "samp": keeps these streams apart from fill_uniform's
  const Kokkos::Array<std::uint32_t, 4> counter = {
      {static_cast<std::uint32_t>(step), static_cast<std::uint32_t>(step >> 32), static_cast<std::uint32_t>(sequence),
       static_cast<std::uint32_t>(sequence >> 32) ^ domain}};
  const Kokkos::Array<std::uint32_t, 4> r =
      philox4x32(counter, static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32));
  const std::uint64_t bits = (static_cast<std::uint64_t>(r[0]) << 21) | (r[1] >> 11);  // 53 bits
  return static_cast<double>(bits) * (1.0 / 9007199254740992.0);
}

/// A 64-bit key whose unsigned order is the order of the (non-NaN) values; -0 and +0 share a key,
/// as they compare equal.
KOKKOS_INLINE_FUNCTION std::uint64_t order_key(double value) {
  if (value == 0.0) value = 0.0;
  std::uint64_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  constexpr std::uint64_t sign = std::uint64_t(1) << 63;
  return (bits & sign) ? ~bits : (bits | sign);
}

/// Whether x is neither infinite nor NaN.
KOKKOS_INLINE_FUNCTION bool finite(double x) { return x - x == 0.0; }

/// Everything a row's team shares through scratch: the radix histogram and the results of each
/// stage, written by one thread and read by all after a barrier.
struct RowShared {
  std::uint64_t bins[256];    // weight per value of the key's current byte
  std::uint32_t counts[256];  // tokens per value of the key's current byte
  std::uint64_t prefix, above, count, cut_key;
  std::int64_t cut_id, chosen;
};

/// What one thread of a row's team finds among its tokens: the largest value, the first of its
/// tokens that has it, its first bad logit (NaN or +inf) and how many of its values are not -inf.
struct RowScan {
  double top;
  int best, bad, candidates;
};

/// Per row r with steps(r) >= 0: the token chosen for sequence first_sequence + r at step
/// steps(r), written to ids(r) and marked in seen (when the penalty is on); or, when probabilities
/// is allocated, the distribution it is drawn from.
template <class ExecutionSpace>
struct SampleRows {
  using Mem = typename ExecutionSpace::memory_space;
  using Member = typename Kokkos::TeamPolicy<ExecutionSpace>::member_type;
  using Shared =
      Kokkos::View<RowShared, typename ExecutionSpace::scratch_memory_space, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

  ConstTensor2<float, Mem> logits;        // (batch, >= vocab)
  Tensor2<std::uint8_t, Mem> seen;        // (batch, vocab); read and written only when penalty != 1
  ConstTensor1<std::int64_t, Mem> steps;  // (batch)
  Tensor1<std::int64_t, Mem> ids;         // (batch) or empty
  Tensor2<double, Mem> probabilities;     // (batch, vocab) or empty
  Tensor1<std::int64_t, Mem> error;       // (3): code, row, token of the first error
  int vocab;
  double temperature, top_p, min_p, penalty;
  int top_k;
  bool greedy;
  std::uint64_t seed, first_sequence;

  /// The logit of token i after the repetition penalty.
  KOKKOS_INLINE_FUNCTION double value(int row, int i) const { return penalised(row, i, logits(row, i)); }
  KOKKOS_INLINE_FUNCTION double penalised(int row, int i, float logit) const {
    const double l = logit;
    if (penalty == 1.0 || !seen(row, i)) return l;
    return l < 0.0 ? l * penalty : l / penalty;
  }
  /// This thread's tokens team_rank, team_rank + team_size, ... in one sweep, four loads in flight
  /// at a time: a team reading its row one load after another waits on memory latency at every
  /// token (about a millisecond for a 50k vocabulary on an H100).
  KOKKOS_INLINE_FUNCTION RowScan scan_row(const Member& team, int row) const {
    RowScan mine{-HUGE_VAL, vocab, vocab, 0};
    const auto note = [&](int i, float logit) {
      if ((!(logit == logit) || logit > FLT_MAX) && i < mine.bad) mine.bad = i;
      const double v = penalised(row, i, logit);
      if (v == v && v > mine.top) {
        mine.top = v;
        mine.best = i;
      }
      if (v != -HUGE_VAL) ++mine.candidates;
    };
    const int stride = team.team_size();
    int i = team.team_rank();
    for (; i + 3 * stride < vocab; i += 4 * stride) {
      float l[4];
      for (int u = 0; u < 4; ++u) l[u] = logits(row, i + u * stride);
      for (int u = 0; u < 4; ++u) note(i + u * stride, l[u]);
    }
    for (; i < vocab; i += stride) note(i, logits(row, i));
    return mine;
  }
  /// Whether token i survives top-k, given the stage's threshold key and last tied id.
  KOKKOS_INLINE_FUNCTION static bool within(std::uint64_t key, int i, std::uint64_t cut_key, std::int64_t cut_id) {
    return key > cut_key || (key == cut_key && i <= cut_id);
  }

  KOKKOS_INLINE_FUNCTION void fail(std::int64_t code, int row, int token) const {
    if (Kokkos::atomic_compare_exchange(&error(0), std::int64_t(sampler_ok), code) == sampler_ok) {
      error(1) = row;
      error(2) = token;
    }
  }

  // Radix select over the tokens with weight(i) > 0 in decreasing key(i) order: leaves in
  // s.cut_key the key of the token where the cumulative weight first reaches `limit` (the total
  // must reach it), in s.above the weight of the larger keys, and in s.cut_id the last id of that
  // key kept: the tied tokens are kept in id order while above + weight before them < limit.
  // A pass whose chosen bin holds one token ends the search: that token is the cut (continuous
  // values need about three passes, not eight).
  template <class Key, class Weight>
  KOKKOS_INLINE_FUNCTION void select(const Member& team, const Shared& s, const Key& key, const Weight& weight,
                                     std::uint64_t limit) const {
    Kokkos::single(Kokkos::PerTeam(team), [&]() {
      s().prefix = 0;
      s().above = 0;
    });
    team.team_barrier();
    int shift = 56;
    for (; shift >= 0; shift -= 8) {
      if (radix_pass(team, s, key, weight, limit, shift)) break;
    }
    if (shift >= 0) {  // one token has the key's leading bytes found so far
      const std::uint64_t mask = ~std::uint64_t(0) << shift, prefix = s().prefix;
      int only = vocab;
      Kokkos::parallel_reduce(
          Kokkos::TeamThreadRange(team, vocab),
          [&](const int i, int& first) {
            if (i < first && weight(i) > 0 && (key(i) & mask) == prefix) first = i;
          },
          Kokkos::Min<int>(only));
      Kokkos::single(Kokkos::PerTeam(team), [&]() {
        s().cut_key = key(only);
        s().cut_id = only;
      });
      team.team_barrier();
      return;
    }
    // The tied tokens all have the same weight w: n = ceil((limit − above) / w) of them are kept.
    const std::uint64_t cut_key = s().prefix;
    std::uint64_t tie_weight = 0;
    Kokkos::parallel_reduce(
        Kokkos::TeamThreadRange(team, vocab),
        [&](const int i, std::uint64_t& w) {
          if (weight(i) > 0 && key(i) == cut_key) w = weight(i);
        },
        Kokkos::Max<std::uint64_t>(tie_weight));
    const std::uint64_t kept_ties = (limit - s().above + tie_weight - 1) / tie_weight;
    Kokkos::parallel_scan(Kokkos::TeamThreadRange(team, vocab),
                          [&](const int i, std::uint64_t& count, const bool final) {
                            if (weight(i) == 0 || key(i) != cut_key) return;
                            count += 1;
                            if (final && count == kept_ties) s().cut_id = i;
                          });
    Kokkos::single(Kokkos::PerTeam(team), [&]() { s().cut_key = cut_key; });
    team.team_barrier();
  }

  // One pass of select over the key's byte at `shift`: histograms the tokens whose key starts with
  // s.prefix, extends s.prefix by the byte of the bin where above + the cumulative weight (bins
  // from the top) reaches the limit — exactly one does, as the total reaches it — and returns
  // whether that bin holds a single token.
  template <class Key, class Weight>
  KOKKOS_INLINE_FUNCTION bool radix_pass(const Member& team, const Shared& s, const Key& key, const Weight& weight,
                                         std::uint64_t limit, int shift) const {
    const std::uint64_t mask = shift == 56 ? 0 : ~std::uint64_t(0) << (shift + 8);
    const std::uint64_t prefix = s().prefix, above = s().above;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, 256), [&](const int b) {
      s().bins[b] = 0;
      s().counts[b] = 0;
    });
    team.team_barrier();
    // A thread adds a run of its tokens that fall in one bin with one pair of atomics: in the first
    // passes nearly every token shares the leading byte, and a team adding them one by one to the
    // same scratch word serialises on it (integer sums: the order does not change the result).
    int run_bin = -1;
    std::uint64_t run_weight = 0;
    std::uint32_t run_count = 0;
    const auto flush = [&]() {
      if (run_count == 0) return;
      Kokkos::atomic_add(&s().bins[run_bin], run_weight);
      Kokkos::atomic_add(&s().counts[run_bin], run_count);
    };
    for (int i = team.team_rank(); i < vocab; i += team.team_size()) {
      const std::uint64_t w = weight(i);
      if (w == 0) continue;
      const std::uint64_t k = key(i);
      if ((k & mask) != prefix) continue;
      const int bin = static_cast<int>((k >> shift) & 255);
      if (bin != run_bin) {
        flush();
        run_bin = bin;
        run_weight = 0;
        run_count = 0;
      }
      run_weight += w;
      ++run_count;
    }
    flush();
    team.team_barrier();
    Kokkos::parallel_scan(Kokkos::TeamThreadRange(team, 256),
                          [&](const int j, std::uint64_t& cumulative, const bool final) {
                            const int b = 255 - j;
                            const std::uint64_t w = s().bins[b];
                            if (final && above + cumulative < limit && above + cumulative + w >= limit) {
                              s().prefix = prefix | (static_cast<std::uint64_t>(b) << shift);
                              s().above = above + cumulative;
                              s().count = s().counts[b];
                            }
                            cumulative += w;
                          });
    team.team_barrier();
    return s().count == 1;
  }

  // The row's choice is `token` (one-hot distribution).
  KOKKOS_INLINE_FUNCTION void emit_one(const Member& team, int row, int token) const {
    if (probabilities.extent(0) > 0) {
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, vocab),
                           [&](const int i) { probabilities(row, i) = i == token ? 1.0 : 0.0; });
    }
    Kokkos::single(Kokkos::PerTeam(team), [&]() { choose(row, token); });
  }
  KOKKOS_INLINE_FUNCTION void choose(int row, int token) const {
    if (ids.extent(0) > 0) ids(row) = token;
    if (penalty != 1.0 && ids.extent(0) > 0) seen(row, token) = 1;
  }

  // One draw from the weights drawn(i) (fixed point, not all 0) by inverse CDF in ascending id
  // order, as the host Sampler: the first token whose cumulative weight exceeds u · total.
  template <class Drawn>
  KOKKOS_INLINE_FUNCTION void draw(const Member& team, const Shared& s, int row, std::int64_t step,
                                   const Drawn& drawn) const {
    std::uint64_t total = 0;
    Kokkos::parallel_reduce(
        Kokkos::TeamThreadRange(team, vocab), [&](const int i, std::uint64_t& t) { t += drawn(i); }, total);
    if (probabilities.extent(0) > 0) {
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, vocab), [&](const int i) {
        probabilities(row, i) = static_cast<double>(drawn(i)) / static_cast<double>(total);
      });
      return;
    }
    const double target = device_sampling_uniform(seed, first_sequence + static_cast<std::uint64_t>(row),
                                                  static_cast<std::uint64_t>(step)) *
                          static_cast<double>(total);
    Kokkos::single(Kokkos::PerTeam(team), [&]() { s().chosen = -1; });
    team.team_barrier();
    Kokkos::parallel_scan(Kokkos::TeamThreadRange(team, vocab),
                          [&](const int i, std::uint64_t& cumulative, const bool final) {
                            const std::uint64_t w = drawn(i);
                            if (w == 0) return;
                            const bool before = static_cast<double>(cumulative) <= target;
                            cumulative += w;
                            if (final && before && static_cast<double>(cumulative) > target) s().chosen = i;
                          });
    team.team_barrier();
    std::int64_t chosen = s().chosen;
    if (chosen < 0) {  // rounding left the target at the very end of the range: the last token
      Kokkos::parallel_reduce(
          Kokkos::TeamThreadRange(team, vocab),
          [&](const int i, std::int64_t& last) {
            if (drawn(i) > 0 && i > last) last = i;
          },
          Kokkos::Max<std::int64_t>(chosen));
    }
    Kokkos::single(Kokkos::PerTeam(team), [&]() { choose(row, static_cast<int>(chosen)); });
  }

  KOKKOS_INLINE_FUNCTION void operator()(const Member& team) const;
  // Top-k, temperature, top-p, min-p and the draw, for a row whose largest value is `top` and
  // that has `candidates` tokens above -inf.
  KOKKOS_INLINE_FUNCTION void filter_and_draw(const Member& team, const Shared& s, int row, std::int64_t step,
                                              double top, int candidates) const;
};

template <class ExecutionSpace>
KOKKOS_INLINE_FUNCTION void SampleRows<ExecutionSpace>::operator()(const Member& team) const {
  const int row = team.league_rank();
  const std::int64_t step = steps.extent(0) > 0 ? steps(row) : 0;
  if (step < 0) return;  // a row that is not sampled this time
  const Shared s(team.team_scratch(0));

  // The largest value, the first token that has it, the first bad logit (NaN or +inf) and the
  // tokens whose value is not -inf: one sweep of the row, then the team's reductions.
  RowScan mine = scan_row(team, row);
  double top = mine.top;
  team.team_reduce(Kokkos::Max<double>(top));
  int best = mine.top == top ? mine.best : vocab, bad = mine.bad, candidates = mine.candidates;
  team.team_reduce(Kokkos::Min<int>(best));
  team.team_reduce(Kokkos::Min<int>(bad));
  team.team_reduce(Kokkos::Sum<int>(candidates));
  if (bad < vocab || candidates == 0) {
    Kokkos::single(Kokkos::PerTeam(team),
                   [&]() { fail(bad < vocab ? sampler_bad_logit : sampler_all_masked, row, bad < vocab ? bad : -1); });
    emit_one(team, row, 0);
    return;
  }
  // Greedy; also the limit a temperature so small that the scaled logits overflow tends to.
  if (greedy || !finite(top / temperature)) {
    emit_one(team, row, best);
    return;
  }
  filter_and_draw(team, s, row, step, top, candidates);
}

template <class ExecutionSpace>
KOKKOS_INLINE_FUNCTION void SampleRows<ExecutionSpace>::filter_and_draw(const Member& team, const Shared& s, int row,
                                                                        std::int64_t step, double top,
                                                                        int candidates) const {
  constexpr double neg_inf = -HUGE_VAL;
  // Top-k on the penalised values: kept_k(i).
  const bool top_k_on = top_k > 0 && top_k < candidates;
  std::uint64_t k_key = 0;
  std::int64_t k_id = vocab;
  if (top_k_on) {
    select(
        team, s, [&](const int i) { return order_key(value(row, i)); },
        [&](const int i) { return std::uint64_t(value(row, i) != neg_inf ? 1 : 0); }, std::uint64_t(top_k));
    k_key = s().cut_key;
    k_id = s().cut_id;
  }
  const auto kept_k = [&](const int i) {
    const double v = value(row, i);
    return v != neg_inf && (!top_k_on || within(order_key(v), i, k_key, k_id));
  };
  // Temperature and the fixed-point weights of what top-k kept.
  const double max_value = top / temperature;
  const auto weight = [&](const int i) { return kept_k(i) ? math::exp(value(row, i) / temperature - max_value) : 0.0; };
  const auto fixed = [&](const int i) {
    return static_cast<std::uint64_t>(math::floor(weight(i) * device_sampler_weight_scale + 0.5));
  };

  // Top-p on the softmax of what top-k kept: kept_p(i).
  const bool top_p_on = top_p > 0.0 && top_p < 1.0;
  std::uint64_t p_key = 0;
  std::int64_t p_id = vocab;
  if (top_p_on) {
    std::uint64_t total = 0;
    Kokkos::parallel_reduce(
        Kokkos::TeamThreadRange(team, vocab), [&](const int i, std::uint64_t& t) { t += fixed(i); }, total);
    // Mass before a token < top_p · total ⇔ mass before < ceil(top_p · total), the masses being integers.
    const double threshold = -math::floor(-top_p * static_cast<double>(total));
    const std::uint64_t limit = threshold >= static_cast<double>(total) ? total : static_cast<std::uint64_t>(threshold);
    select(
        team, s, [&](const int i) { return order_key(value(row, i) / temperature); }, fixed, limit);
    p_key = s().cut_key;
    p_id = s().cut_id;
  }
  // Min-p on the same softmax, then the weights the draw uses.
  const auto drawn = [&](const int i) -> std::uint64_t {
    const double w = weight(i);
    if (w == 0.0 || (top_p_on && !within(order_key(value(row, i) / temperature), i, p_key, p_id))) return 0;
    if (w < min_p) return 0;
    return static_cast<std::uint64_t>(math::floor(w * device_sampler_weight_scale + 0.5));
  };
  draw(team, s, row, step, drawn);
}

}  // namespace impl
}  // namespace kmamba

#endif
