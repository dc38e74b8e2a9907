// A Mamba model over continuous-valued sequences (simulation data, not tokens): a linear input
// projection in place of the token embedding, the language model's n_layer pre-norm residual
// blocks (Add → RMSNorm → Mixer, any mixer kind) and final RMSNorm, and a linear head in place of
// the vocabulary head; trained with the mean squared error. Parameters and gradients live in one
// ParameterSlab (block names as in the language model, plus input_proj.{weight,bias} and
// output_head.{weight,bias}), so the optimizer, DataParallel and checkpoints work unchanged.
//
//   kmamba::SequenceModelConfig config;            // config.backbone: d_model, n_layer, mixer, ...
//   config.input_size = 40;  config.output_size = 40;
//   kmamba::SequenceModel<Exec> model(config);
//   model.initialize(1234);
//   model.forward(exec, x, y);                                // (batch, seqlen, 40) → (batch, seqlen, 40)
//   auto r = model.loss_and_backward(exec, x, targets);       // MSE; gradients added to parameters()
//   auto state = model.make_state(batch);                     // recurrent inference
//   model.step(exec, x_t, state, y_t);                        // (batch, 40) → (batch, 40)
#ifndef KMAMBA_MODELS_SEQUENCEMODEL_HPP
#define KMAMBA_MODELS_SEQUENCEMODEL_HPP

#include <kmamba/core/Tensor.hpp>
#include <kmamba/models/Config.hpp>
#include <kmamba/models/Mixer.hpp>
#include <kmamba/models/ParameterSlab.hpp>

#include <Kokkos_Core.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace kmamba {

/// A SequenceModel's shape: the backbone (every block field of ModelConfig; its vocabulary fields
/// are unused) and the channels per time step in and out.
struct SequenceModelConfig {
  ModelConfig backbone;
  int input_size = 1;
  int output_size = 1;

  /// Throws kmamba::UserError naming the first inconsistent field.
  void validate() const;
  /// {"format": "kmamba-sequence-model", "input_size": ..., "output_size": ..., "backbone": {HF config}}.
  std::string to_json() const;
  /// Parses to_json()'s layout; `source` names the file in error messages. Validates.
  static SequenceModelConfig from_json(const std::string& json_text, const std::string& source);
};

/// The result of a regression loss.
struct RegressionLoss {
  double loss = 0.0;        ///< mean over every value of (prediction − target)²
  std::int64_t values = 0;  ///< values averaged over (batch · seqlen · output_size)
};

template <class ExecutionSpace>
class SequenceModel;

/// The recurrent state of a batch of streams of one SequenceModel: a MixerCache per layer and the
/// (batch, d_model) buffers of a step, allocated once by SequenceModel::make_state. Only the model
/// that made it may use it (others throw kmamba::UserError); it must not outlive that model.
/// States are independent of each other. Move-only.
template <class ExecutionSpace>
class SequenceState {
 public:
  ~SequenceState();
  SequenceState(SequenceState&&) noexcept;
  SequenceState& operator=(SequenceState&&) noexcept;

  /// The number of streams.
  int batch() const;
  /// Time steps fed to every stream since creation or the last reset.
  std::int64_t position() const;
  /// Zeroes every state: the next prefill or step starts new streams. Non-blocking on `exec`.
  void reset(const ExecutionSpace& exec);

