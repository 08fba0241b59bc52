"""train.compile compiles each block with fullgraph=True: a graph break fails at the first step, loudly, instead of
silently splitting the block into slower pieces (issue 22)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._inductor import config as inductor_config

from trainctl.train.parallel.parallelize import apply_compile


class Breaks(nn.Module):
    def forward(self, x):
        x = x * 2
        torch._dynamo.graph_break()
        return x + 1


def test_a_graph_break_in_a_compiled_block_fails_loudly():
    torch._dynamo.reset()
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": Breaks()})
    # A width already set: apply_compile picks no vector ISA (picking runs the compiler: not the unit tier's).
    with inductor_config.patch({"cpp.simdlen": 0}):
        apply_compile(model)
    with pytest.raises(Exception, match="(?i)graph.break|fullgraph"):
        model.layers["0"](torch.ones(2))
