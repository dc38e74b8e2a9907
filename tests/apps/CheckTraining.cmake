# Runs kmamba-train into a fresh directory and checks that it learned: the last held-out loss in
# metrics.jsonl must be at most MAX_RATIO times the first (the untrained model's).
#
#   cmake -DTRAIN=<kmamba-train> -DOUT=<dir> -DMAX_RATIO=0.5 "-DARGS=--steps;150" -P CheckTraining.cmake

# A decimal number as an integer count of thousandths (CMake's math() has integers only).
function(to_thousandths text out)
  if(text MATCHES "[eE]-")
    set(${out} 0 PARENT_SCOPE)  # below 1e-1: negligible here
  elseif(text MATCHES "^([0-9]+)(\\.([0-9]*))?")
    set(fraction "${CMAKE_MATCH_3}000")
    string(SUBSTRING "${fraction}" 0 3 fraction)
    math(EXPR value "${CMAKE_MATCH_1} * 1000 + 1${fraction} - 1000")
    set(${out} ${value} PARENT_SCOPE)
  else()
    message(FATAL_ERROR "CheckTraining: cannot read the loss '${text}'")
  endif()
endfunction()

file(REMOVE_RECURSE "${OUT}")
execute_process(COMMAND "${TRAIN}" ${ARGS} --out "${OUT}" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "CheckTraining: kmamba-train exited with ${rc}")
endif()
file(STRINGS "${OUT}/metrics.jsonl" evals REGEX "\"type\":\"eval\"")
list(LENGTH evals count)
if(count LESS 2)
  message(FATAL_ERROR "CheckTraining: ${OUT}/metrics.jsonl holds ${count} evaluations, expected at least 2")
endif()
list(GET evals 0 first)
list(GET evals -1 last)
string(REGEX MATCH "\"loss\":([-0-9.eE+]+)" ignored "${first}")
set(first_loss "${CMAKE_MATCH_1}")
string(REGEX MATCH "\"loss\":([-0-9.eE+]+)" ignored "${last}")
set(last_loss "${CMAKE_MATCH_1}")
to_thousandths("${first_loss}" first_milli)
to_thousandths("${last_loss}" last_milli)
to_thousandths("${MAX_RATIO}" ratio_milli)
math(EXPR limit_milli "${first_milli} * ${ratio_milli} / 1000")
message(STATUS "CheckTraining: held-out loss ${first_loss} -> ${last_loss} (must be <= ${MAX_RATIO} x the first)")
if(last_milli GREATER limit_milli)
  message(FATAL_ERROR "CheckTraining: the model did not learn enough: held-out loss ${first_loss} -> ${last_loss}")
endif()
