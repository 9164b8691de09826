#!/usr/bin/env bash
# Run comera pretraining under torchrun (one node here; set NNODES/NODE_RANK/MASTER_ADDR for more).
# usage: launch/torchrun.sh [--dry-run] --config CONFIG [trainer options...]
#   --dry-run   check the run (comera pretrain --dry-run at NNODES x NPROC ranks), print the torchrun command, exit
# env:   NPROC (processes per node, default: the node's GPUs, or 2 on CPU), NNODES (default 1), NODE_RANK
#        (default 0), MASTER_ADDR (node rank 0's address, required when NNODES > 1; default 127.0.0.1),
#        MASTER_PORT (default 29500),
#        DS_ACCELERATOR (default: cuda when a GPU is visible, else cpu; see launch/accelerator.sh),
#        TORCHRUN (a command, split on blanks; default: COMERA_PYTHON launch/torchrun.py, torchrun exiting with
#        the failed rank's own status), COMERA_PYTHON (one path, spaces allowed; default python3, .venv's first)
# The trainer's options: comera pretrain --help.
set -euo pipefail
usage() { sed -n '2,11p' "$0"; }   # the header above; read before the cd below, while $0 still resolves
# --help first: otherwise torchrun would start NPROC trainers that each print their own help
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
[ $# -gt 0 ] || { usage >&2; exit 2; }
# Several nodes meet at node rank 0's address. A loopback default would send every other node to its own
# loopback, where each waits out torchrun's rendezvous timeout (600 s) alone.
if [ "${NNODES:-1}" != 1 ] && [ -z "${MASTER_ADDR:-}" ]; then
  echo "torchrun.sh: NNODES=$NNODES spans nodes but MASTER_ADDR is not set; export MASTER_ADDR=<address of node" \
       "rank 0>, the same on every node" >&2
  exit 2
fi
cd "$(dirname "$0")/.."
[ -d .venv ] && export PATH="$PWD/.venv/bin:$PATH"

. launch/accelerator.sh   # DS_ACCELERATOR: cuda on a GPU node, cpu otherwise or when asked
. launch/preflight.sh     # comera_check_run: the trainer's check of the run, as slurm/pretrain.sh makes it
NPROC=${NPROC:-$([ "$COMERA_LOCAL_GPUS" -gt 0 ] && echo "$COMERA_LOCAL_GPUS" || echo 2)}

# --max-restarts 0: a dead rank ends the job (torchrun then stops the other ranks) instead of
# restarting it into a group whose peers are mid-collective; Slurm requeue handles restarts.
if [ -n "${TORCHRUN:-}" ]; then
  read -ra cmd <<< "$TORCHRUN"
else
  cmd=("${COMERA_PYTHON:-python3}" launch/torchrun.py)   # one word: a checkout path with spaces stays whole
fi
cmd+=(--nnodes "${NNODES:-1}" --node-rank "${NODE_RANK:-0}" --nproc-per-node "$NPROC"
     --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" --max-restarts 0
     launch/train.py "$@")
if [ "$DRY_RUN" = 1 ]; then
  # a bad key or a batch the world size does not divide: the one-line refusal, exit 2, not a printed command.
  # Counts that are not numbers go to the trainer as written, which refuses them, rather than to bash arithmetic.
  world="${NNODES:-1}x$NPROC"
  if [[ "${NNODES:-1}" =~ ^[1-9][0-9]*$ && "$NPROC" =~ ^[1-9][0-9]*$ ]]; then world=$((${NNODES:-1} * NPROC)); fi
  comera_check_run torchrun.sh "$world" "$@" || exit
  echo "DS_ACCELERATOR=$DS_ACCELERATOR" >&2; printf '%q' "${cmd[0]}"; printf ' %q' "${cmd[@]:1}"; echo   # quoted: pastable
  exit 0
fi
exec "${cmd[@]}"
