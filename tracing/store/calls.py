"""The trace store port's calls as bytes, for an embedded store that one process holds and other
processes of the same machine use (`store.sharing` serves the calls, `store.client` makes them).

What crosses is what the port declares: `TraceStore` and `BulkStore` (`store.port`) name every
method, its arguments with their types and defaults, and its result type, and `calls()` derives
each call's argument struct and result type from those annotations. A method added to the port
therefore crosses with no change here, unless it takes a kind of value the codec does not know.
Values travel as MessagePack:

- records and batches (msgspec structs) by their fields, nested structs and enums included;
- numpy columns (the summaries' dataclasses) as dtype, shape and raw bytes, string columns as
  their distinct values and int32 codes: the same dtype, shape and values come out, NaN bits
  included; only bool, integer, float and string columns cross (an object column never does);
- `Disagreements` (a tuple that also carries `dropped`) as its rows and `dropped`; a record kind
  (`BulkStore.records`) as its tag.

A value is decoded into its declared type, validated as msgspec validates records. Where that
fails on a limit of the wire (`tracing.kinds`: a UInt64 above 2**63 - 1, which the stores keep)
or on a record kind outside the batch union, it is decoded again by type alone, ignoring the
limits, so a client stores and reads exactly what the store itself would: nothing more refused,
nothing changed. A value of the wrong type is refused either way (TypeError naming it).

Errors cross by class: ValueError and TypeError (bad arguments), StoreConfigError,
PermanentStoreError and TemporaryStoreError (with its retry_after). Any other exception is the
holder's own failure and crosses as a PermanentStoreError.

This module never runs a call and never touches the network.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
from msgspec import inspect as mi

from tracehound.tracing import kinds, summaries
from tracehound.tracing.errors import (
    PermanentStoreError,
    StoreConfigError,
    StoreError,
    TemporaryStoreError,
)
from tracehound.tracing.store import port

PROTOCOL_VERSION = 1
"""Changes when a call's encoding changes; a client and a holder of different versions refuse
each other at the first call (`hello`)."""

HELLO = "hello"
"""The call that is no method of the port: who holds the store and which protocol it speaks."""

NOT_CALLS = frozenset({"close", "url"})
"""Members of the port that stay on the client's side: closing a client closes only the
client, and its URL is its own."""

ARRAY_KINDS = frozenset("biufU")
"""The numpy dtype kinds a column may have on the wire: bool, (u)int, float, unicode."""

CROSSING_ERRORS: Mapping[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (ValueError, TypeError, StoreConfigError, PermanentStoreError,
                TemporaryStoreError)
}
"""The exceptions that keep their class across the process boundary, by name."""


@dataclass(frozen=True, slots=True)
class Call:
    """One method of the port, as it crosses."""

    name: str
    args: type[msgspec.Struct]
    """A struct of the method's keyword arguments, with their declared types and defaults."""
    result: Any
    """The declared result type."""


class Hello(msgspec.Struct, frozen=True, kw_only=True):
    """What a holder says about itself."""

    version: int
    store: str
    """The directory the holder holds."""
    pid: int


class WireError(msgspec.Struct, frozen=True, kw_only=True):
    """A failed call's answer."""

    error: str
    """The exception's class name (one of CROSSING_ERRORS, else a PermanentStoreError)."""
    message: str
    retry_after: float = 1.0


def _hint_namespace() -> dict[str, Any]:
    """The names the port's annotations use, including those it imports for type checking
    only."""
    names: dict[str, Any] = dict(vars(port))
    names.update({n: getattr(summaries, n) for n in dir(summaries) if not n.startswith("_")})
    names["RecordBase"] = kinds.RecordBase
    return names


