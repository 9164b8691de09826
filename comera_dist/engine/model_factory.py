"""Builds the run's model from its config: one place that maps ``model`` + ``comera`` onto the layers."""

from __future__ import annotations

import torch
from torch import nn

from comera_dist.compression.walk import tensorized_modules
from comera_dist.config import RunConfig
from comera_dist.models import build_model


def build_run_model(cfg: RunConfig) -> nn.Module:
    """The model of ``cfg``: tensorized per ``comera.tensorize`` (dense when ``comera.enabled`` is
    false), with every rank gate's threshold set to ``comera.controller.tau``."""
    tensorize = cfg.comera.tensorize if cfg.comera.enabled else None
    model = build_model(cfg.model, tensorize)
    with torch.no_grad():
        for _, layer in tensorized_modules(model):
            layer.tau.fill_(cfg.comera.controller.tau)
    return model
