"""The llama family's module: the shared decoder as it is (trainctl/models/common/decoder.py)."""

from __future__ import annotations

from trainctl.models.common.decoder import Decoder

MODEL = Decoder  # what models/build.py builds for model.family=llama
