"""The CUDA tests' config builders (tests/gpu/configs.py), run on CPU: a wrong argument or an invalid config fails
here, not on a lent GPU (`gpu_config` once passed `steps` twice and 8 GPU tests died of the TypeError)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.gpu import configs
from trainctl.config.validate import resolve

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def every(tmp_path_factory):
    return configs.every_config(tmp_path_factory.mktemp("data-cache"))


def test_every_gpu_config_builds_and_validates(every):
    assert len(every) == 1 + len(configs.CLOSE_TO_FP32) + len(configs.CLOSE_TO_BF16) + 2 + len(configs.MEMORY_CASES) + 1
    for name, cfg in every.items():
        assert cfg.cluster.device == "cuda", name
        # The worker's checks; the device itself is the launcher's (there is no CUDA here).
        resolve(replace(cfg, cluster=replace(cfg.cluster, device="cpu")))


def test_the_builders_apply_their_overrides(every):
    assert every["resume"].train.steps == 20 and every["resume_split"].train.steps == 10
    assert every["resume_split"].checkpoint.every == 10
    assert every["syncs"].train.steps == 8
    memory = every["memory-selective-2"]
    train = memory.train
    assert (train.steps, train.micro_batch, train.global_batch, train.seq_len) == (4, 2, 2, 512)
    assert memory.train.activation_checkpointing == "selective"
    assert every["fp8_tensorwise_compile"].train.compile and every["fp8_tensorwise_compile"].precision.fp8
    assert every["fp8_rowwise"].precision.fp8_recipe == "rowwise"


@pytest.mark.parametrize("mode, micro_batch", configs.MEMORY_CASES)
def test_the_memory_cases_have_a_plan_and_a_message(tmp_path, mode, micro_batch):
    from tests.gpu.test_cuda_training import memory_message

    cfg = configs.memory_config(tmp_path, mode, micro_batch)
    planned = configs.planned_memory(cfg)
    assert planned.peak > 0
    message = memory_message("case", planned, {"peak_bytes": planned.peak // 2, "step": 2,
                                               "peak_source": "cuda_max_memory_allocated"})
    assert f"at phase {planned.peak_phase}" in message and "measured" in message and "+100.00%" in message
