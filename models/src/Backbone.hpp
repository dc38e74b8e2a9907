// The residual backbone of the Mamba models (docs/algorithms.md §4.2): n_layer pre-norm blocks over
// a (batch, seqlen, d_model) residual stream kept in fp32 and the final RMSNorm,
//
//   r_0 = h_0, r_i = r_{i−1} + m_{i−1}, m_i = Mixer_i(RMSNorm_i(r_i)), output = RMSNorm_f(r_{n−1} + m_{n−1})
//
// where h_0 comes from the model's input end (LanguageModel: the token embedding; SequenceModel:
// the input projection) and the output goes to its output end (the LM head; the linear head).
// The backbone owns the blocks' parameters (under "backbone.layers.{i}." the mixer's and
// "norm.weight", then "backbone.norm_f.weight"), the mixers, the activations a training forward
// keeps for backward, activation checkpointing and the gradients-ready announcements; the models
// keep only their ends.
//
//   impl::Backbone<Exec> backbone(config, parallel, "kmamba::lm");
//   backbone.declare_parameters(slab);   // between the input end's and the output end's parameters
//   const auto& output = backbone.forward(exec, slab, batch, seqlen, true, write_h0);
//   ... the output end writes d(loss)/d(output) over backbone.output() ...
//   const auto& dh0 = backbone.backward(exec, slab);   // the input end's backward reads dh0
//   backbone.finish_backward(exec);
#ifndef KMAMBA_MODELS_SRC_BACKBONE_HPP
#define KMAMBA_MODELS_SRC_BACKBONE_HPP

#include <kmamba/core/MatmulPrecision.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/models/Config.hpp>
#include <kmamba/models/Mixer.hpp>
#include <kmamba/models/ModelParallel.hpp>
#include <kmamba/models/ParameterSlab.hpp>
#include <kmamba/models/PipelineStage.hpp>
#include <kmamba/models/SafeTensors.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace kmamba {
namespace impl {

/// Throws kmamba::UserError from `function` unless `file` holds config.n_layer blocks (one more
/// than the highest L of its "backbone.layers.L." tensors), naming num_hidden_layers of
/// `config_path`. Called before a Backbone is built: it makes one mixer per layer.
void check_layers_against_file(const ModelConfig& config, const SafeTensorsReader& file, const std::string& config_path,
                               const char* function);

template <class ExecutionSpace>
class Backbone {
 public:
  using Mem = typename ExecutionSpace::memory_space;
  using Slab = ParameterSlab<Mem>;
  using Ranges = std::vector<std::pair<std::size_t, std::size_t>>;
  using GradientsReadyHook = std::function<void(const ExecutionSpace& exec, std::size_t begin, std::size_t end)>;
  /// Writes the stream's input h_0 into the (batch·seqlen, d_model) rows it is given.
  using InputEnd = std::function<void(const Tensor2<float, Mem>& h0)>;

  static constexpr const char* final_norm_name = "backbone.norm_f.weight";
  /// "backbone.layers.{layer}.": the prefix of block `layer`'s parameters.
  static std::string layer_prefix(int layer);

  /// The blocks of `config` (validated), each mixer split over `parallel` (whose communicators
  /// must outlive the backbone); `label` starts the labels of its buffers ("kmamba::lm").
  Backbone(const ModelConfig& config, const ModelParallel& parallel, const std::string& label);
  /// A pipeline stage's part (PipelineStage.hpp): the blocks `layers` (their parameters under their
  /// unsplit names), and the final norm only when `final_norm`. Without it the stage's output is
  /// the residual stream h_end = r_{end−1} + m_{end−1} that the next stage starts from, and the
  /// stage keeps micro-batches in flight (use_activation_slot), so its blocks are always
  /// checkpointed: a training forward keeps each block's input only, backward recomputes.
  Backbone(const ModelConfig& config, const ModelParallel& parallel, const std::string& label, StageLayers layers,
           bool final_norm);

