#!/bin/sh
# kmamba-generate --output goes through kmamba's output files (kmamba/core/Files.hpp):
#  - a regular file is replaced only when the run ends: killed while generating, the old file
#    stays whole (it was truncated at the start);
#  - a symbolic link is followed, and stays a link;
#  - a device that refuses the bytes (/dev/full) is an error naming the file and the reason.
#   sh CheckGenerateOutput.sh <kmamba-generate> <golden dir> <dir>
generate=$1 golden=$2 out=$3
rm -rf "$out"
mkdir -p "$out"
fail() { echo "CheckGenerateOutput: $*"; exit 1; }
set -- --model "$golden/tiny_mamba2" --prompt-ids 1,5,9 --greedy --ids --no-echo --quiet

echo "the previous output" >"$out/kept.jsonl"
"$generate" "$@" --max-new-tokens 100000000 --output "$out/kept.jsonl" >"$out/stream" 2>&1 &
pid=$!
waited=0
until [ -s "$out/stream" ]; do  # the first tokens are out: the output file is open
  sleep 1
  waited=$((waited + 1))
  [ "$waited" -le 60 ] || { kill -9 "$pid"; fail "no token within 60 s"; }
done
kill -9 "$pid"
wait "$pid"
[ "$(cat "$out/kept.jsonl")" = "the previous output" ] || fail "killed while generating, --output lost the old file"

echo "old" >"$out/target.jsonl"
ln -s target.jsonl "$out/link.jsonl"
"$generate" "$@" --max-new-tokens 3 --output "$out/link.jsonl" >/dev/null || fail "--output through a link failed"
[ -L "$out/link.jsonl" ] || fail "--output replaced the symbolic link"
grep -q '"completion"' "$out/target.jsonl" || fail "--output did not write the link's target"

"$generate" "$@" --max-new-tokens 3 --output /dev/full >/dev/null 2>"$out/full.log"
rc=$?
cat "$out/full.log"
[ "$rc" -eq 2 ] || fail "--output /dev/full: exit status $rc, expected 2"
grep -q "writing '/dev/full' failed: No space left on device" "$out/full.log" ||
  fail "--output /dev/full: no reason given"
echo "CheckGenerateOutput: the old file kept, the link followed, /dev/full refused"
