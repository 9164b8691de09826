"""Reference contractions for the TT and TTM formats (the specification every fast path is tested against).

Shapes use: T tokens, N_in/N_out the layer sizes, r the middle TT rank,
M1*M2 >= vocabulary rows and N1*N2 = embedding columns of a TTM split in two halves.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from comera_dist.tensor.accounting import from_right
from comera_dist.tensor.fused import gelu_matmul, scaled_bmm, shared_input_lr
from comera_dist.tensor.fused_ffn import lowrank_gelu
from comera_dist.tensor.tt import build_precision, chain, matmul_operand_dtype, scale_bonds


def tt_linear_lr(x: Tensor, L: Tensor, R: Tensor, bias: Tensor | None = None) -> Tensor:
    """Bidirectional TT linear: ``y = (x L) R + b``.

    x: (T, N_in); L: (N_in, r) input-side cores contracted (middle gate folded in);
    R: (r, N_out) output-side cores contracted. Returns (T, N_out).
    """
    h = x @ L  # (T, r)
    return h @ R if bias is None else torch.addmm(bias, h, R)  # (T, N_out); bias fused into the GEMM


def tt_linear_lr_shared(x: Tensor, Ls: list[Tensor], Rs: list[Tensor],
                        biases: list[Tensor | None]) -> list[Tensor]:
    """``[tt_linear_lr(x, L_i, R_i, b_i) for each i]`` for layers reading the same ``x`` (attention's Q,
    K and V), the input side as one GEMM: ``h = x [L_1 | ... | L_n]`` (T, sum r_i), then ``h_i R_i + b_i``
    each. The backward then has one GEMM for x's gradient and one for the L's, where separate layers
    have one of each per layer and the sum of the x gradients. x: (T, N_in); L_i: (N_in, r_i); R_i:
    (r_i, N_out_i). Returns the (T, N_out_i).

    When the layers have one shape (every ``R_i`` the same shape: equal ranks before the first prune,
    and after it on the GPU path, where a group's factors keep its padded rank:
    ``kernels.dispatch.keeps_padded_ranks``) and all or none have a bias, the output side is one batched GEMM too,
    ``[h_1 .. h_n] [R_1 .. R_n] + b`` (``baddbmm``): 3 GEMMs become 1 in the forward, and 6 become 2 in
    the backward with one sum for the biases."""
    return shared_input_lr(x, Ls, Rs, biases)  # keeps the factors, not their concatenation and stack


def tt_linear_lr_gelu(x: Tensor, L: Tensor, R: Tensor, bias: Tensor | None = None) -> Tensor:
    """``tt_linear_lr(gelu(x), L, R, bias)`` with GELU fused into ``x L`` (``tensor.fused``): autograd
    keeps ``x``, not ``gelu(x)`` too. Shapes as ``tt_linear_lr``."""
    h = gelu_matmul(x, L)  # (T, r)
    return h @ R if bias is None else torch.addmm(bias, h, R)  # (T, N_out)


def tt_ffn_lr(x: Tensor, inp: tuple[Tensor, Tensor, Tensor | None], out: tuple[Tensor, Tensor, Tensor | None],
              rows: int | None = None) -> Tensor:
    """A TT FFN, ``tt_linear_lr_gelu(tt_linear_lr(x, *inp), *out)``, whose (T, F) middle is remade in backward
    rather than kept (``tensor.fused_ffn``), ``rows`` tokens at a time. x: (T, N_in); ``inp`` = (L_in
    (N_in, r_in), R_in (r_in, F), bias (F,) or None); ``out`` = (L_out (F, r_out), R_out (r_out, N_out), bias
    (N_out,) or None). Returns (T, N_out)."""
    (L_in, R_in, b_in), (L_out, R_out, b_out) = inp, out
    t = lowrank_gelu(x @ L_in, R_in, b_in, L_out, rows)  # (T, r_out); keeps x L_in (T, r_in), not (T, F)
    return t @ R_out if b_out is None else torch.addmm(b_out, t, R_out)  # (T, N_out)


DEDUP = ("dynamic", "static")


def ttm_lookup_pairs(ids: Tensor, A: Tensor, B: Tensor, *, dedup: str = "dynamic") -> Tensor:
    """TTM embedding lookup from the two pre-contracted halves, never building the table.

    ids: (T,) int64 row ids < M1*M2; A: (M1, N1, r); B: (r, M2, N2). Row id ``i`` splits
    row-major into ``(i // M2, i % M2)``. Returns (T, N1*N2).

    dedup: ``"dynamic"`` computes each distinct id once (``torch.unique``: its output size
    depends on the data, a host sync on a GPU and a graph break under torch.compile);
    ``"static"`` keeps every shape fixed by ``T``: one product per token, or, once there are at
    least as many tokens as rows (``T >= M1*M2``), the whole table once and a gather.
    """
    M1, N1, r = A.shape
    M2, N2 = B.shape[1], B.shape[2]
    if dedup not in DEDUP:
        raise ValueError(f"dedup must be one of {list(DEDUP)}, got {dedup!r}")
    if dedup == "static" and ids.numel() >= M1 * M2:
        table = torch.einsum("anr,rbm->abnm", A, B).reshape(M1 * M2, N1 * N2)  # (M1*M2, N1*N2)
        return F.embedding(ids, table)  # (T, N1*N2)
    if dedup == "dynamic":
        uniq, inverse = torch.unique(ids, return_inverse=True)  # (U,), (T,)
    else:
        uniq, inverse = ids, None  # (T,): every token computes its own row
    # Row gathers go through F.embedding: its backward accumulates repeated rows far faster on CPU
    # than the scatter behind advanced indexing or index_select.
    Bt = B.permute(1, 0, 2).reshape(M2, r * N2)  # (M2, r*N2): one contiguous slice per second coordinate
    a = F.embedding(uniq // M2, A.reshape(M1, N1 * r)).view(-1, N1, r)  # (U, N1, r)
    b = F.embedding(uniq % M2, Bt).view(-1, r, N2)  # (U, r, N2)
    rows = torch.bmm(a, b).view(-1, N1 * N2)  # (U, N1*N2)
    return rows.view(*ids.shape, N1 * N2) if inverse is None else F.embedding(inverse, rows)  # (T, N1*N2)


# --------------------------------------------------------------------------------------------
# TT linear: the reference einsum, the two halves L and R, the sequential core-by-core order.
# --------------------------------------------------------------------------------------------

_LETTERS = "abcdefghijklmnopqrsuvwxyzABCDEFGHIJKLMNOPQRSUVWXYZ"  # 't' is the token axis


def tt_linear_einsum(x: Tensor, cores: list[Tensor], masks: list[Tensor] | None, d: int) -> Tensor:
    """Reference TT linear ``y = x W`` as one einsum over all cores and gate masks (no bias).

    x: (T, N_in); cores ``G_k: (r_{k-1}, n_k, r_k)``, the first ``d`` on the input side;
    masks: ``len(cores) - 1`` vectors or None. Returns (T, N_out).
    """
    D = len(cores)
    if 2 * D + 1 > len(_LETTERS):
        raise ValueError(f"tt_linear_einsum supports at most {(len(_LETTERS) - 1) // 2} cores, got {D}")
    bonds, modes = _LETTERS[: D + 1], _LETTERS[D + 1: 2 * D + 1]
    in_shape = [c.shape[1] for c in cores[:d]]
    operands = [x.reshape(x.shape[0], *in_shape)]  # (T, n_1, ..., n_d)
    terms = ["t" + modes[:d]]
    for k, c in enumerate(cores):
        operands.append(c)
        terms.append(bonds[k] + modes[k] + bonds[k + 1])
    for k, m in enumerate(masks or []):
        operands.append(m)
        terms.append(bonds[k + 1])
    y = torch.einsum(",".join(terms) + "->t" + modes[d:], *operands)  # (T, n_{d+1}, ..., n_D)
    return y.reshape(x.shape[0], math.prod(y.shape[1:]))  # explicit sizes: -1 is ambiguous at T = 0


def contract_left(cores_in: list[Tensor], masks_in_and_mid: list[Tensor] | None) -> Tensor:
    """``L (N_in, r_d)``: the input-side cores contracted, with the middle mask folded in.

    masks_in_and_mid: ``d`` vectors (the bonds after each input core, the middle one last) or None.
    """
    z = chain(cores_in, masks_in_and_mid)  # (1, N_in, r_d)
    return z.reshape(z.shape[1], z.shape[2])


def contract_right(cores_out: list[Tensor], masks: list[Tensor] | None) -> Tensor:
    """``R (r_d, N_out)``: the output-side cores contracted; masks: ``d_out - 1`` vectors or None."""
    z = chain(cores_out, masks)  # (r_d, N_out, 1)
    return z.reshape(z.shape[0], z.shape[1])


def contract_halves_batched(cores: list[Tensor], masks: list[Tensor], d: int) -> tuple[Tensor, Tensor]:
    """``L`` and ``R`` of ``G`` same-shape TT layers at once (one batched chain instead of G).

    cores: ``D`` stacked cores ``(G, r_{k-1}, n_k, r_k)``; masks: ``D - 1`` stacked masked gates
    ``(G, r_k)``; ``d`` input-side cores. Returns ``L (G, N_in, r_d)`` (middle mask folded in,
    as ``contract_left``) and ``R (G, r_d, N_out)`` (as ``contract_right``), in the dtype the per-token
    matmuls take them in (``tt.matmul_operand_dtype``: under autocast its dtype, cast once for all G layers).
    """
    G = cores[0].shape[0]
    out_dtype = matmul_operand_dtype(cores[0])
    work, no_autocast = build_precision(cores[0])  # fp32 build under bf16 (see tt.build_precision)
    with no_autocast:
        cores, masks = [c.to(work) for c in cores], [m.to(work) for m in masks]
        left, right = _halves_batched(cores, masks, d, G)
    return left.to(out_dtype), right.to(out_dtype)


def _halves_batched(cores: list[Tensor], masks: list[Tensor], d: int, G: int) -> tuple[Tensor, Tensor]:
    pairs = [(c, masks[k] if k < len(masks) else None) for k, c in enumerate(cores)]  # (core, its right-bond mask)

    def run(chain: list[tuple[Tensor, Tensor | None]]) -> Tensor:  # accounting.from_right's direction
        core_left = from_right(chain[0][0].shape[1], chain[-1][0].shape[3])
        if core_left:  # right to left: z (G, r', P, r_D), each core multiplies it from the left
            c, m = chain[-1]
            z = c if m is None else c * m.view(G, 1, 1, -1)  # (G, r, n, r_D)
            r_last = z.shape[3]
            for c, m in chain[-2::-1]:  # c: (G, r, n, r')
                z = scaled_bmm(z.reshape(G, c.shape[3], -1), c, m, core_left=True)  # (G, r*n, P*r_D)
                z = z.reshape(G, c.shape[1], -1, r_last)  # (G, r, n*P, r_D)
            return z
        c, m = chain[0]
        z = c if m is None else c * m.view(G, 1, 1, -1)  # (G, r0, n, r1)
        r0 = z.shape[1]
        for c, m in chain[1:]:  # c: (G, r, n, r')
            z = scaled_bmm(z.reshape(G, -1, c.shape[1]), c, m, core_left=False)  # (G, r0*P, n*r')
            z = z.reshape(G, r0, -1, c.shape[3])  # (G, r0, P*n, r')
        return z

    left, right = run(pairs[:d]), run(pairs[d:])  # (G, 1, N_in, r_d), (G, r_d, N_out, 1)
    return left.reshape(G, left.shape[2], left.shape[3]), right.reshape(G, right.shape[1], right.shape[2])


def tt_linear_sequential(x: Tensor, cores: list[Tensor], masks: list[Tensor] | None, d: int) -> Tensor:
    """TT linear core by core through the tokens (no L/R build; wins for few tokens or a huge r_d).

    x: (T, N_in) -> (T, N_out). Each step contracts one mode and one bond of the running state.
    """
    T, rem, P = x.shape[0], x.shape[1], 1  # sizes kept explicit: a -1 in a reshape is ambiguous at T = 0
    cores = scale_bonds(cores, masks)  # gates on the (small) cores: nothing extra saved per token
    s = x.reshape(T, rem, 1)  # (T, rem, r_0)
    for c in cores[:d]:  # c: (r, n, r')
        rem //= c.shape[1]
        s = s.reshape(T, c.shape[1], rem, c.shape[0])  # (T, n_k, rem', r)
        s = torch.einsum("tnqr,rns->tqs", s, c)  # (T, rem', r')
    s = s.reshape(T, P, cores[d - 1].shape[2])  # (T, P=1, r_d)
    for c in cores[d:]:  # c: (r, n, r')
        P *= c.shape[1]
        s = torch.einsum("tpr,rns->tpns", s, c).reshape(T, P, c.shape[2])  # (T, P*n, r')
    return s.reshape(T, P)  # (T, N_out)


# --------------------------------------------------------------------------------------------
# TTM lookup: the pair split, the reference gather, the naive per-core chain.
# --------------------------------------------------------------------------------------------


def ttm_split(num_cores: int) -> int:
    """How many cores go into the first half ``A`` of ``ttm_pair_contract`` (ceil of half)."""
    return (num_cores + 1) // 2


def _ttm_chain(cores: list[Tensor], masks: list[Tensor] | None) -> Tensor:
    """Contract 4-way TTM cores: returns ``(r_0, M, N, r_last)``; ``masks[k]`` scales core k's right bond.

    Built in fp32 or wider (``tt.build_precision``), returned in the cores' dtype."""
    out_dtype = cores[0].dtype
    work, no_autocast = build_precision(cores[0])
    with no_autocast:
        masks = None if masks is None else [m.to(work) for m in masks]
        z = _ttm_chain_in(scale_bonds([c.to(work) for c in cores], masks))
    return z.to(out_dtype)


def _ttm_chain_in(cores: list[Tensor]) -> Tensor:
    """In ``accounting.from_right``'s direction, as ``tt.chain``."""
    if from_right(cores[0].shape[0], cores[-1].shape[-1]):
        z = cores[-1]  # (r, M, N, b)
        for c in cores[-2::-1]:  # c: (a, m, n, r)
            b, M, N = z.shape[3], z.shape[1], z.shape[2]
            z = torch.einsum("amnr,rMNb->amMnNb", c, z).reshape(c.shape[0], c.shape[1] * M, c.shape[2] * N, b)
        return z
    z = cores[0]  # (r0, m, n, r1)
    for c in cores[1:]:  # c: (r, m, n, r')
        a, M, N = z.shape[0], z.shape[1], z.shape[2]
        z = torch.einsum("aMNr,rmns->aMmNns", z, c).reshape(a, M * c.shape[1], N * c.shape[2], c.shape[3])
    return z


def ttm_pair_contract(cores: list[Tensor], masks: list[Tensor] | None) -> tuple[Tensor, Tensor]:
    """Split TTM cores into two pre-contracted halves ``A (M1, N1, r)`` and ``B (r, M2, N2)``.

    The first ``ttm_split(D)`` cores form ``A`` (with the mask of the split bond folded in), the
    rest ``B``. Row id ``i`` of the table is ``(i // M2, i % M2)`` in (A, B) coordinates.
    """
    if len(cores) < 2:
        raise ValueError(f"a TTM needs at least 2 cores, got {len(cores)}")
    h = ttm_split(len(cores))
    A = _ttm_chain(cores[:h], None if masks is None else masks[:h])[0]  # (M1, N1, r)
    B = _ttm_chain(cores[h:], None if masks is None else masks[h:])[..., 0]  # (r, M2, N2)
    return A, B


def ttm_lookup_reference(ids: Tensor, A: Tensor, B: Tensor) -> Tensor:
    """Rows ``ids`` of the table ``A . B`` without deduplication; ids: (T,) -> (T, N1*N2)."""
    M2 = B.shape[1]
    a = A[ids // M2]  # (T, N1, r)
    b = B[:, ids % M2]  # (r, T, N2)
    return torch.einsum("tnr,rtm->tnm", a, b).reshape(ids.shape[0], -1)


def ttm_lookup_naive(ids: Tensor, cores: list[Tensor], masks: list[Tensor] | None) -> Tensor:
    """The per-core chain (the paper's baseline): gather each core's slice per token and multiply.

    ids: (T,) -> (T, prod n). No deduplication and no pair pre-contraction.
    """
    row_modes = [c.shape[1] for c in cores]
    T = ids.shape[0]
    stride = 1
    digits = []
    for m in reversed(row_modes):  # row-major digits, m_1 most significant
        digits.append((ids // stride) % m)
        stride *= m
    digits.reverse()
    z = F.embedding(digits[0], cores[0][0].reshape(row_modes[0], -1)).view(T, -1, cores[0].shape[3])  # (T, n_1, r_1)
    for k in range(1, len(cores)):
        if masks is not None:
            z = z * masks[k - 1]
        c = cores[k]  # (r, m, n, r')
        slices = c.permute(1, 0, 2, 3).reshape(c.shape[1], -1)  # (m, r*n*r')
        s = F.embedding(digits[k], slices).view(T, c.shape[0], -1)  # (T, r, n*r'): this token's slice
        z = torch.bmm(z, s).view(T, -1, c.shape[3])  # (T, P*n, r')
    return z.reshape(T, -1)  # (T, prod n)


# --------------------------------------------------------------------------------------------
# Tied output head: logits = h E^T from the TTM cores (orders costed in ``tensor.cost``).
# --------------------------------------------------------------------------------------------


def ttm_head_halves(cores: list[Tensor], masks: list[Tensor] | None, split: int) -> tuple[Tensor, Tensor]:
    """The TTM cut at bond ``split`` into ``left (M_L, N_L, r)`` and ``right (r, M_R, N_R)``.

    Cores ``[0, split)`` form ``left`` (with the mask of the cut bond folded in), the rest
    ``right``; ``ttm_pair_contract`` is the case ``split = ttm_split(D)``.
    """
    D = len(cores)
    if not 1 <= split < D:
        raise ValueError(f"split must lie in [1, {D - 1}] for {D} cores, got {split}")
    left = _ttm_chain(cores[:split], None if masks is None else masks[:split])[0]  # (M_L, N_L, r)
    right = _ttm_chain(cores[split:], None if masks is None else masks[split:])[..., 0]  # (r, M_R, N_R)
    return left, right


def ttm_head_contract(h: Tensor, left: Tensor, right: Tensor, side: str) -> Tensor:
    """``h @ E^T`` for ``E = left . right`` without building E; h: (T, N_L*N_R) -> (T, M_L*M_R).

    side ``"left"``: contract h with ``left`` first (keeps ``(T, M_L, r*N_R)``); ``"right"``: with
    ``right`` first (keeps ``(T*N_L, r*M_R)``). Both are two plain GEMMs (see ``cost.ttm_head_costs``):
    the per-token intermediates are permuted between them, never the halves broadcast over tokens
    (a broadcast ``matmul`` would copy a half once per token).
    """
    ML, NL, r = left.shape
    MR, NR = right.shape[1], right.shape[2]
    T = h.shape[0]
    if h.dim() != 2 or h.shape[-1] != NL * NR:
        raise ValueError(f"h must be (T, {NL * NR}) (the embedding width), got shape {tuple(h.shape)}")
    if side == "left":
        hp = h.reshape(T, NL, NR).permute(1, 0, 2).reshape(NL, T * NR)  # (N_L, T*N_R)
        x = left.permute(0, 2, 1).reshape(ML * r, NL) @ hp  # (M_L*r, T*N_R): [a, s, t, q]
        x = x.view(ML, r, T, NR).permute(2, 0, 1, 3).reshape(T * ML, r * NR)  # (T*M_L, r*N_R)
        rw = right.permute(0, 2, 1).reshape(r * NR, MR)  # (r*N_R, M_R)
        return (x @ rw).view(T, ML * MR)  # (T, M)
    if side == "right":
        rw = right.permute(2, 0, 1).reshape(NR, r * MR)  # (N_R, r*M_R)
        y = h.reshape(T * NL, NR) @ rw  # (T*N_L, r*M_R): [t, p, s, b]
        y = y.view(T, NL * r, MR).permute(1, 0, 2).reshape(NL * r, T * MR)  # (N_L*r, T*M_R)
        out = left.reshape(ML, NL * r) @ y  # (M_L, T*M_R): [a, t, b]
        return out.view(ML, T, MR).permute(1, 0, 2).reshape(T, ML * MR)  # (T, M)
    raise ValueError(f"side must be 'left' or 'right', got {side!r}")


def ttm_head_dense(h: Tensor, cores: list[Tensor], masks: list[Tensor] | None) -> Tensor:
    """The reference ``h @ E^T`` through the full (padded) table ``E (M, N)``; h: (T, N) -> (T, M)."""
    E = _ttm_chain(cores, masks)[0, :, :, 0]  # (M, N)
    return h @ E.t()
