# kmamba-train's option sources and --resume:
# - a bad value in --config fails with 2, naming the file, the option, the value and the range;
# - --resume with an architecture option that differs from the checkpoint's fails with 2 naming it;
# - --resume without run.json fails with 2 instead of continuing on default options;
# - --resume with run.json continues the run to its --steps;
# - --resume reads metrics.jsonl as a regular file of records;
# - --virtual-stages without a pipeline fails with 2 naming virtual_pipeline_stages;
# - --pack-documents trains on packed documents of --data (here the lines of a text file, ended by
#   '\n' = byte 10), with Mamba-2 and Mamba-3 SISO and MIMO models, and is refused for the recall
#   task.
#   cmake -DTRAIN=<kmamba-train> -DOUT=<dir> -P CheckTrainOptions.cmake
file(REMOVE_RECURSE ${OUT})
file(MAKE_DIRECTORY ${OUT})
include(${CMAKE_CURRENT_LIST_DIR}/../support/TrainRuns.cmake)

file(WRITE ${OUT}/bad.json "{\"steps\": 2, \"learning_rate_typo\": 1}")
train(2 "bad.json': unknown or misplaced option \"learning_rate_typo\"" --config ${OUT}/bad.json --out ${OUT}/run)
file(WRITE ${OUT}/nan.json "{\"steps\": 2, \"lr\": \"nan\"}")
train(2 "nan.json': --lr: got 'nan', expected a finite number >= 0" --config ${OUT}/nan.json --out ${OUT}/run)

set(small --d-model 16 --n-layer 1 --seqlen 24 --batch-size 2 --eval-interval 0 --eval-batches 1)
file(WRITE ${OUT}/small.json "{\"steps\": 3, \"checkpoint_interval\": 0}")
train(0 "done: 3 steps" --config ${OUT}/small.json ${small} --out ${OUT}/run)
train(2 "--resume: --d-model differs from the checkpoint's architecture" --resume --out ${OUT}/run --d-model 32)
train(2 "--resume: --dt-min sets the initialisation" --resume --out ${OUT}/run --dt-min 0.01)
train(0 "resumed at step 3.*done: 5 steps" --resume --out ${OUT}/run --steps 5 --d-model 16)
# metrics.jsonl is read back as a regular file through the bounded JSON reader: a FIFO there is an
# error naming it (it hung), and lines that are not records are dropped with a warning (a line
# with a step but no type was an internal error).
file(RENAME ${OUT}/run/metrics.jsonl ${OUT}/metrics.jsonl.saved)
execute_process(COMMAND mkfifo ${OUT}/run/metrics.jsonl)
train(2 "metrics.jsonl' is a FIFO, expected a regular file" --resume --out ${OUT}/run --steps 6)
file(REMOVE ${OUT}/run/metrics.jsonl)
file(READ ${OUT}/metrics.jsonl.saved log)
string(REPEAT "[" 100000 deep)
file(WRITE ${OUT}/run/metrics.jsonl "${log}{\"step\": 1}\n${deep}\n{\"step\": 5, \"type\": \"tra")
train(0 "dropped 3 line\\(s\\) of '[^']*metrics.jsonl' that are not metrics records"
      --resume --out ${OUT}/run --steps 6)
file(RENAME ${OUT}/run/run.json ${OUT}/run.json.saved)
train(2 "run.json' is missing; it holds the run's options" --resume --out ${OUT}/run --steps 7)
# Virtual pipeline stages need a pipeline (the checks that need --pp run under MPI:
# TestPipelineParallel.cpp P5).
train(2 "virtual_pipeline_stages \\(--virtual-pipeline-stages\\) 2 needs pipeline_parallel_size \\(--pipeline-parallel-size\\) >= 2"
      --virtual-stages 2 --steps 1 ${small} --out ${OUT}/virtual_stages)

string(REPEAT "the quick brown fox jumps\nover\na lazy dog, twice over the fence\n" 40 lines)
file(WRITE ${OUT}/lines.txt "${lines}")
train(0 "documents packed, ended by token 10.*done: 2 steps" --data ${OUT}/lines.txt --pack-documents 10 --steps 2
      ${small} --out ${OUT}/packed)
train(2 "--pack-documents packs the documents of --data; the recall task has none" --pack-documents 10 --steps 1
      --out ${OUT}/packed_recall)
train(0 "documents packed, ended by token 10.*done: 2 steps" --data ${OUT}/lines.txt --pack-documents 10
      --mixer mamba3 --steps 2 ${small} --headdim 8 --out ${OUT}/packed_mamba3)
train(0 "documents packed, ended by token 10.*done: 2 steps" --data ${OUT}/lines.txt --pack-documents 10
      --mixer mamba3 --mimo-rank 2 --steps 2 ${small} --headdim 8 --out ${OUT}/packed_mamba3_mimo)
