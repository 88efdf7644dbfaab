"""LoRARequest: which adapter a request runs with. Plain data on the ground floor: it travels
with the request from the front end through the engine core to the workers."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class LoRARequest:
    """A PEFT adapter directory, named for clients (`lora_name`, the served model name) and
    numbered for the engine (`lora_int_id`, unique and >= 1: it keys the slots, the LRU of loaded
    adapters and the prefix cache)."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
