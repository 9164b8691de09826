"""Corpus building: files/hf sources, splits, content-keyed cache, atomic publish, damaged entries."""

import json
import os
import socket
import subprocess
import sys

import datasets
import pytest

from comera_dist.data import CacheError, DataConfig, DataError, build_corpus, cache
from comera_dist.data import corpus as corpus_mod


def _files(tmp_path, n=12):
    d = tmp_path / "docs"
    d.mkdir()
    for i in range(n):
        (d / f"doc{i:02d}.txt").write_text(f"document {i}\nline two of {i}\n")
    return d


def _cfg(tmp_path, **kw):
    kw.setdefault("cache_dir", str(tmp_path / "cache"))
    kw.setdefault("validation_fraction", 0.25)
    return DataConfig(**kw)


def _texts(dd):
    return list(dd["train"]["text"]) + list(dd["validation"]["text"])


def _entries(root, kind="corpus"):
    return sorted(p.name for p in root.iterdir() if p.name.startswith(kind)) if root.exists() else []


def test_text_files_split_by_file_hash(tmp_path):
    d = _files(tmp_path)
    dd = build_corpus(_cfg(tmp_path, source="files", files=[str(d)]), tmp_path / "cache", show_progress=False)
    train, val = set(dd["train"]["text"]), set(dd["validation"]["text"])
    assert train.isdisjoint(val) and len(train) + len(val) == 12 and val  # one document per file
    assert dd.column_names == {"train": ["text"], "validation": ["text"]}


