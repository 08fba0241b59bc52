"""The mistral family's module: the llama decoder (the sliding window is refused unless it covers the sequence)."""

from __future__ import annotations

from trainctl.models.llama.model import build_model

__all__ = ["build_model"]
