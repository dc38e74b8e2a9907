# Runs an app that writes a chart, then reads the chart back: the app must exit 0 (and, with MATCH,
# print something matching it), and PNG must decode with libpng, be at least MIN_WIDTH × MIN_HEIGHT
# and not one flat colour (kmamba_png_check). PNG is removed first, so that a file left by an
# earlier run cannot pass for this one's.
#   cmake "-DCOMMAND=<app>;--opt;value" -DPNG_CHECK=<kmamba_png_check> -DPNG=<file> -DMIN_WIDTH=900
#         -DMIN_HEIGHT=600 ["-DMATCH=<regex for the output>"] -P CheckPngOutput.cmake
file(REMOVE "${PNG}")
execute_process(COMMAND ${COMMAND} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
message(STATUS "exit ${rc}\n${out}${err}")
if(NOT rc STREQUAL "0")
  message(FATAL_ERROR "CheckPngOutput: ${COMMAND} exited with '${rc}', expected 0")
endif()
if(DEFINED MATCH AND NOT "${out}${err}" MATCHES "${MATCH}")
  message(FATAL_ERROR "CheckPngOutput: the output of ${COMMAND} does not match '${MATCH}'")
endif()
execute_process(COMMAND "${PNG_CHECK}" "${PNG}" ${MIN_WIDTH} ${MIN_HEIGHT} RESULT_VARIABLE rc)
if(NOT rc STREQUAL "0")
  message(FATAL_ERROR "CheckPngOutput: the chart '${PNG}' written by ${COMMAND} did not read back (exit '${rc}')")
endif()
