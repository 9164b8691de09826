"""End to end through the installed CLI, as a user runs it (real subprocesses, one rank each):

pretrain on tiny-cpu writes complete checkpoints, the resolved config and a report with PNGs;
``evaluate`` scores the checkpoint on a local corpus (the loss and accuracy a by-hand torch pass
gives); ``export`` round-trips (dense HF model and compact TT form give the checkpoint's logits;
the consolidated file holds its weights); bad data input is one stderr line, exit 2, and nothing
written. "The checkpoint's" weights are read from DeepSpeed's model-states file with ``torch.load``,
not through ``load_run``: evaluate and export share that path, so it cannot be their reference.
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from checkpoint_testlib import revouch

from comera_dist import cli

REPO = Path(__file__).resolve().parents[2]
COMERA = [sys.executable, "-m", "comera_dist.cli"]
CACHE = Path(os.environ.get("COMERA_TEST_CACHE", Path(tempfile.gettempdir()) / "comera-dist-test-cache"))

pytestmark = pytest.mark.slow


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(COMERA_CACHE=str(CACHE), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env.update(extra)
    return env


def comera(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*COMERA, *args], check=False, cwd=REPO, env=env or _env(), capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory) -> Path:
    """One tiny-cpu pretraining run (6 steps, checkpoints at 3 and 6, a prune at 3 and 6)."""
    out = tmp_path_factory.mktemp("e2e") / "run"
    p = comera("pretrain", "--config", "configs/tiny-cpu.yaml", "--set", f"train.output_dir={out}",
               "--set", "metrics.progress=true",  # tiny-cpu turns the bar off; here it must stay out of a log
               env=_env(COMERA_CACHE=str(out.parent / "cache")))  # and so must the data build's bars
    assert p.returncode == 0, p.stderr[-4000:]
    (out.parent / "pretrain.log").write_text(p.stderr)  # what a Slurm job's output file gets
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A local evaluation corpus: a few real source files the tokenizer never saw (this repo's)."""
    d = tmp_path_factory.mktemp("corpus")
    for f in sorted((REPO / "comera_dist" / "engine").glob("*.py"))[:4]:
        (d / f.name).write_text(f.read_text())
    return d


def _engine_weights(run_dir: Path) -> tuple[dict[str, torch.Tensor], torch.nn.Module]:
    """The latest checkpoint's weights as the training engine held them (ZeRO 1, one rank: the whole
    module in ``mp_rank_00_model_states.pt``), and a copy of the rebuilt model holding exactly them."""
    from comera_dist.engine.evaluate import load_run

    run = load_run(run_dir)  # only for the architecture at the pruned shapes: every tensor is replaced
    weights = torch.load(run.path / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=False)["module"]
    model = copy.deepcopy(run.model)
    model.load_state_dict(weights, strict=True)
    return weights, model.eval()


def test_pretrain_writes_checkpoints_config_and_report(run_dir):
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step00000006"
    for tag in ("step00000003", "step00000006"):
        assert (ckpts / tag / "COMPLETE").is_file()
        cfg = (ckpts / tag / "config.yaml").read_text()
        assert "zero_stage: 1" in cfg and f"output_dir: {run_dir}" in cfg
    report = (run_dir / "report.md").read_text()
    pngs = sorted(run_dir.glob("*.png"))
    assert len(pngs) >= 3 and all(p.stat().st_size > 1000 for p in pngs), pngs
    for png in pngs:
        assert png.name in report
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "tokenizer" / "tokenizer.json").is_file()
    assert "no rank alive" not in (run_dir.parent / "pretrain.log").read_text()  # its embedding lives


def test_a_log_file_gets_step_lines_with_an_eta_and_no_bar(run_dir):
    """stderr is a pipe here, as a Slurm job's output file: the bar's redraws ('\r') stay out of it, and
    the step lines say how long is left."""
    log = (run_dir.parent / "pretrain.log").read_text()
    assert "corpus: built" in log and "tokenizer: trained" in log  # the data was built in this run
    # (text=True turns a '\r' into a newline: a tqdm bar shows as its "NN%|" instead)
    assert "\r" not in log and "%|" not in log, log[:2000]
    lines = re.findall(r"INFO comera_dist\.engine\.trainer: step (\d+)/6 .* eta (\d+:\d\d:\d\d)$", log, re.MULTILINE)
    assert lines and lines[-1] == ("6", "0:00:00"), log[-2000:]


