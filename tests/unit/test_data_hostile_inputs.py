"""Inputs that used to end `data prepare` in a traceback (issue 35): a chat template whose code raises anything,
a JSON line nested deeper than the parser follows, a folder entry that cannot be read. Each is one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trainctl.data.chat import RecordOptions
from trainctl.data.chat_template import ChatTemplate, TemplateRefusal, render
from trainctl.data.prepare import DatasetError, prepare

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
DEEP = 200_000  # far past any recursion limit


@pytest.mark.parametrize("text, raised", [
    ("{{ 1 // 0 }}", "ZeroDivisionError"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{{ messages[0].content.nope.deeper }}", "has no attribute 'nope'"),
    ("{{ messages | map(attribute='role') | sum }}", "TypeError"),
])
def test_a_template_whose_code_raises_is_a_refusal_not_a_traceback(text, raised):
    with pytest.raises(TemplateRefusal, match=raised):
        render(ChatTemplate(text, "mine.jinja"), CHAT["messages"])


def _chat_options(tmp_path: Path, template_text: str) -> dict:
    file = tmp_path / "t.jinja"
    file.write_text(template_text)
    return {"records": RecordOptions("chat"), "chat_template": str(file)}


def test_prepare_names_the_record_and_the_template_error(tmp_path):
    (tmp_path / "chat.jsonl").write_text(json.dumps(CHAT) + "\n")
    with pytest.raises(DatasetError, match=r"chat.jsonl: byte 0: the chat template .*ZeroDivisionError"):
        prepare([str(tmp_path / "chat.jsonl")], tmp_path / "out", workers=1,
                **_chat_options(tmp_path, "{{ 1 // 0 }}"))
    assert not (tmp_path / "out").exists()


def test_a_template_nested_too_deeply_to_parse_is_one_line(tmp_path):
    with pytest.raises(DatasetError, match="nests too deeply to parse"):
        render(ChatTemplate("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "deep.jinja"), CHAT["messages"])


@pytest.mark.parametrize("fmt, line", [
    ("text", '{"text": ' + "[" * DEEP + "]" * DEEP + "}"),
    ("chat", "[" * DEEP + "]" * DEEP),
])
def test_a_json_line_nested_too_deeply_is_one_line(fmt, line, tmp_path):
    (tmp_path / "in.jsonl").write_text(line + "\n")
    chat = _chat_options(tmp_path, "{% for m in messages %}{{ m.content }}{% endfor %}") if fmt == "chat" else {}
    with pytest.raises(DatasetError, match=r"in.jsonl: byte 0: JSON nested deeper than the reader follows"):
        prepare([str(tmp_path / "in.jsonl")], tmp_path / "out", workers=1, **chat)
    assert not (tmp_path / "out").exists()


def test_a_folder_entry_that_cannot_be_read_is_one_line(tmp_path):
    """A path longer than the system allows cannot be stat'ed even by root (unlike a chmod 000 entry)."""
    folder = tmp_path / "docs"
    folder.mkdir()
    (folder / "a.txt").write_text("hello\n")
    here = os.getcwd()
    try:  # built one component at a time (each relative): the whole path is past PATH_MAX
        os.chdir(folder)
        for _ in range(4096 // 200 + 1):
            os.mkdir("d" * 200)
            os.chdir("d" * 200)
        Path("deep.txt").write_text("text\n")
    finally:
        os.chdir(here)
    with pytest.raises(DatasetError) as err:
        prepare([str(folder)], tmp_path / "out", workers=1)
    assert len(str(err.value).splitlines()) == 1 and len(str(err.value)) < 400
    assert str(err.value).startswith(f"{folder}: ") and "cannot be read (File name too long)" in str(err.value)
    assert not (tmp_path / "out").exists()
