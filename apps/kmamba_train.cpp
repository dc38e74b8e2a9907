// kmamba-train: trains a Mamba language model. With no arguments it runs the embedded default, a
// small Mamba-2 learning multi-query associative recall; --data trains on text or token files and
// --model fine-tunes a Hugging Face checkpoint. `--help` lists every option (train/TrainOptions.cpp
// declares them). Under `mpirun -np N` it trains on a pp × dp × tp × sp process mesh (--pp --dp --tp --sp);
// only world rank 0 prints and writes. Exit status: 0 done, 130 interrupted (SIGINT/SIGTERM) with
// the checkpoint saved, 2 a bad option or input, 1 an internal error.
#include <kmamba/KMamba.hpp>
#include <kmamba/core/Files.hpp>
#include <kmamba/core/Json.hpp>
#include <kmamba/parallel/ProcessMesh.hpp>

#include "AppRuntime.hpp"
#include "DeviceOption.hpp"
#include "Plot.hpp"
#include "TrainOptions.hpp"

#include <nlohmann/json.hpp>

#include <unistd.h>

#if KMAMBA_ENABLE_MPI
#include <mpi.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <numeric>
#include <sstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

namespace {

using json = nlohmann::json;
using kmamba::app::Run;

const char* const description =
    "Trains a Mamba language model. Without options: the embedded default, a small Mamba-2 that learns\n"
    "multi-query associative recall (key-value pairs, then the keys again; the model must answer each\n"
    "with its value) in a few minutes on a CPU. The run directory receives metrics.jsonl (one JSON\n"
    "object per step and evaluation), loss.png, run.json (the options) and checkpoint/ (a Hugging Face\n"
    "model plus training_state.safetensors). Ctrl-C stops after the current step and saves a checkpoint.";

const char* const footer =
    "Token files: 32-byte header \"KMTOKENS\", u32 version 1, u32 bytes per token (2 or 4), u64 vocabulary\n"
    "size, u64 token count, then the tokens, all little-endian (see kmamba/models/Data.hpp); kmamba-tokenize\n"
    "writes them from text, JSONL or folders (then pass its --tokenizer here too, so checkpoints carry it).\n"
    "Exit status: 0 done; 130 interrupted by SIGINT or SIGTERM, the checkpoint saved (continue with\n"
    "--resume); 2 a bad option, input or run directory; 1 an internal error.";

// ---------------------------------------------------------------------------------------------
// Progress, metrics and the loss curve.

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

// A line of metrics.jsonl as a record Metrics::append takes (an object with an integer "step", a
// string "type", and numbers "loss" and "accuracy" when the type is "train" or "eval"), or null.
json parse_record(const std::string& line) {
  json j;
  try {
    j = kmamba::parse_json(line, "metrics.jsonl");
  } catch (const kmamba::UserError&) {
    return nullptr;
  }
  if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer() || !j.contains("type") ||
      !j["type"].is_string()) {
    return nullptr;
  }
  const auto number = [&](const char* key) { return j.contains(key) && j[key].is_number(); };
  const bool curve = j["type"] == "train" || j["type"] == "eval";
  return !curve || (number("loss") && number("accuracy")) ? j : json(nullptr);
}

// The metrics log and the curves drawn from it.
class Metrics {
 public:
  // `writes`: false on the ranks other than world rank 0, which only keep the records.
  Metrics(const std::string& dir, bool recall, bool writes)
      : path_(dir + "/metrics.jsonl"), plot_path_(dir + "/loss.png"), recall_(recall), writes_(writes) {}