def in_process(capsys, *args: str) -> tuple[int, str, str]:
    """``comera ARGS`` in this process (evaluate/export start no process group)."""
    rc = cli.main(list(args))
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def test_evaluate_checkpoint_on_local_corpus(run_dir, corpus, capsys):
    rc, out, err = in_process(capsys, "evaluate", "--checkpoint", str(run_dir), "--data", str(corpus), "--json",
                              "--batch-size", "4")
    assert rc == 0, err[-3000:]
    result = json.loads(out)  # stdout is the one JSON object (DeepSpeed's zero_to_fp32 prints go to stderr)
    assert result["checkpoint"].endswith("step00000006")
    assert result["masked_tokens"] > 0 and result["batches"] > 0
    assert 0.0 < result["loss"] < 20.0 and 0.0 <= result["accuracy"] <= 1.0
    hand = _hand_evaluate(run_dir, corpus, batch_size=4)
    assert (result["batches"], result["masked_tokens"]) == (hand["batches"], hand["masked_tokens"])
    assert result["accuracy"] == hand["accuracy"]
    # fp32 per-batch means against a float64 sum: ~1e-8 apart; a 1e-2 nudge of one core moves it 6e-6
    assert result["loss"] == pytest.approx(hand["loss"], rel=1e-6), (result, hand)
    # Deterministic: the same masks give the same numbers, from the checkpoint directory itself too.
    rc, out, _ = in_process(capsys, "evaluate", "--checkpoint", str(run_dir / "checkpoints" / "step00000006"),
                            "--data", str(corpus), "--json", "--batch-size", "4")
    assert rc == 0 and json.loads(out)["loss"] == result["loss"]
    # Bad input: a missing checkpoint, an empty corpus.
    (corpus.parent / "empty.txt").write_text("\n")
    for args, needle in ((["--checkpoint", str(corpus / "none"), "--data", str(corpus)], "no such directory"),
                         (["--checkpoint", str(run_dir), "--data", str(corpus.parent / "empty.txt")], "empty corpus"),
                         (["--checkpoint", str(run_dir), "--data", str(corpus), "--max-batches", "0"],
                          "--max-batches must be >= 1")):
        rc, _, err = in_process(capsys, "evaluate", *args)
        assert rc == 2 and err.count("\n") == 1 and needle in err, err


def test_evaluate_bad_data_names_what_evaluate_can_change(run_dir, corpus, tmp_path, capsys):
    """evaluate has no data.builder or data.seq_len to set (the checkpoint fixes the sequence length), and its
    JSON rows' column is --text-column: its data errors name the file, --data, the option or the run's directory."""
    import shutil

    import yaml

    (tmp_path / "a.toml").write_text("[tool]\nname = 'x'\n")
    (tmp_path / "rows.jsonl").write_text(json.dumps({"body": "def f(x):\n    return x\n"}) + "\n")
    (tmp_path / "short.txt").write_text("x = 1\n")
    moved = tmp_path / "moved" / "checkpoints" / "step00000006"  # copied without its run's tokenizer/
    shutil.copytree(run_dir / "checkpoints" / "step00000006", moved)
    saved = yaml.safe_load((moved / "config.yaml").read_text())
    saved["train"]["output_dir"] = str(tmp_path / "gone")
    (moved / "config.yaml").write_text(yaml.safe_dump(saved))
    revouch(moved)  # as the run had saved it: a run moved from elsewhere
    for checkpoint, data, needle, not_named in (
            (run_dir, tmp_path / "a.toml", "cannot read '.toml' files; convert it to one of .json", "builder"),
            (run_dir, tmp_path / "rows.jsonl", ("the checkpoint's data.text_column (--text-column sets another) "
             "'text' is not a column of files"), "data.text_column 'text'"),
            (run_dir, tmp_path / "short.txt", "the checkpoint fixes data.seq_len: give --data more text",
             "lower data.seq_len"),
            (moved, corpus, f"no run tokenizer at {tmp_path / 'moved' / 'tokenizer'} or {tmp_path / 'gone'}",
             "data.tokenizer.pretrained")):
        rc, _, err = in_process(capsys, "evaluate", "--checkpoint", str(checkpoint), "--data", str(data))
        assert rc == 2 and err.count("\n") == 1 and needle in err and not_named not in err, err
    # the rows' own column, named; a wrong name is the option's
    rc, out, err = in_process(capsys, "evaluate", "--checkpoint", str(run_dir), "--data", str(tmp_path / "rows.jsonl"),
                              "--text-column", "nope")
    assert rc == 2 and "--text-column 'nope' is not a column of files" in err and "['body']" in err, err
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"body": p.read_text()}) + "\n" for p in sorted(corpus.rglob("*.py"))[:20]))
    rc, out, err = in_process(capsys, "evaluate", "--checkpoint", str(run_dir), "--data", str(rows),
                              "--text-column", "body", "--json")
    assert rc == 0 and json.loads(out)["batches"] > 0, err


