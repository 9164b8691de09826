"""Test helpers shared by tests/unit and tests/distributed (``tests/`` is on ``sys.path`` through
``tests/conftest.py``): checkpoint directories edited by hand, as a user with write access could."""

from __future__ import annotations

from pathlib import Path

import torch

from comera_dist.engine import manifest


def revouch(path: Path) -> None:
    """Re-render checkpoint ``path``'s manifest from the files there now: an edited checkpoint verifies again."""
    files = manifest.describe(path, manifest.checkpoint_files(path))
    (path / manifest.MARKER).write_text(manifest.render(path.name, files))


class CodeRunningPayload:
    """Unpickling it runs code: it writes ``flag``."""

    def __init__(self, flag: Path):
        self.flag = str(flag)

    def __reduce__(self):
        return exec, (f"open({self.flag!r}, 'w').write('code ran while unpickling')",)


def plant_payload(path: Path, shard: str, flag: Path) -> None:
    """Add a ``CodeRunningPayload`` to ``shard`` of checkpoint ``path`` and re-render the manifest, as someone with
    write access could: the integrity check passes, only the ``weights_only`` gate is left."""
    state = torch.load(path / shard, map_location="cpu", weights_only=False)
    state["extra"] = CodeRunningPayload(flag)
    torch.save(state, path / shard)
    revouch(path)
