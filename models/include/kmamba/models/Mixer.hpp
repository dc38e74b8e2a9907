// The sequence mixer of one residual block (Mamba-1, Mamba-2 or Mamba-3), as the language model
// and the embedding API see it: it declares its parameters in the model's ParameterSlab under its
// checkpoint names, initialises them as the reference does, and runs forward and backward on
// (batch, seqlen, d_model) activations, keeping what backward needs between the two.
//
// For recurrent inference (docs/algorithms.md §1.6, §2.10, §5) a mixer makes a MixerCache per batch:
// its conv window and SSM state plus every buffer a decode step needs. prefill runs the chunked
// forward over a segment of tokens starting from the cache's states and leaves the final states
// in it; step advances every sequence of the batch by one token. prefill over a sequence and
// prefill/step over any split of it give the same outputs (within fp32 rounding).
//
//   auto mixer = kmamba::make_mixer<Exec>(config, "backbone.layers.0.mixer.");
//   mixer->declare_parameters(slab);            // before slab.finalize()
//   ...
//   mixer->forward(exec, slab, u, out, true);   // training: keep activations
//   mixer->backward(exec, slab, dout, du);      // du written, parameter gradients added
//
//   auto cache = mixer->make_cache(batch);      // zero states, all step buffers allocated once
//   mixer->prefill(exec, slab, prompt, out, *cache);     // (batch, seqlen, d_model)
//   mixer->step(exec, slab, token, token_out, *cache);   // (batch, d_model), no tensor allocated
#ifndef KMAMBA_MODELS_MIXER_HPP
#define KMAMBA_MODELS_MIXER_HPP

#include <kmamba/core/Error.hpp>
#include <kmamba/core/Bf16.hpp>
#include <kmamba/core/MatmulPrecision.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/models/Config.hpp>
#include <kmamba/models/ModelParallel.hpp>
#include <kmamba/models/ParameterSlab.hpp>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kmamba {

/// The recurrent state of one mixer for a batch of sequences (the conv window and the SSM state)
/// and the scratch buffers of its decode step, allocated once by Mixer::make_cache. Opaque: only
/// the mixer that made it reads it, and passing it to a mixer of another kind or other dimensions
/// is a kmamba::UserError.
template <class ExecutionSpace>
class MixerCache {
 public:
  explicit MixerCache(int batch) : batch_(batch) {}
  virtual ~MixerCache() = default;
  MixerCache(const MixerCache&) = delete;
  MixerCache& operator=(const MixerCache&) = delete;

  /// The number of sequences the cache holds.
  int batch() const { return batch_; }

  /// Sets the conv and SSM states to zero: every sequence starts afresh. Non-blocking on `exec`.
  virtual void reset(const ExecutionSpace& exec) = 0;

  /// A bf16 copy of the model's parameters in the slab's layout, which step() multiplies in place
  /// of the fp32 projection weights under MatmulPrecision::BFloat16 (the same products: that mode
  /// rounds the weights to bf16 anyway; half the bytes). Empty (the default): the slab's weights.
  /// The copy is the caller's (LanguageModel keeps one) and must outlive the steps that read it.
  void set_bf16_parameters(const ConstTensor1<bf16, typename ExecutionSpace::memory_space>& parameters) {
    bf16_parameters_ = parameters;
  }
  const ConstTensor1<bf16, typename ExecutionSpace::memory_space>& bf16_parameters() const { return bf16_parameters_; }

 private:
  int batch_;
  ConstTensor1<bf16, typename ExecutionSpace::memory_space> bf16_parameters_;  // (slab size) or empty
};

/// One parameter a mixer declares: its name after the mixer's prefix (the Hugging Face name), its
/// shape and whether the optimizer decays it.
struct MixerParameter {
  std::string name;
  std::vector<std::int64_t> shape;
  WeightDecay decay;
};

template <class ExecutionSpace>
class Mixer {
 public:
  using execution_space = ExecutionSpace;
  using memory_space = typename ExecutionSpace::memory_space;
  using Slab = ParameterSlab<memory_space>;

