"""Launch-time checks of the user's token files (`data.kind=memmap`), without torch or numpy.

The worker finds a missing file, a size that is not whole tokens, or a token id past the
vocabulary only after the job started (on Slurm, after the queue). These checks read the
file's size and a bounded sample of its tokens (up to `SAMPLE_BYTES` at the start, the
middle and the end), so `plan` and `launch` answer at once even for terabyte files. An id the
sample misses is still caught by the worker's own check of every batch.
"""

from __future__ import annotations

import functools
from array import array
from pathlib import Path

from trainctl.config.schema import DataConfig, TrainConfig
from trainctl.core.batch_ramp import BatchRamp
from trainctl.data import format as dataset

SAMPLE_BYTES = 1 << 20  # per sampled window: three windows, at most 3 MiB read per file
# array typecodes of the token dtypes; their sizes are checked below (they are platform-defined).
TYPECODES = {"uint16": "H", "uint32": "I"}
ITEMSIZE = {"uint16": 2, "uint32": 4}


def data_file_problems(d: DataConfig, vocab_size: int, seq_len: int, workdir: Path | None = None) -> list[str]:
    """Every problem with data.train_path and data.val_path, one line each naming the key and the path.

    `vocab_size` is the data's resolved vocabulary (data.vocab_size, or the model's when 0);
    relative paths are taken from `workdir` (default: the current directory), as the workers do.
    """
    if d.kind != "memmap" or d.token_dtype not in TYPECODES:
        return []  # other sources have no user files; a bad dtype is a validation problem already
    problems = []
    for split in ("train", "val"):
        path = d.train_path if split == "train" else d.val_path
        if path:
            problem = token_file_problem(f"data.{split}_path", path, d.token_dtype, vocab_size, seq_len, workdir)
            if problem:
                problems.append(problem)
    return problems


def token_file_problem(key: str, path: str, dtype: str, vocab_size: int, seq_len: int,
                       workdir: Path | None = None) -> str | None:
    """The one thing wrong with a flat token file, or None."""
    where = Path(path).expanduser()
    if not where.is_absolute() and workdir is not None:
        where = workdir / where
    head = f"{key}={path!r}"
    try:
        st = where.stat()
    except FileNotFoundError:
        return f"{head}: file not found; point it at a flat token file of {dtype} ids (data.kind=memmap)"
    except OSError as exc:
        return f"{head}: cannot read it ({exc.strerror or exc})"
    if not where.is_file():
        return f"{head}: not a regular file; point it at a flat token file of {dtype} ids"
    itemsize = ITEMSIZE[dtype]
    if st.st_size == 0:
        return f"{head}: file is empty; it needs at least train.seq_len+1={seq_len + 1} tokens"
    if st.st_size % itemsize:
        return (f"{head}: {st.st_size} bytes is not a whole number of {itemsize}-byte tokens; "
                f"check data.token_dtype={dtype} (uint16 or uint32)")
    tokens = st.st_size // itemsize
    if tokens < seq_len + 1:
        return (f"{head}: {tokens} tokens, fewer than train.seq_len+1={seq_len + 1}; "
                "lower train.seq_len or use more data")
    try:
        largest = sampled_max_token(str(where), dtype, st.st_size, st.st_mtime_ns)
    except OSError as exc:
        return f"{head}: cannot read it ({exc.strerror or exc})"
    if largest >= vocab_size:
        return (f"{head}: holds token id {largest}, not below the vocabulary size {vocab_size} (data.vocab_size, "
                f"else model.vocab_size); set both above {largest}, or check data.token_dtype={dtype}")
    return None