  /// The blocks this backbone holds.
  const StageLayers& layers() const { return layers_; }
  /// Adds every block's mixer parameters and norm weight, then the final norm's weight, to `slab`.
  void declare_parameters(Slab& slab) const;
  /// Norm weights 1 and every mixer initialised from its own seed derived from `seed`.
  /// Non-blocking on `exec`.
  void initialize(const ExecutionSpace& exec, const Slab& slab, std::uint64_t seed) const;

  /// Per-layer activation checkpointing (LanguageModel::set_activation_checkpointing).
  void set_activation_checkpointing(bool on);
  bool activation_checkpointing() const { return checkpointing_; }
  /// Which micro-batch's block inputs the following training forward keeps and the following
  /// backward reads (a pipeline stage's micro-batches in flight, each in its own slot; slot 0 by
  /// default). Other slots than 0 need checkpointed blocks (activation checkpointing, or a stage
  /// without the final norm): the mixers keep one micro-batch's activations only.
  void use_activation_slot(std::size_t slot);
  /// Every mixer's projection arithmetic (Mixer::set_matmul_precision).
  void set_matmul_precision(MatmulPrecision precision);
  /// Every mixer's packed sequence ids (Mixer::set_sequence_ids), for the following forward,
  /// backward and prefill calls.
  void set_sequence_ids(const ConstTensor2<std::int64_t, Mem>& seq_idx);
  /// The parameters this rank holds a tensor-parallel shard of.
  std::vector<ShardedParameter> sharded_parameters() const;

  /// The ranges of slab.grads() that backward finishes, announcement by announcement: each block's
  /// parameters after its backward (layers n_layer − 1 … 0), then every parameter outside the
  /// blocks (the ends' and the final norm's) at finish_backward; contiguous entries merged.
  std::vector<Ranges> gradients_ready_sequence(const Slab& slab) const;
  /// Calls `hook` with the ranges of gradients_ready_sequence(slab) as backward finishes them
  /// (their work enqueued on `exec`). An empty hook is not called.
  void set_gradients_ready_hook(GradientsReadyHook hook, const Slab& slab);

  /// The blocks and the final norm over `batch` sequences of `seqlen` positions, from the h_0 that
  /// `input` writes; returns output() = RMSNorm_f(h_n). A training forward keeps what backward
  /// needs (the blocks' inputs only, with checkpointing). Non-blocking on `exec` (a new shape first
  /// reallocates the buffers).
  const Tensor3<float, Mem>& forward(const ExecutionSpace& exec, const Slab& slab, std::int64_t batch,
                                     std::int64_t seqlen, bool training, const InputEnd& input);
  /// (batch, seqlen, d_model): the last forward's output (RMSNorm_f(h_end), or h_end without the
  /// final norm); backward reads d(loss)/d(output) from it.
  const Tensor3<float, Mem>& output() const { return final_norm_ ? normed_ : final_input_; }
  /// Backward of the last training forward, from d(loss)/d(output) written over output(): ADDS the
  /// blocks' and the final norm's parameter gradients into slab.grads(), announcing each block's,
  /// and returns d(loss)/d(h_0) (batch, seqlen, d_model), valid until the next forward.
  const Tensor3<float, Mem>& backward(const ExecutionSpace& exec, const Slab& slab);
  /// After the input end's backward: announces the last range and releases the mixers' activations.
  void finish_backward(const ExecutionSpace& exec);

  /// The recurrent state of a batch of sequences: a MixerCache per block and the (batch, d_model)
  /// buffers of a step.
  struct RecurrentState {
    std::vector<std::unique_ptr<MixerCache<ExecutionSpace>>> caches;  // one per layer
    Tensor2<float, Mem> residual;  // (batch, d_model): the residual stream of the current position
    Tensor2<float, Mem> normed;    // (batch, d_model): a norm's output
    Tensor2<float, Mem> mixed;     // (batch, d_model): a mixer's output
    /// Zeroes every cache's states. Non-blocking on `exec`.
    void reset(const ExecutionSpace& exec);
  };
  /// Zero states for `batch` sequences; `label` starts the buffers' labels.
  RecurrentState make_state(int batch, const std::string& label) const;

