// kmamba-train: trains a Mamba language model. With no arguments it runs the embedded default, a
// small Mamba-2 learning multi-query associative recall; --data trains on text or token files and
// --model fine-tunes a Hugging Face checkpoint. See print_help() for every option. Under
// `mpirun -np N` it trains on a dp × tp × sp process mesh (--dp --tp --sp); only world rank 0
// prints and writes.
#include <kmamba/KMamba.hpp>
#include <kmamba/core/Json.hpp>
#include <kmamba/parallel/ProcessMesh.hpp>

#include "DeviceOption.hpp"
#include "Plot.hpp"

#include <nlohmann/json.hpp>

#include <unistd.h>

#if KMAMBA_ENABLE_MPI
#include <mpi.h>
#endif

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

namespace {

using json = nlohmann::json;

// ---------------------------------------------------------------------------------------------
// Options: one table drives the command line, the JSON config file, run.json and --help.

struct OptionSpec {
  const char* name;   // long option without "--"; the JSON key is the same with '_' for '-'
  const char* value;  // value placeholder; nullptr for a flag
  const char* help;
};

const std::vector<std::pair<const char*, std::vector<OptionSpec>>>& option_table() {
  static const std::vector<std::pair<const char*, std::vector<OptionSpec>>> table = {
      {"what to train",
       {{"data", "FILE", "train on FILE: a KMTOKENS token file, or any other file as byte-level text (vocab 256)"},
        {"model", "DIR", "fine-tune the Hugging Face checkpoint DIR (config.json + model.safetensors)"},
        {"config", "FILE",
         "read options from a JSON object, e.g. {\"steps\": 500, \"lr\": 0.001}; command-line options win"},
        {"out", "DIR", "run directory (default runs/recall, runs/<data file name> or runs/finetune-<model dir name>)"},
        {"resume", nullptr, "continue the run in --out from its checkpoint (its options are the defaults)"},
        {"device", "NAME", "serial, openmp or cuda (default: the build's default execution space)"}}},
      {"optimisation",
       {{"steps", "N", "optimizer steps (default 600 for recall, 2000 otherwise)"},
        {"lr", "X", "peak learning rate (default 0.01 for recall, 0.002 otherwise)"},
        {"min-lr", "X", "learning rate at the end of the cosine decay (default lr / 10)"},
        {"warmup", "N", "linear warm-up steps (default steps / 30, at most 100)"},
        {"weight-decay", "X", "AdamW decoupled weight decay (default 0.1)"},
        {"beta1", "X", "AdamW beta1 (default 0.9)"},
        {"beta2", "X", "AdamW beta2 (default 0.95)"},
        {"grad-clip", "X", "maximum global gradient norm, 0 = off (default 1)"},
        {"batch-size", "N", "sequences per micro-batch (default 16)"},
        {"grad-accum", "N", "micro-batches per optimizer step (default 1)"},
        {"seed", "N", "seed of the model initialisation and of the data (default 1234)"},
        {"precision", "P",
         "fp32, tf32 or bf16: the projection GEMMs and the LM head, forward and backward, multiply operands rounded "
         "to bf16/TF32 with fp32 sums (tensor cores on CUDA); weights, optimizer state, scans and norms stay fp32; "
         "tf32 also runs the scans' chunk products in TF32. CPU backends emulate the rounding: same numerics, no "
         "faster (default fp32)"}}},
      {"data",
       {{"seqlen", "N", "tokens per sequence (default 64 for recall, 128 otherwise)"},
        {"kv-pairs", "N", "recall: key-value pairs per sequence (default 8)"},
        {"queries", "N", "recall: queries per sequence (default: every position after the pairs)"},
        {"vocab-size", "N", "recall: vocabulary size (default 64)"},
        {"validation-fraction", "X", "text/token data: held-out tail (default 0.1)"}}},
      {"model (new models; --model takes them from its config.json)",
       {{"mixer", "NAME", "mamba1, mamba2 or mamba3 (default mamba2)"},
        {"d-model", "N", "model width (default 64 for recall, 128 otherwise)"},
        {"n-layer", "N", "residual blocks (default 2 for recall, 4 otherwise)"},
        {"d-state", "N", "state size per channel (default 16)"},
        {"headdim", "N", "mamba2/mamba3: channels per head (default 16)"},
        {"ngroups", "N", "mamba2/mamba3: B/C groups, a multiple of --tp (default 1)"},
        {"expand", "N", "inner width = expand * d-model (default 2)"},
        {"chunk-size", "N", "mamba2/mamba3: scan chunk length (default 16 for recall, 64 otherwise)"},
        {"dt-min", "X", "smallest initial time step (default 0.001)"},
        {"dt-max", "X", "largest initial time step (default 0.1)"},
        {"bc-bias-init", "X", "mamba3: initial B_bias and C_bias (default 0.1 for recall, the reference's 1 otherwise)"}}},
      {"progress and output",
       {{"eval-interval", "N", "steps between held-out evaluations, 0 = only at the end (default 50)"},
        {"eval-batches", "N", "held-out batches per evaluation (default 8)"},
        {"checkpoint-interval", "N", "steps between checkpoints, 0 = only at the end (default 200)"},
        {"max-skipped-steps", "N",
         "consecutive steps with a non-finite loss or gradient to skip before stopping, 0 = stop at the first "
         "(default 10)"},
        {"log-interval", "N", "steps between progress lines when stdout is not a terminal (default 10)"}}},
      {"parallel (under mpirun -np N; ranks ordered tp fastest, then sp, then dp)",
       {{"data-parallel-size", "N", "--dp: data-parallel ranks (default: N / (tp * sp))"},
        {"tensor-parallel-size", "N", "--tp: ranks splitting each Mamba-2/3 layer's heads (default 1)"},
        {"sequence-parallel-size", "N", "--sp: ranks splitting each sequence into segments (default 1)"},
        {"zero-stage", "N", "0: every rank keeps all AdamW moments (default); 1: ZeRO-1, moments sharded over dp x sp"},
        {"activation-checkpointing", nullptr, "keep only each layer's input and recompute the rest in backward"}}},
  };
  return table;
}

void print_help() {
  std::printf(
      "usage: kmamba-train [options]\n"
      "\n"
      "Trains a Mamba language model. Without options: the embedded default, a small Mamba-2 that learns\n"
      "multi-query associative recall (key-value pairs, then the keys again; the model must answer each\n"
      "with its value) in a few minutes on a CPU. The run directory receives metrics.jsonl (one JSON\n"
      "object per step and evaluation), loss.png, run.json (the options) and checkpoint/ (a Hugging Face\n"
      "model plus training_state.safetensors). Ctrl-C stops after the current step and saves a checkpoint.\n");
  for (const auto& [group, options] : option_table()) {
    std::printf("\n%s:\n", group);
    for (const OptionSpec& o : options) {
      const std::string left = std::string("--") + o.name + (o.value ? std::string(" ") + o.value : "");
      std::printf("  %-26s %s\n", left.c_str(), o.help);
    }
  }
  std::printf(
      "  -h, --help                 this text\n"
      "\n"
      "Token files: 32-byte header \"KMTOKENS\", u32 version 1, u32 bytes per token (2 or 4), u64 vocabulary\n"
      "size, u64 token count, then the tokens, all little-endian (see kmamba/models/Data.hpp).\n"
      "Kokkos options (--kokkos-threads=N, ...) are accepted too.\n");
}

const OptionSpec* find_option(const std::string& name) {
  if (name == "dp") return find_option("data-parallel-size");
  if (name == "tp") return find_option("tensor-parallel-size");
  if (name == "sp") return find_option("sequence-parallel-size");
  for (const auto& group : option_table()) {
    for (const OptionSpec& o : group.second) {
      if (name == o.name) return &o;
    }
  }
  return nullptr;
}

std::string json_key(std::string name) {
  std::replace(name.begin(), name.end(), '-', '_');
  return name;
}

// Option values by name ("batch-size"), as text, merged from the sources in order of precedence.
using Values = std::map<std::string, std::string>;

Values parse_command_line(int argc, char** argv) {
  Values v;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--kokkos-", 0) == 0) continue;
    KMAMBA_REQUIRE(a.rfind("--", 0) == 0, "kmamba-train: unexpected argument '" << a << "' (see --help)");
    std::string name = a.substr(2), value;
    const std::size_t eq = name.find('=');
    const bool inline_value = eq != std::string::npos;
    if (inline_value) value = name.substr(eq + 1), name = name.substr(0, eq);
    const OptionSpec* spec = find_option(name);
    KMAMBA_REQUIRE(spec != nullptr, "kmamba-train: unknown option '--" << name << "' (see --help)");
    name = spec->name;  // --dp, --tp, --sp are short for the mesh options
    if (spec->value == nullptr) {
      KMAMBA_REQUIRE(!inline_value, "kmamba-train: --" << name << " takes no value");
      value = "true";
    } else if (!inline_value) {
      KMAMBA_REQUIRE(i + 1 < argc, "kmamba-train: --" << name << " needs a value " << spec->value << " (see --help)");
      value = argv[++i];
    }
    v[name] = value;
  }
  return v;
}

