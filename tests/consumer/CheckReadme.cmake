# Fails unless README.md holds the embedding example verbatim (cmake -P script; README, EXAMPLE set).
file(READ "${README}" readme)
file(READ "${EXAMPLE}" example)
string(FIND "${readme}" "${example}" position)
if(position EQUAL -1)
  message(FATAL_ERROR "${README} does not hold ${EXAMPLE} verbatim: copy the file into the guide's code block")
endif()
