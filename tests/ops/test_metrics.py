"""Metrics fan-out on one process: config validation, exporter exposition, rank labels, report files."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from comera_dist.configbase import ConfigError, from_dict
from comera_dist.metrics import STANDARD_KEYS, Metrics, MetricsConfig, build_metrics
from comera_dist.metrics.exporter import GAUGES


def _scrape(m: Metrics) -> dict[tuple[str, tuple], float]:
    """Every sample of the live endpoint as {(name, sorted labels): value}, parsed by prometheus-client."""
    text = urllib.request.urlopen(f"http://{m.endpoint}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.fixture
def metrics(tmp_path):
    m = build_metrics(MetricsConfig(progress=False, rank_label_limit=4), rank=0, local_rank=0, world_size=2,
                      total_steps=10, output_dir=tmp_path, run_name="unit")
    yield m
    m.close()


@pytest.mark.parametrize("key, value, message", [
    ("prometheus_port", 70000, "metrics.prometheus_port must be in [0, 65535], got 70000"),
    ("log_every", 0, "metrics.log_every must be >= 1, got 0"),
    ("rank_label_limit", 0, "metrics.rank_label_limit must be >= 1, got 0"),
    ("prometheus_host", "bad host", "metrics.prometheus_host must be an IP address or host name"),
    ("prometheus_host", "", "metrics.prometheus_host must be an IP address or host name"),  # "" binds everywhere
    ("sd_file", " ", "metrics.sd_file must be a path or null"),
    ("compression_target", -1.0, "metrics.compression_target must be > 0 or null, got -1.0"),
    ("compression_target", 0.0, "metrics.compression_target must be > 0 or null, got 0.0"),
    ("compression_target", math.nan, "metrics.compression_target must be > 0 or null, got nan"),
    ("final_scrape_timeout_s", -1.0, "metrics.final_scrape_timeout_s must be in [0, 3600], got -1.0"),
    ("first_scrape_timeout_s", 3601.0, "metrics.first_scrape_timeout_s must be in [0, 3600], got 3601.0"),
])
def test_config_rejects_bad_values(key, value, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        from_dict(MetricsConfig, {key: value}, "metrics")


def test_config_accepts_the_documented_bounds():
    cfg = from_dict(MetricsConfig, {"first_scrape_timeout_s": 3600.0, "final_scrape_timeout_s": 3600.0,
                                    "prometheus_port": 65535}, "metrics")
    assert (cfg.first_scrape_timeout_s, cfg.final_scrape_timeout_s, cfg.prometheus_port) == (3600.0, 3600.0, 65535)


def test_config_unknown_key_suggests():
    with pytest.raises(ConfigError, match="did you mean 'log_every'"):
        from_dict(MetricsConfig, {"log_evry": 5}, "metrics")


def test_exporter_serves_standard_keys_in_base_units(metrics, tmp_path):
    values = {"train_loss": 2.5, "val_loss": 2.75, "val_accuracy": 0.25, "tokens_per_second": 1234.0,
              "learning_rate": 1e-4, "stage": 1, "lambda": 1.0, "compression_ratio": 3.5,
              "compression_ratio_tensorized": 7.0, "model_params": 1000, "peak_memory_bytes": 2**20, "epoch": 2,
              "step_time_seconds": 0.3, "data_wait_seconds": 0.02, "nonfinite_steps_total": 0,
              "custom_key": 9.0}
    metrics.log(values, step=7)
    got = _scrape(metrics)
    for key, (name, _) in GAUGES.items():
        if key in values:
            assert got[(name, ())] == pytest.approx(float(values[key])), name
    assert got[("comera_data_wait_seconds", ())] == pytest.approx(0.02)
    assert got[("comera_train_step", ())] == 7
    assert got[("comera_train_total_steps", ())] == 10 and got[("comera_world_size", ())] == 2
    assert got[("comera_step_time_seconds_count", ())] == 1
    assert got[("comera_step_time_seconds_bucket", (("le", "0.5"),))] == 1
    assert got[("comera_step_time_seconds_bucket", (("le", "0.25"),))] == 0
    assert got[("comera_nonfinite_steps_total", ())] == 0
    assert not any("custom" in name for name, _ in got)  # unknown keys: report only
    # never-logged gauges are absent rather than 0 (no fake 1970 checkpoint)
    assert ("comera_checkpoint_last_success_timestamp_seconds", ()) not in got
    assert ("comera_tt_rank_series_dropped", ()) not in got  # no ranks logged: no rank series, not a 0
    info = next(labels for name, labels in got if name == "comera_build_info")
    assert dict(info)["torch"] == torch.__version__ and dict(info)["deepspeed"] not in ("", "absent")


def test_counters_move_by_increments(metrics):
    metrics.log({"nonfinite_steps_total": 2}, step=1)
    metrics.log({"nonfinite_steps_total": 2}, step=2)
    metrics.log({"nonfinite_steps_total": 5}, step=3)
    metrics.checkpoint_saved(True, 3)
    metrics.checkpoint_saved(False, 4)
    metrics.checkpoint_saved(True, 5)
    got = _scrape(metrics)
    assert got[("comera_nonfinite_steps_total", ())] == 5
    assert got[("comera_checkpoint_saves_total", (("outcome", "success"),))] == 2
    assert got[("comera_checkpoint_saves_total", (("outcome", "failure"),))] == 1
    last_ok = [t for _, ok, t in metrics.history.checkpoints if ok][-1]
    assert got[("comera_checkpoint_last_success_timestamp_seconds", ())] == pytest.approx(last_ok)


def test_rank_labels_are_bounded(metrics):
    metrics.log_ranks({"b.layer": [3, 2], "a.layer": [5, 4, 1]}, step=1)  # 5 bonds, limit 4
    got = _scrape(metrics)
    ranks = {dict(lbl)["layer"] + f"[{dict(lbl)['bond']}]": v for (n, lbl), v in got.items() if n == "comera_tt_rank"}
    assert ranks == {"a.layer[0]": 5, "a.layer[1]": 4, "a.layer[2]": 1, "b.layer[0]": 3}
    assert got[("comera_tt_rank_series_dropped", ())] == 1
    assert metrics.history.ranks[-1][1]["b.layer"] == [3, 2]  # the report keeps everything


def test_sd_file_names_endpoint_then_withdraws(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    sd = tmp_path / "targets" / "run.json"
    m = build_metrics(MetricsConfig(progress=False, report=False, sd_file=str(sd)), rank=0, local_rank=0,
                      world_size=1, total_steps=1, output_dir=tmp_path / "out", run_name="sd")
    assert json.loads(sd.read_text()) == [{"targets": [m.endpoint], "labels": {"run": "sd", "slurm_job_id": "4242"}}]
    assert m.endpoint.startswith("127.0.0.1:") and int(m.endpoint.split(":")[1]) > 0
    m.close()
    assert json.loads(sd.read_text()) == []
    with pytest.raises(urllib.error.URLError) as gone:  # refused: nothing listens (not a hang, not an HTTP error)
        urllib.request.urlopen(f"http://{m.endpoint}/metrics", timeout=2)
    assert isinstance(gone.value.reason, ConnectionRefusedError), gone.value


@pytest.mark.parametrize("how", ["close", "exception"])
def test_a_failed_run_leaves_its_target_down_for_the_alert(tmp_path, how):
    """A crash or a failed stop (exit 3, 4) must not leave like a finished run: its target stays, nothing answers
    there, and Prometheus's ``up == 0`` (``ComeraTrainingStalled``) fires. Withdrawn, no alert could fire."""
    sd = tmp_path / "targets.json"
    cfg = MetricsConfig(progress=False, report=False, sd_file=str(sd))
    m = build_metrics(cfg, rank=0, local_rank=0, world_size=1, total_steps=1, output_dir=tmp_path, run_name="f")
    if how == "close":
        m.close(failed=True)
    else:
        with pytest.raises(RuntimeError, match="boom"), m:
            raise RuntimeError("boom")
    assert json.loads(sd.read_text()) == [{"targets": [m.endpoint], "labels": {"run": "f"}}]
    with pytest.raises(urllib.error.URLError) as gone:
        urllib.request.urlopen(f"http://{m.endpoint}/metrics", timeout=2)
    assert isinstance(gone.value.reason, ConnectionRefusedError), gone.value


