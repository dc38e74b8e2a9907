# Finding kmamba's dependencies, with one clear message for each thing that is missing or contradicts.

# Kokkos >= 3.4 and Kokkos Kernels; derives KMAMBA_ENABLE_CUDA from the Kokkos that was found.
macro(kmamba_find_kokkos)
  find_package(Kokkos 3.4 CONFIG QUIET)
  if(NOT Kokkos_FOUND)
    if(DEFINED Kokkos_ROOT OR DEFINED ENV{Kokkos_ROOT})
      set(_kmamba_where "Kokkos_ROOT='${Kokkos_ROOT}$ENV{Kokkos_ROOT}' holds no usable KokkosConfig.cmake of version >= 3.4")
    else()
      set(_kmamba_where "no Kokkos_ROOT was given and none was found on CMAKE_PREFIX_PATH")
    endif()
    message(FATAL_ERROR "kmamba: Kokkos >= 3.4 not found: ${_kmamba_where}.\n"
      "Build it with `scripts/bootstrap.sh` (host) or `scripts/bootstrap.sh --flavour cuda` and pass "
      "-DKokkos_ROOT=<the prefix it prints>, or point Kokkos_ROOT at your own Kokkos install "
      "(the directory that contains lib/cmake/Kokkos).")
  endif()
  find_package(KokkosKernels CONFIG QUIET HINTS "${Kokkos_DIR}/../../.." "${Kokkos_ROOT}")
  if(NOT KokkosKernels_FOUND)
    message(FATAL_ERROR "kmamba: Kokkos Kernels not found beside Kokkos ${Kokkos_VERSION} (${Kokkos_DIR}). "
      "`scripts/bootstrap.sh` installs both; with your own install, set KokkosKernels_ROOT.")
  endif()

  if("CUDA" IN_LIST Kokkos_DEVICES)
    set(KMAMBA_KOKKOS_HAS_CUDA ON)
  else()
    set(KMAMBA_KOKKOS_HAS_CUDA OFF)
  endif()
  if(DEFINED KMAMBA_ENABLE_CUDA AND NOT KMAMBA_ENABLE_CUDA STREQUAL "")
    if(KMAMBA_ENABLE_CUDA AND NOT KMAMBA_KOKKOS_HAS_CUDA)
      message(FATAL_ERROR "kmamba: KMAMBA_ENABLE_CUDA=ON contradicts the Kokkos found at ${Kokkos_DIR}, "
        "which has no CUDA backend (devices: ${Kokkos_DEVICES}). Use a CUDA Kokkos "
        "(`scripts/bootstrap.sh --flavour cuda`) or drop KMAMBA_ENABLE_CUDA.")
    elseif(NOT KMAMBA_ENABLE_CUDA AND KMAMBA_KOKKOS_HAS_CUDA)
      message(FATAL_ERROR "kmamba: KMAMBA_ENABLE_CUDA=OFF contradicts the Kokkos found at ${Kokkos_DIR}, "
        "which is built with CUDA (devices: ${Kokkos_DEVICES}). Use a host Kokkos "
        "(`scripts/bootstrap.sh`) or drop KMAMBA_ENABLE_CUDA.")
    endif()
  endif()
  set(KMAMBA_ENABLE_CUDA ${KMAMBA_KOKKOS_HAS_CUDA} CACHE BOOL
      "Build the CUDA backend (derived from the Kokkos found; must agree with it)" FORCE)
  if("OPENMP" IN_LIST Kokkos_DEVICES)
    set(KMAMBA_HAS_OPENMP ON)
  else()
    set(KMAMBA_HAS_OPENMP OFF)
  endif()
  if("SERIAL" IN_LIST Kokkos_DEVICES)
    set(KMAMBA_HAS_SERIAL ON)
  else()
    set(KMAMBA_HAS_SERIAL OFF)
  endif()
endmacro()

