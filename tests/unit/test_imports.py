"""The import direction of docs/ARCHITECTURE.md, checked by parsing every module."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "comera_dist"

# package -> comera_dist subpackages it must never import
FORBIDDEN = {
    "tensor": {"layers", "kernels", "compression", "models", "data", "engine", "metrics", "bench", "cli"},
    "kernels": {"layers", "compression", "models", "data", "engine", "metrics", "cli"},
    "layers": {"compression", "models", "data", "engine", "metrics", "cli"},
    "compression": {"models", "data", "engine", "metrics", "cli"},
    "models": {"compression", "data", "engine", "metrics", "cli"},
    "data": {"layers", "kernels", "compression", "models", "engine", "cli"},
    "metrics": {"engine", "cli"},
}
THIRD_PARTY_OWNER = {"deepspeed": {"engine", "bench"}, "triton": {"kernels"}}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if node.level == 0 else f"comera_dist.{node.module}"
            names.add(base)
    return names


def test_import_direction():
    violations = []
    for path in PKG.rglob("*.py"):
        pkg = path.relative_to(PKG).parts[0].removesuffix(".py")
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] == "comera_dist" and len(parts) > 1 and parts[1] in FORBIDDEN.get(pkg, ()):
                violations.append(f"{path.relative_to(PKG)} imports {name}")
            owners = THIRD_PARTY_OWNER.get(parts[0])
            if owners is not None and pkg not in owners:
                violations.append(f"{path.relative_to(PKG)} imports {parts[0]} (only {sorted(owners)} may)")
    assert not violations, "\n".join(violations)


def test_tensor_imports_only_torch():
    allowed = {"torch", "math", "itertools", "functools", "dataclasses", "typing", "__future__", "enum",
               "collections", "comera_dist",
               "threading"}  # smallops' per-thread mode (a thread-local flag), no threads of its own
    bad = [f"{p.name}: {n}" for p in (PKG / "tensor").rglob("*.py") for n in _imports(p)
           if n.split(".")[0] not in allowed]
    assert not bad, bad
