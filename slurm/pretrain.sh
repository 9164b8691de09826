#!/usr/bin/env bash
# CoMERA pretraining on Slurm: one srun task per node, each running torchrun for the node's processes.
# usage: sbatch [sbatch options] slurm/pretrain.sh [--dry-run] CONFIG [--set key=value ...]
#   e.g. mkdir -p logs && sbatch -N 4 slurm/pretrain.sh configs/codebert.yaml --set train.steps=20000
#   CPU (tests): sbatch slurm/pretrain-cpu.sh CFG (this script with CPU-sized #SBATCH defaults)
#   --dry-run   check the config (at the job's world size inside an allocation; outside one, its keys and values),
#               print the resolved launch command and exit
# env: COMERA_HOME (repository; default the submit directory), COMERA_DEVICE (gpu | cpu, default gpu),
#      COMERA_NPROC_PER_NODE (default: GPUs on the node, or 2 on cpu), COMERA_RDZV_PORT (default 20000 +
#      job id mod 12000, below the ephemeral ports), COMERA_TRAIN_SCRIPT (default launch/train.py),
#      COMERA_DRY_RUN=1 (= --dry-run)
# exit: 2 a bad argument or a config the trainer refuses, 1 a python on PATH (.venv's when there is one) without
#       torch or comera_dist (./launch/setup.sh sets up .venv), both before anything starts; else the job's status.
# Preemption / time limit: Slurm sends USR1 to this script 120 s early (--signal=B:USR1@120); it
# forwards USR1 to every node's trainer processes, which checkpoint at the next step boundary and
# exit 0; then the job requeues itself and the next run resumes (--resume auto), unless the run had reached
# train.steps by then with a checkpoint that verifies (comera pretrain --check-config --json says so).
# The node count is never written here: it is sbatch's -N (default 1).
#SBATCH --job-name=comera-pretrain
#SBATCH --partition=gpu
#SBATCH --gres=gpu:8
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=64
#SBATCH --mem=0
#SBATCH --time=24:00:00
#SBATCH --signal=B:USR1@120
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
set -euo pipefail

DRY_RUN=${COMERA_DRY_RUN:-0}
usage() { sed -n '/^# usage/,/^# exit:/{/^# exit:/d;p}' "$0" >&2; }   # the header's usage and env lines
case "${1:-}" in -h|--help) sed -n '2,/^#SBATCH/{/^#SBATCH/d;p}' "$0"; exit 0 ;; esac
if [ "${1:-}" = "--dry-run" ]; then DRY_RUN=1; shift; fi
case "${1:-}" in
  "") usage; exit 2 ;;
  -*) echo "pretrain.sh: unknown option '$1' (CONFIG first, then --set key=value ...)" >&2; usage; exit 2 ;;
esac
CONFIG=$1; shift

# sbatch runs a copy of this file from the spool directory: find the repository explicitly
ROOT=${COMERA_HOME:-${SLURM_SUBMIT_DIR:-$PWD}}
cd "$ROOT" || { echo "pretrain.sh: COMERA_HOME/submit dir '$ROOT' not found" >&2; exit 2; }
[ -f "$CONFIG" ] || { echo "pretrain.sh: config file '$CONFIG' not found (relative to $ROOT)" >&2; exit 2; }
export COMERA_TRAIN_SCRIPT=${COMERA_TRAIN_SCRIPT:-launch/train.py}   # node_launch.sh signals it
TRAIN_SCRIPT=$COMERA_TRAIN_SCRIPT
[ -f "$TRAIN_SCRIPT" ] || { echo "pretrain.sh: COMERA_TRAIN_SCRIPT '$TRAIN_SCRIPT' not found" >&2; exit 2; }
[ -f .venv/bin/activate ] && . .venv/bin/activate

DEVICE=${COMERA_DEVICE:-gpu}
case "$DEVICE" in
  # grep, not wc -l: with no GPU nvidia-smi -L may still print a line ("No devices were found")
  gpu) NPROC=${COMERA_NPROC_PER_NODE:-${SLURM_GPUS_ON_NODE:-$({ nvidia-smi -L 2>/dev/null || true; } | grep -c '^GPU' || true)}}
       # DeepSpeed's cuda accelerator: NCCL, one GPU per rank (engine/distributed.py sets it before the group)
       export DS_ACCELERATOR=${DS_ACCELERATOR:-cuda} ;;
  cpu) NPROC=${COMERA_NPROC_PER_NODE:-2}
       # DeepSpeed's cpu accelerator on gloo; the ranks of a node share its cores
       export DS_ACCELERATOR=cpu OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} ;;
  *)   echo "pretrain.sh: COMERA_DEVICE must be gpu or cpu, got '$DEVICE'" >&2; exit 2 ;;
