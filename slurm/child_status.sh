# shellcheck shell=bash
# Sourced by slurm/pretrain.sh and slurm/node_launch.sh (not run): a background command and its own exit status.
# usage: . slurm/child_status.sh
#   comera_start "SIGNALS" CMD ARGS...   start CMD in the background (COMERA_CHILD: the pid of its keeper)
#   comera_wait                          wait for it, however often a trap interrupts; return CMD's status
# Why not `wait`: bash's wait returns 128+signal when a trap runs, and asked again after CMD exited during the
# trap it has returned -1 (255) instead of CMD's status (bash 5.2; 1 run in 12 of a small script). The status
# decides the requeue (pretrain.sh) and reaches sacct. Here a keeper subshell runs CMD in the foreground, which
# no trap interrupts, and writes its status to a file. The keeper outlives SIGNALS (trapped, a no-op); a signal
# the caller has ignored stays ignored, in the keeper and in CMD.
# Run (not sourced) it only prints this header: --help exits 0, anything else 2.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  case "${1:-}" in -h|--help) sed -n '2,11p' "$0"; exit 0 ;; *) sed -n '2,11p' "$0" >&2; exit 2 ;; esac
fi

comera_start() {
  local signals=$1; shift
  COMERA_STATUS_FILE=$(mktemp "${TMPDIR:-/tmp}/comera-status.XXXXXX")
  # shellcheck disable=SC2086  # SIGNALS is a list
  ( if [ -n "$signals" ]; then trap ':' $signals; fi
    rc=0; "$@" || rc=$?
    echo "$rc" > "$COMERA_STATUS_FILE" ) &
  COMERA_CHILD=$!
}

comera_wait() {
  while kill -0 "$COMERA_CHILD" 2>/dev/null; do wait "$COMERA_CHILD" || true; done
  local rc
  rc=$(cat "$COMERA_STATUS_FILE" 2>/dev/null || true)
  rm -f "$COMERA_STATUS_FILE"
  if ! [[ "$rc" =~ ^[0-9]+$ ]]; then  # the keeper itself was killed (SIGKILL): its own status is all there is
    wait "$COMERA_CHILD" && rc=0 || rc=$?
  fi
  return "$rc"
}
