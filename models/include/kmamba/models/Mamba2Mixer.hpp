// The Mamba-2 mixer (docs/algorithms.md §2.1–§2.3, §2.7; reference `modules/mamba2.py` with
// d_ssm = d_inner, no MLP part, rmsnorm on), forward and backward in fp32:
//
//   [z | x | B | C | dt] = u · in_projᵀ (+ in_proj.bias)                 (b·L, 2E + 2GN + H)
//   [x | B | C]          = silu(causal_conv1d([x | B | C]))              depthwise, conv_dim channels
//   y                    = SSD(x, dt, A = −exp(A_log), B, C, D, dt_bias,
//                              softplus, dt_limit, chunk)                no gate inside the scan,
//                                                                        chunk = min(chunk_size,
//                                                                        ssd_preferred_chunk_size)
//   y                    = gated RMSNorm(y, z), group-wise (group_size E/G), norm_before_gate from
//                          the config, eps = config.norm_epsilon
//   out                  = y · out_projᵀ (+ out_proj.bias)
//
// Each in_proj segment is computed by its own GEMM over the matching rows of in_proj.weight into
// its own buffer, and the conv runs once per segment of xBC over the matching rows of the conv
// weight, so that no split copies are needed. Training keeps a copy of u, the segments before and
// after the conv, y, the norm's rstd and its output (the SSD's and the conv's internals are
// recomputed by the core backward ops). Inference (keep_for_backward = false) uses buffers that
// are released on return, which waits for the device where freeing memory does (cudaFree), as
// the core SSD does; backward's gradient buffers are likewise released on return.
//
// Recurrent inference (docs/algorithms.md §2.10): the cache holds the conv windows of x, B and C
// (batch, width, d_conv − 1) each, the SSM state (batch, nheads, headdim, d_state) in fp32 and
// the step's buffers. prefill is the forward above with the cache's states as the conv's and the
// SSD's initial states, advanced in place to their final states. step runs, per token, three
// kernels at tensor_parallel_size 1 (four with bias):
//   [z | x | B | C | dt] = u · in_projᵀ, one GEMM                  (batch, in_proj_rows)
//   normed               = conv_ssd_step(...): causal_conv1d_update + SiLU of x, B, C, the SSD
//                          step with A = −exp(A_log), D, dt_bias, then gated RMSNorm(y, z)
//                          (z read in place from the row)          one kernel; conv windows and
//                                                                    SSM state advanced in place
//   out                  = normed · out_projᵀ
// As the reference's step (docs/algorithms.md §2.10, §9 flag 1), the decode step applies no dt limit
// (the chunked forward clamps δ to [dt_limit_min, dt_limit_max]), so prefill and step agree
// exactly only while δ lies within those limits — always with the default (0, ∞).
//
// Tensor parallelism (docs/distributed.md §1.1; ModelParallel.tensor of t ranks): rank r holds heads
// [r·H/t, (r+1)·H/t) and groups [r·G/t, (r+1)·G/t) (H and G divisible by t). Its in_proj.weight is
// the rows [z_r | x_r | B_r | C_r | dt_r] of the unsplit one (column parallel), its conv channels,
// dt_bias, A_log, D and norm.weight the matching slices (the gated norm's groups of E/G channels stay
// whole, so the norm is local), out_proj.weight the columns of its channels (row parallel): forward
// all-reduces the partial outputs over the tensor ranks (out_proj.bias added once), backward
// all-reduces du. Grads of the shards are complete on their rank; out_proj.bias is replicated.
//
// Sequence parallelism (docs/distributed.md §2.1; ModelParallel.sequence of c ranks): rank k holds
// one contiguous segment of every sequence (any lengths >= 1). The conv halo is a chain: forward
// receives from rank k−1 the last d_conv − 1 pre-conv inputs of x, B, C (the conv's initial state)
// and sends rank k+1 its own final conv state; backward returns their gradients. The SSM state is
// parallel in time: every rank scans its segment from a zero state, the ranks combine their
// (decay, final state) pairs in ⌈log₂ c⌉ exchanges, and each adds the contribution of the state
// entering its segment (ssd_state_correction_forward); backward combines the gradients the other
// way and runs the SSD backward from the incoming state. Parameter gradients are partial sums over
// the segments; the caller sums them over the sequence ranks (DataParallel does, over dp × sp).
// Packed rows (set_sequence_ids) split too: the ids of the halo's tokens come with it, and no conv
// input or state crosses a document start (docs/distributed.md §2.4). prefill and step do not take
// a sequence split.
//
//   kmamba::Mamba2Mixer<Exec> mixer(config, "backbone.layers.0.mixer.");
//   mixer.declare_parameters(slab);                 // before slab.finalize()
//   mixer.initialize(exec, slab, seed);
//   mixer.forward(exec, slab, u, out, true);
//   mixer.backward(exec, slab, dout, du);           // du written, parameter gradients added
//   auto cache = mixer.make_cache(batch);
//   mixer.prefill(exec, slab, prompt, prompt_out, *cache);
//   mixer.step(exec, slab, token, token_out, *cache);
#ifndef KMAMBA_MODELS_MAMBA2MIXER_HPP
#define KMAMBA_MODELS_MAMBA2MIXER_HPP

