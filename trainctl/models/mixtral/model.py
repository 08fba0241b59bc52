"""The mixtral family's module: the shared decoder's attention with a mixture-of-experts MLP."""

from __future__ import annotations

from trainctl.models.common.decoder import Decoder
from trainctl.models.common.moe import MoEBlock


class Mixtral(Decoder):
    block_class = MoEBlock


MODEL = Mixtral  # what models/build.py builds for model.family=mixtral
