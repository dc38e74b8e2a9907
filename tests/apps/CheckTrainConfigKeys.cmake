# The seed configuration's keys in kmamba-train --config (docs/training.md, "Configuration keys")
# on NP MPI ranks (1, 2 or 4):
# - each key takes effect: the mesh, accumulation, precision, checkpointing and overlap that the
#   run prints, and the options run.json records;
# - a command-line option wins over --config; values that conflict with the world size, with
#   another option or with another key of the file fail with 2, naming the key;
# - pipeline_parallel_size splits the layers into stages: at np 4, pp 2 × tp 2 follows one rank's
#   losses; more stages than the world's ranks or than the model's layers fail with 2, naming the key;
#   gradient_sync_frequency > 1 with zero_stage 1, or with steps not a multiple of it, fails with 2
#   naming both keys; an unknown gradient_compression is refused by name, powersgd with
#   gradient_sync_frequency > 1 and powersgd_rank without powersgd naming both keys; an unknown key in
#   load_balancing is refused by name, a negative data_redistribution_threshold by its key;
# - overlap_communication false reduces after the backward, with the same losses as true;
#   bucket_mb sets the reduction buckets (default 25 MiB), and tiny buckets give the same losses;
# - load_balancing.dynamic_task_allocation true deals the rows of packed batches with very unequal
#   real tokens (a text whose lines alternate with runs of empty ones, --pack-documents 10) to the
#   dp ranks by real tokens: metrics.jsonl reports each rank's real tokens, the busiest is never
#   busier than its fixed share and rows move in some step; the losses equal the fixed shares'
#   and one rank's within LOSS_DIFF (fp32 sums regrouped over the ranks' micro-batches, as the
#   train.mpi_* tests allow); sequence_split_strategy balanced gives the one-rank losses too.
#   cmake -DTRAIN=<kmamba-train> -DMPIEXEC=<mpiexec> "-DMPIFLAGS=-n;2;--oversubscribe" -DNP=2 -DOUT=<dir>
#         -P CheckTrainConfigKeys.cmake
include(${CMAKE_CURRENT_LIST_DIR}/LossCurves.cmake)
file(REMOVE_RECURSE ${OUT})
file(MAKE_DIRECTORY ${OUT})
set(LOSS_DIFF 0.00002)
set(small --d-model 16 --n-layer 1 --headdim 8 --ngroups 2 --seqlen 24 --batch-size 2 --steps 2 --eval-interval 0
          --eval-batches 1 --checkpoint-interval 0 --device serial)

# Runs kmamba-train on NP ranks with --config `config` (a JSON text) and the arguments after it;
# the exit status must be `expected` and the output must match `match`.
function(train name config expected match)
  file(WRITE ${OUT}/${name}.json "${config}")
  execute_process(COMMAND ${MPIEXEC} ${MPIFLAGS} ${TRAIN} --config ${OUT}/${name}.json ${small} --out ${OUT}/${name}
                          ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 240)
  message(STATUS "${name}: kmamba-train --config ${config} ${ARGN} on ${NP} ranks: exit ${rc}\n${out}${err}")
  if(NOT rc STREQUAL "${expected}")
    message(FATAL_ERROR "CheckTrainConfigKeys: ${name} exited with '${rc}', expected ${expected}")
  endif()
  if(NOT "${out}${err}" MATCHES "${match}")
    message(FATAL_ERROR "CheckTrainConfigKeys: the output of ${name} does not match '${match}'")
  endif()
endfunction()

function(expect_run_json name match)
  file(READ ${OUT}/${name}/run.json saved)
  if(NOT saved MATCHES "${match}")
    message(FATAL_ERROR "CheckTrainConfigKeys: ${name}/run.json does not match '${match}':\n${saved}")
  endif()
endfunction()

# The losses of every step, as metrics.jsonl writes them.
function(losses name out)
  train_losses(${OUT}/${name} found)
  set(${out} "${found}" PARENT_SCOPE)
endfunction()

# Runs kmamba-train on one rank without mpirun (the reference of a mesh's losses).
function(train_one_rank name config)
  set(MPIEXEC "")
  set(MPIFLAGS "")
  train(${name} "${config}" 0 "done: " ${ARGN})
endfunction()

