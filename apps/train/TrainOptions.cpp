#include "TrainOptions.hpp"

#include "AppRuntime.hpp"
#include "DeviceOption.hpp"

#include <kmamba/core/Files.hpp>
#include <kmamba/core/Json.hpp>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <string>
#include <utility>

namespace kmamba {
namespace app {
namespace {

using json = nlohmann::json;

// --name VALUE in `group`, checked by `check`; its JSON key is the name with '_' for '-'.
void option(CLI::App& cli, const char* group, const std::string& names, const char* value, const char* help,
            CLI::Validator check) {
  check.description("");  // the placeholder `value` names the kind of value
  cli.add_option(names)->description(help)->type_name(value)->check(check)->group(group);
}

CLI::Validator count_from(long long low) { return integer_in(low, int_max); }

CLI::Validator boolean() { return one_of({"true", "false"}); }

void declare_what(CLI::App& cli) {
  const char* g = "what to train";
  option(cli, g, "--data", "FILE",
         "train on FILE: a KMTOKENS token file, or any other file as byte-level text (vocab 256)", CLI::ExistingFile);
  option(cli, g, "--model", "DIR", "fine-tune the Hugging Face checkpoint DIR (config.json + model.safetensors)",
         CLI::ExistingDirectory);
  option(cli, g, "--tokenizer", "FILE",
         "the tokenizer.json the --data token file was made with (kmamba-tokenize); it goes into every checkpoint, "
         "with tokenizer_config.json and special_tokens_map.json when they lie beside it (default: --model's "
         "tokenizer files)",
         CLI::ExistingFile);
  option(cli, g, "--config", "FILE",
         "read options from a JSON object, e.g. {\"steps\": 500, \"lr\": 0.001}; command-line options win",
         CLI::ExistingFile);
  cli.add_option("--out")
      ->description("run directory (default runs/recall, runs/<data file name> or runs/finetune-<model dir name>)")
      ->type_name("DIR")
      ->group(g);
  cli.add_flag("--resume", "continue the run in --out from its checkpoint (its run.json options are the defaults)")
      ->group(g);
  option(cli, g, "--device", "NAME", "serial, openmp or cuda (default: the build's default execution space)",
         one_of(devices_of_this_build()));
}

void declare_optimisation(CLI::App& cli) {
  const char* g = "optimisation";
  option(cli, g, "--steps", "N", "optimizer steps (default 600 for recall, 2000 otherwise)", count_from(1));
  option(cli, g, "--lr", "X", "peak learning rate (default 0.01 for recall, 0.002 otherwise)", number_in(0, unbounded));
  option(cli, g, "--min-lr", "X", "learning rate at the end of the cosine decay (default lr / 10)",
         number_in(0, unbounded));
  option(cli, g, "--warmup", "N", "linear warm-up steps (default steps / 30, at most 100)", count_from(0));
  option(cli, g, "--weight-decay", "X", "AdamW decoupled weight decay (default 0.1)", number_in(0, unbounded));
  option(cli, g, "--beta1", "X", "AdamW beta1, in [0, 1) (default 0.9)", number_in(0, 1, Ends::HighOpen));
  option(cli, g, "--beta2", "X", "AdamW beta2, in [0, 1) (default 0.95)", number_in(0, 1, Ends::HighOpen));
  option(cli, g, "--grad-clip", "X", "maximum global gradient norm, 0 = off (default 1)", number_in(0, unbounded));
  option(cli, g, "--batch-size", "N", "sequences per micro-batch (default 16)", count_from(1));
  option(cli, g, "--grad-accum,--gradient-accumulation-steps", "N",
         "micro-batches per optimizer step; the data-parallel gradients are reduced once per step (default 1)",
         count_from(1));
  option(cli, g, "--seed", "N", "seed of the model initialisation and of the data (default 1234)",
         integer_in(0, std::numeric_limits<long long>::max()));
  option(cli, g, "--precision,--mixed-precision", "P",
         "fp32, tf32 or bf16: the projection GEMMs and the LM head, forward and backward, multiply operands rounded "
         "to bf16/TF32 with fp32 sums (tensor cores on CUDA); weights, optimizer state, scans and norms stay fp32; "
         "tf32 also runs the scans' chunk products in TF32. CPU backends emulate the rounding: same numerics, no "
         "faster (default fp32)",
         one_of({"fp32", "tf32", "bf16"}));
  cli.add_flag("--offload-optimizer",
               "keep the AdamW moments in host memory (pinned on CUDA) and run the optimizer step on host threads: "
               "the gradients go to the host and the updated parameters come back every step; saves 8 bytes per "
               "parameter of device memory, costs the copies and the host's update (default: on the device)")
      ->group(g);
}

void declare_data(CLI::App& cli) {
  const char* g = "data";
  option(cli, g, "--seqlen", "N", "tokens per sequence (default 64 for recall, 128 otherwise)", count_from(1));
  option(cli, g, "--kv-pairs", "N", "recall: key-value pairs per sequence (default 8)", count_from(1));
  option(cli, g, "--queries", "N", "recall: queries per sequence (default: every position after the pairs)",
         count_from(1));
  option(cli, g, "--vocab-size", "N", "recall: vocabulary size (default 64)", count_from(2));
  option(cli, g, "--validation-fraction", "X", "text/token data: held-out tail, in [0, 1) (default 0.1)",
         number_in(0, 1, Ends::HighOpen));
  option(cli, g, "--pack-documents", "EOD",
         "text/token data: rows of packed documents, each ended by token EOD (kmamba-tokenize's end-of-document "
         "id): no conv, state or target crosses from one document into the next (every mixer, split across "
         "--sp ranks too)",
         integer_in(0, int_max));
}

// The rope fractions Mamba-3 takes (ModelConfig::validate): half of the state dimensions or all.
CLI::Validator rope_fraction() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        std::size_t used = 0;
        double value = 0.0;
        try {
          value = std::stod(text, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used == text.size() && (value == 0.5 || value == 1.0)) return {};
        return "got '" + text + "', expected 0.5 or 1";
      },
      "");
}

void declare_model(CLI::App& cli) {
  const char* g = "model (new models; --model takes them from its config.json)";
  option(cli, g, "--mixer", "NAME", "mamba1, mamba2 or mamba3 (default mamba2)",
         one_of({"mamba1", "mamba2", "mamba3"}));
  option(cli, g, "--d-model", "N", "model width (default 64 for recall, 128 otherwise)", count_from(1));
  option(cli, g, "--n-layer", "N", "residual blocks (default 2 for recall, 4 otherwise)", count_from(1));
  option(cli, g, "--d-state", "N", "state size per channel (default 16)", count_from(1));
  option(cli, g, "--headdim", "N", "mamba2/mamba3: channels per head (default 16)", count_from(1));
  option(cli, g, "--ngroups", "N", "mamba2/mamba3: B/C groups, a multiple of --tp (default 1)", count_from(1));
  option(cli, g, "--expand", "N", "inner width = expand * d-model (default 2)", count_from(1));
  option(cli, g, "--chunk-size", "N", "mamba2/mamba3: scan chunk length (default 16 for recall, 64 otherwise)",
         count_from(1));
  option(cli, g, "--dt-min", "X", "smallest initial time step (default 0.001)", number_in(0, unbounded, Ends::LowOpen));
  option(cli, g, "--dt-max", "X", "largest initial time step (default 0.1)", number_in(0, unbounded, Ends::LowOpen));
  option(cli, g, "--bc-bias-init", "X",
         "mamba3: initial B_bias and C_bias (default 0.1 for recall, the reference's 1 otherwise)",
         number_in(-1e6, 1e6));
  option(cli, g, "--mimo-rank", "R",
         "mamba3: a MIMO model of rank R, each head's input and output spread over R channels (default: SISO)",
         count_from(1));
  option(cli, g, "--rope-fraction", "X",
         "mamba3: share of the state dimensions the data-dependent rotation turns, 0.5 or 1 (default 0.5)",
         rope_fraction());
  cli.add_flag("--outproj-norm",
               "mamba3, SISO: an RMSNorm over each head's scan output (times norm.weight, then the z gate) before "
               "out_proj (default off)")
      ->group(g);
}

void declare_progress(CLI::App& cli) {
  const char* g = "progress and output";
  option(cli, g, "--eval-interval", "N", "steps between held-out evaluations, 0 = only at the end (default 50)",
         count_from(0));
  option(cli, g, "--eval-batches", "N", "held-out batches per evaluation (default 8)", count_from(1));
  option(cli, g, "--checkpoint-interval", "N", "steps between checkpoints, 0 = only at the end (default 200)",
         count_from(0));
  option(cli, g, "--max-skipped-steps", "N",
         "consecutive steps with a non-finite loss or gradient to skip before stopping, 0 = stop at the first "
         "(default 10)",
         count_from(0));
  option(cli, g, "--log-interval", "N", "steps between progress lines when stdout is not a terminal (default 10)",
         count_from(1));
}

void declare_parallel(CLI::App& cli) {
  const char* g = "parallel (under mpirun -np N; ranks ordered tp fastest, then sp, then dp, then pp)";
  option(cli, g, "--data-parallel-size,--dp", "N", "data-parallel ranks (default: N / (tp * sp * pp))", count_from(0));
  option(cli, g, "--tensor-parallel-size,--tp", "N", "ranks splitting each Mamba-2/3 layer's heads (default 1)",
         count_from(1));
  option(cli, g, "--sequence-parallel-size,--sp", "N", "ranks splitting each sequence into segments (default 1)",
         count_from(1));
  option(cli, g, "--zero-stage", "N",
         "0: every rank keeps all AdamW moments (default); 1: ZeRO-1, moments sharded over dp x sp", integer_in(0, 1));
  cli.add_flag("--activation-checkpointing", "keep only each layer's input and recompute the rest in backward")
      ->group(g);
  option(cli, g, "--pipeline-parallel-size,--pp", "N",
         "pipeline stages, each holding consecutive layers, run 1F1B over the --grad-accum micro-batches (default 1)",
         count_from(1));
  option(cli, g, "--virtual-pipeline-stages,--virtual-stages", "V",
         "chunks of consecutive layers per pipeline stage, run by the interleaved 1F1B schedule (bubble "
         "(pp - 1)/(V * grad_accum + pp - 1) instead of (pp - 1)/(grad_accum + pp - 1)); V > 1 needs --pp >= 2, "
         "n_layer a multiple of V * pp and --grad-accum a multiple of pp (default 1: one chunk)",
         count_from(1));
  option(cli, g, "--sequence-parallel-enabled", "BOOL",
         "true: the ranks that tp x dp leave split each sequence (--sp derived, dp 1 unless given); false: --sp "
         "must be 1",
         boolean());
  option(cli, g, "--sequence-split-strategy", "S",
         "even: equal segments, the first seqlen % sp one token longer (default); balanced: segments of about "
         "equal real tokens (positions with a target) summed over each micro-batch's rows",
         one_of({"even", "balanced"}));
  option(cli, g, "--bucket-mb", "X",
         "MiB of fp32 gradients per data-parallel reduction bucket (default 25): smaller buckets start reducing "
         "earlier in the backward, larger ones make fewer collectives",
         number_in(0, unbounded, Ends::LowOpen));
  option(cli, g, "--overlap-communication", "BOOL",
         "true: the data-parallel gradients are reduced bucket by bucket while the last micro-batch's backward "
         "runs (default); false: after it",
         boolean());
  option(cli, g, "--gradient-sync-frequency", "N",
         "1: the gradients are reduced over dp at every optimizer step (default); N > 1: local SGD, each "
         "data-parallel replica steps on its own data and the parameters and AdamW moments are averaged over dp "
         "every N steps (needs --zero-stage 0, --steps and --checkpoint-interval multiples of N)",
         count_from(1));
  option(cli, g, "--gradient-compression,--grad-compression", "C",
         "none: data-parallel gradients travel in fp32 (default); bf16: rounded to bf16 for the wire and summed in "
         "fp32, half the bytes; powersgd: each weight matrix as rank-r factors with error feedback (--powersgd-rank; "
         "needs --gradient-sync-frequency 1)",
         one_of({"none", "bf16", "powersgd"}));
  option(cli, g, "--powersgd-rank", "R",
         "--grad-compression powersgd: the rank of the factors; an (n, m) weight sends R(n + m) values instead of "
         "n m where that is fewer (default 4)",
         count_from(1));
}

// The keys of the JSON options' "load_balancing" object; each is also an option of its own.
const char* const load_balancing_options[] = {"dynamic-task-allocation", "data-redistribution-threshold",
                                              "communication-pipelining", "async-gradient-allreduce"};

void declare_load_balancing(CLI::App& cli) {
  const char* g = "load balancing (in --config: the keys of the \"load_balancing\" object)";
  option(cli, g, "--dynamic-task-allocation", "BOOL",
         "false: each data-parallel rank takes its fixed share of every global batch (default); true: the rows of "
         "each global batch are dealt to the ranks by their real tokens (positions with a target), longest first, "
         "when the fixed shares are out of balance (--data-redistribution-threshold)",
         boolean());
  option(cli, g, "--data-redistribution-threshold", "X",
         "with --dynamic-task-allocation true: rows are moved only when the busiest rank's fixed share holds more "
         "than (1 + X) times the mean real tokens per rank (default 0.1)",
         number_in(0, unbounded));
  option(cli, g, "--communication-pipelining", "BOOL",
         "the switch of --overlap-communication: bucket reductions pipelined with the backward", boolean());
  option(cli, g, "--async-gradient-allreduce", "BOOL",
         "the switch of --overlap-communication: the gradient all-reduce runs beside the backward (on CUDA on a "
         "communication stream; host transports are synchronous)",
         boolean());
}

std::string json_key(std::string name) {
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

// The long name of `o` without "--" ("batch-size"), the key of TrainOptions and of run.json.
std::string long_name(const CLI::Option& o) { return o.get_lnames().empty() ? o.get_name() : o.get_lnames()[0]; }

// The name of option `name` in messages: its JSON key (in "load_balancing" for that group's), then
// the command-line option.
std::string key_of(const std::string& name) {
  const bool nested = std::find(std::begin(load_balancing_options), std::end(load_balancing_options), name) !=
                      std::end(load_balancing_options);
  return (nested ? "load_balancing." : "") + json_key(name) + " (--" + name + ")";
}

// One JSON options file being applied: the options it set, each with its key and value.
struct JsonSource {
  std::string path;
  std::set<std::string> disallowed;
  std::map<std::string, std::pair<std::string, std::string>> applied;  // long name -> (key, value)
};

// Gives option --`name` the value of `key` unless an earlier source set it, checked as on the
// command line. Two keys of the file that name one option (--tp and --tensor-parallel-size) must
// give it the same value.
void apply_json_option(CLI::App& cli, JsonSource& source, const std::string& key, const std::string& name,
                       const json& value) {
  const std::string& path = source.path;
  CLI::Option* o = cli.get_option_no_throw("--" + name);
  KMAMBA_REQUIRE(o != nullptr && o != cli.get_help_ptr() && source.disallowed.count(long_name(*o)) == 0,
                 "kmamba-train: '" << path << "': unknown or misplaced option \"" << key << "\" (see --help)");
  KMAMBA_REQUIRE(value.is_string() || value.is_number() || value.is_boolean(),
                 "kmamba-train: '" << path << "': option \"" << key << "\" must be a string, number or boolean");
  const std::string text = value.is_string() ? value.get<std::string>() : value.dump();
  const auto [earlier, first] = source.applied.emplace(long_name(*o), std::make_pair(key, text));
  if (!first) {
    KMAMBA_REQUIRE(earlier->second.second == text, "kmamba-train: '" << path << "': \"" << earlier->second.first
                                                                     << "\" and \"" << key << "\" both set --"
                                                                     << long_name(*o) << ", to "
                                                                     << earlier->second.second << " and " << text);
    return;
  }
  if (o->count() > 0) return;  // an earlier source wins
  try {
    o->add_result(text);
    o->run_callback();
  } catch (const CLI::ParseError& e) {
    const bool renamed = key != long_name(*o);  // the message names the option as CLI11 knows it
    KMAMBA_USER_ERROR("kmamba-train: '" << path << "': " << (renamed ? "\"" + key + "\": " : "") << e.what());
  }
}

// The "load_balancing" object: each key is an option of that group.
void apply_load_balancing(CLI::App& cli, JsonSource& source, const json& object) {
  std::string keys;
  for (const char* name : load_balancing_options) keys += (keys.empty() ? "" : ", ") + json_key(name);
  KMAMBA_REQUIRE(object.is_object(), "kmamba-train: '" << source.path
                                                       << "': \"load_balancing\" must be a JSON object with the keys "
                                                       << keys);
  for (auto it = object.begin(); it != object.end(); ++it) {
    std::string name = it.key();
    std::replace(name.begin(), name.end(), '_', '-');
    KMAMBA_REQUIRE(std::find(std::begin(load_balancing_options), std::end(load_balancing_options), name) !=
                       std::end(load_balancing_options),
                   "kmamba-train: '" << source.path << "': unknown key \"" << it.key()
                                     << "\" in \"load_balancing\" (expected " << keys << ")");
    apply_json_option(cli, source, "load_balancing." + it.key(), name, it.value());
  }
}

// Gives the options of the JSON object in `path` that no earlier source set (keys with '-' or
// '_'; the "load_balancing" object holds that group's); keys in `disallowed` are errors.
void apply_json_options(CLI::App& cli, const std::string& path, const std::set<std::string>& disallowed) {
  const json j = kmamba::parse_json(kmamba::read_input_file(path, 16u << 20, "kmamba-train: the options file"),
                                    "kmamba-train: '" + path + "'");
  KMAMBA_REQUIRE(j.is_object(), "kmamba-train: '" << path << "' must hold a JSON object of options");
  JsonSource source{path, disallowed, {}};
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "load_balancing") {
      apply_load_balancing(cli, source, it.value());
      continue;
    }
    std::string name = it.key();
    std::replace(name.begin(), name.end(), '_', '-');
    apply_json_option(cli, source, it.key(), name, it.value());
  }
}

