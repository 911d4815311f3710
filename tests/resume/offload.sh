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
clean() {
  if [ -n "$(ls -A "$dir/files")" ]; then
    echo "offload.sh: $dir/files is not empty:" >&2
    ls -la "$dir/files" >&2
    exit 1
  fi
}
run --losses "$dir/losses.ram" > "$dir/ram.log"
# As a user runs it: writes not begun when a backward begins are called off (how many were written
# depends on the machine's load), the losses are the same bits whatever.
run --losses "$dir/losses.offload" --offload "$dir/files" --offload-min 1 > "$dir/offload.log"
cmp "$dir/losses.ram" "$dir/losses.offload"
clean
# Every offloaded tensor through its file (each backward waits for the queued writes): some were
# written, none failed, and they were read back.
run --losses "$dir/losses.wait" --offload "$dir/files" --offload-min 1 --offload-wait 1 > "$dir/wait.log"
cmp "$dir/losses.ram" "$dir/losses.wait"
if ! grep -E "^offload to .*: [1-9][0-9]* tensors written .* 0 failed, 0 over kept files\), [1-9][0-9]* read back" \
  "$dir/wait.log"; then
  echo "offload.sh: the store wrote or read back nothing, or a write failed:" >&2
  cat "$dir/wait.log" >&2
  exit 1
fi
clean
# The files a step let go overwritten by the next steps' writes (the store keeps them while the run
# lasts): every step after the first writes over kept files, the losses are the same bits, and the
# directory is empty once the process has ended.
run --losses "$dir/losses.reuse" --offload "$dir/files" --offload-min 1 --offload-wait 1 --offload-reuse 1 \
  > "$dir/reuse.log"
cmp "$dir/losses.ram" "$dir/losses.reuse"
if ! grep -E "^offload to .*: [1-9][0-9]* tensors written .* 0 failed, [1-9][0-9]* over kept files\)" \
  "$dir/reuse.log"; then
  echo "offload.sh: with --offload-reuse 1 no write went over a kept file:" >&2
  cat "$dir/reuse.log" >&2
  exit 1
fi
clean
echo "offload.sh: losses bitwise equal, files written and read back (and over kept files), directory clean"
