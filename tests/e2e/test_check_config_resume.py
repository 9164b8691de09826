"""``comera pretrain --check-config``/``--dry-run`` against the checkpoint the run would resume
(``config._resume_target``): a config it does not fit is refused before any rank starts (it was refused only
once the ranks were up, after a Slurm queue wait), by reading only, without torch or DeepSpeed.

The checkpoints here are the files that lookup reads (``COMPLETE``, ``comera_meta.json`` with the identity a
run of the given config writes, ``latest``); ``tests/distributed/test_checkpoint_trainer.py`` runs the same
check against a real run's checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from comera_dist import cli
from comera_dist.config import load_run_config
from comera_dist.engine import checkpoint_layout as layout
from comera_dist.engine import manifest

TINY = "configs/tiny-cpu.yaml"


def _checkpoint(root: Path, step: int, *sets: str, job_id: str | None = None) -> Path:
    """A published checkpoint's marker and meta, as a run of ``tiny-cpu.yaml`` with ``sets`` writes them."""
    path = root / layout.tag_for(step)
    path.mkdir(parents=True)
    meta = {"identity": layout.identity(load_run_config(TINY, list(sets))), "step": step, "slurm_job_id": job_id}
    (path / "shard.pt").write_bytes(b"shard of step %d" % step)
    _rewrite_meta(path, meta)
    (root / layout.LATEST).write_text(path.name)
    return path


def _rewrite_meta(path: Path, meta: dict) -> None:
    """``meta`` as the checkpoint's, its manifest written again for it (as a run that saved it would have)."""
    (path / layout.META).write_text(json.dumps(meta))
    (path / manifest.MARKER).write_text(manifest.render(path.name, manifest.describe(path, ["shard.pt", layout.META])))


def _check(capsys, out_dir: Path, *args: str, mode: str = "--check-config") -> tuple[int, str, str]:
    rc = cli.main(["pretrain", "--config", TINY, "--set", f"train.output_dir={out_dir}", *args, mode])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@pytest.mark.parametrize("named", ["auto", "run", "root", "checkpoint"])
@pytest.mark.parametrize("mode", ["--check-config", "--dry-run"])
def test_a_config_the_checkpoint_does_not_fit_is_refused_before_the_run(named, mode, capsys, tmp_path):
    """However ``--resume`` names it: ``auto`` under the output directory, a run directory, its checkpoints
    directory, the checkpoint itself."""
    run = tmp_path / "run"
    ck = _checkpoint(run / "checkpoints", 3, "comera.tensorize.max_rank=6")
    spec = {"auto": "auto", "run": str(run), "root": str(run / "checkpoints"), "checkpoint": str(ck)}[named]
    rc, _, err = _check(capsys, run, "--resume", spec, mode=mode)
    assert rc == cli.EXIT_BAD_INPUT and err.count("\n") == 1, err
    assert f"train.resume={spec}: checkpoint {ck} was written by an incompatible config" in err, err
    assert "tensorize.max_rank: checkpoint 6 vs config 8" in err and "model." not in err, err
    assert f"resume it with the config that wrote it ({ck / 'config.yaml'})" in err, err

    rc, out, err = _check(capsys, run, "--resume", spec, "--set", "comera.tensorize.max_rank=6", mode=mode)
    assert rc == 0, err
    if mode == "--check-config":
        assert f"config accepted, resumes {ck} if it verifies" in out, out
    else:
        assert f"\nresumes {ck} if it verifies (the sizes above are its shapes, not pruned;" in out, out


def test_a_dry_runs_json_names_the_checkpoint_it_would_resume(capsys, tmp_path):
    """And not where it would start fresh, or where the config is refused."""
    rc, out, err = _check(capsys, tmp_path / "run", "--json", mode="--dry-run")
    assert rc == 0 and json.loads(out)["resume"] is None, err
    ck = _checkpoint(tmp_path / "run" / "checkpoints", 3)
    rc, out, err = _check(capsys, tmp_path / "run", "--json", mode="--dry-run")
    assert rc == 0 and json.loads(out)["resume"] == str(ck), err
    rc, out, err = _check(capsys, tmp_path / "run", "--json", "--set", "model.hidden_size=16", "--set",
                          "comera.tensorize.modes={}", mode="--dry-run")
    assert rc == cli.EXIT_BAD_INPUT and "model.hidden_size: checkpoint 32 vs config 16" in err, err
    assert "resume" not in json.loads(out)  # refused: moot


