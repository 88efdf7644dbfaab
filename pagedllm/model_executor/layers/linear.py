"""Linear layers whose parameters load their own checkpoint shards, split over the tensor-parallel
ranks (`get_tp_group()`; one rank unless the worker set up a group).

- `Linear`: the whole weight on every rank.
- `ColumnParallelLinear`: each rank holds a slice of the outputs.
- `MergedColumnParallelLinear`: several checkpoint matrices with the same input (gate/up),
  stacked along the outputs into one GEMM; each rank holds its slice of every one.
- `QKVParallelLinear`: q/k/v stacked, heads split over the ranks; with more ranks than kv heads
  each kv head is replicated on `tp / num_kv_heads` ranks.
- `RowParallelLinear`: each rank holds a slice of the inputs (the output of a column-parallel
  layer) and the partial products are summed over the ranks; the bias is added once, after.

Every `weight_loader` takes the full checkpoint tensor and copies the rank's slice of it, so
the post-load transforms (loader/quantize.py, loader/cpu_pack.py) see only the rank's shard.
Checkpoints laid out otherwise get wrapping loaders that hand the usual ones [out, in] tensors:
`transposed_loader` (GPT-2's Conv1D, [in, out]) and `fused_qkv_loader` (one q/k/v tensor,
stacked or interleaved per head).
At one rank these are the plain layers (`MergedLinear`, `QKVLinear` are the old names).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed import get_tp_group
from pagedllm.forward_context import get_lora_mask
from pagedllm.model_executor.layers.cpu_gemm import packed_linear
from pagedllm.model_executor.layers.gguf_linear import GGUFLinear
from pagedllm.model_executor.layers.lora import LinearLoRA
from pagedllm.model_executor.layers.quantization import WeightOnlyQuant
from pagedllm.transformers_utils.checkpoint_tensor import CheckpointTensor


def native_gguf(loaded: torch.Tensor | CheckpointTensor) -> bool:
    """Whether a checkpoint tensor is a GGUF file's blocks the layer should keep as they are
    (`--quantization gguf`) rather than copy into its float weight."""
    return getattr(loaded, "native", False)


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor | CheckpointTensor) -> None:
    """The whole checkpoint tensor (a torch tensor, or a CheckpointTensor not read yet)."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs checkpoint {tuple(loaded.shape)}")
    if isinstance(loaded, CheckpointTensor):
        loaded.copy_to(param.data)
    else:
        param.data.copy_(loaded)


def load_slice(target: torch.Tensor, loaded: torch.Tensor, dim: int, start: int, full: int, what: str) -> None:
    """Copy rows (dim 0) or columns (dim 1) [start, start + size) of the checkpoint tensor
    `loaded`, whose size along `dim` must be `full`, into `target` (size `size` along `dim`). A
    CheckpointTensor reads only that slice from the file."""
    expected = list(target.shape)
    expected[dim] = full
    if list(loaded.shape) != expected:
        raise ValueError(f"{what}: expected a checkpoint tensor of shape {tuple(expected)}, got {tuple(loaded.shape)}")
    if isinstance(loaded, CheckpointTensor):
        loaded.copy_to(target, dim, start)
    else:
        target.copy_(loaded.narrow(dim, start, target.shape[dim]))


def divide(total: int, tp: int, what: str) -> int:
    if total % tp:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({tp})")
    return total // tp


class Linear(nn.Module):
    """y = x W^T + b with this rank's whole [out_features, in_features] weight."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features  # this rank's
        self.quant: WeightOnlyQuant | None = None  # set by loader/quantize.py; runs few rows
        self.packed: torch.Tensor | None = None  # set by loader/cpu_pack.py; replaces the weight
        self.lora: LinearLoRA | None = None  # set by lora/manager.py: adapter slots added to the output
        self.gguf: GGUFLinear | None = None  # the file's own blocks (--quantization gguf); replaces the weight
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.weight.weight_loader = self._load_whole
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features))
            self.bias.weight_loader = default_weight_loader
        else:
            self.register_parameter("bias", None)

    def _load_whole(self, param: nn.Parameter, loaded: torch.Tensor | CheckpointTensor) -> None:
        if native_gguf(loaded):
            self._add_gguf(loaded, 0)
        else:
            default_weight_loader(param, loaded)

    def _add_gguf(self, loaded, offset: int, columns: tuple[int, int] | None = None) -> None:
        """Keep a GGUF tensor's rows of blocks as output rows from `offset` of this weight."""
        if self.gguf is None:
            self.gguf = GGUFLinear(self.in_features, self.out_features, self.weight.dtype)
        self.gguf.add(offset, loaded, columns)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.gguf is not None:
            out = self.gguf(x, bias)
        elif self.quant is not None and x.numel() <= self.quant.max_rows * self.in_features:
            out = self.quant(x, bias)
        elif self.packed is not None:
            out = packed_linear(x, self.packed, bias)
        else:
            out = F.linear(x, self.weight, bias)
        if self.lora is not None and (mask := get_lora_mask()) is not None:
            out = self.lora.apply(x, out, mask)
        return out