def _beside(run_dir: Path, where: Path, *, tokens: tuple[str, ...] = (), swap: bool = False) -> Path:
    """The run's newest checkpoint under ``where`` with the run's tokenizer beside it, changed: ``tokens``
    added (a larger vocabulary) or two ids swapped (the same size, other ids)."""
    import shutil

    from comera_dist.data.tokenizer import load_tokenizer

    ck = where / "checkpoints" / "step00000006"
    shutil.copytree(run_dir / "checkpoints" / "step00000006", ck)
    tok = load_tokenizer(run_dir / "tokenizer")
    tok.add_tokens(list(tokens))
    tok.save_pretrained(where / "tokenizer")
    if swap:
        file = where / "tokenizer" / "tokenizer.json"
        spec = json.loads(file.read_text())
        vocab = spec["model"]["vocab"]
        a, b = sorted(vocab, key=vocab.get)[300:302]
        vocab[a], vocab[b] = vocab[b], vocab[a]
        file.write_text(json.dumps(spec))
    return ck


def test_evaluate_and_export_refuse_a_tokenizer_the_checkpoint_was_not_trained_with(run_dir, corpus, tmp_path,
                                                                                     capsys):
    """A replaced ``<run>/tokenizer`` gave an evaluation of other tokens' ids without a word, and an export
    shipped it. The checkpoint's meta records its run's tokenizer digest; one without it (an older checkpoint)
    still refuses a vocabulary the model cannot index, naming the tokenizer, not ``model.vocab_size``."""
    meta = json.loads((run_dir / "checkpoints" / "step00000006" / "comera_meta.json").read_text())
    from comera_dist.data.tokenizer import load_tokenizer, tokenizer_digest
    from comera_dist.engine import resume

    assert meta["tokenizer_sha256"] == tokenizer_digest(load_tokenizer(run_dir / "tokenizer"))
    assert set(meta) - {"tokenizer_sha256"} == resume.OWN_META  # what meta_fields may not replace
    with pytest.raises(ValueError, match=r"meta_fields may not replace the checkpoint's own \['plans'\]"):
        resume.save(None, 7, meta_fields={"plans": [], "tokenizer_sha256": "x"})
    swapped = _beside(run_dir, tmp_path / "swapped", swap=True)
    larger = _beside(run_dir, tmp_path / "larger", tokens=tuple(f"tok{i}" for i in range(8)))
    old_meta = larger / "comera_meta.json"
    old_meta.write_text(json.dumps({k: v for k, v in json.loads(old_meta.read_text()).items()
                                    if k != "tokenizer_sha256"}))
    revouch(larger)  # an older checkpoint's manifest vouches for its meta
    cases = ((swapped, f"the tokenizer at {tmp_path / 'swapped' / 'tokenizer'} is not the one it was trained with"),
             (larger, (f"the tokenizer at {tmp_path / 'larger' / 'tokenizer'} has 520 tokens, more than the model's "
                       "vocab_size=512")))
    for ck, needle in cases:
        rc, _, err = in_process(capsys, "evaluate", "--checkpoint", str(ck.parent.parent), "--data", str(corpus))
        assert rc == 2 and err.count("\n") == 1 and needle in err and "set model.vocab_size" not in err, err
        out = tmp_path / f"export-{ck.parent.parent.name}"
        rc, _, err = in_process(capsys, "export", "--checkpoint", str(ck), "--out", str(out))
        assert rc == 2 and needle in err and not out.exists(), err


def test_evaluate_and_export_print_only_their_result_on_stdout(run_dir, corpus, tmp_path):
    """As scripts call them (a fresh process, no DS_ACCELERATOR): DeepSpeed's logger writes to stdout, its
    accelerator warning at import and zero_to_fp32's progress; they go to stderr."""
    env = {k: v for k, v in _env().items() if k != "DS_ACCELERATOR"}
    p = comera("evaluate", "--checkpoint", str(run_dir), "--data", str(corpus), "--max-batches", "1", "--json",
               env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout)["batches"] == 1, p.stdout
    p = comera("export", "--checkpoint", str(run_dir), "--out", str(tmp_path / "tt"), "--format", "tt", env=env)
    assert p.returncode == 0 and p.stdout == f"{tmp_path / 'tt'}\n", (p.stdout, p.stderr[-3000:])


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_evaluate_shows_its_progress_on_a_terminal_only(run_dir, corpus, monkeypatch, capsys):
    """A large corpus takes a while: on a terminal the files being read and the batches evaluated have bars
    (the JSON on stdout is the same); in a log file (the test above) nothing is drawn."""
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert cli.main(["evaluate", "--checkpoint", str(run_dir), "--data", str(corpus), "--json",
                     "--batch-size", "4"]) == 0
    drawn = terminal.getvalue()
    assert "\revaluate:" in drawn and "batch" in drawn, drawn[-2000:]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["batches"] > 0


