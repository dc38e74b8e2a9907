#!/usr/bin/env bash
# CUDA tests, benchmarks and compute-sanitizer runs from binaries built HERE (no GPU needed to
# build) and carried to the GPU machine, so that no device time goes into compiling.
#
# Here:    scripts/gpu-carried.sh --pack [build-dir]   # default build-cuda; writes .gl/bin.tar.xz
#                                                      # (stripped, ~23 MB for the default list)
# There:   scripts/gpu-carried.sh                      # carry .gl; logs go to $OUT
#
# GPU_CARRIED_SUITES names the test suites (default below; set but empty: none),
# GPU_CARRIED_MEMCHECK and GPU_CARRIED_RACECHECK the suites run under compute-sanitizer memcheck /
# racecheck (default: all the test suites; set but empty: none), GPU_CARRIED_SANITIZER_TIMEOUT
# bounds each sanitizer run (s, default 300), GPU_CARRIED_PERF=0 skips the benchmarks (which
# include per-kernel profiles of a training step and of batch-1 and batch-64 decode steps), GPU_CARRIED_EVAL=0
# the golden evaluations, the transformers interop test (tests/interop; this machine's python3 has
# torch and transformers) and the NCCL single-rank runs (the NCCL communicator and embedding suites,
# kmamba-train with every parallel option, kmamba-perf-comm on device memory). The sanitizers run
# last, side by side and alone on the GPU, so that they never share it with a timed benchmark.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
suites=(${GPU_CARRIED_SUITES-mamba3_scan mamba3_mixer decode device_sampling rms_norm sequence_model ssd selective_scan conv1d gemm mamba2_mixer})
nccl_suites=(nccl_communicator embed_data_parallel_nccl)  # MPI main, one rank (the NCCL runs below)
if [ "${1:-}" = "--pack" ]; then
  build="${2:-$root/build-cuda}"
  targets=(kmamba-perf kmamba-perf-decode kmamba-perf-train kmamba-perf-comm kmamba-lorenz96 kmamba-train kmamba-eval)
  for s in "${suites[@]}" "${nccl_suites[@]}"; do targets+=("kmamba_${s}_tests"); done
  cmake --build "$build" -j 2 $(printf -- '--target %s ' "${targets[@]}") || exit 1
  rm -rf "$root/.gl/bin" && mkdir -p "$root/.gl/bin"
  cp "$build"/perf/kmamba-perf "$build"/perf/kmamba-perf-decode "$build"/perf/kmamba-perf-train \
     "$build"/perf/kmamba-perf-comm "$build"/apps/kmamba-lorenz96 "$build"/apps/kmamba-train "$build"/apps/kmamba-eval \
     "$root/.gl/bin/"
  for s in "${suites[@]}" "${nccl_suites[@]}"; do cp "$build/tests/kmamba_${s}_tests" "$root/.gl/bin/"; done
  strip "$root"/.gl/bin/*
  tar cJf "$root/.gl/bin.tar.xz" -C "$root/.gl" bin && rm -rf "$root/.gl/bin"
  du -h "$root/.gl/bin.tar.xz"
  exit 0
fi

out="${OUT:-$root/gpu-out}"
mkdir -p "$out"
export PATH="/usr/local/cuda/bin:$PATH" NCCL_NVLS_ENABLE=0 OMP_PROC_BIND=spread OMP_PLACES=threads
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
[ -f "$root/.gl/bin.tar.xz" ] || { echo "gpu-carried.sh: .gl/bin.tar.xz missing: run --pack here and carry .gl" >&2; exit 1; }
tar xJf "$root/.gl/bin.tar.xz" -C "$root/.gl"
bin="$root/.gl/bin"
# The test binaries were built with this machine's path of tests/data compiled in; the carried
# working tree has its own copy, which KMAMBA_TEST_DATA_DIR names (tests/support/TestData.hpp).
export KMAMBA_TEST_DATA_DIR="$root/tests/data"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv > "$out/machine.txt" 2>&1
status=0
step() {  # step NAME COMMAND...: runs it, logs to $OUT/NAME.log, prints one line, returns its status
  local name=$1; shift
  local t0; t0=$(date +%s)
  "$@" > "$out/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || status=1
  echo "$name: exit $rc in $(( $(date +%s) - t0 )) s; $(grep -E 'PASSED|FAILED|ERROR SUMMARY|RACECHECK SUMMARY' "$out/$name.log" | tail -n 2 | tr '\n' ' ')"
  return $rc
}
for s in "${suites[@]}"; do step "test-$s" "$bin/kmamba_${s}_tests" --gtest_filter='*/Cuda.*'; done
# The golden files reproduced by the evaluation tool on the GPU (the ctest eval.* entries).
if [ "${GPU_CARRIED_EVAL:-1}" != 0 ]; then
  golden="$root/tests/data/golden"
  for pair in ssd:ssd_small selective_scan:selective_scan_small mamba3_siso:mamba3_siso_small \
              mamba3_mimo:mamba3_mimo_small mamba3_mixer:mamba3_block_small; do
    step "eval-${pair#*:}" "$bin/kmamba-eval" --op "${pair%%:*}" \
      --input "$golden/${pair#*:}.safetensors" --output "$out/eval-${pair#*:}.safetensors" --check 1e-3
  done
  for model in tiny_mamba1 tiny_mamba2; do
    step "eval-$model" "$bin/kmamba-eval" --model "$golden/$model" \
      --input "$golden/${model}_io.safetensors" --output /tmp/eval-$model.safetensors --grads --check 1e-3
  done
  step interop-transformers python3 "$root/tests/interop/test_transformers_interop.py" --bin "$bin"
  step nccl-np1 cmake -DTRAIN="$bin/kmamba-train" -DMPIEXEC=mpirun "-DMPIFLAGS=-n;1;--allow-run-as-root;--oversubscribe" \
    -DOUT=/tmp/kmamba-nccl-np1 "-DARGS=--steps;12;--eval-interval;0;--checkpoint-interval;0;--seqlen;33;--grad-accum;2;--device;cuda" \
    "-DMESH=--dp;1" -DMAX_DIFF=0.00002 -P "$root/tests/apps/CheckParallelTraining.cmake"
  # The ctest entries train.mpi_nccl_np1_options, nccl_communicator.np1, embed_data_parallel_nccl.np1
  # and perf.comm_nccl_np1.
  step nccl-np1-options cmake -DTRAIN="$bin/kmamba-train" -DMPIEXEC=mpirun "-DMPIFLAGS=-n;1;--allow-run-as-root;--oversubscribe" \
    -DOUT=/tmp/kmamba-nccl-np1-options "-DARGS=--steps;12;--eval-interval;0;--checkpoint-interval;5;--seqlen;33;--grad-accum;2;--device;cuda" \
    "-DMESH=--dp;1;--tp;1;--sp;1;--zero-stage;1" -DMAX_DIFF=0.00002 -P "$root/tests/apps/CheckParallelTraining.cmake"
  for s in "${nccl_suites[@]}"; do step "test-$s-np1" mpirun -n 1 --allow-run-as-root "$bin/kmamba_${s}_tests"; done
  step perf-comm-nccl-np1 mpirun -n 1 --allow-run-as-root "$bin/kmamba-perf-comm" --device cuda --max-bytes 64K \
    --reps 3 --warmup 1 --json "$out/perf-comm-nccl-np1.json"
