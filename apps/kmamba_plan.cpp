// kmamba-plan: chooses how to train a model on N GPUs — pipeline, data, tensor and sequence
// parallel sizes, micro-batch size, ZeRO stage, activation checkpointing and gradient compression —
// from the cost model of perf/Planner.hpp (docs/distributed.md §8.3), prints the chosen plan's
// predicted step time and memory per GPU with the runners-up, and writes the kmamba-train --config
// file that runs it.
//
//   kmamba-plan --model mamba2-370m --gpus 16 --memory-gb 80 --seqlen 8192 --global-batch 64
//               [--step-json step.json] [--kernel-json kernels.json] [--comm comm-n8.json...] [--out plan.json]
#include "Planner.hpp"

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Files.hpp>

#include "AppRuntime.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

namespace {

using kmamba::perf::Plan;

struct Options {
  std::string model, out = "plan.json", candidates, step_json, kernel_json, precision = "bf16";
  std::vector<std::string> comm;
  int gpus = 0, gpus_per_node = 8, seqlen = 0, global_batch = 0, top = 5, powersgd_rank = 4;
  double memory_gb = 80.0, reserve_gb = 4.0;
  double intra_bw_gbps = 300.0, intra_alpha_us = 10.0, inter_bw_gbps = 50.0, inter_alpha_us = 15.0;
  std::vector<int> pp, tp, sp, zero, grad_accum;
  std::string checkpointing = "auto";
  std::vector<std::string> compression = {"none", "bf16", "powersgd"};
};

const char* const description =
    "Chooses the parallel plan of a training run on N GPUs: pipeline (pp), data (dp), tensor (tp) and\n"
    "sequence (sp) parallel sizes, micro-batch size, ZeRO stage, activation checkpointing and gradient\n"
    "compression. Each plan's step time comes from measured compute (kmamba-perf-train --json, kmamba-perf\n"
    "--json; built in: an H100) and the alpha-beta communication model of kmamba-perf-model; its memory per\n"
    "GPU from the parameters, gradients, AdamW moments and activations it keeps (docs/distributed.md 8.3).\n"
    "Prints the chosen plan and the runners-up and writes the kmamba-train --config file of the chosen one.";

// Mamba-2 (and Mamba-1, Mamba-3 SISO) language models by name: the official shapes.
std::map<std::string, kmamba::ModelConfig> presets() {
  std::map<std::string, kmamba::ModelConfig> out;
  const auto add = [&](const std::string& name, kmamba::MixerKind mixer, int d_model, int n_layer) {
    kmamba::ModelConfig c;
    c.mixer = mixer;
    c.d_model = d_model;
    c.n_layer = n_layer;
    c.vocab_size = 50277;
    c.pad_vocab_size_multiple = 16;
    c.d_state = mixer == kmamba::MixerKind::Mamba1 ? 16 : 128;
    c.headdim = 64;
    c.chunk_size = mixer == kmamba::MixerKind::Mamba3 ? 64 : 256;
    c.validate();
    out[name] = c;
  };
  add("mamba2-130m", kmamba::MixerKind::Mamba2, 768, 24);
  add("mamba2-370m", kmamba::MixerKind::Mamba2, 1024, 48);
  add("mamba2-780m", kmamba::MixerKind::Mamba2, 1536, 48);
  add("mamba2-1.3b", kmamba::MixerKind::Mamba2, 2048, 48);
  add("mamba2-2.7b", kmamba::MixerKind::Mamba2, 2560, 64);
  add("mamba-130m", kmamba::MixerKind::Mamba1, 768, 24);
  add("mamba3-130m", kmamba::MixerKind::Mamba3, 768, 24);
  return out;
}

std::string preset_names() {
  std::string names;
  for (const auto& p : presets()) names += (names.empty() ? "" : ", ") + p.first;
  return names;
}

// --step-json, --kernel-json, --comm and the assumed links.
void declare_measurements(CLI::App& cli, Options& o) {
  using kmamba::app::number_in;
  using kmamba::app::unbounded;
  const auto positive = number_in(0, unbounded, kmamba::app::Ends::LowOpen);
  CLI::Validator existing = CLI::ExistingFile;
  existing.description("");  // the placeholder FILE names the kind of value
  const char* measured = "measurements (default: built in, an H100)";
  cli.add_option("--step-json", o.step_json, "a kmamba-perf-train --json file: one GPU's training step")
      ->type_name("FILE")
      ->check(existing)
      ->group(measured);
  cli.add_option("--kernel-json", o.kernel_json, "a kmamba-perf --json file: the scans' forward and backward")
      ->type_name("FILE")
      ->check(existing)
      ->group(measured);
  cli.add_option("--comm", o.comm, "kmamba-perf-comm --json sweeps of one node (default: --intra-bw, --intra-alpha)")
      ->type_name("FILE")
      ->check(existing)
      ->group(measured);
  cli.add_option("--intra-bw", o.intra_bw_gbps, "without --comm: bus bandwidth inside a node, GB/s (assumed; 300)")
      ->type_name("GBPS")
      ->check(positive)
      ->group(measured);
  cli.add_option("--intra-alpha", o.intra_alpha_us, "without --comm: latency inside a node, us (assumed; 10)")
      ->type_name("US")
      ->check(number_in(0, unbounded))
      ->group(measured);
  cli.add_option("--inter-bw", o.inter_bw_gbps, "bandwidth between nodes per GPU, GB/s (assumed; 50)")
      ->type_name("GBPS")
      ->check(positive)
      ->group(measured);
  cli.add_option("--inter-alpha", o.inter_alpha_us, "latency between nodes per message step, us (assumed; 15)")
      ->type_name("US")
      ->check(number_in(0, unbounded))
      ->group(measured);
}

// --pp --tp --sp --grad-accum --zero-stage --activation-checkpointing --compression --powersgd-rank.
void declare_limits(CLI::App& cli, Options& o) {
  using kmamba::app::integer_in;
  using kmamba::app::one_of;
  const auto count = integer_in(1, kmamba::app::int_max);
  const char* limits = "the plans considered (default: all that fit)";
  for (auto [name, values] : {std::make_pair("--pp", &o.pp), std::make_pair("--tp", &o.tp),
                              std::make_pair("--sp", &o.sp), std::make_pair("--grad-accum", &o.grad_accum)}) {
    cli.add_option(name, *values, "allowed sizes, e.g. 1,2")
        ->type_name("LIST")
        ->delimiter(',')
        ->check(count)
        ->group(limits);
  }
  cli.add_option("--zero-stage", o.zero, "allowed ZeRO stages (0, 1)")
      ->type_name("LIST")
      ->delimiter(',')
      ->check(integer_in(0, 1))
      ->group(limits);
  cli.add_option("--activation-checkpointing", o.checkpointing, "on, off or auto (default: both considered)")
      ->type_name("C")
      ->check(one_of({"auto", "on", "off"}))
      ->group(limits);
  cli.add_option("--compression", o.compression, "allowed gradient compressions (default none,bf16,powersgd)")
      ->type_name("LIST")
      ->delimiter(',')
      ->check(one_of({"none", "bf16", "powersgd"}))
      ->group(limits);
  cli.add_option("--powersgd-rank", o.powersgd_rank, "PowerSGD's rank (default 4)")
      ->type_name("R")
      ->check(count)
      ->group(limits);
}

void declare(CLI::App& cli, Options& o) {
  using kmamba::app::integer_in;
  using kmamba::app::number_in;
  using kmamba::app::one_of;
  using kmamba::app::unbounded;
  const auto count = integer_in(1, kmamba::app::int_max);
  const auto positive = number_in(0, unbounded, kmamba::app::Ends::LowOpen);
  cli.add_option("--model", o.model,
                 "a preset (" + preset_names() +
                     "), a config.json (kmamba or Hugging Face), or a directory holding one, as kmamba-train --model "
                     "takes (with model.safetensors there the plan fine-tunes it)")
      ->type_name("NAME|FILE|DIR")
      ->required();
  cli.add_option("--gpus", o.gpus, "GPUs in all (required)")->type_name("N")->check(count)->required();
  cli.add_option("--gpus-per-node", o.gpus_per_node, "GPUs per node (default 8)")->type_name("G")->check(count);
  cli.add_option("--memory-gb", o.memory_gb, "memory per GPU, GB (default 80)")->type_name("X")->check(positive);
  cli.add_option("--reserve-gb", o.reserve_gb,
                 "of it, kept for the CUDA context, NCCL and cuBLAS buffers and fragmentation (default 4)")
      ->type_name("X")
      ->check(number_in(0, unbounded));
  cli.add_option("--seqlen", o.seqlen, "tokens per sequence (required)")->type_name("L")->check(count)->required();
  cli.add_option("--global-batch", o.global_batch, "sequences per optimizer step (required)")
      ->type_name("B")
      ->check(count)
      ->required();
  cli.add_option("--precision", o.precision, "kmamba-train's --precision of the run (default bf16)")
      ->type_name("P")
      ->check(one_of({"fp32", "tf32", "bf16"}));
  declare_measurements(cli, o);
  declare_limits(cli, o);
  cli.add_option("--top", o.top, "runners-up printed (default 5)")->type_name("K")->check(integer_in(0, 1000));
  cli.add_option("--out", o.out, "the kmamba-train --config file of the chosen plan (default plan.json)")
      ->type_name("FILE");
  cli.add_option("--candidates", o.candidates, "every plan that fits, fastest first, as JSON")->type_name("FILE");
}

// The model of --model: a preset, a config.json, or a directory holding one (and maybe weights).
void load_model(const Options& o, kmamba::perf::PlanRequest& q) {
  const auto all = presets();
  const auto preset = all.find(o.model);
  if (preset != all.end()) {
    q.model = preset->second;
    return;
  }
  namespace fs = std::filesystem;
  KMAMBA_REQUIRE(fs::exists(o.model), "kmamba-plan: --model '" << o.model << "' is neither a preset (" << preset_names()
                                                               << ") nor a file or directory");
  if (fs::is_directory(o.model)) {
    q.model = kmamba::ModelConfig::load(o.model + "/config.json");
    if (fs::exists(o.model + "/model.safetensors")) q.model_dir = o.model;
    return;
  }
  q.model = kmamba::ModelConfig::load(o.model);
}

// The α–β table: fitted to --comm sweeps, else the assumed intra-node link for every collective.
kmamba::perf::CommModel comm_model(const Options& o) {
  std::vector<kmamba::perf::AlphaBeta> fits;
  if (!o.comm.empty()) {
    std::vector<kmamba::perf::Sample> samples;
    for (const std::string& path : o.comm) {
      const auto s = kmamba::perf::read_sweep(path, "kmamba-plan");
      samples.insert(samples.end(), s.begin(), s.end());
    }
    fits = kmamba::perf::fit_all(samples);
    KMAMBA_REQUIRE(!fits.empty(), "kmamba-plan: the --comm sweeps hold no collective on two or more ranks to fit");
  } else {
    fits = kmamba::perf::assumed_fits(o.gpus_per_node, o.intra_alpha_us * 1e-6, o.intra_bw_gbps * 1e9);
  }
  return kmamba::perf::CommModel(fits, o.inter_alpha_us * 1e-6, o.inter_bw_gbps * 1e9, o.gpus_per_node);
}

kmamba::perf::PlanRequest request_of(const Options& o) {
  kmamba::perf::PlanRequest q;
  load_model(o, q);
  q.gpus = o.gpus;
  q.gpus_per_node = o.gpus_per_node;
  KMAMBA_REQUIRE(o.memory_gb > o.reserve_gb,
                 "kmamba-plan: --reserve-gb " << o.reserve_gb << " leaves nothing of --memory-gb " << o.memory_gb);
  q.memory_bytes = (o.memory_gb - o.reserve_gb) * 1e9;
  q.seqlen = o.seqlen;
  q.global_batch = o.global_batch;
  q.precision = o.precision;
  q.pp = o.pp, q.tp = o.tp, q.sp = o.sp, q.zero_stages = o.zero, q.grad_accum = o.grad_accum;
  if (o.checkpointing != "auto") q.checkpointing = {o.checkpointing == "on"};
  q.compression.clear();
  for (const std::string& c : o.compression) {
    q.compression.push_back(kmamba::parse_gradient_compression(c, "kmamba-plan: --compression"));
  }
  q.powersgd_rank = o.powersgd_rank;
  return q;
}

void print_plan(const char* tag, const Plan& p) {
  std::printf("%-7s %-44s %9.1f %9.1f %7.1f %7.1f %7.1f %7.1f %6.1f%% %11.0f %8.2f\n", tag, p.describe().c_str(),
              p.step * 1e3, p.compute * 1e3, p.tp_comm * 1e3, p.sp_comm * 1e3, p.pp_comm * 1e3, p.dp_comm * 1e3,
              100.0 * p.bubble, p.tokens_per_s, p.memory.total() * 1e-9);
}

nlohmann::json plan_json(const Plan& p) {
  return {{"plan", p.describe()},
          {"pp", p.pp},
          {"dp", p.dp},
          {"tp", p.tp},
          {"sp", p.sp},
          {"micro_batch", p.micro_batch},
          {"grad_accum", p.grad_accum},
          {"zero_stage", p.zero_stage},
          {"activation_checkpointing", p.checkpointing},
          {"gradient_compression", kmamba::gradient_compression_name(p.compression)},
          {"step_ms", p.step * 1e3},
          {"compute_ms", p.compute * 1e3},
          {"tp_comm_ms", p.tp_comm * 1e3},
          {"sp_comm_ms", p.sp_comm * 1e3},
          {"pp_comm_ms", p.pp_comm * 1e3},
          {"dp_comm_ms", p.dp_comm * 1e3},
          {"bubble", p.bubble},
          {"tokens_per_s", p.tokens_per_s},
          {"memory_bytes", p.memory.total()},
          {"memory_terms",
           {{"weights", p.memory.weights},
            {"gradients", p.memory.gradients},
            {"optimizer", p.memory.optimizer},
            {"compression", p.memory.compression},
            {"activations", p.memory.activations},
            {"logits", p.memory.logits}}}};
}

int run(const Options& o) {
  const kmamba::perf::PlanRequest q = request_of(o);
  kmamba::perf::Measurements m = kmamba::perf::default_measurements();
  if (!o.step_json.empty()) kmamba::perf::read_step_json(o.step_json, m);
  if (!o.kernel_json.empty()) kmamba::perf::read_kernel_json(o.kernel_json, o.precision, m);
  const kmamba::perf::ComputeRates rates = kmamba::perf::compute_rates(m, q.model.mixer);
  const kmamba::perf::CommModel comm = comm_model(o);
  const std::vector<Plan> plans = kmamba::perf::enumerate_plans(q, comm, rates);
  const kmamba::perf::ModelCosts costs = kmamba::perf::model_costs(q.model);
  std::printf(
      "model: %s, d_model %d, %d layers, %.1f M parameters; %d GPUs (%d a node), %.1f GB each usable; "
      "%d sequences of %d tokens per step\n",
      kmamba::mixer_name(q.model.mixer), q.model.d_model, q.model.n_layer,
      (q.model.n_layer * costs.layer_parameters() + costs.outer_parameters()) * 1e-6, q.gpus, q.gpus_per_node,
      q.memory_bytes * 1e-9, q.global_batch, q.seqlen);
  std::printf("compute: %s; %.3g s per dense FLOP, %.3g s per scan unit\n", m.source.c_str(), rates.seconds_per_flop,
              rates.scan_seconds_per_unit);
  std::printf("communication: %s\n\n", o.comm.empty() ? "assumed intra-node link (--intra-bw, --intra-alpha)"
                                                      : "alpha-beta fits of the --comm sweeps");
  std::printf("%-7s %-44s %9s %9s %7s %7s %7s %7s %7s %11s %8s\n", "", "plan", "step_ms", "compute", "tp_ms", "sp_ms",
              "pp_ms", "dp_ms", "bubble", "tokens/s", "GB/GPU");
  print_plan("chosen", plans.front());
  for (std::size_t i = 1; i < plans.size() && static_cast<int>(i) <= o.top; ++i) print_plan("", plans[i]);
  const kmamba::perf::MemoryTerms& mem = plans.front().memory;
  std::printf(
      "\nchosen plan, memory per GPU (GB): weights %.2f, gradients %.2f, AdamW moments %.2f, PowerSGD %.2f, "
      "activations %.2f, logits %.2f; %zu plans fit\n",
      mem.weights * 1e-9, mem.gradients * 1e-9, mem.optimizer * 1e-9, mem.compression * 1e-9, mem.activations * 1e-9,
      mem.logits * 1e-9, plans.size());
  kmamba::write_output_file(o.out, kmamba::perf::train_config_json(q, plans.front()), "kmamba-plan: --out");
  std::printf("kmamba-plan: wrote %s (mpirun -np %d kmamba-train --config %s%s)\n", o.out.c_str(), q.gpus,
              o.out.c_str(), q.model_dir.empty() ? " --data FILE" : "");
  if (!o.candidates.empty()) {
    nlohmann::json list = nlohmann::json::array();
    for (const Plan& p : plans) list.push_back(plan_json(p));
    kmamba::write_output_file(o.candidates, list.dump(1) + "\n", "kmamba-plan: --candidates");
    std::printf("kmamba-plan: wrote %s\n", o.candidates.c_str());
  }
  return kmamba::app::exit_done;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  kmamba::app::Tool tool{"kmamba-plan", description, [&](CLI::App& cli) { declare(cli, o); }, nullptr,
                         [&](auto&) { return run(o); }};
  tool.keep_freed_host_memory = false;
  return kmamba::app::run_tool(argc, argv, tool);
}
