"""The decoder every family builds, readable in one sitting: llama's module as it is, the base of the others.

Token embedding -> N x (RMSNorm -> grouped-query attention with RoPE -> residual,
RMSNorm -> SwiGLU MLP -> residual) -> RMSNorm -> output projection. No biases.
Other families subclass the pieces: `Attention.project` (q, k, v before RoPE), `TransformerBlock.attention_class`,
`Decoder.block_class`; their shapes are in each family's spec.py.

Built on the meta device (no memory), parallelized, then materialized with
`model.to_empty(device=...)` and `model.init_weights()`: `to_empty` leaves
garbage in every tensor, so `init_weights` also recomputes the RoPE table.
Blocks live in a ModuleDict keyed by their index as a string, so a pipeline
split can delete layers and keep the remaining names (and checkpoints) stable.
"""

from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn

from trainctl.config.schema import ModelConfig
from trainctl.models.common.attention import document_positions_mask
from trainctl.models.common.init import INIT_STD, fill, rng_for, trunc_normal
from trainctl.models.common.layers import RMSNorm, TransformerBlock
from trainctl.models.common.rope import rope_frequencies
from trainctl.models.common.shape import head_dim
from trainctl.models.loss_head import OutputHead, dense_loss_sum


def building_on_meta() -> bool:
    """Whether modules are being built on the meta device (shapes only; init_weights fills them after `to_empty`).
    There the build draws nothing: an operator on meta tensors that runs through torch._refs (normal_, arange)
    imports torch._dynamo, about 0.8 s of one core at every eval, generate or export, which never build an
    optimizer."""
    return torch.get_default_device().type == "meta"


def embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding; on the meta device without its own N(0, 1) draw (building_on_meta)."""
    if building_on_meta():
        return nn.Embedding(num, dim, _weight=torch.empty(num, dim))
    return nn.Embedding(num, dim)


class Decoder(nn.Module):
    block_class: type[TransformerBlock] = TransformerBlock

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): self.block_class(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = OutputHead(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: derived from the config, so checkpoints need not carry it.
        self.register_buffer("freqs", self._rope_table(device=None), persistent=False)

    def _rope_table(self, device) -> torch.Tensor:
        c = self.cfg
        if device is None and building_on_meta():  # shapes only; init_weights computes it
            return torch.empty(c.max_seq_len, head_dim(c) // 2, 2)
        return rope_frequencies(head_dim(c), c.max_seq_len, c.rope_theta, device=device, scaling=c)

    @torch.no_grad()
    def init_weights(self) -> None:
        """Deterministic init given the torch seed; call after `to_empty`.

        Each top-level piece (embedding, every block by its key, norm, output) draws from its
        own stream seeded by the torch seed and its name: a pipeline stage holding only some
        pieces inits them exactly as the full model would.
        """
        seed, device = torch.initial_seed(), self.freqs.device
        self.freqs.copy_(self._rope_table(device=device))
        if self.cfg.tie_embeddings and self.output is not None and self.tok_embeddings is not None:
            # to_empty gives each module's meta parameters their own new storage, which unties them
            # (FSDP2 keeps shared parameters shared itself; then this is a no-op).
            self.output.weight = self.tok_embeddings.weight
        if self.tok_embeddings is not None:
            with rng_for("tok_embeddings", seed, device):
                # Untied: unit-variance embeddings (the first RMSNorm rescales them anyway).
                std = INIT_STD if self.cfg.tie_embeddings else 1.0
                fill(self.tok_embeddings.weight, partial(nn.init.normal_, std=std))
        # Residual-branch outputs shrink with depth so the residual stream's variance stays O(1).
        out_std = INIT_STD / math.sqrt(2 * self.cfg.n_layers)
        for key, wrapped in self.layers.items():
            # Blocks may be wrapped (checkpointing, compile): init the TransformerBlock inside.
            block = next(m for m in wrapped.modules() if isinstance(m, TransformerBlock))
            with rng_for(f"layers.{key}", seed, device):
                block.init_weights(out_std)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not self.cfg.tie_embeddings:
            with rng_for("output", seed, device):
                trunc_normal(self.output.weight, 1 / math.sqrt(self.cfg.dim))

    def forward(self, tokens: torch.Tensor, freqs: torch.Tensor | None = None,
                targets: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [batch, seq, vocab] for tokens [batch, seq]; position t sees only tokens <= t.

        freqs: the RoPE rows of the tokens' positions (context parallelism passes its shard);
        default: positions 0..seq-1. targets [batch, seq]: return the summed next-token cross-entropy
        instead (fp32 scalar), chunked over tokens where the output head allows (models/loss_head.py).
        positions [batch, seq] (data.document_mask): each token's position in its packed document; RoPE
        restarts and attention stays inside each document (block-causal). None: one causal sequence per row.
        """
        # A pipeline stage may lack the embedding (it receives hidden states) or the head (it returns them).
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        freqs = self.freqs if freqs is None else freqs
        mask = None
        if positions is not None:
            freqs, mask = freqs[positions], document_positions_mask(positions)  # the mask: once for every block
        for block in self.layers.values():
            h = block(h, freqs) if mask is None else block(h, freqs, mask=mask)
        h = self.norm(h) if self.norm is not None else h
        if self.output is None:
            return h
        if targets is None:
            return self.output(h)
        if isinstance(self.output, OutputHead) and self.output.chunked:
            return self.output(h, targets)
        return dense_loss_sum(self.output(h), targets)


def count_params(model: nn.Module) -> int:
    """Unique parameters (a tied weight counted once)."""
    return sum(p.numel() for p in model.parameters())