// A JSON object of options (keys with '-' or '_'); keys in `disallowed` are errors.
Values read_json_options(const std::string& path, const std::set<std::string>& disallowed) {
  const json j = kmamba::parse_json(kmamba::read_input_file(path, 16u << 20, "kmamba-train: the config file"),
                                   "kmamba-train: '" + path + "'");
  KMAMBA_REQUIRE(j.is_object(), "kmamba-train: '" << path << "' must hold a JSON object of options");
  Values v;
  for (auto it = j.begin(); it != j.end(); ++it) {
    std::string name = it.key();
    std::replace(name.begin(), name.end(), '_', '-');
    const OptionSpec* spec = find_option(name);
    KMAMBA_REQUIRE(spec != nullptr && disallowed.count(name) == 0,
                   "kmamba-train: '" << path << "': unknown or misplaced option \"" << it.key() << "\" (see --help)");
    const json& value = it.value();
    if (value.is_string()) {
      v[name] = value.get<std::string>();
    } else if (value.is_number() || value.is_boolean()) {
      v[name] = value.dump();
    } else {
      KMAMBA_USER_ERROR("kmamba-train: '" << path << "': option \"" << it.key()
                                          << "\" must be a string, number or boolean");
    }
    KMAMBA_REQUIRE(spec->value != nullptr || v[name] == "true" || v[name] == "false",
                   "kmamba-train: '" << path << "': option \"" << it.key() << "\" must be true or false");
  }
  return v;
}

