"""The mistral family's module: the shared decoder (the sliding window is refused unless it covers the sequence)."""

from __future__ import annotations

from trainctl.models.common.decoder import Decoder

MODEL = Decoder  # what models/build.py builds for model.family=mistral
