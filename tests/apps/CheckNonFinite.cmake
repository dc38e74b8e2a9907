# kmamba-train with a learning rate of 1e30: the first update sends the parameters to ~1e30, every
# later forward pass overflows, so every step after the first is non-finite. The run must skip and
# log --max-skipped-steps (3) of them ("skip" lines, "skipped" records in metrics.jsonl naming the
# non-finite gradients), then stop with an error saying why.
#   cmake -DTRAIN=... -DOUT=... -P CheckNonFinite.cmake
file(REMOVE_RECURSE ${OUT})
execute_process(COMMAND ${TRAIN} --steps 20 --lr 1e30 --min-lr 0 --warmup 0 --eval-interval 0
                        --max-skipped-steps 3 --out ${OUT}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 240)
message(STATUS "exit ${rc}\n${out}${err}")
if(rc EQUAL 0)
  message(FATAL_ERROR "kmamba-train succeeded although every step after the first was non-finite")
endif()
if(NOT err MATCHES "4 non-finite steps in a row, more than max_skipped_steps = 3")
  message(FATAL_ERROR "the error does not say that max_skipped_steps was exceeded")
endif()
if(NOT err MATCHES "non-finite gradients in backbone\\.")
  message(FATAL_ERROR "the error does not name the non-finite gradients")
endif()
string(REGEX MATCHALL "skip  step" skip_lines "${out}")
list(LENGTH skip_lines n_lines)
file(STRINGS ${OUT}/metrics.jsonl records REGEX "\"type\":\"skipped\"")
list(LENGTH records n_records)
if(NOT n_lines EQUAL 3 OR NOT n_records EQUAL 3)
  message(FATAL_ERROR "expected 3 skipped steps on the console and in metrics.jsonl, got ${n_lines} and ${n_records}")
endif()