  // Keeps the records of steps <= `last_step` (those the checkpoint covers) and drops the rest.
  // A log that cannot be stat'ed or is not a regular file is an error naming it (a FIFO would
  // block the read forever); a missing log starts empty.
  void resume(std::int64_t last_step) {
    if (!writes_) return;
    std::vector<json> kept;
    std::error_code unknown;
    if (std::filesystem::exists(path_, unknown) || unknown) kept = read_records(last_step);
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

  // The records of steps <= `last_step` in the log. Lines that are not records (the last one cut
  // short when the run was killed, text written by hand) are dropped with a warning.
  std::vector<json> read_records(std::int64_t last_step) const {
    const std::string text = kmamba::read_input_file(path_, max_log_bytes, "kmamba-train: --resume");
    std::vector<json> kept;
    std::size_t dropped = 0;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) {
      if (line.empty()) continue;
      const json j = parse_record(line);
      if (j.is_null()) {
        ++dropped;
      } else if (j["step"].get<std::int64_t>() <= last_step) {
        kept.push_back(j);
      }
    }
    if (dropped > 0) {
      std::fprintf(stderr, "kmamba-train: warning: --resume dropped %zu line(s) of '%s' that are not metrics records\n",
                   dropped, path_.c_str());
    }
    return kept;
  }

  // The largest log read back: about five million steps of records.
  static constexpr std::uint64_t max_log_bytes = 1ull << 30;

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
      << " held-out tokens, vocab " << tokens.vocab_size() << ", seqlen " << tokens.seqlen();
    if (r.tokens.document_end >= 0) s << ", documents packed, ended by token " << r.tokens.document_end;
    s << ")";
  }
  return s.str();
}

double accuracy_of(const kmamba::LossResult& r) {
  return r.tokens > 0 ? static_cast<double>(r.correct) / static_cast<double>(r.tokens) : 0.0;
}

// The console: on a terminal one line rewritten in place, otherwise plain lines.
class Console {
 public:
  Console() : tty_(::isatty(::fileno(stdout)) != 0) {}
  Console(const Console&) = delete;
  Console& operator=(const Console&) = delete;
  ~Console() { finish(); }
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
  bool progress_line_open = false;  // a \r-updated line is on the terminal without its newline
};

// The model's architecture: the checkpoint's when resuming (options given now must agree with it),
// else --model's, else the options'.
kmamba::ModelConfig architecture(const Run& r) {
  if (r.resume) {
    const kmamba::ModelConfig saved = kmamba::ModelConfig::load(r.checkpoint() + "/config.json");
    if (r.model_dir.empty()) kmamba::app::check_resumed_architecture(r, saved);
    return saved;
  }
  if (!r.model_dir.empty()) return kmamba::ModelConfig::load(r.model_dir + "/config.json");
  return r.model;
}

// The tokenizer files every checkpoint receives: --tokenizer's, which must be a tokenizer whose
// ids the model can take, else those of the --model directory (none for a byte-level model).
kmamba::TokenizerFiles tokenizer_files(const Run& r, const kmamba::ModelConfig& config) {
  if (r.tokenizer.empty()) {
    return r.model_dir.empty() ? kmamba::TokenizerFiles() : kmamba::TokenizerFiles::from_directory(r.model_dir);
  }
  const kmamba::BpeTokenizer tokenizer = kmamba::BpeTokenizer::from_file(r.tokenizer);
  KMAMBA_REQUIRE(tokenizer.vocab_size() <= config.vocab_size,
                 "kmamba-train: --tokenizer '" << r.tokenizer << "' has " << tokenizer.vocab_size()
                                               << " tokens, more than the model's vocabulary of " << config.vocab_size
                                               << ": it is not the tokenizer of this model or data");
  return kmamba::TokenizerFiles::from_file(r.tokenizer);
}

// The process mesh of an MPI run (none without MPI): a size that does not fit the world or the
// model is the same error on every rank, raised before any rank communicates.
struct Parallel {
#if KMAMBA_ENABLE_MPI
  std::unique_ptr<kmamba::ProcessMesh> mesh;
#endif
  bool root = true;    // world rank 0: prints and writes
  bool split = false;  // the model is sharded over tensor, sequence or pipeline ranks
};

