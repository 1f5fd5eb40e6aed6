#!/usr/bin/env bash
# Make this host ready for the SLURM system test (tests/system/test_slurm.py), as root on
# Debian: install SLURM's daemons and client (slurmctld, slurmd, slurm-client: what Debian's
# slurm-wlm brings, less its optional plugins) and munge where absent. It starts nothing: the
# test runs its own single-node cluster (munged, slurmctld, slurmd) from a temporary folder,
# on ports of its own, and stops it at the end.
set -euo pipefail
log=/tmp/hogshard-slurm-setup.log
: > "$log"

need=()
command -v munged >/dev/null || need+=(munge)
command -v slurmctld >/dev/null || need+=(slurmctld)
command -v slurmd >/dev/null || need+=(slurmd)
command -v sbatch >/dev/null || need+=(slurm-client)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "slurm-setup: ${need[*]} missing, and installing needs root and apt-get" >&2
  exit 1
fi
# A dpkg run cut short leaves packages unconfigured; finish it first (as docker-setup.sh does).
if [ -n "$(dpkg --audit 2>/dev/null)" ]; then
  echo "slurm-setup: finishing an interrupted dpkg run (dpkg --configure -a)" >&2
  DEBIAN_FRONTEND=noninteractive dpkg --configure -a >>"$log" 2>&1
fi
echo "slurm-setup: apt-get install ${need[*]}" >&2
apt-get update -q >>"$log" 2>&1
if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${need[@]}" \
    >>"$log" 2>&1; then
  tail -n 20 "$log" >&2
  exit 1
fi
