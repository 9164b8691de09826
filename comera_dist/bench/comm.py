"""``python -m comera_dist.bench comm``: bytes communicated per training step, CoMERA vs the same model dense.

Two real ranks (spawned processes, gloo on loopback) train each model through the engine's
``TrainSession`` with DeepSpeed's communication logger on; after warm-up steps the logger is
cleared and every collective of the measured steps (gradient reduction, ZeRO gathers, the
engine's own loss/penalty collectives) is summed from its records. Nothing is derived from
parameter counts: the byte totals are what ``deepspeed.comm`` sent.

Metrics: ``comm_bytes_per_step_dense``, ``comm_bytes_per_step_comera``,
``comm_bytes_ratio_dense_over_comera`` and ``compression_ratio`` (whole model, dense / CoMERA
parameters). The target is ratio >= compression ratio (``comm_reduction_meets_compression``), the run's
own compression ratio the threshold (``bench.summary.TARGETS``, which judges it on the benchmarks page).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch

from comera_dist.bench.common import base_parser, counts, write_result
from comera_dist.engine.ports import LOOPBACK, free_port

MODEL = {"arch": "bert_mlm", "vocab_size": 2048, "hidden_size": 128, "num_layers": 2, "num_heads": 4,
         "intermediate_size": 512, "max_positions": 64, "dropout": 0.0,
         # A TT embedding has no table to tie the LM head to, so the dense twin unties it as well:
         # both models then have the same architecture and differ only in the tensorized layers.
         "tie_word_embeddings": False}
TENSORIZE = {"num_cores": 4, "embedding_num_cores": 4, "max_rank": 8, "embedding_max_rank": 8}
SEQ = 32


def _config(outdir: str, *, tensorized: bool, zero_stage: int, micro: int, steps: int):
    from comera_dist.config import build_run_config

    return build_run_config({
        "model": MODEL,
        "comera": {"enabled": tensorized, "tensorize": TENSORIZE},
        "data": {"seq_len": SEQ},
        "train": {"steps": steps, "output_dir": outdir},
        "deepspeed": {"zero_stage": zero_stage, "micro_batch_size_per_gpu": micro, "comms_logger": True,
                      "stage3_param_persistence_threshold": 0, "scheduler": {"kind": "constant"}},
        "metrics": {"prometheus": False, "progress": False},
    })


def _batch(step: int, rank: int, micro: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(5, MODEL["vocab_size"], (micro, SEQ), generator=g)  # (B, T)
    labels = torch.where(torch.rand(micro, SEQ, generator=g) < 0.15, ids, torch.full_like(ids, -100))
    return {"input_ids": ids, "labels": labels}


def _logged_bytes() -> dict[str, int]:
    """Bytes per collective name recorded by DeepSpeed's comms logger since it was last cleared."""
    from deepspeed.comm import comm as ds_comm

    return {name: sum(int(size) * int(rec[0]) for size, rec in sizes.items())
            for name, sizes in ds_comm.comms_logger.comms_dict.items()}


def _rank_main(rank: int, world: int, port: int, workdir: str, opts: dict[str, Any]) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR=LOOPBACK,
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from deepspeed.comm import comm as ds_comm

    from comera_dist.engine.distributed import init_distributed, leave_distributed
    from comera_dist.engine.session import TrainSession
    from comera_dist.models import build_model

    init_distributed(120)
    result: dict[str, Any] = {}
    for name, tensorized in (("dense", False), ("comera", True)):
        cfg = _config(f"{workdir}/{name}", tensorized=tensorized, zero_stage=opts["zero_stage"],
                      micro=opts["micro"], steps=opts["warmup"] + opts["steps"])
        session = TrainSession.create(cfg, lambda cfg=cfg: build_model(cfg.model, cfg.comera),
                                      world_size=world)
        step = 0
        for _ in range(opts["warmup"]):
            step += 1
            session.train_step([_batch(step, rank, opts["micro"])])
        ds_comm.comms_logger.comms_dict.clear()
        for _ in range(opts["steps"]):
            step += 1
            session.train_step([_batch(step, rank, opts["micro"])])
        by_op = _logged_bytes()
        report = session.compression_report() if tensorized else None
        params = sum(int(torch.Size(getattr(p, "ds_shape", p.shape)).numel()) for p in session.module.parameters())
        result[name] = {"bytes_by_op": by_op, "bytes_per_step": sum(by_op.values()) / opts["steps"],
                        "params": params, "report": report}
        session.close()
    with open(Path(workdir) / f"rank{rank}.pkl", "wb") as f:
        pickle.dump(result, f)
    leave_distributed()  # left to interpreter exit, gloo's threads can abort the finished rank (-6)


def measure(*, zero_stage: int, micro: int, warmup: int, steps: int, world: int = 2) -> list[dict[str, Any]]:
    """Run the measurement on ``world`` spawned ranks; returns each rank's result."""
    opts = {"zero_stage": zero_stage, "micro": micro, "warmup": warmup, "steps": steps}
    with tempfile.TemporaryDirectory(prefix="comera-bench-comm-") as workdir:
        ctx = mp.get_context("spawn")
        port = free_port()
        procs = [ctx.Process(target=_rank_main, args=(r, world, port, workdir, opts)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        codes = [p.exitcode for p in procs]
        if any(c != 0 for c in codes):
            raise RuntimeError(f"bench comm: ranks exited with {codes}")
        results = []
        for r in range(world):
            with open(Path(workdir) / f"rank{r}.pkl", "rb") as f:
                results.append(pickle.load(f))
    return results


def main(argv: list[str]) -> int:
    p = base_parser("comm", __doc__.splitlines()[0])
    p.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3))
    p.add_argument("--warmup", type=int, default=1, help="untimed steps before the logger is cleared")
    args = p.parse_args(argv)
    steps, micro = counts(p, args, steps=3, batch=4)
    results = measure(zero_stage=args.zero_stage, micro=micro, warmup=args.warmup, steps=steps)
    r0 = results[0]
    dense, comera = r0["dense"], r0["comera"]
    rows = [{"model": name, "rank": rank, "params": res[name]["params"],
             "bytes_per_step": res[name]["bytes_per_step"],
             "ops": ", ".join(f"{op}={b}" for op, b in sorted(res[name]["bytes_by_op"].items()))}
            for rank, res in enumerate(results) for name in ("dense", "comera")]
    metrics = {
        "comm_bytes_per_step_dense": dense["bytes_per_step"],
        "comm_bytes_per_step_comera": comera["bytes_per_step"],
        "comm_bytes_ratio_dense_over_comera": dense["bytes_per_step"] / comera["bytes_per_step"],
        "compression_ratio": float(comera["report"]["compression_ratio_model"]),
        "param_ratio_dense_over_comera": dense["params"] / comera["params"],
    }
    metrics["comm_reduction_meets_compression"] = (metrics["comm_bytes_ratio_dense_over_comera"]
                                                   >= metrics["compression_ratio"])
    write_result(args.json, "comm", metrics, rows,
                 config={"model": MODEL, "tensorize": TENSORIZE, "seq_len": SEQ, "micro_batch": micro,
                         "zero_stage": args.zero_stage, "steps": steps, "warmup": args.warmup, "world_size": 2},
                 argv=argv)
    return 0