template <class Exec>
Parallel make_parallel(const Run& r, const kmamba::ModelConfig& config, const kmamba::app::Runtime& runtime) {
  Parallel p;
  kmamba::app::check_virtual_stages(r, config);
#if KMAMBA_ENABLE_MPI
  if (!runtime.mpi()) return p;
  const kmamba::MeshConfig resolved = kmamba::app::mesh_for_world(r, runtime.size());
  kmamba::check_mesh_fits_model(resolved, config);
  // Device memory travels through NCCL (one GPU per rank); host memory through MPI.
  p.mesh = std::make_unique<kmamba::ProcessMesh>(MPI_COMM_WORLD, resolved,
                                                 kmamba::transport_for<typename Exec::memory_space>());
  p.root = p.mesh->world().rank() == 0;
  p.split = p.mesh->config().tensor_parallel_size > 1 || p.mesh->config().sequence_parallel_size > 1 ||
            p.mesh->config().pipeline_parallel_size > 1;
#else
  (void)config;
  (void)runtime;
  KMAMBA_REQUIRE(r.mesh.tensor_parallel_size == 1 && r.mesh.sequence_parallel_size == 1 &&
                     r.mesh.pipeline_parallel_size == 1 && r.mesh.data_parallel_size <= 1 &&
                     !r.derive_sequence_parallel,
                 "kmamba-train: --dp, --tp, --sp, --pp and --sequence-parallel-enabled need a build with MPI "
                 "(KMAMBA_ENABLE_MPI)");
#endif
  return p;
}

// The trainer of this rank: the model (loaded, resumed or new; this rank's shards of it on a
// split mesh) with the run's settings, data parallel over the mesh.
template <class Exec>
kmamba::Trainer<Exec> make_trainer(const Run& r, const kmamba::ModelConfig& config,
                                   std::shared_ptr<const kmamba::Dataset> data, Parallel& p) {
  const Exec exec;
  auto make_model = [&]() {
    if (!r.resume && !r.model_dir.empty()) return kmamba::LanguageModel<Exec>::load(r.model_dir);
    kmamba::LanguageModel<Exec> model(config);
    if (!r.resume) model.initialize(r.train.seed);
    return model;
  };
  kmamba::LanguageModel<Exec> model = make_model();
#if KMAMBA_ENABLE_MPI
  if (p.split) {
    kmamba::LanguageModel<Exec> local(model.config(), {&p.mesh->tensor(), &p.mesh->sequence()},
                                      {&p.mesh->pipeline(), r.virtual_pipeline_stages});
    kmamba::scatter_parameters(exec, model, local);
    model = std::move(local);
  }
#endif
  model.set_activation_checkpointing(r.activation_checkpointing);
  model.set_matmul_precision(r.precision);
  kmamba::Trainer<Exec> trainer(std::move(model), r.train, std::move(data), exec);
  trainer.set_load_balancing(r.balancing);
  if (r.offload_optimizer) trainer.set_optimizer_placement(kmamba::OptimizerPlacement::Host);
#if KMAMBA_ENABLE_MPI
  if (p.mesh)
    trainer.enable_data_parallel(
        *p.mesh, kmamba::DataParallelConfig{r.zero_stage, r.bucket_elements, r.overlap_communication, r.sync_frequency,
                                            r.compression, r.powersgd_rank});
#else
  (void)p;
#endif
  return trainer;
}

// How the rows of every global batch reach the data-parallel ranks.
void print_load_balancing(const Run& r, const Parallel& p) {
  int ranks = 1;
#if KMAMBA_ENABLE_MPI
  if (p.mesh) ranks = p.mesh->config().data_parallel_size;
#else
  (void)p;
#endif
  if (!r.balancing.dynamic_task_allocation) {
    if (ranks > 1) std::printf("kmamba-train: load balancing: each data-parallel rank takes its fixed share\n");
    return;
  }
  std::printf(
      "kmamba-train: load balancing: the rows of every global batch dealt to the %d data-parallel rank%s by real "
      "tokens when the busiest fixed share holds more than %g%% above the mean\n",
      ranks, ranks == 1 ? "" : "s", 100.0 * r.balancing.data_redistribution_threshold);
}

// Where the AdamW moments live and the step runs.
template <class Exec>
void print_optimizer(const kmamba::Trainer<Exec>& trainer) {
  if (trainer.optimizer_placement() == kmamba::OptimizerPlacement::Device) {
    std::printf("kmamba-train: optimizer: AdamW on the device (%.1f MiB of moments there)\n",
                static_cast<double>(trainer.optimizer_device_bytes()) / static_cast<double>(1 << 20));
    return;
  }
  std::printf(
      "kmamba-train: optimizer: offloaded, AdamW moments in host memory, the step on %d host threads (%s); "
      "gradients to the host and parameters back every step\n",
      Kokkos::DefaultHostExecutionSpace().concurrency(), Kokkos::DefaultHostExecutionSpace::name());
}