@torch.no_grad()
def _hand_evaluate(run_dir: Path, corpus: Path, *, batch_size: int) -> dict[str, float]:
    """What ``evaluate`` must print, by hand: the engine's weights, the same masked batches (the data
    pipeline is shared, the arithmetic is not), cross-entropy and arg-max over the label tokens."""
    from comera_dist.data.collators import collator_for
    from comera_dist.data.loader import eval_batches
    from comera_dist.data.prepare import evaluation_corpus
    from comera_dist.data.tokenizer import load_tokenizer
    from comera_dist.engine.evaluate import load_run

    cfg = load_run(run_dir).cfg
    assert cfg.data.objective == "mlm"  # what the arithmetic below computes
    _, model = _engine_weights(run_dir)
    tokenizer = load_tokenizer(run_dir / "tokenizer")
    blocks = evaluation_corpus([str(corpus)], tokenizer, seq_len=cfg.data.seq_len, objective="mlm",
                               show_progress=False)
    batches = list(eval_batches(blocks, batch_size=batch_size, rank=0, world_size=1, seed=0,
                                collator=collator_for("mlm", tokenizer, cfg.data.mlm_probability)))
    loss_sum, correct, count = 0.0, 0, 0
    for b in batches:
        logits = model(input_ids=b["input_ids"])["logits"]  # (B, T, V)
        keep = b["labels"] != -100  # (B, T)
        picked, labels = logits[keep].double(), b["labels"][keep]  # (N, V), (N,)
        loss_sum += float(F.cross_entropy(picked, labels, reduction="sum"))
        correct += int((picked.argmax(-1) == labels).sum())
        count += int(keep.sum())
    return {"loss": loss_sum / count, "accuracy": correct / count, "masked_tokens": count, "batches": len(batches)}


def test_export_round_trips(run_dir, tmp_path, capsys):
    from transformers import AutoModelForMaskedLM

    from comera_dist.engine.evaluate import load_run
    from comera_dist.models.tt_io import load_tt

    run = load_run(run_dir)
    weights, model = _engine_weights(run_dir)
    ids = torch.randint(0, run.cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(ids)["logits"]  # (2, 16, V)

    for fmt in ("dense-hf", "tt", "consolidated"):
        rc, out, err = in_process(capsys, "export", "--checkpoint", str(run_dir), "--out", str(tmp_path / fmt),
                                  "--format", fmt)
        assert rc == 0, err[-3000:]
        assert out == f"{tmp_path / fmt}\n"  # the path alone (DeepSpeed's zero_to_fp32 prints go to stderr)
    with torch.no_grad():
        hf = AutoModelForMaskedLM.from_pretrained(tmp_path / "dense-hf").eval()
        torch.testing.assert_close(hf(input_ids=ids).logits, expected, rtol=1e-4, atol=1e-4)
        tt = load_tt(tmp_path / "tt").eval()
        torch.testing.assert_close(tt(ids)["logits"], expected, rtol=1e-6, atol=1e-6)
    state = torch.load(tmp_path / "consolidated" / "consolidated_fp32.pt", weights_only=True)
    assert state.keys() == weights.keys()
    differ = [k for k in state if not torch.equal(state[k], weights[k])]
    assert not differ, f"consolidated export != the engine's weights: {differ}"
    for side in ("config.yaml", "comera_meta.json"):  # the run's config and its prune plans, to rebuild the shapes
        assert (tmp_path / "consolidated" / side).read_bytes() == (run.path / side).read_bytes(), side
    assert (tmp_path / "dense-hf" / "tokenizer.json").is_file()
    # An existing non-empty --out is refused, untouched.
    before = sorted(p.name for p in (tmp_path / "tt").iterdir())
    rc, _, err = in_process(capsys, "export", "--checkpoint", str(run_dir), "--out", str(tmp_path / "tt"))
    assert rc == 2 and "not an empty directory" in err
    assert sorted(p.name for p in (tmp_path / "tt").iterdir()) == before


def test_evaluate_and_export_refuse_a_corrupted_checkpoint(run_dir, corpus, tmp_path, capsys):
    """A checkpoint file that no longer matches the manifest (one byte flipped in the model shard) stops
    ``evaluate`` and ``export`` with exit 2 naming the file; nothing is exported."""
    import shutil

    src = run_dir / "checkpoints" / "step00000006"
    bad = tmp_path / "checkpoints" / "step00000006"
    shutil.copytree(src, bad)
    shard = bad / "mp_rank_00_model_states.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    rc, _, err = in_process(capsys, "evaluate", "--checkpoint", str(bad), "--data", str(corpus))
    assert rc == 2 and "fails verification" in err and "mp_rank_00_model_states.pt" in err and "digest" in err, err
    rc, _, err = in_process(capsys, "export", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "out"))
    assert rc == 2 and "fails verification" in err, err
    assert not (tmp_path / "out").exists()
    rc, _, err = in_process(capsys, "evaluate", "--checkpoint", str(src), "--data", str(corpus))
    assert rc == 0, err[-3000:]  # the intact original still evaluates


