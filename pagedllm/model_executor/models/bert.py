"""BERT (encoder only, as sentence-transformers embedders use it): word + absolute position +
token type embeddings, post-norm layers with bidirectional attention, no KV cache.

The batch stays packed (one row per token, no padding) through every linear; only attention
pads, once per forward pass, into [sequences, longest, heads, head_dim] for one SDPA call with a
key-padding mask. The sequences come from the step's attention metadata: each pooled prompt is
computed whole in one step.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.forward_context import get_attention_metadata
from pagedllm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model_executor.layers.vocab_embedding import VocabParallelEmbedding
from pagedllm.model_executor.models.utils import load_weights

# checkpoint sub-module → (stacked parameter's module, shard id)
BERT_PACKED = {"query": ("qkv_proj", "q"), "key": ("qkv_proj", "k"), "value": ("qkv_proj", "v")}


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        # Token type 0 unless the prompt is a text pair (a cross-encoder's query and document).
        types = self.token_type_embeddings.weight[0] if token_type_ids is None else \
            self.token_type_embeddings(token_type_ids)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + types
        return self.LayerNorm(x)


class PaddedBatch:
    """Where each packed token sits in a [sequences, longest] grid, from the step's metadata. The
    cells are worked out on the host: moving tokens into and out of the grid by index then needs
    no device sync, where a boolean mask costs one at every use on a GPU."""

    def __init__(self, num_tokens: int, device: torch.device) -> None:
        segments = get_attention_metadata().prefills
        lens = [s.query_len for s in segments]
        if sum(lens) != num_tokens:
            raise RuntimeError("an encoder step must hold whole prompts, each from its first token")
        longest = max(lens)
        self.shape = (len(lens), longest)
        cells = np.empty(num_tokens, dtype=np.int64)  # grid cell (row * longest + column) of each packed token
        for row, s in enumerate(segments):
            cells[s.token_start : s.token_start + s.query_len] = row * longest + np.arange(s.query_len)
        self.cells = torch.from_numpy(cells).to(device)
        real = torch.arange(longest, device=device) < torch.tensor(lens, device=device)[:, None]  # [B, L]
        self.key_mask = real[:, None, None, :]  # [B, 1, 1, L] for SDPA


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.head_dim = config.hidden_size // config.num_attention_heads
        heads = config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, heads, bias=True)
        self.num_heads = self.qkv_proj.num_heads

    def forward(self, x: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).view(-1, 3, self.num_heads, self.head_dim).unbind(1)
        rows, longest = batch.shape
        padded = []
        for t in (q, k, v):
            p = t.new_zeros(rows * longest, self.num_heads, self.head_dim).index_copy_(0, batch.cells, t)
            padded.append(p.view(rows, longest, self.num_heads, self.head_dim).transpose(1, 2))  # [B, H, L, D]
        out = F.scaled_dot_product_attention(*padded, attn_mask=batch.key_mask)
        out = out.transpose(1, 2).reshape(rows * longest, self.num_heads, self.head_dim)
        return out.index_select(0, batch.cells).view(-1, self.num_heads * self.head_dim)


class BertSelfOutput(nn.Module):
    def __init__(self, config: Any, in_features: int) -> None:
        super().__init__()
        self.dense = RowParallelLinear(in_features, config.hidden_size, bias=True)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config, config.hidden_size)

    def forward(self, x: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
        return self.output(self.self(x, batch), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        if config.hidden_act not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"BERT activation {config.hidden_act!r} is not supported")
        self.approximate = "none" if config.hidden_act == "gelu" else "tanh"
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x), approximate=self.approximate)


class BertLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertSelfOutput(config, config.intermediate_size)

    def forward(self, x: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
        x = self.attention(x, batch)
        return self.output(self.intermediate(x), x)


class BertEncoder(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))


class BertModel(nn.Module):
    """Returns the last layer's hidden states of every token; the pooler makes the vectors."""

    packed_modules_mapping = BERT_PACKED

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        batch = PaddedBatch(len(input_ids), input_ids.device)
        x = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            x = layer(x, batch)
        return x

    def load_weights(self, weights) -> set[str]:
        # A checkpoint of BertModel may carry its pooler (unused: sentence embedders pool
        # themselves) and, saved from a task model, a "bert." prefix.
        def renamed():
            for name, tensor in weights:
                name = name.removeprefix("bert.")
                if not name.startswith(("pooler.", "cls.")) and "position_ids" not in name:
                    yield name, tensor

        return load_weights(self, renamed())


class BertForSequenceClassification(nn.Module):
    """BERT with its pooler (dense + tanh on the first token) and a linear classifier: the
    runner's CLS pooling feeds `classify`, which returns the logits."""

    packed_modules_mapping = BERT_PACKED

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.bert = BertModel(config)
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, intermediate_tensors=None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        return self.bert(input_ids, positions, token_type_ids=token_type_ids)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler(pooled.to(self.pooler.weight.dtype)))).float()

    def load_weights(self, weights) -> set[str]:
        def renamed():
            for name, tensor in weights:
                if "position_ids" in name:
                    continue
                name = name.removeprefix("bert.").replace("pooler.dense.", "pooler.")
                yield (name if name.startswith(("pooler.", "classifier.")) else f"bert.{name}"), tensor

        return load_weights(self, renamed())
