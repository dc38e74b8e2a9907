// The Mamba language model (docs/algorithms.md §4): token embedding, n_layer pre-norm residual blocks
// (Add → RMSNorm → Mixer, the residual stream kept in fp32), the final RMSNorm and the LM head
// (tied to the embedding unless the config unties it), over a vocabulary padded to
// pad_vocab_size_multiple. Parameters and gradients live in one ParameterSlab under the Hugging
// Face checkpoint names.
//
//   kmamba::LanguageModel<Kokkos::DefaultExecutionSpace> model(config);
//   model.initialize(1234);
//   auto targets = kmamba::next_token_targets(exec, ids);             // labels = ids shifted by one
//   float loss = model.loss_and_backward(exec, ids, targets);   // grads added to model.parameters()
//   model.save("out/");                                         // config.json + model.safetensors
//
// Recurrent inference (docs/algorithms.md §5): a DecodeState holds every layer's MixerCache and the
// buffers of a decode step for a batch of sequences, allocated once. prefill runs the chunked
// forward over a segment of tokens per sequence (continuing from the state, so a prompt may be
// fed in several segments) and returns the logits of the segment's last position; decode_step
// feeds one token per sequence and returns the next logits without allocating a tensor.
// kmamba::generate (Generation.hpp) drives both, with prompts of different lengths.
//
//   auto state = model.make_decode_state(batch);
//   model.prefill(exec, prompt_ids, state, logits);    // (batch, seqlen) → (batch, vocab_size)
//   model.decode_step(exec, next_ids, state, logits);  // (batch) → (batch, vocab_size)
#ifndef KMAMBA_MODELS_LANGUAGEMODEL_HPP
#define KMAMBA_MODELS_LANGUAGEMODEL_HPP

