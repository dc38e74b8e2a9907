// kmamba-perf-model: fits the alpha-beta model of each collective to kmamba-perf-comm sweeps (one
// JSON file per group size, e.g. n = 2, 4, 8 GPUs of one node; without sweeps an assumed intra-node
// link) and predicts the per-step communication, step time, tokens/s, MFU and memory per GPU of a
// Mamba-2 model (default: mamba2-370m) trained data parallel (fp32, bf16 or PowerSGD gradients),
// tensor parallel, sequence parallel and pipeline parallel on 1 ... 1024 GPUs
// (docs/distributed.md §8.2; the formulas are in ScalingModel.hpp). Writes a PNG of tokens/s and MFU against the GPU
// count.
//
//   kmamba-perf-model [comm-n2.json comm-n4.json comm-n8.json] --compute-ms 850 --tokens-per-gpu 16384
//                     [--png scaling.png] [--json prediction.json] [options]
#include "ScalingModel.hpp"

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Files.hpp>
#include <kmamba/core/Json.hpp>

#include "AppRuntime.hpp"
#include "Plot.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

using kmamba::perf::Prediction;

struct Options {
  std::vector<std::string> sweeps;
  double compute_ms = 0.0, tokens_per_gpu = 16384.0;
  int gpus_per_node = 8;
  double intra_bw_gbps = 300.0, intra_alpha_us = 10.0, inter_bw_gbps = 50.0, inter_alpha_us = 15.0;
  std::vector<int> gpus = {1, 4, 8, 16, 32, 64, 128, 256, 512, 1024};
  std::vector<int> tp = {2, 4}, pp = {2, 4};
  int sp = 8, micro_batches = 16, powersgd_rank = 4;
  std::vector<std::string> compression = {"bf16", "powersgd"};
  std::vector<double> seqlens = {8192, 16384, 32768};
  double serial_fraction = 0.1, peak_tflops = 989.0, bytes_per_value = 4.0;
  kmamba::perf::Shape shape;
  std::string png, json;
};

const char* const description =
    "Fits time = alpha + bytes * factor(n) * beta per collective and group size to kmamba-perf-comm sweeps\n"
    "(factor: all-reduce 2(n-1)/n, reduce-scatter / all-gather (n-1)/n, broadcast / send-recv 1), prints the\n"
    "fits and each point's error, and predicts data- (with compressed gradients), tensor-, sequence- and\n"
    "pipeline-parallel training on N GPUs. Without sweeps, every collective of a node takes --intra-alpha and\n"
    "--intra-bw (assumed).";

