"""The data pipeline: corpus on ``datasets``, local tokenizer, packed blocks, collators, resumable loader.

Importing it turns off ``datasets``' download-count ping (a HEAD request to S3 at every ``load_dataset``, local
files included), unless ``HF_UPDATE_DOWNLOAD_COUNTS`` asks for it: a run reads local files without the network,
and on an air-gapped node each ping waited for DNS or its 3 s timeout.
"""

import os

import datasets

if "HF_UPDATE_DOWNLOAD_COUNTS" not in os.environ:
    datasets.config.HF_UPDATE_DOWNLOAD_COUNTS = False

from comera_dist.data.collators import IGNORE_INDEX, causal_collator, collator_for, mlm_collator
from comera_dist.data.config import DataConfig, TokenizerConfig
from comera_dist.data.corpus import build_corpus
from comera_dist.data.errors import CacheError, DataError
from comera_dist.data.loader import PackedLoader, eval_batches
from comera_dist.data.noise import batch_seed
from comera_dist.data.prepare import PreparedData, check_compat, evaluation_corpus, prepare_data
from comera_dist.data.tokenizer import SPECIAL_TOKENS, load_tokenizer, train_tokenizer

__all__ = [
    "IGNORE_INDEX", "SPECIAL_TOKENS", "CacheError", "DataConfig", "DataError", "PackedLoader", "PreparedData",
    "TokenizerConfig", "batch_seed", "build_corpus", "causal_collator", "check_compat", "collator_for",
    "eval_batches", "evaluation_corpus", "load_tokenizer", "mlm_collator", "prepare_data", "train_tokenizer",
]
