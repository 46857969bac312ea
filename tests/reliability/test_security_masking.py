"""Messages about a malformed store or sink URL name it without its password: the node agent's
sink, the store factory and a receiver's URL (whose path may be its token)."""

from __future__ import annotations

import pytest

from tracehound.agent.node.daemon import make_sink
from tracehound.controller.alerts import shown_url
from tracehound.tracing.errors import StoreConfigError
from tracehound.tracing.store import open_store

CANARY = "pw-canary-5e1d"


@pytest.mark.parametrize("url", [
    f"clickhose://user:{CANARY}@ch:9000/db",  # a misspelt scheme
    f"ftp://user:{CANARY}@ch/db",
])
def test_a_bad_sink_or_store_url_is_shown_masked(url: str) -> None:
    for opening in (make_sink, open_store):
        with pytest.raises(StoreConfigError) as raised:
            opening(url)
        assert CANARY not in str(raised.value)
        assert "user:***@ch" in str(raised.value)


@pytest.mark.parametrize(("url", "shown"), [
    (f"https://hooks.slack.com/services/T0/B0/{CANARY}", "https://hooks.slack.com/..."),
    (f"http://127.0.0.1:9093/api/v2/alerts?token={CANARY}", "http://127.0.0.1:9093/..."),
    (f"https://user:{CANARY}@[::1]:8443/", "https://[::1]:8443"),
    ("http://am:9093", "http://am:9093"),
    (f"http://[::1/{CANARY}", "?"),
])
def test_a_receivers_url_is_shown_without_path_query_or_user(url: str, shown: str) -> None:
    assert shown_url(url) == shown