def test_a_run_whose_newest_checkpoint_is_corrupted_is_refused_naming_the_newest_that_verifies(
        run_dir, corpus, tmp_path, capsys):
    """Still refused (no quiet fallback, ``evaluate.load_run``), but the message names the checkpoint to pass."""
    import shutil

    shutil.copytree(run_dir / "checkpoints", tmp_path / "run" / "checkpoints")
    root = tmp_path / "run" / "checkpoints"
    for tag in ("step00000006", "step00000003"):
        shard = root / tag / "mp_rank_00_model_states.pt"
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        good = root / "step00000003"
        hint = f"pass --checkpoint {good} to use it" if tag == "step00000006" else f"no other checkpoint in {root}"
        rc, _, err = in_process(capsys, "evaluate", "--checkpoint", str(tmp_path / "run"), "--data", str(corpus))
        assert rc == 2 and err.count("\n") == 1 and f"{root / 'step00000006'} fails verification" in err, err
        assert hint in err, err
        rc, _, err = in_process(capsys, "export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "o"))
        assert rc == 2 and hint in err, err
        assert not (tmp_path / "o").exists()


def test_export_checks_out_before_loading_the_weights(run_dir, tmp_path, monkeypatch, capsys):
    """Loading a large model takes minutes: an --out that cannot take the export is refused before it."""
    from comera_dist.engine import evaluate

    def load_run(spec):
        raise AssertionError("the weights were loaded before --out was checked")

    monkeypatch.setattr(evaluate, "load_run", load_run)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("kept")
    (tmp_path / "file").write_text("kept")
    for out, needle in ((tmp_path / "full", "exists and is not an empty directory"),
                        (tmp_path / "file", "exists and is not an empty directory"),
                        (tmp_path / "file" / "sub" / "out", f"{tmp_path / 'file'} is a file, not a directory")):
        rc, _, err = in_process(capsys, "export", "--checkpoint", str(run_dir), "--out", str(out))
        assert rc == 2 and err.count("\n") == 1 and f"--out {out}: {needle}" in err, err
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # as for a non-root user on a read-only dir
    rc, _, err = in_process(capsys, "export", "--checkpoint", str(run_dir), "--out", str(tmp_path / "new" / "out"))
    assert rc == 2 and f"cannot create it, {tmp_path} is not writable" in err, err
    assert (tmp_path / "full" / "x").read_text() == "kept" and not (tmp_path / "new").exists()


def test_export_makes_its_directory_before_loading_the_weights(run_dir, tmp_path, monkeypatch, capsys):
    """Where ``os.access`` says yes and the file system says no (root squashing on NFS, ACLs; here an immutable
    directory, which refuses root too, with ``os.access`` made to agree as a squashed client's would), the export
    fails before the weights load; and a failed export leaves none of the parents it made."""
    from comera_dist.engine import evaluate

    real_load = evaluate.load_run
    monkeypatch.setattr(evaluate, "load_run", lambda spec: pytest.fail("the weights loaded first"))
    monkeypatch.setattr(os, "access", lambda path, mode: True)
    locked = tmp_path / "locked"
    locked.mkdir()
    if subprocess.run(["chattr", "+i", str(locked)], capture_output=True, check=False).returncode != 0:
        pytest.skip("chattr +i is not supported here")  # the file system (tmpfs, overlay) or no privilege
    try:
        rc, _, err = in_process(capsys, "export", "--checkpoint", str(run_dir), "--out", str(locked / "a" / "out"))
    finally:
        subprocess.run(["chattr", "-i", str(locked)], check=True)
    assert rc == 2 and err.count("\n") == 1, err
    assert f"--out {locked / 'a' / 'out'}: cannot create it in {locked / 'a'}: Operation not permitted" in err, err
    assert list(locked.iterdir()) == []

    def damaged(spec):  # the weights fail to load once the directory is made
        raise evaluate.InputError(f"checkpoint {spec}: damaged")

    monkeypatch.setattr(evaluate, "load_run", damaged)
    rc, _, err = in_process(capsys, "export", "--checkpoint", str(run_dir), "--out", str(tmp_path / "b" / "c" / "out"))
    assert rc == 2 and "damaged" in err and not (tmp_path / "b").exists(), err
    monkeypatch.setattr(evaluate, "load_run", real_load)
    rc, out, err = in_process(capsys, "export", "--checkpoint", str(run_dir), "--out", str(tmp_path / "b" / "c" / "out"),
                              "--format", "tt")
    assert rc == 0 and out == f"{tmp_path / 'b' / 'c' / 'out'}\n" and (tmp_path / "b" / "c" / "out").is_dir(), err


def _one_line_exit_2(p: subprocess.CompletedProcess, needle: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    errors = [line for line in p.stderr.splitlines() if line.startswith("comera ")]
    assert len(errors) == 1 and needle in errors[0], p.stderr[-3000:]


def test_bad_data_input_exit_2_nothing_written(tmp_path):
    out = tmp_path / "run"
    base = ["pretrain", "--config", "configs/tiny-cpu.yaml", "--set", f"train.output_dir={out}"]
    # The tokenizer has 512 tokens; a 100-row embedding cannot take them.
    _one_line_exit_2(comera(*base, "--set", "model.vocab_size=100"), "model vocab_size=100")
    # An empty corpus.
    (tmp_path / "empty.txt").write_text("\n\n")
    _one_line_exit_2(comera(*base, "--set", "data.source=files", "--set", f"data.files=[{tmp_path / 'empty.txt'}]"),
                     "empty")
    # A missing corpus file.
    _one_line_exit_2(comera(*base, "--set", "data.source=files", "--set", f"data.files=[{tmp_path / 'nope.txt'}]"),
                     "nope.txt")
    # An unreadable cache: the run's own cache, built here (no other test's leftovers), its packed blocks damaged.
    from comera_dist.config import load_run_config
    from comera_dist.data.prepare import prepare_data

    cache = tmp_path / "cache"
    prepare_data(load_run_config(REPO / "configs/tiny-cpu.yaml", [f"data.cache_dir={cache}"]).data,
                 show_progress=False)
    damaged = list(cache.glob("blocks-*/comera_meta.json"))
    assert len(damaged) == 1, sorted(p.name for p in cache.iterdir())
    damaged[0].write_text("{not json")
    _one_line_exit_2(comera(*base, "--set", f"data.cache_dir={cache}"), "unreadable cache entry")
    # A mistyped --resume path: refused before the data build (a large corpus's takes hours), its cache not made.
    fresh = tmp_path / "fresh-cache"
    _one_line_exit_2(comera(*base, "--set", f"data.cache_dir={fresh}", "--resume", str(tmp_path / "no-such-ckpt")),
                     "no such checkpoint or run directory")
    assert not fresh.exists()
    assert not out.exists()


AGGRESSIVE_GATES = ("--set", "train.steps=6", "--set", "comera.controller.late_stage_step=2",
                    "--set", "comera.controller.tau=0.97", "--set", "comera.lr.gates=0.02",
                    "--set", "comera.controller.target_loss=3.0")
"""tiny-cpu with gates that die within 2 steps, so the prune at step 3 really slices ranks and rebuilds the engine.
Alone they kill a bond of the TTM embedding at step 2 too (all its gates fall together)."""

PRUNING_RUN = (*AGGRESSIVE_GATES, "--set", "comera.controller.embedding_tau=0.3")
"""``AGGRESSIVE_GATES`` with the embedding's threshold low enough that it lives through these runs (as
``launch/gpu_check.sh`` sets it): the projections' ranks die and are pruned, the model keeps seeing its input."""


def _train_losses(log: str) -> list[float]:
    """Every logged step's train loss, in order (the runs log every step)."""
    return [float(v) for v in re.findall(r"step \d+/\d+ train_loss (\S+)", log)]


def test_a_warmup_run_that_prunes_logs_no_scheduler_warning(tmp_path):
    """DeepSpeed's warmup scheduler warns in its constructor, once per engine build (the start and each prune):
    the builds drop that message (``engine.build.scheduler_start_quiet``). The pruned model still learns: its
    losses move after the prunes, where a dead embedding would pin them at ln 512 (the test's checks would then
    compare a model that no longer trains)."""
    out = tmp_path / "run"
    run = ("pretrain", "--config", "configs/tiny-cpu.yaml", "--set", f"train.output_dir={out}", *PRUNING_RUN,
           "--set", "deepspeed.scheduler.kind=warmup_cosine", "--set", "deepspeed.scheduler.warmup_steps=1")
    p = comera(*run)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "physical prune, engine rebuilt" in p.stderr  # a second engine build
    assert "Attempting to get learning rate" not in p.stdout + p.stderr
    assert "no rank alive" not in p.stderr
    losses = _train_losses(p.stderr)
    assert len(losses) == 6 and len(set(losses[3:])) == 3, losses  # steps 4-6, after the prune at 3
    assert all(abs(v - math.log(512)) > 1e-3 for v in losses[3:]), losses

    # a dry run of its resume sizes the model that resume loads: the pruned checkpoint's parameters
    dry = comera(*run, "--dry-run", "--json")
    assert dry.returncode == 0, dry.stderr[-2000:]
    summary, latest = json.loads(dry.stdout), out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    saved = torch.load(latest / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    trained = [name for name in saved if not name.endswith(("tau", "bond_sizes"))]
    assert summary["resume"] == str(latest) and summary["prunes"] >= 1, summary["resume"]
    assert summary["params"]["allocated"] == sum(saved[name].numel() for name in trained)


def test_a_dead_input_embedding_stops_the_run_and_a_resume_with_its_own_threshold_recovers(tmp_path):
    """The aggressive gates alone kill a bond of the TTM embedding at step 2: every token maps to zero, and a dead
    gate gets no gradient. The run stops there (exit 4, the collapse's code), names the layer and the setting to
    change, and writes no checkpoint of the dead model. Resumed from its step-1 checkpoint with that setting (the
    message's advice; the checkpoint's own tau buffers would win without ``resume._apply_run_settings``), the run
    trains to its end."""
    out = tmp_path / "run"
    run = ("pretrain", "--config", "configs/tiny-cpu.yaml", "--set", f"train.output_dir={out}", *AGGRESSIVE_GATES,
           "--set", "metrics.prometheus=false", "--set", "train.checkpoint_every=1")
    p = comera(*run)
    assert p.returncode == 4, p.stderr[-4000:]
    assert "step 2: stopping without a checkpoint: embeddings.word has a bond with no rank alive" in p.stderr, \
        p.stderr[-3000:]
    assert "comera.controller.embedding_tau" in p.stderr and "step 3/6" not in p.stderr
    assert (out / "checkpoints" / "latest").read_text().strip() == "step00000001"  # none of the dead model
    assert (out / "report.md").is_file()  # the report of what ran is still written
    p = comera(*run, "--set", "comera.controller.embedding_tau=0.3")
    assert p.returncode == 0, p.stderr[-4000:]
    assert "resumed at step 1" in p.stderr and "tau 0.97 -> 0.3 (embeddings.word)" in p.stderr, p.stderr[-3000:]
    assert "no rank alive" not in p.stderr and len(_train_losses(p.stderr)) == 5  # steps 2-6


def test_compiled_run_recompiles_after_a_physical_prune_and_matches_eager(tmp_path):
    """A prune changes the shapes: the rebuilt engine is compiled again (a second trace, the
    re-capture point of CUDA graphs), and so is its DeepSpeed optimizer step (``train.compile_optimizer``),
    and the compiled run still trains exactly as the eager one. (The engine compiled without its optimizer
    step: test_compiled_step_matches_eager, and test_compiled_run_stays_compiled_through_many_prunes.)"""
    runs = {}
    for name, extra in (("eager", ()),
                        ("compiled", ("--set", "train.compile=true", "--set", "train.compile_optimizer=true"))):
        out = tmp_path / name
        p = comera("pretrain", "--config", "configs/tiny-cpu.yaml", "--set", f"train.output_dir={out}",
                   *PRUNING_RUN, *extra, env=_env(COMERA_COMPILE_BACKEND="aot_eager"), timeout=600)
        assert p.returncode == 0, p.stderr[-4000:]
        runs[name] = (out, p.stderr)
    log = runs["compiled"][1]
    assert "step 3: physical prune, engine rebuilt" in log
    assert log.count("torch.compile (aot_eager, mode default): engine compiled = True") >= 2  # start, after the prune
    assert "physical prune" in runs["eager"][1] and "torch.compile" not in runs["eager"][1]
    assert log.count("torch.compile (aot_eager): optimizer step of DeepSpeedZeroOptimizer compiled") >= 2
    tag = "step00000006"
    eager, compiled = (torch.load(runs[v][0] / "checkpoints" / tag / "mp_rank_00_model_states.pt",
                                  weights_only=False)["module"] for v in ("eager", "compiled"))
    assert compiled.keys() == eager.keys()
    for name, t in eager.items():
        assert compiled[name].shape == t.shape, name  # the same ranks were pruned
        torch.testing.assert_close(compiled[name], t, rtol=1e-5, atol=1e-6, msg=name)


def test_compiled_run_stays_compiled_through_many_prunes(tmp_path):
    """A prune at every step from step 3: six rebuilt modules, each compiled for training and
    evaluation. The old modules' dead cache entries must not use up Dynamo's ``recompile_limit`` (8),
    after which it runs the module eagerly and says so once (``hit config.recompile_limit``): the
    trainer resets Dynamo before compiling a rebuilt engine. Backend ``eager``: Dynamo's caching is
    what is under test."""
    out = tmp_path / "run"
    p = comera("pretrain", "--config", "configs/tiny-cpu.yaml", "--set", f"train.output_dir={out}",
               *PRUNING_RUN, "--set", "train.steps=8", "--set", "comera.pruning.every=1",
               "--set", "train.checkpoint_every=0", "--set", "train.compile=true",
               env=_env(COMERA_COMPILE_BACKEND="eager"), timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    assert p.stderr.count("physical prune, engine rebuilt") >= 5
    assert p.stderr.count("torch.compile (eager, mode default): engine compiled = True") >= 6
    assert "recompile_limit" not in p.stderr, p.stderr[p.stderr.find("recompile_limit") - 500:][:1500]


@pytest.mark.parametrize("backend,mode", [("aot_eager", "default"), ("inductor", "reduce-overhead")])
def test_compiled_step_matches_eager(run_dir, tmp_path, backend, mode):
    """``train.compile: true`` (torch.compile of the forward inside the engine) trains the same
    trajectory: after 3 steps the weights match the eager run's step-3 checkpoint. aot_eager traces the same graphs as inductor without its
    code generation; inductor in ``reduce-overhead`` mode (CUDA graphs on a GPU, fused C++ kernels
    here) is the GPU configuration, compiled for the CPU."""
    out = tmp_path / "compiled"
    p = comera("pretrain", "--config", "configs/tiny-cpu.yaml", "--set", f"train.output_dir={out}",
               "--set", "train.steps=3", "--set", "train.compile=true", "--set", f"train.compile_mode={mode}",
               env=_env(COMERA_COMPILE_BACKEND=backend), timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    assert f"torch.compile ({backend}, mode {mode}): engine compiled = True" in p.stderr
    assert "optimizer step of" not in p.stderr  # compiled only with train.compile_optimizer
    tag = "step00000003"
    eager = torch.load(run_dir / "checkpoints" / tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    compiled = torch.load(out / "checkpoints" / tag / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert compiled.keys() == eager.keys()
    for name, t in eager.items():
        # A key bias shifts every logit of a query's row by the same amount: softmax cancels it, so its
        # gradient is rounding noise, which Adam scales up to steps of about lr. Fused kernels round
        # differently (1.3e-6 measured after 3 steps); every other tensor agrees to 1e-6.
        atol = 1e-5 if name.endswith("attn.key.bias") else 1e-6
        torch.testing.assert_close(compiled[name], t, rtol=1e-5, atol=atol, msg=name)


def test_a_dense_run_trains_logs_and_checkpoints(tmp_path):
    """``comera.enabled=false``, the dense baseline users compare against: no TT layer, so no rank to collapse
    (S = 0 there is no collapse), and the job trains, logs its ratio (1) and checkpoints as a CoMERA run does."""
    out = tmp_path / "run"
    p = comera("pretrain", "--config", "configs/tiny-cpu.yaml", "--set", f"train.output_dir={out}",
               "--set", "comera.enabled=false", "--set", "train.steps=2", "--set", "train.checkpoint_every=2",
               "--set", "train.log_every=1", "--set", "metrics.prometheus=false")
    assert p.returncode == 0, p.stderr[-4000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step00000002"
    assert "step 2/2 train_loss" in p.stderr and "compression_ratio 1 " in p.stderr, p.stderr[-2000:]
    report = (out / "report.md").read_text()  # its end: a rank heatmap of no layer crashed the job here
    assert "| compression_ratio_tensorized | 1 | 1 | 1 | 1 |" in report, report
    assert "TT ranks" not in report and not (out / "report_ranks.png").exists(), report


def test_a_gpt_pretrains_evaluates_and_exports_through_the_cli(tmp_path):
    """The causal path as a user runs it (``configs/gpt-small.yaml``'s arch, objective and tied TTM head at
    tiny-cpu's size): ``comera pretrain`` with its prunes and late stage, ``comera evaluate`` scoring next tokens,
    and ``comera export`` to a HuggingFace causal LM that loads and generates."""
    out, hf = tmp_path / "run", tmp_path / "hf"
    p = comera("pretrain", "--config", "configs/tiny-cpu.yaml", "--set", f"train.output_dir={out}",
               "--set", "model.arch=gpt", "--set", "data.objective=causal", "--set", "model.tie_word_embeddings=true",
               "--set", "metrics.prometheus=false", *PRUNING_RUN)
    assert p.returncode == 0, p.stderr[-4000:]
    assert "physical prune, engine rebuilt" in p.stderr and "step 6/6 train_loss" in p.stderr
    ev = comera("evaluate", "--checkpoint", str(out), "--data", str(REPO / "comera_dist" / "cli.py"), "--json")
    assert ev.returncode == 0, ev.stderr[-3000:]
    result = json.loads(ev.stdout)
    assert result["objective"] == "causal" and math.isfinite(result["loss"]) and result["batches"] > 0
    ex = comera("export", "--checkpoint", str(out), "--out", str(hf))
    assert ex.returncode == 0 and ex.stdout.strip() == str(hf), ex.stderr[-3000:]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(hf), AutoTokenizer.from_pretrained(hf)
    # the run tokenizer's ids, not GPT-2's default 50256 (outside this vocabulary)
    assert tok.eos_token_id is not None and tok.eos_token_id < model.config.vocab_size
    for ids_of in (model.config, model.generation_config):
        assert (ids_of.bos_token_id, ids_of.eos_token_id, ids_of.pad_token_id) == (
            tok.bos_token_id, tok.eos_token_id, tok.pad_token_id), ids_of
    ids = tok("def main():", return_tensors="pt")["input_ids"]
    generated = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    assert generated.shape == (1, ids.shape[1] + 3)