def test_a_job_leaving_a_shared_sd_file_keeps_the_live_jobs_target(tmp_path):
    """Two runs given one ``metrics.sd_file``: the later one's target replaces the first's, and the first one's
    exit must not withdraw it (the live job would go unscraped, and no alert fire for it)."""
    sd = tmp_path / "targets" / "shared.json"
    cfg = MetricsConfig(progress=False, report=False, sd_file=str(sd))
    a = build_metrics(cfg, rank=0, local_rank=0, world_size=1, total_steps=1, output_dir=tmp_path / "a", run_name="a")
    b = build_metrics(cfg, rank=0, local_rank=0, world_size=1, total_steps=1, output_dir=tmp_path / "b", run_name="b")
    a.close()
    assert json.loads(sd.read_text()) == [{"targets": [b.endpoint], "labels": {"run": "b"}}]
    b.close()
    assert json.loads(sd.read_text()) == []


def test_a_resumed_job_serves_its_checkpoints_time_before_it_saves(tmp_path):
    """``ComeraCheckpointTooOld`` reads the last checkpoint's time: a resumed job serves the one it resumed
    (from the history inside it) from its first scrape, not only after its own first save (never, if all fail)."""
    cfg = MetricsConfig(progress=False, report=False)
    first = build_metrics(cfg, rank=0, local_rank=0, world_size=1, total_steps=4, output_dir=tmp_path, run_name="r")
    first.log({"train_loss": 1.0}, 2)
    first.checkpoint_saved(True, 2)
    (tmp_path / "step2").mkdir()
    for name, text in first.history_files(2).items():
        (tmp_path / "step2" / name).write_text(text)
    saved_at = first.history.checkpoints[-1][2]
    first.close()
    resumed = build_metrics(cfg, rank=0, local_rank=0, world_size=1, total_steps=4, output_dir=tmp_path, run_name="r")
    try:
        resumed.restore_history(2, tmp_path / "step2")
        want = max(when for _, ok, when in resumed.history.checkpoints if ok)  # the step-2 record inside it
        assert abs(want - saved_at) < 60
        assert _scrape(resumed)[("comera_checkpoint_last_success_timestamp_seconds", ())] == want
    finally:
        resumed.close()


