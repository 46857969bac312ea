"""A training state as bytes, cheaply and without pickle: the payload of a snapshot.

A state is what `state_dict()` calls return: dicts (with str or int keys), lists and tuples of
tensors, numbers, strings, booleans and None. It becomes a JSON manifest of that structure,
each tensor a reference to its bytes, followed by the tensors' raw bytes, one after another:

    manifest length (8 bytes, big endian) | manifest (JSON) | tensor bytes

Encoding costs one copy of the tensors' bytes and no pickling, several times cheaper than
`torch.save`; decoding builds each tensor on the payload's buffer and clones it (the buffer
can then go). Nothing in a payload is executed when it is read. A state with anything else in
it (a numpy array, an object) raises `UnsupportedState` naming where; the caller falls back to
`torch.save`, whose payloads are read with `weights_only=True`.
"""

from __future__ import annotations

import importlib
import struct
import warnings
from typing import Any

import msgspec

_LENGTH = struct.Struct(">Q")
_ENCODER = msgspec.json.Encoder()


class UnsupportedState(TypeError):
    """A value the codec does not carry; the message says where it is in the state."""


def _torch() -> Any:
    return importlib.import_module("torch")


def encode_state(state: Any) -> bytes:
    """The state's bytes (see the module docstring); UnsupportedState for what it cannot carry."""
    torch = _torch()
    chunks: list[memoryview] = []
    offset = 0

    def walk(value: Any, where: str) -> Any:
        nonlocal offset
        if isinstance(value, torch.Tensor):
            tensor = value.detach().contiguous()
            if tensor.device.type != "cpu":
                tensor = tensor.cpu()
            raw = tensor.reshape(-1).view(torch.uint8).numpy() if tensor.numel() else None
            size = 0 if raw is None else raw.nbytes
            entry = {"t": str(tensor.dtype).removeprefix("torch."), "s": list(tensor.shape),
                     "o": offset, "n": size}
            if raw is not None:
                chunks.append(memoryview(raw))
            offset += size
            return {"__tensor__": entry}
        if isinstance(value, dict):
            return {"__dict__": [[walk_key(k, where), walk(v, f"{where}[{k!r}]")]
                                 for k, v in value.items()]}
        if isinstance(value, (list, tuple)):
            items = [walk(v, f"{where}[{i}]") for i, v in enumerate(value)]
            return items if isinstance(value, list) else {"__tuple__": items}
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        raise UnsupportedState(f"state{where} is a {type(value).__name__}")

    def walk_key(key: Any, where: str) -> Any:
        if isinstance(key, (str, int)) and not isinstance(key, bool):
            return key
        raise UnsupportedState(f"state{where} has a key of type {type(key).__name__}")

    manifest = _ENCODER.encode(walk(state, ""))
    return b"".join([_LENGTH.pack(len(manifest)), manifest, *chunks])


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
