#!/usr/bin/env bash
# Run comera pretraining under Open MPI's mpirun. Each rank finds its rank and world size through
# MPI (mpi4py, DeepSpeed's MPI discovery in engine/distributed.py) and rendezvouses over gloo.
# usage: launch/mpirun.sh [--dry-run] --config CONFIG [trainer options...]
#   --dry-run   check the run (comera pretrain --dry-run at NP ranks), print the mpirun command and exit
# env:   NP (total processes, default: this node's GPUs, or 2 on CPU), MPIRUN (default: mpirun on PATH, the venv's first),
#        MASTER_ADDR (rank 0's host; needed when the ranks span hosts, 127.0.0.1 on one host), MASTER_PORT
#        (default 29500), MPIRUN_ARGS (extra args, e.g. a hostfile),
#        DS_ACCELERATOR (default: cuda when a GPU is visible, else cpu; see launch/accelerator.sh)
# The trainer's options: comera pretrain --help.
set -euo pipefail
usage() { sed -n '2,10p' "$0"; }   # the header above; read before the cd below, while $0 still resolves
# --help first: otherwise mpirun would start NP trainers that each print their own help
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
[ $# -gt 0 ] || { usage >&2; exit 2; }
cd "$(dirname "$0")/.."
[ -d .venv ] && export PATH="$PWD/.venv/bin:$PATH"

# The rendezvous address: ranks on one host meet on loopback (engine/distributed.py), so no rank listens on a
# public interface by accident; ranks on several hosts need MASTER_ADDR, and without it every rank stops with
# that message. A default here would send remote ranks to their own loopback, to time out.
export MASTER_PORT=${MASTER_PORT:-29500}
forward=(-x MASTER_PORT -x DS_ACCELERATOR -x OMP_NUM_THREADS -x PATH)
if [ -n "${MASTER_ADDR:-}" ]; then export MASTER_ADDR; forward+=(-x MASTER_ADDR); fi
. launch/accelerator.sh   # DS_ACCELERATOR: cuda on a GPU node, cpu otherwise or when asked
. launch/preflight.sh     # comera_check_run: the trainer's check of the run, as slurm/pretrain.sh makes it
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
NP=${NP:-$([ "$COMERA_LOCAL_GPUS" -gt 0 ] && echo "$COMERA_LOCAL_GPUS" || echo 2)}

# --allow-run-as-root: containers/CI run as root; --oversubscribe: more ranks than cores is fine
# on CPU. -x forwards the variables to remote ranks as well.
# shellcheck disable=SC2206
cmd=(${MPIRUN:-mpirun} --allow-run-as-root --oversubscribe -np "$NP"
     "${forward[@]}" ${MPIRUN_ARGS:-}
     python launch/train.py "$@")
if [ "$DRY_RUN" = 1 ]; then
  # a bad key or a batch NP ranks do not divide: the one-line refusal, exit 2, not a printed command
  comera_check_run mpirun.sh "$NP" "$@" || exit
  echo "DS_ACCELERATOR=$DS_ACCELERATOR" >&2; echo "${cmd[*]}"; exit 0
fi
exec "${cmd[@]}"