// Typed access to the merged values, with errors that name the option.
class Options {
 public:
  explicit Options(Values values) : values_(std::move(values)) {}
  bool has(const std::string& name) const { return values_.count(name) != 0; }
  std::string text(const std::string& name, const std::string& fallback) const {
    return has(name) ? values_.at(name) : fallback;
  }
  bool flag(const std::string& name) const { return has(name) && values_.at(name) == "true"; }
  long long integer(const std::string& name, long long fallback, long long min,
                    long long max = std::numeric_limits<int>::max()) const {
    if (!has(name)) return fallback;
    const std::string& s = values_.at(name);
    char* end = nullptr;
    errno = 0;
    const long long v = std::strtoll(s.c_str(), &end, 10);
    KMAMBA_REQUIRE(!s.empty() && end == s.c_str() + s.size() && errno == 0,
                   "kmamba-train: --" << name << " expects an integer, got '" << s << "'");
    KMAMBA_REQUIRE(v >= min && v <= max,
                   "kmamba-train: --" << name << " must lie in [" << min << ", " << max << "], got " << v);
    return v;
  }
  double number(const std::string& name, double fallback) const {
    if (!has(name)) return fallback;
    const std::string& s = values_.at(name);
    char* end = nullptr;
    const double v = std::strtod(s.c_str(), &end);
    KMAMBA_REQUIRE(!s.empty() && end == s.c_str() + s.size() && std::isfinite(v),
                   "kmamba-train: --" << name << " expects a number, got '" << s << "'");
    return v;
  }
  const Values& values() const { return values_; }

 private:
  Values values_;
};

// Everything a run needs, resolved from the options with the defaults of its kind.
struct Run {
  explicit Run(Options o) : options(std::move(o)) {}
  Options options;
  enum class Kind { Recall, Tokens } kind = Kind::Recall;
  std::string data_path, model_dir, out, device;
  bool resume = false;
  kmamba::TrainConfig train;
  kmamba::AssociativeRecallConfig recall;
  kmamba::TokenDatasetConfig tokens;
  kmamba::ModelConfig model;
  kmamba::MeshConfig mesh;
  int zero_stage = 0;
  kmamba::MatmulPrecision precision = kmamba::MatmulPrecision::Float32;
  std::int64_t log_interval = 10;
};

std::string base_name(const std::string& path) {
  std::string name = std::filesystem::path(path).filename().string();
  if (name.empty()) name = std::filesystem::path(path).parent_path().filename().string();
  return name.empty() ? "run" : name;
}

