"""The JSON wire form of records, and the one place untrusted payloads become records.

Ranks send records to their node agent, one JSON object per line, and node agents send batches
(`{"batch_id": ..., "records": [...]}`) to an ingest endpoint or a store. A record's wire form is
its declaration in `tracing.events` (field names as declared, `type` the kind's tag), encoded and
decoded by msgspec, which validates every field while it parses. A bad record is rejected with a
message that names the field and what was expected, and the good records of the same batch are
kept.

Decoding accepts the kinds that travel in batches (what ranks and node agents send); the trace
file format (`tracing.traceformat`) also reads incidents and actions through `decode(...,
batch_only=False)`.
"""

from __future__ import annotations

import json
import re
import typing
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from msgspec import inspect as mi

from tracehound.tracing import kinds
from tracehound.tracing.events import Batch, Record


class InvalidRecord(ValueError):
    """A payload that is not a valid record. The message names the field and the expected form."""


@dataclass(frozen=True, slots=True)
class Rejection:
    """A record that was refused, where it was in its batch, and why."""

    index: int
    reason: str


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    batch: Batch
    rejected: tuple[Rejection, ...]


def record_types(*, batch_only: bool = True) -> tuple[str, ...]:
    """Every `type` a record may have on the wire (of batch kinds, or of every kind)."""
    return tuple(x.tag for x in kinds.layouts(batch=True if batch_only else None))


# --- encoding ------------------------------------------------------------------------------

_encoder = msgspec.json.Encoder()


def encode(record: kinds.RecordBase) -> dict[str, Any]:
    """The wire form of a record as plain Python values (what `json.dumps` would take)."""
    out: dict[str, Any] = msgspec.json.decode(_encoder.encode(record))
    return out


def encode_line(record: kinds.RecordBase) -> bytes:
    """A record as compact JSON bytes (no newline)."""
    return _encoder.encode(record)


def encode_batch(batch: Batch) -> bytes:
    """A batch as compact JSON bytes."""
    return _encoder.encode(batch)


def batch_of_lines(batch_id: str, lines: Sequence[bytes]) -> bytes:
    """A batch's JSON built from records that are already JSON (spool lines), without decoding
    them: the receiver validates each record once."""
    return b"".join((
        b'{"batch_id":', _encoder.encode(batch_id), b',"records":[', b",".join(lines), b"]}",
    ))


# --- decoding ------------------------------------------------------------------------------


class _Envelope(msgspec.Struct):
    batch_id: str
    records: list[msgspec.Raw]


_decoders: dict[tuple[int, bool], tuple[Any, Any, Any]] = {}


def _codecs(batch_only: bool) -> tuple[Any, Any, Any]:
    """(record union type, record decoder, batch decoder) for the kinds registered now."""
    key = (kinds.generation(), batch_only)
    found = _decoders.get(key)
    if found is None:
        classes = tuple(x.kind for x in kinds.layouts(batch=True if batch_only else None))
        union: Any = typing.Union[classes] if len(classes) > 1 else classes[0]  # noqa: UP007
        batch_type = msgspec.defstruct(
            "WireBatch", [("batch_id", str), ("records", list[union])], frozen=True,
        )
        found = (union, msgspec.json.Decoder(union), msgspec.json.Decoder(batch_type))
        _decoders.clear()
        _decoders[key] = found
    return found


def decode(raw: Any, *, batch_only: bool = True) -> Any:
    """A record from its wire form as plain Python values (a parsed JSON object); raises
    InvalidRecord saying what is wrong."""
    union, _, _ = _codecs(batch_only)
    try:
        return _text_checked(msgspec.convert(raw, union))
    except msgspec.ValidationError as exc:
        raise InvalidRecord(_reason(str(exc), raw, batch_only)) from None
    except RecursionError:
        raise InvalidRecord(_TOO_DEEP) from None


_TOO_DEEP = "the record is nested too deep to be read"


def _text_checked(record: Any) -> Any:
    """`record` if every string in it is text; InvalidRecord naming the field holding a lone
    UTF-16 surrogate otherwise. JSON allows `"\\ud800"`, which is not text and which no store
    can keep: msgspec refuses it, Python's json (the fallback, and what `decode` is given)
    takes it."""
    for name in record.__struct_fields__:
        try:
            _encoder.encode(getattr(record, name))
        except UnicodeEncodeError:
            raise InvalidRecord(
                f"field {name!r} holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is not "
                "text") from None
    return record


def decode_line(data: bytes | str, *, batch_only: bool = True) -> Any:
    """A record from one line of JSON; raises InvalidRecord saying what is wrong."""
    _, decoder, _ = _codecs(batch_only)
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as exc:
        raise InvalidRecord(_reason(str(exc), _parsed(data), batch_only)) from None
    except (msgspec.DecodeError, RecursionError, UnicodeEncodeError):
        # Not JSON to msgspec (or too deep, or a str that is not text); Python's parser also
        # takes NaN, Infinity and lone surrogates, which a record then refuses by name.
        return decode(_parsed(data, strict=True), batch_only=batch_only)