def test_json_and_parquet_with_a_text_column(tmp_path):
    rows = [{"content": f"row number {i} " * 3, "id": i} for i in range(40)]
    (tmp_path / "a.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "a.parquet"))
    for name in ("a.jsonl", "a.parquet"):
        cfg = _cfg(tmp_path, source="files", files=[str(tmp_path / name)], text_column="content")
        dd = build_corpus(cfg, tmp_path / "cache", show_progress=False)
        # one file: split by document hash
        assert len(dd["train"]) + len(dd["validation"]) == 40 and len(dd["validation"]) > 0
        assert set(dd["train"]["text"]).isdisjoint(dd["validation"]["text"])
    bad = _cfg(tmp_path, source="files", files=[str(tmp_path / "a.jsonl")], text_column="body")
    with pytest.raises(DataError, match=r"data.text_column 'body' is not a column of .*columns: \['content', 'id'\]"):
        build_corpus(bad, tmp_path / "cache")
    num = _cfg(tmp_path, source="files", files=[str(tmp_path / "a.jsonl")], text_column="id")
    with pytest.raises(DataError, match="data.text_column 'id' .* not strings"):
        build_corpus(num, tmp_path / "cache")


def test_non_utf8_text_files_are_replaced_not_fatal(tmp_path):
    d = _files(tmp_path, 6)
    (d / "latin.txt").write_bytes(b"caf\xe9 au lait\n")
    dd = build_corpus(_cfg(tmp_path, source="files", files=[str(d)], split_by="document"), tmp_path / "cache",
                      show_progress=False)
    assert "caf\ufffd au lait\n" in _texts(dd)


def test_hf_source_takes_load_dataset_kwargs(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_text("\n".join(json.dumps({"text": f"sample {i} " * 4}) for i in range(30)))
    cfg = _cfg(tmp_path, source="hf", hf_kwargs={"path": "json", "data_files": str(f), "split": "train"})
    dd = build_corpus(cfg, tmp_path / "cache", show_progress=False)
    assert len(dd["train"]) + len(dd["validation"]) == 30
    stream = _cfg(tmp_path, source="hf", hf_kwargs={"path": "json", "data_files": str(f), "streaming": True})
    with pytest.raises(DataError, match="streaming datasets cannot be packed"):
        build_corpus(stream, tmp_path / "cache")
    missing = _cfg(tmp_path, source="hf", hf_kwargs={"path": "json", "data_files": str(tmp_path / "no.json")})
    with pytest.raises(DataError, match=r"data.hf_kwargs=.*no.json.*load_dataset failed"):
        build_corpus(missing, tmp_path / "cache")


@pytest.mark.parametrize("spec", ["file", "glob", "dir", "split dict"])
def test_hf_local_files_are_part_of_the_cache_key(tmp_path, spec):
    """Editing a local file that ``hf_kwargs`` names (directly, by a glob, a directory or per split) builds
    the corpus again; an unrelated file does not, nor does a hub name that is no local path."""
    d = tmp_path / "data"
    d.mkdir()
    f = d / "rows.jsonl"
    f.write_text(json.dumps({"text": "one"}) + "\n")
    (tmp_path / "other.txt").write_text("unrelated")
    files = {"file": str(f), "glob": str(d / "*.jsonl"), "split dict": {"train": [str(f)]}}.get(spec)
    kwargs = {"path": "json", "data_files": files} if files else {"path": "json", "data_dir": str(d)}
    cfg = _cfg(tmp_path, source="hf", hf_kwargs=kwargs)
    key, _ = corpus_mod.corpus_plan(cfg)
    (tmp_path / "other.txt").write_text("unrelated, edited")
    assert corpus_mod.corpus_plan(cfg)[0] == key
    f.write_text(json.dumps({"text": "one, edited"}) + "\n")
    assert corpus_mod.corpus_plan(cfg)[0] != key
    hub = _cfg(tmp_path, source="hf", hf_kwargs={"path": "some-org/some-dataset"})
    assert corpus_mod._hf_local_stats(hub.hf_kwargs) == []


def test_missing_and_empty_inputs_name_the_path_and_filters(tmp_path):
    with pytest.raises(DataError, match=r"data.files: no such file or directory: .*gone.txt"):
        build_corpus(_cfg(tmp_path, source="files", files=[str(tmp_path / "gone.txt")]), tmp_path / "cache")
    blank = tmp_path / "blank"
    blank.mkdir()
    for i in range(4):
        (blank / f"b{i}.txt").write_text("  \n\n")
    cfg = _cfg(tmp_path, source="files", files=[str(blank)])
    with pytest.raises(DataError, match=r"empty corpus: the train split has no non-blank documents "
                                        r"\(source 'files': files \[.*blank'\], builder=text"):
        build_corpus(cfg, tmp_path / "cache")
    assert _entries(tmp_path / "cache") == [] and not [p for p in (tmp_path / "cache").iterdir()
                                                          if p.name.startswith(".")]


def test_empty_validation_split_says_how_to_fix(tmp_path):
    d = _files(tmp_path, 3)
    cfg = _cfg(tmp_path, source="files", files=[str(d)], split_by="file", validation_fraction=0.01)
    with pytest.raises(DataError, match=r"validation split has no non-blank documents .*raise "
                                        r"data.validation_fraction \(now 0.01\)"):
        build_corpus(cfg, tmp_path / "cache")


def test_second_build_is_a_cache_hit_and_edits_invalidate_it(tmp_path, monkeypatch):
    d = _files(tmp_path)
    cfg = _cfg(tmp_path, source="files", files=[str(d)])
    first = build_corpus(cfg, tmp_path / "cache", show_progress=False)

    def boom(*a, **k):
        raise AssertionError("rebuilt although cached")

    with monkeypatch.context() as m:
        m.setattr(corpus_mod, "_materialize", boom)
        again = build_corpus(cfg, tmp_path / "cache", show_progress=False)
    assert list(again["train"]["text"]) == list(first["train"]["text"]) and len(_entries(tmp_path / "cache")) == 1
    (d / "doc03.txt").write_text("edited, longer text than before\n")
    edited = build_corpus(cfg, tmp_path / "cache", show_progress=False)
    assert len(_entries(tmp_path / "cache")) == 2
    assert "edited, longer text than before\n" in _texts(edited)


def test_interrupted_build_leaves_no_entry(tmp_path, monkeypatch):
    d = _files(tmp_path)
    cfg = _cfg(tmp_path, source="files", files=[str(d)])
    real_save = datasets.DatasetDict.save_to_disk

    def save_then_die(self, path, **kw):
        real_save(self, path, **kw)  # the files are written ...
        raise KeyboardInterrupt  # ... and the process is interrupted before publishing

    monkeypatch.setattr(datasets.DatasetDict, "save_to_disk", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        build_corpus(cfg, tmp_path / "cache", show_progress=False)
    assert os.listdir(tmp_path / "cache") == ["hf"]  # no entry, no temporary directory
    monkeypatch.setattr(datasets.DatasetDict, "save_to_disk", real_save)
    assert len(build_corpus(cfg, tmp_path / "cache", show_progress=False)["train"]) > 0


@pytest.mark.parametrize("damage", ["meta", "arrow", "state"])
def test_damaged_entry_is_a_clear_error(tmp_path, damage):
    d = _files(tmp_path)
    cfg = _cfg(tmp_path, source="files", files=[str(d)])
    build_corpus(cfg, tmp_path / "cache", show_progress=False)
    entry = tmp_path / "cache" / _entries(tmp_path / "cache")[0]
    if damage == "meta":
        (entry / "comera_meta.json").unlink()
    elif damage == "arrow":
        arrow = next((entry / "train").glob("*.arrow"))
        arrow.write_bytes(arrow.read_bytes()[:100])
    else:
        (entry / "validation" / "state.json").write_text("{")
    with pytest.raises(CacheError, match=f"unreadable cache entry {entry} .*delete it to rebuild: rm -rf"):
        build_corpus(cfg, tmp_path / "cache", show_progress=False)


def test_builds_left_by_killed_processes_are_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    final = tmp_path / "corpus-abc"
    host = socket.gethostname()
    stale = tmp_path / f".corpus-abc.tmp-{host}-{dead.pid}-deadbeef"
    live = tmp_path / f".corpus-abc.tmp-{host}-{os.getpid()}-0badc0de"
    remote = tmp_path / f".corpus-abc.tmp-other-host-{dead.pid}-12345678"
    for d in (stale, live, remote):
        (d / "train").mkdir(parents=True)
    with cache.publish(final, {"rows": {}}) as tmp:
        (tmp / "x").write_text("done")
    assert not stale.exists() and live.exists() and remote.exists()
    assert (final / "x").read_text() == "done" and cache.read_meta(final) == {"rows": {}}


HOLD_LOCK = """
import fcntl, sys, time
f = open(sys.argv[1])
fcntl.flock(f, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(60)
"""

PROBE_LOCK = """
import fcntl, sys
f = open(sys.argv[1])
try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
except OSError:
    print("held")
else:
    print("free")
"""


def _lock(build):
    return build.with_name(build.name + ".lock")


def test_a_live_build_of_another_pid_namespace_is_left_alone(tmp_path):
    """A container with the host's network shares its hostname, not its pids: its live build's pid is dead here,
    and the sweep deleted the build under it (FileNotFoundError there). The build's lock, held from before its
    directory exists until it is published, tells."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    final, host = tmp_path / "corpus-abc", socket.gethostname()
    elsewhere = tmp_path / f".corpus-abc.tmp-{host}-{dead.pid}-0000cafe"  # its pid means nothing here
    stale = tmp_path / f".corpus-abc.tmp-{host}-{dead.pid}-deadbeef"  # killed: its lock is free
    for d in (elsewhere, stale):
        (d / "train").mkdir(parents=True)
        _lock(d).touch()
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(_lock(elsewhere))], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert cache.remove_stale_builds(final) == [stale]
        assert (elsewhere / "train").is_dir() and not stale.exists() and not _lock(stale).exists()
    finally:
        holder.kill()
        holder.wait()
    assert cache.remove_stale_builds(final) == [elsewhere]  # its process gone too: stale now


def test_a_build_holds_its_lock_until_it_is_published(tmp_path):
    final = tmp_path / "corpus-abc"
    with cache.publish(final, {"rows": {}}) as tmp:
        probe = subprocess.run([sys.executable, "-c", PROBE_LOCK, str(_lock(tmp))], capture_output=True, text=True,
                               check=True)
        assert probe.stdout.strip() == "held", probe
    assert sorted(os.listdir(tmp_path)) == ["corpus-abc"]  # no lock file left


def test_a_cache_directory_that_cannot_be_written_is_named(tmp_path):
    (tmp_path / "file").write_text("")
    with (pytest.raises(CacheError, match=r"data.cache_dir: cannot build the cache entry .*corpus-abc: File exists"),
          cache.publish(tmp_path / "file" / "corpus-abc", {})):
        pass


def _pretrain_read_only(ro, *args: str) -> subprocess.CompletedProcess:
    """``comera pretrain ARGS`` in a private mount namespace where ``ro`` is a read-only bind mount of itself."""
    program = ("import sys; from comera_dist import cli; "
               f"sys.exit(cli.main(['pretrain', '--config', 'configs/tiny-cpu.yaml', *{list(args)!r}]))")
    mount = f"mount --bind {ro} {ro} && mount -o remount,ro,bind {ro}"
    return subprocess.run(["unshare", "-m", "sh", "-c", f'{mount} && exec {sys.executable} -c "{program}"'],
                          capture_output=True, text=True, env=os.environ | {"WORLD_SIZE": "1"}, timeout=300,
                          check=False)


def test_a_read_only_cache_directory_is_one_line_exit_2(tmp_path):
    """A read-only mount (root too): `OSError: [Errno 30] Read-only file system`, a traceback and exit 1, at the
    first build. --check-config accepts it (a prebuilt read-only cache is a fair setup), not a read-only
    train.output_dir."""
    if subprocess.run(["unshare", "-m", "true"], capture_output=True, check=False).returncode != 0:
        pytest.skip("unshare -m is not permitted here (a private mount namespace for the read-only bind mount)")
    ro = tmp_path / "ro"
    ro.mkdir()
    done = _pretrain_read_only(ro, "--set", f"train.output_dir={tmp_path / 'run'}", "--set", f"data.cache_dir={ro}",
                               "--set", "train.steps=1", "--set", "data.max_files=5")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert (f"data.cache_dir: cannot build the cache entry {ro}/" in done.stderr
            and "Read-only file system (point data.cache_dir at a directory this user can write)" in done.stderr)
    done = _pretrain_read_only(ro, "--set", f"train.output_dir={ro / 'run'}", "--check-config")
    assert done.returncode == 2, done.stderr[-3000:]
    assert f"train.output_dir={ro / 'run'}: {ro} is not writable by this user" in done.stderr, done.stderr[-3000:]
