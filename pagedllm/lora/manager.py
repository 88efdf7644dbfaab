"""The worker's adapters: `max_loras` slots in every target layer (model_executor/layers/lora.py)
and an LRU of up to `max_cpu_loras` loaded adapters. Each step, `prepare` puts the step's adapters
into slots (the scheduler never schedules more distinct adapters than there are slots) and
returns the per-token mask the LoRA layers read from the forward context."""

from __future__ import annotations

import re
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
from torch import nn

from pagedllm.config import LoRAConfig
from pagedllm.lora.peft import LoRAWeights, load_adapter
from pagedllm.lora_request import LoRARequest
from pagedllm.model_executor.layers.linear import Linear
from pagedllm.model_executor.layers.lora import LinearLoRA

_LAYER = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(qkv_proj|o_proj|gate_up_proj|down_proj)$")
# pagedllm's fused layer → the PEFT modules in it, by the layer's shard ids.
_SUBS = {"qkv_proj": {"q": "q_proj", "k": "k_proj", "v": "v_proj"}, "gate_up_proj": {0: "gate_proj", 1: "up_proj"}}


class LoRAManager:
    def __init__(self, model: nn.Module, config: LoRAConfig, text_config: Any, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.config, self.text_config, self.dtype, self.device = config, text_config, dtype, device
        self.layers: list[tuple[int, LinearLoRA]] = []
        for name, module in model.named_modules():
            m = _LAYER.search(name)
            if m is None or not isinstance(module, Linear):
                continue
            kind = m.group(2)
            if kind in _SUBS:
                slices = {peft: module.shard_offsets[shard][:2] for shard, peft in _SUBS[kind].items()}
            else:
                slices = {kind: (0, module.out_features)}
            module.lora = LinearLoRA(module.in_features, slices, config.max_loras, config.max_lora_rank, dtype,
                                     device)
            self.layers.append((int(m.group(1)), module.lora))
        self.slots: list[int | None] = [None] * config.max_loras  # the adapter id in each slot
        self._slot_age = [0] * config.max_loras  # the step that last used each slot
        self._step = 0
        self.loaded: OrderedDict[int, LoRAWeights] = OrderedDict()  # the LRU, most recent last
        rank = config.max_lora_rank
        self._column_slot = torch.arange(config.max_loras * rank, device=device) // rank

    def _weights(self, request: LoRARequest) -> LoRAWeights:
        weights = self.loaded.pop(request.lora_int_id, None)
        if weights is None:
            weights = load_adapter(request.lora_path, request.lora_name, self.text_config,
                                   self.config.max_lora_rank, self.dtype)
        self.loaded[request.lora_int_id] = weights
        while len(self.loaded) > self.config.max_cpu_loras:
            self.loaded.popitem(last=False)
        return weights

    def _slot_for(self, request: LoRARequest, in_step: set[int]) -> int:
        if request.lora_int_id in self.slots:
            return self.slots.index(request.lora_int_id)
        free = [s for s, held in enumerate(self.slots) if held is None or held not in in_step]
        if not free:
            raise RuntimeError(f"more adapters in one step than --max-loras {self.config.max_loras}")
        slot = min(free, key=lambda s: (self.slots[s] is not None, self._slot_age[s]))
        weights = self._weights(request)
        for layer, lora in self.layers:
            lora.set_slot(slot, {module: w for (i, module), w in weights.modules.items() if i == layer})
        self.slots[slot] = request.lora_int_id
        return slot

    def prepare(self, requests: list[LoRARequest | None], num_tokens: list[int]) -> torch.Tensor | None:
        """Slots for the step's adapters, and the mask [tokens, max_loras * max_rank] (None: no adapter)."""
        self._step += 1
        if all(r is None for r in requests):
            return None
        in_step = {r.lora_int_id for r in requests if r is not None}
        slots = []
        for r in requests:
            slot = -1 if r is None else self._slot_for(r, in_step)
            if slot >= 0:
                self._slot_age[slot] = self._step
            slots.append(slot)
        token_slot = torch.from_numpy(np.repeat(np.array(slots, dtype=np.int64), num_tokens)).to(self.device)
        return (token_slot[:, None] == self._column_slot[None, :]).to(self.dtype)

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter (unloaded by the server); its slot is overwritten on next use."""
        found = self.loaded.pop(lora_int_id, None) is not None
        if lora_int_id in self.slots:
            self.slots[self.slots.index(lora_int_id)] = None
            found = True
        return found