#include <kmamba/core/Tensor.hpp>
#include <kmamba/models/Config.hpp>
#include <kmamba/models/Mixer.hpp>
#include <kmamba/models/ParameterSlab.hpp>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kmamba {

template <class MemorySpace>
struct SsdArgs;  // kmamba/core/Ssd.hpp

namespace impl {
template <class MemorySpace, std::size_t N>
struct SegmentedInProj;  // MixerToolkit.hpp
}  // namespace impl

template <class ExecutionSpace>
class Mamba2Mixer : public Mixer<ExecutionSpace> {
 public:
  using execution_space = ExecutionSpace;
  using memory_space = typename ExecutionSpace::memory_space;
  using Slab = ParameterSlab<memory_space>;

  /// A Mamba-2 mixer for `config` (validated; config.mixer must be Mamba2) whose parameters are
  /// named `prefix` + the Hugging Face names.
  Mamba2Mixer(const ModelConfig& config, const std::string& prefix);
  /// The same, split over the ranks of `parallel` (see the file comment); the communicators must
  /// outlive the mixer. Throws kmamba::UserError unless the tensor-parallel size divides nheads and
  /// ngroups.
  Mamba2Mixer(const ModelConfig& config, const std::string& prefix, const ModelParallel& parallel);

  const std::string& prefix() const override { return prefix_; }

  /// in_proj.weight (2E + 2GN + H, d_model), conv1d.weight (E + 2GN, 1, d_conv), conv1d.bias
  /// (E + 2GN) when conv_bias, dt_bias (H), A_log (H), D (H), norm.weight (E), out_proj.weight
  /// (d_model, E), and in_proj.bias / out_proj.bias when bias. Weight decay on the three weights.
  void declare_parameters(Slab& slab) const override;

  /// The reference initialisation (under tensor parallelism: this rank's slices of the unsplit
  /// mixer's initialisation): in_proj and out_proj weights uniform in ±1/sqrt(fan_in) (torch's
  /// kaiming_uniform(a=√5)), out_proj then divided by sqrt(n_layer) when rescale_prenorm_residual;
  /// conv weight and bias uniform in ±1/sqrt(d_conv); dt_bias = invsp(max(dt_init_floor, dt)) with
  /// dt log-uniform in [dt_min, dt_max]; A_log = log(U[1, 16)); D = 1; norm weight 1; linear
  /// biases 0. Each parameter draws its own Philox stream, keyed by `seed` and its full name, so
  /// layers differ even when they are given the same seed. Non-blocking on `exec`.
  void initialize(const ExecutionSpace& exec, const Slab& slab, std::uint64_t seed) const override;

