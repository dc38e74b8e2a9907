#!/usr/bin/env bash
# Builds kmamba's host test suites with AddressSanitizer + UndefinedBehaviorSanitizer (gcc, the
# host Kokkos of scripts/bootstrap.sh, MPI off) and runs them; any report fails the run.
#
#   scripts/sanitize.sh [--build-dir DIR] [--all] [suite...]
#
# Without suites: core (shapes, bf16, random fills), models (safetensors, config.json), data,
# tokenizer, sampling, trainer, the checkpoint kill test and app_common (the app runtime every app
# starts through: options, exit statuses, the PNG writer) (SANITIZE_SUITES); --all: every suite and
# app. Kokkos itself is not instrumented (its own code is not checked, calls into it are).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build_dir="$root/build-asan"
all=0
suites=()
die() { echo "sanitize: error: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
  case "$1" in
    --build-dir) [ $# -ge 2 ] || die "--build-dir needs a directory"; build_dir="$2"; shift 2 ;;
    --all) all=1; shift ;;
    -h|--help) sed -n '2,10p' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) die "unknown option '$1'" ;;
    *) suites+=("$1"); shift ;;
  esac
done
SANITIZE_SUITES=(core models data tokenizer sampling trainer checkpoint_kill app_common)
[ ${#suites[@]} -gt 0 ] || suites=("${SANITIZE_SUITES[@]}")
jobs="$(nproc 2>/dev/null || echo 2)"

kokkos_root="$("$root/scripts/bootstrap.sh" | sed -n 's/^Kokkos_ROOT=//p' | tail -n 1)"
[ -n "$kokkos_root" ] || die "bootstrap did not report a Kokkos install"
flags="-fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer"
mkdir -p "$build_dir"
cmake -S "$root" -B "$build_dir" -DKokkos_ROOT="$kokkos_root" -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
      -DKMAMBA_ENABLE_MPI=OFF -DKMAMBA_BUILD_APPS=ON -DKMAMBA_BUILD_PERF=OFF \
      >"$build_dir.configure.log" 2>&1 || { tail -n 30 "$build_dir.configure.log" >&2; die "configuring failed"; }

t0=$(date +%s)
if [ "$all" = 1 ]; then
  cmake --build "$build_dir" -j "$jobs" >"$build_dir/sanitize-build.log" 2>&1 || { tail -n 40 "$build_dir/sanitize-build.log" >&2; die "build failed"; }
  filter=()
else
  targets=()
  for s in "${suites[@]}"; do targets+=("kmamba_${s}_tests"); done
  cmake --build "$build_dir" -j "$jobs" --target "${targets[@]}" >"$build_dir/sanitize-build.log" 2>&1 \
    || { tail -n 40 "$build_dir/sanitize-build.log" >&2; die "build failed (log: $build_dir/sanitize-build.log)"; }
  regex="^($(IFS='|'; echo "${suites[*]}"))\\."
  filter=(-R "$regex")
fi
t1=$(date +%s)
echo "sanitize: built in $((t1 - t0)) s"

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export LSAN_OPTIONS="suppressions=$root/scripts/lsan.supp:print_suppressions=0"
cd "$build_dir"
ctest --output-on-failure -LE cuda "${filter[@]}" -j "$jobs"
echo "sanitize: tests ran in $(( $(date +%s) - t1 )) s"
