# kmamba-train and its run directory:
#  - a loss curve that cannot be written (loss.png is a directory) is a warning, after the final
#    checkpoint is saved, and the run ends with 0;
#  - two runs started on one directory at once: one trains, the other stops at once with exit 2,
#    naming the process that holds the directory; the loss.png of the run that trained reads back
#    with libpng (kmamba_png_check: at least the 900 × 640 kmamba-train draws, not one flat colour).
#
#   cmake -DTRAIN=<kmamba-train> -DPNG_CHECK=<kmamba_png_check> -DOUT=<dir> -P CheckRunDirectory.cmake
set(small --steps 3 --eval-interval 0 --checkpoint-interval 0 --d-model 16 --n-layer 1 --seqlen 32)

file(REMOVE_RECURSE "${OUT}")
file(MAKE_DIRECTORY "${OUT}/plot/loss.png")
execute_process(COMMAND "${TRAIN}" ${small} --out "${OUT}/plot" RESULT_VARIABLE rc ERROR_VARIABLE err OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "CheckRunDirectory: with an unwritable loss.png kmamba-train exited with ${rc}:\n${err}")
endif()
if(NOT err MATCHES "warning: the loss curve was not written")
  message(FATAL_ERROR "CheckRunDirectory: no warning for the unwritable loss.png:\n${err}")
endif()
if(NOT EXISTS "${OUT}/plot/checkpoint/training_state.safetensors")
  message(FATAL_ERROR "CheckRunDirectory: the final checkpoint was not saved")
endif()

# Two COMMANDs of one execute_process run at the same time, as a pipeline; the first one's output
# goes to /dev/null rather than into the pipe, which the second may close first.
execute_process(COMMAND sh -c "exec \"$@\" >/dev/null" sh "${TRAIN}" --steps 40 --eval-interval 0 --out "${OUT}/shared"
                COMMAND "${TRAIN}" --steps 40 --eval-interval 0 --out "${OUT}/shared"
                RESULTS_VARIABLE codes ERROR_VARIABLE err OUTPUT_QUIET)
list(SORT codes)
if(NOT codes STREQUAL "0;2")
  message(FATAL_ERROR "CheckRunDirectory: two runs on one directory exited with ${codes}, expected 0 and 2:\n${err}")
endif()
if(NOT err MATCHES "kmamba-train: '[^']*shared' is in use by another process \\(process id [0-9]+")
  message(FATAL_ERROR "CheckRunDirectory: the second run did not name the first:\n${err}")
endif()
execute_process(COMMAND "${PNG_CHECK}" "${OUT}/shared/loss.png" 900 640 RESULT_VARIABLE rc)
if(NOT rc STREQUAL "0")
  message(FATAL_ERROR "CheckRunDirectory: the loss curve '${OUT}/shared/loss.png' did not read back (exit '${rc}')")
endif()
message(STATUS "CheckRunDirectory: a failed plot is a warning after the checkpoint; a second run is refused; "
               "the loss curve reads back")