def test_a_check_configs_json_says_whether_the_run_has_anything_left(capsys, tmp_path):
    """What slurm/pretrain.sh asks before it requeues after a USR1: a run at ``train.steps`` (tiny-cpu's 6) has
    nothing left, and a requeue of it would only say so."""
    run = tmp_path / "run"
    verdicts = []
    for step in (None, 3, 6):
        if step is not None:
            _checkpoint(run / "checkpoints", step)
        rc, out, err = _check(capsys, run, "--json")
        assert rc == 0 and err == "", err
        verdicts.append(json.loads(out))
    assert [(v["step"], v["nothing_to_train"]) for v in verdicts] == [(None, False), (3, False), (6, True)]
    assert verdicts[0]["resume"] is None and verdicts[2]["resume"] == str(run / "checkpoints" / layout.tag_for(6))
    assert {v["train_steps"] for v in verdicts} == {6} and {v["config"] for v in verdicts} == {TINY}
    rc, out, _ = _check(capsys, run, "--json", "--set", "train.steps=8")  # raised: there is more to train
    assert rc == 0 and json.loads(out)["nothing_to_train"] is False


@pytest.mark.parametrize("damage", ["flipped", "truncated", "marker"])
def test_a_final_checkpoint_that_does_not_verify_leaves_something_to_train(damage, capsys, tmp_path):
    """Its meta says ``train.steps``, but the run's ``resume auto`` walks back past it to step 3 and trains on: the
    verdict must say so, or pretrain.sh skips the requeue and those steps are lost."""
    run = tmp_path / "run"
    _checkpoint(run / "checkpoints", 3)
    final = _checkpoint(run / "checkpoints", 6)
    rc, out, err = _check(capsys, run, "--json")
    assert rc == 0 and json.loads(out)["nothing_to_train"] is True and json.loads(out)["problems"] == [], err
    shard = final / "shard.pt"
    if damage == "flipped":
        shard.write_bytes(b"shard of step 7")  # same size, other bytes
    elif damage == "truncated":
        shard.write_bytes(b"shard")
    else:
        (final / manifest.MARKER).write_text("")  # a crash's zero-length marker
    rc, out, err = _check(capsys, run, "--json")
    verdict = json.loads(out)
    assert rc == 0 and verdict["nothing_to_train"] is False, (out, err)
    if damage == "flipped":  # only its digest tells: the final verdict reads every byte
        assert verdict["step"] == 6 and len(verdict["problems"]) == 1, verdict
        assert "digest differs" in verdict["problems"][0], verdict
    else:  # a size or the marker tells at a stat: the check walks back past it, as the run does
        assert verdict["step"] == 3 and verdict["problems"] == [], verdict


@pytest.mark.parametrize("mode", ["--check-config", "--dry-run"])
def test_a_resume_path_whose_shard_is_truncated_is_refused_as_the_run_would(mode, capsys, tmp_path):
    """Accepted (exit 0) before, and the run then refused it: sizes cost a stat per file on the login node."""
    ck = _checkpoint(tmp_path / "run" / "checkpoints", 3)
    (ck / "shard.pt").write_bytes(b"shard")
    rc, out, err = _check(capsys, tmp_path / "run", "--resume", str(ck), mode=mode)
    assert rc == cli.EXIT_BAD_INPUT and err.count("\n") == 1, (out, err)
    assert (f"train.resume={ck}: resume: checkpoint {ck} fails verification: {ck / 'shard.pt'}: size 5 bytes, the "
            "manifest says 15") in err, err
    rc, out, err = _check(capsys, tmp_path / "run", "--resume", str(ck / "shard.pt"), mode=mode)
    assert rc == cli.EXIT_BAD_INPUT and "shard.pt is a file, not a directory: give the checkpoint's" in err, err


