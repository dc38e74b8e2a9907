// The Mamba-3 mixer (docs/algorithms.md §3.1–§3.7; reference `modules/mamba3.py`), SISO and MIMO,
// forward and backward in fp32. No convolution and no A_log: A is data dependent.
//
//   [z | x | B | C | dd_dt | dd_A | trap | angle] = u · in_projᵀ     (b·L, 2E + 2·R·G·N + 3H + S)
//   B̃, C̃    = RMSNorm_N(B)·B_norm.weight, RMSNorm_N(C)·C_norm.weight  per (rank, group), eps norm_epsilon
//   Δ       = softplus(dd_dt + dt_bias)                               (b, H, L)
//   A       = min(−f(dd_A), −A_floor), f(v) = 1 + v (v ≥ 0), 1/(1 − v) (v < 0)
//   ADT     = A·Δ;  angles(b, t, h, :) = angle(b, t, :) for every head
//   y       = mamba3 scan(q = C̃, k = B̃, v = x, ADT, Δ, trap, C_bias, B_bias, angles, D
//                         [, z, mimo_x, mimo_z, mimo_o])              kmamba/core/Mamba3Scan.hpp
//             (the scan applies the z gate when there is no output norm)
//   y       = RMSNorm over each head's P values · norm.weight ⊙ silu(z)  (is_outproj_norm, SISO only)
//   out     = y · out_projᵀ
// with E = d_inner, R = mimo_rank (1 for SISO), G = ngroups, N = d_state, H = nheads and
// S = (floor(N·rope_fraction) rounded down to even) / 2 rotary angles. The scan's chunk is
// config.chunk_size for SISO and max(1, chunk_size / R) for MIMO (the reference's 64 / R).
//
// Each in_proj segment is its own GEMM over the matching rows of in_proj.weight. Training keeps a
// copy of u, the segments, the normed B and C with their rstd, the scan inputs (Δ, ADT, trap,
// angles), y and the output norm's rstd and output; the scan's internals are recomputed by the core
// backward. Buffers of an inference forward and backward's gradient buffers are released on return
// (which waits for the device where freeing memory does).
//
// Recurrent inference (docs/algorithms.md §3.7): the cache holds the scan's four states, angle (b, H, S), ssm
// (b, H, P, N), k (b, H[, R], N) rotated and biased, v (b, H[, R], P) (SISO: the last x; MIMO: the
// last x ⊙ mimo_x, the scan's convention), all fp32, and the step's buffers. prefill is the forward
// above continuing from the cache's states; step runs the same pre-processing on one token and the
// core decode step.
//
// Tensor parallelism (docs/distributed.md §1.1; ModelParallel.tensor of t ranks, H and G divisible by t):
// rank r holds heads [r·H/t, (r+1)·H/t) and groups [r·G/t, (r+1)·G/t). Its in_proj.weight is the
// rows [z_r | x_r | B_r | C_r | dd_dt_r | dd_A_r | trap_r | angle] of the unsplit one (column
// parallel; B and C are (R, G, N) per token, so each of the R rank blocks contributes its G/t
// groups), dt_bias, D, B_bias, C_bias, mimo_* and norm.weight the slices of its heads, out_proj.weight
// the columns of its channels (row parallel: forward all-reduces the partial outputs over the tensor
// ranks, backward all-reduces du). The angle rows of in_proj.weight and B_norm.weight, C_norm.weight
// are shared by every head: replicated, their gradients (partial sums over this rank's heads) are
// all-reduced over the tensor ranks in backward, so they are complete and equal on every tensor rank.
//
// Sequence parallelism (docs/distributed.md §2.3, parallel in time; ModelParallel.sequence of c
// ranks): the angle entering rank k's segment is the sum of the earlier segments' angle totals and
// its previous-token k and v are rank k−1's last (a halo), both exchanged before any scan; every rank
// then scans its segment from a zero SSM state at once, the segments' (decay, final state) pairs
// give each the SSM state entering it, whose contribution is added to its outputs
// (kmamba/core/Mamba3StateCorrection.hpp). Backward mirrors it: the incoming states' gradients are
// composed over the ranks in reverse, the halo's go back to rank k−1 before the scans, the final
// angle's are added after them. Parameter gradients are partial sums over the segments
// (DataParallel sums them over dp × sp).
// prefill and step do not take a sequence split.
//
// Packed rows (set_sequence_ids; docs/algorithms.md §3.8): SISO and MIMO, split across sequence
// ranks too: the id of the previous segment's last token comes with the halo, and no angle, k, v or
// SSM state crosses a document start (docs/distributed.md §2.4).
//
// Not supported (kmamba::UserError at construction): is_outproj_norm together with is_mimo (the
// reference normalises each rank before the mimo_o contraction, which the core MIMO scan fuses),
// and config.bias (the reference's projections have none).
//
//   kmamba::Mamba3Mixer<Exec> mixer(config, "backbone.layers.0.mixer.");
//   mixer.declare_parameters(slab);                 // before slab.finalize()
//   mixer.initialize(exec, slab, seed);
//   mixer.forward(exec, slab, u, out, true);
//   mixer.backward(exec, slab, dout, du);           // du written, parameter gradients added
//   auto cache = mixer.make_cache(batch);
//   mixer.prefill(exec, slab, prompt, prompt_out, *cache);
//   mixer.step(exec, slab, token, token_out, *cache);
#ifndef KMAMBA_MODELS_MAMBA3MIXER_HPP
#define KMAMBA_MODELS_MAMBA3MIXER_HPP

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