def _parse_int(text: str) -> int | float:
    """Python refuses to convert an integer of more than 4300 digits (ValueError), which would
    fail a whole batch: such a number, past every field's range, is read as a float (inf) that
    its record is then rejected for, by the field's name."""
    return int(text) if len(text) <= 4000 else float(text)


def _json_loads(data: bytes | str) -> Any:
    """Python's json parser (for what msgspec refuses: NaN, Infinity, lone surrogates)."""
    return json.loads(data, parse_int=_parse_int)


def _parsed(data: bytes | str, *, strict: bool = False) -> Any:
    try:
        return _json_loads(data)
    except (ValueError, RecursionError) as exc:
        # ValueError: not JSON, or not UTF-8
        if strict:
            raise InvalidRecord(f"a record must be JSON: {_json_problem(exc)}") from None
        return None


def _json_problem(exc: Exception) -> str:
    return "nested too deep" if isinstance(exc, RecursionError) else str(exc)


def decode_records(raws: Iterable[Any]) -> tuple[list[Record], list[Rejection]]:
    """Decode what can be decoded (parsed JSON objects); every rejected record is returned with
    its reason."""
    records: list[Record] = []
    rejected: list[Rejection] = []
    for index, raw in enumerate(raws):
        try:
            records.append(decode(raw))
        except InvalidRecord as exc:
            rejected.append(Rejection(index, str(exc)))
    return records, rejected


def decode_batch(data: bytes | str) -> DecodedBatch:
    """A batch from JSON. The batch itself must be well formed; bad records inside are rejected
    one by one and the rest kept."""
    _, record_decoder, batch_decoder = _codecs(True)
    if isinstance(data, str):
        try:
            data = data.encode()
        except UnicodeEncodeError as exc:
            raise InvalidRecord(f"a batch must be JSON text: {exc}") from None
    try:
        whole = batch_decoder.decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError, RecursionError):
        whole = None
    if whole is not None:
        if not whole.batch_id:
            raise InvalidRecord("field 'batch_id' must not be empty")
        return DecodedBatch(Batch(batch_id=whole.batch_id, records=tuple(whole.records)), ())
    records: list[Record] = []
    rejected: list[Rejection] = []
    try:
        envelope = msgspec.json.decode(data, type=_Envelope)
    except (msgspec.DecodeError, RecursionError):
        batch_id, raws = _python_envelope(data)
        records, rejected = decode_records(raws)
        return DecodedBatch(Batch(batch_id=batch_id, records=tuple(records)), tuple(rejected))
    except msgspec.ValidationError as exc:
        _python_envelope(data)  # says what is wrong with the batch in its own words
        raise InvalidRecord(f"a batch must be {{'batch_id', 'records'}}: {exc}") from None
    if not envelope.batch_id:
        raise InvalidRecord("field 'batch_id' must not be empty")
    for index, raw in enumerate(envelope.records):
        try:
            records.append(record_decoder.decode(raw))
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            parsed = _parsed(bytes(raw))
            reason = _reason(str(exc), parsed, True) if parsed is not None else str(exc)
            rejected.append(Rejection(index, reason))
        except RecursionError:
            rejected.append(Rejection(index, _TOO_DEEP))
    return DecodedBatch(Batch(batch_id=envelope.batch_id, records=tuple(records)), tuple(rejected))


def _check_batch_id(batch_id: str) -> None:
    try:
        batch_id.encode()
    except UnicodeEncodeError:
        raise InvalidRecord("field 'batch_id' holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                            "which is not text") from None


def _python_envelope(data: bytes | str) -> tuple[str, list[Any]]:
    """batch_id and raw records of a batch parsed by Python's json (which msgspec refused)."""
    try:
        raw = _json_loads(data)
    except (ValueError, RecursionError) as exc:
        raise InvalidRecord(f"a batch must be JSON: {_json_problem(exc)}") from None
    if not isinstance(raw, Mapping):
        raise InvalidRecord("a batch must be a JSON object with 'batch_id' and 'records'")
    if "batch_id" not in raw:
        raise InvalidRecord("missing field 'batch_id'")
    batch_id = raw["batch_id"]
    if not isinstance(batch_id, str) or not batch_id:
        raise InvalidRecord("field 'batch_id' must be a non-empty string")
    _check_batch_id(batch_id)
    if "records" not in raw:
        raise InvalidRecord("missing field 'records'")
    raws = raw["records"]
    if not isinstance(raws, list):
        raise InvalidRecord("field 'records' must be a list")
    return batch_id, raws


# --- what was wrong, in words that name the field ---------------------------------------------

_AT = re.compile(r"^(?P<message>.*?)(?: - at `(?P<path>[^`]*)`)?$", re.S)
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]")
_WIRE_NAMES = {
    "int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean",
    "object": "an object", "array": "a list", "null": "null",
}


