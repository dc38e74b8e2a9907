// The Mamba-1 mixer (Mamba1Mixer.hpp) on the mixer toolkit (MixerToolkit.hpp): its parameter
// list, the small kernels around the projections (layout changes between token-major and
// channel-major, biases, gradient sums, initialisation) and the member functions.
#include <kmamba/models/Mamba1Mixer.hpp>

#include "MixerToolkit.hpp"
#include "PackedSegments.hpp"
#include "SegmentStateScan.hpp"

#include <kmamba/backends/Gemm.hpp>
#include <kmamba/core/Conv1d.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/ForEachBackend.hpp>
#include <kmamba/core/Random.hpp>
#include <kmamba/core/SelectiveScan.hpp>
#include <kmamba/core/SelectiveScanStateCorrection.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/Tensor.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>
#include <kmamba/core/Math.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace kmamba {
namespace impl {

struct Mamba1Dims {
  int d_model, d_inner, d_state, d_conv, dt_rank;
  bool bias, conv_bias;
};

inline Mamba1Dims mamba1_dims(const ModelConfig& c) {
  return Mamba1Dims{c.d_model, c.d_inner(), c.d_state, c.d_conv, c.resolved_dt_rank(), c.bias, c.conv_bias};
}

/// Every parameter of the mixer, with its Hugging Face name and shape, in checkpoint order.
inline std::vector<MixerParameter> mamba1_parameters(const Mamba1Dims& d) {
  const std::int64_t dm = d.d_model, e = d.d_inner, n = d.d_state, w = d.d_conv, r = d.dt_rank;
  std::vector<MixerParameter> specs;
  specs.push_back({"in_proj.weight", {2 * e, dm}, WeightDecay::Yes});
  if (d.bias) specs.push_back({"in_proj.bias", {2 * e}, WeightDecay::No});
  specs.push_back({"conv1d.weight", {e, 1, w}, WeightDecay::Yes});
  if (d.conv_bias) specs.push_back({"conv1d.bias", {e}, WeightDecay::No});
  specs.push_back({"x_proj.weight", {r + 2 * n, e}, WeightDecay::Yes});
  specs.push_back({"dt_proj.weight", {e, r}, WeightDecay::Yes});
  specs.push_back({"dt_proj.bias", {e}, WeightDecay::No});
  specs.push_back({"A_log", {e, n}, WeightDecay::No});
  specs.push_back({"D", {e}, WeightDecay::No});
  specs.push_back({"out_proj.weight", {dm, e}, WeightDecay::Yes});
  if (d.bias) specs.push_back({"out_proj.bias", {dm}, WeightDecay::No});
  return specs;
}

/// The mixer's parameters (or their gradients) as views into a slab, the projections split into
/// the row blocks the forward multiplies by separately. Optional ones are empty when absent.
template <class Mem>
struct Mamba1Tensors {
  Tensor2<float, Mem> in_x;         // (d_inner, d_model), rows [0, d_inner) of in_proj.weight
  Tensor2<float, Mem> in_z;         // (d_inner, d_model), rows [d_inner, 2·d_inner)
  Tensor1<float, Mem> in_bias;      // (2·d_inner)
  Tensor2<float, Mem> conv_weight;  // (d_inner, d_conv), conv1d.weight without its middle axis
  Tensor1<float, Mem> conv_bias;    // (d_inner)
  Tensor2<float, Mem> x_dt;         // (dt_rank, d_inner), rows [0, dt_rank) of x_proj.weight
  Tensor2<float, Mem> x_bc;         // (2·d_state, d_inner), rows [dt_rank, dt_rank + 2·d_state)
  Tensor2<float, Mem> dt_weight;    // (d_inner, dt_rank)
  Tensor1<float, Mem> dt_bias;      // (d_inner)
  Tensor2<float, Mem> A_log;        // (d_inner, d_state)
  Tensor1<float, Mem> D;            // (d_inner)
  Tensor2<float, Mem> out_weight;   // (d_model, d_inner)
  Tensor1<float, Mem> out_bias;     // (d_model)
};

/// Views of the parameters (`gradients` false) or of the gradients (true) of the mixer under
/// `prefix`; throws kmamba::UserError naming the parameter if one is missing or mis-shaped.
template <class Mem>
Mamba1Tensors<Mem> mamba1_tensors(const char* function, const ParameterSlab<Mem>& slab, const std::string& prefix,
                                  const Mamba1Dims& d, bool gradients) {
  const std::vector<MixerParameter> parameters = mamba1_parameters(d);
  check_mixer_parameters(function, slab, prefix, parameters);
  const Tensor1<float, Mem>& storage = gradients ? slab.grads() : slab.params();
  std::vector<float*> data;
  for (const MixerParameter& p : parameters) data.push_back(storage.data() + slab.entry(prefix + p.name).offset);
  const std::size_t dm = static_cast<std::size_t>(d.d_model), e = static_cast<std::size_t>(d.d_inner),
                    n = static_cast<std::size_t>(d.d_state), w = static_cast<std::size_t>(d.d_conv),
                    r = static_cast<std::size_t>(d.dt_rank);
  std::size_t i = 0;
  Mamba1Tensors<Mem> t;
  float* in_proj = data[i++];
  t.in_x = Tensor2<float, Mem>(in_proj, e, dm);
  t.in_z = Tensor2<float, Mem>(in_proj + e * dm, e, dm);
  if (d.bias) t.in_bias = Tensor1<float, Mem>(data[i++], 2 * e);
  t.conv_weight = Tensor2<float, Mem>(data[i++], e, w);
  if (d.conv_bias) t.conv_bias = Tensor1<float, Mem>(data[i++], e);
  float* x_proj = data[i++];
  t.x_dt = Tensor2<float, Mem>(x_proj, r, e);
  t.x_bc = Tensor2<float, Mem>(x_proj + r * e, 2 * n, e);
  t.dt_weight = Tensor2<float, Mem>(data[i++], e, r);
  t.dt_bias = Tensor1<float, Mem>(data[i++], e);
  t.A_log = Tensor2<float, Mem>(data[i++], e, n);
  t.D = Tensor1<float, Mem>(data[i++], e);
  t.out_weight = Tensor2<float, Mem>(data[i++], dm, e);
  if (d.bias) t.out_bias = Tensor1<float, Mem>(data[i++], dm);
  return t;
}

// ----------------------------------------------------------------------------------------------
// Layout changes between the projections and the selective scan.

// The (batch·seqlen, features) matrix as a (batch, seqlen, features) tensor over the same memory.
template <class T, class Mem>
Tensor3<T, Mem> mamba1_token_tensor(const Tensor2<T, Mem>& rows,  // (batch·seqlen, features)
                                    std::int64_t batch) {
  const std::size_t b = static_cast<std::size_t>(batch);
  return Tensor3<T, Mem>(rows.data(), b, b == 0 ? 0 : rows.extent(0) / b, rows.extent(1));
}

// A (batch, 1, d_state, seqlen) scan operand as (batch, d_state, seqlen) over the same memory.
template <class Mem>
Tensor3<float, Mem> mamba1_group_squeezed(const Tensor4<float, Mem>& t) {  // (batch, 1, d_state, seqlen)
  return Tensor3<float, Mem>(t.data(), t.extent(0), t.extent(2), t.extent(3));
}

template <class ViewType>
void mamba1_check_activation(const char* function, const char* name,
                             const ViewType& view,  // (batch, seqlen, d_model)
                             std::int64_t batch, std::int64_t seqlen, std::int64_t d_model) {
  check_shape(function, name, view, {batch, seqlen, d_model}, "(batch, seqlen, d_model)");
  check_allocated(function, name, view);
  KMAMBA_REQUIRE(view.span_is_contiguous(),
                 function << ": " << name << " (shape " << shape_of(view).to_string() << ") must be contiguous");
}

/// Moves `channels` columns between the token-major layout of the projections,
/// rows(b·seqlen + t, column0 + c), and the channel-major layout of the selective scan,
/// channel_major(b, c, t), through tiles staged in team scratch so that each side is read and
/// written along its contiguous axis. One team per (batch, channel tile, time tile).
template <class ExecutionSpace, bool ToChannelMajor>
struct Mamba1Relayout {
  using Mem = typename ExecutionSpace::memory_space;
  using Policy = Kokkos::TeamPolicy<ExecutionSpace>;
  using Member = typename Policy::member_type;
  using TileView = Kokkos::View<float**, typename ExecutionSpace::scratch_memory_space, Kokkos::MemoryUnmanaged>;
  static constexpr int tile = 32;

