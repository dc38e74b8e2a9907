# Runs kmamba-train under mpirun with local SGD (--gradient-sync-frequency N > 1: the dp replicas
# step on their own data, averaged every N steps), or another data-parallel option whose start
# line EXPECT names (e.g. PowerSGD), and checks that it learns: the mean training loss of the last
# 4 steps must be at most MAX_RATIO times that of the first 4 (the untrained model's is about
# ln(vocab size)).
#
#   cmake -DTRAIN=<kmamba-train> -DMPIEXEC=<mpiexec> "-DMPIFLAGS=-n;2;--oversubscribe" -DOUT=<dir>
#         "-DARGS=--dp;2;--gradient-sync-frequency;4;--steps;48" [-DEXPECT=<regex>] -DMAX_RATIO=0.85
#         -P CheckLocalSgdTraining.cmake

include(${CMAKE_CURRENT_LIST_DIR}/LossCurves.cmake)

file(REMOVE_RECURSE "${OUT}")
execute_process(COMMAND "${MPIEXEC}" ${MPIFLAGS} "${TRAIN}" ${ARGS} --out "${OUT}" OUTPUT_VARIABLE output
                RESULT_VARIABLE rc)
message(STATUS "${output}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "CheckLocalSgdTraining: mpiexec ${MPIFLAGS} kmamba-train ${ARGS} exited with ${rc}")
endif()
if(NOT DEFINED EXPECT)
  set(EXPECT "local SGD: the replicas step alone, averaged every")
endif()
if(NOT output MATCHES "${EXPECT}")
  message(FATAL_ERROR "CheckLocalSgdTraining: the run does not say '${EXPECT}'")
endif()

# The mean of 4 losses, in millionths.
function(mean_of_four losses first out)
  set(sum 0)
  math(EXPR last "${first} + 3")
  foreach(i RANGE ${first} ${last})
    list(GET losses ${i} loss)
    to_millionths("${loss}" micro)
    math(EXPR sum "${sum} + ${micro}")
  endforeach()
  math(EXPR mean "${sum} / 4")
  set(${out} ${mean} PARENT_SCOPE)
endfunction()

train_losses("${OUT}" losses)
list(LENGTH losses steps)
if(steps LESS 8)
  message(FATAL_ERROR "CheckLocalSgdTraining: ${steps} training steps in ${OUT}/metrics.jsonl, expected at least 8")
endif()
mean_of_four("${losses}" 0 start)
math(EXPR tail "${steps} - 4")
mean_of_four("${losses}" ${tail} end)
to_millionths("${MAX_RATIO}" ratio)
math(EXPR limit "${start} * ${ratio} / 1000000")
message(STATUS "CheckLocalSgdTraining: mean loss ${start}e-6 over the first 4 steps, ${end}e-6 over the last 4 "
               "(limit ${limit}e-6)")
if(end GREATER limit)
  message(FATAL_ERROR "CheckLocalSgdTraining: the loss did not fall enough: ${start}e-6 -> ${end}e-6")
endif()
