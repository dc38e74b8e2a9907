#!/bin/sh
# kmamba-eval on a copy of a golden checkpoint whose first stored float is made NaN: it must fail
# with status 2 and name the non-finite parameter (it wrote NaN outputs and exited 0).
#   sh CheckEvalNonFinite.sh <kmamba-eval> <golden dir> <dir>
eval_app=$1 golden=$2 out=$3
rm -rf "$out"
mkdir -p "$out"
cp -r "$golden/tiny_mamba2" "$out/model"
file="$out/model/model.safetensors"
# The data section starts after the 8-byte little-endian header length and the header.
header=$(od -An -t u8 -N 8 "$file" | tr -d ' ')
printf '\000\000\300\177' | dd of="$file" bs=1 seek=$((8 + header)) conv=notrunc 2>/dev/null
"$eval_app" --model "$out/model" --input "$golden/tiny_mamba2_io.safetensors" --output "$out/out.safetensors" \
  >"$out/log" 2>&1
rc=$?
cat "$out/log"
[ "$rc" -eq 2 ] || { echo "CheckEvalNonFinite: exit status $rc, expected 2"; exit 1; }
grep -q "holds non-finite parameters: .* (1 of " "$out/log" || { echo "CheckEvalNonFinite: no message naming the parameter"; exit 1; }
