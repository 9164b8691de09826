"""``resume.rng_state`` and ``set_rng_state``: each of torch's, python's and numpy's streams resumes where it was.

The two-rank kill-and-resume test sees the torch stream (dropout draws from it) but none of the others: the
product draws nothing from python's or numpy's generators, and each process seeds them alike, so a resume that
left them at the seed passed it. A user's model or collator that draws from them would not resume identically.
"""

from __future__ import annotations

import pickle
import random

import numpy as np
import pytest
import torch

from comera_dist.engine.resume import rng_state, set_rng_state


def _draws() -> dict[str, list]:
    return {"torch": torch.rand(4).tolist(), "python": [random.random() for _ in range(4)],
            "numpy": np.random.rand(4).tolist()}


@pytest.mark.parametrize("stream", ["torch", "python", "numpy"])
def test_each_stream_resumes_where_it_was_saved(stream):
    torch.manual_seed(1), random.seed(2), np.random.seed(3)
    _draws()  # away from the seed: a restore that only re-seeded would not get here
    saved = pickle.loads(pickle.dumps(rng_state()))  # as it travels: gathered, then saved beside the shards
    after_save = _draws()
    torch.manual_seed(7), random.seed(8), np.random.seed(9)  # what a fresh process of the resumed job holds
    set_rng_state(saved)
    assert _draws()[stream] == after_save[stream]