def test_busy_port_is_a_clear_error(metrics, tmp_path):
    port = int(metrics.endpoint.split(":")[1])
    with pytest.raises(OSError, match=f"cannot serve Prometheus on 127.0.0.1:{port}"):
        build_metrics(MetricsConfig(progress=False, prometheus_port=port), rank=0, local_rank=0, world_size=1,
                      total_steps=1, output_dir=tmp_path / "b", run_name="busy")


def test_other_ranks_export_nothing(tmp_path):
    m = build_metrics(MetricsConfig(), rank=1, local_rank=1, world_size=2, total_steps=5, output_dir=tmp_path,
                      run_name="r1")
    m.log({"train_loss": 1.0}, 1)
    m.log_ranks({"l": [2]}, 1)
    m.checkpoint_saved(True, 1)
    m.close()
    assert m.endpoint is None and m.progress is None and not m.history.scalars
    assert list(tmp_path.iterdir()) == []  # no targets file, no report


@pytest.mark.parametrize("call, message", [
    (lambda m: m.log({"train_loss": "x"}, 1), "value of 'train_loss' must be a real number"),
    (lambda m: m.log({"train_loss": 1.0}, -1), "step must be an int >= 0, got -1"),
    (lambda m: m.log_ranks({"l": [2, -1]}, 1), "ranks of layer 'l' must be ints >= 0"),
])
def test_bad_input_names_the_value(tmp_path, call, message):
    m = build_metrics(MetricsConfig(prometheus=False, progress=False, report=False), rank=1, local_rank=0,
                      world_size=2, total_steps=5, output_dir=tmp_path, run_name="bad")
    with pytest.raises((TypeError, ValueError), match=message):
        call(m)  # checked on every rank, not only the exporting one


def test_bad_rank_argument():
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=2\), got rank=2"):
        Metrics(MetricsConfig(), rank=2, local_rank=0, world_size=2, total_steps=1, output_dir=".", run_name="x")


