#!/usr/bin/env bash
# CPU variant of slurm/pretrain.sh (tests, CI, laptops with Slurm): same launch, CPU-sized #SBATCH defaults.
# usage: mkdir -p logs && sbatch [sbatch options] slurm/pretrain-cpu.sh [--dry-run] CONFIG [--set key=value ...]
#   e.g. sbatch -N 2 slurm/pretrain-cpu.sh configs/tiny-cpu.yaml
# env:   as slurm/pretrain.sh; COMERA_NPROC_PER_NODE defaults to 2 (gloo ranks per node)
# The signal/requeue lines must be here too: sbatch reads only the submitted file's #SBATCH lines.
#SBATCH --job-name=comera-pretrain-cpu
#SBATCH --partition=debug
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --mem=2G
#SBATCH --time=01:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
set -euo pipefail
# its own header, not pretrain.sh's (which the exec below would print), and where the full options are
case "${1:-}" in -h|--help) sed -n '2,6p' "$0"; echo "(slurm/pretrain.sh --help: the options and env in full)"; exit 0 ;; esac
ROOT=${COMERA_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
export COMERA_DEVICE=cpu
# exec keeps this PID, so Slurm's USR1 for the batch shell reaches pretrain.sh's trap
exec "$ROOT/slurm/pretrain.sh" "$@"
