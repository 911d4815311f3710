#!/usr/bin/env bash
# A training run killed with SIGKILL between two saves and resumed from its last saved state ends
# bitwise where the uninterrupted run ends: the same weights file and the same loss at every step.
# Checkpointing and dropout are on.  Usage: kill_and_resume.sh TRAIN_GPT WORKDIR
set -euo pipefail
bin=$1
dir=$2
rm -rf "$dir"
mkdir -p "$dir"
common=(--steps 60 --layers 2 --width 64 --batch 8 --log-every 20 --sample 0 --legible-floor 0 --dropout 0.1
        --policy blocks --save-every 20)

"$bin" "${common[@]}" --out "$dir/a.safetensors" --losses "$dir/a.losses" > "$dir/a.log"

set +e
"$bin" "${common[@]}" --out "$dir/b.safetensors" --die-after 50 > "$dir/b1.log" 2>&1
rc=$?
set -e
if [ "$rc" -ne 137 ]; then echo "the run to be killed exited with $rc, not by SIGKILL (137)"; exit 1; fi
if [ -e "$dir/b.safetensors" ]; then echo "the killed run wrote its final weights"; exit 1; fi

"$bin" "${common[@]}" --out "$dir/b.safetensors" --resume "$dir/b.state.safetensors" --losses "$dir/b.losses" > "$dir/b2.log"
grep -q "resumed from .* at step 40" "$dir/b2.log" || { echo "did not resume at step 40"; cat "$dir/b2.log"; exit 1; }
cmp "$dir/a.safetensors" "$dir/b.safetensors"
cmp "$dir/a.losses" "$dir/b.losses"
cmp "$dir/a.loss.csv" "$dir/b.loss.csv"
echo "killed at step 50, resumed from step 40: weights and all $(wc -l < "$dir/a.losses") losses bitwise equal"
