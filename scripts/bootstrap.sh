#!/usr/bin/env bash
# kmamba dependency bootstrap.
#
# Installs the Debian packages kmamba needs and builds Kokkos 3.4.01 + Kokkos Kernels 3.4.01 from
# Debian's `trilinos` source package into a cache outside the clone, so that later runs reuse it.
# With --kokkos-source and --kernels-source it builds another Kokkos release instead (the Kokkos 4
# line: Debian 12's registry offers only 3.4, so the user supplies its release tarballs).
# Idempotent: a finished install carries a stamp; an install without its stamp is removed and redone.
#
#   scripts/bootstrap.sh [--flavour host|cuda] [options]
#
# Prints the Kokkos install prefix as its last line (`Kokkos_ROOT=...`).
set -euo pipefail

KOKKOS_VERSION=3.4.01
TRILINOS_VERSION=13.2.0
STAMP_VERSION=5   # bump when the build recipe below changes

flavour=host
deps_dir="${KMAMBA_DEPS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kmamba}"
source_arg=""
kokkos_source_arg=""
kernels_source_arg=""
kernels_version=""
use_apt=1
jobs="$(nproc 2>/dev/null || echo 2)"
pack_out=""
cuda_arch=HOPPER90

usage() {
  cat <<USAGE
usage: scripts/bootstrap.sh [options]

Builds Kokkos ${KOKKOS_VERSION} + Kokkos Kernels ${KOKKOS_VERSION} (from Debian's trilinos ${TRILINOS_VERSION}
source package) into a cache, after installing the Debian packages kmamba needs.

options:
  --flavour host|cuda   host: OpenMP + Serial, BLAS = OpenBLAS (default)
                        cuda: CUDA + OpenMP + Serial (sm_90), BLAS = cuBLAS; compiles anywhere
                        the CUDA toolkit is installed, runs on a GPU machine
  --deps-dir DIR        cache directory (default: \$KMAMBA_DEPS_DIR or ~/.cache/kmamba; now: ${deps_dir})
  --source PATH         use this source instead of 'apt-get source trilinos': a Trilinos source tree,
                        the trilinos orig tarball, or a tarball made by --pack-source (for machines
                        that cannot download anything)
  --pack-source FILE    write a small tarball holding only packages/kokkos and packages/kokkos-kernels
                        (about 5 MB) to FILE, for --source on another machine, and exit
  --kokkos-source PATH  build this Kokkos release instead of ${KOKKOS_VERSION}: its source tarball
                        (kokkos-X.Y.ZZ.tar.gz, as released) or an unpacked source tree; needs
                        --kernels-source; host flavour only (the cuda flavour patches Kokkos 3.4)
  --kernels-source PATH the matching Kokkos Kernels release: tarball or source tree
  --no-apt              do not install Debian packages (non-Debian machines, or no package registry)
  --jobs N              parallel build jobs (default: ${jobs})
  -h, --help            this text

The install goes to DEPS_DIR/kokkos-VERSION-FLAVOUR (VERSION: ${KOKKOS_VERSION}, or that of
--kokkos-source); pass it to CMake as -DKokkos_ROOT=...
USAGE
}

die() { echo "bootstrap: error: $*" >&2; exit 1; }
say() { echo "bootstrap: $*" >&2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --flavour) [ $# -ge 2 ] || die "--flavour needs a value (host or cuda)"; flavour="$2"; shift 2 ;;
    --flavour=*) flavour="${1#*=}"; shift ;;
    --deps-dir) [ $# -ge 2 ] || die "--deps-dir needs a directory"; deps_dir="$2"; shift 2 ;;
    --source) [ $# -ge 2 ] || die "--source needs a path"; source_arg="$2"; shift 2 ;;
    --kokkos-source) [ $# -ge 2 ] || die "--kokkos-source needs a path"; kokkos_source_arg="$2"; shift 2 ;;
    --kernels-source) [ $# -ge 2 ] || die "--kernels-source needs a path"; kernels_source_arg="$2"; shift 2 ;;
    --pack-source) [ $# -ge 2 ] || die "--pack-source needs a file name"; pack_out="$2"; shift 2 ;;
    --no-apt) use_apt=0; shift ;;
    --jobs) [ $# -ge 2 ] || die "--jobs needs a number"; jobs="$2"; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) usage >&2; die "unknown argument '$1'" ;;
  esac
done
case "$flavour" in host|cuda) ;; *) die "--flavour must be 'host' or 'cuda', got '$flavour'" ;; esac
case "$jobs" in ''|*[!0-9]*) die "--jobs must be a positive integer, got '$jobs'" ;; esac
if [ -n "$kokkos_source_arg$kernels_source_arg" ]; then
  [ -n "$kokkos_source_arg" ] && [ -n "$kernels_source_arg" ] || die "--kokkos-source and --kernels-source go together"
  [ -z "$source_arg$pack_out" ] || die "--kokkos-source replaces the trilinos source: no --source or --pack-source with it"
  [ "$flavour" = host ] || die "--kokkos-source builds the host flavour only (the cuda flavour's fixes are for Kokkos ${KOKKOS_VERSION})"