Run resolve(const Options& o) {
  Run r(o);
  r.data_path = o.text("data", "");
  r.model_dir = o.text("model", "");
  r.kind = r.data_path.empty() ? Run::Kind::Recall : Run::Kind::Tokens;
  const bool recall = r.kind == Run::Kind::Recall;
  r.resume = o.flag("resume");
  r.device = o.text("device", "");
  kmamba_apps::check_device("kmamba-train", r.device);
  r.out = o.text("out", !r.model_dir.empty() ? "runs/finetune-" + base_name(r.model_dir)
                        : recall             ? "runs/recall"
                                             : "runs/" + base_name(r.data_path));

  kmamba::TrainConfig& t = r.train;
  t.total_steps = o.integer("steps", recall ? 600 : 2000, 1);
  t.lr = o.number("lr", recall ? 1e-2 : 2e-3);
  t.min_lr = o.number("min-lr", t.lr / 10.0);
  t.warmup_steps = o.integer("warmup", std::min<long long>(100, t.total_steps / 30), 0);
  t.weight_decay = o.number("weight-decay", 0.1);
  t.beta1 = o.number("beta1", 0.9);
  t.beta2 = o.number("beta2", 0.95);
  t.grad_clip = o.number("grad-clip", 1.0);
  t.batch_size = o.integer("batch-size", 16, 1);
  t.grad_accum = o.integer("grad-accum", 1, 1);
  t.seed = static_cast<std::uint64_t>(o.integer("seed", 1234, 0, std::numeric_limits<long long>::max()));
  t.eval_interval = o.integer("eval-interval", 50, 0);
  t.eval_batches = o.integer("eval-batches", 8, 1);
  t.checkpoint_interval = o.integer("checkpoint-interval", 200, 0);
  t.max_skipped_steps = o.integer("max-skipped-steps", 10, 0);
  t.validate();
  r.log_interval = o.integer("log-interval", 10, 1);
  r.precision = kmamba::parse_matmul_precision(o.text("precision", "fp32"), "kmamba-train: --precision");
  r.mesh.data_parallel_size = static_cast<int>(o.integer("data-parallel-size", 0, 0));
  r.mesh.tensor_parallel_size = static_cast<int>(o.integer("tensor-parallel-size", 1, 1));
  r.mesh.sequence_parallel_size = static_cast<int>(o.integer("sequence-parallel-size", 1, 1));
  r.zero_stage = static_cast<int>(o.integer("zero-stage", 0, 0, 1));

  const std::int64_t seqlen = o.integer("seqlen", recall ? 64 : 128, 1);
  if (recall) {
    r.recall.vocab_size = static_cast<int>(o.integer("vocab-size", 64, 2));
    r.recall.num_kv_pairs = static_cast<int>(o.integer("kv-pairs", 8, 1));
    r.recall.seqlen = seqlen;
    r.recall.num_queries =
        static_cast<int>(o.integer("queries", std::max<std::int64_t>(1, seqlen - 2 * r.recall.num_kv_pairs), 1));
    r.recall.seed = t.seed;
    r.recall.validate();
  } else {
    KMAMBA_REQUIRE(!o.has("kv-pairs") && !o.has("vocab-size") && !o.has("queries"),
                   "kmamba-train: --kv-pairs, --queries and --vocab-size configure the recall task, not --data");
    r.tokens.seqlen = seqlen;
    r.tokens.validation_fraction = o.number("validation-fraction", 0.1);
    r.tokens.seed = t.seed;
  }

  if (!r.model_dir.empty()) {
    for (const char* name : {"mixer", "d-model", "n-layer", "d-state", "headdim", "ngroups", "expand", "chunk-size",
                           "dt-min", "dt-max", "bc-bias-init"}) {
      KMAMBA_REQUIRE(!o.has(name), "kmamba-train: --" << name << " conflicts with --model (the architecture comes from "
                                                      << r.model_dir << "/config.json)");
    }
    return r;
  }
  kmamba::ModelConfig& m = r.model;
  const std::string mixer = o.text("mixer", "mamba2");
  KMAMBA_REQUIRE(mixer == "mamba1" || mixer == "mamba2" || mixer == "mamba3",
                 "kmamba-train: --mixer must be mamba1, mamba2 or mamba3, got '" << mixer << "'");
  m.mixer = mixer == "mamba1"   ? kmamba::MixerKind::Mamba1
            : mixer == "mamba2" ? kmamba::MixerKind::Mamba2
                                : kmamba::MixerKind::Mamba3;
  m.d_model = static_cast<int>(o.integer("d-model", recall ? 64 : 128, 1));
  m.n_layer = static_cast<int>(o.integer("n-layer", recall ? 2 : 4, 1));
  m.d_state = static_cast<int>(o.integer("d-state", 16, 1));
  m.expand = static_cast<int>(o.integer("expand", 2, 1));
  m.headdim = static_cast<int>(o.integer("headdim", 16, 1));
  m.ngroups = static_cast<int>(o.integer("ngroups", 1, 1));
  m.chunk_size = static_cast<int>(o.integer("chunk-size", recall ? 16 : 64, 1));
  m.dt_min = o.number("dt-min", m.dt_min);
  m.dt_max = o.number("dt-max", m.dt_max);
  KMAMBA_REQUIRE(m.mixer == kmamba::MixerKind::Mamba3 || !o.has("bc-bias-init"),
                 "kmamba-train: --bc-bias-init configures a mamba3 model, not " << mixer);
  if (m.mixer == kmamba::MixerKind::Mamba3) m.bc_bias_init = o.number("bc-bias-init", recall ? 0.1 : 1.0);
  m.vocab_size = recall ? r.recall.vocab_size : 256;  // replaced by a token file's vocabulary
  return r;
}

// ---------------------------------------------------------------------------------------------
// Progress, metrics and the loss curve.

volatile std::sig_atomic_t stop_requested = 0;
bool mpi_running = false;           // main initialised MPI (launched by mpirun, or given a mesh option)
bool errors_are_collective = true;  // an error so far is raised on every rank alike (MPI_Finalize, not Abort)
#if KMAMBA_ENABLE_MPI
int mpi_world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}
#endif
bool progress_line_open = false;  // a \r-updated line is on the terminal without its newline

extern "C" void on_stop_signal(int) {
  stop_requested = 1;
  const char message[] = "\nkmamba-train: stopping after this step (Ctrl-C again to abort without a checkpoint)\n";
  const ssize_t ignored = ::write(2, message, sizeof(message) - 1);
  (void)ignored;
}

void install_stop_handler() {
  struct sigaction action {};
  action.sa_handler = on_stop_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESETHAND;  // a second signal takes the default action
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
}

// printf into a std::string.
template <class... Args>
std::string format(const char* pattern, Args... args) {
  char text[256];
  std::snprintf(text, sizeof(text), pattern, args...);
  return text;
}

std::string duration(double seconds) {
  const long long s = std::llround(std::max(0.0, seconds));
  if (s >= 3600) return format("%lldh%02lldm", s / 3600, (s / 60) % 60);
  if (s >= 60) return format("%lldm%02llds", s / 60, s % 60);
  return format("%llds", s);
}

std::string rate(double tokens_per_second) {
  if (tokens_per_second >= 1e6) return format("%.2fM", tokens_per_second * 1e-6);
  if (tokens_per_second >= 1e3) return format("%.1fk", tokens_per_second * 1e-3);
  return format("%.0f", tokens_per_second);
}

// The metrics log and the curves drawn from it.
class Metrics {
 public:
  // `writes`: false on the ranks other than world rank 0, which only keep the records.
  Metrics(const std::string& dir, bool recall, bool writes)
      : path_(dir + "/metrics.jsonl"), plot_path_(dir + "/loss.png"), recall_(recall), writes_(writes) {}

