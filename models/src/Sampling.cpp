#include <kmamba/core/Error.hpp>
#include <kmamba/core/Random.hpp>
#include <kmamba/models/Sampling.hpp>

#include "SamplingKernels.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace kmamba {

void SamplingConfig::validate() const {
  KMAMBA_REQUIRE(std::isfinite(temperature) && temperature >= 0.0f,
                 "kmamba::SamplingConfig: temperature must be finite and >= 0, got " << temperature);
  KMAMBA_REQUIRE(top_k >= 0, "kmamba::SamplingConfig: top_k must be >= 0, got " << top_k);
  KMAMBA_REQUIRE(top_p >= 0.0f && top_p <= 1.0f, "kmamba::SamplingConfig: top_p must be in [0, 1], got " << top_p);
  KMAMBA_REQUIRE(min_p >= 0.0f && min_p <= 1.0f, "kmamba::SamplingConfig: min_p must be in [0, 1], got " << min_p);
  KMAMBA_REQUIRE(std::isfinite(repetition_penalty) && repetition_penalty > 0.0f,
                 "kmamba::SamplingConfig: repetition_penalty must be finite and > 0, got " << repetition_penalty);
}

double sampling_uniform(std::uint64_t seed, std::uint64_t sequence, std::uint64_t step) {
  return impl::device_sampling_uniform(seed, sequence, step);
}

Sampler::Sampler(const SamplingConfig& config) : config_(config) { config_.validate(); }

double Sampler::select(const float* logits, std::int64_t vocab, const std::int64_t* history, std::size_t history_size) {
  KMAMBA_REQUIRE(vocab > 0, "kmamba::Sampler: the vocabulary must not be empty, got " << vocab);
  KMAMBA_REQUIRE(logits != nullptr, "kmamba::Sampler: logits is null");
  KMAMBA_REQUIRE(history != nullptr || history_size == 0, "kmamba::Sampler: history is null");
  const auto n = static_cast<std::size_t>(vocab);
  value_.resize(n);
  weight_.resize(n);
  mark_.assign(n, 0);
  for (std::size_t i = 0; i < n; ++i) {
    const float l = logits[i];
    KMAMBA_REQUIRE(!std::isnan(l) && l != std::numeric_limits<float>::infinity(),
                   "kmamba::Sampler: the logit of token " << i << " is " << l << " (NaN and +inf are not allowed)");
    value_[i] = l;
  }

  // 1. Repetition penalty.
  if (config_.repetition_penalty != 1.0f) penalize_repetitions(vocab, history, history_size);

  std::size_t best = n;
  for (std::size_t i = 0; i < n; ++i) {
    if (value_[i] != -std::numeric_limits<double>::infinity() && (best == n || value_[i] > value_[best])) best = i;
  }
  KMAMBA_REQUIRE(best < n, "kmamba::Sampler: every logit is -inf");

  // 2. Greedy; also the limit a temperature so small that the scaled logits overflow tends to.
  if (config_.greedy() || !std::isfinite(value_[best] / config_.temperature)) {
    kept_.assign(1, static_cast<std::int64_t>(best));
    weight_[best] = 1.0;
    return 1.0;
  }

  // Candidates: every token whose logit is not -inf, in ascending id order.
  kept_.clear();
  for (std::size_t i = 0; i < n; ++i) {
    if (value_[i] != -std::numeric_limits<double>::infinity()) kept_.push_back(static_cast<std::int64_t>(i));
  }

  // 3. Top-k.
  if (config_.top_k > 0 && static_cast<std::size_t>(config_.top_k) < kept_.size()) keep_top_k(value_[best]);

  // 4. Temperature, and the softmax weights of what is left.
  const double max_value = value_[best] / config_.temperature;
  double total = 0.0;
  for (const std::int64_t id : kept_) {
    const auto i = static_cast<std::size_t>(id);
    value_[i] /= config_.temperature;
    weight_[i] = std::exp(value_[i] - max_value);
    total += weight_[i];
  }

  // 5a. Top-p.
  if (config_.top_p > 0.0f && config_.top_p < 1.0f) keep_top_p(max_value, static_cast<double>(config_.top_p) * total);

  // 5b. Min-p: the largest weight is exp(0) = 1, so p_i >= min_p * p_max is weight_i >= min_p.
  if (config_.min_p > 0.0f) {
    const double min_p = config_.min_p;
    const auto removed = [&](std::int64_t id) { return weight_[static_cast<std::size_t>(id)] < min_p; };
    kept_.erase(std::remove_if(kept_.begin(), kept_.end(), removed), kept_.end());
  }

  total = 0.0;
  for (const std::int64_t id : kept_) total += weight_[static_cast<std::size_t>(id)];
  return total;
}

void Sampler::penalize_repetitions(std::int64_t vocab, const std::int64_t* history, std::size_t history_size) {
  const double penalty = config_.repetition_penalty;
  for (std::size_t h = 0; h < history_size; ++h) {
    const std::int64_t id = history[h];
    KMAMBA_REQUIRE(id >= 0 && id < vocab,
                   "kmamba::Sampler: history[" << h << "] = " << id << " is outside [0, " << vocab << ")");
    const auto i = static_cast<std::size_t>(id);
    if (mark_[i]) continue;
    mark_[i] = 1;
    value_[i] = value_[i] < 0.0 ? value_[i] * penalty : value_[i] / penalty;
  }
  for (std::size_t h = 0; h < history_size; ++h) mark_[static_cast<std::size_t>(history[h])] = 0;
}

