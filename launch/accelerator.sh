# Sourced by the launchers (not run): picks DeepSpeed's accelerator for this node and exports it.
# usage: . launch/accelerator.sh      (from a launcher, after cd to the repository)
#   DS_ACCELERATOR set by the caller     -> kept (cpu on a GPU node is a deliberate CPU run)
#   COMERA_DEVICE=cpu                    -> cpu
#   an NVIDIA GPU visible (nvidia-smi)   -> cuda
#   otherwise                            -> cpu
# Also sets COMERA_LOCAL_GPUS (GPUs on this node, 0 on cpu) for the launchers' process-count defaults.
# On cpu the ranks of a node share its cores: one OpenMP thread each unless OMP_NUM_THREADS says otherwise.
# Run (not sourced) it only prints this header: --help exits 0, anything else 2 (its exports would be lost).
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  case "${1:-}" in -h|--help) sed -n '1,9p' "$0"; exit 0 ;; *) sed -n '1,9p' "$0" >&2; exit 2 ;; esac
fi
comera_gpu_count() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    { nvidia-smi -L 2>/dev/null || true; } | grep -c '^GPU' || true
  else
    echo 0
  fi
}
COMERA_LOCAL_GPUS=$(comera_gpu_count)
if [ -z "${DS_ACCELERATOR:-}" ]; then
  if [ "${COMERA_DEVICE:-}" != cpu ] && [ "$COMERA_LOCAL_GPUS" -gt 0 ]; then DS_ACCELERATOR=cuda; else DS_ACCELERATOR=cpu; fi
fi
[ "$DS_ACCELERATOR" = cpu ] && COMERA_LOCAL_GPUS=0
[ "$DS_ACCELERATOR" = cpu ] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export DS_ACCELERATOR COMERA_LOCAL_GPUS
