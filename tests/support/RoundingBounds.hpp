// Bounds on the difference between two fp32 evaluations of the same computation that associate
// their sums differently: one process against a process mesh, one rank's micro-batches against a
// reduction over ranks, one BLAS kernel against another. The equality tests of the parallel code
// take their tolerances from here, so that each bound follows from the numerics (what is summed,
// over how many terms, through how many stages) and not from what one machine happened to print.
//
// 1. A sum of n terms evaluated in any order has |computed − exact| ≤ γ(n−1)·Σ|terms|, with
//    γ(k) = k·u / (1 − k·u) and u the unit roundoff (2⁻²⁴ for fp32, 2⁻⁵³ for double) [Higham,
//    Accuracy and Stability of Numerical Algorithms, 2nd ed., section 4.2]. Two orders therefore differ by
//    at most 2·γ(n−1)·Σ|terms|: `sum_order_bound`.
//
// 2. A gradient element of a model is the end of a chain of such sums (norms, projections, the scan,
//    the softmax, then the same chain backwards and the sum over tokens). The worst case of (1) along
//    the chain, N·u with N the summed lengths, is far above what any order produces, because the
//    rounding errors are not all of one sign. The probabilistic analysis of Higham and Mary (SIAM J.
//    Sci. Comput. 41(5), 2019, Thms 2.4 and 3.1) bounds the error of a sum or inner product of n
//    terms by γ̃(n)·Σ|terms|, γ̃(n) = exp(λ·√n·u + n·u²/(1−u)) − 1 ≈ λ·√n·u, with probability at least
//    1 − 2n·exp(−λ²(1−u)²/2) when the rounding errors are mean-independent; a chain of sums is, along
//    each path through it, a product of (1+δ) factors like a sum of the chain's summed length N. We
//    take λ = 8 (failure probability 2N·e⁻³² ≈ 3e-11 per compared value for N ≈ 1000, so below 1e-3
//    over the ~1e7 values the MPI suites compare) and N from the model's dimensions
//    (`mamba_rounding_depth`): τ = 8·√N·u, 1.3e-5 to 1.9e-5 for the test models.
//    The bound is relative to the magnitudes of the terms, which we take to be those of the largest
//    value in the compared tensor (`per_tensor_bounds`): the largest elements of a tensor are not
//    themselves the result of heavy cancellation — an assumption, which the first step's
//    comparisons (same parameters in both runs) put to the test for every tensor. After optimizer
//    steps the two runs' parameters differ (item 3) and each gradient moves by its Hessian times
//    that difference, which is not bounded by the gradient's own tensor (a tensor whose gradient is
//    near zero, e.g. a layer's D, sees the drift of every parameter upstream); those comparisons
//    take the whole slab's largest gradient as the scale of the terms (`slab_bounds`), and the tests
//    check that premise at every step where the gradients are visible.
//
// 3. AdamW (decoupled decay) maps the clipped gradients ĝ_s = c_s·g_s to the update
//    u_t = m̂_t / (ŝ_t + ε), m̂_t = Σ_s a_ts·ĝ_s, ŝ_t = (Σ_s b_ts·ĝ_s²)^½, with weights
//    a_ts = (1−β₁)β₁^(t−s)/(1−β₁^t) and b_ts = (1−β₂)β₂^(t−s)/(1−β₂^t) that sum to 1. If the two runs'
//    clipped gradients differ by at most D_s per element, then |Δm̂| ≤ Σ a·D and (ŝ is a weighted
//    2-norm) |Δŝ| ≤ (Σ b·D²)^½, hence
//        |Δu| ≤ (|Δm̂|·(ŝ+ε) + |m̂|·|Δŝ|) / ((max(ŝ−|Δŝ|, 0) + ε)·(ŝ+ε)),
//    which is ≈ 2·D/ŝ where the gradient is well above its rounding and up to 2·D/ε where it is at
//    rounding level: there Adam turns a rounding difference into a parameter difference of order
//    lr·D/ε, and no tolerance relative to the tensor's scale can hold. The parameters then differ by
//    Δθ_t ≤ (1 − lr·λ_wd)·Δθ_(t−1) + lr·|Δu_t| plus the fp32 rounding of each run's update. D_s comes
//    from (2) and from the clip factors' difference: D = c·δ + |Δc|·(|g| + δ), δ the gradient bound,
//    |Δc| from the norms' difference ≤ ‖δ‖₂. `AdamWDifferenceBound` carries this recursion element
//    by element along the reference run. It is tight (≈ 2·lr·τ per step) for the elements whose
//    gradients are large, which is where an error of the optimizer's bookkeeping (moments of the
//    wrong shard, a missed step, a wrong learning rate or decay) shows.
#ifndef KMAMBA_TESTS_SUPPORT_ROUNDINGBOUNDS_HPP
#define KMAMBA_TESTS_SUPPORT_ROUNDINGBOUNDS_HPP

#include <kmamba/models/Config.hpp>
#include <kmamba/models/Optimizer.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace kmamba::test {

/// Unit roundoff of T (round to nearest): 2⁻²⁴ for float, 2⁻⁵³ for double.
template <class T>
constexpr double unit_roundoff() {
  return std::numeric_limits<T>::epsilon() / 2;
}

