// What the Mamba-1, Mamba-2 and Mamba-3 mixers share: their parameter lists (declared in a slab,
// checked against it, read as flat views or row blocks of it), the Philox key of each parameter,
// the dt-bias initialisation and A = −exp(A_log), the initialisation of a tensor-parallel shard as
// its slices of the unsplit mixer's initialisation, and (Mamba-2, Mamba-3) the in_proj computed per
// segment of its rows, forward and backward.
#ifndef KMAMBA_MODELS_SRC_MIXERTOOLKIT_HPP
#define KMAMBA_MODELS_SRC_MIXERTOOLKIT_HPP

#include "Elementwise.hpp"

#include <kmamba/backends/Gemm.hpp>
#include <kmamba/core/Bf16.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/MatmulPrecision.hpp>
#include <kmamba/core/Random.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/models/Config.hpp>
#include <kmamba/models/Mixer.hpp>
#include <kmamba/models/ModelParallel.hpp>
#include <kmamba/models/ParameterSlab.hpp>
#include <kmamba/core/Math.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace kmamba {
namespace impl {

// ---------------------------------------------------------------------------------------------
// Parameter lists.

/// Adds prefix + name of every parameter to `slab` (before finalize), in list order.
template <class Mem>
void declare_mixer_parameters(ParameterSlab<Mem>& slab, const std::string& prefix,
                              const std::vector<MixerParameter>& parameters) {
  for (const MixerParameter& p : parameters) slab.add(prefix + p.name, p.shape, p.decay);
}

/// Throws kmamba::UserError, naming `function`, unless `slab` holds every parameter with its shape.
template <class Mem>
void check_mixer_parameters(const char* function, const ParameterSlab<Mem>& slab, const std::string& prefix,
                            const std::vector<MixerParameter>& parameters) {
  for (const MixerParameter& p : parameters) {
    const std::string name = prefix + p.name;
    KMAMBA_REQUIRE(slab.contains(name), function << ": the parameter slab has no '" << name
                                                 << "' (call declare_parameters before finalize)");
    const auto& shape = slab.entry(name).shape;
    if (shape == p.shape) continue;
    Shape actual, expected;
    actual.rank = static_cast<int>(shape.size());
    expected.rank = static_cast<int>(p.shape.size());
    for (std::size_t i = 0; i < shape.size() && i < Shape::max_rank; ++i) actual.dims[i] = shape[i];
    for (std::size_t i = 0; i < p.shape.size(); ++i) expected.dims[i] = p.shape[i];
    KMAMBA_USER_ERROR(function << ": parameter '" << name << "' has shape " << actual.to_string() << " but "
                               << expected.to_string() << " was expected");
  }
}

/// The whole of one slab entry as a flat vector of `storage` (the slab's params or grads).
template <class Mem>
Tensor1<float, Mem> flat(const Tensor1<float, Mem>& storage, const ParameterSlab<Mem>& slab, const std::string& name) {
  const auto& e = slab.entry(name);
  return Tensor1<float, Mem>(storage.data() + e.offset, e.size);
}

/// Rows [first, first + count) of a row-major (rows, cols) matrix starting at `data`.
template <class Mem>
Tensor2<float, Mem> rows_of(float* data, int first, int count, int cols) {
  return Tensor2<float, Mem>(data + static_cast<std::size_t>(first) * static_cast<std::size_t>(cols),
                             static_cast<std::size_t>(count), static_cast<std::size_t>(cols));
}

// ---------------------------------------------------------------------------------------------
// Argument checks of the Mamba-2 and Mamba-3 mixers' entry points; each throws kmamba::UserError
// naming `function`.

/// Checks that u is (batch, seqlen, d_model) and out has its shape; returns {batch, seqlen}.
template <class Mem>
std::array<std::int64_t, 2> check_sequence_shapes(const char* function,
                                                  const ConstTensor3<float, Mem>& u,  // (batch, seqlen, d_model)
                                                  const Tensor3<float, Mem>& out,     // (batch, seqlen, d_model)
                                                  int d_model) {
  check_shape(function, "u", u, Shape({Shape::any, Shape::any, d_model}), "(batch, seqlen, d_model)");
  const auto batch = static_cast<std::int64_t>(u.extent(0)), seqlen = static_cast<std::int64_t>(u.extent(1));
  check_shape(function, "out", out, Shape({batch, seqlen, d_model}), "(batch, seqlen, d_model) of u");
  return {batch, seqlen};
}

/// Checks that `a` and `b` (named `a_name`, `b_name`) are allocated and contiguous.
template <class A, class B>
void check_contiguous(const char* function, const char* a_name, const A& a, const char* b_name, const B& b) {
  check_allocated(function, a_name, a);
  check_allocated(function, b_name, b);
  KMAMBA_REQUIRE(a.span_is_contiguous() && b.span_is_contiguous(),
                 function << ": " << a_name << " and " << b_name << " must be contiguous");
}

/// The checks of backward: activations were `kept` by a forward of (batch, seqlen), and dout and du
/// have its shape, allocated and contiguous.
template <class Mem>
void check_backward_arguments(const char* function, bool kept, std::int64_t batch, std::int64_t seqlen, int d_model,
                              const ConstTensor3<float, Mem>& dout,  // (batch, seqlen, d_model)
                              const Tensor3<float, Mem>& du) {       // (batch, seqlen, d_model)
  KMAMBA_REQUIRE(kept, function << ": no activations were kept: call forward with keep_for_backward = true first");
  check_shape(function, "dout", dout, Shape({batch, seqlen, d_model}), "(batch, seqlen, d_model) of the last forward");
  check_shape(function, "du", du, Shape({batch, seqlen, d_model}), "(batch, seqlen, d_model) of the last forward");
  check_contiguous(function, "dout", dout, "du", du);
}

/// The checks of step: u is (batch, d_model) and out has its shape, both allocated; returns batch.
template <class Mem>
std::int64_t check_step_arguments(const char* function, const ConstTensor2<float, Mem>& u,  // (batch, d_model)
                                  const Tensor2<float, Mem>& out,                           // (batch, d_model)
                                  int d_model) {
  check_shape(function, "u", u, Shape({Shape::any, d_model}), "(batch, d_model)");
  const auto batch = static_cast<std::int64_t>(u.extent(0));
  check_shape(function, "out", out, Shape({batch, d_model}), "(batch, d_model) of u");
  check_allocated(function, "u", u);
  check_allocated(function, "out", out);
  return batch;
}

/// Recurrent inference (prefill, step) needs whole sequences: no sequence parallelism.
inline void check_whole_sequences(const char* function, const ModelParallel& parallel) {
  KMAMBA_REQUIRE(parallel.sequence_size() == 1, function
                                                    << ": a mixer split across " << parallel.sequence_size()
                                                    << " sequence-parallel ranks does not run recurrent inference");
}

/// A new cache of `mixer` for `batch` sequences (at least 1).
template <class Cache, class Exec, class Mixer>
std::unique_ptr<MixerCache<Exec>> new_mixer_cache(const char* function, const Mixer& mixer, int batch) {
  KMAMBA_REQUIRE(batch >= 1, function << ": batch must be at least 1, got " << batch);
  return std::unique_ptr<MixerCache<Exec>>(new Cache(mixer, batch));
}

/// `cache` as the mixer's own `Cache`: checks that a mixer whose shape key is `key` made it (else
/// the message says "the cache was not made by " and `made_by()`) for `batch` sequences.
template <class Cache, class Exec, class Key, class MadeBy>
Cache& mixer_cache(const char* function, MixerCache<Exec>& cache, const Key& key, std::int64_t batch,
                   const MadeBy& made_by) {
  Cache* const mine = dynamic_cast<Cache*>(&cache);
  KMAMBA_REQUIRE(mine != nullptr && mine->shape == key, function << ": the cache was not made by " << made_by());
  KMAMBA_REQUIRE(mine->batch() == batch,
                 function << ": the cache holds " << mine->batch() << " sequences but u has batch " << batch);
  return *mine;
}

/// A decode step's projection C = A·Wᵀ + beta·C for a weight W inside the slab's parameters (a
/// parameter or rows of one): under BFloat16 with a bf16 copy of the parameters (`bf16_parameters`,
/// MixerCache::bf16_parameters), W's rows in the copy (the same product at half the bytes);
/// otherwise W itself in `precision`.
template <class Exec>
void step_product(const Exec& exec, const ParameterSlab<typename Exec::memory_space>& slab,
                  const ConstTensor1<bf16, typename Exec::memory_space>& bf16_parameters,  // (slab size) or empty
                  const ConstTensor2<float, typename Exec::memory_space>& A,               // (batch, k)
                  const ConstTensor2<float, typename Exec::memory_space>& W,               // (n, k) in the slab
                  float beta, const Tensor2<float, typename Exec::memory_space>& C,        // (batch, n)
                  MatmulPrecision precision) {
  using Mem = typename Exec::memory_space;
  if (precision != MatmulPrecision::BFloat16 || !bf16_parameters.is_allocated()) {
    gemm<Exec, Mem>(exec, Transpose::No, Transpose::Yes, 1.0f, A, W, beta, C, precision);
    return;
  }
  const std::ptrdiff_t offset = W.data() - slab.params().data();
  KMAMBA_REQUIRE(bf16_parameters.extent(0) == slab.size() && offset >= 0 &&
                     static_cast<std::size_t>(offset) + W.span() <= slab.size() && W.span_is_contiguous(),
                 "kmamba::step_product: the weight is not a contiguous block of the slab's "
                     << slab.size() << " parameters, or the bf16 copy holds " << bf16_parameters.extent(0));
  const ConstTensor2<bf16, Mem> rounded(bf16_parameters.data() + offset, W.extent(0), W.extent(1));
  gemm<Exec, Mem>(exec, Transpose::No, Transpose::Yes, 1.0f, A, rounded, beta, C);
}

// ---------------------------------------------------------------------------------------------
// Initialisation.

/// splitmix64's finaliser of (seed xor the FNV-1a hash of `name` from `fnv_basis`) + `increment`.
inline std::uint64_t seed_keyed_by_name(std::uint64_t seed, const std::string& name, std::uint64_t fnv_basis,
                                        std::uint64_t increment) {
  std::uint64_t h = fnv_basis;
  for (const unsigned char c : name) {
    h ^= c;
    h *= 1099511628211ull;
  }
  std::uint64_t z = (seed ^ h) + increment;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

/// The Philox key of a Mamba-2 or Mamba-3 parameter from the model seed and the parameter's full
/// name. The keys fix each mixer kind's initialisation under a seed, so each kind keeps its own.
inline std::uint64_t parameter_seed(std::uint64_t seed, const std::string& name) {
  return seed_keyed_by_name(seed, name, 1469598103934665603ull, 0x9e3779b97f4a7c15ull);
}

/// The Philox key of a Mamba-1 parameter (the 64-bit FNV-1a offset basis, no increment).
inline std::uint64_t mamba1_parameter_seed(std::uint64_t seed, const std::string& name) {
  return seed_keyed_by_name(seed, name, 14695981039346656037ull, 0);
}

/// dt_bias(i) = invsp(max(dt_floor, exp(U·(log dt_max − log dt_min) + log dt_min))), U uniform in
/// [0, 1), with invsp(y) = y + log(−expm1(−y)) the inverse of softplus, evaluated in `Real`.
template <class Mem, class Real>
struct DtBiasInitFunctor {
  Tensor1<float, Mem> dt_bias;  // (channels or heads)
  std::uint64_t seed;
  Real log_dt_min, log_dt_max, dt_floor;
  KOKKOS_INLINE_FUNCTION void operator()(const int i) const {
    const Real u = static_cast<Real>(uniform_at(seed, static_cast<std::uint64_t>(i)));
    Real dt = kmamba::math::exp(u * (log_dt_max - log_dt_min) + log_dt_min);
    dt = dt < dt_floor ? dt_floor : dt;
    dt_bias(i) = static_cast<float>(dt + kmamba::math::log(-kmamba::math::expm1(-dt)));
  }
};

/// The reference dt-bias initialisation from config.dt_min, dt_max and dt_init_floor, drawn from
/// the Philox stream `key` and evaluated in `Real` (Mamba-1: double; Mamba-2, Mamba-3: float).
template <class Real, class Exec>
void initialize_dt_bias(const Exec& exec, const char* label, const ModelConfig& config,
                        const Tensor1<float, typename Exec::memory_space>& dt_bias,  // (channels or heads)
                        std::uint64_t key) {
  Kokkos::parallel_for(label, Kokkos::RangePolicy<Exec>(exec, 0, static_cast<int>(dt_bias.extent(0))),
                       DtBiasInitFunctor<typename Exec::memory_space, Real>{
                           dt_bias, key, static_cast<Real>(std::log(config.dt_min)),
                           static_cast<Real>(std::log(config.dt_max)), static_cast<Real>(config.dt_init_floor)});
}

/// Initialises the tensor-parallel shard `shard` in `slab`: `full`, the unsplit mixer under the
/// same prefix, initialises a slab of its own (`label`) with `seed`, and every parameter of the
/// shard receives its runs of that initialisation (ShardedParameter; a parameter the shard does
/// not split is copied whole). Blocking.
template <class Exec>
void initialize_shard(const Exec& exec, const Mixer<Exec>& full, const Mixer<Exec>& shard,
                      const ParameterSlab<typename Exec::memory_space>& slab, std::uint64_t seed,
                      const std::string& label) {
  using Mem = typename Exec::memory_space;
  ParameterSlab<Mem> unsplit;
  full.declare_parameters(unsplit);
  unsplit.finalize(label);
  full.initialize(exec, unsplit, seed);
  const std::vector<ShardedParameter> shards = shard.sharded_parameters();
  for (const auto& entry : unsplit.entries()) {
    const Tensor1<float, Mem> local = flat(slab.params(), slab, entry.name);
    const Tensor1<float, Mem> source = flat(unsplit.params(), unsplit, entry.name);
    const auto split =
        std::find_if(shards.begin(), shards.end(), [&](const ShardedParameter& p) { return p.name == entry.name; });
    if (split == shards.end()) {
      Kokkos::deep_copy(exec, local, source);
      continue;
    }
    for (const ShardedParameter::Run& run : split->runs) {
      const auto count = static_cast<std::size_t>(run.count);
      Kokkos::deep_copy(exec, Tensor1<float, Mem>(local.data() + run.local_offset, count),
                        Tensor1<float, Mem>(source.data() + run.full_offset, count));
    }
  }
  exec.fence();  // the unsplit slab is freed on return
}

// ---------------------------------------------------------------------------------------------
// Kernels.

/// A(i) = −exp(A_log(i)).
template <class Mem>
struct NegativeExpFunctor {
  ConstTensor1<float, Mem> A_log;  // (n)
  Tensor1<float, Mem> A;           // (n)
  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const { A(i) = -kmamba::math::exp(A_log(i)); }
};

/// A = −exp(A_log) over flat views.
template <class Exec>
void negative_exp(const Exec& exec, const char* label,
                  const ConstTensor1<float, typename Exec::memory_space>& A_log,  // (n)
                  const Tensor1<float, typename Exec::memory_space>& A) {         // (n)
  for_each_index(exec, label, static_cast<std::int64_t>(A.extent(0)),
                 NegativeExpFunctor<typename Exec::memory_space>{A_log, A});
}

/// out(r, c) = bias(offset + c): the starting value of a GEMM with beta = 1 that adds a bias.
template <class Mem>
struct BroadcastBiasFunctor {
  ConstTensor1<float, Mem> bias;  // (features), the whole bias vector
  Tensor2<float, Mem> out;        // (rows, width)
  int offset;
  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const {
    const std::int64_t width = static_cast<std::int64_t>(out.extent(1));
    const std::int64_t c = i % width;
    out(i / width, c) = bias(offset + c);
  }
};

/// out = bias(offset : offset + width) in every row, as kernel `label` (light weight: it may run in
/// a recorded step graph).
template <class Exec>
void broadcast_bias(const Exec& exec, const char* label,
                    const ConstTensor1<float, typename Exec::memory_space>& bias,          // (≥ offset + width)
                    int offset, const Tensor2<float, typename Exec::memory_space>& out) {  // (rows, width)
  Kokkos::parallel_for(label,
                       light_weight(Kokkos::RangePolicy<Exec, Kokkos::IndexType<std::int64_t>>(
                           exec, 0, static_cast<std::int64_t>(out.size()))),
                       BroadcastBiasFunctor<typename Exec::memory_space>{bias, out, offset});
}

// ---------------------------------------------------------------------------------------------
// The in_proj of the Mamba-2 and Mamba-3 mixers, one GEMM per segment of its rows (z, x, B, C,
// dt, ...) into the segment's own matrix, so that no split copies are needed.

/// in_proj.weight (and bias) as N segments: segment s is rows [offsets[s], offsets[s] + widths[s]).
template <class Mem, std::size_t N>
struct SegmentedInProj {
  const char* kind;  // the labels' prefix (e.g. "kmamba::mamba2")
  MatmulPrecision precision;
  ConstTensor2<float, Mem> weight;     // (in_proj_rows, d_model)
  ConstTensor1<float, Mem> bias;       // (in_proj_rows), or unallocated: no bias
  std::array<int, N> offsets, widths;  // per segment
};

/// The gradients that project_segments_backward adds to. Under tensor parallelism the rows of one
/// segment may be replicated on every rank (Mamba-3's angle rows): its weight gradient, this rank's
/// part of it, is written to `replicated` instead, for the caller to sum over the ranks.
template <class Mem>
struct SegmentedInProjGrads {
  Tensor2<float, Mem> weight;      // (in_proj_rows, d_model), accumulated
  Tensor1<float, Mem> bias;        // (in_proj_rows), accumulated; unallocated where in_proj has none
  int replicated_segment = -1;     // the segment written to `replicated`, or −1: none
  Tensor2<float, Mem> replicated;  // (widths[replicated_segment], d_model), overwritten
};

/// pre[s] = u · (in_proj's rows of segment s)ᵀ (+ their bias) for every segment; under BFloat16 u
/// and the weight are rounded once for all the products.
template <class Exec, std::size_t N>
void project_segments(const Exec& exec, const SegmentedInProj<typename Exec::memory_space, N>& in_proj,
                      const ConstTensor2<float, typename Exec::memory_space>& u,                // (rows, d_model)
                      const std::array<Tensor2<float, typename Exec::memory_space>, N>& pre) {  // (rows, widths[s])
  using Mem = typename Exec::memory_space;
  const GemmOperand<Mem> u_op = gemm_operand(exec, u, in_proj.precision);
  const GemmOperand<Mem> w_op = gemm_operand(exec, in_proj.weight, in_proj.precision);
  const std::string bias_label = std::string(in_proj.kind) + "::broadcast_bias";
  for (std::size_t s = 0; s < N; ++s) {
    float beta = 0.0f;
    if (in_proj.bias.is_allocated()) {
      broadcast_bias(exec, bias_label.c_str(), in_proj.bias, in_proj.offsets[s], pre[s]);
      beta = 1.0f;
    }
    gemm(exec, Transpose::No, Transpose::Yes, 1.0f, u_op, w_op.rows(in_proj.offsets[s], in_proj.widths[s]), beta,
         pre[s], in_proj.precision);
  }
}

/// The backward of project_segments for the gradients dpre of its outputs: per segment s, the
/// weight gradient of its rows += dpre[s]ᵀ · u (see SegmentedInProjGrads for a replicated
/// segment), the bias gradient += the column sums of dpre[s], and du = Σ_s dpre[s] · its rows.
/// Under BFloat16 u, the weight and each dpre[s] are rounded once for their two products, the
/// dpre[s] into one allocation (each release of device memory may wait for the device).
template <class Exec, std::size_t N>
void project_segments_backward(const Exec& exec, const SegmentedInProj<typename Exec::memory_space, N>& in_proj,
                               const ConstTensor2<float, typename Exec::memory_space>& u,  // (rows, d_model)
                               const std::array<Tensor2<float, typename Exec::memory_space>, N>& dpre,
                               const SegmentedInProjGrads<typename Exec::memory_space>& grads,
                               const Tensor2<float, typename Exec::memory_space>& du) {  // (rows, d_model)
  using Mem = typename Exec::memory_space;
  const MatmulPrecision precision = in_proj.precision;
  const std::string kind = in_proj.kind;
  const std::size_t rows = u.extent(0);
  const int d_model = static_cast<int>(in_proj.weight.extent(1));
  const GemmOperand<Mem> u_op = gemm_operand(exec, u, precision);
  const GemmOperand<Mem> w_op = gemm_operand(exec, in_proj.weight, precision);
  const Tensor1<bf16, Mem> dpre_rounded =
      precision == MatmulPrecision::BFloat16
          ? allocate_uninitialized<Tensor1<bf16, Mem>>(kind + "::d_in_proj_bf16", rows * in_proj.weight.extent(0))
          : Tensor1<bf16, Mem>();
  for (std::size_t s = 0; s < N; ++s) {
    const int offset = in_proj.offsets[s], width = in_proj.widths[s];
    const GemmOperand<Mem> d_op = gemm_operand(exec, ConstTensor2<float, Mem>(dpre[s]), precision, dpre_rounded,
                                               rows * static_cast<std::size_t>(offset));
    if (static_cast<int>(s) == grads.replicated_segment) {
      gemm(exec, Transpose::Yes, Transpose::No, 1.0f, d_op, u_op, 0.0f, grads.replicated, precision);
    } else {
      gemm(exec, Transpose::Yes, Transpose::No, 1.0f, d_op, u_op, 1.0f,
           rows_of<Mem>(grads.weight.data(), offset, width, d_model), precision);
    }
    gemm(exec, Transpose::No, Transpose::No, 1.0f, d_op, w_op.rows(offset, width), s == 0 ? 0.0f : 1.0f, du, precision);
    if (grads.bias.is_allocated()) add_column_sums(exec, (kind + "::bias_grad").c_str(), dpre[s], grads.bias, offset);
  }
}

}  // namespace impl
}  // namespace kmamba

#endif
