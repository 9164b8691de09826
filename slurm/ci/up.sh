#!/usr/bin/env bash
# Bring up a throwaway Slurm cluster on loopback (no systemd): munged, slurmctld, one slurmd per node.
# usage: slurm/ci/up.sh [NNODES]    NNODES=1: one node "localhost"; >1: emulated nodes n1..nN (NodeAddr 127.0.0.2..)
# env:   SLURM_CI_DIR (default /tmp/comera-slurm-ci), SLURM_CI_PORT (slurmctld port, default 16817),
#        SLURM_CI_FAKE_GPUS (default 0: N fake "gpu" GRES per node backed by /dev/tty0..N-1, so that
#        --gres=gpu:N allocations and SLURM_GPUS_ON_NODE work; no device isolation)
# after: export SLURM_CONF=$SLURM_CI_DIR/etc/slurm.conf ; tear down with slurm/ci/down.sh
# Needs root and the Debian packages slurmctld slurmd slurm-client munge (launch/setup.sh --dev).
set -euo pipefail
NNODES=${1:-1}
D=${SLURM_CI_DIR:-/tmp/comera-slurm-ci}
PORT=${SLURM_CI_PORT:-16817}
CPUS=$(getconf _NPROCESSORS_ONLN)   # not nproc: it honours OMP_NUM_THREADS
for bin in slurmctld slurmd munged sinfo; do
  command -v "$bin" >/dev/null || { echo "up.sh: $bin not found: install slurmctld slurmd slurm-client munge" >&2; exit 1; }
done
[[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || { echo "up.sh: NNODES must be a positive integer, got '$NNODES'" >&2; exit 2; }
[ -e /etc/munge/munge.key ] || { echo "up.sh: /etc/munge/munge.key missing (reinstall munge)" >&2; exit 1; }

# fresh state every time: a saved job list from an earlier cluster would come back to life
rm -rf "$D"; mkdir -p "$D"/{etc,state,log,run,munge,spool}
chown munge:munge "$D/munge"; chmod 0755 "$D/munge"
MS="$D/munge/munge.socket"
# Emulated nodes have NodeAddrs 127.0.0.2.. (loopback, but not 127.0.0.1, so that a test tells a node's NodeAddr
# from loopback). NoInAddrAny binds a slurmd to the host's own name (127.0.0.1), not to its NodeAddr, where
# slurmctld and srun reach it: their slurmds listen on every address instead (munge authenticates each message).
if [ "$NNODES" -eq 1 ]; then COMM=NoInAddrAny,NoCtldInAddrAny; else COMM=NoCtldInAddrAny; fi
cat > "$D/etc/slurm.conf" <<CONF
ClusterName=comera-ci
# slurmctld on loopback only; slurmd too for one node (see COMM)
SlurmctldHost=localhost(127.0.0.1)
CommunicationParameters=$COMM
SlurmctldPort=$PORT
SlurmdPort=$((PORT + 1))
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire also sets how long a requeued job waits before it may start again (default 120 s)
AuthInfo=socket=$MS,cred_expire=10
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pidfile
SlurmdPidFile=$D/run/slurmd-%n.pidfile
SlurmctldLogFile=$D/log/slurmctld.log
SlurmdLogFile=$D/log/slurmd-%n.log
# no systemd/cgroup here
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
KillWait=10
CONF
: > "$D/etc/cgroup.conf"
if [ "$NNODES" -eq 1 ]; then
  NODES=(localhost)
  echo "NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=4000 State=UNKNOWN" >> "$D/etc/slurm.conf"
else
  NODES=()
  for i in $(seq 1 "$NNODES"); do
    NODES+=("n$i")
    # emulated node: its own slurmd port, the same host; its name does not resolve, its NodeAddr (above) does
    echo "NodeName=n$i NodeHostname=localhost NodeAddr=127.0.0.$((i + 1)) Port=$((PORT + 10 + i)) CPUs=$CPUS RealMemory=4000 State=UNKNOWN" >> "$D/etc/slurm.conf"
  done
fi
echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >> "$D/etc/slurm.conf"
GPUS=${SLURM_CI_FAKE_GPUS:-0}
if [ "$GPUS" -gt 0 ]; then
  sed -i "s/^\(NodeName=.*\) State=UNKNOWN$/\1 Gres=gpu:$GPUS State=UNKNOWN/" "$D/etc/slurm.conf"
  sed -i "1i GresTypes=gpu" "$D/etc/slurm.conf"
  echo "Name=gpu File=/dev/tty[0-$((GPUS - 1))]" > "$D/etc/gres.conf"
  echo "PartitionName=gpu Nodes=ALL Default=NO MaxTime=INFINITE State=UP" >> "$D/etc/slurm.conf"
fi
export SLURM_CONF="$D/etc/slurm.conf"

# munged as user munge on a private socket (setpriv execs, so $! is munged itself)
setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged -F --socket="$MS" \
  --pid-file="$D/munge/munged.pid" --log-file="$D/log/munged.log" --seed-file="$D/munge/munged.seed" \
  >"$D/log/munged.out" 2>&1 &
echo $! > "$D/run/munged.pid"
for _ in $(seq 50); do [ -S "$MS" ] && break; sleep 0.1; done
[ -S "$MS" ] || { echo "up.sh: munged did not start" >&2; cat "$D/log/munged.out" >&2; exit 1; }

slurmctld -D >"$D/log/slurmctld.out" 2>&1 &
echo $! > "$D/run/slurmctld.pid"
for n in "${NODES[@]}"; do
  mkdir -p "$D/spool/$n"
  slurmd -D -N "$n" >"$D/log/slurmd-$n.out" 2>&1 &
  echo $! > "$D/run/slurmd-$n.pid"
done
for _ in $(seq 150); do
  idle=$(sinfo -h -o '%T %D' 2>/dev/null | awk '$1=="idle"{n+=$2} END{print n+0}')
  [ "$idle" = "$NNODES" ] && { echo "slurm up: $NNODES node(s) (${NODES[*]}), SLURM_CONF=$SLURM_CONF"; exit 0; }
  sleep 0.2
done
echo "up.sh: slurm did not come up" >&2; sinfo >&2 || true; tail -n 20 "$D"/log/*.out >&2
exit 1