#if KMAMBA_ENABLE_MPI
// The pipeline part of the mesh line: the schedule and the layers stage 0 holds ("" without pp).
template <class Exec>
std::string pipeline_text(const Run& r, const kmamba::MeshConfig& mesh, const kmamba::LanguageModel<Exec>& model) {
  if (mesh.pipeline_parallel_size == 1) return "";
  const long long m = static_cast<long long>(r.train.grad_accum);
  std::string text = format(" x pipeline parallel %d (", mesh.pipeline_parallel_size);
  if (r.virtual_pipeline_stages == 1) {
    text += format("1F1B over the %lld micro-batches of a step; stage 0 holds layers", m);
  } else {
    text += format("interleaved 1F1B over the %lld micro-batches of a step, %d chunks per stage; stage 0 holds layers",
                   m, r.virtual_pipeline_stages);
  }
  for (int c = 0; c < r.virtual_pipeline_stages; ++c) {
    text += format("%s %d to %d", c == 0 ? "" : ",", model.layers(c).begin, model.layers(c).end - 1);
  }
  return text + ")";
}

// How the data-parallel gradients travel, for the start line. Under pipeline parallelism the
// reduction waits for the schedule's last backward (docs/distributed.md §4), so nothing overlaps.
std::string reduction_text(const Run& r, bool pipelined) {
  if (r.compression == kmamba::GradientCompression::PowerSgd) {
    return format("after the backward as PowerSGD rank-%d factors with error feedback (fp32 on the wire)",
                  r.powersgd_rank);
  }
  return format("%s the backward in buckets of %g MiB (%s on the wire)",
                r.overlap_communication && !pipelined ? "during" : "after",
                static_cast<double>(r.bucket_elements * sizeof(float)) / static_cast<double>(1 << 20),
                r.compression == kmamba::GradientCompression::Bf16 ? "bf16, summed in fp32" : "fp32");
}
#endif

template <class Exec>
void print_start(const Run& r, const kmamba::Dataset& data, const kmamba::ModelConfig& config,
                 const kmamba::Trainer<Exec>& trainer, const Parallel& p) {
  std::printf("kmamba-train: %s\n", describe_data(r, data).c_str());
  std::printf("kmamba-train: %s, d_model %d, %d layers, %zu parameters%s, on %s, %s projections%s%s\n",
              kmamba::mixer_name(config.mixer), config.d_model, config.n_layer, trainer.model().parameters().size(),
              p.split ? " in rank 0's part (split over tp, sp or pp)" : "", Exec::name(),
              kmamba::matmul_precision_name(r.precision),
              r.activation_checkpointing ? ", activation checkpointing" : "",
              r.model_dir.empty() ? "" : (" (from " + r.model_dir + ")").c_str());
#if KMAMBA_ENABLE_MPI
  if (p.mesh) {
    const kmamba::MeshConfig& mesh = p.mesh->config();
    std::printf(
        "kmamba-train: %d ranks: data parallel %d x tensor parallel %d x sequence parallel %d%s%s; ZeRO stage %d; "
        "gradients reduced %s%s\n",
        p.mesh->world().size(), mesh.data_parallel_size, mesh.tensor_parallel_size, mesh.sequence_parallel_size,
        mesh.sequence_parallel_size > 1
            ? format(" (%s segments)", kmamba::sequence_split_name(r.balancing.sequence_split)).c_str()
            : "",
        pipeline_text(r, mesh, trainer.model()).c_str(), r.zero_stage,
        reduction_text(r, mesh.pipeline_parallel_size > 1).c_str(),
        r.sync_frequency > 1 ? format("; local SGD: the replicas step alone, averaged every %lld steps",
                                      static_cast<long long>(r.sync_frequency))
                                   .c_str()
                             : "");
  }
#else
  (void)p;
#endif
  print_load_balancing(r, p);
  print_optimizer(trainer);
  std::printf("kmamba-train: %lld steps of %lld x %lld sequences, lr %g; writing %s%s\n",
              static_cast<long long>(r.train.total_steps), static_cast<long long>(r.train.grad_accum),
              static_cast<long long>(r.train.batch_size), r.train.lr, r.out.c_str(),
              r.resume ? (", resumed at step " + std::to_string(trainer.steps_taken())).c_str() : "");
  std::fflush(stdout);
}

