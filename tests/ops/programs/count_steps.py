"""A minimal real distributed program with the trainer's CLI and stop/resume contract (Slurm harness tests).

It is NOT the comera trainer: it exercises slurm/pretrain.sh's plumbing (srun per
node, torchrun c10d rendezvous across nodes, USR1 forwarding, requeue, --resume
auto) before and independently of launch/train.py. Each step all-reduces over
gloo; on SIGUSR1/SIGTERM all ranks agree, rank 0 writes a checkpoint, exit 0.

usage: count_steps.py --config FILE --resume auto|none [--set steps=N] [--set out=DIR] [--set step_s=S]
                      [--set status=N]   (every rank's exit status at the end, as the trainer's 2, 3 or 4)
"""

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

stop = {"sig": None}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--resume", default="auto")
    ap.add_argument("--set", action="append", default=[])
    args = ap.parse_args()
    opts = dict(kv.split("=", 1) for kv in args.set)
    steps, out, step_s = int(opts.get("steps", 20)), Path(opts["out"]), float(opts.get("step_s", 0.2))
    previous = {s: signal.signal(s, lambda n, f: stop.update(sig=stop["sig"] or signal.Signals(n).name))
                for s in (signal.SIGUSR1, signal.SIGTERM)}
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ckpt = out / "checkpoint.json"
    start = 0
    if args.resume == "auto" and ckpt.exists():
        start = json.loads(ckpt.read_text())["step"]
    print(f"rank {rank}/{world} on {socket.gethostname()} node {os.environ.get('SLURMD_NODENAME')} "
          f"MASTER_ADDR={os.environ.get('MASTER_ADDR')} start step {start}", flush=True)
    step = start
    while step < steps:
        time.sleep(step_s)
        t = torch.ones(1)
        dist.all_reduce(t)  # (1,) == world
        assert int(t.item()) == world
        step += 1
        if rank == 0:
            print(f"step {step}", flush=True)
        flag = torch.tensor([1.0 if stop["sig"] else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag.item() > 0:
            break
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        ckpt.write_text(json.dumps({"step": step, "world": world}))
        print(f"saved checkpoint at step {step} ({'stop ' + stop['sig'] if stop['sig'] else 'done'})", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    # As the trainer's StopRequest.close: the inherited handlers back (node_launch.sh starts the workers with
    # USR1 ignored). Python resets its own handlers to the default at exit, so a second USR1 arriving then (Slurm
    # signals every process of the step, and node_launch.sh relays it too) would kill the exiting rank.
    for s, handler in previous.items():
        signal.signal(s, handler)
    return int(opts.get("status", 0))


if __name__ == "__main__":
    sys.exit(main())