  // Keeps the records of steps <= `last_step` (those the checkpoint covers) and drops the rest.
  void resume(std::int64_t last_step) {
    if (!writes_) return;
    std::ifstream in(path_);
    std::vector<json> kept;
    for (std::string line; std::getline(in, line);) {
      if (line.empty()) continue;
      try {
        const json j = json::parse(line);
        if (j.at("step").get<std::int64_t>() <= last_step) kept.push_back(j);
      } catch (const json::exception&) {
        continue;  // a line cut short by a crash
      }
    }
    in.close();
    start();
    for (const json& j : kept) append(j);
  }

  void start() {
    if (!writes_) return;
    file_ = std::make_unique<kmamba::AppendFile>(path_, true, "kmamba-train");
  }

  // A record that cannot be written (disk full) is an error, never a silently shorter log.
  void append(const json& record) {
    if (writes_) file_->append(record.dump() + '\n');
    const double step = static_cast<double>(record.at("step").get<std::int64_t>());
    if (record.at("type") == "train") {
      const double loss = record.at("loss").get<double>();
      ema_ = train_steps_.empty() ? loss : 0.95 * ema_ + 0.05 * loss;
      train_steps_.push_back(step);
      train_loss_.push_back(loss);
      train_ema_.push_back(ema_);
      accuracy_ema_ = train_steps_.size() == 1 ? record.at("accuracy").get<double>()
                                               : 0.95 * accuracy_ema_ + 0.05 * record.at("accuracy").get<double>();
      train_accuracy_.push_back(100.0 * accuracy_ema_);
    } else if (record.at("type") == "eval") {
      eval_steps_.push_back(step);
      eval_loss_.push_back(record.at("loss").get<double>());
      eval_accuracy_.push_back(100.0 * record.at("accuracy").get<double>());
    }
  }

  const std::string& path() const { return path_; }
  const std::string& plot_path() const { return plot_path_; }

  // The loss curve is cosmetic: failing to write it is a warning, and the run goes on.
  void plot() const {
    if (!writes_) return;
    try {
      write_plot();
    } catch (const kmamba::Error& e) {
      std::fprintf(stderr, "kmamba-train: warning: the loss curve was not written: %s\n", e.what());
    }
  }

 private:
  void write_plot() const {
    using kmamba::app::Rgb;
    using kmamba::app::Series;
    const Rgb light{174, 199, 232}, blue{31, 119, 180}, orange{255, 127, 14};
    std::vector<kmamba::app::Panel> panels;
    panels.push_back({"loss",
                      true,
                      {Series{"train", light, train_steps_, train_loss_, false},
                       Series{"train (average)", blue, train_steps_, train_ema_, false},
                       Series{"held-out", orange, eval_steps_, eval_loss_, true}}});
    const std::string accuracy_title = recall_ ? "recall accuracy %" : "next-token accuracy %";
    panels.push_back({accuracy_title,
                      false,
                      {Series{"train (average)", blue, train_steps_, train_accuracy_, false},
                       Series{"held-out", orange, eval_steps_, eval_accuracy_, true}}});
    kmamba::app::write_png(plot_path_, kmamba::app::plot(panels, "step", 900, 640));
  }

  std::string path_, plot_path_;
  bool recall_;
  bool writes_;
  std::unique_ptr<kmamba::AppendFile> file_;
  double ema_ = 0.0, accuracy_ema_ = 0.0;
  std::vector<double> train_steps_, train_loss_, train_ema_, train_accuracy_, eval_steps_, eval_loss_, eval_accuracy_;
};

// ---------------------------------------------------------------------------------------------
// The run.

std::shared_ptr<const kmamba::Dataset> make_data(Run& r) {
  if (r.kind == Run::Kind::Recall) return std::make_shared<kmamba::AssociativeRecallTask>(r.recall);
  auto data = std::make_shared<kmamba::TokenDataset>(kmamba::TokenDataset::from_file(r.data_path, r.tokens));
  r.model.vocab_size = data->vocab_size();
  return data;
}

std::string describe_data(const Run& r, const kmamba::Dataset& data) {
  std::ostringstream s;
  if (r.kind == Run::Kind::Recall) {
    s << "associative recall (" << r.recall.num_kv_pairs << " pairs, seqlen " << r.recall.seqlen << ", vocab "
      << r.recall.vocab_size << ")";
  } else {
    const auto& tokens = static_cast<const kmamba::TokenDataset&>(data);
    s << tokens.source() << " (" << tokens.size(kmamba::Split::Train) << " + " << tokens.size(kmamba::Split::Validation)
      << " held-out tokens, vocab " << tokens.vocab_size() << ", seqlen " << tokens.seqlen() << ")";
  }
  return s.str();
}

void write_run_json(const Run& r) {
  json j = json::object();
  for (const auto& [name, value] : r.options.values()) {
    if (name == "resume" || name == "config") continue;
    j[json_key(name)] = value;
  }
  j["data"] = r.data_path;
  j["model"] = r.model_dir;
  j["out"] = r.out;
  kmamba::write_output_file(r.out + "/run.json", j.dump(2) + '\n', "kmamba-train");
}

