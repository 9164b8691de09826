"""Start and stop a throwaway Prometheus on loopback, configured from monitoring/prometheus.yml.

Used by tests/ops and CI. The config is the shipped one with three test-time
changes: the file_sd path points at the job's discovery file, rule files are
absolute, and intervals are 1 s so a short run is scraped several times. The
TSDB is always fresh (a reused one serves stale samples after a restart).

usage: python monitoring/ci/promserver.py up DIR PORT SD_FILE   (prints the PID; DIR/prometheus.pid)
       python monitoring/ci/promserver.py down DIR
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import yaml

MONITORING = Path(__file__).resolve().parents[1]


def render_config(sd_file: Path, *, interval: str = "1s") -> dict:
    """monitoring/prometheus.yml with the file_sd path, rule paths and intervals set for a test."""
    cfg = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = cfg["global"]["evaluation_interval"] = interval
    cfg["rule_files"] = [str(MONITORING / f) for f in cfg.get("rule_files", [])]
    (job,) = [j for j in cfg["scrape_configs"] if j["job_name"] == "comera"]
    job["file_sd_configs"][0]["files"] = [str(sd_file)]
    job["file_sd_configs"][0]["refresh_interval"] = interval
    return cfg


def up(workdir: Path, port: int, sd_file: Path, *, timeout: float = 20.0) -> subprocess.Popen:
    """Start Prometheus on 127.0.0.1:port with a fresh TSDB under ``workdir``; wait until ready."""
    if shutil.which("prometheus") is None:
        raise FileNotFoundError("prometheus not on PATH: install the Debian package (launch/setup.sh --dev)")
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(workdir / "data", ignore_errors=True)
    config = workdir / "prometheus.yml"
    config.write_text(json.dumps(render_config(sd_file), indent=1))  # JSON is YAML
    check = subprocess.run(["promtool", "check", "config", str(config)], capture_output=True, text=True, check=False)
    if check.returncode != 0:
        raise RuntimeError(f"promtool rejected {config}:\n{check.stdout}{check.stderr}")
    log = (workdir / "prometheus.log").open("w")
    proc = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={workdir / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],  # never the default 0.0.0.0
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    (workdir / "prometheus.pid").write_text(str(proc.pid))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {proc.returncode}: {(workdir / 'prometheus.log').read_text()}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=1)
            return proc
        except OSError:
            time.sleep(0.1)
    down(workdir)
    raise TimeoutError(f"prometheus on 127.0.0.1:{port} not ready after {timeout}s")


def down(workdir: Path) -> None:
    """Stop the Prometheus recorded in ``workdir/prometheus.pid`` (SIGTERM, then SIGKILL after 10 s)."""
    pidfile = workdir / "prometheus.pid"
    if not pidfile.exists():
        return
    pid = int(pidfile.read_text())
    try:
        os.kill(pid, signal.SIGTERM)
        for _ in range(100):
            os.kill(pid, 0)
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:  # our child: reap it
                    break
            except ChildProcessError:
                pass
            time.sleep(0.1)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    pidfile.unlink(missing_ok=True)


def query(port: int, expr: str, *, at: float | None = None) -> list[dict]:
    """Instant query; returns the result vector (raises on an API error)."""
    params = {"query": expr} | ({"time": f"{at:.3f}"} if at is not None else {})
    return _get(port, "/api/v1/query", params)["result"]


def query_range(port: int, expr: str, start: float, end: float, step: float = 1.0) -> list[dict]:
    """Range query; returns the result matrix (raises on an API error)."""
    return _get(port, "/api/v1/query_range", {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}",
                                               "step": str(step)})["result"]


def wait_for(port: int, expr: str, *, timeout: float = 30.0) -> list[dict]:
    """Poll an instant query until it returns at least one series."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = query(port, expr)
        if result:
            return result
        time.sleep(0.25)
    raise TimeoutError(f"no series for {expr!r} on 127.0.0.1:{port} after {timeout}s")


def _get(port: int, path: str, params: dict) -> dict:
    url = f"http://127.0.0.1:{port}{path}?{urllib.parse.urlencode(params)}"
    try:
        body = json.load(urllib.request.urlopen(url, timeout=10))
    except urllib.error.HTTPError as e:
        body = json.load(e)
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus API {path} {params}: {body.get('errorType')}: {body.get('error')}")
    return body["data"]


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "up":
        proc = up(Path(argv[1]), int(argv[2]), Path(argv[3]))
        print(proc.pid)
        return 0
    if len(argv) == 2 and argv[0] == "down":
        down(Path(argv[1]))
        return 0
    print(__doc__.strip().splitlines()[-2:], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
