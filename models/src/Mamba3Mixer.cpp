// The Mamba-3 mixer: forward, backward, recurrent inference and its tensor- and sequence-parallel
// split (Mamba3Mixer.hpp), on the mixer toolkit (MixerToolkit.hpp).
#include <kmamba/models/Mamba3Mixer.hpp>

#include "Mamba3Kernels.hpp"
#include "MixerToolkit.hpp"

#include <kmamba/backends/Gemm.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/ForEachBackend.hpp>
#include <kmamba/core/Mamba3Scan.hpp>
#include <kmamba/core/Random.hpp>
#include <kmamba/core/RmsNorm.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>

namespace kmamba {
namespace {

constexpr const char* segment_names[] = {"z", "x", "B", "C", "dd_dt", "dd_A", "trap", "angle"};

using impl::as_flat;
using impl::flat;
using impl::rows_of;

// A (rows, width) matrix as (rows·width / n, n).
template <class Mem>
Tensor2<float, Mem> as_vectors(const Tensor2<float, Mem>& m, int n) {
  return Tensor2<float, Mem>(m.data(), m.size() / static_cast<std::size_t>(n), static_cast<std::size_t>(n));
}

std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

template <class Exec, class Mem>
void accumulate(const Exec& exec, const Tensor1<float, Mem>& value, const Tensor1<float, Mem>& grad) {
  impl::accumulate(exec, "kmamba::mamba3::accumulate_grad", value, grad);
}

// The scan operands of one forward or backward (SISO: rank 1, the q/k views have a rank axis of 1).
template <class Mem>
struct ScanOperands {
  Tensor5<float, Mem> q, k;              // (batch, seqlen, rank, ngroups, dstate)
  Tensor4<float, Mem> v, z;              // (batch, seqlen, nheads, headdim); z absent with the output norm
  Tensor3<float, Mem> dt, adt, trap;     // (batch, nheads, seqlen)
  Tensor4<float, Mem> angles;            // (batch, seqlen, nheads, nangles)
  Tensor3<float, Mem> q_bias, k_bias;    // (nheads, rank, dstate)
  Tensor3<float, Mem> mimo_x, mimo_z, mimo_o;  // (nheads, rank, headdim), MIMO only
  Tensor1<float, Mem> D;                 // (nheads)
};

template <class Mem>
Mamba3SisoArgs<Mem> siso_args(const ScanOperands<Mem>& o, int chunk) {
  Mamba3SisoArgs<Mem> a;
  const auto& q = o.q;
  a.q = ConstTensor4<float, Mem>(q.data(), q.extent(0), q.extent(1), q.extent(3), q.extent(4));
  a.k = ConstTensor4<float, Mem>(o.k.data(), q.extent(0), q.extent(1), q.extent(3), q.extent(4));
  a.v = o.v;
  a.adt = o.adt;
  a.dt = o.dt;
  a.trap = o.trap;
  a.q_bias = ConstTensor2<float, Mem>(o.q_bias.data(), o.q_bias.extent(0), o.q_bias.extent(2));
  a.k_bias = ConstTensor2<float, Mem>(o.k_bias.data(), o.k_bias.extent(0), o.k_bias.extent(2));
  a.angles = o.angles;
  a.D = o.D;
  a.z = o.z;
  a.chunk_size = chunk;
  return a;
}

template <class Mem>
Mamba3MimoArgs<Mem> mimo_args(const ScanOperands<Mem>& o, int chunk) {
  Mamba3MimoArgs<Mem> a;
  a.q = o.q;
  a.k = o.k;
  a.v = o.v;
  a.adt = o.adt;
  a.dt = o.dt;
  a.trap = o.trap;
  a.q_bias = o.q_bias;
  a.k_bias = o.k_bias;
  a.angles = o.angles;
  a.mimo_v = o.mimo_x;
  if (o.z.is_allocated()) a.mimo_z = o.mimo_z;
  a.mimo_o = o.mimo_o;
  a.D = o.D;
  a.z = o.z;
  a.chunk_size = chunk;
  return a;
}

// The scan's four states with k and v on a rank axis (1 for SISO), as the SISO or MIMO states.
template <class Mem>
struct ScanStates {
  Tensor3<float, Mem> angle;  // (batch, nheads, nangles)
  Tensor4<float, Mem> ssm;    // (batch, nheads, headdim, d_state)
  Tensor4<float, Mem> k;      // (batch, nheads, rank, d_state)
  Tensor4<float, Mem> v;      // (batch, nheads, rank, headdim)

