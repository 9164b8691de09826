#!/usr/bin/env bash
# One node's share of a Slurm job: torchrun for the node's processes, immune to the stop signal it relays.
# usage (from slurm/pretrain.sh, one srun task per node): slurm/node_launch.sh [torchrun options] SCRIPT [args]
# A stop is SIGUSR1 to the trainer processes. Slurm delivers a step signal to every process of the
# step, torchrun included, and torchrun has no USR1 handler (the default action kills it, and with it
# the trainers mid-checkpoint). So torchrun starts with USR1 ignored (inherited through exec; the
# trainer installs its own handler), and this wrapper also relays USR1/TERM to torchrun's workers by
# parent PID for process-tracking plugins that signal only the task itself.
set -euo pipefail
# --help (or nothing) stops here: torchrun would answer with its own help, or start nothing useful
case "${1:-}" in
  -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
  "")        sed -n '2,8p' "$0" >&2; exit 2 ;;
esac
# this node's address as Slurm knows it: emulated nodes share one host under unresolvable names
if [ -n "${SLURMD_NODENAME:-}" ]; then
  LOCAL_ADDR=$(scontrol show node "$SLURMD_NODENAME" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
else
  LOCAL_ADDR=127.0.0.1
fi
trap '' USR1
python3 launch/torchrun.py --local-addr "$LOCAL_ADDR" "$@" &   # torchrun, exiting with the failed rank's status
TORCHRUN_PID=$!
stop() {
  echo "node_launch.sh[${SLURMD_NODENAME:-local}]: $1 -> USR1 to the trainers under torchrun $TORCHRUN_PID"
  # only torchrun's worker processes (they run the training script), not any helper it forks
  pkill -USR1 -P "$TORCHRUN_PID" -f -- "${COMERA_TRAIN_SCRIPT:-launch/train.py}" || true
}
trap 'stop USR1' USR1
trap 'stop TERM' TERM
while :; do
  wait "$TORCHRUN_PID" && rc=0 || rc=$?
  kill -0 "$TORCHRUN_PID" 2>/dev/null || break   # woken by a trap: keep waiting for torchrun
done
exit "$rc"
