// The Mamba-2 mixer: forward, backward, recurrent inference and its tensor- and sequence-parallel
// split (Mamba2Mixer.hpp), on the mixer toolkit (MixerToolkit.hpp).
#include <kmamba/models/Mamba2Mixer.hpp>

#include "MixerToolkit.hpp"
#include "PackedSegments.hpp"
#include "SegmentStateScan.hpp"

#include <kmamba/backends/Gemm.hpp>
#include <kmamba/core/Conv1d.hpp>
#include <kmamba/core/ConvSsdStep.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/ForEachBackend.hpp>
#include <kmamba/core/Random.hpp>
#include <kmamba/core/RmsNorm.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Ssd.hpp>
#include <kmamba/core/SsdStateCorrection.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>
#include <kmamba/core/Math.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>

namespace kmamba {
namespace impl {

// grad_A_log(h) += dA(h) · A(h), since dA/dA_log = −exp(A_log) = A.
template <class MemorySpace>
struct Mamba2ALogGradFunctor {
  ConstTensor1<float, MemorySpace> dA;  // (nheads)
  ConstTensor1<float, MemorySpace> A;   // (nheads)
  Tensor1<float, MemorySpace> grad;     // (nheads)
  KOKKOS_INLINE_FUNCTION void operator()(const int h) const { grad(h) += dA(h) * A(h); }
};

// A_log(h) = log(U[lo, hi)).
template <class MemorySpace>
struct Mamba2ALogInitFunctor {
  Tensor1<float, MemorySpace> A_log;  // (nheads)
  std::uint64_t seed;
  float lo, hi;
  KOKKOS_INLINE_FUNCTION void operator()(const int h) const {
    A_log(h) = kmamba::math::log(lo + (hi - lo) * uniform_at(seed, static_cast<std::uint64_t>(h)));
  }
};

}  // namespace impl

namespace {

constexpr const char* segment_names[] = {"z", "x", "B", "C", "dt"};

using impl::flat;
using impl::rows_of;

// A (batch·seqlen, width) matrix seen as (batch, seqlen, width) or (batch, seqlen, heads, width / heads).
template <class Mem>
Tensor3<float, Mem> as_sequence(const Tensor2<float, Mem>& m, std::int64_t batch, std::int64_t seqlen) {
  return Tensor3<float, Mem>(m.data(), static_cast<std::size_t>(batch), static_cast<std::size_t>(seqlen), m.extent(1));
}
template <class Mem>
Tensor4<float, Mem> as_heads(const Tensor2<float, Mem>& m, std::int64_t batch, std::int64_t seqlen, int heads) {
  return Tensor4<float, Mem>(m.data(), static_cast<std::size_t>(batch), static_cast<std::size_t>(seqlen),
                             static_cast<std::size_t>(heads), m.extent(1) / static_cast<std::size_t>(heads));
}

template <class Exec, class Mem>
void accumulate(const Exec& exec, const Tensor1<float, Mem>& value, const Tensor1<float, Mem>& grad) {
  impl::accumulate(exec, "kmamba::mamba2::accumulate_grad", value, grad);
}

}  // namespace

template <class ExecutionSpace>
Mamba2Mixer<ExecutionSpace>::Mamba2Mixer(const ModelConfig& config, const std::string& prefix)
    : Mamba2Mixer(config, prefix, ModelParallel()) {}

template <class ExecutionSpace>
Mamba2Mixer<ExecutionSpace>::Mamba2Mixer(const ModelConfig& config, const std::string& prefix,
                                         const ModelParallel& parallel)
    : config_(config), prefix_(prefix), parallel_(parallel) {
  config_.validate();
  KMAMBA_REQUIRE(config_.mixer == MixerKind::Mamba2,
                 "kmamba::Mamba2Mixer: the config's mixer is " << mixer_name(config_.mixer) << ", not Mamba2");
  const int t = parallel_.tensor_size();
  KMAMBA_REQUIRE(config_.num_heads() % t == 0 && config_.ngroups % t == 0,
                 "kmamba::Mamba2Mixer: tensor_parallel_size " << t << " must divide nheads " << config_.num_heads()
                                                              << " and ngroups " << config_.ngroups
                                                              << " (each rank holds whole heads with their B/C group)");
  d_model_ = config_.d_model;
  d_inner_ = config_.d_inner() / t;
  nheads_ = config_.num_heads() / t;
  headdim_ = config_.headdim;
  ngroups_ = config_.ngroups / t;
  d_state_ = config_.d_state;
  d_conv_ = config_.d_conv;
  conv_dim_ = d_inner_ + 2 * ngroups_ * d_state_;
  segment_widths_ = {d_inner_, d_inner_, ngroups_ * d_state_, ngroups_ * d_state_, nheads_};
  int offset = 0;
  for (int s = 0; s < segment_count; ++s) {
    segment_offsets_[s] = offset;
    offset += segment_widths_[s];
  }
  in_proj_rows_ = offset;
}

template <class ExecutionSpace>
std::vector<MixerParameter> Mamba2Mixer<ExecutionSpace>::parameter_specs() const {
  std::vector<MixerParameter> specs;
  specs.push_back({"in_proj.weight", {in_proj_rows_, d_model_}, WeightDecay::Yes});
  if (config_.bias) specs.push_back({"in_proj.bias", {in_proj_rows_}, WeightDecay::No});
  specs.push_back({"conv1d.weight", {conv_dim_, 1, d_conv_}, WeightDecay::Yes});
  if (config_.conv_bias) specs.push_back({"conv1d.bias", {conv_dim_}, WeightDecay::No});
  specs.push_back({"dt_bias", {nheads_}, WeightDecay::No});
  specs.push_back({"A_log", {nheads_}, WeightDecay::No});
  specs.push_back({"D", {nheads_}, WeightDecay::No});
  specs.push_back({"norm.weight", {d_inner_}, WeightDecay::No});
  specs.push_back({"out_proj.weight", {d_model_, d_inner_}, WeightDecay::Yes});
  if (config_.bias) specs.push_back({"out_proj.bias", {d_model_}, WeightDecay::No});
  return specs;
}

template <class ExecutionSpace>
void Mamba2Mixer<ExecutionSpace>::declare_parameters(Slab& slab) const {
  impl::declare_mixer_parameters(slab, prefix_, parameter_specs());
}

template <class ExecutionSpace>
void Mamba2Mixer<ExecutionSpace>::check_parameters(const char* function, const Slab& slab) const {
  impl::check_mixer_parameters(function, slab, prefix_, parameter_specs());
}

template <class ExecutionSpace>
std::vector<ShardedParameter> Mamba2Mixer<ExecutionSpace>::sharded_parameters() const {
  const std::int64_t t = parallel_.tensor_size(), r = parallel_.tensor_rank();
  if (t == 1) return {};
  const std::int64_t d = d_model_, K = d_conv_, E = d_inner_ * t, GN = ngroups_ * d_state_ * t, H = nheads_ * t;
  const std::array<std::int64_t, segment_count> full_offsets = {0, E, 2 * E, 2 * E + GN, 2 * E + 2 * GN};
  std::vector<ShardedParameter> out;
  // The five (or, for the conv, the x, B, C) segments: rank r's block of each, `row` elements per channel.
  const auto segments = [&](const char* name, std::vector<std::int64_t> full_shape, int first, int last,
                            std::int64_t row, std::int64_t base) {
    ShardedParameter p{prefix_ + name, std::move(full_shape), {}};
    for (int s = first; s <= last; ++s) {
      const std::int64_t w = segment_widths_[s];
      p.runs.push_back({(full_offsets[s] - base + r * w) * row, (segment_offsets_[s] - (base / t)) * row, w * row});
    }
    out.push_back(p);
  };
  const auto slice = [&](const char* name, std::int64_t full, std::int64_t local) {
    out.push_back({prefix_ + name, {full}, {{r * local, 0, local}}});
  };
  segments("in_proj.weight", {2 * E + 2 * GN + H, d}, z_segment, dt_segment, d, 0);
  if (config_.bias) segments("in_proj.bias", {2 * E + 2 * GN + H}, z_segment, dt_segment, 1, 0);
  segments("conv1d.weight", {E + 2 * GN, 1, K}, x_segment, C_segment, K, E);
  if (config_.conv_bias) segments("conv1d.bias", {E + 2 * GN}, x_segment, C_segment, 1, E);
  slice("dt_bias", H, nheads_);
  slice("A_log", H, nheads_);
  slice("D", H, nheads_);
  slice("norm.weight", E, d_inner_);
  ShardedParameter out_proj{prefix_ + "out_proj.weight", {d, E}, {}};
  for (std::int64_t i = 0; i < d; ++i) out_proj.runs.push_back({i * E + r * d_inner_, i * d_inner_, d_inner_});
  out.push_back(out_proj);
  return out;
}

template <class ExecutionSpace>
void Mamba2Mixer<ExecutionSpace>::initialize(const ExecutionSpace& exec, const Slab& slab, std::uint64_t seed) const {
  check_parameters("kmamba::Mamba2Mixer::initialize", slab);
  if (parallel_.tensor_size() > 1) {
    impl::initialize_shard(exec, Mamba2Mixer(config_, prefix_), *this, slab, seed, "kmamba::mamba2::unsplit_init");
    return;
  }
  const auto param = [&](const char* name) { return flat(slab.params(), slab, prefix_ + name); };
  const auto uniform = [&](const char* name, double bound) {
    fill_uniform(exec, param(name), impl::parameter_seed(seed, prefix_ + name), static_cast<float>(-bound),
                 static_cast<float>(bound));
  };
  // torch's nn.Linear / nn.Conv1d default: kaiming_uniform(a = √5) gives the bound 1/sqrt(fan_in).
  uniform("in_proj.weight", 1.0 / std::sqrt(static_cast<double>(d_model_)));
  uniform("conv1d.weight", 1.0 / std::sqrt(static_cast<double>(d_conv_)));
  if (config_.conv_bias) uniform("conv1d.bias", 1.0 / std::sqrt(static_cast<double>(d_conv_)));
  double out_bound = 1.0 / std::sqrt(static_cast<double>(d_inner_));
  if (config_.rescale_prenorm_residual) out_bound /= std::sqrt(static_cast<double>(config_.n_layer));
  uniform("out_proj.weight", out_bound);
  if (config_.bias) {
    Kokkos::deep_copy(exec, param("in_proj.bias"), 0.0f);
    Kokkos::deep_copy(exec, param("out_proj.bias"), 0.0f);
  }
  Kokkos::deep_copy(exec, param("D"), 1.0f);
  Kokkos::deep_copy(exec, param("norm.weight"), 1.0f);
  impl::initialize_dt_bias<float>(exec, "kmamba::mamba2::init_dt_bias", config_, param("dt_bias"),
                                  impl::parameter_seed(seed, prefix_ + "dt_bias"));
  // A_init_range = (1, 16).
  Kokkos::parallel_for("kmamba::mamba2::init_A_log", Kokkos::RangePolicy<ExecutionSpace>(exec, 0, nheads_),
                       impl::Mamba2ALogInitFunctor<memory_space>{
                           param("A_log"), impl::parameter_seed(seed, prefix_ + "A_log"), 1.0f, 16.0f});
}

template <class ExecutionSpace>
typename Mamba2Mixer<ExecutionSpace>::Activations Mamba2Mixer<ExecutionSpace>::make_activations(std::int64_t batch,
                                                                                                std::int64_t seqlen,
                                                                                                bool training) const {
  const std::int64_t rows = batch * seqlen;
  Activations a;
  a.batch = batch;
  a.seqlen = seqlen;
  if (training) a.u = allocate_uninitialized<Matrix>("kmamba::mamba2::u", rows, d_model_);
  for (int s = 0; s < segment_count; ++s) {
    a.pre[s] = allocate_uninitialized<Matrix>(std::string("kmamba::mamba2::in_proj_") + segment_names[s], rows,
                                              segment_widths_[s]);
    if (s >= x_segment && s <= C_segment) {
      a.act[s] = allocate_uninitialized<Matrix>(std::string("kmamba::mamba2::conv_") + segment_names[s], rows,
                                                segment_widths_[s]);
    }
  }
  a.A = allocate_uninitialized<Tensor1<float, memory_space>>("kmamba::mamba2::A", nheads_);
  a.y = allocate_uninitialized<Matrix>("kmamba::mamba2::ssd_out", rows, d_inner_);
  a.rstd = allocate_uninitialized<Matrix>("kmamba::mamba2::norm_rstd", rows, ngroups_);
  a.normed = allocate_uninitialized<Matrix>("kmamba::mamba2::norm_out", rows, d_inner_);
  if (parallel_.sequence_size() > 1) {
    // Zero on the first rank, which receives nothing.
    for (int s = x_segment; s <= C_segment; ++s) {
      a.conv_initial[s] = allocate<Tensor3<float, memory_space>>(
          std::string("kmamba::mamba2::conv_initial_") + segment_names[s], batch, segment_widths_[s], d_conv_ - 1);
    }
    a.ssm_initial = allocate_uninitialized<Tensor4<float, memory_space>>("kmamba::mamba2::ssm_initial", batch, nheads_,
                                                                         headdim_, d_state_);
    a.segment_decay =
        allocate_uninitialized<Tensor2<float, memory_space>>("kmamba::mamba2::segment_decay", batch, nheads_);
  }
  return a;
}

namespace {

// The SSD inputs of one forward: x, B, C after the conv, dt from in_proj, A = −exp(A_log).
template <class Mem>
SsdArgs<Mem> make_ssd_args(const ModelConfig& config, const ParameterSlab<Mem>& slab, const std::string& prefix,
                           int nheads, int ngroups, std::int64_t batch, std::int64_t seqlen,
                           const Tensor2<float, Mem>& x,    // (batch·seqlen, d_inner)
                           const Tensor2<float, Mem>& dt,   // (batch·seqlen, nheads)
                           const Tensor1<float, Mem>& A,    // (nheads)
                           const Tensor2<float, Mem>& B,    // (batch·seqlen, ngroups·d_state)
                           const Tensor2<float, Mem>& C) {  // (batch·seqlen, ngroups·d_state)
  SsdArgs<Mem> args;
  args.x = as_heads(x, batch, seqlen, nheads);
  args.dt = as_sequence(dt, batch, seqlen);
  args.A = A;
  args.B = as_heads(B, batch, seqlen, ngroups);
  args.C = as_heads(C, batch, seqlen, ngroups);
  args.D = slab.template param<1>(prefix + "D");
  args.dt_bias = slab.template param<1>(prefix + "dt_bias");
  args.dt_softplus = true;
  args.dt_min = static_cast<float>(config.dt_limit_min);
  args.dt_max = static_cast<float>(config.dt_limit_max);
  args.chunk_size = std::min(config.chunk_size, ssd_preferred_chunk_size);
  return args;
}

}  // namespace

template <class ExecutionSpace>
class Mamba2Mixer<ExecutionSpace>::Cache final : public MixerCache<ExecutionSpace> {
 public:
  using Mem = typename ExecutionSpace::memory_space;

