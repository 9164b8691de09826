"""``python -m comera_dist.bench <name> [options]``: run one benchmark, print a table, write JSON.

Each benchmark is a module ``comera_dist.bench.<name>`` (dashes become underscores)
exposing ``main(argv: list[str]) -> int``.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys

import comera_dist.bench as _pkg

_NOT_BENCHMARKS = {"common", "__main__", "graphed", "six_encoder_device"}
"""Helper modules of the benchmarks (no ``main``)."""


def available() -> list[str]:
    return sorted(m.name.replace("_", "-") for m in pkgutil.iter_modules(_pkg.__path__)
                  if m.name not in _NOT_BENCHMARKS)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = available()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\nbenchmarks: " + ", ".join(names))
        return 0 if argv else 2
    name = argv[0]
    if name not in names:
        print(f"unknown benchmark {name!r}; available: {', '.join(names)}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"comera_dist.bench.{name.replace('-', '_')}")
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