std::string base_name(const std::string& path) {
  std::string name = std::filesystem::path(path).filename().string();
  if (name.empty()) name = std::filesystem::path(path).parent_path().filename().string();
  return name.empty() ? "run" : name;
}

std::string out_of(const TrainOptions& o) {
  const std::string data = o.text("data", ""), model = o.text("model", "");
  return o.text("out", !model.empty() ? "runs/finetune-" + base_name(model)
                       : data.empty() ? "runs/recall"
                                      : "runs/" + base_name(data));
}

void resolve_training(const TrainOptions& o, Run& r) {
  const bool recall = r.recall_task();
  TrainConfig& t = r.train;
  t.total_steps = o.integer("steps", recall ? 600 : 2000);
  t.lr = o.number("lr", recall ? 1e-2 : 2e-3);
  t.min_lr = o.number("min-lr", t.lr / 10.0);
  t.warmup_steps = o.integer("warmup", std::min<long long>(100, t.total_steps / 30));
  t.weight_decay = o.number("weight-decay", 0.1);
  t.beta1 = o.number("beta1", 0.9);
  t.beta2 = o.number("beta2", 0.95);
  t.grad_clip = o.number("grad-clip", 1.0);
  t.batch_size = o.integer("batch-size", 16);
  t.grad_accum = o.integer("grad-accum", 1);
  t.seed = static_cast<std::uint64_t>(o.integer("seed", 1234));
  t.eval_interval = o.integer("eval-interval", 50);
  t.eval_batches = o.integer("eval-batches", 8);
  t.checkpoint_interval = o.integer("checkpoint-interval", 200);
  t.max_skipped_steps = o.integer("max-skipped-steps", 10);
  t.validate();
  r.log_interval = o.integer("log-interval", 10);
  r.precision = parse_matmul_precision(o.text("precision", "fp32"), "kmamba-train: --precision");
  r.offload_optimizer = o.flag("offload-optimizer");
}

