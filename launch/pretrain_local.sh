#!/usr/bin/env bash
# The README's first command: CoMERA pretraining of a small CodeBERT-like model on this machine
# through the standard deepspeed launcher, on the embedded stdlib corpus: on its GPUs (NCCL) when
# it has any, else 2 CPU processes (gloo).
# usage: launch/pretrain_local.sh [--dry-run] [trainer options, e.g. --set train.steps=50 --resume none]
#   --dry-run   print the launch command, then the model/compression/DeepSpeed summary, and exit
# env:   CONFIG (default configs/codebert-tiny-cpu.yaml), NPROC (default: the GPUs, or 2 on CPU), MASTER_PORT
#        (default 29500), DS_ACCELERATOR (default: cuda when a GPU is visible, else cpu; launch/accelerator.sh)
# Run launch/setup.sh once first. The trainer's options: comera pretrain --help.
set -euo pipefail
# --help first (the header above; before the cd, while $0 resolves): otherwise deepspeed would start
# NPROC trainers that each print their own help
case "${1:-}" in -h|--help) sed -n '2,9p' "$0"; exit 0 ;; esac
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
cd "$(dirname "$0")/.."
[ -d .venv ] && export PATH="$PWD/.venv/bin:$PATH"

CONFIG=${CONFIG:-configs/codebert-tiny-cpu.yaml}
. launch/accelerator.sh   # DS_ACCELERATOR: cuda on a GPU node, cpu otherwise or when asked
. launch/preflight.sh     # comera_require_env: no venv is one line, exit 1 (not a traceback or "deepspeed: not found")
comera_require_env pretrain_local.sh || exit
NPROC=${NPROC:-$([ "$COMERA_LOCAL_GPUS" -gt 0 ] && echo "$COMERA_LOCAL_GPUS" || echo 2)}
MASTER_PORT=${MASTER_PORT:-29500}

# No hub access (the corpus and tokenizer are built locally).
export TOKENIZERS_PARALLELISM=false
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# --num_gpus is the process count on CPU too: without it the launcher starts one per NUMA node.
cmd=(deepspeed --num_gpus "$NPROC" --master_addr 127.0.0.1 --master_port "$MASTER_PORT"
     launch/train.py --config "$CONFIG" "$@")
if [ "$DRY_RUN" = 1 ]; then
  # stderr: stdout is the trainer's summary alone, so --dry-run --json pipes into a JSON reader
  echo "would run: DS_ACCELERATOR=$DS_ACCELERATOR ${cmd[*]}" >&2
  exec python launch/train.py --config "$CONFIG" --world-size "$NPROC" --dry-run "$@"
fi
exec "${cmd[@]}"