  /// See Mixer::forward. Throws kmamba::UserError naming the tensor and both shapes when u or out
  /// is not (batch, seqlen, d_model), or when `slab` lacks one of this mixer's parameters.
  void forward(const ExecutionSpace& exec, const Slab& slab,
               const ConstTensor3<float, memory_space>& u,  // (batch, seqlen, d_model)
               const Tensor3<float, memory_space>& out,     // (batch, seqlen, d_model)
               bool keep_for_backward) override;

  /// See Mixer::backward. Throws kmamba::UserError when no activations are kept or when dout or du
  /// is not the (batch, seqlen, d_model) of the kept forward.
  void backward(const ExecutionSpace& exec, const Slab& slab,
                const ConstTensor3<float, memory_space>& dout,     // (batch, seqlen, d_model)
                const Tensor3<float, memory_space>& du) override;  // (batch, seqlen, d_model)

  void release_activations() override;

  std::unique_ptr<MixerCache<ExecutionSpace>> make_cache(int batch) const override;

  /// Under tensor parallelism every parameter but out_proj.bias (see the file comment).
  std::vector<ShardedParameter> sharded_parameters() const override;

  /// See Mixer::prefill.
  void prefill(const ExecutionSpace& exec, const Slab& slab,
               const ConstTensor3<float, memory_space>& u,  // (batch, seqlen, d_model)
               const Tensor3<float, memory_space>& out,     // (batch, seqlen, d_model)
               MixerCache<ExecutionSpace>& cache) override;

  /// See Mixer::step. No dt limit (see the file comment).
  void step(const ExecutionSpace& exec, const Slab& slab,
            const ConstTensor2<float, memory_space>& u,  // (batch, d_model)
            const Tensor2<float, memory_space>& out,     // (batch, d_model)
            MixerCache<ExecutionSpace>& cache) const override;

 protected:
  bool supports_sequence_ids() const override { return true; }

 private:
  class Cache;  // the MixerCache of this mixer, defined in Mamba2Mixer.cpp
  // The segments of in_proj's output, in the order of its rows (docs/algorithms.md §2.2).
  enum Segment { z_segment = 0, x_segment, B_segment, C_segment, dt_segment, segment_count };

  using Matrix = Tensor2<float, memory_space>;
  using ConstMatrix = ConstTensor2<float, memory_space>;

  // What forward computes, each (batch·seqlen, width) row-major.
  struct Activations {
    std::int64_t batch = 0, seqlen = 0;
    Matrix u;                               // (rows, d_model), a copy of the input (training only)
    std::array<Matrix, segment_count> pre;  // (rows, width) per in_proj segment; x, B, C before the conv
    std::array<Matrix, segment_count> act;  // (rows, width) x, B, C after conv + SiLU (z, dt: empty)
    Tensor1<float, memory_space> A;         // (nheads), −exp(A_log)
    Matrix y;                               // (rows, d_inner), the SSD output
    Matrix rstd;                            // (rows, ngroups), the gated norm's rstd
    Matrix normed;                          // (rows, d_inner), the gated norm's output
    // Sequence parallelism: the states entering this rank's segment (zero on the first rank) and
    // the factor by which the segment scales the SSM state.
    std::array<Tensor3<float, memory_space>, segment_count> conv_initial;  // x, B, C: (batch, width, d_conv − 1)
    Tensor4<float, memory_space> ssm_initial;                              // (batch, nheads, headdim, d_state)
    Tensor2<float, memory_space> segment_decay;                            // (batch, nheads)
    // With packed rows: 1 where the previous segment's last max(1, d_conv − 1) tokens are in this
    // segment's first document (PackedSegments.hpp), (batch, max(1, d_conv − 1)); else empty.
    Tensor2<float, memory_space> halo_mask;
  };

