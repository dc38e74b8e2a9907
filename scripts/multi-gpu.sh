#!/usr/bin/env bash
# Multi-GPU scaling from binaries built HERE and carried to a 2/4/8-GPU machine, so that
# no device time goes into compiling:
#   (a) equivalence: kmamba-train under mpirun on NCCL meshes (pipeline stages too) follows the
#       one-GPU run step by step
#       (tests/apps/CheckParallelTraining.cmake, as the train.mpi_* ctest entries do on CPU ranks);
#   (b) kmamba-perf-comm: the collectives of kmamba::Communicator over 1 KiB ... 1 GiB at n = 2, 4, 8;
#   (c) kmamba-perf-train on a mamba2-370m-shaped model: one GPU, dp weak scaling (with and without
#       ZeRO-1) and, part sp, one sequence of 8K ... 64K tokens split over sp ranks (activation
#       checkpointing on, also on the one-GPU reference); tp strong scaling needs tp to divide the
#       B/C groups, so the tp runs and their one-GPU reference use ngroups 4 (mamba2-370m has 1);
#   (d) kmamba-perf-model: alpha-beta fits of (b) and the 16 -> 1024 GPU prediction with (c)'s
#       one-GPU step time, tables and scaling.png;
#   (e) suites: the NCCL test suites (every collective of the communicator on device memory, the
#       embedding API's data parallelism) at n ranks; on the host, their MPI twins;
#   (f) plan (not in the default parts): kmamba-plan, calibrated on one GPU and a sweep of the
#       largest rank count, ranks the meshes of that many GPUs, each measured with kmamba-perf-train:
#       predicted and measured step times and their Spearman correlation
#       (tests/perf/CheckPlanRanking.cmake with SPACE Cuda; docs/distributed.md §8.3).
#
# Here:    scripts/multi-gpu.sh --pack [build-dir]   # default build-cuda (NCCL on); writes .gl/multi-gpu.tar.xz
# There:   scripts/multi-gpu.sh                      # carry .gl; logs and results go to $OUT
# Plumbing on this CPU machine (no GPU): scripts/multi-gpu.sh --host [build-dir]   # default build-host;
#          CPU ranks (MPI, Serial), np 2 and 4, small models and messages.
#
# MULTI_GPU_PARTS picks the parts (default "suites equiv comm train sp model", "plan" on request; each
# writes its own files, so a long session can run them in separate calls), MULTI_GPU_NPS the rank
# counts (default: 2 4 8 up to the GPUs present; host: 2 4), MULTI_GPU_COMM_MAX the largest message
# (default 1G; host 1M),
# MULTI_GPU_TIMEOUT bounds each command (s, default 600), MULTI_GPU_STEPS the timed training steps
# (default 3; host 2), MULTI_GPU_BATCH the sequences of 2048 tokens per data-parallel group in the
# dp/tp runs (default 4), MULTI_GPU_SEQLENS the sp sequence lengths (default 8192 16384 32768 65536),
# MULTI_GPU_CHECKPOINT=0 turns activation checkpointing off in the sp runs.
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/.." && pwd)"
binaries=(kmamba-train kmamba-perf-comm kmamba-perf-train kmamba-perf-model kmamba-plan kmamba-perf)
suites=(kmamba_nccl_communicator_tests kmamba_embed_data_parallel_nccl_tests)  # under tests/ of the build

