"""Builds each projection/embedding of a model as a dense or a TT layer, per the tensorize settings.

The models never import ``comera_dist.compression`` (import rule); they read the
tensorize settings through the small ``TensorizeSpec`` protocol below, which
``compression.config.TensorizeConfig`` satisfies. Layer *kinds* are the keys of
``TensorizeSpec.modes``: ``"attention"`` (Q, K, V, out), ``"ffn_in"``, ``"ffn_out"``
and ``"embedding"``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, Protocol

from torch import nn

from comera_dist.layers import TiedTTHead, TTEmbedding, TTLinear
from comera_dist.layers.dense import Linear

LinearKind = Literal["attention", "ffn_in", "ffn_out"]
FULL_RANK = 1 << 30
"""A rank bound no factorization reaches: TT-SVD at this bound is exact."""


class TensorizeSpec(Protocol):
    """What the models read from ``comera.tensorize`` (duck-typed; see ``TensorizeConfig``)."""

    embedding: bool
    attention: bool
    ffn: bool
    num_cores: int
    embedding_num_cores: int
    max_rank: int
    embedding_max_rank: int
    modes: Mapping[str, Sequence[Sequence[int]]]
    init: str


def is_tensorized(spec: TensorizeSpec | None, kind: str) -> bool:
    """Whether layers of ``kind`` are TT layers under ``spec`` (``None``: all dense)."""
    if spec is None:
        return False
    if kind == "embedding":
        return bool(spec.embedding)
    if kind == "attention":
        return bool(spec.attention)
    if kind in ("ffn_in", "ffn_out"):
        return bool(spec.ffn)
    raise ValueError(f"unknown layer kind {kind!r}; expected attention, ffn_in, ffn_out or embedding")


def explicit_modes(spec: TensorizeSpec, kind: str, rows: int, cols: int) -> tuple[list[int] | None, list[int] | None]:
    """The override ``spec.modes[kind]`` for a ``rows x cols`` layer, or ``(None, None)``.

    An override applies to the layers whose shape it factorizes; a layer of the same kind with a
    different shape (e.g. the narrower K/V projections of grouped-query attention) gets automatic
    modes. ``check_modes_used`` reports an override that matched no layer at all.
    """
    pair = spec.modes.get(kind) if spec.modes else None
    if pair is None:
        return None, None
    in_modes, out_modes = [int(m) for m in pair[0]], [int(m) for m in pair[1]]
    if kind == "embedding":
        # TTM rows may be padded (prod(row_modes) >= vocabulary), columns must be exact.
        if _prod(in_modes) < rows or _prod(out_modes) != cols:
            raise ValueError(f"tensorize.modes['embedding']={[in_modes, out_modes]} cannot hold a "
                             f"{rows}x{cols} table: need prod(rows) >= {rows} and prod(cols) == {cols}")
        return in_modes, out_modes
    if _prod(in_modes) != rows or _prod(out_modes) != cols:
        return None, None
    return in_modes, out_modes


def check_modes_used(spec: TensorizeSpec | None, shapes: Mapping[str, set[tuple[int, int]]]) -> None:
    """Raise if an explicit ``modes`` override fits none of the tensorized layers of its kind.

    ``shapes``: kind -> the set of ``(rows, cols)`` of the tensorized layers of that kind.
    """
    if spec is None or not spec.modes:
        return
    for kind, pair in spec.modes.items():
        if kind == "embedding" or kind not in shapes:
            continue
        want = (_prod(pair[0]), _prod(pair[1]))
        if want not in shapes[kind]:
            raise ValueError(f"tensorize.modes[{kind!r}]={[list(pair[0]), list(pair[1])]} factorizes "
                             f"{want[0]}x{want[1]}, but the {kind} layers are {sorted(shapes[kind])}")


def make_linear(spec: TensorizeSpec | None, kind: LinearKind, in_features: int, out_features: int, *,
                bias: bool = True, init_std: float = 0.02) -> nn.Module:
    """A ``Linear(in, out)``-equivalent module: dense (normal init) or ``TTLinear``.

    ``spec.init == "svd"`` builds the dense init first and truncates it by TT-SVD to ``max_rank``;
    ``"random"`` draws Gaussian cores directly (``TTLinear``'s init).
    """
    if not is_tensorized(spec, kind):
        return _dense_linear(in_features, out_features, bias, init_std)
    in_modes, out_modes = explicit_modes(spec, kind, in_features, out_features)
    if spec.init == "svd":
        return tt_from_linear(_dense_linear(in_features, out_features, bias, init_std), spec, kind)
    return TTLinear(in_features, out_features, in_modes=in_modes, out_modes=out_modes,
                    num_cores=spec.num_cores, max_rank=spec.max_rank, bias=bias)


def make_embedding(spec: TensorizeSpec | None, num_embeddings: int, embedding_dim: int, *,
                   init_std: float = 0.02) -> nn.Module:
    """The word-embedding table: dense ``nn.Embedding`` (normal init) or ``TTEmbedding``."""
    if not is_tensorized(spec, "embedding"):
        return _dense_embedding(num_embeddings, embedding_dim, init_std)
    if spec.init == "svd":
        return tt_from_embedding(_dense_embedding(num_embeddings, embedding_dim, init_std), spec)
    row_modes, col_modes = explicit_modes(spec, "embedding", num_embeddings, embedding_dim)
    return TTEmbedding(num_embeddings, embedding_dim, row_modes=row_modes, col_modes=col_modes,
                       num_cores=spec.embedding_num_cores, max_rank=spec.embedding_max_rank)


def make_output_head(word: nn.Module, *, tie: bool, bias: bool, init_std: float = 0.02) -> nn.Module:
    """The output projection ``(..., C) -> (..., V)`` over the word table ``word`` (V x C).

    ``tie`` with a ``TTEmbedding``: a ``TiedTTHead`` computing ``h E^T`` from the embedding's own cores
    and gates; ``tie`` with an ``nn.Embedding``: an ``nn.Linear`` sharing its weight; otherwise a dense
    ``nn.Linear`` of its own (normal init). A bias, if any, is dense and zero-initialized.
    """
    if not isinstance(word, (TTEmbedding, nn.Embedding)):
        raise TypeError(f"word must be a TTEmbedding or nn.Embedding, got {type(word).__name__}")
    vocab, width = word.num_embeddings, word.embedding_dim
    if tie and isinstance(word, TTEmbedding):
        return TiedTTHead(word, bias=bias)
    if tie:
        head = nn.Linear(width, vocab, bias=bias, dtype=word.weight.dtype, device=word.weight.device)
        head.weight = word.weight  # (V, C) shared
        if bias:
            nn.init.zeros_(head.bias)
        return head
    return _dense_linear(width, vocab, bias, init_std)


def tt_from_linear(linear: nn.Linear, spec: TensorizeSpec, kind: LinearKind, *,
                   max_rank: int | None = None) -> TTLinear:
    """TT-SVD of a dense ``nn.Linear`` (weight ``(out, in)``) to ``max_rank`` (default ``spec.max_rank``)."""
    in_modes, out_modes = explicit_modes(spec, kind, linear.in_features, linear.out_features)
    return TTLinear.from_linear(linear, in_modes=in_modes, out_modes=out_modes, num_cores=spec.num_cores,
                                max_rank=spec.max_rank if max_rank is None else max_rank)


def tt_from_embedding(emb: nn.Embedding, spec: TensorizeSpec, *, max_rank: int | None = None) -> TTEmbedding:
    """TT-SVD (TTM) of a dense ``nn.Embedding`` to ``max_rank`` (default ``spec.embedding_max_rank``)."""
    row_modes, col_modes = explicit_modes(spec, "embedding", emb.num_embeddings, emb.embedding_dim)
    return TTEmbedding.from_embedding(emb, row_modes=row_modes, col_modes=col_modes,
                                      num_cores=spec.embedding_num_cores,
                                      max_rank=spec.embedding_max_rank if max_rank is None else max_rank)


def _dense_linear(in_features: int, out_features: int, bias: bool, init_std: float) -> Linear:
    layer = Linear(in_features, out_features, bias=bias)
    nn.init.normal_(layer.weight, std=init_std)
    if bias:
        nn.init.zeros_(layer.bias)
    return layer


def _dense_embedding(num_embeddings: int, embedding_dim: int, init_std: float) -> nn.Embedding:
    emb = nn.Embedding(num_embeddings, embedding_dim)
    nn.init.normal_(emb.weight, std=init_std)
    return emb


def _prod(values: Sequence[int]) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


__all__ = ["FULL_RANK", "TensorizeSpec", "check_modes_used", "explicit_modes", "is_tensorized",
           "make_embedding", "make_linear", "make_output_head", "tt_from_embedding", "tt_from_linear"]
