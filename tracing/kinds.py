"""How a record kind is declared, and everything derived from the declaration.

A record kind is declared once, in `tracing.events`, as a frozen msgspec `Struct` subclass of
`RecordBase` with a `tag` (its `type` on the wire) and a `TABLE` (`Stored`: where it is kept).
Its field annotations say everything else:

- the Python type and the wire form (msgspec encodes and decodes it, validating as it goes);
- the limits a decoded value must keep (`U32`, `U64`, `I32`, `I64`, `Name`, `Text`, ...), which
  become the validation messages of `tracing.wire`;
- the ClickHouse column type (`U32` is `UInt32`, a `str` or an enum is `String`, a tuple is an
  `Array`, a tuple of nested structs becomes one array column per nested field);
- the column name (the field name, or `column("...")` where SQL needs another one).

From that, this module derives each kind's columns (`layout`), its rows and column batches for
an insert, and the record back from a row read. `tracing.store.schema` derives the DDL from the
same layout. Declaring a new kind with `@record_kind` therefore puts it on the wire, in the
schema and in the column batches without touching any other file.

Nothing here knows a particular kind; nothing here touches the network or a store.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, TypeVar

import msgspec
from msgspec import Meta
from msgspec import inspect as mi

MAX_TEXT = 4096
"""The longest string any field may hold (a stack frame, a verdict summary, a node name)."""

# --- field types: the Python type, the limits on the wire, the ClickHouse column type ---------

_CH = "clickhouse_type"
_COLUMN = "column"

def integer(clickhouse_type: str, *, ge: int, le: int) -> Meta:
    """An integer field's limits on the wire and its ClickHouse type
    (`Annotated[int, integer("UInt64", ge=1, le=2**64 - 1)]`)."""
    return Meta(ge=ge, le=le, extra={_CH: clickhouse_type})


U32 = Annotated[int, integer("UInt32", ge=0, le=2**31 - 1)]
"""A count or id that fits 31 bits (attempt, pid): UInt32."""
MAX_U64 = 2**63 - 1
"""The largest value a UInt64 field takes on the wire: msgspec checks limits within int64, and
no time in microseconds, byte count or sequence id comes near it."""
U64 = Annotated[int, integer("UInt64", ge=0, le=MAX_U64)]
"""A non-negative 64-bit integer (times in microseconds, byte counts): UInt64."""
I32 = Annotated[int, integer("Int32", ge=-(2**31 - 1), le=2**31 - 1)]
"""A signed 32-bit integer (exit codes): Int32."""
I64 = Annotated[int, integer("Int64", ge=-(2**63), le=2**63 - 1)]
"""A signed 64-bit integer: Int64."""
NON_EMPTY = Meta(min_length=1, max_length=MAX_TEXT)
"""The limits of a string that must not be empty (`Annotated[JobId, NON_EMPTY]`)."""
BOUNDED = Meta(max_length=MAX_TEXT)
"""The limits of a string that may be empty."""
Name = Annotated[str, NON_EMPTY]
"""A string that must not be empty (device, op, metric): String."""
Text = Annotated[str, BOUNDED]
"""A string that may be empty: String."""
F64 = float
"""A finite number (NaN and infinities are refused): Float64."""


def column(name: str) -> Meta:
    """Store a field under another column name (`Annotated[str, column("group_id")]`); on a
    field holding nested structs, the prefix of their columns."""
    return Meta(extra={_COLUMN: name})


NOT_STORED = Meta(extra={_COLUMN: None})
"""A field that is not a column (filled in when read back, such as an incident's actions)."""


@dataclass(frozen=True, slots=True)
class Stored:
    """Where a record kind is kept: one ClickHouse table."""

    table: str
    time: str
    """The microsecond column the table is partitioned by (per day)."""
    order_by: tuple[str, ...]
    key: tuple[str, ...] = ()
    """Columns that identify a row within one batch: a retried batch's rows whose key is already
    stored under the same batch_id are not written again (batch kinds only)."""
    engine: str = "MergeTree"
    batch: bool = True
    """Records of this kind arrive in batches from ranks and node agents (the table then has a
    `batch_id` column); False for what the controller writes itself (incidents, actions)."""


class RecordBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    """The base of every record kind. Construction does not validate (records built in this
    process are trusted); decoding from the wire does. Floats must be finite either way."""

    TABLE: ClassVar[Stored]

    def __post_init__(self) -> None:
        for name in _FLOAT_FIELDS.get(type(self), ()):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise ValueError(f"field {name!r} must be a finite number, got {value!r}")


_FLOAT_FIELDS: dict[type, tuple[str, ...]] = {}
R = TypeVar("R", bound=RecordBase)


# --- columns -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type: str
    """A ClickHouse type understood by 18.16 and chdb (String, UInt64, Array(String), ...)."""


Getter = Callable[[Any], Any]
Reader = Callable[[Any], Any]


@dataclass(frozen=True, slots=True)
class _Scalar:
    field: str
    column: Column
    to_db: Getter
    from_db: Reader


@dataclass(frozen=True, slots=True)
class _Nested:
    """A tuple of nested structs, kept as one array column per nested field."""

    field: str
    struct: type[msgspec.Struct]
    parts: tuple[_Scalar, ...]


@dataclass(frozen=True, slots=True)
class Layout:
    """A record kind's table columns and its conversions to and from rows."""

    kind: type[RecordBase]
    tag: str
    stored: Stored
    columns: tuple[Column, ...]
    """Every column an insert writes, in order (`batch_id` first for batch kinds)."""
    _fields: tuple[_Scalar | _Nested, ...]

    @property
    def column_names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.columns)

    @property
    def read_columns(self) -> tuple[str, ...]:
        """The columns a record is read back from, in order: all but batch_id."""
        return tuple(c.name for c in self.columns if c.name != "batch_id")

    def column_batch(self, records: Sequence[Any], batch_id: str = "") -> list[list[Any]]:
        """`records` (all of this kind) as one list per column, ready for one insert."""
        out: list[list[Any]] = [[batch_id] * len(records)] if self.stored.batch else []
        for f in self._fields:
            if isinstance(f, _Scalar):
                out.append([f.to_db(getattr(r, f.field)) for r in records])
                continue
            for part in f.parts:
                out.append([
                    [part.to_db(getattr(p, part.field)) for p in getattr(r, f.field)]
                    for r in records
                ])
        return out

    def rows(self, records: Sequence[Any], batch_id: str = "") -> list[tuple[Any, ...]]:
        """`records` as rows in column order."""
        return list(zip(*self.column_batch(records, batch_id), strict=True))

    def from_row(self, row: Sequence[Any]) -> Any:
        """The record a row read back in `read_columns` order stands for."""
        values: dict[str, Any] = {}
        i = 0
        for f in self._fields:
            if isinstance(f, _Scalar):
                values[f.field] = f.from_db(row[i])
                i += 1
                continue
            arrays = row[i:i + len(f.parts)]
            i += len(f.parts)
            # A part added to the declaration after the row was stored reads back as an empty
            # array (the column was added to an older table): its field keeps its default.
            length = len(arrays[0]) if arrays else 0
            present = []
            for part, array in zip(f.parts, arrays, strict=True):
                if len(array) == length:
                    present.append((part, array))
                elif len(array):
                    raise ValueError(f"{self.kind.__name__}.{f.field}: column of "
                                     f"{part.field} holds {len(array)} values, not {length}")
            values[f.field] = tuple(
                f.struct(**{p.field: p.from_db(a[k]) for p, a in present})
                for k in range(length)
            )
        return self.kind(**values)


