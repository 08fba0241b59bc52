"""A Llama-style decoder, readable in one sitting: the llama family's module, and the base of the others.

Token embedding -> N x (RMSNorm -> grouped-query attention with RoPE -> residual,
RMSNorm -> SwiGLU MLP -> residual) -> RMSNorm -> output projection. No biases.
Other families subclass the pieces: `Attention.project` (q, k, v before RoPE), `TransformerBlock.attention_class`,
`Llama.block_class`; their shapes are in each family's spec.py.

Built on the meta device (no memory), parallelized, then materialized with
`model.to_empty(device=...)` and `model.init_weights()`: `to_empty` leaves
garbage in every tensor, so `init_weights` also recomputes the RoPE table.
Blocks live in a ModuleDict keyed by their index as a string, so a pipeline
split can delete layers and keep the remaining names (and checkpoints) stable.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Callable, Iterator
from functools import partial

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn import functional
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainctl.config.schema import ModelConfig
from trainctl.models.llama.spec import SPEC
from trainctl.models.loss_head import OutputHead, dense_loss_sum

INIT_STD = 0.02
# SDPA's kernels in the order the worker prefers them on CUDA: cuDNN and flash (bf16/fp16 only), then the
# memory-efficient kernel (fp32 too), then the math fallback, which materializes batch x heads x seq x seq.
ATTENTION_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                      SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_backends(first: str = "cudnn") -> contextlib.AbstractContextManager:
    """Entered once around the worker's training: SDPA tries ATTENTION_BACKENDS in that order; `first`="flash"
    (train.attention) leaves cuDNN out, the one-key fallback when a cuDNN kernel misbehaves.

    Once, not per call: the setting is global, and a per-block context would be traced into every
    compiled block.
    """
    order = [b for b in ATTENTION_BACKENDS if first == "cudnn" or b != SDPBackend.CUDNN_ATTENTION]
    return sdpa_kernel(order, set_priority=True)


def expands_kv(q: torch.Tensor) -> bool:
    """Whether grouped-query attention copies the kv heads up instead of passing enable_gqa.

    enable_gqa runs only in the flash and math kernels, and flash (like cuDNN) needs bf16/fp16:
    fp32 on CUDA with enable_gqa would fall back to math. Copied kv heads let the memory-efficient
    kernel run it; bf16/fp16 keep enable_gqa (no copies), and so does the CPU.
    """
    return q.is_cuda and q.dtype == torch.float32


def _fill(param: torch.Tensor, init_fn: Callable[[torch.Tensor], object]) -> None:
    """Initialize `param` in place with values that do not depend on how it is sharded.

    A sharded (DTensor) parameter gets its local slice of a full-size tensor drawn from
    the (identically seeded) RNG on every rank, so FSDP/TP runs start from exactly the
    weights a single process would draw; drawing per shard would repeat one shard's
    values on every rank on CPU, and differ from the unsharded init on CUDA.
    """
    if not isinstance(param, DTensor):
        init_fn(param)
        return
    full = torch.empty(param.shape, dtype=param.dtype, device=param.to_local().device)
    init_fn(full)
    # src_data_rank=None: every rank holds the same full tensor, so slice locally, no communication.
    local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
    param.to_local().copy_(local)


def _normal(param: torch.Tensor, std: float) -> None:
    _fill(param, partial(nn.init.trunc_normal_, std=std, a=-3 * std, b=3 * std))


@contextlib.contextmanager
def _rng_for(name: str, seed: int, device: torch.device) -> Iterator[None]:
    """Draw from a stream seeded by (`seed`, `name`), leaving the global RNG state as it was."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % 2**63)
        yield


def scaled_frequencies(inv_freq: torch.Tensor, cfg: ModelConfig | None) -> torch.Tensor:
    """RoPE scaling of the inverse frequencies as transformers computes it (fp32): `linear` divides them all by
    the factor; `llama3` divides the low frequencies (wavelength past original/low_freq_factor), keeps the high
    ones (below original/high_freq_factor) and blends in between."""
    if cfg is None or cfg.rope_scaling == "none":
        return inv_freq
    if cfg.rope_scaling == "linear":
        return inv_freq / cfg.rope_factor
    assert cfg.rope_scaling == "llama3", cfg.rope_scaling  # validate refuses the rest
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    original = cfg.rope_original_max_seq_len
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, smoothed, scaled)


def rope_frequencies(head_dim: int, max_seq_len: int, theta: float, device=None,
                     scaling: ModelConfig | None = None) -> torch.Tensor:
    """cos and sin of the rotary angles, shape [max_seq_len, head_dim // 2, 2] in fp32 (`scaling`: the config
    whose rope_scaling keys apply)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim))
    inv_freq = scaled_frequencies(inv_freq, scaling)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[2i], x[2i+1]) of x [batch, seq, heads, head_dim] by the position's angles.

    freqs: the table's rows 0.. [>= seq, head_dim/2, 2], or one row per token [batch, seq, head_dim/2, 2]
    (document masking: positions restart at each document).
    """
    if freqs.dim() == 4:
        cos, sin = freqs[:, :, None, :, 0], freqs[:, :, None, :, 1]  # [batch, seq, 1, head_dim/2]
    else:
        seq_len = x.shape[1]
        cos, sin = freqs[:seq_len, None, :, 0], freqs[:seq_len, None, :, 1]  # [seq, 1, head_dim/2]
    pairs = x.float().unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return rotated.flatten(-2).type_as(x)


