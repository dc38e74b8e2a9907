#include "ScalingModel.hpp"

#include <kmamba/core/Error.hpp>
#include <kmamba/parallel/GradientBuckets.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <utility>

namespace kmamba {
namespace perf {

double ring_factor(const std::string& collective, int ranks) {
  KMAMBA_REQUIRE(ranks >= 1, "kmamba::perf::ring_factor: ranks must be >= 1, got " << ranks);
  const double n = ranks;
  if (collective == "all_reduce") return 2.0 * (n - 1.0) / n;
  if (collective == "reduce_scatter" || collective == "all_gather") return (n - 1.0) / n;
  if (collective == "broadcast" || collective == "send_recv") return 1.0;
  KMAMBA_USER_ERROR("kmamba::perf::ring_factor: unknown collective '"
                    << collective << "' (all_reduce, reduce_scatter, all_gather, broadcast, send_recv)");
}

double AlphaBeta::time(double logical_bytes) const {
  return alpha + logical_bytes * ring_factor(collective, ranks) * beta;
}

AlphaBeta fit_alpha_beta(const std::vector<Sample>& samples) {
  KMAMBA_REQUIRE(samples.size() >= 2, "kmamba::perf::fit_alpha_beta: needs at least two sizes, got " << samples.size());
  AlphaBeta fit;
  fit.collective = samples.front().collective;
  fit.ranks = samples.front().ranks;
  const double factor = ring_factor(fit.collective, fit.ranks);
  KMAMBA_REQUIRE(factor > 0.0, "kmamba::perf::fit_alpha_beta: " << fit.collective << " on " << fit.ranks
                                                                << " rank moves no bytes; nothing to fit");
  // Weighted least squares with weights 1/t²: minimises Σ ((α + β·x − t) / t)².
  double sw = 0, swx = 0, swxx = 0, swt = 0, swxt = 0;
  for (const Sample& s : samples) {
    KMAMBA_REQUIRE(s.collective == fit.collective && s.ranks == fit.ranks,
                   "kmamba::perf::fit_alpha_beta: mixed samples ("
                       << s.collective << " on " << s.ranks << " ranks with " << fit.collective << " on " << fit.ranks
                       << ")");
    KMAMBA_REQUIRE(s.seconds > 0.0 && s.bytes > 0.0, "kmamba::perf::fit_alpha_beta: " << s.collective << " of "
                                                                                      << s.bytes << " bytes took "
                                                                                      << s.seconds << " s");
    const double x = s.bytes * factor, w = 1.0 / (s.seconds * s.seconds);
    sw += w;
    swx += w * x;
    swxx += w * x * x;
    swt += w * s.seconds;
    swxt += w * x * s.seconds;
  }
  const double det = sw * swxx - swx * swx;
  KMAMBA_REQUIRE(det > 0.0, "kmamba::perf::fit_alpha_beta: " << fit.collective << " on " << fit.ranks
                                                             << " ranks: the sizes must differ");
  fit.alpha = (swxx * swt - swx * swxt) / det;
  fit.beta = (sw * swxt - swx * swt) / det;
  if (fit.alpha < 0.0) {  // noise at small sizes: a latency cannot be negative
    fit.alpha = 0.0;
    fit.beta = swxt / swxx;
    fit.alpha_clamped = true;
  }
  for (const Sample& s : samples) {
    fit.bytes.push_back(s.bytes);
    fit.relative_error.push_back((fit.time(s.bytes) - s.seconds) / s.seconds);
  }
  return fit;
}

std::vector<AlphaBeta> fit_all(const std::vector<Sample>& samples) {
  std::map<std::pair<std::string, int>, std::vector<Sample>> groups;
  for (const Sample& s : samples) groups[{s.collective, s.ranks}].push_back(s);
  std::vector<AlphaBeta> fits;
  for (const auto& group : groups) {
    if (ring_factor(group.first.first, group.first.second) > 0.0) fits.push_back(fit_alpha_beta(group.second));
  }
  return fits;
}

CommModel::CommModel(std::vector<AlphaBeta> intra, double inter_alpha, double inter_bandwidth, int gpus_per_node)
    : intra_(std::move(intra)),
      inter_alpha_(inter_alpha),
      inter_bandwidth_(inter_bandwidth),
      gpus_per_node_(gpus_per_node) {
  KMAMBA_REQUIRE(gpus_per_node >= 1, "kmamba::perf::CommModel: gpus_per_node must be >= 1, got " << gpus_per_node);
  KMAMBA_REQUIRE(inter_alpha >= 0.0 && inter_bandwidth > 0.0,
                 "kmamba::perf::CommModel: the inter-node link needs alpha >= 0 and a positive bandwidth, got alpha "
                     << inter_alpha << " s, bandwidth " << inter_bandwidth << " B/s");
}

const AlphaBeta* CommModel::nearest(const std::string& collective, int n) const {
  const AlphaBeta* best = nullptr;
  for (const AlphaBeta& f : intra_) {
    if (f.collective != collective) continue;
    if (best == nullptr || std::abs(f.ranks - n) < std::abs(best->ranks - n) ||
        (std::abs(f.ranks - n) == std::abs(best->ranks - n) && f.ranks > best->ranks)) {
      best = &f;
    }
  }
  KMAMBA_REQUIRE(best != nullptr, "kmamba::perf::CommModel: no fit of " << collective << " in the sweep");
  return best;
}

double CommModel::intra(const std::string& collective, int n, double bytes) const {
  if (n <= 1) return 0.0;
  const AlphaBeta* f = nearest(collective, n);
  return f->alpha + bytes * ring_factor(collective, n) * f->beta;
}

double CommModel::inter(const std::string& collective, int k, double bytes) const {
  if (k <= 1) return 0.0;
  const double steps = collective == "all_reduce" ? 2.0 * (k - 1) : collective == "send_recv" ? 1.0 : k - 1.0;
  return steps * inter_alpha_ + bytes * ring_factor(collective, k) / inter_bandwidth_;
}

double CommModel::all_reduce(int group, int per_node, double bytes) const {
  KMAMBA_REQUIRE(
      per_node >= 1 && group % per_node == 0,
      "kmamba::perf::CommModel::all_reduce: " << per_node << " ranks per node do not divide a group of " << group);
  if (group == per_node) return intra("all_reduce", group, bytes);
  const int nodes = group / per_node;
  return intra("reduce_scatter", per_node, bytes) + inter("all_reduce", nodes, bytes / per_node) +
         intra("all_gather", per_node, bytes);
}

std::int64_t Shape::padded_vocab() const {
  const std::int64_t m = std::max(1, pad_vocab_size_multiple);
  return (vocab_size + m - 1) / m * m;
}

double parameter_count(const Shape& s) {
  const double d = s.d_model, di = s.d_inner(), H = s.nheads(), G = s.ngroups, N = s.d_state, K = s.d_conv;
  const double layer = d * (2 * di + 2 * G * N + H) + (di + 2 * G * N) * (K + 1) + 3 * H + di + di * d + d;
  return s.n_layer * layer + replicated_parameter_count(s);
}

double replicated_parameter_count(const Shape& s) {
  return static_cast<double>(s.padded_vocab()) * s.d_model + s.d_model;
}

double flops_per_token(const Shape& s) {
  const double Q = s.chunk_size, N = s.d_state, G = s.ngroups, P = s.headdim, H = s.nheads();
  return 6.0 * parameter_count(s) + 3.0 * s.n_layer * (2 * Q * N * G + 2 * Q * P * H + 4 * N * P * H);
}

namespace {

void check_layout(const CommModel& comm, const Workload& work, int gpus, int split, const char* what) {
  KMAMBA_REQUIRE(work.compute_s > 0.0 && work.tokens_per_gpu > 0.0,
                 "kmamba::perf: the workload needs the measured one-GPU step time and its tokens");
  KMAMBA_REQUIRE(split >= 1 && gpus % split == 0,
                 "kmamba::perf: " << what << " " << split << " does not divide " << gpus << " GPUs");
  KMAMBA_REQUIRE(gpus <= comm.gpus_per_node() || gpus % comm.gpus_per_node() == 0,
                 "kmamba::perf: " << gpus << " GPUs is not a whole number of " << comm.gpus_per_node() << "-GPU nodes");
}

// The DDP gradient all-reduce of `values` fp32 gradients per rank over `group` ranks, `per_node` of
// them on a node, in the buckets GradientReducer cuts.
double gradient_all_reduce(const CommModel& comm, const Workload& work, double values, int group, int per_node) {
  if (group <= 1) return 0.0;
  const double bucket = static_cast<double>(default_bucket_elements(group));
  const double buckets = std::ceil(values / bucket);
  return buckets * comm.all_reduce(group, per_node, values * work.bytes_per_value / buckets);
}

void finish(Prediction& p, const Workload& work) {
  const double comm = p.dp_comm + p.tp_comm + p.sp_comm;
  p.step = p.compute + comm;
  p.step_overlap = p.compute + p.tp_comm + p.sp_comm + std::max(0.0, p.dp_comm - work.backward_fraction * p.compute);
  const double flops = flops_per_token(work.shape) * p.tokens_per_step;
  p.tokens_per_s = p.tokens_per_step / p.step;
  p.tokens_per_s_overlap = p.tokens_per_step / p.step_overlap;
  p.mfu = flops / p.step / (p.gpus * work.peak_flops);
  p.mfu_overlap = flops / p.step_overlap / (p.gpus * work.peak_flops);
}

}  // namespace

Prediction predict_dp(const CommModel& comm, const Workload& work, int gpus) {
  check_layout(comm, work, gpus, 1, "dp");
  Prediction p;
  p.layout = "dp";
  p.gpus = p.dp = gpus;
  p.tokens_per_step = gpus * work.tokens_per_gpu;
  p.compute = work.compute_s;
  p.dp_comm = gradient_all_reduce(comm, work, parameter_count(work.shape), gpus, std::min(gpus, comm.gpus_per_node()));
  finish(p, work);
  return p;
}

Prediction predict_tp(const CommModel& comm, const Workload& work, int gpus, int tp) {
  check_layout(comm, work, gpus, tp, "tp");
  KMAMBA_REQUIRE(
      tp <= comm.gpus_per_node() && comm.gpus_per_node() % tp == 0,
      "kmamba::perf::predict_tp: tp " << tp << " must divide the " << comm.gpus_per_node() << " GPUs of a node");
  const Shape& s = work.shape;
  Prediction p;
  p.layout = "tp" + std::to_string(tp);
  p.gpus = gpus;
  p.tp = tp;
  p.dp = gpus / tp;
  p.tokens_per_step = p.dp * work.tokens_per_gpu;
  // The embedding and tied head are replicated on every tensor rank; the layers are split.
  const double all = parameter_count(s), replicated = replicated_parameter_count(s);
  const double head_share = 6.0 * replicated / flops_per_token(s);
  p.compute = work.compute_s * (head_share + (1.0 - head_share) / tp);
  const double activation = work.bytes_per_value * work.tokens_per_gpu * s.d_model;
  p.tp_comm = 2.0 * s.n_layer * comm.intra("all_reduce", tp, activation);
  p.dp_comm = gradient_all_reduce(comm, work, (all - replicated) / tp + replicated, p.dp,
                                  std::min(p.dp, comm.gpus_per_node() / tp));
  finish(p, work);
  return p;
}

Prediction predict_sp(const CommModel& comm, const Workload& work, int gpus, int sp, double seqlen) {
  check_layout(comm, work, gpus, sp, "sp");
  KMAMBA_REQUIRE(sp <= comm.gpus_per_node() ? comm.gpus_per_node() % sp == 0 : sp % comm.gpus_per_node() == 0,
                 "kmamba::perf::predict_sp: sp " << sp << " and the " << comm.gpus_per_node()
                                                 << " GPUs of a node must divide one another");
  const Shape& s = work.shape;
  Prediction p;
  p.layout = "sp" + std::to_string(sp) + "@" + std::to_string(static_cast<long long>(seqlen));
  p.gpus = gpus;
  p.sp = sp;
  p.dp = gpus / sp;
  p.seqlen = seqlen;
  p.tokens_per_step = p.dp * seqlen;
  p.compute = work.compute_s * (seqlen / sp) / work.tokens_per_gpu;
  // One hop of the chain, per direction: the conv halos of x, B and C (d_conv − 1 inputs each) and
  // the SSM state (nheads · headdim · d_state); a hop between nodes goes over the inter-node link.
  const double v = work.bytes_per_value, K1 = s.d_conv - 1;
  const std::vector<double> messages = {v * K1 * s.d_inner(), v * K1 * s.ngroups * s.d_state,
                                        v * K1 * s.ngroups * s.d_state,
                                        v * s.nheads() * s.headdim * static_cast<double>(s.d_state)};
  double hop_intra = 0.0, hop_inter = 0.0;
  for (double m : messages) {
    hop_intra += comm.intra("send_recv", std::min(sp, comm.gpus_per_node()), m);
    hop_inter += comm.inter("send_recv", 2, m);
  }
  const int hops = sp - 1;
  const int crossings = sp > comm.gpus_per_node() ? sp / comm.gpus_per_node() - 1 : 0;
  const double serial_layer = work.serial_fraction * p.compute / s.n_layer;
  p.sp_comm = sp > 1 ? hops * serial_layer + 2.0 * ((hops - crossings) * hop_intra + crossings * hop_inter) : 0.0;
  p.dp_comm = gradient_all_reduce(comm, work, parameter_count(s), gpus, std::min(gpus, comm.gpus_per_node()));
  finish(p, work);
  return p;
}

}  // namespace perf
}  // namespace kmamba
