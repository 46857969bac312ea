"""What can go wrong with a store, sorted by what the caller can do about it.

    StoreError
    ├── StoreConfigError      the URL or a setting is wrong: fix it, retrying will not help
    ├── PermanentStoreError   the store refused the request for good (bad schema, bad query)
    └── TemporaryStoreError   the store is unreachable or busy: retry after `retry_after` seconds

Third-party errors are wrapped and chained (`raise ... from exc`), so the original stays visible.
`shown` cuts a value short for a message.
"""

import reprlib


class StoreError(Exception):
    """Any failure of a trace store."""


class StoreConfigError(StoreError):
    """A store URL or setting that cannot work as given."""


class PermanentStoreError(StoreError):
    """The store answered and refused; the same request will fail again."""


class TemporaryStoreError(StoreError):
    """The store could not be reached or was busy; the same request may succeed later."""

    def __init__(self, message: str, *, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlong = 3, 200, 200, 200
_SHOWN.maxlist = _SHOWN.maxtuple = _SHOWN.maxdict = _SHOWN.maxset = 10


def shown(value: object) -> str:
    """`repr(value)` cut short, for an error message: a YAML document's aliases can make a value
    of a few lines stand for billions of elements ("billion laughs"), which a plain repr would
    spell out."""
    return _SHOWN.repr(value)