 private:
  friend class SequenceModel<ExecutionSpace>;
  struct Impl;
  explicit SequenceState(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

template <class ExecutionSpace>
class SequenceModel {
 public:
  using execution_space = ExecutionSpace;
  using memory_space = typename ExecutionSpace::memory_space;
  using Slab = ParameterSlab<memory_space>;

  /// Declares (zero-valued) parameters for `config` (validated).
  explicit SequenceModel(const SequenceModelConfig& config);
  ~SequenceModel();
  SequenceModel(SequenceModel&&) noexcept;
  SequenceModel& operator=(SequenceModel&&) noexcept;

  /// Reads `dir`/config.json (to_json's layout) and `dir`/model.safetensors. A missing, extra or
  /// mis-shaped tensor is a UserError naming it.
  static SequenceModel load(const std::string& dir);
  /// Writes `dir`/config.json and `dir`/model.safetensors (F32), each atomically; creates `dir`.
  void save(const std::string& dir) const;

  /// Deterministic in `seed`: the blocks as the language model initialises them, the input
  /// projection and the head normal with std 1/sqrt(fan_in), biases zero. Blocking.
  void initialize(std::uint64_t seed);

  const SequenceModelConfig& config() const;
  Slab& parameters();
  const Slab& parameters() const;

  /// Per-layer activation checkpointing, as LanguageModel::set_activation_checkpointing: a
  /// training forward keeps only each block's input and its norm's rstd, and backward recomputes
  /// one block at a time; the gradients are the same. Off by default.
  void set_activation_checkpointing(bool on);
  bool activation_checkpointing() const;
  /// Packed variable-length rows, as LanguageModel::set_sequence_ids: the sequence ids (batch,
  /// seqlen) of the rows of the following forward, loss, loss_and_backward and prefill calls (an
  /// empty View: one sequence per row); no state or conv tap crosses from one sequence into the
  /// next. The View is kept, not copied.
  void set_sequence_ids(const ConstTensor2<std::int64_t, memory_space>& seq_idx);
  /// Called by loss_and_backward, on the host and in backward order, for each range [begin, end) of
  /// parameters().grads() that backward has finished (work enqueued on `exec`): each block's
  /// parameters right after the block's backward, layers n_layer − 1 … 0, then every other
  /// parameter (input projection, final norm, head) at the end — the announcements of
  /// gradients_ready_sequence(). An empty hook (the default) is not called.
  using GradientsReadyHook = std::function<void(const ExecutionSpace& exec, std::size_t begin, std::size_t end)>;
  void set_gradients_ready_hook(GradientsReadyHook hook);
  /// The ranges the hook receives during one backward, announcement by announcement.
  std::vector<std::vector<std::pair<std::size_t, std::size_t>>> gradients_ready_sequence() const;

  /// outputs = model(inputs). Non-blocking on `exec` (a call with a new (batch, seqlen) first
  /// reallocates the activation buffers, which may wait for the device). The buffers are shared
  /// by forward, loss and loss_and_backward: calls on different execution-space instances must not
  /// overlap.
  void forward(const ExecutionSpace& exec,
               const ConstTensor3<float, memory_space>& inputs,  // (batch, seqlen, input_size)
               const Tensor3<float, memory_space>& outputs);     // (batch, seqlen, output_size)

  /// Forward, the mean squared error against `targets`, and backward: ADDS weight · d(loss)/dθ into
  /// parameters().grads() (zero them with zero_grads()). `outputs`, when allocated, receives the
  /// forward's outputs. Blocking (returns host values).
  RegressionLoss loss_and_backward(const ExecutionSpace& exec,
                                   const ConstTensor3<float, memory_space>& inputs,   // (batch, seqlen, input_size)
                                   const ConstTensor3<float, memory_space>& targets,  // (batch, seqlen, output_size)
                                   double weight = 1.0,
                                   const Tensor3<float, memory_space>& outputs = {});  // (batch, seqlen, output_size)

  /// Forward and the mean squared error only. Blocking.
  RegressionLoss loss(const ExecutionSpace& exec,
                      const ConstTensor3<float, memory_space>& inputs,    // (batch, seqlen, input_size)
                      const ConstTensor3<float, memory_space>& targets);  // (batch, seqlen, output_size)

  /// Sets every gradient to zero. Non-blocking.
  void zero_grads(const ExecutionSpace& exec);

  /// A SequenceState for `batch` streams (batch >= 1, else kmamba::UserError) with zero states.
  SequenceState<ExecutionSpace> make_state(int batch) const;

  /// Feeds one segment of time steps per stream through the chunked forward, continuing from
  /// `state` and leaving the states after the segment in it (prefill(a) then prefill(b) equals
  /// prefill(a ++ b), and equals forward(a ++ b) from a reset state). `outputs`, when allocated,
  /// receives every position's output. Non-blocking on `exec`, except that the segment's temporary
  /// (batch, seqlen, d_model) buffers are released on return.
  void prefill(const ExecutionSpace& exec,
               const ConstTensor3<float, memory_space>& inputs,  // (batch, seqlen, input_size)
               SequenceState<ExecutionSpace>& state,
               const Tensor3<float, memory_space>& outputs) const;  // (batch, seqlen, output_size) or empty

  /// One time step of every stream: outputs(b, :) follows inputs(b, :) and the stream's history.
  /// Allocates no tensor; non-blocking on `exec`.
  void step(const ExecutionSpace& exec, const ConstTensor2<float, memory_space>& inputs,  // (batch, input_size)
            SequenceState<ExecutionSpace>& state,
            const Tensor2<float, memory_space>& outputs) const;  // (batch, output_size)

 private:
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace kmamba

#endif
