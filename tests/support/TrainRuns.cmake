# What the kmamba-train checks run with `cmake -P` share (include() it after setting TRAIN):
# train(expected match args...) runs ${TRAIN} with `args`, logs its output, and stops the script
# (named after its file in the message) unless it exits with `expected` and its output, stdout and
# stderr together, matches the regular expression `match`.
get_filename_component(train_runs_check ${CMAKE_SCRIPT_MODE_FILE} NAME_WE)
function(train expected match)
  execute_process(COMMAND ${TRAIN} ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 240)
  message(STATUS "kmamba-train ${ARGN}: exit ${rc}\n${out}${err}")
  if(NOT rc STREQUAL "${expected}")
    message(FATAL_ERROR "${train_runs_check}: kmamba-train ${ARGN} exited with '${rc}', expected ${expected}")
  endif()
  if(NOT "${out}${err}" MATCHES "${match}")
    message(FATAL_ERROR "${train_runs_check}: the output of kmamba-train ${ARGN} does not match '${match}'")
  endif()
endfunction()
