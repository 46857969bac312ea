#!/usr/bin/env bash
# Installs Debian's Slurm (slurmctld, slurmd, the client commands) and munge when one of them is
# missing, for the tests that run jobs on a real Slurm cluster (tests/slurm). Idempotent and
# quick when they are there: nothing is fetched then. The daemons are not started here (no
# systemd): tests/slurm_harness.py starts its own, with their files under a temp dir.
set -euo pipefail

missing=()
for binary in slurmctld slurmd scontrol munged; do
    command -v "$binary" >/dev/null 2>&1 || [[ -x /usr/sbin/$binary ]] || missing+=("$binary")
done
if (( ${#missing[@]} == 0 )); then
    exit 0
fi
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
    echo "install-slurm: ${missing[*]} missing; as root: apt-get install -y slurmctld slurmd slurm-client munge" >&2
    exit 1
fi
echo "== installing slurmctld, slurmd, slurm-client and munge (Debian packages)"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null; }
echo "   $(slurmctld -V) installed"