// Local SGD (--gradient-sync-frequency N > 1): the replicas are one state only after an averaging,
// so the checkpoints and the end fall on multiples of N, and ZeRO-1's sharded moments are refused.
void resolve_sync_frequency(const TrainOptions& o, Run& r) {
  const std::int64_t n = o.integer("gradient-sync-frequency", 1);
  r.sync_frequency = n;
  if (n == 1) return;
  KMAMBA_REQUIRE(!r.offload_optimizer, "kmamba-train: " << key_of("offload-optimizer") << " with "
                                                        << key_of("gradient-sync-frequency") << " " << n
                                                        << ": local steps average the AdamW moments over dp on the "
                                                           "device, where an offloaded optimizer keeps none; use "
                                                           "gradient_sync_frequency 1 or no optimizer offload");
  KMAMBA_REQUIRE(r.zero_stage == 0, "kmamba-train: " << key_of("zero-stage") << " " << r.zero_stage << " with "
                                                     << key_of("gradient-sync-frequency") << " " << n
                                                     << ": ZeRO-1 shards the AdamW moments over the dp ranks, but "
                                                        "local steps need every replica's own moments; use "
                                                        "zero_stage 0 or gradient_sync_frequency 1");
  for (const auto& [name, value] : {std::make_pair("steps", r.train.total_steps),
                                    std::make_pair("checkpoint-interval", r.train.checkpoint_interval)}) {
    KMAMBA_REQUIRE(value % n == 0, "kmamba-train: " << key_of(name) << " " << value << " is not a multiple of "
                                                    << key_of("gradient-sync-frequency") << " " << n
                                                    << ": the data-parallel replicas are one model, which a "
                                                       "checkpoint holds, only after every N-th step");
  }
}