def document_positions_mask(positions: torch.Tensor) -> torch.Tensor:
    """Block-causal attention mask [batch, 1, seq, seq] (True: may attend) of packed documents.

    positions [batch, seq]: each token's position in its document, 0 where a document starts; a token sees
    only the tokens of its own document up to itself, as if each document were a row of its own.
    """
    documents = torch.cumsum(positions == 0, dim=1)  # a document's number within its row
    same = documents[:, :, None] == documents[:, None, :]
    seq_len = positions.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=positions.device).tril()
    return (same & causal)[:, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))

    def reset_parameters(self) -> None:
        _fill(self.weight, nn.init.ones_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 for stability under bf16 autocast, then cast back.
        return functional.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).type_as(x)


class Attention(nn.Module):
    """Grouped-query attention: n_kv_heads key/value heads shared by n_heads query heads."""

    def __init__(self, cfg: ModelConfig, qkv_bias: bool = False):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = SPEC.head_dim(cfg)
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=qkv_bias)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)
        self.repeat_kv = False  # context parallelism: copy kv heads up front (see train/context_parallel.py)

    def init_weights(self, out_std: float) -> None:
        for linear in (self.wq, self.wk, self.wv):
            _normal(linear.weight, INIT_STD)
            if linear.bias is not None:
                _fill(linear.bias, nn.init.zeros_)
        _normal(self.wo.weight, out_std)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [batch, seq, heads, head_dim] before RoPE (a tp rank sees its own heads only)."""
        batch, seq_len, _ = x.shape
        return tuple(linear(x).view(batch, seq_len, -1, self.head_dim) for linear in (self.wq, self.wk, self.wv))

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """mask: a boolean [batch, 1, seq, seq] (document_positions_mask) instead of plain causal attention."""
        batch, seq_len, _ = x.shape
        q, k, v = self.project(x)
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, seq, head_dim]
        grouped = self.n_kv_heads != self.n_heads
        # An explicit mask rules out flash and cuDNN on CUDA; copied kv heads let the memory-efficient kernel run.
        if grouped and (self.repeat_kv or expands_kv(q) or (mask is not None and q.is_cuda)):
            k, v = (t.repeat_interleave(self.n_heads // self.n_kv_heads, dim=1) for t in (k, v))
            grouped = False
        # The kv heads are shared by groups of query heads (enable_gqa avoids materializing copies).
        if mask is None:
            out = functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
        else:
            out = functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=grouped)
        return self.wo(out.transpose(1, 2).reshape(batch, seq_len, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def init_weights(self, out_std: float) -> None:
        for linear in (self.w1, self.w3):
            _normal(linear.weight, INIT_STD)
        _normal(self.w2.weight, out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(functional.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    attention_class: type[Attention] = Attention

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = self.attention_class(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def init_weights(self, out_std: float) -> None:
        self.attention_norm.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.attention.init_weights(out_std)
        self.feed_forward.init_weights(out_std)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # mask by keyword: TP's PrepareModuleInput lays out the positional (x, freqs) only.
        h = x + self.attention(self.attention_norm(x), freqs, mask=mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    block_class: type[TransformerBlock] = TransformerBlock

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): self.block_class(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = OutputHead(cfg.dim, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # Not persistent: derived from the config, so checkpoints need not carry it.
        self.register_buffer("freqs", self._rope_table(device=None), persistent=False)

    def _rope_table(self, device) -> torch.Tensor:
        c = self.cfg
        return rope_frequencies(SPEC.head_dim(c), c.max_seq_len, c.rope_theta, device=device, scaling=c)

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
            with _rng_for("tok_embeddings", seed, device):
                # Untied: unit-variance embeddings (the first RMSNorm rescales them anyway).
                std = INIT_STD if self.cfg.tie_embeddings else 1.0
                _fill(self.tok_embeddings.weight, partial(nn.init.normal_, std=std))
        # Residual-branch outputs shrink with depth so the residual stream's variance stays O(1).
        out_std = INIT_STD / math.sqrt(2 * self.cfg.n_layers)
        for key, wrapped in self.layers.items():
            # Blocks may be wrapped (checkpointing, compile): init the TransformerBlock inside.
            block = next(m for m in wrapped.modules() if isinstance(m, TransformerBlock))
            with _rng_for(f"layers.{key}", seed, device):
                block.init_weights(out_std)
        if self.norm is not None:
            self.norm.reset_parameters()
        if self.output is not None and not self.cfg.tie_embeddings:
            with _rng_for("output", seed, device):
                _normal(self.output.weight, 1 / math.sqrt(self.cfg.dim))

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


MODEL = Llama  # what models/build.py builds for model.family=llama


def build_model(cfg: ModelConfig, device: str | torch.device = "meta") -> Llama:
    """A Llama on `device` (meta by default: shapes only, no memory, no init); any family: models/build.py."""
    with torch.device(device):
        return Llama(cfg)


def count_params(model: nn.Module) -> int:
    """Unique parameters (a tied weight counted once)."""
    return sum(p.numel() for p in model.parameters())
