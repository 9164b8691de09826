"""COMERA_REQUIRE_SERVICES=1 turns every skip in tests/ops into a failure naming its reason.

Runs one Slurm test in a child pytest whose ``os.geteuid`` says 1000 (a non-root user): without
the variable it is skipped with the reason, with it the same test fails with that reason.
"""

from __future__ import annotations

import os
import subprocess
import sys

from opsmarks import REPO

NODE = "tests/ops/test_slurm_harness.py::test_bad_config_path_is_a_clear_error"
AS_USER_1000 = "import os, sys, pytest; os.geteuid = lambda: 1000; sys.exit(pytest.main(sys.argv[1:]))"


def _pytest_as_non_root(**env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "COMERA_REQUIRE_SERVICES"}
    return subprocess.run([sys.executable, "-c", AS_USER_1000, "-p", "no:cacheprovider", "-q", "-rsfE", NODE],
                          cwd=REPO, env=base | env, capture_output=True, text=True, timeout=120, check=False)


def test_not_root_skips_with_reason():
    r = _pytest_as_non_root()
    assert r.returncode == 0 and "1 skipped" in r.stdout, r.stdout + r.stderr
    assert "euid 1000 is not root" in r.stdout, r.stdout


def test_require_services_turns_the_skip_into_a_failure():
    r = _pytest_as_non_root(COMERA_REQUIRE_SERVICES="1")
    assert r.returncode == 1 and "skipped" not in r.stdout, r.stdout + r.stderr
    assert "COMERA_REQUIRE_SERVICES=1 turns this skip into a failure" in r.stdout, r.stdout
    assert "euid 1000 is not root" in r.stdout, r.stdout
