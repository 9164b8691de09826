import os, sys, ctypes, tempfile, gc
os.environ.setdefault("DS_ACCELERATOR", "cpu")
from comera_dist.bench.common import single_rank_env
single_rank_env()
from comera_dist.bench.soak import rss_bytes
from comera_dist.config import load_run_config
from comera_dist.engine.session import TrainSession
from comera_dist.engine.trainer import train
trim = sys.argv[1] == "trim"
libc = ctypes.CDLL("libc.so.6")
rss = []
orig = TrainSession.maybe_prune
def maybe_prune(self, step):
    did = orig(self, step)
    if did and trim:
        gc.collect(); libc.malloc_trim(0)
    return did
TrainSession.maybe_prune = maybe_prune
ostep = TrainSession.train_step
def train_step(self, *a, **k):
    out = ostep(self, *a, **k); rss.append(rss_bytes()); return out
TrainSession.train_step = train_step
out = tempfile.mkdtemp()
extra = [] if sys.argv[2] == "prune" else ["comera.pruning.every=0"]
cfg = load_run_config("configs/tiny-cpu.yaml", ["train.steps=2000", "train.checkpoint_every=100", f"train.output_dir={out}",
      "train.log_every=50", "train.eval_every=100", "metrics.prometheus=false", "metrics.progress=false", "metrics.report=false",
      "comera.controller.tau=0.9", "comera.lr.gates=0.01", "comera.pruning.every=50", "comera.pruning.start_step=50", *extra])
train(cfg, resume="none")
print(sys.argv[1:], "RSS MiB every 250:", [round(r / 2**20, 1) for r in rss[::250]], round(rss[-1] / 2**20, 1))
