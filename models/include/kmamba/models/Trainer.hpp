// Training a LanguageModel: gradient accumulation over micro-batches, global-norm clipping, the
// warm-up + cosine learning-rate schedule and AdamW, held-out evaluation, and checkpoints that
// resume bit-exactly (on a deterministic backend) where they left off.
//
//   kmamba::LanguageModel<Exec> model(model_config);
//   model.initialize(train_config.seed);
//   auto data = std::make_shared<kmamba::AssociativeRecallTask>(kmamba::AssociativeRecallConfig{});
//   kmamba::Trainer<Exec> trainer(std::move(model), train_config, data);
//   while (trainer.steps_taken() < train_config.total_steps) {
//     kmamba::StepResult r = trainer.step();
//     if (r.step % train_config.eval_interval == 0) kmamba::LossResult v = trainer.evaluate();
//   }
//   trainer.save_checkpoint("runs/recall");   // config.json, model.safetensors, training_state.safetensors
//
// A checkpoint directory holds the model as LanguageModel::save writes it (loadable by Hugging Face
// transformers) and training_state.safetensors: for every parameter P the AdamW moments
// "optimizer.exp_avg.P" and "optimizer.exp_avg_sq.P" (F32, P's shape), "trainer.step" and
// "trainer.data_position" (I64, shape (1,)), and in its metadata the TrainConfig as JSON
// ("train_config"), the data set's fingerprint ("dataset") and a checksum of the parameters
// ("parameter_checksum") that ties it to the model.safetensors written with it.
//
// Data parallel (under mpirun): every rank builds the same trainer, then
//   kmamba::ProcessMesh mesh(MPI_COMM_WORLD, mesh_config);
//   trainer.enable_data_parallel(mesh, {/*zero_stage=*/1});
// and step() gives each dp rank its own micro-batches of the step's global batch. With tensor or
// sequence parallelism the trainer takes a model split over the mesh's tp and sp axes
// (LanguageModel(config, {&mesh.tensor(), &mesh.sequence()})): step() and evaluate() give each sp
// rank its segment of every sequence, checkpoints are written and resumed in the unsplit layout.
// With pipeline parallelism the model is this rank's stage (LanguageModel(config, {&mesh.tensor(),
// &mesh.sequence()}, {&mesh.pipeline()})): step() runs its micro-batches through the stages in the
// 1F1B order (Pipeline.hpp; interleaved for a model of {&mesh.pipeline(), v} with v chunks per
// stage) and checkpoints gather the stages into the unsplit model.
#ifndef KMAMBA_MODELS_TRAINER_HPP
#define KMAMBA_MODELS_TRAINER_HPP

#include <kmamba/models/Data.hpp>
#include <kmamba/models/Distributed.hpp>
#include <kmamba/models/LanguageModel.hpp>
#include <kmamba/models/LoadBalance.hpp>
#include <kmamba/models/Optimizer.hpp>
#include <kmamba/models/Pipeline.hpp>
#include <kmamba/models/Tokenizer.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace kmamba {

/// Hyper-parameters and schedule of a training run.
struct TrainConfig {
  double lr = 3e-3;                 ///< peak learning rate
  double min_lr = 3e-4;             ///< floor of the cosine decay
  std::int64_t warmup_steps = 100;  ///< linear warm-up steps
  std::int64_t total_steps = 1000;  ///< optimizer steps of the run (the end of the cosine)
  double weight_decay = 0.1;        ///< decoupled, on projection/conv/embedding weights only
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double grad_clip = 1.0;                  ///< maximum global gradient norm (0: no clipping)
  std::int64_t batch_size = 32;            ///< sequences per micro-batch
  std::int64_t grad_accum = 1;             ///< micro-batches per optimizer step
  std::uint64_t seed = 1234;               ///< model initialisation and data order
  std::int64_t eval_interval = 100;        ///< steps between held-out evaluations (0: none; > 0 needs a held-out split)
  std::int64_t eval_batches = 8;           ///< held-out batches of batch_size per evaluation
  std::int64_t checkpoint_interval = 500;  ///< steps between checkpoints (0: only at the end)
  /// Consecutive steps with a non-finite loss or gradient that are skipped (parameters and
  /// optimizer untouched, counted in skipped_steps()) before step() throws; 0: throw at the first.
  std::int64_t max_skipped_steps = 10;

