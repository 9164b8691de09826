"""The ``comera:`` config section: tensorization, rank controller, pruning, learning rates.

Each dataclass validates its own values in ``__post_init__`` and raises
``ValueError`` naming the field and the bad value; ``configbase.from_dict``
builds them from YAML (unknown keys and wrong types are errors there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

_MODE_KINDS = ("attention", "ffn_in", "ffn_out", "embedding")


@dataclass(kw_only=True, slots=True)
class TensorizeConfig:
    """Which layers become TT/TTM layers, and their shapes."""

    embedding: bool = True
    """Store the word-embedding table as a TTM layer (``TTEmbedding``)."""
    attention: bool = True
    """Store the attention projections (Q, K, V, out) as TT linear layers."""
    ffn: bool = True
    """Store the two feed-forward projections as TT linear layers."""
    num_cores: int = 6
    """TT cores per linear layer: half input-side, half output-side (even, >= 2)."""
    embedding_num_cores: int = 4
    """TTM cores for an embedding table (>= 2)."""
    max_rank: int = 30
    """Upper bound of every interior TT rank of the linear layers (>= 1)."""
    embedding_max_rank: int = 32
    """Upper bound of every interior TTM rank of the embedding (>= 1)."""
    modes: dict[str, list[list[int]]] = field(default_factory=dict)
    """Explicit factorizations overriding the automatic ones, per layer kind:
    ``"attention"``, ``"ffn_in"``, ``"ffn_out"`` -> ``[in_modes, out_modes]``;
    ``"embedding"`` -> ``[row_modes, col_modes]``. Products are checked against the
    layer dimensions when the layers are built."""
    init: Literal["random", "svd"] = "random"
    """``random``: Gaussian cores (method doc section 1); ``svd``: TT-SVD of existing
    dense weights (HuggingFace conversion)."""

    def __post_init__(self) -> None:
        if self.num_cores < 2 or self.num_cores % 2:
            raise ValueError(f"tensorize.num_cores must be even and >= 2, got {self.num_cores}")
        if self.embedding_num_cores < 2:
            raise ValueError(f"tensorize.embedding_num_cores must be >= 2, got {self.embedding_num_cores}")
        if self.max_rank < 1:
            raise ValueError(f"tensorize.max_rank must be >= 1, got {self.max_rank}")
        if self.embedding_max_rank < 1:
            raise ValueError(f"tensorize.embedding_max_rank must be >= 1, got {self.embedding_max_rank}")
        if self.init not in ("random", "svd"):
            raise ValueError(f"tensorize.init must be 'random' or 'svd', got {self.init!r}")
        for kind, pair in self.modes.items():
            where = f"tensorize.modes[{kind!r}]"
            if kind not in _MODE_KINDS:
                raise ValueError(f"tensorize.modes key must be one of {list(_MODE_KINDS)}, got {kind!r}")
            if len(pair) != 2:
                raise ValueError(f"{where} must be [in_modes, out_modes] (two lists), got {pair!r}")
            if any(len(m) == 0 or any(int(v) < 1 for v in m) for m in pair):
                raise ValueError(f"{where} modes must be non-empty lists of positive integers, got {pair!r}")
            if kind != "embedding" and len(pair[0]) != len(pair[1]):
                raise ValueError(f"{where} needs as many input as output modes, got {pair!r}")
            if kind == "embedding" and len(pair[0]) != len(pair[1]):
                raise ValueError(f"{where} needs as many row as column modes, got {pair!r}")


@dataclass(kw_only=True, slots=True)
class ControllerConfig:
    """The two-stage multi-objective rank controller (method doc section 3)."""

    gamma: float = 0.01
    """Early-stage weight of the rank penalty: ``loss = L + gamma * R``."""
    tau: float = 1e-2
    """Gate threshold: a rank survives while its gate exceeds ``tau``, in (0, 1): every gate starts at 1."""
    embedding_tau: float | None = None
    """The TT embedding's gate threshold, in (0, 1) (``None``: ``tau``). A bond of the embedding with no rank
    alive maps every token to zero, and the run stops (exit 4); a dead projection only drops its sublayer. So
    the embedding may need a lower threshold than the projections: an aggressive ``tau`` (a short run that must
    prune) kills its bonds first, since all of a bond's gates can fall together."""
    late_stage_step: int | None = None
    """Optimizer step at which the late stage begins (``None``: not by step)."""
    late_stage_loss: float | None = None
    """Switch to the late stage once the global task loss is <= this (``None``: not by loss). The trainer
    compares each step's loss after the step, so the late stage begins at the step after the crossing."""
    target_ratio: float = 0.5
    """Late-stage size target ``S* = target_ratio * S(at the switch)``, in (0, 1]."""
    target_loss: float = 0.0
    """Late-stage task-loss target ``L*`` (>= 0)."""
    late_task_weight: float = 0.1
    """The always-on task-loss weight of the late objective (the ``0.1 * L`` term)."""
    late_rank_weight: float = 0.01
    """The always-on penalty weight of the late objective (the ``0.01 * R`` term)."""

    def __post_init__(self) -> None:
        if self.gamma < 0:
            raise ValueError(f"controller.gamma must be >= 0, got {self.gamma}")
        if not 0 < self.tau < 1:
            raise ValueError(f"controller.tau must be in (0, 1), got {self.tau}: every gate starts at 1, so "
                             "a threshold of 1 or more kills every rank before the first step")
        if self.embedding_tau is not None and not 0 < self.embedding_tau < 1:
            raise ValueError(f"controller.embedding_tau must be in (0, 1) or null, got {self.embedding_tau}")
        if self.late_stage_step is not None and self.late_stage_step < 0:
            raise ValueError(f"controller.late_stage_step must be >= 0 or null, got {self.late_stage_step}")
        if self.late_stage_loss is not None and not self.late_stage_loss > 0:
            raise ValueError(f"controller.late_stage_loss must be > 0 or null, got {self.late_stage_loss}")
        if not 0 < self.target_ratio <= 1:
            raise ValueError(f"controller.target_ratio must be in (0, 1], got {self.target_ratio}")
        if self.target_loss < 0:
            raise ValueError(f"controller.target_loss must be >= 0, got {self.target_loss}")
        if self.late_task_weight < 0:
            raise ValueError(f"controller.late_task_weight must be >= 0, got {self.late_task_weight}")
        if self.late_rank_weight < 0:
            raise ValueError(f"controller.late_rank_weight must be >= 0, got {self.late_rank_weight}")