def _reason(message: str, raw: Any, batch_only: bool) -> str:
    """msgspec's validation message rewritten to name the field, its limits and the bad value."""
    found = _AT.match(message)
    assert found is not None
    text, path = found["message"], found["path"] or "$"
    steps: list[str | int] = [
        name if name else int(index) for name, index in _STEP.findall(path[1:])
    ]
    if text.startswith("Object missing required field"):
        missing = text.split("`")[1]
        if not steps and missing == "type":
            return _bad_type(None, batch_only)
        return _prefix(steps) + f"missing field {missing!r}"
    if not steps:
        if text.startswith("Expected `object`"):
            return f"a record must be a JSON object, got {_got(text)}"
        return text
    if steps == ["type"]:
        return _bad_type(_value(raw, steps), batch_only)
    element: str | int | None = None
    if isinstance(steps[-1], int):
        element = steps.pop()
    name = str(steps[-1])
    where = _prefix(steps[:-1]) + f"field {name!r}"
    info = _field_type(raw, steps)
    value = _value(raw, steps)
    if element is not None:
        item = f"{name}[{element}]"
        if "length <=" in text:
            return f"{where}: {item} is over {kinds.MAX_TEXT} characters"
        return f"{where} must be a list of {_plural(info)}: {item} is {_got(text)}"
    if text.startswith("Expected `array`"):
        return f"{where} must be a list of {_plural(info)}, got {_got(text)}"
    if text.startswith("Expected `str` of length >="):
        return f"{where} must not be empty"
    if text.startswith("Expected `str` of length <="):
        return f"{where} must be at most {kinds.MAX_TEXT} characters"
    if text.startswith(("Expected `int` >=", "Expected `int` <=")):
        lo, hi = _limits(info)
        return f"{where} must be between {lo} and {hi}, got {_short(value)}"
    if text.startswith("Invalid enum value"):
        accepted = ", ".join(str(e.value) for e in info.cls) if isinstance(
            info, mi.EnumType) else "?"
        return f"{where} must be one of {accepted}, got {_short(value)}"
    if text.startswith("Number out of range") or "finite" in text:
        return f"{where} must be a finite number, got {_short(value)}"
    if text.startswith("Expected `"):
        expected = text.split("`")[1]
        return f"{where} must be {_WIRE_NAMES.get(expected, expected)}, got {_got(text)}"
    return f"{where}: {text}"


def _bad_type(value: Any, batch_only: bool) -> str:
    accepted = ", ".join(record_types(batch_only=batch_only))
    return f"field 'type' must be one of {accepted}, got {_short(value)}"


def _prefix(steps: Sequence[str | int]) -> str:
    """`groups[1]: ` for a field inside the second element of `groups`."""
    if not steps:
        return ""
    text = "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in steps).lstrip(".")
    return f"{text}: "


def _got(text: str) -> str:
    return text.rsplit("got `", 1)[-1].rstrip("`") if "got `" in text else "something else"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _value(raw: Any, steps: Sequence[str | int]) -> Any:
    for step in steps:
        try:
            raw = raw[step]
        except (KeyError, IndexError, TypeError):
            return None
    return raw


def _field_type(raw: Any, steps: Sequence[str | int]) -> Any:
    """The msgspec type info of the field at `steps` in the record `raw` claims to be."""
    tag = raw.get("type") if isinstance(raw, Mapping) else None
    layout = kinds.by_tag(tag) if isinstance(tag, str) else None
    if layout is None:
        return None
    info: Any = mi.type_info(layout.kind)
    for step in steps:
        info = info.type if isinstance(info, mi.Metadata) else info
        if isinstance(step, int):
            info = info.item_type if isinstance(info, mi.VarTupleType | mi.ListType) else None
        elif isinstance(info, mi.StructType):
            info = next((f.type for f in info.fields if f.encode_name == step), None)
        else:
            return None
        if info is None:
            return None
    return info.type if isinstance(info, mi.Metadata) else info


def _limits(info: Any) -> tuple[Any, Any]:
    if isinstance(info, mi.IntType):
        return info.ge, info.le
    return "?", "?"


def _plural(info: Any) -> str:
    item = info.item_type if isinstance(info, mi.VarTupleType | mi.ListType) else None
    item = item.type if isinstance(item, mi.Metadata) else item
    if isinstance(item, mi.StrType):
        return "strings"
    if isinstance(item, mi.IntType):
        return "non-negative integers" if (item.ge or 0) >= 0 else "integers"
    if isinstance(item, mi.StructType):
        return "objects"
    return "values"
