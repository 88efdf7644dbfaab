"""Without a GPU, the Triton kernels run under Triton's CPU interpreter (tests/conftest.py sets it
where the machine has no NVIDIA device; here too, for a GPU machine whose CUDA is unusable)."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
