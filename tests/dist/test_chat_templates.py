"""Chat templates rendered by trainctl (jinja2 only, launcher side) equal transformers' apply_chat_template,
text and token ids, on Llama 3, Qwen ChatML, Mistral [INST] and Zephyr templates (importing transformers costs the
unit tier too much: here)."""

from __future__ import annotations

import pytest

from tests.unit.test_data_chat import TEMPLATES, chats_for, tokenizer_folder
from trainctl.data.chat_template import load_template, render
from trainctl.data.tokenizer import HFTokenizer

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_rendering_and_tokens_equal_transformers(tmp_path, name):
    transformers = pytest.importorskip("transformers")
    folder = tokenizer_folder(tmp_path, name)
    hf = transformers.AutoTokenizer.from_pretrained(folder)
    template = load_template(None, folder)
    ours = HFTokenizer(folder / "tokenizer.json")
    compared = 0
    for chat in chats_for(name):
        for messages in (chat, chat[:-1]):
            for prompt in (False, True):
                want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=prompt)
                assert render(template, messages, prompt) == want
                ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=prompt)
                ids = ids["input_ids"] if hasattr(ids, "keys") else ids
                assert ours.encode_offsets(want)[0].tolist() == list(ids)
                compared += 1
    assert compared == 8