  Tensor2<float, Mem> rows;           // (batch·seqlen, columns)
  Tensor3<float, Mem> channel_major;  // (batch, channels, seqlen)
  int column0, channels, seqlen, channel_tiles, time_tiles;

  static std::size_t scratch_bytes() { return TileView::shmem_size(tile, tile + 1); }

  KOKKOS_INLINE_FUNCTION void operator()(const Member& team) const {
    const int time_tile = team.league_rank() % time_tiles;
    const int rest = team.league_rank() / time_tiles;
    const int b = rest / channel_tiles;
    const int c0 = (rest % channel_tiles) * tile, t0 = time_tile * tile;
    const int nc = channels - c0 < tile ? channels - c0 : tile;
    const int nt = seqlen - t0 < tile ? seqlen - t0 : tile;
    const std::int64_t row0 = static_cast<std::int64_t>(b) * seqlen + t0;
    const TileView staged(team.team_scratch(0), tile, tile + 1);  // (time, channel)
    if (ToChannelMajor) {
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nt), [&](const int t) {
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, nc),
                             [&](const int c) { staged(t, c) = rows(row0 + t, column0 + c0 + c); });
      });
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nc), [&](const int c) {
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, nt),
                             [&](const int t) { channel_major(b, c0 + c, t0 + t) = staged(t, c); });
      });
    } else {
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nc), [&](const int c) {
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, nt),
                             [&](const int t) { staged(t, c) = channel_major(b, c0 + c, t0 + t); });
      });
      team.team_barrier();
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, nt), [&](const int t) {
        Kokkos::parallel_for(Kokkos::ThreadVectorRange(team, nc),
                             [&](const int c) { rows(row0 + t, column0 + c0 + c) = staged(t, c); });
      });
    }
  }
};

template <bool ToChannelMajor, class ExecutionSpace>
void mamba1_relayout(
    const ExecutionSpace& exec, const char* label,
    const Tensor2<float, typename ExecutionSpace::memory_space>& rows,  // (batch·seqlen, columns)
    int column0,
    const Tensor3<float, typename ExecutionSpace::memory_space>& channel_major) {  // (batch, channels, seqlen)
  using Functor = Mamba1Relayout<ExecutionSpace, ToChannelMajor>;
  using Policy = typename Functor::Policy;
  const int batch = static_cast<int>(channel_major.extent(0)), channels = static_cast<int>(channel_major.extent(1)),
            seqlen = static_cast<int>(channel_major.extent(2));
  KMAMBA_ASSERT(rows.extent(0) == static_cast<std::size_t>(batch) * static_cast<std::size_t>(seqlen) &&
                    static_cast<std::size_t>(column0 + channels) <= rows.extent(1),
                label << ": token-major and channel-major extents disagree");
  const int channel_tiles = (channels + Functor::tile - 1) / Functor::tile;
  const int time_tiles = (seqlen + Functor::tile - 1) / Functor::tile;
  const int league = batch * channel_tiles * time_tiles;
  if (league == 0) return;
  const Functor functor{rows, channel_major, column0, channels, seqlen, channel_tiles, time_tiles};
  // On the host a team is one thread walking the tile; on a GPU the vector lanes run along the
  // contiguous axis of each side and the threads of the team over the other.
  constexpr bool host = Kokkos::SpaceAccessibility<ExecutionSpace, Kokkos::HostSpace>::accessible;
  const int vector_length = host ? 1 : std::min(Functor::tile, static_cast<int>(Policy::vector_length_max()));
  int team_size = 1;
  if (!host) {
    Policy probe(exec, league, 1, vector_length);
    probe.set_scratch_size(0, Kokkos::PerTeam(Functor::scratch_bytes()));
    team_size = std::max(1, std::min(8, probe.team_size_max(functor, Kokkos::ParallelForTag())));
  }
  Policy policy(exec, league, team_size, vector_length);
  policy.set_scratch_size(0, Kokkos::PerTeam(Functor::scratch_bytes()));
  Kokkos::parallel_for(label, policy, functor);
}

/// The selective scan's operands (Args: SelectiveScanArgs for a forward or backward, with the
/// channel-major views of the mixer's Activations; SelectiveScanStepArgs for a decode step): u = xc,
/// delta, A, B, C, z, and D and delta_bias = dt_proj.bias of `p`, softplus on.
template <class Args, class Mem, class U, class Delta, class AView, class BC, class Z>
Args mamba1_scan_args(const Mamba1Tensors<Mem>& p, const U& u, const Delta& delta, const AView& A, const BC& B,
                      const BC& C, const Z& z) {
  Args scan;
  scan.u = u;
  scan.delta = delta;
  scan.A = A;
  scan.B = B;
  scan.C = C;
  scan.D = p.D;
  scan.z = z;
  scan.delta_bias = p.dt_bias;
  scan.delta_softplus = true;
  return scan;
}

// ----------------------------------------------------------------------------------------------
// Elementwise and reduction kernels.

/// rows(m, j) += bias(bias0 + j) for the columns of `rows`.
template <class Mem>
struct Mamba1AddBias {
  Tensor2<float, Mem> rows;       // (batch·seqlen, columns)
  ConstTensor1<float, Mem> bias;  // (≥ bias0 + columns)
  int bias0;
  KOKKOS_INLINE_FUNCTION void operator()(const std::int64_t i) const {
    const std::int64_t columns = static_cast<std::int64_t>(rows.extent(1));
    const std::int64_t m = i / columns;
    const int j = static_cast<int>(i % columns);
    rows(m, j) += bias(bias0 + j);
  }
};