// The real tokens each data-parallel rank trained on over the run's steps, those its fixed
// shares held, and how far the busiest rank of each step was above the step's mean (dynamic task
// allocation).
struct BalanceTally {
  std::vector<std::int64_t> tokens, fixed;
  std::int64_t steps = 0, moved = 0;
  double excess = 0.0, fixed_excess = 0.0;  // Σ over the steps of busiest / mean − 1

  // busiest / mean − 1 of one step's real tokens per rank (0 without real tokens).
  static double above_mean(const std::vector<std::int64_t>& v) {
    const double total = static_cast<double>(std::accumulate(v.begin(), v.end(), std::int64_t{0}));
    const double busiest = static_cast<double>(*std::max_element(v.begin(), v.end()));
    return total > 0 ? busiest * static_cast<double>(v.size()) / total - 1.0 : 0.0;
  }

  void add(const kmamba::StepResult& s) {
    tokens.resize(s.rank_tokens.size(), 0);
    fixed.resize(s.rank_tokens.size(), 0);
    for (std::size_t r = 0; r < s.rank_tokens.size(); ++r) {
      tokens[r] += s.rank_tokens[r];
      fixed[r] += s.fixed_share_tokens[r];
    }
    ++steps;
    moved += s.rows_moved ? 1 : 0;
    excess += above_mean(s.rank_tokens);
    fixed_excess += above_mean(s.fixed_share_tokens);
  }

  std::string summary() const {
    const auto list = [](const std::vector<std::int64_t>& v) {
      std::string text;
      for (const std::int64_t x : v) text += (text.empty() ? "" : " ") + std::to_string(x);
      return text;
    };
    const double n = static_cast<double>(steps);
    return format(
        "kmamba-train: load balancing: rows moved in %lld of %lld steps; the busiest data-parallel rank "
        "held %.1f%% above the step's mean real tokens on average (fixed shares %.1f%%); real tokens per "
        "rank over the run %s (fixed shares %s)",
        static_cast<long long>(moved), static_cast<long long>(steps), 100.0 * excess / n, 100.0 * fixed_excess / n,
        list(tokens).c_str(), list(fixed).c_str());
  }
};

// The loop of optimizer steps with its evaluations, checkpoints, metrics and progress lines.
template <class Exec>
class TrainingLoop {
 public:
  TrainingLoop(const Run& r, kmamba::Trainer<Exec>& trainer, Metrics& metrics, Parallel& p)
      : r_(r), trainer_(trainer), metrics_(metrics), parallel_(p) {}

  /// Steps until the run's total or a stop signal; returns true when interrupted.
  bool run() {
    kmamba::app::install_stop_handler("kmamba-train");
    if (!r_.resume) {
      evaluate();
      metrics_.plot();
    }
    started_ = std::chrono::steady_clock::now();
    const std::int64_t total = r_.train.total_steps;
    // A stop waits for the replicas to be one state (local SGD), which a checkpoint holds.
    while (trainer_.steps_taken() < total && !(stop() && trainer_.replicas_identical())) {
      const auto t0 = std::chrono::steady_clock::now();
      const kmamba::StepResult s = trainer_.step();
      train_seconds_ += seconds_since(t0);
      session_tokens_ += s.input_tokens;
      ++session_steps_;
      if (s.skipped) {
        record_skipped(s);
        continue;
      }
      record_step(s);
      if (s.step == total) break;
      // The checkpoint before the plot, which may fail without losing the run.
      const bool evaluated = r_.train.eval_interval > 0 && s.step % r_.train.eval_interval == 0;
      if (evaluated) evaluate();
      if (r_.train.checkpoint_interval > 0 && s.step % r_.train.checkpoint_interval == 0) {
        trainer_.save_checkpoint(r_.checkpoint());
      }
      if (evaluated) metrics_.plot();
    }
    console_.finish();
    const bool interrupted = trainer_.steps_taken() < total;
    if (!interrupted) evaluate();
    trainer_.save_checkpoint(r_.checkpoint());
    metrics_.plot();
    return interrupted;
  }

