"""A training state as bytes, cheaply and without pickle: the payload of a snapshot.

A state is what `state_dict()` calls return: dicts (with str or int keys), lists and tuples of
tensors, numbers, strings, booleans and None. It becomes a JSON manifest of that structure,
each tensor a reference to its bytes, followed by the tensors' raw bytes, one after another:

    manifest length (8 bytes, big endian) | manifest (JSON) | tensor bytes

Packing (`pack`, on the training thread) copies every tensor's bytes once into one buffer; what
is left (`packed_bytes`, on the snapshot writer's thread) is a manifest and a join, with no
pickling: several times cheaper than staging clones and `torch.save`. Decoding builds each
tensor on the payload's buffer and clones it (the buffer can then go). Nothing in a payload is
executed when it is read. A state with anything else in it (a numpy array, an object) raises
`UnsupportedState` naming where; the caller falls back to `torch.save`, whose payloads are read
with `weights_only=True`.
"""

from __future__ import annotations

import importlib
import struct
import warnings
from dataclasses import dataclass
from typing import Any

import msgspec

_LENGTH = struct.Struct(">Q")
_ENCODER = msgspec.json.Encoder()


class UnsupportedState(TypeError):
    """A value the codec does not carry; the message says where it is in the state."""


def _torch() -> Any:
    return importlib.import_module("torch")


@dataclass(frozen=True)
class Packed:
    """A state packed for a snapshot: its manifest, and every tensor's bytes in one buffer."""

    manifest: Any
    data: Any
    """A flat uint8 tensor on the CPU (the one copy of the state's tensors)."""
    nbytes: int


def pack(state: Any) -> Packed:
    """Copy the state's tensors into one CPU buffer and describe the rest: all the work a
    snapshot does on the training thread. UnsupportedState for what the codec cannot carry."""
    torch = _torch()
    tensors: list[Any] = []
    offset = 0

    def walk(value: Any, where: str) -> Any:
        nonlocal offset
        if isinstance(value, torch.Tensor):
            local = value.to_local() if hasattr(value, "to_local") else value
            size = local.numel() * local.element_size()
            tensors.append((local, offset, size))
            offset += size
            return {"__tensor__": {"t": str(local.dtype).removeprefix("torch."),
                                   "s": list(local.shape), "o": offset - size, "n": size}}
        if isinstance(value, dict):
            return {"__dict__": [[_key(k, where), walk(v, f"{where}[{k!r}]")]
                                 for k, v in value.items()]}
        if isinstance(value, (list, tuple)):
            items = [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
            return items if isinstance(value, list) else {"__tuple__": items}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise UnsupportedState(f"state{where} is a {type(value).__name__}")

    manifest = walk(state, "")
    data = torch.empty(offset, dtype=torch.uint8)
    with torch.no_grad():  # each into its place: a GPU tensor's bytes come over as they go
        for tensor, begin, size in tensors:
            if size:
                data[begin:begin + size].copy_(tensor.detach().reshape(-1).view(torch.uint8))
    return Packed(manifest, data, offset)


def _key(key: Any, where: str) -> Any:
    if isinstance(key, (str, int)) and not isinstance(key, bool):
        return key
    raise UnsupportedState(f"state{where} has a key of type {type(key).__name__}")


def packed_bytes(packed: Packed) -> bytes:
    """The payload of a packed state: its manifest's length and JSON, then the tensor bytes."""
    manifest = _ENCODER.encode(packed.manifest)
    raw = memoryview(packed.data.numpy()) if packed.nbytes else memoryview(b"")
    return b"".join([_LENGTH.pack(len(manifest)), manifest, raw])


def encode_state(state: Any) -> bytes:
    """The state's bytes (see the module docstring); UnsupportedState for what it cannot carry."""
    return packed_bytes(pack(state))


def decode_state(payload: bytes | memoryview) -> Any:
    """The state `encode_state` made of `payload`; ValueError if it does not hold together."""
    torch = _torch()
    view = memoryview(payload)
    if len(view) < _LENGTH.size:
        raise ValueError("state payload too short for its manifest length")
    (length,) = _LENGTH.unpack(view[:_LENGTH.size])
    start = _LENGTH.size + length
    if start > len(view):
        raise ValueError("state payload cut short inside its manifest")
    data = view[start:]
    manifest = msgspec.json.decode(view[_LENGTH.size:start])
    with warnings.catch_warnings():  # a read-only buffer: each tensor is cloned off it
        warnings.simplefilter("ignore", UserWarning)
        return _build(torch, manifest, data)


def _build(torch: Any, manifest: Any, data: memoryview) -> Any:
    """The state a manifest describes, its tensors cloned off `data`."""

    def build(node: Any) -> Any:
        if isinstance(node, list):
            return [build(v) for v in node]
        if not isinstance(node, dict):
            return node
        if "__tensor__" in node:
            entry = node["__tensor__"]
            dtype = getattr(torch, entry["t"])
            begin, size = int(entry["o"]), int(entry["n"])
            if begin + size > len(data):
                raise ValueError("a tensor of the state lies past the payload's end")
            if size == 0:
                return torch.empty(entry["s"], dtype=dtype)
            flat = torch.frombuffer(data[begin:begin + size], dtype=torch.uint8).clone()
            return flat.view(dtype).reshape(entry["s"])
        if "__tuple__" in node:
            return tuple(build(v) for v in node["__tuple__"])
        return {k: build(v) for k, v in node["__dict__"]}

    return build(manifest)
