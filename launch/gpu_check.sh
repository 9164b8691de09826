#!/usr/bin/env bash
# The GPU acceptance check: everything the GPU path must do, bounded, with a summary, JSON and logs.
# usage: launch/gpu_check.sh [--dry-run] OUTDIR [--cpu-smoke]
#   OUTDIR       logs/, env.json, results.tsv, summary.json, kernels.json, six-encoder.json land here
#   --cpu-smoke  the same steps on this machine's CPU at tiny sizes (CI runs it to test this script)
#   --dry-run    print the steps and exit
# env: PYTHON (default: .venv/bin/python, else python3), WHEELS (default .whl, from launch/gpu_wheels.sh),
#      COMERA_CHECK_WORK (runs + data cache; default /tmp/comera-check-$$), COMERA_CHECK_BUDGET_S (whole check,
#      default 470 on GPU, 600 on CPU), COMERA_CHECK_NPROC (trainer processes, default: every visible GPU, 1 on CPU),
#      COMERA_CHECK_ONLY (space-separated step names to run, e.g. "env pretrain-z3"; default all),
#      COMERA_CHECK_JOBS (steps run side by side after env; default 1 on GPU, where each step's figures need the
#      card to itself, 2 on CPU, where the smoke's steps are single-threaded)
# Steps: env (installs missing wheels with pip --no-index --target), native GPU tests (TRITON_INTERPRET=0: the
# Triton kernels and the whole-step CUDA graph against eager, inductor's compile pool through a step-wide USR1,
# each test bounded by pytest-timeout),
# per ZeRO stage 1, 2, 3 in bf16: run A (late stage, physical prune + rebuild, checkpoint mid-run) and run B
# resumed from A's mid-run checkpoint, whose losses must equal A's step for step; the same at ZeRO 0 compiled with
# CUDA graphs, fp32 and 2 micro-batches per step (-z0-graphs: ZeRO 0's gradient check and the finite-loss probe),
# and at ZeRO 1 compiled with CUDA graphs, every block recomputed with dropout on (-recompute-graphs); bench kernels; bench
# six-encoder (eager and CUDA-graph modes), again at batch 1 with a 4 MiB cuBLAS workspace for every
# contender (-ws4), and at batch 32 in bf16 with the loss compiled by inductor and captured (-compiled; its rows
# also count the kernels the compiled graphs launch, graph_kernels, beside bench ops --compiled's CPU proxy),
# CoMERA against GaLore at batch 1 with every block recomputed in backward (-recompute), and so with each
# recomputed block remaking its TT factors too, with the peaks named (-recompute-factors: model.recompute_factors),
# and dense against
# CoMERA with its grouped factors at their own middle rank (-align1: COMERA_RANK_ALIGN=1; by default it is padded to a
# multiple of 8), and batch 1 with no product on cuBLASLt (-nolt: DISABLE_ADDMM_CUDA_LT=1, whose workspace is its own),
# and dense against CoMERA with its TT FFN unfused (-ffn-off: COMERA_FFN_ROWS=off; by default its (T, F) middle
# is remade in backward, not kept), and CoMERA and GaLore at batch 1 eager with the blocks live at each step's peak
# named by the line that allocated them (-peaks: CUDA's allocator history);
# bench trainer-rate (the real trainer on configs/six-encoder-mlm.yaml, 1 GPU, ZeRO 1, against the bare
# CoMERA step of the same model and batch), eager, then with every parameter its own tensor
# (-unpacked: deepspeed.pack_vectors=false), in bf16 without DeepSpeed's per-gradient overflow check
# (-nocheck: deepspeed.bf16_overflow_check=false), also without ZeRO's contiguous gradient buffer
# (-lean: deepspeed.contiguous_gradients=false), compiled with train.compile_mode=reduce-overhead
# (-graphs: CUDA graphs), and so with DeepSpeed's optimizer step compiled too (-graphs-opt: train.compile_optimizer).
# Each step is bounded by `timeout` and by what is left of the budget; a failed step does not stop the others.
# Exit 0 only if every step passed.
set -euo pipefail
usage() { sed -n '2,/^[^#]/{/^#/p}' "$0"; }   # the header above; read before the cd below, while $0 still resolves
DRY_RUN=0
while [ $# -gt 0 ]; do   # the options, then OUTDIR: a mistyped option must not become the output folder
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    -*)        echo "gpu_check: unknown option '$1'" >&2; usage >&2; exit 2 ;;
    *)         break ;;
  esac