  void print_end(bool interrupted) const {
    const long long steps = static_cast<long long>(trainer_.steps_taken());
    if (interrupted) {
      std::printf(
          "kmamba-train: interrupted at step %lld of %lld; checkpoint saved to %s; continue with: "
          "kmamba-train --resume --out %s\n",
          steps, static_cast<long long>(r_.train.total_steps), r_.checkpoint().c_str(), r_.out.c_str());
    } else {
      std::printf("kmamba-train: done: %lld steps in %s (%s tok/s); held-out loss %.4f%s\n", steps,
                  duration(seconds_since(started_)).c_str(), rate(tokens_per_second()).c_str(), last_eval_.loss,
                  r_.recall_task() ? format(", recall accuracy %.1f%%", 100.0 * accuracy_of(last_eval_)).c_str() : "");
    }
    if (trainer_.skipped_steps() > 0) {
      std::printf("kmamba-train: %lld steps were skipped for a non-finite loss or gradient (see \"skipped\" in %s)\n",
                  static_cast<long long>(trainer_.skipped_steps()), metrics_.path().c_str());
    }
    if (balance_.steps > 0) std::printf("%s\n", balance_.summary().c_str());
    std::printf("kmamba-train: model %s, metrics %s, loss curve %s\n", r_.checkpoint().c_str(), metrics_.path().c_str(),
                metrics_.plot_path().c_str());
  }

 private:
  static double seconds_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
  }
  double tokens_per_second() const { return static_cast<double>(session_tokens_) / std::max(train_seconds_, 1e-9); }

  // A stop signal on any rank stops every rank after the same step.
  bool stop() const {
    const bool here = kmamba::app::stop_requested();
#if KMAMBA_ENABLE_MPI
    if (parallel_.mesh) {
      return parallel_.mesh->world().all_reduce_value(static_cast<int>(here), kmamba::ReduceOp::Max) != 0;
    }
#endif
    return here;
  }

  void evaluate() {
    last_eval_ = trainer_.evaluate();
    metrics_.append({{"type", "eval"},
                     {"step", trainer_.steps_taken()},
                     {"loss", last_eval_.loss},
                     {"accuracy", accuracy_of(last_eval_)},
                     {"tokens", last_eval_.tokens}});
    console_.line(format("eval  step %6lld | held-out loss %.4f | acc %5.1f%%",
                         static_cast<long long>(trainer_.steps_taken()), last_eval_.loss,
                         100.0 * accuracy_of(last_eval_)));
  }

  void record_skipped(const kmamba::StepResult& s) {
    const auto number = [](double v) { return std::isfinite(v) ? json(v) : json(std::to_string(v)); };
    metrics_.append({{"type", "skipped"},
                     {"step", s.step + 1},
                     {"loss", number(s.loss)},
                     {"grad_norm", number(s.grad_norm)},
                     {"skipped_steps", trainer_.skipped_steps()},
                     {"reason", s.non_finite}});
    console_.line(format("skip  step %6lld | %s (skipped %lld so far)", static_cast<long long>(s.step + 1),
                         s.non_finite.c_str(), static_cast<long long>(trainer_.skipped_steps())));
  }

  void record_step(const kmamba::StepResult& s) {
    const std::int64_t total = r_.train.total_steps;
    json record = {{"type", "train"},
                   {"step", s.step},
                   {"loss", s.loss},
                   {"accuracy", s.accuracy()},
                   {"tokens", s.tokens},
                   {"lr", s.lr},
                   {"grad_norm", s.grad_norm},
                   {"tokens_per_s", tokens_per_second()},
                   {"elapsed_s", seconds_since(started_)}};
    if (!s.rank_tokens.empty()) {  // dynamic task allocation: each dp rank's real tokens
      record["rank_tokens"] = s.rank_tokens;
      record["fixed_share_tokens"] = s.fixed_share_tokens;
      record["rows_moved"] = s.rows_moved;
      balance_.add(s);
    }
    metrics_.append(record);
    if (!console_.tty() && s.step % r_.log_interval != 0 && s.step != total) return;
    const double eta = train_seconds_ / static_cast<double>(session_steps_) * static_cast<double>(total - s.step);
    console_.progress(
        format("step %6lld/%lld | loss %.4f", static_cast<long long>(s.step), static_cast<long long>(total), s.loss) +
        (r_.recall_task() ? format(" | acc %5.1f%%", 100.0 * s.accuracy()) : "") + format(" | lr %.1e | ", s.lr) +
        rate(tokens_per_second()) + " tok/s | ETA " + duration(eta));
  }

  const Run& r_;
  kmamba::Trainer<Exec>& trainer_;
  Metrics& metrics_;
  Parallel& parallel_;
  Console console_;
  BalanceTally balance_;
  kmamba::LossResult last_eval_;
  std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  double train_seconds_ = 0.0;  // in step(), without evaluations and checkpoints
  std::int64_t session_tokens_ = 0, session_steps_ = 0;
};

