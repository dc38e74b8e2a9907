# One rank of RankFailure throws while the others wait in a collective: the run must end within
# TIMEOUT seconds, fail, and say which rank failed and why.
#   cmake -DMPIEXEC=... -DNP=4 "-DFLAGS=..." -DEXE=... -DTIMEOUT=60 -P RunRankFailure.cmake
math(EXPR failing "${NP} - 1")
string(TIMESTAMP t0 "%s")
execute_process(COMMAND ${MPIEXEC} -n ${NP} ${FLAGS} ${EXE} ${failing}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT ${TIMEOUT})
string(TIMESTAMP t1 "%s")
math(EXPR seconds "${t1} - ${t0}")
message(STATUS "exit: ${rc} after ${seconds} s\n${out}${err}")
if(rc MATCHES "timeout|Timeout")
  message(FATAL_ERROR "the ranks still ran after ${TIMEOUT} s: a failed rank left the others hanging")
endif()
if(rc EQUAL 0)
  message(FATAL_ERROR "the run succeeded although rank ${failing} threw")
endif()
if(NOT "${out}${err}" MATCHES "kmamba: rank ${failing} of ${NP} failed: injected failure in round 3; aborting all ${NP} ranks")
  message(FATAL_ERROR "no message naming the failed rank ${failing}")
endif()