@functools.lru_cache(maxsize=32)
def sampled_max_token(path: str, dtype: str, size: int, mtime_ns: int) -> int:
    """Largest token id in three windows of the file (start, middle, end); all of it when small.

    `size` and `mtime_ns` key the cache: `plan --compare` builds many plans of one config.
    """
    itemsize = ITEMSIZE[dtype]
    window = SAMPLE_BYTES - SAMPLE_BYTES % itemsize
    middle = (size // 2) - (size // 2) % itemsize
    starts = sorted({0, max(0, middle - window // 2), max(0, size - window)})
    largest = 0
    with open(path, "rb") as f:
        for start in starts:
            f.seek(start)
            chunk = f.read(min(window, size - start))
            chunk = chunk[: len(chunk) - len(chunk) % itemsize]
            if chunk:
                largest = max(largest, max(_tokens(chunk, dtype)))
    return largest


def _tokens(chunk: bytes, dtype: str) -> array:
    tokens = array(TYPECODES[dtype])  # native byte order, as the worker's numpy memmap reads it
    if tokens.itemsize != ITEMSIZE[dtype]:  # never on Linux or macOS; a wrong size would misread every id
        raise OSError(f"this platform's array typecode {TYPECODES[dtype]!r} is not {ITEMSIZE[dtype]} bytes")
    tokens.frombytes(chunk)
    return tokens



def datasets_problems(d: DataConfig, model_vocab: int, train: TrainConfig) -> list[str]:
    """data.datasets (prepared by `trainctl data prepare`): every problem, one line each; stat and meta.json only.

    Checked at compose time, so `config show`, `plan` and `launch` refuse in one line before any run directory.
    """
    if not d.datasets:
        if d.weights:
            return [f"data.weights={list(d.weights)}: blend weights need data.datasets=[DIR,...]"]
        return []
    problems = []
    if d.kind != "memmap":
        problems.append(f"data.datasets: read by data=memmap only (data.kind={d.kind}); add data=memmap")
    if d.weights and (len(d.weights) != len(d.datasets) or any(w <= 0 for w in d.weights)):
        problems.append(f"data.weights={list(d.weights)}: one positive weight per dataset "
                        f"({len(d.datasets)}), or [] to blend by their sizes")
    vocab = d.vocab_size or model_vocab
    for path in d.datasets:
        problems += dataset.dataset_problems(path, "train", vocab, train.seq_len)
        if train.eval_every > 0:  # evaluation reads the val split
            problems += dataset.dataset_problems(path, "val", vocab, train.seq_len)
    problems += blend_problems(d)
    return list(dict.fromkeys(problems))


def document_mask_problems(d: DataConfig, pp: int, cp: int) -> list[str]:
    """data.document_mask=true needs every document's first token marked (the mask files of prepared chat and
    instruction datasets), and a layout that hands the per-token positions to every attention layer."""
    if not d.document_mask:
        return []
    problems = []
    if d.kind != "memmap" or not d.datasets:
        problems.append(f"data.document_mask=true: data.kind={d.kind} marks no document starts; use data=memmap "
                        "data.datasets=[DIR] prepared with `trainctl data prepare --format chat` (or instruction)")
    for path in d.datasets:
        try:
            meta = dataset.read_meta(path)
        except dataset.DatasetError:
            continue  # datasets_problems reports it
        if not meta.masked:
            problems.append(f"data.document_mask=true: {path} marks no document starts (no mask files: text or "
                            "format v1 data); prepare it with --format chat or instruction, or set "
                            "data.document_mask=false")
    # A pipeline schedule hands only hidden states from stage to stage; cp's ring attention has no mask.
    for key, degree in (("pp", pp), ("cp", cp)):
        if degree > 1:
            problems.append(f"data.document_mask=true: not implemented with sharding.{key}={degree} yet; use "
                            f"sharding.{key}=1 or data.document_mask=false")
    return problems


def _tokenizers_of(d: DataConfig) -> dict[str, dataset.TokenizerInfo]:
    """Each readable dataset's tokenizer (an unreadable one is reported by dataset_problems)."""
    found = {}
    for path in d.datasets:
        try:
            found[path] = dataset.read_meta(path).tokenizer
        except dataset.DatasetError:
            continue
    return found


def blend_problems(d: DataConfig) -> list[str]:
    """Blended datasets must share one tokenizer: the same id would otherwise mean another token in each."""
    tokenizers = _tokenizers_of(d)
    if len(tokenizers) < 2:
        return []
    (first, tok), *others = tokenizers.items()
    problems = []
    for path, other in others:
        if other.fingerprint is None or tok.fingerprint is None:
            unknown = path if other.fingerprint is None else first
            problems.append(f"data.datasets: {unknown}: its tokenizer cannot be told (no tokenizer.json), so it "
                            "cannot be blended; prepare it again")
        elif other.fingerprint != tok.fingerprint:
            problems.append(f"data.datasets: {path} was prepared with another tokenizer ({other.kind}) than {first} "
                            f"({tok.kind}); blend datasets prepared with the same tokenizer")
        elif other.eos_id != tok.eos_id:
            problems.append(f"data.datasets: {path} ends documents with token {other.eos_id}, {first} with "
                            f"{tok.eos_id}; prepare them with the same --eos-token")
    return problems


def model_tokenizer_problems(d: DataConfig, hf_dir: str) -> list[str]:
    """Prepared datasets must use the tokenizer of the Hugging Face folder the model comes from (model.path, or
    checkpoint.init_from): other ids would train the pretrained embeddings on other tokens."""
    if not d.datasets or not hf_dir:
        return []
    theirs = Path(hf_dir).expanduser() / "tokenizer.json"
    if not theirs.is_file():
        return []  # no tokenizer.json to compare with (a sentencepiece-only folder, or none)
    try:
        fingerprint = dataset.tokenizer_fingerprint(theirs)
    except (OSError, ValueError) as exc:
        return [f"{hf_dir}: its tokenizer.json is unreadable ({type(exc).__name__}); fix or remove it"]
    problems = []
    for path, tok in _tokenizers_of(d).items():
        if tok.kind == "bytes":
            problems.append(f"data.datasets: {path} holds byte tokens, but the model from {hf_dir} has its own "
                            f"tokenizer; prepare the data with --tokenizer {theirs}")
        elif tok.fingerprint != fingerprint:
            problems.append(f"data.datasets: {path} was prepared with another tokenizer than the model's "
                            f"({theirs}); prepare the data with --tokenizer {theirs}")
    return problems


def epochs_of(d: DataConfig, train: TrainConfig) -> float | None:
    """How many passes over data.datasets' train tokens the run makes (None when unknown or unreadable)."""
    if not d.datasets or train.global_batch < 1:
        return None
    try:
        tokens = sum(dataset.read_meta(path).splits["train"].tokens for path in d.datasets)
    except dataset.DatasetError:
        return None
    sequences = train.steps * train.global_batch
    if train.batch_ramp.start > 0:  # a ramp's early steps train fewer sequences
        dp = train.global_batch // (train.micro_batch * train.grad_accum)
        sequences = BatchRamp.of(train, dp).total_sequences
    return sequences * (train.seq_len + 1) / max(tokens, 1)
