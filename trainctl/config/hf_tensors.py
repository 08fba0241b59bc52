"""A Hugging Face folder's tensors against the model's, from the safetensors headers alone (no torch, no weights read).

`checkpoint.init_from=DIR` loads DIR's tensors by name into the model the config builds. Before launch every tensor
the family expects must be there with its shape, and every tensor there must be one the model has: a tensor of
another architecture (a bias, an extra norm, a vision tower) would otherwise be skipped without a word, and a
shape mismatch would end the job in the worker instead of on the login node.

A folder whose config.json says `tie_word_embeddings: true` but which ships an `lm_head.weight` of its own: a tied
model has one matrix, so the head would be dropped. The same bytes as the embedding are what save_pretrained
writes for a tied model (loaded as one); any other head is refused, naming the fix (untie in config.json).
"""

from __future__ import annotations

from trainctl.config.hf_config import HFConfigError, Stored
from trainctl.models import registry

HEAD, EMBEDDING = "lm_head.weight", "model.embed_tokens.weight"
BUFFER_SUFFIXES = ("rotary_emb.inv_freq",)  # non-persistent buffers some older exports still hold: not weights


def expected_tensors(m) -> dict[str, list[int]]:
    """Every tensor the model loads, by its Hugging Face name, with its shape (a tied head is the embedding)."""
    spec = registry.spec(m.family)
    tensors = [spec.embedding_tensor(m), *(t for i in range(m.n_layers) for t in spec.block_tensors(m, i)),
               *spec.head_tensors(m, first=True)]
    expected = {}
    for t in tensors:
        experts = getattr(spec, "expert_hf_tensors", lambda *_: None)(t.name, m)  # a stacked weight: per expert
        expected.update(experts or [(spec.to_hf_name(t.name), [t.rows] if t.cols == 1 else [t.rows, t.cols])])
    return expected


def check_tensors(stored: dict[str, Stored], m) -> None:
    """One line for the first tensor missing, misshapen or unexpected (see module doc); nothing when they match."""
    expected = expected_tensors(m)
    missing = [name for name in expected if name not in stored]
    if missing:
        raise HFConfigError(f"no tensor {missing[0]}{_more(missing)}, which the {m.family} model needs; "
                            "its safetensors files are not of this model (or are incomplete)")
    for name, shape in expected.items():
        if stored[name].shape != shape:
            raise HFConfigError(f"{name} has shape {stored[name].shape}, the model's is {shape}")
    extra = [name for name in stored if name not in expected and not name.endswith(BUFFER_SUFFIXES)]
    if m.tie_embeddings and HEAD in extra:
        _check_tied_head(stored)
        extra.remove(HEAD)
    if extra:
        raise HFConfigError(f"tensor {extra[0]}{_more(extra)} is not part of the {m.family} model, so it "
                            "would not be loaded; use a folder of that family's architecture, without other tensors")


def _check_tied_head(stored: dict[str, Stored]) -> None:
    head, embedding = stored[HEAD], stored[EMBEDDING]
    same = head.shape == embedding.shape and head.entry.get("dtype") == embedding.entry.get("dtype") \
        and head.same_bytes(embedding)
    if not same:
        raise HFConfigError(f"config.json says tie_word_embeddings true, but {HEAD} differs from {EMBEDDING} "
                            "(tying would drop the trained head); set tie_word_embeddings to false in its config.json")


def _more(names: list[str]) -> str:
    return f" (and {len(names) - 1} more)" if len(names) > 1 else ""
