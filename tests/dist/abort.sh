#!/usr/bin/env bash
# usage: abort.sh MPIEXEC [MPIEXEC FLAGS...] -- PROGRAM
# Runs PROGRAM on 2 ranks; rank 1 throws. Passes when the job ends non-zero within 30 s with the
# failing rank and its message on stderr.
set -uo pipefail
launcher=()
while [[ $1 != -- ]]; do launcher+=("$1"); shift; done
shift
program=$1
err=$(mktemp)
start=$(date +%s)
timeout 60 "${launcher[@]}" "$program" 2>"$err" >/dev/null
status=$?
elapsed=$(( $(date +%s) - start ))
cat "$err" >&2
fail() { echo "abort.sh: $*" >&2; rm -f "$err"; exit 1; }
grep -q "remat::dist: rank 1 failed, ending every rank: a failure on purpose in rank 1" "$err" ||
  fail "stderr does not name rank 1 and its message"
rm -f "$err"
(( status != 0 )) || fail "the job exited 0"
(( status != 124 )) || fail "the job hung (killed by timeout after 60 s)"
(( elapsed <= 30 )) || fail "the job took $elapsed s to end"
echo "abort.sh: the job ended with status $status after $elapsed s"
