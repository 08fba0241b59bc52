"""Rotary position embeddings every family shares: the (scaled) angle table and the rotation of q and k."""

from __future__ import annotations

import math

import torch

from trainctl.config.schema import ModelConfig


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
