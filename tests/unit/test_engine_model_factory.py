"""The run's model honours ``comera.controller.tau``, ``embedding_tau`` and ``comera.enabled``."""

import pytest

from comera_dist.compression.walk import tensorized_modules
from comera_dist.config import load_run_config
from comera_dist.engine.model_factory import build_run_model, set_thresholds
from comera_dist.layers import TTEmbedding

CONFIG = "configs/tiny-cpu.yaml"


@pytest.mark.parametrize("tau", [0.05, 0.3])
def test_controller_tau_reaches_every_gate_threshold(tau):
    cfg = load_run_config(CONFIG, [f"comera.controller.tau={tau}"])
    layers = list(tensorized_modules(build_run_model(cfg)))
    assert layers, "tiny-cpu must tensorize some layers"
    assert all(float(layer.tau) == pytest.approx(tau) for _, layer in layers)
    # a gate just below tau is masked, one just above survives
    layer = layers[0][1]
    layer.gates[0].data[:2] = layer.gates[0].new_tensor([tau * 0.9, tau * 1.1])
    assert layer.masked_gates()[0][0] == 0 and layer.masked_gates()[0][1] > 0


def test_disabled_comera_builds_a_dense_model():
    cfg = load_run_config(CONFIG, ["comera.enabled=false"])
    assert not list(tensorized_modules(build_run_model(cfg)))


def test_embedding_tau_reaches_the_embedding_only_and_set_thresholds_reports_what_moved():
    cfg = load_run_config(CONFIG, ["comera.controller.tau=0.3", "comera.controller.embedding_tau=0.1"])
    model = build_run_model(cfg)
    taus = {name: float(layer.tau) for name, layer in tensorized_modules(model)}
    embeddings = [name for name, layer in tensorized_modules(model) if isinstance(layer, TTEmbedding)]
    assert embeddings == ["embeddings.word"] and taus.pop("embeddings.word") == pytest.approx(0.1)
    assert taus and all(t == pytest.approx(0.3) for t in taus.values())
    assert set_thresholds(model, cfg.comera.controller) == {}  # already there
    moved = set_thresholds(model, load_run_config(CONFIG, ["comera.controller.tau=0.3"]).comera.controller)
    assert moved == {"embeddings.word": (pytest.approx(0.1), pytest.approx(0.3))}  # null: the embedding takes tau