class ColumnParallelLinear(Linear):
    """Outputs split over the ranks: rank r holds rows [r * out / tp, (r + 1) * out / tp) of the
    weight (and bias). `gather_output` concatenates the ranks' outputs; the models instead feed
    the slice to a `RowParallelLinear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, gather_output: bool = False) -> None:
        self.tp = get_tp_group()
        self.tp_rank, self.tp_size = self.tp.rank_in_group, self.tp.world_size
        super().__init__(in_features, divide(out_features, self.tp_size, "output size"), bias)
        self.gather_output = gather_output
        self.weight.weight_loader = self._load_rows
        if bias:
            self.bias.weight_loader = self._load_rows

    def _load_rows(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[0]
        if native_gguf(loaded) and param is self.weight:
            self._add_gguf(loaded.rows(self.tp_rank * size, size), 0)
            return
        load_slice(param.data, loaded, 0, self.tp_rank * size, size * self.tp_size, "column-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x, self.bias)
        return self.tp.all_gather(out, dim=-1) if self.gather_output else out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Checkpoint matrices with the same input stacked along the outputs (gate and up). Each
    rank's weight is its slice of every matrix, in order: [gate_r; up_r]."""

    def __init__(self, in_features: int, shard_sizes: dict[str | int, int] | list[int], bias: bool = False) -> None:
        if not isinstance(shard_sizes, dict):
            shard_sizes = dict(enumerate(shard_sizes))
        tp_size = get_tp_group().world_size
        per_rank = {k: divide(size, tp_size, f"shard {k!r}'s output size") for k, size in shard_sizes.items()}
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        # (offset in this rank's weight, rows per rank, first row in the checkpoint tensor, its rows)
        self.shard_offsets: dict[str | int, tuple[int, int, int, int]] = {}
        offset = 0
        for shard_id, size in per_rank.items():
            self.shard_offsets[shard_id] = (offset, size, self.tp_rank * size, shard_sizes[shard_id])
            offset += size
        self.weight.weight_loader = self._load_shard
        if bias:
            self.bias.weight_loader = self._load_shard

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int) -> None:
        offset, size, start, full = self.shard_offsets[shard_id]
        if native_gguf(loaded) and param is self.weight:
            if loaded.shape[0] != full:
                raise ValueError(f"shard {shard_id!r}: expected {full} rows, got {tuple(loaded.shape)}")
            self._add_gguf(loaded.rows(start, size), offset)
            return
        load_slice(param.data.narrow(0, offset, size), loaded, 0, start, full, f"shard {shard_id!r}")


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k, v stacked; `num_heads` / `num_kv_heads` (as in the checkpoint) are split over the
    ranks. Rank r holds query heads [r * Hq / tp, (r + 1) * Hq / tp) and, when tp > Hkv, the one
    kv head r * Hkv // tp (each kv head then lives on tp / Hkv ranks). After construction
    `self.num_heads` and `self.num_kv_heads` are this rank's counts."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False) -> None:
        tp_size = get_tp_group().world_size
        check_head_split(num_heads, num_kv_heads, tp_size)
        self.total_num_heads, self.total_num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.num_heads = num_heads // tp_size
        self.num_kv_heads = max(1, num_kv_heads // tp_size)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        replicas = tp_size // num_kv_heads if tp_size > num_kv_heads else 1
        # Whole sizes as the checkpoint has them, with each replicated kv head counted per rank.
        sizes = {"q": num_heads * head_dim, "k": self.kv_size * tp_size, "v": self.kv_size * tp_size}
        super().__init__(hidden_size, sizes, bias)
        kv_start = self.tp_rank // replicas * self.kv_size  # kv head r * Hkv // tp when replicated
        for shard_id in ("k", "v"):
            offset, size, _, _ = self.shard_offsets[shard_id]
            self.shard_offsets[shard_id] = (offset, size, kv_start, num_kv_heads * head_dim)


def check_head_split(num_heads: int, num_kv_heads: int, tp_size: int) -> None:
    if num_heads % tp_size:
        raise ValueError(f"num_attention_heads ({num_heads}) is not divisible by tensor_parallel_size ({tp_size})")
    if num_kv_heads % tp_size and tp_size % num_kv_heads:
        raise ValueError(f"num_key_value_heads ({num_kv_heads}) and tensor_parallel_size ({tp_size}): "
                         "neither divides the other")


def _whole(loaded: torch.Tensor | CheckpointTensor) -> torch.Tensor:
    return loaded.load() if isinstance(loaded, CheckpointTensor) else loaded


def transposed_loader(loader):
    """`loader` for a checkpoint that stores a matrix as [in, out] (GPT-2's Conv1D): it gets the
    [out, in] transpose, so its rank slicing is the one it has for nn.Linear checkpoints."""

    def load(param: nn.Parameter, loaded: torch.Tensor | CheckpointTensor, *shard_id) -> None:
        loader(param, _whole(loaded).t(), *shard_id)

    return load


def fused_qkv_loader(layer: QKVParallelLinear, interleaved: bool = False):
    """A loader for a checkpoint's single fused q/k/v tensor (weight [3 H D, in] or bias [3 H D],
    as many kv heads as query heads): stacked [q; k; v] (GPT-2's c_attn), or `interleaved` per
    head as [H, 3, D] (GPT-NeoX's query_key_value). Each part goes through the layer's shard
    loader, which keeps this rank's heads."""
    heads, head_dim = layer.total_num_heads, layer.head_dim
    if layer.total_num_kv_heads != heads:
        raise ValueError("a fused qkv checkpoint tensor needs as many kv heads as query heads")

    def load(param: nn.Parameter, loaded: torch.Tensor | CheckpointTensor) -> None:
        if loaded.shape[0] != 3 * heads * head_dim:
            raise ValueError(f"fused qkv: expected {3 * heads * head_dim} rows, got {tuple(loaded.shape)}")
        full = _whole(loaded)
        rest = tuple(full.shape[1:])
        parts = full.view(heads, 3, head_dim, *rest).transpose(0, 1) if interleaved else \
            full.view(3, heads, head_dim, *rest)
        for part, shard_id in zip(parts, "qkv"):
            layer._load_shard(param, part.reshape(heads * head_dim, *rest), shard_id)

    return load


class RowParallelLinear(Linear):
    """Inputs split over the ranks: rank r holds columns [r * in / tp, (r + 1) * in / tp) of the
    weight and gets that slice of the input; the partial outputs are summed over the ranks
    (`reduce_results`), then the (whole, unsplit) bias is added once. Without `reduce_results`
    the caller sums the outputs, and only rank 0 adds the bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, reduce_results: bool = True) -> None:
        self.tp = get_tp_group()
        self.tp_rank, self.tp_size = self.tp.rank_in_group, self.tp.world_size
        super().__init__(divide(in_features, self.tp_size, "input size"), out_features, bias)
        self.reduce_results = reduce_results
        self.weight.weight_loader = self._load_columns

    def _load_columns(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        size = param.shape[1]
        if native_gguf(loaded):
            if loaded.shape[1] != size * self.tp_size:
                raise ValueError(f"row-parallel weight: expected {size * self.tp_size} inputs, "
                                 f"got {tuple(loaded.shape)}")
            self._add_gguf(loaded, 0, (self.tp_rank * size, size) if self.tp_size > 1 else None)
            return
        load_slice(param.data, loaded, 1, self.tp_rank * size, size * self.tp_size, "row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._matmul(x, self.bias)  # the bias fused into the GEMM
        out = self._matmul(x, None)
        if self.reduce_results:
            out = self.tp.all_reduce(out)
        elif self.tp_rank != 0:
            return out
        return out if self.bias is None else out + self.bias


# The names the layers had before tensor parallelism.
MergedLinear = MergedColumnParallelLinear
QKVLinear = QKVParallelLinear