template <class ExecutionSpace>
void mamba1_add_bias(const ExecutionSpace& exec,
                     const Tensor2<float, typename ExecutionSpace::memory_space>& rows,  // (batch·seqlen, columns)
                     const ConstTensor1<float, typename ExecutionSpace::memory_space>& bias,  // (≥ bias0 + columns)
                     int bias0) {
  Kokkos::parallel_for("kmamba::mamba1::add_bias",
                       light_weight(Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::int64_t>>(
                           exec, 0, static_cast<std::int64_t>(rows.size()))),
                       Mamba1AddBias<typename ExecutionSpace::memory_space>{rows, bias, bias0});
}

/// grad(grad0 + j) += Σ_m rows(m, j), summed in row order (deterministic).
template <class ExecutionSpace>
void mamba1_add_column_sums(
    const ExecutionSpace& exec,
    const ConstTensor2<float, typename ExecutionSpace::memory_space>& rows,  // (batch·seqlen, columns)
    const Tensor1<float, typename ExecutionSpace::memory_space>& grad,       // (≥ grad0 + columns)
    int grad0) {
  add_column_sums(exec, "kmamba::mamba1::bias_gradient", rows, grad, grad0);
}

/// Adds the selective scan's parameter gradients into the slab: dA_log = dA·A (A = −exp(A_log)),
/// dD, d(dt_proj.bias) = d(delta_bias).
template <class Mem>
struct Mamba1AddScanGradients {
  ConstTensor2<float, Mem> A, dA;            // (d_inner, d_state)
  ConstTensor1<float, Mem> dD, ddelta_bias;  // (d_inner)
  Tensor2<float, Mem> grad_A_log;            // (d_inner, d_state)
  Tensor1<float, Mem> grad_D, grad_dt_bias;  // (d_inner)
  KOKKOS_INLINE_FUNCTION void operator()(const int d) const {
    for (std::size_t n = 0; n < A.extent(1); ++n) grad_A_log(d, n) += dA(d, n) * A(d, n);
    grad_D(d) += dD(d);
    grad_dt_bias(d) += ddelta_bias(d);
  }
};

/// Adds the conv's weight (and bias) gradients into the slab.
template <class Mem>
struct Mamba1AddConvGradients {
  ConstTensor2<float, Mem> dweight;  // (d_inner, d_conv)
  ConstTensor1<float, Mem> dbias;    // (d_inner) if has_bias
  Tensor2<float, Mem> grad_weight;   // (d_inner, d_conv)
  Tensor1<float, Mem> grad_bias;     // (d_inner) if has_bias
  bool has_bias;
  KOKKOS_INLINE_FUNCTION void operator()(const int d) const {
    for (std::size_t k = 0; k < dweight.extent(1); ++k) grad_weight(d, k) += dweight(d, k);
    if (has_bias) grad_bias(d) += dbias(d);
  }
};

// ----------------------------------------------------------------------------------------------
// Initialisation.

/// A_log(d, n) = ln(n + 1) (S4D-real).
template <class Mem>
struct Mamba1ALogInit {
  Tensor2<float, Mem> A_log;  // (d_inner, d_state)
  KOKKOS_INLINE_FUNCTION void operator()(const int d) const {
    for (std::size_t n = 0; n < A_log.extent(1); ++n) {
      A_log(d, n) = static_cast<float>(kmamba::math::log(static_cast<double>(n + 1)));
    }
  }
};

}  // namespace impl

// ----------------------------------------------------------------------------------------------
// Members.

template <class ExecutionSpace>
Mamba1Mixer<ExecutionSpace>::Mamba1Mixer(const ModelConfig& config, std::string prefix)
    : Mamba1Mixer(config, std::move(prefix), ModelParallel()) {}

template <class ExecutionSpace>
Mamba1Mixer<ExecutionSpace>::Mamba1Mixer(const ModelConfig& config, std::string prefix, const ModelParallel& parallel)
    : config_(config), prefix_(std::move(prefix)), parallel_(parallel) {
  KMAMBA_REQUIRE(config.mixer == MixerKind::Mamba1,
                 "kmamba::Mamba1Mixer: the config's mixer is " << mixer_name(config.mixer) << ", not Mamba1");
  KMAMBA_REQUIRE(parallel_.tensor_size() == 1, "kmamba::Mamba1Mixer: tensor_parallel_size "
                                                   << parallel_.tensor_size()
                                                   << " is not supported (the Mamba1 mixer splits sequences only)");
  config.validate();
  d_model_ = config.d_model;
  d_inner_ = config.d_inner();
  d_state_ = config.d_state;
  d_conv_ = config.d_conv;
  dt_rank_ = config.resolved_dt_rank();
}

template <class ExecutionSpace>
void Mamba1Mixer<ExecutionSpace>::declare_parameters(Slab& slab) const {
  impl::declare_mixer_parameters(slab, prefix_, impl::mamba1_parameters(impl::mamba1_dims(config_)));
}

template <class ExecutionSpace>
void Mamba1Mixer<ExecutionSpace>::initialize(const ExecutionSpace& exec, const Slab& slab, std::uint64_t seed) const {
  using Mem = memory_space;
  constexpr const char* function = "kmamba::Mamba1Mixer::initialize";
  const impl::Mamba1Dims dims = impl::mamba1_dims(config_);
  const impl::Mamba1Tensors<Mem> p = impl::mamba1_tensors(function, slab, prefix_, dims, false);
  const auto key = [&](const char* name) { return impl::mamba1_parameter_seed(seed, prefix_ + name); };
  const auto uniform = [&](const auto& view, const char* name, double bound) {
    fill_uniform(exec, view, key(name), static_cast<float>(-bound), static_cast<float>(bound));
  };
  // in_proj.weight is filled as one stream over its 2·d_inner rows.
  const Tensor2<float, Mem> in_proj(p.in_x.data(), 2 * static_cast<std::size_t>(d_inner_),
                                    static_cast<std::size_t>(d_model_));
  const Tensor2<float, Mem> x_proj(p.x_dt.data(), static_cast<std::size_t>(dt_rank_ + 2 * d_state_),
                                   static_cast<std::size_t>(d_inner_));
  uniform(in_proj, "in_proj.weight", 1.0 / std::sqrt(static_cast<double>(d_model_)));
  uniform(p.conv_weight, "conv1d.weight", 1.0 / std::sqrt(static_cast<double>(d_conv_)));
  if (dims.conv_bias) uniform(p.conv_bias, "conv1d.bias", 1.0 / std::sqrt(static_cast<double>(d_conv_)));
  uniform(x_proj, "x_proj.weight", 1.0 / std::sqrt(static_cast<double>(d_inner_)));
  const double dt_std = std::pow(static_cast<double>(dt_rank_), -0.5) * config_.dt_scale;
  if (config_.dt_init_random) {
    uniform(p.dt_weight, "dt_proj.weight", dt_std);
  } else {
    Kokkos::deep_copy(exec, p.dt_weight, static_cast<float>(dt_std));
  }
  impl::initialize_dt_bias<double>(exec, "kmamba::mamba1::init_dt_bias", config_, p.dt_bias, key("dt_proj.bias"));
  Kokkos::parallel_for("kmamba::mamba1::init_A_log", Kokkos::RangePolicy<ExecutionSpace>(exec, 0, d_inner_),
                       impl::Mamba1ALogInit<Mem>{p.A_log});
  Kokkos::deep_copy(exec, p.D, 1.0f);
  double out_bound = 1.0 / std::sqrt(static_cast<double>(d_inner_));
  if (config_.rescale_prenorm_residual) out_bound /= std::sqrt(static_cast<double>(config_.n_layer));
  uniform(p.out_weight, "out_proj.weight", out_bound);
  if (dims.bias) {
    Kokkos::deep_copy(exec, p.in_bias, 0.0f);
    Kokkos::deep_copy(exec, p.out_bias, 0.0f);
  }
}

