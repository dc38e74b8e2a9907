// The Mamba-3 mixer: forward, backward, recurrent inference and its tensor- and sequence-parallel
// split (Mamba3Mixer.hpp), on the mixer toolkit (MixerToolkit.hpp).
#include <kmamba/models/Mamba3Mixer.hpp>

#include "Mamba3Kernels.hpp"
#include "MixerToolkit.hpp"
#include "PackedSegments.hpp"
#include "SegmentStateScan.hpp"

#include <kmamba/backends/Gemm.hpp>
#include <kmamba/core/Error.hpp>
#include <kmamba/core/ForEachBackend.hpp>
#include <kmamba/core/Mamba3Scan.hpp>
#include <kmamba/core/Mamba3StateCorrection.hpp>
#include <kmamba/core/Random.hpp>
#include <kmamba/core/RmsNorm.hpp>
#include <kmamba/core/Shape.hpp>
#include <kmamba/core/impl/LightWeightLaunch.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <sstream>
#include <string>

namespace kmamba {
namespace {

constexpr const char* segment_names[] = {"z", "x", "B", "C", "dd_dt", "dd_A", "trap", "angle"};

using impl::as_flat;
using impl::flat;
using impl::rows_of;

// A view as the (size / last extent, last extent) matrix of its rows.
template <class View>
Tensor2<float, typename View::memory_space> as_matrix(const View& v) {
  const std::size_t last = v.extent(View::rank - 1);
  return Tensor2<float, typename View::memory_space>(v.data(), v.size() / last, last);
}

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

// A view of q, k or their biases (or gradients) with a rank axis of extent 1 as the SISO view
// without it: (batch, seqlen, 1, ngroups, dstate) → (batch, seqlen, ngroups, dstate) and
// (nheads, 1, dstate) → (nheads, dstate).
template <class T, class Mem>
Tensor4<T, Mem> without_rank(const Tensor5<T, Mem>& v) {
  return Tensor4<T, Mem>(v.data(), v.extent(0), v.extent(1), v.extent(3), v.extent(4));
}
template <class T, class Mem>
Tensor3<T, Mem> without_rank(const Tensor4<T, Mem>& v) {  // the k and v states: (batch, nheads, 1, n)
  return Tensor3<T, Mem>(v.data(), v.extent(0), v.extent(1), v.extent(3));
}
template <class T, class Mem>
Tensor2<T, Mem> without_rank(const Tensor3<T, Mem>& v) {
  return Tensor2<T, Mem>(v.data(), v.extent(0), v.extent(2));
}

// The SISO scan's arguments and gradients are the MIMO ones of rank 1 without the rank axis and
// the rank projections; the initial states and the kept ungated output are set by the caller.
template <class Mem>
Mamba3SisoArgs<Mem> siso_args(const Mamba3MimoArgs<Mem>& m) {
  return {without_rank(m.q),      without_rank(m.k), m.v, m.adt, m.dt, m.trap,    without_rank(m.q_bias),
          without_rank(m.k_bias), m.angles,          m.D, m.z,   {},   m.seq_idx, {},
          m.chunk_size,           m.matmul_precision};
}
template <class Mem>
Mamba3SisoGrads<Mem> siso_grads(const Mamba3MimoGrads<Mem>& g) {
  return {without_rank(g.dq),      without_rank(g.dk),      g.dv,      g.dadt, g.ddt, g.dtrap,
          without_rank(g.dq_bias), without_rank(g.dk_bias), g.dangles, g.dD,   g.dz,  {}};
}

// The scan's four states have k and v on a rank axis (1 for SISO): they are the MIMO states, and
// the SISO ones are their views without that axis.
template <class Mem>
Mamba3MimoStates<Mem> allocate_states(const std::string& what, std::int64_t batch, int nheads, int nangles, int headdim,
                                      int d_state, int rank) {
  const std::string label = "kmamba::mamba3::" + what;
  return {allocate_uninitialized<Tensor3<float, Mem>>(label + "_angle", batch, nheads, nangles),
          allocate_uninitialized<Tensor4<float, Mem>>(label + "_ssm", batch, nheads, headdim, d_state),
          allocate_uninitialized<Tensor4<float, Mem>>(label + "_k", batch, nheads, rank, d_state),
          allocate_uninitialized<Tensor4<float, Mem>>(label + "_v", batch, nheads, rank, headdim)};
}

// The SISO view of states of rank 1 (each absent where it is).
template <class Mem>
Mamba3SisoStates<Mem> siso_states(const Mamba3MimoStates<Mem>& s) {
  return {s.angle, s.ssm, s.k.is_allocated() ? without_rank(s.k) : Tensor3<float, Mem>(),
          s.v.is_allocated() ? without_rank(s.v) : Tensor3<float, Mem>()};
}

template <class Exec, class Mem>
void copy_states(const Exec& exec, const Mamba3MimoStates<Mem>& to, const Mamba3MimoStates<Mem>& from) {
  Kokkos::deep_copy(exec, to.angle, from.angle);
  Kokkos::deep_copy(exec, to.ssm, from.ssm);
  Kokkos::deep_copy(exec, to.k, from.k);
  Kokkos::deep_copy(exec, to.v, from.v);
}

// The states as the scan of `args` takes them: MIMO states, or their SISO views.
template <class Mem>
const Mamba3MimoStates<Mem>& scan_states(const Mamba3MimoArgs<Mem>&, const Mamba3MimoStates<Mem>& s) {
  return s;
}
template <class Mem>
Mamba3SisoStates<Mem> scan_states(const Mamba3SisoArgs<Mem>&, const Mamba3MimoStates<Mem>& s) {
  return siso_states(s);
}

// The scan of either variant.
template <class Exec, class Mem>
void scan_forward(const Exec& exec, const Mamba3SisoArgs<Mem>& args, const Tensor4<float, Mem>& y,
                  const Mamba3SisoStates<Mem>& final_states) {
  mamba3_siso_forward(exec, args, y, final_states);
}
template <class Exec, class Mem>
void scan_forward(const Exec& exec, const Mamba3MimoArgs<Mem>& args, const Tensor4<float, Mem>& y,
                  const Mamba3MimoStates<Mem>& final_states) {
  mamba3_mimo_forward(exec, args, y, final_states);
}
template <class Exec, class Mem>
void scan_backward(const Exec& exec, const Mamba3SisoArgs<Mem>& args, const Tensor4<float, Mem>& dy,
                   const Mamba3SisoStates<Mem>& dfinal, const Mamba3SisoGrads<Mem>& grads) {
  mamba3_siso_backward(exec, args, dy, dfinal, grads);
}
template <class Exec, class Mem>
void scan_backward(const Exec& exec, const Mamba3MimoArgs<Mem>& args, const Tensor4<float, Mem>& dy,
                   const Mamba3MimoStates<Mem>& dfinal, const Mamba3MimoGrads<Mem>& grads) {
  mamba3_mimo_backward(exec, args, dy, dfinal, grads);
}

// A (batch, nheads, ...) tensor as the (batch·nheads, rest) rows the segment scans compose.
template <class View>
Tensor2<float, typename View::memory_space> head_rows(const View& v) {
  const std::size_t rows = v.extent(0) * v.extent(1);
  return Tensor2<float, typename View::memory_space>(v.data(), rows, v.size() / rows);
}

// The states entering a segment and the segment's decay (Activations' sequence-parallel members).
// With packed rows (docs/distributed.md §2.4) a segment whose first token starts a document takes
// no state in and passes none of the earlier segments' on: its incoming states (and their
// gradients) and its decays are zero on that row.
template <class Mem>
struct SegmentInputs {
  Mamba3MimoStates<Mem> initial;       // angle, ssm, k, v entering the segment
  Tensor2<float, Mem> decay;           // (batch, nheads): exp(Σ adt) over the segment
  ConstTensor2<float, Mem> halo_mask;  // (batch, 1), packed rows: 0 where the segment starts a document
  // (batch, nheads), packed rows: the decay of the angle's pairs, 1 where the angle entering the
  // segment reaches its end (no document starts in it), else 0; absent: 1 everywhere.
  ConstTensor2<float, Mem> angle_carry;

  // The decays as the segment scans take them, one per (batch·nheads) row.
  ConstTensor2<float, Mem> decay_rows() const { return ConstTensor2<float, Mem>(decay.data(), decay.size(), 1); }
  // Zeroes the rows of `state` (batch first) whose segment starts a document.
  template <class Exec, class View>
  void mask_starts(const Exec& exec, const View& state) const {
    if (halo_mask.is_allocated()) impl::mask_packed_rows(exec, halo_mask, state);
  }
};

// This rank's neighbours along the sequence (no_peer at its ends) and the extents of the states
// entering its segment: batch, heads, headdim, dstate, angles and rank.
struct SegmentLayout {
  int previous, next;
  std::size_t b, H, P, N, S, R;

  template <class Mem>
  SegmentLayout(const Communicator& sequence, const Mamba3MimoStates<Mem>& s)
      : previous(sequence.rank() > 0 ? sequence.rank() - 1 : no_peer),
        next(sequence.rank() + 1 < sequence.size() ? sequence.rank() + 1 : no_peer),
        b(s.ssm.extent(0)),
        H(s.ssm.extent(1)),
        P(s.ssm.extent(2)),
        N(s.ssm.extent(3)),
        S(s.angle.extent(2)),
        R(s.k.extent(2)) {}
};

// The segments' exclusive sum over the sequence ranks in `direction` of the angles `local` (batch,
// nheads, n): the segment scan of pairs with the decays `carry` (batch, nheads) of 0s and 1s, or
// unit decays when absent.
template <class Exec, class Mem>
void sum_over_segments(const Exec& exec, const Communicator& sequence, impl::SegmentScanDirection direction,
                       const ConstTensor2<float, Mem>& carry, const Tensor3<float, Mem>& local,
                       const Tensor3<float, Mem>& incoming) {
  const std::size_t rows = local.extent(0) * local.extent(1);
  ConstTensor2<float, Mem> decays(carry.data(), rows, 1);
  if (!carry.is_allocated()) {
    const auto ones = allocate_uninitialized<Tensor2<float, Mem>>("kmamba::mamba3::unit_decay", rows, 1);
    Kokkos::deep_copy(exec, ones, 1.0f);
    decays = ones;
  }
  impl::segment_state_scan(exec, sequence, direction, decays, ConstTensor2<float, Mem>(head_rows(local)),
                           head_rows(incoming));
}

// Sequence parallel forward of one segment (docs/distributed.md §2.3). The angle entering it is the
// sum of the previous segments' angle totals and the previous token's k and v are the previous
// segment's last (a halo), both known before any scan; every rank then scans its segment from a
// zero SSM state at once, the (decay, final state) pairs give each the SSM state entering it, and
// its contribution is added to y (and the kept ungated output). Writes `in.initial` and `in.decay`.
// Packed rows (args.seq_idx): the ops stop each state at the segment's document starts; a start at
// its first token zeroes what enters it and what of the earlier segments it passes on.
template <class Exec, class Args, class Mem>
void scan_segment(const Exec& exec, const Communicator& sequence, Args args, const Tensor4<float, Mem>& y,
                  const SegmentInputs<Mem>& in) {
  using T3 = Tensor3<float, Mem>;
  using T4 = Tensor4<float, Mem>;
  const SegmentLayout at(sequence, in.initial);
  const int previous = at.previous, next = at.next;
  const Mamba3MimoStates<Mem>& s = in.initial;
  const std::size_t b = at.b, H = at.H, P = at.P, N = at.N, S = at.S, R = at.R;
  args.initial = {};
  const auto total = allocate_uninitialized<T3>("kmamba::mamba3::angle_total", b, H, S);
  mamba3_segment_states(exec, args, scan_states(args, {total, {}, {}, {}}), in.decay);
  in.mask_starts(exec, in.decay);
  sum_over_segments(exec, sequence, impl::SegmentScanDirection::Forward, in.angle_carry, total, s.angle);
  in.mask_starts(exec, s.angle);
  args.initial = scan_states(args, {s.angle, {}, {}, {}});
  const Mamba3MimoStates<Mem> last{{},
                                   {},
                                   allocate_uninitialized<T4>("kmamba::mamba3::k_final", b, H, R, N),
                                   allocate_uninitialized<T4>("kmamba::mamba3::v_final", b, H, R, P)};
  mamba3_segment_states(exec, args, scan_states(args, last), Tensor2<float, Mem>());
  sequence.send_recv(exec, last.k, next, s.k, previous);  // rank 0 keeps its zeros
  sequence.send_recv(exec, last.v, next, s.v, previous);
  in.mask_starts(exec, s.k);  // no previous-token term across a document start
  in.mask_starts(exec, s.v);
  args.initial = scan_states(args, {s.angle, {}, s.k, s.v});
  const auto final_ssm = allocate_uninitialized<T4>("kmamba::mamba3::ssm_final", b, H, P, N);
  scan_forward(exec, args, y, scan_states(args, {{}, final_ssm, {}, {}}));
  impl::segment_state_scan(exec, sequence, impl::SegmentScanDirection::Forward, in.decay_rows(),
                           ConstTensor2<float, Mem>(head_rows(final_ssm)), head_rows(s.ssm));
  in.mask_starts(exec, s.ssm);
  mamba3_state_correction_forward(exec, args, s.ssm, y, T4());
}

// Sequence parallel backward of one segment (docs/distributed.md §2.3), the mirror of scan_segment:
// the gradient the outputs give the incoming SSM state, composed over the later segments into the
// final state's; the gradients of the previous segment's last k and v through the state entering
// this one, sent back before any scan; the scan's backward from the incoming states; then the final
// angle's gradient (the later segments' angle gradients summed) added to those of the angles and dt.
// Packed rows: the gradients of the states zeroed on entry (the segment starts a document) are zero.
template <class Exec, class Args, class Grads, class Mem>
void backward_segment(const Exec& exec, const Communicator& sequence, Args args, const Tensor4<float, Mem>& dy,
                      const SegmentInputs<Mem>& in, const Grads& grads) {
  using T3 = Tensor3<float, Mem>;
  using T4 = Tensor4<float, Mem>;
  const SegmentLayout at(sequence, in.initial);
  const int previous = at.previous, next = at.next;
  const Mamba3MimoStates<Mem>& s = in.initial;
  const std::size_t b = at.b, H = at.H, P = at.P, N = at.N, S = at.S, R = at.R;
  args.initial = scan_states(args, s);
  const auto from_outputs = allocate_uninitialized<T4>("kmamba::mamba3::d_ssm_incoming", b, H, P, N);
  mamba3_state_correction_backward(exec, args, dy, from_outputs);
  in.mask_starts(exec, from_outputs);
  const auto dfinal_ssm = allocate_uninitialized<T4>("kmamba::mamba3::d_ssm_final", b, H, P, N);
  impl::segment_state_scan(exec, sequence, impl::SegmentScanDirection::Backward, in.decay_rows(),
                           ConstTensor2<float, Mem>(head_rows(from_outputs)), head_rows(dfinal_ssm));
  const Mamba3MimoStates<Mem> dinitial{{},
                                       {},
                                       allocate_uninitialized<T4>("kmamba::mamba3::d_k_initial", b, H, R, N),
                                       allocate_uninitialized<T4>("kmamba::mamba3::d_v_initial", b, H, R, P)};
  if (previous != no_peer) {
    const auto dentering = allocate_uninitialized<T4>("kmamba::mamba3::d_ssm_entering", b, H, P, N);
    impl::segment_state_inclusive(exec, in.decay_rows(), ConstTensor2<float, Mem>(head_rows(from_outputs)),
                                  ConstTensor2<float, Mem>(head_rows(dfinal_ssm)), head_rows(dentering));
    mamba3_initial_kv_backward(exec, args, dentering, scan_states(args, dinitial));
  }
  Mamba3MimoStates<Mem> dfinal{{}, dfinal_ssm, {}, {}};
  if (next != no_peer) {
    dfinal.k = allocate_uninitialized<T4>("kmamba::mamba3::d_k_final", b, H, R, N);
    dfinal.v = allocate_uninitialized<T4>("kmamba::mamba3::d_v_final", b, H, R, P);
  }
  sequence.send_recv(exec, dinitial.k, previous, dfinal.k, next);
  sequence.send_recv(exec, dinitial.v, previous, dfinal.v, next);
  const auto dangle_total = allocate_uninitialized<T3>("kmamba::mamba3::d_angle_initial", b, H, S);
  Grads g = grads;
  g.dinitial = scan_states(args, {dangle_total, {}, {}, {}});
  scan_backward(exec, args, dy, scan_states(args, dfinal), g);
  in.mask_starts(exec, dangle_total);
  const auto dfinal_angle = allocate_uninitialized<T3>("kmamba::mamba3::d_angle_final", b, H, S);
  sum_over_segments(exec, sequence, impl::SegmentScanDirection::Backward, in.angle_carry, dangle_total, dfinal_angle);
  if (next != no_peer) {
    mamba3_final_angle_backward(exec, args.angles, args.dt, dfinal_angle, g.dangles, g.ddt, args.seq_idx);
  }
}

}  // namespace

template <class ExecutionSpace>
Mamba3Mixer<ExecutionSpace>::Mamba3Mixer(const ModelConfig& config, const std::string& prefix)
    : Mamba3Mixer(config, prefix, ModelParallel()) {}

template <class ExecutionSpace>
Mamba3Mixer<ExecutionSpace>::Mamba3Mixer(const ModelConfig& config, const std::string& prefix,
                                         const ModelParallel& parallel)
    : config_(config), prefix_(prefix), parallel_(parallel) {
  config_.validate();
  KMAMBA_REQUIRE(config_.mixer == MixerKind::Mamba3,
                 "kmamba::Mamba3Mixer: the config's mixer is " << mixer_name(config_.mixer) << ", not Mamba3");
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
  KMAMBA_REQUIRE(nangles_ >= 1, "kmamba::Mamba3Mixer: d_state "
                                    << d_state_ << " with rope_fraction " << config_.rope_fraction
                                    << " leaves no rotary angle (need d_state·rope_fraction >= 2)");
  rank_ = config_.is_mimo ? config_.mimo_rank : 1;
  chunk_ = config_.is_mimo ? std::max(1, config_.chunk_size / rank_) : config_.chunk_size;
  const int bc_rows = rank_ * ngroups_ * d_state_;  // each of B and C
  segment_widths_ =
      std::array<int, segment_count>{d_inner_, d_inner_, bc_rows, bc_rows, nheads_, nheads_, nheads_, nangles_};
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
  // Kept for the backward, which then need not run the scan's forward again for the gate's gradient.
  if (training && !config_.is_mimo && !config_.is_outproj_norm) {
    a.ungated = allocate_uninitialized<Matrix>("kmamba::mamba3::scan_out_ungated", rows, d_inner_);
  }
  if (config_.is_outproj_norm) {
    a.rstd = allocate_uninitialized<Matrix>("kmamba::mamba3::norm_rstd", rows, nheads_);
    a.normed = allocate_uninitialized<Matrix>("kmamba::mamba3::norm_out", rows, d_inner_);
  }
  if (parallel_.sequence_size() > 1) {  // zero on the first rank, which receives nothing
    a.segment_decay = allocate_uninitialized<Tensor2<float, Mem>>("kmamba::mamba3::segment_decay", batch, nheads_);
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
      ssm[i] =
          allocate<Tensor4<float, Mem>>("kmamba::decode::mamba3::ssm_state" + which, batch, H, m.headdim_, m.d_state_);
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

  // State set i ([0]: the current states; [1]: a copy of them taken by prefill, the scan's initial
  // states, since it writes the final ones into [0]).
  Mamba3MimoStates<Mem> states(int i) const { return {angle[i], ssm[i], k[i], v[i]}; }

  std::array<int, 7> shape;                  // the dimensions of the mixer that made it
  std::array<Tensor3<float, Mem>, 2> angle;  // (batch, nheads, nangles)
  std::array<Tensor4<float, Mem>, 2> ssm;    // (batch, nheads, headdim, d_state)
  std::array<Tensor4<float, Mem>, 2> k;      // (batch, nheads, rank, d_state)
  std::array<Tensor4<float, Mem>, 2> v;      // (batch, nheads, rank, headdim)
  std::array<Matrix, segment_count> pre;     // (batch, width) per in_proj segment
  Matrix Bn, Cn;                             // (batch·rank·ngroups, d_state)
  Tensor3<float, Mem> dt, adt, trap;         // (batch, nheads, 1)
  Tensor4<float, Mem> angles;                // (batch, 1, nheads, nangles)
  Matrix y;                                  // (batch, d_inner)
  Matrix normed;                             // (batch, d_inner), with the output norm
};

template <class ExecutionSpace>
void Mamba3Mixer<ExecutionSpace>::project(const ExecutionSpace& exec, const Slab& slab, const std::string& weight,
                                          int offset, int width, const ConstMatrix& u, const Matrix& out,
                                          const ConstTensor1<bf16, memory_space>& bf16_parameters) const {
  using Mem = memory_space;
  const Tensor2<float, Mem> w = slab.template param<2>(weight);  // (features, k)
  impl::step_product(exec, slab, bf16_parameters, u,
                     rows_of<Mem>(w.data(), offset, width, static_cast<int>(w.extent(1))), 0.0f, out,
                     this->matmul_precision());
}

template <class ExecutionSpace>
impl::SegmentedInProj<typename ExecutionSpace::memory_space, Mamba3Mixer<ExecutionSpace>::segment_count>
Mamba3Mixer<ExecutionSpace>::in_proj(const Slab& slab) const {
  return {"kmamba::mamba3", this->matmul_precision(), slab.template param<2>(prefix_ + "in_proj.weight"), {},
          segment_offsets_, segment_widths_};
}

template <class ExecutionSpace>
Mamba3MimoArgs<typename ExecutionSpace::memory_space> Mamba3Mixer<ExecutionSpace>::scan_args(
    const Slab& slab, const Activations& a) const {
  using Mem = memory_space;
  const std::string& p = prefix_;
  const std::size_t b = sz(a.batch), L = sz(a.seqlen), R = sz(rank_), G = sz(ngroups_), N = sz(d_state_);
  const std::size_t H = sz(nheads_), P = sz(headdim_);
  Mamba3MimoArgs<Mem> args;
  args.q = ConstTensor5<float, Mem>(a.Cn.data(), b, L, R, G, N);
  args.k = ConstTensor5<float, Mem>(a.Bn.data(), b, L, R, G, N);
  args.v = ConstTensor4<float, Mem>(a.pre[x_segment].data(), b, L, H, P);
  args.adt = a.adt;
  args.dt = a.dt;
  args.trap = a.trap;
  args.q_bias = slab.template param<3>(p + "C_bias");
  args.k_bias = slab.template param<3>(p + "B_bias");
  args.angles = a.angles;
  if (config_.is_mimo) {
    args.mimo_v = slab.template param<3>(p + "mimo_x");
    if (!config_.is_outproj_norm) args.mimo_z = slab.template param<3>(p + "mimo_z");
    args.mimo_o = slab.template param<3>(p + "mimo_o");
  }
  args.D = slab.template param<1>(p + "D");
  if (!config_.is_outproj_norm) args.z = ConstTensor4<float, Mem>(a.pre[z_segment].data(), b, L, H, P);
  args.chunk_size = chunk_;
  // The SISO scan runs on the SSD and takes its precisions (BFloat16 included); MIMO's chunk stages fp32 or TF32.
  args.matmul_precision = config_.is_mimo ? this->scan_matmul_precision() : this->ssd_matmul_precision();
  return args;
}

template <class ExecutionSpace>
void Mamba3Mixer<ExecutionSpace>::forward_scan(const ExecutionSpace& exec, const Slab& slab, Activations& a,
                                               Cache* cache) const {
  using Mem = memory_space;
  Mamba3MimoArgs<Mem> args = scan_args(slab, a);
  args.seq_idx = this->sequence_ids("kmamba::Mamba3Mixer::forward", a.batch, a.seqlen);
  const bool split_packed = parallel_.sequence_size() > 1 && args.seq_idx.is_allocated();
  // Packed rows split across the sequence ranks: whether each segment starts a document (the id of
  // the previous segment's last token comes from its rank) and whether an angle passes through it.
  a.halo_mask = split_packed ? impl::packed_halo_mask(exec, *parallel_.sequence, parallel_.previous_segment_rank(),
                                                      parallel_.next_segment_rank(), args.seq_idx, 1)
                             : Tensor2<float, Mem>();
  a.angle_carry = split_packed
                      ? impl::packed_segment_carry(exec, ConstTensor2<float, Mem>(a.halo_mask), args.seq_idx, nheads_)
                      : Tensor2<float, Mem>();
  const Tensor4<float, Mem> y(a.y.data(), sz(a.batch), sz(a.seqlen), sz(nheads_), sz(headdim_));
  Mamba3SisoArgs<Mem> siso = siso_args(args);
  if (a.ungated.is_allocated())
    siso.ungated_out = Tensor4<float, Mem>(a.ungated.data(), y.extent(0), y.extent(1), y.extent(2), y.extent(3));
  if (parallel_.sequence_size() > 1) {
    const SegmentInputs<Mem> in{
        {a.angle_initial, a.ssm_initial, a.k_initial, a.v_initial}, a.segment_decay, a.halo_mask, a.angle_carry};
    if (config_.is_mimo) {
      scan_segment(exec, *parallel_.sequence, args, y, in);
    } else {
      scan_segment(exec, *parallel_.sequence, siso, y, in);
    }
    return;
  }
  // The scan starts from the cache's states (a copy of them, as it writes the final ones into the cache).
  Mamba3MimoStates<Mem> initial, final_states;
  if (cache != nullptr) {
    final_states = cache->states(0);
    initial = cache->states(1);
    copy_states(exec, initial, final_states);
  }
  if (config_.is_mimo) {
    args.initial = initial;
    mamba3_mimo_forward(exec, args, y, final_states);
  } else {
    siso.initial = siso_states(initial);
    mamba3_siso_forward(exec, siso, y, siso_states(final_states));
  }
}

template <class ExecutionSpace>
void Mamba3Mixer<ExecutionSpace>::run_forward(const ExecutionSpace& exec, const Slab& slab, const ConstMatrix& u,
                                              const Matrix& out, Activations& a, Cache* cache) const {
  using Mem = memory_space;
  const std::int64_t batch = a.batch, seqlen = a.seqlen, rows = batch * seqlen;
  const std::string& p = prefix_;
  const float eps = static_cast<float>(config_.norm_epsilon);

  impl::project_segments(exec, in_proj(slab), u, a.pre);
  rms_norm(exec, as_vectors(a.pre[B_segment], d_state_), slab.template param<1>(p + "B_norm.weight"), eps, a.Bn,
           a.Brstd);
  rms_norm(exec, as_vectors(a.pre[C_segment], d_state_), slab.template param<1>(p + "C_norm.weight"), eps, a.Cn,
           a.Crstd);
  impl::for_each_index(
      exec, "kmamba::mamba3::preprocess", rows * nheads_,
      impl::Mamba3PreprocessFunctor<Mem>{a.pre[dt_segment], a.pre[A_segment], a.pre[trap_segment], a.pre[angle_segment],
                                         slab.template param<1>(p + "dt_bias"), a.dt, a.adt, a.trap, a.angles,
                                         static_cast<float>(config_.A_floor)});

  forward_scan(exec, slab, a, cache);

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
  const auto [batch, seqlen] = impl::check_sequence_shapes(function, u, out, d_model_);
  this->sequence_ids(function, batch, seqlen);
  impl::check_contiguous(function, "u", u, "out", out);
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
  using Vector = Tensor1<float, memory_space>;
  constexpr const char* function = "kmamba::Mamba3Mixer::backward";
  const std::int64_t batch = kept_.batch, seqlen = kept_.seqlen, rows = batch * seqlen;
  impl::check_backward_arguments(function, has_kept_, batch, seqlen, d_model_, dout, du);
  this->sequence_ids(function, batch, seqlen);
  check_parameters(function, slab);
  const ConstMatrix dout2(dout.data(), sz(rows), sz(d_model_));
  const Matrix du2(du.data(), sz(rows), sz(d_model_));
  // Tensor parallel: the gradients of the replicated B_norm.weight, C_norm.weight (d_state each) and
  // angle rows of in_proj.weight (nangles, d_model), partial over this rank's heads, summed over the
  // tensor ranks in one all-reduce.
  const Vector replicated_grads =
      parallel_.tensor_size() > 1
          ? allocate_uninitialized<Vector>("kmamba::mamba3::d_replicated", 2 * d_state_ + nangles_ * d_model_)
          : Vector();
  std::array<Matrix, segment_count> dpre;  // the gradients of the in_proj segments
  for (int s = 0; s < segment_count; ++s) {
    dpre[s] = allocate_uninitialized<Matrix>(std::string("kmamba::mamba3::d_in_proj_") + segment_names[s], rows,
                                             segment_widths_[s]);
  }
  const Matrix dy = backward_output(exec, slab, dout2, dpre);
  const Mamba3MimoGrads<memory_space> g = backward_scan(exec, slab, dy, dpre);
  backward_preprocess(exec, slab, g, dpre, replicated_grads);
  backward_in_proj(exec, slab, dpre, replicated_grads, du2);
}

template <class ExecutionSpace>
typename Mamba3Mixer<ExecutionSpace>::Matrix Mamba3Mixer<ExecutionSpace>::backward_output(
    const ExecutionSpace& exec, const Slab& slab, const ConstMatrix& dout,
    const std::array<Matrix, segment_count>& dpre) const {
  using Mem = memory_space;
  using Vector = Tensor1<float, Mem>;
  const Activations& a = kept_;
  const std::string& p = prefix_;
  const std::int64_t rows = a.batch * a.seqlen;
  // out = (normed or y) · out_projᵀ.
  const Matrix dy_out = allocate_uninitialized<Matrix>("kmamba::mamba3::d_out_proj_in", rows, d_inner_);
  gemm<ExecutionSpace, Mem>(exec, Transpose::No, Transpose::No, 1.0f, dout,
                            slab.template param<2>(p + "out_proj.weight"), 0.0f, dy_out, this->matmul_precision());
  gemm<ExecutionSpace, Mem>(exec, Transpose::Yes, Transpose::No, 1.0f, dout, config_.is_outproj_norm ? a.normed : a.y,
                            1.0f, slab.template grad<2>(p + "out_proj.weight"), this->matmul_precision());
  if (!config_.is_outproj_norm) return dy_out;
  const Matrix dy = allocate_uninitialized<Matrix>("kmamba::mamba3::d_scan_out", rows, d_inner_);
  const Vector dnorm_weight = allocate_uninitialized<Vector>("kmamba::mamba3::d_norm_weight", d_inner_);
  gated_rms_norm_backward(exec, dy_out, a.y, a.pre[z_segment], slab.template param<1>(p + "norm.weight"), a.rstd,
                          headdim_, true, dy, dpre[z_segment], dnorm_weight);
  accumulate(exec, dnorm_weight, flat(slab.grads(), slab, p + "norm.weight"));
  return dy;
}

template <class ExecutionSpace>
Mamba3MimoGrads<typename ExecutionSpace::memory_space> Mamba3Mixer<ExecutionSpace>::backward_scan(
    const ExecutionSpace& exec, const Slab& slab, const Matrix& dy,
    const std::array<Matrix, segment_count>& dpre) const {
  using Mem = memory_space;
  using T3 = Tensor3<float, Mem>;
  using T4 = Tensor4<float, Mem>;
  const Activations& a = kept_;
  const auto grad = [&](const char* name) { return flat(slab.grads(), slab, prefix_ + name); };
  const std::int64_t batch = a.batch, seqlen = a.seqlen;
  const std::size_t b = sz(batch), L = sz(seqlen), R = sz(rank_), G = sz(ngroups_), N = sz(d_state_);
  const std::size_t H = sz(nheads_), P = sz(headdim_);
  const bool split_sequence = parallel_.sequence_size() > 1;

  // The gradients of the MIMO scan (of rank 1 for the SISO one).
  Mamba3MimoGrads<Mem> g;
  g.dq = allocate_uninitialized<Tensor5<float, Mem>>("kmamba::mamba3::d_C_normed", b, L, R, G, N);
  g.dk = allocate_uninitialized<Tensor5<float, Mem>>("kmamba::mamba3::d_B_normed", b, L, R, G, N);
  g.dv = T4(dpre[x_segment].data(), b, L, H, P);
  g.dadt = allocate_uninitialized<T3>("kmamba::mamba3::d_adt", batch, nheads_, seqlen);
  g.ddt = allocate_uninitialized<T3>("kmamba::mamba3::d_dt", batch, nheads_, seqlen);
  g.dtrap = allocate_uninitialized<T3>("kmamba::mamba3::d_trap", batch, nheads_, seqlen);
  g.dq_bias = allocate_uninitialized<T3>("kmamba::mamba3::d_C_bias", nheads_, rank_, d_state_);
  g.dk_bias = allocate_uninitialized<T3>("kmamba::mamba3::d_B_bias", nheads_, rank_, d_state_);
  g.dangles = allocate_uninitialized<T4>("kmamba::mamba3::d_angles", batch, seqlen, nheads_, nangles_);
  if (config_.is_mimo) {
    g.dmimo_v = allocate_uninitialized<T3>("kmamba::mamba3::d_mimo_x", nheads_, rank_, headdim_);
    if (!config_.is_outproj_norm) {
      g.dmimo_z = allocate_uninitialized<T3>("kmamba::mamba3::d_mimo_z", nheads_, rank_, headdim_);
    }
    g.dmimo_o = allocate_uninitialized<T3>("kmamba::mamba3::d_mimo_o", nheads_, rank_, headdim_);
  }
  g.dD = allocate_uninitialized<Tensor1<float, Mem>>("kmamba::mamba3::d_D", nheads_);
  if (!config_.is_outproj_norm) g.dz = T4(dpre[z_segment].data(), b, L, H, P);
  Mamba3MimoArgs<Mem> args = scan_args(slab, a);
  args.seq_idx = this->sequence_ids("kmamba::Mamba3Mixer::backward", a.batch, a.seqlen);
  Mamba3SisoArgs<Mem> siso = siso_args(args);
  if (a.ungated.is_allocated()) siso.ungated_out = T4(a.ungated.data(), b, L, H, P);
  const Mamba3SisoGrads<Mem> siso_g = siso_grads(g);
  const T4 dy4(dy.data(), b, L, H, P);
  const SegmentInputs<Mem> in{
      {a.angle_initial, a.ssm_initial, a.k_initial, a.v_initial}, a.segment_decay, a.halo_mask, a.angle_carry};
  if (config_.is_mimo && split_sequence) {
    backward_segment(exec, *parallel_.sequence, args, dy4, in, g);
  } else if (config_.is_mimo) {
    mamba3_mimo_backward(exec, args, dy4, Mamba3MimoStates<Mem>(), g);
  } else if (split_sequence) {
    backward_segment(exec, *parallel_.sequence, siso, dy4, in, siso_g);
  } else {
    mamba3_siso_backward(exec, siso, dy4, Mamba3SisoStates<Mem>(), siso_g);
  }
  if (config_.is_mimo) {
    accumulate(exec, as_flat(g.dmimo_v), grad("mimo_x"));
    if (g.dmimo_z.is_allocated()) accumulate(exec, as_flat(g.dmimo_z), grad("mimo_z"));
    accumulate(exec, as_flat(g.dmimo_o), grad("mimo_o"));
  }
  accumulate(exec, g.dD, grad("D"));
  accumulate(exec, as_flat(g.dq_bias), grad("C_bias"));
  accumulate(exec, as_flat(g.dk_bias), grad("B_bias"));
  return g;
}

template <class ExecutionSpace>
void Mamba3Mixer<ExecutionSpace>::backward_preprocess(const ExecutionSpace& exec, const Slab& slab,
                                                      const Mamba3MimoGrads<memory_space>& g,
                                                      const std::array<Matrix, segment_count>& dpre,
                                                      const Tensor1<float, memory_space>& replicated_grads) const {
  using Mem = memory_space;
  using Vector = Tensor1<float, Mem>;
  const Activations& a = kept_;
  const std::string& p = prefix_;
  const auto grad = [&](const char* name) { return flat(slab.grads(), slab, p + name); };
  const std::int64_t rows = a.batch * a.seqlen;
  const bool split_tensor = parallel_.tensor_size() > 1;
  // B and C RMSNorms; under tensor parallelism their weight gradients are summed in backward_in_proj.
  const Vector dnorm_weight = split_tensor
                                  ? Vector(replicated_grads.data(), sz(d_state_))
                                  : allocate_uninitialized<Vector>("kmamba::mamba3::d_BC_norm_weight", d_state_);
  const Vector dC_norm_weight = split_tensor ? Vector(replicated_grads.data() + d_state_, sz(d_state_)) : dnorm_weight;
  rms_norm_backward(exec, as_matrix(g.dk), as_vectors(a.pre[B_segment], d_state_),
                    slab.template param<1>(p + "B_norm.weight"), a.Brstd, as_vectors(dpre[B_segment], d_state_),
                    dnorm_weight);
  if (!split_tensor) accumulate(exec, dnorm_weight, grad("B_norm.weight"));
  rms_norm_backward(exec, as_matrix(g.dq), as_vectors(a.pre[C_segment], d_state_),
                    slab.template param<1>(p + "C_norm.weight"), a.Crstd, as_vectors(dpre[C_segment], d_state_),
                    dC_norm_weight);
  if (!split_tensor) accumulate(exec, dC_norm_weight, grad("C_norm.weight"));

  // dd_dt, dd_A, trap, angle and dt_bias.
  impl::for_each_index(
      exec, "kmamba::mamba3::preprocess_backward", rows * nheads_,
      impl::Mamba3PreprocessBackwardFunctor<Mem>{
          a.pre[dt_segment], a.pre[A_segment], slab.template param<1>(p + "dt_bias"), g.ddt, g.dadt, g.dtrap,
          dpre[dt_segment], dpre[A_segment], dpre[trap_segment], static_cast<float>(config_.A_floor)});
  impl::for_each_index(exec, "kmamba::mamba3::angle_grad", rows * nangles_,
                       impl::Mamba3AngleGradFunctor<Mem>{g.dangles, dpre[angle_segment]});
  impl::add_column_sums(exec, "kmamba::mamba3::dt_bias_grad", dpre[dt_segment], grad("dt_bias"), 0);
}

template <class ExecutionSpace>
void Mamba3Mixer<ExecutionSpace>::backward_in_proj(const ExecutionSpace& exec, const Slab& slab,
                                                   const std::array<Matrix, segment_count>& dpre,
                                                   const Tensor1<float, memory_space>& replicated_grads,
                                                   const Matrix& du) const {
  using Vector = Tensor1<float, memory_space>;
  const std::string& p = prefix_;
  const auto grad = [&](const char* name) { return flat(slab.grads(), slab, p + name); };
  const bool split_tensor = parallel_.tensor_size() > 1;
  const Matrix dw_in = slab.template grad<2>(p + "in_proj.weight");  // (in_proj_rows, d_model)
  // Under tensor parallelism the angle rows are replicated: their gradient is summed over the tensor ranks below.
  impl::project_segments_backward(
      exec, in_proj(slab), ConstMatrix(kept_.u), dpre,
      {dw_in, Vector(), split_tensor ? static_cast<int>(angle_segment) : -1,
       split_tensor ? Matrix(replicated_grads.data() + 2 * d_state_, sz(nangles_), sz(d_model_)) : Matrix()},
      du);
  if (split_tensor) {
    parallel_.tensor->all_reduce(exec, replicated_grads);
    accumulate(exec, Vector(replicated_grads.data(), sz(d_state_)), grad("B_norm.weight"));
    accumulate(exec, Vector(replicated_grads.data() + d_state_, sz(d_state_)), grad("C_norm.weight"));
    accumulate(exec, Vector(replicated_grads.data() + 2 * d_state_, sz(nangles_ * d_model_)),
               Vector(dw_in.data() + sz(segment_offsets_[angle_segment]) * sz(d_model_), sz(nangles_ * d_model_)));
    sum_over_tensor_ranks(exec, du);
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
  return impl::new_mixer_cache<Cache, ExecutionSpace>("kmamba::Mamba3Mixer::make_cache", *this, batch);
}

template <class ExecutionSpace>
typename Mamba3Mixer<ExecutionSpace>::Cache& Mamba3Mixer<ExecutionSpace>::cache_of(const char* function,
                                                                                   MixerCache<ExecutionSpace>& cache,
                                                                                   std::int64_t batch) const {
  return impl::mixer_cache<Cache>(function, cache, shape_key(), batch, [&] {
    std::ostringstream s;
    s << "a Mamba-3 mixer of these dimensions (d_model " << d_model_ << ", nheads " << nheads_ << ", headdim "
      << headdim_ << ", ngroups " << ngroups_ << ", d_state " << d_state_ << ", nangles " << nangles_ << ", rank "
      << rank_ << ")";
    return s.str();
  });
}

template <class ExecutionSpace>
void Mamba3Mixer<ExecutionSpace>::prefill(const ExecutionSpace& exec, const Slab& slab,
                                          const ConstTensor3<float, memory_space>& u,  // (batch, seqlen, d_model)
                                          const Tensor3<float, memory_space>& out,     // (batch, seqlen, d_model)
                                          MixerCache<ExecutionSpace>& cache) {
  constexpr const char* function = "kmamba::Mamba3Mixer::prefill";
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
  const std::int64_t batch = impl::check_step_arguments(function, u, out, d_model_);
  Cache& c = cache_of(function, cache, batch);
  check_parameters(function, slab);
  impl::check_whole_sequences(function, parallel_);
  const std::string& p = prefix_;
  const float eps = static_cast<float>(config_.norm_epsilon);
  const std::size_t b = sz(batch), R = sz(rank_), G = sz(ngroups_), N = sz(d_state_), H = sz(nheads_);
  const std::size_t P = sz(headdim_), S = sz(nangles_);

  for (int s = 0; s < segment_count; ++s) {
    project(exec, slab, p + "in_proj.weight", segment_offsets_[s], segment_widths_[s], u, c.pre[s],
            c.bf16_parameters());
  }
  rms_norm(exec, as_vectors(c.pre[B_segment], d_state_), slab.template param<1>(p + "B_norm.weight"), eps, c.Bn);
  rms_norm(exec, as_vectors(c.pre[C_segment], d_state_), slab.template param<1>(p + "C_norm.weight"), eps, c.Cn);
  Kokkos::parallel_for(
      "kmamba::decode::mamba3::preprocess",
      impl::light_weight(
          Kokkos::RangePolicy<ExecutionSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, batch * nheads_)),
      impl::Mamba3PreprocessFunctor<Mem>{c.pre[dt_segment], c.pre[A_segment], c.pre[trap_segment], c.pre[angle_segment],
                                         slab.template param<1>(p + "dt_bias"), c.dt, c.adt, c.trap, c.angles,
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
    mamba3_mimo_step(exec, args, c.states(0), y);
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
    mamba3_siso_step(exec, args, siso_states(c.states(0)), y);
  }
  if (config_.is_outproj_norm) {
    gated_rms_norm(exec, c.y, c.pre[z_segment], slab.template param<1>(p + "norm.weight"), eps, headdim_, true,
                   c.normed);
  }
  project(exec, slab, p + "out_proj.weight", 0, d_model_, config_.is_outproj_norm ? c.normed : c.y, out,
          c.bf16_parameters());
  sum_over_tensor_ranks(exec, out);
}

#define KMAMBA_INSTANTIATE(Exec) template class Mamba3Mixer<Exec>;
KMAMBA_FOR_EACH_BACKEND(KMAMBA_INSTANTIATE)
#undef KMAMBA_INSTANTIATE

}  // namespace kmamba
