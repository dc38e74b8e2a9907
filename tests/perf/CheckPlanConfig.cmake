# kmamba-plan's plan file runs: plans for a small Mamba-2 model on 2 ranks (with tp 2 forced, so
# that the mesh keys matter), then kmamba-train --config <plan> under mpirun on those 2 ranks must
# train with the plan's mesh, micro-batch and accumulation.
#
#   cmake -DPLAN=<kmamba-plan> -DTRAIN=<kmamba-train> -DMPIEXEC=<mpiexec> "-DMPIFLAGS=-n;2;--oversubscribe"
#         -DOUT=<dir> -P CheckPlanConfig.cmake

file(REMOVE_RECURSE "${OUT}")
file(MAKE_DIRECTORY "${OUT}")
file(WRITE "${OUT}/config.json" [=[{"d_model": 64, "n_layer": 2, "vocab_size": 64, "pad_vocab_size_multiple": 8,
 "ssm_cfg": {"layer": "Mamba2", "d_state": 16, "headdim": 16, "ngroups": 2, "chunk_size": 16}}
]=])
execute_process(COMMAND "${PLAN}" --model "${OUT}/config.json" --gpus 2 --gpus-per-node 2 --seqlen 64 --global-batch 8
                        --pp 1 --tp 2 --out "${OUT}/plan.json"
                RESULT_VARIABLE rc OUTPUT_VARIABLE output ERROR_VARIABLE errors)
if(NOT rc EQUAL 0 OR NOT output MATCHES "chosen +pp1 dp1 tp2 sp1 mb([0-9]+) acc([0-9]+)")
  message(FATAL_ERROR "CheckPlanConfig: kmamba-plan exited with ${rc}, expected a chosen tp 2 plan:\n${output}\n${errors}")
endif()
set(micro_batch ${CMAKE_MATCH_1})
set(accumulation ${CMAKE_MATCH_2})
file(READ "${OUT}/plan.json" plan)
foreach(key pipeline_parallel_size tensor_parallel_size data_parallel_size sequence_parallel_size batch_size grad_accum
            zero_stage activation_checkpointing gradient_compression precision mixer d_model seqlen)
  string(JSON value ERROR_VARIABLE missing GET "${plan}" ${key})
  if(missing)
    message(FATAL_ERROR "CheckPlanConfig: ${OUT}/plan.json has no \"${key}\":\n${plan}")
  endif()
endforeach()
execute_process(COMMAND "${MPIEXEC}" ${MPIFLAGS} "${TRAIN}" --config "${OUT}/plan.json" --steps 2 --eval-interval 0
                        --checkpoint-interval 0 --device serial --out "${OUT}/run"
                RESULT_VARIABLE rc OUTPUT_VARIABLE output ERROR_VARIABLE errors)
set(expected "2 ranks: data parallel 1 x tensor parallel 2 x sequence parallel 1.*2 steps of ${accumulation} x ${micro_batch} sequences")
if(NOT rc EQUAL 0 OR NOT output MATCHES "${expected}")
  message(FATAL_ERROR "CheckPlanConfig: kmamba-train --config ${OUT}/plan.json exited with ${rc}, expected "
                      "'${expected}':\n${output}\n${errors}")
endif()
