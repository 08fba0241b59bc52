"""Generated Hugging Face config.json files, run records and sweep records: an answer or a user error in one line,
never a traceback or a hang (data prepare's inputs: test_fuzz_prepare.py)."""

from __future__ import annotations

import json
import math
import os

from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz.guard import BOUNDED, USER_ERRORS, deadline
from trainctl.config import hf_config
from trainctl.core import rundir as layout
from trainctl.launch import sweep
from trainctl.runs import figures
from trainctl.runs import registry as runs

LLAMA = {"model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 352, "vocab_size": 512, "max_position_embeddings": 512,
         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "hidden_act": "silu"}
JSON_ANY = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-(2**65), 2**65), st.floats(),
                                  st.text(max_size=8)),
                        lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                st.dictionaries(st.text(max_size=6), inner, max_size=3)),
                        max_leaves=8)
HF_KEYS = st.sampled_from([*LLAMA, "head_dim", "rope_scaling", "rope_parameters", "attention_bias", "mlp_bias",
                           "architectures", "torch_dtype"])


@BOUNDED
@given(st.dictionaries(HF_KEYS, JSON_ANY, max_size=4), st.sets(st.sampled_from(list(LLAMA)), max_size=2))
def test_any_hf_config_json_is_read_or_refused_in_one_line(tmp_path_factory, changes, dropped):
    folder = tmp_path_factory.mktemp("hf")
    data = {k: v for k, v in {**LLAMA, **changes}.items() if k not in dropped}
    (folder / "config.json").write_text(json.dumps(data))  # NaN and Infinity included, as json writes them
    with deadline(10):
        try:
            fields = hf_config.model_fields(folder)
        except hf_config.HFConfigError as exc:
            assert "\n" not in str(exc)
            return
    # Accepted: every size is a positive int, every float finite; nothing was silently replaced.
    for key in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "max_seq_len"):
        assert isinstance(fields[key], int) and not isinstance(fields[key], bool) and fields[key] > 0, key
    assert math.isfinite(fields["norm_eps"]) and math.isfinite(fields["rope_theta"])
    if isinstance(data.get("num_key_value_heads"), int):
        assert fields["n_kv_heads"] == data["num_key_value_heads"]


RECORD_FILES = [layout.CONFIG, layout.METRICS, layout.PROGRESS, layout.RESULT, layout.LAUNCH, layout.HOLDER,
                layout.STOPPED, layout.PLAN, "slurm-attempts.jsonl"]
CONTENT = st.one_of(st.binary(max_size=64), JSON_ANY.map(lambda v: json.dumps(v).encode()),
                    st.lists(JSON_ANY.map(json.dumps), max_size=4).map(lambda ls: "\n".join(ls).encode()),
                    st.sampled_from([b"", b"\xff\xfe", b'{"kind": "train", "step": 3, "loss": NaN}\n',
                                     b"train:\n  steps: [1\n", b"a: &a [1]\nb: [*a, *a]\n"]))


FIFO = b"<a named pipe>"


@BOUNDED
@given(st.dictionaries(st.sampled_from([*RECORD_FILES, layout.LOCK]), st.one_of(CONTENT, st.just(FIFO)), max_size=5))
def test_any_run_records_are_read_without_raising(tmp_path_factory, files):
    run_dir = tmp_path_factory.mktemp("runs") / "r"
    run_dir.mkdir()
    (run_dir / layout.CONFIG).write_text("train:\n  steps: 4\n")
    for name, content in files.items():
        if content == FIFO:  # a reader that opens it blocks until a writer comes: never, here
            (run_dir / name).unlink(missing_ok=True)
            os.mkfifo(run_dir / name)
        else:
            (run_dir / name).write_bytes(content)
    with deadline(10):
        states = runs.run_states(runs.list_runs(run_dir.parent))
        for st_ in states:
            figures.figures(st_.path)


POINT = st.fixed_dictionaries({}, optional={"index": JSON_ANY, "run_dir": st.one_of(JSON_ANY, st.just("x")),
                                            "overrides": st.one_of(JSON_ANY, st.lists(st.text(max_size=8)))})
SWEEP_RECORD = st.one_of(JSON_ANY, st.fixed_dictionaries({"points": st.one_of(JSON_ANY, st.lists(st.one_of(POINT,
                                                                                                           JSON_ANY)))}))


@BOUNDED
@given(SWEEP_RECORD)
def test_any_sweep_record_ranks_or_is_refused(tmp_path_factory, record):
    root = tmp_path_factory.mktemp("runs")
    folder = sweep.sweep_dir(root, "sw")
    folder.mkdir(parents=True)
    (folder / sweep.SWEEP_FILE).write_text(json.dumps(record))
    with deadline(10):
        try:
            sweep.ranked(sweep.read(root, "sw"))
        except USER_ERRORS:
            pass
