#!/usr/bin/env bash
# Builds kmamba's libFuzzer targets (tests/fuzz: safetensors, config.json, tokenizer.json and
# KMTOKENS readers, with AddressSanitizer + UndefinedBehaviorSanitizer) with clang and runs each
# for a fixed time from its seed corpus with a fixed seed. Fails on any finding; the crashing
# input is left in the build directory (crash-*, leak-*, oom-*, timeout-*).
#
#   scripts/fuzz.sh [--seconds N] [--build-dir DIR] [target...]    (targets: safetensors config tokenizer token_file)
#
# Needs clang and libFuzzer (Debian: clang libclang-rt-14-dev, installed by scripts/bootstrap.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
seconds="${KMAMBA_FUZZ_SECONDS:-30}"
build_dir="$root/build-fuzz"
targets=()
die() { echo "fuzz: error: $*" >&2; exit 1; }
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) [ $# -ge 2 ] || die "--seconds needs a number"; seconds="$2"; shift 2 ;;
    --build-dir) [ $# -ge 2 ] || die "--build-dir needs a directory"; build_dir="$2"; shift 2 ;;
    -h|--help) sed -n '2,10p' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) die "unknown option '$1'" ;;
    *) targets+=("$1"); shift ;;
  esac
done
case "$seconds" in ''|*[!0-9]*) die "--seconds must be a positive integer, got '$seconds'" ;; esac
[ ${#targets[@]} -gt 0 ] || targets=(safetensors config tokenizer token_file)
command -v clang++ >/dev/null 2>&1 || die "clang++ not found (Debian packages clang and libclang-rt-14-dev; scripts/bootstrap.sh installs them)"

CXX=clang++ cmake -S "$root/tests/fuzz" -B "$build_dir" >/dev/null
cmake --build "$build_dir" -j "$(nproc 2>/dev/null || echo 2)" >/dev/null

status=0
for t in "${targets[@]}"; do
  [ -d "$root/tests/fuzz/corpus/$t" ] || die "no target '$t' (no tests/fuzz/corpus/$t)"
  work="$build_dir/corpus-$t"        # the seed corpus grows here; the committed seeds stay as they are
  rm -rf "$work"; mkdir -p "$work"; cp "$root/tests/fuzz/corpus/$t"/* "$work/"
  # Long enough for the structure-aware seeds (a header of 1000 tensors, values nested 1500 deep)
  # to be read whole: libFuzzer cuts every input at max_len.
  case "$t" in safetensors) max_len=131072 ;; tokenizer) max_len=32768 ;; *) max_len=8192 ;; esac
  dict=(); [ "$t" = token_file ] || dict=(-dict="$root/tests/fuzz/json.dict")
  log="$build_dir/fuzz-$t.log"
  t0=$(date +%s)
  if "$build_dir/kmamba_fuzz_$t" "$work" "${dict[@]}" -seed=1 -max_total_time="$seconds" -max_len="$max_len" \
       -rss_limit_mb=2048 -malloc_limit_mb=512 -timeout=10 -print_final_stats=1 \
       -artifact_prefix="$build_dir/" >"$log" 2>&1; then
    runs="$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")"
    echo "fuzz: $t: ${runs:-?} executions in $(( $(date +%s) - t0 )) s, no finding"
  else
    echo "fuzz: $t: FINDING (log: $log)" >&2
    grep -E "ERROR|SUMMARY|runtime error|Test unit written|^    #[0-9]+ " "$log" | head -40 >&2
    status=1
  fi
done
exit $status
