#!/bin/bash
# The issue's workloads for each mode, alternating, with start-up time and peak RSS:
#   W1 = pagedllm bench throughput --num-prompts 64 --input-len 32 --output-len 128
#   W2 = pagedllm bench latency --input-len 32 --output-len 128 --batch-size 1
# Usage: benchmarks/bench_targets.sh [rounds] [modes...]   (modes: default bf16 int8 int4; default all)
# "default" passes no --quantization (the GGUF default model then runs int4); bf16 is --quantization none.
# Runs vary ~10% from process to process on a shared machine: compare rounds, not single runs.
set -u
rounds=${1:-3}
shift || true
if [ $# -gt 0 ]; then modes=("$@"); else modes=(default bf16 int8 int4); fi
run() {  # label, then the pagedllm arguments
  local label=$1
  shift
  local out
  out=$( { /usr/bin/time -f "peak RSS %M kB" pagedllm "$@"; } 2>&1 )
  echo "$label | $(echo "$out" | grep -Eo '[0-9.]+ output tokens/s|TPOT: [0-9.]+ ms/token' | head -1)" \
       "| $(echo "$out" | grep -Eo 'startup time: [0-9.]+ s') | $(echo "$out" | grep -Eo 'peak RSS [0-9]+ kB')"
}
for round in $(seq "$rounds"); do
  for mode in "${modes[@]}"; do
    case $mode in
      default) q=() ;;
      bf16) q=(--quantization none) ;;
      *) q=(--quantization "$mode") ;;
    esac
    run "round $round W1 $mode" bench throughput --num-prompts 64 --input-len 32 --output-len 128 "${q[@]}"
    run "round $round W2 $mode" bench latency --input-len 32 --output-len 128 --batch-size 1 "${q[@]}"
  done
done
