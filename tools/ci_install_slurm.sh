#!/usr/bin/env bash
# Installs Slurm (slurmctld, slurmd, the client commands) and munge from Debian's packages for the tests
# on a real Slurm (tests/launchers/test_slurm.py), which start their own daemons on a temporary config.
# Idempotent: does nothing when the commands are already there. Needs root (CI runs as root).
set -euo pipefail

needed=(sbatch scontrol slurmctld slurmd munged)
missing=0
for cmd in "${needed[@]}"; do
    PATH=$PATH:/usr/sbin command -v "$cmd" > /dev/null 2>&1 || missing=1
done
if ((missing == 0)); then
    echo "ci_install_slurm: Slurm and munge already installed"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -q
# The packages' own services are not started (no init system here; the tests start the daemons).
apt-get install -y -q --no-install-recommends slurmctld slurmd slurm-client munge
