"""Fuzz of `data prepare`'s inputs and options: a dataset whose shards match meta.json, or one line and nothing
left behind; never another exception, never a hang (bounded examples, in process, one worker)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pytest

from trainctl.data.format import DatasetError, dataset_problems, read_meta
from trainctl.data.prepare import prepare

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies

JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                        max_size=3), max_leaves=6)


@st.composite
def input_file(draw):
    suffix = draw(st.sampled_from([".txt", ".md", ".jsonl", ".json", ".parquet", ".bin", ""]))
    kind = draw(st.sampled_from(["text", "bytes", "records", "prefixed"]))
    if kind == "text":
        data = draw(st.text(max_size=300)).encode("utf-8", "surrogatepass")
    elif kind == "bytes":
        data = draw(st.binary(max_size=300))
    elif kind == "records":
        record = st.dictionaries(st.sampled_from(["text", "body"]), JSON_VALUES, max_size=2) | JSON_VALUES
        records = draw(st.lists(record, max_size=5))
        data = "".join(json.dumps(r) + "\n" for r in records).encode()
    else:  # magic bytes of a compressed file, or a BOM, then text
        head = draw(st.sampled_from([b"\x1f\x8b", b"BZh", b"\xef\xbb\xbf", b"PAR1", b"PK\x03\x04", b""]))
        data = head + draw(st.text(max_size=100)).encode("utf-8", "surrogatepass")
    return suffix, data


OPTIONS = st.fixed_dictionaries({
    "val_fraction": st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, 0.3, 0.999]),
    "shard_tokens": st.integers(min_value=-3, max_value=1 << 50) | st.integers(min_value=1, max_value=64),
    "workers": st.sampled_from([1, 0, -2]),
    "text_field": st.sampled_from(["text", "body", ""]),
    "seed": st.integers(min_value=0, max_value=3),
})


@hypothesis.settings(max_examples=60, deadline=None, database=None,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(files=st.lists(input_file(), min_size=1, max_size=3), options=OPTIONS)
def test_prepare_makes_a_whole_dataset_or_refuses_in_one_line_leaving_nothing(files, options):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "in").mkdir()
        for i, (suffix, data) in enumerate(files):
            (root / "in" / f"f{i}{suffix}").write_bytes(data)
        out = root / "out"
        try:
            meta = prepare([str(root / "in" / "*")], out, **options)
        except DatasetError as exc:
            assert "\n" not in str(exc) and str(exc)
            assert not out.exists()
            return
        assert read_meta(out).splits == meta.splits and meta.splits["train"].tokens > 0
        assert dataset_problems(out, "train", vocab_size=256, seq_len=1) == []
        assert sorted(p.name for p in out.iterdir() if not p.name.endswith(".bin")) == ["meta.json"]
        ids = [np.fromfile(p, dtype=meta.token_dtype) for s in ("train", "val") for p in meta.shard_paths(s)]
        assert all(int(x.max(initial=0)) < meta.tokenizer.vocab_size for x in ids)  # never a wrapped id
