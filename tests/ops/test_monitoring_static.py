"""monitoring/ validated offline: promtool on config and rules, alert unit tests, the dashboard's structure and PromQL."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import urllib.request

import pytest
import yaml
from check_dashboard import DASHBOARD, expressions, promtool_errors, provisioned_uids, structure_errors
from opsmarks import REPO, requires_prometheus

from comera_dist.metrics import MetricsConfig, build_metrics
from comera_dist.metrics.exporter import STEP_TIME_BUCKETS

pytestmark = requires_prometheus
MON = REPO / "monitoring"
RULES = MON / "rules/comera.rules.yml"
ALERTS = {"ComeraTrainingStalled", "ComeraLossNaN", "ComeraThroughputDrop", "ComeraCheckpointTooOld",
          "ComeraCheckpointSaveFailed", "ComeraCompressionTargetMissed"}


def _promtool(*args, cwd=MON) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def test_promtool_check_config_and_rules():
    r = _promtool("check", "config", "prometheus.yml")
    assert r.returncode == 0 and "SUCCESS: 1 rule files found" in r.stdout, r.stdout + r.stderr
    r = _promtool("check", "rules", RULES)
    assert r.returncode == 0 and "SUCCESS: 6 rules found" in r.stdout, r.stdout + r.stderr


def test_prometheus_yml_discovers_targets_from_files():
    cfg = yaml.safe_load((MON / "prometheus.yml").read_text())
    (job,) = cfg["scrape_configs"]
    assert job["job_name"] == "comera" and "static_configs" not in job
    assert job["file_sd_configs"][0]["files"] == ["targets/*.json"]


def test_alert_rules_unit_tests_pass():
    r = _promtool("test", "rules", "comera.rules.test.yml", cwd=MON / "rules")
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_every_alert_exists_and_has_a_unit_test():
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == ALERTS
    tests = yaml.safe_load((MON / "rules/comera.rules.test.yml").read_text())["tests"]
    tested = {c["alertname"] for t in tests for c in t["alert_rule_test"] if c.get("exp_alerts")}
    assert tested == ALERTS  # each alert has a case where it fires (and the file has quiet cases too)


@pytest.mark.parametrize("alert", sorted(ALERTS))
def test_unit_tests_catch_a_broken_alert(alert, tmp_path):
    """Replace one alert's expression by one that never fires: its unit test must fail."""
    rules = yaml.safe_load(RULES.read_text())
    for rule in rules["groups"][0]["rules"]:
        if rule["alert"] == alert:
            rule["expr"] = "vector(0) > 1"
    (tmp_path / "comera.rules.yml").write_text(yaml.safe_dump(rules))
    (tmp_path / "t.yml").write_text((MON / "rules/comera.rules.test.yml").read_text())
    r = _promtool("test", "rules", "t.yml", cwd=tmp_path)
    assert r.returncode != 0 and f"alertname: {alert}" in r.stdout + r.stderr, r.stdout + r.stderr


def test_dashboard_structure(dashboard):
    assert structure_errors(dashboard, provisioned_uids()) == []


@pytest.mark.parametrize("break_it, expected", [
    (lambda d: d["panels"][1].update(id=d["panels"][0]["id"]), "used 2 times"),
    (lambda d: d["panels"][0]["gridPos"].update(w=30), "outside the 24-column grid"),
    (lambda d: d["panels"][1]["gridPos"].update(x=0, y=0), "overlaps panel 1"),
    (lambda d: d["panels"][2]["targets"][0]["datasource"].update(uid="other"), "datasource uid 'other' not provisioned"),
    # `.*` would match the missing label too, so no query could find the typo
    (lambda d: d["panels"][2]["targets"][0].update(expr=d["panels"][2]["targets"][0]["expr"].replace(
        'run=~"$run"', 'rnu=~"$run"')), "$run on label 'rnu', not 'run'"),
    (lambda d: d["panels"][2]["targets"][0].update(expr=d["panels"][2]["targets"][0]["expr"].replace(
        'run=~"$run"', 'rnu=~"${run}"')), "$run on label 'rnu', not 'run'"),
])
def test_structure_check_catches(dashboard, break_it, expected):
    broken = copy.deepcopy(dashboard)
    break_it(broken)
    assert any(expected in e for e in structure_errors(broken, provisioned_uids())), expected


