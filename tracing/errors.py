"""What can go wrong with a store, sorted by what the caller can do about it.

    StoreError
    ├── StoreConfigError      the URL or a setting is wrong: fix it, retrying will not help
    ├── PermanentStoreError   the store refused the request for good (bad schema, bad query)
    └── TemporaryStoreError   the store is unreachable or busy: retry after `retry_after` seconds

Third-party errors are wrapped and chained (`raise ... from exc`), so the original stays visible.
"""


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