def test_report_markdown_and_pngs(tmp_path):
    m = build_metrics(MetricsConfig(prometheus=False, progress=True, log_every=2), rank=0, local_rank=0,
                      world_size=1, total_steps=6, output_dir=tmp_path, run_name="rep")
    for step in range(6):
        m.log({"train_loss": 3.0 - 0.1 * step, "compression_ratio": 1.0 + step, "stage": step >= 3,
               "objective": 9.0}, step)
        if step % 2 == 0:
            m.log({"val_loss": 3.1 - 0.1 * step}, step)
        m.log_ranks({"enc.q": [4, 4 - step // 2], "emb": [8]}, step)
    m.log({"train_loss": math.nan}, 6)
    m.checkpoint_saved(True, 6)
    m.close()
    md = (tmp_path / "report.md").read_text()
    assert "# Run report: rep" in md and "- checkpoints: 1 saved, 0 failed" in md
    assert "- processes: 1" in md and "- steps configured: 6" in md and "- last step logged: 6" in md
    assert "- best validation loss: 2.7000 at step 4" in md and "- late stage from step 3" in md
    assert "| objective | 9 | 9 | 9 | 9 |" in md  # unknown keys kept for the report
    assert "| train_loss | 3 | nan | 2.5 | 3 |" in md
    assert "| enc.q | [4, 4] -> [4, 2] |" in md
    for png in ("report_loss.png", "report_compression.png", "report_ranks.png"):
        assert f"]({png})" in md
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_standard_keys_documented():
    text = (Path(__file__).resolve().parents[2] / "monitoring/README.md").read_text()
    for key in STANDARD_KEYS:
        assert f"`{key}`" in text, key


def _late_scrape(m: Metrics, wait) -> tuple[bool, float, dict]:
    """Run ``wait()`` while a scraper reads the endpoint 0.5 s later, as Prometheus does for a job of seconds:
    (what ``wait`` returned, how long it took, every sample the scraper read)."""
    import threading
    import time

    seen = {}

    def scraper():
        time.sleep(0.5)
        seen.update(_scrape(m))

    t = threading.Thread(target=scraper)
    t.start()
    t0 = time.monotonic()
    got = wait()
    waited = time.monotonic() - t0
    t.join()
    return got, waited, seen


def test_close_waits_for_a_final_scrape(tmp_path):
    m = build_metrics(MetricsConfig(progress=False, report=False, final_scrape_timeout_s=30), rank=0, local_rank=0,
                      world_size=1, total_steps=1, output_dir=tmp_path, run_name="linger")
    m.log({"train_loss": 1.5}, 1)
    scraped, waited, seen = _late_scrape(m, lambda: m.exporter.close(m.cfg.final_scrape_timeout_s))
    assert scraped is True
    assert 0.4 < waited < 10 and seen[("comera_train_loss", ())] == 1.5


def test_close_gives_up_without_scraper(tmp_path):
    import time

    m = build_metrics(MetricsConfig(progress=False, report=False, final_scrape_timeout_s=0.3), rank=0, local_rank=0,
                      world_size=1, total_steps=1, output_dir=tmp_path, run_name="alone")
    m.log({"train_loss": 1.5}, 1)
    t0 = time.monotonic()
    assert m.exporter.close(0.3) is False
    assert 0.3 <= time.monotonic() - t0 < 5


def test_first_scrape_wait_returns_once_the_starting_values_are_read(tmp_path):
    m = build_metrics(MetricsConfig(progress=False, report=False, first_scrape_timeout_s=30), rank=0, local_rank=0,
                      world_size=1, total_steps=2, output_dir=tmp_path, run_name="start")
    m.log({"train_loss": 2.5}, 0)
    scraped, waited, seen = _late_scrape(m, m.wait_for_first_scrape)
    m.close()
    assert scraped is True
    assert 0.4 < waited < 10 and seen[("comera_train_loss", ())] == 2.5
    assert seen[("comera_step_time_seconds_count", ())] == 0  # rate() panels' sample before the steps


def test_first_scrape_wait_gives_up_and_is_off_by_default(tmp_path):
    import time

    m = build_metrics(MetricsConfig(progress=False, report=False, first_scrape_timeout_s=0.3), rank=0, local_rank=0,
                      world_size=1, total_steps=1, output_dir=tmp_path, run_name="unscraped")
    m.log({"train_loss": 1.5}, 0)
    t0 = time.monotonic()
    assert m.wait_for_first_scrape() is False
    assert 0.3 <= time.monotonic() - t0 < 5
    m.close()
    off = build_metrics(MetricsConfig(progress=False, report=False), rank=0, local_rank=0,
                        world_size=1, total_steps=1, output_dir=tmp_path / "off", run_name="off")
    off.log({"train_loss": 1.5}, 0)
    waits = []
    off.exporter.wait_for_scrape = lambda timeout: waits.append(timeout) or False
    assert off.wait_for_first_scrape() is True and waits == []  # off by default: no wait at all
    off.close()


# The names the dashboard, the alerts and monitoring/README.md use: pinned here, not read back from GAUGES.
SERVED_NAMES = {
    "train_loss": "comera_train_loss", "val_loss": "comera_val_loss", "val_accuracy": "comera_val_accuracy_ratio",
    "tokens_per_second": "comera_tokens_per_second", "data_wait_seconds": "comera_data_wait_seconds",
    "learning_rate": "comera_learning_rate", "stage": "comera_stage", "lambda": "comera_lambda",
    "compression_ratio": "comera_compression_ratio",
    "compression_ratio_tensorized": "comera_compression_ratio_tensorized",
    "target_compression_ratio": "comera_compression_ratio_target", "model_params": "comera_model_parameters",
    "peak_memory_bytes": "comera_peak_memory_bytes", "epoch": "comera_epoch",
}


def test_every_gauge_key_is_served_under_its_documented_name(metrics):
    values = {key: float(i + 1) for i, key in enumerate(SERVED_NAMES)}
    metrics.log(values, step=3)
    got = _scrape(metrics)
    assert {key: got.get((name, ())) for key, name in SERVED_NAMES.items()} == values


def test_compression_target_is_served_from_the_start(tmp_path):
    m = build_metrics(MetricsConfig(progress=False, report=False, compression_target=2.5), rank=0, local_rank=0,
                      world_size=1, total_steps=1, output_dir=tmp_path, run_name="target")
    try:
        assert _scrape(m)[("comera_compression_ratio_target", ())] == 2.5
    finally:
        m.close()


def test_a_failed_checkpoint_keeps_the_last_success_time_and_is_recorded(metrics):
    got = _scrape(metrics)  # both outcome series exist before any save: the first failure is an increase
    assert got[("comera_checkpoint_saves_total", (("outcome", "failure"),))] == 0
    assert got[("comera_checkpoint_saves_total", (("outcome", "success"),))] == 0
    metrics.checkpoint_saved(True, 2)
    ok_time = metrics.history.checkpoints[-1][2]

    def time_of():
        return _scrape(metrics)[("comera_checkpoint_last_success_timestamp_seconds", ())]

    assert time_of() == ok_time
    metrics.checkpoint_saved(False, 4)
    assert metrics.history.checkpoints[-1][2] > ok_time
    assert time_of() == ok_time  # the checkpoint-age panel and alert keep counting from the good one
    assert [(s, ok) for s, ok, _ in metrics.history.checkpoints] == [(2, True), (4, False)]  # the report's count


def test_a_failed_checkpoint_needs_its_own_scrape_before_close(metrics):
    """The failure moved only a counter: the final-scrape wait must still wait for a scrape that reads it."""
    metrics.log({"train_loss": 1.0}, 1)
    _scrape(metrics)
    assert metrics.exporter.wait_for_scrape(0) is True
    metrics.checkpoint_saved(False, 1)
    assert metrics.exporter.wait_for_scrape(0.2) is False
    _scrape(metrics)
    assert metrics.exporter.wait_for_scrape(0) is True


def test_a_wildcard_bind_advertises_the_host_name(tmp_path):
    import socket

    m = build_metrics(MetricsConfig(progress=False, report=False, prometheus_host="0.0.0.0"), rank=0, local_rank=0,
                      world_size=1, total_steps=1, output_dir=tmp_path, run_name="wild")
    try:
        port = m.exporter.port
        assert m.endpoint == f"{socket.getfqdn()}:{port}"  # what another node's Prometheus can reach
        assert json.loads((tmp_path / "prometheus_targets.json").read_text())[0]["targets"] == [m.endpoint]
    finally:
        m.close()


def test_a_fully_pruned_bond_is_logged_as_rank_zero(metrics):
    metrics.log_ranks({"enc.q": [0, 3]}, step=5)
    got = _scrape(metrics)
    assert got[("comera_tt_rank", (("bond", "0"), ("layer", "enc.q")))] == 0
    assert metrics.history.ranks == [(5, {"enc.q": [0, 3]})]


def test_the_progress_bar_counts_to_the_configured_steps(tmp_path):
    m = build_metrics(MetricsConfig(prometheus=False, report=False), rank=0, local_rank=0, world_size=1,
                      total_steps=12, output_dir=tmp_path, run_name="bar")
    try:
        assert m.progress._bar.total == 12
    finally:
        m.close()


def test_two_jobs_on_one_node_get_their_own_port(tmp_path):
    """The default port is 0 (a free one each): two jobs sharing a node never collide."""
    a, b = (build_metrics(MetricsConfig(progress=False, report=False), rank=0, local_rank=0, world_size=1,
                          total_steps=1, output_dir=tmp_path / name, run_name=name) for name in ("a", "b"))
    try:
        assert a.endpoint.startswith("127.0.0.1:") and a.exporter.port != b.exporter.port
    finally:
        a.close()
        b.close()


def test_an_empty_run_reports_no_last_step(tmp_path):
    m = build_metrics(MetricsConfig(prometheus=False, progress=False), rank=0, local_rank=0, world_size=3,
                      total_steps=9, output_dir=tmp_path, run_name="empty")
    m.close()
    md = (tmp_path / "report.md").read_text()
    assert "- last step logged: none" in md and "- processes: 3" in md and "- steps configured: 9" in md


def test_timestamps_are_unix_seconds(metrics):
    """``time() - comera_*_timestamp_seconds`` (the step-stall and checkpoint-age panels) needs wall-clock time."""
    import time

    t0 = time.time()
    metrics.log({"train_loss": 1.0}, 1)
    metrics.checkpoint_saved(True, 1)
    t1 = time.time()
    got = _scrape(metrics)
    assert t0 <= got[("comera_last_step_timestamp_seconds", ())] <= t1
    assert t0 <= got[("comera_checkpoint_last_success_timestamp_seconds", ())] <= t1
    assert t0 <= metrics.history.checkpoints[-1][2] <= t1


def test_a_non_finite_step_time_is_not_observed(metrics):
    metrics.log({"step_time_seconds": math.inf}, 1)
    metrics.log({"step_time_seconds": math.nan}, 2)
    metrics.log({"step_time_seconds": -0.5}, 3)
    metrics.log({"step_time_seconds": 0.2}, 4)
    got = _scrape(metrics)
    assert got[("comera_step_time_seconds_count", ())] == 1  # the mean step time panel stays finite
    assert got[("comera_step_time_seconds_sum", ())] == pytest.approx(0.2)


MULTIPROC_RUNS = """
import json, sys, urllib.request
from prometheus_client.parser import text_string_to_metric_families
from comera_dist.metrics import MetricsConfig, build_metrics

def run(out):
    m = build_metrics(MetricsConfig(progress=False), rank=0, local_rank=0, world_size=1, total_steps=4,
                      output_dir=out, run_name="unit")
    m.checkpoint_saved(True, 1)
    m.log({"nonfinite_steps_total": 1, "step_time_seconds": 0.2}, step=1)
    text = urllib.request.urlopen(f"http://{m.endpoint}/metrics", timeout=5).read().decode()
    m.close()
    return {s.name + json.dumps(s.labels, sort_keys=True): s.value
            for f in text_string_to_metric_families(text) for s in f.samples if f.type in ("counter", "histogram")
            and not s.name.endswith("_created")}

print(json.dumps([run(sys.argv[1] + "/a"), run(sys.argv[1] + "/b")]))
"""


@pytest.mark.parametrize("made", [True, False])
def test_a_prometheus_multiproc_dir_is_ignored(tmp_path, made):
    """prometheus-client's multiprocess mode (the variable set for some other program): a second run in one process
    started its counters at the first run's counts, and a directory that does not exist crashed the first metric."""
    multiproc = tmp_path / "multiproc"
    if made:
        multiproc.mkdir()
    env = os.environ | {"PROMETHEUS_MULTIPROC_DIR": str(multiproc)}
    p = subprocess.run([sys.executable, "-c", MULTIPROC_RUNS, str(tmp_path)], env=env, capture_output=True,
                       text=True, timeout=120, check=False)
    assert p.returncode == 0, p.stderr
    first, second = json.loads(p.stdout)
    assert first == second, (first, second)  # each run counts from 0
    assert first['comera_checkpoint_saves_total{"outcome": "success"}'] == 1
    assert first["comera_nonfinite_steps_total{}"] == 1 and first["comera_step_time_seconds_count{}"] == 1
    assert f"metrics: PROMETHEUS_MULTIPROC_DIR={multiproc} is ignored" in p.stderr
    assert not made or list(multiproc.iterdir()) == []  # no mmapped files left behind