done
[ $# -ge 1 ] || { usage >&2; exit 2; }
OUT=$1; shift
MODE=gpu
if [ "${1:-}" = "--cpu-smoke" ]; then MODE=cpu-smoke; shift; fi
[ $# -eq 0 ] || { echo "gpu_check: unexpected arguments: $*" >&2; exit 2; }
cd "$(dirname "$0")/.."

if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=$PWD/.venv/bin/python; else PYTHON=python3; fi
fi
WORK=${COMERA_CHECK_WORK:-/tmp/comera-check-$$}
WHEELS=${WHEELS:-.whl}
SITE=$WORK/site
export COMERA_CACHE=${COMERA_CACHE:-$WORK/cache}
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# torchrun from the interpreter we check (the lent machine may have no torchrun on PATH)
# one word, not TORCHRUN="$PYTHON launch/torchrun.py": that string is split on blanks, a checkout path's too
export COMERA_PYTHON=$PYTHON

if [ "$MODE" = gpu ]; then
  export DS_ACCELERATOR=cuda TRITON_INTERPRET=0
  BUDGET=${COMERA_CHECK_BUDGET_S:-470}
  JOBS=${COMERA_CHECK_JOBS:-1}
  NPROC=${COMERA_CHECK_NPROC:-$({ nvidia-smi -L 2>/dev/null || true; } | grep -c '^GPU' || true)}
  # Trainer: the README's tiny CodeBERT, a few dozen steps; kernels/six-encoder at the paper's shapes.
  SIZE=(--set data.max_files=60 --set deepspeed.micro_batch_size_per_gpu=16)
  STEPS=24 CKPT=12 PRUNE=6 LATE=4 TOL=2e-2
  KERNEL_TESTS=(-m pytest -q -rA -p no:cacheprovider --timeout 40 -m gpu tests/unit/test_bench_graphed_step.py
                tests/unit/test_bench_compile_stats.py tests/unit/test_bench_kernel_time.py
                tests/unit/test_tensor_fused_shared.py tests/unit/test_tensor_fused_ffn.py tests/unit/test_models_cpu_dropout.py
                tests/unit/test_bench_workspace.py tests/unit/test_bench_peak_allocations.py
                tests/unit/test_compile_workers.py tests/kernels)
  BENCH_KERNELS=(-m comera_dist.bench kernels --tokens 4096 16384 --steps 10)
  # --profile: each eager step's kernels at batch 32 timed by kind (config.kernel_time): where the device time goes
  BENCH_SIX=(-m comera_dist.bench six-encoder --batch-sizes 1 8 32 --steps 10 --profile)
  BENCH_SIX_WS=(-m comera_dist.bench six-encoder --batch-sizes 1 --dtypes fp32 --steps 10)
  # the bf16 target's candidate: inductor fuses the element-wise work both models share (one compile each)
  BENCH_SIX_COMPILED=(-m comera_dist.bench six-encoder --modes graph compiled-graph --dtypes bf16
                      --contenders dense comera --batch-sizes 32 --steps 10 --profile)
  # the batch-1 memory target with every block recomputed in backward (model.activation_checkpointing), against
  # GaLore recomputing too; a raw CUDA-graph capture of a checkpoint with dropout may fail (torch issue
  # 162504: the RNG state is read during capture), so the compiled graph (RNG functionalised) runs beside it
  BENCH_SIX_RECOMPUTE=(-m comera_dist.bench six-encoder --recompute --modes eager graph compiled-graph
                       --dtypes fp32 --contenders comera galore --batch-sizes 1 --steps 10)
  # the same with each recomputed block remaking its TT factors (model.recompute_factors): on the CPU its batch-1
  # peak was 18.5 MiB lower (the blocks' factors, their stacked cores and gradients) for twice the aten ops; the
  # peaks named by line as -peaks does. compiled-graph left out: it failed with -recompute on the H200
  BENCH_SIX_RECOMPUTE_FACTORS=(-m comera_dist.bench six-encoder --recompute-factors --modes eager graph
                               --dtypes fp32 --contenders comera galore --batch-sizes 1 --steps 10 --peak-allocations)
  # what padding the middle rank to a multiple of 8 buys (the default): the same step at the factors' own rank
  BENCH_SIX_ALIGN1=(-m comera_dist.bench six-encoder --contenders dense comera --batch-sizes 1 32 --steps 10)
  # batch 1 with every biased product on plain cuBLAS (no cuBLASLt epilogue), for every contender: does the
  # peak lose cuBLASLt's own workspace (each row's workspace_MiB), and what does each step pay for it
  BENCH_SIX_NOLT=(-m comera_dist.bench six-encoder --batch-sizes 1 --steps 10)
  # what the fused TT FFN (the default: the (T, F) pre-activation remade in backward) costs or buys in speed and
  # memory: the same rows with it off, beside bench-six-encoder's
  BENCH_SIX_FFN_OFF=("${BENCH_SIX_ALIGN1[@]}")
  # what CoMERA's and GaLore's eager batch-1 steps hold at their peaks, by the line that allocated it: the
  # batch-1 memory target needs about 13 MiB less of CoMERA's own 56 (the fourth lease)
  BENCH_SIX_PEAKS=(-m comera_dist.bench six-encoder --batch-sizes 1 --dtypes fp32 --modes eager
                   --contenders comera galore --steps 3 --peak-allocations)
  TRAINER_RATE=(-m comera_dist.bench trainer-rate --config configs/six-encoder-mlm.yaml --set data.max_files=300 --steps 30 --skip 5)
  GRAPHS_BACKEND=inductor
  # kernel-tests: the 150 s it had, and 30 s allowed (not yet timed on a GPU) for test_compile_workers' two compiles
  T_KTEST=180 T_RUN=90 T_BENCH=120
else
  export DS_ACCELERATOR=cpu TRITON_INTERPRET=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  BUDGET=${COMERA_CHECK_BUDGET_S:-600}
  JOBS=${COMERA_CHECK_JOBS:-2}
  NPROC=${COMERA_CHECK_NPROC:-1}
  SIZE=(--set model.hidden_size=32 --set model.intermediate_size=64 --set model.num_layers=1
        --set model.num_heads=2 --set model.vocab_size=512 --set data.tokenizer.vocab_size=512
        --set data.max_files=30 --set data.seq_len=32 --set deepspeed.micro_batch_size_per_gpu=4
        --set comera.tensorize.max_rank=4 --set comera.tensorize.embedding_max_rank=4 --set metrics.report=false)
  STEPS=9 CKPT=6 PRUNE=3 LATE=2 TOL=1e-6
  # the dispatch tests in the interpreter: the script's plumbing, not the kernels' coverage (CI has that)
  KERNEL_TESTS=(-m pytest -q -p no:cacheprovider tests/kernels/test_dispatch.py -k "not without_the_interpreter")
  BENCH_KERNELS=(-m comera_dist.bench kernels --allow-cpu --tokens 32 --steps 1)
  BENCH_SIX=(-m comera_dist.bench six-encoder --smoke --batch-sizes 1 --steps 1)
  BENCH_SIX_WS=(-m comera_dist.bench six-encoder --smoke --device cpu --batch-sizes 1 --dtypes fp32 --steps 1)
  BENCH_SIX_COMPILED=(-m comera_dist.bench six-encoder --smoke --device cpu --modes eager compiled --dtypes bf16
                      --contenders dense comera --batch-sizes 1 --steps 1 --compile-backend aot_eager --profile)
  BENCH_SIX_RECOMPUTE=(-m comera_dist.bench six-encoder --smoke --device cpu --recompute --modes eager compiled
                       --dtypes fp32 --contenders comera galore --batch-sizes 1 --steps 1 --compile-backend aot_eager)
  BENCH_SIX_RECOMPUTE_FACTORS=(-m comera_dist.bench six-encoder --smoke --device cpu --recompute-factors --modes eager
                               --dtypes fp32 --contenders comera galore --batch-sizes 1 --steps 1 --peak-allocations)
  BENCH_SIX_ALIGN1=(-m comera_dist.bench six-encoder --smoke --device cpu --contenders dense comera --batch-sizes 1
                    --dtypes fp32 --steps 1)
  BENCH_SIX_NOLT=("${BENCH_SIX_ALIGN1[@]}")  # the same plumbing: the variables change nothing on a CPU
  BENCH_SIX_FFN_OFF=("${BENCH_SIX_ALIGN1[@]}")
  BENCH_SIX_PEAKS=(-m comera_dist.bench six-encoder --smoke --device cpu --batch-sizes 1 --dtypes fp32 --modes eager
                   --contenders comera galore --steps 1 --peak-allocations)
  TRAINER_RATE=(-m comera_dist.bench trainer-rate --smoke --steps 2)
  GRAPHS_BACKEND=aot_eager  # the plumbing only: inductor's C++ code generation takes minutes on a CPU
  T_KTEST=120 T_RUN=120 T_BENCH=90
fi
if ! [[ "$NPROC" =~ ^[1-9][0-9]*$ ]]; then
  # a dry run on a machine without a GPU (a login node) still lists the steps
  [ "$DRY_RUN" = 1 ] || { echo "gpu_check: no GPU visible (nvidia-smi -L); use --cpu-smoke on a CPU" >&2; exit 2; }
  NPROC="<GPUs>"
fi
[[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || { echo "gpu_check: COMERA_CHECK_JOBS must be a positive integer, not '$JOBS'" >&2; exit 2; }

# The run: bf16 (fp32 masters), the late stage from step LATE, a physical prune every PRUNE steps with a
# high gate threshold and gate lr so ranks really die in a short run (a low target loss keeps lambda at 0,
# so the late stage does not drive every gate below tau at once), a checkpoint every CKPT steps, every
# step logged. The embedding's threshold is low (0.3): at 0.97 a bond of it dies in 2 steps (all its gates
# fall together), and the trainer stops a model that no longer sees its input (exit 4).
TRAIN=(--config configs/codebert-tiny-cpu.yaml "${SIZE[@]}" --set deepspeed.precision=bf16
       --set train.steps=$STEPS --set train.checkpoint_every=$CKPT --set train.eval_every=$CKPT
       --set train.eval_batches=2 --set train.log_every=1 --set comera.controller.late_stage_step=$LATE
       --set comera.controller.tau=0.97 --set comera.controller.embedding_tau=0.3 --set comera.lr.gates=0.02
       --set comera.controller.target_loss=3.0
       --set deepspeed.scheduler.warmup_steps=1 --set comera.pruning.every=$PRUNE
       --set comera.pruning.start_step=$PRUNE --set metrics.prometheus=false)

STEPS_LIST="env kernel-tests pretrain-z1 pretrain-z2 pretrain-z3 pretrain-z0-graphs pretrain-recompute-graphs bench-kernels bench-six-encoder bench-six-encoder-ws4 bench-six-encoder-compiled bench-six-encoder-recompute bench-six-encoder-recompute-factors bench-six-encoder-align1 bench-six-encoder-nolt bench-six-encoder-ffn-off bench-six-encoder-peaks trainer-rate trainer-rate-unpacked trainer-rate-nocheck trainer-rate-lean trainer-rate-graphs trainer-rate-graphs-opt"
if [ "$DRY_RUN" = 1 ]; then
  echo "gpu_check ($MODE, $NPROC process(es), budget ${BUDGET}s, $JOBS step(s) at a time): $STEPS_LIST"
  echo "trainer: NPROC=$NPROC launch/torchrun.sh ${TRAIN[*]} --set deepspeed.zero_stage=S --resume none"
  exit 0
fi

mkdir -p "$OUT/logs" "$WORK"
OUT=$(cd "$OUT" && pwd)
: > "$OUT/results.tsv"
START=$(date +%s)

# run_step NAME LIMIT_S CMD...: bounded by LIMIT_S and the budget left; records rc and seconds. With JOBS > 1
# it waits for a free slot and runs the step in the background (results.tsv is put in STEPS_LIST order at the end).
run_step() {
  local name=$1
  if [ -n "${COMERA_CHECK_ONLY:-}" ] && [[ " $COMERA_CHECK_ONLY " != *" $name "* ]]; then return 0; fi
  if [ "$JOBS" -eq 1 ]; then run_one "$@"; return 0; fi
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  run_one "$@" &
}

run_one() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - ($(date +%s) - START)))
  [ "$left" -lt "$limit" ] && limit=$left
  local log="$OUT/logs/$name.log" t0 rc
  t0=$(date +%s%N)
  if [ "$limit" -le 5 ]; then
    echo "skipped: the ${BUDGET}s budget is spent" > "$log"; rc=124
  else
    echo "== $name (limit ${limit}s): $*" | tee "$log"
    set +e
    timeout --kill-after=10 "$limit" "$@" >> "$log" 2>&1
    rc=$?
    set -e
  fi
  local ms=$((($(date +%s%N) - t0) / 1000000))
  printf '%s\t%s\t%d.%03d\t%s\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000)) "logs/$name.log" >> "$OUT/results.tsv"
  echo "   -> $name: rc $rc"
  return 0
}

env_step() {
  if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PYTHON" launch/gpu_check.py install "$WHEELS" "$SITE"
  else
    echo "no wheels in $WHEELS (launch/gpu_wheels.sh makes them); using what is installed"
  fi
  "$PYTHON" launch/gpu_check.py env "$OUT" "$MODE"
}

pretrain_step() {  # STAGE [NAME [--set K=V...]]: run A to STEPS, run B resumed from A's step-CKPT checkpoint
  # to STEPS, both at ZeRO STAGE with the extra settings; B must match A. Logs and runs are named NAME (z$STAGE).
  local stage=$1 name=${2:-z$1} port
  shift; if [ $# -gt 0 ]; then shift; fi
  local a="$WORK/$name-a" b="$WORK/$name-b"
  # a free loopback port below the ephemeral range: checks (or tests) running side by side must not meet at
  # one rendezvous, and no outgoing connection may take it before the job binds it (comera_dist/engine/ports.py)
  port=$("$PYTHON" -m comera_dist.engine.ports)
  rm -rf "$a" "$b"
  NPROC=$NPROC MASTER_PORT=$port launch/torchrun.sh "${TRAIN[@]}" --set deepspeed.zero_stage="$stage" "$@" \
    --set train.output_dir="$a" --resume none > "$OUT/logs/pretrain-$name-a.log" 2>&1 \
    || { echo "run A failed: logs/pretrain-$name-a.log"; tail -20 "$OUT/logs/pretrain-$name-a.log"; return 1; }
  grep -E "physical prune|step $CKPT/|resumed" "$OUT/logs/pretrain-$name-a.log" | head -5
  NPROC=$NPROC MASTER_PORT=$port launch/torchrun.sh "${TRAIN[@]}" --set deepspeed.zero_stage="$stage" "$@" \
    --set train.output_dir="$b" --resume "$a/checkpoints/step$(printf %08d "$CKPT")" \
    > "$OUT/logs/pretrain-$name-b.log" 2>&1 \
    || { echo "run B failed: logs/pretrain-$name-b.log"; tail -20 "$OUT/logs/pretrain-$name-b.log"; return 1; }
  "$PYTHON" launch/gpu_check.py resume "$OUT/logs/pretrain-$name-a.log" "$OUT/logs/pretrain-$name-b.log" \
    "$a" "$CKPT" "$STEPS" "$TOL"
}

export -f env_step pretrain_step
export PYTHON WHEELS SITE OUT MODE WORK NPROC STEPS CKPT TOL
TRAIN_Q=$(printf '%q ' "${TRAIN[@]}")
export TRAIN_Q

echo "gpu_check: $MODE, $NPROC trainer process(es), budget ${BUDGET}s, work $WORK, results $OUT"
run_step env 120 bash -c env_step
wait  # the others may import the wheels env installs
run_step kernel-tests "$T_KTEST" "$PYTHON" "${KERNEL_TESTS[@]}"
for stage in 1 2 3; do
  run_step "pretrain-z$stage" $((2 * T_RUN)) bash -c "eval \"TRAIN=(\$TRAIN_Q)\"; pretrain_step $stage"
done
# ZeRO 0 (fp32: bf16 needs stage 1) compiled with CUDA graphs and 2 micro-batches per step: ZeRO 0's all-reduced
# gradient check and the session's forward-only finite-loss probe of each micro-batch, whose losses must outlive
# the next graph replay
run_step pretrain-z0-graphs $((2 * T_RUN)) env COMERA_COMPILE_BACKEND=$GRAPHS_BACKEND bash -c \
  "eval \"TRAIN=(\$TRAIN_Q)\"; pretrain_step 0 z0-graphs --set deepspeed.precision=fp32 --set train.compile=true \
   --set train.compile_mode=reduce-overhead --set deepspeed.gradient_accumulation_steps=2"
# ZeRO 1 in bf16 compiled with CUDA graphs, every block recomputed in backward with dropout on: the bench's compiled
# recompute step fails on the H200 ("Attempt to increase offset for a CUDA generator not in capture mode"); does
# the trainer's (its module compiled, not the whole step)? (3 runs' time: inductor compiles again after each prune)
run_step pretrain-recompute-graphs $((3 * T_RUN)) env COMERA_COMPILE_BACKEND=$GRAPHS_BACKEND bash -c \
  "eval \"TRAIN=(\$TRAIN_Q)\"; pretrain_step 1 recompute-graphs --set model.activation_checkpointing=true \
   --set model.dropout=0.1 --set train.compile=true --set train.compile_mode=reduce-overhead"
run_step bench-kernels "$T_BENCH" "$PYTHON" "${BENCH_KERNELS[@]}" --json "$OUT/kernels.json"
run_step bench-six-encoder "$T_BENCH" "$PYTHON" "${BENCH_SIX[@]}" --json "$OUT/six-encoder.json"
# batch 1 again with a 4 MiB cuBLAS workspace per stream for every contender (torch's default is 65 MiB on the
# H200, the largest term of CoMERA's batch-1 peak): the memory ratio and the speeds under it, side by side
run_step bench-six-encoder-ws4 "$T_BENCH" env CUBLAS_WORKSPACE_CONFIG=:4096:1 CUBLASLT_WORKSPACE_SIZE=4096 \
  "$PYTHON" "${BENCH_SIX_WS[@]}" --json "$OUT/six-encoder-ws4.json"
run_step bench-six-encoder-compiled $((2 * T_BENCH)) "$PYTHON" "${BENCH_SIX_COMPILED[@]}" \
  --json "$OUT/six-encoder-compiled.json"
run_step bench-six-encoder-recompute $((2 * T_BENCH)) "$PYTHON" "${BENCH_SIX_RECOMPUTE[@]}" \
  --json "$OUT/six-encoder-recompute.json"
run_step bench-six-encoder-recompute-factors "$T_BENCH" "$PYTHON" "${BENCH_SIX_RECOMPUTE_FACTORS[@]}" \
  --json "$OUT/six-encoder-recompute-factors.json"
run_step bench-six-encoder-align1 "$T_BENCH" env COMERA_RANK_ALIGN=1 "$PYTHON" "${BENCH_SIX_ALIGN1[@]}" \
  --json "$OUT/six-encoder-align1.json"
run_step bench-six-encoder-nolt "$T_BENCH" env DISABLE_ADDMM_CUDA_LT=1 TORCH_BLAS_PREFER_CUBLASLT=0 \
  "$PYTHON" "${BENCH_SIX_NOLT[@]}" --json "$OUT/six-encoder-nolt.json"
run_step bench-six-encoder-ffn-off "$T_BENCH" env COMERA_FFN_ROWS=off "$PYTHON" "${BENCH_SIX_FFN_OFF[@]}" \
  --json "$OUT/six-encoder-ffn-off.json"
run_step bench-six-encoder-peaks "$T_BENCH" "$PYTHON" "${BENCH_SIX_PEAKS[@]}" --json "$OUT/six-encoder-peaks.json"
run_step trainer-rate "$T_BENCH" "$PYTHON" "${TRAINER_RATE[@]}" --json "$OUT/trainer-rate.json"
# the same with every parameter its own tensor (deepspeed.pack_vectors=false): what packing buys (143 -> 6 tensors)
run_step trainer-rate-unpacked "$T_BENCH" "$PYTHON" "${TRAINER_RATE[@]}" --set deepspeed.pack_vectors=false \
  --json "$OUT/trainer-rate-unpacked.json"
# the same without DeepSpeed's per-gradient bf16 overflow check (deepspeed.bf16_overflow_check=false)
run_step trainer-rate-nocheck "$T_BENCH" "$PYTHON" "${TRAINER_RATE[@]}" --set deepspeed.precision=bf16 \
  --set deepspeed.bf16_overflow_check=false --json "$OUT/trainer-rate-nocheck.json"
# and also without ZeRO's contiguous gradient buffer (deepspeed.contiguous_gradients=false: fewer per-tensor ops)
run_step trainer-rate-lean "$T_BENCH" "$PYTHON" "${TRAINER_RATE[@]}" --set deepspeed.precision=bf16 \
  --set deepspeed.bf16_overflow_check=false --set deepspeed.contiguous_gradients=false \
  --json "$OUT/trainer-rate-lean.json"
# the same with the trainer compiled in reduce-overhead mode: its forward and backward replay as CUDA graphs;
# TORCH_LOGS names every recompile and every CUDA-graph skip (the compiled trainer was 44 ms slower per step
# than its own session step on the H200, undiagnosed)
run_step trainer-rate-graphs $((2 * T_BENCH)) env COMERA_COMPILE_BACKEND=$GRAPHS_BACKEND TORCH_LOGS=recompiles,perf_hints \
  "$PYTHON" "${TRAINER_RATE[@]}" --set train.compile=true --set train.compile_mode=reduce-overhead \
  --json "$OUT/trainer-rate-graphs.json"
# and with DeepSpeed's ZeRO-1 optimizer step compiled (train.compile_optimizer): on the CPU its ~170 eager host ops
# per step are most of what the compiled trainer runs outside its graphs (docs/bench/raw/trainer-host-ops-by-origin-cpu.md)
run_step trainer-rate-graphs-opt $((2 * T_BENCH)) env COMERA_COMPILE_BACKEND=$GRAPHS_BACKEND TORCH_LOGS=recompiles \
  "$PYTHON" "${TRAINER_RATE[@]}" --set train.compile=true --set train.compile_mode=reduce-overhead \
  --set train.compile_optimizer=true --json "$OUT/trainer-rate-graphs-opt.json"
wait
# the steps in STEPS_LIST order, however they finished
awk -v order="$STEPS_LIST" 'BEGIN { n = split(order, o, " "); for (i = 1; i <= n; i++) at[o[i]] = i }
  { printf "%d\t%s\n", at[$1], $0 }' "$OUT/results.tsv" | sort -n -s -k1,1 | cut -f2- > "$OUT/results.tsv.tmp"
mv "$OUT/results.tsv.tmp" "$OUT/results.tsv"
"$PYTHON" launch/gpu_check.py summary "$OUT"
