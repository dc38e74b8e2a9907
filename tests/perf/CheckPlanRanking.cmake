# kmamba-plan's ranking of the meshes of NP ranks against their measured step times.
#
# Calibrates the planner where it runs: one rank's training step (kmamba-perf-train --json), the
# SSD's forward and backward (kmamba-perf --json) and a collective sweep on NP ranks
# (kmamba-perf-comm --json). kmamba-plan then ranks every pp 1 mesh of NP ranks that fits the
# model (ZeRO 0, no checkpointing or compression, one micro-batch per step: the configurations
# kmamba-perf-train measures), kmamba-perf-train measures each under mpirun, and Spearman's rank
# correlation of the predicted and measured step times must reach MIN_RHO (in thousandths; without
# MIN_RHO the script only reports it).
#
# SPACE Serial (default; the CPU test): a Mamba-2 model of d_model 256, 4 layers, 4 groups, d_state
# 32 and vocab 32768, 4 sequences of 128 tokens a step. The meshes' costs differ clearly by what
# they split: dp the whole step; tp the layers but not the LM head (82% of the dense FLOPs), and it
# adds activation all-reduces; sp all of it, adding the state correction and the exchanges.
# Predicted on the CPU host: dp 4, dp 2 x sp 2, sp 4, dp 2 x tp 2, tp 2 x sp 2, tp 4 at 1, 1.2,
# 1.5, 2.0, 2.2 and 3.4 times dp 4's step: far enough apart that the machine's load, which moves
# every time by tens of per cent, swaps at most close neighbours. SPACE Cuda (scripts/multi-gpu.sh
# part plan): mamba2-370m's shape with 4 groups, bf16, 2 · NP sequences of 2048 tokens, one GPU per
# rank.
#
#   cmake -DPLAN=<kmamba-plan> -DPERF_TRAIN=<kmamba-perf-train> -DPERF=<kmamba-perf>
#         -DPERF_COMM=<kmamba-perf-comm> -DMPIEXEC=<mpiexec> "-DMPIFLAGS=-n;4;--oversubscribe"
#         -DOUT=<dir> [-DNP=4] [-DSPACE=Serial|Cuda] [-DMIN_RHO=800] -P CheckPlanRanking.cmake

if(NOT DEFINED NP)
  set(NP 4)
endif()
if(NOT DEFINED SPACE)
  set(SPACE Serial)
endif()
file(REMOVE_RECURSE "${OUT}")
file(MAKE_DIRECTORY "${OUT}")
if(SPACE STREQUAL "Cuda")
  math(EXPR batch "2 * ${NP}")
  set(calibration_batch 2)  # the rates are per token; 2 · NP sequences would not fit one GPU
  set(seqlen 2048)
  set(precision bf16)
  set(model --preset 370m --ngroups 4 --seqlen ${seqlen} --precision ${precision} --space Cuda)
  set(kernels --case ssd --space Cuda --precision ${precision})
  set(comm --device cuda --max-bytes 1G --factor 2)
  # kmamba-perf-train --preset 370m --ngroups 4 in mamba_ssm's config form.
  file(WRITE "${OUT}/config.json" [=[{"d_model": 1024, "n_layer": 48, "vocab_size": 50277, "pad_vocab_size_multiple": 8,
 "ssm_cfg": {"layer": "Mamba2", "d_state": 128, "headdim": 64, "ngroups": 4, "chunk_size": 256}}
]=])
else()
  set(batch 4)
  set(calibration_batch 4)
  set(seqlen 128)
  set(precision fp32)
  set(model --small --ngroups 4 --d-state 32 --vocab 32768 --seqlen ${seqlen} --space Serial)
  set(kernels --small --case ssd --chunk 64 --space Serial --precision ${precision})
  set(comm --device host --max-bytes 4M --reps 3 --warmup 1)
  # kmamba-perf-train --small --ngroups 4 --d-state 32 --vocab 32768 in mamba_ssm's config form.
  file(WRITE "${OUT}/config.json" [=[{"d_model": 256, "n_layer": 4, "vocab_size": 32768, "pad_vocab_size_multiple": 16,
 "ssm_cfg": {"layer": "Mamba2", "d_state": 32, "headdim": 64, "ngroups": 4, "chunk_size": 64}}
]=])
endif()