  /// Throws kmamba::UserError naming the first invalid field.
  void validate() const;
  /// The AdamW part.
  AdamWConfig adamw() const;
  /// A JSON object with one key per field (the names above).
  std::string to_json() const;
  /// Parses to_json()'s layout; absent keys keep their defaults, unknown keys and values of the
  /// wrong type are UserErrors naming `source` and the key. Validates.
  static TrainConfig from_json(const std::string& json_text, const std::string& source);
  /// The configuration stored in `dir`/training_state.safetensors.
  static TrainConfig from_checkpoint(const std::string& dir);
};

/// What one optimizer step did.
struct StepResult {
  std::int64_t step = 0;          ///< optimizer steps taken, this one included
  double loss = 0.0;              ///< mean cross-entropy over the step's predicted tokens
  std::int64_t tokens = 0;        ///< predicted tokens (targets != ignore_index)
  std::int64_t correct = 0;       ///< predicted tokens whose arg-max is the target
  std::int64_t input_tokens = 0;  ///< tokens read by the model (batch · seqlen over the micro-batches)
  double grad_norm = 0.0;         ///< global gradient norm before clipping
  double lr = 0.0;                ///< learning rate of this step
  bool skipped = false;           ///< non-finite loss or gradients: no update was made (see non_finite)
  std::string non_finite;         ///< when skipped: what was non-finite, naming the parameters
  /// With LoadBalancing::dynamic_task_allocation (step() only): the real tokens each dp rank
  /// trained on, those its fixed share held, and whether rows were moved; empty otherwise.
  std::vector<std::int64_t> rank_tokens, fixed_share_tokens;
  bool rows_moved = false;

  double accuracy() const { return tokens > 0 ? static_cast<double>(correct) / static_cast<double>(tokens) : 0.0; }
};

template <class ExecutionSpace>
class Trainer {
 public:
  using execution_space = ExecutionSpace;
  using memory_space = typename ExecutionSpace::memory_space;

  /// Takes over `model` (initialised or loaded) and fresh AdamW state. `data` (may be null when only
  /// the explicit-batch overloads are used) supplies step() and evaluate(); its vocabulary must fit
  /// the model's, and config.eval_interval > 0 needs a held-out split. Validates `config`.
  Trainer(LanguageModel<ExecutionSpace> model, const TrainConfig& config, std::shared_ptr<const Dataset> data,
          const ExecutionSpace& exec = ExecutionSpace());

  /// One optimizer step on config().grad_accum training micro-batches of config().batch_size from
  /// the data set, starting at data_position(), which then advances past them.
  StepResult step();
  /// One optimizer step on `micro_batches`: zero the gradients; for each micro-batch i add
  /// (tokens_i / Σ tokens) · ∇loss_i, so k micro-batches give the gradient of one batch of all their
  /// sequences; clip to config().grad_clip; AdamW at learning_rate(steps_taken()). A non-finite loss
  /// or gradient norm skips the update (StepResult::skipped, steps_taken() unchanged, the data
  /// position still advances past the batches) and is counted in skipped_steps(); more than
  /// config().max_skipped_steps such steps in a row is a UserError naming the non-finite
  /// parameters and gradients, thrown before the parameters change.
  StepResult step(const std::vector<TokenBatch>& micro_batches);

  /// Mean loss and accuracy over config().eval_batches held-out batches (validation batches
  /// 0, 1, ..., the same every time). Data without a held-out split (validation fraction 0) has no
  /// held-out loss: a UserError (a loss over training batches would pass for one).
  LossResult evaluate();
  /// Mean loss and accuracy over `batches` (weighted by their predicted tokens).
  LossResult evaluate(const std::vector<TokenBatch>& batches);