# Packed rows of very unequal real tokens: lines of 120 bytes between runs of 120 empty lines, so
# a window of 24 tokens holds up to 24 real tokens in the text and none among the empty lines
# (each newline ends a document, and its target is ignored).
set(packed_text ${OUT}/packed.txt)
string(REPEAT "kmamba packs documents. " 5 line)
string(REPEAT "\n" 120 blank_lines)
string(REPEAT "${line}\n${blank_lines}" 16 text)
file(WRITE ${packed_text} "${text}")
set(packed --data ${packed_text} --pack-documents 10)

# Fails unless every train record of `name` reports the dp ranks' real tokens, the busiest rank is
# never above its fixed share's busiest, and rows moved in at least one step.
function(expect_balanced name ranks)
  file(STRINGS ${OUT}/${name}/metrics.jsonl records REGEX "\"type\":\"train\"")
  set(moved FALSE)
  foreach(record IN LISTS records)
    string(JSON count LENGTH "${record}" rank_tokens)
    if(NOT count EQUAL ranks)
      message(FATAL_ERROR "CheckTrainConfigKeys: ${name}: ${count} rank_tokens, expected ${ranks}: ${record}")
    endif()
    set(busiest 0)
    set(fixed_busiest 0)
    math(EXPR last "${ranks} - 1")
    foreach(r RANGE ${last})
      string(JSON t GET "${record}" rank_tokens ${r})
      string(JSON f GET "${record}" fixed_share_tokens ${r})
      if(t GREATER busiest)
        set(busiest ${t})
      endif()
      if(f GREATER fixed_busiest)
        set(fixed_busiest ${f})
      endif()
    endforeach()
    if(busiest GREATER fixed_busiest)
      message(FATAL_ERROR "CheckTrainConfigKeys: ${name}: the busiest rank holds ${busiest} real tokens, its fixed share ${fixed_busiest}: ${record}")
    endif()
    string(JSON step_moved GET "${record}" rows_moved)
    if(step_moved)
      set(moved TRUE)
    endif()
  endforeach()
  if(NOT moved)
    message(FATAL_ERROR "CheckTrainConfigKeys: ${name}: no step moved rows")
  endif()
endfunction()

set(balancing "\"load_balancing\": {\"dynamic_task_allocation\": false, \"communication_pipelining\": true, \"async_gradient_allreduce\": true}")
set(not_split "\"pipeline_parallel_size\": 1, \"sequence_parallel_enabled\": false, \"sequence_split_strategy\": \"even\", \"gradient_sync_frequency\": 1")
set(ranks "${NP} ranks: data parallel")

