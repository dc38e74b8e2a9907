#include "ScalingModel.hpp"

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Files.hpp>
#include <kmamba/core/Json.hpp>
#include <kmamba/parallel/GradientBuckets.hpp>
#include <kmamba/parallel/PowerSgd.hpp>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <numeric>
#include <utility>

#include <nlohmann/json.hpp>

namespace kmamba {
namespace perf {

std::vector<Sample> read_sweep(const std::string& path, const std::string& tool) {
  const std::string text = read_input_file(path, JsonLimits().max_bytes, tool.c_str());
  const nlohmann::json doc = parse_json(text, tool + ": '" + path + "'");
  std::vector<Sample> samples;
  try {
    const int ranks = doc.at("ranks").get<int>();
    for (const auto& r : doc.at("results").get<std::vector<nlohmann::json>>()) {
      samples.push_back({r.at("collective").get<std::string>(), ranks, r.at("bytes").get<double>(),
                         r.at("time_us").get<double>() * 1e-6});
    }
  } catch (const nlohmann::json::exception& e) {
    KMAMBA_USER_ERROR(tool << ": '" << path << "' is not a kmamba-perf-comm result ({\"ranks\": N, "
                           << "\"results\": [{\"collective\": NAME, \"bytes\": B, \"time_us\": T}, "
                           << "...]}): " << e.what());
  }
  return samples;
}

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

std::vector<AlphaBeta> assumed_fits(int ranks, double alpha, double bandwidth) {
  std::vector<AlphaBeta> fits;
  for (const char* c : {"all_reduce", "reduce_scatter", "all_gather", "send_recv"}) {
    AlphaBeta f;
    f.collective = c;
    f.ranks = std::max(2, ranks);
    f.alpha = alpha;
    f.beta = 1.0 / bandwidth;
    fits.push_back(f);
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

// The all-reduce of `values` values of `value_bytes` bytes per rank over `group` ranks, `per_node`
// of them on a node, in the buckets GradientReducer cuts.
double bucket_all_reduce(const CommModel& comm, double values, double value_bytes, int group, int per_node) {
  if (group <= 1 || values <= 0.0) return 0.0;
  const double bucket = static_cast<double>(default_bucket_elements(group));
  const double buckets = std::ceil(values / bucket);
  return buckets * comm.all_reduce(group, per_node, values * value_bytes / buckets);
}

// The workload's gradient reduction of `blocks` over `group` ranks into p.dp_comm (all of it) and
// p.dp_fixed (what no backward hides).
void reduce_gradients(Prediction& p, const CommModel& comm, const Workload& work,
                      const std::vector<ParameterBlock>& blocks, int group, int per_node) {
  const GradientWire wire{work.compression, work.powersgd_rank, 0};
  const ReductionTime r = gradient_reduction(comm, blocks, group, per_node, wire, work.memory_bandwidth);
  p.dp_comm = r.hideable + r.exposed;
  p.dp_fixed = r.exposed;
}

std::vector<ParameterBlock> all_blocks(const ModelCosts& costs, int t) {
  std::vector<ParameterBlock> blocks;
  for (int l = 0; l < costs.n_layer; ++l) {
    for (const ParameterBlock& b : costs.layer) blocks.push_back(b.on_tensor_rank(t));
  }
  blocks.insert(blocks.end(), costs.outer.begin(), costs.outer.end());
  return blocks;
}

// One GPU holding every layer, training the workload's tokens per step as one micro-batch.
StageLoad whole_model(const Workload& work, int tp) {
  StageLoad stage;
  stage.layers = work.shape.n_layer;
  stage.tokens = work.tokens_per_gpu;
  stage.tp = tp;
  return stage;
}

void finish(Prediction& p, const Workload& work) {
  const double comm = p.dp_comm + p.tp_comm + p.sp_comm + p.pp_comm;
  p.step = p.compute + comm;
  p.step_overlap = p.compute + p.tp_comm + p.sp_comm + p.pp_comm + p.dp_fixed +
                   std::max(0.0, p.dp_comm - p.dp_fixed - work.backward_fraction * p.compute);
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
  reduce_gradients(p, comm, work, all_blocks(model_costs(work.shape), 1), gpus, std::min(gpus, comm.gpus_per_node()));
  p.memory =
      memory_per_gpu(model_costs(work.shape), whole_model(work, 1), {work.compression, work.powersgd_rank, 0}).total();
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
  const double replicated = replicated_parameter_count(s);
  const double head_share = 6.0 * replicated / flops_per_token(s);
  p.compute = work.compute_s * (head_share + (1.0 - head_share) / tp);
  const double activation = work.bytes_per_value * work.tokens_per_gpu * s.d_model;
  p.tp_comm = 2.0 * s.n_layer * comm.intra("all_reduce", tp, activation);
  reduce_gradients(p, comm, work, all_blocks(model_costs(s), tp), p.dp, std::min(p.dp, comm.gpus_per_node() / tp));
  StageLoad stage = whole_model(work, tp);
  p.memory = memory_per_gpu(model_costs(s), stage, {work.compression, work.powersgd_rank, 0}).total();
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
  const ModelCosts costs = model_costs(s);
  const double overhead = sp > 1 ? costs.sp_scan_overhead * work.serial_fraction : 0.0;
  p.compute = work.compute_s * (seqlen / sp) / work.tokens_per_gpu * (1.0 + overhead);
  p.sp_comm = s.n_layer * sequence_parallel_seconds(comm, costs, 1.0, sp, false, sp > comm.gpus_per_node());
  reduce_gradients(p, comm, work, all_blocks(model_costs(s), 1), gpus, std::min(gpus, comm.gpus_per_node()));
  StageLoad stage = whole_model(work, 1);
  stage.tokens = seqlen / sp;
  p.memory = memory_per_gpu(model_costs(s), stage, {work.compression, work.powersgd_rank, 0}).total();
  finish(p, work);
  return p;
}

Prediction predict_pp(const CommModel& comm, const Workload& work, int gpus, int pp, int micro_batches) {
  check_layout(comm, work, gpus, pp, "pp");
  const Shape& s = work.shape;
  KMAMBA_REQUIRE(pp <= s.n_layer && micro_batches >= 1, "kmamba::perf::predict_pp: pp "
                                                            << pp << " stages of " << s.n_layer << " layers, "
                                                            << micro_batches << " micro-batches");
  Prediction p;
  p.layout = "pp" + std::to_string(pp) + "m" + std::to_string(micro_batches);
  p.gpus = gpus;
  p.pp = pp;
  p.dp = gpus / pp;
  p.micro_batches = micro_batches;
  p.bubble = pipeline_bubble(pp, micro_batches);
  p.tokens_per_step = p.dp * pp * work.tokens_per_gpu;
  // Each stage's share of a micro-batch's compute: its layers', and the head's on the last stage.
  const double head_share = 6.0 * replicated_parameter_count(s) / flops_per_token(s);
  const std::vector<int> layers = stage_layers(s.n_layer, pp);
  const double micro_tokens = pp * work.tokens_per_gpu / micro_batches;
  const double per_token = work.compute_s / work.tokens_per_gpu;
  double slowest = 0.0;
  for (int k = 0; k < pp; ++k) {
    const double share = (1.0 - head_share) * layers[k] / s.n_layer + (k == pp - 1 ? head_share : 0.0);
    slowest = std::max(slowest, share * micro_tokens * per_token);
  }
  const double slots = micro_batches + pp - 1.0;
  p.compute = slots * slowest;
  // Stage neighbours are dp ranks apart (pp outermost): across nodes when dp fills a node.
  const bool across = p.dp >= comm.gpus_per_node();
  p.pp_comm = pp > 1 ? slots * pipeline_send_seconds(comm, micro_tokens, s.d_model, across) : 0.0;
  const ModelCosts costs = model_costs(s);
  const int per_node = std::gcd(p.dp, comm.gpus_per_node());  // the dp ranks of a stage on one node
  double memory = 0.0;
  for (int k = 0; k < pp; ++k) {
    std::vector<ParameterBlock> blocks;
    for (int l = 0; l < layers[k]; ++l) blocks.insert(blocks.end(), costs.layer.begin(), costs.layer.end());
    if (k == 0 || k == pp - 1) blocks.insert(blocks.end(), costs.outer.begin(), costs.outer.end());
    if (k == pp - 1) reduce_gradients(p, comm, work, blocks, p.dp, per_node);
    StageLoad stage;
    stage.layers = layers[k];
    stage.first = k == 0;
    stage.last = k == pp - 1;
    stage.in_flight = std::min(micro_batches, pp - k);
    stage.tokens = micro_tokens;
    memory = std::max(memory, memory_per_gpu(costs, stage, {work.compression, work.powersgd_rank, 0}).total());
  }
  p.memory = memory;
  finish(p, work);
  return p;
}

double pipeline_bubble(int stages, int micro_batches) {
  KMAMBA_REQUIRE(stages >= 1 && micro_batches >= 1,
                 "kmamba::perf::pipeline_bubble: " << stages << " stages, " << micro_batches << " micro-batches");
  return (stages - 1.0) / (micro_batches + stages - 1.0);
}

ParameterBlock ParameterBlock::on_tensor_rank(int t) const {
  ParameterBlock b = *this;
  if (split_axis == 0) b.rows /= t;
  if (split_axis == 1) b.cols /= t;
  return b;
}

double ModelCosts::layer_parameters() const {
  double n = 0.0;
  for (const ParameterBlock& b : layer) n += b.elements();
  return n;
}

double ModelCosts::outer_parameters() const {
  double n = 0.0;
  for (const ParameterBlock& b : outer) n += b.elements();
  return n;
}

ModelCosts model_costs(const Shape& s) {
  const double d = s.d_model, di = s.d_inner(), H = s.nheads(), GN = double(s.ngroups) * s.d_state, K = s.d_conv;
  const double W2 = 2 * di + 2 * GN + H, conv = di + 2 * GN;
  ModelCosts c;
  c.n_layer = s.n_layer;
  c.d_model = s.d_model;
  c.padded_vocab = static_cast<double>(s.padded_vocab());
  c.layer = {{W2, d, true, 0}, {conv, K, true, 0}, {conv, 1, false, 0}, {H, 1, false, 0}, {H, 1, false, 0},
             {H, 1, false, 0}, {di, 1, false, 0},  {d, di, true, 1},    {d, 1, false, -1}};
  c.outer = {{c.padded_vocab, d, true, -1}, {d, 1, false, -1}};
  const double P = s.headdim, N = s.d_state, Q = s.chunk_size;
  c.scan_units = di * N;
  c.activation_bytes = kept_activation_bytes(c, di, 4.0 * H * P * N / Q);  // a state (H·P·N) per chunk
  c.state_bytes = 4.0 * H * (1.0 + P * N);
  c.halo_bytes = 4.0 * (K - 1) * conv;
  return c;
}

double kept_activation_bytes(const ModelCosts& costs, double d_inner, double chunk_state_bytes) {
  double outputs = 0.0;
  for (const ParameterBlock& b : costs.layer) {
    if (b.matrix && b.split_axis != 1) outputs += b.rows;
  }
  return 4.0 * (2.0 * costs.d_model + 2.0 * d_inner + outputs) + chunk_state_bytes;
}

double powersgd_values(const std::vector<ParameterBlock>& blocks, int rank) {
  double values = 0.0;
  for (const ParameterBlock& b : blocks) {
    const auto rows = static_cast<std::int64_t>(b.rows), cols = static_cast<std::int64_t>(b.cols);
    values += b.matrix && powersgd_compresses(rows, cols, rank) ? rank * (b.rows + b.cols) : b.elements();
  }
  return values;
}

ReductionTime gradient_reduction(const CommModel& comm, const std::vector<ParameterBlock>& blocks, int group,
                                 int per_node, const GradientWire& wire, double memory_bandwidth) {
  ReductionTime r;
  if (group <= 1) return r;
  double elements = 0.0;
  for (const ParameterBlock& b : blocks) elements += b.elements();
  if (wire.compression != GradientCompression::PowerSgd) {
    const double bytes = wire.compression == GradientCompression::Bf16 ? 2.0 : 4.0;
    r.hideable = bucket_all_reduce(comm, elements, bytes, group, per_node);
    // ZeRO-1: the reduce-scatter is half of the all-reduce's bytes; the all-gather of the updated
    // parameters after the step is the other half and waits for the optimizer.
    if (wire.zero_stage == 1) r.exposed = r.hideable / 2, r.hideable /= 2;
    return r;
  }
  double p_values = 0.0, q_values = 0.0, compressed = 0.0;
  for (const ParameterBlock& b : blocks) {
    const auto rows = static_cast<std::int64_t>(b.rows), cols = static_cast<std::int64_t>(b.cols);
    if (b.matrix && powersgd_compresses(rows, cols, wire.powersgd_rank)) {
      p_values += wire.powersgd_rank * b.rows;
      q_values += wire.powersgd_rank * b.cols;
      compressed += b.elements();
    } else {
      p_values += b.elements();
    }
  }
  r.exposed = comm.all_reduce(group, per_node, 4.0 * p_values) + comm.all_reduce(group, per_node, 4.0 * q_values) +
              9.0 * 4.0 * compressed / memory_bandwidth;
  return r;
}

std::vector<int> stage_layers(int n_layer, int stages) {
  KMAMBA_REQUIRE(stages >= 1 && stages <= n_layer,
                 "kmamba::perf::stage_layers: " << stages << " pipeline stages for " << n_layer
                                                << " layers (each stage needs at least one)");
  std::vector<int> layers(static_cast<std::size_t>(stages), n_layer / stages);
  for (int k = 0; k < n_layer % stages; ++k) ++layers[static_cast<std::size_t>(k)];
  return layers;
}

MemoryTerms memory_per_gpu(const ModelCosts& costs, const StageLoad& stage, const GradientWire& wire) {
  double params = 0.0, compressible = 0.0, factors = 0.0;
  auto hold = [&](const ParameterBlock& b) {
    params += b.elements();
    const auto rows = static_cast<std::int64_t>(b.rows), cols = static_cast<std::int64_t>(b.cols);
    if (b.matrix && powersgd_compresses(rows, cols, wire.powersgd_rank)) {
      compressible += b.elements();
      factors += wire.powersgd_rank * (b.rows + b.cols);
    }
  };
  for (int l = 0; l < stage.layers; ++l) {
    for (const ParameterBlock& b : costs.layer) hold(b.on_tensor_rank(stage.tp));
  }
  // The embedding on the first stage; the last holds the tied head, its own copy of it.
  if (stage.first || stage.last) {
    for (const ParameterBlock& b : costs.outer) hold(b);
  }
  MemoryTerms m;
  m.weights = 4.0 * params;
  m.gradients = 4.0 * params;
  m.optimizer = 8.0 * params / (wire.zero_stage == 1 ? stage.zero_group : 1);
  if (wire.compression == GradientCompression::PowerSgd) m.compression = 4.0 * (compressible + factors);
  const double layer_bytes = costs.activation_bytes * stage.tokens / stage.tp;
  const double kept = stage.checkpointing ? stage.layers * 4.0 * (costs.d_model + 1.0) * stage.tokens + layer_bytes
                                          : stage.layers * layer_bytes;
  m.activations = stage.in_flight * kept;
  if (stage.last) m.logits = 4.0 * costs.padded_vocab * stage.tokens;
  return m;
}

double tensor_parallel_seconds(const CommModel& comm, double tokens, int d_model, int t, bool checkpointing) {
  if (t <= 1) return 0.0;
  return (checkpointing ? 3.0 : 2.0) * comm.intra("all_reduce", t, 4.0 * tokens * d_model);
}

double sequence_parallel_seconds(const CommModel& comm, const ModelCosts& costs, double sequences, int c,
                                 bool checkpointing, bool across_nodes) {
  if (c <= 1) return 0.0;
  const auto hop = [&](double bytes) {
    return across_nodes ? comm.inter("send_recv", 2, bytes) : comm.intra("send_recv", 2, bytes);
  };
  const double rounds = std::ceil(std::log2(static_cast<double>(c)));
  const double direction = rounds * hop(sequences * costs.state_bytes) + (c - 1.0) * hop(sequences * costs.halo_bytes);
  return (checkpointing ? 3.0 : 2.0) * direction;
}

double pipeline_send_seconds(const CommModel& comm, double tokens, int d_model, bool across_nodes) {
  const double bytes = 4.0 * tokens * d_model;
  return 2.0 * (across_nodes ? comm.inter("send_recv", 2, bytes) : comm.intra("send_recv", 2, bytes));
}

}  // namespace perf
}  // namespace kmamba