template <class Exec>
int train(Run& r, const CLI::App& cli, kmamba::app::Runtime& runtime) {
  std::shared_ptr<const kmamba::Dataset> data = make_data(r);
  const kmamba::ModelConfig config = architecture(r);
  kmamba::TokenizerFiles tokenizer = tokenizer_files(r, config);
  Parallel parallel = make_parallel<Exec>(r, config, runtime);
  // One run per directory: a second kmamba-train on it stops here, naming this one's process id.
  std::unique_ptr<kmamba::DirectoryLock> lock;
  if (parallel.root) lock = std::make_unique<kmamba::DirectoryLock>(r.out, "kmamba-train");
  kmamba::Trainer<Exec> trainer = make_trainer<Exec>(r, config, data, parallel);
  trainer.set_tokenizer_files(std::move(tokenizer));
#if KMAMBA_ENABLE_MPI
  if (parallel.mesh) runtime.errors_may_be_local();  // from here on an error may strike one rank only
#endif
  Metrics metrics(r.out, r.recall_task(), parallel.root);
  if (r.resume) {
    trainer.resume(r.checkpoint());
    metrics.resume(trainer.steps_taken());
  } else {
    metrics.start();
  }
  if (parallel.root) kmamba::app::write_run_json(cli, r);
  print_start(r, *data, config, trainer, parallel);
  if (trainer.steps_taken() >= r.train.total_steps) {
    std::printf("kmamba-train: the run in %s is complete at step %lld (raise --steps to continue it)\n", r.out.c_str(),
                static_cast<long long>(trainer.steps_taken()));
    return kmamba::app::exit_done;
  }
  TrainingLoop<Exec> loop(r, trainer, metrics, parallel);
  const bool interrupted = loop.run();
  loop.print_end(interrupted);
  return interrupted ? kmamba::app::exit_interrupted : kmamba::app::exit_done;
}

}  // namespace

int main(int argc, char** argv) {
  kmamba::keep_freed_host_memory();  // steps reuse freed host memory (KMAMBA_HOST_MALLOC_KEEP=0: off)
  CLI::App cli{description, "kmamba-train"};
  kmamba::app::configure(cli, footer);
  kmamba::app::declare_train_options(cli);
  Run run;
  return kmamba::app::run_app(
      argc, argv, cli,
      [&] {
        run = kmamba::app::configure_run(cli);
        // MPI when a launcher started this process or a mesh option asks for ranks.
        return kmamba::app::Launch{kmamba::app::launched_by_mpi() || kmamba::app::asks_for_ranks(cli)};
      },
      [&](kmamba::app::Runtime& runtime) {
        return kmamba::app::on_space(run.device, [&](auto exec) { return train<decltype(exec)>(run, cli, runtime); });
      });
}
