"""Builds the run's model from its config: one place that maps ``model`` + ``comera`` onto the layers."""

from __future__ import annotations

import torch
from torch import nn

from comera_dist.compression.config import ControllerConfig
from comera_dist.compression.walk import tensorized_modules
from comera_dist.config import RunConfig
from comera_dist.layers import TTEmbedding
from comera_dist.models import build_model


def build_run_model(cfg: RunConfig) -> nn.Module:
    """The model of ``cfg``: tensorized per ``comera.tensorize`` (dense when ``comera.enabled`` is
    false), with its rank gates' thresholds from ``comera.controller`` (``set_thresholds``)."""
    tensorize = cfg.comera.tensorize if cfg.comera.enabled else None
    model = build_model(cfg.model, tensorize)
    set_thresholds(model, cfg.comera.controller)
    return model


def set_thresholds(model: nn.Module, controller: ControllerConfig) -> dict[str, tuple[float, float]]:
    """Set every TT layer's gate threshold (its ``tau`` buffer) to ``controller.tau``, a TT embedding's to
    ``controller.embedding_tau`` when that is set. Returns ``{layer: (old, new)}`` for the layers it changed
    (a resume reports what its config changed against the checkpoint's buffers)."""
    embedding_tau = controller.tau if controller.embedding_tau is None else controller.embedding_tau
    changed = {}
    with torch.no_grad():
        for name, layer in tensorized_modules(model):
            old = float(layer.tau)
            layer.tau.fill_(embedding_tau if isinstance(layer, TTEmbedding) else controller.tau)
            if float(layer.tau) != old:  # as the fp32 buffer holds them
                changed[name] = (old, float(layer.tau))
    return changed