function(run_step what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE output ERROR_VARIABLE errors)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "CheckPlanRanking: ${what} exited with ${rc}:\n${output}\n${errors}")
  endif()
endfunction()

run_step("kmamba-perf-train (one rank)" "${PERF_TRAIN}" ${model} --batch ${calibration_batch} --steps 3
         --json "${OUT}/step.json")
run_step("kmamba-perf" "${PERF}" ${kernels} --repeats 3 --json "${OUT}/kernels.json")
run_step("kmamba-perf-comm" "${MPIEXEC}" ${MPIFLAGS} "${PERF_COMM}" ${comm} --json "${OUT}/comm.json")
run_step("kmamba-plan" "${PLAN}" --model "${OUT}/config.json" --gpus ${NP} --gpus-per-node ${NP} --memory-gb 1000
         --seqlen ${seqlen} --global-batch ${batch} --precision ${precision} --step-json "${OUT}/step.json"
         --kernel-json "${OUT}/kernels.json"
         --comm "${OUT}/comm.json" --pp 1 --zero-stage 0 --activation-checkpointing off --compression none --grad-accum 1
         --top 10 --out "${OUT}/plan.json" --candidates "${OUT}/candidates.json")

file(READ "${OUT}/candidates.json" plans)
string(JSON count LENGTH "${plans}")
if(count LESS 4)
  message(FATAL_ERROR "CheckPlanRanking: kmamba-plan ranked ${count} meshes, expected at least 4:\n${plans}")
endif()
math(EXPR last "${count} - 1")
# Each mesh's median step, measured in two rounds (the candidates' order, then the reverse) so
# that a change of the machine's load during the test falls on every mesh; the faster round counts.
function(measure i round)
  foreach(key dp tp sp micro_batch)
    string(JSON ${key} GET "${plans}" ${i} ${key})
  endforeach()
  set(json "${OUT}/dp${dp}tp${tp}sp${sp}-${round}.json")
  run_step("kmamba-perf-train dp ${dp} tp ${tp} sp ${sp}" "${MPIEXEC}" ${MPIFLAGS} "${PERF_TRAIN}" ${model}
           --batch ${micro_batch} --dp ${dp} --tp ${tp} --sp ${sp} --steps 4 --comm-steps 1 --json "${json}")
endfunction()
foreach(i RANGE ${last})
  measure(${i} 1)
endforeach()
foreach(i RANGE ${last} 0 -1)
  measure(${i} 2)
endforeach()
set(predicted)
set(measured)
set(table "")
foreach(i RANGE ${last})
  foreach(key dp tp sp step_ms)
    string(JSON ${key} GET "${plans}" ${i} ${key})
  endforeach()
  set(times)
  foreach(round 1 2)
    file(READ "${OUT}/dp${dp}tp${tp}sp${sp}-${round}.json" result)
    string(JSON time GET "${result}" step_ms)
    list(APPEND times ${time})
  endforeach()
  list(GET times 0 first)
  list(GET times 1 second)
  set(time ${first})
  if(second LESS first)
    set(time ${second})
  endif()
  list(APPEND predicted ${step_ms})
  list(APPEND measured ${time})
  string(APPEND table "  dp ${dp} tp ${tp} sp ${sp}: predicted ${step_ms} ms, measured ${first} and ${second} ms\n")
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
message(STATUS "CheckPlanRanking: ${count} meshes of ${NP} ranks\n${table}"
               "  ranks predicted ${predicted_ranks}, measured ${measured_ranks}: Spearman rho = ${rho}/1000")
if(DEFINED MIN_RHO AND rho LESS MIN_RHO)
  message(FATAL_ERROR "CheckPlanRanking: Spearman rho ${rho}/1000 below ${MIN_RHO}/1000")
endif()
