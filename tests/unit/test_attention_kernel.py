"""train.attention: the one-key fallback from cuDNN to flash, and the plan's prediction of the kernel (issue 22)."""

from __future__ import annotations

import pytest
from torch.nn.attention import SDPBackend

from trainctl.config import compose
from trainctl.config.errors import ConfigError
from trainctl.config.validate import resolve
from trainctl.models.common import attention
from trainctl.plan.attention_kernel import predicted_kernel
from trainctl.plan.runplan import build


def cfg(*overrides: str):
    return resolve(compose.compose(["recipe=llama1b_bench", *overrides]))


@pytest.mark.parametrize("overrides, kernel", [
    ((), "cudnn or flash"),  # Llama 3.2 1B: grouped-query attention, head dim 64
    (("model.n_kv_heads=32",), "cudnn"),
    (("train.attention=flash",), "flash"),
    (("precision=fp32",), "efficient"),
    (("model.head_dim=320",), "efficient"),  # an explicit head size (as Qwen3's) past flash's 256, not dim/heads
    (("cluster=local", "cluster.device=cpu", "cluster.gpu=''"), "cpu-flash"),
])
def test_the_plan_names_the_kernel(overrides, kernel):
    config = cfg(*overrides)
    assert predicted_kernel(config)[0] == kernel
    assert any(note.startswith(f"attention kernel: {kernel} (") for note in build(config).notes)


def test_flash_leaves_cudnn_out_of_the_order(monkeypatch):
    seen = []
    monkeypatch.setattr(attention, "sdpa_kernel", lambda order, set_priority: seen.append(list(order)))
    attention.attention_backends("cudnn")
    attention.attention_backends("flash")
    assert seen[0][0] == SDPBackend.CUDNN_ATTENTION
    assert SDPBackend.CUDNN_ATTENTION not in seen[1] and seen[1][0] == SDPBackend.FLASH_ATTENTION


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ConfigError, match="train.attention"):
        cfg("train.attention=xformers")