// --gradient-compression and --powersgd-rank: PowerSGD compresses the gradients that local SGD
// does not reduce, so it needs --gradient-sync-frequency 1; a rank without PowerSGD is refused.
void resolve_compression(const TrainOptions& o, Run& r) {
  r.compression = parse_gradient_compression(o.text("gradient-compression", "none"), "kmamba-train");
  const std::string name = gradient_compression_name(r.compression);
  r.powersgd_rank = static_cast<int>(o.integer("powersgd-rank", 4));
  KMAMBA_REQUIRE(r.compression == GradientCompression::PowerSgd || !o.has("powersgd-rank"),
                 "kmamba-train: " << key_of("powersgd-rank") << " " << r.powersgd_rank << " with "
                                  << key_of("gradient-compression") << " " << name
                                  << ": the rank applies to gradient_compression powersgd only");
  const long long sync = o.integer("gradient-sync-frequency", 1);
  KMAMBA_REQUIRE(r.compression != GradientCompression::PowerSgd || sync == 1,
                 "kmamba-train: " << key_of("gradient-compression") << " " << name << " with "
                                  << key_of("gradient-sync-frequency") << " " << sync
                                  << ": local steps reduce no gradients over dp between averagings, so there is "
                                     "nothing to compress; use gradient_compression none or gradient_sync_frequency 1");
}

