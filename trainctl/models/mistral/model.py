"""The mistral family's module: the llama decoder (the sliding window is refused unless it covers the sequence)."""

from __future__ import annotations

from trainctl.models.llama.model import Llama

MODEL = Llama  # what models/build.py builds for model.family=mistral
