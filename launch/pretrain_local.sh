#!/usr/bin/env bash
# The README's first command: CoMERA pretraining of a small CodeBERT-like model on this machine's
# CPU, 2 processes through the standard deepspeed launcher (gloo), on the embedded stdlib corpus.
# usage: launch/pretrain_local.sh [--dry-run] [trainer options, e.g. --set train.steps=50 --resume none]
#   --dry-run   print the launch command, then the model/compression/DeepSpeed summary, and exit
# env:   CONFIG (default configs/codebert-tiny-cpu.yaml), NPROC (default 2), MASTER_PORT (default 29500)
# Run launch/setup.sh once first.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] && export PATH="$PWD/.venv/bin:$PATH"

CONFIG=${CONFIG:-configs/codebert-tiny-cpu.yaml}
NPROC=${NPROC:-2}
MASTER_PORT=${MASTER_PORT:-29500}
DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi

# CPU DeepSpeed: the cpu accelerator on gloo, one thread per rank (the ranks share the cores),
# no hub access (the corpus and tokenizer are built locally).
export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} TOKENIZERS_PARALLELISM=false
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1

# --num_gpus is the process count on CPU too: without it the launcher starts one per NUMA node.
cmd=(deepspeed --num_gpus "$NPROC" --master_addr 127.0.0.1 --master_port "$MASTER_PORT"
     launch/train.py --config "$CONFIG" "$@")
if [ "$DRY_RUN" = 1 ]; then
  echo "would run: ${cmd[*]}"
  exec python launch/train.py --config "$CONFIG" --world-size "$NPROC" --dry-run "$@"
fi
exec "${cmd[@]}"