  static ScanStates make(const std::string& what, std::int64_t batch, int nheads, int nangles, int headdim,
                         int d_state, int rank) {
    ScanStates s;
    s.angle = allocate_uninitialized<Tensor3<float, Mem>>("kmamba::mamba3::" + what + "_angle", batch, nheads, nangles);
    s.ssm = allocate_uninitialized<Tensor4<float, Mem>>("kmamba::mamba3::" + what + "_ssm", batch, nheads, headdim,
                                                        d_state);
    s.k = allocate_uninitialized<Tensor4<float, Mem>>("kmamba::mamba3::" + what + "_k", batch, nheads, rank, d_state);
    s.v = allocate_uninitialized<Tensor4<float, Mem>>("kmamba::mamba3::" + what + "_v", batch, nheads, rank, headdim);
    return s;
  }
  bool allocated() const { return ssm.is_allocated(); }
  Mamba3SisoStates<Mem> siso() const {
    Mamba3SisoStates<Mem> s;
    if (!allocated()) return s;
    s.angle = angle;
    s.ssm = ssm;
    s.k = Tensor3<float, Mem>(k.data(), k.extent(0), k.extent(1), k.extent(3));
    s.v = Tensor3<float, Mem>(v.data(), v.extent(0), v.extent(1), v.extent(3));
    return s;
  }
  Mamba3MimoStates<Mem> mimo() const { return {angle, ssm, k, v}; }
  // Sends the four states to (receives them from) rank `peer` of `comm`, in one fixed order.
  template <class Exec>
  void send(const Exec& exec, const Communicator& comm, int peer) const {
    comm.send(exec, angle, peer);
    comm.send(exec, ssm, peer);
    comm.send(exec, k, peer);
    comm.send(exec, v, peer);
  }
  template <class Exec>
  void recv(const Exec& exec, const Communicator& comm, int peer) const {
    comm.recv(exec, angle, peer);
    comm.recv(exec, ssm, peer);
    comm.recv(exec, k, peer);
    comm.recv(exec, v, peer);
  }
};

}  // namespace

template <class ExecutionSpace>
Mamba3Mixer<ExecutionSpace>::Mamba3Mixer(const ModelConfig& config, const std::string& prefix)
    : Mamba3Mixer(config, prefix, ModelParallel()) {}

template <class ExecutionSpace>
Mamba3Mixer<ExecutionSpace>::Mamba3Mixer(const ModelConfig& config, const std::string& prefix,
                                         const ModelParallel& parallel)
    : config_(config), prefix_(prefix), parallel_(parallel) {
  config_.validate();
  KMAMBA_REQUIRE(config_.mixer == MixerKind::Mamba3, "kmamba::Mamba3Mixer: the config's mixer is "
                                                         << mixer_name(config_.mixer) << ", not Mamba3");
  KMAMBA_REQUIRE(!config_.bias, "kmamba::Mamba3Mixer: bias is true, but the Mamba-3 projections have no bias");
  KMAMBA_REQUIRE(!(config_.is_mimo && config_.is_outproj_norm),
                 "kmamba::Mamba3Mixer: is_outproj_norm with is_mimo is not supported (the per-rank output norm "
                 "comes before the mimo_o contraction, which the MIMO scan fuses)");
  const int t = parallel_.tensor_size();
  KMAMBA_REQUIRE(config_.num_heads() % t == 0 && config_.ngroups % t == 0,
                 "kmamba::Mamba3Mixer: tensor_parallel_size " << t << " must divide nheads " << config_.num_heads()
                                                              << " and ngroups " << config_.ngroups
                                                              << " (each rank holds whole heads with their B/C group)");
  d_model_ = config_.d_model;
  d_inner_ = config_.d_inner() / t;
  nheads_ = config_.num_heads() / t;
  headdim_ = config_.headdim;
  ngroups_ = config_.ngroups / t;
  d_state_ = config_.d_state;
  const int split = static_cast<int>(std::floor(d_state_ * config_.rope_fraction));
  nangles_ = (split - split % 2) / 2;
  KMAMBA_REQUIRE(nangles_ >= 1, "kmamba::Mamba3Mixer: d_state " << d_state_ << " with rope_fraction "
                                                                << config_.rope_fraction
                                                                << " leaves no rotary angle (need d_state·rope_fraction >= 2)");
  rank_ = config_.is_mimo ? config_.mimo_rank : 1;
  chunk_ = config_.is_mimo ? std::max(1, config_.chunk_size / rank_) : config_.chunk_size;
  const int rgn = rank_ * ngroups_ * d_state_;
  segment_widths_ = {d_inner_, d_inner_, rgn, rgn, nheads_, nheads_, nheads_, nangles_};
  int offset = 0;
  for (int s = 0; s < segment_count; ++s) {
    segment_offsets_[s] = offset;
    offset += segment_widths_[s];
  }
  in_proj_rows_ = offset;
}

template <class ExecutionSpace>
std::vector<MixerParameter> Mamba3Mixer<ExecutionSpace>::parameter_specs() const {
  std::vector<MixerParameter> specs;
  specs.push_back({"in_proj.weight", {in_proj_rows_, d_model_}, WeightDecay::Yes});
  specs.push_back({"dt_bias", {nheads_}, WeightDecay::No});
  specs.push_back({"B_bias", {nheads_, rank_, d_state_}, WeightDecay::No});
  specs.push_back({"C_bias", {nheads_, rank_, d_state_}, WeightDecay::No});
  specs.push_back({"B_norm.weight", {d_state_}, WeightDecay::No});
  specs.push_back({"C_norm.weight", {d_state_}, WeightDecay::No});
  specs.push_back({"D", {nheads_}, WeightDecay::No});
  if (config_.is_mimo) {
    for (const char* name : {"mimo_x", "mimo_z", "mimo_o"}) {
      specs.push_back({name, {nheads_, rank_, headdim_}, WeightDecay::No});
    }
  }
  if (config_.is_outproj_norm) specs.push_back({"norm.weight", {d_inner_}, WeightDecay::No});
  specs.push_back({"out_proj.weight", {d_model_, d_inner_}, WeightDecay::Yes});
  return specs;
}

template <class ExecutionSpace>
void Mamba3Mixer<ExecutionSpace>::declare_parameters(Slab& slab) const {
  impl::declare_mixer_parameters(slab, prefix_, parameter_specs());
}

template <class ExecutionSpace>
void Mamba3Mixer<ExecutionSpace>::check_parameters(const char* function, const Slab& slab) const {
  impl::check_mixer_parameters(function, slab, prefix_, parameter_specs());
}

template <class ExecutionSpace>
std::vector<ShardedParameter> Mamba3Mixer<ExecutionSpace>::sharded_parameters() const {
  const std::int64_t t = parallel_.tensor_size(), r = parallel_.tensor_rank();
  if (t == 1) return {};
  const std::int64_t d = d_model_, E = d_inner_ * t, H = nheads_ * t, R = rank_, N = d_state_, P = headdim_;
  const std::int64_t GN = ngroups_ * d_state_;  // this rank's B (or C) values per mimo rank
  std::vector<ShardedParameter> out;
  // in_proj.weight: rank r's block of z, x, dd_dt, dd_A, trap; of B and C its groups within each
  // of the R rank blocks; the angle rows whole (replicated).
  ShardedParameter in_proj{prefix_ + "in_proj.weight", {2 * E + 2 * R * GN * t + 3 * H + nangles_, d}, {}};
  std::int64_t full = 0;
  for (int s = 0; s < segment_count; ++s) {
    const std::int64_t local = segment_offsets_[s], width = segment_widths_[s];
    if (s == angle_segment) {
      in_proj.runs.push_back({full * d, local * d, width * d, true});
    } else if (s == B_segment || s == C_segment) {
      for (std::int64_t q = 0; q < R; ++q) {
        in_proj.runs.push_back({(full + (q * t + r) * GN) * d, (local + q * GN) * d, GN * d});
      }
    } else {
      in_proj.runs.push_back({(full + r * width) * d, local * d, width * d});
    }
    full += s == angle_segment ? width : width * t;
  }
  out.push_back(in_proj);
  const auto heads = [&](const char* name, std::vector<std::int64_t> full_shape, std::int64_t per_head) {
    out.push_back({prefix_ + name, std::move(full_shape), {{r * nheads_ * per_head, 0, nheads_ * per_head}}});
  };
  heads("dt_bias", {H}, 1);
  heads("B_bias", {H, R, N}, R * N);
  heads("C_bias", {H, R, N}, R * N);
  heads("D", {H}, 1);
  if (config_.is_mimo) {
    for (const char* name : {"mimo_x", "mimo_z", "mimo_o"}) heads(name, {H, R, P}, R * P);
  }
  if (config_.is_outproj_norm) heads("norm.weight", {E}, P);
  ShardedParameter out_proj{prefix_ + "out_proj.weight", {d, E}, {}};
  for (std::int64_t i = 0; i < d; ++i) out_proj.runs.push_back({i * E + r * d_inner_, i * d_inner_, d_inner_});
  out.push_back(out_proj);
  return out;
}

template <class ExecutionSpace>
void Mamba3Mixer<ExecutionSpace>::initialize(const ExecutionSpace& exec, const Slab& slab, std::uint64_t seed) const {
  check_parameters("kmamba::Mamba3Mixer::initialize", slab);
  if (parallel_.tensor_size() > 1) {
    impl::initialize_shard(exec, Mamba3Mixer(config_, prefix_), *this, slab, seed, "kmamba::mamba3::unsplit_init");
    return;
  }
  const auto param = [&](const char* name) { return flat(slab.params(), slab, prefix_ + name); };
  const auto uniform = [&](const char* name, double bound) {
    fill_uniform(exec, param(name), impl::parameter_seed(seed, prefix_ + name), static_cast<float>(-bound),
                 static_cast<float>(bound));
  };
  uniform("in_proj.weight", 1.0 / std::sqrt(static_cast<double>(d_model_)));
  double out_bound = 1.0 / std::sqrt(static_cast<double>(d_inner_));
  if (config_.rescale_prenorm_residual) out_bound /= std::sqrt(static_cast<double>(config_.n_layer));
  uniform("out_proj.weight", out_bound);
  for (const char* name : {"B_norm.weight", "C_norm.weight", "D"}) Kokkos::deep_copy(exec, param(name), 1.0f);
  for (const char* name : {"B_bias", "C_bias"}) {
    Kokkos::deep_copy(exec, param(name), static_cast<float>(config_.bc_bias_init));
  }
  if (config_.is_mimo) {
    Kokkos::deep_copy(exec, param("mimo_x"), 1.0f / static_cast<float>(rank_));
    Kokkos::deep_copy(exec, param("mimo_z"), 1.0f);
    Kokkos::deep_copy(exec, param("mimo_o"), 1.0f / static_cast<float>(rank_));
  }
  if (config_.is_outproj_norm) Kokkos::deep_copy(exec, param("norm.weight"), 1.0f);
  impl::initialize_dt_bias<float>(exec, "kmamba::mamba3::init_dt_bias", config_, param("dt_bias"),
                                  impl::parameter_seed(seed, prefix_ + "dt_bias"));
}

template <class ExecutionSpace>
typename Mamba3Mixer<ExecutionSpace>::Activations Mamba3Mixer<ExecutionSpace>::make_activations(std::int64_t batch,
                                                                                                std::int64_t seqlen,
                                                                                                bool training) const {
  using Mem = memory_space;
  const std::int64_t rows = batch * seqlen;
  const std::int64_t vectors = rows * rank_ * ngroups_;
  Activations a;
  a.batch = batch;
  a.seqlen = seqlen;
  if (training) a.u = allocate_uninitialized<Matrix>("kmamba::mamba3::u", rows, d_model_);
  for (int s = 0; s < segment_count; ++s) {
    a.pre[s] = allocate_uninitialized<Matrix>(std::string("kmamba::mamba3::in_proj_") + segment_names[s], rows,
                                              segment_widths_[s]);
  }
  a.Bn = allocate_uninitialized<Matrix>("kmamba::mamba3::B_normed", vectors, d_state_);
  a.Cn = allocate_uninitialized<Matrix>("kmamba::mamba3::C_normed", vectors, d_state_);
  a.Brstd = allocate_uninitialized<Tensor1<float, Mem>>("kmamba::mamba3::B_rstd", vectors);
  a.Crstd = allocate_uninitialized<Tensor1<float, Mem>>("kmamba::mamba3::C_rstd", vectors);
  a.dt = allocate_uninitialized<Tensor3<float, Mem>>("kmamba::mamba3::dt", batch, nheads_, seqlen);
  a.adt = allocate_uninitialized<Tensor3<float, Mem>>("kmamba::mamba3::adt", batch, nheads_, seqlen);
  a.trap = allocate_uninitialized<Tensor3<float, Mem>>("kmamba::mamba3::trap", batch, nheads_, seqlen);
  a.angles = allocate_uninitialized<Tensor4<float, Mem>>("kmamba::mamba3::angles", batch, seqlen, nheads_, nangles_);
  a.y = allocate_uninitialized<Matrix>("kmamba::mamba3::scan_out", rows, d_inner_);
  if (config_.is_outproj_norm) {
    a.rstd = allocate_uninitialized<Matrix>("kmamba::mamba3::norm_rstd", rows, nheads_);
    a.normed = allocate_uninitialized<Matrix>("kmamba::mamba3::norm_out", rows, d_inner_);
  }
  if (parallel_.sequence_size() > 1) {  // zero on the first rank, which receives nothing
    a.angle_initial = allocate<Tensor3<float, Mem>>("kmamba::mamba3::angle_initial", batch, nheads_, nangles_);
    a.ssm_initial = allocate<Tensor4<float, Mem>>("kmamba::mamba3::ssm_initial", batch, nheads_, headdim_, d_state_);
    a.k_initial = allocate<Tensor4<float, Mem>>("kmamba::mamba3::k_initial", batch, nheads_, rank_, d_state_);
    a.v_initial = allocate<Tensor4<float, Mem>>("kmamba::mamba3::v_initial", batch, nheads_, rank_, headdim_);
  }
  return a;
}

template <class ExecutionSpace>
class Mamba3Mixer<ExecutionSpace>::Cache final : public MixerCache<ExecutionSpace> {
 public:
  using Mem = typename ExecutionSpace::memory_space;