if(NP EQUAL 1)
  set(seed "{\"tensor_parallel_size\": 1, \"data_parallel_size\": 1, \"gradient_accumulation_steps\": 2, \"mixed_precision\": \"bf16\", \"activation_checkpointing\": true, \"overlap_communication\": true, ${not_split}, ${balancing}}")
  train(seed "${seed}" 0
        "bf16 projections, activation checkpointing.*${ranks} 1 x tensor parallel 1 x sequence parallel 1; ZeRO stage 0; gradients reduced during the backward.*2 steps of 2 x 2 sequences.*done: 2 steps")
  expect_run_json(seed "\"activation_checkpointing\": \"true\".*\"dynamic_task_allocation\": \"false\".*\"grad_accum\": \"2\".*\"pipeline_parallel_size\": \"1\".*\"precision\": \"bf16\"")
  train(command_line_wins "${seed}" 0 "fp32 projections, activation checkpointing.*2 steps of 3 x 2 sequences"
        --grad-accum 3 --precision fp32)
  train(tp_misfits "{\"tensor_parallel_size\": 2}" 2 "the world has 1 ranks, which is not a multiple of tensor_parallel_size 2")
  train(dynamic_one_rank "{\"load_balancing\": {\"dynamic_task_allocation\": true}}" 0
        "the rows of every global batch dealt to the 1 data-parallel rank by real tokens when the busiest fixed share holds more than 10% above the mean.*rows moved in 0 of 2 steps; the busiest data-parallel rank held 0.0% above the step.s mean real tokens on average \\(fixed shares 0.0%\\); real tokens per rank over the run [0-9]+ \\(fixed shares [0-9]+\\)")
  train(sp_leaves_no_rank "{\"sequence_parallel_enabled\": true}" 2
        "sequence_parallel_enabled \\(--sequence-parallel-enabled\\) true: tensor_parallel_size 1 x data_parallel_size 1 use all 1 ranks of the world, leaving none to split sequences")

  # Errors found before MPI starts, the same on any number of ranks: one rank without mpirun.
  set(MPIEXEC "")
  set(MPIFLAGS "")
  train(pipeline_misfits "{\"pipeline_parallel_size\": 2}" 2
        "the world has 1 ranks, which is not a multiple of tensor_parallel_size 1 × sequence_parallel_size 1 × pipeline_parallel_size 2")
  train(sync_frequency_zero1 "{\"gradient_sync_frequency\": 4, \"zero_stage\": 1}" 2
        "zero_stage \\(--zero-stage\\) 1 with gradient_sync_frequency \\(--gradient-sync-frequency\\) 4: ZeRO-1 shards the AdamW moments")
  train(sync_frequency_steps "{\"gradient_sync_frequency\": 4}" 2
        "steps \\(--steps\\) 2 is not a multiple of gradient_sync_frequency \\(--gradient-sync-frequency\\) 4")
  train(unknown_compression "{\"gradient_compression\": \"fp8\"}" 2
        "\"gradient_compression\": --gradient-compression: got 'fp8', expected one of none, bf16, powersgd")
  train(powersgd_local_sgd "{\"gradient_compression\": \"powersgd\", \"gradient_sync_frequency\": 4}" 2
        "gradient_compression \\(--gradient-compression\\) powersgd with gradient_sync_frequency \\(--gradient-sync-frequency\\) 4: local steps reduce no gradients")
  train(powersgd_rank_alone "{\"powersgd_rank\": 8}" 2
        "powersgd_rank \\(--powersgd-rank\\) 8 with gradient_compression \\(--gradient-compression\\) none: the rank applies to gradient_compression powersgd only")
  train(unknown_split "{\"sequence_split_strategy\": \"random\"}" 2
        "\"sequence_split_strategy\": --sequence-split-strategy: got 'random', expected one of even, balanced")
  train(negative_threshold "{\"load_balancing\": {\"dynamic_task_allocation\": true, \"data_redistribution_threshold\": -0.1}}" 2
        "\"load_balancing.data_redistribution_threshold\": --data-redistribution-threshold: got '-0.1', expected a finite number >= 0")
  train(balancing_typo "{\"load_balancing\": {\"dynamic_task_allocation\": false, \"work_stealing\": true}}" 2
        "unknown key \"work_stealing\" in \"load_balancing\" \\(expected dynamic_task_allocation, data_redistribution_threshold, communication_pipelining, async_gradient_allreduce\\)")
  train(balancing_scalar "{\"load_balancing\": true}" 2 "\"load_balancing\" must be a JSON object with the keys")
  train(bad_bool "{\"load_balancing\": {\"async_gradient_allreduce\": 1}}" 2
        "\"load_balancing.async_gradient_allreduce\": --async-gradient-allreduce: got '1', expected one of true, false")
  train(fp16 "{\"mixed_precision\": \"fp16\"}" 2
        "\"mixed_precision\": --precision: got 'fp16', expected one of fp32, tf32, bf16")
  train(no_accumulation "{\"gradient_accumulation_steps\": 0}" 2
        "\"gradient_accumulation_steps\": --grad-accum: got '0', expected an integer in .1, 2147483647.")
  train(two_keys "{\"grad_accum\": 2, \"gradient_accumulation_steps\": 4}" 2
        "\"grad_accum\" and \"gradient_accumulation_steps\" both set --grad-accum, to 2 and 4")
  train(overlap_conflict "{\"overlap_communication\": true}" 2
        "overlap_communication \\(--overlap-communication\\) true conflicts with load_balancing.async_gradient_allreduce \\(--async-gradient-allreduce\\) false"
        --async-gradient-allreduce false)
  train(sp_conflict "{\"sequence_parallel_enabled\": false}" 2
        "sequence_parallel_enabled \\(--sequence-parallel-enabled\\) false conflicts with sequence_parallel_size \\(--sp\\) 2"
        --sp 2)
  train(sp_one "{\"sequence_parallel_enabled\": true, \"sequence_parallel_size\": 1}" 2
        "sequence_parallel_enabled \\(--sequence-parallel-enabled\\) true conflicts with sequence_parallel_size \\(--sp\\) 1: sequence parallelism needs at least 2 ranks")
