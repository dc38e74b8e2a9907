# kmamba-train --offload-optimizer (and the JSON key offload_optimizer): the AdamW moments in host
# memory and the step on host threads train the same run as the optimizer on the device. On one
# thread of the Serial backend (deterministic sums):
# - the start line names the optimizer's place (offloaded; on the device by default);
# - metrics.jsonl (without its wall-clock fields) and the checkpoint's model.safetensors and
#   training_state.safetensors (the moments) are the bytes of the run without offload;
# - the key offload_optimizer in --config does the same, and run.json records it;
# - a run of 3 steps extended by --resume to 6 (run.json restores the option) ends with the
#   checkpoint and metrics of the same two runs without offload;
# - with gradient_sync_frequency > 1 (local steps average the moments on the device) it fails with
#   2, naming both keys.
#   cmake -DTRAIN=<kmamba-train> -DOUT=<dir> -P CheckOffloadOptimizer.cmake
file(REMOVE_RECURSE ${OUT})
file(MAKE_DIRECTORY ${OUT})
include(${CMAKE_CURRENT_LIST_DIR}/../support/TrainRuns.cmake)

set(small --d-model 16 --n-layer 1 --seqlen 24 --batch-size 4 --eval-interval 3 --eval-batches 1
          --checkpoint-interval 3 --grad-clip 0.05 --weight-decay 0.1 --device serial)

function(read_metrics dir out)
  file(READ "${dir}/metrics.jsonl" text)
  string(REGEX REPLACE "\"(elapsed_s|tokens_per_s)\":[^,}]*,?" "" text "${text}")
  set(${out} "${text}" PARENT_SCOPE)
endfunction()

# Run `dir` has the metrics and checkpoint of run `reference`.
function(expect_same_run reference dir)
  read_metrics(${OUT}/${reference} want)
  read_metrics(${OUT}/${dir} got)
  if(NOT got STREQUAL want)
    message(FATAL_ERROR "CheckOffloadOptimizer: ${dir}/metrics.jsonl differs from ${reference}'s:\n"
                        "${got}\nexpected\n${want}")
  endif()
  foreach(file model.safetensors training_state.safetensors)
    file(SHA256 ${OUT}/${reference}/checkpoint/${file} want)
    file(SHA256 ${OUT}/${dir}/checkpoint/${file} got)
    if(NOT got STREQUAL want)
      message(FATAL_ERROR "CheckOffloadOptimizer: ${dir}/checkpoint/${file} differs from ${reference}'s")
    endif()
  endforeach()
endfunction()

train(0 "optimizer: AdamW on the device" ${small} --steps 6 --out ${OUT}/device)
train(0 "optimizer: offloaded, AdamW moments in host memory" ${small} --steps 6 --offload-optimizer
      --out ${OUT}/offload)
expect_same_run(device offload)

file(WRITE ${OUT}/offload.json "{\"offload_optimizer\": true}")
train(0 "optimizer: offloaded" --config ${OUT}/offload.json ${small} --steps 6 --out ${OUT}/config)
expect_same_run(device config)
file(READ ${OUT}/config/run.json saved)
if(NOT saved MATCHES "\"offload_optimizer\": *(true|\"true\")")
  message(FATAL_ERROR "CheckOffloadOptimizer: run.json does not record offload_optimizer:\n${saved}")
endif()

foreach(run device offload)
  set(flag)
  if(run STREQUAL "offload")
    set(flag --offload-optimizer)
  endif()
  train(0 "done: 3 steps" ${small} --steps 3 ${flag} --out ${OUT}/${run}_resumed)
endforeach()
train(0 "optimizer: AdamW on the device.*resumed at step 3.*done: 6 steps" --resume --steps 6
      --out ${OUT}/device_resumed)
train(0 "optimizer: offloaded.*resumed at step 3.*done: 6 steps" --resume --steps 6 --out ${OUT}/offload_resumed)
expect_same_run(device_resumed offload_resumed)

train(2 "offload_optimizer \\(--offload-optimizer\\) with gradient_sync_frequency \\(--gradient-sync-frequency\\) 2"
      ${small} --steps 6 --offload-optimizer --gradient-sync-frequency 2 --out ${OUT}/local_sgd)