fi
if [ "${GPU_CARRIED_PERF:-1}" != 0 ]; then
  step perf-kernels "$bin/kmamba-perf" --space Cuda
  # The SSD's chunk products grow with the chunk length Q (docs/algorithms.md §6.1): the same SSD at
  # shorter chunks, fp32 products.
  for q in 64 128; do
    step "perf-ssd-chunk$q" "$bin/kmamba-perf" --space Cuda --case ssd --precision fp32 --chunk "$q"
  done
  step perf-decode "$bin/kmamba-perf-decode" --space Cuda
  step perf-train "$bin/kmamba-perf-train" --space Cuda --kernel-times 2
  step perf-train-bf16 "$bin/kmamba-perf-train" --space Cuda --precision bf16
  step perf-train-bf16-chunk64 "$bin/kmamba-perf-train" --space Cuda --precision bf16 --chunk 64
  step perf-decode-b1-kernels "$bin/kmamba-perf-decode" --space Cuda --profile-steps 20 --profile-batch 1 --kernel-times
  step perf-decode-b64-kernels "$bin/kmamba-perf-decode" --space Cuda --profile-steps 20 --profile-batch 64 --kernel-times
  step lorenz96 "$bin/kmamba-lorenz96" --out "$out/lorenz96"
fi
# The sanitizer runs go side by side (each is slow and mostly host-bound); each leaves its own log.
sanitize() {  # sanitize TOOL SUITE
  step "$1-$2" timeout "${GPU_CARRIED_SANITIZER_TIMEOUT:-300}" compute-sanitizer --tool "$1" --error-exitcode 99 \
    --print-limit 20 "$bin/kmamba_${2}_tests" --gtest_filter='*/Cuda.*'
}
pids=()
for s in ${GPU_CARRIED_MEMCHECK-${suites[*]}}; do sanitize memcheck "$s" & pids+=($!); done
for s in ${GPU_CARRIED_RACECHECK-${suites[*]}}; do sanitize racecheck "$s" & pids+=($!); done
for p in "${pids[@]}"; do wait "$p" || status=1; done
exit $status