  Cache(const Mamba2Mixer& mixer, int batch) : MixerCache<ExecutionSpace>(batch), shape(mixer.shape_key()) {
    const int W = mixer.d_conv_;
    for (int s = x_segment; s <= C_segment; ++s) {
      conv[s] = allocate<Tensor3<float, Mem>>(std::string("kmamba::decode::mamba2::conv_state_") + segment_names[s],
                                              batch, mixer.segment_widths_[s], W - 1);
    }
    projected = allocate_uninitialized<Matrix>("kmamba::decode::mamba2::in_proj", batch, mixer.in_proj_rows_);
    ssm = allocate<Tensor4<float, Mem>>("kmamba::decode::mamba2::ssm_state", batch, mixer.nheads_, mixer.headdim_,
                                        mixer.d_state_);
    group_arrivals = allocate<Tensor2<int, Mem>>("kmamba::decode::mamba2::group_arrivals", batch, mixer.ngroups_);
    y = allocate_uninitialized<Matrix>("kmamba::decode::mamba2::ssd_out", batch, mixer.d_inner_);
    normed = allocate_uninitialized<Matrix>("kmamba::decode::mamba2::norm_out", batch, mixer.d_inner_);
  }

  void reset(const ExecutionSpace& exec) override {
    for (int s = x_segment; s <= C_segment; ++s) Kokkos::deep_copy(exec, conv[s], 0.0f);
    Kokkos::deep_copy(exec, ssm, 0.0f);
  }

