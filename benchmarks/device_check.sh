#!/usr/bin/env bash
# The GPU path's device check, in one run on a single-GPU machine without network (docs/gpu.md):
#   setup       installs what the image lacks from wheels carried in .whl/ (and .whl/test/);
#   attention   the attention kernel's bandwidth against the device's copy bandwidth;
#   tests       tests/cuda/ and the Triton kernel tests, natively;
#   latency     batch-1 TPOT (`bench latency`) on a random-weight Llama-3.1-8B-shaped bf16 model;
#   throughput  `bench throughput` on it: 1,000 prompts, 512 in / 128 out;
#   profile     a decode step taken apart: graph replay, eager forward, LM head (profile_cuda_step.py);
#   async       latency and throughput again with --async-scheduling;
#   kvcache     --kv-cache-dtype: the attention kernel over each byte cache, and a decode batch of 64
#               sequences of 2,048 prompt tokens on the 8B shape with a bf16 against an fp8 cache;
#   suites      with the time left, suites that run on the default device (CUDA there; SUITES names them).
# PHASES (default: all but async, in that order) picks phases; results land in $OUT (default
# /tmp/device_check): logs, JSON and summary.txt.
# Usage: [PHASES="tests latency"] bash benchmarks/device_check.sh [seconds for the run, default 420]
set -uo pipefail
BUDGET=${1:-420}
PHASES=${PHASES:-attention tests latency throughput profile suites}
OUT=${OUT:-/tmp/device_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
left() { echo $((BUDGET - SECONDS)); }
cap() { local want=$1; local l; l=$(left); echo $(( l - 10 < want ? (l > 20 ? l - 10 : 10) : want )); }
MODEL=/tmp/llama-3.1-8b-shape
COMMON=(--model "$MODEL" --load-format dummy --dtype bfloat16 --max-model-len 2048)
PAGEDLLM=($PY -m pagedllm.entrypoints.cli.main)

setup() {
    if compgen -G ".whl/*.whl" > /dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl $(compgen -G ".whl/test/*.whl") > "$OUT/pip.log" 2>&1 || note "wheel install failed (pip.log)"
        export PYTHONPATH=/tmp/site
    fi
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TVM_FFI_DISABLE_TORCH_C_DLPACK=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$SUMMARY"
    $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$SUMMARY"
    $PY benchmarks/make_shape_model.py llama-3.1-8b "$MODEL" > /dev/null
}

attention() {
    timeout "$(cap 60)" $PY benchmarks/attention_bandwidth.py --output-json "$OUT/attention.json" 2>&1 | tee -a "$SUMMARY"
}

tests() {
    timeout "$(cap 170)" $PY -m pytest -q -p no:cacheprovider -o addopts="" --timeout 120 -rfE -n 4 --dist load \
        tests/model_executor/layers/triton_ops tests/cuda > "$OUT/tests.log" 2>&1
    note "tests rc=$? ($(tail -1 "$OUT/tests.log"))"
    grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | tee -a "$SUMMARY"
}

latency() {  # $1: a name for the outputs, then extra engine flags
    local name=${1:-latency}
    shift || true
    timeout "$(cap 100)" "${PAGEDLLM[@]}" bench latency "${COMMON[@]}" --max-num-seqs 1 --batch-size 1 \
        --input-len 128 --output-len 128 --num-iters-warmup 1 --num-iters 3 --output-json "$OUT/$name.json" "$@" \
        > "$OUT/$name.log" 2>&1
    note "$name rc=$? $(grep -E 'TPOT|Avg latency' "$OUT/$name.log" | tr '\n' ' ')"
}

throughput() {  # $1: a name for the outputs, then extra engine flags
    local name=${1:-throughput}
    shift || true
    timeout "$(cap 150)" "${PAGEDLLM[@]}" bench throughput "${COMMON[@]}" --num-prompts 1000 --input-len 512 \
        --output-len 128 --output-json "$OUT/$name.json" "$@" 2>&1 | tr '\r' '\n' | grep -v "Processed prompts" \
        > "$OUT/$name.log"
    note "$name rc=${PIPESTATUS[0]} $(grep -E 'Throughput|startup' "$OUT/$name.log" | tr '\n' ' ')"
    grep -E "CUDA graphs|GPU memory|KV cache" "$OUT/$name.log" | tee -a "$SUMMARY"
}

profile() {
    timeout "$(cap 90)" $PY benchmarks/profile_cuda_step.py "$MODEL" --load-format dummy \
        --output-json "$OUT/profile.json" 2>&1 | grep -v INFO | tee -a "$SUMMARY"
}

async() {
    latency latency_async --async-scheduling
    throughput throughput_async --async-scheduling
}

kvcache() {
    timeout "$(cap 90)" $PY benchmarks/attention_bandwidth.py --kv-cache-dtype auto int8 fp8 fp8_e5m2 \
        --cases 1x4096,16x4096,64x4096,256x1024 --output-json "$OUT/attention_kv.json" 2>&1 | tee -a "$SUMMARY"
    local kv
    for kv in ${KV_DTYPES:-auto fp8}; do
        timeout "$(cap 150)" "${PAGEDLLM[@]}" bench latency --model "$MODEL" --load-format dummy --dtype bfloat16 \
            --max-model-len 4096 --max-num-seqs 64 --max-num-batched-tokens 131072 --batch-size 64 \
            --input-len 2048 --output-len 128 \
            --num-iters-warmup 1 --num-iters 2 --kv-cache-dtype $kv --output-json "$OUT/latency_64x2048_$kv.json" \
            > "$OUT/latency_64x2048_$kv.log" 2>&1
        note "64 x 2048 kv $kv rc=$? $(grep -E 'TTFT|TPOT|Avg latency' "$OUT/latency_64x2048_$kv.log" | tr '\n' ' ')"
        grep -E "KV cache|blocks" "$OUT/latency_64x2048_$kv.log" | tee -a "$SUMMARY"
    done
}

suites() {
    [ "$(left)" -gt 40 ] || { note "no time left for the suites"; return; }
    local default="tests/model_executor/models/test_models.py tests/model_executor/layers/test_sampler.py
        tests/structured_output/test_structured_output.py tests/spec_decode/test_spec_decode.py
        tests/lora/test_lora_peft.py tests/pooling/test_pooling.py::test_tiny_bert_equals_transformers"
    # shellcheck disable=SC2086
    timeout "$(cap 400)" $PY -m pytest -q -p no:cacheprovider -o addopts="" --timeout 60 -rfE ${SUITES:-$default} \
        > "$OUT/suites.log" 2>&1
    note "suites rc=$? ($(tail -1 "$OUT/suites.log"))"
    grep -E "^(FAILED|ERROR)" "$OUT/suites.log" | tee -a "$SUMMARY"
}

setup
for phase in $PHASES; do
    note "== $phase, at ${SECONDS} s"
    "$phase"
done
note "done in ${SECONDS} s"
