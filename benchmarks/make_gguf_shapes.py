"""Random-weight GGUF files in the Gemma 3 text shapes (270M, 1B, 4B, 12B) with the default
model's tokenizer (vocabulary 262,144), for speed and memory at real sizes: written as F16 with
the `gguf` package, tensor by tensor, then quantized with llama.cpp's own `llama-quantize`
(built from the llama.cpp source that llama-cpp-python's sdist vendors; docs/performance.md).
Random weights make nonsense text, which is fine for tokens/s and bytes.

    python benchmarks/make_gguf_shapes.py gemma3-1b /data/gemma3-1b-q4_k_m.gguf \\
        --llama-quantize /work/peers/llama-build/bin/llama-quantize [--type Q4_K_M]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time

import numpy as np

# hidden, feed-forward, layers, query heads, kv heads, head dim, sliding window (the published configs)
SHAPES = {
    "gemma3-270m": (640, 2048, 18, 4, 1, 256, 512),
    "gemma3-1b": (1152, 6912, 26, 4, 1, 256, 512),
    "gemma3-4b": (2560, 10240, 34, 8, 4, 256, 1024),
    "gemma3-12b": (3840, 15360, 48, 16, 8, 256, 1024),
}


def _tensors(shape: tuple[int, ...], vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """(GGUF name, numpy shape [out, in]) of every tensor, in llama.cpp's order."""
    hidden, ffn, layers, heads, kv, hd, _ = shape
    out = [("token_embd.weight", (vocab, hidden)), ("output_norm.weight", (hidden,))]
    for i in range(layers):
        b = f"blk.{i}."
        out += [(b + "attn_q.weight", (heads * hd, hidden)), (b + "attn_k.weight", (kv * hd, hidden)),
                (b + "attn_v.weight", (kv * hd, hidden)), (b + "attn_output.weight", (hidden, heads * hd)),
                (b + "attn_q_norm.weight", (hd,)), (b + "attn_k_norm.weight", (hd,)),
                (b + "attn_norm.weight", (hidden,)), (b + "post_attention_norm.weight", (hidden,)),
                (b + "ffn_gate.weight", (ffn, hidden)), (b + "ffn_up.weight", (ffn, hidden)),
                (b + "ffn_down.weight", (hidden, ffn)), (b + "ffn_norm.weight", (hidden,)),
                (b + "post_ffw_norm.weight", (hidden,))]
    return out


def write_f16(shape_name: str, path: str, seed: int = 0) -> None:
    """The F16 file, one tensor in memory at a time: matrices N(0, 0.02) (slices of one random
    pool, so a 12B file is written in minutes), norms 1 (Gemma stores 1 + w)."""
    import gguf

    from pagedllm.transformers_utils.default_model import resolve_default_model
    from pagedllm.transformers_utils.gguf_reader import open_gguf_reader

    shape = SHAPES[shape_name]
    src = open_gguf_reader(resolve_default_model())
    vocab = len(src.fields["tokenizer.ggml.tokens"].data)
    writer = gguf.GGUFWriter(path, "gemma3")
    hidden, ffn, layers, heads, kv, hd, window = shape
    values = {"embedding_length": hidden, "block_count": layers, "feed_forward_length": ffn,
              "attention.head_count": heads, "attention.head_count_kv": kv, "attention.key_length": hd,
              "attention.value_length": hd, "attention.sliding_window": window}
    for key, field in src.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        name = key.removeprefix("gemma3.")
        value = values.get(name, field.contents())
        if key == "general.name":
            value = f"random {shape_name}"
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, value, field.types[0], sub_type=sub)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    tensors = _tensors(shape, vocab)
    for name, dims in tensors:
        dtype = np.float16 if len(dims) == 2 else np.float32
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(1 << 26, dtype=np.float32) * 0.02).astype(np.float16)
    for _name, dims in tensors:
        count = int(np.prod(dims))
        if len(dims) == 1:
            writer.write_tensor_data(np.ones(dims, np.float32))
            continue
        start = int(rng.integers(0, pool.size))
        idx = (start + np.arange(count, dtype=np.int64) * 7919) % pool.size  # a stride through the pool
        writer.write_tensor_data(pool[idx].reshape(dims))
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("output", help="the quantized .gguf to write")
    parser.add_argument("--llama-quantize", required=True, help="path to llama.cpp's llama-quantize")
    parser.add_argument("--type", default="Q4_K_M", help="llama-quantize's type (default Q4_K_M)")
    parser.add_argument("--keep-f16", action="store_true", help="keep the F16 file next to the output")
    args = parser.parse_args()
    f16 = args.output.removesuffix(".gguf") + "-f16.gguf"
    start = time.perf_counter()
    write_f16(args.shape, f16)
    print(f"F16 written in {time.perf_counter() - start:.0f} s: {os.path.getsize(f16) / 1e9:.2f} GB")
    start = time.perf_counter()
    subprocess.run([args.llama_quantize, f16, args.output, args.type, str(os.cpu_count())], check=True)
    print(f"{args.type} in {time.perf_counter() - start:.0f} s: {os.path.getsize(args.output) / 1e9:.2f} GB")
    if not args.keep_f16:
        os.remove(f16)


if __name__ == "__main__":
    main()