fi

mkdir -p "$deps_dir" || die "cannot create the cache directory '$deps_dir'"
deps_dir="$(cd "$deps_dir" && pwd)"

# ---------------------------------------------------------------------------------------------
# 1. Debian packages
# ---------------------------------------------------------------------------------------------
debian_packages=(build-essential cmake git libgtest-dev libgmock-dev
                 libopenmpi-dev openmpi-bin nlohmann-json3-dev libopenblas-dev libcli11-dev libpng-dev
                 ca-certificates xz-utils dpkg-dev
                 clang libclang-rt-14-dev)   # clang + libFuzzer for scripts/fuzz.sh
if [ "$use_apt" = 1 ]; then
  command -v dpkg-query >/dev/null 2>&1 || die "dpkg-query not found: this is not a Debian machine; install the equivalents of: ${debian_packages[*]} and rerun with --no-apt"
  missing=()
  for p in "${debian_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    say "installing Debian packages: ${missing[*]}"
    sudo_cmd=""
    [ "$(id -u)" = 0 ] || sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
      || die "apt-get install failed for: ${missing[*]}"
  else
    say "Debian packages already installed"
  fi
fi
command -v cmake >/dev/null 2>&1 || die "cmake not found (Debian package 'cmake')"
command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || die "no C++ compiler found (Debian package 'build-essential')"

# ---------------------------------------------------------------------------------------------
# 2. Kokkos / Kokkos Kernels source
# ---------------------------------------------------------------------------------------------
src_root="$deps_dir/src/trilinos-${TRILINOS_VERSION}"   # holds packages/kokkos, packages/kokkos-kernels

extract_tarball() {  # $1 = tarball; extracts the two packages into $src_root
  local tarball="$1" tmp
  tmp="$(mktemp -d "$deps_dir/src/extract.XXXXXX")"
  say "extracting Kokkos sources from $tarball"
  tar -xf "$tarball" -C "$tmp" --wildcards '*packages/kokkos/*' '*packages/kokkos-kernels/*' \
    || { rm -rf "$tmp"; die "could not extract packages/kokkos and packages/kokkos-kernels from '$tarball'"; }
  local top
  top="$(find "$tmp" -maxdepth 3 -type d -name packages | head -n 1)"
  [ -n "$top" ] && [ -f "$top/kokkos/CMakeLists.txt" ] && [ -f "$top/kokkos-kernels/CMakeLists.txt" ] \
    || { rm -rf "$tmp"; die "'$tarball' does not hold packages/kokkos and packages/kokkos-kernels"; }
  rm -rf "$src_root"
  mkdir -p "$src_root"
  mv "$top" "$src_root/packages"
  rm -rf "$tmp"
}

check_kokkos_version() {  # $1 = packages dir
  grep -q "tag:  ${KOKKOS_VERSION}" "$1/kokkos/master_history.txt" 2>/dev/null \
    || die "the Kokkos source in '$1/kokkos' is not version ${KOKKOS_VERSION}"
}

release_version() {  # $1 = source tree, $2 = CMake project prefix (Kokkos, KokkosKernels): prints X.Y.ZZ
  local v major minor patch
  v="$(sed -nE "s/^ *[sS][eE][tT] *\($2_VERSION_(MAJOR|MINOR|PATCH) +([0-9]+) *\).*/\1 \2/p" "$1/CMakeLists.txt")"
  major="$(echo "$v" | sed -n 's/^MAJOR //p' | head -n 1)"
  minor="$(echo "$v" | sed -n 's/^MINOR //p' | head -n 1)"
  patch="$(echo "$v" | sed -n 's/^PATCH //p' | head -n 1)"
  [ -n "$major" ] && [ -n "$minor" ] && [ -n "$patch" ] || die "'$1' names no $2 version in its CMakeLists.txt"
  printf '%d.%d.%02d\n' "$major" "$minor" "$((10#$patch))"
}

unpack_release() {  # $1 = tarball or tree, $2 = destination; the tree holds CMakeLists.txt at its top
  local from="$1" dest="$2" tmp top
  rm -rf "$dest"
  if [ -d "$from" ]; then
    [ -f "$from/CMakeLists.txt" ] || die "'$from' is not a source tree (no CMakeLists.txt)"
    cp -a "$from" "$dest"
  elif [ -f "$from" ]; then
    tmp="$(mktemp -d "$deps_dir/src/extract.XXXXXX")"
    say "extracting $from"
    tar -xf "$from" -C "$tmp" || { rm -rf "$tmp"; die "could not extract '$from'"; }
    top="$(find "$tmp" -maxdepth 2 -name CMakeLists.txt -printf '%h\n' | sort | head -n 1)"
    [ -n "$top" ] || { rm -rf "$tmp"; die "'$from' holds no source tree (no CMakeLists.txt)"; }
    mv "$top" "$dest"
    rm -rf "$tmp"
  else
    die "'$from' does not exist"
  fi
}

