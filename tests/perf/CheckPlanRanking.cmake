# kmamba-plan's ranking of the meshes of 4 CPU ranks against their measured step times.
#
# Calibrates the planner on this host: one rank's training step (kmamba-perf-train --json), the
# SSD's forward and backward (kmamba-perf --json) and a collective sweep on 4 ranks
# (kmamba-perf-comm --json). kmamba-plan then ranks every pp 1 mesh of 4 ranks that fits the
# model (ZeRO 0, no checkpointing or compression, one micro-batch per step: the configurations
# kmamba-perf-train measures), kmamba-perf-train measures each under mpirun, and Spearman's rank
# correlation of the predicted and measured step times must reach MIN_RHO (in thousandths).
# The meshes' costs differ by what they split: dp splits the whole step; tp the layers, not the LM
# head (vocab 16384: 62% of the dense FLOPs), and adds activation all-reduces; sp splits it all but
# adds the state correction and the exchanges. Predicted on this host: dp 4 < dp 2 x tp 2 ≈ dp 2 x
# sp 2 < sp 4 ≈ tp 4 ≈ tp 2 x sp 2, each group 1.2-1.3x the one before.
#
#   cmake -DPLAN=<kmamba-plan> -DPERF_TRAIN=<kmamba-perf-train> -DPERF=<kmamba-perf>
#         -DPERF_COMM=<kmamba-perf-comm> -DMPIEXEC=<mpiexec> "-DMPIFLAGS=-n;4;--oversubscribe"
#         -DOUT=<dir> -DMIN_RHO=800 -P CheckPlanRanking.cmake

set(batch 4)
set(seqlen 256)
set(model --small --ngroups 4 --vocab 16384 --seqlen ${seqlen} --space Serial)
file(REMOVE_RECURSE "${OUT}")
file(MAKE_DIRECTORY "${OUT}")
# The same model as kmamba-perf-train --small --ngroups 4 --vocab 16384 (mamba_ssm's config form).
file(WRITE "${OUT}/config.json" [=[{"d_model": 256, "n_layer": 4, "vocab_size": 16384, "pad_vocab_size_multiple": 16,
 "ssm_cfg": {"layer": "Mamba2", "d_state": 128, "headdim": 64, "ngroups": 4, "chunk_size": 64}}
]=])

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE output ERROR_VARIABLE errors)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "CheckPlanRanking: ${what} exited with ${rc}:\n${output}\n${errors}")
  endif()
endfunction()

run_step("kmamba-perf-train (one rank)" "${PERF_TRAIN}" ${model} --batch ${batch} --steps 3 --json "${OUT}/step.json")
run_step("kmamba-perf" "${PERF}" --small --case ssd --chunk 64 --space Serial --precision fp32 --repeats 3
         --json "${OUT}/kernels.json")
run_step("kmamba-perf-comm" "${MPIEXEC}" ${MPIFLAGS} "${PERF_COMM}" --device host --max-bytes 4M --reps 3 --warmup 1
         --json "${OUT}/comm.json")
run_step("kmamba-plan" "${PLAN}" --model "${OUT}/config.json" --gpus 4 --gpus-per-node 4 --memory-gb 1000 --seqlen ${seqlen}
         --global-batch ${batch} --precision fp32 --step-json "${OUT}/step.json" --kernel-json "${OUT}/kernels.json"
         --comm "${OUT}/comm.json" --pp 1 --zero-stage 0 --activation-checkpointing off --compression none --grad-accum 1
         --top 10 --out "${OUT}/plan.json" --candidates "${OUT}/candidates.json")

file(READ "${OUT}/candidates.json" plans)
string(JSON count LENGTH "${plans}")
if(count LESS 4)
  message(FATAL_ERROR "CheckPlanRanking: kmamba-plan ranked ${count} meshes, expected at least 4:\n${plans}")
endif()
math(EXPR last "${count} - 1")
set(predicted)
set(measured)
set(table "")
foreach(i RANGE ${last})
  foreach(key dp tp sp micro_batch step_ms)
    string(JSON ${key} GET "${plans}" ${i} ${key})
  endforeach()
  set(json "${OUT}/dp${dp}tp${tp}sp${sp}.json")
  run_step("kmamba-perf-train dp ${dp} tp ${tp} sp ${sp}" "${MPIEXEC}" ${MPIFLAGS} "${PERF_TRAIN}" ${model}
           --batch ${micro_batch} --dp ${dp} --tp ${tp} --sp ${sp} --steps 5 --comm-steps 1 --json "${json}")
  file(READ "${json}" result)
  string(JSON time GET "${result}" step_ms)
  list(APPEND predicted ${step_ms})
  list(APPEND measured ${time})
  string(APPEND table "  dp ${dp} tp ${tp} sp ${sp}: predicted ${step_ms} ms, measured ${time} ms\n")
endforeach()

# Rank of each value: 1 + how many are smaller (if() compares the numbers as doubles).
function(ranks values out)
  set(result)
  foreach(v IN LISTS values)
    set(rank 1)
    foreach(w IN LISTS values)
      if(w LESS v)
        math(EXPR rank "${rank} + 1")
      endif()
    endforeach()
    list(APPEND result ${rank})
  endforeach()
  set(${out} ${result} PARENT_SCOPE)
endfunction()
ranks("${predicted}" predicted_ranks)
ranks("${measured}" measured_ranks)
set(d2 0)
foreach(i RANGE ${last})
  list(GET predicted_ranks ${i} a)
  list(GET measured_ranks ${i} b)
  math(EXPR d2 "${d2} + (${a} - ${b}) * (${a} - ${b})")
endforeach()
# Spearman's rho = 1 − 6 Σ d² / (n (n² − 1)), in thousandths.
math(EXPR rho "1000 - 6000 * ${d2} / (${count} * (${count} * ${count} - 1))")
message(STATUS "CheckPlanRanking: ${count} meshes of 4 ranks\n${table}"
               "  ranks predicted ${predicted_ranks}, measured ${measured_ranks}: Spearman rho = ${rho}/1000")
if(rho LESS MIN_RHO)
  message(FATAL_ERROR "CheckPlanRanking: Spearman rho ${rho}/1000 below ${MIN_RHO}/1000")
endif()
