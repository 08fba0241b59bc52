"""StopRequest's decisions (train/stop.py) and the metrics.jsonl rewrite on resume (train/metrics.py), in process."""

from __future__ import annotations

import json

import pytest

from trainctl.config.schema import LoggingConfig
from trainctl.train.loop import stop as stop_module
from trainctl.train.loop.stop import StopRequest, exit_code_of
from trainctl.train.observe.metrics import MetricsLogger


class Exited(Exception):
    pass


@pytest.fixture
def exits(monkeypatch) -> list[int]:
    codes: list[int] = []

    def fake_exit(code: int):
        codes.append(code)
        raise Exited(code)

    monkeypatch.setattr(stop_module.os, "_exit", fake_exit)
    return codes


def test_exit_codes_follow_the_shell():
    assert (exit_code_of("SIGINT"), exit_code_of("SIGTERM"), exit_code_of("SIGUSR2")) == (130, 143, 140)


def test_a_signal_before_training_exits_at_once(exits):
    request = StopRequest()
    with pytest.raises(Exited):
        request.on_signal("SIGTERM", now=0.0)
    assert exits == [143]


def test_first_signal_asks_for_a_save_and_a_second_one_exits(exits):
    request = StopRequest()
    request.armed = True
    request.on_signal("SIGINT", now=10.0)
    assert request.requested and request.signal_name == "SIGINT" and request.exit_code == 130 and exits == []
    request.on_signal("SIGINT", now=10.0 + StopRequest.DUPLICATE_S / 2)  # the same stop delivered twice
    assert exits == []
    with pytest.raises(Exited):
        request.on_signal("SIGTERM", now=10.0 + StopRequest.DUPLICATE_S + 1)
    assert exits == [143]


def test_a_hook_requests_the_stop_a_signal_would_without_a_signal(exits):
    """hooks.on_step_end may call stop.request(): the same flag the next step's agreement reads, exit code 0."""
    request = StopRequest()
    request.armed = True
    request.request(now=10.0)
    assert request.requested and request.signal_name == "" and request.exit_code == 0 and not request.preempted
    # A signal after it is a second stop request, as after a first signal: it exits at once.
    with pytest.raises(Exited):
        request.on_signal("SIGTERM", now=10.0 + StopRequest.DUPLICATE_S + 1)
    assert exits == [143]


def test_a_repeated_preemption_signal_does_not_end_the_save(exits):
    request = StopRequest("SIGUSR2")
    request.armed = True
    request.on_signal("SIGUSR2", now=0.0)
    request.on_signal("SIGUSR2", now=100.0)
    assert exits == [] and request.preempted and request.exit_code == 140


def logger(tmp_path, lines: list) -> MetricsLogger:
    (tmp_path / "metrics.jsonl").write_text("".join(x if isinstance(x, str) else json.dumps(x) + "\n" for x in lines))
    return MetricsLogger(tmp_path, LoggingConfig(progress=False), 10, True, {})


def test_resume_drops_what_followed_the_checkpoint(tmp_path):
    kept = [{"kind": "eval", "step": 0, "val_loss": 5.0}, {"kind": "train", "step": 1, "loss": 4.0},
            {"kind": "train", "step": 2, "loss": 3.0}, {"kind": "memory", "step": 2}, {"kind": "final", "steps": 9}]
    dropped = [{"kind": "train", "step": 3, "loss": 2.5}, {"kind": "checkpoint", "step": 4}, "{half a line\n",
               {"kind": "train", "step": 4, "loss": 2.0}]
    metrics = logger(tmp_path, kept[:3] + dropped[:2] + kept[3:] + dropped[2:])
    metrics.resumed(2, "checkpoints/step-00000002", 16)
    metrics.train(3, {"loss": 2.4})
    metrics.close()
    got = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert got == kept + [{"kind": "resume", "step": 2, "checkpoint": "checkpoints/step-00000002", "samples_seen": 16},
                          {"kind": "train", "step": 3, "loss": 2.4}]
    assert not list(tmp_path.glob(".*.tmp"))


def test_resume_without_earlier_metrics(tmp_path):
    metrics = MetricsLogger(tmp_path, LoggingConfig(progress=False), 10, True, {})
    metrics.resumed(4, "c", 32)
    metrics.close()
    assert [json.loads(line)["kind"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == ["resume"]
