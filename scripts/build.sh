#!/usr/bin/env bash
# Sets up the dependencies (scripts/bootstrap.sh), then configures and builds kmamba.
#
#   scripts/build.sh [--flavour host|cuda] [--build-dir DIR] [--werror] [--target T]... [-- extra CMake arguments]
#
# --target builds only the named targets (repeatable; default: everything).
# --kokkos-root DIR builds against a Kokkos + Kokkos Kernels already installed in DIR (3.4 or 4.x),
# without running the bootstrap (no Debian packages installed, no Kokkos built).
#
# Other bootstrap options (--source, --kokkos-source, --kernels-source, --no-apt, --deps-dir, --jobs)
# are passed through; with --kokkos-source the Kokkos given is built by the bootstrap and used.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"

flavour=host
build_dir=""
werror=OFF
bootstrap_args=()
cmake_args=()
targets=()
kokkos_root=""
while [ $# -gt 0 ]; do
  case "$1" in
    --flavour) flavour="$2"; bootstrap_args+=(--flavour "$2"); shift 2 ;;
    --build-dir) build_dir="$2"; shift 2 ;;
    --werror) werror=ON; shift ;;
    --target) targets+=(--target "$2"); shift 2 ;;
    --source|--kokkos-source|--kernels-source|--deps-dir|--jobs) bootstrap_args+=("$1" "$2"); shift 2 ;;
    --kokkos-root) kokkos_root="$2"; shift 2 ;;
    --no-apt) bootstrap_args+=("$1"); shift ;;
    --) shift; cmake_args+=("$@"); break ;;
    -h|--help) sed -n '2,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build.sh: unknown argument '$1' (see --help)" >&2; exit 1 ;;
  esac
done
[ -n "$build_dir" ] || build_dir="$root/build-$flavour"
jobs="$(nproc 2>/dev/null || echo 2)"

if [ -n "$kokkos_root" ]; then
  [ -d "$kokkos_root" ] || { echo "build.sh: --kokkos-root '$kokkos_root' is not a directory" >&2; exit 1; }
  kokkos_root="$(cd "$kokkos_root" && pwd)"
else
  kokkos_root="$("$here/bootstrap.sh" "${bootstrap_args[@]}" | sed -n 's/^Kokkos_ROOT=//p' | tail -n 1)"
  [ -n "$kokkos_root" ] || { echo "build.sh: bootstrap did not report a Kokkos install" >&2; exit 1; }
fi

config=(-DKokkos_ROOT="$kokkos_root" -DCMAKE_BUILD_TYPE=Release -DKMAMBA_WERROR="$werror")
if [ "$flavour" = cuda ]; then
  config+=(-DCMAKE_CXX_COMPILER="$kokkos_root/bin/nvcc_wrapper")
fi
echo "build.sh: configuring $build_dir (Kokkos_ROOT=$kokkos_root)" >&2
mkdir -p "$build_dir"
cmake -S "$root" -B "$build_dir" "${config[@]}" "${cmake_args[@]}" >"$build_dir.configure.log" 2>&1 \
  || { tail -n 30 "$build_dir.configure.log" >&2; echo "build.sh: configuring failed (log: $build_dir.configure.log)" >&2; exit 1; }
echo "build.sh: building with $jobs jobs" >&2
cmake --build "$build_dir" -j "$jobs" "${targets[@]}" >&2
echo "$build_dir"
