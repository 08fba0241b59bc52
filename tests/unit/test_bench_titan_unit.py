"""scripts/bench_titan.py's bookkeeping, without torchtitan: the recipe as torchtitan's config, its metric
records read back, and the trainctl/torchtitan ratio (the run itself is rehearsed by gpu_proof.sh --rehearse)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

from trainctl.config.compose import compose

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import bench_titan  # noqa: E402


def torchtitan_ffn_width(dim: int, multiple_of: int, ffn_dim_multiplier: float | None) -> int:
    """torchtitan 0.2.2's FeedForward.__init__ (models/llama3/model/model.py), with hidden_dim = 4 * dim."""
    hidden = int(2 * (4 * dim) / 3)
    if ffn_dim_multiplier is not None:
        hidden = int(ffn_dim_multiplier * hidden)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


@pytest.mark.parametrize("model", ["llama3_1b", "tiny", "llama3_8b", "llama3_70b", "llama2_7b", "llama2_13b"])
def test_model_args_give_torchtitan_the_recipe_s_ffn_width(model):
    cfg = compose([f"model={model}"]).model
    args = bench_titan.titan_model_args(cfg)
    assert torchtitan_ffn_width(cfg.dim, args["multiple_of"], args["ffn_dim_multiplier"]) == cfg.ffn_dim
    assert (args["dim"], args["n_layers"], args["n_heads"], args["n_kv_heads"], args["vocab_size"]) == (
        cfg.dim, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size)


def test_the_bench_recipe_becomes_a_one_device_torchtitan_job_that_parses_as_toml(tmp_path):
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+, as torchtitan (the GPU image runs 3.12)
    cfg = compose(["recipe=llama1b_bench"])
    job = bench_titan.titan_job(cfg, "cuda", warmup=10, steps=30, log_freq=5, dump_folder=tmp_path / "dump")
    assert tomllib.loads(bench_titan.to_toml(job)) == job  # every value survives the TOML writer
    training = job["training"]
    assert (training["local_batch_size"], training["global_batch_size"], training["seq_len"]) == (8, 8, 2048)
    assert training["steps"] == 40 and training["mixed_precision_param"] == "bfloat16"
    assert training["dtype"] == "float32" and training["max_norm"] == cfg.optim.grad_clip
    assert job["compile"]["enable"] is True and job["activation_checkpoint"]["mode"] == "none"
    assert job["model"] == {"name": bench_titan.TRAIN_SPEC, "flavor": bench_titan.FLAVOR}
    assert job["optimizer"]["implementation"] == "fused" and job["optimizer"]["lr"] == cfg.optim.lr
    assert job["checkpoint"] == {"enable": False} and job["validation"] == {"enable": False}


@pytest.mark.parametrize("overrides, word", [(["precision=fp8"], "fp8"),
                                             (["train.activation_checkpointing=selective"], "activation"),
                                             (["precision=fp16"], "compute_dtype")])
def test_what_torchtitan_would_run_differently_is_refused(tmp_path, overrides, word):
    cfg = compose(["recipe=llama1b_bench", *overrides])
    with pytest.raises(ValueError, match=word):
        bench_titan.titan_job(cfg, "cuda", 10, 30, 5, tmp_path)


def _records(warmup_tps: float = 100.0) -> list[dict]:
    """torchtitan's records every 5 steps of 40: compilation in the first, a peak in the second (warm-up)."""
    records = []
    for step in range(5, 45, 5):
        tps = warmup_tps if step <= 10 else 1000.0 + step
        records.append({"step": step, "throughput(tps)": tps, "tflops": tps / 100, "mfu(%)": tps / 50,
                        "memory/max_active(GiB)": 30.0 if step == 10 else 20.0 + step / 100,
                        "memory/max_reserved(GiB)": 40.0, "loss_metrics/global_avg_loss": 12.0 - step / 10,
                        "flops_per_token": 8.0e9, "peak_flops": 989e12})
    return records


def test_figures_are_medians_after_warmup_and_the_run_s_peak(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _records()) + "\n")
    summary = bench_titan.summarize(bench_titan.read_records(path), warmup=10)
    assert summary["timed_steps"] == [15, 20, 25, 30, 35, 40]
    assert summary["tokens_per_s"] == pytest.approx(1027.5)  # median of 1015..1040: warm-up's 100s left out
    assert summary["mfu_pct"] == pytest.approx(1027.5 / 50) and summary["tflops"] == pytest.approx(10.275)
    assert summary["peak_active_gib"] == 30.0  # torchtitan resets its peaks each log: the largest interval's
    assert summary["peak_reserved_gib"] == 40.0 and summary["loss_first_last"] == [11.5, 8.0]