def test_auto_checks_the_newest_checkpoint_whose_meta_reads(capsys, tmp_path):
    """The run skips a checkpoint whose meta does not read (its manifest cannot match) and takes the next."""
    root = tmp_path / "run" / "checkpoints"
    old = _checkpoint(root, 3, "model.hidden_size=16", "comera.tensorize.modes={}")
    new = _checkpoint(root, 6)
    rc, out, err = _check(capsys, tmp_path / "run")
    assert rc == 0 and f"resumes {new} if it verifies" in out, err
    (new / layout.META).write_text("{not json")
    rc, _, err = _check(capsys, tmp_path / "run")
    assert rc == cli.EXIT_BAD_INPUT and f"checkpoint {old} was written by an incompatible config" in err, err
    assert "model.hidden_size: checkpoint 16 vs config 32" in err, err


def test_a_resume_path_that_is_no_checkpoint_is_refused(capsys, tmp_path):
    """An empty directory: the run refused it at its start."""
    (tmp_path / "empty").mkdir()
    rc, _, err = _check(capsys, tmp_path / "run", "--resume", str(tmp_path / "empty"))
    assert rc == cli.EXIT_BAD_INPUT and err.count("\n") == 1, err
    assert f"{tmp_path / 'empty'} is not a complete checkpoint" in err, err


@pytest.mark.parametrize("job", ["7", "8"])
def test_a_requeued_job_is_checked_against_its_own_newest_checkpoint(job, capsys, tmp_path, monkeypatch):
    """A requeue resumes the job's own newest checkpoint whatever ``--resume`` it was submitted with
    (``checkpoint.requeued_spec``); another job's checkpoints are what ``--resume none`` chose to leave."""
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    monkeypatch.setenv("SLURM_JOB_ID", job)
    ck = _checkpoint(tmp_path / "run" / "checkpoints", 3, "comera.tensorize.max_rank=6", job_id="7")
    rc, out, err = _check(capsys, tmp_path / "run", "--resume", "none")
    if job == "7":
        assert rc == cli.EXIT_BAD_INPUT and f"train.resume=auto: checkpoint {ck} was written by an incompatible" \
            in err, err
    else:
        assert rc == 0 and "config accepted, starts fresh" in out, err


@pytest.mark.parametrize("named", ["auto", "run"])
@pytest.mark.parametrize("older", [True, False], ids=["beside-an-older-one", "alone"])
def test_a_checkpoint_a_crash_left_unpublished_is_checked_and_left_in_place(named, older, capsys, tmp_path):
    """A crash between a re-save's renames leaves ``latest`` naming a tag whose complete copy is ``.tmp-<tag>``.
    The run publishes it and resumes it (``finish_interrupted``); a check reads it where it is, as the run may be
    live and race its own rename."""
    root = tmp_path / "run" / "checkpoints"
    if older:
        _checkpoint(root, 3, "comera.tensorize.max_rank=6")  # what the run would not resume
    pending = root / (layout.TMP_PREFIX + layout.tag_for(6))
    _checkpoint(root, 6).rename(pending)
    before = sorted(p.name for p in root.iterdir())
    spec = "auto" if named == "auto" else str(tmp_path / "run")
    rc, out, err = _check(capsys, tmp_path / "run", "--resume", spec)
    assert rc == 0 and f"resumes {pending} if it verifies" in out, err
    assert sorted(p.name for p in root.iterdir()) == before


def test_a_home_relative_output_directory_is_the_users(capsys, tmp_path, monkeypatch):
    """``train.output_dir: ~/runs/x`` in YAML or ``--set`` is no shell word: it was a directory named ``~``."""
    monkeypatch.setenv("HOME", str(tmp_path))
    ck = _checkpoint(tmp_path / "runs" / "x" / "checkpoints", 3)
    rc = cli.main(["pretrain", "--config", TINY, "--set", "train.output_dir=~/runs/x", "--check-config"])
    captured = capsys.readouterr()
    assert rc == 0 and f"resumes {ck} if it verifies" in captured.out, captured.err
    cfg = load_run_config(TINY, ["train.output_dir=~/runs/x", "train.resume=~/runs/x"])
    assert cfg.train.output_dir == cfg.train.resume == str(tmp_path / "runs" / "x")


