"""``comera pretrain`` trains ``bert_mlm`` on ``mlm`` data or ``gpt`` on ``causal`` data: a classifier, or an
arch given the other objective, is one line and exit 2 before any rank starts (they crashed at the first step
with a traceback, or trained an encoder to copy its unmasked input)."""

from __future__ import annotations

import pytest

from comera_dist import cli
from comera_dist.config import check_pretrainable, load_run_config


@pytest.mark.parametrize(("config", "sets", "needle"), [
    ("configs/six-encoder.yaml", [], "model.arch=six_encoder_cls is not pretrained by comera pretrain"),
    ("configs/tiny-cpu.yaml", ["data.objective=causal"], "data.objective=causal does not train model.arch=bert_mlm"),
    ("configs/tiny-cpu.yaml", ["model.arch=gpt"], "data.objective=mlm does not train model.arch=gpt"),
])
def test_a_run_that_cannot_pretrain_is_one_line_exit_2(config, sets, needle, capsys):
    args = ["pretrain", "--config", config, *[a for s in sets for a in ("--set", s)]]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err, err


@pytest.mark.parametrize("config", ["configs/tiny-cpu.yaml", "configs/gpt-small.yaml", "configs/six-encoder-mlm.yaml",
                                    "configs/codebert.yaml", "configs/codebert-tiny-cpu.yaml"])
def test_the_pretraining_configs_pass(config):
    check_pretrainable(load_run_config(config))
