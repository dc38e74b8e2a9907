# Runs a command and checks its exit status and what it printed on stderr: an app's answer to a bad
# option or input must be the documented status and a message naming the option, the value and the
# accepted range.
#   cmake "-DCOMMAND=<app>;--opt;value" -DSTATUS=2 "-DMATCH=<regex for stderr>" -P CheckExit.cmake
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 120)
message(STATUS "exit ${rc}\n${out}${err}")
if(NOT rc STREQUAL "${STATUS}")
  message(FATAL_ERROR "CheckExit: ${COMMAND} exited with '${rc}', expected ${STATUS}")
endif()
if(NOT err MATCHES "${MATCH}")
  message(FATAL_ERROR "CheckExit: the message of ${COMMAND} does not match '${MATCH}'")
endif()