# nlohmann/json (header-only, used privately by models/ and by the tests): from an installed
# nlohmann_json package, or a directory holding nlohmann/json.hpp given as KMAMBA_JSON_INCLUDE_DIR.
macro(kmamba_find_json)
  set(KMAMBA_JSON_INCLUDE_DIR "" CACHE PATH "Directory holding nlohmann/json.hpp (default: the installed nlohmann_json)")
  if(NOT KMAMBA_JSON_INCLUDE_DIR)
    find_package(nlohmann_json 3 QUIET)
    if(nlohmann_json_FOUND)
      get_target_property(_kmamba_json_dirs nlohmann_json::nlohmann_json INTERFACE_INCLUDE_DIRECTORIES)
      list(GET _kmamba_json_dirs 0 _kmamba_json_dir)
      set(KMAMBA_JSON_INCLUDE_DIR "${_kmamba_json_dir}" CACHE PATH "Directory holding nlohmann/json.hpp" FORCE)
    endif()
  endif()
  if(NOT EXISTS "${KMAMBA_JSON_INCLUDE_DIR}/nlohmann/json.hpp")
    message(FATAL_ERROR "kmamba: nlohmann/json.hpp not found (Debian: `apt-get install nlohmann-json3-dev`, or run "
      "scripts/bootstrap.sh, or pass -DKMAMBA_JSON_INCLUDE_DIR=<dir containing nlohmann/json.hpp>).")
  endif()
endmacro()

macro(kmamba_find_optional_deps)
  if(KMAMBA_ENABLE_MPI)
    find_package(MPI COMPONENTS CXX QUIET)
    if(NOT MPI_CXX_FOUND)
      message(FATAL_ERROR "kmamba: KMAMBA_ENABLE_MPI=ON but no MPI C++ library was found. "
        "Install it (Debian: `apt-get install libopenmpi-dev openmpi-bin`, or run scripts/bootstrap.sh) "
        "or configure with -DKMAMBA_ENABLE_MPI=OFF.")
    endif()
  endif()

  if(KMAMBA_ENABLE_CUDA)
    find_package(CUDAToolkit QUIET)
    if(NOT CUDAToolkit_FOUND)
      message(FATAL_ERROR "kmamba: the Kokkos found is built with CUDA but the CUDA toolkit "
        "(cudart, cuBLAS) was not found; put its bin/ on PATH or set CUDAToolkit_ROOT.")
    endif()
  endif()

  if(NOT DEFINED KMAMBA_ENABLE_NCCL)
    set(_kmamba_nccl_default OFF)
    if(KMAMBA_ENABLE_CUDA AND KMAMBA_ENABLE_MPI)
      set(_kmamba_nccl_default ON)
    endif()
  endif()
  option(KMAMBA_ENABLE_NCCL "Build the NCCL communicator (needs CUDA and MPI)" ${_kmamba_nccl_default})
  if(KMAMBA_ENABLE_NCCL)
    if(NOT KMAMBA_ENABLE_CUDA)
      message(FATAL_ERROR "kmamba: KMAMBA_ENABLE_NCCL=ON contradicts KMAMBA_ENABLE_CUDA=OFF: NCCL needs "
        "the CUDA backend. Use a CUDA Kokkos or configure with -DKMAMBA_ENABLE_NCCL=OFF.")
    endif()
    if(NOT KMAMBA_ENABLE_MPI)
      message(FATAL_ERROR "kmamba: KMAMBA_ENABLE_NCCL=ON contradicts KMAMBA_ENABLE_MPI=OFF: the NCCL "
        "communicator is bootstrapped with MPI. Enable MPI or configure with -DKMAMBA_ENABLE_NCCL=OFF.")
    endif()
    find_package(NCCL QUIET)
    if(NOT NCCL_FOUND)
      message(FATAL_ERROR "kmamba: KMAMBA_ENABLE_NCCL=ON but nccl.h / libnccl were not found "
        "(looked beside the CUDA toolkit and in the system paths); set NCCL_ROOT or configure "
        "with -DKMAMBA_ENABLE_NCCL=OFF.")
    endif()
  endif()
endmacro()

# Warnings for kmamba's own targets; KMAMBA_WERROR (CI turns it on) makes them errors.
option(KMAMBA_WERROR "Treat compiler warnings in kmamba's own code as errors" OFF)
function(kmamba_warnings target)
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
    target_compile_options(${target} PRIVATE -Wall -Wextra)
    if(KMAMBA_WERROR)
      target_compile_options(${target} PRIVATE -Werror)
    endif()
  endif()
endfunction()
