// The Trainer's checkpoint format: beside the model LanguageModel::save writes, a checkpoint
// directory holds training_state.safetensors with AdamW's two moments (one tensor per parameter,
// named optimizer.exp_avg.<name> and optimizer.exp_avg_sq.<name>), the step and data counters, and
// as metadata the TrainConfig (TrainConfig::to_json), the dataset's fingerprint and a checksum of
// the parameters that ties the file to the model.safetensors written with it.
#ifndef KMAMBA_MODELS_SRC_TRAINERCHECKPOINT_HPP
#define KMAMBA_MODELS_SRC_TRAINERCHECKPOINT_HPP

#include <kmamba/core/Tensor.hpp>
#include <kmamba/models/Data.hpp>
#include <kmamba/models/ParameterSlab.hpp>
#include <kmamba/models/SafeTensors.hpp>
#include <kmamba/models/Trainer.hpp>

#include <Kokkos_Core.hpp>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace kmamba {
namespace impl {

/// The training state's file in a checkpoint directory.
constexpr const char* training_state_file = "training_state.safetensors";
/// The dataset fingerprint of a run without data.
constexpr const char* no_dataset = "none";

/// One parameter of the slab: its two moment tensors have its shape and start at `offset` of the
/// moment slabs.
struct MomentTensor {
  std::string name;
  std::vector<std::int64_t> shape;
  std::size_t offset;
};

template <class MemorySpace>
std::vector<MomentTensor> moment_tensors(const ParameterSlab<MemorySpace>& slab) {
  std::vector<MomentTensor> tensors;
  for (const auto& e : slab.entries()) tensors.push_back({e.name, e.shape, e.offset});
  return tensors;
}

/// FNV-1a over the bytes of the parameter slab: ties training_state.safetensors to the
/// model.safetensors written with it.
template <class MemorySpace>
std::string parameter_checksum(const Tensor1<float, MemorySpace>& params) {
  auto host = Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), params);
  std::uint64_t hash = 1469598103934665603ull;
  const auto* bytes = reinterpret_cast<const unsigned char*>(host.data());
  for (std::size_t i = 0; i < host.extent(0) * sizeof(float); ++i) {
    hash ^= bytes[i];
    hash *= 1099511628211ull;
  }
  char text[17];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(hash));
  return text;
}

/// What training_state.safetensors holds besides the moments.
struct TrainingState {
  std::int64_t steps = 0;          // optimizer steps taken
  std::int64_t data_position = 0;  // training batches consumed, of config.batch_size sequences each
  std::int64_t skipped_steps = 0;  // steps skipped for a non-finite loss or gradient
  TrainConfig config;
  std::string dataset;             // the training data's fingerprint, "none" without data
  std::string parameter_checksum;  // of the model written beside it
};

/// Writes `state` and the moments (host copies of the moment slabs, in the order of `tensors`) to
/// `path`.
void write_training_state(const std::string& path, const std::vector<MomentTensor>& tensors, const float* exp_avg,
                          const float* exp_avg_sq, const TrainingState& state);

/// Opens the training state of checkpoint `dir`; throws kmamba::UserError unless it is a kmamba
/// training state of format version 1.
SafeTensorsReader open_training_state(const std::string& dir);

/// Throws kmamba::UserError, naming `dir`, unless the checkpoint's model configuration (config.json
/// text `saved`) equals this run's (`ours`), its parameters have the checksum the training state
/// recorded, and it was trained on `data` (when both the run and the checkpoint have data).
void check_checkpoint_matches(const SafeTensorsReader& file, const std::string& dir, const std::string& saved,
                              const std::string& ours, const std::string& checksum, const Dataset* data);

/// Reads the moments (in the order of `tensors`, into `exp_avg` and `exp_avg_sq` sized to the slab)
/// and the rest of the training state; throws kmamba::UserError for a tensor missing, mis-shaped,
/// not F32 or unexpected, and for a bad counter or configuration.
TrainingState read_training_state(const SafeTensorsReader& file, const std::vector<MomentTensor>& tensors,
                                  std::vector<float>& exp_avg, std::vector<float>& exp_avg_sq);

}  // namespace impl
}  // namespace kmamba

#endif
