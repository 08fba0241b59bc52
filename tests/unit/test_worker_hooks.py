"""The worker's hooks seam (train/loop/hooks.py): none by default, loaded only when the test variable names them,
and each called where its contract says."""

from __future__ import annotations

import pytest
import torch

from trainctl.core.checkpoints import list_committed
from trainctl.train.checkpoint.store import CheckpointManager
from trainctl.train.loop.hooks import TEST_HOOKS_ENV, Hooks, hooks_from_env
from trainctl.train.loop.loss import TokenLoss

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no group: as meant

SEEN: list = []


def doubling_hooks() -> Hooks:
    """Named by the tests below through TEST_HOOKS_ENV."""
    return Hooks(on_loss=lambda step, loss: loss * 2)


def not_hooks() -> dict:
    return {}


def test_no_variable_no_hooks_and_nothing_imported():
    assert hooks_from_env({}) == Hooks(None, None, None)


def test_the_variable_names_a_function_returning_hooks():
    hooks = hooks_from_env({TEST_HOOKS_ENV: f"{__name__}:doubling_hooks"})
    assert hooks.on_loss(3, 5) == 10 and hooks.on_step_end is None and hooks.before_commit is None
    with pytest.raises(TypeError, match="returned dict, not Hooks"):
        hooks_from_env({TEST_HOOKS_ENV: f"{__name__}:not_hooks"})


def test_on_loss_sees_each_normalized_training_loss():
    seen = []
    loss = TokenLoss(4.0, lambda value: seen.append(value.item()) or value * 0 + 7)
    assert loss.normalize(torch.tensor(8.0)).item() == 7 and seen == [2.0]
    assert TokenLoss(4.0).normalize(torch.tensor(8.0)).item() == 2.0  # unset: untouched


def test_before_commit_runs_once_the_files_are_written_and_before_the_commit(tmp_path):
    def check(step):
        assert list((tmp_path / f"step-{step:08d}.tmp").iterdir()) and list_committed(tmp_path) == []
        SEEN.append(step)

    manager = CheckpointManager(tmp_path, keep_last=2, before_commit=check)
    manager.save(3, {"model": {"w": torch.ones(2)}}, {"position": 3}, {"tokens_seen": 30})
    manager.close()
    assert SEEN == [3] and [s for s, _ in list_committed(tmp_path)] == [3]