/// γ(k) = k·u / (1 − k·u).
template <class T>
double gamma(std::int64_t k) {
  const double ku = static_cast<double>(k) * unit_roundoff<T>();
  return ku / (1.0 - ku);
}

/// Two evaluations of a sum of n terms of type T in any two orders differ by at most this times
/// Σ|terms| (item 1 of the file comment).
template <class T>
double sum_order_bound(std::int64_t n) {
  return 2.0 * gamma<T>(std::max<std::int64_t>(n - 1, 0));
}

/// Higham–Mary's probabilistic bound λ·√N·u on the relative error of a computation of N dependent
/// fp32 roundings (item 2), λ = 8.
inline double probabilistic_bound(std::int64_t dependent_roundings, double lambda = 8.0) {
  return lambda * std::sqrt(static_cast<double>(dependent_roundings)) * unit_roundoff<float>();
}

/// N for a gradient element of a LanguageModel (or SequenceModel backbone) of `config` trained on
/// sequences of `seqlen` tokens, `tokens` of them in one optimizer step: the summed lengths of the
/// reductions along the longest path from the inputs through the loss back to a parameter's
/// gradient. Per layer, forward: RMSNorm (d_model), in_proj (d_model), the conv (d_conv), Mamba-1's
/// x_proj and dt_proj (d_inner, dt_rank), the scan (its recurrence over seqlen tokens and its output
/// over d_state·rank), the gated norm (d_inner / ngroups) and out_proj (d_inner); backward the same
/// reductions transposed (out_proj over d_model, in_proj over its outputs). The head: the final
/// norm, the LM head (d_model) and the softmax (vocab) each way; last, the sum over the step's tokens.
inline std::int64_t mamba_rounding_depth(const ModelConfig& c, std::int64_t seqlen, std::int64_t tokens) {
  const std::int64_t d = c.d_model, di = c.d_inner(), rank = c.is_mimo ? c.mimo_rank : 1;
  const std::int64_t groups = std::max(c.ngroups, 1), state = static_cast<std::int64_t>(c.d_state) * rank;
  const std::int64_t mamba1 = c.mixer == MixerKind::Mamba1 ? di + c.resolved_dt_rank() : 0;
  const std::int64_t in_proj_outputs = 2 * di + 2 * groups * state + c.num_heads();
  const std::int64_t scan = seqlen + state;
  const std::int64_t forward = d + d + c.d_conv + mamba1 + scan + di / groups + di;
  const std::int64_t backward = d + di / groups + scan + mamba1 + c.d_conv + in_proj_outputs + d;
  const std::int64_t head = (2 * d + c.vocab_size) + (c.vocab_size + d);
  return c.n_layer * (forward + backward) + head + tokens;
}

/// The gradient (or any) tolerance for `config` at `seqlen` and `tokens` per step: relative to each
/// tensor's largest |value| (item 2).
inline double model_tolerance(const ModelConfig& config, std::int64_t seqlen, std::int64_t tokens) {
  return probabilistic_bound(mamba_rounding_depth(config, seqlen, tokens));
}

/// Per-element bounds δ_i = tolerance · max over i's tensor of |values|, for a slab-layout vector.
/// `entries` has .offset and .size (ParameterSlab::entries()).
template <class Entries, class Values>
std::vector<double> per_tensor_bounds(const Entries& entries, const Values& values, double tolerance) {
  std::vector<double> out(static_cast<std::size_t>(values.extent(0)), 0.0);
  for (const auto& e : entries) {
    double scale = 0.0;
    for (std::size_t i = e.offset; i < e.offset + e.size; ++i) scale = std::max(scale, std::abs(double(values(i))));
    for (std::size_t i = e.offset; i < e.offset + e.size; ++i) out[i] = tolerance * scale;
  }
  return out;
}

/// δ_i = tolerance · max|values| over the whole vector, for every element (item 2: gradients after
/// optimizer steps).
template <class Values>
std::vector<double> slab_bounds(const Values& values, double tolerance) {
  double scale = 0.0;
  for (std::size_t i = 0; i < values.extent(0); ++i) scale = std::max(scale, std::abs(double(values(i))));
  return std::vector<double>(static_cast<std::size_t>(values.extent(0)), tolerance * scale);
}

/// |‖g'‖₂ − ‖g‖₂| ≤ ‖g' − g‖₂ ≤ ‖δ‖₂ for per-element bounds δ (the norms' own double sums add a
/// relative 2γ(n) of 2⁻⁵³, counted here too).
inline double norm_difference_bound(const std::vector<double>& delta, double norm) {
  double sum = 0.0;
  for (const double d : delta) sum += d * d;
  return std::sqrt(sum) + sum_order_bound<double>(static_cast<std::int64_t>(delta.size())) * norm;
}

/// |clip_scale(n') − clip_scale(n)| over |n' − n| ≤ dn (clip_scale does not increase with the norm).
inline double clip_scale_difference(double norm, double dn, double max_norm) {
  const double c = clip_scale(norm, max_norm);
  return std::max(clip_scale(std::max(norm - dn, 0.0), max_norm) - c, c - clip_scale(norm + dn, max_norm));
}

