// make_mixer: the mixer of a config's kind.
#include <kmamba/models/Mixer.hpp>

#include <kmamba/core/Error.hpp>
#include <kmamba/core/ForEachBackend.hpp>
#include <kmamba/models/Mamba1Mixer.hpp>
#include <kmamba/models/Mamba2Mixer.hpp>
#include <kmamba/models/Mamba3Mixer.hpp>

#include <Kokkos_Core.hpp>

namespace kmamba {

template <class ExecutionSpace>
std::unique_ptr<Mixer<ExecutionSpace>> make_mixer(const ModelConfig& config, const std::string& prefix) {
  switch (config.mixer) {
    case MixerKind::Mamba1:
      return std::unique_ptr<Mixer<ExecutionSpace>>(new Mamba1Mixer<ExecutionSpace>(config, prefix));
    case MixerKind::Mamba2:
      return std::unique_ptr<Mixer<ExecutionSpace>>(new Mamba2Mixer<ExecutionSpace>(config, prefix));
    case MixerKind::Mamba3:
      return std::unique_ptr<Mixer<ExecutionSpace>>(new Mamba3Mixer<ExecutionSpace>(config, prefix));
  }
  KMAMBA_USER_ERROR("kmamba::make_mixer: unknown mixer kind " << static_cast<int>(config.mixer));
}

template <class ExecutionSpace>
std::unique_ptr<Mixer<ExecutionSpace>> make_mixer(const ModelConfig& config, const std::string& prefix,
                                                  const ModelParallel& parallel) {
  if (parallel.tensor_size() == 1 && parallel.sequence_size() == 1) return make_mixer<ExecutionSpace>(config, prefix);
  switch (config.mixer) {
    case MixerKind::Mamba2:
      return std::unique_ptr<Mixer<ExecutionSpace>>(new Mamba2Mixer<ExecutionSpace>(config, prefix, parallel));
    case MixerKind::Mamba3:
      return std::unique_ptr<Mixer<ExecutionSpace>>(new Mamba3Mixer<ExecutionSpace>(config, prefix, parallel));
    case MixerKind::Mamba1:
      return std::unique_ptr<Mixer<ExecutionSpace>>(new Mamba1Mixer<ExecutionSpace>(config, prefix, parallel));
  }
  KMAMBA_USER_ERROR("kmamba::make_mixer: unknown mixer kind " << static_cast<int>(config.mixer));
}

#define KMAMBA_INSTANTIATE_MAKE_MIXER(Exec)                                                       \
  template std::unique_ptr<Mixer<Exec>> make_mixer<Exec>(const ModelConfig&, const std::string&); \
  template std::unique_ptr<Mixer<Exec>> make_mixer<Exec>(const ModelConfig&, const std::string&, const ModelParallel&);
KMAMBA_FOR_EACH_BACKEND(KMAMBA_INSTANTIATE_MAKE_MIXER)
#undef KMAMBA_INSTANTIATE_MAKE_MIXER

}  // namespace kmamba