  Cache(const Mamba3Mixer& m, int batch) : MixerCache<ExecutionSpace>(batch), shape(m.shape_key()) {
    const int R = m.rank_, H = m.nheads_;
    for (int i = 0; i < 2; ++i) {
      const std::string which = i == 0 ? "" : "_before_prefill";
      angle[i] = allocate<Tensor3<float, Mem>>("kmamba::decode::mamba3::angle_state" + which, batch, H, m.nangles_);
      ssm[i] = allocate<Tensor4<float, Mem>>("kmamba::decode::mamba3::ssm_state" + which, batch, H, m.headdim_,
                                            m.d_state_);
      k[i] = allocate<Tensor4<float, Mem>>("kmamba::decode::mamba3::k_state" + which, batch, H, R, m.d_state_);
      v[i] = allocate<Tensor4<float, Mem>>("kmamba::decode::mamba3::v_state" + which, batch, H, R, m.headdim_);
    }
    for (int s = 0; s < segment_count; ++s) {
      pre[s] = allocate_uninitialized<Matrix>(std::string("kmamba::decode::mamba3::in_proj_") + segment_names[s], batch,
                                              m.segment_widths_[s]);
    }
    Bn = allocate_uninitialized<Matrix>("kmamba::decode::mamba3::B_normed", batch * R * m.ngroups_, m.d_state_);
    Cn = allocate_uninitialized<Matrix>("kmamba::decode::mamba3::C_normed", batch * R * m.ngroups_, m.d_state_);
    dt = allocate_uninitialized<Tensor3<float, Mem>>("kmamba::decode::mamba3::dt", batch, H, 1);
    adt = allocate_uninitialized<Tensor3<float, Mem>>("kmamba::decode::mamba3::adt", batch, H, 1);
    trap = allocate_uninitialized<Tensor3<float, Mem>>("kmamba::decode::mamba3::trap", batch, H, 1);
    angles = allocate_uninitialized<Tensor4<float, Mem>>("kmamba::decode::mamba3::angles", batch, 1, H, m.nangles_);
    y = allocate_uninitialized<Matrix>("kmamba::decode::mamba3::scan_out", batch, m.d_inner_);
    if (m.config_.is_outproj_norm) {
      normed = allocate_uninitialized<Matrix>("kmamba::decode::mamba3::norm_out", batch, m.d_inner_);
    }
  }

