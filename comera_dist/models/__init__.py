"""comera_dist.models: BERT-like MLM encoder, the paper's six-encoder classifier, GPT-like decoder; HF in and out.

Import the HF side (``models.hf``, ``models.export``, ``models.tt_io``) explicitly: it pulls in
``transformers``, which the training path does not need.
"""

from comera_dist.models.build import build_model, count_params, tensorized_modules
from comera_dist.models.config import ModelConfig

__all__ = ["ModelConfig", "build_model", "count_params", "tensorized_modules"]
