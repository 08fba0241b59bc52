"""Chat templates rendered the way transformers renders them, without transformers (launcher side).

A template comes from `--chat-template NAME|FILE` (a built-in below, or a .jinja file) or from the tokenizer's
folder: `chat_template.jinja` (what transformers 5 saves) or `chat_template` in tokenizer_config.json (a string,
or a list of {name, template} of which "default" is used). It is rendered as `apply_chat_template` does
(transformers/utils/chat_template_utils.py): jinja2's ImmutableSandboxedEnvironment with trim_blocks and
lstrip_blocks, the loopcontrols extension, `raise_exception`, a `tojson` that does not escape HTML,
`strftime_now`, and the tokenizer's named special tokens (bos_token, eos_token, ...) as variables.

Loss masks need to know which characters an assistant wrote: `assistant_spans` renders prefixes of the
conversation and checks that each rendering extends the previous one (the prefix property); a template
that rewrites earlier turns when a later one is added (e.g. one that drops past reasoning) is refused.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from trainctl.data.format import DatasetError

CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Built-in templates: ChatML (Qwen, many fine-tunes) and Llama 3 Instruct's own template, verbatim.
BUILTIN = {
    "chatml": ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
               "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
               "{% endif %}"),
    "llama3": ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
               "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + "
               "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
               "{{ content }}{% endfor %}{% if add_generation_prompt %}"
               "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"),
}
BUILTIN_TOKENS = {"chatml": {}, "llama3": {"bos_token": "<|begin_of_text|>"}}  # unless the tokenizer names its own


@dataclass(frozen=True)
class ChatTemplate:
    text: str
    source: str  # where it came from, for messages and meta.json
    tokens: dict[str, str] = field(default_factory=dict)  # the named special tokens the template sees

    @property
    def sha256(self) -> str:
        return hashlib.sha256(json.dumps([self.text, self.tokens], sort_keys=True).encode()).hexdigest()

    def record(self) -> dict:
        """What meta.json keeps of it (generate and eval render prompts with the same template)."""
        return {"source": self.source, "template": self.text, "special_tokens": dict(self.tokens)}


def load_template(name: str | None, tokenizer_folder: Path | None) -> ChatTemplate:
    """--chat-template (a built-in name or a file) or the tokenizer folder's template; refused in one line."""
    tokens = special_tokens(tokenizer_folder) if tokenizer_folder else {}
    if name:
        if name in BUILTIN:
            return ChatTemplate(BUILTIN[name], f"built-in {name}", {**BUILTIN_TOKENS[name], **tokens})
        path = Path(name).expanduser()
        if not path.is_file():
            raise DatasetError(f"--chat-template {name}: neither a built-in template ({', '.join(BUILTIN)}) nor a "
                               "file; name one, or pass a .jinja file")
        return ChatTemplate(_read_text(path, "--chat-template"), str(path.resolve()), tokens)
    found = _folder_template(tokenizer_folder) if tokenizer_folder else None
    if found is None:
        where = f"the tokenizer folder {tokenizer_folder}" if tokenizer_folder else "the byte tokenizer"
        raise DatasetError(f"--format chat: {where} has no chat template ({TEMPLATE_FILE}, or chat_template in "
                           f"{CONFIG_FILE}); pass --chat-template {'|'.join(BUILTIN)} or a .jinja file")
    text, source = found
    return ChatTemplate(text, source, tokens)


def _read_text(path: Path, key: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise DatasetError(f"{key} {path}: unreadable ({exc}); pass a UTF-8 text file") from None


def _config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(_read_text(path, "--tokenizer"))
    except (ValueError, RecursionError) as exc:
        raise DatasetError(f"{path}: not JSON ({exc}); fix or remove it") from None
    return data if isinstance(data, dict) else {}


def _folder_template(folder: Path) -> tuple[str, str] | None:
    if (folder / TEMPLATE_FILE).is_file():
        return _read_text(folder / TEMPLATE_FILE, "--tokenizer"), str(folder / TEMPLATE_FILE)
    template = _config(folder).get("chat_template")
    source = str(folder / CONFIG_FILE)
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: transformers' default is "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise DatasetError(f"{source}: chat_template lists {', '.join(map(str, named))} but no \"default\"; "
                               "pass --chat-template with one of them saved as a .jinja file")
        template = named["default"]
    if template is None:
        return None
    if not isinstance(template, str):
        raise DatasetError(f"{source}: chat_template is a {type(template).__name__}, not a string; fix it")
    return template, source