bool Sampler::before(std::int64_t a, std::int64_t b) const {
  const double va = value_[static_cast<std::size_t>(a)], vb = value_[static_cast<std::size_t>(b)];
  return va > vb || (va == vb && a < b);
}

void Sampler::gather_leading_bins(double top, double limit, bool weighted) {
  constexpr int bins = 64;
  const auto bin_of = [&](std::int64_t id) {
    return static_cast<int>(std::min<double>(bins - 1, top - value_[static_cast<std::size_t>(id)]));
  };
  double sums[bins] = {};
  for (const std::int64_t id : kept_) sums[bin_of(id)] += weighted ? weight_[static_cast<std::size_t>(id)] : 1.0;
  int last = 0;
  for (double cumulative = sums[0]; cumulative < limit && last < bins - 1;) cumulative += sums[++last];
  order_.clear();
  for (const std::int64_t id : kept_) {
    if (bin_of(id) <= last) order_.push_back(id);
  }
}

void Sampler::keep_top_k(double top) {
  const auto k = static_cast<std::ptrdiff_t>(config_.top_k);
  gather_leading_bins(top, static_cast<double>(k), false);
  std::nth_element(order_.begin(), order_.begin() + (k - 1), order_.end(),
                   [this](std::int64_t a, std::int64_t b) { return before(a, b); });
  kept_.assign(order_.begin(), order_.begin() + k);
  std::sort(kept_.begin(), kept_.end());
}

void Sampler::keep_top_p(double max_value, double threshold) {
  gather_leading_bins(max_value, threshold, true);
  // Quickselect-style partitioning finds the kept prefix of order_ without sorting it.
  // Invariant: order_[0, lo) are the first lo tokens and kept, order_[hi, end) come after all of
  // order_[lo, hi) and are dropped, `mass` is the weight of order_[0, lo).
  double mass = 0.0;
  std::size_t lo = 0, hi = order_.size();
  while (lo < hi) {
    const std::int64_t pivot = order_[lo + (hi - lo) / 2];
    const auto first = order_.begin() + static_cast<std::ptrdiff_t>(lo);
    const auto last = order_.begin() + static_cast<std::ptrdiff_t>(hi);
    const auto mid = std::partition(first, last, [&](std::int64_t id) { return before(id, pivot); });
    double ahead = 0.0;
    for (auto it = first; it != mid; ++it) ahead += weight_[static_cast<std::size_t>(*it)];
    if (mass + ahead >= threshold) {
      hi = static_cast<std::size_t>(mid - order_.begin());  // the pivot and what follows it are dropped
    } else {
      // Everything before the pivot is kept, and so is the pivot.
      std::iter_swap(mid, std::find(mid, last, pivot));
      mass += ahead + weight_[static_cast<std::size_t>(pivot)];
      lo = static_cast<std::size_t>(mid - order_.begin()) + 1;
    }
  }
  for (std::size_t i = 0; i < lo; ++i) mark_[static_cast<std::size_t>(order_[i])] = 1;
  const auto removed = [this](std::int64_t id) { return mark_[static_cast<std::size_t>(id)] == 0; };
  kept_.erase(std::remove_if(kept_.begin(), kept_.end(), removed), kept_.end());
  for (const std::int64_t id : kept_) mark_[static_cast<std::size_t>(id)] = 0;
}

std::int64_t Sampler::sample(const float* logits, std::int64_t vocab, const std::int64_t* history,
                             std::size_t history_size, std::uint64_t sequence, std::uint64_t step) {
  const double total = select(logits, vocab, history, history_size);
  if (kept_.size() == 1) return kept_[0];
  // 6. Inverse CDF over the kept tokens in ascending id order.
  const double target = sampling_uniform(config_.seed, sequence, step) * total;
  double cumulative = 0.0;
  std::int64_t last_positive = kept_[0];
  for (const std::int64_t id : kept_) {
    const double w = weight_[static_cast<std::size_t>(id)];
    if (w <= 0.0) continue;
    cumulative += w;
    last_positive = id;
    if (cumulative > target) return id;
  }
  return last_positive;  // rounding left the target at the very end of the range
}

std::int64_t Sampler::sample(const std::vector<float>& logits, const std::vector<std::int64_t>& history,
                             std::uint64_t sequence, std::uint64_t step) {
  return sample(logits.data(), static_cast<std::int64_t>(logits.size()), history.data(), history.size(), sequence,
                step);
}

void Sampler::distribution(const float* logits, std::int64_t vocab, const std::int64_t* history,
                           std::size_t history_size, std::vector<double>& probabilities) {
  const double total = select(logits, vocab, history, history_size);
  probabilities.assign(static_cast<std::size_t>(vocab), 0.0);
  for (const std::int64_t id : kept_) {
    const auto i = static_cast<std::size_t>(id);
    probabilities[i] = weight_[i] / total;
  }
}

StopReason StopCriteria::check(std::int64_t generated, std::int64_t last_token) const {
  if (generated > 0 && std::find(stop_tokens.begin(), stop_tokens.end(), last_token) != stop_tokens.end()) {
    return StopReason::StopToken;
  }
  if (max_new_tokens >= 0 && generated >= max_new_tokens) return StopReason::MaxNewTokens;
  return StopReason::None;
}

}  // namespace kmamba
