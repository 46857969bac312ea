"""The dashboard on an embedded store that another real process holds (as a running `tracehound
run` does): it reads through that process, and never writes; when the holder ends, the page's
next call opens the directory itself and shares it in turn, without a page in between that
cannot read the store; closing the dashboard's store stops that."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from holder_harness import StoreHolder
from ui_harness import app, texts

from tracehound.tracing.errors import PermanentStoreError
from tracehound.tracing.events import JobPhase, JobState
from tracehound.tracing.ids import JobId
from tracehound.tracing.store import open_store
from tracehound.tracing.store.client import SharedStoreClient
from tracehound.tracing.store.sharing import endpoint_path, read_endpoint
from tracehound.ui.store import close_shared_store, shared_store

JOB = JobId("held-job")


def test_the_dashboard_reads_a_held_store_then_holds_it_when_the_holder_ends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directory = tmp_path / "store"
    url = f"chdb://{directory}"
    holder = StoreHolder()
    try:
        holder.hold(url)
        with open_store(url) as writer:  # a client: the holder writes what it is sent
            assert isinstance(writer, SharedStoreClient)
            writer.record_state(JobState(job=JOB, time_us=1_700_000_000_000_000, seq=1,
                                         state=JobPhase.RUNNING, attempt=0, nodes=("node-0",)))

        at = app(url, "jobs", monkeypatch)
        dashboards = shared_store(url).store
        assert isinstance(dashboards, SharedStoreClient)
        assert any(JOB in str(df.value.to_dict()) for df in at.dataframe)
        with pytest.raises(PermanentStoreError, match="read-only and refuses record_state"):
            dashboards.record_state(JobState(job=JOB, time_us=1, seq=2, state=JobPhase.FAILED,
                                             attempt=0))

        holder.release()  # the run that held the store ended
        at.run()  # the dashboard's client opens the directory itself, and shares it
        assert not at.exception, [e.value for e in at.exception]
        assert any(JOB in str(df.value.to_dict()) for df in at.dataframe)
        assert "The trace store cannot be read now" not in "\n".join(texts(at))
        assert shared_store(url).store is dashboards
        published = read_endpoint(str(directory))
        assert published is not None and published.pid == os.getpid()
        with pytest.raises(PermanentStoreError, match="read-only and refuses record_state"):
            dashboards.record_state(JobState(job=JOB, time_us=1, seq=2, state=JobPhase.FAILED,
                                             attempt=0))

        close_shared_store()
        assert not endpoint_path(str(directory)).exists()
    finally:
        close_shared_store()
        holder.stop()
