#!/usr/bin/env bash
# Run comera pretraining under Open MPI's mpirun. Each rank finds its rank and world size through
# MPI (mpi4py, DeepSpeed's MPI discovery in engine/distributed.py) and rendezvouses over gloo.
# usage: launch/mpirun.sh [--dry-run] --config CONFIG [trainer options...]
#   --dry-run   print the mpirun command and exit
# env:   NP (total processes, default: this node's GPUs, or 2 on CPU), MPIRUN (default: mpirun on PATH, the venv's first),
#        MASTER_ADDR (default 127.0.0.1), MASTER_PORT (default 29500), MPIRUN_ARGS (extra args, e.g. a hostfile),
#        DS_ACCELERATOR (default: cuda when a GPU is visible, else cpu; see launch/accelerator.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] && export PATH="$PWD/.venv/bin:$PATH"
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
[ $# -gt 0 ] || { sed -n '4,8p' "$0" >&2; exit 2; }

# MPI discovery would take the first address of `hostname -I`; force the rendezvous address
# (loopback for one machine) so no rank ever listens on a public interface by accident.
export MASTER_ADDR=${MASTER_ADDR:-127.0.0.1} MASTER_PORT=${MASTER_PORT:-29500}
. launch/accelerator.sh   # DS_ACCELERATOR: cuda on a GPU node, cpu otherwise or when asked
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
NP=${NP:-$([ "$COMERA_LOCAL_GPUS" -gt 0 ] && echo "$COMERA_LOCAL_GPUS" || echo 2)}

# --allow-run-as-root: containers/CI run as root; --oversubscribe: more ranks than cores is fine
# on CPU. -x forwards the variables to remote ranks as well.
# shellcheck disable=SC2206
cmd=(${MPIRUN:-mpirun} --allow-run-as-root --oversubscribe -np "$NP"
     -x MASTER_ADDR -x MASTER_PORT -x DS_ACCELERATOR -x OMP_NUM_THREADS -x PATH ${MPIRUN_ARGS:-}
     python launch/train.py "$@")
if [ "$DRY_RUN" = 1 ]; then echo "DS_ACCELERATOR=$DS_ACCELERATOR" >&2; echo "${cmd[*]}"; exit 0; fi
exec "${cmd[@]}"