@functools.cache
def calls() -> Mapping[str, Call]:
    """Every method of the port that crosses (all but NOT_CALLS), by name."""
    found: dict[str, Call] = {}
    namespace = _hint_namespace()
    for name, member in inspect.getmembers(port.BulkStore):
        if name.startswith("_") or name in NOT_CALLS or not callable(member):
            continue
        hints = typing.get_type_hints(member, globalns=namespace)
        fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
        for parameter in list(inspect.signature(member).parameters.values())[1:]:
            hint = hints[parameter.name]
            if parameter.default is inspect.Parameter.empty:
                fields.append((parameter.name, hint))
            else:
                fields.append((parameter.name, hint, parameter.default))
        args = msgspec.defstruct(f"{name}_args", fields, kw_only=True, frozen=True)
        found[name] = Call(name=name, args=args, result=hints.get("return", type(None)))
    return found


def call(name: str) -> Call:
    """The call of that name; TypeError naming it when the port has no such method."""
    found = calls().get(name)
    if found is None:
        raise TypeError(f"the trace store port has no method {name!r}")
    return found


# --- values ------------------------------------------------------------------------------------


def _array_to_wire(array: npt.NDArray[Any]) -> dict[str, Any]:
    if array.dtype.kind not in ARRAY_KINDS:
        raise TypeError(f"a numpy column of dtype {array.dtype} cannot cross: expected bool, "
                        "integer, float or string columns")
    shape = list(array.shape)
    if array.dtype.kind == "U":
        values, codes = np.unique(array.ravel(), return_inverse=True)
        return {"dtype": array.dtype.str, "shape": shape, "values": values.tolist(),
                "codes": codes.astype("<i4").tobytes()}
    return {"dtype": array.dtype.str, "shape": shape,
            "data": np.ascontiguousarray(array).tobytes()}


def _array_from_wire(obj: Any) -> npt.NDArray[Any]:
    if not isinstance(obj, dict):
        raise TypeError(f"expected a numpy column, got {type(obj).__name__}")
    try:
        dtype = np.dtype(obj["dtype"])
        shape = tuple(int(n) for n in obj["shape"])
    except (KeyError, TypeError, ValueError) as exc:
        raise TypeError(f"malformed numpy column: {exc}") from None
    if dtype.kind not in ARRAY_KINDS or dtype.hasobject:
        raise TypeError(f"a numpy column of dtype {dtype} cannot cross")
    count = int(np.prod(shape, dtype=np.int64))
    if dtype.kind == "U":
        codes = np.frombuffer(obj.get("codes", b""), dtype="<i4")
        values = np.array(obj.get("values", []), dtype=dtype)
        if codes.shape[0] != count or (count and (codes.min() < 0
                                                  or codes.max() >= values.shape[0])):
            raise TypeError("malformed string column: its codes do not fit its values")
        return values[codes].reshape(shape) if count else np.empty(shape, dtype=dtype)
    data = obj.get("data", b"")
    if not isinstance(data, bytes) or len(data) != count * dtype.itemsize:
        raise TypeError(f"malformed numpy column: {count} values of {dtype} do not fit "
                        f"{len(data) if isinstance(data, bytes) else 'no'} bytes")
    return np.frombuffer(data, dtype=dtype).reshape(shape).copy()


def _enc_hook(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return _array_to_wire(value)
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, type) and issubclass(value, kinds.RecordBase):
        return kinds.layout(value).tag
    raise NotImplementedError(f"a {type(value).__name__} cannot cross to a shared store")


def _dec_hook(declared: Any, obj: Any) -> Any:
    origin = typing.get_origin(declared) or declared
    if origin is np.ndarray:
        return _array_from_wire(obj)
    if origin is summaries.Disagreements:
        if not isinstance(obj, dict):
            raise TypeError(f"expected disagreements, got {type(obj).__name__}")
        rows = msgspec.convert(obj.get("rows", []), list[summaries.Disagreement])
        return summaries.Disagreements(rows, dropped=int(obj.get("dropped", 0)))
    if origin is type:
        layout = kinds.by_tag(obj) if isinstance(obj, str) else None
        if layout is None:
            raise TypeError(f"no record kind is declared with the tag {obj!r}")
        return layout.kind
    raise NotImplementedError(f"{declared!r} cannot cross from a shared store")


def _prepare(value: Any) -> Any:
    """What msgspec cannot encode as is: Disagreements, a tuple that carries one more field."""
    if isinstance(value, summaries.Disagreements):
        return {"rows": list(value), "dropped": value.dropped}
    return value


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


