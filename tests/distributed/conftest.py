"""Distributed tests: every test here starts real processes (marked ``distributed``).

The mark is checked, not trusted: a test here that passes without starting a process, itself
or through a fixture it uses (a module-scoped run shared by several tests counts for each),
fails with a note to move it to tests/unit, tests/e2e or tests/ops. What is counted is every
process start of this pytest process (subprocess, multiprocessing spawn or fork, posix_spawn);
the one started may be a launcher that starts the ranks, so this is a floor, not "2 ranks".
"""

import _posixsubprocess
import functools
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The helpers and the rank functions live in importable modules of this folder, so that
# spawned ranks can unpickle them.
sys.path.insert(0, str(Path(__file__).parent))

HERE = Path(__file__).parent
_starts = 0  # process starts seen so far in this pytest process
_fixture_starts: dict[tuple[str, str], int] = {}  # (fixture baseid, name) -> starts during its setups
_item_start = pytest.StashKey[int]()


def _count() -> None:
    global _starts
    _starts += 1


def _counted(start):
    @functools.wraps(start)
    def counted(*args, **kwargs):
        _count()
        return start(*args, **kwargs)
    return counted


# subprocess.Popen calls fork_exec through its own name for it (bound at import), or posix_spawn;
# multiprocessing's spawn/forkserver look fork_exec up on _posixsubprocess; its fork, os.fork.
subprocess._fork_exec = _counted(subprocess._fork_exec)
_posixsubprocess.fork_exec = _counted(_posixsubprocess.fork_exec)
os.posix_spawn = _counted(os.posix_spawn)
os.posix_spawnp = _counted(os.posix_spawnp)
os.register_at_fork(after_in_parent=_count)


def _here(item) -> bool:
    return Path(str(item.fspath)).parent == HERE


def pytest_collection_modifyitems(items):
    for item in items:
        if _here(item):
            item.add_marker(pytest.mark.distributed)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    before = _starts
    try:
        return (yield)
    finally:
        if _starts > before:
            key = (fixturedef.baseid, fixturedef.argname)
            _fixture_starts[key] = _fixture_starts.get(key, 0) + _starts - before


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    item.stash[_item_start] = _starts
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    result = yield  # raises (and skips this check) when the test failed or skipped
    if _here(item) and _starts == item.stash[_item_start] and not any(
            name in item.fixturenames and item.nodeid.startswith(baseid) for baseid, name in _fixture_starts):
        pytest.fail(f"{item.nodeid} passed without starting a process: it is no distributed test; move it to "
                    "tests/unit, tests/e2e or tests/ops (tests/distributed/conftest.py)", pytrace=False)
    return result