// --overlap-communication and the load-balancing options --communication-pipelining and
// --async-gradient-allreduce name one switch; those given must agree.
bool resolve_overlap(const TrainOptions& o) {
  const char* given = nullptr;
  bool overlap = true;
  for (const char* name : {"overlap-communication", "communication-pipelining", "async-gradient-allreduce"}) {
    if (!o.has(name)) continue;
    const bool value = o.flag(name);
    KMAMBA_REQUIRE(given == nullptr || value == overlap,
                   "kmamba-train: " << key_of(given) << " " << std::boolalpha << overlap << " conflicts with "
                                    << key_of(name) << " " << value
                                    << ": both set whether the gradient reduction overlaps the backward");
    given = name;
    overlap = value;
  }
  return overlap;
}

// --sequence-parallel-enabled against --sp: false needs sp 1; true takes an --sp above 1, or
// derives it from the world size (mesh_for_world) when --sp is not given.
void resolve_sequence_parallel(const TrainOptions& o, Run& r) {
  if (!o.has("sequence-parallel-enabled")) return;
  const bool enabled = o.flag("sequence-parallel-enabled");
  const int sp = r.mesh.sequence_parallel_size;
  KMAMBA_REQUIRE(enabled ? !o.has("sequence-parallel-size") || sp > 1 : sp == 1,
                 "kmamba-train: " << key_of("sequence-parallel-enabled") << " " << std::boolalpha << enabled
                                  << " conflicts with sequence_parallel_size (--sp) " << sp
                                  << (enabled ? ": sequence parallelism needs at least 2 ranks per sequence (leave "
                                                "--sp out to derive it)"
                                              : ""));
  r.derive_sequence_parallel = enabled && !o.has("sequence-parallel-size");
}