def test_provisioning_files():
    ds = yaml.safe_load((MON / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["uid"] == "comera-prometheus"
    prov = yaml.safe_load((MON / "grafana/provisioning/dashboards/comera.yml").read_text())
    (provider,) = prov["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_dashboard_promql_passes_promtool(dashboard):
    exprs = expressions(dashboard)
    assert len(exprs) >= 16
    assert promtool_errors(exprs) is None
    assert promtool_errors(["sum(rate(comera_train_loss[5m]) by"]) is not None  # the check can fail


def test_dashboard_shows_required_views(dashboard):
    text = " ".join(expressions(dashboard))
    for metric in ("comera_compression_ratio", "comera_tt_rank", "comera_train_loss", "comera_val_loss",
                   "comera_tokens_per_second", "comera_data_wait_seconds", "comera_peak_memory_bytes",
                   "time() - comera_checkpoint_last_success_timestamp_seconds", "comera_stage"):
        assert metric in text, metric


def test_rules_and_dashboard_use_only_exported_metrics(tmp_path, dashboard):
    """Every comera_* name in the alerts and the dashboard is served by a real exporter."""
    m = build_metrics(MetricsConfig(progress=False, report=False, compression_target=2.0), rank=0, local_rank=0,
                      world_size=1, total_steps=3, output_dir=tmp_path, run_name="names")
    m.log({"train_loss": 1, "val_loss": 1, "val_accuracy": 0.5, "tokens_per_second": 1, "step_time_seconds": 0.1,
           "data_wait_seconds": 0.01, "learning_rate": 1e-3, "stage": 0, "lambda": 0, "compression_ratio": 1, "compression_ratio_tensorized": 1,
           "model_params": 1, "peak_memory_bytes": 1, "nonfinite_steps_total": 0, "epoch": 0}, 1)
    m.log_ranks({"layer": [1]}, 1)
    m.checkpoint_saved(True, 1)
    served = set(re.findall(r"^(comera_\w+)", urllib.request.urlopen(f"http://{m.endpoint}/metrics").read().decode(),
                            re.MULTILINE))
    m.close()
    rule_exprs = [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    used = set(re.findall(r"\bcomera_\w+", " ".join(expressions(dashboard) + rule_exprs)))
    assert len(used) >= 15
    assert used - served == set(), f"not exported: {sorted(used - served)}"


def _bucket_series(run: str, per_scrape: list[float], le: float) -> dict:
    """``comera_step_time_seconds_bucket`` of ``run`` for bucket ``le``: ``per_scrape`` gives its count at each
    15 s scrape."""
    return {"series": f'comera_step_time_seconds_bucket{{run="{run}",le="{le:g}"}}',
            "values": " ".join(f"{v:g}" for v in per_scrape)}


def test_step_time_quantiles_show_steps_longer_than_the_rate_window(dashboard, tmp_path):
    """The panel's p50/p90 over Grafana's rate window (1 m here) read NaN for a run whose steps take longer, with
    no step in the window: now that run's quantiles come from the last 30 minutes. A run of 0.3 s steps keeps the
    short window. Evaluated by promtool on the dashboard's own expressions."""
    (panel,) = [p for p in dashboard["panels"] if p.get("title") == "Step time"]
    exprs = expressions({"panels": [panel]})[:2]  # p50, p90 of any run; the data-wait gauge aside
    scrapes = 121  # 30 minutes at 15 s
    slow = [float(i // 8) for i in range(scrapes)]  # one 120 s step every 8 scrapes
    fast = [50.0 * i for i in range(scrapes)]  # 50 steps of 0.3 s per scrape
    series = [_bucket_series("r1", [0.0] * scrapes if le < 120 else slow, le) for le in STEP_TIME_BUCKETS]
    series += [_bucket_series("r2", [0.0] * scrapes if le < 0.3 else fast, le) for le in STEP_TIME_BUCKETS]
    series += [{"series": 'comera_step_time_seconds_bucket{run="r1",le="+Inf"}', "values": " ".join(map(str, slow))},
               {"series": 'comera_step_time_seconds_bucket{run="r2",le="+Inf"}', "values": " ".join(map(str, fast))}]
    series += [{"series": f'comera_step_time_seconds_count{{run="{r}"}}', "values": " ".join(map(str, v))}
               for r, v in (("r1", slow), ("r2", fast))]
    # at 29m30s r1's last step was 90 s ago; linear interpolation in its bucket (60, 150], r2's (0.25, 0.5]
    cases = [{"expr": e, "eval_time": "29m30s", "exp_samples": [{"labels": '{run="r1"}', "value": 60 + 90 * q},
                                                                {"labels": '{run="r2"}', "value": 0.25 + 0.25 * q}]}
             for e, q in zip(exprs, (0.5, 0.9))]
    spec = {"rule_files": [], "evaluation_interval": "15s",
            "tests": [{"interval": "15s", "input_series": series, "promql_expr_test": cases}]}
    (tmp_path / "quantiles.test.yml").write_text(yaml.safe_dump(spec))
    r = _promtool("test", "rules", "quantiles.test.yml", cwd=tmp_path)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr
