// The residual backbone shared by LanguageModel and SequenceModel: the blocks' forward (kept or
// checkpointed), backward, prefill and decode step.
#include "Backbone.hpp"

#include "Elementwise.hpp"

#include <kmamba/core/Error.hpp>
#include <kmamba/core/ForEachBackend.hpp>
#include <kmamba/core/RmsNorm.hpp>

#include <Kokkos_Core.hpp>

#include <algorithm>
#include <string>

namespace kmamba {
namespace impl {

void check_layers_against_file(const ModelConfig& config, const SafeTensorsReader& file, const std::string& config_path,
                               const char* function) {
  const std::string prefix = "backbone.layers.";
  long long layers = 0;
  std::string last;  // a tensor of the last layer
  for (const std::string& name : file.names()) {
    if (name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::size_t end = name.find_first_not_of("0123456789", prefix.size());
    const std::string digits = name.substr(prefix.size(), end - prefix.size());
    if (digits.empty() || digits.size() > 9 || std::stoll(digits) + 1 <= layers) continue;
    layers = std::stoll(digits) + 1;
    last = name;
  }
  KMAMBA_REQUIRE(layers == config.n_layer, function << ": '" << config_path << "' gives num_hidden_layers (n_layer) "
                                                    << config.n_layer << ", but '" << file.path() << "' holds "
                                                    << layers << " layers (the last tensor of the last layer: '" << last
                                                    << "')");
}

template <class ExecutionSpace>
std::string Backbone<ExecutionSpace>::layer_prefix(int layer) {
  return "backbone.layers." + std::to_string(layer) + ".";
}

template <class ExecutionSpace>
Backbone<ExecutionSpace>::Backbone(const ModelConfig& config, const ModelParallel& parallel, const std::string& label)
    : Backbone(config, parallel, label, StageLayers{0, config.n_layer}, true) {}

template <class ExecutionSpace>
Backbone<ExecutionSpace>::Backbone(const ModelConfig& config, const ModelParallel& parallel, const std::string& label,
                                   StageLayers layers, bool final_norm)
    : config_(config), label_(label), layers_(layers), final_norm_(final_norm) {
  config_.validate();
  KMAMBA_ASSERT(layers.begin >= 0 && layers.begin < layers.end && layers.end <= config_.n_layer,
                "blocks [" << layers.begin << ", " << layers.end << ") of a model of " << config_.n_layer);
  for (int i = layers_.begin; i < layers_.end; ++i) {
    mixers_.push_back(make_mixer<ExecutionSpace>(config_, layer_prefix(i) + "mixer.", parallel));
  }
}

template <class ExecutionSpace>
void Backbone<ExecutionSpace>::declare_parameters(Slab& slab) const {
  for (int i = layers_.begin; i < layers_.end; ++i) {
    mixers_[static_cast<std::size_t>(i - layers_.begin)]->declare_parameters(slab);
    slab.add(layer_prefix(i) + "norm.weight", {config_.d_model}, WeightDecay::No);
  }
  if (final_norm_) slab.add(final_norm_name, {config_.d_model}, WeightDecay::No);
}

template <class ExecutionSpace>
void Backbone<ExecutionSpace>::initialize(const ExecutionSpace& exec, const Slab& slab, std::uint64_t seed) const {
  // Each block's seed follows from its unsplit layer number, so that a stage holds the blocks of
  // the unsplit initialisation.
  for (int i = layers_.begin; i < layers_.end; ++i) {
    Kokkos::deep_copy(exec, slab.template param<1>(layer_prefix(i) + "norm.weight"), 1.0f);
    mixers_[static_cast<std::size_t>(i - layers_.begin)]->initialize(
        exec, slab, seed + 0x9E3779B97F4A7C15ull * static_cast<std::uint64_t>(i + 1));
  }
  if (final_norm_) Kokkos::deep_copy(exec, slab.template param<1>(final_norm_name), 1.0f);
}

template <class ExecutionSpace>
void Backbone<ExecutionSpace>::set_activation_checkpointing(bool on) {
  checkpointing_ = on;
  if (!checkpointed()) {
    recompute_in_ = Tensor3<float, Mem>();
    recompute_out_ = Tensor3<float, Mem>();
  }
}

template <class ExecutionSpace>
void Backbone<ExecutionSpace>::use_activation_slot(std::size_t slot) {
  KMAMBA_REQUIRE(slot == 0 || checkpointed(), "kmamba::Backbone::use_activation_slot: slot "
                                                  << slot
                                                  << " needs checkpointed blocks (the mixers keep one "
                                                     "micro-batch's activations)");
  if (slot == slot_) return;
  if (parked_.size() <= std::max(slot, slot_)) parked_.resize(std::max(slot, slot_) + 1);
  std::swap(residuals_, parked_[slot_]);  // park the current slot's block inputs
  std::swap(residuals_, parked_[slot]);   // and take the slot's
  slot_ = slot;
  // A slot of another shape than the last forward's brings the shared buffers to its shape.
  if (!residuals_.empty() && (static_cast<std::int64_t>(residuals_[0].extent(0)) != batch_ ||
                              static_cast<std::int64_t>(residuals_[0].extent(1)) != seqlen_)) {
    prepare(static_cast<std::int64_t>(residuals_[0].extent(0)), static_cast<std::int64_t>(residuals_[0].extent(1)),
            true);
  }
}

template <class ExecutionSpace>
void Backbone<ExecutionSpace>::set_matmul_precision(MatmulPrecision precision) {
  for (auto& mixer : mixers_) mixer->set_matmul_precision(precision);
}

template <class ExecutionSpace>
void Backbone<ExecutionSpace>::set_sequence_ids(const ConstTensor2<std::int64_t, Mem>& seq_idx) {
  for (auto& mixer : mixers_) mixer->set_sequence_ids(seq_idx);
}

template <class ExecutionSpace>
std::vector<ShardedParameter> Backbone<ExecutionSpace>::sharded_parameters() const {
  std::vector<ShardedParameter> all;
  for (const auto& mixer : mixers_) {
    for (ShardedParameter& p : mixer->sharded_parameters()) all.push_back(std::move(p));
  }
  return all;
}

template <class ExecutionSpace>
std::vector<typename Backbone<ExecutionSpace>::Ranges> Backbone<ExecutionSpace>::gradients_ready_sequence(
    const Slab& slab) const {
  const auto ranges_of = [&](const auto& belongs) {
    Ranges ranges;
    for (const auto& e : slab.entries()) {
      if (belongs(e.name)) ranges.emplace_back(e.offset, e.offset + e.size);
    }
    std::sort(ranges.begin(), ranges.end());
    Ranges merged;
    for (const auto& r : ranges) {
      if (!merged.empty() && merged.back().second == r.first) {
        merged.back().second = r.second;
      } else {
        merged.push_back(r);
      }
    }
    return merged;
  };
  const auto starts_with = [](const std::string& name, const std::string& prefix) {
    return name.compare(0, prefix.size(), prefix) == 0;
  };
  std::vector<Ranges> sequence;
  for (int i = layers_.end - 1; i >= layers_.begin; --i) {
    const std::string prefix = layer_prefix(i);
    sequence.push_back(ranges_of([&](const std::string& name) { return starts_with(name, prefix); }));
  }
  sequence.push_back(ranges_of([&](const std::string& name) { return !starts_with(name, "backbone.layers."); }));
  return sequence;
}

template <class ExecutionSpace>
void Backbone<ExecutionSpace>::set_gradients_ready_hook(GradientsReadyHook hook, const Slab& slab) {
  gradients_ready_ = std::move(hook);
  ready_sequence_ = gradients_ready_ ? gradients_ready_sequence(slab) : std::vector<Ranges>();
}

template <class ExecutionSpace>
void Backbone<ExecutionSpace>::announce(const ExecutionSpace& exec, std::size_t k) const {
  if (!gradients_ready_) return;
  for (const auto& r : ready_sequence_[k]) gradients_ready_(exec, r.first, r.second);
}

template <class ExecutionSpace>
void Backbone<ExecutionSpace>::prepare(std::int64_t b, std::int64_t l, bool training) {
  const std::int64_t dm = config_.d_model, rows = b * l;
  const auto sequence = [&](const std::string& what) {
    return allocate_uninitialized<Tensor3<float, Mem>>(label_ + "::" + what, b, l, dm);
  };
  const auto keeps_shape = [&](const Tensor3<float, Mem>& x) {
    return static_cast<std::int64_t>(x.extent(0)) == b && static_cast<std::int64_t>(x.extent(1)) == l;
  };
  if (batch_ != b || seqlen_ != l || !normed_.is_allocated()) {
    batch_ = b;
    seqlen_ = l;
    if (!residuals_.empty() && !keeps_shape(residuals_[0])) residuals_.clear();
    rstds_.clear();
    final_input_ = sequence("final_input");
    final_rstd_ = allocate_uninitialized<Tensor1<float, Mem>>(label_ + "::final_rstd", rows);
    normed_ = sequence("normed");
    mixed_ = sequence("mixed");
    norm_grad_ = allocate<Tensor1<float, Mem>>(label_ + "::norm_grad", dm);
    recompute_in_ = Tensor3<float, Mem>();
    recompute_out_ = Tensor3<float, Mem>();
  }
  if (training && checkpointed() && !recompute_in_.is_allocated()) {
    recompute_in_ = sequence("recompute_in");
    recompute_out_ = sequence("recompute_out");
  }
  const std::size_t wanted = training ? static_cast<std::size_t>(layer_count()) : 1u;
  while (residuals_.size() < wanted) residuals_.push_back(sequence("residual_" + std::to_string(residuals_.size())));
  while (rstds_.size() < wanted) {
    rstds_.push_back(
        allocate_uninitialized<Tensor1<float, Mem>>(label_ + "::rstd_" + std::to_string(rstds_.size()), rows));
  }
}

template <class ExecutionSpace>
const Tensor3<float, typename ExecutionSpace::memory_space>& Backbone<ExecutionSpace>::forward(
    const ExecutionSpace& exec, const Slab& slab, std::int64_t batch, std::int64_t seqlen, bool training,
    const InputEnd& input) {
  prepare(batch, seqlen, training);
  input(token_rows(residuals_[0]));
  forward_blocks(exec, slab, training);
  const std::size_t last = training ? static_cast<std::size_t>(layer_count() - 1) : 0u;
  add(exec, "kmamba::backbone::residual_add", as_flat(mixed_), as_flat(residuals_[last]), as_flat(final_input_));
  if (final_norm_) {
    kmamba::rms_norm(exec, token_rows(final_input_), slab.template param<1>(final_norm_name),
                     static_cast<float>(config_.norm_epsilon), token_rows(normed_), final_rstd_);
  }
  return output();
}

template <class ExecutionSpace>
void Backbone<ExecutionSpace>::forward_blocks(const ExecutionSpace& exec, const Slab& slab, bool training) {
  for (int i = 0; i < layer_count(); ++i) {
    const std::size_t slot = training ? static_cast<std::size_t>(i) : 0u;
    const Tensor3<float, Mem>& residual = residuals_[slot];
    if (i > 0) {  // r_i = r_{i−1} + m_{i−1}, in place during inference
      add(exec, "kmamba::backbone::residual_add", as_flat(mixed_), as_flat(residuals_[training ? slot - 1 : 0u]),
          as_flat(residual));
    }
    kmamba::rms_norm(exec, token_rows(residual),
                     slab.template param<1>(layer_prefix(layers_.begin + i) + "norm.weight"),
                     static_cast<float>(config_.norm_epsilon), token_rows(normed_), rstds_[slot]);
    Mixer<ExecutionSpace>& mixer = *mixers_[static_cast<std::size_t>(i)];
    mixer.forward(exec, slab, normed_, mixed_, training && !checkpointed());
    // A mixer may keep its buffers as workspace after a forward that keeps nothing (Mamba-1).
    if (training && checkpointed()) mixer.release_activations();
  }
}

template <class ExecutionSpace>
void Backbone<ExecutionSpace>::add_norm_grad(const ExecutionSpace& exec, const Slab& slab,
                                             const std::string& name) const {
  accumulate(exec, "kmamba::backbone::accumulate_norm_grad", norm_grad_, slab.template grad<1>(name));
}

template <class ExecutionSpace>
const Tensor3<float, typename ExecutionSpace::memory_space>& Backbone<ExecutionSpace>::backward(
    const ExecutionSpace& exec, const Slab& slab) {
  // mixed_ is free in backward: it holds dres, the residual stream's gradient; normed_ holds the
  // gradient of each norm's output.
  if (final_norm_) {
    kmamba::rms_norm_backward(exec, token_rows(normed_), token_rows(final_input_),
                              slab.template param<1>(final_norm_name), final_rstd_, token_rows(mixed_), norm_grad_);
    add_norm_grad(exec, slab, final_norm_name);
  } else {
    Kokkos::deep_copy(exec, mixed_, final_input_);
  }
  for (int i = layer_count() - 1; i >= 0; --i) backward_block(exec, slab, i);
  return mixed_;
}

template <class ExecutionSpace>
void Backbone<ExecutionSpace>::backward_block(const ExecutionSpace& exec, const Slab& slab, int i) {
  const std::size_t layer = static_cast<std::size_t>(i);
  const std::string norm = layer_prefix(layers_.begin + i) + "norm.weight";
  Mixer<ExecutionSpace>& mixer = *mixers_[layer];
  if (checkpointed()) {  // recompute the block's forward from its kept input
    kmamba::rms_norm(exec, token_rows(residuals_[layer]), slab.template param<1>(norm),
                     static_cast<float>(config_.norm_epsilon), token_rows(recompute_in_), rstds_[layer]);
    mixer.forward(exec, slab, recompute_in_, recompute_out_, true);
  }
  mixer.backward(exec, slab, mixed_, normed_);
  if (checkpointed()) mixer.release_activations();
  // The norm's input gradient goes to final_input_ (free in backward), then into dres.
  kmamba::rms_norm_backward(exec, token_rows(normed_), token_rows(residuals_[layer]), slab.template param<1>(norm),
                            rstds_[layer], token_rows(final_input_), norm_grad_);
  add_norm_grad(exec, slab, norm);
  announce(exec, static_cast<std::size_t>(layer_count() - 1 - i));
  accumulate(exec, "kmamba::backbone::accumulate_residual_grad", as_flat(final_input_), as_flat(mixed_));
}

template <class ExecutionSpace>
void Backbone<ExecutionSpace>::finish_backward(const ExecutionSpace& exec) {
  announce(exec, static_cast<std::size_t>(layer_count()));
  for (auto& mixer : mixers_) mixer->release_activations();
}

template <class ExecutionSpace>
void Backbone<ExecutionSpace>::RecurrentState::reset(const ExecutionSpace& exec) {
  for (auto& cache : caches) cache->reset(exec);
}

template <class ExecutionSpace>
typename Backbone<ExecutionSpace>::RecurrentState Backbone<ExecutionSpace>::make_state(int batch,
                                                                                       const std::string& label) const {
  RecurrentState state;
  for (const auto& mixer : mixers_) state.caches.push_back(mixer->make_cache(batch));
  const int dm = config_.d_model;
  state.residual = allocate_uninitialized<Tensor2<float, Mem>>(label + "::residual", batch, dm);
  state.normed = allocate_uninitialized<Tensor2<float, Mem>>(label + "::normed", batch, dm);
  state.mixed = allocate_uninitialized<Tensor2<float, Mem>>(label + "::mixed", batch, dm);
  return state;
}

template <class ExecutionSpace>
typename Backbone<ExecutionSpace>::Segment Backbone<ExecutionSpace>::prefill(const ExecutionSpace& exec,
                                                                             const Slab& slab, std::int64_t batch,
                                                                             std::int64_t seqlen, const InputEnd& input,
                                                                             RecurrentState& state,
                                                                             const std::string& label) const {
  const std::int64_t dm = config_.d_model;
  const float eps = static_cast<float>(config_.norm_epsilon);
  const auto sequence = [&](const char* what) {
    return allocate_uninitialized<Tensor3<float, Mem>>(label + "::prefill_" + what, batch, seqlen, dm);
  };
  const Segment s{sequence("residual"), sequence("normed"), sequence("mixed")};
  input(token_rows(s.residual));
  // Each block's residual add and norm are one kernel (the first block's input is h_0).
  for (int i = 0; i < layer_count(); ++i) {
    const auto norm_weight = slab.template param<1>(layer_prefix(layers_.begin + i) + "norm.weight");
    if (i == 0) {
      kmamba::rms_norm(exec, token_rows(s.residual), norm_weight, eps, token_rows(s.normed));
    } else {
      kmamba::add_rms_norm(exec, token_rows(s.residual), token_rows(s.mixed), norm_weight, eps, token_rows(s.normed));
    }
    const std::size_t layer = static_cast<std::size_t>(i);
    mixers_[layer]->prefill(exec, slab, s.normed, s.mixed, *state.caches[layer]);
  }
  return s;
}

template <class ExecutionSpace>
void Backbone<ExecutionSpace>::step(const ExecutionSpace& exec, const Slab& slab, RecurrentState& state) const {
  const float eps = static_cast<float>(config_.norm_epsilon);
  // Each block's residual add and norm are one kernel (the first block's input is h_0).
  for (int i = 0; i < layer_count(); ++i) {
    const auto norm_weight = slab.template param<1>(layer_prefix(layers_.begin + i) + "norm.weight");
    if (i == 0) {
      kmamba::rms_norm(exec, state.residual, norm_weight, eps, state.normed);
    } else {
      kmamba::add_rms_norm(exec, state.residual, state.mixed, norm_weight, eps, state.normed);
    }
    const std::size_t layer = static_cast<std::size_t>(i);
    mixers_[layer]->step(exec, slab, state.normed, state.mixed, *state.caches[layer]);
  }
  kmamba::add_rms_norm(exec, state.residual, state.mixed, slab.template param<1>(final_norm_name), eps, state.normed);
}

#define KMAMBA_INSTANTIATE(Exec) template class Backbone<Exec>;
KMAMBA_FOR_EACH_BACKEND(KMAMBA_INSTANTIATE)
#undef KMAMBA_INSTANTIATE

}  // namespace impl
}  // namespace kmamba
