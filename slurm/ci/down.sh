#!/usr/bin/env bash
# Tear down the cluster started by slurm/ci/up.sh: cancel jobs, stop every daemon by its recorded PID.
# usage: slurm/ci/down.sh      env: SLURM_CI_DIR (default /tmp/comera-slurm-ci)
set -uo pipefail
D=${SLURM_CI_DIR:-/tmp/comera-slurm-ci}
export SLURM_CONF="$D/etc/slurm.conf"
if [ -f "$D/run/slurmctld.pid" ] && kill -0 "$(cat "$D/run/slurmctld.pid")" 2>/dev/null; then
  scancel --quiet --user="$(id -un)" 2>/dev/null || true
  for _ in $(seq 50); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
fi
pids=()
for f in "$D"/run/slurmd-*.pid "$D/run/slurmctld.pid" "$D/run/munged.pid"; do
  [ -e "$f" ] || continue
  p=$(cat "$f"); kill "$p" 2>/dev/null && pids+=("$p")
done
# each daemon takes about 2 s to exit: signal all first, then wait for all
for _ in $(seq 150); do
  alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
  [ $alive = 0 ] && break; sleep 0.1
done
for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && kill -9 "$p"; done
rm -f "$D"/run/*.pid
echo "slurm down"