namespace impl {
template <class MemorySpace, std::size_t N>
struct SegmentedInProj;  // MixerToolkit.hpp
}  // namespace impl

template <class MemorySpace>
struct Mamba3MimoArgs;
template <class MemorySpace>
struct Mamba3MimoGrads;

template <class ExecutionSpace>
class Mamba3Mixer : public Mixer<ExecutionSpace> {
 public:
  using execution_space = ExecutionSpace;
  using memory_space = typename ExecutionSpace::memory_space;
  using Slab = ParameterSlab<memory_space>;

  /// A Mamba-3 mixer for `config` (validated; config.mixer must be Mamba3) whose parameters are
  /// named `prefix` + the reference module's names.
  Mamba3Mixer(const ModelConfig& config, const std::string& prefix);
  /// The same, this rank's shard under `parallel` (see the file comment). Throws kmamba::UserError
  /// when the tensor-parallel size does not divide nheads and ngroups.
  Mamba3Mixer(const ModelConfig& config, const std::string& prefix, const ModelParallel& parallel);

  const std::string& prefix() const override { return prefix_; }

  /// in_proj.weight (2E + 2RGN + 3H + S, d_model), dt_bias (H), B_bias, C_bias (H, R, N),
  /// B_norm.weight, C_norm.weight (N), D (H), mimo_x, mimo_z, mimo_o (H, R, P) when is_mimo,
  /// norm.weight (E) when is_outproj_norm, out_proj.weight (d_model, E). Weight decay on the two
  /// projection weights only.
  void declare_parameters(Slab& slab) const override;

  /// The reference initialisation (docs/algorithms.md §3.1, §4.4): in_proj and out_proj uniform
  /// in ±1/sqrt(fan_in),
  /// out_proj then divided by sqrt(n_layer) when rescale_prenorm_residual; dt_bias =
  /// invsp(max(dt_init_floor, dt)) with dt log-uniform in [dt_min, dt_max]; B_bias = C_bias =
  /// config.bc_bias_init (the reference's 1); norm weights 1; D = 1; mimo_x = mimo_o = 1/R,
  /// mimo_z = 1. Each random parameter draws its own Philox stream keyed by `seed` and its full
  /// name. Non-blocking on `exec`.
  void initialize(const ExecutionSpace& exec, const Slab& slab, std::uint64_t seed) const override;

  /// See Mixer::forward. Throws kmamba::UserError naming the tensor and both shapes when u or out
  /// is not (batch, seqlen, d_model), or when `slab` lacks one of this mixer's parameters.
  void forward(const ExecutionSpace& exec, const Slab& slab,
               const ConstTensor3<float, memory_space>& u,  // (batch, seqlen, d_model)
               const Tensor3<float, memory_space>& out,     // (batch, seqlen, d_model)
               bool keep_for_backward) override;

  /// See Mixer::backward.
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

  /// Under tensor parallelism every parameter but B_norm.weight and C_norm.weight; the angle rows of
  /// in_proj.weight are a replicated run (see the file comment).
  std::vector<ShardedParameter> sharded_parameters() const override;

  /// The number of rotary angles S.
  int nangles() const { return nangles_; }

 protected:
  /// Packed rows (set_sequence_ids), SISO and MIMO.
  bool supports_sequence_ids() const override { return true; }

 private:
  class Cache;  // the MixerCache of this mixer, defined in Mamba3Mixer.cpp
  // The segments of in_proj's output, in the order of its rows (docs/algorithms.md §3.1).
  enum Segment {
    z_segment = 0,
    x_segment,
    B_segment,
    C_segment,
    dt_segment,
    A_segment,
    trap_segment,
    angle_segment,
    segment_count
  };

  using Matrix = Tensor2<float, memory_space>;
  using ConstMatrix = ConstTensor2<float, memory_space>;