void resolve_parallel(const TrainOptions& o, Run& r) {
  r.mesh.data_parallel_size = static_cast<int>(o.integer("data-parallel-size", 0));
  r.mesh.tensor_parallel_size = static_cast<int>(o.integer("tensor-parallel-size", 1));
  r.mesh.sequence_parallel_size = static_cast<int>(o.integer("sequence-parallel-size", 1));
  r.mesh.pipeline_parallel_size = static_cast<int>(o.integer("pipeline-parallel-size", 1));
  r.virtual_pipeline_stages = static_cast<int>(o.integer("virtual-pipeline-stages", 1));
  r.zero_stage = static_cast<int>(o.integer("zero-stage", 0));
  r.activation_checkpointing = o.flag("activation-checkpointing");
  resolve_compression(o, r);
  resolve_sync_frequency(o, r);
  r.overlap_communication = resolve_overlap(o);
  r.balancing.dynamic_task_allocation = o.flag("dynamic-task-allocation");
  r.balancing.data_redistribution_threshold = o.number("data-redistribution-threshold", 0.1);
  r.balancing.sequence_split =
      o.text("sequence-split-strategy", "even") == "balanced" ? SequenceSplit::Balanced : SequenceSplit::Even;
  const double bucket_bytes = o.number("bucket-mb", 25.0) * static_cast<double>(1 << 20);
  r.bucket_elements = std::max<std::size_t>(1, static_cast<std::size_t>(bucket_bytes / sizeof(float)));
  resolve_sequence_parallel(o, r);
}

void resolve_data(const TrainOptions& o, Run& r) {
  const bool recall = r.recall_task();
  const std::int64_t seqlen = o.integer("seqlen", recall ? 64 : 128);
  if (recall) {
    r.recall.vocab_size = static_cast<int>(o.integer("vocab-size", 64));
    r.recall.num_kv_pairs = static_cast<int>(o.integer("kv-pairs", 8));
    r.recall.seqlen = seqlen;
    r.recall.num_queries =
        static_cast<int>(o.integer("queries", std::max<std::int64_t>(1, seqlen - 2 * r.recall.num_kv_pairs)));
    r.recall.seed = r.train.seed;
    r.recall.validate();
    KMAMBA_REQUIRE(!o.has("pack-documents"),
                   "kmamba-train: --pack-documents packs the documents of --data; the recall task has none");
  } else {
    KMAMBA_REQUIRE(!o.has("kv-pairs") && !o.has("vocab-size") && !o.has("queries"),
                   "kmamba-train: --kv-pairs, --queries and --vocab-size configure the recall task, not --data");
    r.tokens.document_end = o.integer("pack-documents", -1);
    r.tokens.seqlen = seqlen;
    r.tokens.validation_fraction = o.number("validation-fraction", 0.1);
    r.tokens.seed = r.train.seed;
  }
}

const char* const architecture_options[] = {"mixer",        "d-model",   "n-layer",       "d-state",     "headdim",
                                            "ngroups",      "expand",    "chunk-size",    "dt-min",      "dt-max",
                                            "bc-bias-init", "mimo-rank", "rope-fraction", "outproj-norm"};

// The Mamba-3 options of a new model; each is an error for another mixer.
void resolve_mamba3(const TrainOptions& o, const std::string& mixer, bool recall, ModelConfig& m) {
  const bool m3 = m.mixer == MixerKind::Mamba3;
  for (const char* name : {"bc-bias-init", "mimo-rank", "rope-fraction", "outproj-norm"}) {
    KMAMBA_REQUIRE(m3 || !o.has(name), "kmamba-train: --" << name << " configures a mamba3 model, not " << mixer);
  }
  if (!m3) return;
  m.bc_bias_init = o.number("bc-bias-init", recall ? 0.1 : 1.0);
  m.is_mimo = o.has("mimo-rank");
  m.mimo_rank = static_cast<int>(o.integer("mimo-rank", m.mimo_rank));
  m.rope_fraction = o.number("rope-fraction", m.rope_fraction);
  m.is_outproj_norm = o.flag("outproj-norm");
  KMAMBA_REQUIRE(!(m.is_mimo && m.is_outproj_norm), "kmamba-train: --outproj-norm with --mimo-rank "
                                                        << m.mimo_rank
                                                        << ": the out-proj norm is for SISO models (the MIMO "
                                                           "scan contracts the ranks before out_proj)");
}