void declare(CLI::App& cli, Options& o) {
  using kmamba::app::integer_in;
  using kmamba::app::number_in;
  using kmamba::app::unbounded;
  const auto positive = number_in(0, unbounded, kmamba::app::Ends::LowOpen);
  const auto count = integer_in(1, kmamba::app::int_max);
  cli.add_option("sweeps", o.sweeps, "kmamba-perf-comm JSON files (default: the assumed --intra-* link)")
      ->type_name("SWEEP.json");
  cli.add_option("--compute-ms", o.compute_ms,
                 "measured step time of one GPU (no parallelism) on --tokens-per-gpu tokens (required)")
      ->type_name("T")
      ->check(positive)
      ->required();
  cli.add_option("--tokens-per-gpu", o.tokens_per_gpu, "tokens of that step (default 16384 = 8 x 2048)")
      ->type_name("N")
      ->check(positive);
  cli.add_option("--gpus", o.gpus, "GPU counts to predict (default 1,4,8,16,32,...,1024)")
      ->type_name("LIST")
      ->delimiter(',')
      ->check(count);
  cli.add_option("--gpus-per-node", o.gpus_per_node, "GPUs per node; the sweeps describe one node (default 8)")
      ->type_name("G")
      ->check(count);
  cli.add_option("--intra-bw", o.intra_bw_gbps, "without sweeps: bus bandwidth inside a node, GB/s (assumed; 300)")
      ->type_name("GBPS")
      ->check(positive);
  cli.add_option("--intra-alpha", o.intra_alpha_us, "without sweeps: latency inside a node, us (assumed; 10)")
      ->type_name("US")
      ->check(number_in(0, unbounded));
  cli.add_option("--inter-bw", o.inter_bw_gbps, "inter-node bandwidth per GPU, GB/s (assumed; default 50)")
      ->type_name("GBPS")
      ->check(positive);
  cli.add_option("--inter-alpha", o.inter_alpha_us, "inter-node latency per message step, us (assumed; default 15)")
      ->type_name("US")
      ->check(number_in(0, unbounded));
  cli.add_option("--tp", o.tp, "tensor-parallel sizes (default 2,4)")->type_name("LIST")->delimiter(',')->check(count);
  cli.add_option("--sp", o.sp, "sequence-parallel size (default 8)")->type_name("C")->check(count);
  cli.add_option("--pp", o.pp, "pipeline-parallel sizes (default 2,4)")
      ->type_name("LIST")
      ->delimiter(',')
      ->check(count);
  cli.add_option("--micro-batches", o.micro_batches, "micro-batches of a pipeline step (default 16)")
      ->type_name("M")
      ->check(count);
  cli.add_option("--compression", o.compression, "compressed data-parallel layouts (default bf16,powersgd)")
      ->type_name("LIST")
      ->delimiter(',')
      ->check(kmamba::app::one_of({"bf16", "powersgd"}));
  cli.add_option("--powersgd-rank", o.powersgd_rank, "PowerSGD's rank (default 4)")->type_name("R")->check(count);
  cli.add_option("--seqlens", o.seqlens, "sequence lengths of the sp layouts (default 8192,16384,32768)")
      ->type_name("LIST")
      ->delimiter(',')
      ->check(positive);
  cli.add_option("--serial-fraction", o.serial_fraction,
                 "share of the compute in the conv and SSD scans, which sp's state correction adds to, in [0, 1] "
                 "(default 0.1; calibrate from a one-GPU profile)")
      ->type_name("X")
      ->check(number_in(0, 1));
  cli.add_option("--peak-tflops", o.peak_tflops, "per-GPU peak for MFU (default 989, H200 dense bf16)")
      ->type_name("X")
      ->check(positive);
  cli.add_option("--bytes-per-value", o.bytes_per_value, "activation element bytes (default 4, fp32)")
      ->type_name("B")
      ->check(positive);
  const char* shape = "model shape (default mamba2-370m)";
  cli.add_option("--d-model", o.shape.d_model, "default 1024")->type_name("N")->check(count)->group(shape);
  cli.add_option("--n-layer", o.shape.n_layer, "default 48")->type_name("N")->check(count)->group(shape);
  cli.add_option("--vocab-size", o.shape.vocab_size, "default 50277")->type_name("N")->check(count)->group(shape);
  cli.add_option("--pad-vocab-multiple", o.shape.pad_vocab_size_multiple, "default 8")
      ->type_name("N")
      ->check(count)
      ->group(shape);
  cli.add_option("--d-state", o.shape.d_state, "default 128")->type_name("N")->check(count)->group(shape);
  cli.add_option("--headdim", o.shape.headdim, "default 64")->type_name("N")->check(count)->group(shape);
  cli.add_option("--expand", o.shape.expand, "default 2")->type_name("N")->check(count)->group(shape);
  cli.add_option("--ngroups", o.shape.ngroups, "default 1")->type_name("N")->check(count)->group(shape);
  cli.add_option("--chunk-size", o.shape.chunk_size, "default 256")->type_name("N")->check(count)->group(shape);
  cli.add_option("--png", o.png, "plot of predicted tokens/s and MFU against GPUs")->type_name("FILE");
  cli.add_option("--json", o.json, "the fits and predictions as JSON")->type_name("FILE");
}

void validate(const Options& o) {
  KMAMBA_REQUIRE(o.shape.d_inner() % o.shape.headdim == 0,
                 "kmamba-perf-model: --headdim " << o.shape.headdim << " must divide d_inner " << o.shape.d_inner());
}

void print_prediction_header() {
  std::printf("%-16s %5s %4s %3s %3s %3s %10s %9s %9s %9s %9s %9s %9s %7s %12s %6s %10s %6s %7s\n", "layout", "gpus",
              "dp", "tp", "sp", "pp", "tok/step", "comp_ms", "dp_ms", "tp_ms", "sp_ms", "pp_ms", "step_ms", "comm%",
              "tok/s", "MFU%", "ovl_tok/s", "oMFU%", "GB/GPU");
}