  virtual ~Mixer() = default;

  /// The prefix of this mixer's parameter names, e.g. "backbone.layers.3.mixer.".
  virtual const std::string& prefix() const = 0;

  /// Adds this mixer's parameters to `slab` (before finalize), named prefix() + the Hugging Face
  /// name ("in_proj.weight", "A_log", ...) with the Hugging Face shapes; weight decay only on the
  /// projection and conv weights (docs/algorithms.md §4; none on biases, norms, A_log, D, dt_bias).
  virtual void declare_parameters(Slab& slab) const = 0;

  /// The reference initialisation of this mixer's parameters
  /// (docs/algorithms.md §1.1 / §2.1 / §3.1 and §4.4, including the prenorm-residual rescale of
  /// out_proj.weight when the config asks for it).
  /// Deterministic in `seed`. Non-blocking on `exec`.
  virtual void initialize(const ExecutionSpace& exec, const Slab& slab, std::uint64_t seed) const = 0;

  /// out = mixer(u). When `keep_for_backward`, the activations backward needs are kept until the
  /// next forward. `out` is overwritten. Non-blocking on `exec`.
  virtual void forward(const ExecutionSpace& exec, const Slab& slab,
                       const ConstTensor3<float, memory_space>& u,  // (batch, seqlen, d_model)
                       const Tensor3<float, memory_space>& out,     // (batch, seqlen, d_model)
                       bool keep_for_backward) = 0;

  /// Backward of the last forward(keep_for_backward = true): writes du (overwritten) and ADDS the
  /// parameter gradients into slab.grads() (so micro-batches accumulate). Throws kmamba::UserError
  /// when no activations were kept or dout's shape differs from that forward's. Non-blocking.
  virtual void backward(const ExecutionSpace& exec, const Slab& slab,
                        const ConstTensor3<float, memory_space>& dout,  // (batch, seqlen, d_model)
                        const Tensor3<float, memory_space>& du) = 0;    // (batch, seqlen, d_model)

  /// Releases the activations kept for backward.
  virtual void release_activations() = 0;

  /// A cache for `batch` sequences with zero states and every buffer step() needs. Throws
  /// kmamba::UserError unless batch >= 1.
  virtual std::unique_ptr<MixerCache<ExecutionSpace>> make_cache(int batch) const = 0;

  /// The chunked forward over one segment of tokens per sequence, continuing from the states in
  /// `cache` (zero after make_cache or reset) and leaving the states after the segment's last
  /// token in it; `out` is overwritten. A segment of length 0 changes nothing. Releases the
  /// activations kept for backward, as an inference forward does. Non-blocking on `exec`, except
  /// that the temporary buffers of the segment are released on return (which waits for the device
  /// where freeing memory does). Throws kmamba::UserError for a wrong shape or a cache of another
  /// mixer kind, dimensions or batch.
  virtual void prefill(const ExecutionSpace& exec, const Slab& slab,
                       const ConstTensor3<float, memory_space>& u,  // (batch, seqlen, d_model)
                       const Tensor3<float, memory_space>& out,     // (batch, seqlen, d_model)
                       MixerCache<ExecutionSpace>& cache) = 0;

  /// One decode step: the next token of every sequence, from the states in `cache`, which are
  /// advanced by that token; `out` is overwritten. Allocates no tensor (every buffer is in the
  /// cache); non-blocking on `exec`. Throws kmamba::UserError like prefill.
  virtual void step(const ExecutionSpace& exec, const Slab& slab,
                    const ConstTensor2<float, memory_space>& u,  // (batch, d_model)
                    const Tensor2<float, memory_space>& out,     // (batch, d_model)
                    MixerCache<ExecutionSpace>& cache) const = 0;