double accuracy_of(const kmamba::LossResult& r) {
  return r.tokens > 0 ? static_cast<double>(r.correct) / static_cast<double>(r.tokens) : 0.0;
}

// The console: on a terminal one line rewritten in place, otherwise plain lines.
class Console {
 public:
  Console() : tty_(::isatty(::fileno(stdout)) != 0) {}
  bool tty() const { return tty_; }
  // A progress line (replaced by the next line on a terminal).
  void progress(const std::string& line) { print(line, false); }
  // A line that stays.
  void line(const std::string& line) { print(line, true); }
  // Ends a progress line left open.
  void finish() {
    if (progress_line_open) std::printf("\n");
    progress_line_open = false;
    std::fflush(stdout);
  }

 private:
  void print(const std::string& line, bool permanent) {
    if (tty_) {
      std::printf("\r%s\033[K%s", line.c_str(), permanent ? "\n" : "");
      progress_line_open = !permanent;
    } else {
      std::printf("%s\n", line.c_str());
    }
    std::fflush(stdout);
  }
  bool tty_;
};

template <class Exec>
int train(Run& r) {
  const Exec exec;
  const std::string checkpoint = r.out + "/checkpoint";
  const bool recall = r.kind == Run::Kind::Recall;
  std::shared_ptr<const kmamba::Dataset> data = make_data(r);

  // The model: the checkpoint's architecture when resuming, else --model's, else a new one.
  kmamba::ModelConfig model_config = r.model;
  if (r.resume) {
    model_config = kmamba::ModelConfig::load(checkpoint + "/config.json");
  } else if (!r.model_dir.empty()) {
    model_config = kmamba::ModelConfig::load(r.model_dir + "/config.json");
  }
#if KMAMBA_ENABLE_MPI
  // The mesh: a size that does not fit the world or the model is the same error on every rank,
  // raised before any rank communicates.
  std::unique_ptr<kmamba::ProcessMesh> mesh;
  if (mpi_running) {
    const int world = mpi_world_size();
    const kmamba::MeshConfig resolved = r.mesh.resolve(world);
    kmamba::check_mesh_fits_model(resolved, model_config);
    // Device memory travels through NCCL (one GPU per rank); host memory through MPI.
    constexpr bool device_memory =
        !Kokkos::SpaceAccessibility<Kokkos::HostSpace, typename Exec::memory_space>::accessible;
#if KMAMBA_ENABLE_NCCL
    const kmamba::Transport transport = device_memory ? kmamba::Transport::Nccl : kmamba::Transport::Mpi;
#else
    (void)device_memory;  // a CUDA build without NCCL: the MPI transport says what is missing
    const kmamba::Transport transport = kmamba::Transport::Mpi;
#endif
    mesh = std::make_unique<kmamba::ProcessMesh>(MPI_COMM_WORLD, resolved, transport);
  }
  const bool root = mesh == nullptr || mesh->world().rank() == 0;
  const bool split = mesh != nullptr && (mesh->config().tensor_parallel_size > 1 ||
                                         mesh->config().sequence_parallel_size > 1);
#else
  KMAMBA_REQUIRE(r.mesh.tensor_parallel_size == 1 && r.mesh.sequence_parallel_size == 1 &&
                     r.mesh.data_parallel_size <= 1,
                 "kmamba-train: --dp, --tp and --sp need a build with MPI (KMAMBA_ENABLE_MPI)");
  const bool root = true, split = false;
#endif
  // One run per directory: a second kmamba-train on it stops here, naming this one's process id.
  std::unique_ptr<kmamba::DirectoryLock> lock;
  if (root) lock = std::make_unique<kmamba::DirectoryLock>(r.out, "kmamba-train");
  auto make_model = [&]() {
    if (!r.resume && !r.model_dir.empty()) return kmamba::LanguageModel<Exec>::load(r.model_dir);
    kmamba::LanguageModel<Exec> model(model_config);
    if (!r.resume) model.initialize(r.train.seed);
    return model;
  };
  kmamba::LanguageModel<Exec> model = make_model();
#if KMAMBA_ENABLE_MPI
  if (split) {  // this rank's shards of the unsplit model
    kmamba::LanguageModel<Exec> local(model.config(), {&mesh->tensor(), &mesh->sequence()});
    kmamba::scatter_parameters(exec, model, local);
    model = std::move(local);
  }
#endif
  model.set_activation_checkpointing(r.options.flag("activation-checkpointing"));
  model.set_matmul_precision(r.precision);
  kmamba::Trainer<Exec> trainer(std::move(model), r.train, data, exec);
#if KMAMBA_ENABLE_MPI
  if (mesh) trainer.enable_data_parallel(*mesh, kmamba::DataParallelConfig{r.zero_stage, 0});
  errors_are_collective = mesh == nullptr;  // from here on an error may strike one rank only
#endif
  Metrics metrics(r.out, recall, root);
  if (r.resume) {
    trainer.resume(checkpoint);
    metrics.resume(trainer.steps_taken());
  } else {
    metrics.start();
  }
  if (root) write_run_json(r);

  const std::int64_t total = r.train.total_steps;
  std::printf("kmamba-train: %s\n", describe_data(r, *data).c_str());
  std::printf("kmamba-train: %s, d_model %d, %d layers, %zu parameters, on %s, %s projections%s\n",
              kmamba::mixer_name(model_config.mixer), model_config.d_model, model_config.n_layer,
              trainer.model().parameters().size(), Exec::name(), kmamba::matmul_precision_name(r.precision),
              r.model_dir.empty() ? "" : (" (from " + r.model_dir + ")").c_str());
#if KMAMBA_ENABLE_MPI
  if (mesh) {
    std::printf("kmamba-train: %d ranks: data parallel %d x tensor parallel %d x sequence parallel %d\n",
                mesh->world().size(), mesh->config().data_parallel_size, mesh->config().tensor_parallel_size,
                mesh->config().sequence_parallel_size);
  }
#endif
  std::printf("kmamba-train: %lld steps of %lld x %lld sequences, lr %g; writing %s%s\n", static_cast<long long>(total),
              static_cast<long long>(r.train.grad_accum), static_cast<long long>(r.train.batch_size), r.train.lr,
              r.out.c_str(), r.resume ? (", resumed at step " + std::to_string(trainer.steps_taken())).c_str() : "");
  std::fflush(stdout);
  if (trainer.steps_taken() >= total) {
    std::printf("kmamba-train: the run in %s is complete at step %lld (raise --steps to continue it)\n", r.out.c_str(),
                static_cast<long long>(trainer.steps_taken()));
    return 0;
  }

  Console console;
  kmamba::LossResult last_eval;
  auto evaluate = [&]() {
    last_eval = trainer.evaluate();
    metrics.append({{"type", "eval"},
                    {"step", trainer.steps_taken()},
                    {"loss", last_eval.loss},
                    {"accuracy", accuracy_of(last_eval)},
                    {"tokens", last_eval.tokens}});
    console.line(format("eval  step %6lld | held-out loss %.4f | acc %5.1f%%",
                        static_cast<long long>(trainer.steps_taken()), last_eval.loss, 100.0 * accuracy_of(last_eval)));
  };

  install_stop_handler();
  if (!r.resume) {
    evaluate();
    metrics.plot();
  }
  const auto started = std::chrono::steady_clock::now();
  double train_seconds = 0.0;  // in step(), without evaluations and checkpoints
  std::int64_t session_tokens = 0, session_steps = 0;
  // Ctrl-C on any rank stops every rank after the same step.
  const auto stop = [&]() {
#if KMAMBA_ENABLE_MPI
    if (mesh) return mesh->world().all_reduce_value(static_cast<int>(stop_requested), kmamba::ReduceOp::Max) != 0;
#endif
    return stop_requested != 0;
  };
  while (trainer.steps_taken() < total && !stop()) {
    const auto t0 = std::chrono::steady_clock::now();
    const kmamba::StepResult s = trainer.step();
    train_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    session_tokens += s.input_tokens;
    ++session_steps;
    const double tokens_per_second = static_cast<double>(session_tokens) / std::max(train_seconds, 1e-9);
    if (s.skipped) {
      metrics.append({{"type", "skipped"},
                      {"step", s.step + 1},
                      {"loss", std::isfinite(s.loss) ? json(s.loss) : json(std::to_string(s.loss))},
                      {"grad_norm", std::isfinite(s.grad_norm) ? json(s.grad_norm) : json(std::to_string(s.grad_norm))},
                      {"skipped_steps", trainer.skipped_steps()},
                      {"reason", s.non_finite}});
      console.line(format("skip  step %6lld | %s (skipped %lld so far)", static_cast<long long>(s.step + 1),
                          s.non_finite.c_str(), static_cast<long long>(trainer.skipped_steps())));
      continue;
    }
    metrics.append({{"type", "train"},
                    {"step", s.step},
                    {"loss", s.loss},
                    {"accuracy", s.accuracy()},
                    {"tokens", s.tokens},
                    {"lr", s.lr},
                    {"grad_norm", s.grad_norm},
                    {"tokens_per_s", tokens_per_second},
                    {"elapsed_s", std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count()}});
    if (console.tty() || s.step % r.log_interval == 0 || s.step == total) {
      const double eta = train_seconds / static_cast<double>(session_steps) * static_cast<double>(total - s.step);
      console.progress(
          format("step %6lld/%lld | loss %.4f", static_cast<long long>(s.step), static_cast<long long>(total), s.loss) +
          (recall ? format(" | acc %5.1f%%", 100.0 * s.accuracy()) : "") + format(" | lr %.1e | ", s.lr) +
          rate(tokens_per_second) + " tok/s | ETA " + duration(eta));
    }
    if (s.step == total) break;
    // The checkpoint before the plot, which may fail without losing the run.
    const bool evaluated = r.train.eval_interval > 0 && s.step % r.train.eval_interval == 0;
    if (evaluated) evaluate();
    if (r.train.checkpoint_interval > 0 && s.step % r.train.checkpoint_interval == 0)
      trainer.save_checkpoint(checkpoint);
    if (evaluated) metrics.plot();
  }
  console.finish();
  const bool interrupted = trainer.steps_taken() < total;
  if (!interrupted) evaluate();
  trainer.save_checkpoint(checkpoint);
  metrics.plot();
  if (interrupted) {
    std::printf(
        "kmamba-train: interrupted at step %lld of %lld; checkpoint saved to %s; continue with: kmamba-train --resume "
        "--out %s\n",
        static_cast<long long>(trainer.steps_taken()), static_cast<long long>(total), checkpoint.c_str(),
        r.out.c_str());
  } else {
    const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
    std::printf("kmamba-train: done: %lld steps in %s (%s tok/s); held-out loss %.4f%s\n",
                static_cast<long long>(trainer.steps_taken()), duration(elapsed).c_str(),
                rate(static_cast<double>(session_tokens) / std::max(train_seconds, 1e-9)).c_str(), last_eval.loss,
                recall ? format(", recall accuracy %.1f%%", 100.0 * accuracy_of(last_eval)).c_str() : "");
  }
  if (trainer.skipped_steps() > 0) {
    std::printf("kmamba-train: %lld steps were skipped for a non-finite loss or gradient (see \"skipped\" in %s)\n",
                static_cast<long long>(trainer.skipped_steps()), metrics.path().c_str());
  }
  std::printf("kmamba-train: model %s, metrics %s, loss curve %s\n", checkpoint.c_str(), metrics.path().c_str(),
              metrics.plot_path().c_str());
  return 0;
}