  // Every parameter this mixer declares, in declaration order.
  std::vector<MixerParameter> parameter_specs() const;
  // Throws kmamba::UserError unless `slab` holds every parameter with its shape.
  void check_parameters(const char* function, const Slab& slab) const;

  Activations make_activations(std::int64_t batch, std::int64_t seqlen, bool training) const;
  // The forward; with a cache, its states are the initial states and receive the final ones.
  void run_forward(const ExecutionSpace& exec, const Slab& slab,
                   const ConstMatrix& u,  // (batch·seqlen, d_model)
                   const Matrix& out,     // (batch·seqlen, d_model)
                   Activations& acts, Cache* cache) const;
  // Sequence parallel SSD: y and a.ssm_initial from this segment's scan and the other segments'
  // (decay, final state) pairs; keeps a.segment_decay for the backward.
  void scan_segment(const ExecutionSpace& exec, const SsdArgs<memory_space>& args,
                    const Tensor4<float, memory_space>& y,  // (batch, seqlen, nheads, headdim)
                    Activations& acts) const;
  // The steps of backward over the kept activations, from the output back to the input. `dpre`
  // receives the gradients of the in_proj segments and `dact` those of x, B and C after the conv,
  // (rows, width) each.
  Matrix backward_output(const ExecutionSpace& exec, const Slab& slab,
                         const ConstMatrix& dout,                               // (rows, d_model)
                         const std::array<Matrix, segment_count>& dpre) const;  // returns (rows, d_inner)
  void backward_ssd(const ExecutionSpace& exec, const Slab& slab,
                    const Matrix& dy,  // (rows, d_inner)
                    const std::array<Matrix, segment_count>& dpre, const std::array<Matrix, segment_count>& dact) const;
  void backward_conv(const ExecutionSpace& exec, const Slab& slab, const std::array<Matrix, segment_count>& dact,
                     const std::array<Matrix, segment_count>& dpre) const;
  void backward_in_proj(const ExecutionSpace& exec, const Slab& slab, const std::array<Matrix, segment_count>& dpre,
                        const Matrix& du) const;  // (rows, d_model)
  // d_model, d_inner, nheads, headdim, ngroups, d_state, d_conv: what a cache must have been made for.
  std::array<int, 7> shape_key() const;
  // `cache` as this mixer's Cache; throws kmamba::UserError if it is another mixer's or its batch
  // differs from `batch`.
  Cache& cache_of(const char* function, MixerCache<ExecutionSpace>& cache, std::int64_t batch) const;
  // in_proj.weight and its bias (config.bias) in the segments z, x, B, C, dt, for
  // impl::project_segments and impl::project_segments_backward.
  impl::SegmentedInProj<memory_space, segment_count> in_proj(const Slab& slab) const;
  // out (rows, width) = bias(offset : offset + width) + u · (rows [offset, offset + width) of w)ᵀ.
  void project(const ExecutionSpace& exec, const Slab& slab, const std::string& weight, const std::string& bias,
               int offset, int width,
               const ConstMatrix& u,                                                 // (rows, k)
               const Matrix& out,                                                    // (rows, width)
               const ConstTensor1<bf16, memory_space>& bf16_parameters = {}) const;  // (slab size): step_product

  // Sums the partial out_proj outputs (forward) or input gradients (backward) over the tensor ranks.
  void sum_over_tensor_ranks(const ExecutionSpace& exec, const Matrix& m) const;  // (rows, d_model)

  ModelConfig config_;
  std::string prefix_;
  ModelParallel parallel_;
  int d_model_, d_inner_, nheads_, headdim_, ngroups_, d_state_, d_conv_, conv_dim_, in_proj_rows_;
  std::array<int, segment_count> segment_offsets_{}, segment_widths_{};

  // The activations of the last forward(keep_for_backward = true), valid while has_kept_.
  Activations kept_;
  bool has_kept_ = false;
};

}  // namespace kmamba

#endif
