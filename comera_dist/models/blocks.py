"""Transformer pieces shared by the models: SDPA self-attention, GELU feed-forward, BERT-like embeddings.

Every projection comes from ``factory.make_linear`` (dense or TT per kind) and the
word table from ``factory.make_embedding``; the layout mirrors HuggingFace BERT/GPT-2
so that ``models.export`` maps weights one to one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from comera_dist.kernels.dispatch import host_work_ok
from comera_dist.layers import inside_checkpoint
from comera_dist.layers.group import Factors, project, project_ffn, project_shared_input, shared_factors
from comera_dist.models.config import ModelConfig
from comera_dist.models.cpu_dropout import Dropout, attention
from comera_dist.models.factory import TensorizeSpec, make_embedding, make_linear


class SelfAttention(nn.Module):
    """Multi-head self-attention through ``F.scaled_dot_product_attention`` (``cpu_dropout.attention`` with
    dropout on the CPU); Q, K, V, out are "attention" kind."""

    def __init__(self, cfg: ModelConfig, spec: TensorizeSpec | None, *, causal: bool):
        super().__init__()
        d = cfg.hidden_size
        self.num_heads, self.causal, self.dropout = cfg.num_heads, causal, cfg.dropout
        self.query = make_linear(spec, "attention", d, d, init_std=cfg.init_std)
        self.key = make_linear(spec, "attention", d, d, init_std=cfg.init_std)
        self.value = make_linear(spec, "attention", d, d, init_std=cfg.init_std)
        self.out = make_linear(spec, "attention", d, d, init_std=cfg.init_std)

    def forward(self, x: Tensor, keep: Tensor | None, factors: Factors | None = None) -> Tensor:
        """x: (B, T, C); keep: (B, T) bool, False at padding keys, or None; factors: shared TT
        factors (``layers.group.shared_factors``) or None. Returns (B, T, C)."""
        B, T, C = x.shape
        h = self.num_heads
        # Q, K, V read the same x: with shared TT factors their input side is one GEMM
        q, k, v = (t.view(B, T, h, C // h).transpose(1, 2)  # (B, h, T, C/h) each
                   for t in project_shared_input((self.query, self.key, self.value), x, factors))
        mask = None
        if keep is not None:
            mask = keep[:, None, None, :]  # (B, 1, 1, T) keys a query may see
            if self.causal:
                mask = mask & torch.ones(T, T, dtype=torch.bool, device=x.device).tril()  # (B, 1, T, T)
            # A query always sees itself, so a row of only padding keys gives no NaN (its output is unused).
            mask = mask | torch.eye(T, dtype=torch.bool, device=x.device)  # (B, 1, T, T)
        dropout_p, is_causal = self.dropout if self.training else 0.0, self.causal and mask is None
        y = attention(q, k, v, mask, dropout_p, is_causal)  # (B, h, T, C/h): SDPA, or the CPU's dropout path
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return project(self.out, y, factors)


class FeedForward(nn.Module):
    """``out(gelu(inp(x)))``; ``inp`` is "ffn_in" kind (d -> ffn), ``out`` is "ffn_out" kind (ffn -> d)."""

    def __init__(self, cfg: ModelConfig, spec: TensorizeSpec | None):
        super().__init__()
        self.inp = make_linear(spec, "ffn_in", cfg.hidden_size, cfg.intermediate_size, init_std=cfg.init_std)
        self.out = make_linear(spec, "ffn_out", cfg.intermediate_size, cfg.hidden_size, init_std=cfg.init_std)

    def forward(self, x: Tensor, factors: Factors | None = None) -> Tensor:
        """x: (B, T, C) -> (B, T, C); factors as in ``SelfAttention.forward``."""
        return project_ffn(self.inp, self.out, x, factors)  # (B, T, C); keeps no (B, T, ffn) tensor where TT


class BertEmbeddings(nn.Module):
    """word (dense or TTM) + learned position + token type, then LayerNorm and dropout."""

    def __init__(self, cfg: ModelConfig, spec: TensorizeSpec | None):
        super().__init__()
        self.max_positions = cfg.max_positions
        self.word = make_embedding(spec, cfg.vocab_size, cfg.hidden_size, init_std=cfg.init_std)
        self.position = nn.Embedding(cfg.max_positions, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size) if cfg.type_vocab_size else None
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.drop = Dropout(cfg.dropout)
        nn.init.normal_(self.position.weight, std=cfg.init_std)
        if self.token_type is not None:
            nn.init.normal_(self.token_type.weight, std=cfg.init_std)

    def forward(self, input_ids: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """input_ids: (B, T) int64 -> (B, T, C). Token types default to 0 (one segment)."""
        T = input_ids.shape[1]
        pos = torch.arange(T, device=input_ids.device)  # (T,)
        x = self.word(input_ids) + self.position(pos)  # (B, T, C)
        if self.token_type is not None:
            types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids  # (B, T)
            x = x + self.token_type(types)  # (B, T, C)
        return self.drop(self.norm(x))


class PostLNBlock(nn.Module):
    """BERT encoder block: ``x = LN(x + attn(x)); x = LN(x + ffn(x))`` (post-LayerNorm, GELU)."""

    def __init__(self, cfg: ModelConfig, spec: TensorizeSpec | None):
        super().__init__()
        self.attn = SelfAttention(cfg, spec, causal=False)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.ffn = FeedForward(cfg, spec)
        self.ffn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.drop = Dropout(cfg.dropout)

    def forward(self, x: Tensor, keep: Tensor | None, factors: Factors | None = None) -> Tensor:
        """x: (B, T, C); keep: (B, T) bool or None; factors: shared TT factors or None -> (B, T, C)."""
        x = self.attn_norm(x + self.drop(self.attn(x, keep, factors)))  # (B, T, C)
        return self.ffn_norm(x + self.drop(self.ffn(x, factors)))  # (B, T, C)


RECOMPUTE_CONTEXT = "recompute_context"
"""Attribute a model may hold: a callable returning a context manager that each block's recomputation in
backward runs inside (``engine.packing`` sets it, so a recomputed block reads its parameters as views in
autograd, as its forward did, and saves what the forward saved)."""


def recomputes(model: nn.Module) -> bool:
    """Whether ``run_blocks`` recomputes ``model``'s blocks in this forward: ``model.activation_checkpointing``,
    while training with gradients."""
    return model.config.activation_checkpointing and model.training and torch.is_grad_enabled()


def block_factors_skipped(model: nn.Module) -> tuple[nn.Module, ...]:
    """The blocks whose TT factors the model leaves out of its shared ones in this forward
    (``layers.group.shared_factors_and_penalty``'s ``skip``): all of them when each contracts its own inside its
    recomputation (``model.recompute_factors``), else none."""
    return tuple(model.blocks) if recomputes(model) and model.config.recompute_factors else ()


def run_blocks(model: nn.Module, x: Tensor, keep: Tensor | None, factors: Factors | None) -> Tensor:
    """``x`` (B, T, C) through ``model.blocks`` in turn -> (B, T, C).

    When ``recomputes(model)``, each block runs under ``torch.utils.checkpoint`` (non-reentrant): autograd keeps
    only the block's input, and the block runs again in backward to remake what its own backward reads, with
    the RNG state of its forward (the same dropout masks). With ``model.recompute_factors`` each block also
    contracts its own layers' TT factors inside its checkpoint (``shared_factors(block)``; ``factors`` holds none
    of them), so its ``L``/``R`` are remade with it instead of kept from the forward to the end of backward.
    The gradients are those of the plain forward (with ``recompute_factors`` to rounding: the factors' products are
    summed per block, not per model). Under ``torch.compile`` the partitioner decides the
    recomputation inside the graph, and the model's ``recompute_context`` is not used.
    """
    if not recomputes(model):
        for block in model.blocks:
            x = block(x, keep, factors)  # (B, T, C)
        return x
    own = bool(block_factors_skipped(model))
    for block in model.blocks:
        x = checkpoint(_recomputed, block, x, keep, factors, own, use_reentrant=False, **_recompute_context(model))
    return x


def _recomputed(block: nn.Module, x: Tensor, keep: Tensor | None, factors: Factors | None, own: bool) -> Tensor:
    """A checkpointed block's forward (run again in backward): with ``factors``, or with its own when ``own``.
    The CPU's one-thread contractions (``tensor.smallops``) keep only their inputs here, which the checkpoint
    drops too: a layer's own (under ZeRO-3, a singleton, a forced order) as well as the block's shared ones."""
    with inside_checkpoint():
        return block(x, keep, shared_factors(block) if own else factors)  # (B, T, C)


ContextPair = tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]


def _recompute_context(model: nn.Module) -> dict[str, Callable[[], ContextPair]]:
    """``checkpoint``'s ``context_fn`` entering the model's ``RECOMPUTE_CONTEXT`` around recomputation,
    or nothing (no such context, or traced: Dynamo accepts only selective-checkpoint contexts)."""
    enter = model.__dict__.get(RECOMPUTE_CONTEXT)
    if enter is None or torch.compiler.is_compiling():
        return {}
    return {"context_fn": lambda: (contextlib.nullcontext(), enter())}


def check_inputs(cfg: ModelConfig, input_ids: Tensor, attention_mask: Tensor | None) -> Tensor | None:
    """Validate ``input_ids`` (B, T) against the config; return the (B, T) bool key mask or None."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    if input_ids.shape[1] > cfg.max_positions:
        raise ValueError(f"input_ids has sequence length {input_ids.shape[1]} > model.max_positions "
                         f"{cfg.max_positions}")
    # The id range check syncs with the device, so it runs in CPU eager mode only (on CUDA it would
    # block whole-step graph capture, under torch.compile break the graph); the data side checks
    # tokenizer/model vocabulary agreement up front. One host read; min/max only on failure.
    if host_work_ok(input_ids) and input_ids.numel() and \
            bool(((input_ids < 0) | (input_ids >= cfg.vocab_size)).any()):
        raise ValueError(f"input_ids holds ids in [{int(input_ids.min())}, {int(input_ids.max())}], outside "
                         f"the vocabulary [0, {cfg.vocab_size}) of model.vocab_size")
    if attention_mask is None:
        return None
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                         f"{tuple(input_ids.shape)}")
    return attention_mask.bool()
