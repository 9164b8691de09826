"""Export round trips: dense ``save_pretrained`` -> ``from_pretrained`` and compact ``save_tt`` -> ``load_tt``.

Every round trip compares logits of the reloaded model with the model that was saved
(float64, so densifying a TT layer costs ~1e-15 and a wrong key map costs O(1)).
"""

import dataclasses
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    AutoModelForSequenceClassification,
    BertConfig,
    BertForMaskedLM,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from comera_dist.compression.config import TensorizeConfig
from comera_dist.layers import TTEmbedding, TTLinear
from comera_dist.models import ModelConfig, build_model, tensorized_modules
from comera_dist.models.export import export_dense, to_hf
from comera_dist.models.factory import FULL_RANK
from comera_dist.models.hf import tensorize
from comera_dist.models.tt_io import load_tt, save_tt

V = 60
IDS = torch.randint(1, V, (2, 10), generator=torch.Generator().manual_seed(3))
MASK = torch.ones_like(IDS).index_fill_(1, torch.arange(8, 10), 0)  # right padding in the last two
SPEC = TensorizeConfig(num_cores=4, max_rank=3, embedding_num_cores=2, embedding_max_rank=5)
AUTO = {"bert_mlm": AutoModelForMaskedLM, "six_encoder_cls": AutoModelForSequenceClassification,
        "gpt": AutoModelForCausalLM}


def ours(arch: str, spec=SPEC, **kw):
    torch.manual_seed(0)
    cfg = ModelConfig(arch=arch, vocab_size=V, hidden_size=16, num_layers=2, num_heads=2, intermediate_size=32,
                      max_positions=16, num_labels=3, init_std=0.2, **kw)
    return build_model(cfg, spec).double().eval()


def hf_model(name: str):
    torch.manual_seed(0)
    if name == "bert":
        m = BertForMaskedLM(BertConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=32, max_position_embeddings=16, initializer_range=0.2))
    elif name == "gpt2":
        m = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2, n_positions=16,
                                       bos_token_id=0, eos_token_id=0, initializer_range=0.2))
    else:
        m = LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, intermediate_size=32, max_position_embeddings=16,
                                         initializer_range=0.2))
    return m.double().eval()


def logits(model, ids=IDS, mask=None):
    with torch.no_grad():
        out = model(ids, attention_mask=mask)
    return out["logits"] if isinstance(out, dict) else out.logits


@pytest.mark.parametrize("arch", ["bert_mlm", "six_encoder_cls", "gpt"])
@pytest.mark.parametrize("tt", [False, True], ids=["dense", "tt"])
def test_our_models_export_to_standard_hf_models(arch, tt, tmp_path):
    model = ours(arch, SPEC if tt else None, type_vocab_size=0 if arch == "bert_mlm" else 2)
    ref = logits(model, mask=MASK)
    export_dense(model, tmp_path)
    loaded = AUTO[arch].from_pretrained(tmp_path, torch_dtype=torch.float64).eval()
    assert type(loaded).__name__ == {"bert_mlm": "BertForMaskedLM", "six_encoder_cls": "BertForSequenceClassification",
                                     "gpt": "GPT2LMHeadModel"}[arch]
    got = logits(loaded, mask=MASK)
    if arch == "six_encoder_cls":
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
    else:  # padded query positions are not compared: their attention rows are defined differently
        torch.testing.assert_close(got[:, :8], ref[:, :8], rtol=0, atol=1e-10)
    assert loaded.config.tie_word_embeddings == (arch != "six_encoder_cls")  # a TT table ties too (TiedTTHead)


@pytest.mark.parametrize("name", ["bert", "gpt2", "llama"])
def test_tensorized_hf_model_exports_dense_and_reloads(name, tmp_path):
    tt = tensorize(hf_model(name), SPEC)  # truncated: the export must carry the TT weights, not the originals
    ref = logits(tt)
    export_dense(tt, tmp_path)
    auto = AutoModelForMaskedLM if name == "bert" else AutoModelForCausalLM
    loaded = auto.from_pretrained(tmp_path, torch_dtype=torch.float64).eval()
    assert not any(isinstance(m, (TTLinear, TTEmbedding)) for m in loaded.modules())
    torch.testing.assert_close(logits(loaded), ref, rtol=0, atol=1e-10)
    assert isinstance(tt.get_input_embeddings(), TTEmbedding)  # export left the TT model alone


def _prune_some(model):
    """Physically drop ranks from a few layers so the saved shapes differ from a fresh build."""
    for layer in list(tensorized_modules(model).values())[:3]:
        kept = {0: torch.arange(layer.bond_dims()[0] - 1)} if layer.bond_dims()[0] > 1 else {}
        layer.prune_(kept)
    with torch.no_grad():  # and switch one gate off (below tau) so masks round-trip too
        next(iter(tensorized_modules(model).values())).gates[-1][0] = 0.0


@pytest.mark.parametrize("arch", ["bert_mlm", "six_encoder_cls", "gpt"])
def test_save_tt_load_tt_round_trip_with_pruned_ranks(arch, tmp_path):
    model = ours(arch)
    _prune_some(model)
    shapes = {n: m.tensor_shapes() for n, m in tensorized_modules(model).items()}
    save_tt(model, tmp_path)
    meta = json.loads((tmp_path / "tt_config.json").read_text())
    assert meta["format"] == "comera-tt" and meta["model_config"]["arch"] == arch
    loaded = load_tt(tmp_path)
    assert {n: m.tensor_shapes() for n, m in tensorized_modules(loaded).items()} == shapes
    assert next(loaded.parameters()).dtype == torch.float64
    torch.testing.assert_close(logits(loaded), logits(model), rtol=0, atol=0)
    # Compact means compact: the file holds the cores and gates, never a dense weight of a TT layer.
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    for name in shapes:
        assert f"{name}.core" in keys and f"{name}.gate" in keys and f"{name}.weight" not in keys


