"""The incident dashboard: a Streamlit script, served by `tracehound ui` (`streamlit run` on this
file). It reads the store named by `--store URL` after the script's `--`, else $TRACEHOUND_STORE,
else the embedded default; it never writes to it.

Views (`?view=` in the address, so an alert or a colleague can link to one):
jobs, incident (`&job=J&incident=ID`), progress, stragglers, health. The sidebar picks the job,
the time range and the nodes, and refreshes a running job's view every `--refresh` seconds.
"""

from __future__ import annotations

import argparse
import sys

import streamlit as st

from tracehound.tracing.errors import StoreError
from tracehound.ui import views
from tracehound.ui.store import reopen_after, shared_store


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tracehound ui (app)", add_help=False)
    parser.add_argument("--store", default=None)
    parser.add_argument("--refresh", type=float, default=5.0)
    known, _ = parser.parse_known_args(argv)
    return known


def main() -> None:
    st.set_page_config(page_title="Tracehound", layout="wide")
    args = _args(sys.argv[1:])
    opened = shared_store(args.store)
    if opened.error is not None:
        st.title("Tracehound")
        st.error("The trace store cannot be opened.")
        st.text(opened.error)
        return
    assert opened.store is not None
    try:
        views.render(opened.store, refresh_s=max(args.refresh, 1.0))
    except StoreError as exc:  # the server went away, refused the login, ...: say so, plainly
        st.error("The trace store cannot be read now; the page tries again when reloaded.")
        st.text(f"{opened.store.url}: {exc}")
        reopen_after(exc)  # the process that held it may have ended


main()
