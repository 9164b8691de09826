#!/usr/bin/env bash
# Fetch the wheels the lent GPU machine lacks (../shared/docs/GPU.md: Python 3.12, no network) into
# a git-ignored folder that travels with the checkout; launch/gpu_check.sh installs them there.
# usage: launch/gpu_wheels.sh [--dry-run] [DIR]      (DIR default .whl)
#   --dry-run   print the pip commands and exit
# env:   PIP (default: the venv's pip, else pip3), PYVER (default 3.12)
set -euo pipefail
usage() { sed -n '2,6p' "$0"; }   # the header above; read before the cd below, while $0 still resolves
DRY_RUN=0
while [ $# -gt 0 ]; do   # the options, then DIR: a mistyped option must not become a folder of wheels
  case "$1" in
    --dry-run) DRY_RUN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    -*)        echo "gpu_wheels: unknown option '$1'" >&2; usage >&2; exit 2 ;;
    *)         break ;;
  esac
done
[ $# -le 1 ] || { echo "gpu_wheels: one DIR at most, got: $*" >&2; usage >&2; exit 2; }
DIR=${1:-.whl}
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
if [ -z "${PIP:-}" ]; then
  if [ -x .venv/bin/pip ]; then PIP=.venv/bin/pip; else PIP=pip3; fi
fi

# Pure-Python or manylinux wheels for CPython $PYVER, no dependencies (the machine has torch,
# transformers, numpy, pyarrow...; these are what it lacks, plus typing-extensions, which pydantic
# needs newer than torch's). datasets < 5 where no venv pins it. deepspeed ships an sdist only: its pure-Python wheel is built here.
NAMES=(datasets hjson pydantic pydantic-core annotated-types typing-inspection typing-extensions dill multiprocess
       galore-torch py-cpuinfo msgpack ninja einops xxhash)
# Pin each to the version CI tests (this venv's), so the GPU runs what CI ran; unpinned where absent.
BINARY=()
for name in "${NAMES[@]}"; do
  v=$({ [ -x .venv/bin/python ] && .venv/bin/python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" \
        "$name" 2>/dev/null; } || true)
  if [ -n "$v" ]; then BINARY+=("$name==$v"); elif [ "$name" = datasets ]; then BINARY+=("datasets<5"); else BINARY+=("$name"); fi
done
download=("$PIP" download -q --no-deps --only-binary=:all: --python-version "$PYVER" --implementation cp
          --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64
          -d "$DIR")
build=("$PIP" wheel -q --no-deps -w "$DIR" deepspeed==0.19.8)
if [ "$DRY_RUN" = 1 ]; then
  echo "${download[*]} ${BINARY[*]}"
  echo "${build[*]}"
  exit 0
fi
mkdir -p "$DIR"
"${download[@]}" "${BINARY[@]}"
ls "$DIR"/deepspeed-0.19.8-*.whl >/dev/null 2>&1 || "${build[@]}"
echo "gpu_wheels: $(ls "$DIR"/*.whl | wc -l) wheels, $(du -sh "$DIR" | cut -f1) in $DIR:"
ls "$DIR"
