"""Two real gloo processes: rank 0 builds the cache while rank 1 waits on the barrier, then both
iterate disjoint shards of the same blocks."""

import hashlib
import json
import os
import subprocess
import sys
import textwrap
from collections import Counter

import numpy as np
import pytest

WORKER = textwrap.dedent("""
    import hashlib, json, sys
    import numpy as np
    import torch.distributed as dist
    from comera_dist.data import DataConfig, PackedLoader, TokenizerConfig, prepare_data

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = DataConfig(max_files=20, validation_fraction=0.2, seq_len=64, cache_dir=sys.argv[1],
                     tokenizer=TokenizerConfig(vocab_size=500))
    data = prepare_data(cfg, rank=rank, world_size=world, barrier=dist.barrier, show_progress=False)
    loader = PackedLoader(data.train, batch_size=4, rank=rank, world_size=world, seed=7,
                          collator=lambda ids, gen: {"input_ids": ids})
    digests = [hashlib.sha1(row.numpy().astype(np.int32).tobytes()).hexdigest()
               for _ in range(loader.batches_per_epoch) for row in next(loader)["input_ids"]]
    gathered = [None] * world
    dist.all_gather_object(gathered, digests)
    if rank == 0:
        json.dump({"shards": gathered, "path": str(data.cache_path)}, open(sys.argv[2], "w"))
    dist.destroy_process_group()
""")


@pytest.mark.distributed
def test_rank0_builds_others_wait_then_shards_are_disjoint(tmp_path, port):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out, cache = tmp_path / "out.json", tmp_path / "cache"
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen([sys.executable, str(script), str(cache), str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(logs)
    result = json.loads(out.read_text())
    # one published entry of each kind, no leftover temporary directory: only rank 0 built
    assert sorted(p.name.split("-")[0] for p in cache.iterdir() if p.name != "hf") == ["blocks", "corpus",
                                                                                          "tokenizer"]
    import datasets
    blocks = np.asarray(datasets.load_from_disk(result["path"])["train"].with_format("numpy")["input_ids"])
    all_digests = [hashlib.sha1(row.astype(np.int32).tobytes()).hexdigest() for row in blocks]
    r0, r1 = result["shards"]
    assert len(r0) == len(r1) == (len(blocks) // 8) * 4
    # code repeats, so a few blocks are equal: no block content may be drawn more often, over
    # both ranks, than it occurs in the dataset (an index given to both ranks would be)
    drawn, available = Counter(r0) + Counter(r1), Counter(all_digests)
    assert all(drawn[d] <= available[d] for d in drawn) and len(set(r0) & set(r1)) <= 2