  /// Writes the model (LanguageModel::save), `dir`/training_state.safetensors and the tokenizer
  /// files (set_tokenizer_files) into a staging directory and replaces `dir` with it as a whole (StagedDirectory): a
  /// save killed at any moment leaves the previous checkpoint or the new one, never a mix; files in `dir` that are not
  /// part of the checkpoint are not kept. Creates the parents of `dir` if needed. Data parallel: collective; the
  /// moments are gathered and world rank 0 writes, and every rank returns once the files exist.
  void save_checkpoint(const std::string& dir) const;
  /// Restores the parameters, AdamW moments, step count and data position saved in `dir`. The
  /// checkpoint's model configuration must equal this model's; a missing, extra, mis-shaped or
  /// corrupt tensor, a model.safetensors from another save, or other data is a UserError naming it,
  /// and leaves this trainer unchanged. Keeps config() (so a run can be extended); a changed
  /// batch_size rescales the data position when it divides the sequences consumed. A trainer
  /// without tokenizer files takes the checkpoint's, so that they stay in the checkpoints after it.
  void resume(const std::string& dir);
  /// The tokenizer files written into every checkpoint beside the model: those of the directory
  /// the model was loaded from (TokenizerFiles::from_directory), or of the tokenizer the data was
  /// made with. None by default (a byte-level model needs none).
  void set_tokenizer_files(TokenizerFiles files) { tokenizer_files_ = std::move(files); }
  const TokenizerFiles& tokenizer_files() const { return tokenizer_files_; }

#if KMAMBA_ENABLE_MPI
  /// Trains data parallel over the dp axis of `mesh` (which must outlive this trainer) from now on,
  /// through a DataParallel made for this model and config().adamw() with `options`: a step's
  /// global batch is config().grad_accum micro-batches per dp rank (step() gives rank r the
  /// data set's micro-batches data_position() + r·grad_accum + i, its fixed share, or with
  /// LoadBalancing::dynamic_task_allocation the rows balance_rows deals it), the gradients are summed over
  /// dp once per step, weighted by the global token count, the norm is taken over the whole mesh,
  /// and AdamW (its moments sharded under ZeRO-1) replaces this trainer's optimizer, which keeps
  /// only the step count. StepResult reports global losses and counts. save_checkpoint() gathers
  /// the moments and only world rank 0 writes; resume() gives each rank its shards. The current
  /// optimizer state carries over. Collective over the mesh where noted; call on every rank.
  /// With options.sync_frequency N > 1 (local SGD, docs/distributed.md §3.2) each dp replica
  /// steps on its own micro-batches, weighted by its own tokens and reduced over sp only (the
  /// reported loss and counts stay global, grad_norm is the replica's), and the parameters and
  /// moments are averaged over dp after every N-th step; checkpoints are written only then
  /// (replicas_identical()). A model split into pipeline stages (of mesh.pipeline()) then trains
  /// through a kmamba::Pipeline: every stage of a pipeline takes the same micro-batches, and the
  /// gradients are reduced over dp × sp after the pipeline's flush (a model made with a pipeline
  /// communicator, even of one stage, trains through it).
  void enable_data_parallel(const ProcessMesh& mesh, const DataParallelConfig& options = DataParallelConfig());
  /// The data-parallel engine enable_data_parallel() made (null before): its layout, moments and
  /// communication timeline.
  DataParallel<ExecutionSpace>* data_parallel() { return data_parallel_.get(); }
  const DataParallel<ExecutionSpace>* data_parallel() const { return data_parallel_.get(); }
  /// The pipeline enable_data_parallel() made for a model split into stages (null otherwise): its
  /// timing of the last step.
  const Pipeline<ExecutionSpace>* pipeline() const { return pipeline_.get(); }
#endif

  std::int64_t steps_taken() const { return optimizer_.steps_taken(); }
  /// Whether every data-parallel replica holds the same model and moments (always, but between
  /// the averagings of local steps), so that save_checkpoint() may run.
  bool replicas_identical() const;
  /// Training micro-batches (of config().batch_size) consumed by step(), over all dp ranks.
  std::int64_t data_position() const { return data_position_; }
  /// Steps skipped for a non-finite loss or gradient (saved in checkpoints).
  std::int64_t skipped_steps() const { return skipped_steps_; }
  const TrainConfig& config() const { return config_; }
  LanguageModel<ExecutionSpace>& model() { return model_; }
  const LanguageModel<ExecutionSpace>& model() const { return model_; }
  /// The one-rank AdamW; after enable_data_parallel() only its step count (the DataParallel holds
  /// the moments).
  const AdamW<memory_space>& optimizer() const { return optimizer_; }
  /// Where the AdamW moments live and are updated (Optimizer.hpp): on the device (default), or
  /// offloaded to host memory and host threads. Moves the current moments there; set it before
  /// enable_data_parallel(), which takes it over. resume() keeps it.
  void set_optimizer_placement(OptimizerPlacement placement);
  OptimizerPlacement optimizer_placement() const { return optimizer_.placement(); }
  /// Bytes of AdamW state in device memory (0 when offloaded; a ZeRO-1 rank's shards).
  std::size_t optimizer_device_bytes() const;
  const std::shared_ptr<const Dataset>& data() const { return data_; }

