# Runs kmamba-train on one rank and under mpirun on a process mesh over the same global batches
# (the one-rank run accumulates the dp ranks' micro-batches) and checks that the training loss of
# every step agrees within MAX_DIFF (absolute; the losses are about 4 at the start, and
# metrics.jsonl rounds them to about 1e-6 here).
#
#   cmake -DTRAIN=<kmamba-train> -DMPIEXEC=<mpiexec> "-DMPIFLAGS=-n;4;--oversubscribe" -DOUT=<dir>
#         "-DARGS=--steps;12" "-DONE_RANK=--grad-accum;2" "-DMESH=--dp;2;--tp;2" -DMAX_DIFF=0.00002
#         -P CheckParallelTraining.cmake

include(${CMAKE_CURRENT_LIST_DIR}/LossCurves.cmake)

file(REMOVE_RECURSE "${OUT}/one_rank" "${OUT}/mesh")
execute_process(COMMAND "${TRAIN}" ${ARGS} ${ONE_RANK} --out "${OUT}/one_rank" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "CheckParallelTraining: kmamba-train on one rank exited with ${rc}")
endif()
execute_process(COMMAND "${MPIEXEC}" ${MPIFLAGS} "${TRAIN}" ${ARGS} ${MESH} --out "${OUT}/mesh" RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "CheckParallelTraining: mpiexec ${MPIFLAGS} kmamba-train ${MESH} exited with ${rc}")
endif()
expect_same_losses("${OUT}/one_rank" "${OUT}/mesh" "${MAX_DIFF}")