  // What forward computes; matrices are (batch·seqlen, width) row-major.
  struct Activations {
    std::int64_t batch = 0, seqlen = 0;
    Matrix u;                                    // (rows, d_model), a copy of the input (training only)
    std::array<Matrix, segment_count> pre;       // (rows, width) per in_proj segment
    Matrix Bn, Cn;                               // (rows·R·G, N) after their RMSNorm
    Tensor1<float, memory_space> Brstd, Crstd;   // (rows·R·G)
    Tensor3<float, memory_space> dt, adt, trap;  // (batch, nheads, seqlen)
    Tensor4<float, memory_space> angles;         // (batch, seqlen, nheads, nangles)
    Matrix y;                                    // (rows, d_inner), the scan output
    Matrix ungated;  // (rows, d_inner), SISO with the gate in the scan, training: the scan output before the gate
    Matrix rstd;     // (rows, nheads), the output norm's rstd (is_outproj_norm)
    Matrix normed;   // (rows, d_inner), the output norm's output (is_outproj_norm)
    // Sequence parallelism: the scan states entering this rank's segment (zero on the first rank)
    // and the factor exp(Σ adt) by which the segment scales an SSM state entering it.
    Tensor2<float, memory_space> segment_decay;  // (batch, nheads)
    Tensor3<float, memory_space> angle_initial;  // (batch, nheads, nangles)
    Tensor4<float, memory_space> ssm_initial;    // (batch, nheads, headdim, d_state)
    Tensor4<float, memory_space> k_initial;      // (batch, nheads, rank, d_state)
    Tensor4<float, memory_space> v_initial;      // (batch, nheads, rank, headdim)
    // Packed rows split across sequence ranks (else empty): 1 where the previous segment's last
    // token is in this segment's first document (PackedSegments.hpp), and 1 where, besides, no
    // document starts inside the segment (the angle entering it reaches its end), else 0.
    Tensor2<float, memory_space> halo_mask;    // (batch, 1)
    Tensor2<float, memory_space> angle_carry;  // (batch, nheads)
  };

  std::vector<MixerParameter> parameter_specs() const;
  void check_parameters(const char* function, const Slab& slab) const;

  Activations make_activations(std::int64_t batch, std::int64_t seqlen, bool training) const;
  // The forward; with a cache, its states are the initial states and receive the final ones.
  void run_forward(const ExecutionSpace& exec, const Slab& slab,
                   const ConstMatrix& u,  // (batch·seqlen, d_model)
                   const Matrix& out,     // (batch·seqlen, d_model)
                   Activations& acts, Cache* cache) const;
  // The arguments of the MIMO scan over `acts` (of rank 1 for the SISO one; mamba3_siso_args).
  Mamba3MimoArgs<memory_space> scan_args(const Slab& slab, const Activations& acts) const;
  // The scan of run_forward, from and into the cache's states, or of this rank's segment (docs/distributed.md §2.3;
  // with packed rows, writes acts.halo_mask and acts.angle_carry).
  void forward_scan(const ExecutionSpace& exec, const Slab& slab, Activations& acts, Cache* cache) const;
  // The steps of backward over the kept activations, from the output back to the input. `dpre`
  // receives the gradients of the in_proj segments, (rows, width) each; `replicated_grads` those of
  // the parameters tensor ranks replicate (see backward).
  Matrix backward_output(const ExecutionSpace& exec, const Slab& slab,
                         const ConstMatrix& dout,                               // (rows, d_model)
                         const std::array<Matrix, segment_count>& dpre) const;  // returns (rows, d_inner)
  Mamba3MimoGrads<memory_space> backward_scan(const ExecutionSpace& exec, const Slab& slab,
                                              const Matrix& dy,  // (rows, d_inner)
                                              const std::array<Matrix, segment_count>& dpre) const;
  void backward_preprocess(const ExecutionSpace& exec, const Slab& slab, const Mamba3MimoGrads<memory_space>& grads,
                           const std::array<Matrix, segment_count>& dpre,
                           const Tensor1<float, memory_space>& replicated_grads) const;
  void backward_in_proj(const ExecutionSpace& exec, const Slab& slab, const std::array<Matrix, segment_count>& dpre,
                        const Tensor1<float, memory_space>& replicated_grads,
                        const Matrix& du) const;  // (rows, d_model)
  // d_model, nheads, headdim, ngroups, d_state, nangles, rank: what a cache must have been made for.
  std::array<int, 7> shape_key() const;
  Cache& cache_of(const char* function, MixerCache<ExecutionSpace>& cache, std::int64_t batch) const;
  // out (rows, width) = u · (rows [offset, offset + width) of in_proj.weight)ᵀ.
  void project(const ExecutionSpace& exec, const Slab& slab, const std::string& weight, int offset, int width,
               const ConstMatrix& u,                                                 // (rows, k)
               const Matrix& out,                                                    // (rows, width)
               const ConstTensor1<bf16, memory_space>& bf16_parameters = {}) const;  // (slab size): step_product
  // in_proj.weight in its segments, for impl::project_segments and impl::project_segments_backward.
  impl::SegmentedInProj<memory_space, segment_count> in_proj(const Slab& slab) const;
  // Sums the partial out_proj outputs (forward) or input gradients (backward) over the tensor ranks.
  void sum_over_tensor_ranks(const ExecutionSpace& exec, const Matrix& m) const;  // (rows, d_model)

  ModelConfig config_;
  std::string prefix_;
  ModelParallel parallel_;
  int d_model_, d_inner_, nheads_, headdim_, ngroups_, d_state_, nangles_, rank_, chunk_, in_proj_rows_;
  std::array<int, segment_count> segment_offsets_{}, segment_widths_{};

  Activations kept_;
  bool has_kept_ = false;
};

}  // namespace kmamba

#endif
