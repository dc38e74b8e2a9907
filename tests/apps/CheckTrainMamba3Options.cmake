# kmamba-train's Mamba-3 options: a tiny MIMO model (--mimo-rank, --rope-fraction) and a SISO model
# with --outproj-norm train a few steps and write those fields into their checkpoint's config.json;
# both resume (run.json restores the options), the MIMO run refusing another rank; bad values and
# misplaced options fail with 2 naming them.
#   cmake -DTRAIN=<kmamba-train> -DOUT=<dir> -P CheckTrainMamba3Options.cmake
file(REMOVE_RECURSE ${OUT})
file(MAKE_DIRECTORY ${OUT})
include(${CMAKE_CURRENT_LIST_DIR}/../support/TrainRuns.cmake)
function(expect_config dir pattern)
  file(READ ${dir}/checkpoint/config.json config)
  if(NOT config MATCHES "${pattern}")
    message(FATAL_ERROR "CheckTrainMamba3Options: ${dir}/checkpoint/config.json does not match '${pattern}':\n${config}")
  endif()
endfunction()

set(tiny --mixer mamba3 --d-model 16 --n-layer 1 --d-state 8 --headdim 8 --seqlen 24 --batch-size 2
    --eval-interval 0 --eval-batches 1 --checkpoint-interval 0)
train(0 "done: 4 steps" ${tiny} --mimo-rank 2 --rope-fraction 1 --steps 4 --out ${OUT}/mimo)
expect_config(${OUT}/mimo "\"is_mimo\": true.*\"mimo_rank\": 2.*\"rope_fraction\": 1.0")
train(2 "--resume: --mimo-rank differs from the checkpoint's architecture" --resume --out ${OUT}/mimo --mimo-rank 3)
train(0 "resumed at step 4.*done: 6 steps" --resume --out ${OUT}/mimo --steps 6)
train(0 "done: 3 steps" ${tiny} --outproj-norm --steps 3 --out ${OUT}/outproj_norm)
expect_config(${OUT}/outproj_norm "\"is_mimo\": false.*\"is_outproj_norm\": true")
train(0 "resumed at step 3.*done: 4 steps" --resume --out ${OUT}/outproj_norm --steps 4)

train(2 "--rope-fraction: got '0.3', expected 0.5 or 1" ${tiny} --rope-fraction 0.3 --out ${OUT}/bad)
train(2 "--mimo-rank: got '0', expected an integer in \\[1, " ${tiny} --mimo-rank 0 --out ${OUT}/bad)
train(2 "--mimo-rank configures a mamba3 model, not mamba2" --mixer mamba2 --mimo-rank 2 --out ${OUT}/bad)
train(2 "--outproj-norm with --mimo-rank 2: the out-proj norm is for SISO models" ${tiny} --mimo-rank 2 --outproj-norm
      --out ${OUT}/bad)
