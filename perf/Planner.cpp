#include "Planner.hpp"

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Files.hpp>
#include <kmamba/core/Json.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <sstream>
#include <utility>

namespace kmamba {
namespace perf {
namespace {

using json = nlohmann::json;

// How tensor parallelism shards a mixer parameter (docs/distributed.md §1): out_proj by its
// columns (row parallel), Mamba-3's shared B/C norms not at all, everything else by its first
// extent (heads, channels, in_proj's per-rank row blocks).
int split_axis_of(const std::string& name) {
  if (name == "out_proj.weight") return 1;
  if (name == "B_norm.weight" || name == "C_norm.weight") return -1;
  return 0;
}

std::vector<int> divisors(int n) {
  std::vector<int> out;
  for (int k = 1; k <= n; ++k) {
    if (n % k == 0) out.push_back(k);
  }
  return out;
}

bool allowed(const std::vector<int>& values, int v) {
  return values.empty() || std::find(values.begin(), values.end(), v) != values.end();
}

double dense_parameters(const ModelCosts& c) { return c.n_layer * c.layer_parameters() + c.outer_parameters(); }

}  // namespace

ModelCosts model_costs(const ModelConfig& config) {
  const auto mixer = make_mixer<Kokkos::DefaultHostExecutionSpace>(config, "");
  ParameterSlab<Kokkos::HostSpace> slab;  // declared only: nothing is allocated
  mixer->declare_parameters(slab);
  ModelCosts c;
  c.n_layer = config.n_layer;
  c.d_model = config.d_model;
  c.padded_vocab = config.padded_vocab_size();
  for (const auto& e : slab.entries()) {
    ParameterBlock b;
    b.rows = static_cast<double>(e.shape[0]);
    for (std::size_t k = 1; k < e.shape.size(); ++k) b.cols *= static_cast<double>(e.shape[k]);
    b.matrix = e.shape.size() >= 2;
    b.split_axis = split_axis_of(e.name);
    c.layer.push_back(b);
  }
  const double d = config.d_model, di = config.d_inner(), N = config.d_state, K = config.d_conv;
  c.layer.push_back({d, 1, false, -1});  // the block's norm
  c.outer.push_back({c.padded_vocab, d, true, -1});
  if (!config.tie_embeddings) c.outer.push_back({c.padded_vocab, d, true, -1});
  c.outer.push_back({d, 1, false, -1});
  const double H = config.num_heads(), P = config.headdim, R = config.is_mimo ? config.mimo_rank : 1;
  if (config.mixer == MixerKind::Mamba1) {
    c.scan_units = di * N;
    c.activation_bytes = kept_activation_bytes(c, di, 0.0);
    c.state_bytes = 4.0 * 2.0 * di * N;
    c.halo_bytes = 4.0 * (K - 1) * di;
    // The correction and its gradient: about two forward scans (perf/RESULTS.md, Mamba-1 on sp).
    c.sp_scan_overhead = 0.5;
    return c;
  }
  c.scan_units = di * N * R;
  c.activation_bytes = kept_activation_bytes(c, di, 4.0 * H * P * N / config.chunk_size);
  c.state_bytes = 4.0 * H * (1.0 + P * N);
  c.halo_bytes =
      config.mixer == MixerKind::Mamba2 ? 4.0 * (K - 1) * (di + 2.0 * config.ngroups * N) : 4.0 * H * R * (N + P);
  return c;
}

Measurements default_measurements() {
  Measurements m;
  ModelConfig& s = m.step_model;  // mamba2-130m
  s.mixer = MixerKind::Mamba2;
  s.d_model = 768;
  s.n_layer = 24;
  s.vocab_size = 50277;
  s.pad_vocab_size_multiple = 16;
  s.d_state = 128;
  s.headdim = 64;
  s.chunk_size = 256;
  m.step_tokens = 8.0 * 2048;
  m.step_seconds = 137.3e-3;
  const double b8_l4096 = 8.0 * 4096;
  m.scan_seconds_per_unit[mixer_name(MixerKind::Mamba2)] = 5.008e-3 / (b8_l4096 * 32 * 64 * 128);
  m.scan_seconds_per_unit[mixer_name(MixerKind::Mamba3)] = 12.65e-3 / (b8_l4096 * 32 * 64 * 128);
  m.scan_seconds_per_unit[mixer_name(MixerKind::Mamba1)] = (1.689e-3 + 6.855e-3) / (b8_l4096 * 1536 * 16);
  m.source = "built-in: H100 80GB HBM3, perf/RESULTS.md session 21 (mamba2-130m step, bf16, 8 x 2048: 137.3 ms)";
  return m;
}

void read_step_json(const std::string& path, Measurements& m) {
  const json doc =
      parse_json(read_input_file(path, JsonLimits().max_bytes, "kmamba-plan"), "kmamba-plan: '" + path + "'");
  try {
    KMAMBA_REQUIRE(doc.at("tool").get<std::string>() == "kmamba-perf-train",
                   "kmamba-plan: '" << path << "' is not a kmamba-perf-train --json result");
    KMAMBA_REQUIRE(doc.at("ranks").get<int>() == 1, "kmamba-plan: '" << path << "' was measured on "
                                                                     << doc.at("ranks").get<int>()
                                                                     << " ranks; the step must be one GPU's");
    ModelConfig c;
    const std::string mixer = doc.at("mixer").get<std::string>();
    c.mixer = mixer == mixer_name(MixerKind::Mamba1)   ? MixerKind::Mamba1
              : mixer == mixer_name(MixerKind::Mamba3) ? MixerKind::Mamba3
                                                       : MixerKind::Mamba2;
    c.d_model = doc.at("d_model").get<int>();
    c.n_layer = doc.at("n_layer").get<int>();
    c.ngroups = doc.at("ngroups").get<int>();
    c.d_state = doc.at("d_state").get<int>();
    c.headdim = doc.at("headdim").get<int>();
    c.expand = doc.at("expand").get<int>();
    c.chunk_size = doc.at("chunk_size").get<int>();
    c.vocab_size = doc.at("vocab_size").get<int>();
    c.pad_vocab_size_multiple = doc.at("pad_vocab_size_multiple").get<int>();
    c.validate();
    m.step_model = c;
    m.step_tokens = doc.at("tokens_per_step").get<double>();
    m.step_seconds = doc.at("step_ms").get<double>() * 1e-3;
  } catch (const json::exception& e) {
    KMAMBA_USER_ERROR("kmamba-plan: '" << path << "' is not a kmamba-perf-train --json result (" << e.what() << ")");
  }
  KMAMBA_REQUIRE(m.step_tokens > 0 && m.step_seconds > 0, "kmamba-plan: '" << path << "' holds no timed step");
  m.source = "step: " + path;
}

void read_kernel_json(const std::string& path, const std::string& precision, Measurements& m) {
  const json doc =
      parse_json(read_input_file(path, JsonLimits().max_bytes, "kmamba-plan"), "kmamba-plan: '" + path + "'");
  // Per mixer: seconds and units of its forward + backward rows, in the precision asked for and in fp32.
  const std::vector<std::pair<MixerKind, std::string>> cases = {
      {MixerKind::Mamba2, "ssd"}, {MixerKind::Mamba3, "mamba3 siso"}, {MixerKind::Mamba1, "selective_scan"}};
  try {
    KMAMBA_REQUIRE(doc.at("tool").get<std::string>() == "kmamba-perf",
                   "kmamba-plan: '" << path << "' is not a kmamba-perf --json result");
    for (const auto& [mixer, name] : cases) {
      for (const std::string& suffix : {precision == "fp32" ? std::string() : " " + precision, std::string()}) {
        double seconds = 0.0, units = 0.0;
        for (const json& row : doc.at("rows")) {
          const std::string c = row.at("case").get<std::string>();
          if (c != name + " fwd" + suffix && c != name + " bwd" + suffix) continue;
          seconds += row.at("seconds").get<double>();
          units = row.at("scan_units").get<double>();
        }
        if (seconds <= 0.0 || units <= 0.0) continue;
        m.scan_seconds_per_unit[mixer_name(mixer)] = seconds / units;
        m.source += (m.source.empty() ? "" : "; ") + std::string("scans: ") + path;
        break;
      }
    }
  } catch (const json::exception& e) {
    KMAMBA_USER_ERROR("kmamba-plan: '" << path << "' is not a kmamba-perf --json result (" << e.what() << ")");
  }
}

ComputeRates compute_rates(const Measurements& m, MixerKind mixer) {
  const auto rate = [&](MixerKind kind) {
    const auto it = m.scan_seconds_per_unit.find(mixer_name(kind));
    KMAMBA_REQUIRE(it != m.scan_seconds_per_unit.end(), "kmamba-plan: no measured scan time of a "
                                                            << mixer_name(kind)
                                                            << " model (a kmamba-perf --json file with its case)");
    return it->second;
  };
  const ModelCosts step = model_costs(m.step_model);
  const double scans = m.step_tokens * step.n_layer * step.scan_units * rate(m.step_model.mixer);
  ComputeRates r;
  r.scan_seconds_per_unit = rate(mixer);
  r.seconds_per_flop = (m.step_seconds - scans) / (6.0 * dense_parameters(step) * m.step_tokens);
  KMAMBA_REQUIRE(r.seconds_per_flop > 0.0, "kmamba-plan: the measured scans ("
                                               << scans * 1e3 << " ms) take the whole measured step ("
                                               << m.step_seconds * 1e3
                                               << " ms): measure the step and the kernels on the same device");
  return r;
}

namespace {

// A micro-batch on one rank of one stage of `layers` blocks (and the head on the last stage):
// its compute and its layers' tp and sp communication.
struct StageTime {
  double compute = 0.0, tp = 0.0, sp = 0.0;
  double total() const { return compute + tp + sp; }
};

StageTime stage_time(const PlanRequest& q, const ModelCosts& c, const CommModel& comm, const ComputeRates& rates,
                     const Plan& p, int layers, bool last) {
  const double tokens = static_cast<double>(p.micro_batch) * q.seqlen / p.sp;
  const double overhead = p.sp > 1 ? c.sp_scan_overhead : 0.0;
  const double scan = c.scan_units / p.tp * rates.scan_seconds_per_unit * (1.0 + overhead);
  const double dense = 6.0 * c.layer_parameters() / p.tp * rates.seconds_per_flop;
  // Recomputing a block repeats its forward, a third of its forward + backward.
  const double recompute = p.checkpointing ? 4.0 / 3.0 : 1.0;
  StageTime t;
  t.compute = layers * tokens * (scan + dense) * recompute;
  if (last) t.compute += tokens * 6.0 * c.outer_parameters() * rates.seconds_per_flop;
  t.tp = layers * tensor_parallel_seconds(comm, tokens, c.d_model, p.tp, p.checkpointing);
  const bool sp_across = p.tp * p.sp > comm.gpus_per_node();
  t.sp = layers * sequence_parallel_seconds(comm, c, p.micro_batch, p.sp, p.checkpointing, sp_across);
  return t;
}

// The ranks of a dp × sp group (same tp and pp coordinates, tp apart) on one node.
int reduction_ranks_per_node(const CommModel& comm, const Plan& p) {
  const int group = p.dp * p.sp;
  const int per_node = p.tp >= comm.gpus_per_node() ? 1 : comm.gpus_per_node() / p.tp;
  return std::gcd(group, per_node);
}

Plan evaluate(const PlanRequest& q, const ModelCosts& c, const CommModel& comm, const ComputeRates& rates,
              const Plan& layout) {
  Plan p = layout;
  const std::vector<int> layers = stage_layers(c.n_layer, p.pp);
  const GradientWire wire{p.compression, p.powersgd_rank, p.zero_stage};
  const double slots = p.grad_accum + p.pp - 1.0;
  StageTime slowest;
  double reduction = 0.0, memory = -1.0;
  for (int k = 0; k < p.pp; ++k) {
    const bool first = k == 0, last = k == p.pp - 1;
    const StageTime t = stage_time(q, c, comm, rates, p, layers[k], last);
    if (t.total() > slowest.total()) slowest = t;
    std::vector<ParameterBlock> blocks;
    for (int l = 0; l < layers[k]; ++l) {
      for (const ParameterBlock& b : c.layer) blocks.push_back(b.on_tensor_rank(p.tp));
    }
    if (first || last) blocks.insert(blocks.end(), c.outer.begin(), c.outer.end());
    const ReductionTime r =
        gradient_reduction(comm, blocks, p.dp * p.sp, reduction_ranks_per_node(comm, p), wire, q.memory_bandwidth);
    reduction = std::max(reduction, r.exposed + std::max(0.0, r.hideable - q.backward_fraction * t.compute));
    StageLoad stage;
    stage.layers = layers[k];
    stage.first = first;
    stage.last = last;
    stage.in_flight = std::min(p.grad_accum, p.pp - k);
    stage.tokens = static_cast<double>(p.micro_batch) * q.seqlen / p.sp;
    stage.tp = p.tp;
    stage.zero_group = p.dp * p.sp;
    stage.checkpointing = p.checkpointing;
    const MemoryTerms m = memory_per_gpu(c, stage, wire);
    if (m.total() > memory) memory = m.total(), p.memory = m;
  }
  // Stage neighbours are tp · sp · dp ranks apart (pp outermost).
  const bool pp_across = p.tp * p.sp * p.dp >= comm.gpus_per_node();
  const double tokens = static_cast<double>(p.micro_batch) * q.seqlen / p.sp;
  p.compute = slots * slowest.compute;
  p.tp_comm = slots * slowest.tp;
  p.sp_comm = slots * slowest.sp;
  p.pp_comm = p.pp > 1 ? slots * pipeline_send_seconds(comm, tokens, c.d_model, pp_across) : 0.0;
  p.dp_comm = reduction;
  p.bubble = pipeline_bubble(p.pp, p.grad_accum);
  p.step = p.compute + p.tp_comm + p.sp_comm + p.pp_comm + p.dp_comm;
  p.tokens_per_s = static_cast<double>(q.global_batch) * q.seqlen / p.step;
  return p;
}

// Every (zero, checkpointing, compression) variant of one mesh and micro-batch into `out`.
void add_variants(const PlanRequest& q, const ModelCosts& c, const CommModel& comm, const ComputeRates& rates,
                  Plan layout, std::vector<Plan>& out) {
  const bool reduces = layout.dp * layout.sp > 1;
  for (int zero : {0, 1}) {
    if (!allowed(q.zero_stages, zero) || (zero == 1 && !reduces)) continue;
    for (bool checkpointing : q.checkpointing) {
      for (GradientCompression compression : q.compression) {
        if (compression != GradientCompression::None && !reduces) continue;
        layout.zero_stage = zero;
        layout.checkpointing = checkpointing;
        layout.compression = compression;
        layout.powersgd_rank = q.powersgd_rank;
        out.push_back(evaluate(q, c, comm, rates, layout));
      }
    }
  }
}

void check_request(const PlanRequest& q) {
  KMAMBA_REQUIRE(q.gpus >= 1 && q.gpus_per_node >= 1 && (q.gpus <= q.gpus_per_node || q.gpus % q.gpus_per_node == 0),
                 "kmamba-plan: " << q.gpus << " GPUs is not a whole number of " << q.gpus_per_node << "-GPU nodes");
  KMAMBA_REQUIRE(q.seqlen >= 1 && q.global_batch >= 1 && q.memory_bytes > 0.0,
                 "kmamba-plan: the sequence length, the global batch and the memory must be positive");
}

}  // namespace

Plan evaluate_plan(const PlanRequest& request, const CommModel& comm, const ComputeRates& rates, const Plan& layout) {
  check_request(request);
  KMAMBA_REQUIRE(layout.pp * layout.dp * layout.tp * layout.sp == request.gpus &&
                     layout.dp * layout.grad_accum * layout.micro_batch == request.global_batch,
                 "kmamba-plan: plan " << layout.describe() << " does not fit " << request.gpus
                                      << " GPUs and a batch of " << request.global_batch << " sequences");
  return evaluate(request, model_costs(request.model), comm, rates, layout);
}

std::vector<Plan> enumerate_plans(const PlanRequest& q, const CommModel& comm, const ComputeRates& rates) {
  check_request(q);
  const ModelCosts c = model_costs(q.model);
  std::vector<Plan> all;
  std::string refused;
  for (int pp : divisors(q.gpus)) {
    if (!allowed(q.pp, pp) || pp > q.model.n_layer) continue;
    for (int tp : divisors(q.gpus / pp)) {
      if (!allowed(q.tp, tp) || (tp > 1 && q.gpus_per_node % tp != 0)) continue;  // tp inside a node
      for (int sp : divisors(q.gpus / pp / tp)) {
        const int dp = q.gpus / pp / tp / sp;
        if (!allowed(q.sp, sp) || sp > q.seqlen || q.global_batch % dp != 0) continue;
        try {
          check_mesh_fits_model(MeshConfig{dp, tp, sp}, q.model);
        } catch (const UserError& e) {
          refused = e.what();
          continue;
        }
        for (int mb : divisors(q.global_batch / dp)) {
          Plan layout;
          layout.pp = pp, layout.dp = dp, layout.tp = tp, layout.sp = sp, layout.micro_batch = mb;
          layout.grad_accum = q.global_batch / dp / mb;
          if (allowed(q.grad_accum, layout.grad_accum)) add_variants(q, c, comm, rates, layout, all);
        }
      }
    }
  }
  KMAMBA_REQUIRE(!all.empty(), "kmamba-plan: no pp x dp x tp x sp mesh of "
                                   << q.gpus << " GPUs (" << q.gpus_per_node
                                   << " a node, tp inside a node) fits the model, a global batch of " << q.global_batch
                                   << " sequences (dp must divide it) and the allowed sizes"
                                   << (refused.empty() ? std::string() : "; the last refusal: " + refused));
  const auto smallest = *std::min_element(
      all.begin(), all.end(), [](const Plan& a, const Plan& b) { return a.memory.total() < b.memory.total(); });
  all.erase(std::remove_if(all.begin(), all.end(), [&](const Plan& p) { return p.memory.total() > q.memory_bytes; }),
            all.end());
  KMAMBA_REQUIRE(!all.empty(), "kmamba-plan: no plan fits " << q.memory_bytes * 1e-9 << " GB per GPU: the smallest ("
                                                            << smallest.describe() << ") needs "
                                                            << smallest.memory.total() * 1e-9
                                                            << " GB; use more GPUs, a smaller global batch or "
                                                               "sequence, or a smaller model");
  std::stable_sort(all.begin(), all.end(), [](const Plan& a, const Plan& b) {
    return a.step != b.step ? a.step < b.step : a.memory.total() < b.memory.total();
  });
  return all;
}

std::string Plan::describe() const {
  std::ostringstream s;
  s << "pp" << pp << " dp" << dp << " tp" << tp << " sp" << sp << " mb" << micro_batch << " acc" << grad_accum
    << " zero" << zero_stage << (checkpointing ? " ckpt" : "") << " " << gradient_compression_name(compression);
  if (compression == GradientCompression::PowerSgd) s << powersgd_rank;
  return s.str();
}

std::string train_config_json(const PlanRequest& q, const Plan& p) {
  const ModelConfig& m = q.model;
  json j = json::object();
  if (q.model_dir.empty()) {
    std::string mixer = mixer_name(m.mixer);  // kmamba-train's --mixer takes it in lower case
    std::transform(mixer.begin(), mixer.end(), mixer.begin(), [](unsigned char ch) { return std::tolower(ch); });
    j["mixer"] = mixer;
    j["d_model"] = m.d_model;
    j["n_layer"] = m.n_layer;
    j["d_state"] = m.d_state;
    j["expand"] = m.expand;
    if (m.mixer != MixerKind::Mamba1) {
      j["headdim"] = m.headdim;
      j["ngroups"] = m.ngroups;
      j["chunk_size"] = m.chunk_size;
    }
    if (m.mixer == MixerKind::Mamba3) {
      j["rope_fraction"] = m.rope_fraction;
      if (m.is_mimo) j["mimo_rank"] = m.mimo_rank;
      if (m.is_outproj_norm) j["outproj_norm"] = true;
    }
  } else {
    j["model"] = q.model_dir;
  }
  j["precision"] = q.precision;
  j["seqlen"] = q.seqlen;
  j["batch_size"] = p.micro_batch;
  j["grad_accum"] = p.grad_accum;
  j["pipeline_parallel_size"] = p.pp;
  j["data_parallel_size"] = p.dp;
  j["tensor_parallel_size"] = p.tp;
  j["sequence_parallel_size"] = p.sp;
  j["zero_stage"] = p.zero_stage;
  j["activation_checkpointing"] = p.checkpointing;
  j["gradient_compression"] = gradient_compression_name(p.compression);
  if (p.compression == GradientCompression::PowerSgd) j["powersgd_rank"] = p.powersgd_rank;
  return j.dump(2) + "\n";
}

}  // namespace perf
}  // namespace kmamba
