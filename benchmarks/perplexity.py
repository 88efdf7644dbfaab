"""Perplexity of a GGUF under pagedllm, scored the way `llama-perplexity -c N` scores it, and
beside it llama-perplexity's own figure on the same file and text when its binary is given.

The text is Python's own `pydoc_data.topics` (every topic, in key order, joined by blank lines):
it ships with every Python, so both sides read the same bytes. As llama-perplexity does, the
text is tokenized once (with BOS), cut into chunks of N tokens, each chunk's first token replaced
by BOS, and the second half of each chunk scored (positions N/2 + 1 .. N - 1, each predicted
from everything before it in its chunk).

    python benchmarks/perplexity.py MODEL.gguf [--ctx 512] [--chunks 32] \\
        [--llama-perplexity /work/peers/llama-build/bin/llama-perplexity] [--quantization gguf] \\
        [--kv-cache-dtype auto int8 fp8 fp8_e5m2] [--dtype float32]

With several --kv-cache-dtype values, one engine each, one after the other, and each figure
against the first's.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import tempfile


def topics_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def pagedllm_perplexity(model: str, text: str, ctx: int, chunks: int, quantization: str | None,
                        kv_cache_dtype: str = "auto", dtype: str = "auto") -> float:
    from pagedllm import LLM, SamplingParams

    kwargs = {"quantization": quantization} if quantization else {}
    llm = LLM(model, max_model_len=ctx + 1, kv_cache_memory=256 << 20, kv_cache_dtype=kv_cache_dtype, dtype=dtype,
              **kwargs)
    tokenizer = llm.get_tokenizer()
    ids = tokenizer(text).input_ids  # BOS first, as the model's tokenizer adds it
    bos = tokenizer.bos_token_id
    count = min(chunks, len(ids) // ctx)
    prompts = []
    for i in range(count):
        chunk = list(ids[i * ctx : (i + 1) * ctx])
        chunk[0] = bos
        prompts.append({"prompt_token_ids": chunk})
    outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    first = ctx // 2
    nll, n = 0.0, 0
    for prompt, out in zip(prompts, outputs):
        chunk = prompt["prompt_token_ids"]
        for pos in range(first + 1, ctx):
            nll -= out.prompt_logprobs[pos][chunk[pos]].logprob
            n += 1
    return math.exp(nll / n)


def llama_perplexity(binary: str, model: str, text_path: str, ctx: int, chunks: int) -> float:
    out = subprocess.run([binary, "-m", model, "-f", text_path, "-c", str(ctx), "--chunks", str(chunks),
                          "-t", str(os.cpu_count())], capture_output=True, text=True, check=True)
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    if match is None:
        raise RuntimeError("llama-perplexity printed no final estimate:\n" + out.stderr[-2000:])
    return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a .gguf file, or a checkpoint directory (llama-perplexity: .gguf only)")
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--chunks", type=int, default=32)
    parser.add_argument("--quantization", default=None, help="pagedllm's --quantization (default: the file's own)")
    parser.add_argument("--llama-perplexity", default=None, help="llama.cpp's llama-perplexity, to run beside")
    parser.add_argument("--kv-cache-dtype", nargs="+", default=["auto"], help="pagedllm's --kv-cache-dtype, each")
    parser.add_argument("--dtype", default="auto", help="pagedllm's --dtype")
    args = parser.parse_args()
    text = topics_text()
    first = None
    for kv_cache_dtype in args.kv_cache_dtype:
        ppl = pagedllm_perplexity(args.model, text, args.ctx, args.chunks, args.quantization, kv_cache_dtype,
                                  args.dtype)
        first = first or ppl
        print(f"pagedllm (kv_cache_dtype {kv_cache_dtype}): PPL = {ppl:.4f}  ({ppl / first - 1:+.3%})", flush=True)
    ours = first
    if args.llama_perplexity:
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(text)
        try:
            theirs = llama_perplexity(args.llama_perplexity, args.model, f.name, args.ctx, args.chunks)
        finally:
            os.unlink(f.name)
        print(f"llama.cpp: PPL = {theirs:.4f}  (pagedllm {ours / theirs - 1:+.3%})")


if __name__ == "__main__":
    main()
