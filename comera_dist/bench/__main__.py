"""``python -m comera_dist.bench <name> [options]``: run one benchmark, print a table, write JSON.

Each benchmark is a module ``comera_dist.bench.<name>`` (dashes become underscores)
exposing ``main(argv: list[str]) -> int``; the package's other modules are helpers.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pkgutil
import sys
from pathlib import Path

import comera_dist.bench as _pkg

USAGE = "usage: python -m comera_dist.bench <name> [options]"


def _defines_main(module: str) -> bool:
    """Whether ``comera_dist.bench.<module>`` defines a top-level ``main``. Read from the source, not
    imported: listing the benchmarks must not import torch, DeepSpeed and the models of every one."""
    spec = importlib.util.find_spec(f"{_pkg.__name__}.{module}")
    tree = ast.parse(Path(spec.origin).read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in tree.body)


def _modules() -> dict[str, bool]:
    """Every module of the package by CLI name, and whether it is a benchmark (has a ``main``)."""
    return {m.name.replace("_", "-"): _defines_main(m.name) for m in pkgutil.iter_modules(_pkg.__path__)
            if m.name != "__main__"}


def available() -> list[str]:
    """The runnable benchmarks' names, sorted."""
    return sorted(name for name, runnable in _modules().items() if runnable)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    modules = _modules()
    names = sorted(name for name, runnable in modules.items() if runnable)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\nbenchmarks: " + ", ".join(names))
        return 0 if argv else 2
    name = argv[0]
    if name not in names:
        why = f"{name!r} is a helper of the benchmarks (no main)" if name in modules else \
            f"unknown benchmark {name!r}"
        print(f"{USAGE}\n{why}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"comera_dist.bench.{name.replace('-', '_')}")
    from comera_dist.configbase import ConfigError
    from comera_dist.engine.errors import InputError
    from comera_dist.kernels.dispatch import SettingError

    try:
        return module.main(argv[1:])
    except (ConfigError, InputError, SettingError) as e:  # a config it loads (--config, --set), a COMERA_* setting
        print(f"python -m comera_dist.bench {name}: error: {e}".replace("\n", " "), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