template <class ExecutionSpace>
void Mamba1Mixer<ExecutionSpace>::prepare_activations(std::int64_t batch, std::int64_t seqlen, bool keep_input) {
  using Mem = memory_space;
  const std::int64_t tokens = batch * seqlen;
  if (act_.batch != batch || act_.seqlen != seqlen || !act_.x.is_allocated()) {
    act_ = Activations{};
    act_.batch = batch;
    act_.seqlen = seqlen;
    const auto rows = [&](const char* label, int columns) {
      return allocate_uninitialized<Tensor2<float, Mem>>(label, tokens, columns);
    };
    const auto channels = [&](const char* label) {
      return allocate_uninitialized<Tensor3<float, Mem>>(label, batch, d_inner_, seqlen);
    };
    act_.x = rows("kmamba::mamba1::x", d_inner_);
    act_.z = rows("kmamba::mamba1::z", d_inner_);
    act_.xc = rows("kmamba::mamba1::xc", d_inner_);
    act_.dt = rows("kmamba::mamba1::dt", dt_rank_);
    act_.bc = rows("kmamba::mamba1::bc", 2 * d_state_);
    act_.delta = rows("kmamba::mamba1::delta", d_inner_);
    act_.y = rows("kmamba::mamba1::y", d_inner_);
    act_.xc_channels = channels("kmamba::mamba1::xc_channels");
    act_.delta_channels = channels("kmamba::mamba1::delta_channels");
    act_.z_channels = channels("kmamba::mamba1::z_channels");
    act_.y_channels = channels("kmamba::mamba1::y_channels");
    act_.B = allocate_uninitialized<Tensor4<float, Mem>>("kmamba::mamba1::B", batch, 1, d_state_, seqlen);
    act_.C = allocate_uninitialized<Tensor4<float, Mem>>("kmamba::mamba1::C", batch, 1, d_state_, seqlen);
    act_.A = allocate_uninitialized<Tensor2<float, Mem>>("kmamba::mamba1::A", d_inner_, d_state_);
    if (parallel_.sequence_size() > 1) {  // zero on the first rank, which receives nothing
      act_.conv_initial = allocate<Tensor3<float, Mem>>("kmamba::mamba1::conv_initial", batch, d_inner_, d_conv_ - 1);
      act_.ssm_initial =
          allocate_uninitialized<Tensor3<float, Mem>>("kmamba::mamba1::ssm_initial", batch, d_inner_, d_state_);
      act_.segment_decay =
          allocate_uninitialized<Tensor3<float, Mem>>("kmamba::mamba1::segment_decay", batch, d_inner_, d_state_);
    }
  }
  if (keep_input && !act_.u.is_allocated()) {
    act_.u = allocate_uninitialized<Tensor2<float, Mem>>("kmamba::mamba1::u", tokens, d_model_);
  }
}

template <class ExecutionSpace>
void Mamba1Mixer<ExecutionSpace>::release_activations() {
  act_ = Activations{};
  kept_ = false;
}

template <class ExecutionSpace>
class Mamba1Mixer<ExecutionSpace>::Cache final : public MixerCache<ExecutionSpace> {
 public:
  using Mem = typename ExecutionSpace::memory_space;

  Cache(const Mamba1Mixer& mixer, int batch) : MixerCache<ExecutionSpace>(batch), shape(mixer.shape_key()) {
    const int E = mixer.d_inner_, N = mixer.d_state_;
    const auto rows = [&](const char* label, int columns) {
      return allocate_uninitialized<Tensor2<float, Mem>>(label, batch, columns);
    };
    conv = allocate<Tensor3<float, Mem>>("kmamba::decode::mamba1::conv_state", batch, E, mixer.d_conv_ - 1);
    ssm = allocate<Tensor3<float, Mem>>("kmamba::decode::mamba1::ssm_state", batch, E, N);
    x = rows("kmamba::decode::mamba1::x", E);
    z = rows("kmamba::decode::mamba1::z", E);
    xc = rows("kmamba::decode::mamba1::xc", E);
    dt = rows("kmamba::decode::mamba1::dt", mixer.dt_rank_);
    delta = rows("kmamba::decode::mamba1::delta", E);
    y = rows("kmamba::decode::mamba1::y", E);
    B = allocate_uninitialized<Tensor3<float, Mem>>("kmamba::decode::mamba1::B", batch, 1, N);
    C = allocate_uninitialized<Tensor3<float, Mem>>("kmamba::decode::mamba1::C", batch, 1, N);
    A = allocate_uninitialized<Tensor2<float, Mem>>("kmamba::decode::mamba1::A", E, N);
  }

  void reset(const ExecutionSpace& exec) override {
    Kokkos::deep_copy(exec, conv, 0.0f);
    Kokkos::deep_copy(exec, ssm, 0.0f);
  }

  std::array<int, 5> shape;      // the dimensions of the mixer that made it
  Tensor3<float, Mem> conv;      // (batch, d_inner, d_conv − 1)
  Tensor3<float, Mem> ssm;       // (batch, d_inner, d_state)
  Tensor2<float, Mem> x, z, xc;  // (batch, d_inner)
  Tensor2<float, Mem> dt;        // (batch, dt_rank)
  Tensor2<float, Mem> delta, y;  // (batch, d_inner)
  Tensor3<float, Mem> B, C;      // (batch, 1, d_state)
  Tensor2<float, Mem> A;         // (d_inner, d_state), −exp(A_log)
};