void print_prediction(const Prediction& p) {
  std::printf(
      "%-16s %5d %4d %3d %3d %3d %10.0f %9.2f %9.2f %9.2f %9.2f %9.2f %9.2f %7.1f %12.4g %6.2f %10.4g %6.2f %7.2f\n",
      p.layout.c_str(), p.gpus, p.dp, p.tp, p.sp, p.pp, p.tokens_per_step, p.compute * 1e3, p.dp_comm * 1e3,
      p.tp_comm * 1e3, p.sp_comm * 1e3, p.pp_comm * 1e3, p.step * 1e3, 100.0 * p.comm_share(), p.tokens_per_s,
      100.0 * p.mfu, p.tokens_per_s_overlap, 100.0 * p.mfu_overlap, p.memory * 1e-9);
}

nlohmann::json to_json(const Prediction& p) {
  return {{"layout", p.layout},
          {"gpus", p.gpus},
          {"dp", p.dp},
          {"tp", p.tp},
          {"sp", p.sp},
          {"pp", p.pp},
          {"micro_batches", p.micro_batches},
          {"bubble", p.bubble},
          {"seqlen", p.seqlen},
          {"tokens_per_step", p.tokens_per_step},
          {"compute_ms", p.compute * 1e3},
          {"dp_comm_ms", p.dp_comm * 1e3},
          {"tp_comm_ms", p.tp_comm * 1e3},
          {"sp_comm_ms", p.sp_comm * 1e3},
          {"pp_comm_ms", p.pp_comm * 1e3},
          {"dp_not_hideable_ms", p.dp_fixed * 1e3},
          {"memory_bytes", p.memory},
          {"step_ms", p.step * 1e3},
          {"comm_share", p.comm_share()},
          {"tokens_per_s", p.tokens_per_s},
          {"mfu", p.mfu},
          {"step_overlap_ms", p.step_overlap * 1e3},
          {"tokens_per_s_overlap", p.tokens_per_s_overlap},
          {"mfu_overlap", p.mfu_overlap}};
}

// The predicted tokens/s and MFU against the GPU count, one series per layout.
void plot_predictions(const std::string& path, const std::vector<Prediction>& all) {
  using kmamba::app::Panel;
  using kmamba::app::Rgb;
  using kmamba::app::Series;
  const std::vector<Rgb> palette = {{31, 119, 180}, {255, 127, 14},  {44, 160, 44},   {214, 39, 40},  {148, 103, 189},
                                    {140, 86, 75},  {227, 119, 194}, {127, 127, 127}, {188, 189, 34}, {23, 190, 207}};
  Panel rate{"predicted tokens/s (no overlap)", true, {}};
  Panel mfu{"predicted mfu % (no overlap)", false, {}};
  std::vector<std::string> names;
  for (const Prediction& p : all) {
    if (std::find(names.begin(), names.end(), p.layout) == names.end()) names.push_back(p.layout);
  }
  for (std::size_t i = 0; i < names.size(); ++i) {
    std::string label = names[i];  // the chart font has no '@'
    const std::size_t at = label.find('@');
    if (at != std::string::npos) label = label.substr(0, at) + " len " + label.substr(at + 1);
    Series r{label, palette[i % palette.size()], {}, {}, false};
    Series m = r;
    for (const Prediction& p : all) {
      if (p.layout != names[i]) continue;
      r.x.push_back(std::log2(p.gpus));
      r.y.push_back(p.tokens_per_s);
      m.x.push_back(std::log2(p.gpus));
      m.y.push_back(100.0 * p.mfu);
    }
    rate.series.push_back(r);
    mfu.series.push_back(m);
  }
  kmamba::app::write_png(path, kmamba::app::plot({rate, mfu}, "log2(gpus)", 900, 700));
  std::printf("\nkmamba-perf-model: wrote %s\n", path.c_str());
}

// The fits and the predictions as JSON.
void write_json(const std::string& path, const std::vector<kmamba::perf::AlphaBeta>& fits,
                const std::vector<Prediction>& all) {
  nlohmann::json fits_json = nlohmann::json::array(), predictions = nlohmann::json::array();
  for (const auto& f : fits) {
    fits_json.push_back({{"collective", f.collective},
                         {"ranks", f.ranks},
                         {"alpha_us", f.alpha * 1e6},
                         {"busbw_GBps", f.beta > 0 ? 1e-9 / f.beta : 0.0},
                         {"alpha_clamped", f.alpha_clamped},
                         {"bytes", f.bytes},
                         {"relative_error", f.relative_error}});
  }
  for (const Prediction& p : all) predictions.push_back(to_json(p));
  kmamba::write_output_file(path, nlohmann::json{{"fits", fits_json}, {"predictions", predictions}}.dump(1) + "\n",
                            "kmamba-perf-model: --json");
  std::printf("kmamba-perf-model: wrote %s\n", path.c_str());
}

