"""model.lora's rank against the layers it adapts, and adapters on a random frozen base (issue 35)."""

from __future__ import annotations

import dataclasses

import pytest

from trainctl import api
from trainctl.core.errors import UserError
from trainctl.plan.runplan import lora_warnings

TINY = ["recipe=tiny_cpu"]  # dim 256, 8 heads, 4 kv heads: wk and wv are 256 -> 128


def test_a_rank_above_a_targets_narrow_side_is_refused_with_the_limit():
    with pytest.raises(UserError) as err:
        api.resolved([*TINY, "model.lora.rank=100000"])
    assert err.value.problems == ["model.lora.rank=100000: above min(in, out) of k, o, q, v (128), where an adapter "
                                  "is no longer low-rank; use a rank of at most 128 (e.g. 8 or 16), or "
                                  "model.lora.rank=0 to train every weight"]
    with pytest.raises(UserError, match=r"rank=129: above min\(in, out\) of k, v \(128\)"):
        api.resolved([*TINY, "model.lora.rank=129"])
    assert api.resolved([*TINY, "model.lora.rank=128", "model.lora.targets=[q,o]"]).model.lora.rank == 128


def test_adapters_larger_than_their_weights_warn_with_the_counts():
    plan = api.plan([*TINY, "model.lora.rank=128"])
    assert ("model.lora.rank=128: the adapters train 229,376 parameters per layer, more than the 196,608 weights "
            "they adapt; a smaller rank (e.g. 8 or 16) is the usual LoRA, or model.lora.rank=0 trains every weight "
            "with less") in plan.warnings
    assert not [w for w in api.plan([*TINY, "model.lora.rank=8"]).warnings if "parameters per layer" in w]


def test_adapters_on_a_random_base_warn_in_the_plan_and_a_dry_run(tmp_path):
    plan = api.plan([*TINY, "model.lora.rank=8"])
    assert [w for w in plan.warnings if w.startswith("model.lora.rank=8 on a random base: no checkpoint.init_from")]
    prepared = api.prepare_launch([*TINY, "model.lora.rank=8", f"runs_dir={tmp_path}"], dry_run=True)
    assert [w for w in prepared.warnings if "on a random base" in w]
    cfg = api.resolved([*TINY, "model.lora.rank=8"])
    given = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, init_from="/models/llama"))
    assert lora_warnings(given) == []
    assert not [w for w in api.plan(TINY).warnings if "lora" in w.lower()]