template <class ExecutionSpace>
void Mamba1Mixer<ExecutionSpace>::forward(const ExecutionSpace& exec, const Slab& slab,
                                          const ConstTensor3<float, memory_space>& u,  // (batch, seqlen, d_model)
                                          const Tensor3<float, memory_space>& out,     // (batch, seqlen, d_model)
                                          bool keep_for_backward) {
  constexpr const char* function = "kmamba::Mamba1Mixer::forward";
  const auto batch = static_cast<std::int64_t>(u.extent(0)), seqlen = static_cast<std::int64_t>(u.extent(1));
  impl::mamba1_check_activation(function, "u", u, batch, seqlen, d_model_);
  impl::mamba1_check_activation(function, "out", out, batch, seqlen, d_model_);
  kept_ = false;
  prepare_activations(batch, seqlen, keep_for_backward);
  if (keep_for_backward) Kokkos::deep_copy(exec, act_.u, impl::token_rows(u));
  run_forward(exec, function, slab, u, out, nullptr);
  kept_ = keep_for_backward;
}

template <class ExecutionSpace>
void Mamba1Mixer<ExecutionSpace>::run_forward(const ExecutionSpace& exec, const char* function, const Slab& slab,
                                              const ConstTensor3<float, memory_space>& u,  // (batch, seqlen, d_model)
                                              const Tensor3<float, memory_space>& out,     // (batch, seqlen, d_model)
                                              Cache* cache) {
  using Mem = memory_space;
  const std::int64_t batch = static_cast<std::int64_t>(u.extent(0));
  const impl::Mamba1Dims dims = impl::mamba1_dims(config_);
  const impl::Mamba1Tensors<Mem> p = impl::mamba1_tensors(function, slab, prefix_, dims, false);
  const Activations& a = act_;
  const ConstTensor2<std::int64_t, Mem>& seq_idx =
      this->sequence_ids(function, batch, static_cast<std::int64_t>(u.extent(1)));
  const auto gemm = [&](Transpose ta, Transpose tb, const ConstTensor2<float, Mem>& A,
                        const ConstTensor2<float, Mem>& B, float beta, const Tensor2<float, Mem>& C) {
    kmamba::gemm<ExecutionSpace, Mem>(exec, ta, tb, 1.0f, A, B, beta, C, this->matmul_precision());
  };
  const ConstTensor2<float, Mem> u_rows = impl::token_rows(u);  // (batch·seqlen, d_model)

  // [x | z] = u·in_projᵀ (+ bias)
  gemm(Transpose::No, Transpose::Yes, u_rows, p.in_x, 0.0f, a.x);
  gemm(Transpose::No, Transpose::Yes, u_rows, p.in_z, 0.0f, a.z);
  if (dims.bias) {
    impl::mamba1_add_bias(exec, a.x, p.in_bias, 0);
    impl::mamba1_add_bias(exec, a.z, p.in_bias, d_inner_);
  }
  // xc = silu(conv(x) + bias), from and into the cache's conv window when there is one; split
  // sequences take the previous rank's last d_conv − 1 inputs (the halo) and pass theirs on.
  const bool split_sequence = parallel_.sequence_size() > 1;
  const int previous = parallel_.previous_segment_rank(), next = parallel_.next_segment_rank();
  Tensor3<float, Mem> conv_initial = cache != nullptr ? cache->conv : Tensor3<float, Mem>();
  Tensor3<float, Mem> conv_final = conv_initial;
  act_.halo_mask =
      split_sequence && seq_idx.is_allocated()
          ? impl::packed_halo_mask(exec, *parallel_.sequence, previous, next, seq_idx, std::max(1, d_conv_ - 1))
          : Tensor2<float, Mem>();
  if (split_sequence) {
    conv_initial = a.conv_initial;
    if (previous != no_peer) parallel_.sequence->recv(exec, conv_initial, previous);
    if (a.halo_mask.is_allocated()) impl::mask_packed_halo(exec, ConstTensor2<float, Mem>(a.halo_mask), conv_initial);
    conv_final = next != no_peer ? allocate_uninitialized<Tensor3<float, Mem>>("kmamba::mamba1::conv_final", batch,
                                                                               d_inner_, d_conv_ - 1)
                                 : Tensor3<float, Mem>();
  }
  causal_conv1d(exec, impl::mamba1_token_tensor(a.x, batch), p.conv_weight, p.conv_bias, conv_initial,
                impl::mamba1_token_tensor(a.xc, batch), conv_final, Conv1dActivation::silu, seq_idx);
  if (split_sequence && next != no_peer) parallel_.sequence->send(exec, conv_final, next);
  // [dt | B | C] = xc·x_projᵀ;  delta = dt·dt_projᵀ
  gemm(Transpose::No, Transpose::Yes, a.xc, p.x_dt, 0.0f, a.dt);
  gemm(Transpose::No, Transpose::Yes, a.xc, p.x_bc, 0.0f, a.bc);
  gemm(Transpose::No, Transpose::Yes, a.dt, p.dt_weight, 0.0f, a.delta);
  // The scan's channel-major operands and A = −exp(A_log).
  impl::mamba1_relayout<true>(exec, "kmamba::mamba1::xc_to_channels", a.xc, 0, a.xc_channels);
  impl::mamba1_relayout<true>(exec, "kmamba::mamba1::delta_to_channels", a.delta, 0, a.delta_channels);
  impl::mamba1_relayout<true>(exec, "kmamba::mamba1::z_to_channels", a.z, 0, a.z_channels);
  impl::mamba1_relayout<true>(exec, "kmamba::mamba1::B_to_channels", a.bc, 0, impl::mamba1_group_squeezed(a.B));
  impl::mamba1_relayout<true>(exec, "kmamba::mamba1::C_to_channels", a.bc, d_state_, impl::mamba1_group_squeezed(a.C));
  impl::negative_exp(exec, "kmamba::mamba1::A", impl::as_flat(p.A_log), impl::as_flat(a.A));
  SelectiveScanArgs<Mem> scan =
      impl::mamba1_scan_args<SelectiveScanArgs<Mem>>(p, a.xc_channels, a.delta_channels, a.A, a.B, a.C, a.z_channels);
  scan.seq_idx = seq_idx;
  if (split_sequence) {
    scan_segment(exec, scan, a.y_channels);
  } else {
    const Tensor3<float, Mem> ssm_state = cache != nullptr ? cache->ssm : Tensor3<float, Mem>();
    scan.initial_state = ssm_state;
    selective_scan_forward(exec, scan, a.y_channels, ssm_state);
  }
  // out = y·out_projᵀ (+ bias)
  impl::mamba1_relayout<false>(exec, "kmamba::mamba1::y_to_tokens", a.y, 0, a.y_channels);
  const Tensor2<float, Mem> out_rows = impl::token_rows(out);
  gemm(Transpose::No, Transpose::Yes, a.y, p.out_weight, 0.0f, out_rows);
  if (dims.bias) impl::mamba1_add_bias(exec, out_rows, p.out_bias, 0);
}

