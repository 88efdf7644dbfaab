"""How executor ↔ worker messages are encoded: msgpack (msgspec), never pickle.

A call is two frames: a header `(call_id, method, kwargs)` and the args. A reply is a header
`(call_id, rank, ok)` and the result (or the error text). The step methods' args and results are
decoded into their types (`SchedulerOutput`, `GrammarOutput`, `ModelRunnerOutput`); other calls
carry plain values. A CPU tensor (the grammar bitmask) travels as a msgpack extension: dtype,
shape and raw bytes.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np
import torch

from pagedllm.core.sched_output import GrammarOutput, ModelRunnerOutput, SchedulerOutput

_TENSOR_EXT = 1

# method → the type of its args tuple / of its result, for typed decoding.
_ARG_TYPES: dict[str, Any] = {
    "execute_model": tuple[SchedulerOutput],
    "sample_tokens": tuple[GrammarOutput | None],
}
_RESULT_TYPES: dict[str, Any] = {"sample_tokens": ModelRunnerOutput | None}


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        array = obj.detach().cpu().contiguous().numpy()
        return msgspec.msgpack.Ext(_TENSOR_EXT, msgspec.msgpack.encode((array.dtype.str, array.shape, array.data)))
    raise TypeError(f"{type(obj).__name__} cannot be sent to a worker process")


def _ext_hook(code: int, data: memoryview) -> Any:
    if code != _TENSOR_EXT:
        raise TypeError(f"unknown msgpack extension {code}")
    dtype, shape, raw = msgspec.msgpack.decode(data)
    return torch.from_numpy(np.frombuffer(raw, dtype=dtype).reshape(shape).copy())


class MessageCodec:
    """One encoder and the decoders, shared by the executor and its worker processes."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._plain = msgspec.msgpack.Decoder(ext_hook=_ext_hook)
        self._args = {m: msgspec.msgpack.Decoder(t, ext_hook=_ext_hook) for m, t in _ARG_TYPES.items()}
        self._results = {m: msgspec.msgpack.Decoder(t, ext_hook=_ext_hook) for m, t in _RESULT_TYPES.items()}

    def encode_call(self, call_id: int, method: str, args: tuple, kwargs: dict[str, Any]) -> list[bytes]:
        return [self._encoder.encode((call_id, method, kwargs)), self._encoder.encode(args)]

    def decode_call(self, frames: list[bytes]) -> tuple[int, str, tuple, dict[str, Any]]:
        call_id, method, kwargs = self._plain.decode(frames[0])
        args = self._args.get(method, self._plain).decode(frames[1])
        return call_id, method, tuple(args), kwargs

    def encode_reply(self, call_id: int, rank: int, ok: bool, value: Any) -> list[bytes]:
        return [self._encoder.encode((call_id, rank, ok)), self._encoder.encode(value)]

    def decode_reply_header(self, frames: list[bytes]) -> tuple[int, int, bool]:
        """(call_id, rank, ok): read first, so a late reply to another call is dropped undecoded."""
        call_id, rank, ok = self._plain.decode(frames[0])
        return call_id, rank, ok

    def decode_reply_value(self, frames: list[bytes], method: str, ok: bool) -> Any:
        return (self._results.get(method, self._plain) if ok else self._plain).decode(frames[1])