def test_the_check_does_not_import_deepspeed(tmp_path):
    """``--check-config`` runs on a login node: DeepSpeed's import alone prints its accelerator warning, and a
    dry run's stdout is its JSON."""
    _checkpoint(tmp_path / "run" / "checkpoints", 3)
    code = ("import sys; from comera_dist import cli; "
            f"rc = cli.main(['pretrain', '--config', {TINY!r}, '--set', 'train.output_dir={tmp_path / 'run'}', "
            "'--check-config']); print(rc, 'deepspeed' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "resumes" in done.stdout and done.stdout.splitlines()[-1] == "0 False", (done.stdout, done.stderr)


def test_a_finished_run_is_said_to_have_nothing_to_train(capsys, tmp_path):
    """The run would resume at ``train.steps`` and exit saying so (``trainer._nothing_to_train``)."""
    root = tmp_path / "run" / "checkpoints"
    _checkpoint(root, 3)
    rc, out, err = _check(capsys, tmp_path / "run")
    assert rc == 0 and "nothing to train" not in out, err
    done = _checkpoint(root, 6)  # tiny-cpu.yaml's train.steps
    rc, out, err = _check(capsys, tmp_path / "run")
    assert rc == 0 and (f"resumes {done} if it verifies, at step 6 of train.steps=6: nothing to train (--set "
                        "train.steps=N trains on)") in out, err
    rc, out, err = _check(capsys, tmp_path / "run", "--set", "train.steps=8")
    assert rc == 0 and "nothing to train" not in out, err


def _halving_plan(cfg) -> tuple[str, str]:
    """A plan that keeps the first half of the first bond of the model's first tensorized layer, and that layer."""
    from comera_dist.compression.pruning import PruningPlan, bond_dims
    from comera_dist.engine.model_factory import build_run_model

    dims = bond_dims(build_run_model(cfg))
    name = next(iter(dims))
    plan = PruningPlan(kept={name: {0: list(range(dims[name][0] // 2))}}, bond_dims=dims)
    return name, plan.to_json()


def test_a_dry_run_sizes_a_pruned_checkpoint_at_its_shapes(capsys, tmp_path):
    """The sizes of a resume are those of the model it loads: the config's sliced by the meta's plans."""
    run = tmp_path / "run"
    ck = _checkpoint(run / "checkpoints", 3)
    rc, out, err = _check(capsys, run, "--json", mode="--dry-run")
    whole = json.loads(out)
    assert rc == 0 and whole["prunes"] == 0, err
    name, plan = _halving_plan(load_run_config(TINY, [f"train.output_dir={run}"]))
    meta = json.loads((ck / layout.META).read_text())
    _rewrite_meta(ck, meta | {"plans": [plan]})
    rc, out, err = _check(capsys, run, "--json", mode="--dry-run")
    pruned = json.loads(out)
    assert rc == 0 and pruned["prunes"] == 1 and pruned["resume"] == str(ck), err
    assert pruned["layers"][name]["active_params"] < whole["layers"][name]["active_params"]
    assert pruned["params"]["total"] < whole["params"]["total"]
    others = [n for n in whole["layers"] if n != name]
    assert all(pruned["layers"][n] == whole["layers"][n] for n in others)
    rc, out, err = _check(capsys, run, mode="--dry-run")
    assert rc == 0 and f"\nresumes {ck} if it verifies (the sizes above are its shapes, after its 1 prune(s);" in out


def test_a_dry_run_refuses_a_checkpoint_whose_plan_does_not_fit(capsys, tmp_path):
    """A plan made for other bond sizes: the run's resume would fail on it after the queue wait."""
    run = tmp_path / "run"
    ck = _checkpoint(run / "checkpoints", 3)
    name, plan = _halving_plan(load_run_config(TINY, [f"train.output_dir={run}"]))
    bad = json.loads(plan)
    bad["bond_dims"][name][0] += 1
    meta = json.loads((ck / layout.META).read_text())
    _rewrite_meta(ck, meta | {"plans": [json.dumps(bad)]})
    rc, _, err = _check(capsys, run, mode="--dry-run")
    assert rc == cli.EXIT_BAD_INPUT and err.count("\n") == 1, err
    assert f"train.resume: checkpoint {ck}: the checkpoint's pruning plan 1 of 1 does not apply" in err, err
    assert f"layer {name!r} has bond sizes" in err, err