template <class ExecutionSpace>
void Mamba1Mixer<ExecutionSpace>::scan_segment(const ExecutionSpace& exec, const SelectiveScanArgs<memory_space>& args,
                                               const Tensor3<float, memory_space>& y) {  // (batch, d_inner, seqlen)
  using Mem = memory_space;
  // Every rank scans its segment from a zero state at once; the (decay, last state) pairs of the
  // segments then give each rank the state entering its own (docs/distributed.md §2.2), whose
  // contribution is added to the gated output (the gate multiplies it as the rest of y).
  const std::int64_t batch = act_.batch;
  const auto last = allocate_uninitialized<Tensor3<float, Mem>>("kmamba::mamba1::ssm_final", batch, d_inner_, d_state_);
  selective_scan_forward(exec, args, y, last);
  selective_scan_segment_decay(exec, args, act_.segment_decay);
  // Packed rows: a segment that starts a document passes no state on and takes none in (a start
  // inside the segment the decay and the correction see through args.seq_idx).
  const ConstTensor2<float, Mem> halo_mask(act_.halo_mask);
  if (halo_mask.is_allocated()) impl::mask_packed_rows(exec, halo_mask, act_.segment_decay);
  const std::size_t rows = static_cast<std::size_t>(batch), width = static_cast<std::size_t>(d_inner_) * d_state_;
  impl::segment_state_scan(exec, *parallel_.sequence, impl::SegmentScanDirection::Forward,
                           ConstTensor2<float, Mem>(act_.segment_decay.data(), rows, width),
                           ConstTensor2<float, Mem>(last.data(), rows, width),
                           Tensor2<float, Mem>(act_.ssm_initial.data(), rows, width));
  if (halo_mask.is_allocated()) impl::mask_packed_rows(exec, halo_mask, act_.ssm_initial);
  selective_scan_state_correction_forward(exec, args, act_.ssm_initial, y, Tensor3<float, Mem>());
}

template <class ExecutionSpace>
std::array<int, 5> Mamba1Mixer<ExecutionSpace>::shape_key() const {
  return {d_model_, d_inner_, d_state_, d_conv_, dt_rank_};
}

template <class ExecutionSpace>
std::unique_ptr<MixerCache<ExecutionSpace>> Mamba1Mixer<ExecutionSpace>::make_cache(int batch) const {
  return impl::new_mixer_cache<Cache, ExecutionSpace>("kmamba::Mamba1Mixer::make_cache", *this, batch);
}

template <class ExecutionSpace>
typename Mamba1Mixer<ExecutionSpace>::Cache& Mamba1Mixer<ExecutionSpace>::cache_of(const char* function,
                                                                                   MixerCache<ExecutionSpace>& cache,
                                                                                   std::int64_t batch) const {
  return impl::mixer_cache<Cache>(function, cache, shape_key(), batch, [&] {
    std::ostringstream s;
    s << "a Mamba-1 mixer of these dimensions (d_model " << d_model_ << ", d_inner " << d_inner_ << ", d_state "
      << d_state_ << ", d_conv " << d_conv_ << ", dt_rank " << dt_rank_ << ")";
    return s.str();
  });
}

template <class ExecutionSpace>
void Mamba1Mixer<ExecutionSpace>::prefill(const ExecutionSpace& exec, const Slab& slab,
                                          const ConstTensor3<float, memory_space>& u,  // (batch, seqlen, d_model)
                                          const Tensor3<float, memory_space>& out,     // (batch, seqlen, d_model)
                                          MixerCache<ExecutionSpace>& cache) {
  constexpr const char* function = "kmamba::Mamba1Mixer::prefill";
  const auto batch = static_cast<std::int64_t>(u.extent(0)), seqlen = static_cast<std::int64_t>(u.extent(1));
  check_shape(function, "u", u, {batch, seqlen, d_model_}, "(batch, seqlen, d_model)");
  check_shape(function, "out", out, {batch, seqlen, d_model_}, "(batch, seqlen, d_model) of u");
  impl::check_whole_sequences(function, parallel_);
  Cache& c = cache_of(function, cache, batch);
  impl::mamba1_tensors(function, slab, prefix_, impl::mamba1_dims(config_), false);  // checked for seqlen 0 too
  release_activations();
  if (seqlen == 0) return;
  impl::mamba1_check_activation(function, "u", u, batch, seqlen, d_model_);
  impl::mamba1_check_activation(function, "out", out, batch, seqlen, d_model_);
  prepare_activations(batch, seqlen, false);
  run_forward(exec, function, slab, u, out, &c);
  act_ = Activations{};  // the segment's buffers are not kept between segments
}

template <class ExecutionSpace>
void Mamba1Mixer<ExecutionSpace>::step(const ExecutionSpace& exec, const Slab& slab,
                                       const ConstTensor2<float, memory_space>& u,  // (batch, d_model)
                                       const Tensor2<float, memory_space>& out,     // (batch, d_model)
                                       MixerCache<ExecutionSpace>& cache) const {
  using Mem = memory_space;
  constexpr const char* function = "kmamba::Mamba1Mixer::step";
  const auto batch = static_cast<std::int64_t>(u.extent(0));
  check_shape(function, "u", u, {batch, d_model_}, "(batch, d_model)");
  check_shape(function, "out", out, {batch, d_model_}, "(batch, d_model) of u");
  check_allocated(function, "u", u);
  check_allocated(function, "out", out);
  impl::check_whole_sequences(function, parallel_);
  Cache& c = cache_of(function, cache, batch);
  const impl::Mamba1Dims dims = impl::mamba1_dims(config_);
  const impl::Mamba1Tensors<Mem> p = impl::mamba1_tensors(function, slab, prefix_, dims, false);
  const auto gemm = [&](const ConstTensor2<float, Mem>& A, const ConstTensor2<float, Mem>& W,
                        const Tensor2<float, Mem>& C) {
    impl::step_product(exec, slab, c.bf16_parameters(), A, W, 0.0f, C, this->matmul_precision());
  };
  const std::size_t n = static_cast<std::size_t>(d_state_), e = static_cast<std::size_t>(d_inner_),
                    b = static_cast<std::size_t>(batch);

  // [x | z] = u·in_projᵀ (+ bias);  xc = silu(conv_update(x) + bias)
  gemm(u, p.in_x, c.x);
  gemm(u, p.in_z, c.z);
  if (dims.bias) {
    impl::mamba1_add_bias(exec, c.x, p.in_bias, 0);
    impl::mamba1_add_bias(exec, c.z, p.in_bias, d_inner_);
  }
  causal_conv1d_update(exec, c.x, p.conv_weight, p.conv_bias, c.conv, c.xc, Conv1dActivation::silu);
  // [dt | B | C] = xc·x_projᵀ, each part into its own buffer;  delta = dt·dt_projᵀ
  gemm(c.xc, p.x_dt, c.dt);
  gemm(c.xc, ConstTensor2<float, Mem>(p.x_bc.data(), n, e), Tensor2<float, Mem>(c.B.data(), b, n));
  gemm(c.xc, ConstTensor2<float, Mem>(p.x_bc.data() + n * e, n, e), Tensor2<float, Mem>(c.C.data(), b, n));
  gemm(c.dt, p.dt_weight, c.delta);
  Kokkos::parallel_for("kmamba::decode::mamba1::A",
                       impl::light_weight(Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::int64_t>>(
                           exec, 0, static_cast<std::int64_t>(c.A.size()))),
                       impl::NegativeExpFunctor<Mem>{impl::as_flat(p.A_log), impl::as_flat(c.A)});
  selective_scan_step(exec, impl::mamba1_scan_args<SelectiveScanStepArgs<Mem>>(p, c.xc, c.delta, c.A, c.B, c.C, c.z),
                      c.ssm, c.y);
  // out = y·out_projᵀ (+ bias)
  gemm(c.y, p.out_weight, out);
  if (dims.bias) impl::mamba1_add_bias(exec, out, p.out_bias, 0);
}

