"""Finding, reading and splitting raw documents: stdlib listing, encodings, hash split, path errors."""

import os
import shutil
import subprocess
import sys

import pytest

from comera_dist.data import DataError, sources


def _tree(root, files):
    for rel, data in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
    return root


def test_stdlib_listing_skips_site_packages_and_non_python(tmp_path):
    _tree(tmp_path, {"a.py": "x=1", "pkg/b.py": "y=2", "pkg/notes.txt": "no",
                     "site-packages/third.py": "z", "pkg/__pycache__/b.py": "c", "dist-packages/d.py": "d"})
    assert sources.list_stdlib_files(tmp_path) == ["a.py", "pkg/b.py"]
    with pytest.raises(DataError, match="stdlib root is not a directory: .*missing"):
        sources.list_stdlib_files(tmp_path / "missing")


def test_real_stdlib_is_large_and_excludes_site_packages():
    files = sources.list_stdlib_files(sources.stdlib_root())
    assert len(files) > 500 and "json/decoder.py" in files
    assert not any("site-packages" in f for f in files)


def test_split_hash_is_pinned_across_machines_and_python_versions():
    # sha256-based, never Python's salted hash(): these values must never change, or every
    # cached split and published validation number changes with it.
    assert sources.split_unit("json/decoder.py", "comera-dist") == pytest.approx(0.9328191976, abs=1e-9)
    assert sources.split_unit("json/decoder.py", "other") != sources.split_unit("json/decoder.py", "comera-dist")


def test_split_depends_on_relative_path_only_and_is_disjoint():
    keys = [f"pkg{i % 7}/mod{i}.py" for i in range(400)]
    train, val = sources.split_keys(keys, fraction=0.1, salt="s")
    assert set(train).isdisjoint(val) and sorted(train + val) == sorted(keys)
    assert 20 <= len(val) <= 60  # ~10% of 400
    assert sources.split_keys(list(reversed(keys)), fraction=0.1, salt="s") == (train, val)
    assert sources.split_keys(keys, fraction=0.1, salt="t") != (train, val)


def test_capped_split_keeps_both_splits_and_is_a_subset():
    keys = [f"m{i}.py" for i in range(300)]
    full_train, full_val = sources.split_keys(keys, fraction=0.1, salt="s")
    train, val = sources.split_keys(keys, fraction=0.1, salt="s", max_keys=20)
    assert len(train) + len(val) == 20 and len(val) == 2
    assert set(train) <= set(full_train) and set(val) <= set(full_val)


def test_split_of_stdlib_copies_is_the_same_wherever_it_lives(tmp_path):
    files = {f"lib/m{i}.py": f"v = {i}\n" for i in range(50)}
    a, b = _tree(tmp_path / "a", files), tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)  # other absolute root, other mtimes
    split = lambda root: sources.split_keys(sources.list_stdlib_files(root), fraction=0.2, salt="s")
    assert split(a) == split(b)


def test_reading_honours_encoding_cookies_and_replaces_bad_bytes(tmp_path):
    latin = tmp_path / "latin.py"
    latin.write_bytes(b"# -*- coding: latin-1 -*-\nname = '\xe9t\xe9'\n")
    assert sources.read_text_file(latin) == ("# -*- coding: latin-1 -*-\nname = '\u00e9t\u00e9'\n", False)
    broken = tmp_path / "broken.py"
    broken.write_bytes(b"x = '\xff\xfe'\n")
    text, lossy = sources.read_text_file(broken)
    assert lossy and text == "x = '\ufffd\ufffd'\n"
    bogus = tmp_path / "bogus.py"
    bogus.write_bytes(b"# coding: no-such-codec\nok = 1\n")
    assert sources.read_text_file(bogus) == ("# coding: no-such-codec\nok = 1\n", False)
    txt = tmp_path / "t.txt"
    txt.write_bytes(b"caf\xc3\xa9 \x80")
    assert sources.read_text_file(txt) == ("caf\u00e9 \ufffd", True)


def test_resolve_paths_files_dirs_globs_and_errors(tmp_path):
    _tree(tmp_path, {"d/a.txt": "a", "d/sub/b.json": "{}", "d/skip.bin": "x", "c.parquet": "p"})
    got = sources.resolve_paths([str(tmp_path / "d"), str(tmp_path / "*.parquet"), str(tmp_path / "d/a.txt")])
    assert [p.name for p in got] == ["c.parquet", "a.txt", "b.json"]
    with pytest.raises(DataError, match=r"data.files: no such file or directory: .*nope.txt"):
        sources.resolve_paths([str(tmp_path / "nope.txt")])
    with pytest.raises(DataError, match=r"data.files: the pattern .*\*.csv' matches no files"):
        sources.resolve_paths([str(tmp_path / "*.csv")])
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="holds no files with a known extension"):
        sources.resolve_paths([str(tmp_path / "empty")])


