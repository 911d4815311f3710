#!/usr/bin/env bash
# train_gpt --memory: the run fits the cap (every step's peak of tensor memory at or under it),
# trains with the micro-batch the fit chose, and the fit leaves the training stream alone: the
# same run given that micro-batch by hand (and no checkpointing, which changes no bits) has the
# same loss at every step, dropout on.  Usage: fit_memory.sh TRAIN_GPT WORKDIR
set -euo pipefail
bin=$1
dir=$2
rm -rf "$dir"
mkdir -p "$dir"
common=(--steps 6 --layers 2 --width 64 --batch 8 --log-every 1 --sample 0 --legible-floor 0 --dropout 0.1)

"$bin" "${common[@]}" --memory 3MB --out "$dir/fit.safetensors" --losses "$dir/fit.losses" > "$dir/fit.log"
cat "$dir/fit.log"
micro=$(sed -n 's/^choice: .*micro-batch \([0-9]*\) x.*/\1/p' "$dir/fit.log")
if [ -z "$micro" ]; then echo "no choice printed"; exit 1; fi
# Every step's peak (MiB, as printed) within the cap of 3 MiB.
if awk '/^step/ { for (i = 1; i < NF; i++) if ($i == "peak") { v = $(i + 1); u = $(i + 2);
       if (u == "KiB") v /= 1024; if (u == "B") v /= 1048576; if (v > 3.0) bad = 1 } } END { exit !bad }' "$dir/fit.log"; then
  echo "a step's peak is above the 3 MiB cap"; exit 1
fi
"$bin" "${common[@]}" --micro-batch "$micro" --out "$dir/hand.safetensors" --losses "$dir/hand.losses" > "$dir/hand.log"
cmp "$dir/fit.losses" "$dir/hand.losses"
echo "fit_memory: micro-batch $micro, the same losses as --micro-batch $micro by hand"
