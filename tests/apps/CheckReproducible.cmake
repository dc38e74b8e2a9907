# Two runs of kmamba-train with the same options are the same run: metrics.jsonl agrees line for
# line once the wall-clock fields (elapsed_s, tokens_per_s) are taken out, and the checkpoints'
# model.safetensors are the same bytes. Run on several threads, where a sum whose order followed
# the threads' timing would show within the first steps.
#
#   cmake -DTRAIN=<kmamba-train> -DOUT=<dir> "-DARGS=--steps;60" -P CheckReproducible.cmake

# metrics.jsonl of run `dir` without its wall-clock fields, in `out`.
function(read_metrics dir out)
  file(READ "${dir}/metrics.jsonl" text)
  string(REGEX REPLACE "\"(elapsed_s|tokens_per_s)\":[^,}]*,?" "" text "${text}")
  set(${out} "${text}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${OUT}")
foreach(run first second)
  execute_process(COMMAND "${TRAIN}" ${ARGS} --out "${OUT}/${run}" RESULT_VARIABLE rc OUTPUT_QUIET
                  ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "CheckReproducible: kmamba-train ${ARGS} exited with ${rc}:\n${err}")
  endif()
endforeach()

read_metrics("${OUT}/first" first)
read_metrics("${OUT}/second" second)
if(NOT first STREQUAL second)
  string(REPLACE "\n" ";" first_lines "${first}")
  string(REPLACE "\n" ";" second_lines "${second}")
  foreach(line IN LISTS first_lines)
    list(POP_FRONT second_lines other)
    if(NOT line STREQUAL other)
      message(FATAL_ERROR "CheckReproducible: the runs' metrics differ; first at\n  ${line}\nand\n  ${other}")
    endif()
  endforeach()
  message(FATAL_ERROR "CheckReproducible: the runs' metrics differ in length")
endif()
file(SHA256 "${OUT}/first/checkpoint/model.safetensors" first_model)
file(SHA256 "${OUT}/second/checkpoint/model.safetensors" second_model)
if(NOT first_model STREQUAL second_model)
  message(FATAL_ERROR "CheckReproducible: the runs' metrics agree but their checkpoints' parameters differ")
endif()
string(REGEX MATCHALL "\"type\":\"train\"" steps "${first}")
list(LENGTH steps count)
message(STATUS "CheckReproducible: ${count} steps, metrics and parameters the same bit for bit in both runs")