@functools.cache
def _decoder(declared: Any) -> msgspec.msgpack.Decoder[Any]:
    return msgspec.msgpack.Decoder(type=declared, dec_hook=_dec_hook)


@functools.cache
def _info(declared: Any) -> mi.Type:
    return mi.type_info(declared)


def encode(value: Any) -> bytes:
    """`value` (a call's arguments struct or result) as MessagePack."""
    return _ENCODER.encode(_prepare(value))


def decode(body: bytes, declared: Any) -> Any:
    """A value of the `declared` type from `body`, exactly as it was encoded (see the module
    docstring); TypeError naming what does not fit."""
    try:
        return _decoder(declared).decode(body)
    except msgspec.ValidationError:
        pass  # a wire limit the stores do not keep, or a kind beyond the batch union
    except msgspec.DecodeError as exc:
        raise TypeError(f"not a MessagePack value: {exc}") from None
    return _lax(_info(declared), msgspec.msgpack.decode(body), "$")


_Converter = Callable[[mi.Type, Any, str], Any]


def _lax(info: mi.Type, value: Any, where: str) -> Any:
    """`value` (decoded without a type) as the type `info` describes, checking types but no
    limits."""
    handler = _LAX.get(type(info))
    if handler is None:
        raise TypeError(f"{where}: a {type(info).__name__} cannot cross")
    return handler(info, value, where)


def _expect(value: Any, types: type | tuple[type, ...], what: str, where: str) -> None:
    if not isinstance(value, types):
        raise TypeError(f"{where}: expected {what}, got {type(value).__name__}")


def _lax_scalar(types: type | tuple[type, ...], what: str) -> _Converter:
    def convert(_info: mi.Type, value: Any, where: str) -> Any:
        _expect(value, types, what, where)
        return value
    return convert


