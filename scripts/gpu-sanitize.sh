#!/usr/bin/env bash
# On a GPU machine: builds the CUDA flavour exactly as scripts/gpu-test.sh does (reusing its
# build-gpu/ when present) and runs the CUDA instantiations of the kernel test suites under
# compute-sanitizer, memcheck then racecheck. Logs go to $OUT (or ./gpu-out): one file per suite
# and tool, and sanitize-summary.txt. Fails when any run reports an error.
#
# Here (once):   scripts/gpu-test.sh --pack           # .deps/ to carry
# There:         scripts/gpu-sanitize.sh [suite...]   # default: the kernel suites below
#                SANITIZE_TOOLS="memcheck" scripts/gpu-sanitize.sh ssd   # one tool, one suite
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
deps="$root/.deps"
out="${OUT:-$root/gpu-out}"
mkdir -p "$out"
export PATH="/usr/local/cuda/bin:$PATH"
sanitizer="$(command -v compute-sanitizer || true)"
[ -n "$sanitizer" ] || { echo "gpu-sanitize.sh: compute-sanitizer not found (part of the CUDA toolkit)" >&2; exit 1; }
suites=("$@")
[ ${#suites[@]} -gt 0 ] || suites=(core gemm token_ops conv1d rms_norm selective_scan ssd mamba3_scan mamba1_mixer
                                  mamba2_mixer language_model decode)
tools=(${SANITIZE_TOOLS:-memcheck racecheck})

build_dir="$root/build-gpu"
if [ ! -f "$build_dir/CMakeCache.txt" ]; then
  [ -f "$deps/kokkos-src.tar.xz" ] || { echo "gpu-sanitize.sh: $deps/kokkos-src.tar.xz missing: run 'scripts/gpu-test.sh --pack' and carry .deps" >&2; exit 1; }
  extra=(-DKMAMBA_GTEST_SOURCE_DIR="$deps/googletest" -DKMAMBA_JSON_INCLUDE_DIR="$deps/json")
  command -v mpicxx >/dev/null 2>&1 || extra+=(-DKMAMBA_ENABLE_MPI=OFF -DKMAMBA_ENABLE_NCCL=OFF)
  "$here/build.sh" --flavour cuda --no-apt --source "$deps/kokkos-src.tar.xz" --deps-dir /tmp/kmamba-deps \
                   --build-dir "$build_dir" -- "${extra[@]}" 2> >(tee "$out/sanitize-build.log" >&2) >/dev/null
else
  cmake --build "$build_dir" -j "$(nproc)" 2>&1 | tail -n 3
fi

summary="$out/sanitize-summary.txt"
: > "$summary"
status=0
for tool in "${tools[@]}"; do
  for suite in "${suites[@]}"; do
    exe="$build_dir/tests/kmamba_${suite}_tests"
    [ -x "$exe" ] || { echo "$tool $suite: no executable $exe" | tee -a "$summary"; status=1; continue; }
    log="$out/sanitize-$tool-$suite.log"
    t0=$(date +%s)
    # racecheck checks shared memory only and is slow: it runs the same Cuda tests, one process each.
    if timeout 1800 "$sanitizer" --tool "$tool" --error-exitcode 99 --print-limit 50 \
         "$exe" --gtest_filter='*/Cuda.*' >"$log" 2>&1; then
      result=clean
    else
      result="FAILED (exit $?)"
      status=1
    fi
    line="$tool $suite: $result in $(( $(date +%s) - t0 )) s; $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$log" | tail -n 1)"
    echo "$line" | tee -a "$summary"
  done
done
exit $status