/// Item 3 of the file comment: element-wise bounds on the parameters' and moments' differences
/// between a reference AdamW run and a run whose gradients differ from it by at most δ per element,
/// carried step by step along the reference run.
class AdamWDifferenceBound {
 public:
  AdamWDifferenceBound(const AdamWConfig& config, std::size_t size, std::size_t decay_end)
      : config_(config),
        decay_end_(decay_end),
        m_(size, 0.0),
        v_(size, 0.0),
        dm_(size, 0.0),
        dv_(size, 0.0),
        dq_(size, 0.0),
        dtheta_(size, 0.0) {}

  /// One step of the reference: its raw gradients g (before clipping), clip factor `clip` with
  /// |Δclip| ≤ clip_error, per-element gradient bounds `delta`, learning rate `lr`, and its
  /// parameters after the step (for the fp32 rounding of the update). Each argument indexes the slab.
  template <class Grads, class Params>
  void step(const Grads& g, const std::vector<double>& delta, double clip, double clip_error, double lr,
            const Params& params_after) {
    ++t_;
    const double b1 = config_.beta1, b2 = config_.beta2, eps = config_.eps, u = unit_roundoff<float>();
    const double bias1 = 1.0 - std::pow(b1, static_cast<double>(t_)),
                 bias2 = 1.0 - std::pow(b2, static_cast<double>(t_));
    for (std::size_t i = 0; i < m_.size(); ++i) {
      const double gi = double(g(i)), gc = clip * gi;
      const double D = clip * delta[i] + clip_error * (std::abs(gi) + delta[i]);
      m_[i] = b1 * m_[i] + (1 - b1) * gc;
      v_[i] = b2 * v_[i] + (1 - b2) * gc * gc;
      // Stored moments: their difference plus each run's fp32 rounding of the update (2u each).
      dm_[i] = b1 * dm_[i] + (1 - b1) * D + 2 * u * std::abs(m_[i]);
      dv_[i] = b2 * dv_[i] + (1 - b2) * D * (2 * std::abs(gc) + D) + 2 * u * v_[i];
      dq_[i] = b2 * dq_[i] + (1 - b2) * D * D;
      const double mh = m_[i] / bias1, sh = std::sqrt(v_[i] / bias2);
      // ŝ's own rounding: v is rounded once per step (relative 2u), its square root once more.
      const double dmh = dm_[i] / bias1, dsh = std::sqrt(dq_[i] / bias2) + 2 * u * static_cast<double>(t_ + 1) * sh;
      const double lower = std::max(sh - dsh, 0.0) + eps;
      const double update = std::abs(mh) / (sh + eps);
      double du = (dmh * (sh + eps) + std::abs(mh) * dsh) / (lower * (sh + eps));
      du = std::min(du, update + (std::abs(mh) + dmh) / lower);  // neither update exceeds its own size
      const double decay = i < decay_end_ ? lr * config_.weight_decay : 0.0;
      // Each run rounds the decayed parameter, the quotient, and the subtraction (a few u each).
      const double rounding = 2 * u * (std::abs(double(params_after(i))) + 4 * lr * update);
      dtheta_[i] = (1 - decay) * dtheta_[i] + lr * du + rounding;
    }
  }

  double parameter(std::size_t i) const { return dtheta_[i]; }
  double first_moment(std::size_t i) const { return dm_[i]; }
  double second_moment(std::size_t i) const { return dv_[i]; }
  std::int64_t steps() const { return t_; }

 private:
  AdamWConfig config_;
  std::size_t decay_end_;
  std::vector<double> m_, v_;    // the reference's moments, in double
  std::vector<double> dm_, dv_;  // bounds on the stored moments' differences
  std::vector<double> dq_;       // Σ b·D², for the bound on Δŝ
  std::vector<double> dtheta_;   // bounds on the parameters' differences
  std::int64_t t_ = 0;
};

/// |got(i) − ref(i)| ≤ bound(i) for every element of every entry (.name, .offset, .size); one
/// failure per entry, naming its worst element. Returns the largest |got − ref| / bound.
template <class Entries, class Got, class Ref, class Bound>
double expect_within(const Entries& entries, const Got& got, const Ref& ref, const Bound& bound,
                     const std::string& what) {
  double worst = 0.0;
  for (const auto& entry : entries) {
    double entry_worst = 0.0;
    std::size_t at = entry.offset;
    for (std::size_t i = entry.offset; i < entry.offset + entry.size; ++i) {
      const double diff = std::abs(double(got(i)) - double(ref(i)));
      const double ratio = diff == 0.0 ? 0.0 : diff / bound(i);
      if (!(ratio <= entry_worst)) {
        entry_worst = ratio;
        at = i;
      }
    }
    EXPECT_LE(entry_worst, 1.0) << what << " " << entry.name << " element " << at - entry.offset << ": " << got(at)
                                << " vs " << ref(at) << ", bound " << bound(at);
    worst = std::max(worst, entry_worst);
  }
  return worst;
}

}  // namespace kmamba::test

#endif
