#!/usr/bin/env bash
# The README's first command: CoMERA pretraining of a small CodeBERT-like model on this machine
# through the standard deepspeed launcher, on the embedded stdlib corpus: on its GPUs (NCCL) when
# it has any, else 2 CPU processes (gloo).
# usage: launch/pretrain_local.sh [--dry-run] [trainer options, e.g. --set train.steps=50 --resume none]
#   --dry-run   print the launch command, then the model/compression/DeepSpeed summary, and exit
# env:   CONFIG (default configs/codebert-tiny-cpu.yaml), NPROC (default: the GPUs, or 2 on CPU), MASTER_PORT
#        (default 29500), DS_ACCELERATOR (default: cuda when a GPU is visible, else cpu; launch/accelerator.sh)
# Run launch/setup.sh once first.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] && export PATH="$PWD/.venv/bin:$PATH"

CONFIG=${CONFIG:-configs/codebert-tiny-cpu.yaml}
. launch/accelerator.sh   # DS_ACCELERATOR: cuda on a GPU node, cpu otherwise or when asked
NPROC=${NPROC:-$([ "$COMERA_LOCAL_GPUS" -gt 0 ] && echo "$COMERA_LOCAL_GPUS" || echo 2)}
MASTER_PORT=${MASTER_PORT:-29500}
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi

# No hub access (the corpus and tokenizer are built locally).
export TOKENIZERS_PARALLELISM=false
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# --num_gpus is the process count on CPU too: without it the launcher starts one per NUMA node.
cmd=(deepspeed --num_gpus "$NPROC" --master_addr 127.0.0.1 --master_port "$MASTER_PORT"
     launch/train.py --config "$CONFIG" "$@")
if [ "$DRY_RUN" = 1 ]; then
  echo "would run: DS_ACCELERATOR=$DS_ACCELERATOR ${cmd[*]}"
  exec python launch/train.py --config "$CONFIG" --world-size "$NPROC" --dry-run "$@"
fi
exec "${cmd[@]}"
