"""The models a server answers to: its served names for the base model and the LoRA adapters
registered with the engine (`--lora-modules` at start, `/v1/load_lora_adapter` at run time).
One instance is shared by every serving class, so a name resolves the same way on every route
and an adapter loaded or unloaded is seen by all of them at once."""

from __future__ import annotations

import asyncio
import logging

from pydantic import Field

from pagedllm import envs
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.protocol import EngineClient
from pagedllm.entrypoints.openai.errors import OpenAIError
from pagedllm.entrypoints.openai.protocol import ModelCard, ModelList, TopLevelRequest
from pagedllm.entrypoints.openai.server_config import LoRAModulePath
from pagedllm.lora_request import LoRARequest

logger = logging.getLogger(__name__)

RUNTIME_LORA_ENV = "PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_lora_updating_allowed() -> bool:
    """Loading adapters over HTTP lets a client make the server read any directory it can
    reach, so the routes exist only when the operator opts in (vLLM's rule)."""
    return envs.PAGEDLLM_ALLOW_RUNTIME_LORA_UPDATING


class LoadLoRAAdapterRequest(TopLevelRequest):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(TopLevelRequest):
    """By name, by id, or both (then they must name the same adapter)."""

    lora_name: str | None = None
    lora_int_id: int | None = None


class OpenAIServingModels:
    def __init__(self, engine: EngineClient, base_model_names: list[str],
                 lora_modules: tuple[LoRAModulePath, ...] = ()) -> None:
        if not base_model_names:
            raise ValueError("a server needs at least one served model name")
        self.engine = engine
        self.base_model_names = base_model_names
        model_config = engine.model_config
        # root of a base card: the model as the operator named it, never its resolved path on this machine
        self._root = model_config.model or base_model_names[0]
        self._max_model_len = model_config.max_model_len
        self.lora_requests: dict[str, LoRARequest] = {}  # served adapter name → its request, in load order
        self.static_lora_modules = lora_modules
        self._static_loaded = False
        self._next_id = 1  # never reused: the engine keys loaded weights and cached prefixes by id
        self._lock = asyncio.Lock()
        names = [m.name for m in lora_modules]
        for name in names:
            if name in base_model_names:
                raise ValueError(f"--lora-modules: {name!r} is already a served model name")
            if names.count(name) > 1:
                raise ValueError(f"--lora-modules: {name!r} is given more than once")
        if lora_modules and getattr(engine, "lora_config", None) is None:
            raise ValueError("--lora-modules needs --enable-lora")

    # ---- names ------------------------------------------------------------
    def is_known(self, name: str) -> bool:
        return name in self.base_model_names or name in self.lora_requests

    def model_name(self, requested: str | None) -> str:
        """The name to answer with (a base name or an adapter's); unknown is a 404 as in OpenAI's API."""
        if requested is None or requested == "":
            return self.base_model_names[0]
        if not self.is_known(requested):
            raise OpenAIError(f"The model `{requested}` does not exist.", 404, param="model")
        return requested

    def lora_request(self, requested: str | None) -> LoRARequest | None:
        """The adapter a request names; None for the base model. An adapter unloaded since the
        name was checked is a 404 rather than a silent run on the base model."""
        name = self.model_name(requested)
        return self.lora_requests.get(name)

    # ---- /v1/models ---------------------------------------------------------
    def model_cards(self) -> ModelList:
        cards = [self._base_card(name) for name in self.base_model_names]
        cards += [self._lora_card(lora) for lora in self.lora_requests.values()]
        return ModelList(data=cards)

    def model_card(self, name: str) -> ModelCard:
        if name in self.base_model_names:
            return self._base_card(name)
        if name in self.lora_requests:
            return self._lora_card(self.lora_requests[name])
        raise OpenAIError(f"The model `{name}` does not exist.", 404, param="model")

    def _base_card(self, name: str) -> ModelCard:
        return ModelCard(id=name, root=self._root, max_model_len=self._max_model_len)

    def _lora_card(self, lora: LoRARequest) -> ModelCard:
        parent = lora.base_model_name or self.base_model_names[0]
        return ModelCard(id=lora.lora_name, root=lora.lora_path, parent=parent, max_model_len=self._max_model_len)

    # ---- load / unload -------------------------------------------------------
    async def init_static_loras(self) -> None:
        """Register every `--lora-modules` adapter with the engine, in order (ids 1, 2, ...); the
        first bad one raises ValueError with the engine's message. Runs once."""
        if self._static_loaded:
            return
        self._static_loaded = True
        for module in self.static_lora_modules:
            try:
                await self._add(module.name, module.path, module.base_model_name)
            except ValueError as e:
                raise ValueError(f"--lora-modules {module.name}: {e}") from None
            logger.info("LoRA adapter %r served from %s", module.name, module.path)

    async def load_lora_adapter(self, request: LoadLoRAAdapterRequest) -> str:
        name = request.lora_name
        async with self._lock:
            if name in self.base_model_names:
                raise OpenAIError(f"The model `{name}` is a base model name, not a LoRA adapter.", param="lora_name")
            if name in self.lora_requests:
                raise OpenAIError(f"The LoRA adapter '{name}' has already been loaded.", param="lora_name")
            try:
                await self._add(name, request.lora_path, None)
            except EngineDeadError:
                raise
            except ValueError as e:  # the engine's check of the adapter against the model
                raise OpenAIError(str(e), param="lora_path") from None
            except Exception as e:  # an unreadable file (OSError, a corrupt safetensors header): still the input
                raise OpenAIError(f"LoRA adapter {request.lora_path!r} cannot be read: {type(e).__name__}: {e}",
                                  param="lora_path") from None
        logger.info("LoRA adapter %r loaded from %s", name, request.lora_path)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_lora_adapter(self, request: UnloadLoRAAdapterRequest) -> str:
        if request.lora_name is None and request.lora_int_id is None:
            raise OpenAIError("give lora_name or lora_int_id", param="lora_name")
        async with self._lock:
            lora = self._find(request.lora_name, request.lora_int_id)
            if lora is None:
                what = repr(request.lora_name) if request.lora_name is not None else f"id {request.lora_int_id}"
                raise OpenAIError(f"The LoRA adapter {what} cannot be found.", 404,
                                  param="lora_name" if request.lora_name is not None else "lora_int_id")
            del self.lora_requests[lora.lora_name]  # new requests stop resolving it first
            await self.engine.remove_lora(lora.lora_int_id)
        logger.info("LoRA adapter %r unloaded", lora.lora_name)
        return f"Success: LoRA adapter '{lora.lora_name}' removed successfully."

    def _find(self, name: str | None, lora_int_id: int | None) -> LoRARequest | None:
        lora = self.lora_requests.get(name) if name is not None else next(
            (r for r in self.lora_requests.values() if r.lora_int_id == lora_int_id), None)
        if lora is not None and lora_int_id is not None and lora.lora_int_id != lora_int_id:
            return None
        return lora

    async def _add(self, name: str, path: str, base_model_name: str | None) -> None:
        lora = LoRARequest(name, self._next_id, path, base_model_name)
        self._next_id += 1  # spent even on failure: an id is never seen with two paths
        await self.engine.add_lora(lora)
        self.lora_requests[name] = lora
