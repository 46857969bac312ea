"""The real Slurm cluster of the tests here: `slurm_cluster`, started once per session by
`tests/slurm_harness.py` (munged and slurmctld on this machine, two slurmd nodes in network
namespaces of their own) and stopped at the session's end.

Every test that uses it is marked `e2e` (it runs real daemons and jobs: the serial lane of
`make test`) and `slurm`. After each such test the cluster is reset for the next: its jobs are
cancelled and drained nodes resumed, and every node is idle again.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for `import slurm_harness`

from slurm_harness import SlurmCluster, start_cluster


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    """A running two-node Slurm cluster: `node_names`, `env` (SLURM_CONF for sbatch, squeue,
    scontrol), `host_address` (where its jobs reach a service of the test), `sbatch`,
    `job_state`, `wait_job_state`, `wait_nodes_idle` and `run`."""
    cluster = start_cluster(tmp_path_factory.mktemp("slurm-cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(autouse=True)
def _fresh_cluster(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "slurm_cluster" in request.fixturenames:
        cluster: SlurmCluster = request.getfixturevalue("slurm_cluster")
        cluster.reset()
