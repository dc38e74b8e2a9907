// The Mamba-1 mixer (docs/algorithms.md §1.1, §1.2, §1.5), with the parameters of Hugging Face's
// MambaMixer / mamba_ssm's Mamba under prefix():
//
//   in_proj.weight  (2·d_inner, d_model)            in_proj.bias  (2·d_inner)   when config.bias
//   conv1d.weight   (d_inner, 1, d_conv)            conv1d.bias   (d_inner)     when config.conv_bias
//   x_proj.weight   (dt_rank + 2·d_state, d_inner)
//   dt_proj.weight  (d_inner, dt_rank)              dt_proj.bias  (d_inner)
//   A_log           (d_inner, d_state)              D             (d_inner)
//   out_proj.weight (d_model, d_inner)              out_proj.bias (d_model)     when config.bias
//
// Forward, for u of shape (batch, seqlen, d_model):
//   [x | z]      = u·in_projᵀ (+ bias)                      x first, z second
//   xc           = silu(causal depthwise conv1d(x) + conv bias)
//   [dt | B | C] = xc·x_projᵀ
//   delta        = dt·dt_projᵀ                               (dt_proj.bias enters the scan)
//   y            = selective_scan(xc, delta, A = −exp(A_log), B, C, D, z,
//                                 delta_bias = dt_proj.bias, softplus)
//   out          = y·out_projᵀ (+ bias)
// in fp32 on every backend. Backward runs the chain in reverse and adds every parameter
// gradient into the slab's gradients.
//
// Sequence parallelism (docs/distributed.md §2.2; ModelParallel.sequence of c ranks; no tensor
// parallelism): rank k holds one contiguous segment of every sequence (any lengths >= 1). The conv
// halo is a chain: forward receives from rank k−1 the last d_conv − 1 inputs of x (the conv's
// initial state) and sends rank k+1 its own final conv state; backward returns their gradients.
// The SSM state is parallel in time: every rank scans its segment from a zero state, the ranks
// combine their (decay, last state) pairs in ⌈log₂ c⌉ exchanges, and each adds the contribution of
// the state entering its segment (selective_scan_state_correction_forward); backward combines the
// gradients the other way and runs the scan's backward from the incoming state. Parameter
// gradients are partial sums over the segments; the caller sums them over the sequence ranks
// (DataParallel does, over dp × sp). Packed rows split as Mamba-2's (docs/distributed.md §2.4:
// the halo's ids come with the conv halo; masks stop the halo, the state and the correction at a
// document start). prefill and step do not take a split.
//
// Recurrent inference (docs/algorithms.md §1.6): the cache holds the conv window (batch, d_inner,
// d_conv − 1), the SSM state (batch, d_inner, d_state) in fp32 and the step's buffers. prefill is
// the forward above with the cache's states as the conv's and the scan's initial states, advanced
// in place to their final states. step runs, per token:
//   [x | z]      = u·in_projᵀ (+ bias)
//   xc           = causal_conv1d_update(x) then SiLU          conv window shifted in place
//   [dt | B | C] = xc·x_projᵀ, one GEMM per part;  delta = dt·dt_projᵀ
//   y            = selective_scan_step(xc, delta, A, B, C, D, z, dt_proj.bias, softplus)
//   out          = y·out_projᵀ (+ bias)
//
//   kmamba::Mamba1Mixer<Exec> mixer(config, "backbone.layers.0.mixer.");
//   mixer.declare_parameters(slab);
//   slab.finalize("kmamba::model");
//   mixer.initialize(exec, slab, seed);
//   mixer.forward(exec, slab, u, out, true);
//   mixer.backward(exec, slab, dout, du);
//   auto cache = mixer.make_cache(batch);
//   mixer.prefill(exec, slab, prompt, prompt_out, *cache);
//   mixer.step(exec, slab, token, token_out, *cache);
#ifndef KMAMBA_MODELS_MAMBA1MIXER_HPP
#define KMAMBA_MODELS_MAMBA1MIXER_HPP

#include <kmamba/core/Tensor.hpp>
#include <kmamba/models/Config.hpp>
#include <kmamba/models/Mixer.hpp>
#include <kmamba/models/ParameterSlab.hpp>