// The fits of the sweeps, printed with each point's error; without sweeps the assumed link.
std::vector<kmamba::perf::AlphaBeta> fit_sweeps(const Options& o) {
  if (o.sweeps.empty()) {
    std::printf("no sweeps: every collective inside a node alpha %.1f us, bus bandwidth %.0f GB/s (assumed)\n",
                o.intra_alpha_us, o.intra_bw_gbps);
    return kmamba::perf::assumed_fits(o.gpus_per_node, o.intra_alpha_us * 1e-6, o.intra_bw_gbps * 1e9);
  }
  std::vector<kmamba::perf::Sample> samples;
  for (const std::string& path : o.sweeps) {
    const auto s = kmamba::perf::read_sweep(path, "kmamba-perf-model");
    samples.insert(samples.end(), s.begin(), s.end());
  }
  const std::vector<kmamba::perf::AlphaBeta> fits = kmamba::perf::fit_all(samples);
  KMAMBA_REQUIRE(!fits.empty(), "kmamba-perf-model: the sweeps hold no collective on two or more ranks to fit");
  std::printf("alpha-beta fits (time = alpha + bytes * factor(n) * beta; bus bandwidth = 1/beta):\n");
  std::printf("%-15s %5s %12s %14s %12s %12s\n", "collective", "ranks", "alpha_us", "busbw_GB/s", "max|err|%",
              "rms_err%");
  for (const auto& f : fits) {
    double worst = 0, sq = 0;
    for (double e : f.relative_error) worst = std::max(worst, std::abs(e)), sq += e * e;
    std::printf("%-15s %5d %12.2f %14.3f %12.1f %12.1f%s\n", f.collective.c_str(), f.ranks, f.alpha * 1e6,
                f.beta > 0 ? 1e-9 / f.beta : 0.0, 100 * worst, 100 * std::sqrt(sq / f.relative_error.size()),
                f.alpha_clamped ? "  (alpha < 0 in the free fit; fitted with alpha = 0)" : "");
  }
  std::printf("\nfit error per point ((model - measured) / measured):\n");
  for (const auto& f : fits) {
    std::printf("%s n=%d:", f.collective.c_str(), f.ranks);
    for (std::size_t i = 0; i < f.bytes.size(); ++i) {
      std::printf(" %.0f:%+.1f%%", f.bytes[i], 100.0 * f.relative_error[i]);
    }
    std::printf("\n");
  }
  return fits;
}

// One layout of the table: its kind ("dp", "tp", "sp", "pp"), size, sequence length (sp) and
// gradient compression (dp).
struct Layout {
  std::string kind;
  int size = 1;
  double seqlen = 0.0;
  kmamba::GradientCompression compression = kmamba::GradientCompression::None;
};

std::vector<Layout> layouts_for(const Options& o, int n) {
  std::vector<Layout> v = {{"dp", n, 0.0, kmamba::GradientCompression::None}};
  for (const std::string& c : o.compression) {
    if (n > 1) v.push_back({"dp", n, 0.0, kmamba::parse_gradient_compression(c, "kmamba-perf-model: --compression")});
  }
  for (int t : o.tp) {
    if (n % t == 0 && t <= o.gpus_per_node) v.push_back({"tp", t, 0.0, kmamba::GradientCompression::None});
  }
  if (n % o.sp == 0) {
    for (double L : o.seqlens) v.push_back({"sp", o.sp, L, kmamba::GradientCompression::None});
  }
  for (int p : o.pp) {
    if (n % p == 0 && p <= o.shape.n_layer) v.push_back({"pp", p, 0.0, kmamba::GradientCompression::None});
  }
  return v;
}

Prediction predict(const Options& o, const kmamba::perf::CommModel& comm, kmamba::perf::Workload work, int n,
                   const Layout& l) {
  work.compression = l.compression;
  work.powersgd_rank = o.powersgd_rank;
  Prediction p = l.kind == "dp"   ? kmamba::perf::predict_dp(comm, work, n)
                 : l.kind == "tp" ? kmamba::perf::predict_tp(comm, work, n, l.size)
                 : l.kind == "sp" ? kmamba::perf::predict_sp(comm, work, n, l.size, l.seqlen)
                                  : kmamba::perf::predict_pp(comm, work, n, l.size, o.micro_batches);
  if (l.compression == kmamba::GradientCompression::Bf16) p.layout += "+bf16";
  if (l.compression == kmamba::GradientCompression::PowerSgd) p.layout += "+psgd" + std::to_string(o.powersgd_rank);
  return p;
}

