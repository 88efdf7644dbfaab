"""Reading a drafter's weight file (Medusa heads, an EAGLE head): the first of the layout's
file names found, as safetensors or a torch pickle read with `weights_only`."""

from __future__ import annotations

import os

import torch


def load_head_tensors(path: str, files: tuple[str, ...], what: str) -> dict[str, torch.Tensor]:
    """The tensors of the first of `files` under `path`; `what` names the drafter in errors."""
    for name in files:
        file = os.path.join(path, name)
        if os.path.exists(file):
            break
    else:
        raise ValueError(f"{what} at {path!r}: none of {', '.join(files)} found")
    try:
        if file.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(file)
        return torch.load(file, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged or foreign file: say which, not the reader's internals
        raise ValueError(f"{what}: {file!r} cannot be read ({type(e).__name__}: {e})") from None