int dispatch(Run& r) {
#if KMAMBA_HAS_SERIAL
  if (r.device == "serial") return train<Kokkos::Serial>(r);
#endif
#if KMAMBA_HAS_OPENMP
  if (r.device == "openmp") return train<Kokkos::OpenMP>(r);
#endif
#if KMAMBA_ENABLE_CUDA
  if (r.device == "cuda") return train<Kokkos::Cuda>(r);
#endif
  return train<Kokkos::DefaultExecutionSpace>(r);
}

// Merges the option sources: the resumed run's run.json, then --config, then the command line.
Run configure(int argc, char** argv) {
  const Values cli = parse_command_line(argc, argv);
  Values merged;
  const Values file = cli.count("config") ? read_json_options(cli.at("config"), {"config"}) : Values{};
  Values first = file;
  for (const auto& [k, v] : cli) first[k] = v;
  if (Options(first).flag("resume")) {
    const std::string out = resolve(Options(first)).out;
    const std::string saved = out + "/run.json";
    kmamba::StagedDirectory::recover(out + "/checkpoint");  // a save killed mid-way on a file system without exchange
    KMAMBA_REQUIRE(std::filesystem::exists(out + "/checkpoint/training_state.safetensors"),
                   "kmamba-train: --resume: no checkpoint in '" << out << "/checkpoint' (pass the run's --out)");
    if (std::filesystem::exists(saved)) merged = read_json_options(saved, {"config", "resume"});
  }
  for (const auto& [k, v] : first) merged[k] = v;
  merged.erase("config");
  return resolve(Options(merged));
}

}  // namespace