void print_workload(const Options& o) {
  const kmamba::perf::Shape& s = o.shape;
  std::printf(
      "\nmodel: Mamba-2, d_model %d, %d layers, d_state %d, headdim %d, expand %d, ngroups %d, vocab %d (padded %lld), "
      "%.1f M parameters, %.3g FLOPs/token\n",
      s.d_model, s.n_layer, s.d_state, s.headdim, s.expand, s.ngroups, s.vocab_size,
      static_cast<long long>(s.padded_vocab()), kmamba::perf::parameter_count(s) * 1e-6,
      kmamba::perf::flops_per_token(s));
  std::printf(
      "one GPU: %.2f ms per step of %.0f tokens; %d GPUs per node; inter-node %.0f GB/s per GPU, alpha %.1f us "
      "(assumed); peak %.0f TFLOP/s; %g-byte activations, fp32 gradients (bf16 on the wire with +bf16)\n",
      o.compute_ms, o.tokens_per_gpu, o.gpus_per_node, o.inter_bw_gbps, o.inter_alpha_us, o.peak_tflops,
      o.bytes_per_value);
  std::printf(
      "step_ms = compute + every communication exposed; ovl_* hide the dp reduction behind the backward (2/3 of the "
      "compute; not PowerSGD, not ZeRO's all-gather); sp: state correction on a scan share of %.2f; ppPmM: P stages, "
      "M micro-batches (1F1B), comp_ms the schedule's (M + P - 1) slots of the slowest stage\n\n",
      o.serial_fraction);
}

// Step time at the largest GPU count for each assumed inter-node bandwidth and latency.
void print_sensitivity(const Options& o, const std::vector<kmamba::perf::AlphaBeta>& fits,
                       const kmamba::perf::Workload& work) {
  const int largest = *std::max_element(o.gpus.begin(), o.gpus.end());
  std::printf("\nsensitivity at %d GPUs: step_ms (no overlap) for inter-node bandwidth x latency\n", largest);
  std::printf("%-16s", "layout");
  const std::vector<double> bws = {25, 50, 100}, alphas = {10, 15, 20};
  for (double bw : bws)
    for (double a : alphas) std::printf(" %6.0fG/%2.0fus", bw, a);
  std::printf("\n");
  const kmamba::perf::CommModel base(fits, o.inter_alpha_us * 1e-6, o.inter_bw_gbps * 1e9, o.gpus_per_node);
  for (const Layout& l : layouts_for(o, largest)) {
    std::printf("%-16s", predict(o, base, work, largest, l).layout.c_str());
    for (double bw : bws) {
      for (double a : alphas) {
        const kmamba::perf::CommModel c(fits, a * 1e-6, bw * 1e9, o.gpus_per_node);
        std::printf(" %12.2f", predict(o, c, work, largest, l).step * 1e3);
      }
    }
    std::printf("\n");
  }
}

int run(const Options& o) {
  const std::vector<kmamba::perf::AlphaBeta> fits = fit_sweeps(o);
  const kmamba::perf::CommModel comm(fits, o.inter_alpha_us * 1e-6, o.inter_bw_gbps * 1e9, o.gpus_per_node);
  kmamba::perf::Workload work;
  work.shape = o.shape;
  work.compute_s = o.compute_ms * 1e-3;
  work.tokens_per_gpu = o.tokens_per_gpu;
  work.peak_flops = o.peak_tflops * 1e12;
  work.bytes_per_value = o.bytes_per_value;
  work.serial_fraction = o.serial_fraction;
  print_workload(o);
  std::vector<Prediction> all;
  print_prediction_header();
  for (int n : o.gpus) {
    for (const Layout& l : layouts_for(o, n)) {
      all.push_back(predict(o, comm, work, n, l));
      print_prediction(all.back());
    }
  }
  print_sensitivity(o, fits, work);
  if (!o.png.empty()) plot_predictions(o.png, all);
  if (!o.json.empty()) write_json(o.json, fits, all);
  return kmamba::app::exit_done;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  kmamba::app::Tool tool{"kmamba-perf-model", description, [&](CLI::App& cli) { declare(cli, o); },
                         [&](const CLI::App&) { validate(o); }, [&](auto&) { return run(o); }};
  tool.keep_freed_host_memory = false;
  return kmamba::app::run_tool(argc, argv, tool);
}
