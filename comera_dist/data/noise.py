"""Counter-based randomness per block: a block's MLM masks depend on which block it is, not on who draws it.

Each block a loader hands out has a 64-bit key, ``block_keys(seed, epoch, slots)``: a hash of the run's seed,
the epoch and the block's slot in that epoch's order (evaluation uses its own domain, ``EVAL_EPOCH``). The
collator's random numbers are ``uniform(keys, length, stream)``: splitmix64 of (key, position, stream), a pure
function of those. So the masks of a block are the same on every rank, in every batch size and at every world
size: a run resumed on another number of ranks (``PackedLoader.load_state_dict``) sees the same blocks with the
same masks, and a validation pass gives the same loss whichever ranks share it.

A ``torch.Generator`` per batch cannot do that (its stream depends on the batch's shape and the rank), and one
per block costs a generator and a dozen small ops per row on the loader thread; this is a few vectorized numpy
ops on the whole ``(B, L)`` batch. ``batch_seed`` (the same hash, another domain) seeds each epoch's shuffle.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from torch import Tensor

EVAL_EPOCH = -1
"""The epoch of validation blocks' keys (training epochs are >= 0), so no training draw repeats a validation one."""

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / phi: splitmix64's increment
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_STREAMS = 4  # draws a collator may take per position (``stream`` in [0, _STREAMS))


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer on a uint64 array (numpy's uint64 array arithmetic wraps mod 2^64)."""
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def _hash64(*parts: object) -> int:
    """A 64-bit hash of ``parts``: the same on every process, machine and Python (no ``hash()`` salt)."""
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def batch_seed(seed: int, step: int, rank: int) -> int:
    """A 63-bit generator seed from (seed, step, rank), well mixed so nearby triples are unrelated
    (``PackedLoader`` draws each epoch's order from ``batch_seed(seed, epoch, -1)``)."""
    return _hash64(seed, step, rank) & (2**63 - 1)


def _domain(seed: int, epoch: int) -> np.uint64:
    """The blocks' hash domain of epoch ``epoch`` of run ``seed``."""
    return np.uint64(_hash64("comera-blocks", seed, epoch))


def block_keys(seed: int, epoch: int, slots: np.ndarray | Tensor | range) -> np.ndarray:
    """(B,) uint64 keys of the blocks at ``slots`` (their indices in epoch ``epoch``'s order) of run ``seed``."""
    slots = np.asarray(slots, dtype=np.int64)
    if slots.ndim != 1 or (slots < 0).any():
        raise ValueError(f"block_keys: slots must be a 1-D array of indices >= 0, got shape {slots.shape}")
    with np.errstate(over="ignore"):
        return _mix(_domain(seed, epoch) + (slots.astype(np.uint64) + np.uint64(1)) * _GOLDEN)


def uniform(keys: np.ndarray, length: int, stream: int) -> Tensor:
    """(B, length) float64 uniforms in [0, 1): draw ``stream`` at each position of each keyed block."""
    if not 0 <= stream < _STREAMS:
        raise ValueError(f"uniform: stream must be in [0, {_STREAMS}), got {stream}")
    keys = np.asarray(keys, dtype=np.uint64)
    counters = np.arange(length, dtype=np.uint64) * np.uint64(_STREAMS) + np.uint64(stream + 1)  # (length,)
    with np.errstate(over="ignore"):
        bits = _mix(keys[:, None] ^ _mix(counters * _GOLDEN)[None, :])  # (B, length)
    return torch.from_numpy((bits >> np.uint64(11)).astype(np.float64) * 2.0**-53)
