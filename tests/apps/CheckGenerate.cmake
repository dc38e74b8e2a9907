# Exercises kmamba-generate end to end on the golden checkpoints and on a text model trained by
# kmamba-train: greedy decoding and seeded sampling reproduce, a prompt generates the same tokens
# alone and inside a batch of prompts of other lengths, a prompt outside the model's vocabulary is
# refused with a message, and a byte-level model from kmamba-train generates from a text prompt.
#
#   cmake -DGENERATE=<kmamba-generate> -DTRAIN=<kmamba-train> -DGOLDEN=<golden dir> -DDATA=<text file>
#         -DOUT=<dir> -P CheckGenerate.cmake

file(REMOVE_RECURSE "${OUT}")
file(MAKE_DIRECTORY "${OUT}")

# Runs kmamba-generate with ARGN; stores stdout in `out_var`; fails unless it exits with 0.
function(generate out_var)
  execute_process(COMMAND "${GENERATE}" ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE stdout ERROR_VARIABLE stderr)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "CheckGenerate: kmamba-generate ${ARGN} exited with ${rc}:\n${stderr}")
  endif()
  message(STATUS "kmamba-generate ${ARGN}:\n${stdout}${stderr}")
  set(${out_var} "${stdout}" PARENT_SCOPE)
endfunction()

foreach(model tiny_mamba1 tiny_mamba2)
  set(dir "${GOLDEN}/${model}")
  generate(a --model "${dir}" --prompt-ids "1,5,9,13,17" --greedy --max-new-tokens 12 --ids --no-echo)
  generate(b --model "${dir}" --prompt-ids "1,5,9,13,17" --greedy --max-new-tokens 12 --ids --no-echo --quiet)
  if(NOT a STREQUAL b)
    message(FATAL_ERROR "CheckGenerate: ${model}: greedy decoding differs between two runs:\n${a}\n${b}")
  endif()
  string(STRIP "${a}" ids)
  string(REPLACE " " ";" ids "${ids}")
  list(LENGTH ids count)
  if(NOT count EQUAL 12)
    message(FATAL_ERROR "CheckGenerate: ${model}: expected 12 generated ids, got ${count}: '${a}'")
  endif()

  # bf16 projections decode from the model's bf16 copy of the weights: the same count of greedy ids,
  # the same in two runs.
  generate(h1 --model "${dir}" --prompt-ids "1,5,9,13,17" --greedy --max-new-tokens 12 --ids --no-echo --quiet
           --precision bf16)
  generate(h2 --model "${dir}" --prompt-ids "1,5,9,13,17" --greedy --max-new-tokens 12 --ids --no-echo --quiet
           --precision bf16)
  string(STRIP "${h1}" bf16_ids)
  string(REPLACE " " ";" bf16_ids "${bf16_ids}")
  list(LENGTH bf16_ids bf16_count)
  if(NOT h1 STREQUAL h2 OR NOT bf16_count EQUAL 12)
    message(FATAL_ERROR "CheckGenerate: ${model}: --precision bf16 gave '${h1}' then '${h2}' (12 ids expected)")
  endif()

  generate(s1 --model "${dir}" --prompt-ids "3,1,4,1,5" --seed 7 --top-k 20 --max-new-tokens 16 --ids --quiet)
  generate(s2 --model "${dir}" --prompt-ids "3,1,4,1,5" --seed 7 --top-k 20 --max-new-tokens 16 --ids --quiet)
  if(NOT s1 STREQUAL s2)
    message(FATAL_ERROR "CheckGenerate: ${model}: seeded sampling differs between two runs:\n${s1}\n${s2}")
  endif()

  # Prompts of different lengths in one batch: each must match its run alone (greedy and seeded).
  file(WRITE "${OUT}/${model}_prompts.txt" "HELLO\n\n0123456789 ABC\nX\n")
  generate(batch --model "${dir}" --batch-file "${OUT}/${model}_prompts.txt" --greedy --max-new-tokens 10
           --output "${OUT}/${model}_batch.jsonl")
  # (Read as strings: completions may hold brackets, which CMake lists do not survive.)
  file(READ "${OUT}/${model}_batch.jsonl" batch_json)
  string(REGEX MATCHALL "\n" newlines "${batch_json}")
  list(LENGTH newlines batch_count)
  if(NOT batch_count EQUAL 3)
    message(FATAL_ERROR "CheckGenerate: ${model}: --output holds ${batch_count} lines, expected 3 (one per prompt)")
  endif()
  set(previous -1)
  foreach(prompt "HELLO" "0123456789 ABC" "X")
    generate(single --model "${dir}" --prompt "${prompt}" --greedy --max-new-tokens 10
             --output "${OUT}/${model}_single.jsonl")
    file(READ "${OUT}/${model}_single.jsonl" single_json)
    string(FIND "${batch_json}" "${single_json}" position)
    if(position LESS_EQUAL previous)
      message(FATAL_ERROR "CheckGenerate: ${model}: prompt '${prompt}' alone gave\n${single_json}"
                          "which is not the next line of the batch's output:\n${batch_json}")
    endif()
    set(previous ${position})
  endforeach()

  # The golden models' vocabulary has 96 ids: lowercase bytes are outside it.
  execute_process(COMMAND "${GENERATE}" --model "${dir}" --prompt "hello" RESULT_VARIABLE rc
                  OUTPUT_VARIABLE stdout ERROR_VARIABLE stderr)
  if(rc EQUAL 0 OR NOT stderr MATCHES "outside the model's vocabulary")
    message(FATAL_ERROR "CheckGenerate: ${model}: a prompt outside the vocabulary gave rc ${rc}, stderr '${stderr}'")
  endif()
endforeach()

# A byte-level text model trained here, then generation from a text prompt.
execute_process(COMMAND "${TRAIN}" --data "${DATA}" --out "${OUT}/text_model" --steps 30 --d-model 32 --n-layer 1
                        --seqlen 32 --batch-size 4 --eval-interval 0 --checkpoint-interval 0
                RESULT_VARIABLE rc OUTPUT_QUIET)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "CheckGenerate: kmamba-train on ${DATA} exited with ${rc}")
endif()
generate(text --model "${OUT}/text_model/checkpoint" --prompt "The model " --max-new-tokens 40 --seed 3)
if(NOT text MATCHES "^The model ")
  message(FATAL_ERROR "CheckGenerate: the streamed text does not start with the echoed prompt: '${text}'")
endif()
