# Runs kmamba-perf with --json on a small case and checks the file it writes: one row per printed
# case (by name), each with a positive time, floor, ratio to the floor and rates.
#
#   cmake -DPERF=<kmamba-perf> -DOUT=<file.json> -P CheckKernelBenchJson.cmake

file(REMOVE "${OUT}")
execute_process(COMMAND "${PERF}" --small --case selective_scan --space Serial --repeats 1 --json "${OUT}"
                RESULT_VARIABLE rc OUTPUT_VARIABLE output ERROR_VARIABLE errors)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "kmamba-perf exited with ${rc}:\n${output}\n${errors}")
endif()
file(READ "${OUT}" doc)
string(JSON tool GET "${doc}" tool)
string(JSON space GET "${doc}" space)
string(JSON count LENGTH "${doc}" rows)
if(NOT tool STREQUAL "kmamba-perf" OR NOT space STREQUAL "Serial" OR NOT count EQUAL 2)
  message(FATAL_ERROR "${OUT}: expected tool kmamba-perf, space Serial and 2 rows, got '${tool}', '${space}', ${count}")
endif()
math(EXPR last "${count} - 1")
foreach(i RANGE ${last})
  string(JSON name GET "${doc}" rows ${i} case)
  string(FIND "${output}" "${name}" printed)
  if(printed EQUAL -1)
    message(FATAL_ERROR "${OUT}: row '${name}' is not in the printed table:\n${output}")
  endif()
  foreach(key seconds floor_seconds ratio_to_floor gb_per_s tflop_per_s)
    string(JSON value GET "${doc}" rows ${i} ${key})
    if(NOT value GREATER 0)
      message(FATAL_ERROR "${OUT}: row '${name}' has ${key} = ${value}, expected > 0")
    endif()
  endforeach()
endforeach()
message(STATUS "kmamba-perf wrote ${count} rows to ${OUT}")