  void reset(const ExecutionSpace& exec) override {
    Kokkos::deep_copy(exec, angle[0], 0.0f);
    Kokkos::deep_copy(exec, ssm[0], 0.0f);
    Kokkos::deep_copy(exec, k[0], 0.0f);
    Kokkos::deep_copy(exec, v[0], 0.0f);
  }

  // State set i as the SISO / MIMO scan's states ([0]: the current states; [1]: a copy of them
  // taken by prefill, the scan's initial states, since it writes the final ones into [0]).
  Mamba3SisoStates<Mem> siso(int i) const {
    Mamba3SisoStates<Mem> s;
    s.angle = angle[i];
    s.ssm = ssm[i];
    s.k = Tensor3<float, Mem>(k[i].data(), k[i].extent(0), k[i].extent(1), k[i].extent(3));
    s.v = Tensor3<float, Mem>(v[i].data(), v[i].extent(0), v[i].extent(1), v[i].extent(3));
    return s;
  }
  Mamba3MimoStates<Mem> mimo(int i) const {
    Mamba3MimoStates<Mem> s;
    s.angle = angle[i];
    s.ssm = ssm[i];
    s.k = k[i];
    s.v = v[i];
    return s;
  }

  std::array<int, 7> shape;                      // the dimensions of the mixer that made it
  std::array<Tensor3<float, Mem>, 2> angle;      // (batch, nheads, nangles)
  std::array<Tensor4<float, Mem>, 2> ssm;        // (batch, nheads, headdim, d_state)
  std::array<Tensor4<float, Mem>, 2> k;          // (batch, nheads, rank, d_state)
  std::array<Tensor4<float, Mem>, 2> v;          // (batch, nheads, rank, headdim)
  std::array<Matrix, segment_count> pre;         // (batch, width) per in_proj segment
  Matrix Bn, Cn;                                 // (batch·rank·ngroups, d_state)
  Tensor3<float, Mem> dt, adt, trap;             // (batch, nheads, 1)
  Tensor4<float, Mem> angles;                    // (batch, 1, nheads, nangles)
  Matrix y;                                      // (batch, d_inner)
  Matrix normed;                                 // (batch, d_inner), with the output norm
};

template <class ExecutionSpace>
void Mamba3Mixer<ExecutionSpace>::project(const ExecutionSpace& exec, const Slab& slab, const std::string& weight,
                                          int offset, int width, const ConstMatrix& u, const Matrix& out) const {
  using Mem = memory_space;
  const Tensor2<float, Mem> w = slab.template param<2>(weight);  // (features, k)
  gemm<ExecutionSpace, Mem>(exec, Transpose::No, Transpose::Yes, 1.0f, u,
                            rows_of<Mem>(w.data(), offset, width, static_cast<int>(w.extent(1))), 0.0f, out,
                            this->matmul_precision());
}

template <class ExecutionSpace>
void Mamba3Mixer<ExecutionSpace>::run_forward(const ExecutionSpace& exec, const Slab& slab, const ConstMatrix& u,
                                              const Matrix& out, Activations& a, Cache* cache) const {
  using Mem = memory_space;
  const std::int64_t batch = a.batch, seqlen = a.seqlen, rows = batch * seqlen;
  const std::string& p = prefix_;
  const float eps = static_cast<float>(config_.norm_epsilon);
  const bool split_sequence = parallel_.sequence_size() > 1;
  const Communicator* const sequence = parallel_.sequence;
  const int k = parallel_.sequence_rank();
  const int previous = k > 0 ? k - 1 : no_peer, next = k + 1 < parallel_.sequence_size() ? k + 1 : no_peer;

  for (int s = 0; s < segment_count; ++s) {
    project(exec, slab, p + "in_proj.weight", segment_offsets_[s], segment_widths_[s], u, a.pre[s]);
  }
  rms_norm(exec, as_vectors(a.pre[B_segment], d_state_), slab.template param<1>(p + "B_norm.weight"), eps, a.Bn,
           a.Brstd);
  rms_norm(exec, as_vectors(a.pre[C_segment], d_state_), slab.template param<1>(p + "C_norm.weight"), eps, a.Cn,
           a.Crstd);
  Kokkos::parallel_for("kmamba::mamba3::preprocess",
                       Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, rows * nheads_),
                       impl::Mamba3PreprocessFunctor<Mem>{a.pre[dt_segment], a.pre[A_segment], a.pre[trap_segment],
                                                          a.pre[angle_segment], slab.template param<1>(p + "dt_bias"),
                                                          a.dt, a.adt, a.trap, a.angles,
                                                          static_cast<float>(config_.A_floor)});

