"""`data prepare --format preference`: TRL's record layouts, each pair's two documents side by side (chosen first,
REJECTED on the second's first token), the chat template and answer-only masks as for SFT, one-line refusals
naming the record's line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import cli_in_process
from trainctl.data import format as dataset
from trainctl.data.chat import RecordOptions
from trainctl.data.prepare import prepare

USER = {"role": "user", "content": "Is water wet?"}
LAYOUTS = {
    "text": {"prompt": "Is water wet?", "chosen": "Yes.", "rejected": "No."},
    "messages": {"prompt": [USER], "chosen": [{"role": "assistant", "content": "Yes."}],
                 "rejected": [{"role": "assistant", "content": "No."}]},
    "implicit": {"chosen": [USER, {"role": "assistant", "content": "Yes."}],
                 "rejected": [USER, {"role": "assistant", "content": "No."}]},
}


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def documents(out: Path) -> list[tuple[str, str, int]]:
    """(text, the text of its counted targets, first token's flags) of each train document."""
    meta = dataset.read_meta(out)
    tokens = np.concatenate([np.fromfile(p, meta.token_dtype) for p in meta.shard_paths("train")])
    flags = np.concatenate([np.fromfile(p, np.uint8) for p in meta.mask_paths("train")])
    starts = [*np.flatnonzero(flags & dataset.DOC_START), tokens.size]
    out_docs = []
    for a, b in zip(starts, starts[1:], strict=False):
        text = bytes(tokens[a:b].astype(np.uint8)).decode()
        counted = bytes(tokens[a:b][(flags[a:b] & dataset.LOSS) != 0].astype(np.uint8)).decode()
        out_docs.append((text, counted, int(flags[a])))
    return out_docs


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_layout_renders_the_same_pair(tmp_path, layout):
    source = write_jsonl(tmp_path / "p.jsonl", [LAYOUTS[layout]] * 2)
    records = RecordOptions("preference")
    meta = prepare([str(source)], tmp_path / "out", records=records, chat_template="chatml", val_fraction=0, workers=1)
    assert meta.content == "preference" and meta.splits["train"].documents == 4
    docs = documents(tmp_path / "out")
    prompt = "<|im_start|>user\nIs water wet?<|im_end|>\n<|im_start|>assistant\n"
    assert [d[0] for d in docs[:2]] == [prompt + "Yes.<|im_end|>\n\x00", prompt + "No.<|im_end|>\n\x00"]
    # the answer and its end-of-turn count, never the prompt nor the closing EOS (as an SFT chat record)
    assert [d[1] for d in docs[:2]] == ["Yes.<|im_end|>\n", "No.<|im_end|>\n"]
    assert [d[2] for d in docs] == [dataset.DOC_START, dataset.DOC_START | dataset.REJECTED] * 2


def test_a_pair_stays_in_one_split(tmp_path):
    pairs = [{"prompt": f"question {i}", "chosen": f"good {i}", "rejected": f"bad {i}"} for i in range(40)]
    source = write_jsonl(tmp_path / "p.jsonl", pairs)
    records = RecordOptions("preference")
    meta = prepare([str(source)], tmp_path / "out", records=records, chat_template="chatml", val_fraction=0.3,
                   workers=1)
    assert 0 < meta.splits["val"].documents < 80
    assert meta.splits["train"].documents % 2 == 0 and meta.splits["val"].documents % 2 == 0


REFUSED = {
    "identical": ({"prompt": "a", "chosen": "same", "rejected": "same"}, "chosen and rejected are identical"),
    "empty-text": ({"prompt": "a", "chosen": "", "rejected": "b"}, "field 'chosen' is empty"),
    "blank": ({"prompt": "a", "chosen": "x", "rejected": "  "}, "field 'rejected' has no assistant text"),
    "empty-list": ({"prompt": "a", "chosen": "x", "rejected": []}, "field 'rejected' is empty"),
    "missing": ({"prompt": "a", "chosen": "x"}, "no field 'rejected'"),
    "number": ({"prompt": "a", "chosen": 3, "rejected": "x"}, "field 'chosen' is a number"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_refusals_name_the_line(tmp_path, monkeypatch, capsys, case):
    bad, words = REFUSED[case]
    good = LAYOUTS["text"]
    source = tmp_path / "p.jsonl"
    source.write_text(json.dumps(good) + "\n\n" + json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    code, _, err = cli_in_process(monkeypatch, capsys, "data", "prepare", str(source), "--out", str(tmp_path / "o"),
                                  "--format", "preference", "--chat-template", "chatml", "--workers", "1")
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert f"{source}: line 4: {words}" in err, err
    assert not (tmp_path / "o").exists()


def test_torn_pairs_are_refused_by_the_worker(tmp_path):
    from trainctl.config.schema import DataConfig
    from trainctl.train.loop.sources import DataError
    from trainctl.train.preference.pairs import PairBatches

    source = write_jsonl(tmp_path / "p.jsonl", [LAYOUTS["text"]] * 3)
    prepare([str(source)], tmp_path / "out", records=RecordOptions("preference"), chat_template="chatml",
            val_fraction=0, workers=1)
    cfg = DataConfig(kind="memmap", datasets=[str(tmp_path / "out")], vocab_size=256)
    assert len(PairBatches(cfg, "train", 64, 2, 2, 1, 0, 1, seed=0).pairs) == 3
    mask = dataset.read_meta(tmp_path / "out").mask_paths("train")[0]
    flags = np.fromfile(mask, np.uint8)
    flags[np.flatnonzero(flags & dataset.REJECTED)[1]] &= ~np.uint8(dataset.REJECTED)  # pair 2 loses its mark
    flags.tofile(mask)
    with pytest.raises(DataError, match="not whole preference pairs"):
        PairBatches(cfg, "train", 64, 2, 2, 1, 0, 1, seed=0)