void resolve_model(const TrainOptions& o, Run& r) {
  const bool recall = r.recall_task();
  if (!r.model_dir.empty()) {
    for (const char* name : architecture_options) {
      KMAMBA_REQUIRE(!o.has(name), "kmamba-train: --" << name << " conflicts with --model (the architecture comes from "
                                                      << r.model_dir << "/config.json)");
    }
    return;
  }
  ModelConfig& m = r.model;
  const std::string mixer = o.text("mixer", "mamba2");
  m.mixer = mixer == "mamba1" ? MixerKind::Mamba1 : mixer == "mamba2" ? MixerKind::Mamba2 : MixerKind::Mamba3;
  m.d_model = static_cast<int>(o.integer("d-model", recall ? 64 : 128));
  m.n_layer = static_cast<int>(o.integer("n-layer", recall ? 2 : 4));
  m.d_state = static_cast<int>(o.integer("d-state", 16));
  m.expand = static_cast<int>(o.integer("expand", 2));
  m.headdim = static_cast<int>(o.integer("headdim", 16));
  m.ngroups = static_cast<int>(o.integer("ngroups", 1));
  m.chunk_size = static_cast<int>(o.integer("chunk-size", recall ? 16 : 64));
  m.dt_min = o.number("dt-min", m.dt_min);
  m.dt_max = o.number("dt-max", m.dt_max);
  resolve_mamba3(o, mixer, recall, m);
  m.vocab_size = recall ? r.recall.vocab_size : 256;  // replaced by a token file's vocabulary
}

Run resolve(const TrainOptions& o) {
  Run r;
  r.data_path = o.text("data", "");
  r.model_dir = o.text("model", "");
  r.tokenizer = o.text("tokenizer", "");
  r.kind = r.data_path.empty() ? Run::Kind::Recall : Run::Kind::Tokens;
  r.resume = o.flag("resume");
  r.device = o.text("device", "");
  r.out = out_of(o);
  resolve_training(o, r);
  resolve_parallel(o, r);
  resolve_data(o, r);
  resolve_model(o, r);
  return r;
}

// The options given on the command line or by --config: those with a value before run.json.
std::set<std::string> given_options(const CLI::App& cli) {
  std::set<std::string> given;
  for (const CLI::Option* o : cli.get_options()) {
    if (o->count() > 0) given.insert(long_name(*o));
  }
  return given;
}

}  // namespace

void declare_train_options(CLI::App& cli) {
  declare_what(cli);
  declare_optimisation(cli);
  declare_data(cli);
  declare_model(cli);
  declare_progress(cli);
  declare_parallel(cli);
  declare_load_balancing(cli);
}

bool TrainOptions::has(const std::string& name) const { return cli_.count("--" + name) > 0; }

std::string TrainOptions::text(const std::string& name, const std::string& fallback) const {
  return has(name) ? cli_.get_option("--" + name)->as<std::string>() : fallback;
}

bool TrainOptions::flag(const std::string& name) const { return has(name) && cli_.get_option("--" + name)->as<bool>(); }

long long TrainOptions::integer(const std::string& name, long long fallback) const {
  return has(name) ? cli_.get_option("--" + name)->as<long long>() : fallback;
}

double TrainOptions::number(const std::string& name, double fallback) const {
  return has(name) ? cli_.get_option("--" + name)->as<double>() : fallback;
}

Run configure_run(CLI::App& cli) {
  const TrainOptions o(cli);
  if (o.has("config")) apply_json_options(cli, o.text("config", ""), {"config"});
  const std::set<std::string> given = given_options(cli);
  if (o.flag("resume")) {
    const std::string out = out_of(o);
    StagedDirectory::recover(out + "/checkpoint");  // a save killed mid-way on a file system without exchange
    KMAMBA_REQUIRE(std::filesystem::exists(out + "/checkpoint/training_state.safetensors"),
                   "kmamba-train: --resume: no checkpoint in '" << out << "/checkpoint' (pass the run's --out)");
    const std::string saved = out + "/run.json";
    KMAMBA_REQUIRE(std::filesystem::exists(saved),
                   "kmamba-train: --resume: '" << saved << "' is missing; it holds the run's options (--steps, the "
                                               << "learning-rate schedule, the data), without which the run would "
                                               << "continue on other ones");
    apply_json_options(cli, saved, {"config", "resume"});
  }
  Run r = resolve(o);
  r.given = given;
  return r;
}

bool asks_for_ranks(const CLI::App& cli) {
  for (const char* name : {"--data-parallel-size", "--tensor-parallel-size", "--sequence-parallel-size",
                           "--pipeline-parallel-size", "--sequence-parallel-enabled", "--zero-stage",
                           "--gradient-sync-frequency", "--gradient-compression", "--powersgd-rank"}) {
    if (cli.count(name) > 0) return true;
  }
  return false;
}