def _identity(value: Any) -> Any:
    return value


def _scalar_type(info: Any, where: str) -> tuple[str, Getter, Reader]:
    """The ClickHouse type of a scalar field and its conversions to and from a column value."""
    extra: dict[str, Any] = {}
    if isinstance(info, mi.Metadata):
        extra = info.extra or {}
        info = info.type
    if isinstance(info, mi.IntType):
        if _CH not in extra:
            raise TypeError(f"{where}: declare the integer's width (U32, U64, I32 or I64)")
        return str(extra[_CH]), _identity, int
    if isinstance(info, mi.StrType):
        return "String", _identity, str
    if isinstance(info, mi.FloatType):
        return "Float64", float, float
    if isinstance(info, mi.BoolType):
        return "UInt8", int, bool
    if isinstance(info, mi.EnumType):
        cls = info.cls
        return "String", _enum_value, cls
    if isinstance(info, mi.VarTupleType | mi.ListType):
        inner, to_db, from_db = _scalar_type(info.item_type, where)
        return (
            f"Array({inner})",
            lambda v: [to_db(x) for x in v],
            lambda v: tuple(from_db(x) for x in v),
        )
    raise TypeError(f"{where}: a {type(info).__name__} field cannot be a column")


def _enum_value(value: enum.Enum) -> Any:
    return value.value


