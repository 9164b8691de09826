"""Distributed tests: every test here starts real processes (marked ``distributed``)."""

import sys
from pathlib import Path

import pytest

# The helpers and the rank functions live in importable modules of this folder, so that
# spawned ranks can unpickle them.
sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).parent == here:
            item.add_marker(pytest.mark.distributed)
