"""The run's own tokenizer for `generate`: what turns a prompt into the ids the model trained on, and back.

- a Hugging Face tokenizer.json: the run's verified copy (RUN/tokenizer/, sha256 checked by hf_folder.run_tokenizer),
  its end-of-sequence ids from the run's record and generation_config.json, and for --chat the chat template
  (tokenizer_config.json / chat_template.jinja among the copies, else the one the dataset was prepared with);
- byte tokens (a dataset prepared with --tokenizer bytes, or the stdlib demo corpus): UTF-8 bytes, NUL ends;
- no tokenizer (synthetic data): text cannot be encoded; refused in one line that names --prompt-ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from trainctl.config.load import load_run_config
from trainctl.core import rundir as layout
from trainctl.core.errors import UserError
from trainctl.data.chat_template import ChatTemplate, TemplateRefusal, load_template, render
from trainctl.data.format import DatasetError
from trainctl.data.tokenizer import BYTES_EOS  # the byte tokenizer's (and the stdlib corpus's) end of document


class TokenizerError(UserError):
    """The run's tokenizer cannot encode or decode what was asked; one line."""


@dataclass
class RunTokens:
    kind: str  # hf | bytes | none
    eos_ids: list[int] = field(default_factory=list)
    file: str | None = None
    folder: Path | None = None  # the run's tokenizer copies (tokenizer_config.json, chat template)
    dataset: Path | None = None  # the prepared dataset, whose meta.json may hold the chat template
    _tok: object = None

    def encode(self, text: str) -> list[int]:
        if self.kind == "bytes":
            return list(text.replace("\0", "").encode("utf-8"))
        if self.kind == "none":
            raise TokenizerError(["the run trained on synthetic data and has no tokenizer: text cannot be encoded; "
                                  "pass token ids with --prompt-ids 1,2,3"])
        return list(self._hf().encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        if self.kind == "bytes":
            return bytes(i for i in ids if i < 256).decode("utf-8", "replace")
        if self.kind == "none":
            return " ".join(map(str, ids))
        return self._hf().decode(ids, skip_special_tokens=False)

    def _hf(self):
        if self._tok is None:
            from tokenizers import Tokenizer

            self._tok = Tokenizer.from_file(self.file)
        return self._tok

    def chat_prompt(self, text: str) -> str:
        """The user's message rendered with the run's chat template and the assistant's generation prompt."""
        template = self.template()
        try:
            return render(template, [{"role": "user", "content": text}], add_generation_prompt=True)
        except TemplateRefusal as exc:
            raise TokenizerError([f"--chat: the chat template ({template.source}) refuses the prompt: {exc}"]) from None

    def end_of_turn(self) -> str | None:
        """The text the chat template puts after an assistant's message (e.g. `<|im_end|>`), where --chat stops
        when it is no end-of-sequence id (byte tokens spell it out); None when the template shows none."""
        sentinel = "\ue000answer\ue000"  # private-use characters: never in a template's own text
        messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": sentinel}]
        try:
            text = render(self.template(), messages)
        except TemplateRefusal:
            return None
        after = text[text.find(sentinel) + len(sentinel):].strip() if sentinel in text else ""
        return after or None

    def template(self) -> ChatTemplate:
        if self.folder is not None:
            try:
                return load_template(None, self.folder)
            except DatasetError:
                pass  # the run's tokenizer folder has none: the dataset's, below
        recorded = _dataset_template(self.dataset)
        if recorded is None:
            raise TokenizerError(["--chat: the run has no chat template (none among its tokenizer files, none "
                                  "recorded by its dataset); leave --chat out and write the prompt as trained"])
        return recorded


def _dataset_template(dataset: Path | None) -> ChatTemplate | None:
    if dataset is None:
        return None
    try:
        record = json.loads((dataset / "meta.json").read_text()).get("chat_template")
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("template"), str):
        return None
    return ChatTemplate(record["template"], str(record.get("source")), dict(record.get("special_tokens") or {}))


def _generation_eos(folder: Path | None) -> list[int]:
    """eos_token_id of the run's generation_config.json (an int or a list), as transformers stops on it."""
    try:
        value = json.loads((folder / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, TypeError, AttributeError):
        return []
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int)]


def run_tokens(run_dir: Path) -> RunTokens:
    """The run's tokenizer, verified (hf_folder.run_tokenizer checks every copy's sha256)."""
    from trainctl.models.hf_folder import run_tokenizer

    record_path = run_dir / layout.TOKENIZER_RECORD
    record = layout.read_json(record_path) if record_path.exists() else {}
    data = load_run_config(run_dir).data
    dataset = Path(record["dataset"]) if record.get("dataset") else None
    if dataset is None and data.kind == "memmap" and data.datasets:
        dataset = Path(data.datasets[0])
    if data.kind == "stdlib" or record.get("byte_tokens"):
        return RunTokens("bytes", [BYTES_EOS], dataset=dataset)
    tokens = run_tokenizer(run_dir)
    if not tokens or not tokens.get("file"):
        if data.kind == "memmap" and tokens is not None:  # a bytes dataset of a run made before the record
            return RunTokens("bytes", [BYTES_EOS], dataset=dataset)
        return RunTokens("none")
    folder = run_dir / layout.TOKENIZER if record else None
    eos = [tokens["eos_id"]] if isinstance(tokens.get("eos_id"), int) else []
    eos += [i for i in _generation_eos(folder) if i not in eos]
    return RunTokens("hf", eos, tokens["file"], folder, dataset)