  ScanOperands<Mem> o;
  const std::size_t b = sz(batch), L = sz(seqlen), R = sz(rank_), G = sz(ngroups_), N = sz(d_state_);
  const std::size_t H = sz(nheads_), P = sz(headdim_);
  o.q = Tensor5<float, Mem>(a.Cn.data(), b, L, R, G, N);
  o.k = Tensor5<float, Mem>(a.Bn.data(), b, L, R, G, N);
  o.v = Tensor4<float, Mem>(a.pre[x_segment].data(), b, L, H, P);
  if (!config_.is_outproj_norm) o.z = Tensor4<float, Mem>(a.pre[z_segment].data(), b, L, H, P);
  o.dt = a.dt;
  o.adt = a.adt;
  o.trap = a.trap;
  o.angles = a.angles;
  o.q_bias = slab.template param<3>(p + "C_bias");
  o.k_bias = slab.template param<3>(p + "B_bias");
  o.D = slab.template param<1>(p + "D");
  const Tensor4<float, Mem> y(a.y.data(), b, L, H, P);
  // Sequence parallel: the states entering this segment come from the previous rank, the final
  // states go to the next one.
  const ScanStates<Mem> sp_initial{a.angle_initial, a.ssm_initial, a.k_initial, a.v_initial};
  ScanStates<Mem> sp_final;
  if (split_sequence) {
    if (previous != no_peer) sp_initial.recv(exec, *sequence, previous);
    if (next != no_peer) sp_final = ScanStates<Mem>::make("final", batch, nheads_, nangles_, headdim_, d_state_, rank_);
  }
  if (config_.is_mimo) {
    o.mimo_x = slab.template param<3>(p + "mimo_x");
    o.mimo_z = slab.template param<3>(p + "mimo_z");
    o.mimo_o = slab.template param<3>(p + "mimo_o");
    Mamba3MimoArgs<Mem> args = mimo_args(o, chunk_);
    args.matmul_precision = this->scan_matmul_precision();
    Mamba3MimoStates<Mem> final_states;
    if (cache != nullptr) {
      final_states = cache->mimo(0);
      const Mamba3MimoStates<Mem> initial = cache->mimo(1);
      Kokkos::deep_copy(exec, initial.angle, final_states.angle);
      Kokkos::deep_copy(exec, initial.ssm, final_states.ssm);
      Kokkos::deep_copy(exec, initial.k, final_states.k);
      Kokkos::deep_copy(exec, initial.v, final_states.v);
      args.initial = initial;
    }
    if (split_sequence) {
      args.initial = sp_initial.mimo();
      final_states = sp_final.mimo();
    }
    mamba3_mimo_forward(exec, args, y, final_states);
  } else {
    Mamba3SisoArgs<Mem> args = siso_args(o, chunk_);
    args.matmul_precision = this->scan_matmul_precision();
    Mamba3SisoStates<Mem> final_states;
    if (cache != nullptr) {
      final_states = cache->siso(0);
      const Mamba3SisoStates<Mem> initial = cache->siso(1);
      Kokkos::deep_copy(exec, initial.angle, final_states.angle);
      Kokkos::deep_copy(exec, initial.ssm, final_states.ssm);
      Kokkos::deep_copy(exec, initial.k, final_states.k);
      Kokkos::deep_copy(exec, initial.v, final_states.v);
      args.initial = initial;
    }
    if (split_sequence) {
      args.initial = sp_initial.siso();
      final_states = sp_final.siso();
    }
    mamba3_siso_forward(exec, args, y, final_states);
  }
  if (split_sequence && next != no_peer) sp_final.send(exec, *sequence, next);

  if (config_.is_outproj_norm) {
    gated_rms_norm(exec, a.y, a.pre[z_segment], slab.template param<1>(p + "norm.weight"), eps, headdim_, true,
                   a.normed, a.rstd);
  }
  project(exec, slab, p + "out_proj.weight", 0, d_model_, config_.is_outproj_norm ? a.normed : a.y, out);
  sum_over_tensor_ranks(exec, out);  // row parallel: each tensor rank adds its channels' part
}

template <class ExecutionSpace>
void Mamba3Mixer<ExecutionSpace>::sum_over_tensor_ranks(const ExecutionSpace& exec, const Matrix& m) const {
  if (parallel_.tensor_size() > 1) parallel_.tensor->all_reduce(exec, m);
}