def test_infer_builder(tmp_path):
    assert sources.infer_builder([tmp_path / "a.py", tmp_path / "b.txt"], None) == "text"
    assert sources.infer_builder([tmp_path / "a.jsonl"], None) == "json"
    assert sources.infer_builder([tmp_path / "a.csv"], "text") == "text"
    with pytest.raises(DataError, match=r"mix builders \['json', 'text'\]"):
        sources.infer_builder([tmp_path / "a.json", tmp_path / "b.txt"], None)
    with pytest.raises(DataError, match=r"cannot infer a builder for extensions \['.csv'\]"):
        sources.infer_builder([tmp_path / "a.csv"], None)


def test_text_files_read_alike_by_evaluation_and_by_the_datasets_text_builder(tmp_path):
    # Training reads data.files through the datasets text builder, evaluation through read_text_file: one
    # file must make the same document either way, whatever its line endings.
    _tree(tmp_path, {"w.txt": b"def f():\r\n    return 1\r\n", "m.md": b"# t\rbody\r\n\r\nend\n",
                     "c.py": b"x = 1\r\ny = 2\r\n", "odd.py": b"# coding: no-such-codec\r\nok = 1\r\n"})
    paths = sorted(tmp_path.iterdir())
    built = sources.load_files(paths, builder="text", text_column="text", sample_by="document",
                               cache_dir=tmp_path / "hf", num_proc=1)["text"]
    assert built == [sources.read_text_file(p)[0] for p in paths]
    assert not any("\r" in t for t in built)


def test_a_broken_file_among_several_is_the_one_named(tmp_path):
    _tree(tmp_path, {"a.jsonl": '{"text": "one"}\n', "b.jsonl": '{"text": "two"}\n{"text": \n',
                     "c.jsonl": '{"text": "three"}\n'})
    paths = sorted(tmp_path.glob("*.jsonl"))
    with pytest.raises(DataError, match=r"failed on \S*b\.jsonl \(one of 3 files\)") as err:
        sources.load_files(paths, builder="json", text_column="text", sample_by="document",
                           cache_dir=tmp_path / "hf", num_proc=1)
    assert "a.jsonl" not in str(err.value)


def test_files_that_fail_only_together_say_so_with_the_parsers_reason(tmp_path):
    _tree(tmp_path, {"a.jsonl": '{"text": "a", "n": 1}\n', "b.jsonl": '{"text": "b", "n": "x"}\n'})
    with pytest.raises(DataError, match=r"failed on 2 files together, though each loads alone .*"
                                        r"ArrowInvalid: Failed to parse string: 'x'"):
        sources.load_files(sorted(tmp_path.glob("*.jsonl")), builder="json", text_column="text",
                           sample_by="document", cache_dir=tmp_path / "hf", num_proc=1)


NETWORK_PROGRAM = """
import socket, sys
from pathlib import Path
tried = []
def refuse(*args, **kwargs):
    tried.append(args[-1] if args and isinstance(args[-1], tuple) else args[:2])
    raise OSError("no network in this test")
socket.socket.connect = lambda self, address: refuse(address)
socket.getaddrinfo = refuse  # a name lookup comes first, where one is tried at all
socket.create_connection = refuse
from comera_dist.data import sources
root = Path(sys.argv[1])
(root / "a.txt").write_text("x = 1\\n")
ds = sources.load_files([root / "a.txt"], builder="text", text_column="text", sample_by="document",
                        cache_dir=root / "cache", num_proc=1)
assert ds["text"] == ["x = 1\\n"], ds["text"]
print(tried)
"""


@pytest.mark.parametrize("asked", [None, "1"])
def test_loading_local_files_leaves_the_network_alone(asked, tmp_path):
    """datasets pinged S3 at every load_dataset, local files included, unless the process was set offline (only
    launch/test.sh and two launchers did; slurm/pretrain.sh and a plain `comera pretrain` did not)."""
    env = {k: v for k, v in os.environ.items() if "OFFLINE" not in k and k != "HF_UPDATE_DOWNLOAD_COUNTS"}
    if asked:
        env["HF_UPDATE_DOWNLOAD_COUNTS"] = asked  # the user's own choice stands
    done = subprocess.run([sys.executable, "-c", NETWORK_PROGRAM, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    tried = done.stdout.strip().splitlines()[-1]
    assert (tried == "[]") == (asked is None), tried


def test_a_file_whose_name_looks_like_a_pattern_is_read_as_named(tmp_path):
    """"run[1]/a[1].txt" was taken for a glob: refused as matching nothing, and datasets, which reads data_files as
    patterns too, built an empty dataset of it."""
    (tmp_path / "run[1]").mkdir()
    (tmp_path / "run[1]" / "a[1].txt").write_text("x = 1\n")
    (tmp_path / "run[1]" / "b.txt").write_text("y = 2\n")
    for named in (tmp_path / "run[1]" / "a[1].txt", tmp_path / "run[1]"):
        paths = sources.resolve_paths([str(named)])
        ds = sources.load_files(paths, builder="text", text_column="text", sample_by="document",
                                cache_dir=tmp_path / "cache", num_proc=1)
        assert sorted(ds["text"]) == (["x = 1\n"] if named.is_file() else ["x = 1\n", "y = 2\n"]), paths