  /// How step() hands the global batch's rows to the dp ranks and how sequences are cut into
  /// sequence-parallel segments (docs/distributed.md §2, §3.1). Neither changes what a step
  /// computes beyond the order of fp32 sums: the loss stays the mean over the global batch's real
  /// tokens. Set the same on every rank. Validates `balancing`.
  void set_load_balancing(const LoadBalancing& balancing);
  const LoadBalancing& load_balancing() const { return balancing_; }

 private:
  const Dataset& dataset(const char* function) const;
  // The data-parallel hooks; without enable_data_parallel(): one rank, the sums are the values.
  int data_rank() const;
  int data_size() const;
  template <class T>
  T sum_over_data(T local) const;
  double reduce_and_norm();
  // The tokens that weigh a step's micro-batches: the global batch's, or with local steps the
  // replica's. Collective over dp × sp.
  std::int64_t step_tokens(std::int64_t local) const;
  // "the loss is nan; non-finite gradients in backbone.layers.1.mixer.D (16 values), ...".
  std::string non_finite_report(double loss, double grad_norm) const;
  void optimizer_step(double lr, double grad_scale);
  void write_checkpoint(const std::string& dir, const LanguageModel<ExecutionSpace>& model,
                        const std::vector<float>& m,         // (parameters of model)
                        const std::vector<float>& v) const;  // (parameters of model)
  // An AdamW without moments, `steps` taken, for the trainer whose DataParallel holds them.
  AdamW<memory_space> empty_optimizer(std::int64_t steps) const;
  // Under sequence parallelism: this rank's segment of every sequence of b (even or balanced).
  TokenBatch sequence_segment_of(const TokenBatch& b) const;
  // The step's global batch dealt to the dp ranks by real tokens (balance_rows), from the real
  // tokens of every rank's fixed share `own` (gathered over dp). Collective over dp.
  RowAssignment assign_rows(const std::vector<TokenBatch>& own) const;
  // Micro-batches of up to batch_size rows holding the step's global rows `rows` (ascending): those
  // of this rank's fixed share `own` copied, the others read from `data`.
  std::vector<TokenBatch> micro_batches_of(const Dataset& data, const std::vector<TokenBatch>& own,
                                           const std::vector<std::int64_t>& rows) const;
  // Gives the model b's packed sequence ids (none for a batch without them) and returns b's ids
  // and targets on the device.
  std::pair<ConstTensor2<std::int64_t, memory_space>, ConstTensor2<std::int64_t, memory_space>> upload(
      const TokenBatch& b);
  // b's ids, targets and packed sequence ids (or none) on the device, with weight 1.
  PipelineMicroBatch<memory_space> to_device(const TokenBatch& b) const;
  // The forward and backward of a step's micro-batches `runs` (this rank's rows and segments),
  // weighted by their tokens over `total`: adds the gradients and returns the results summed,
  // with loss the sum of loss · tokens.
  LossResult accumulate(const std::vector<TokenBatch>& runs, std::int64_t total);
  // The loss of one held-out batch (this rank's segment), through the pipeline when there is one.
  LossResult held_out_loss(const TokenBatch& b);

  ExecutionSpace exec_;
  LanguageModel<ExecutionSpace> model_;
  TrainConfig config_;
  std::shared_ptr<const Dataset> data_;
  AdamW<memory_space> optimizer_;
  std::int64_t data_position_ = 0;
  std::int64_t skipped_steps_ = 0;
  std::int64_t consecutive_skips_ = 0;
  TokenizerFiles tokenizer_files_;
  LoadBalancing balancing_;
#if KMAMBA_ENABLE_MPI
  std::unique_ptr<DataParallel<ExecutionSpace>> data_parallel_;
  std::unique_ptr<Pipeline<ExecutionSpace>> pipeline_;
#endif
};

}  // namespace kmamba

#endif
