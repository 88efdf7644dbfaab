"""Token embedding and the LM head, both split over the tensor-parallel ranks by vocabulary.

The vocabulary is padded to a multiple of the number of ranks; rank r holds the rows
[r * V' / tp, (r + 1) * V' / tp) of the padded table (padding rows zero). The embedding looks up
the ids in its range, zeros the others and sums over the ranks; the LM head computes its slice
of the logits (only for the rows to sample), gathers the slices and drops the padding, so every
rank has the whole, identical logits. At one rank both are the plain layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import get_tp_group
from pagedllm.model_executor.layers.cpu_gemm import packed_linear
from pagedllm.model_executor.layers.gguf_linear import GGUFLinear
from pagedllm.model_executor.layers.linear import native_gguf
from pagedllm.model_executor.layers.quantization import QuantizedLMHead
from pagedllm.transformers_utils.checkpoint_tensor import CheckpointTensor


class _VocabShard:
    """This rank's rows of a vocabulary of `vocab_size`, and their loader."""

    def _init_shard(self, vocab_size: int) -> None:
        # Set before loading where only rows are read from the table (lookups, a ranked head's
        # re-scoring): it then stays in the file's narrower dtype (mapped where the file allows),
        # each looked-up row converted to `dtype` (exact: the checkpoint's values), instead of a
        # copy in the model's wider dtype.
        self.keep_file_dtype = False
        self.tp = get_tp_group()
        self.tp_rank, self.tp_size = self.tp.rank_in_group, self.tp.world_size
        self.org_vocab_size = vocab_size
        self.padded_vocab_size = -(-vocab_size // self.tp_size) * self.tp_size
        self.num_rows = self.padded_vocab_size // self.tp_size
        self.vocab_start = self.tp_rank * self.num_rows
        self.vocab_end = min(self.vocab_start + self.num_rows, vocab_size)

    def _load_vocab_rows(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        expected = (self.org_vocab_size, param.shape[1])
        if tuple(loaded.shape) != expected:
            raise ValueError(f"shape mismatch: vocabulary table {expected} vs checkpoint {tuple(loaded.shape)}")
        valid = max(0, self.vocab_end - self.vocab_start)
        if native_gguf(loaded):  # the file's blocks, looked up / multiplied as they are
            self.gguf = GGUFLinear(param.shape[1], param.shape[0], param.dtype)
            if valid:
                self.gguf.add(0, loaded.rows(self.vocab_start, valid))
            return
        if (self.keep_file_dtype and loaded.dtype.is_floating_point and loaded.dtype != param.dtype
                and loaded.dtype.itemsize < param.dtype.itemsize):
            param.data = torch.empty(param.shape, dtype=loaded.dtype, device=param.device)
        if (isinstance(loaded, CheckpointTensor) and loaded.mappable and valid == param.shape[0]
                and loaded.dtype == param.dtype and param.device.type == "cpu" and param.numel() > 0):
            # Mapped, not read, where the file allows it: a lookup touches a few rows a step (the
            # float32 embedding of a 262k vocabulary is 671 MB, read in ~0.4 s), and processes
            # mapping it share it.
            mapped = loaded.rows(self.vocab_start, valid).mapped()
            if mapped is not None:
                param.data = mapped
                return
        if isinstance(loaded, CheckpointTensor):
            loaded.copy_to(param.data[:valid], 0, self.vocab_start)
        else:
            param.data[:valid].copy_(loaded[self.vocab_start : self.vocab_start + valid])
        param.data[valid:].zero_()


class VocabParallelEmbedding(nn.Module, _VocabShard):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self._init_shard(vocab_size)
        self.gguf: GGUFLinear | None = None  # the file's own blocks (--quantization gguf); replaces the weight
        self.weight = nn.Parameter(torch.empty(self.num_rows, hidden_size))
        self.weight.weight_loader = self._load_vocab_rows
        self.dtype = self.weight.dtype  # the rows' dtype, whatever the table is kept in

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of this rank's table."""
        if self.gguf is not None:
            return self.gguf.lookup(ids)
        rows = F.embedding(ids, self.weight)
        return rows if rows.dtype == self.dtype else rows.to(self.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.lookup(input_ids)
        mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(mine, input_ids - self.vocab_start, 0)
        out = self.lookup(local).masked_fill_(~mine.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module, _VocabShard):
    """Owns its weight (this rank's vocabulary rows) unless tied, in which case it reads the
    embedding's, which is split the same way."""

    def __init__(self, vocab_size: int, hidden_size: int, tied_to: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self._init_shard(vocab_size)
        self.tied_to = tied_to
        self.quant: QuantizedLMHead | None = None  # set by loader/quantize.py
        self.packed: torch.Tensor | None = None  # set by loader/cpu_pack.py
        self.gguf: GGUFLinear | None = None  # the file's own blocks (--quantization gguf), or the tied embedding's
        if tied_to is None:
            self.weight = nn.Parameter(torch.empty(self.num_rows, hidden_size))
            self.weight.weight_loader = self._load_vocab_rows

    def forward(self, hidden: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
        weight = None if self.gguf is not None else self.tied_to.weight if self.tied_to is not None else self.weight
        # Left in the model dtype: greedy argmax needs no float32 copy of [B, vocab]
        # (bf16 → fp32 is exact, so the sampler converts only when it must).
        if self.gguf is not None:
            logits = self.gguf(hidden)
        elif self.quant is not None:
            logits = self.quant(hidden, weight)
        elif self.packed is not None:
            logits = packed_linear(hidden, self.packed, None)
        else:
            logits = F.linear(hidden, weight)
        if softcap:
            logits = torch.tanh(logits.float() / softcap) * softcap
        if self.tp_size == 1:
            return logits
        logits = self.tp.all_gather(logits, dim=-1)
        if self.padded_vocab_size != self.org_vocab_size:
            logits = logits[..., : self.org_vocab_size].contiguous()
        return logits


class LearnedPositionEmbedding(nn.Module):
    """Absolute positions looked up in a trained table (GPT-2's wpe, OPT's embed_positions),
    whole on every rank: it is small. The table keeps `offset` rows before position 0 (OPT: 2)."""

    def __init__(self, num_positions: int, hidden_size: int, offset: int = 0) -> None:
        super().__init__()
        self.offset = offset
        self.weight = nn.Parameter(torch.empty(num_positions + offset, hidden_size))

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions + self.offset if self.offset else positions, self.weight)


# The names the layers had before tensor parallelism.
VocabEmbedding = VocabParallelEmbedding
LMHead = ParallelLMHead
