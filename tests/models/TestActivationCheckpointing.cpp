// Per-layer activation checkpointing (LanguageModel::set_activation_checkpointing and
// SequenceModel::set_activation_checkpointing, both the backbone's): the loss and every gradient
// equal the run that keeps every activation (bit-identical on Serial, which
// recomputes with the same kernels on the same inputs in the same order; within 1e-6 of the
// largest gradient on backends whose reductions may change order between runs), and the peak of
// live Kokkos allocations during loss_and_backward is lower. The peak is measured with the Kokkos
// tools allocate/deallocate callbacks (every managed View allocation). Measured on the 2-core CPU
// (6 layers, d_model 64, batch 4 × seqlen 128): see the "[ measured ]" lines.
#include <kmamba/core/Random.hpp>
#include <kmamba/models/LanguageModel.hpp>
#include <kmamba/models/SequenceModel.hpp>

#include "Backends.hpp"
#include "ModelConfigs.hpp"

#include <gtest/gtest.h>
#include <Kokkos_Core.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

namespace {

// Live bytes of managed allocations and their high-water mark, from the Kokkos tools callbacks.
std::int64_t live_bytes = 0, peak_bytes = 0;

extern "C" void on_allocate(Kokkos_Profiling_SpaceHandle, const char*, const void*, std::uint64_t size) {
  live_bytes += static_cast<std::int64_t>(size);
  peak_bytes = std::max(peak_bytes, live_bytes);
}
extern "C" void on_deallocate(Kokkos_Profiling_SpaceHandle, const char*, const void*, std::uint64_t size) {
  live_bytes -= static_cast<std::int64_t>(size);
}

// The peak of live allocations above those alive when it starts, while it lives.
class PeakMemory {
 public:
  PeakMemory() {
    live_bytes = peak_bytes = 0;
    Kokkos::Tools::Experimental::set_allocate_data_callback(on_allocate);
    Kokkos::Tools::Experimental::set_deallocate_data_callback(on_deallocate);
  }
  ~PeakMemory() {
    Kokkos::Tools::Experimental::set_allocate_data_callback(nullptr);
    Kokkos::Tools::Experimental::set_deallocate_data_callback(nullptr);
  }
  std::int64_t peak() const { return peak_bytes; }
};

KMAMBA_BACKEND_TEST_SUITE(ActivationCheckpointingTest);

kmamba::ModelConfig small_config(kmamba::MixerKind mixer) {
  return kmamba::test::model_config(mixer, {64, 6, 96, 16, 16, 32, 2});
}

struct Run {
  double loss = 0.0;
  std::vector<float> grads;
  std::int64_t peak_bytes = 0;
};

// The loss, the gradients and the peak of live allocations of `model.loss_and_backward(args...)`.
template <class Model, class... Args>
Run measured_step(Model& model, const Args&... args) {
  Run run;
  {
    const PeakMemory peak;
    run.loss = model.loss_and_backward(args...).loss;
    run.peak_bytes = peak.peak();
  }
  const auto grads = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), model.parameters().grads());
  run.grads.assign(grads.data(), grads.data() + grads.span());
  return run;
}

template <class Exec>
Run train_step(const kmamba::ModelConfig& config, bool checkpointing, int batch, int seqlen) {
  using Mem = typename Exec::memory_space;
  const Exec exec;
  std::mt19937_64 rng(31);
  std::uniform_int_distribution<std::int64_t> token(0, config.vocab_size - 1);
  kmamba::Tensor2<std::int64_t, Kokkos::HostSpace> ids_host("kmamba::test::ids", batch, seqlen);
  for (std::size_t i = 0; i < ids_host.span(); ++i) ids_host.data()[i] = token(rng);
  const auto ids = Kokkos::create_mirror_view_and_copy(Mem(), ids_host);
  const auto targets = kmamba::next_token_targets(exec, kmamba::ConstTensor2<std::int64_t, Mem>(ids));
  kmamba::LanguageModel<Exec> model(config);
  model.initialize(5);
  model.set_activation_checkpointing(checkpointing);
  EXPECT_EQ(model.activation_checkpointing(), checkpointing);
  return measured_step(model, exec, ids, targets);
}

