"""Make a draft model from the target itself: keep N of its decoder layers.

The copy shares the target's tokenizer, embeddings and LM head, so its vocabulary always
matches; fewer layers make it cheaper. By default the first N layers are kept; with
--keep-last M the last M layers are kept too (first N - M, last M), which keeps the hidden
states in the space the final norm and LM head expect.

    python -m pagedllm.spec_decode.truncated_draft SRC DST --num-layers 6 --keep-last 2
(SRC may be the default model's name or a .gguf file; it is resolved as the engine does.)
"""

from __future__ import annotations

import argparse
import os
import re
import shutil

from safetensors.torch import save_file

from pagedllm.transformers_utils.model_path import resolve_model_path
from pagedllm.transformers_utils.weight_utils import iterate_safetensors

_LAYER = re.compile(r"\.layers\.(\d+)\.")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                    "generation_config.json", "chat_template.jinja")


def make_truncated_draft(src: str | None, dst: str, num_layers: int, keep_last: int = 0) -> str:
    from transformers import AutoConfig

    src = resolve_model_path(src)
    config = AutoConfig.from_pretrained(src)
    text = config.get_text_config()
    total = text.num_hidden_layers
    if not 1 <= num_layers < total or not 0 <= keep_last <= num_layers:
        raise ValueError(f"need 1 <= num_layers < {total} and 0 <= keep_last <= num_layers")
    kept = list(range(num_layers - keep_last)) + list(range(total - keep_last, total))
    new_index = {old: new for new, old in enumerate(kept)}
    text.num_hidden_layers = num_layers
    if getattr(text, "layer_types", None):
        text.layer_types = [text.layer_types[i] for i in kept]
    tensors = {}
    for name, tensor in iterate_safetensors(src):
        m = _LAYER.search(name)
        if m is not None:
            if int(m.group(1)) not in new_index:
                continue
            name = name[: m.start()] + f".layers.{new_index[int(m.group(1))]}." + name[m.end() :]
        tensors[name] = tensor.contiguous().clone()
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    config.save_pretrained(dst)
    for name in _TOKENIZER_FILES:
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(dst, name))
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="target model (path, .gguf, or the default model's name)")
    parser.add_argument("dst", help="directory to write the draft model to")
    parser.add_argument("--num-layers", type=int, required=True)
    parser.add_argument("--keep-last", type=int, default=0)
    args = parser.parse_args()
    print(make_truncated_draft(args.src, args.dst, args.num_layers, args.keep_last))


if __name__ == "__main__":
    main()
