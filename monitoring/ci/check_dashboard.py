"""Validate the Grafana dashboard without a Grafana server: structure, datasource uid, PromQL.

Structure: unique panel ids, every gridPos inside 24 columns and no two panels
overlapping, every datasource uid equal to the provisioned one. PromQL: every
target expression (Grafana variables substituted) parses and type-checks in
``promtool check rules``, and, given a live Prometheus, returns data.

usage: python monitoring/ci/check_dashboard.py [DASHBOARD_JSON] [--prometheus-port PORT [--run NAME]]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

MONITORING = Path(__file__).resolve().parents[1]
DASHBOARD = MONITORING / "grafana/dashboards/comera-training.json"
DATASOURCES = MONITORING / "grafana/provisioning/datasources/prometheus.yml"
GRID_COLUMNS = 24

# Grafana's variables -> values promtool and the live Prometheus accept ($run: any run, or the one given)
VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m", "$run": ".*"}
RUN_MATCHER = re.compile(r'(\w+)\s*(?:=~|!~|!=|=)\s*"\$(?:run|\{run\})"')


def provisioned_uids(path: Path = DATASOURCES) -> set[str]:
    return {ds["uid"] for ds in yaml.safe_load(path.read_text())["datasources"]}


def structure_errors(dash: dict, uids: set[str]) -> list[str]:
    """Everything structurally wrong with the dashboard, one message per problem (empty = valid)."""
    errors = []
    panels = dash.get("panels") or []
    if not panels:
        errors.append("dashboard has no panels")
    ids = [p.get("id") for p in panels]
    errors += [f"panel id {i!r} used {ids.count(i)} times" for i in sorted(set(ids), key=str) if ids.count(i) > 1]
    boxes = []
    for p in panels:
        g, name = p.get("gridPos", {}), f"panel {p.get('id')} ({p.get('title')!r})"
        x, y, w, h = (g.get(k) for k in ("x", "y", "w", "h"))
        if not all(isinstance(v, int) for v in (x, y, w, h)):
            errors.append(f"{name}: gridPos needs integer x, y, w, h, got {g}")
            continue
        if x < 0 or y < 0 or w < 1 or h < 1 or x + w > GRID_COLUMNS:
            errors.append(f"{name}: gridPos {g} outside the {GRID_COLUMNS}-column grid")
        for other, (ox, oy, ow, oh) in boxes:
            if x < ox + ow and ox < x + w and y < oy + oh and oy < y + h:
                errors.append(f"{name}: gridPos {g} overlaps {other}")
        boxes.append((name, (x, y, w, h)))
    for where, ds in _datasources(dash):
        if ds.get("uid") not in uids:
            errors.append(f"{where}: datasource uid {ds.get('uid')!r} not provisioned (have {sorted(uids)})")
    for p in panels:
        if p.get("type") != "row" and not any(t.get("expr") for t in p.get("targets", [])):
            errors.append(f"panel {p.get('id')} ({p.get('title')!r}) has no PromQL target")
        for t in p.get("targets", []):
            # `.*` matches a missing label too: `{rnu=~"$run"}` would show every run, found by no query
            errors += [f"panel {p.get('id')} ({p.get('title')!r}): $run on label {label!r}, not 'run': {t['expr']}"
                       for label in RUN_MATCHER.findall(t.get("expr") or "") if label != "run"]
    return errors


def expressions(dash: dict, run: str | None = None) -> list[str]:
    """Every target's PromQL, with Grafana variables replaced by concrete values; ``run``: the run to select
    (a live check names its run, so that a panel selecting on the wrong label finds nothing), else any run."""
    # the regex of that one name, inside a PromQL string (whose own escapes double the backslashes)
    selected = VARIABLES["$run"] if run is None else re.escape(run).replace("\\", "\\\\").replace('"', '\\"')
    values = VARIABLES | {"$run": selected, "${run}": selected}
    out = []
    for p in dash.get("panels", []):
        for t in p.get("targets", []):
            if t.get("expr"):
                expr = t["expr"]
                for var in sorted(values, key=len, reverse=True):
                    expr = expr.replace(var, values[var])
                if re.search(r"\$\w", expr):
                    raise ValueError(f"panel {p.get('id')}: unknown Grafana variable in {t['expr']!r}")
                out.append(expr)
    return out


def promtool_errors(exprs: list[str]) -> str | None:
    """None when promtool accepts every expression as a recording rule, else its output."""
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:expr_{i}", "expr": e}
                                                        for i, e in enumerate(exprs)]}]}
    with tempfile.NamedTemporaryFile("w", suffix=".yml") as f:
        json.dump(rules, f)
        f.flush()
        r = subprocess.run(["promtool", "check", "rules", f.name], capture_output=True, text=True, check=False)
    return None if r.returncode == 0 else (r.stdout + r.stderr)


def _datasources(dash: dict):
    for p in dash.get("panels", []):
        if isinstance(p.get("datasource"), dict):
            yield f"panel {p.get('id')}", p["datasource"]
        for t in p.get("targets", []):
            if isinstance(t.get("datasource"), dict):
                yield f"panel {p.get('id')} target {t.get('refId')}", t["datasource"]
    for v in dash.get("templating", {}).get("list", []):
        if isinstance(v.get("datasource"), dict):
            yield f"variable {v.get('name')}", v["datasource"]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dashboard", nargs="?", type=Path, default=DASHBOARD)
    ap.add_argument("--prometheus-port", type=int, help="also query a live Prometheus on 127.0.0.1:PORT")
    ap.add_argument("--run", help="with --prometheus-port: the run every panel must show (default: any run)")
    args = ap.parse_args(argv)
    dash = json.loads(args.dashboard.read_text())
    ok = True
    for e in structure_errors(dash, provisioned_uids()):
        print("structure:", e)
        ok = False
    exprs = expressions(dash, args.run)
    err = promtool_errors(exprs)
    print(f"promtool: {len(exprs)} expressions", "ok" if err is None else f"FAILED\n{err}")
    ok &= err is None
    if args.prometheus_port:
        sys.path.insert(0, str(Path(__file__).parent))
        from promserver import query
        for e in exprs:
            n = len(query(args.prometheus_port, e))
            print(f"  {n:3d} series  {e}")
            ok &= n > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
