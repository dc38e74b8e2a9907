#!/bin/sh
# kmamba-train stopped by SIGINT once it is training: it saves its checkpoint and exits 130
# (128 + SIGINT), so that a script can tell it from a finished run; --resume then finishes with 0.
#   sh CheckInterrupt.sh <kmamba-train> <dir>
train=$1 out=$2
rm -rf "$out"
"$train" --steps 100000 --eval-interval 0 --checkpoint-interval 0 --log-interval 1 --d-model 16 --n-layer 1 \
  --seqlen 24 --batch-size 2 --out "$out" >"$out.log" 2>&1 &
pid=$!
waited=0
until grep -q '"type":"train"' "$out/metrics.jsonl" 2>/dev/null; do
  sleep 1
  waited=$((waited + 1))
  if [ "$waited" -gt 120 ]; then
    kill -9 "$pid"
    echo "CheckInterrupt: no training step within 120 s"; cat "$out.log"; exit 1
  fi
done
kill -INT "$pid"
wait "$pid"
rc=$?
cat "$out.log"
[ "$rc" -eq 130 ] || { echo "CheckInterrupt: exit status $rc after SIGINT, expected 130"; exit 1; }
grep -q "interrupted at step" "$out.log" || { echo "CheckInterrupt: no 'interrupted at step' line"; exit 1; }
[ -f "$out/checkpoint/training_state.safetensors" ] || { echo "CheckInterrupt: no checkpoint saved"; exit 1; }
steps=$(grep -o 'interrupted at step [0-9]*' "$out.log" | grep -o '[0-9]*$')
"$train" --resume --out "$out" --steps $((steps + 2)) || { echo "CheckInterrupt: --resume failed"; exit 1; }