mkdir -p "$deps_dir/src"
if [ -n "$kokkos_source_arg" ]; then
  # A Kokkos release given by the user: unpacked into the cache, keyed by its version.
  unpack_release "$kokkos_source_arg" "$deps_dir/src/kokkos-given"
  unpack_release "$kernels_source_arg" "$deps_dir/src/kokkos-kernels-given"
  [ -f "$deps_dir/src/kokkos-given/core/src/Kokkos_Core.hpp" ] || die "'$kokkos_source_arg' is not a Kokkos source"
  [ -d "$deps_dir/src/kokkos-kernels-given/blas" ] || die "'$kernels_source_arg' is not a Kokkos Kernels source"
  KOKKOS_VERSION="$(release_version "$deps_dir/src/kokkos-given" Kokkos)"
  kernels_version="$(release_version "$deps_dir/src/kokkos-kernels-given" KokkosKernels)"
  say "Kokkos ${KOKKOS_VERSION} and Kokkos Kernels ${kernels_version} from the sources given"
  kokkos_pkg="$deps_dir/src/kokkos-given"
  kernels_pkg="$deps_dir/src/kokkos-kernels-given"
elif [ -n "$source_arg" ]; then
  if [ -d "$source_arg" ]; then
    [ -f "$source_arg/packages/kokkos/CMakeLists.txt" ] || die "'$source_arg' is not a Trilinos source tree (no packages/kokkos/CMakeLists.txt)"
    if [ "$(cd "$source_arg" && pwd)" != "$src_root" ]; then
      rm -rf "$src_root"; mkdir -p "$src_root/packages"
      cp -a "$source_arg/packages/kokkos" "$source_arg/packages/kokkos-kernels" "$src_root/packages/"
    fi
  elif [ -f "$source_arg" ]; then
    extract_tarball "$source_arg"
  else
    die "--source '$source_arg' does not exist"
  fi
elif [ ! -f "$src_root/.complete" ]; then
  command -v apt-get >/dev/null 2>&1 || die "apt-get not found; pass --source with a Trilinos ${TRILINOS_VERSION} source tree or tarball"
  apt_dir="$deps_dir/src/apt"
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/sources.list.d" "$apt_dir/download"
  cat > "$apt_dir/sources.list.d/debian-src.sources" <<SRC
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: bookworm
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  apt_opts=(-o "Dir::Etc::SourceParts=$apt_dir/sources.list.d" -o "Dir::Etc::SourceList=/dev/null"
            -o "Dir::State::Lists=$apt_dir/lists" -o "Debug::NoDropPrivs=1" -o "APT::Sandbox::User=root")
  say "fetching Debian's trilinos source package (about 170 MB)"
  apt-get -qq "${apt_opts[@]}" update || die "apt-get update for the deb-src index failed"
  (cd "$apt_dir/download" && apt-get -qq "${apt_opts[@]}" source --download-only "trilinos=${TRILINOS_VERSION}-*" >/dev/null 2>&1 \
     || apt-get -qq "${apt_opts[@]}" source --download-only trilinos >/dev/null) \
    || die "'apt-get source trilinos' failed"
  orig="$(ls "$apt_dir/download"/trilinos_${TRILINOS_VERSION}.orig.tar.* 2>/dev/null | head -n 1)"
  [ -n "$orig" ] || die "the trilinos ${TRILINOS_VERSION} orig tarball was not downloaded"
  extract_tarball "$orig"
  rm -rf "$apt_dir/download"
fi
if [ -z "$kokkos_source_arg" ]; then
  check_kokkos_version "$src_root/packages"
  touch "$src_root/.complete"
  kokkos_pkg="$src_root/packages/kokkos"
  kernels_pkg="$src_root/packages/kokkos-kernels"
fi

if [ -n "$pack_out" ]; then
  tar -C "$src_root" -cJf "$pack_out" packages/kokkos packages/kokkos-kernels || die "could not write '$pack_out'"
  say "wrote $pack_out"
  exit 0
fi

# ---------------------------------------------------------------------------------------------
# 3. Build
# ---------------------------------------------------------------------------------------------
prefix="$deps_dir/kokkos-${KOKKOS_VERSION}-${flavour}"
stamp="$prefix/.kmamba-bootstrap"
want_stamp="kmamba-bootstrap ${STAMP_VERSION} kokkos ${KOKKOS_VERSION} flavour ${flavour} arch ${cuda_arch}"
# The CUDA flavour carries fixes the host flavour does not need; their count is part of its stamp.
[ "$flavour" = cuda ] && want_stamp="$want_stamp cuda-fixes 9"
[ -n "$kokkos_source_arg" ] && want_stamp="$want_stamp kernels ${kernels_version} from given sources"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want_stamp" ]; then
  say "Kokkos ${KOKKOS_VERSION} (${flavour}) already installed in $prefix"
  echo "Kokkos_ROOT=$prefix"
  exit 0