esac
if ! [[ "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
  if [ -n "${COMERA_NPROC_PER_NODE:-}" ]; then
    echo "pretrain.sh: COMERA_NPROC_PER_NODE must be a positive integer, got '$COMERA_NPROC_PER_NODE'" >&2; exit 2
  elif [ "$DRY_RUN" = 1 ]; then
    # a login node has no GPU: show the command with the count a GPU node fills in, not an error
    NPROC="<GPUs-per-node>"
    echo "pretrain.sh: no GPU on this node; in the job --nproc-per-node is the node's GPU count" \
         "(SLURM_GPUS_ON_NODE, else nvidia-smi), or COMERA_NPROC_PER_NODE" >&2
  else
    echo "pretrain.sh: no GPU found on this node (nvidia-smi lists none); set COMERA_DEVICE=cpu" \
         "(slurm/pretrain-cpu.sh) or COMERA_NPROC_PER_NODE" >&2; exit 2
  fi
fi

# Rendezvous on the first node of the allocation. Its NodeAddr is what other nodes reach (emulated
# nodes share one host and their names do not resolve, so never use the bare node name).
NNODES=${SLURM_JOB_NUM_NODES:-1}
if [ -n "${SLURM_JOB_NODELIST:-}" ]; then
  HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | sed -n 1p)  # not head: its SIGPIPE + pipefail end big jobs
  HEAD_ADDR=$(scontrol show node "$HEAD_NODE" | grep -o 'NodeAddr=[^ ]*' | cut -d= -f2)
else
  HEAD_NODE=localhost HEAD_ADDR=127.0.0.1   # --dry-run outside an allocation
fi
JOB_ID=${SLURM_JOB_ID:-0}
# below 32768, where Linux's ephemeral ports start: no outgoing connection on the head node can hold it
# (the range of engine/slurm_ranks.py's step_port, for srun steps started without this script)
RDZV_PORT=${COMERA_RDZV_PORT:-$((20000 + JOB_ID % 12000))}

# The trainer's own check of the config and its batch arithmetic at this job's world size, before any node
# starts: a mistyped key or a world size the batch does not divide would otherwise stop every rank, once per
# rank. It needs the world size: inside an allocation (the job, or a dry run under salloc) with a known
# process count; outside one, the node count is sbatch's -N, still to come, so only the config is checked.
# A python without torch (no .venv here, say) is said as such, exit 1, not as a refused config.
if [ "$TRAIN_SCRIPT" = launch/train.py ]; then
  . launch/preflight.sh   # comera_check_run, as launch/torchrun.sh and launch/mpirun.sh check a dry run
  if [ -n "${SLURM_JOB_NUM_NODES:-}" ] && [[ "$NPROC" =~ ^[0-9]+$ ]]; then
    comera_check_run pretrain.sh $((NNODES * NPROC)) --config "$CONFIG" "$@" || exit
  else
    comera_check_run pretrain.sh "" --config "$CONFIG" "$@" || exit
    echo "pretrain.sh: outside an allocation the job's world size is unknown: config keys checked; the job checks" \
         "its batch arithmetic before srun (comera pretrain --dry-run --world-size N checks it now)" >&2
  fi
fi

# --resume auto: the first run finds no checkpoint and starts fresh; a requeued run continues (a user's own
# --resume applies to the first run: a requeued job resumes its run's newest checkpoint once there is one)
train=("$TRAIN_SCRIPT" --config "$CONFIG" --resume auto "$@")
# --cpus-per-task given again: srun 22.05 stopped reading it from the job (SLURM_CPUS_PER_TASK), and the node's
# task, torchrun and all of its trainers, would have been held to one CPU where cgroups bind the cores
launch=(srun --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1
        ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"}
        slurm/node_launch.sh
        --nnodes "$NNODES" --nproc-per-node "$NPROC" --rdzv-backend c10d
        --rdzv-endpoint "$HEAD_ADDR:$RDZV_PORT" --rdzv-id "comera-$JOB_ID" --max-restarts 0
        "${train[@]}")
echo "pretrain.sh: job $JOB_ID restart ${SLURM_RESTART_COUNT:-0} on $NNODES node(s) (${SLURM_JOB_NODELIST:-none})," \
     "head $HEAD_NODE=$HEAD_ADDR:$RDZV_PORT, $NPROC process(es)/node, device $DEVICE"
echo "pretrain.sh: ${launch[*]}"
if [ "$DRY_RUN" = 1 ]; then exit 0; fi

STOP=""
forward_stop() {  # USR1 (time limit, preemption notice) or TERM: the steps checkpoint and exit
  STOP=$1
  echo "pretrain.sh: caught $1, forwarding USR1 to the trainer on every node"
  scancel --signal=USR1 "$JOB_ID" || true   # every step's tasks, not this batch shell
}
trap 'forward_stop USR1' USR1
trap 'forward_stop TERM' TERM

# srun in the background: bash runs a trap only between commands. comera_wait returns srun's own status
# however the traps interrupt it (slurm/child_status.sh says why `wait` alone does not).
. slurm/child_status.sh
comera_start "USR1 TERM" "${launch[@]}"
comera_wait && rc=0 || rc=$?
echo "pretrain.sh: training step exited with $rc"

case "$STOP" in
  USR1)  # time-limit or preemption notice: the trainers have checkpointed; come back as the same job
    if [ "$rc" -ne 0 ]; then
      echo "pretrain.sh: trainer did not stop cleanly after USR1 (rc $rc); not requeueing" >&2
      exit "$rc"
    fi
    # the USR1 came at the last step or after it: the run is done, and a requeue would only say so
    if [ "$TRAIN_SCRIPT" = launch/train.py ] && comera_run_finished --config "$CONFIG" "$@" --resume auto; then
      echo "pretrain.sh: the run reached train.steps before the USR1 took effect; not requeueing job $JOB_ID"
      exit 0
    fi
    echo "pretrain.sh: checkpointed after USR1; requeueing job $JOB_ID (resumes with --resume auto)"
    scontrol requeue "$JOB_ID"
    exit 0 ;;  # requeue ends this batch shell; if it returns first, exit cleanly
  TERM)  # scancel, or preemption that Slurm requeues itself (PreemptMode=REQUEUE): never requeue here,
         # a requeue would bring a cancelled job back
    echo "pretrain.sh: stopped by SIGTERM after checkpointing (rc $rc); not requeueing"
    exit "$rc" ;;
esac
exit "$rc"
