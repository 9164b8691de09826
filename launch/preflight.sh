# shellcheck shell=bash
# Sourced by the launchers (not run): the trainer's own check of a run before any rank starts.
# usage: . launch/preflight.sh      (from a launcher, after cd to the repository, its venv on PATH)
#   comera_check_run NAME N ARGS...    comera pretrain --dry-run --world-size N ARGS (keys, values, the batch)
#   comera_check_run NAME "" ARGS...   comera pretrain --check-config ARGS (the world size is not known yet)
#   comera_require_env NAME            only the first part: the python on PATH has torch and comera_dist
#   comera_run_finished ARGS...        0 when the run's newest checkpoint is at train.steps and verifies (a requeue trains nothing)
# The trainer's output is dropped; its one-line refusal reaches stderr, and NAME's line says what follows.
# Returns 0 when the trainer accepts the run, else the launcher's exit status: 1 the python on PATH cannot import
# torch or comera_dist (launch/setup.sh makes .venv with both), 2 the trainer refused it, else the check's own.
# Run (not sourced) it only prints this header: --help exits 0, anything else 2 (its function would be lost).
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  case "${1:-}" in -h|--help) sed -n '2,11p' "$0"; exit 0 ;; *) sed -n '2,11p' "$0" >&2; exit 2 ;; esac
fi

# Looked up, not imported (milliseconds), from launch/: for `python launch/train.py` that directory, not the
# repository, leads sys.path, so a comera_dist the repository holds but the python has not installed is missing.
_COMERA_LACKS='import importlib.util, sys
lacks = [name for name in ("torch", "comera_dist") if importlib.util.find_spec(name) is None]
print(" and ".join(lacks), sys.executable, sep="\n") if lacks else None
sys.exit(1 if lacks else 0)'

comera_require_env() {  # NAME: 0, or 1 with one line when the python on PATH cannot run the trainer
  local name=$1 lacks
  # A missing environment is not a refused config: without this the trainer's ImportError read as one.
  if ! command -v python >/dev/null; then
    echo "$name: no python on PATH: ./launch/setup.sh sets up .venv (torch and comera-dist); nothing started" >&2
    return 1
  fi
  if ! lacks=$(cd launch && python -c "$_COMERA_LACKS" 2>&1); then
    echo "$name: the Python environment lacks ${lacks%%$'\n'*} (${lacks#*$'\n'}, the python on PATH):" \
         "./launch/setup.sh sets up .venv with torch and comera-dist, which the launchers use; nothing started" >&2
    return 1
  fi
}

comera_check_run() {
  local name=$1 world=$2 rc=0 check refused
  shift 2
  comera_require_env "$name" || return
  if [ -n "$world" ]; then
    check="comera pretrain --dry-run" refused="refused this run"
    python launch/train.py --dry-run --world-size "$world" "$@" > /dev/null || rc=$?
  else
    check="comera pretrain --check-config" refused="refused this config"
    python launch/train.py --check-config "$@" > /dev/null || rc=$?
  fi
  case $rc in
    0) ;;
    2) echo "$name: $check $refused (above); nothing started" >&2 ;;
    *) echo "$name: $check failed with status $rc (above); nothing started" >&2 ;;
  esac
  return "$rc"
}

# slurm/pretrain.sh asks before it requeues after a USR1: one that came at the last step, or after it, left a
# finished run, and its requeue would allocate the job again to say "nothing to train". Bounded: the time limit
# is near, and a check that fails or takes too long answers "not finished" (the requeue is the safe side).
comera_run_finished() {
  local verdict
  verdict=$(timeout "${COMERA_FINISHED_CHECK_S:-30}" python launch/train.py --check-config --json "$@" 2>/dev/null) \
    || return 1
  python -c 'import json, sys; sys.exit(0 if json.loads(sys.argv[1]).get("nothing_to_train") is True else 1)' \
    "$verdict" 2>/dev/null
}
