#!/usr/bin/env bash
# Run comera pretraining under torchrun (one node here; set NNODES/NODE_RANK/MASTER_ADDR for more).
# usage: launch/torchrun.sh [--dry-run] --config CONFIG [trainer options...]
#   --dry-run   print the torchrun command and exit
# env:   NPROC (processes per node, default 2), NNODES (default 1), NODE_RANK (default 0),
#        MASTER_ADDR (default 127.0.0.1), MASTER_PORT (default 29500)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] && export PATH="$PWD/.venv/bin:$PATH"
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
[ $# -gt 0 ] || { sed -n '3,6p' "$0" >&2; exit 2; }

export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# --max-restarts 0: a dead rank ends the job (torchrun then stops the other ranks) instead of
# restarting it into a group whose peers are mid-collective; Slurm requeue handles restarts.
cmd=(torchrun --nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "${NPROC:-2}"
     --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" --max-restarts 0
     launch/train.py "$@")
if [ "$DRY_RUN" = 1 ]; then echo "${cmd[*]}"; exit 0; fi
exec "${cmd[@]}"