fi
[ -e "$prefix" ] && { say "removing an incomplete or outdated install in $prefix"; rm -rf "$prefix"; }

work="$deps_dir/build-${flavour}"
rm -rf "$work"
mkdir -p "$work"
kokkos_src="$work/kokkos-src"          # patched copy; the cached source stays pristine
cp -a "$kokkos_pkg" "$kokkos_src"

apply_fix() {  # $1 = description, $2 = file, $3 = check-regex that must match after the edit
  grep -Eq -- "$3" "$2" || die "Kokkos fix '$1' did not apply to $2"
}

cmake_common=(-DCMAKE_BUILD_TYPE=Release -DCMAKE_INSTALL_PREFIX="$prefix" -DCMAKE_CXX_STANDARD=17
              -DCMAKE_CXX_EXTENSIONS=OFF -DCMAKE_POSITION_INDEPENDENT_CODE=ON -DBUILD_SHARED_LIBS=OFF
              -DCMAKE_POLICY_VERSION_MINIMUM=3.10)
kokkos_opts=(-DKokkos_ENABLE_SERIAL=ON -DKokkos_ENABLE_OPENMP=ON -DKokkos_ENABLE_TESTS=OFF
             -DKokkos_ENABLE_EXAMPLES=OFF)
kk_opts=(-DKokkosKernels_ENABLED_COMPONENTS="BATCHED;BLAS" -DKokkosKernels_ADD_DEFAULT_ETI=OFF
         -DKokkosKernels_ENABLE_TESTS=OFF -DKokkosKernels_ENABLE_EXAMPLES=OFF
         -DKokkosKernels_ENABLE_TPL_LAPACK=OFF -DKokkosKernels_ENABLE_TPL_CUSPARSE=OFF)