def test_unmeasured_memory_is_none_and_no_timed_record_is_an_error():
    records = [dict(r, **{"memory/max_active(GiB)": -1e-9, "memory/max_reserved(GiB)": -1e-9}) for r in _records()]
    summary = bench_titan.summarize(records, warmup=10)
    assert summary["peak_active_gib"] is None and summary["peak_reserved_gib"] is None
    with pytest.raises(ValueError, match="no torchtitan metrics after warm-up step 40"):
        bench_titan.summarize(records, warmup=40)
    assert bench_titan.read_records(Path("/nonexistent/metrics.jsonl")) == []


def _titan() -> dict:
    return {"recipe": "llama1b_bench", "model": "llama3_1b", "batch": "8x1x2048", "precision": "bf16",
            "compile": True, "tokens_per_s": 40000.0}


def test_ratio_is_trainctl_s_median_over_torchtitan_s():
    loop = {**_titan(), "fp8": False, "trainctl_tokens_per_s": [41000.0, 44000.0, 42000.0]}
    del loop["tokens_per_s"]
    versus = bench_titan.compare(_titan(), loop)
    assert versus["comparable"] and versus["trainctl_tokens_per_s"] == 42000.0
    assert versus["ratio_trainctl_over_torchtitan"] == pytest.approx(1.05)
    assert bench_titan.compare(_titan(), None) is None


@pytest.mark.parametrize("change, differs", [({"batch": "2x1x64"}, ["batch"]), ({"model": "tiny"}, ["model"]),
                                             ({"fp8": True}, ["fp8"]), ({"compile": False}, ["compile"])])
def test_no_ratio_between_different_shapes(change, differs):
    loop = {**_titan(), "fp8": False, "trainctl_tokens_per_s": [1.0], **change}
    assert bench_titan.compare(_titan(), loop) == {"comparable": False, "differs_in": differs}


def test_a_fallback_ratio_carries_its_note():
    titan = {**_titan(), "batch": "4x2x2048", "requested_batch": "8x1x2048", "oom_fallback": "ran 4 x 2"}
    loop = {**_titan(), "fp8": False, "trainctl_tokens_per_s": [42000.0]}
    versus = bench_titan.compare(titan, loop)
    assert versus["comparable"] and versus["note"] == "ran 4 x 2"


OOM = ["[rank0]: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 3.91 GiB.\n"]


def _run(monkeypatch, tmp_path, device: str, outcomes: list[tuple[int, list[str]]]):
    """bench_titan.run with the worker replaced: each attempt's config and the result."""
    seen = []

    def fake_worker(spec, toml_path, timeout):
        seen.append(toml_path.read_text())
        rc, lines = outcomes[len(seen) - 1]
        return ["torchrun"], rc, lines

    monkeypatch.setattr(bench_titan, "run_worker", fake_worker)
    cfg = compose(["recipe=llama1b_bench"])
    args = argparse.Namespace(device=device, warmup=10, steps=30, log_freq=5, timeout=480, oom_retries=1)
    spec = {"model_args": {}, "metrics_path": str(tmp_path / "metrics.jsonl")}
    return seen, bench_titan.run(cfg, args, tmp_path, spec)


def test_a_cuda_oom_retries_at_half_the_micro_batch_with_the_same_tokens_per_step(monkeypatch, tmp_path):
    seen, result = _run(monkeypatch, tmp_path, "cuda", [(1, OOM), (0, ["done\n"])])
    assert "local_batch_size = 8\nglobal_batch_size = 8\n" in seen[0]
    assert "local_batch_size = 4\nglobal_batch_size = 8\n" in seen[1]
    assert result["batch"] == "4x2x2048" and result["requested_batch"] == "8x1x2048" and result["returncode"] == 0
    assert "out of memory at local batch 8" in result["oom_fallback"] and len(result["attempts"]) == 2
    assert result["config_toml"] == seen[1]


@pytest.mark.parametrize("device, outcomes", [("cuda", [(1, ["ValueError: something else\n"])]),
                                              ("cpu", [(1, OOM)]), ("cuda", [(1, OOM), (1, OOM)])])
def test_no_retry_but_after_one_cuda_oom(monkeypatch, tmp_path, device, outcomes):
    seen, result = _run(monkeypatch, tmp_path, device, outcomes)
    assert len(seen) == len(outcomes) and result["returncode"] == 1 and result["oom_fallback"] is None
    assert result["log_tail"] == [line.rstrip() for line in outcomes[-1][1]]