  /// Packed variable-length rows (docs/algorithms.md §2.9): the sequence ids (batch, seqlen) of
  /// the tokens of the following forward, backward and prefill calls, until replaced. A token
  /// whose id differs from the previous token's starts a new document, and neither the conv nor
  /// the scan carries anything across that start, so each document gives what it gives alone. An
  /// empty View (the default) is one sequence per row. A backward uses the ids set at the time,
  /// which must be its forward's. Throws kmamba::UserError for ids given to a mixer without
  /// packed sequences (supports_sequence_ids false: none of the Mamba-1, Mamba-2 and Mamba-3 mixers).
  void set_sequence_ids(const ConstTensor2<std::int64_t, memory_space>& seq_idx) {
    KMAMBA_REQUIRE(!seq_idx.is_allocated() || supports_sequence_ids(),
                   "kmamba::Mixer::set_sequence_ids: the mixer '"
                       << prefix() << "' takes no packed sequence ids (seq_idx); packed variable-length rows are "
                       << "supported by the Mamba-1, Mamba-2 and Mamba-3 mixers");
    seq_idx_ = seq_idx;
  }

  /// The parameters this rank holds a tensor-parallel shard of (ModelParallel.hpp); every other
  /// parameter is replicated, with its unsplit shape. Empty for a mixer that is not split.
  virtual std::vector<ShardedParameter> sharded_parameters() const { return {}; }

  /// The arithmetic of this mixer's projection GEMMs (in_proj, x_proj, dt_proj, out_proj, ...) in
  /// forward, backward (dX and dW), prefill and decode steps: kmamba::gemm's MatmulPrecision,
  /// Float32 by default. The weights stay fp32 (rounded copies are made per product, never
  /// stored); the scans, convolutions, norms and recurrent states stay fp32. TensorFloat32 also
  /// runs the chunk products of the Mamba-2/3 scans in TF32 (SsdArgs::matmul_precision);
  /// BFloat16 leaves them in Float32.
  void set_matmul_precision(MatmulPrecision precision) { matmul_precision_ = precision; }
  MatmulPrecision matmul_precision() const { return matmul_precision_; }
  /// The precision of the Mamba-3 scans' chunk products that goes with matmul_precision():
  /// TensorFloat32 for TensorFloat32, Float32 otherwise (they have no bf16 form).
  MatmulPrecision scan_matmul_precision() const {
    return matmul_precision_ == MatmulPrecision::TensorFloat32 ? MatmulPrecision::TensorFloat32
                                                               : MatmulPrecision::Float32;
  }
  /// The precision of the SSD's chunk products that goes with matmul_precision(): the same (the
  /// SSD's BFloat16 is its fused tensor-core forward; SsdArgs::matmul_precision).
  MatmulPrecision ssd_matmul_precision() const { return matmul_precision_; }

 protected:
  /// Whether set_sequence_ids accepts ids.
  virtual bool supports_sequence_ids() const { return false; }

  /// The ids set by set_sequence_ids, checked against the (batch, seqlen) of a call of `function`.
  const ConstTensor2<std::int64_t, memory_space>& sequence_ids(const char* function, std::int64_t batch,
                                                               std::int64_t seqlen) const {
    if (seq_idx_.is_allocated()) {
      check_shape(function, "seq_idx", seq_idx_, Shape({batch, seqlen}), "(batch, seqlen) of u (set_sequence_ids)");
    }
    return seq_idx_;
  }

 private:
  MatmulPrecision matmul_precision_ = MatmulPrecision::Float32;
  ConstTensor2<std::int64_t, memory_space> seq_idx_;  // (batch, seqlen) or empty
};

/// The mixer of config.mixer (Mamba-1, Mamba-2 or Mamba-3) with parameter names prefixed by `prefix`.
/// Throws kmamba::UserError for a mixer kind this build cannot run.
template <class ExecutionSpace>
std::unique_ptr<Mixer<ExecutionSpace>> make_mixer(const ModelConfig& config, const std::string& prefix);

/// The same, split over the ranks of `parallel` (tensor and sequence parallelism: Mamba-2 and Mamba-3).
/// Throws kmamba::UserError when the mixer kind cannot be split or the split does not fit it.
template <class ExecutionSpace>
std::unique_ptr<Mixer<ExecutionSpace>> make_mixer(const ModelConfig& config, const std::string& prefix,
                                                  const ModelParallel& parallel);

}  // namespace kmamba

#endif