#include <kmamba/core/MatmulPrecision.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/models/Config.hpp>
#include <kmamba/models/Mixer.hpp>
#include <kmamba/models/ParameterSlab.hpp>
#include <kmamba/models/PipelineStage.hpp>

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace kmamba {

/// Positions whose target equals this are not predicted (no loss, no gradient).
constexpr std::int64_t ignore_index = -100;

/// The token embedding's parameter name (also the LM head's weight when the head is tied to it).
constexpr const char* embedding_parameter_name = "backbone.embeddings.weight";

namespace impl {
template <class MemorySpace>
struct ShiftTargets {
  Tensor2<std::int64_t, MemorySpace> targets;
  ConstTensor2<std::int64_t, MemorySpace> ids;
  ConstTensor2<std::int64_t, MemorySpace> seq_idx;  // if has_seq_idx
  bool has_seq_idx;
  KOKKOS_INLINE_FUNCTION void operator()(const int b, const int t) const {
    const bool last = t + 1 >= static_cast<int>(ids.extent(1)) || (has_seq_idx && seq_idx(b, t + 1) != seq_idx(b, t));
    targets(b, t) = last ? ignore_index : ids(b, t + 1);
  }
};
}  // namespace impl

/// The Hugging Face convention: targets(b, t) = ids(b, t + 1), and ignore_index at the last position.
/// With the rows' packed sequence ids (LanguageModel::set_sequence_ids), ignore_index also at the
/// last position of every document, so that no target crosses into the next one. Non-blocking on
/// `exec`. Throws kmamba::UserError for seq_idx of another shape than ids.
template <class ExecutionSpace>
Tensor2<std::int64_t, typename ExecutionSpace::memory_space> next_token_targets(
    const ExecutionSpace& exec,
    const ConstTensor2<std::int64_t, typename ExecutionSpace::memory_space>& ids,  // (batch, seqlen)
    const ConstTensor2<std::int64_t, typename ExecutionSpace::memory_space>& seq_idx =
        {}) {  // (batch, seqlen) or empty
  using Mem = typename ExecutionSpace::memory_space;
  if (seq_idx.is_allocated()) {
    check_shape("kmamba::next_token_targets", "seq_idx", seq_idx, shape_of(ids), "(batch, seqlen) of ids");
  }
  Tensor2<std::int64_t, Mem> targets(Kokkos::view_alloc(Kokkos::WithoutInitializing, "kmamba::lm::targets"),
                                     ids.extent(0), ids.extent(1));
  Kokkos::parallel_for("kmamba::lm::next_token_targets",
                       Kokkos::MDRangePolicy<ExecutionSpace, Kokkos::Rank<2>>(
                           exec, {0, 0}, {static_cast<int>(ids.extent(0)), static_cast<int>(ids.extent(1))}),
                       impl::ShiftTargets<Mem>{targets, ids, seq_idx, seq_idx.is_allocated()});
  return targets;
}

/// The result of LanguageModel::loss_and_backward.
struct LossResult {
  double loss = 0.0;         ///< mean cross-entropy over the predicted positions
  std::int64_t tokens = 0;   ///< predicted positions (targets != ignore_index)
  std::int64_t correct = 0;  ///< predicted positions whose arg-max logit is the target
};

template <class ExecutionSpace>
class LanguageModel;

/// The recurrent state of a batch of sequences of one LanguageModel: a MixerCache per layer (conv
/// windows and SSM states) and the (batch, d_model) buffers of a decode step, allocated once by
/// LanguageModel::make_decode_state. Only the model that made it may use it (others throw
/// kmamba::UserError); it must not outlive that model. Move-only.
template <class ExecutionSpace>
class DecodeState {
 public:
  ~DecodeState();
  DecodeState(DecodeState&&) noexcept;
  DecodeState& operator=(DecodeState&&) noexcept;

  /// The number of sequences.
  int batch() const;
  /// Tokens fed to every sequence since creation or the last reset (prefill segments and steps).
  std::int64_t position() const;
  /// Zeroes every state: the next prefill or step starts new sequences. Non-blocking on `exec`.
  void reset(const ExecutionSpace& exec);
  /// On CUDA, decode steps are recorded once into a CUDA graph and replayed (one launch per step
  /// instead of a few hundred; see kmamba/backends/StepGraph.hpp); on by default. Host backends
  /// and tensor-parallel models run every step normally either way.
  void set_step_graph(bool enabled);
  /// "recorded", "warming up" (the first steps run normally) or "not recorded: <why>".
  std::string step_graph_status() const;

 private:
  friend class LanguageModel<ExecutionSpace>;
  struct Impl;
  explicit DecodeState(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

template <class ExecutionSpace>
class LanguageModel {
 public:
  using execution_space = ExecutionSpace;
  using memory_space = typename ExecutionSpace::memory_space;
  using Slab = ParameterSlab<memory_space>;

  /// Declares (zero-valued) parameters for `config` (validated).
  explicit LanguageModel(const ModelConfig& config);
  /// The same, each mixer split over the ranks of `parallel` (ModelParallel.hpp; the communicators
  /// must outlive the model): the slab holds this rank's shards under the unsplit names, and under
  /// sequence parallelism the ids and targets given to every call are this rank's segment of each
  /// sequence (all ranks of `parallel.sequence` call together). initialize() gives each rank the
  /// slices of the unsplit initialisation; save() needs an unsplit model (gather_parameters).
  LanguageModel(const ModelConfig& config, const ModelParallel& parallel);
  /// The same, holding only stage `stages.stage()` of a model split into pipeline stages
  /// (PipelineStage.hpp; the communicator must outlive the model): the blocks
  /// stage_layers(n_layer, stage, stages) under their unsplit names, the embedding on the first
  /// stage, the final norm and the LM head on the last (with the embedding too when the head is tied).
  /// With stages.virtual_stages v > 1 the rank holds its v chunks instead (PipelineStage.hpp: chunk
  /// c the blocks chunk_layers(n_layer, stages, c), each checkpointed as a stage; the embedding with
  /// chunk 0 of the first rank, the final norm and the head with chunk v − 1 of the last), all in the
  /// one slab. initialize() gives the stage the unsplit initialisation's values. Such a model trains
  /// through stage_forward / stage_backward (driven by kmamba::Pipeline); forward, loss,
  /// loss_and_backward, prefill, decode and save need the whole model (a UserError otherwise).
  /// Throws a UserError when there are more (virtual) stages than layers.
  LanguageModel(const ModelConfig& config, const ModelParallel& parallel, const PipelineParallel& stages);
  ~LanguageModel();
  LanguageModel(LanguageModel&&) noexcept;
  LanguageModel& operator=(LanguageModel&&) noexcept;

  /// Reads `dir`/config.json and `dir`/model.safetensors (Hugging Face or mamba_ssm names, any float
  /// dtype stored: F32, F16, BF16, F64). A missing, extra or mis-shaped tensor is a UserError naming it.
  static LanguageModel load(const std::string& dir);
  /// Writes `dir`/config.json and `dir`/model.safetensors (F32, Hugging Face names; the tied LM head
  /// is not written), each atomically; creates `dir` if needed.
  void save(const std::string& dir) const;

  /// The reference initialisation (docs/algorithms.md §4.4), deterministic in `seed`. Blocking.
  void initialize(std::uint64_t seed);

  const ModelConfig& config() const;
  const ModelParallel& parallel() const;
  const PipelineParallel& pipeline() const;
  /// The blocks this model holds: all of them, or its pipeline stage's (its chunk `chunk`'s, in
  /// [0, pipeline().virtual_stages), with virtual stages).
  StageLayers layers(int chunk = 0) const;
  /// Per-layer activation checkpointing: when on, a training forward keeps only each block's input
  /// (the residual stream, and its norm's rstd); backward recomputes the block's norm and mixer
  /// forward right before the block's backward and releases them after, so one block's mixer
  /// activations are alive at a time instead of all of them. The gradients are the same. Under
  /// sequence parallelism the recompute repeats the block's state passing. Off by default. A
  /// pipeline stage before the last checkpoints its blocks whatever this says: it keeps several
  /// micro-batches in flight, and the mixers hold one micro-batch's activations.
  void set_activation_checkpointing(bool on);
  bool activation_checkpointing() const;
  /// The arithmetic of every projection GEMM: each mixer's (Mixer::set_matmul_precision: in_proj,
  /// x_proj, dt_proj, out_proj, ...) and the LM head's, in training forward and backward (dX and
  /// dW), loss, prefill and decode steps. Float32 (default) multiplies exactly; BFloat16 /
  /// TensorFloat32 round both operands of every product to bf16 / TF32 with fp32 sums
  /// (kmamba::gemm: the tensor cores on CUDA, an exact emulation, no faster, on host backends);
  /// TensorFloat32 also runs the Mamba-2/3 scans' chunk products in TF32. The parameters stay fp32
  /// master weights (the optimizer state too) and the embedding, norms, convolutions, scans,
  /// recurrent states and the loss stay fp32. A runtime option, not part of the config: save()
  /// does not write it and load() starts in Float32.
  /// Decode under BFloat16 keeps the weights in bf16 too: make_decode_state and each prefill
  /// round the parameters into one bf16 copy (half their size, allocated once) that the steps'
  /// projections and head read at half the bytes — the same products, since the mode rounds the
  /// weights anyway. Parameters changed afterwards reach the steps at the next prefill or new
  /// state; a state made before the precision became BFloat16 rounds per step until its next prefill.
  void set_matmul_precision(MatmulPrecision precision);
  MatmulPrecision matmul_precision() const;
  /// Packed variable-length rows (docs/training.md): the sequence ids (batch, seqlen) of the rows
  /// of the following forward, loss, loss_and_backward and prefill calls, until replaced (an empty
  /// View, the default: one sequence per row). A token whose id differs from the previous token's
  /// starts a document, and no conv tap or SSM state crosses that start, so each document's logits
  /// and gradients are those it has alone. The loss is masked by the targets: take them from
  /// next_token_targets(exec, ids, seq_idx). The View is kept, not copied. Throws
  /// kmamba::UserError at the next call for ids of another shape than that call's, or for a mixer
  /// split across sequence-parallel ranks that takes no packed rows there (Mamba-3).
  void set_sequence_ids(const ConstTensor2<std::int64_t, memory_space>& seq_idx);
  /// Called by loss_and_backward, on the host and in backward order, for each range [begin, end) of
  /// parameters().grads() whose gradients that backward has finished (their work enqueued on
  /// `exec`, not necessarily done): each block's parameters (its mixer's and its norm's) right after
  /// the block's backward, layers n_layer − 1 … 0, then every other parameter (embedding, final norm,
  /// LM head) at the end — the announcements of gradients_ready_sequence(). A model of several
  /// chunks (virtual stages) announces chunk 0's blocks and then the rest, after chunk 0's
  /// backward, which runs last; the other chunks' blocks are left to the reduction's finish. Data
  /// parallelism reduces each gradient bucket as soon as it is complete (DataParallel::attach). An
  /// empty hook (the default) is not called.
  using GradientsReadyHook = std::function<void(const ExecutionSpace& exec, std::size_t begin, std::size_t end)>;
  void set_gradients_ready_hook(GradientsReadyHook hook);
  /// The ranges the hook receives during one backward, announcement by announcement (contiguous
  /// entries of the slab merged into one range).
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> gradients_ready_sequence() const;
  /// The parameters this rank holds a tensor-parallel shard of (empty when not split).
  std::vector<ShardedParameter> sharded_parameters() const;
  Slab& parameters();
  const Slab& parameters() const;

  /// logits(b, t, :) over the real vocabulary (vocab_size columns, the padding rows dropped).
  /// Non-blocking on `exec`.
  void forward(const ExecutionSpace& exec,
               const ConstTensor2<std::int64_t, memory_space>& ids,  // (batch, seqlen), each in [0, vocab_size)
               const Tensor3<float, memory_space>& logits);          // (batch, seqlen, vocab_size)

  /// Forward, mean next-token cross-entropy against `targets` (ignore_index skips a position), and
  /// backward: ADDS weight · d(loss)/dθ into parameters().grads() (zero them with zero_grads() at
  /// the start of an accumulation window). `logits`, when allocated, receives the forward's logits.
  /// Blocking (returns host values). A token or target outside the vocabulary is a UserError.
  LossResult loss_and_backward(const ExecutionSpace& exec,
                               const ConstTensor2<std::int64_t, memory_space>& ids,      // (batch, seqlen)
                               const ConstTensor2<std::int64_t, memory_space>& targets,  // (batch, seqlen)
                               double weight = 1.0,
                               const Tensor3<float, memory_space>& logits = {});  // (batch, seqlen, vocab_size)

  /// Forward and loss only (no gradients, no kept activations). Blocking.
  LossResult loss(const ExecutionSpace& exec, const ConstTensor2<std::int64_t, memory_space>& ids,  // (batch, seqlen)
                  const ConstTensor2<std::int64_t, memory_space>& targets);                         // (batch, seqlen)

  /// Pipeline parallelism, one stage (PipelineStage.hpp; kmamba::Pipeline drives these in the 1F1B
  /// order): the training forward of one micro-batch through this stage's chunk `chunk` (0 without
  /// virtual stages) — from the embedding of `ids` on virtual stage 0, from `input`, the previous
  /// virtual stage's output, elsewhere — keeping its block inputs in the chunk's `slot` (one slot per
  /// micro-batch in flight; 0 on the last virtual stage, which runs each micro-batch's backward
  /// right after its forward). On the last virtual stage also the head and the loss against
  /// `targets` (returned; zeros elsewhere, where targets may be empty). With `training` false
  /// nothing is kept (held-out losses). Non-blocking on chunks other than the last virtual stage.
  /// Ids outside the vocabulary, an input of another shape or a chunk outside [0, virtual_stages)
  /// are UserErrors.
  LossResult stage_forward(const ExecutionSpace& exec,
                           const ConstTensor2<std::int64_t, memory_space>& ids,      // (batch, seqlen)
                           const ConstTensor2<std::int64_t, memory_space>& targets,  // (batch, seqlen) or empty
                           const ConstTensor3<float, memory_space>& input,  // (batch, seqlen, d_model) or empty
                           int chunk, std::size_t slot, bool training = true);
  /// (batch, seqlen, d_model): the last stage_forward's output of chunk `chunk` on a virtual stage
  /// before the last, the residual stream the next virtual stage starts from. Valid until the
  /// chunk's next stage call.
  const Tensor3<float, memory_space>& stage_output(int chunk) const;
  /// Backward of the micro-batch stage_forward kept in chunk `chunk`'s `slot`: on the last virtual
  /// stage from its loss weighted by `weight` (as loss_and_backward), elsewhere from `output_grad`, the gradient of
  /// stage_output(chunk) (the weight already in it). ADDS the chunk's parameter gradients and returns
  /// the gradient of the chunk's input (batch, seqlen, d_model), valid until the chunk's next stage
  /// call; an empty View on virtual stage 0. Non-blocking.
  Tensor3<float, memory_space> stage_backward(
      const ExecutionSpace& exec, const ConstTensor2<std::int64_t, memory_space>& ids,  // (batch, seqlen)
      const ConstTensor3<float, memory_space>& output_grad,  // (batch, seqlen, d_model) or empty
      double weight, int chunk, std::size_t slot);

  /// Sets every gradient to zero. Non-blocking.
  void zero_grads(const ExecutionSpace& exec);

  /// A DecodeState for `batch` sequences (batch >= 1, else kmamba::UserError) with zero states.
  DecodeState<ExecutionSpace> make_decode_state(int batch) const;

  /// Feeds one segment of tokens per sequence through the chunked forward, continuing from
  /// `state` and leaving the states after the segment in it (so prefill(a) then prefill(b) equals
  /// prefill(a ++ b)). `last_logits`, when allocated, receives the logits after each sequence's
  /// last token, over the real vocabulary (the reference's num_last_tokens = 1). Releases the
  /// activations kept for backward. Blocking for the id check; its temporary (batch, seqlen,
  /// d_model) buffers are released on return. A token outside the vocabulary, a shape that
  /// disagrees or another model's state is a kmamba::UserError.
  void prefill(const ExecutionSpace& exec,
               const ConstTensor2<std::int64_t, memory_space>& ids,  // (batch, seqlen), seqlen >= 1
               DecodeState<ExecutionSpace>& state,
               const Tensor2<float, memory_space>& last_logits);  // (batch, vocab_size) or empty

  /// One decode step: feeds ids(b) to sequence b and writes the logits that follow over the real
  /// vocabulary. Allocates no tensor. Blocking for the id check only (the rest is ordered on
  /// `exec`). Errors as prefill. With `check_ids` false the caller guarantees every id is in
  /// [0, vocab_size) — e.g. chosen on the device by a DeviceSampler over at most vocab_size
  /// tokens — and the step never waits for the device (an id outside reads outside the table).
  void decode_step(const ExecutionSpace& exec, const ConstTensor1<std::int64_t, memory_space>& ids,  // (batch)
                   DecodeState<ExecutionSpace>& state,
                   const Tensor2<float, memory_space>& logits,  // (batch, vocab_size)
                   bool check_ids = true) const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace kmamba

#endif