def special_tokens(folder: Path) -> dict[str, str]:
    """The named special tokens of tokenizer_config.json (a string, or an AddedToken dict's content)."""
    config = _config(folder)
    tokens = {}
    for key in SPECIAL_TOKENS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[key] = value
    return tokens


# ---------------------------------------------------------------- rendering


class TemplateRefusal(Exception):
    """The template raised (raise_exception, or a jinja error): its message is the user's to read."""


def _jinja2():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        raise DatasetError("--format chat renders chat templates with jinja2: pip install jinja2 (or "
                           "pip install 'trainctl[data]')") from None
    return jinja2


@functools.lru_cache(maxsize=8)
def _compiled(text: str):
    jinja2 = _jinja2()
    ImmutableSandboxedEnvironment = jinja2.sandbox.ImmutableSandboxedEnvironment  # noqa: N806 (jinja's name)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' own: jinja's tojson escapes HTML characters, which a chat template must not
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(text)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise DatasetError(f"the chat template does not parse (line {exc.lineno}: {exc.message}); fix it or pass "
                           f"--chat-template {'|'.join(BUILTIN)}") from None
    except RecursionError:  # its expressions nest deeper than jinja's parser follows
        raise DatasetError(f"the chat template nests too deeply to parse; fix it or pass --chat-template "
                           f"{'|'.join(BUILTIN)}") from None


def render(template: ChatTemplate, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The conversation as text, exactly as transformers' apply_chat_template(tokenize=False) renders it."""
    jinja2 = _jinja2()
    compiled = _compiled(template.text)
    try:
        return compiled.render(messages=messages, tools=None, documents=None,
                               add_generation_prompt=add_generation_prompt, **template.tokens)
    except jinja2.exceptions.TemplateError as exc:
        raise TemplateRefusal(str(exc) or type(exc).__name__) from None
    except Exception as exc:  # noqa: BLE001 (a template is the user's code: 1 // 0, a macro calling itself, ...)
        raise TemplateRefusal(f"{type(exc).__name__}: {exc}") from None


def assistant_spans(template: ChatTemplate, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """(the whole rendering, the character spans that assistant messages add to it).

    The span of assistant message i runs from the end of render(messages[:i], add_generation_prompt=True) (the
    prompt up to the assistant's header) to the end of render(messages[:i+1]) (its text and end-of-turn token).
    Raises TemplateRefusal when a rendering is not a prefix of the next one.
    """
    whole = render(template, messages)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        upto = render(template, messages[: i + 1])
        prompt = next((p for p in _prompts_of(template, messages[:i]) if upto.startswith(p)), None)
        if prompt is None or not whole.startswith(upto):
            raise TemplateRefusal(f"rendering message {i} ({message['role']}) changes the text rendered before it, "
                                  "so its tokens cannot be told apart (the prefix property does not hold)")
        if len(upto) > len(prompt):
            spans.append((len(prompt), len(upto)))
    return whole, spans


def _prompts_of(template: ChatTemplate, messages: list[dict]):
    """What may precede the next assistant message, best first: the rendering with the generation prompt (the
    assistant's header belongs to the prompt, not to the answer), then without it; before a first message, the
    empty text when the template cannot render an empty conversation."""
    for generation_prompt in (True, False):
        try:
            yield render(template, messages, add_generation_prompt=generation_prompt)
        except TemplateRefusal:
            if messages:
                raise
            yield ""