#include <array>
#include <cstdint>
#include <memory>
#include <string>

namespace kmamba {

template <class MemorySpace>
struct SelectiveScanArgs;  // kmamba/core/SelectiveScan.hpp

template <class ExecutionSpace>
class Mamba1Mixer final : public Mixer<ExecutionSpace> {
 public:
  using execution_space = ExecutionSpace;
  using memory_space = typename ExecutionSpace::memory_space;
  using Slab = ParameterSlab<memory_space>;

  /// Throws kmamba::UserError unless config.mixer is MixerKind::Mamba1 and the config is valid.
  Mamba1Mixer(const ModelConfig& config, std::string prefix);
  /// A mixer of a sequence-split model (file comment); throws kmamba::UserError if `parallel`
  /// splits the tensors as well.
  Mamba1Mixer(const ModelConfig& config, std::string prefix, const ModelParallel& parallel);

  const std::string& prefix() const override { return prefix_; }

  void declare_parameters(Slab& slab) const override;

  /// Per docs/algorithms.md §1.1 and §4.4: in_proj, x_proj and out_proj kaiming-uniform
  /// (U(±1/√fan_in)), out_proj then divided by √n_layer when config.rescale_prenorm_residual;
  /// conv1d weight and bias U(±1/√d_conv); dt_proj.weight U(±dt_rank^−½·dt_scale) (or that
  /// constant when !config.dt_init_random); dt_proj.bias the inverse softplus of a log-uniform
  /// dt in [dt_min, dt_max] floored at dt_init_floor; A_log(d, n) = ln(n + 1); D = 1; linear
  /// biases 0. Each tensor draws from its own Philox stream, keyed by `seed` and its full name,
  /// so mixers of different layers differ under one seed.
  void initialize(const ExecutionSpace& exec, const Slab& slab, std::uint64_t seed) const override;

  void forward(const ExecutionSpace& exec, const Slab& slab,
               const ConstTensor3<float, memory_space>& u,  // (batch, seqlen, d_model)
               const Tensor3<float, memory_space>& out,     // (batch, seqlen, d_model)
               bool keep_for_backward) override;

  /// Allocates its temporary gradient buffers per call and releases them on return (the
  /// selective scan's backward does the same), which waits for the device where freeing memory
  /// does (cudaFree).
  void backward(const ExecutionSpace& exec, const Slab& slab,
                const ConstTensor3<float, memory_space>& dout,     // (batch, seqlen, d_model)
                const Tensor3<float, memory_space>& du) override;  // (batch, seqlen, d_model)

  void release_activations() override;

  std::unique_ptr<MixerCache<ExecutionSpace>> make_cache(int batch) const override;

  /// See Mixer::prefill.
  void prefill(const ExecutionSpace& exec, const Slab& slab,
               const ConstTensor3<float, memory_space>& u,  // (batch, seqlen, d_model)
               const Tensor3<float, memory_space>& out,     // (batch, seqlen, d_model)
               MixerCache<ExecutionSpace>& cache) override;

  /// See Mixer::step.
  void step(const ExecutionSpace& exec, const Slab& slab,
            const ConstTensor2<float, memory_space>& u,  // (batch, d_model)
            const Tensor2<float, memory_space>& out,     // (batch, d_model)
            MixerCache<ExecutionSpace>& cache) const override;

 protected:
  bool supports_sequence_ids() const override { return true; }

