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
  node=$(scontrol show node "$SLURMD_NODENAME" 2>&1) || true   # its answer, or its complaint ("Node n9 not found")
  LOCAL_ADDR=$(grep -o 'NodeAddr=[^ ]*' <<<"$node" | cut -d= -f2) || LOCAL_ADDR=""
  if [ -z "$LOCAL_ADDR" ]; then
    echo "node_launch.sh: no NodeAddr for this node from 'scontrol show node $SLURMD_NODENAME': ${node:-no output}" >&2
    exit 1
  fi
else
  LOCAL_ADDR=127.0.0.1
fi
. "$(dirname "${BASH_SOURCE[0]}")/child_status.sh"   # comera_start, comera_wait: torchrun's own status
trap '' USR1
# torchrun, exiting with the failed rank's status, under a keeper subshell that outlives the step's TERM
comera_start TERM python3 launch/torchrun.py --local-addr "$LOCAL_ADDR" "$@"
stop() {
  local torchrun
  torchrun=$(pgrep -P "$COMERA_CHILD" | tr '\n' ' ' || true)
  echo "node_launch.sh[${SLURMD_NODENAME:-local}]: $1 -> USR1 to the trainers under torchrun ${torchrun% }"
  # only torchrun's worker processes (they run the training script), not any helper it forks
  for pid in $torchrun; do pkill -USR1 -P "$pid" -f -- "${COMERA_TRAIN_SCRIPT:-launch/train.py}" || true; done
}
trap 'stop USR1' USR1
trap 'stop TERM' TERM
comera_wait && rc=0 || rc=$?
exit "$rc"