// One SequenceModel training step on random inputs and targets (20 channels in and out).
template <class Exec>
Run sequence_train_step(const kmamba::ModelConfig& backbone, bool checkpointing, int batch, int seqlen) {
  using Mem = typename Exec::memory_space;
  const Exec exec;
  kmamba::SequenceModelConfig config;
  config.backbone = backbone;
  config.input_size = config.output_size = 20;
  const auto random = [&](const char* label, std::uint64_t seed) {
    auto v = kmamba::allocate_uninitialized<kmamba::Tensor3<float, Mem>>(label, batch, seqlen, 20);
    kmamba::fill_normal(exec, v, seed, 0.0f, 1.0f);
    return v;
  };
  const auto inputs = random("kmamba::test::inputs", 7);
  const auto targets = random("kmamba::test::targets", 8);
  kmamba::SequenceModel<Exec> model(config);
  model.initialize(5);
  model.set_activation_checkpointing(checkpointing);
  EXPECT_EQ(model.activation_checkpointing(), checkpointing);
  exec.fence();
  return measured_step(model, exec, kmamba::ConstTensor3<float, Mem>(inputs),
                       kmamba::ConstTensor3<float, Mem>(targets));
}

template <class Exec>
void check_same_gradients(const char* model, kmamba::MixerKind mixer, const Run& kept, const Run& recomputed) {
  // Serial recomputes bit-identically; OpenMP's and CUDA's reductions may sum in another order
  // from one run to the next (measured up to 3e-8 absolute on OpenMP).
  const double tolerance = Exec::concurrency() == 1 ? 0.0 : 1e-6;
  EXPECT_LE(std::abs(recomputed.loss - kept.loss), tolerance * kept.loss);
  double diff = 0.0, scale = 0.0;
  for (std::size_t i = 0; i < kept.grads.size(); ++i) {
    diff = std::max(diff, std::abs(static_cast<double>(recomputed.grads[i]) - kept.grads[i]));
    scale = std::max(scale, std::abs(static_cast<double>(kept.grads[i])));
  }
  EXPECT_GT(scale, 0.0);
  EXPECT_LE(diff, tolerance * scale);
  EXPECT_LT(recomputed.peak_bytes, kept.peak_bytes);
  std::printf(
      "[ measured ] %s %s %s: peak live allocations in loss_and_backward %.2f MiB kept, %.2f MiB with "
      "checkpointing (%.0f%% less); max|grad diff| %.1e\n",
      Exec::name(), model, kmamba::mixer_name(mixer), static_cast<double>(kept.peak_bytes) / (1 << 20),
      static_cast<double>(recomputed.peak_bytes) / (1 << 20),
      100.0 * (1.0 - static_cast<double>(recomputed.peak_bytes) / static_cast<double>(kept.peak_bytes)), diff);
}

template <class Exec>
void check_language_model(kmamba::MixerKind mixer) {
  const kmamba::ModelConfig config = small_config(mixer);
  const Run kept = train_step<Exec>(config, false, 4, 128);
  const Run recomputed = train_step<Exec>(config, true, 4, 128);
  check_same_gradients<Exec>("LanguageModel", mixer, kept, recomputed);
}

TYPED_TEST(ActivationCheckpointingTest, Mamba2GradientsAreUnchangedAndPeakMemoryFalls) {
  check_language_model<TypeParam>(kmamba::MixerKind::Mamba2);
}

TYPED_TEST(ActivationCheckpointingTest, Mamba1GradientsAreUnchangedAndPeakMemoryFalls) {
  check_language_model<TypeParam>(kmamba::MixerKind::Mamba1);
}

TYPED_TEST(ActivationCheckpointingTest, SequenceModelGradientsAreUnchangedAndPeakMemoryFalls) {
  const kmamba::ModelConfig config = small_config(kmamba::MixerKind::Mamba2);
  const Run kept = sequence_train_step<TypeParam>(config, false, 4, 128);
  const Run recomputed = sequence_train_step<TypeParam>(config, true, 4, 128);
  check_same_gradients<TypeParam>("SequenceModel", kmamba::MixerKind::Mamba2, kept, recomputed);
}

}  // namespace