 private:
  class Cache;  // the MixerCache of this mixer, defined in Mamba1Mixer.cpp
  // What forward computes, token-major (rows = batch·seqlen) for the projections and
  // channel-major for the selective scan. Kept between forward and backward; z, delta, bc and
  // y_channels are needed by forward only and are kept as reusable workspace.
  struct Activations {
    std::int64_t batch = 0, seqlen = 0;
    Tensor2<float, memory_space> u;               // (batch·seqlen, d_model), a copy of the input
    Tensor2<float, memory_space> x;               // (batch·seqlen, d_inner), the conv input
    Tensor2<float, memory_space> z;               // (batch·seqlen, d_inner), the gate
    Tensor2<float, memory_space> xc;              // (batch·seqlen, d_inner), silu(conv(x))
    Tensor2<float, memory_space> dt;              // (batch·seqlen, dt_rank), the low-rank dt
    Tensor2<float, memory_space> bc;              // (batch·seqlen, 2·d_state), [B | C]
    Tensor2<float, memory_space> delta;           // (batch·seqlen, d_inner), dt·dt_projᵀ
    Tensor2<float, memory_space> y;               // (batch·seqlen, d_inner), the gated scan output
    Tensor3<float, memory_space> xc_channels;     // (batch, d_inner, seqlen)
    Tensor3<float, memory_space> delta_channels;  // (batch, d_inner, seqlen)
    Tensor3<float, memory_space> z_channels;      // (batch, d_inner, seqlen)
    Tensor3<float, memory_space> y_channels;      // (batch, d_inner, seqlen)
    Tensor4<float, memory_space> B;               // (batch, 1, d_state, seqlen)
    Tensor4<float, memory_space> C;               // (batch, 1, d_state, seqlen)
    Tensor2<float, memory_space> A;               // (d_inner, d_state), −exp(A_log)
    // Sequence parallelism: the states entering this rank's segment (zero on the first rank) and
    // the factors by which the segment scales the SSM state.
    Tensor3<float, memory_space> conv_initial;   // (batch, d_inner, d_conv − 1)
    Tensor3<float, memory_space> ssm_initial;    // (batch, d_inner, d_state)
    Tensor3<float, memory_space> segment_decay;  // (batch, d_inner, d_state)
    // With packed rows: 1 where the previous segment's last max(1, d_conv − 1) tokens are in this
    // segment's first document (PackedSegments.hpp), (batch, max(1, d_conv − 1)); else empty.
    Tensor2<float, memory_space> halo_mask;
  };

  void prepare_activations(std::int64_t batch, std::int64_t seqlen, bool keep_input);
  // The forward over act_ (prepared for u's batch and seqlen); with a cache, its states are the
  // initial states and receive the final ones. Errors about the slab name `function`.
  void run_forward(const ExecutionSpace& exec, const char* function, const Slab& slab,
                   const ConstTensor3<float, memory_space>& u,  // (batch, seqlen, d_model)
                   const Tensor3<float, memory_space>& out,     // (batch, seqlen, d_model)
                   Cache* cache);
  // Sequence parallel scan: y from this segment's scan and the other segments' (decay, last state)
  // pairs, which give act_.ssm_initial; keeps act_.segment_decay for the backward.
  void scan_segment(const ExecutionSpace& exec, const SelectiveScanArgs<memory_space>& args,
                    const Tensor3<float, memory_space>& y);  // (batch, d_inner, seqlen)
  // Sequence parallel backward: the gradient of this segment's last state, (batch, d_inner, d_state).
  Tensor3<float, memory_space> last_state_gradient(
      const ExecutionSpace& exec, const SelectiveScanArgs<memory_space>& args,
      const ConstTensor3<float, memory_space>& dy) const;  // (batch, d_inner, seqlen)
  // The conv + SiLU backward over act_: dx from dxc, the conv's parameter gradients added into the
  // slab's; the halo's gradient passes between the sequence ranks.
  void backward_conv(const ExecutionSpace& exec, const Slab& slab,
                     const ConstTensor2<float, memory_space>& dxc,   // (batch·seqlen, d_inner)
                     const Tensor2<float, memory_space>& dx) const;  // (batch·seqlen, d_inner)
  // d_model, d_inner, d_state, d_conv, dt_rank: what a cache must have been made for.
  std::array<int, 5> shape_key() const;
  // `cache` as this mixer's Cache; throws kmamba::UserError if it is another mixer's or its batch
  // differs from `batch`.
  Cache& cache_of(const char* function, MixerCache<ExecutionSpace>& cache, std::int64_t batch) const;

  ModelConfig config_;
  std::string prefix_;
  ModelParallel parallel_;
  int d_model_, d_inner_, d_state_, d_conv_, dt_rank_;
  Activations act_;
  bool kept_ = false;
};

}  // namespace kmamba

#endif
