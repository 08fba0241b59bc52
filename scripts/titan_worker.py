"""The torchtitan side of scripts/bench_titan.py, run by it under torchrun: torchtitan's own Trainer
(torchtitan.train.main) with the recipe's model registered as a train spec of its own.

    torchrun --standalone --nproc_per_node=1 scripts/titan_worker.py SPEC_JSON --job.config_file titan.toml

SPEC_JSON (written by bench_titan.py): device, train_spec and flavor (the names its TOML asks for),
model_args (TransformerModelArgs keywords), ffn_dim (checked against the built model), metrics_path. The
train spec is torchtitan's llama3 one (model, parallelize function, loss, optimizer, schedule) with two
swaps: synthetic tokens (one fixed batch; no tokenizer, so HF `datasets` need not be carried) and a metrics
logger that appends each of torchtitan's metric records to metrics_path as a JSON line. On device cpu (the
rehearsal) torchtitan 0.2, which assumes an accelerator, is shown the CPU as a device module without memory
statistics; everything else is torchtitan's.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def stub_datasets() -> None:
    """torchtitan imports HF `datasets` at import time for its text dataloader, which this bench does not use;
    where `datasets` is absent (the GPU image), a stand-in that fails loudly if that path is ever taken."""
    import importlib.util
    import types

    if importlib.util.find_spec("datasets") is not None:
        return

    def unavailable(*args, **kwargs):
        raise RuntimeError("bench_titan: HF datasets is not installed; only synthetic tokens are supported")

    datasets, distributed = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
    datasets.Dataset, datasets.load_dataset, datasets.distributed = type("Dataset", (), {}), unavailable, distributed
    distributed.split_dataset_by_node = unavailable
    sys.modules.update({"datasets": datasets, "datasets.distributed": distributed})


def present_cpu_as_device() -> None:
    """Rehearsal only: torchtitan 0.2 picks `cuda` when no accelerator is present and asks its device module for
    memory statistics; present the CPU as the device, with empty statistics (-1 in the records)."""
    import types

    import torch
    import torch._utils

    cpu = types.SimpleNamespace(
        set_device=lambda device: None, current_device=lambda: 0, device_count=lambda: 1,
        get_device_name=lambda device=None: "cpu (rehearsal)", synchronize=torch.cpu.synchronize,
        get_device_properties=lambda device=None: types.SimpleNamespace(total_memory=os.sysconf("SC_PHYS_PAGES")
                                                                         * os.sysconf("SC_PAGE_SIZE")),
        memory_stats=lambda device=None: {}, reset_peak_memory_stats=lambda device=None: None,
        empty_cache=lambda: None, is_available=lambda: True)
    device_module = torch._utils._get_device_module
    torch._utils._get_available_device_type = lambda: "cpu"
    torch._utils._get_device_module = lambda kind="cuda": cpu if kind == "cpu" else device_module(kind)


def synthetic_loader(batch: int, seq_len: int, vocab: int, seed: int):
    """One fixed batch of random tokens forever (bench_loop feeds both its arms the same way), on CPU:
    torchtitan moves each micro-batch to the device itself."""
    import torch
    from torchtitan.components.dataloader import BaseDataLoader

    class Synthetic(BaseDataLoader):
        def __init__(self):
            tokens = torch.randint(0, vocab, (batch, seq_len + 1), generator=torch.Generator().manual_seed(seed))
            self.batch = ({"input": tokens[:, :-1].contiguous()}, tokens[:, 1:].contiguous())

        def __iter__(self):
            while True:
                yield self.batch

        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            pass

    return Synthetic()


def register_spec(spec: dict) -> None:
    """torchtitan's llama3 train spec with the recipe's model, synthetic tokens and a JSON-lines metrics logger."""
    import dataclasses

    import torch
    import torchtitan.protocols.train_spec as train_spec
    from torchtitan.components.metrics import BaseLogger, build_metrics_processor
    from torchtitan.models.llama3 import TransformerModelArgs, get_train_spec

    args = TransformerModelArgs(**spec["model_args"])
    with torch.device("meta"):
        model = get_train_spec().model_cls(args)
    width = model.layers["0"].feed_forward.w1.weight.shape[0]
    if width != spec["ffn_dim"]:
        raise SystemExit(f"bench_titan: torchtitan's FFN width is {width}, the recipe's {spec['ffn_dim']}")
    del model

    class JsonLines(BaseLogger):
        def __init__(self, processor):
            self.processor = processor

        def log(self, metrics, step):
            record = {"step": step, **metrics, "flops_per_token": self.processor.num_flops_per_token,
                      "peak_flops": self.processor.gpu_peak_flops}
            with open(spec["metrics_path"], "a") as out:
                out.write(json.dumps(record) + "\n")

    def metrics_processor(job_config, parallel_dims, model_args=None, tag=None):
        processor = build_metrics_processor(job_config, parallel_dims, model_args, tag)
        if hasattr(processor.logger, "add_logger"):  # a container of tensorboard/wandb loggers
            processor.logger.add_logger(JsonLines(processor))
        else:  # with neither enabled, torchtitan's logger is a BaseLogger that does nothing
            processor.logger = JsonLines(processor)
        return processor

    def loader(dp_world_size, dp_rank, tokenizer, job_config, **kwargs):
        t = job_config.training
        return synthetic_loader(t.local_batch_size, t.seq_len, args.vocab_size, job_config.debug.seed or 0)

    train_spec.register_train_spec(spec["train_spec"], dataclasses.replace(
        get_train_spec(), model_args={spec["flavor"]: args}, build_dataloader_fn=loader, build_tokenizer_fn=None,
        build_validator_fn=None, build_metrics_processor_fn=metrics_processor))


def worker(spec: dict, titan_args: list[str]) -> None:
    import importlib.metadata as metadata

    # Before torchtitan's import: its ConfigManager.parse_args takes sys.argv[1:] as a default argument.
    sys.argv = [sys.argv[0], *titan_args]
    stub_datasets()
    if spec["device"] == "cpu":
        present_cpu_as_device()
    import torch

    try:
        import torchtitan.train
    except ModuleNotFoundError as err:
        raise SystemExit(f"titan_worker: {err.name} is not installed: scripts/gpu_wheels.sh carries torchtitan and "
                         "what it imports, gpu_proof.sh's titan stage installs them") from None

    name = torch.cuda.get_device_name(0) if spec["device"] == "cuda" else "cpu"
    Path(spec["metrics_path"] + ".versions").write_text(json.dumps(
        {"torchtitan": metadata.version("torchtitan"), "torch": torch.__version__, "device_name": name}))
    register_spec(spec)
    torchtitan.train.main(torchtitan.train.Trainer)


if __name__ == "__main__":
    if len(sys.argv) < 2 or not sys.argv[1].startswith("{"):
        raise SystemExit("titan_worker: usage: titan_worker.py SPEC_JSON TORCHTITAN_ARGS... (bench_titan.py runs it)")
    worker(json.loads(sys.argv[1]), sys.argv[2:])