elseif(NP EQUAL 2)
  # overlap_communication false: the buckets are reduced after the backward, and the losses are
  # those of the overlapped reduction (host transports reduce in the same order either way).
  set(dp2 "\"data_parallel_size\": 2, \"gradient_accumulation_steps\": 2, ${not_split}")
  set(dp2_mesh "${ranks} 2 x tensor parallel 1 x sequence parallel 1; ZeRO stage 0")
  train(dp2_overlap_true "{${dp2}, \"overlap_communication\": true}" 0
        "${dp2_mesh}; gradients reduced during the backward in buckets of 25 MiB.*2 steps of 2 x 2 sequences")
  train(dp2_overlap_false "{${dp2}, \"overlap_communication\": false}" 0
        "${dp2_mesh}; gradients reduced after the backward.*2 steps of 2 x 2 sequences")
  expect_run_json(dp2_overlap_false "\"overlap_communication\": \"false\"")
  losses(dp2_overlap_true overlapped)
  losses(dp2_overlap_false after)
  if(NOT overlapped STREQUAL after OR overlapped STREQUAL "")
    message(FATAL_ERROR "CheckTrainConfigKeys: the losses with the overlap (${overlapped}) and without (${after}) differ")
  endif()
  # Buckets of 2^-16 MiB (16 bytes: 4 fp32 elements, 2 a rank): hundreds of buckets, the same sums.
  train(dp2_small_buckets "{${dp2}, \"bucket_mb\": 0.0000152587890625}" 0
        "${dp2_mesh}; gradients reduced during the backward in buckets of 1.52588e-05 MiB")
  losses(dp2_small_buckets small_bucket_losses)
  if(NOT overlapped STREQUAL small_bucket_losses)
    message(FATAL_ERROR "CheckTrainConfigKeys: the losses with 16-byte buckets (${small_bucket_losses}) and 25 MiB ones (${overlapped}) differ")
  endif()
  train(sp_derived "{\"sequence_parallel_enabled\": true, \"sequence_split_strategy\": \"even\"}" 0
        "${ranks} 1 x tensor parallel 1 x sequence parallel 2 \\(even segments\\)")
  train(dp_misfits "{\"data_parallel_size\": 4}" 2 "data_parallel_size 4 .* = 4 ranks, but the world has 2")
  # Packed rows of very unequal real tokens, dealt to the ranks by real tokens: the losses of the
  # fixed shares and of one rank on the same global batches.
  set(dp2_packed "\"data_parallel_size\": 2, \"gradient_accumulation_steps\": 2")
  train(dp2_dynamic "{${dp2_packed}, \"load_balancing\": {\"dynamic_task_allocation\": true, \"data_redistribution_threshold\": 0.05}}" 0
        "dealt to the 2 data-parallel ranks by real tokens when the busiest fixed share holds more than 5% above the mean.*rows moved in [12] of 2 steps; .*real tokens per rank over the run [0-9]+ [0-9]+ \\(fixed shares [0-9]+ [0-9]+\\)"
        ${packed})
  expect_balanced(dp2_dynamic 2)
  expect_run_json(dp2_dynamic "\"data_redistribution_threshold\": \"0.05\".*\"dynamic_task_allocation\": \"true\"")
  train(dp2_fixed "{${dp2_packed}, \"load_balancing\": {\"dynamic_task_allocation\": false}}" 0
        "load balancing: each data-parallel rank takes its fixed share" ${packed})
  train_one_rank(dp2_packed_one_rank "{\"gradient_accumulation_steps\": 4}" ${packed})
  expect_same_losses(${OUT}/dp2_fixed ${OUT}/dp2_dynamic ${LOSS_DIFF})
  expect_same_losses(${OUT}/dp2_packed_one_rank ${OUT}/dp2_dynamic ${LOSS_DIFF})
  # Segments of equal real tokens (the recall rows' queries lie in their second part).
  train(sp_balanced "{\"sequence_parallel_enabled\": true, \"sequence_split_strategy\": \"balanced\"}" 0
        "${ranks} 1 x tensor parallel 1 x sequence parallel 2 \\(balanced segments\\)")
  train_one_rank(sp_balanced_one_rank "{}")
  expect_same_losses(${OUT}/sp_balanced_one_rank ${OUT}/sp_balanced ${LOSS_DIFF})
