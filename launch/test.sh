#!/usr/bin/env bash
# Run the whole test suite on CPU: unit, 2-process distributed (gloo), Triton kernels in the
# interpreter, and slow end-to-end tests that start real Slurm and Prometheus daemons.
# usage: launch/test.sh [pytest args...]      (pytest's own options: .venv/bin/python -m pytest --help)
set -euo pipefail
case "${1:-}" in -h|--help) sed -n '2,4p' "$0"; exit 0 ;; esac
cd "$(dirname "$0")/.."
export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu} TRITON_INTERPRET=${TRITON_INTERPRET:-1} OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/python -m pytest "$@"
