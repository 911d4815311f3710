#!/usr/bin/env bash
# train_gpt --offload: the same short run with its saved activations in RAM and offloaded to files
# gives bitwise the same losses, says what the store did, and leaves the directory empty.
#   offload.sh TRAIN_GPT WORKDIR
set -euo pipefail
train_gpt=$1
dir=$2
rm -rf "$dir"
mkdir -p "$dir/files"
run() {
  "$train_gpt" --policy blocks --dropout 0.1 --steps 4 --layers 2 --width 32 --heads 2 --context 16 --batch 4 \
    --log-every 2 --sample 0 --out "$dir/w.safetensors" "$@"
}
run --losses "$dir/losses.ram" > "$dir/ram.log"
run --losses "$dir/losses.offload" --offload "$dir/files" --offload-min 1 > "$dir/offload.log"
cmp "$dir/losses.ram" "$dir/losses.offload"
grep -E "^offload to .*: [1-9][0-9]* tensors written .* 0 failed\), [1-9][0-9]* read back" "$dir/offload.log"
if [ -n "$(ls -A "$dir/files")" ]; then
  echo "offload.sh: $dir/files is not empty:" >&2
  ls -la "$dir/files" >&2
  exit 1
fi
echo "offload.sh: losses bitwise equal, directory clean"