  /// One segment's (batch, seqlen, d_model) buffers after prefill: h_n = residual + mixed.
  struct Segment {
    Tensor3<float, Mem> residual;  // the last block's input r_{n−1}
    Tensor3<float, Mem> normed;    // the last block's norm output
    Tensor3<float, Mem> mixed;     // the last block's mixer output m_{n−1}
  };
  /// The blocks over one segment of `seqlen` positions per sequence from the h_0 that `input`
  /// writes, continuing from `state`'s caches and leaving the states after the segment in them
  /// (Mixer::prefill, which releases the activations kept for backward). The returned buffers
  /// (labels from `label`) are freed with the last copy of them.
  Segment prefill(const ExecutionSpace& exec, const Slab& slab, std::int64_t batch, std::int64_t seqlen,
                  const InputEnd& input, RecurrentState& state, const std::string& label) const;
  /// One position of every sequence from h_0 in state.residual: the blocks' steps and the final
  /// norm, leaving RMSNorm_f(h_n) in state.normed. Allocates nothing; non-blocking on `exec`.
  void step(const ExecutionSpace& exec, const Slab& slab, RecurrentState& state) const;

 private:
  // Allocates the forward's buffers for (batch, seqlen) when the shape changes; a training
  // forward keeps one residual per layer, inference one.
  void prepare(std::int64_t batch, std::int64_t seqlen, bool training);
  // The blocks held, and whether a training forward keeps block inputs only (recomputing in backward).
  int layer_count() const { return layers_.end - layers_.begin; }
  bool checkpointed() const { return checkpointing_ || !final_norm_; }
  // The blocks of a training or inference forward over residuals_[0], leaving r_{n−1} and m_{n−1}.
  void forward_blocks(const ExecutionSpace& exec, const Slab& slab, bool training);
  // Block `layer`'s backward from dres_ = d(loss)/d(r_{layer+1}), leaving d(loss)/d(r_layer) in it.
  void backward_block(const ExecutionSpace& exec, const Slab& slab, int layer);
  // grad(name) += norm_grad_.
  void add_norm_grad(const ExecutionSpace& exec, const Slab& slab, const std::string& name) const;
  // Calls the hook with announcement k.
  void announce(const ExecutionSpace& exec, std::size_t k) const;

  ModelConfig config_;
  std::string label_;
  StageLayers layers_;
  bool final_norm_ = true;
  std::vector<std::unique_ptr<Mixer<ExecutionSpace>>> mixers_;  // one per block of layers_
  bool checkpointing_ = false;
  GradientsReadyHook gradients_ready_;
  std::vector<Ranges> ready_sequence_;

  // The buffers of the last forward (batch, seqlen fixed by it).
  std::int64_t batch_ = 0, seqlen_ = 0;
  std::vector<Tensor3<float, Mem>> residuals_;            // blocks (training) or 1 × (batch, seqlen, d_model): r_i
  std::vector<Tensor1<float, Mem>> rstds_;                // as residuals_, (batch·seqlen): norm i's rstd
  std::vector<std::vector<Tensor3<float, Mem>>> parked_;  // the other slots' residuals_ (empty at slot_)
  std::size_t slot_ = 0;
  Tensor3<float, Mem> final_input_;                   // (batch, seqlen, d_model): h_n; backward's scratch
  Tensor1<float, Mem> final_rstd_;                    // (batch·seqlen)
  Tensor3<float, Mem> normed_;                        // (batch, seqlen, d_model): a norm's output; output()
  Tensor3<float, Mem> mixed_;                         // (batch, seqlen, d_model): a mixer's output; backward's dres
  Tensor1<float, Mem> norm_grad_;                     // (d_model): one norm's weight gradient
  Tensor3<float, Mem> recompute_in_, recompute_out_;  // (batch, seqlen, d_model), with checkpointing
};

}  // namespace impl
}  // namespace kmamba

#endif