def test_load_tt_reads_a_version_1_file_with_one_tensor_per_core_and_bond(tmp_path):
    """A file written before the flat layout (``<layer>.cores.<k>``, ``<layer>.gates.<k>``, version 1)
    loads into the same model; a core of the wrong shape is an error naming the key."""
    model = ours("gpt")
    _prune_some(model)
    save_tt(model, tmp_path)
    layers = tensorized_modules(model)
    old = {}
    for key, value in load_file(tmp_path / "model.safetensors").items():
        name, _, leaf = key.rpartition(".")
        if name in layers and leaf in ("core", "gate"):
            pieces = layers[name].split_cores(value) if leaf == "core" else value.split(layers[name].bond_dims())
            old.update({f"{name}.{leaf}s.{k}": p.contiguous() for k, p in enumerate(pieces)})
        else:
            old[key] = value
    save_file(old, tmp_path / "model.safetensors")
    meta = json.loads((tmp_path / "tt_config.json").read_text())
    (tmp_path / "tt_config.json").write_text(json.dumps({**meta, "version": 1}))
    torch.testing.assert_close(logits(load_tt(tmp_path)), logits(model), rtol=0, atol=0)
    first = next(iter(layers))
    old[f"{first}.cores.1"] = old[f"{first}.cores.1"][:1].contiguous()
    save_file(old, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=rf"state_dict\['{first}.cores.1'\] has shape"):
        load_tt(tmp_path)


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_save_tt_load_tt_round_trip_for_hf_models(name, tmp_path):
    tt = tensorize(hf_model(name), SPEC)
    _prune_some(tt)
    save_tt(tt, tmp_path)
    loaded = load_tt(tmp_path)
    assert type(loaded) is type(tt)
    torch.testing.assert_close(logits(loaded), logits(tt), rtol=0, atol=0)


def test_to_hf_of_a_full_rank_tt_model_equals_the_dense_twin():
    spec = dataclasses.replace(SPEC, max_rank=FULL_RANK, embedding_max_rank=FULL_RANK, init="svd")
    dense = ours("bert_mlm", None)
    with torch.no_grad():  # HF's BERT declares id 0 the padding row; a TTM table (and its tied head) keeps it zero
        dense.embeddings.word.weight[0] = 0.0
    tt = tensorize(to_hf(dense), spec)  # our dense model -> HF -> TT at full rank
    torch.testing.assert_close(logits(tt), logits(dense), rtol=0, atol=1e-10)


def test_bad_directories_are_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="tt_config.json not found"):
        load_tt(tmp_path)
    save_tt(ours("gpt"), tmp_path)
    (tmp_path / "tt_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="tt_config.json is not valid JSON"):
        load_tt(tmp_path)
    (tmp_path / "tt_config.json").write_text(json.dumps({"format": "other", "version": 1}))
    with pytest.raises(ValueError, match="format 'other'"):
        load_tt(tmp_path)
    with pytest.raises(TypeError, match="to_hf supports"):
        to_hf(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="save_tt supports"):
        save_tt(torch.nn.Linear(2, 2), tmp_path / "x")


def test_a_failed_save_leaves_the_previous_directory_intact(tmp_path, monkeypatch):
    out = tmp_path / "tt"
    model = ours("gpt")
    save_tt(model, out)
    before = (out / "model.safetensors").read_bytes()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("comera_dist.models.tt_io.save_model", broken)
    with pytest.raises(OSError, match="disk full"):
        save_tt(ours("gpt", tie_word_embeddings=False), out)
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tt"]  # no temporary sibling left behind
    torch.testing.assert_close(logits(load_tt(out)), logits(model), rtol=0, atol=0)


def test_an_exported_gpt_names_the_run_tokenizers_special_ids(tmp_path):
    """GPT-2's config defaults (bos = eos = 50256) lie outside a run's vocabulary: the export takes the run
    tokenizer's ids, or names none."""
    from transformers import GenerationConfig

    ids = {"bos_token_id": 2, "eos_token_id": 3, "pad_token_id": 0}
    export_dense(ours("gpt"), tmp_path / "run", token_ids=ids)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert {k: config[k] for k in ids} == ids
    generation = GenerationConfig.from_pretrained(tmp_path / "run")
    assert (generation.bos_token_id, generation.eos_token_id, generation.pad_token_id) == (2, 3, 0)
    bare = to_hf(ours("gpt")).config
    assert (bare.bos_token_id, bare.eos_token_id) == (None, None)


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_every_exported_file_has_the_umasks_mode(mask, tmp_path):
    """safetensors writes its file 0o600 whatever the umask: a dense or TT export's weights were unreadable to
    the team that could read its config."""
    import os

    old = os.umask(mask)
    try:
        export_dense(ours("gpt", SPEC), tmp_path / "dense")
        save_tt(ours("gpt", SPEC), tmp_path / "tt")
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): oct(p.stat().st_mode & 0o777) for p in tmp_path.rglob("*")
             if p.is_file()}
    assert "dense/model.safetensors" in modes and set(modes.values()) == {oct(0o666 & ~mask)}, modes