if [ "$flavour" = cuda ]; then
  nvcc_bin="$(command -v nvcc || true)"
  [ -n "$nvcc_bin" ] || for d in /usr/local/cuda/bin /usr/local/cuda-*/bin; do [ -x "$d/nvcc" ] && nvcc_bin="$d/nvcc" && break; done
  [ -n "$nvcc_bin" ] || die "nvcc not found: the cuda flavour needs the CUDA toolkit (put its bin/ on PATH)"
  cuda_home="$(cd "$(dirname "$nvcc_bin")/.." && pwd)"
  export PATH="$cuda_home/bin:$PATH"
  say "CUDA toolkit: $cuda_home ($("$nvcc_bin" --version | grep -o 'release [0-9.]*'))"

  # Fix 1: nvcc_wrapper defaults to sm_35, which nvcc 13 refuses.
  sed -i 's/^default_arch="sm_35"/default_arch="sm_90"/' "$kokkos_src/bin/nvcc_wrapper"
  apply_fix "nvcc_wrapper default arch" "$kokkos_src/bin/nvcc_wrapper" '^default_arch="sm_90"'
  # Fix 2: half -> double/integer conversions: pass a __half to the intrinsics, go through float
  # for double (__half2double is gone in CUDA 13).
  half_hpp="$kokkos_src/core/src/Cuda/Kokkos_Cuda_Half.hpp"
  sed -i -E 's/return __half2double\(val\);/return static_cast<double>(__half2float(static_cast<__half>(val)));/' "$half_hpp"
  sed -i -E 's/return (__half2(short|ushort|int|uint|ll|ull)_rz|__half2float)\(val\);/return \1(static_cast<__half>(val));/' "$half_hpp"
  apply_fix "half to double" "$half_hpp" 'static_cast<double>\(__half2float\(static_cast<__half>\(val\)\)\)'
  apply_fix "half to float" "$half_hpp" 'return __half2float\(static_cast<__half>\(val\)\);'
  grep -q '__half2double' "$half_hpp" && die "Kokkos fix 'half to double' left a __half2double call in $half_hpp"
  # Fix 3: cudaMemPrefetchAsync takes a cudaMemLocation and flags on CUDA >= 13.
  space_cpp="$kokkos_src/core/src/Cuda/Kokkos_CudaSpace.cpp"
  prefetch_patch='
    #if defined(CUDART_VERSION) && CUDART_VERSION >= 13000
    cudaMemLocation kmamba_loc;
    kmamba_loc.type = cudaMemLocationTypeDevice;
    kmamba_loc.id   = space.cuda_device();
    CUDA_SAFE_CALL(cudaMemPrefetchAsync(ptr, bytes, kmamba_loc, 0,
                                        space.cuda_stream()));
    #else
    CUDA_SAFE_CALL(cudaMemPrefetchAsync(ptr, bytes, space.cuda_device(),
                                        space.cuda_stream()));
    #endif'
  awk -v repl="$prefetch_patch" '
    /CUDA_SAFE_CALL\(cudaMemPrefetchAsync\(ptr, bytes, space.cuda_device\(\),/ { getline nxt; print repl; next }
    { print }' "$space_cpp" > "$space_cpp.new" && mv "$space_cpp.new" "$space_cpp"
  apply_fix "cudaMemPrefetchAsync location" "$space_cpp" 'cudaMemPrefetchAsync\(ptr, bytes, kmamba_loc, 0,'
  # Fix 4: a Hopper arch option, so kernels are compiled for sm_90.
  arch_cmake="$kokkos_src/cmake/kokkos_arch.cmake"
  sed -i -E 's/^(KOKKOS_ARCH_OPTION\(AMPERE86 .*)$/\1\nKOKKOS_ARCH_OPTION(HOPPER90        GPU  "NVIDIA Hopper generation CC 9.0")/' "$arch_cmake"
  sed -i -E 's/^(CHECK_CUDA_ARCH\(AMPERE86  sm_86\))$/\1\nCHECK_CUDA_ARCH(HOPPER90  sm_90)/' "$arch_cmake"
  sed -i -E 's/^(#cmakedefine KOKKOS_ARCH_AMPERE86)$/\1\n#cmakedefine KOKKOS_ARCH_HOPPER90/' "$kokkos_src/cmake/KokkosCore_config.h.in"
  apply_fix "Hopper arch option" "$arch_cmake" '^KOKKOS_ARCH_OPTION\(HOPPER90'
  apply_fix "Hopper arch check" "$arch_cmake" '^CHECK_CUDA_ARCH\(HOPPER90  sm_90\)'
  apply_fix "Hopper config define" "$kokkos_src/cmake/KokkosCore_config.h.in" '^#cmakedefine KOKKOS_ARCH_HOPPER90'

  # Fix 5: Kokkos 3.4 copies the properties of FindCUDAToolkit's CUDA::cudart / CUDA::cuda_driver
  # into its installed config; with CMake >= 3.28 those targets link internal helper targets that
  # do not exist in a consumer, so Kokkos Kernels and every user fail to configure. Link the
  # libraries by path instead (nvcc_wrapper supplies the CUDA include directories).
  cat > "$kokkos_src/cmake/Modules/FindTPLCUDA.cmake" <<'CUDA_TPL'
IF (NOT CUDAToolkit_ROOT AND CUDA_ROOT)
  SET(CUDAToolkit_ROOT ${CUDA_ROOT})
ENDIF()
find_package(CUDAToolkit)
include(FindPackageHandleStandardArgs)
FIND_PACKAGE_HANDLE_STANDARD_ARGS(TPLCUDA DEFAULT_MSG CUDA_cudart_LIBRARY CUDA_cuda_driver_LIBRARY)
IF (CUDA_cudart_LIBRARY AND CUDA_cuda_driver_LIBRARY)
  KOKKOS_CREATE_IMPORTED_TPL(CUDA INTERFACE
    LINK_LIBRARIES ${CUDA_cuda_driver_LIBRARY} ${CUDA_cudart_LIBRARY}
  )
ENDIF()
CUDA_TPL
  apply_fix "CUDA TPL by path" "$kokkos_src/cmake/Modules/FindTPLCUDA.cmake" 'LINK_LIBRARIES \$\{CUDA_cuda_driver_LIBRARY\}'

  # Fix 6: the block-wide step of Kokkos 3.4's CUDA reductions (cuda_inter_warp_reduction, used by
  # every team parallel_reduce) reads its static __shared__ partials and returns with no barrier,
  # so the next reduction of the same value type in the same kernel overwrites the partials while
  # slower warps still read them: compute-sanitizer racecheck reports it, and under racecheck's
  # scheduling RMSNorm backward (two reductions per row) and the SSD chunk backward computed wrong
  # gradients. Fixed upstream in Kokkos 3.6 (PR 4855); here a barrier closes both overloads.
  reduce_hpp="$kokkos_src/core/src/Cuda/Kokkos_Cuda_ReduceScan.hpp"
  awk '
    /^    join\(value, result\[i\]\);$/ { print; print "  __syncthreads();  // kmamba fix 6"; next }
    /^  reducer.reference\(\) = value;$/ && !seen_ref { seen_ref = 1; print; print "  __syncthreads();  // kmamba fix 6"; next }
    { print }' "$reduce_hpp" > "$reduce_hpp.new" && mv "$reduce_hpp.new" "$reduce_hpp"
  [ "$(grep -c 'kmamba fix 6' "$reduce_hpp")" = 2 ] || die "Kokkos fix 'reduction barrier' did not apply to $reduce_hpp"

  # Fix 7: the shared-memory warp tree of Kokkos 3.4's range reductions over values of 9–16 bytes
  # (CudaReductionsFunctor<..., false, false>, e.g. a combined Sum + Min of two longs) reads slots
  # that other lanes write with no barrier between: the first step reads the slots the lanes have
  # just stored, each step joins value[lane + delta] into value[lane] (a lane reads the slot its
  # neighbour is writing), a tree narrower than the warp (the block's second level, one slot per
  # warp) synchronises only its own lanes yet reads past them, and each lane then copies lane 0's
  # slot while lane 0 rewrites it: racecheck reports thousands of hazards (warnings: correct only
  # while the warp runs in lockstep). Upstream reworked this in Kokkos 3.6 (PR 4855). Here every
  # step syncs, reads its partner within its own tree, syncs, then joins, and the final broadcast
  # reads its tree's first slot, syncs, then writes. The lanes that read anything else before hold
  # values nobody uses, so the results are unchanged.
  awk '
    function syncwarp(indent) {
      print "#ifdef KOKKOS_IMPL_CUDA_SYNCWARP_NEEDS_MASK"; print indent "KOKKOS_IMPL_CUDA_SYNCWARP_MASK(mask);"
      print "#else"; print indent "KOKKOS_IMPL_CUDA_SYNCWARP;"; print "#endif"
    }
    /^      if \(lane_id \+ delta < 32\) \{$/ {
      getline join_line; getline close_line
      if (join_line != "        ValueJoin::join(functor, value, value + delta);" || close_line != "      }") { print "UNEXPECTED"; exit 1 }
      syncwarp("      ")
      print "      Scalar partner;  // kmamba fix 7"
      print "      const bool in_tree = lane_id % width + delta < width;"
      print "      if (in_tree) partner = value[delta];"
      syncwarp("      ")
      print "      if (in_tree) ValueJoin::join(functor, value, &partner);"
      next
    }
    /^    \*value = \*\(value - lane_id\);$/ {
      print "    const Scalar total = *(value - lane_id % width);  // kmamba fix 7"
      syncwarp("    ")
      print "    *value = total;"
      next
    }
    { print }' "$reduce_hpp" > "$reduce_hpp.new" && mv "$reduce_hpp.new" "$reduce_hpp"
  [ "$(grep -c 'kmamba fix 7' "$reduce_hpp")" = 2 ] || die "Kokkos fix 'warp tree' did not apply to $reduce_hpp"

  # Fix 8: after a CUDA parallel_reduce's last block has its result, thread 0 writes it (and the
  # functor's final) into the block's last shared slot and threads 0 … words − 1 copy that slot's
  # words to the result with no barrier in between unless the value is wider than a warp, so the
  # other threads may read words thread 0 has not written yet (racecheck: "Write … and Read …"
  # warnings in every range reduction of a value wider than 4 bytes). Upstream added a warp
  # barrier there in Kokkos 4.2 (PR 6630); here the barrier is a block barrier, since on the team
  # and MDRange paths the copying threads need not share thread 0's warp (it runs once, in the
  # last block, whose threads all reach it).
  parallel_hpp="$kokkos_src/core/src/Cuda/Kokkos_Cuda_Parallel.hpp"
  awk '
    /^ *if \(CudaTraits::WarpSize < word_count.value\) \{$/ {
      opening = $0; getline barrier; getline closing
      if (barrier ~ /^ *__syncthreads\(\);$/ && closing ~ /^ *\}$/) {
        sub(/if.*/, "__syncthreads();  // kmamba fix 8", opening); print opening; next
      }
      print opening; print barrier; print closing; next
    }
    { print }' "$parallel_hpp" > "$parallel_hpp.new" && mv "$parallel_hpp.new" "$parallel_hpp"
  [ "$(grep -c 'kmamba fix 8' "$parallel_hpp")" = 5 ] || die "Kokkos fix 'result barrier' did not apply to $parallel_hpp"

  # Fix 9: device allocations from CUDA's stream-ordered memory pool (a backport of Kokkos 4.0's
  # KOKKOS_ENABLE_IMPL_CUDA_MALLOC_ASYNC), ordered on the legacy default stream without waiting for
  # the device. Every CudaSpace View allocation of Kokkos 3.4 is a cudaMalloc and every release a
  # cudaFree, each a device synchronisation, and the allocation then writes its header with a
  # synchronous copy: a training step of mamba2-130m makes ~990 allocations, so the launch queue
  # drained ~3000 times a step. Here:
  # - an allocation is a cudaMallocAsync on the legacy stream and its header a cudaMemcpyAsync from
  #   pageable memory (staged at once, no wait); work on the legacy stream and on every blocking
  #   stream (Kokkos' own instances) comes after both. An allocation that grows the pool waits for
  #   the device, so that work on non-blocking streams cannot get ahead of it (rare: the pool keeps
  #   everything released);
  # - a release is a cudaFreeAsync on the legacy stream: the memory is reused only by work that
  #   comes after the work already queued on the legacy and blocking streams.
  # The rule this adds, the one of PyTorch's caching allocator: work on a non-blocking stream that
  # uses a View must be joined (an event the legacy or a blocking stream waits for, or a fence)
  # before the View's last reference goes. kmamba's communication stream is joined that way.
  # KMAMBA_CUDA_MALLOC_ASYNC=sync keeps upstream's synchronisation (after every allocation, on both
  # sides of every release, a synchronous header copy); KMAMBA_CUDA_MALLOC_ASYNC=0 keeps cudaMalloc /
  # cudaFree (read once, at the first allocation), as does a device without memory pools. On a
  # failed allocation the pool is trimmed and the allocation tried once more.
  pool_code='
// kmamba fix 9: device allocations from the stream-ordered memory pool (see scripts/bootstrap.sh).
namespace {
enum class KmambaPoolMode { none, stream_ordered, upstream_sync };

cudaMemPool_t kmamba_default_pool() {
  int device = 0;
  cudaMemPool_t pool = nullptr;
  if (cudaGetDevice(&device) != cudaSuccess || cudaDeviceGetDefaultMemPool(&pool, device) != cudaSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return pool;
}

KmambaPoolMode kmamba_pool_mode() {
  static const KmambaPoolMode mode = [] {
    const char *opt = std::getenv("KMAMBA_CUDA_MALLOC_ASYNC");
    const std::string choice = opt == nullptr ? "" : opt;
    if (choice == "0") return KmambaPoolMode::none;
    int device = 0, pools = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, device) != cudaSuccess || pools == 0) {
      cudaGetLastError();
      return KmambaPoolMode::none;
    }
    cudaMemPool_t pool = kmamba_default_pool();
    unsigned long long keep_everything = ~0ull;
    if (pool == nullptr || cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep_everything) != cudaSuccess) {
      cudaGetLastError();
      return KmambaPoolMode::none;
    }
    return choice == "sync" ? KmambaPoolMode::upstream_sync : KmambaPoolMode::stream_ordered;
  }();
  return mode;
}

unsigned long long kmamba_pool_reserved(cudaMemPool_t pool) {
  unsigned long long reserved = 0;
  if (pool == nullptr || cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemCurrent, &reserved) != cudaSuccess) {
    cudaGetLastError();
    return ~0ull;
  }
  return reserved;
}

cudaError_t kmamba_device_allocate(void **ptr, size_t size) {
  const KmambaPoolMode mode = kmamba_pool_mode();
  if (size == 0 || mode == KmambaPoolMode::none) return cudaMalloc(ptr, size);
  cudaMemPool_t pool = kmamba_default_pool();
  const unsigned long long reserved = kmamba_pool_reserved(pool);
  cudaError_t error = cudaMallocAsync(ptr, size, 0);
  if (error == cudaErrorMemoryAllocation) {
    cudaGetLastError();
    if (cudaDeviceSynchronize() == cudaSuccess && pool != nullptr && cudaMemPoolTrimTo(pool, 0) == cudaSuccess) {
      error = cudaMallocAsync(ptr, size, 0);
    }
  }
  const unsigned long long after = kmamba_pool_reserved(pool);
  const bool grew = reserved == ~0ull || after == ~0ull || after != reserved;  // unknown counts as grown
  if (error == cudaSuccess && (grew || mode == KmambaPoolMode::upstream_sync)) error = cudaDeviceSynchronize();
  return error;
}

void kmamba_device_free(void *ptr) {
  if (ptr == nullptr) return;
  const KmambaPoolMode mode = kmamba_pool_mode();
  if (mode == KmambaPoolMode::none) {
    CUDA_SAFE_CALL(cudaFree(ptr));
    return;
  }
  if (mode == KmambaPoolMode::upstream_sync) CUDA_SAFE_CALL(cudaDeviceSynchronize());
  CUDA_SAFE_CALL(cudaFreeAsync(ptr, 0));
  if (mode == KmambaPoolMode::upstream_sync) CUDA_SAFE_CALL(cudaDeviceSynchronize());
}

void kmamba_write_header(void *device_header, const void *host_header, size_t bytes) {
  if (kmamba_pool_mode() != KmambaPoolMode::stream_ordered) {
    CUDA_SAFE_CALL(cudaMemcpy(device_header, host_header, bytes, cudaMemcpyDefault));
    return;
  }
  CUDA_SAFE_CALL(cudaMemcpyAsync(device_header, host_header, bytes, cudaMemcpyHostToDevice, 0));
}
}  // namespace
'
  awk -v code="$pool_code" '
    /^void \*CudaSpace::allocate\(const size_t arg_alloc_size\) const \{$/ && !inserted { print code; inserted = 1 }
    /^  auto error_code = cudaMalloc\(&ptr, arg_alloc_size\);$/ {
      sub(/cudaMalloc\(/, "kmamba_device_allocate("); print; next
    }
    /^void CudaSpace::impl_deallocate\($/ { in_free = 1 }
    in_free && /^    CUDA_SAFE_CALL\(cudaFree\(arg_alloc_ptr\)\);$/ {
      print "    kmamba_device_free(arg_alloc_ptr);"; in_free = 0; next
    }
    /^SharedAllocationRecord<Kokkos::CudaSpace, void>::SharedAllocationRecord\($/ { in_record = 1 }
    in_record && /^  Kokkos::Impl::DeepCopy<CudaSpace, HostSpace>\(RecordBase::m_alloc_ptr, &header,$/ {
      getline rest
      print "  kmamba_write_header(RecordBase::m_alloc_ptr, &header, sizeof(SharedAllocationHeader));"
      in_record = 0; next
    }
    { print }' "$space_cpp" > "$space_cpp.new" && mv "$space_cpp.new" "$space_cpp"
  [ "$(grep -c 'kmamba_device_allocate(&ptr, arg_alloc_size)' "$space_cpp")" = 1 ] &&
    [ "$(grep -c 'kmamba_device_free(arg_alloc_ptr)' "$space_cpp")" = 1 ] &&
    [ "$(grep -c 'kmamba_write_header(RecordBase::m_alloc_ptr' "$space_cpp")" = 1 ] &&
    grep -q 'kmamba fix 9' "$space_cpp" || die "Kokkos fix 'memory pool' did not apply to $space_cpp"

  cmake_common+=(-DCMAKE_CXX_COMPILER="$kokkos_src/bin/nvcc_wrapper")
  kokkos_opts+=(-DKokkos_ENABLE_CUDA=ON -DKokkos_ENABLE_CUDA_LAMBDA=ON -DKokkos_ENABLE_CUDA_CONSTEXPR=ON
                -DKokkos_ARCH_${cuda_arch}=ON)
  kk_opts+=(-DKokkosKernels_ENABLE_TPL_CUBLAS=ON -DKokkosKernels_ENABLE_TPL_BLAS=OFF
            -DCUBLAS_LIBRARY_DIRS="$cuda_home/lib64" -DCUBLAS_LIBRARIES="cublas")
else
  kk_opts+=(-DKokkosKernels_ENABLE_TPL_BLAS=ON -DBLAS_LIBRARIES=openblas -DKokkosKernels_ENABLE_TPL_CUBLAS=OFF)
fi

run_step() {  # $1 = name, $2 = log file, rest = command
  local name="$1" log="$2"; shift 2
  say "$name (log: $log)"
  if ! "$@" >"$log" 2>&1; then
    echo "----- last lines of $log -----" >&2
    tail -n 40 "$log" >&2
    rm -rf "$prefix"
    die "$name failed; nothing was installed (full log: $log)"
  fi
}

t0=$(date +%s)
run_step "configuring Kokkos ${KOKKOS_VERSION} (${flavour})" "$work/kokkos-configure.log" \
  cmake -S "$kokkos_src" -B "$work/kokkos" "${cmake_common[@]}" "${kokkos_opts[@]}"
run_step "building Kokkos with $jobs jobs" "$work/kokkos-build.log" cmake --build "$work/kokkos" -j "$jobs"
run_step "installing Kokkos" "$work/kokkos-install.log" cmake --install "$work/kokkos"
t1=$(date +%s)
say "Kokkos done in $((t1 - t0)) s"

if [ "$flavour" = cuda ]; then
  cmake_common=("${cmake_common[@]/-DCMAKE_CXX_COMPILER=*/-DCMAKE_CXX_COMPILER=$prefix/bin/nvcc_wrapper}")
fi
run_step "configuring Kokkos Kernels ${kernels_version:-${KOKKOS_VERSION}} (BATCHED;BLAS, no default ETI)" "$work/kk-configure.log" \
  cmake -S "$kernels_pkg" -B "$work/kokkos-kernels" "${cmake_common[@]}" \
        -DKokkos_ROOT="$prefix" "${kk_opts[@]}"
run_step "building Kokkos Kernels with $jobs jobs" "$work/kk-build.log" cmake --build "$work/kokkos-kernels" -j "$jobs"
run_step "installing Kokkos Kernels" "$work/kk-install.log" cmake --install "$work/kokkos-kernels"
t2=$(date +%s)
say "Kokkos Kernels done in $((t2 - t1)) s"

[ -f "$prefix/lib/cmake/Kokkos/KokkosConfig.cmake" ] || [ -f "$prefix/lib64/cmake/Kokkos/KokkosConfig.cmake" ] \
  || { rm -rf "$prefix"; die "the install in $prefix has no KokkosConfig.cmake"; }
echo "$want_stamp" > "$stamp"
rm -rf "$work"
say "installed Kokkos ${KOKKOS_VERSION} + Kokkos Kernels (${flavour}) in $prefix ($((t2 - t0)) s)"
echo "Kokkos_ROOT=$prefix"
