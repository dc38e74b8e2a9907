# The tokenizer travels from text to checkpoints: kmamba-tokenize encodes a text with a BPE
# tokenizer.json; kmamba-train trained on it with --tokenizer writes that tokenizer.json into its
# checkpoint, keeps it there when resumed, and a run fine-tuning that checkpoint (--model) carries
# it on; kmamba-generate then encodes with it, without the byte-fallback warning. A --tokenizer with
# more tokens than the model is refused.
#
#   cmake -DTOKENIZE=<kmamba-tokenize> -DTRAIN=<kmamba-train> -DGENERATE=<kmamba-generate>
#         -DTOKENIZER=<tokenizer.json> -DTEXT=<text file> -DOUT=<dir> -P CheckTokenizerTravels.cmake

file(REMOVE_RECURSE "${OUT}")
file(MAKE_DIRECTORY "${OUT}")
file(READ "${TOKENIZER}" tokenizer_text)

function(run name)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message(STATUS "${name}: exit ${rc}\n${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "CheckTokenizerTravels: ${name} exited with ${rc}")
  endif()
  set(run_stderr "${err}" PARENT_SCOPE)
endfunction()

function(expect_tokenizer checkpoint)
  if(NOT EXISTS "${checkpoint}/tokenizer.json")
    message(FATAL_ERROR "CheckTokenizerTravels: ${checkpoint} has no tokenizer.json")
  endif()
  file(READ "${checkpoint}/tokenizer.json" copied)
  if(NOT copied STREQUAL tokenizer_text)
    message(FATAL_ERROR "CheckTokenizerTravels: ${checkpoint}/tokenizer.json differs from ${TOKENIZER}")
  endif()
endfunction()

set(tokens "${OUT}/tokens.kmtok")
run(tokenize "${TOKENIZE}" --input "${TEXT}" --tokenizer "${TOKENIZER}" --output "${tokens}" --threads 2)
set(small --d-model 16 --n-layer 1 --seqlen 32 --batch-size 4 --eval-interval 0 --checkpoint-interval 0)
run(train "${TRAIN}" --data "${tokens}" --tokenizer "${TOKENIZER}" --steps 2 ${small} --out "${OUT}/run")
expect_tokenizer("${OUT}/run/checkpoint")
run(resume "${TRAIN}" --resume --out "${OUT}/run" --steps 3)
expect_tokenizer("${OUT}/run/checkpoint")
run(finetune "${TRAIN}" --model "${OUT}/run/checkpoint" --data "${tokens}" --steps 1 --seqlen 32 --batch-size 4
    --eval-interval 0 --checkpoint-interval 0 --out "${OUT}/finetune")
expect_tokenizer("${OUT}/finetune/checkpoint")
run(generate "${GENERATE}" --model "${OUT}/finetune/checkpoint" --prompt "Hello world" --max-new-tokens 4 --seed 1)
if(run_stderr MATCHES "warning")
  message(FATAL_ERROR "CheckTokenizerTravels: kmamba-generate warned on a checkpoint with its tokenizer: ${run_stderr}")
endif()

# A byte-level model (vocabulary 256) cannot take the 660-token tokenizer.
execute_process(COMMAND "${TRAIN}" --data "${TEXT}" --tokenizer "${TOKENIZER}" --steps 1 ${small} --out "${OUT}/bytes"
                RESULT_VARIABLE rc ERROR_VARIABLE err OUTPUT_QUIET)
if(NOT rc EQUAL 2 OR NOT err MATCHES "--tokenizer '[^']*' has [0-9]+ tokens, more than the model's vocabulary of 256")
  message(FATAL_ERROR "CheckTokenizerTravels: a tokenizer larger than the model gave exit ${rc}: ${err}")
endif()