@dataclass(kw_only=True, slots=True)
class PruningConfig:
    """When dead ranks are physically sliced out of the cores."""

    every: int = 0
    """Optimizer steps between physical prunes; 0 disables pruning (>= 0)."""
    start_step: int = 0
    """No physical prune happens before this optimizer step (>= 0)."""
    min_rank: int = 1
    """A bond never shrinks below this many ranks (the largest gates are kept) (>= 1)."""

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ValueError(f"pruning.every must be >= 0, got {self.every}")
        if self.start_step < 0:
            raise ValueError(f"pruning.start_step must be >= 0, got {self.start_step}")
        if self.min_rank < 1:
            raise ValueError(f"pruning.min_rank must be >= 1, got {self.min_rank}")


@dataclass(kw_only=True, slots=True)
class LrConfig:
    """AdamW learning rates per parameter role (the reference's defaults)."""

    cores: float = 1e-4
    """Learning rate of TT/TTM cores."""
    gates: float = 1e-3
    """Learning rate of the rank gates."""
    dense: float = 5e-5
    """Learning rate of everything else (norms, biases, position embeddings, heads)."""
    weight_decay: float = 0.0
    """AdamW weight decay of cores and dense parameters (gates never decay) (>= 0)."""

    def __post_init__(self) -> None:
        for name in ("cores", "gates", "dense"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"lr.{name} must be > 0, got {value}")
        if self.weight_decay < 0:
            raise ValueError(f"lr.weight_decay must be >= 0, got {self.weight_decay}")


@dataclass(kw_only=True, slots=True)
class ComeraConfig:
    """The whole ``comera:`` run-config section."""

    enabled: bool = True
    """Train tensorized (True) or the plain dense model (False, the baseline)."""
    tensorize: TensorizeConfig = field(default_factory=TensorizeConfig)
    """Which layers are tensorized and how."""
    controller: ControllerConfig = field(default_factory=ControllerConfig)
    """The early/late rank controller."""
    pruning: PruningConfig = field(default_factory=PruningConfig)
    """Physical rank pruning schedule."""
    lr: LrConfig = field(default_factory=LrConfig)
    """Learning rates per parameter role."""
