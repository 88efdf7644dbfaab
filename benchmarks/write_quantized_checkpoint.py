"""A real model written as a pre-quantized Hugging Face checkpoint by round-to-nearest, in each
layout pagedllm reads (GPTQ, AWQ, compressed-tensors W4A16 / int8 W8A8 / FP8, FP8 per tensor or
per 128 x 128 block), for speed, memory and perplexity of each format on real weights. The
packing is the tests' own
(tests/transformers_utils/quant_writers.py, which follows each tool's layout); a GGUF source is
dequantized to float32 by transformers first, and takes pagedllm's tokenizer files for it.

    python benchmarks/write_quantized_checkpoint.py MODEL.gguf /tmp/g270-float --method float
    python benchmarks/write_quantized_checkpoint.py /tmp/g270-float /tmp/g270-gptq --method gptq [--group 128]
    python benchmarks/perplexity.py /tmp/g270-gptq
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.transformers_utils.quant_writers import write_8bit, write_quantized  # noqa: E402

# method -> (writer, its arguments)
METHODS = {
    "gptq": (write_quantized, dict(method="gptq", bits=4, sym=True)),
    "awq": (write_quantized, dict(method="awq", bits=4, sym=False)),
    "w4a16": (write_quantized, dict(method="compressed-tensors", bits=4, sym=True)),
    "w8a8": (write_8bit, dict(method="compressed-tensors", fmt="int-quantized", strategy="channel")),
    "ct-fp8": (write_8bit, dict(method="compressed-tensors", fmt="float-quantized", strategy="channel")),
    "fp8": (write_8bit, dict(method="fp8")),
    "fp8-block": (write_8bit, dict(method="fp8", strategy="block", block=(128, 128))),  # DeepSeek-V3 / Qwen3 FP8
}


def float_checkpoint(source: str, into: Path) -> Path:
    """`source` as one float32 model.safetensors with its config and tokenizer."""
    if not source.endswith(".gguf"):
        return Path(source)
    import json

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from pagedllm.transformers_utils.gguf_loader import convert_gguf

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(source), gguf_file=os.path.basename(source),
                                                 dtype=torch.float32)
    # transformers does not save a model it read from a GGUF: its tensors are written here
    tied = model.config.get_text_config().tie_word_embeddings
    state = {k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    save_file(state, str(into / "model.safetensors"), metadata={"format": "pt"})
    tokenizer_dir = Path(convert_gguf(source))  # pagedllm's config and tokenizer for the file
    config = json.loads((tokenizer_dir / "config.json").read_text())
    config.pop("quantization_config", None)
    (into / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, into / name)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a .gguf file, or a directory with one float model.safetensors")
    parser.add_argument("path")
    parser.add_argument("--method", choices=["float", *sorted(METHODS)], default="gptq",
                        help="float: the float32 checkpoint alone (a source for the others, read once)")
    parser.add_argument("--group", type=int, default=128, help="inputs per scale of the 4-bit formats")
    args = parser.parse_args()
    if args.method == "float":
        Path(args.path).mkdir(parents=True, exist_ok=True)
        float_checkpoint(args.source, Path(args.path))
        print(args.path)
        return
    writer, kwargs = METHODS[args.method]
    if writer is write_quantized:
        kwargs = {**kwargs, "group": args.group}
    with tempfile.TemporaryDirectory() as tmp:
        writer(float_checkpoint(args.source, Path(tmp)), Path(args.path), **kwargs)
    print(args.path)


if __name__ == "__main__":
    main()