MeshConfig mesh_for_world(const Run& run, int world_size) {
  MeshConfig mesh = run.mesh;
  if (run.derive_sequence_parallel) {
    mesh.data_parallel_size = std::max(1, mesh.data_parallel_size);
    const long long others =
        static_cast<long long>(mesh.tensor_parallel_size) * mesh.data_parallel_size * mesh.pipeline_parallel_size;
    std::string sizes = "tensor_parallel_size " + std::to_string(mesh.tensor_parallel_size) + " x data_parallel_size " +
                        std::to_string(mesh.data_parallel_size);
    if (mesh.pipeline_parallel_size > 1)
      sizes += " x pipeline_parallel_size " + std::to_string(mesh.pipeline_parallel_size);
    KMAMBA_REQUIRE(world_size % others == 0, "kmamba-train: " << key_of("sequence-parallel-enabled")
                                                              << " true: the world's " << world_size
                                                              << " ranks are not a multiple of " << sizes);
    KMAMBA_REQUIRE(world_size / others > 1, "kmamba-train: " << key_of("sequence-parallel-enabled")
                                                             << " true: " << sizes << " use all " << world_size
                                                             << " ranks of the world, leaving none to split "
                                                                "sequences (sequence parallelism needs at least 2 "
                                                                "ranks per sequence)");
    mesh.sequence_parallel_size = static_cast<int>(world_size / others);
  }
  return mesh.resolve(world_size);
}

void check_virtual_stages(const Run& run, const ModelConfig& config) {
  const int v = run.virtual_pipeline_stages, p = run.mesh.pipeline_parallel_size;
  if (v == 1) return;
  const std::string key = key_of("virtual-pipeline-stages") + " " + std::to_string(v);
  KMAMBA_REQUIRE(p >= 2, "kmamba-train: " << key << " needs " << key_of("pipeline-parallel-size")
                                          << " >= 2 (chunks of a pipeline stage), got " << p);
  KMAMBA_REQUIRE(config.n_layer % (v * p) == 0,
                 "kmamba-train: " << key << " with " << key_of("pipeline-parallel-size") << " " << p
                                  << " splits the layers into " << v * p << " equal chunks: " << key_of("n-layer")
                                  << " must be a multiple of " << v * p << ", got " << config.n_layer);
  KMAMBA_REQUIRE(run.train.grad_accum % p == 0,
                 "kmamba-train: " << key << " runs the micro-batches through the chunks in groups of "
                                  << key_of("pipeline-parallel-size") << " " << p << ": " << key_of("grad-accum")
                                  << " must be a multiple of " << p << ", got " << run.train.grad_accum);
}

void check_resumed_architecture(const Run& run, const ModelConfig& saved) {
  const ModelConfig& m = run.model;
  const std::vector<std::pair<const char*, bool>> same = {
      {"mixer", m.mixer == saved.mixer},
      {"d-model", m.d_model == saved.d_model},
      {"n-layer", m.n_layer == saved.n_layer},
      {"d-state", m.d_state == saved.d_state},
      {"headdim", m.headdim == saved.headdim},
      {"ngroups", m.ngroups == saved.ngroups},
      {"expand", m.expand == saved.expand},
      {"chunk-size", m.chunk_size == saved.chunk_size},
      {"mimo-rank", m.is_mimo == saved.is_mimo && m.mimo_rank == saved.mimo_rank},
      {"rope-fraction", m.rope_fraction == saved.rope_fraction},
      {"outproj-norm", m.is_outproj_norm == saved.is_outproj_norm},
      {"vocab-size", m.vocab_size == saved.vocab_size}};
  for (const auto& [name, equal] : same) {
    KMAMBA_REQUIRE(run.given.count(name) == 0 || equal,
                   "kmamba-train: --resume: --" << name << " differs from the checkpoint's architecture in '"
                                                << run.checkpoint() << "/config.json' (a resumed run keeps it)");
  }
  for (const char* name : {"dt-min", "dt-max", "bc-bias-init"}) {
    KMAMBA_REQUIRE(run.given.count(name) == 0, "kmamba-train: --resume: --"
                                                   << name
                                                   << " sets the initialisation, which a resumed run does not redo");
  }
}

void write_run_json(const CLI::App& cli, const Run& run) {
  json j = json::object();
  for (const CLI::Option* o : cli.get_options()) {
    const std::string name = long_name(*o);
    if (o->count() == 0 || name == "resume" || name == "config") continue;
    j[json_key(name)] = o->as<std::string>();
  }
  j["out"] = run.out;
  kmamba::write_output_file(run.out + "/run.json", j.dump(2) + '\n', "kmamba-train");
}

}  // namespace app
}  // namespace kmamba
