"""Small TT layers shared by the unit tests (a helper module, not a test file)."""

import torch

from comera_dist.layers import TTEmbedding


def gated_embedding(V=50, N=12, num_cores=3, max_rank=4, dtype=torch.float64, **kw) -> TTEmbedding:
    """A seeded float64 ``TTEmbedding`` with non-trivial gates, one entry of gate 0 below tau (masked out)."""
    torch.manual_seed(0)
    emb = TTEmbedding(V, N, num_cores=num_cores, max_rank=max_rank, dtype=dtype, **kw)
    with torch.no_grad():
        for g in emb.gates:
            g.uniform_(0.5, 1.5)
        emb.gates[0][1] = 0.002  # below tau: masked out
    return emb