def _lax_int(_info: mi.Type, value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{where}: expected a whole number, got {type(value).__name__}")
    return value


def _lax_float(_info: mi.Type, value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: expected a number, got {type(value).__name__}")
    return float(value)


def _lax_none(_info: mi.Type, value: Any, where: str) -> None:
    if value is not None:
        raise TypeError(f"{where}: expected nothing (None), got {type(value).__name__}")


def _lax_enum(info: mi.Type, value: Any, where: str) -> Any:
    cls = typing.cast(mi.EnumType, info).cls
    try:
        return cls(value)
    except ValueError:
        raise TypeError(f"{where}: {value!r} is no {cls.__name__}") from None


def _lax_items(info: mi.Type, value: Any, where: str) -> Any:
    _expect(value, (list, tuple), "a list", where)
    item = typing.cast(mi.ListType, info).item_type
    items = [_lax(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(info, mi.VarTupleType):
        return tuple(items)
    if isinstance(info, mi.SetType):
        return set(items)
    if isinstance(info, mi.FrozenSetType):
        return frozenset(items)
    return items


def _lax_tuple(info: mi.Type, value: Any, where: str) -> tuple[Any, ...]:
    _expect(value, (list, tuple), "a list", where)
    types = typing.cast(mi.TupleType, info).item_types
    if len(value) != len(types):
        raise TypeError(f"{where}: expected {len(types)} items, got {len(value)}")
    return tuple(_lax(t, v, f"{where}[{i}]") for i, (t, v) in enumerate(zip(types, value,
                                                                            strict=True)))


def _lax_dict(info: mi.Type, value: Any, where: str) -> dict[Any, Any]:
    _expect(value, dict, "a map", where)
    mapping = typing.cast(mi.DictType, info)
    return {_lax(mapping.key_type, k, f"{where} key"): _lax(mapping.value_type, v,
                                                             f"{where}[{k!r}]")
            for k, v in value.items()}


def _lax_fields(info: mi.Type, value: Any, where: str) -> Any:
    _expect(value, dict, "a map of fields", where)
    shape = typing.cast(mi.StructType | mi.DataclassType, info)
    values: dict[str, Any] = {}
    for f in shape.fields:
        if f.encode_name in value:
            values[f.name] = _lax(f.type, value[f.encode_name], f"{where}.{f.name}")
        elif f.required:
            raise TypeError(f"{where}: field {f.name!r} is missing")
    return shape.cls(**values)


def _tag_of(value: Any) -> str | None:
    if isinstance(value, dict):
        tag = value.get("type")
        return tag if isinstance(tag, str) else None
    return None


def _lax_union(info: mi.Type, value: Any, where: str) -> Any:
    members = typing.cast(mi.UnionType, info).types
    if value is None and any(isinstance(m, mi.NoneType) for m in members):
        return None
    tag = _tag_of(value)
    if tag is not None:
        for member in members:
            if isinstance(member, mi.StructType) and member.tag == tag:
                return _lax(member, value, where)
        layout = kinds.by_tag(tag)
        if layout is None:
            raise TypeError(f"{where}: no record kind {tag!r} is declared in the process that "
                            "holds the store")
        return _lax(_info(layout.kind), value, where)  # beyond the union: the store decides
    failures = []
    for member in members:
        if isinstance(member, mi.NoneType):
            continue
        try:
            return _lax(member, value, where)
        except TypeError as exc:
            failures.append(str(exc))
    raise TypeError(f"{where}: fits none of the union's types ({'; '.join(failures)})")


def _lax_custom(info: mi.Type, value: Any, where: str) -> Any:
    try:
        return _dec_hook(typing.cast(mi.CustomType, info).cls, value)
    except NotImplementedError as exc:
        raise TypeError(f"{where}: {exc}") from None


def _lax_any(_info: mi.Type, value: Any, _where: str) -> Any:
    return value


def _lax_meta(info: mi.Type, value: Any, where: str) -> Any:
    return _lax(typing.cast(mi.Metadata, info).type, value, where)


_LAX: dict[type, _Converter] = {
    mi.AnyType: _lax_any,
    mi.NoneType: _lax_none,
    mi.BoolType: _lax_scalar(bool, "true or false"),
    mi.IntType: _lax_int,
    mi.FloatType: _lax_float,
    mi.StrType: _lax_scalar(str, "a string"),
    mi.BytesType: _lax_scalar(bytes, "bytes"),
    mi.EnumType: _lax_enum,
    mi.ListType: _lax_items,
    mi.VarTupleType: _lax_items,
    mi.SetType: _lax_items,
    mi.FrozenSetType: _lax_items,
    mi.TupleType: _lax_tuple,
    mi.DictType: _lax_dict,
    mi.StructType: _lax_fields,
    mi.DataclassType: _lax_fields,
    mi.UnionType: _lax_union,
    mi.CustomType: _lax_custom,
    mi.Metadata: _lax_meta,
}


# --- errors ------------------------------------------------------------------------------------


def encode_error(exc: BaseException) -> bytes:
    """A failed call's answer: the first class of `exc`'s MRO that crosses (else the holder's
    own failure, a PermanentStoreError) and its message."""
    name = next((c.__name__ for c in type(exc).__mro__ if c.__name__ in CROSSING_ERRORS
                 and CROSSING_ERRORS[c.__name__] is c), PermanentStoreError.__name__)
    retry_after = exc.retry_after if isinstance(exc, TemporaryStoreError) else 1.0
    return msgspec.msgpack.encode(WireError(error=name, message=str(exc),
                                            retry_after=float(retry_after)))


def decode_error(body: bytes) -> WireError | None:
    """A failed call's answer, None when `body` is none."""
    try:
        return msgspec.msgpack.decode(body, type=WireError)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def error_of(wire: WireError, context: str) -> Exception:
    """The exception a failed call raises on the client: its class as the holder raised it.
    ValueError and TypeError keep their message as is (it names the bad argument); a store
    error's message is prefixed with `context` (which store, which holder)."""
    cls = CROSSING_ERRORS.get(wire.error, PermanentStoreError)
    if cls is TemporaryStoreError:
        return TemporaryStoreError(f"{context}: {wire.message}", retry_after=wire.retry_after)
    if issubclass(cls, StoreError):
        return cls(f"{context}: {wire.message}")
    return cls(wire.message)
