"""Completions (and anything holding tensors) in a form every transport can pickle: each tensor as its dtype
name, shape and raw bytes. Plain pickling of float8 / float4 tensors fails in torch (the TRACE guidance's E4M3
block scales are float8), so Ray results and torch.distributed object collectives carry `to_wire(obj)` and
the receiver calls `from_wire` (CPU tensors, dtypes and bytes kept)."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class _WireTensor:
    """A tensor as dtype name + shape + its bytes: plain pickle cannot carry float8 / float4 tensors."""

    dtype: str
    shape: tuple
    data: bytes

    @staticmethod
    def pack(t: torch.Tensor) -> _WireTensor:
        t = t.detach().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return _WireTensor(str(t.dtype).removeprefix("torch."), tuple(t.shape), raw)

    def unpack(self) -> torch.Tensor:
        dtype = getattr(torch, self.dtype)
        if not self.data:
            return torch.empty(self.shape, dtype=dtype)
        return torch.frombuffer(bytearray(self.data), dtype=torch.uint8).view(dtype).reshape(self.shape)


def _map_tensors(obj, fn, kind):
    """`obj` with every `kind` leaf (inside dicts, lists, tuples and dataclasses) replaced by fn(leaf)."""
    if isinstance(obj, kind):
        return fn(obj)
    if type(obj) is dict:
        return {k: _map_tensors(v, fn, kind) for k, v in obj.items()}
    if type(obj) in (list, tuple):
        return type(obj)(_map_tensors(v, fn, kind) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.replace(obj, **{f.name: _map_tensors(getattr(obj, f.name), fn, kind)
                                           for f in dataclasses.fields(obj) if f.init})
    return obj


def to_wire(obj):
    """`obj` (completions, lists, dicts) with every tensor moved to the CPU as a picklable _WireTensor."""
    return _map_tensors(obj, _WireTensor.pack, torch.Tensor)


def from_wire(obj):
    """The inverse of to_wire: CPU tensors again."""
    return _map_tensors(obj, _WireTensor.unpack, _WireTensor)
