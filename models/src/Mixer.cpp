// make_mixer: the mixer of a config's kind.
#include <kmamba/models/Mixer.hpp>

#include <kmamba/Config.hpp>
#include <kmamba/core/Error.hpp>
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

#if KMAMBA_HAS_SERIAL
template std::unique_ptr<Mixer<Kokkos::Serial>> make_mixer<Kokkos::Serial>(const ModelConfig&, const std::string&);
#endif
#if KMAMBA_HAS_OPENMP
template std::unique_ptr<Mixer<Kokkos::OpenMP>> make_mixer<Kokkos::OpenMP>(const ModelConfig&, const std::string&);
#endif
#if KMAMBA_ENABLE_CUDA
template std::unique_ptr<Mixer<Kokkos::Cuda>> make_mixer<Kokkos::Cuda>(const ModelConfig&, const std::string&);
#endif

}  // namespace kmamba
