// KMAMBA_FOR_EACH_BACKEND(M) expands M(Space) once for every execution space this build enables
// (Kokkos::Serial, Kokkos::OpenMP, Kokkos::Cuda): the library instantiates its templates with it,
// at the end of the .cpp file that defines them.
//
//   #define KMAMBA_INSTANTIATE(Exec) template class Mamba2Mixer<Exec>;
//   KMAMBA_FOR_EACH_BACKEND(KMAMBA_INSTANTIATE)
//   #undef KMAMBA_INSTANTIATE
#ifndef KMAMBA_CORE_FOREACHBACKEND_HPP
#define KMAMBA_CORE_FOREACHBACKEND_HPP

#include <kmamba/Config.hpp>

#include <Kokkos_Core.hpp>

#if KMAMBA_HAS_SERIAL
#define KMAMBA_IMPL_ON_SERIAL(M) M(Kokkos::Serial)
#else
#define KMAMBA_IMPL_ON_SERIAL(M)
#endif
#if KMAMBA_HAS_OPENMP
#define KMAMBA_IMPL_ON_OPENMP(M) M(Kokkos::OpenMP)
#else
#define KMAMBA_IMPL_ON_OPENMP(M)
#endif
#if KMAMBA_ENABLE_CUDA
#define KMAMBA_IMPL_ON_CUDA(M) M(Kokkos::Cuda)
#else
#define KMAMBA_IMPL_ON_CUDA(M)
#endif

#define KMAMBA_FOR_EACH_BACKEND(M) KMAMBA_IMPL_ON_SERIAL(M) KMAMBA_IMPL_ON_OPENMP(M) KMAMBA_IMPL_ON_CUDA(M)

#endif
