#!/bin/bash
# The issue's workloads at each distributed layout, alternating rounds (default model, default mode):
#   W1 = pagedllm bench throughput --num-prompts 64 --input-len 32 --output-len 128
#   W2 = pagedllm bench latency --input-len 32 --output-len 128 --batch-size 1
# Layouts: tp1 (one rank in the engine-core process), tp2 and pp2 (two worker processes, gloo),
# dp2 (two engine cores, each with its rank in a worker process, so their steps overlap).
# Usage: benchmarks/bench_layouts.sh [rounds] [layouts...]   (default: 1 round, all layouts)
set -u
rounds=${1:-1}
shift || true
if [ $# -gt 0 ]; then layouts=("$@"); else layouts=(tp1 tp2 pp2 dp2); fi
run() {  # label, then the pagedllm arguments
  local label=$1
  shift
  local out
  out=$(pagedllm "$@" 2>&1)
  echo "$label | $(echo "$out" | grep -Eo '[0-9.]+ output tokens/s|TPOT: [0-9.]+ ms/token' | head -1)"
}
for round in $(seq "$rounds"); do
  for layout in "${layouts[@]}"; do
    case $layout in
      tp1) a=() ;;
      tp2) a=(--tensor-parallel-size 2) ;;
      pp2) a=(--pipeline-parallel-size 2) ;;
      dp2) a=(--data-parallel-size 2 --distributed-executor-backend mp) ;;
    esac
    run "round $round W1 $layout" bench throughput --num-prompts 64 --input-len 32 --output-len 128 "${a[@]}"
    run "round $round W2 $layout" bench latency --input-len 32 --output-len 128 --batch-size 1 "${a[@]}"
  done
done