// MPI is started when a launcher started this process or a mesh option asks for ranks; every rank
// but world rank 0 then writes nothing to stdout.
void start_mpi(int& argc, char**& argv, const Run& run) {
#if KMAMBA_ENABLE_MPI
  const bool launched = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr || std::getenv("PMI_SIZE") != nullptr ||
                        std::getenv("PMIX_RANK") != nullptr;
  const bool asked = run.options.has("data-parallel-size") || run.options.has("tensor-parallel-size") ||
                     run.options.has("sequence-parallel-size") || run.options.has("zero-stage");
  if (!launched && !asked) return;
  MPI_Init(&argc, &argv);
  mpi_running = true;
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank != 0) {
    KMAMBA_REQUIRE(std::freopen("/dev/null", "w", stdout) != nullptr, "kmamba-train: cannot silence rank " << rank);
  }
#else
  (void)argc;
  (void)argv;
  (void)run;
#endif
}

// Ends MPI: an error raised on one rank only aborts the others (they may wait in a collective).
int finish_mpi(int status) {
#if KMAMBA_ENABLE_MPI
  if (mpi_running) {
    if (status != 0 && !errors_are_collective) MPI_Abort(MPI_COMM_WORLD, status);
    MPI_Finalize();
  }
#endif
  return status;
}

int main(int argc, char** argv) {
  kmamba::keep_freed_host_memory();  // steps reuse freed host memory (KMAMBA_HOST_MALLOC_KEEP=0: off)
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "-h" || a == "--help") {
      print_help();
      return 0;
    }
  }
  try {
    Run run = configure(argc, argv);
    start_mpi(argc, argv, run);
    // Kokkos sees only its own options: it would also claim --device and --threads.
    std::vector<char*> kokkos_args = {argv[0]};
    for (int i = 1; i < argc; ++i) {
      if (std::string(argv[i]).rfind("--kokkos-", 0) == 0) kokkos_args.push_back(argv[i]);
    }
    int kokkos_argc = static_cast<int>(kokkos_args.size());
    kokkos_args.push_back(nullptr);
    int status = 0;
    {
      Kokkos::ScopeGuard kokkos(kokkos_argc, kokkos_args.data());
      try {
        status = dispatch(run);
      } catch (const std::exception& e) {
        Console().finish();
        std::fprintf(stderr, "%s\n", e.what());
        status = 2;
      }
    }
    return finish_mpi(status);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return finish_mpi(2);
  }
}