template <class ExecutionSpace>
void Mamba3Mixer<ExecutionSpace>::forward(const ExecutionSpace& exec, const Slab& slab,
                                          const ConstTensor3<float, memory_space>& u,  // (batch, seqlen, d_model)
                                          const Tensor3<float, memory_space>& out,     // (batch, seqlen, d_model)
                                          bool keep_for_backward) {
  constexpr const char* function = "kmamba::Mamba3Mixer::forward";
  check_shape(function, "u", u, Shape({Shape::any, Shape::any, d_model_}), "(batch, seqlen, d_model)");
  const auto batch = static_cast<std::int64_t>(u.extent(0));
  const auto seqlen = static_cast<std::int64_t>(u.extent(1));
  check_shape(function, "out", out, Shape({batch, seqlen, d_model_}), "(batch, seqlen, d_model) of u");
  check_allocated(function, "u", u);
  check_allocated(function, "out", out);
  KMAMBA_REQUIRE(u.span_is_contiguous() && out.span_is_contiguous(), function << ": u and out must be contiguous");
  check_parameters(function, slab);
  const std::int64_t rows = batch * seqlen;
  const ConstMatrix u2(u.data(), sz(rows), sz(d_model_));
  const Matrix out2(out.data(), sz(rows), sz(d_model_));
  if (keep_for_backward) {
    has_kept_ = false;
    if (!kept_.y.is_allocated() || kept_.batch != batch || kept_.seqlen != seqlen) {
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
void Mamba3Mixer<ExecutionSpace>::backward(const ExecutionSpace& exec, const Slab& slab,
                                           const ConstTensor3<float, memory_space>& dout,  // (batch, seqlen, d_model)
                                           const Tensor3<float, memory_space>& du) {       // (batch, seqlen, d_model)
  using Mem = memory_space;
  using Vector = Tensor1<float, Mem>;
  using T3 = Tensor3<float, Mem>;
  using T4 = Tensor4<float, Mem>;
  constexpr const char* function = "kmamba::Mamba3Mixer::backward";
  KMAMBA_REQUIRE(has_kept_, function << ": no activations were kept: call forward with keep_for_backward = true first");
  const Activations& a = kept_;
  const std::int64_t batch = a.batch, seqlen = a.seqlen, rows = batch * seqlen;
  check_shape(function, "dout", dout, Shape({batch, seqlen, d_model_}), "(batch, seqlen, d_model) of the last forward");
  check_shape(function, "du", du, Shape({batch, seqlen, d_model_}), "(batch, seqlen, d_model) of the last forward");
  check_allocated(function, "dout", dout);
  check_allocated(function, "du", du);
  KMAMBA_REQUIRE(dout.span_is_contiguous() && du.span_is_contiguous(), function << ": dout and du must be contiguous");
  check_parameters(function, slab);
  const ConstMatrix dout2(dout.data(), sz(rows), sz(d_model_));
  const Matrix du2(du.data(), sz(rows), sz(d_model_));
  const std::string& p = prefix_;
  const auto grad = [&](const char* name) { return flat(slab.grads(), slab, p + name); };
  const std::size_t b = sz(batch), L = sz(seqlen), R = sz(rank_), G = sz(ngroups_), N = sz(d_state_);
  const std::size_t H = sz(nheads_), P = sz(headdim_);
  const bool split_tensor = parallel_.tensor_size() > 1, split_sequence = parallel_.sequence_size() > 1;
  const Communicator* const sequence = parallel_.sequence;
  const int k = parallel_.sequence_rank();
  const int previous = k > 0 ? k - 1 : no_peer, next = k + 1 < parallel_.sequence_size() ? k + 1 : no_peer;
  // Tensor parallel: the gradients of the replicated B_norm.weight, C_norm.weight (d_state each) and
  // angle rows of in_proj.weight (nangles, d_model), partial over this rank's heads, summed over the
  // tensor ranks in one all-reduce.
  const Vector replicated_grads =
      split_tensor ? allocate_uninitialized<Vector>("kmamba::mamba3::d_replicated", 2 * d_state_ + nangles_ * d_model_)
                   : Vector();

  // out = (normed or y) · out_projᵀ.
  const Matrix dy_out = allocate_uninitialized<Matrix>("kmamba::mamba3::d_out_proj_in", rows, d_inner_);
  gemm<ExecutionSpace, Mem>(exec, Transpose::No, Transpose::No, 1.0f, dout2,
                            slab.template param<2>(p + "out_proj.weight"), 0.0f, dy_out, this->matmul_precision());
  gemm<ExecutionSpace, Mem>(exec, Transpose::Yes, Transpose::No, 1.0f, dout2,
                            config_.is_outproj_norm ? a.normed : a.y, 1.0f,
                            slab.template grad<2>(p + "out_proj.weight"), this->matmul_precision());

  std::array<Matrix, segment_count> dpre;
  for (int s = 0; s < segment_count; ++s) {
    dpre[s] = allocate_uninitialized<Matrix>(std::string("kmamba::mamba3::d_in_proj_") + segment_names[s], rows,
                                             segment_widths_[s]);
  }
  Matrix dy = dy_out;
  if (config_.is_outproj_norm) {
    dy = allocate_uninitialized<Matrix>("kmamba::mamba3::d_scan_out", rows, d_inner_);
    const Vector dnorm_weight = allocate_uninitialized<Vector>("kmamba::mamba3::d_norm_weight", d_inner_);
    gated_rms_norm_backward(exec, dy_out, a.y, a.pre[z_segment], slab.template param<1>(p + "norm.weight"), a.rstd,
                            headdim_, true, dy, dpre[z_segment], dnorm_weight);
    accumulate(exec, dnorm_weight, grad("norm.weight"));
  }

  // The scan.
  const Matrix dBn = allocate_uninitialized<Matrix>("kmamba::mamba3::d_B_normed", rows * rank_ * ngroups_, d_state_);
  const Matrix dCn = allocate_uninitialized<Matrix>("kmamba::mamba3::d_C_normed", rows * rank_ * ngroups_, d_state_);
  const T3 ddt = allocate_uninitialized<T3>("kmamba::mamba3::d_dt", batch, nheads_, seqlen);
  const T3 dadt = allocate_uninitialized<T3>("kmamba::mamba3::d_adt", batch, nheads_, seqlen);
  const T3 dtrap = allocate_uninitialized<T3>("kmamba::mamba3::d_trap", batch, nheads_, seqlen);
  const T4 dangles = allocate_uninitialized<T4>("kmamba::mamba3::d_angles", batch, seqlen, nheads_, nangles_);
  const T3 dC_bias = allocate_uninitialized<T3>("kmamba::mamba3::d_C_bias", nheads_, rank_, d_state_);
  const T3 dB_bias = allocate_uninitialized<T3>("kmamba::mamba3::d_B_bias", nheads_, rank_, d_state_);
  const Vector dD = allocate_uninitialized<Vector>("kmamba::mamba3::d_D", nheads_);
  const T4 dy4(dy.data(), b, L, H, P);
  const T4 dz4 = config_.is_outproj_norm ? T4() : T4(dpre[z_segment].data(), b, L, H, P);
  // Sequence parallel: the gradients of this segment's final states come back from the next rank,
  // those of its initial states go to the previous one.
  const ScanStates<Mem> sp_initial{a.angle_initial, a.ssm_initial, a.k_initial, a.v_initial};
  ScanStates<Mem> sp_dfinal, sp_dinitial;
  if (split_sequence) {
    if (next != no_peer) {
      sp_dfinal = ScanStates<Mem>::make("d_final", batch, nheads_, nangles_, headdim_, d_state_, rank_);
      sp_dfinal.recv(exec, *sequence, next);
    }
    if (previous != no_peer) {
      sp_dinitial = ScanStates<Mem>::make("d_initial", batch, nheads_, nangles_, headdim_, d_state_, rank_);
    }
  }

  ScanOperands<Mem> o;
  o.q = Tensor5<float, Mem>(a.Cn.data(), b, L, R, G, N);
  o.k = Tensor5<float, Mem>(a.Bn.data(), b, L, R, G, N);
  o.v = T4(a.pre[x_segment].data(), b, L, H, P);
  if (!config_.is_outproj_norm) o.z = T4(a.pre[z_segment].data(), b, L, H, P);
  o.dt = a.dt;
  o.adt = a.adt;
  o.trap = a.trap;
  o.angles = a.angles;
  o.q_bias = slab.template param<3>(p + "C_bias");
  o.k_bias = slab.template param<3>(p + "B_bias");
  o.D = slab.template param<1>(p + "D");
  if (config_.is_mimo) {
    o.mimo_x = slab.template param<3>(p + "mimo_x");
    o.mimo_z = slab.template param<3>(p + "mimo_z");
    o.mimo_o = slab.template param<3>(p + "mimo_o");
    Mamba3MimoGrads<Mem> g;
    g.dq = Tensor5<float, Mem>(dCn.data(), b, L, R, G, N);
    g.dk = Tensor5<float, Mem>(dBn.data(), b, L, R, G, N);
    g.dv = T4(dpre[x_segment].data(), b, L, H, P);
    g.dadt = dadt;
    g.ddt = ddt;
    g.dtrap = dtrap;
    g.dq_bias = dC_bias;
    g.dk_bias = dB_bias;
    g.dangles = dangles;
    g.dmimo_v = allocate_uninitialized<T3>("kmamba::mamba3::d_mimo_x", nheads_, rank_, headdim_);
    if (!config_.is_outproj_norm) {
      g.dmimo_z = allocate_uninitialized<T3>("kmamba::mamba3::d_mimo_z", nheads_, rank_, headdim_);
    }
    g.dmimo_o = allocate_uninitialized<T3>("kmamba::mamba3::d_mimo_o", nheads_, rank_, headdim_);
    g.dD = dD;
    g.dz = dz4;
    Mamba3MimoArgs<Mem> args = mimo_args(o, chunk_);
    args.matmul_precision = this->scan_matmul_precision();
    if (split_sequence) {
      args.initial = sp_initial.mimo();
      g.dinitial = sp_dinitial.mimo();
    }
    mamba3_mimo_backward(exec, args, dy4, split_sequence ? sp_dfinal.mimo() : Mamba3MimoStates<Mem>(), g);
    accumulate(exec, as_flat(g.dmimo_v), grad("mimo_x"));
    if (g.dmimo_z.is_allocated()) accumulate(exec, as_flat(g.dmimo_z), grad("mimo_z"));
    accumulate(exec, as_flat(g.dmimo_o), grad("mimo_o"));
  } else {
    Mamba3SisoGrads<Mem> g;
    g.dq = T4(dCn.data(), b, L, G, N);
    g.dk = T4(dBn.data(), b, L, G, N);
    g.dv = T4(dpre[x_segment].data(), b, L, H, P);
    g.dadt = dadt;
    g.ddt = ddt;
    g.dtrap = dtrap;
    g.dq_bias = Tensor2<float, Mem>(dC_bias.data(), H, N);
    g.dk_bias = Tensor2<float, Mem>(dB_bias.data(), H, N);
    g.dangles = dangles;
    g.dD = dD;
    g.dz = dz4;
    Mamba3SisoArgs<Mem> args = siso_args(o, chunk_);
    args.matmul_precision = this->scan_matmul_precision();
    if (split_sequence) {
      args.initial = sp_initial.siso();
      g.dinitial = sp_dinitial.siso();
    }
    mamba3_siso_backward(exec, args, dy4, split_sequence ? sp_dfinal.siso() : Mamba3SisoStates<Mem>(), g);
  }
  if (split_sequence && previous != no_peer) sp_dinitial.send(exec, *sequence, previous);
  accumulate(exec, dD, grad("D"));
  accumulate(exec, as_flat(dC_bias), grad("C_bias"));
  accumulate(exec, as_flat(dB_bias), grad("B_bias"));

  // B and C RMSNorms.
  const Vector dnorm_weight =
      split_tensor ? Vector(replicated_grads.data(), sz(d_state_))
                   : allocate_uninitialized<Vector>("kmamba::mamba3::d_BC_norm_weight", d_state_);
  const Vector dC_norm_weight = split_tensor ? Vector(replicated_grads.data() + d_state_, sz(d_state_)) : dnorm_weight;
  rms_norm_backward(exec, dBn, as_vectors(a.pre[B_segment], d_state_), slab.template param<1>(p + "B_norm.weight"),
                    a.Brstd, as_vectors(dpre[B_segment], d_state_), dnorm_weight);
  if (!split_tensor) accumulate(exec, dnorm_weight, grad("B_norm.weight"));
  rms_norm_backward(exec, dCn, as_vectors(a.pre[C_segment], d_state_), slab.template param<1>(p + "C_norm.weight"),
                    a.Crstd, as_vectors(dpre[C_segment], d_state_), dC_norm_weight);
  if (!split_tensor) accumulate(exec, dC_norm_weight, grad("C_norm.weight"));

  // Pre-processing: dd_dt, dd_A, trap, angle and dt_bias.
  Kokkos::parallel_for("kmamba::mamba3::preprocess_backward",
                       Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, rows * nheads_),
                       impl::Mamba3PreprocessBackwardFunctor<Mem>{
                           a.pre[dt_segment], a.pre[A_segment], slab.template param<1>(p + "dt_bias"), ddt, dadt, dtrap,
                           dpre[dt_segment], dpre[A_segment], dpre[trap_segment], static_cast<float>(config_.A_floor)});
  Kokkos::parallel_for("kmamba::mamba3::angle_grad",
                       Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, rows * nangles_),
                       impl::Mamba3AngleGradFunctor<Mem>{dangles, dpre[angle_segment]});
  impl::add_column_sums(exec, "kmamba::mamba3::dt_bias_grad", dpre[dt_segment], grad("dt_bias"), 0);

  // in_proj: weight gradients per segment, and du = Σ_segments dpre · in_proj rows.
  float* const w_in = slab.template param<2>(p + "in_proj.weight").data();  // (in_proj_rows, d_model)
  float* const dw_in = slab.template grad<2>(p + "in_proj.weight").data();  // (in_proj_rows, d_model)
  for (int s = 0; s < segment_count; ++s) {
    if (split_tensor && s == angle_segment) {  // replicated rows: summed over the tensor ranks below
      gemm<ExecutionSpace, Mem>(exec, Transpose::Yes, Transpose::No, 1.0f, dpre[s], a.u, 0.0f,
                                Matrix(replicated_grads.data() + 2 * d_state_, sz(nangles_), sz(d_model_)),
                                this->matmul_precision());
    } else {
      gemm<ExecutionSpace, Mem>(exec, Transpose::Yes, Transpose::No, 1.0f, dpre[s], a.u, 1.0f,
                                rows_of<Mem>(dw_in, segment_offsets_[s], segment_widths_[s], d_model_),
                                this->matmul_precision());
    }
    gemm<ExecutionSpace, Mem>(exec, Transpose::No, Transpose::No, 1.0f, dpre[s],
                              rows_of<Mem>(w_in, segment_offsets_[s], segment_widths_[s], d_model_),
                              s == 0 ? 0.0f : 1.0f, du2, this->matmul_precision());
  }
  if (split_tensor) {
    parallel_.tensor->all_reduce(exec, replicated_grads);
    accumulate(exec, Vector(replicated_grads.data(), sz(d_state_)), grad("B_norm.weight"));
    accumulate(exec, Vector(replicated_grads.data() + d_state_, sz(d_state_)), grad("C_norm.weight"));
    accumulate(exec, Vector(replicated_grads.data() + 2 * d_state_, sz(nangles_ * d_model_)),
               Vector(dw_in + sz(segment_offsets_[angle_segment]) * sz(d_model_), sz(nangles_ * d_model_)));
    sum_over_tensor_ranks(exec, du2);
  }
}

template <class ExecutionSpace>
void Mamba3Mixer<ExecutionSpace>::release_activations() {
  kept_ = Activations();
  has_kept_ = false;
}

template <class ExecutionSpace>
std::array<int, 7> Mamba3Mixer<ExecutionSpace>::shape_key() const {
  return {d_model_, nheads_, headdim_, ngroups_, d_state_, nangles_, rank_};
}

template <class ExecutionSpace>
std::unique_ptr<MixerCache<ExecutionSpace>> Mamba3Mixer<ExecutionSpace>::make_cache(int batch) const {
  KMAMBA_REQUIRE(batch >= 1, "kmamba::Mamba3Mixer::make_cache: batch must be at least 1, got " << batch);
  return std::unique_ptr<MixerCache<ExecutionSpace>>(new Cache(*this, batch));
}

template <class ExecutionSpace>
typename Mamba3Mixer<ExecutionSpace>::Cache& Mamba3Mixer<ExecutionSpace>::cache_of(const char* function,
                                                                                    MixerCache<ExecutionSpace>& cache,
                                                                                    std::int64_t batch) const {
  Cache* const mine = dynamic_cast<Cache*>(&cache);
  KMAMBA_REQUIRE(mine != nullptr && mine->shape == shape_key(),
                 function << ": the cache was not made by a Mamba-3 mixer of these dimensions (d_model " << d_model_
                          << ", nheads " << nheads_ << ", headdim " << headdim_ << ", ngroups " << ngroups_
                          << ", d_state " << d_state_ << ", nangles " << nangles_ << ", rank " << rank_ << ")");
  KMAMBA_REQUIRE(mine->batch() == batch,
                 function << ": the cache holds " << mine->batch() << " sequences but u has batch " << batch);
  return *mine;
}

template <class ExecutionSpace>
void Mamba3Mixer<ExecutionSpace>::prefill(const ExecutionSpace& exec, const Slab& slab,
                                          const ConstTensor3<float, memory_space>& u,  // (batch, seqlen, d_model)
                                          const Tensor3<float, memory_space>& out,     // (batch, seqlen, d_model)
                                          MixerCache<ExecutionSpace>& cache) {
  constexpr const char* function = "kmamba::Mamba3Mixer::prefill";
  check_shape(function, "u", u, Shape({Shape::any, Shape::any, d_model_}), "(batch, seqlen, d_model)");
  const auto batch = static_cast<std::int64_t>(u.extent(0));
  const auto seqlen = static_cast<std::int64_t>(u.extent(1));
  check_shape(function, "out", out, Shape({batch, seqlen, d_model_}), "(batch, seqlen, d_model) of u");
  Cache& c = cache_of(function, cache, batch);
  check_parameters(function, slab);
  KMAMBA_REQUIRE(parallel_.sequence_size() == 1,
                 function << ": a mixer split across " << parallel_.sequence_size()
                          << " sequence-parallel ranks does not run recurrent inference");
  release_activations();
  if (seqlen == 0) return;
  check_allocated(function, "u", u);
  check_allocated(function, "out", out);
  KMAMBA_REQUIRE(u.span_is_contiguous() && out.span_is_contiguous(), function << ": u and out must be contiguous");
  const std::int64_t rows = batch * seqlen;
  Activations local = make_activations(batch, seqlen, false);
  run_forward(exec, slab, ConstMatrix(u.data(), sz(rows), sz(d_model_)), Matrix(out.data(), sz(rows), sz(d_model_)),
              local, &c);
}

template <class ExecutionSpace>
void Mamba3Mixer<ExecutionSpace>::step(const ExecutionSpace& exec, const Slab& slab,
                                       const ConstTensor2<float, memory_space>& u,  // (batch, d_model)
                                       const Tensor2<float, memory_space>& out,     // (batch, d_model)
                                       MixerCache<ExecutionSpace>& cache) const {
  using Mem = memory_space;
  constexpr const char* function = "kmamba::Mamba3Mixer::step";
  check_shape(function, "u", u, Shape({Shape::any, d_model_}), "(batch, d_model)");
  const auto batch = static_cast<std::int64_t>(u.extent(0));
  check_shape(function, "out", out, Shape({batch, d_model_}), "(batch, d_model) of u");
  check_allocated(function, "u", u);
  check_allocated(function, "out", out);
  Cache& c = cache_of(function, cache, batch);
  check_parameters(function, slab);
  KMAMBA_REQUIRE(parallel_.sequence_size() == 1,
                 function << ": a mixer split across " << parallel_.sequence_size()
                          << " sequence-parallel ranks does not run recurrent inference");
  const std::string& p = prefix_;
  const float eps = static_cast<float>(config_.norm_epsilon);
  const std::size_t b = sz(batch), R = sz(rank_), G = sz(ngroups_), N = sz(d_state_), H = sz(nheads_);
  const std::size_t P = sz(headdim_), S = sz(nangles_);

  for (int s = 0; s < segment_count; ++s) {
    project(exec, slab, p + "in_proj.weight", segment_offsets_[s], segment_widths_[s], u, c.pre[s]);
  }
  rms_norm(exec, as_vectors(c.pre[B_segment], d_state_), slab.template param<1>(p + "B_norm.weight"), eps, c.Bn);
  rms_norm(exec, as_vectors(c.pre[C_segment], d_state_), slab.template param<1>(p + "C_norm.weight"), eps, c.Cn);
  Kokkos::parallel_for("kmamba::decode::mamba3::preprocess",
                       impl::light_weight(
                           Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, batch * nheads_)),
                       impl::Mamba3PreprocessFunctor<Mem>{c.pre[dt_segment], c.pre[A_segment], c.pre[trap_segment],
                                                          c.pre[angle_segment], slab.template param<1>(p + "dt_bias"),
                                                          c.dt, c.adt, c.trap, c.angles,
                                                          static_cast<float>(config_.A_floor)});
  const ConstTensor2<float, Mem> dt(c.dt.data(), b, H), adt(c.adt.data(), b, H), trap(c.trap.data(), b, H);
  const ConstTensor3<float, Mem> angles(c.angles.data(), b, H, S);
  const ConstTensor3<float, Mem> x(c.pre[x_segment].data(), b, H, P);
  const ConstTensor3<float, Mem> z =
      config_.is_outproj_norm ? ConstTensor3<float, Mem>() : ConstTensor3<float, Mem>(c.pre[z_segment].data(), b, H, P);
  const Tensor3<float, Mem> y(c.y.data(), b, H, P);
  if (config_.is_mimo) {
    Mamba3MimoStepArgs<Mem> args;
    args.q = ConstTensor4<float, Mem>(c.Cn.data(), b, R, G, N);
    args.k = ConstTensor4<float, Mem>(c.Bn.data(), b, R, G, N);
    args.v = x;
    args.adt = adt;
    args.dt = dt;
    args.trap = trap;
    args.q_bias = slab.template param<3>(p + "C_bias");
    args.k_bias = slab.template param<3>(p + "B_bias");
    args.angles = angles;
    args.mimo_v = slab.template param<3>(p + "mimo_x");
    if (z.is_allocated()) args.mimo_z = slab.template param<3>(p + "mimo_z");
    args.mimo_o = slab.template param<3>(p + "mimo_o");
    args.D = slab.template param<1>(p + "D");
    args.z = z;
    mamba3_mimo_step(exec, args, c.mimo(0), y);
  } else {
    Mamba3SisoStepArgs<Mem> args;
    args.q = ConstTensor3<float, Mem>(c.Cn.data(), b, G, N);
    args.k = ConstTensor3<float, Mem>(c.Bn.data(), b, G, N);
    args.v = x;
    args.adt = adt;
    args.dt = dt;
    args.trap = trap;
    args.q_bias = ConstTensor2<float, Mem>(slab.template param<3>(p + "C_bias").data(), H, N);
    args.k_bias = ConstTensor2<float, Mem>(slab.template param<3>(p + "B_bias").data(), H, N);
    args.angles = angles;
    args.D = slab.template param<1>(p + "D");
    args.z = z;
    mamba3_siso_step(exec, args, c.siso(0), y);
  }
  if (config_.is_outproj_norm) {
    gated_rms_norm(exec, c.y, c.pre[z_segment], slab.template param<1>(p + "norm.weight"), eps, headdim_, true,
                   c.normed);
  }
  project(exec, slab, p + "out_proj.weight", 0, d_model_, config_.is_outproj_norm ? c.normed : c.y, out);
  sum_over_tensor_ranks(exec, out);
}

#define KMAMBA_INSTANTIATE(Exec) template class Mamba3Mixer<Exec>;
KMAMBA_FOR_EACH_BACKEND(KMAMBA_INSTANTIATE)
#undef KMAMBA_INSTANTIATE

}  // namespace kmamba