template <class ExecutionSpace>
void Mamba1Mixer<ExecutionSpace>::backward(const ExecutionSpace& exec, const Slab& slab,
                                           const ConstTensor3<float, memory_space>& dout,  // (batch, seqlen, d_model)
                                           const Tensor3<float, memory_space>& du) {       // (batch, seqlen, d_model)
  using Mem = memory_space;
  constexpr const char* function = "kmamba::Mamba1Mixer::backward";
  KMAMBA_REQUIRE(kept_, function << ": no activations were kept; call forward with keep_for_backward = true first");
  const Activations& a = act_;
  const std::int64_t batch = a.batch, seqlen = a.seqlen, tokens = batch * seqlen;
  impl::mamba1_check_activation(function, "dout", dout, batch, seqlen, d_model_);
  impl::mamba1_check_activation(function, "du", du, batch, seqlen, d_model_);
  const impl::Mamba1Dims dims = impl::mamba1_dims(config_);
  const impl::Mamba1Tensors<Mem> p = impl::mamba1_tensors(function, slab, prefix_, dims, false);
  const impl::Mamba1Tensors<Mem> g = impl::mamba1_tensors(function, slab, prefix_, dims, true);
  const ConstTensor2<std::int64_t, Mem>& seq_idx = this->sequence_ids(function, batch, seqlen);
  const auto gemm = [&](Transpose ta, Transpose tb, const ConstTensor2<float, Mem>& A,
                        const ConstTensor2<float, Mem>& B, float beta, const Tensor2<float, Mem>& C) {
    kmamba::gemm<ExecutionSpace, Mem>(exec, ta, tb, 1.0f, A, B, beta, C, this->matmul_precision());
  };
  const auto rows = [&](const char* label, int columns) {
    return allocate_uninitialized<Tensor2<float, Mem>>(label, tokens, columns);
  };
  const auto channels = [&](const char* label) {
    return allocate_uninitialized<Tensor3<float, Mem>>(label, batch, d_inner_, seqlen);
  };
  const ConstTensor2<float, Mem> dout_rows = impl::token_rows(dout);  // (batch·seqlen, d_model)

  // out = y·out_projᵀ + bias
  const Tensor2<float, Mem> dy = rows("kmamba::mamba1::dy", d_inner_);
  gemm(Transpose::No, Transpose::No, dout_rows, p.out_weight, 0.0f, dy);
  gemm(Transpose::Yes, Transpose::No, dout_rows, a.y, 1.0f, g.out_weight);
  if (dims.bias) impl::mamba1_add_column_sums(exec, dout_rows, g.out_bias, 0);

  // The selective scan, channel-major.
  const Tensor3<float, Mem> dy_channels = channels("kmamba::mamba1::dy_channels");
  impl::mamba1_relayout<true>(exec, "kmamba::mamba1::dy_to_channels", dy, 0, dy_channels);
  SelectiveScanArgs<Mem> scan =
      impl::mamba1_scan_args<SelectiveScanArgs<Mem>>(p, a.xc_channels, a.delta_channels, a.A, a.B, a.C, a.z_channels);
  scan.seq_idx = seq_idx;
  SelectiveScanGrads<Mem> sg;
  sg.du = channels("kmamba::mamba1::dxc_channels");
  sg.ddelta = channels("kmamba::mamba1::ddelta_channels");
  sg.dz = channels("kmamba::mamba1::dz_channels");
  sg.dA = allocate_uninitialized<Tensor2<float, Mem>>("kmamba::mamba1::dA", d_inner_, d_state_);
  sg.dB = allocate_uninitialized<Tensor4<float, Mem>>("kmamba::mamba1::dB", batch, 1, d_state_, seqlen);
  sg.dC = allocate_uninitialized<Tensor4<float, Mem>>("kmamba::mamba1::dC", batch, 1, d_state_, seqlen);
  sg.dD = allocate_uninitialized<Tensor1<float, Mem>>("kmamba::mamba1::dD", d_inner_);
  sg.ddelta_bias = allocate_uninitialized<Tensor1<float, Mem>>("kmamba::mamba1::ddelta_bias", d_inner_);
  // Sequence parallel: the segment's gradients are those of the scan from its incoming state.
  Tensor3<float, Mem> dlast_state;
  if (parallel_.sequence_size() > 1) {
    dlast_state = last_state_gradient(exec, scan, dy_channels);
    scan.initial_state = a.ssm_initial;
  }
  selective_scan_backward(exec, scan, dy_channels, dlast_state, sg);
  Kokkos::parallel_for("kmamba::mamba1::scan_parameter_gradients",
                       Kokkos::RangePolicy<ExecutionSpace>(exec, 0, d_inner_),
                       impl::Mamba1AddScanGradients<Mem>{a.A, sg.dA, sg.dD, sg.ddelta_bias, g.A_log, g.D, g.dt_bias});

  // Back to token-major. dy is dead once packed; its buffer takes dxc.
  const Tensor2<float, Mem> dxc = dy;
  const Tensor2<float, Mem> ddelta = rows("kmamba::mamba1::ddelta", d_inner_);
  const Tensor2<float, Mem> dz = rows("kmamba::mamba1::dz", d_inner_);
  const Tensor2<float, Mem> dbc = rows("kmamba::mamba1::dbc", 2 * d_state_);
  impl::mamba1_relayout<false>(exec, "kmamba::mamba1::dxc_to_tokens", dxc, 0, sg.du);
  impl::mamba1_relayout<false>(exec, "kmamba::mamba1::ddelta_to_tokens", ddelta, 0, sg.ddelta);
  impl::mamba1_relayout<false>(exec, "kmamba::mamba1::dz_to_tokens", dz, 0, sg.dz);
  impl::mamba1_relayout<false>(exec, "kmamba::mamba1::dB_to_tokens", dbc, 0, impl::mamba1_group_squeezed(sg.dB));
  impl::mamba1_relayout<false>(exec, "kmamba::mamba1::dC_to_tokens", dbc, d_state_, impl::mamba1_group_squeezed(sg.dC));

  // delta = dt·dt_projᵀ
  const Tensor2<float, Mem> ddt = rows("kmamba::mamba1::ddt", dt_rank_);
  gemm(Transpose::Yes, Transpose::No, ddelta, a.dt, 1.0f, g.dt_weight);
  gemm(Transpose::No, Transpose::No, ddelta, p.dt_weight, 0.0f, ddt);
  // [dt | B | C] = xc·x_projᵀ
  gemm(Transpose::Yes, Transpose::No, ddt, a.xc, 1.0f, g.x_dt);
  gemm(Transpose::Yes, Transpose::No, dbc, a.xc, 1.0f, g.x_bc);
  gemm(Transpose::No, Transpose::No, ddt, p.x_dt, 1.0f, dxc);
  gemm(Transpose::No, Transpose::No, dbc, p.x_bc, 1.0f, dxc);

  // xc = silu(conv(x) + bias). ddelta is dead after the x_proj products; its buffer takes dx.
  const Tensor2<float, Mem> dx = ddelta;
  backward_conv(exec, slab, dxc, dx);

  // [x | z] = u·in_projᵀ + bias
  gemm(Transpose::Yes, Transpose::No, dx, a.u, 1.0f, g.in_x);
  gemm(Transpose::Yes, Transpose::No, dz, a.u, 1.0f, g.in_z);
  if (dims.bias) {
    impl::mamba1_add_column_sums(exec, dx, g.in_bias, 0);
    impl::mamba1_add_column_sums(exec, dz, g.in_bias, d_inner_);
  }
  const Tensor2<float, Mem> du_rows = impl::token_rows(du);
  gemm(Transpose::No, Transpose::No, dx, p.in_x, 0.0f, du_rows);
  gemm(Transpose::No, Transpose::No, dz, p.in_z, 1.0f, du_rows);
}

