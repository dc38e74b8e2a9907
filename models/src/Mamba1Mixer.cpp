// Explicit instantiations of kmamba::Mamba1Mixer for every execution space this build enables.
#include <kmamba/Config.hpp>
#include <kmamba/models/Mamba1Mixer.hpp>
#include <kmamba/models/impl/Mamba1MixerImpl.hpp>

namespace kmamba {

#if KMAMBA_HAS_SERIAL
template class Mamba1Mixer<Kokkos::Serial>;
#endif
#if KMAMBA_HAS_OPENMP
template class Mamba1Mixer<Kokkos::OpenMP>;
#endif
#if KMAMBA_ENABLE_CUDA
template class Mamba1Mixer<Kokkos::Cuda>;
#endif

}  // namespace kmamba
