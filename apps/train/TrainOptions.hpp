// kmamba-train's options: declared once through CLI11 (the command line, --help, the JSON config
// file, run.json), then resolved with the defaults of the run's kind into a Run.
#ifndef KMAMBA_APPS_TRAIN_TRAINOPTIONS_HPP
#define KMAMBA_APPS_TRAIN_TRAINOPTIONS_HPP

#include <kmamba/KMamba.hpp>

#include <CLI/CLI.hpp>

#include <cstddef>
#include <cstdint>
#include <set>
#include <string>

namespace kmamba {
namespace app {

/// Declares every option of kmamba-train into `cli`, grouped as --help shows them.
void declare_train_options(CLI::App& cli);

/// Typed access to the parsed options by long name ("batch-size"); a value not given anywhere is
/// the fallback. The ranges were checked when the value was parsed.
class TrainOptions {
 public:
  explicit TrainOptions(const CLI::App& cli) : cli_(cli) {}
  bool has(const std::string& name) const;
  std::string text(const std::string& name, const std::string& fallback) const;
  bool flag(const std::string& name) const;
  long long integer(const std::string& name, long long fallback) const;
  double number(const std::string& name, double fallback) const;
  const CLI::App& cli() const { return cli_; }

 private:
  const CLI::App& cli_;
};

/// Everything a run needs, resolved from the options with the defaults of its kind.
struct Run {
  enum class Kind { Recall, Tokens } kind = Kind::Recall;
  std::string data_path, model_dir, tokenizer, out, device;
  bool resume = false;
  bool activation_checkpointing = false;
  TrainConfig train;
  AssociativeRecallConfig recall;
  TokenDatasetConfig tokens;
  ModelConfig model;
  MeshConfig mesh;
  /// Chunks of layers per pipeline rank (--virtual-pipeline-stages): above 1, the interleaved 1F1B
  /// schedule; 1, the plain one.
  int virtual_pipeline_stages = 1;
  /// sequence_parallel_enabled true without --sp: the ranks that tp × dp leave split each sequence.
  bool derive_sequence_parallel = false;
  int zero_stage = 0;
  /// The data-parallel gradients are reduced during the last micro-batch's backward (else after it).
  bool overlap_communication = true;
  /// fp32 gradient elements per data-parallel reduction bucket (--bucket-mb).
  std::size_t bucket_elements = 0;
  /// Optimizer steps per averaging of the dp replicas (--gradient-sync-frequency; 1: DDP).
  std::int64_t sync_frequency = 1;
  /// How the data-parallel gradients travel (--gradient-compression).
  GradientCompression compression = GradientCompression::None;
  /// PowerSGD's rank (--powersgd-rank), with compression PowerSgd.
  int powersgd_rank = 4;
  /// The load_balancing keys and sequence_split_strategy.
  LoadBalancing balancing;
  MatmulPrecision precision = MatmulPrecision::Float32;
  /// The AdamW moments and update in host memory and on host threads (--offload-optimizer).
  bool offload_optimizer = false;
  std::int64_t log_interval = 10;
  /// The options given on the command line or in --config (not those run.json restored).
  std::set<std::string> given;
  std::string checkpoint() const { return out + "/checkpoint"; }
  bool recall_task() const { return kind == Kind::Recall; }
};

/// Merges the option sources into `cli` (the command line wins over --config, which wins over the
/// resumed run's run.json) and resolves them. Throws kmamba::UserError for a bad value, a
/// misplaced option, or --resume without the run's checkpoint and run.json.
Run configure_run(CLI::App& cli);

/// True when an option asks for a process mesh (the run then starts MPI).
bool asks_for_ranks(const CLI::App& cli);

/// The run's mesh on `world_size` ranks: --sp derived when run.derive_sequence_parallel, then
/// MeshConfig::resolve. Throws kmamba::UserError naming the key whose size does not fit.
MeshConfig mesh_for_world(const Run& run, int world_size);

/// Checks virtual_pipeline_stages v against the run and the model `config`: v > 1 needs
/// pipeline_parallel_size p >= 2, n_layer a multiple of v·p (equal chunks) and grad_accum a multiple
/// of p (the interleaved schedule's groups). Throws kmamba::UserError naming the key and the value
/// expected otherwise.
void check_virtual_stages(const Run& run, const ModelConfig& config);

/// Throws kmamba::UserError naming the first architecture option given with --resume that
/// differs from the checkpoint's `saved` configuration (a resumed run keeps its architecture).
void check_resumed_architecture(const Run& run, const ModelConfig& saved);

/// Writes `run.out`/run.json: every option with a value, as text, and the resolved run directory.
void write_run_json(const CLI::App& cli, const Run& run);

}  // namespace app
}  // namespace kmamba

#endif
