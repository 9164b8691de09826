#!/usr/bin/env bash
# Set up comera-dist on a fresh machine: a venv in .venv with the CPU torch build
# first (an unpinned torch resolves to a multi-GB CUDA build), then the project.
# usage: launch/setup.sh [--dev]     --dev adds the test tools and the system services
#                                     the tests start for real (Slurm, munge, Prometheus, OpenMPI)
# env:   TORCH_SPEC (default 'torch==2.13.0+cpu'), VENV (default .venv)
set -euo pipefail
usage() { sed -n '2,6p' "$0"; }   # the header above; read before the cd below, while $0 still resolves
# anything but --dev stops here: --help (or a typo) must not start a pip install
DEV=0
case "$*" in
  "")        ;;
  --dev)     DEV=1 ;;
  -h|--help) usage; exit 0 ;;
  *)         echo "setup.sh: unexpected arguments: $*" >&2; usage >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}

if [ "$DEV" = 1 ] && command -v apt-get >/dev/null; then
  # Real programs the tests drive: Slurm (slurmctld/slurmd/munge), Prometheus + promtool,
  # OpenMPI with PMIx for srun --mpi=pmix, numactl for deepspeed --bind_cores_to_rank; unshare and mount (a
  # read-only bind mount in a private mount namespace) and pgrep, which a minimal image may lack.
  PKGS="slurmctld slurmd slurm-client munge prometheus openmpi-bin libopenmpi-dev libpmix-dev numactl curl
        util-linux mount procps"
  missing=$(for p in $PKGS; do dpkg -s "$p" >/dev/null 2>&1 || echo "$p"; done)
  if [ -n "$missing" ]; then
    SUDO=""; [ "$(id -u)" != 0 ] && SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq -o DPkg::Lock::Timeout=300 \
      --no-install-recommends $missing >/dev/null
  fi
fi

[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
PIP="$VENV/bin/pip --disable-pip-version-check -q"
"$VENV/bin/python" -c 'import torch' 2>/dev/null || $PIP install "$TORCH_SPEC"
if [ "$DEV" = 1 ]; then $PIP install -e '.[dev]'; else $PIP install -e .; fi
echo "comera-dist installed in $VENV ($("$VENV/bin/python" -c 'import torch; print("torch", torch.__version__)'))"