if [ "${1:-}" = "--pack" ]; then
  build="${2:-$root/build-cuda}"
  grep -q "KMAMBA_ENABLE_NCCL:BOOL=ON" "$build/CMakeCache.txt" 2>/dev/null ||
    { echo "multi-gpu.sh: $build is not a CUDA build with KMAMBA_ENABLE_NCCL=ON" >&2; exit 1; }
  cmake --build "$build" -j 2 $(printf -- '--target %s ' "${binaries[@]}" "${suites[@]}") || exit 1
  rm -rf "$root/.gl/multi-gpu" && mkdir -p "$root/.gl/multi-gpu"
  cp "$build/apps/kmamba-train" "$build/perf/kmamba-perf-comm" "$build/perf/kmamba-perf-train" \
     "$build/perf/kmamba-perf-model" "$build/apps/kmamba-plan" "$build/perf/kmamba-perf" "$root/.gl/multi-gpu/"
  for s in "${suites[@]}"; do cp "$build/tests/$s" "$root/.gl/multi-gpu/"; done
  strip "$root"/.gl/multi-gpu/*
  tar cJf "$root/.gl/multi-gpu.tar.xz" -C "$root/.gl" multi-gpu && rm -rf "$root/.gl/multi-gpu"
  du -h "$root/.gl/multi-gpu.tar.xz"
  exit 0
fi

export NCCL_NVLS_ENABLE=0 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
host=0
if [ "${1:-}" = "--host" ]; then
  host=1
  bin="$(cd "${2:-$root/build-host}" && pwd)"  # absolute: the links below point at it
  suites=(kmamba_communicator_tests kmamba_embed_data_parallel_tests)  # the MPI twins
  binaries+=("${suites[@]}")
  for b in "${binaries[@]}"; do
    found=$(ls "$bin/apps/$b" "$bin/perf/$b" "$bin/tests/$b" 2>/dev/null | head -n 1)
    [ -n "$found" ] || { echo "multi-gpu.sh: $b is not built in $bin (cmake --build $bin --target $b)" >&2; exit 1; }
  done
  mkdir -p "$root/.gl/multi-gpu-host"
  for b in "${binaries[@]}"; do
    ln -sf "$(ls "$bin/apps/$b" "$bin/perf/$b" "$bin/tests/$b" 2>/dev/null | head -n 1)" "$root/.gl/multi-gpu-host/$b"
  done
  bin="$root/.gl/multi-gpu-host"
  out="${OUT:-$root/multi-gpu-out}"
  export OMP_NUM_THREADS=1 OMP_PROC_BIND=false
  nps=(${MULTI_GPU_NPS:-2 4})
  device=serial space=Serial comm_device=host comm_max="${MULTI_GPU_COMM_MAX:-1M}"
  steps="${MULTI_GPU_STEPS:-2}"
  train_model=(--small --batch 1 --seqlen 256)
  sp_seqlens=(${MULTI_GPU_SEQLENS:-512 1024})
  sp_model=(--small --batch 1)
else
  [ -f "$root/.gl/multi-gpu.tar.xz" ] || { echo "multi-gpu.sh: .gl/multi-gpu.tar.xz missing: run --pack here and carry .gl" >&2; exit 1; }
  tar xJf "$root/.gl/multi-gpu.tar.xz" -C "$root/.gl"
  bin="$root/.gl/multi-gpu"
  out="${OUT:-$root/gpu-out}"
  export PATH="/usr/local/cuda/bin:$PATH" OMP_PROC_BIND=spread OMP_PLACES=threads
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  default_nps=""
  for n in 2 4 8; do [ "$n" -le "$gpus" ] && default_nps="$default_nps $n"; done
  nps=(${MULTI_GPU_NPS:-$default_nps})
  device=cuda space=Cuda comm_device=cuda comm_max="${MULTI_GPU_COMM_MAX:-1G}"
  steps="${MULTI_GPU_STEPS:-3}"
  train_model=(--preset 370m --batch "${MULTI_GPU_BATCH:-4}" --seqlen 2048)
  sp_seqlens=(${MULTI_GPU_SEQLENS:-8192 16384 32768 65536})
  sp_model=(--preset 370m --batch 1)
  [ "${MULTI_GPU_CHECKPOINT:-1}" = 0 ] || sp_model+=(--activation-checkpointing)
fi
parts="${MULTI_GPU_PARTS:-suites equiv comm train sp model}"
limit="${MULTI_GPU_TIMEOUT:-600}"
mpi=(mpirun --allow-run-as-root --oversubscribe --bind-to none -x NCCL_NVLS_ENABLE)
mkdir -p "$out"
echo "multi-gpu.sh: parts '$parts', ranks ${nps[*]}, device $device, out $out" | tee -a "$out/summary.txt"
{
  date -u
  env | grep -E '^(NCCL_|OMP_|CUDA_VISIBLE)' | sort
  if [ "$host" = 1 ]; then nproc; else
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm --format=csv
    nvidia-smi topo -m
  fi
} > "$out/machine.txt" 2>&1
status=0
step() {  # step NAME COMMAND...: runs it bounded by $limit, logs to $OUT/NAME.log, prints one line
  local name=$1; shift
  local t0; t0=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || status=1
  echo "$name: exit $rc in $(( $(date +%s) - t0 )) s; $(grep -E 'largest loss difference|FATAL|wrote|ms/step|failed|PASSED|Spearman' "$out/$name.log" | tail -n 1 | cut -c1-160)" | tee -a "$out/summary.txt"
}
has_part() { case " $parts " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }

# (e) The NCCL suites (host: their MPI twins) at every rank count.
if has_part suites; then
  for np in "${nps[@]}"; do
    for s in "${suites[@]}"; do step "$s-np$np" "${mpi[@]}" -n "$np" "$bin/$s"; done
  done
fi

# (a) One-GPU run vs the mesh over the same global batches (grad-accum = dp on one GPU), ngroups 4
# and 8 heads so that tp 2 and 4 split them. Pipeline meshes (pp) run 4 layers and 4 micro-batches
# per step through the stages (the one-GPU run accumulates dp · 4).
if has_part equiv; then
  for np in "${nps[@]}"; do
    case $np in
      2) meshes=("dp;2" "tp;2" "sp;2" "dp;2;zero-stage;1" "pp;2") ;;
      4) meshes=("dp;4" "dp;2;tp;2" "dp;2;sp;2" "tp;2;sp;2" "tp;4" "dp;4;zero-stage;1" "dp;2;tp;2;zero-stage;1"
                 "pp;4" "pp;2;tp;2" "pp;2;dp;2;zero-stage;1") ;;
      8) meshes=("dp;8" "dp;4;tp;2" "dp;4;sp;2" "dp;2;tp;2;sp;2" "dp;2;tp;4" "dp;8;zero-stage;1" "pp;2;tp;4"
                 "pp;2;dp;2;tp;2" "pp;4;tp;2") ;;
      *) meshes=("dp;$np") ;;
    esac
    for mesh in "${meshes[@]}"; do
      dp=$np accum=1 pipeline=""
      [[ "$mesh" =~ tp\;([0-9]+) ]] && dp=$((dp / BASH_REMATCH[1]))
      [[ "$mesh" =~ sp\;([0-9]+) ]] && dp=$((dp / BASH_REMATCH[1]))
      if [[ "$mesh" =~ pp\;([0-9]+) ]]; then dp=$((dp / BASH_REMATCH[1])) accum=4 pipeline=";--n-layer;4"; fi
      flags=$(echo "$mesh" | sed -E 's/(^|;)([a-z-]+)/\1--\2/g')
      name="equiv-np$np-$(echo "$mesh" | tr -d ';' | sed 's/zero-stage1/zero1/')"
      step "$name" cmake -DTRAIN="$bin/kmamba-train" -DMPIEXEC=mpirun \
        "-DMPIFLAGS=-n;$np;--allow-run-as-root;--oversubscribe;--bind-to;none;-x;NCCL_NVLS_ENABLE" \
        -DOUT="$out/$name" \
        "-DARGS=--steps;12;--eval-interval;0;--checkpoint-interval;0;--seqlen;64;--ngroups;4;--device;$device$pipeline" \
        "-DONE_RANK=--grad-accum;$((dp * accum))" "-DMESH=$flags;--grad-accum;$accum" -DMAX_DIFF=0.00002 \
        -P "$root/tests/apps/CheckParallelTraining.cmake"
    done
  done
fi

# (b) The collectives over the message sizes, one JSON per group size.
if has_part comm; then
  for np in "${nps[@]}"; do
    step "comm-n$np" "${mpi[@]}" -n "$np" "$bin/kmamba-perf-comm" --device "$comm_device" --max-bytes "$comm_max" \
      --factor 2 --json "$out/comm-n$np.json"
  done
fi

# (c) Training throughput, memory and communication share.
if has_part train; then
  step train-1gpu "$bin/kmamba-perf-train" --space "$space" "${train_model[@]}" --steps "$steps" \
    --json "$out/train-1gpu.json"
  for np in "${nps[@]}"; do  # dp weak scaling: the same batch per GPU
    step "train-dp$np" "${mpi[@]}" -n "$np" "$bin/kmamba-perf-train" --space "$space" "${train_model[@]}" \
      --steps "$steps" --dp "$np" --json "$out/train-dp$np.json"
    step "train-dp$np-zero1" "${mpi[@]}" -n "$np" "$bin/kmamba-perf-train" --space "$space" "${train_model[@]}" \
      --steps "$steps" --dp "$np" --zero 1 --json "$out/train-dp$np-zero1.json"
  done
  # tp strong scaling: the one-GPU batch split over tp ranks; ngroups 4 so that tp 2 and 4 divide it.
  step train-1gpu-g4 "$bin/kmamba-perf-train" --space "$space" "${train_model[@]}" --ngroups 4 --steps "$steps" \
    --json "$out/train-1gpu-g4.json"
  for tp in 2 4; do
    for np in "${nps[@]}"; do [ "$np" = "$tp" ] || continue
      step "train-tp$tp-g4" "${mpi[@]}" -n "$tp" "$bin/kmamba-perf-train" --space "$space" "${train_model[@]}" \
        --ngroups 4 --steps "$steps" --tp "$tp" --json "$out/train-tp$tp-g4.json"
    done
  done
fi
if has_part sp; then
  for L in "${sp_seqlens[@]}"; do  # sp: one sequence of L tokens split over sp ranks (and on one GPU while it fits)
    step "train-sp1-L$L" "$bin/kmamba-perf-train" --space "$space" "${sp_model[@]}" --seqlen "$L" \
      --steps "$steps" --json "$out/train-sp1-L$L.json"
    for np in "${nps[@]}"; do
      step "train-sp$np-L$L" "${mpi[@]}" -n "$np" "$bin/kmamba-perf-train" --space "$space" "${sp_model[@]}" --seqlen "$L" \
        --steps "$steps" --sp "$np" --json "$out/train-sp$np-L$L.json"
    done
  done
fi
if has_part train || has_part sp; then
  # One line per run: the table layouts of the issue (JSON values read with sed, formatted with awk).
  value() { sed -n -E "s/^ *\"$2\": *\"?([^,\"]*)\"?,?$/\1/p" "$1" | head -n 1; }
  {
    printf "%-26s %5s %3s %3s %3s %6s %9s %10s %12s %8s %8s %7s\n" run ranks dp tp sp seqlen tok/step step_ms tok/s MFU% peak_GB comm%
    for f in "$out"/train-*.json; do
      [ -f "$f" ] || continue
      echo "$(basename "$f" .json) $(value "$f" ranks) $(value "$f" dp) $(value "$f" tp) $(value "$f" sp) \
$(value "$f" seqlen) $(value "$f" tokens_per_step) $(value "$f" step_ms) $(value "$f" tokens_per_s) \
$(value "$f" mfu_bf16) $(value "$f" peak_memory_bytes) $(value "$f" comm_share)" |
        awk '{ printf "%-26s %5s %3s %3s %3s %6s %9s %10.1f %12.0f %8.3f %8.2f %7s\n", $1, $2, $3, $4, $5, $6, $7, $8, $9,
               100 * $10, $11 / 1e9, ($12 == "" ? "-" : sprintf("%.1f", 100 * $12)) }'
    done
  } > "$out/scaling.txt" 2>&1
  cat "$out/scaling.txt" | tee -a "$out/summary.txt"
fi

# (d) The alpha-beta fits and the 16 -> 1024 GPU prediction from the one-GPU step.
if has_part model; then
  sweeps=$(ls "$out"/comm-n*.json 2>/dev/null)
  compute_ms=$(sed -n -E 's/^ *"step_ms": *([^,]*),?$/\1/p' "$out/train-1gpu.json" 2>/dev/null | head -n 1)
  tokens=$(sed -n -E 's/^ *"tokens_per_step": *([^,]*),?$/\1/p' "$out/train-1gpu.json" 2>/dev/null | head -n 1)
  if [ -z "$sweeps" ] || [ -z "$compute_ms" ]; then
    echo "model: needs comm-n*.json and train-1gpu.json in $out (parts comm and train)" | tee -a "$out/summary.txt"
    status=1
  else
    shape=()
    [ "$host" = 1 ] && shape+=(--d-model 256 --n-layer 4 --chunk-size 64 --pad-vocab-multiple 16)
    step model "$bin/kmamba-perf-model" $sweeps --compute-ms "$compute_ms" --tokens-per-gpu "$tokens" ${shape[@]+"${shape[@]}"} \
      --png "$out/scaling.png" --json "$out/prediction.json"
  fi
fi
# (f) The planner's ranking of the meshes of the largest rank count against their measured steps.
if has_part plan; then
  np="${nps[${#nps[@]}-1]}"
  step "plan-np$np" cmake -DPLAN="$bin/kmamba-plan" -DPERF_TRAIN="$bin/kmamba-perf-train" -DPERF="$bin/kmamba-perf" \
    -DPERF_COMM="$bin/kmamba-perf-comm" -DMPIEXEC=mpirun \
    "-DMPIFLAGS=-n;$np;--allow-run-as-root;--oversubscribe;--bind-to;none;-x;NCCL_NVLS_ENABLE" \
    -DOUT="$out/plan-np$np" -DNP="$np" -DSPACE="$space" -P "$root/tests/perf/CheckPlanRanking.cmake"
fi
echo "multi-gpu.sh: done, status $status; results in $out" | tee -a "$out/summary.txt"
exit $status