def _column_name(info: Any, default: str) -> str | None:
    if isinstance(info, mi.Metadata) and info.extra and _COLUMN in info.extra:
        name: str | None = info.extra[_COLUMN]
        return name
    return default


def _nested_struct(info: Any) -> type[msgspec.Struct] | None:
    inner = info.type if isinstance(info, mi.Metadata) else info
    if isinstance(inner, mi.VarTupleType | mi.ListType):
        item = inner.item_type
        item = item.type if isinstance(item, mi.Metadata) else item
        if isinstance(item, mi.StructType):
            return item.cls
    return None


def _layout(kind: type[RecordBase]) -> Layout:
    stored = kind.TABLE
    info = mi.type_info(kind)
    assert isinstance(info, mi.StructType)
    columns: list[Column] = [Column("batch_id", "String")] if stored.batch else []
    fields: list[_Scalar | _Nested] = []
    floats: list[str] = []
    for f in info.fields:
        where = f"{kind.__name__}.{f.name}"
        name = _column_name(f.type, f.name)
        if name is None:
            continue
        nested = _nested_struct(f.type)
        if nested is not None:
            parts = []
            for p in mi.type_info(nested).fields:  # type: ignore[attr-defined]
                ch, to_db, from_db = _scalar_type(p.type, f"{where}.{p.name}")
                part_name = f"{name}_{_column_name(p.type, p.name)}"
                part = _Scalar(p.name, Column(part_name, f"Array({ch})"), to_db, from_db)
                parts.append(part)
                columns.append(part.column)
            fields.append(_Nested(f.name, nested, tuple(parts)))
            continue
        ch, to_db, from_db = _scalar_type(f.type, where)
        if ch == "Float64":
            floats.append(f.name)
        scalar = _Scalar(f.name, Column(name, ch), to_db, from_db)
        fields.append(scalar)
        columns.append(scalar.column)
    _FLOAT_FIELDS[kind] = tuple(floats)
    names = {c.name for c in columns}
    for needed in (stored.time, *stored.order_by, *stored.key):
        if needed not in names:
            raise TypeError(f"{kind.__name__}.TABLE names column {needed!r}, which it lacks")
    tag = kind.__struct_config__.tag
    if not isinstance(tag, str):
        raise TypeError(f"{kind.__name__} needs a string tag (its `type` on the wire)")
    return Layout(kind, tag, stored, tuple(columns), tuple(fields))


# --- the registry of kinds -----------------------------------------------------------------

_LAYOUTS: dict[type, Layout] = {}
_BY_TAG: dict[str, Layout] = {}
_generation = 0


def record_kind(kind: type[R]) -> type[R]:
    """Register a record kind (a class decorator): it is on the wire, in the schema and in the
    column batches from now on. Registering a tag or table twice is an error."""
    global _generation
    layout = _layout(kind)
    if layout.tag in _BY_TAG:
        raise TypeError(f"record type {layout.tag!r} is already declared by "
                        f"{_BY_TAG[layout.tag].kind.__name__}")
    if any(other.stored.table == layout.stored.table for other in _LAYOUTS.values()):
        raise TypeError(f"table {layout.stored.table!r} is already used by another record kind")
    _LAYOUTS[kind] = layout
    _BY_TAG[layout.tag] = layout
    _generation += 1
    return kind


def forget_kind(kind: type[RecordBase]) -> None:
    """Undo `record_kind` (for kinds that only a test declares)."""
    global _generation
    layout = _LAYOUTS.pop(kind, None)
    if layout is not None:
        del _BY_TAG[layout.tag]
        _generation += 1


def generation() -> int:
    """A number that changes whenever a kind is registered or forgotten (for caches)."""
    return _generation


def layout(kind: type[RecordBase]) -> Layout:
    """The layout of a registered kind."""
    try:
        return _LAYOUTS[kind]
    except KeyError:
        raise TypeError(f"{kind.__name__} is not a registered record kind") from None


def layouts(*, batch: bool | None = None) -> tuple[Layout, ...]:
    """Every registered kind's layout in registration order (only batch kinds, or only the
    others, when `batch` says so)."""
    return tuple(x for x in _LAYOUTS.values() if batch is None or x.stored.batch == batch)


def by_tag(tag: str) -> Layout | None:
    return _BY_TAG.get(tag)


def group_by_kind(records: Iterable[RecordBase]) -> dict[type, list[Any]]:
    """Records sorted by kind, each kind in the order given."""
    out: dict[type, list[Any]] = {}
    for record in records:
        out.setdefault(type(record), []).append(record)
    return out