elseif(NP EQUAL 4)
  # The seed's example (tensor parallel 4 x data parallel 2 on 8 ranks), on 4 ranks.
  train(seed_example
        "{\"tensor_parallel_size\": 2, \"data_parallel_size\": 2, \"gradient_accumulation_steps\": 8, \"mixed_precision\": \"bf16\", \"activation_checkpointing\": true, \"overlap_communication\": true, ${not_split}, ${balancing}}"
        0
        "bf16 projections, activation checkpointing.*${ranks} 2 x tensor parallel 2 x sequence parallel 1; ZeRO stage 0; gradients reduced during the backward.*2 steps of 8 x 2 sequences.*done: 2 steps")
  expect_run_json(seed_example "\"data_parallel_size\": \"2\".*\"grad_accum\": \"8\".*\"tensor_parallel_size\": \"2\"")
  train(tp_sp_derived "{\"tensor_parallel_size\": 2, \"sequence_parallel_enabled\": true}" 0
        "${ranks} 1 x tensor parallel 2 x sequence parallel 2 \\(even segments\\)")
  train(sp_no_rank_left "{\"tensor_parallel_size\": 2, \"data_parallel_size\": 2, \"sequence_parallel_enabled\": true}" 2
        "sequence_parallel_enabled \\(--sequence-parallel-enabled\\) true: tensor_parallel_size 2 x data_parallel_size 2 use all 4 ranks of the world, leaving none")
  train(tp_misfits "{\"tensor_parallel_size\": 3}" 2 "the world has 4 ranks, which is not a multiple of tensor_parallel_size 3")
  train(dp4_dynamic "{\"load_balancing\": {\"dynamic_task_allocation\": true, \"data_redistribution_threshold\": 0}}" 0
        "rows moved in [12] of 2 steps; .*real tokens per rank over the run [0-9]+ [0-9]+ [0-9]+ [0-9]+ " ${packed})
  expect_balanced(dp4_dynamic 4)
  train_one_rank(dp4_packed_one_rank "{\"gradient_accumulation_steps\": 4}" ${packed})
  expect_same_losses(${OUT}/dp4_packed_one_rank ${OUT}/dp4_dynamic ${LOSS_DIFF})
  train(dp2_sp2_balanced "{\"data_parallel_size\": 2, \"sequence_parallel_enabled\": true, \"sequence_split_strategy\": \"balanced\", \"load_balancing\": {\"dynamic_task_allocation\": true}}" 0
        "${ranks} 2 x tensor parallel 1 x sequence parallel 2 \\(balanced segments\\)")
  train_one_rank(dp2_sp2_one_rank "{\"gradient_accumulation_steps\": 2}")
  expect_same_losses(${OUT}/dp2_sp2_one_rank ${OUT}/dp2_sp2_balanced ${LOSS_DIFF})
  train(pipeline_more_stages_than_layers "{\"tensor_parallel_size\": 2, \"pipeline_parallel_size\": 2}" 2
        "pipeline_parallel_size 2 must lie in \\[1, 1\\]: the model has 1 layers")
  string(REPLACE "--n-layer;1" "--n-layer;2" small "${small}")  # one layer per stage
  train(pp2_tp2 "{\"tensor_parallel_size\": 2, \"pipeline_parallel_size\": 2, \"gradient_accumulation_steps\": 3}" 0
        "${ranks} 1 x tensor parallel 2 x sequence parallel 1 x pipeline parallel 2 \\(1F1B over the 3 micro-batches of a step; stage 0 holds layers 0 to 0\\)")
  train_one_rank(pp2_tp2_one_rank "{\"gradient_accumulation_steps\": 3}")
  expect_same_losses(${OUT}/pp2_tp2_one_rank ${OUT}/pp2_tp2 ${LOSS_DIFF})
else()
  message(FATAL_ERROR "CheckTrainConfigKeys: NP must be 1, 2 or 4, got '${NP}'")
endif()
