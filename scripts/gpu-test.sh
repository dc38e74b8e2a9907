#!/usr/bin/env bash
# Builds the CUDA flavour on a GPU machine from carried sources and runs the `cuda`-labelled tests,
# kmamba-bench and the benchmarks (kmamba-perf, kmamba-perf-decode). Made for the device tool's
# machines, where nothing can be downloaded.
#
# Here (once):   scripts/gpu-test.sh --pack      # writes .deps/ (Kokkos, GoogleTest and JSON sources;
#                                                 # ~6 MB). The golden data travels with the working
#                                                 # tree (tests/data/golden).
# There:         scripts/gpu-test.sh             # with .deps carried; logs go to $OUT (or ./gpu-out)
#
# A shorter run: GPU_TEST_TARGETS="kmamba_decode_tests kmamba-perf-decode" builds only those targets,
# GPU_TEST_REGEX=decode runs only the matching cuda tests, GPU_TEST_PERF="kmamba-perf-decode
# kmamba-perf-train" runs only those benchmarks (names under build/perf or build/apps; default: the
# kernel and decode benchmarks and kmamba-bench; "none" runs none). GPU_TEST_JOBS=N runs N tests at
# once (default 1; the tests share the one GPU, so use it for correctness runs, not for timing).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
deps="$root/.deps"

if [ "${1:-}" = "--pack" ]; then
  mkdir -p "$deps"
  "$here/bootstrap.sh" --pack-source "$deps/kokkos-src.tar.xz"
  [ -d /usr/src/googletest ] || { echo "gpu-test.sh: /usr/src/googletest missing (Debian package googletest)" >&2; exit 1; }
  rm -rf "$deps/googletest"
  cp -a /usr/src/googletest "$deps/googletest"
  rm -rf "$deps/json" && mkdir -p "$deps/json" && cp -a /usr/include/nlohmann "$deps/json/"
  rm -rf "$deps/golden"  # left by older versions of this script; the goldens are in tests/data now
  du -sh "$deps"
  exit 0
fi

out="${OUT:-$root/gpu-out}"
mkdir -p "$out"
[ -f "$deps/kokkos-src.tar.xz" ] || { echo "gpu-test.sh: $deps/kokkos-src.tar.xz missing: run 'scripts/gpu-test.sh --pack' and carry .deps" >&2; exit 1; }
export PATH="/usr/local/cuda/bin:$PATH"
export OMP_PROC_BIND=spread OMP_PLACES=threads
{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
  nvcc --version | tail -n 2
  g++ --version | head -n 1
  cmake --version | head -n 1
  command -v mpicxx mpirun || echo "no MPI compiler wrapper"
} 2>&1 | tee "$out/machine.txt"

extra=(-DKMAMBA_GTEST_SOURCE_DIR="$deps/googletest" -DKMAMBA_JSON_INCLUDE_DIR="$deps/json")
if ! command -v mpicxx >/dev/null 2>&1; then
  extra+=(-DKMAMBA_ENABLE_MPI=OFF -DKMAMBA_ENABLE_NCCL=OFF)
fi
t0=$(date +%s)
set -o pipefail
target_args=()
for t in ${GPU_TEST_TARGETS:-}; do target_args+=(--target "$t"); done
build_dir="$("$here/build.sh" "${target_args[@]}" --flavour cuda --no-apt --source "$deps/kokkos-src.tar.xz" \
               --deps-dir /tmp/kmamba-deps --build-dir "$root/build-gpu" -- "${extra[@]}" 2> >(tee "$out/build.log" >&2) | tail -n 1)"
t1=$(date +%s)
echo "gpu-test.sh: dependencies + build took $((t1 - t0)) s" | tee -a "$out/build.log"
cd "$build_dir"
status=0
if [ -n "${GPU_TEST_REGEX:-}" ]; then
  ctest --output-on-failure -j "${GPU_TEST_JOBS:-1}" -L cuda -R "$GPU_TEST_REGEX" 2>&1 | tee "$out/ctest.log" || status=1
elif [ -z "${GPU_TEST_TARGETS:-}" ]; then
  ctest --output-on-failure -j "${GPU_TEST_JOBS:-1}" -L cuda 2>&1 | tee "$out/ctest.log" || status=1
fi
perf="${GPU_TEST_PERF:-kmamba-bench kmamba-perf kmamba-perf-decode}"
for p in $perf; do
  case "$p" in
    none) ;;
    kmamba-bench) { ./apps/kmamba-bench --space Cuda && ./apps/kmamba-bench --space Cuda --shape 8x4096; } 2>&1 | tee "$out/bench.log" || status=1 ;;
    *) dir=./perf; [ -x "$dir/$p" ] || dir=./apps
       "$dir/$p" --space Cuda 2>&1 | tee "$out/$p.log" || status=1 ;;
  esac
done
exit $status
