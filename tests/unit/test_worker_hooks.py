"""The worker's hooks seam (train/loop/hooks.py): none by default, loaded only when the test variable names them,
and each called where its contract says."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from tests.faults import worker_faults
from trainctl.config.schema import PrecisionConfig, ShardingConfig
from trainctl.core.checkpoints import list_committed
from trainctl.core.wrapping import wrapping_of
from trainctl.train.checkpoint.store import CheckpointManager
from trainctl.train.loop.hooks import TEST_HOOKS_ENV, Hooks, hooks_from_env
from trainctl.train.loop.loss import TokenLoss
from trainctl.train.loop.micro_batch import MicroBatchContext
from trainctl.train.loop.stop import StopRequest

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # one process, no group: as meant

SEEN: list = []


def doubling_hooks() -> Hooks:
    """Named by the tests below through TEST_HOOKS_ENV."""
    return Hooks(on_loss=lambda step, loss: loss * 2)


def not_hooks() -> dict:
    return {}


def test_no_variable_no_hooks_and_nothing_imported():
    assert hooks_from_env({}) == Hooks(None, None, None, None)


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


def test_forward_enters_the_offload_context_a_hook_may_wrap():
    """on_setup may replace job.contexts' offload_context (the offload probe does): forward() enters that one."""
    entered = []

    def watched(enabled, device):
        entered.append(enabled)
        return torch.autograd.graph.save_on_cpu()

    contexts = MicroBatchContext(model=torch.nn.Identity(), precision=PrecisionConfig(), offload=True,
                                 wrap=wrapping_of(ShardingConfig(), PrecisionConfig()), device=torch.device("cpu"))
    weight = torch.ones(3, requires_grad=True)
    with contexts.forward():
        (weight * weight).sum().backward()
    assert entered == [] and torch.equal(weight.grad, 2 * torch.ones(3))  # the default: the real offload
    with replace(contexts, offload_context=watched).forward():
        (weight * weight).sum()
    assert entered == [True]


class FakeJob:
    def __init__(self, step: int):
        self.progress, self.stop = SimpleNamespace(step=step), StopRequest()


@pytest.mark.parametrize("start", [0, 4])
def test_the_stop_fault_asks_through_the_seam_for_a_stop_in_the_step_it_names(start):
    """stop_after_step=5: the request is there when step 5 (1-based) begins, whether the run starts before or at
    step 4 (a resume there): that step's agreement carries it, as if a signal had come during step 5."""
    hooks, job = worker_faults.hooks_of({"stop_after_step": 5}), FakeJob(start)
    hooks.on_setup(job)
    for done in range(start + 1, 5):
        assert not job.stop.requested, done
        hooks.on_step_end(job, SimpleNamespace(step=done))
    assert job.stop.requested and job.stop.exit_code == 0
