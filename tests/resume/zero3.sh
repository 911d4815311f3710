#!/usr/bin/env bash
# ZeRO-3 under mpirun trains bitwise as ZeRO-1 does (both are one process accumulating the ranks'
# micro-batches in rank order): the same loss at every step and the same weights file, with
# checkpointing and dropout on. A ZeRO-3 run saving every 20 steps, killed after step 50 and
# resumed from step 40 ends where the uninterrupted run ends.  Usage: zero3.sh MPIEXEC NP TRAIN_GPT WORKDIR
set -euo pipefail
mpiexec=$1
np=$2
bin=$3
dir=$4
rm -rf "$dir"
mkdir -p "$dir"
common=(--steps 60 --layers 2 --width 64 --batch 6 --log-every 20 --sample 0 --legible-floor 0 --dropout 0.1
        --policy blocks)
run() { "$mpiexec" --oversubscribe -n "$np" "$bin" "${common[@]}" "$@"; }

run --zero 1 --out "$dir/zero1.safetensors" --losses "$dir/zero1.losses" > "$dir/zero1.log"
run --zero 3 --out "$dir/zero3.safetensors" --losses "$dir/zero3.losses" > "$dir/zero3.log"
grep -q "(ZeRO-3)" "$dir/zero3.log" || { echo "the run did not say it was ZeRO-3"; cat "$dir/zero3.log"; exit 1; }
cmp "$dir/zero1.losses" "$dir/zero3.losses"
cmp "$dir/zero1.safetensors" "$dir/zero3.safetensors"

# A run killed after step 50 (every rank: SIGKILL) leaves the state it saved after step 40.
set +e
run --zero 3 --save-every 20 --die-after 50 --out "$dir/part.safetensors" > "$dir/part.log" 2>&1
set -e
if [ -e "$dir/part.safetensors" ]; then echo "the killed run wrote its final weights"; exit 1; fi
run --zero 3 --resume "$dir/part.state.safetensors" --out "$dir/resumed.safetensors" --losses "$dir/resumed.losses" \
  > "$dir/resumed.log"
grep -q "resumed from .* at step 40" "$dir/resumed.log" || { echo "did not resume at step 40"; cat "$dir/resumed.log"; exit 1; }
cmp "$dir/zero3.safetensors" "$dir/resumed.safetensors"
cmp "$dir/zero3.losses" "$dir/resumed.losses"
echo "ZeRO-3 on $np ranks: all $(wc -l < "$dir/zero3.losses") losses and the weights bitwise ZeRO-1's; resumed from step 40 bitwise"
