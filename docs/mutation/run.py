"""Usage: run.py TARGET BREAKS.py [pytest args...]. Writes each break, runs pytest -x, and restores the file.

BREAKS.py defines ``BREAKS``, a list of ``(name, old, new, *extra_tests)``. ``old`` must occur exactly once in
TARGET. ``ONLY="a,b"`` runs only the breaks with those names. The suite's environment is set here. A SIGTERM
(``pkill -f docs/mutation/run.py``) restores TARGET before it exits; a SIGKILL does not (``git checkout`` it).
"""

import os
import runpy
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, DS_ACCELERATOR="cpu", TRITON_INTERPRET="1", OMP_NUM_THREADS="1")


def main() -> None:
    target, breaks, tests = Path(sys.argv[1]), runpy.run_path(sys.argv[2])["BREAKS"], sys.argv[3:]
    only = set(filter(None, os.environ.get("ONLY", "").split(",")))
    orig = target.read_text()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a kill still runs the restore below
    try:
        for name, old, new, *extra in breaks:
            if only and name not in only:
                continue
            if orig.count(old) != 1:
                print(f"{name}: the pattern occurs {orig.count(old)} times, not once", flush=True)
                continue
            target.write_text(orig.replace(old, new))
            r = subprocess.run([str(REPO / ".venv/bin/python"), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                                *tests, *extra], check=False, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=1500)
            target.write_text(orig)
            last = (r.stdout.strip().splitlines() or ["?"])[-1]
            failed = next((line for line in r.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))), "")
            print(f"{'RED' if r.returncode else 'SURVIVED'}\t{name}\t{last}\t{failed}", flush=True)
    finally:
        target.write_text(orig)


if __name__ == "__main__":
    main()