template <class ExecutionSpace>
Tensor3<float, typename ExecutionSpace::memory_space> Mamba1Mixer<ExecutionSpace>::last_state_gradient(
    const ExecutionSpace& exec, const SelectiveScanArgs<memory_space>& args,
    const ConstTensor3<float, memory_space>& dy) const {  // (batch, d_inner, seqlen)
  using Mem = memory_space;
  // The gradient of this segment's last state is the one of the state entering the next segment,
  // composed over the later segments from what each segment's outputs give its incoming state
  // (docs/distributed.md §2.2).
  const std::int64_t batch = act_.batch;
  const auto from_outputs =
      allocate_uninitialized<Tensor3<float, Mem>>("kmamba::mamba1::d_ssm_incoming", batch, d_inner_, d_state_);
  selective_scan_state_correction_backward(exec, args, dy, from_outputs);
  if (act_.halo_mask.is_allocated())
    impl::mask_packed_rows(exec, ConstTensor2<float, Mem>(act_.halo_mask), from_outputs);
  const auto dlast_state =
      allocate_uninitialized<Tensor3<float, Mem>>("kmamba::mamba1::d_ssm_final", batch, d_inner_, d_state_);
  const std::size_t rows = static_cast<std::size_t>(batch), width = static_cast<std::size_t>(d_inner_) * d_state_;
  impl::segment_state_scan(exec, *parallel_.sequence, impl::SegmentScanDirection::Backward,
                           ConstTensor2<float, Mem>(act_.segment_decay.data(), rows, width),
                           ConstTensor2<float, Mem>(from_outputs.data(), rows, width),
                           Tensor2<float, Mem>(dlast_state.data(), rows, width));
  return dlast_state;
}

template <class ExecutionSpace>
void Mamba1Mixer<ExecutionSpace>::backward_conv(
    const ExecutionSpace& exec, const Slab& slab,
    const ConstTensor2<float, memory_space>& dxc,    // (batch·seqlen, d_inner)
    const Tensor2<float, memory_space>& dx) const {  // (batch·seqlen, d_inner)
  using Mem = memory_space;
  constexpr const char* function = "kmamba::Mamba1Mixer::backward";
  const Activations& a = act_;
  const std::int64_t batch = a.batch;
  const impl::Mamba1Dims dims = impl::mamba1_dims(config_);
  const impl::Mamba1Tensors<Mem> p = impl::mamba1_tensors(function, slab, prefix_, dims, false);
  const impl::Mamba1Tensors<Mem> g = impl::mamba1_tensors(function, slab, prefix_, dims, true);
  const auto dconv_weight =
      allocate_uninitialized<Tensor2<float, Mem>>("kmamba::mamba1::dconv_weight", d_inner_, d_conv_);
  const Tensor1<float, Mem> dconv_bias =
      dims.conv_bias ? allocate_uninitialized<Tensor1<float, Mem>>("kmamba::mamba1::dconv_bias", d_inner_)
                     : Tensor1<float, Mem>();
  // Sequence parallel: the halo's gradient comes back from the next rank and goes to the previous
  // one (no_peer without the split).
  const int previous = parallel_.previous_segment_rank(), next = parallel_.next_segment_rank();
  Tensor3<float, Mem> dconv_final, dconv_initial;
  if (next != no_peer) {
    dconv_final =
        allocate_uninitialized<Tensor3<float, Mem>>("kmamba::mamba1::d_conv_final", batch, d_inner_, d_conv_ - 1);
    parallel_.sequence->recv(exec, dconv_final, next);
  }
  if (previous != no_peer) {
    dconv_initial =
        allocate_uninitialized<Tensor3<float, Mem>>("kmamba::mamba1::d_conv_initial", batch, d_inner_, d_conv_ - 1);
  }
  causal_conv1d_backward(exec, impl::mamba1_token_tensor(a.x, batch), p.conv_weight, p.conv_bias, a.conv_initial,
                         impl::mamba1_token_tensor(dxc, batch), dconv_final, impl::mamba1_token_tensor(dx, batch),
                         dconv_weight, dconv_bias, dconv_initial, Conv1dActivation::silu,
                         this->sequence_ids(function, batch, a.seqlen));
  if (previous != no_peer) {
    if (a.halo_mask.is_allocated()) impl::mask_packed_halo(exec, ConstTensor2<float, Mem>(a.halo_mask), dconv_initial);
    parallel_.sequence->send(exec, dconv_initial, previous);
  }
  Kokkos::parallel_for(
      "kmamba::mamba1::conv_parameter_gradients", Kokkos::RangePolicy<ExecutionSpace>(exec, 0, d_inner_),
      impl::Mamba1AddConvGradients<Mem>{dconv_weight, dconv_bias, g.conv_weight, g.conv_bias, dims.conv_bias});
}

#define KMAMBA_INSTANTIATE(Exec) template class Mamba1Mixer<Exec>;
KMAMBA_FOR_EACH_BACKEND(KMAMBA_INSTANTIATE)
#undef KMAMBA_INSTANTIATE

}  // namespace kmamba