  std::array<int, 7> shape;                             // the dimensions of the mixer that made it
  std::array<Tensor3<float, Mem>, segment_count> conv;  // x, B, C: (batch, width, d_conv − 1)
  Tensor4<float, Mem> ssm;                              // (batch, nheads, headdim, d_state)
  Tensor2<int, Mem> group_arrivals;                     // (batch, ngroups): conv_ssd_step's tickets, zero between steps
  Matrix projected;                                     // (batch, in_proj_rows): the whole in_proj output
  Matrix y;                                             // (batch, d_inner)
  Matrix normed;                                        // (batch, d_inner)
};

template <class ExecutionSpace>
void Mamba2Mixer<ExecutionSpace>::project(const ExecutionSpace& exec, const Slab& slab, const std::string& weight,
                                          const std::string& bias, int offset, int width, const ConstMatrix& u,
                                          const Matrix& out,
                                          const ConstTensor1<bf16, memory_space>& bf16_parameters) const {
  using Mem = memory_space;
  const Tensor2<float, Mem> w = slab.template param<2>(weight);  // (features, k)
  float beta = 0.0f;
  if (config_.bias && !bias.empty()) {
    impl::broadcast_bias(exec, "kmamba::mamba2::broadcast_bias", flat(slab.params(), slab, bias), offset, out);
    beta = 1.0f;
  }
  impl::step_product(exec, slab, bf16_parameters, u,
                     rows_of<Mem>(w.data(), offset, width, static_cast<int>(w.extent(1))), beta, out,
                     this->matmul_precision());
}

template <class ExecutionSpace>
impl::SegmentedInProj<typename ExecutionSpace::memory_space, Mamba2Mixer<ExecutionSpace>::segment_count>
Mamba2Mixer<ExecutionSpace>::in_proj(const Slab& slab) const {
  return {"kmamba::mamba2",
          this->matmul_precision(),
          slab.template param<2>(prefix_ + "in_proj.weight"),
          config_.bias ? flat(slab.params(), slab, prefix_ + "in_proj.bias") : Tensor1<float, memory_space>(),
          segment_offsets_,
          segment_widths_};
}

template <class ExecutionSpace>
void Mamba2Mixer<ExecutionSpace>::run_forward(const ExecutionSpace& exec, const Slab& slab, const ConstMatrix& u,
                                              const Matrix& out, Activations& a, Cache* cache) const {
  using Mem = memory_space;
  const std::int64_t batch = a.batch, seqlen = a.seqlen;
  const std::string& p = prefix_;
  const bool split_sequence = parallel_.sequence_size() > 1;
  const Communicator* const sequence = parallel_.sequence;
  const int previous = parallel_.previous_segment_rank(), next = parallel_.next_segment_rank();
  const ConstTensor2<std::int64_t, Mem>& seq_idx = this->sequence_ids("kmamba::Mamba2Mixer::forward", batch, seqlen);

  impl::negative_exp(exec, "kmamba::mamba2::A", slab.template param<1>(p + "A_log"), a.A);

  impl::project_segments(exec, in_proj(slab), u, a.pre);
  a.halo_mask = split_sequence && seq_idx.is_allocated()
                    ? impl::packed_halo_mask(exec, *sequence, previous, next, seq_idx, std::max(1, d_conv_ - 1))
                    : Tensor2<float, Mem>();

  // Causal depthwise conv + SiLU on x, B and C; their channels are rows [offset − d_inner, ...) of the conv.
  float* const conv_w = slab.template param<3>(p + "conv1d.weight").data();  // (conv_dim, 1, d_conv)
  float* const conv_b = config_.conv_bias ? slab.template param<1>(p + "conv1d.bias").data() : nullptr;
  for (int s = x_segment; s <= C_segment; ++s) {
    const int channel = segment_offsets_[s] - d_inner_;
    const int width = segment_widths_[s];
    const ConstTensor1<float, Mem> bias =
        conv_b != nullptr ? ConstTensor1<float, Mem>(conv_b + channel, static_cast<std::size_t>(width))
                          : ConstTensor1<float, Mem>();
    Tensor3<float, Mem> initial = cache != nullptr ? cache->conv[s] : Tensor3<float, Mem>();
    Tensor3<float, Mem> final_state = initial;
    if (split_sequence) {  // the halo: the previous rank's last d_conv − 1 inputs
      initial = a.conv_initial[s];
      if (previous != no_peer) sequence->recv(exec, initial, previous);
      if (a.halo_mask.is_allocated()) impl::mask_packed_halo(exec, ConstTensor2<float, Mem>(a.halo_mask), initial);
      final_state = next != no_peer
                        ? allocate_uninitialized<Tensor3<float, Mem>>(
                              std::string("kmamba::mamba2::conv_final_") + segment_names[s], batch, width, d_conv_ - 1)
                        : Tensor3<float, Mem>();
    }
    causal_conv1d(exec, as_sequence(a.pre[s], batch, seqlen), rows_of<Mem>(conv_w, channel, width, d_conv_), bias,
                  initial, as_sequence(a.act[s], batch, seqlen), final_state, Conv1dActivation::silu, seq_idx);
    if (split_sequence && next != no_peer) sequence->send(exec, final_state, next);
  }

  SsdArgs<Mem> args = make_ssd_args(config_, slab, p, nheads_, ngroups_, batch, seqlen, a.act[x_segment],
                                    a.pre[dt_segment], a.A, a.act[B_segment], a.act[C_segment]);
  args.matmul_precision = this->ssd_matmul_precision();
  args.seq_idx = seq_idx;
  const Tensor4<float, Mem> y = as_heads(a.y, batch, seqlen, nheads_);
  if (split_sequence) {
    scan_segment(exec, args, y, a);
  } else {
    args.initial_states = cache != nullptr ? cache->ssm : Tensor4<float, Mem>();
    ssd_forward(exec, args, y, cache != nullptr ? cache->ssm : Tensor4<float, Mem>());
  }

  gated_rms_norm(exec, a.y, a.pre[z_segment], slab.template param<1>(p + "norm.weight"),
                 static_cast<float>(config_.norm_epsilon), d_inner_ / ngroups_, config_.norm_before_gate, a.normed,
                 a.rstd);

  // Row parallel: each tensor rank adds its channels' part; the bias is added once.
  project(exec, slab, p + "out_proj.weight", parallel_.tensor_rank() == 0 ? p + "out_proj.bias" : std::string(), 0,
          d_model_, a.normed, out);
  sum_over_tensor_ranks(exec, out);
}

template <class ExecutionSpace>
void Mamba2Mixer<ExecutionSpace>::scan_segment(
    const ExecutionSpace& exec, const SsdArgs<memory_space>& args,
    const Tensor4<float, memory_space>& y,  // (batch, seqlen, nheads, headdim)
    Activations& a) const {
  using Mem = memory_space;
  // Every rank scans its segment from a zero state at once; the (decay, final state) pairs of the
  // segments then give each rank the state entering its own (docs/distributed.md §2.1), whose
  // contribution C_t·exp(cumsum_t)·h_in is added to y before the gated norm (the SSD here has no
  // gate, and D·x does not depend on the state).
  const auto final_states =
      allocate_uninitialized<Tensor4<float, Mem>>("kmamba::mamba2::ssm_final", a.batch, nheads_, headdim_, d_state_);
  ssd_forward(exec, args, y, final_states);
  ssd_segment_decay(exec, args, a.segment_decay);
  // Packed rows: a segment that starts a document passes no state on and takes none in.
  const ConstTensor2<float, Mem> halo_mask(a.halo_mask);
  if (halo_mask.is_allocated()) impl::mask_packed_rows(exec, halo_mask, a.segment_decay);
  const std::size_t rows = static_cast<std::size_t>(a.batch * nheads_), width = a.ssm_initial.size() / rows;
  impl::segment_state_scan(exec, *parallel_.sequence, impl::SegmentScanDirection::Forward,
                           ConstTensor2<float, Mem>(a.segment_decay.data(), rows, 1),
                           ConstTensor2<float, Mem>(final_states.data(), rows, width),
                           Tensor2<float, Mem>(a.ssm_initial.data(), rows, width));
  if (halo_mask.is_allocated()) impl::mask_packed_rows(exec, halo_mask, a.ssm_initial);
  ssd_state_correction_forward(exec, args, a.ssm_initial, y, Tensor4<float, Mem>());
}

template <class ExecutionSpace>
void Mamba2Mixer<ExecutionSpace>::sum_over_tensor_ranks(const ExecutionSpace& exec, const Matrix& m) const {
  if (parallel_.tensor_size() > 1) parallel_.tensor->all_reduce(exec, m);
}

template <class ExecutionSpace>
void Mamba2Mixer<ExecutionSpace>::forward(const ExecutionSpace& exec, const Slab& slab,
                                          const ConstTensor3<float, memory_space>& u,  // (batch, seqlen, d_model)
                                          const Tensor3<float, memory_space>& out,     // (batch, seqlen, d_model)
                                          bool keep_for_backward) {
  constexpr const char* function = "kmamba::Mamba2Mixer::forward";
  const auto [batch, seqlen] = impl::check_sequence_shapes(function, u, out, d_model_);
  this->sequence_ids(function, batch, seqlen);
  impl::check_contiguous(function, "u", u, "out", out);
  check_parameters(function, slab);
  const std::int64_t rows = batch * seqlen;
  const ConstMatrix u2(u.data(), static_cast<std::size_t>(rows), static_cast<std::size_t>(d_model_));
  const Matrix out2(out.data(), static_cast<std::size_t>(rows), static_cast<std::size_t>(d_model_));
  if (keep_for_backward) {
    has_kept_ = false;
    if (!kept_.A.is_allocated() || kept_.batch != batch || kept_.seqlen != seqlen) {
      kept_ = make_activations(batch, seqlen, true);
    }
    Kokkos::deep_copy(exec, kept_.u, u2);
    run_forward(exec, slab, u2, out2, kept_, nullptr);
    has_kept_ = true;
  } else {
    release_activations();
    Activations local = make_activations(batch, seqlen, false);
    run_forward(exec, slab, u2, out2, local, nullptr);
  }
}

template <class ExecutionSpace>
void Mamba2Mixer<ExecutionSpace>::backward(const ExecutionSpace& exec, const Slab& slab,
                                           const ConstTensor3<float, memory_space>& dout,  // (batch, seqlen, d_model)
                                           const Tensor3<float, memory_space>& du) {       // (batch, seqlen, d_model)
  constexpr const char* function = "kmamba::Mamba2Mixer::backward";
  const std::int64_t batch = kept_.batch, seqlen = kept_.seqlen, rows = batch * seqlen;
  impl::check_backward_arguments(function, has_kept_, batch, seqlen, d_model_, dout, du);
  check_parameters(function, slab);
  const ConstMatrix dout2(dout.data(), static_cast<std::size_t>(rows), static_cast<std::size_t>(d_model_));
  const Matrix du2(du.data(), static_cast<std::size_t>(rows), static_cast<std::size_t>(d_model_));
  std::array<Matrix, segment_count> dpre;  // gradients of the in_proj segments
  std::array<Matrix, segment_count> dact;  // gradients of x, B, C after the conv
  for (int s = 0; s < segment_count; ++s) {
    dpre[s] = allocate_uninitialized<Matrix>(std::string("kmamba::mamba2::d_in_proj_") + segment_names[s], rows,
                                             segment_widths_[s]);
    if (s >= x_segment && s <= C_segment) {
      dact[s] = allocate_uninitialized<Matrix>(std::string("kmamba::mamba2::d_conv_") + segment_names[s], rows,
                                               segment_widths_[s]);
    }
  }
  const Matrix dy = backward_output(exec, slab, dout2, dpre);
  backward_ssd(exec, slab, dy, dpre, dact);
  backward_conv(exec, slab, dact, dpre);
  backward_in_proj(exec, slab, dpre, du2);
}

template <class ExecutionSpace>
typename Mamba2Mixer<ExecutionSpace>::Matrix Mamba2Mixer<ExecutionSpace>::backward_output(
    const ExecutionSpace& exec, const Slab& slab, const ConstMatrix& dout,
    const std::array<Matrix, segment_count>& dpre) const {
  using Mem = memory_space;
  const Activations& a = kept_;
  const std::string& p = prefix_;
  const std::int64_t rows = a.batch * a.seqlen;
  // out = normed · out_projᵀ (+ bias).
  const Matrix dnormed = allocate_uninitialized<Matrix>("kmamba::mamba2::d_norm_out", rows, d_inner_);
  gemm<ExecutionSpace, Mem>(exec, Transpose::No, Transpose::No, 1.0f, dout,
                            slab.template param<2>(p + "out_proj.weight"), 0.0f, dnormed, this->matmul_precision());
  gemm<ExecutionSpace, Mem>(exec, Transpose::Yes, Transpose::No, 1.0f, dout, a.normed, 1.0f,
                            slab.template grad<2>(p + "out_proj.weight"), this->matmul_precision());
  if (config_.bias)
    impl::add_column_sums(exec, "kmamba::mamba2::bias_grad", dout, flat(slab.grads(), slab, p + "out_proj.bias"), 0);
  // Gated RMSNorm: gradients of the SSD output y and of the z segment.
  const Matrix dy = allocate_uninitialized<Matrix>("kmamba::mamba2::d_ssd_out", rows, d_inner_);
  const auto dnorm_weight = allocate_uninitialized<Tensor1<float, Mem>>("kmamba::mamba2::d_norm_weight", d_inner_);
  gated_rms_norm_backward(exec, dnormed, a.y, a.pre[z_segment], slab.template param<1>(p + "norm.weight"), a.rstd,
                          d_inner_ / ngroups_, config_.norm_before_gate, dy, dpre[z_segment], dnorm_weight);
  accumulate(exec, dnorm_weight, flat(slab.grads(), slab, p + "norm.weight"));
  return dy;
}

template <class ExecutionSpace>
void Mamba2Mixer<ExecutionSpace>::backward_ssd(const ExecutionSpace& exec, const Slab& slab, const Matrix& dy,
                                               const std::array<Matrix, segment_count>& dpre,
                                               const std::array<Matrix, segment_count>& dact) const {
  using Mem = memory_space;
  using Vector = Tensor1<float, Mem>;
  const Activations& a = kept_;
  const std::string& p = prefix_;
  const auto grad = [&](const char* name) { return flat(slab.grads(), slab, p + name); };
  const std::int64_t batch = a.batch, seqlen = a.seqlen;
  const bool split_sequence = parallel_.sequence_size() > 1;
  // Gradients of x, B, C (after the conv), of the dt segment, A, D and dt_bias.
  const Vector dA = allocate_uninitialized<Vector>("kmamba::mamba2::d_A", nheads_);
  const Vector dD = allocate_uninitialized<Vector>("kmamba::mamba2::d_D", nheads_);
  const Vector ddt_bias = allocate_uninitialized<Vector>("kmamba::mamba2::d_dt_bias", nheads_);
  SsdGrads<Mem> g;
  g.dx = as_heads(dact[x_segment], batch, seqlen, nheads_);
  g.ddt = as_sequence(dpre[dt_segment], batch, seqlen);
  g.dA = dA;
  g.dB = as_heads(dact[B_segment], batch, seqlen, ngroups_);
  g.dC = as_heads(dact[C_segment], batch, seqlen, ngroups_);
  g.dD = dD;
  g.ddt_bias = ddt_bias;
  SsdArgs<Mem> args = make_ssd_args(config_, slab, p, nheads_, ngroups_, batch, seqlen, a.act[x_segment],
                                    a.pre[dt_segment], a.A, a.act[B_segment], a.act[C_segment]);
  args.matmul_precision = this->ssd_matmul_precision();
  args.seq_idx = this->sequence_ids("kmamba::Mamba2Mixer::backward", batch, seqlen);
  const Tensor4<float, Mem> dy_heads = as_heads(dy, batch, seqlen, nheads_);
  // Sequence parallel: the gradient of this segment's final state is the one of the state entering
  // the next segment, composed over the later segments from what each segment's outputs give its
  // incoming state (docs/distributed.md §2.1); the segment's gradients are then those of the SSD
  // from its incoming state.
  Tensor4<float, Mem> dfinal_states;
  if (split_sequence) {
    const auto from_outputs = allocate_uninitialized<Tensor4<float, Mem>>("kmamba::mamba2::d_ssm_incoming", batch,
                                                                          nheads_, headdim_, d_state_);
    ssd_state_correction_backward(exec, args, dy_heads, from_outputs);
    if (a.halo_mask.is_allocated()) impl::mask_packed_rows(exec, ConstTensor2<float, Mem>(a.halo_mask), from_outputs);
    dfinal_states =
        allocate_uninitialized<Tensor4<float, Mem>>("kmamba::mamba2::d_ssm_final", batch, nheads_, headdim_, d_state_);
    const std::size_t rows = static_cast<std::size_t>(batch * nheads_), width = from_outputs.size() / rows;
    impl::segment_state_scan(exec, *parallel_.sequence, impl::SegmentScanDirection::Backward,
                             ConstTensor2<float, Mem>(a.segment_decay.data(), rows, 1),
                             ConstTensor2<float, Mem>(from_outputs.data(), rows, width),
                             Tensor2<float, Mem>(dfinal_states.data(), rows, width));
    args.initial_states = a.ssm_initial;
  }
  ssd_backward(exec, args, dy_heads, dfinal_states, g);
  accumulate(exec, dD, grad("D"));
  accumulate(exec, ddt_bias, grad("dt_bias"));
  Kokkos::parallel_for("kmamba::mamba2::A_log_grad", Kokkos::RangePolicy<ExecutionSpace>(exec, 0, nheads_),
                       impl::Mamba2ALogGradFunctor<Mem>{dA, a.A, grad("A_log")});
}

template <class ExecutionSpace>
void Mamba2Mixer<ExecutionSpace>::backward_conv(const ExecutionSpace& exec, const Slab& slab,
                                                const std::array<Matrix, segment_count>& dact,
                                                const std::array<Matrix, segment_count>& dpre) const {
  using Mem = memory_space;
  using Vector = Tensor1<float, Mem>;
  const std::int64_t batch = kept_.batch, seqlen = kept_.seqlen;
  // Sequence parallel: each segment's halo gradient comes back from the next rank and goes to the
  // previous one (no_peer without the split).
  const int previous = parallel_.previous_segment_rank(), next = parallel_.next_segment_rank();
  // Conv + SiLU backward per segment into the in_proj segment gradients.
  float* const conv_w = slab.template param<3>(prefix_ + "conv1d.weight").data();  // (conv_dim, 1, d_conv)
  float* const conv_b = config_.conv_bias ? slab.template param<1>(prefix_ + "conv1d.bias").data() : nullptr;
  const Matrix dconv_weight = allocate_uninitialized<Matrix>("kmamba::mamba2::d_conv_weight", conv_dim_, d_conv_);
  const Vector dconv_bias =
      config_.conv_bias ? allocate_uninitialized<Vector>("kmamba::mamba2::d_conv_bias", conv_dim_) : Vector();
  for (int s = x_segment; s <= C_segment; ++s) {
    const int channel = segment_offsets_[s] - d_inner_;
    const std::size_t width = static_cast<std::size_t>(segment_widths_[s]);
    const ConstTensor1<float, Mem> bias =
        conv_b != nullptr ? ConstTensor1<float, Mem>(conv_b + channel, width) : ConstTensor1<float, Mem>();
    const Vector dbias = conv_b != nullptr ? Vector(dconv_bias.data() + channel, width) : Vector();
    Tensor3<float, Mem> dfinal_state, dinitial_state;
    if (next != no_peer) {
      dfinal_state = allocate_uninitialized<Tensor3<float, Mem>>(
          std::string("kmamba::mamba2::d_conv_final_") + segment_names[s], batch, width, d_conv_ - 1);
      parallel_.sequence->recv(exec, dfinal_state, next);
    }
    if (previous != no_peer) {
      dinitial_state = allocate_uninitialized<Tensor3<float, Mem>>(
          std::string("kmamba::mamba2::d_conv_initial_") + segment_names[s], batch, width, d_conv_ - 1);
    }
    causal_conv1d_backward(exec, as_sequence(kept_.pre[s], batch, seqlen),
                           rows_of<Mem>(conv_w, channel, segment_widths_[s], d_conv_), bias, kept_.conv_initial[s],
                           as_sequence(dact[s], batch, seqlen), dfinal_state, as_sequence(dpre[s], batch, seqlen),
                           rows_of<Mem>(dconv_weight.data(), channel, segment_widths_[s], d_conv_), dbias,
                           dinitial_state, Conv1dActivation::silu,
                           this->sequence_ids("kmamba::Mamba2Mixer::backward", batch, seqlen));
    if (previous != no_peer) {
      if (kept_.halo_mask.is_allocated()) {
        impl::mask_packed_halo(exec, ConstTensor2<float, Mem>(kept_.halo_mask), dinitial_state);
      }
      parallel_.sequence->send(exec, dinitial_state, previous);
    }
  }
  accumulate(exec, Vector(dconv_weight.data(), dconv_weight.size()),
             flat(slab.grads(), slab, prefix_ + "conv1d.weight"));
  if (config_.conv_bias) accumulate(exec, dconv_bias, flat(slab.grads(), slab, prefix_ + "conv1d.bias"));
}

template <class ExecutionSpace>
void Mamba2Mixer<ExecutionSpace>::backward_in_proj(const ExecutionSpace& exec, const Slab& slab,
                                                   const std::array<Matrix, segment_count>& dpre,
                                                   const Matrix& du) const {
  const std::string& p = prefix_;
  impl::project_segments_backward(
      exec, in_proj(slab), ConstMatrix(kept_.u), dpre,
      {slab.template grad<2>(p + "in_proj.weight"),
       config_.bias ? flat(slab.grads(), slab, p + "in_proj.bias") : Tensor1<float, memory_space>(), -1, Matrix()},
      du);
  sum_over_tensor_ranks(exec, du);
}

template <class ExecutionSpace>
void Mamba2Mixer<ExecutionSpace>::release_activations() {
  kept_ = Activations();
  has_kept_ = false;
}

template <class ExecutionSpace>
std::array<int, 7> Mamba2Mixer<ExecutionSpace>::shape_key() const {
  return {d_model_, d_inner_, nheads_, headdim_, ngroups_, d_state_, d_conv_};
}

template <class ExecutionSpace>
std::unique_ptr<MixerCache<ExecutionSpace>> Mamba2Mixer<ExecutionSpace>::make_cache(int batch) const {
  return impl::new_mixer_cache<Cache, ExecutionSpace>("kmamba::Mamba2Mixer::make_cache", *this, batch);
}

template <class ExecutionSpace>
typename Mamba2Mixer<ExecutionSpace>::Cache& Mamba2Mixer<ExecutionSpace>::cache_of(const char* function,
                                                                                   MixerCache<ExecutionSpace>& cache,
                                                                                   std::int64_t batch) const {
  return impl::mixer_cache<Cache>(function, cache, shape_key(), batch, [&] {
    std::ostringstream s;
    s << "a Mamba-2 mixer of these dimensions (d_model " << d_model_ << ", nheads " << nheads_ << ", headdim "
      << headdim_ << ", ngroups " << ngroups_ << ", d_state " << d_state_ << ", d_conv " << d_conv_ << ")";
    return s.str();
  });
}

template <class ExecutionSpace>
void Mamba2Mixer<ExecutionSpace>::prefill(const ExecutionSpace& exec, const Slab& slab,
                                          const ConstTensor3<float, memory_space>& u,  // (batch, seqlen, d_model)
                                          const Tensor3<float, memory_space>& out,     // (batch, seqlen, d_model)
                                          MixerCache<ExecutionSpace>& cache) {
  constexpr const char* function = "kmamba::Mamba2Mixer::prefill";
  const auto [batch, seqlen] = impl::check_sequence_shapes(function, u, out, d_model_);
  this->sequence_ids(function, batch, seqlen);
  Cache& c = cache_of(function, cache, batch);
  check_parameters(function, slab);
  impl::check_whole_sequences(function, parallel_);
  release_activations();
  if (seqlen == 0) return;
  impl::check_contiguous(function, "u", u, "out", out);
  const std::int64_t rows = batch * seqlen;
  Activations local = make_activations(batch, seqlen, false);
  run_forward(exec, slab, ConstMatrix(u.data(), static_cast<std::size_t>(rows), static_cast<std::size_t>(d_model_)),
              Matrix(out.data(), static_cast<std::size_t>(rows), static_cast<std::size_t>(d_model_)), local, &c);
}

template <class ExecutionSpace>
void Mamba2Mixer<ExecutionSpace>::step(const ExecutionSpace& exec, const Slab& slab,
                                       const ConstTensor2<float, memory_space>& u,  // (batch, d_model)
                                       const Tensor2<float, memory_space>& out,     // (batch, d_model)
                                       MixerCache<ExecutionSpace>& cache) const {
  using Mem = memory_space;
  constexpr const char* function = "kmamba::Mamba2Mixer::step";
  const std::int64_t batch = impl::check_step_arguments(function, u, out, d_model_);
  Cache& c = cache_of(function, cache, batch);
  check_parameters(function, slab);
  impl::check_whole_sequences(function, parallel_);
  const std::string& p = prefix_;

  // in_proj as one product (its segments are consecutive rows of the weight), then the conv of
  // x, B, C, the SSM update and the gated norm (z read in place) in one kernel reading its row.
  project(exec, slab, p + "in_proj.weight", p + "in_proj.bias", 0, in_proj_rows_, u, c.projected, c.bf16_parameters());
  ConvSsdStepArgs<Mem> args;
  args.xbcdt = c.projected;
  args.xbc_offset = segment_offsets_[x_segment];
  args.ngroups = ngroups_;
  args.conv_weight = rows_of<Mem>(slab.template param<3>(p + "conv1d.weight").data(), 0, conv_dim_, d_conv_);
  if (config_.conv_bias) args.conv_bias = slab.template param<1>(p + "conv1d.bias");
  args.A_log = slab.template param<1>(p + "A_log");
  args.D = slab.template param<1>(p + "D");
  args.dt_bias = slab.template param<1>(p + "dt_bias");
  args.dt_softplus = true;
  args.norm_weight = slab.template param<1>(p + "norm.weight");
  args.norm_eps = static_cast<float>(config_.norm_epsilon);
  args.norm_before_gate = config_.norm_before_gate;
  const std::size_t b = static_cast<std::size_t>(batch);
  conv_ssd_step(
      exec, args,
      ConvSsdStepState<Mem>{c.conv[x_segment], c.conv[B_segment], c.conv[C_segment], c.ssm, c.group_arrivals},
      Tensor3<float, Mem>(c.y.data(), b, static_cast<std::size_t>(nheads_), static_cast<std::size_t>(headdim_)),
      c.normed);
  project(exec, slab, p + "out_proj.weight", parallel_.tensor_rank() == 0 ? p + "out_proj.bias" : std::string(), 0,
          d_model_, c.normed, out, c.bf16_parameters());
  sum_over_tensor_ranks(exec, out);
}

#define KMAMBA_INSTANTIATE(Exec) template class Mamba2Mixer<Exec>;
KMAMBA_FOR_EACH_BACKEND(KMAMBA_INSTANTIATE)
#undef KMAMBA_INSTANTIATE

}  // namespace kmamba
